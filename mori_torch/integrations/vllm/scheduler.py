"""Scheduler side of MoriTorchConnector: which blocks a decode pulls in the
step its request is scheduled, and how long a prefill keeps a finished
request's blocks for the decode.

The protocol is the one vLLM's P/D proxies already speak (NIXL, MoRIIO):
the proxy sends the prompt to the prefill with ``kv_transfer_params =
{"do_remote_decode": true}`` and ``max_tokens=1``; the prefill answers with
the ``kv_transfer_params`` returned by :meth:`request_finished`; the proxy
sends the request with those params to the decode.

Loads are synchronous in vLLM's sense (``load_async=False``): the decode
schedules the request at once, and the worker pulls the blocks layer by
layer inside that step's forward pass, so no scheduler step waits for KV.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from .metadata import MoriTorchConnectorMetadata, PullSpec
from .settings import Settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
                "remote_num_tokens")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ConnectorScheduler:
    def __init__(self, vllm_config: "VllmConfig", settings: Settings, host: str):
        kvc = vllm_config.kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = kvc.engine_id
        self.is_producer = kvc.is_kv_producer
        self.is_consumer = kvc.is_kv_consumer
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.settings = settings
        self.host = host
        self._pull: Dict[str, PullSpec] = {}
        self._send: Dict[str, float] = {}

    # ---- decode side ---------------------------------------------------------

    def _remote(self, request: "Request") -> Optional[Dict[str, Any]]:
        """The request's remote-prefill params if this instance pulls and
        they are well-formed; None (with a warning for malformed ones)."""
        p = request.kv_transfer_params
        if not self.is_consumer or not p or not p.get("do_remote_prefill"):
            return None
        missing = [k for k in _REMOTE_KEYS if k not in p]
        problem = f"lacks {missing}" if missing else None
        if problem is None:
            ids, n = p["remote_block_ids"], p["remote_num_tokens"]
            if not isinstance(ids, list) or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in ids):
                problem = f"remote_block_ids {str(ids)[:80]} is not a list of block ids"
            elif isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(ids) * self.block_size:
                problem = f"remote_num_tokens {n!r} does not fit {len(ids)} blocks of {self.block_size} tokens"
            elif p.get("remote_block_size", self.block_size) != self.block_size:
                problem = (f"the prefill's block size {p.get('remote_block_size')} differs from this instance's "
                           f"{self.block_size}")
            elif p.get("remote_tp_size", self.tp_size) != self.tp_size:
                problem = (f"the prefill runs tensor parallel {p.get('remote_tp_size')}, this decode "
                           f"{self.tp_size}; MoriTorchConnector pulls between equal TP sizes")
        if problem is not None:
            log.warning("request %s: kv_transfer_params %s; its prompt is computed here instead",
                        request.request_id, problem)
            return None
        return p

    def _load_end(self, request: "Request", p: Dict[str, Any]) -> int:
        # The last prompt token is always computed here: the step that
        # pulls the KV also produces the first decode token from it.
        return min(p["remote_num_tokens"], request.num_prompt_tokens - 1)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        p = self._remote(request)
        if p is None:
            return 0, False
        return max(0, self._load_end(request, p) - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return
        remote = self._remote(request)
        p["do_remote_prefill"] = False  # one pull per request, even if rescheduled
        if remote is None:
            return
        local: List[int] = []
        remote_ids: List[int] = []
        if num_external_tokens > 0:
            (block_ids,) = blocks.get_block_ids()
            end = self._load_end(request, remote)
            first, last = (end - num_external_tokens) // self.block_size, _cdiv(end, self.block_size)
            local, remote_ids = list(block_ids[first:last]), list(remote["remote_block_ids"][first:last])
        # Without blocks to pull (a full local prefix hit) the prefill is
        # still told, so it frees its blocks now rather than at the lease's end.
        self._pull[request.request_id] = self._spec(remote, local, remote_ids)

    def _spec(self, p: Dict[str, Any], local: List[int], remote_ids: List[int]) -> PullSpec:
        return PullSpec(local, remote_ids, str(p["remote_engine_id"]), str(p["remote_request_id"]),
                        str(p["remote_host"]), int(p["remote_port"]), int(p.get("remote_tp_size", self.tp_size)))

    # ---- both sides ------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> MoriTorchConnectorMetadata:
        meta = MoriTorchConnectorMetadata(reqs_to_pull=self._pull, reqs_to_send=self._send)
        self._pull, self._send = {}, {}
        return meta

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p:
            return False, None
        if p.get("do_remote_prefill"):
            # Finished (aborted) before it was scheduled: nothing to pull, but
            # the prefill holds blocks for it; tell it to free them.
            remote = self._remote(request)
            p["do_remote_prefill"] = False
            if remote is not None:
                self._pull[request.request_id] = self._spec(remote, [], [])
            return False, None
        if not p.get("do_remote_decode") or not self.is_producer:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: no decode will come
        if not block_ids:
            return False, None
        self._send[request.request_id] = time.time() + self.settings.kv_lease_s
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": request.num_computed_tokens,
            "remote_host": self.host,
            "remote_port": self.settings.side_channel_port,
            "remote_tp_size": self.tp_size,
            "remote_block_size": self.block_size,
        }
