"""What the scheduler-side connector tells the worker-side one each step."""
from __future__ import annotations

import dataclasses
from typing import Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclasses.dataclass
class PullSpec:
    """Decode side: pull ``remote_block_ids[i]`` of the prefill's request
    ``remote_request_id`` into local block ``local_block_ids[i]`` during this
    step's forward pass. Empty lists: nothing to pull (a full local prefix
    hit, or an abort), only tell the prefill to free its blocks."""

    local_block_ids: List[int]
    remote_block_ids: List[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int


@dataclasses.dataclass
class MoriTorchConnectorMetadata(KVConnectorMetadata):
    # decode side: request id -> what to pull this step
    reqs_to_pull: Dict[str, PullSpec] = dataclasses.field(default_factory=dict)
    # prefill side: request id -> wall-clock deadline (time.time()) after
    # which its blocks are freed even if no decode read them
    reqs_to_send: Dict[str, float] = dataclasses.field(default_factory=dict)
