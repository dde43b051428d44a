"""Retry and failover costs (issue 17), in one run, TCP on loopback, both
engines in this process:

1. added latency of a retried transfer: transfers of one size timed alone,
   and the same transfers with the target's connections shut down once while
   they run (shutdown(2) of its sockets from a thread here, a reset as the
   initiator sees it); only transfers that were retried exactly once count.
   Added latency = median(retried) - median(alone);
2. throughput of 16 MiB writes during a kill loop (the target's connections
   killed every --kill-period-s with `ss -K` when this machine allows it,
   else shut down as in 1) against the same writes without, alternating
   one-second blocks so that other load hits both alike;
3. the cost of failover on against off in the normal path: 4 KiB and 1 MiB
   transfers, two initiator engines (failover=True / False) to one target,
   alternated one by one (ABBA).

Time to fail over to another backend and back needs two backends: it is
measured in the Soft-RoCE VM (tests/cpp/rdma_vm_failover_test.cpp prints
it) and on the GPU machine (tests/python/test_gpu_failover.py).

    python benchmarks/bench_failover.py --json docs/results/failover_tcp_cpu.json
"""
import argparse
import json
import os
import platform
import random
import socket
import statistics
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import socket_kill  # noqa: E402
from mori_torch.io import BackendType, IOEngine, IOEngineConfig, StatusCode, TcpBackendConfig  # noqa: E402

NBYTES = 16 << 20


