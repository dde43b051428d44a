"""Host cost of submitting a batch from the forms serving engines pass
(issue #14, "Python lists"): Python lists (vLLM, SGLang), tuples, numpy
arrays and int64 tensors, for a session batch and for the engine-level
multi-pair batch SGLang uses. Two engines in this process, TCP over
loopback on host memory (any machine), or XGMI on cuda:0 (--backend xgmi).

Host cost = the time the submitting call takes (not the transfer), per
segment, median over repeats; the same batch as int64 tensors is the
baseline of the same run. Each row also gives the minor page faults per
call (memory that the kernel maps in again on every call shows there).
Bytes are checked once per form. Then where the engine-level batch's extra
cost goes (tensors, uids given: k pairs against one session batch of the
same segments, 1-segment pairs, k uid allocations), and the conversion
of one list alone,
with offsets below 2^30 and past 2^33. Last, one segment's write: the call time
of the engine-level write against the session's, median over 3
alternating rounds; and one poll of a status (`Succeeded()`) through
mori_torch.io against TorchScript's method call.

    python benchmarks/bench_submit.py --json docs/results/submit_cpu.json
"""
import argparse
import itertools
import json
import os
import platform
import random
import resource
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mori_torch.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig, XgmiBackendConfig  # noqa: E402


def forms(lo, ro, sizes):
    return {
        "tensors": tuple(torch.tensor(x, dtype=torch.int64) for x in (lo, ro, sizes)),
        "lists": (lo, ro, sizes),
        "tuples": tuple(tuple(x) for x in (lo, ro, sizes)),
        "numpy": tuple(np.asarray(x, dtype=np.int64) for x in (lo, ro, sizes)),
    }


FAULTS = {}  # minor page faults per call of the last timed() run


