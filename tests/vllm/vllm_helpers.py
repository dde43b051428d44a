"""Real vLLM 0.33 objects for the connector tests, in the style of vLLM's
own tests/v1/kv_connector/unit/utils.py (not shipped in the wheel): an
offline model folder, VllmConfig, Scheduler, Request, ModelRunnerOutput and
KV caches from vLLM's own planner and allocator."""
import json
import os
from itertools import count
from typing import Any, Dict, List, Optional

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

EOS = 2
BLOCK = 16
LAYERS = 4
KV_HEADS = 2
HEAD = 32

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": KV_HEADS * 2 * HEAD,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": EOS, "tie_word_embeddings": False,
}


def model_dir(root: str) -> str:
    """A folder with a hand-written tiny Llama config.json (no weights, no
    tokenizer: the scheduler runs with skip_tokenizer_init)."""
    path = os.path.join(root, "tiny-llama")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    return path


def make_vllm_config(model: str, role: str, extra: Dict[str, Any], *, engine_id: Optional[str] = None,
                     max_num_batched_tokens: int = 64, layout: str = "LBNHC",
                     kv_load_failure_policy: str = "fail", num_blocks: Optional[int] = None) -> VllmConfig:
    model_config = ModelConfig(model=model, dtype="bfloat16", seed=42, skip_tokenizer_init=True,
                               max_model_len=2048)
    scheduler_config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=2048, enable_chunked_prefill=True,
                                       is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=num_blocks)
    cache_config.kv_cache_layout = layout  # resolved by the engine core before connectors start
    kvc = KVTransferConfig(kv_connector="MoriTorchConnector", kv_connector_module_path="mori_torch.integrations.vllm",
                           kv_role=role, kv_connector_extra_config=extra, engine_id=engine_id,
                           kv_load_failure_policy=kv_load_failure_policy)
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
                      kv_transfer_config=kvc, device_config=DeviceConfig("cpu"))


def layer_names() -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv_cache_config(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """vLLM's own plan for LAYERS full-attention layers and num_blocks blocks
    (num_gpu_blocks_override) in the configured layout."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    groups = [KVCacheGroupSpec(layer_names(), spec)]
    cfg = get_kv_cache_config_from_groups(vllm_config, groups, available_memory=1 << 40)
    assert cfg.num_blocks == num_blocks
    return cfg


def allocate_caches(vllm_config: VllmConfig, cfg: KVCacheConfig) -> Dict[str, torch.Tensor]:
    """CPU KV caches as vLLM's allocator lays them out: a view per layer,
    [num_blocks, heads, block_size, 2 * head_size], over one buffer."""
    return allocate_kv_cache(cfg, torch.device("cpu"), vllm_config.cache_config.get_resolved_kv_cache_layout())


def make_scheduler(vllm_config: VllmConfig, cfg: KVCacheConfig) -> Scheduler:
    vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=cfg, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK)


_ids = count(1)
_hash_ready = [False]


def make_request(prompt: List[int], *, max_tokens: int = 16, params: Optional[dict] = None,
                 request_id: Optional[str] = None) -> Request:
    if not _hash_ready[0]:
        init_none_hash(sha256)
        _hash_ready[0] = True
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=request_id or f"req-{next(_ids)}", prompt_token_ids=list(prompt), sampling_params=sp,
                  pooling_params=None, mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    req.kv_transfer_params = params
    return req


def prompt(n: int, seed: int, prefix: Optional[List[int]] = None) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    head = list(prefix or [])
    return head + torch.randint(10, 900, (n - len(head),), generator=g).tolist()


def runner_output(sched: Scheduler, out, kv: Optional[KVConnectorOutput] = None, token: int = 7) -> ModelRunnerOutput:
    """What a model runner returns for ``out``: one sampled token for each
    request whose scheduled tokens reach its end, none for a prefill chunk
    that does not (vLLM discards those samples)."""
    req_ids = scheduled_ids(out)
    sampled = []
    for r in req_ids:
        req = sched.requests.get(r)
        sampled.append([token] if req is not None and req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                             pooler_output=None, kv_connector_output=kv)


def scheduled_ids(out) -> List[str]:
    return [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
