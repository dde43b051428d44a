"""Small-transfer latency over TCP, host memory, at the default config,
against a plain socket round trip measured in the same run.

    python benchmarks/bench_tcp_latency.py [--samples 2000] [--rounds 5] [--json out.json]

Three processes on loopback: a target engine, a plain socket echo server,
and the initiator, which times, in alternating rounds (so that load changes
on the machine hit every case alike):

* ``socket``: a plain TCP round trip of the same shape as a read: an 80-byte
  request (our request header's size) answered by the payload, blocking
  ``sendall``/``recv`` on one connection (the baseline of the ratios);
* ``socket, client spins``: the same with the client spinning on a
  non-blocking ``recv`` (as an application polling ``Succeeded()`` spins),
  the server still blocking;
* mori_torch ``read`` and ``write`` of one segment, call -> ``Succeeded()``
  polled (as an application polls) and call -> ``Wait()`` returned, with the
  default ``TcpBackendConfig``, with ``poller_receives=False`` (responses
  read by the event loop only, not by the polling thread), with
  ``notice_delay_us=0`` and ``1000`` (a read's completion notice sent on its
  own at once, or riding on the next request; the default picks one by
  whether the event loops spin) and with ``inline_max_bytes=0`` (every
  request handed to the backend's worker threads, the behaviour before
  inline handling).

Reported per case: p50, p90, p99 (microseconds) over all rounds, the ratio of
the p50 to the socket's p50 and of the p99 to the own p50. Every read's bytes
are checked against the target's pattern.
"""
import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mori_torch.io import (  # noqa: E402
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    TcpBackendConfig,
)

REQUEST_BYTES = 80  # tcp_protocol.h RequestHeader
CONFIGS = {"default": {}, "poller off": {"poller_receives": False}, "notices at once": {"notice_delay_us": 0},
           "notices held": {"notice_delay_us": 1000}, "inline off": {"inline_max_bytes": 0}}


def _pattern(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def _target(conn, size: int):
    torch.set_num_threads(1)
    out = {}
    engines = []
    for name, cfg in CONFIGS.items():
        e = IOEngine(f"lat-target-{name.replace(' ', '-')}-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
        e.create_backend(BackendType.TCP, TcpBackendConfig(**cfg))
        buf = _pattern(size * 2)
        out[name] = (e.get_engine_desc().pack(), e.register_torch_tensor(buf).pack())
        engines.append((e, buf))
    conn.send(out)
    conn.recv()
    for e, _ in engines:
        e.shutdown()


def _echo_server(conn, size: int):
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(srv.getsockname()[1])
    s, _ = srv.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(size)
    while True:
        got = 0
        while got < REQUEST_BYTES:
            chunk = s.recv(REQUEST_BYTES - got)
            if not chunk:
                return
            got += len(chunk)
        s.sendall(payload)


def pcts(samples):
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return pick(0.5), pick(0.9), pick(0.99)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="bytes per transfer (default: 4096)")
    ap.add_argument("--samples", type=int, default=2000, help="timed transfers per case and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    tp, tc = ctx.Pipe()
    target = ctx.Process(target=_target, args=(tc, args.size), daemon=True)
    target.start()
    ep, ec = ctx.Pipe()
    echo = ctx.Process(target=_echo_server, args=(ec, args.size), daemon=True)
    echo.start()
    descs = tp.recv()
    sock = socket.create_connection(("127.0.0.1", ep.recv()))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req = bytes(REQUEST_BYTES)
    rbuf = bytearray(args.size)

    def socket_round(spin=False):
        view = memoryview(rbuf)
        out = []
        flags = socket.MSG_DONTWAIT if spin else 0
        for _ in range(args.samples):
            t0 = time.perf_counter()
            sock.sendall(req)
            got = 0
            while got < args.size:
                try:
                    got += sock.recv_into(view[got:], args.size - got, flags)
                except BlockingIOError:
                    pass
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    cases = {}
    engines = []
    ref = _pattern(args.size * 2)[: args.size]
    for name, cfg in CONFIGS.items():
        e = IOEngine(f"lat-init-{name.replace(' ', '-')}-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
        e.create_backend(BackendType.TCP, TcpBackendConfig(**cfg))
        edesc, mdesc = descs[name]
        e.register_remote_engine(EngineDesc.unpack(edesc))
        local = torch.zeros(args.size, dtype=torch.uint8)
        sess = e.create_session(e.register_torch_tensor(local), MemoryDesc.unpack(mdesc))
        engines.append(e)
        for op in ("read", "write"):
            for how in ("poll", "wait"):
                cases[f"{op}, {how}, {name}"] = (sess, op, how, local)

    def engine_round(sess, op, how, local):
        fn = sess.read if op == "read" else sess.write
        # A write goes to the second half of the target's buffer: the reads' half stays the pattern.
        roff = 0 if op == "read" else args.size
        out = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            st = fn(0, roff, args.size, 1)
            if how == "poll":
                while not st.Succeeded():
                    if st.Failed():
                        raise SystemExit(f"{op} failed: {st.Message()}")
            else:
                st.Wait()
            out.append((time.perf_counter() - t0) * 1e6)
            if not st.Succeeded():
                raise SystemExit(f"{op} failed: {st.Message()}")
        if op == "read" and not torch.equal(local, ref):
            raise SystemExit("a read's bytes differ from the target's pattern")
        return out

    samples = {"socket": [], "socket, client spins": []}
    samples.update({k: [] for k in cases})
    for fn in [socket_round] + [lambda c=c: engine_round(*c) for c in cases.values()]:
        fn()  # warm-up: connections open, pages touched
    for r in range(args.rounds):
        samples["socket"] += socket_round()
        samples["socket, client spins"] += socket_round(spin=True)
        for k, c in cases.items():
            samples[k] += engine_round(*c)
        print(f"round {r + 1}/{args.rounds}: socket p50 {statistics.median(samples['socket']):.1f} us, read poll "
              f"p50 {statistics.median(samples['read, poll, default']):.1f} us", file=sys.stderr, flush=True)
    tp.send("done")
    sock.close()
    for e in engines:
        e.shutdown()
    target.join(10)
    echo.kill()

    sock_p50 = pcts(samples["socket"])[0]
    rows = []
    for k, v in samples.items():
        p50, p90, p99 = pcts(v)
        rows.append(dict(case=k, p50_us=round(p50, 2), p90_us=round(p90, 2), p99_us=round(p99, 2),
                         p50_over_socket=round(p50 / sock_p50, 3), p99_over_p50=round(p99 / p50, 3), n=len(v)))
    print("| case | p50 us | p90 us | p99 us | p50 / socket p50 | p99 / p50 |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['p50_us']:.1f} | {r['p90_us']:.1f} | {r['p99_us']:.1f} | "
              f"{r['p50_over_socket']:.2f} | {r['p99_over_p50']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="bench_tcp_latency", size=args.size, samples=args.samples, rounds=args.rounds,
                           machine=f"{platform.node()}, {os.cpu_count()} cores", torch=torch.__version__,
                           command="python benchmarks/bench_tcp_latency.py " + " ".join(
                               sys.argv[1:] if argv is None else argv),
                           baseline="plain socket round trip: 80-byte request, payload response, loopback",
                           rows=rows), f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
