"""vLLM KV connector (KV connector v1 API, vLLM 0.33) whose decode side pulls
each layer's KV pages with ``torch.ops.mori`` inside the forward pass.

Load it with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "MoriTorchConnector",
                           "kv_connector_module_path": "mori_torch.integrations.vllm",
                           "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"rendezvous": "tcpstore://10.0.0.1:29600"}}'

See README "vLLM: prefill/decode with MoriTorchConnector" and
:mod:`.settings` for the extra config.
"""
from .connector import MoriTorchConnector
from .metadata import MoriTorchConnectorMetadata
from .stats import MoriTorchKVConnectorStats

__all__ = ["MoriTorchConnector", "MoriTorchConnectorMetadata", "MoriTorchKVConnectorStats"]
