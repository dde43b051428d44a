"""MoriTorchConnector: vLLM's KV connector v1 interface, delegating to the
scheduler-side (:mod:`.scheduler`) or worker-side (:mod:`.worker`) half."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .metadata import MoriTorchConnectorMetadata
from .scheduler import ConnectorScheduler
from .settings import parse_settings
from .stats import MoriTorchKVConnectorStats
from .worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _tp_rank() -> int:
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


class MoriTorchConnector(KVConnectorBase_V1):
    """Disaggregated prefill/decode over mori_torch: the decode pulls each
    layer's KV pages with ``torch.ops.mori.read_pages`` inside the forward
    pass. Roles ``kv_producer`` (prefill), ``kv_consumer`` (decode),
    ``kv_both``; backends and discovery in ``kv_connector_extra_config``
    (see :mod:`mori_torch.integrations.vllm.settings`)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvc = self._kv_transfer_config
        settings = parse_settings(kvc.kv_connector_extra_config, kvc.kv_port)
        if settings.host is not None:
            host = settings.host
        else:
            from vllm.utils.network_utils import get_ip

            host = get_ip()
        self._scheduler: Optional[ConnectorScheduler] = None
        self._worker: Optional[ConnectorWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(vllm_config, settings, host)
        else:
            self._worker = ConnectorWorker(kvc.engine_id, settings, host, _tp_rank(), kvc.is_kv_producer,
                                           kvc.is_kv_consumer)

    # ---- scheduler side --------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> Tuple[int, ...]:
        # The request's own blocks are transferred, in every group.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]):
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MoriTorchConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # the decode pulls; the prefill only keeps its blocks

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> Optional[MoriTorchKVConnectorStats]:
        return None if self._worker is None else self._worker.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> MoriTorchKVConnectorStats:
        return MoriTorchKVConnectorStats(data=data) if data is not None else MoriTorchKVConnectorStats()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        # wait_for_layer_load runs in Python before each attention; vLLM's
        # piecewise graphs keep attention outside the captured pieces.
        return True

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
