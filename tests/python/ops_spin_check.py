"""Run by test_ops_gpu.py in a fresh process with MORI_TORCH_STREAM_FLAGS=spin:
the doorbell works with spin kernels instead of stream memory operations,
eager and inside a CUDA graph replayed with new block tables, and the
graph's doorbell slot is freed when the graph is destroyed."""
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mori_torch import ops  # noqa: E402
from test_ops_gpu import PAGE, TcpEnv, pages_of, rand_pages  # noqa: E402


def main():
    assert ops.stream_flag_mechanism() == "spin", ops.stream_flag_mechanism()
    t = TcpEnv()
    t.remote.copy_(rand_pages(1, "cpu"))
    ops.read_pages(t.h, t.local, torch.tensor([1], device="cuda"), torch.tensor([9], device="cuda"), PAGE)
    torch.cuda.synchronize()
    assert torch.equal(pages_of(t.local, 1), pages_of(t.remote, 9))
    remote_in = torch.zeros(1, dtype=torch.int64, device="cuda")
    local_in = torch.tensor([2], device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            ops.read_pages(t.h, t.local, local_in, remote_in, PAGE)
    for i in range(20):
        remote_in.fill_(i * 3)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(pages_of(t.local, 2), pages_of(t.remote, i * 3)), i
    ops.check_errors(t.h)
    # The captured doorbell is freed with its graph (this process has no other).
    assert ops.doorbell_slots()["captured"] == 1, ops.doorbell_slots()
    del g
    gc.collect()
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10
    while ops.doorbell_slots() != {"watched": 0, "captured": 0} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ops.doorbell_slots() == {"watched": 0, "captured": 0}, ops.doorbell_slots()
    t.close()
    print("spin fallback ok")


if __name__ == "__main__":
    main()
