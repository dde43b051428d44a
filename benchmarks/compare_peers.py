#!/usr/bin/env python3
"""mori_torch next to NIXL and Mooncake Transfer Engine: the same workloads,
each library in its own pair of processes through its public API, every
library's bytes checked, torch baselines measured in the same run.

    python benchmarks/compare_peers.py --mem gpu cpu --json docs/results/peers_gpu.json \\
        --plot docs/results/peers_gpu.png --markdown docs/results/peers_gpu.md

Workloads (all READs: the initiator pulls pages from the target, as a
disaggregated-prefill KV pull does; timed from the call to completion):
  64MiB          one 64 MiB segment
  16384x16KiB    16,384 pages of 16 KiB in one batch, remote page order permuted
  4096x4KiB      4,096 pages of 4 KiB in one batch, permuted
  latency_4KiB   one 4 KiB read, --lat-samples times: the distribution

Paths:
  gpu   GPU memory through each library's intra-node GPU path: mori_torch XGMI
        backend; NIXL UCX (cuda_ipc, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y);
        Mooncake MC_INTRANODE_NVLINK=1. Baselines: torch copy_ of the same
        bytes, and the indexed page gather (index_select on an int64 view).
  cpu   host memory through each library's TCP path: mori_torch TCP backend;
        NIXL UCX_TLS=tcp,cuda_copy (plain tcp is refused when a GPU is
        present); Mooncake MC_FORCE_TCP=1. Baselines: a plain socket loopback
        moving the same bytes (as many connections as mori_torch stripes
        over), and torch copy_ / page gather in one process.

Page indices are permuted so that no two consecutive pages are adjacent on the
target (NIXL merges consecutive descriptors). A library that is not installed
is reported as such; one that fails is reported with its error, and the others
still run. Versions go into the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

KiB, MiB = 1 << 10, 1 << 20
HOST = "127.0.0.1"
SOCKET_CONNS = 8  # the socket baseline's most connections: mori_torch's default num_data_conns

# (name, segment bytes, segments, latency?); --quick shrinks them for CPU tests.
WORKLOADS = [("64MiB", 64 * MiB, 1, False), ("16384x16KiB", 16 * KiB, 16384, False),
             ("4096x4KiB", 4 * KiB, 4096, False), ("latency_4KiB", 4 * KiB, 1, True)]
QUICK_WORKLOADS = [("4MiB", 4 * MiB, 1, False), ("1024x16KiB", 16 * KiB, 1024, False),
                   ("512x4KiB", 4 * KiB, 512, False), ("latency_4KiB", 4 * KiB, 1, True)]

PEERS = ("mori_torch", "nixl", "mooncake")
MODULE = {"mori_torch": "mori_torch", "nixl": "nixl_cu13", "mooncake": "mooncake.engine"}
DIST = {"nixl": "nixl-cu13", "mooncake": "mooncake-transfer-engine-cuda13"}
ENV = {
    ("nixl", "gpu"): {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"},
    ("nixl", "cpu"): {"UCX_TLS": "tcp,cuda_copy"},
    ("mooncake", "gpu"): {"MC_INTRANODE_NVLINK": "1"},
    ("mooncake", "cpu"): {"MC_FORCE_TCP": "1"},
}
PATH = {
    ("mori_torch", "gpu"): "XGMI backend (CUDA IPC, copy engines / copy kernel)",
    ("mori_torch", "cpu"): "TCP backend, default TcpBackendConfig",
    ("nixl", "gpu"): "UCX backend, cuda_ipc",
    ("nixl", "cpu"): "UCX backend, UCX_TLS=tcp,cuda_copy",
    ("mooncake", "gpu"): "TransferEngine P2PHANDSHAKE, MC_INTRANODE_NVLINK=1",
    ("mooncake", "cpu"): "TransferEngine P2PHANDSHAKE, MC_FORCE_TCP=1",
    ("socket", "cpu"): "plain TCP sockets, loopback, request then data",
    ("torch_copy", "gpu"): "torch copy_ of the same bytes, one process",
    ("torch_copy", "cpu"): "torch copy_ of the same bytes, one process",
    ("torch_gather", "gpu"): "torch index_select of the pages on an int64 view, one process",
    ("torch_gather", "cpu"): "torch index_select of the pages on an int64 view, one process",
}
BASELINE = {"gpu": "torch_copy", "cpu": "socket"}  # what each path's ratio divides by


class Unavailable(Exception):
    """The library cannot run here (import failed, no GPU): reported, not an error."""


# --------------------------------------------------------------------------
# Data and checks (both processes build the same pattern from the seed)
# --------------------------------------------------------------------------


def pattern(nbytes: int, seed: int, device: str):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)


def permutation(n: int, seed: int) -> List[int]:
    """A permutation of range(n) with no i followed by i + 1 (nothing can merge)."""
    import random

    rng = random.Random(seed)
    idx = list(range(n))
    rng.shuffle(idx)
    for _ in range(100):
        bad = [i for i in range(n - 1) if idx[i + 1] == idx[i] + 1]
        if not bad:
            break
        for i in bad:
            j = rng.randrange(n)
            idx[i + 1], idx[j] = idx[j], idx[i + 1]
    return idx


def pages_match(local, ref, seg: int, n: int, remote_idx: Sequence[int]) -> bool:
    """Local page i holds the target's page remote_idx[i]."""
    import torch

    if seg % 8 == 0:
        local, ref, seg = local.view(torch.int64), ref.view(torch.int64), seg // 8
    idx = torch.tensor(list(remote_idx), dtype=torch.int64, device=ref.device)
    return bool(torch.equal(local[: n * seg].view(n, seg), ref.view(-1, seg).index_select(0, idx)))