def timed(fn, repeats):
    times = []
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        st = fn()
        times.append(time.perf_counter_ns() - t0)
        for s in st if isinstance(st, list) else [st]:
            s.Wait()
            assert s.Succeeded(), s.Message()
    FAULTS["last"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / repeats
    return statistics.median(times[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("tcp", "xgmi"), default="tcp")
    ap.add_argument("--segments", type=int, default=16384)
    ap.add_argument("--segment-bytes", type=int, default=4096)
    ap.add_argument("--pairs", type=int, default=8, help="memory pairs of the engine-level batch")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--single-samples", type=int, default=1000, help="samples per round of the single 4 KiB write")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    n, seg = args.segments, args.segment_bytes
    dev = "cuda:0" if args.backend == "xgmi" else "cpu"
    bt = BackendType.XGMI if args.backend == "xgmi" else BackendType.TCP
    cfg = XgmiBackendConfig() if args.backend == "xgmi" else TcpBackendConfig()
    a = IOEngine(f"submit-a-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine(f"submit-b-{os.getpid()}", IOEngineConfig("127.0.0.1", 0))
    for e in (a, b):
        e.create_backend(bt, cfg)
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    src = torch.randint(0, 256, (n * seg,), dtype=torch.uint8, device=dev)
    dst = torch.zeros(n * seg, dtype=torch.uint8, device=dev)
    sd, dd = a.register_torch_tensor(src), b.register_torch_tensor(dst)
    if dev != "cpu":
        torch.cuda.synchronize()  # engine calls are not stream-ordered: the fills end first
    sess = a.create_session(sd, dd)

    perm = list(range(n))
    random.Random(1).shuffle(perm)
    lo = [i * seg for i in range(n)]
    ro = [p * seg for p in perm]
    sizes = [seg] * n
    records = []
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores"

    def record(kind, form, ns, base_ns, segments):
        r = dict(backend=args.backend, kind=kind, form=form, segments=segments, segment_bytes=seg,
                 call_us=ns / 1e3, ns_per_segment=ns / segments, baseline="the same batch as int64 tensors",
                 baseline_ns_per_segment=base_ns / segments, ratio_to_tensors=base_ns / ns,
                 minor_faults_per_call=FAULTS["last"], machine=machine)
        records.append(r)
        print(f"{kind:>7} {form:>19}: {ns / segments:6.1f} ns/segment (tensors {base_ns / segments:.1f}), "
              f"call {ns / 1e3:8.1f} us, {FAULTS['last']:.1f} page faults/call", flush=True)

    # Session batch: one memory pair, n segments.
    base = None
    for form, (lf, rf, sf) in forms(lo, ro, sizes).items():
        dst.zero_()
        if dev != "cpu":
            torch.cuda.synchronize()
        sess.batch_write(lf, rf, sf, sess.allocate_transfer_uid()).Wait()
        assert torch.equal(dst.view(n, seg)[torch.tensor(perm)], src.view(n, seg)), form
        ns = timed(lambda: sess.batch_write(lf, rf, sf, sess.allocate_transfer_uid()), args.repeats)
        base = ns if form == "tensors" else base
        record("session", form, ns, base, n)
    # The path lists took before they were converted in C: TorchScript's List[int].
    ns = timed(lambda: sess._s.batch_write(lo, ro, sizes, sess.allocate_transfer_uid()), args.repeats)
    record("session", "lists via List[int]", ns, base, n)

    # Engine batch: `pairs` memory pairs of n / pairs segments each.
    k = args.pairs
    per = n // k
    base = None
    for form in ("tensors", "lists", "numpy"):
        chunks = [forms(lo[i * per:(i + 1) * per], ro[i * per:(i + 1) * per], sizes[:per])[form] for i in range(k)]
        los, ros, szs = ([c[j] for c in chunks] for j in range(3))
        ns = timed(lambda: a.batch_write([sd] * k, los, [dd] * k, ros, szs,
                                         [a.allocate_transfer_uid() for _ in range(k)]),
                   args.repeats)
        base = ns if form == "tensors" else base
        record("engine", form, ns, base, per * k)

    # Where the engine-level batch's extra host cost goes, with tensors (no
    # list conversion) and uids given: k pairs of n / k segments and of 1
    # segment each, against one session batch of the same segments; and k
    # uid allocations (the batch's callers make one per pair).
    los, ros, szs = ([torch.tensor(x[i * per:(i + 1) * per], dtype=torch.int64) for i in range(k)]
                     for x in (lo, ro, sizes))
    one = [torch.tensor(x[i * per:i * per + 1], dtype=torch.int64) for x in (lo, ro, sizes) for i in range(k)]
    lo1, ro1, sz1 = one[:k], one[k:2 * k], one[2 * k:]
    t_lo, t_ro, t_sz = (torch.tensor(x[:per * k], dtype=torch.int64) for x in (lo, ro, sizes))
    t1 = [torch.tensor([x[i * per] for i in range(k)], dtype=torch.int64) for x in (lo, ro, sizes)]
    fresh = itertools.count(1 << 40)  # uids as a caller would hold them: new ones, not allocated in the call

    def uids():
        return [next(fresh) for _ in range(k)]

    parts = {
        f"engine batch_write, {k} pairs x {per}": lambda: a.batch_write([sd] * k, los, [dd] * k, ros, szs, uids()),
        f"session batch_write, 1 x {per * k}": lambda: sess.batch_write(t_lo, t_ro, t_sz, next(fresh)),
        f"engine batch_write, {k} pairs x 1": lambda: a.batch_write([sd] * k, lo1, [dd] * k, ro1, sz1, uids()),
        f"session batch_write, 1 x {k}": lambda: sess.batch_write(*t1, next(fresh)),
        f"{k} x IOEngine.allocate_transfer_uid": lambda: [a.allocate_transfer_uid() for _ in range(k)] and [],
    }
    part_ns = {form: [] for form in parts}
    for _ in range(3):  # alternating rounds
        for form, fn in parts.items():
            part_ns[form].append(timed(fn, args.repeats))
    base_form = f"session batch_write, 1 x {per * k}"
    base = statistics.median(part_ns[base_form])
    for form, v in part_ns.items():
        ns = statistics.median(v)
        records.append(dict(backend=args.backend, kind="engine part", form=form, call_us=ns / 1e3,
                            baseline=base_form + ", same run", baseline_call_us=base / 1e3, rounds=3, machine=machine))
        print(f"   part {form:>36}: call {ns / 1e3:8.1f} us", flush=True)

    # Reading one list of n offsets into an int64 tensor (what the list forms
    # above pay three times per batch): this buffer's page offsets, and the
    # same pages 2^33 bytes further in, as in a KV cache of tens of GiB (ints
    # of two 30-bit digits); against torch.tensor(list) of the same list.
    from mori_torch._int64s import int64s
    for form, values in (("offsets below 2^30", ro), ("offsets past 2^33", [(1 << 33) + v for v in ro])):
        assert int64s("offsets", values).tolist() == values
        ts, tb = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter_ns()
            int64s("offsets", values)
            t1 = time.perf_counter_ns()
            torch.tensor(values, dtype=torch.int64)
            tb.append(time.perf_counter_ns() - t1)
            ts.append(t1 - t0)
        ns, bns = statistics.median(ts), statistics.median(tb)
        records.append(dict(backend=args.backend, kind="convert", form=form, segments=n, ns_per_entry=ns / n,
                            baseline="torch.tensor(list, dtype=torch.int64) of the same list, same run",
                            baseline_ns_per_entry=bns / n, ratio_to_baseline=bns / ns, repeats=args.repeats,
                            interop_threads=torch.get_num_interop_threads(), machine=machine))
        print(f"convert {form:>19}: {ns / n:6.2f} ns/entry (torch.tensor {bns / n:.1f})", flush=True)

    # One 4 KiB write, call time (submit only), engine-level call against the
    # session's in the same run: the engine-level call passes two descriptors.
    single = {}
    for _ in range(3):  # alternating rounds
        for form, fn in (("session", lambda: sess.write(0, 0, seg, sess.allocate_transfer_uid())),
                         ("engine", lambda: a.write(sd, 0, dd, 0, seg, a.allocate_transfer_uid()))):
            ts = []
            for _ in range(args.single_samples):
                t0 = time.perf_counter_ns()
                st = fn()
                ts.append(time.perf_counter_ns() - t0)
                st.Wait()
                assert st.Succeeded(), st.Message()
            single.setdefault(form, []).append(statistics.median(ts[len(ts) // 10:]))
    base = statistics.median(single["session"])
    for form in ("session", "engine"):
        ns = statistics.median(single[form])
        records.append(dict(backend=args.backend, kind="single", form=form, segments=1, segment_bytes=seg,
                            call_us=ns / 1e3, baseline="session write of the same bytes, same run",
                            baseline_call_us=base / 1e3, ratio_to_session=ns / base, samples=args.single_samples,
                            rounds=3, machine=machine))
        print(f" single {form:>19}: call p50 {ns / 1e3:6.1f} us (session {base / 1e3:.1f})", flush=True)

    # One poll of a status (Succeeded()): mori_torch.io's call against the
    # TorchScript method it used to make, same run.
    st = sess.write(0, 0, seg, sess.allocate_transfer_uid())
    st.Wait()
    polls = {}
    for _ in range(3):
        for form, fn in (("io", st.Succeeded), ("torchscript method", st._s.Succeeded)):
            t0 = time.perf_counter_ns()
            for _ in range(20000):
                fn()
            polls.setdefault(form, []).append((time.perf_counter_ns() - t0) / 20000)
    base = statistics.median(polls["torchscript method"])
    for form in ("io", "torchscript method"):
        ns = statistics.median(polls[form])
        records.append(dict(backend=args.backend, kind="poll", form=form, call_us=ns / 1e3,
                            baseline="TransferStatus.Succeeded through TorchScript's method call, same run",
                            baseline_call_us=base / 1e3, ratio_to_method=ns / base, rounds=3, machine=machine))
        print(f"   poll {form:>19}: {ns:6.0f} ns per Succeeded() (TorchScript method {base:.0f})", flush=True)

    out = dict(command=" ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:]),
               time_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), torch=torch.__version__, records=records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    for e in (a, b):
        e.shutdown()


if __name__ == "__main__":
    main()
