"""An engine in its own process that publishes itself in a rendezvous
directory, for tests/python/test_rendezvous.py. Driven by lines on stdin:
`verify SEED` (is my buffer pattern(SEED)?), `status`, `exit`.

usage: rendezvous_peer.py KIND ADDRESS NAMESPACE KEY TTL_S SEED
"""
import sys

import torch

from conftest import make_directory, pattern
from mori_torch.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig


def main():
    kind, address, namespace, key, ttl_s, seed = sys.argv[1:7]
    engine = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(BackendType.TCP, TcpBackendConfig(op_timeout_ms=120000))
    buf = pattern(1 << 20, int(seed))
    directory = make_directory(kind, address, namespace, float(ttl_s))
    directory.publish(engine, {"kv": engine.register_torch_tensor(buf)}, takeover_timeout_s=60)
    print("READY", directory._published.incarnation, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "verify":
            print("VERIFY", torch.equal(buf, pattern(buf.numel(), int(cmd[1]))), flush=True)
        elif cmd[0] == "status":
            print("STATUS", directory.published, getattr(directory, "republished", 0), flush=True)
        elif cmd[0] == "exit":
            break
    directory.close()
    engine.shutdown()
    print("BYE", flush=True)


if __name__ == "__main__":
    main()