def percentiles(samples_ns: List[int]) -> Dict[str, float]:
    s = sorted(samples_ns)
    pick = lambda q: s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] / 1e3  # noqa: E731
    return {"min_us": s[0] / 1e3, "p10_us": pick(10), "p50_us": pick(50), "p90_us": pick(90),
            "p99_us": pick(99), "max_us": s[-1] / 1e3, "mean_us": sum(s) / len(s) / 1e3}


# --------------------------------------------------------------------------
# Libraries: each has a target side (serve) and an initiator side (connect,
# then prepare(...) -> one call-to-completion transfer). Imports happen in the
# child process, after its environment is set.
# --------------------------------------------------------------------------


class MoriTorch:
    def __init__(self, mem: str, cfg: dict):
        from mori_torch import io

        self.io, self.mem = io, mem
        self.engine = io.IOEngine(f"peers-{os.getpid()}", io.IOEngineConfig(HOST, 0))
        if mem == "gpu":
            self.engine.create_backend(io.BackendType.XGMI, io.XgmiBackendConfig())
        else:
            self.engine.create_backend(io.BackendType.TCP, io.TcpBackendConfig())

    def version(self) -> str:
        import mori_torch

        return mori_torch.__version__ + _git_rev()

    def serve(self, buf) -> object:
        self.mem_desc = self.engine.register_torch_tensor(buf)
        return (self.engine.get_engine_desc().pack(), self.mem_desc.pack())

    def on_peer(self, meta) -> None:
        self.engine.register_remote_engine(self.io.EngineDesc.unpack(meta))

    def connect(self, buf, meta) -> object:
        io = self.io
        desc, mem = meta
        self.engine.register_remote_engine(io.EngineDesc.unpack(desc))
        self.sess = self.engine.create_session(self.engine.register_torch_tensor(buf), io.MemoryDesc.unpack(mem))
        return self.engine.get_engine_desc().pack()

    def prepare(self, seg: int, local_idx, remote_idx, poll: bool) -> Callable[[], None]:
        import torch

        sess = self.sess
        if len(local_idx) == 1:
            lo, ro = local_idx[0] * seg, remote_idx[0] * seg

            def submit():
                return sess.read(lo, ro, seg, sess.allocate_transfer_uid())
        else:
            lo = torch.tensor(local_idx, dtype=torch.int64) * seg
            ro = torch.tensor(remote_idx, dtype=torch.int64) * seg
            sz = torch.full((len(local_idx),), seg, dtype=torch.int64)

            def submit():
                return sess.batch_read(lo, ro, sz, sess.allocate_transfer_uid())

        def run():
            st = submit()
            if poll:  # latency: call -> Succeeded(), as an application polls
                while not st.Succeeded():
                    if st.Failed():
                        break
            else:
                st.Wait()
            if not st.Succeeded():
                raise RuntimeError(f"mori_torch transfer failed: {st!r}")

        return run


