"""A target engine in its own process for the fault tests (run inside a
network namespace by `ip netns exec`). Prints one line: the packed EngineDesc
and MemoryDesc in hex; its buffer holds pattern(size, seed); exits when stdin
closes."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mori_torch.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--size", type=int, default=8 << 20)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    e = IOEngine(f"fault-target-{os.getpid()}", IOEngineConfig(args.host, 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig())
    g = torch.Generator().manual_seed(args.seed)
    buf = torch.randint(0, 256, (args.size,), dtype=torch.uint8, generator=g)
    d = e.register_torch_tensor(buf)
    print(e.get_engine_desc().pack().hex(), d.pack().hex(), flush=True)
    sys.stdin.read()
    e.shutdown()


if __name__ == "__main__":
    main()