def shut_down_inbound(port: int) -> int:
    """Shuts down this process's connected sockets whose local port is
    `port` (the target engine's inbound connections); returns how many."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.family == socket.AF_INET and s.getsockname()[1] == port:
                s.getpeername()  # raises for the listener
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass
        finally:
            s.detach()
    return n


class Setup:
    def __init__(self, aa=False):
        self.target = IOEngine(f"fo-bench-target-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
        self.target.create_backend(BackendType.TCP, TcpBackendConfig())
        self.remote = torch.zeros(NBYTES, dtype=torch.uint8)
        self.rd = self.target.register_torch_tensor(self.remote)
        self.port = self.target.get_engine_desc().port
        self.inits = {}
        for mode in ("on", "off"):
            e = IOEngine(f"fo-bench-{mode}-{os.getpid()}", IOEngineConfig("127.0.0.1", 0, failover=aa or mode == "on"))
            e.create_backend(BackendType.TCP, TcpBackendConfig())
            e.register_remote_engine(self.target.get_engine_desc())
            buf = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)
            self.inits[mode] = (e, buf, e.register_torch_tensor(buf))

    def write(self, mode, size, off=0):
        e, _, d = self.inits[mode]
        t0 = time.perf_counter()
        st = e.write(d, off, self.rd, off, size, e.allocate_transfer_uid())
        code = st.WaitFor(60000)
        dt = time.perf_counter() - t0
        if code != StatusCode.SUCCESS:
            raise RuntimeError(f"{StatusCode(code).name}: {st.Message()}")
        return dt

    def verify(self, mode, size):
        e, buf, _ = self.inits[mode]
        self.remote.zero_()
        self.write(mode, size)
        assert torch.equal(self.remote[:size], buf[:size]), "bytes differ"

    def close(self):
        for e, _, _ in self.inits.values():
            e.shutdown()
        self.target.shutdown()


def retried_latency(s: Setup, size: int, iters: int, rng: random.Random) -> dict:
    s.verify("on", size)
    alone = [s.write("on", size) for _ in range(iters)]
    base = statistics.median(alone)
    e = s.inits["on"][0]
    retried = []
    tries = 0
    while len(retried) < iters and tries < iters * 20:
        tries += 1
        before = e.failover_stats()["retries"]
        delay = rng.uniform(0.1, 0.6) * base
        k = threading.Thread(target=lambda: (time.sleep(delay), shut_down_inbound(s.port)))
        k.start()
        dt = s.write("on", size)
        k.join()
        if e.failover_stats()["retries"] - before == 1:
            retried.append(dt)
    s.verify("on", size)
    r = {"bytes": size, "alone_ms": [round(x * 1e3, 4) for x in alone],
         "retried_ms": [round(x * 1e3, 4) for x in retried], "tries": tries}
    if retried:
        r["median_alone_ms"] = round(base * 1e3, 3)
        r["median_retried_ms"] = round(statistics.median(retried) * 1e3, 3)
        r["added_ms"] = round((statistics.median(retried) - base) * 1e3, 3)
    return r


def kill_loop_throughput(s: Setup, seconds: float, period: float, use_ss: bool) -> dict:
    def block(dur):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < dur:
            s.write("on", NBYTES)
            n += 1
        return n * NBYTES / (time.perf_counter() - t0)

    stop = threading.Event()
    kills = [0]

    def killer():
        while not stop.wait(period):
            kills[0] += socket_kill.kill(s.port) if use_ss else shut_down_inbound(s.port)

    calm, killed = [], []
    e = s.inits["on"][0]
    before = e.failover_stats()
    for _ in range(max(1, int(seconds))):
        calm.append(block(1.0))
        stop.clear()
        t = threading.Thread(target=killer)
        t.start()
        killed.append(block(1.0))
        stop.set()
        t.join()
    after = e.failover_stats()
    s.verify("on", NBYTES)
    return {"method": "ss -K" if use_ss else "shutdown(2) in process", "period_s": period, "kills": kills[0],
            "retries": after["retries"] - before["retries"], "exhausted": after["exhausted"] - before["exhausted"],
            "calm_gbps": [round(x / 1e9, 3) for x in calm], "killed_gbps": [round(x / 1e9, 3) for x in killed],
            "ratio_killed_over_calm": round(statistics.median(killed) / statistics.median(calm), 3)}


def on_off_cost(s: Setup, size: int, iters: int) -> dict:
    for m in ("on", "off"):
        s.verify(m, size)
    t = {"on": [], "off": []}
    order = ("on", "off", "off", "on")
    for _ in range(iters):
        for m in order:
            t[m].append(s.write(m, size))
    on, off = statistics.median(t["on"]), statistics.median(t["off"])
    return {"bytes": size, "iters": iters * 2, "median_on_us": round(on * 1e6, 2), "median_off_us": round(off * 1e6, 2),
            "ratio_on_over_off": round(on / off, 4)}


class _SkipToCost(Exception):
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cost-iters", type=int, default=1500)
    ap.add_argument("--loop-seconds", type=float, default=5)
    ap.add_argument("--kill-period-s", type=float, default=0.5)
    ap.add_argument("--aa", action="store_true",
                    help="A/A control: both initiators with failover on (the on/off ratio then shows order effects)")
    ap.add_argument("--only-cost", action="store_true", help="only the on/off cost (3)")
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = random.Random(1)
    s = Setup(args.aa)
    out = {"command": "python " + " ".join(sys.argv), "machine": platform.node(), "cpus": os.cpu_count(),
           "kernel": platform.release(), "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out["aa"] = args.aa
    try:
        if args.only_cost:
            raise _SkipToCost()
        out["retried_latency"] = [retried_latency(s, n, args.iters, rng) for n in (64 << 10, 1 << 20, NBYTES)]
        for r in out["retried_latency"]:
            print(f"retried {r['bytes']:>9} B: alone {r.get('median_alone_ms')} ms, retried "
                  f"{r.get('median_retried_ms')} ms, added {r.get('added_ms')} ms ({len(r['retried_ms'])} retried)")
        out["kill_loop"] = kill_loop_throughput(s, args.loop_seconds, args.kill_period_s, socket_kill.supported())
        k = out["kill_loop"]
        print(f"kill loop ({k['method']}, every {k['period_s']} s, {k['kills']} sockets killed, "
              f"{k['retries']} retries, {k['exhausted']} failed): killed/calm throughput {k['ratio_killed_over_calm']}")
    except _SkipToCost:
        pass
    try:
        out["on_off"] = [on_off_cost(s, n, args.cost_iters if n <= 4096 else args.cost_iters // 10)
                         for n in (4096, 1 << 20)]
        for r in out["on_off"]:
            print(f"failover on/off {r['bytes']:>8} B: {r['median_on_us']} us / {r['median_off_us']} us = "
                  f"{r['ratio_on_over_off']}")
    finally:
        s.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