class Nixl:
    def __init__(self, mem: str, cfg: dict):
        import torch  # noqa: F401  (NIXL's notes: torch first)

        api = _import_peer("nixl_cu13")
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        self.agent = nixl_agent(f"peers-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        self.dev = cfg["device"]

    def version(self) -> str:
        return _dist_version(DIST["nixl"])

    def serve(self, buf) -> object:
        self.reg = self.agent.register_memory(buf)
        return (self.agent.get_agent_metadata(), buf.data_ptr())

    def on_peer(self, meta) -> None:
        self.agent.add_remote_agent(meta)

    def connect(self, buf, meta) -> object:
        md, self.remote_base = meta
        self.reg = self.agent.register_memory(buf)
        self.local_base = buf.data_ptr()
        self.kind = "VRAM" if buf.is_cuda else "DRAM"
        self.remote = self.agent.add_remote_agent(md)
        return self.agent.get_agent_metadata()

    def _dlist(self, agent: str, base: int, seg: int, n: int):
        import numpy as np

        d = np.empty((n, 3), dtype=np.uint64)
        d[:, 0] = base + np.arange(n, dtype=np.uint64) * seg
        d[:, 1] = seg
        d[:, 2] = self.dev if self.kind == "VRAM" else 0
        return self.agent.prep_xfer_dlist(agent, d, self.kind)

    def prepare(self, seg: int, local_idx, remote_idx, poll: bool) -> Callable[[], None]:
        import numpy as np

        # vLLM's pattern: descriptor lists prepared once, one prepped transfer per call.
        n = max(max(local_idx), max(remote_idx)) + 1
        lp = self._dlist("NIXL_INIT_AGENT", self.local_base, seg, n)
        rp = self._dlist(self.remote, self.remote_base, seg, n)
        li = np.asarray(local_idx, dtype=np.int32)
        ri = np.asarray(remote_idx, dtype=np.int32)
        agent = self.agent

        def run():
            h = agent.make_prepped_xfer("READ", lp, li, rp, ri)
            st = agent.transfer(h)
            while st == "PROC":
                st = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if st != "DONE":
                raise RuntimeError(f"NIXL transfer ended in state {st}")

        run.keep = (lp, rp)  # the prepped lists live as long as the closure
        return run


class Mooncake:
    def __init__(self, mem: str, cfg: dict):
        self.te = _import_peer("mooncake.engine").TransferEngine()
        protocol = cfg["mooncake_gpu_protocol"] if mem == "gpu" else "tcp"
        rc = self.te.initialize(HOST, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({HOST!r}, 'P2PHANDSHAKE', {protocol!r})"
                               f" returned {rc}")

    def version(self) -> str:
        return _dist_version(DIST["mooncake"])

    def _register(self, buf) -> None:
        rc = self.te.register_memory(buf.data_ptr(), buf.numel())
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory returned {rc}")

    def serve(self, buf) -> object:
        self._register(buf)
        return (f"{HOST}:{self.te.get_rpc_port()}", buf.data_ptr())

    def on_peer(self, meta) -> None:
        pass

    def connect(self, buf, meta) -> object:
        self.session, self.remote_base = meta
        self._register(buf)
        self.local_base = buf.data_ptr()
        return None

    def prepare(self, seg: int, local_idx, remote_idx, poll: bool) -> Callable[[], None]:
        import numpy as np

        te, session = self.te, self.session
        if len(local_idx) == 1:
            lo, ro = self.local_base + local_idx[0] * seg, self.remote_base + remote_idx[0] * seg

            def call():
                return te.transfer_sync_read(session, lo, ro, seg)
        else:
            lo = self.local_base + np.asarray(local_idx, dtype=np.uint64) * seg
            ro = self.remote_base + np.asarray(remote_idx, dtype=np.uint64) * seg
            ln = np.full(len(local_idx), seg, dtype=np.uint64)

            def call():
                return te.batch_transfer_sync_read_arrays(session, lo, ro, ln)

        def run():
            rc = call()
            if rc != 0:
                raise RuntimeError(f"Mooncake read returned {rc}")

        return run


class SocketLoopback:
    """The TCP baseline: the target sends the bytes asked for on each of up to
    SOCKET_CONNS connections (one thread each); the initiator splits a transfer
    over as many connections as mori_torch's TCP backend stripes it over."""

    REQ = struct.Struct("<QQ")

    def __init__(self, mem: str, cfg: dict):
        pass

    def version(self) -> str:
        return platform.python_version()

    def serve(self, buf) -> object:
        from mori_torch.benchmark import tensor_view

        mv = tensor_view(buf)
        lsock = socket.create_server((HOST, 0))
        threading.Thread(target=self._accept, args=(lsock, mv), daemon=True).start()
        return lsock.getsockname()[1]

    def _accept(self, lsock, mv) -> None:
        for _ in range(SOCKET_CONNS):
            s, _ = lsock.accept()
            threading.Thread(target=self._serve_conn, args=(s, mv), daemon=True).start()

    def _serve_conn(self, s, mv) -> None:
        from mori_torch.benchmark import _recv_exact, _tune

        _tune(s)
        req = bytearray(self.REQ.size)
        try:
            while True:
                _recv_exact(s, memoryview(req))
                off, ln = self.REQ.unpack(req)
                s.sendall(mv[off : off + ln])
        except (ConnectionError, OSError):
            s.close()

    def on_peer(self, meta) -> None:
        pass

    def connect(self, buf, port) -> object:
        from mori_torch.benchmark import _tune, tensor_view

        self.mv = tensor_view(buf)
        self.socks = []
        for _ in range(SOCKET_CONNS):
            s = socket.create_connection((HOST, port))
            _tune(s)
            self.socks.append(s)
        return None

    def prepare(self, seg: int, local_idx, remote_idx, poll: bool) -> Callable[[], None]:
        # Contiguous bytes (a socket stream has no pages): the baseline for what a byte costs over TCP.
        from concurrent.futures import ThreadPoolExecutor

        from mori_torch.benchmark import _recv_exact, engine_stripes, split_parts

        total = seg * len(local_idx)
        parts = split_parts(total, engine_stripes(total, SOCKET_CONNS))
        mv, socks = self.mv, self.socks

        def one(i: int) -> None:
            off, ln = parts[i]
            socks[i].sendall(self.REQ.pack(off, ln))
            _recv_exact(socks[i], mv[off : off + ln])

        if len(parts) == 1:
            return lambda: one(0)
        pool = ThreadPoolExecutor(len(parts) - 1)

        def run():
            futs = [pool.submit(one, i) for i in range(1, len(parts))]
            one(0)
            for f in futs:
                f.result()

        run.keep = pool
        return run

    def expected(self, local_idx, remote_idx, poll: bool):
        """The same number of bytes, from the start of the target's buffer."""
        return list(range(len(local_idx)))


class TorchLocal:
    """In-process torch baselines (no target): copy_ of the same bytes, or the
    page gather (index_select on an int64 view). Latency: copy_ then an event
    polled until it completes (GPU)."""

    def __init__(self, mem: str, cfg: dict, gather: bool):
        self.gather = gather

    def version(self) -> str:
        import torch

        return torch.__version__

    def connect(self, buf, src) -> None:
        self.dst, self.src = buf, src

    def prepare(self, seg: int, local_idx, remote_idx, poll: bool) -> Callable[[], None]:
        import torch

        n = len(local_idx)
        dst, src = self.dst, self.src
        sync = torch.cuda.synchronize if dst.is_cuda else (lambda: None)
        if self.gather:
            d64 = dst.view(torch.int64)[: n * seg // 8].view(n, seg // 8)
            s64 = src.view(torch.int64).view(-1, seg // 8)
            idx = torch.tensor(remote_idx, dtype=torch.int64, device=src.device)

            def run():
                torch.index_select(s64, 0, idx, out=d64)
                sync()
        elif poll and dst.is_cuda:
            d, s = dst[:seg], src[remote_idx[0] * seg : (remote_idx[0] + 1) * seg]
            ev = torch.cuda.Event()

            def run():
                d.copy_(s)
                ev.record()
                while not ev.query():
                    pass
        else:
            d, s = dst[: n * seg], src[: n * seg]

            def run():
                d.copy_(s)
                sync()

        return run

    def expected(self, local_idx, remote_idx, poll: bool):
        """copy_ moves the same bytes unpermuted (the latency copy_ takes the same page)."""
        if self.gather or (poll and self.dst.is_cuda):
            return remote_idx
        return list(range(len(local_idx)))


def _import_peer(module: str):
    """The peer's module; one that is installed but cannot load here (e.g.
    Mooncake without libcuda) makes the library unavailable, not failed."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Unavailable(f"{module} does not import: {e}") from None


def _dist_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def _git_rev() -> str:
    import subprocess

    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"+g{rev}" if rev else ""


LIBS = {"mori_torch": MoriTorch, "nixl": Nixl, "mooncake": Mooncake, "socket": SocketLoopback}


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


def _child_setup(lib: str, mem: str, cfg: dict) -> str:
    os.environ.update(ENV.get((lib, mem), {}))
    import torch

    if mem == "gpu":
        if not torch.cuda.is_available():
            raise Unavailable("no CUDA GPU visible")
        torch.cuda.set_device(cfg["device"])
        return f"cuda:{cfg['device']}"
    return "cpu"


def _target_main(lib: str, mem: str, cfg: dict, conn) -> None:
    try:
        device = _child_setup(lib, mem, cfg)
        impl = LIBS[lib](mem, cfg)
        buf = pattern(cfg["buffer_bytes"], cfg["seed"], device)
        conn.send(("meta", impl.serve(buf)))
        while True:
            cmd, arg = conn.recv()
            if cmd == "peer":
                impl.on_peer(arg)
                conn.send(("ok", None))
            elif cmd == "stop":
                break
    except EOFError:
        pass
    except Unavailable as e:
        _send(conn, ("unavailable", str(e)))
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))


def _send(conn, msg) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError):
        pass


def _recv(conn, what: str, timeout: float):
    if not conn.poll(timeout):
        raise RuntimeError(f"{what} did not answer within {timeout:.0f} s")
    msg = conn.recv()
    if msg[0] == "unavailable":
        raise Unavailable(msg[1])
    if msg[0] == "error":
        raise RuntimeError(f"{what} failed:\n{msg[1]}")
    return msg[1]


def _initiator_main(lib: str, mem: str, cfg: dict, tconn, result) -> None:
    """Runs every workload against the target and sends back one record per workload."""
    try:
        device = _child_setup(lib, mem, cfg)
        import torch

        ref = pattern(cfg["buffer_bytes"], cfg["seed"], device)  # the target's bytes
        buf = torch.zeros(cfg["buffer_bytes"], dtype=torch.uint8, device=device)
        if lib.startswith("torch_"):
            impl = TorchLocal(mem, cfg, gather=lib == "torch_gather")
            impl.connect(buf, ref)
        else:
            impl = LIBS[lib](mem, cfg)
            meta = _recv(tconn, "target", cfg["timeout"])
            mine = impl.connect(buf, meta)
            tconn.send(("peer", mine))
            _recv(tconn, "target", cfg["timeout"])
        version = impl.version()
        records = []
        for name, seg, n, latency in cfg["workloads"]:
            local_idx = list(range(n))
            remote_idx = permutation(cfg["buffer_bytes"] // seg, cfg["seed"] + n)[:n]
            if latency:
                remote_idx = [remote_idx[0]]
            run = impl.prepare(seg, local_idx, remote_idx, poll=latency)
            buf.zero_()
            iters = cfg["lat_samples"] if latency else cfg["iters"] or max(5, min(50, int(4e9 // (seg * n))))
            for _ in range(cfg["warmup"]):
                run()
            lat = []
            pc = time.perf_counter_ns
            for _ in range(iters):
                t0 = pc()
                run()
                lat.append(pc() - t0)
            # Peers move the permuted pages; the baselines say what they move.
            expect = impl.expected(local_idx, remote_idx, latency) if hasattr(impl, "expected") else remote_idx
            verified = pages_match(buf, ref, seg, n, expect)
            st = percentiles(lat)
            records.append(dict(workload=name, segment_bytes=seg, segments=n, total_bytes=seg * n, latency=latency,
                                iters=iters, gbps=seg * n / (st["mean_us"] * 1e3), verified=verified, **st))
        result.send(("ok", dict(version=version, workloads=records)))
    except Unavailable as e:
        _send(result, ("unavailable", str(e)))
    except BaseException:
        _send(result, ("error", traceback.format_exc()))
    finally:
        _send(tconn, ("stop", None))


def run_library(lib: str, mem: str, cfg: dict) -> dict:
    rec = dict(library=lib, mem=mem, path=PATH[(lib, mem)], env=ENV.get((lib, mem), {}))
    if lib in MODULE and importlib.util.find_spec(MODULE[lib].split(".")[0]) is None:
        return dict(rec, status="not installed", detail=f"module {MODULE[lib]} not found"
                    + (f" (pip install {DIST[lib]})" if lib in DIST else ""))
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    r_parent, r_child = ctx.Pipe()
    procs = [ctx.Process(target=_initiator_main, args=(lib, mem, cfg, t_parent, r_child), daemon=True)]
    if not lib.startswith("torch_"):
        procs.append(ctx.Process(target=_target_main, args=(lib, mem, cfg, t_child), daemon=True))
    for p in procs:
        p.start()
    t0 = time.monotonic()
    try:
        out = _recv(r_parent, f"{lib} ({mem})", cfg["timeout"])
        rec.update(status="ok", **out)
    except Unavailable as e:
        rec.update(status="unavailable", detail=str(e))
    except RuntimeError as e:
        rec.update(status="error", detail=str(e)[-4000:])
    finally:
        for p in procs:
            p.join(max(1.0, 30 - (time.monotonic() - t0)) if rec.get("status") == "ok" else 5)
            if p.is_alive():
                p.kill()
                p.join()
    return rec


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def add_ratios(results: List[dict]) -> None:
    """ratio = GB/s over the path's baseline (latency: baseline p50 / p50)."""
    base = {(r["mem"], w["workload"]): w for r in results if r["status"] == "ok"
            and r["library"] == BASELINE[r["mem"]] for w in r["workloads"]}
    for r in results:
        for w in r.get("workloads", []):
            b = base.get((r["mem"], w["workload"]))
            w["baseline"] = BASELINE[r["mem"]] if b else None
            if not b:
                w["ratio"] = None
            elif w["latency"]:
                w["ratio"] = b["p50_us"] / w["p50_us"]
            else:
                w["ratio"] = w["gbps"] / b["gbps"]


def markdown(report: dict) -> str:
    out = []
    for mem in report["mem_types"]:
        rows = [r for r in report["results"] if r["mem"] == mem]
        names = [w[0] for w in report["workloads"]]
        out.append(f"**{'GPU memory, intra-node GPU paths' if mem == 'gpu' else 'Host memory, TCP paths'}** "
                   f"(payload GB/s, mean over iterations; latency: p50 / p99 µs; "
                   f"ratio against {BASELINE[mem]} in the same run)\n")
        out.append("| library | version | " + " | ".join(names) + " |")
        out.append("|---|---|" + "---|" * len(names))
        for r in rows:
            if r["status"] != "ok":
                why = r["detail"].strip().splitlines()[-1] if r.get("detail") else ""
                why = why if len(why) <= 100 else why[:99] + "…"
                out.append(f"| {r['library']} | {r['status']}: {why} |" + " |" * len(names))
                continue
            by = {w["workload"]: w for w in r["workloads"]}
            cells = []
            for n in names:
                w = by.get(n)
                if w is None:
                    cells.append("-")
                    continue
                v = f"{w['p50_us']:.1f} / {w['p99_us']:.1f}" if w["latency"] else f"{w['gbps']:.2f}"
                if w["ratio"] is not None and r["library"] != BASELINE[mem]:
                    v += f" ({w['ratio']:.2f}×)"
                if not w["verified"]:
                    v += " **bytes wrong**"
                cells.append(v)
            out.append(f"| {r['library']} | {r['version']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(report: dict, path: str) -> Optional[str]:
    """Bar chart per path: GB/s per workload (log scale), p50 latency. None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    mems = report["mem_types"]
    fig, axes = plt.subplots(len(mems), 2, figsize=(13, 4.2 * len(mems)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for row, mem in zip(axes, mems):
        rows = [r for r in report["results"] if r["mem"] == mem and r["status"] == "ok"]
        bulk = [w[0] for w in report["workloads"] if not w[3]]
        lat = [w[0] for w in report["workloads"] if w[3]]
        width = 0.8 / max(1, len(rows))
        for i, r in enumerate(rows):
            by = {w["workload"]: w for w in r["workloads"]}
            xs = [k + i * width for k in range(len(bulk))]
            row[0].bar(xs, [by[n]["gbps"] if n in by else 0 for n in bulk], width, label=r["library"])
            row[1].bar([k + i * width for k in range(len(lat))], [by[n]["p50_us"] if n in by else 0 for n in lat],
                       width, label=r["library"])
        row[0].set_xticks([k + 0.4 - width / 2 for k in range(len(bulk))], bulk)
        row[0].set_yscale("log")
        row[0].set_ylabel("GB/s (payload)")
        row[0].set_title(f"{mem} memory: throughput")
        row[1].set_xticks([k + 0.4 - width / 2 for k in range(len(lat))], lat)
        row[1].set_yscale("log")
        row[1].set_ylabel("p50 µs")
        row[1].set_title(f"{mem} memory: latency")
        row[0].legend(fontsize=8)
    fig.suptitle(f"compare_peers: {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def machine() -> str:
    model = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    desc = f"{socket.gethostname()}, {model}, {os.cpu_count()} cores"
    import torch

    if torch.cuda.is_available():
        desc += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return desc


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mem", nargs="+", choices=("gpu", "cpu"), default=None,
                    help="paths to run (default: gpu and cpu with a GPU, cpu without)")
    ap.add_argument("--libs", nargs="+", choices=PEERS, default=list(PEERS), help="libraries to compare (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help="small workloads (4 MiB, 1,024 x 16 KiB, 512 x 4 KiB) for tests")
    ap.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                    help="run only these workloads, in this order (default: all; names as in the table)")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed calls per throughput workload (default: ~4 GB moved, 5..50)")
    ap.add_argument("--lat-samples", type=int, default=1000,
                    help="4 KiB reads timed for the latency distribution (default: 1000)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per workload (default: 3)")
    ap.add_argument("--device", type=int, default=0, help="GPU of both processes (default: 0)")
    ap.add_argument("--mooncake-gpu-protocol", default="rdma",
                    help="Mooncake's protocol argument on GPU memory; MC_INTRANODE_NVLINK=1 picks the intra-node "
                    "NVLink transport whatever it says (default: rdma, as Mooncake's own intra-NVLink check passes)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one library's run may take (default: 300)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", help="write the report (JSON) here")
    ap.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    ap.add_argument("--markdown", help="write the markdown table here")
    ap.add_argument("--from-json", metavar="PATH", help="run nothing: print the table (and --plot) of a saved report")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        return write_outputs(report, args)
    import torch

    mems = args.mem or (["gpu", "cpu"] if torch.cuda.is_available() else ["cpu"])
    workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    if args.workloads:
        known = {w[0]: w for w in workloads}
        unknown = [n for n in args.workloads if n not in known]
        if unknown:
            ap.error(f"--workloads: unknown {', '.join(unknown)}; these are: {', '.join(known)}")
        workloads = [known[n] for n in args.workloads]
    cfg = dict(workloads=workloads, buffer_bytes=max(seg * n for _, seg, n, _ in workloads), seed=args.seed,
               iters=args.iters, lat_samples=args.lat_samples, warmup=args.warmup, device=args.device,
               mooncake_gpu_protocol=args.mooncake_gpu_protocol, timeout=args.timeout)
    report = dict(benchmark="compare_peers", op="read", machine=machine(), torch=torch.__version__,
                  python=platform.python_version(),
                  timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python benchmarks/compare_peers.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  mem_types=mems, workloads=workloads, baseline=BASELINE, results=[])
    for mem in mems:
        libs = list(args.libs) + (["socket"] if mem == "cpu" else []) + ["torch_copy", "torch_gather"]
        for lib in libs:
            print(f"== {lib} ({mem}): {PATH[(lib, mem)]}", file=sys.stderr, flush=True)
            rec = run_library(lib, mem, cfg)
            report["results"].append(rec)
            if rec["status"] != "ok":
                last = rec.get("detail", "").strip().splitlines()[-1] if rec.get("detail") else ""
                print(f"   {rec['status']}: {last}", file=sys.stderr, flush=True)
    add_ratios(report["results"])
    return write_outputs(report, args)


def write_outputs(report: dict, args) -> int:
    table = markdown(report)
    print(table)
    if args.json and not args.from_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.plot:
        note = plot(report, args.plot)
        if note:
            print(f"compare_peers: {note}", file=sys.stderr)
    # Exit status: 1 when a library that ran moved wrong bytes or failed; peers
    # that are not installed or cannot run here (e.g. no GPU) are not failures.
    bad = [r for r in report["results"] if r["status"] == "error"
           or any(not w["verified"] for w in r.get("workloads", []))]
    for r in bad:
        print(f"compare_peers: {r['library']} ({r['mem']}) "
              + ("failed" if r["status"] == "error" else "moved wrong bytes"), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
