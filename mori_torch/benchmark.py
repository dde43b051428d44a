"""Point-to-point transfer benchmark for mori_torch, with MORI-IO's benchmark flags.

Runs an initiator (this process) and a target (a spawned process) on one
machine. The target creates an engine with the chosen backend, registers a
buffer and hands its packed EngineDesc/MemoryDesc to the initiator through a
multiprocessing Pipe; the initiator registers its own buffer and times
transfers into (write) or out of (read) the target's buffer.

Backends: tcp (host or GPU memory), rdma (verbs; needs an RDMA device), xgmi
(GPU peers: GPU memory in both processes, the target on cuda:1 when there are
two GPUs, else both on cuda:0; needs a GPU).

Every case is measured against a baseline taken in the same run:
- tcp and rdma: a plain socket loopback between the same two processes and
  the same buffers, moving the same bytes per iteration over the same number
  of TCP connections (one Python thread per connection; sendall/recv_into on
  memoryviews release the GIL), with the same request/response shape as the
  engine (write: data then a 1-byte acknowledgement; read: a 1-byte request
  then the data);
- xgmi: torch copy_ of the same bytes between the same two GPUs, in the
  initiator process (the speed of the memory or the link).

    python -m mori_torch.benchmark --op-type write --buffer-size 64M \\
        --transfer-batch-size 1 --enable-sess --iters 20

Flags follow MORI-IO's tests/python/io/benchmark.py (--buffer-size,
--transfer-batch-size, --enable-batch-transfer, --enable-sess, --all,
--num-qp-per-transfer) plus later ones (--backend, --op-type, --all-batch,
--mem-type, --iters, --warmup) and mori_torch's own (--num-data-conns,
--shuffle, --json, --no-baseline, ...). Without --enable-batch-transfer an
iteration issues --transfer-batch-size separate read/write calls and waits for
all of them, as MORI-IO's benchmark does; with it, one batch call carries all
segments.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import re
import socket
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

ALL_BACKENDS = ("tcp", "rdma", "xgmi")
# The engine's default TcpBackendConfig.striping_threshold_bytes: transfers of
# at least this many bytes are striped across the data connections.
STRIPING_THRESHOLD = 64 * KiB
SOCK_BUF_BYTES = 32 * MiB
PIPE_TIMEOUT_S = 600.0


class BenchError(Exception):
    """A failure reported to the user as one line, without a traceback;
    ``exit_code`` is the command's exit status (2: a usage error)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8', '16K', '64M', '1G', '64KiB', '4kb' -> bytes (K, M, G, T are binary)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use e.g. 4096, 16K, 64M, 1G)")
    n = int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}[m.group(2).lower()]
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return v


def _config_int(scope: str, name: str):
    """An argparse type: an integer in the range the configuration table
    declares for ``scope.name``."""

    def parse(text: str) -> int:
        from mori_torch import config

        e = config.lookup(scope, name)
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not e.minimum <= v <= e.maximum:
            raise argparse.ArgumentTypeError(f"{scope}.{name} must be in [{e.minimum}, {e.maximum}], got {v}")
        return v

    return parse


