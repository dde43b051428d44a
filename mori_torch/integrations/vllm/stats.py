"""Transfer stats of MoriTorchConnector, reported through vLLM's connector
stats (``get_kv_connector_stats`` -> logged and exported by vLLM)."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_COUNTERS = ("pulled_requests", "pulled_blocks", "pulled_bytes", "failed_requests", "failed_blocks",
             "failed_connects", "sent_requests", "expired_requests")


@dataclasses.dataclass
class MoriTorchKVConnectorStats(KVConnectorStats):
    """Counters since the last report, plus the host time spent enqueuing
    pulls (``enqueue_s``) and the time from the first pull of a step to the
    step's transfers being complete (``step_s``, one entry per step with
    pulls). Plain dicts and lists: vLLM ships stats between processes."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data: Dict[str, Any] = {k: 0 for k in _COUNTERS}
        self.data["enqueue_s"] = 0.0
        self.data["step_s"] = []

    def add(self, key: str, n) -> None:
        self.data[key] += n

    def clone_and_reset(self) -> "MoriTorchKVConnectorStats":
        old = copy.deepcopy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return all(self.data[k] == 0 for k in _COUNTERS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _COUNTERS:
            self.data[k] += other.data.get(k, 0)
        self.data["enqueue_s"] += other.data.get("enqueue_s", 0.0)
        self.data["step_s"] = list(self.data["step_s"]) + list(other.data.get("step_s", []))
        return self

    def reduce(self) -> Dict[str, int | float]:
        out: Dict[str, int | float] = {k: self.data[k] for k in _COUNTERS}
        steps = self.data["step_s"]
        if steps:
            out["avg_step_ms"] = round(1e3 * sum(steps) / len(steps), 3)
            total = sum(steps)
            out["pull_GBps"] = round(self.data["pulled_bytes"] / total / 1e9, 3) if total > 0 else 0.0
        out["enqueue_ms"] = round(1e3 * self.data["enqueue_s"], 3)
        return out