def fmt_size(n: int) -> str:
    """Compact binary size: 8, 512, 16K, 64M, 1.5M."""
    for unit, div in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mori_torch.benchmark",
        description="Benchmark mori_torch transfers between two processes on this machine, "
        "each figure next to a baseline measured in the same run (socket loopback; torch copy_ for xgmi).",
    )
    g = p.add_argument_group("MORI-IO benchmark flags")
    g.add_argument("--backend", choices=ALL_BACKENDS, default="tcp",
                   help="transfer backend: tcp, rdma (needs an RDMA device) or xgmi (GPU peers; needs a GPU)"
                   " (default: tcp)")
    g.add_argument("--op-type", choices=("read", "write", "both"), default="read",
                   help="read: remote -> local; write: local -> remote; both: read cases then write cases"
                   " (default: read)")
    g.add_argument("--buffer-size", type=parse_size, default=32 * KiB,
                   help="bytes per segment; suffixes K, M, G allowed (default: 32K)")
    g.add_argument("--transfer-batch-size", type=_positive_int, default=None,
                   help="segments per iteration (default: 256, or as many as fit in --max-buffer)")
    g.add_argument("--enable-batch-transfer", action="store_true",
                   help="one batch_read/batch_write call per iteration instead of one call per segment")
    g.add_argument("--enable-sess", action="store_true", help="use an IOEngineSession instead of engine-level calls")
    g.add_argument("--all", action="store_true", help="sweep segment sizes from 8 B to 64 MiB (see --sweep-step)")
    g.add_argument("--all-batch", action="store_true", help="sweep batch sizes 1, 2, 4, ..., 4096")
    g.add_argument("--num-qp-per-transfer", type=_positive_int, default=1,
                   help="RDMA queue pairs per transfer (accepted for compatibility; used by the rdma backend)")
    g.add_argument("--mem-type", choices=("cpu", "gpu"), default=None,
                   help="where the buffers live (default: gpu with --backend xgmi, else cpu)")
    g.add_argument("--iters", type=_positive_int, default=None,
                   help="timed iterations per case (default: auto: about 2 GB moved per case, 10..200; "
                        "xgmi: about 64 GB, 20..500)")
    g.add_argument("--warmup", type=_nonneg_int, default=2, help="untimed iterations per case (default: 2)")

    m = p.add_argument_group("mori_torch options")
    m.add_argument("--num-data-conns", type=_positive_int, default=8,
                   help="TcpBackendConfig.num_data_conns, also the baseline's connection limit (default: 8)")
    m.add_argument("--staging-chunk-bytes", type=parse_size, default=None,
                   help="TcpBackendConfig.staging_chunk_bytes (GPU memory over TCP; default: the config's)")
    m.add_argument("--staging-depth", type=_positive_int, default=None,
                   help="TcpBackendConfig.staging_depth (GPU memory over TCP; default: the config's)")
    m.add_argument("--shuffle", action="store_true",
                   help="permute the remote offsets (no two segments adjacent) so segments cannot merge")
    m.add_argument("--sweep-step", type=int, choices=(2, 4), default=2,
                   help="ratio between consecutive sizes of --all (default: 2)")
    m.add_argument("--rounds", type=_positive_int, default=1,
                   help="split the timed iterations into this many alternating engine/baseline blocks, "
                   "so that load changes on the machine hit both alike (default: 1)")
    m.add_argument("--no-notification", action="store_true",
                   help="TcpBackendConfig.enable_notification=False (default: notifications on, as in MORI-IO)")
    m.add_argument("--notice-delay-us", type=_config_int("TcpBackendConfig", "notice_delay_us"), default=None,
                   help="TcpBackendConfig.notice_delay_us: how long a read's completion notice may wait to ride "
                   "on the next request (0: sent at once; default: the config's, -1: held where the event "
                   "loops spin)")
    m.add_argument("--no-baseline", action="store_true", help="skip the baseline")
    m.add_argument("--copy-baseline", choices=("local", "peer"), default="local",
                   help="xgmi: what the torch copy_ baseline copies to and from: local = a second tensor that "
                   "this process allocates on the target's GPU (default); peer = the target process's own "
                   "buffer, the memory mori_torch moves to and from, opened here through torch's CUDA IPC "
                   "(torch.multiprocessing), as two processes sharing tensors with torch would copy")
    m.add_argument("--baseline-conns", type=_positive_int, default=None,
                   help="force the baseline's connection count (default: the engine's stripe count, "
                   "min(num_data_conns, ceil(total / 64 KiB)), 1 below 64 KiB)")
    m.add_argument("--max-buffer", type=parse_size, default=2 * GiB,
                   help="largest buffer per process; bigger cases are skipped (default: 2G)")
    m.add_argument("--host", default="127.0.0.1", help="address both engines bind (default: 127.0.0.1)")
    m.add_argument("--json", metavar="PATH", default=None, help="write one JSON record per case to PATH")
    m.add_argument("--json-append", action="store_true", help="append to the JSON list already in PATH")
    m.add_argument("--seed", type=int, default=1234, help="seed of the data pattern and the shuffle")
    m.add_argument("--quiet", action="store_true", help="print only the table")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.notice_delay_us is not None and args.backend != "tcp":
        raise BenchError(f"--notice-delay-us is a TcpBackendConfig setting: it needs --backend tcp, "
                         f"not {args.backend}")
    if args.mem_type is None:
        args.mem_type = "gpu" if args.backend == "xgmi" else "cpu"
    if args.backend == "xgmi" and args.mem_type != "gpu":
        raise BenchError("--backend xgmi moves GPU memory between GPU peers: use --mem-type gpu (or leave it out)")
    if args.mem_type == "gpu":
        import torch

        if not torch.cuda.is_available():
            need = "--backend xgmi" if args.backend == "xgmi" else "--mem-type gpu"
            raise BenchError(f"{need} needs a CUDA/HIP GPU; none is visible")
    if args.copy_baseline == "peer" and args.backend != "xgmi":
        raise BenchError(f"--copy-baseline peer is a torch copy_ between GPU peers: it needs --backend xgmi, "
                         f"not {args.backend}")
    if args.json_append and not args.json:
        raise BenchError("--json-append needs --json PATH")


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    seg: int
    n: int

    @property
    def total(self) -> int:
        return self.seg * self.n


def make_cases(args) -> Tuple[List[Case], List[Case]]:
    """(cases to run, cases skipped for --max-buffer)."""
    if args.all:
        sizes, s = [], 8
        while s <= 64 * MiB:
            sizes.append(s)
            s *= args.sweep_step
        if sizes[-1] != 64 * MiB:
            sizes.append(64 * MiB)
    else:
        sizes = [args.buffer_size]
    if args.all_batch:
        batches = [1 << i for i in range(13)]
    elif args.transfer_batch_size is not None:
        batches = [args.transfer_batch_size]
    else:
        batches = [None]  # MORI-IO's 256, or fewer where 256 segments exceed --max-buffer
    ops = ["read", "write"] if args.op_type == "both" else [args.op_type]
    run, skipped = [], []
    for op in ops:
        for n in batches:
            for seg in sizes:
                c = Case(op, seg, n if n is not None else default_batch(seg, args.max_buffer))
                (run if c.total <= args.max_buffer else skipped).append(c)
    return run, skipped


DEFAULT_BATCH = 256


def default_batch(seg: int, max_buffer: int) -> int:
    """MORI-IO's default of 256 segments per iteration, capped to what fits in
    --max-buffer (64M segments: 32 under the default 2G)."""
    return max(1, min(DEFAULT_BATCH, max_buffer // max(seg, 1)))


def auto_iters(total: int, backend: str = "tcp") -> int:
    """Timed iterations of a case moving `total` bytes: about 2 GB over TCP
    and RDMA (10..200); about 64 GB over XGMI (20..500), where a case takes
    microseconds and a few dozen samples leave its mean to a host stall or two."""
    if backend == "xgmi":
        return int(min(500, max(20, 64e9 // max(total, 1))))
    return int(min(200, max(10, 2e9 // max(total, 1))))


def machine_info() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{socket.gethostname()}, {model}, {os.cpu_count()} cores"


def engine_stripes(total: int, nconns: int) -> int:
    """How many connections the TCP backend stripes one transfer of `total` bytes over."""
    if total >= STRIPING_THRESHOLD and nconns > 1:
        return int(min(nconns, -(-total // STRIPING_THRESHOLD)))
    return 1


def make_offsets(case: Case, shuffle: bool, seed: int) -> Tuple[List[int], List[int]]:
    """Local offsets are contiguous; remote ones optionally permuted so no two
    consecutive segments are adjacent on the remote side (nothing can merge)."""
    idx = list(range(case.n))
    if shuffle and case.n > 1:
        rng = random.Random(seed)
        rng.shuffle(idx)
        for _ in range(100):  # break up the few accidental i, i+1 neighbours
            bad = [i for i in range(case.n - 1) if idx[i + 1] == idx[i] + 1]
            if not bad:
                break
            for i in bad:
                j = rng.randrange(case.n)
                idx[i + 1], idx[j] = idx[j], idx[i + 1]
        if case.n == 2 and idx == [0, 1]:
            idx = [1, 0]
    local = [i * case.seg for i in range(case.n)]
    remote = [i * case.seg for i in idx]
    return local, remote


def tensor_view(t) -> memoryview:
    """A writable byte memoryview over a contiguous uint8 CPU tensor."""
    n = t.numel()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def digest(mv: memoryview, offsets: Sequence[int], seg: int) -> str:
    """Hash of the segments at `offsets`, in order (contiguous runs hashed at once)."""
    h = hashlib.blake2b(digest_size=16)
    i, n = 0, len(offsets)
    while i < n:
        j = i + 1
        while j < n and offsets[j] == offsets[j - 1] + seg:
            j += 1
        h.update(mv[offsets[i] : offsets[j - 1] + seg])
        i = j
    return h.hexdigest()


class BenchBuffer:
    """The registered buffer (on `device` with --mem-type gpu) and its host
    side: the socket baseline moves host memory, and data checks hash a host
    copy of GPU bytes."""

    def __init__(self, nbytes: int, gpu: bool, device: str = "cuda:0"):
        import torch

        self.gpu = gpu
        self.mem = torch.empty(nbytes, dtype=torch.uint8, device=device if gpu else "cpu")
        self.host = torch.empty(nbytes, dtype=torch.uint8) if gpu else self.mem
        self.mv = tensor_view(self.host)

    def fill(self, kind: str, seed: int, nbytes: int) -> None:
        fill(self.host, kind, seed, nbytes)
        if self.gpu:
            import torch

            self.mem[:nbytes].copy_(self.host[:nbytes])
            torch.cuda.synchronize(self.mem.device)

    def digest(self, offsets: Sequence[int], seg: int) -> str:
        if self.gpu:
            import torch

            self.host.copy_(self.mem)
            torch.cuda.synchronize(self.mem.device)
        return digest(self.mv, offsets, seg)


def fill(t, kind: str, seed: int, nbytes: int) -> None:
    import torch

    v = t[:nbytes]
    if kind == "zero":
        v.zero_()
    else:
        g = torch.Generator().manual_seed(seed)
        v.random_(0, 256, generator=g)


def percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile of sorted values."""
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def summarize(total: int, lat_ns: Sequence[int]) -> Dict[str, float]:
    s = sorted(lat_ns)
    mean = sum(s) / len(s)
    return {
        "gbps": total / mean,  # bytes per ns == GB/s (1e9 B/s)
        "mean_us": mean / 1e3,
        "p50_us": percentile(s, 50) / 1e3,
        "p99_us": percentile(s, 99) / 1e3,
        "min_us": s[0] / 1e3,
    }


# --------------------------------------------------------------------------
# Socket baseline (both sides)
# --------------------------------------------------------------------------


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF_BYTES)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        k = sock.recv_into(view)
        if k == 0:
            raise ConnectionError("baseline peer closed the connection")
        view = view[k:]


def split_parts(total: int, nparts: int) -> List[Tuple[int, int]]:
    """(offset, length) of `nparts` contiguous chunks covering [0, total)."""
    per = -(-total // nparts)
    parts, off = [], 0
    while off < total:
        ln = min(per, total - off)
        parts.append((off, ln))
        off += ln
    return parts


def _baseline_serve(sock, mv, op, off, ln, iters, errors):
    """Target side of one baseline connection for `iters` iterations."""
    try:
        ack = b"\x01"
        one = bytearray(1)
        chunk = mv[off : off + ln]
        for _ in range(iters):
            if op == "write":
                _recv_exact(sock, chunk)
                sock.sendall(ack)
            else:
                _recv_exact(sock, memoryview(one))
                sock.sendall(chunk)
    except Exception as e:  # reported to the initiator
        errors.append(f"{type(e).__name__}: {e}")


def run_baseline_initiator(socks, mv, op, parts, iters) -> List[int]:
    """Initiator side: times `iters` iterations; helper threads drive parts 1..n-1."""
    n = len(parts)
    ack = bytearray(1)
    req = b"\x01"

    def do(i: int) -> None:
        off, ln = parts[i]
        s = socks[i]
        if op == "write":
            s.sendall(mv[off : off + ln])
            _recv_exact(s, memoryview(ack))
        else:
            s.sendall(req)
            _recv_exact(s, mv[off : off + ln])

    lat: List[int] = []
    if n == 1:
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            do(0)
            lat.append(time.perf_counter_ns() - t0)
        return lat

    # Helper i waits on go[i] and releases done[i]: plain locks, acquired and
    # released in C with the GIL dropped, so the per-iteration hand-off costs
    # two futex wake-ups per helper and no Python-level condition variables.
    go = [threading.Lock() for _ in range(n)]
    done = [threading.Lock() for _ in range(n)]
    for lk in go + done:
        lk.acquire()
    errors: List[str] = []
    stop = [False]

    def helper(i: int) -> None:
        while True:
            go[i].acquire()
            if stop[0]:
                return
            try:
                do(i)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                stop[0] = True
            done[i].release()  # also after an error: the main thread never waits forever
            if stop[0]:
                return

    threads = [threading.Thread(target=helper, args=(i,), daemon=True) for i in range(1, n)]
    for t in threads:
        t.start()
    try:
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            for i in range(1, n):
                go[i].release()
            do(0)
            for i in range(1, n):
                done[i].acquire()
            lat.append(time.perf_counter_ns() - t0)
            if errors:
                break
    finally:
        stop[0] = True
        for i in range(1, n):
            if go[i].locked():
                go[i].release()
        for t in threads:
            t.join(5)
    if errors:
        raise BenchError("baseline failed: " + errors[0])
    return lat


# --------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------


def tcp_notice_delay_us(args) -> Optional[int]:
    """TcpBackendConfig.notice_delay_us as configured (-1: the default's
    choice by the event loops), None for the other backends."""
    if args.backend != "tcp":
        return None
    from mori_torch import config

    return args.notice_delay_us if args.notice_delay_us is not None else config.lookup(
        "TcpBackendConfig", "notice_delay_us").default


def backend_config(args) -> dict:
    """The backend's config fields from the flags (picklable: the target gets it too)."""
    if args.backend == "tcp":
        cfg = dict(num_data_conns=args.num_data_conns, enable_notification=not args.no_notification)
        if args.staging_chunk_bytes is not None:
            cfg["staging_chunk_bytes"] = args.staging_chunk_bytes
        if args.staging_depth is not None:
            cfg["staging_depth"] = args.staging_depth
        if args.notice_delay_us is not None:
            cfg["notice_delay_us"] = args.notice_delay_us
        return cfg
    if args.backend == "rdma":
        return dict(qp_per_transfer=args.num_qp_per_transfer, enable_notification=not args.no_notification)
    return {}


def create_backend(io, engine, backend: str, cfg: dict) -> None:
    kind = {"tcp": (io.BackendType.TCP, io.TcpBackendConfig), "rdma": (io.BackendType.RDMA, io.RdmaBackendConfig),
            "xgmi": (io.BackendType.XGMI, io.XgmiBackendConfig)}[backend]
    engine.create_backend(kind[0], kind[1](**cfg))


def gpu_devices(backend: str) -> Tuple[str, str]:
    """(initiator's, target's) GPU: GPU peers use two GPUs where there are two."""
    import torch

    if backend == "xgmi" and torch.cuda.device_count() >= 2:
        return "cuda:0", "cuda:1"
    return "cuda:0", "cuda:0"


# --------------------------------------------------------------------------
# Target process
# --------------------------------------------------------------------------


def _target_main(conn, cfg: dict) -> None:
    """Entry point of the spawned target process: serves commands from the Pipe."""
    engine = None
    lsock = None
    socks: List[socket.socket] = []
    try:

        from mori_torch import io

        if cfg.get("quiet_log"):
            io.set_log_level("error")
        engine = io.IOEngine(f"bench-target-{os.getpid()}", io.IOEngineConfig(cfg["host"], 0))
        create_backend(io, engine, cfg["backend"], cfg["backend_cfg"])
        buf = BenchBuffer(cfg["buffer_bytes"], cfg["gpu"], cfg["device"])
        mem = engine.register_torch_tensor(buf.mem)
        mv = buf.mv
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _tune(lsock)  # accepted sockets inherit the buffer sizes
        lsock.bind((cfg["host"], 0))
        lsock.listen(64)
        conn.send(("ready", engine.get_engine_desc().pack(), mem.pack(), lsock.getsockname()[1]))

        serve_threads: List[threading.Thread] = []
        serve_errors: List[str] = []
        while True:
            cmd, *a = conn.recv()
            if cmd == "stop":
                conn.send(("ok",))
                break
            elif cmd == "register_remote":
                engine.register_remote_engine(io.EngineDesc.unpack(a[0]))
                conn.send(("ok",))
            elif cmd == "accept":
                for _ in range(a[0]):
                    s, _addr = lsock.accept()
                    _tune(s)
                    socks.append(s)
                conn.send(("ok",))
            elif cmd == "fill":
                kind, seed, nbytes = a
                buf.fill(kind, seed, nbytes)
                conn.send(("ok",))
            elif cmd == "share":
                # The buffer itself: the Pipe pickles a CUDA tensor as a CUDA
                # IPC handle (torch.multiprocessing's reductions).
                conn.send(("ok", buf.mem))
            elif cmd == "digest":
                offsets, seg = a
                conn.send(("ok", buf.digest(offsets, seg)))
            elif cmd == "pop_notices":
                key, uids, timeout_s = a
                deadline = time.monotonic() + timeout_s
                pending = list(uids)
                while pending and time.monotonic() < deadline:
                    pending = [u for u in pending if engine.pop_inbound_transfer_status(key, u) is None]
                    if pending:
                        time.sleep(0.001)
                conn.send(("ok", len(uids) - len(pending)))
            elif cmd == "baseline_start":
                op, parts, iters = a
                serve_errors = []
                serve_threads = [
                    threading.Thread(target=_baseline_serve, args=(socks[i], mv, op, off, ln, iters, serve_errors),
                                     daemon=True)
                    for i, (off, ln) in enumerate(parts)
                ]
                for t in serve_threads:
                    t.start()
                conn.send(("ok",))
            elif cmd == "baseline_join":
                for t in serve_threads:
                    t.join(PIPE_TIMEOUT_S)
                conn.send(("ok", serve_errors[:1]))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    except EOFError:
        pass  # the initiator went away
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        for s in socks:
            s.close()
        if lsock is not None:
            lsock.close()
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass


class Target:
    """The initiator's handle on the target process."""

    def __init__(self, cfg: dict):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(child, cfg), name="mori-bench-target", daemon=True)
        self.proc.start()
        child.close()

    def recv(self, timeout: float = PIPE_TIMEOUT_S):
        if not self.conn.poll(timeout):
            raise BenchError(f"target process did not answer within {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise BenchError(f"target process exited unexpectedly (exit code {self.proc.exitcode})") from None
        if msg[0] == "error":
            raise BenchError("target process failed:\n" + msg[1])
        return msg

    def call(self, *cmd, timeout: float = PIPE_TIMEOUT_S):
        self.conn.send(cmd)
        return self.recv(timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=30)
            except Exception:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


# --------------------------------------------------------------------------
# Initiator
# --------------------------------------------------------------------------


class Initiator:
    def __init__(self, args, buffer_bytes: int):
        import torch

        from mori_torch import io

        self.io = io
        self.args = args
        bcfg = backend_config(args)
        gpu = args.mem_type == "gpu"
        mine, theirs = gpu_devices(args.backend)
        self.engine = None
        self.target = None
        self.socks: List[socket.socket] = []
        self.copy_src = None
        try:
            # The initiator's backend first: a backend that cannot start here
            # (no RDMA device, no GPU) fails with its own message before a
            # target process is spawned.
            self.engine = io.IOEngine(f"bench-initiator-{os.getpid()}", io.IOEngineConfig(args.host, 0))
            try:
                create_backend(io, self.engine, args.backend, bcfg)
            except RuntimeError as e:
                raise BenchError(f"--backend {args.backend} cannot start on this machine: {e}") from None
            self.target = Target(dict(host=args.host, backend=args.backend, backend_cfg=bcfg, buffer_bytes=buffer_bytes,
                                      quiet_log=False, gpu=gpu, device=theirs))
            _, eng_desc, mem_desc, bport = self.target.recv(120)
            self.buf = BenchBuffer(buffer_bytes, gpu, mine)
            self.mem = self.engine.register_torch_tensor(self.buf.mem)
            self.mv = self.buf.mv
            self.remote_engine = io.EngineDesc.unpack(eng_desc)
            self.remote_mem = io.MemoryDesc.unpack(mem_desc)
            self.engine.register_remote_engine(self.remote_engine)
            self.target.call("register_remote", self.engine.get_engine_desc().pack())
            self.sess = self.engine.create_session(self.mem, self.remote_mem)
            if self.sess is None:
                raise BenchError("create_session returned None: no backend can serve this memory pair")
            if not args.no_baseline and args.backend == "xgmi":
                # torch copy_ between the same two GPUs: to and from the target
                # process's buffer, opened here by CUDA IPC (peer), or a tensor here.
                self.copy_src = (self.target.call("share")[1] if args.copy_baseline == "peer"
                                 else torch.empty(buffer_bytes, dtype=torch.uint8, device=theirs))
            elif not args.no_baseline:
                nb = args.baseline_conns or args.num_data_conns
                self.target.conn.send(("accept", nb))
                for _ in range(nb):
                    s = socket.create_connection((args.host, bport))
                    _tune(s)
                    self.socks.append(s)
                self.target.recv()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception:
                pass
            self.engine = None
        if self.target is not None:
            self.target.close()

    # -- engine transfers -------------------------------------------------

    def _submitter(self, case: Case, loffs, roffs, sizes):
        """A call that submits the case's transfers (allocating their uids, as
        a user does) and returns (statuses, uids); what it calls is looked up
        here, once, so that timing it times the library, not this harness."""
        a = self.args
        write = case.op == "write"
        if a.enable_batch_transfer:
            if a.enable_sess:
                fn = self.sess.batch_write if write else self.sess.batch_read
                alloc = self.sess.allocate_transfer_uid

                def session_batch():
                    uid = alloc()
                    return [fn(loffs, roffs, sizes, uid)], [uid]

                return session_batch
            fn = self.engine.batch_write if write else self.engine.batch_read
            alloc = self.engine.allocate_transfer_uid
            mems, rmems, lo, ro, sz = [self.mem], [self.remote_mem], [loffs], [roffs], [sizes]

            def engine_batch():
                uids = [alloc()]
                return fn(mems, lo, rmems, ro, sz, uids), uids

            return engine_batch
        # Each transfer's arguments but its uid, built here once.
        if a.enable_sess:
            fn = self.sess.write if write else self.sess.read
            alloc = self.sess.allocate_transfer_uid
            calls = [(lo, ro, case.seg) for lo, ro in zip(loffs, roffs)]
        else:
            fn = self.engine.write if write else self.engine.read
            alloc = self.engine.allocate_transfer_uid
            calls = [(self.mem, lo, self.remote_mem, ro, case.seg) for lo, ro in zip(loffs, roffs)]
        if len(calls) == 1:
            # One transfer per iteration (a 64 MiB segment): no list
            # building around it, which cost about a microsecond, 1.5% of a
            # 64 MiB copy on one GPU, that the baseline does not pay.
            (one,) = calls

            def single():
                uid = alloc()
                return [fn(*one, uid)], [uid]

            return single

        def singles():
            uids = [alloc() for _ in calls]
            return [fn(*c, uid) for c, uid in zip(calls, uids)], uids

        return singles

    @staticmethod
    def _check(sts) -> None:
        for s in sts:
            if not s.Succeeded():
                raise BenchError(f"transfer failed: {s.Code().name}: {s.Message()}")

    def verify_and_warm(self, case: Case, loffs, roffs, warmup: int) -> bool:
        sizes = [case.seg] * case.n
        # Verification: pattern in the source, zeros in the destination, one
        # transfer, then both sides hash the segments in order.
        seed = self.args.seed + case.seg * 7919 + case.n
        src_local = case.op == "write"
        self.buf.fill("random" if src_local else "zero", seed, case.total)
        span = max(roffs) + case.seg
        self.target.call("fill", "zero" if src_local else "random", seed + 1, span)
        sts, uids = self._submitter(case, loffs, roffs, sizes)()
        for s in sts:
            s.Wait()
        self._check(sts)
        mine = self.buf.digest(loffs, case.seg)
        _, theirs = self.target.call("digest", roffs, case.seg)
        if mine != theirs:
            raise BenchError(
                f"data check failed for {case.op} {case.n} x {case.seg} B: destination bytes differ from the source"
            )
        if not self.args.no_notification and self.args.backend != "xgmi":  # XGMI has no notices
            # The target records a write's notice right after answering it and
            # a read's when the initiator's notice message arrives: both may
            # trail Wait() a little, hence the target polls for them. A read's
            # notice may also wait notice_delay_us for a next request, and
            # none follows while the target polls.
            wait_s = 10.0 + max(tcp_notice_delay_us(self.args) or 0, 0) / 1e6
            _, popped = self.target.call("pop_notices", self.engine.key, uids, wait_s)
            if popped != len(uids):
                raise BenchError(f"target saw {popped} of {len(uids)} completion notices"
                                 f" for {case.op} {case.n} x {case.seg} B")

        self.engine_iters(case, loffs, roffs, warmup)
        return True

    def engine_iters(self, case: Case, loffs, roffs, iters: int) -> List[int]:
        """Times `iters` transfers: submit to the return of the last Wait()."""
        sizes = [case.seg] * case.n
        lat: List[int] = []
        pc = time.perf_counter_ns
        submit = self._submitter(case, loffs, roffs, sizes)
        for _ in range(iters):
            t0 = pc()
            sts, _ = submit()
            for s in sts:
                s.Wait()
            t1 = pc()
            self._check(sts)
            lat.append(t1 - t0)
        return lat

    # -- baseline ---------------------------------------------------------

    def baseline_parts(self, case: Case) -> List[Tuple[int, int]]:
        nconns = self.args.baseline_conns or engine_stripes(case.total, self.args.num_data_conns)
        return split_parts(case.total, min(nconns, len(self.socks)))

    def baseline_iters(self, case: Case, iters: int, warmup: int) -> List[int]:
        """Times `warmup + iters` baseline iterations and returns the last `iters`."""
        if self.copy_src is not None:
            return self.copy_iters(case, iters, warmup)
        parts = self.baseline_parts(case)
        self.target.call("baseline_start", case.op, parts, iters + warmup)
        try:
            lat = run_baseline_initiator(self.socks, self.mv, case.op, parts, iters + warmup)
        finally:
            _, errs = self.target.call("baseline_join")
        if errs:
            raise BenchError("baseline target failed: " + errs[0])
        return lat[warmup:]

    def copy_iters(self, case: Case, iters: int, warmup: int) -> List[int]:
        """torch copy_ of the case's bytes between the two GPUs, synchronized per iteration."""
        import torch

        here, there = self.buf.mem[: case.total], self.copy_src[: case.total]
        dst, src = (there, here) if case.op == "write" else (here, there)
        lat: List[int] = []
        pc = time.perf_counter_ns
        for _ in range(iters + warmup):
            t0 = pc()
            dst.copy_(src)
            torch.cuda.synchronize(dst.device)
            lat.append(pc() - t0)
        return lat[warmup:]


def baseline_kind(args) -> str:
    if args.backend != "xgmi":
        return "socket_loopback"
    return "torch_copy_peer" if args.copy_baseline == "peer" else "torch_copy"


def baseline_description(args) -> str:
    if args.backend == "xgmi":
        a, b = gpu_devices(args.backend)
        there = ("the target process's buffer on " + b + " (CUDA IPC, as torch.multiprocessing shares it)"
                 if args.copy_baseline == "peer" else b)
        return (f"torch copy_ of the same bytes between {there} and {a} in this run (the memory's or the link's "
                "speed); ratio = mori_torch GB/s / copy_ GB/s (1.0 = as fast as copy_)")
    return ("plain TCP sockets moving the same bytes between the same two processes over as many "
            "connections, in this run; ratio = mori_torch GB/s / baseline GB/s (1.0 = as fast as raw sockets)")


def print_table(rows: List[dict], file=sys.stdout) -> None:
    cols = [
        ("op", lambda r: r["op"]),
        ("mem", lambda r: r["mem"]),
        ("seg bytes", lambda r: fmt_size(r["segment_bytes"])),
        ("segments", lambda r: str(r["segments"])),
        ("total", lambda r: fmt_size(r["total_bytes"])),
        ("GB/s", lambda r: f"{r['gbps']:.3f}"),
        ("p50 us", lambda r: f"{r['p50_us']:.1f}"),
        ("p99 us", lambda r: f"{r['p99_us']:.1f}"),
        ("baseline GB/s", lambda r: "-" if r["baseline_gbps"] is None else f"{r['baseline_gbps']:.3f}"),
        ("ratio", lambda r: "-" if r["ratio"] is None else f"{r['ratio']:.2f}"),
        ("p50 ratio", lambda r: "-" if r.get("ratio_p50") is None else f"{r['ratio_p50']:.2f}"),
    ]
    cells = [[f(r) for _, f in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _) in enumerate(cols)]
    line = "  ".join(h.rjust(w) for (h, _), w in zip(cols, widths))
    print(line, file=file)
    print("-" * len(line), file=file)
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)), file=file)
    file.flush()


def run(args, argv: Sequence[str]) -> List[dict]:
    cases, skipped = make_cases(args)
    if not cases:
        raise BenchError(f"every case needs more than --max-buffer={fmt_size(args.max_buffer)} per process")
    buffer_bytes = max(c.total for c in cases)
    machine = machine_info()
    mode = "batch" if args.enable_batch_transfer else "single"
    api = "session" if args.enable_sess else "engine"
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, file=sys.stderr, flush=True))
    log(
        f"mori_torch benchmark: backend={args.backend} mem={args.mem_type} api={api} mode={mode} "
        f"num_data_conns={args.num_data_conns} shuffle={args.shuffle} notifications={not args.no_notification}"
    )
    log(f"machine: {machine}; buffer {fmt_size(buffer_bytes)} per process; {len(cases)} case(s)")
    for c in skipped:
        log(f"skipped {c.op} {c.n} x {fmt_size(c.seg)}: needs {fmt_size(c.total)}"
            f" > --max-buffer {fmt_size(args.max_buffer)}")
    if not args.no_baseline:
        log("baseline: " + baseline_description(args))
    if args.transfer_batch_size is None and not args.all_batch:
        for seg in sorted({c.seg for c in cases if c.n < DEFAULT_BATCH}):
            log(f"{fmt_size(seg)} segments: {default_batch(seg, args.max_buffer)} per iteration, not "
                f"{DEFAULT_BATCH}, to stay within --max-buffer {fmt_size(args.max_buffer)} (set --transfer-batch-size)")

    records: List[dict] = []
    init = Initiator(args, buffer_bytes)
    try:
        for case in cases:
            iters = args.iters or auto_iters(case.total, args.backend)
            loffs, roffs = make_offsets(case, args.shuffle, args.seed + case.n)
            verified = init.verify_and_warm(case, loffs, roffs, args.warmup)
            # Engine and baseline alternate in --rounds blocks so that drift
            # (other load on the machine) hits both alike.
            rounds = max(1, min(args.rounds, iters))
            lat: List[int] = []
            blat: List[int] = []
            for r in range(rounds):
                k = iters // rounds + (1 if r < iters % rounds else 0)
                lat += init.engine_iters(case, loffs, roffs, k)
                if not args.no_baseline:
                    blat += init.baseline_iters(case, k, args.warmup if r == 0 else 1)
            eng = summarize(case.total, lat)
            rec = dict(
                backend=args.backend,
                op=case.op,
                mem=args.mem_type,
                segment_bytes=case.seg,
                segments=case.n,
                total_bytes=case.total,
                gbps=eng["gbps"],
                p50_us=eng["p50_us"],
                p99_us=eng["p99_us"],
                mean_us=eng["mean_us"],
                min_us=eng["min_us"],
                baseline=None,
                baseline_gbps=None,
                ratio=None,
                ratio_p50=None,
                iters=iters,
                warmup=args.warmup,
                rounds=rounds,
                num_data_conns=args.num_data_conns,
                sess=bool(args.enable_sess),
                batch=bool(args.enable_batch_transfer),
                shuffle=bool(args.shuffle),
                notifications=not args.no_notification and args.backend != "xgmi",
                notice_delay_us=tcp_notice_delay_us(args),
                engine_stripes=engine_stripes(case.total, args.num_data_conns)
                if args.backend == "tcp" and (args.enable_batch_transfer or case.n == 1) else None,
                verified=verified,
                machine=machine,
                command=list(argv),
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            )
            if not args.no_baseline:
                base = summarize(case.total, blat)
                rec["baseline"] = dict(
                    kind=baseline_kind(args),
                    conns=None if init.copy_src is not None else len(init.baseline_parts(case)),
                    p50_us=base["p50_us"],
                    p99_us=base["p99_us"],
                    mean_us=base["mean_us"],
                )
                rec["baseline_gbps"] = base["gbps"]
                rec["ratio"] = eng["gbps"] / base["gbps"]
                # The same comparison by medians: GB/s comes from the mean,
                # which a few host stalls on either side can move by a few
                # percent when a case takes tens of microseconds.
                rec["ratio_p50"] = base["p50_us"] / eng["p50_us"]
            records.append(rec)
            log(
                f"  {case.op} {case.n} x {fmt_size(case.seg)}: {rec['gbps']:.3f} GB/s"
                + ("" if rec["ratio"] is None
                   else f", baseline {rec['baseline_gbps']:.3f} GB/s, ratio {rec['ratio']:.2f}")
            )
    finally:
        init.close()
    return records


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = "mori_torch.benchmark"
    try:
        check_args(args)
        records = run(args, [prog] + argv)
    except BenchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:  # raised by the engine (e.g. create_backend, register_*)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    print_table(records)
    if args.json:
        out = records
        if args.json_append and os.path.exists(args.json):
            with open(args.json) as f:
                out = json.load(f) + records
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
