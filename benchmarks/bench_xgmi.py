"""GPU-peer (XGMI backend) figures that the benchmark CLI does not take, each
against torch's copy_ between the same two devices measured in the same run,
both engines in this one process. Two GPUs: source on cuda:0, destination on
cuda:1. One GPU, or --same-device: both on cuda:0 (HBM, not the link).

    python benchmarks/bench_xgmi.py --json docs/results/xgmi_h200x2.json [--grid] [--latency-breakdown]

Single segments (64 MiB, 1 GiB) and one page batch at a time, timed from the
call to completion between two processes, are the CLI's:

    python -m mori_torch.benchmark --backend xgmi --op-type both --buffer-size 64M --transfer-batch-size 1
    python -m mori_torch.benchmark --backend xgmi --op-type both --buffer-size 16K \
        --transfer-batch-size 16384 --enable-batch-transfer --enable-sess --shuffle

Cases:
- batches of 16,384 segments of 4/16/64 KiB, remote offsets permuted (nothing
  merges), from int64 tensors and from Python lists: submitted `--depth` at a
  time (throughput, host work overlapping earlier copies), and one at a time
  (call to completion, against copy_ of the same bytes), with the ratio of
  lists to tensors;
- host time per segment to submit a 16,384-segment session batch;
- a 4 KiB write's latency, call to Succeeded() polled from Python, p50/p99;
- --latency-rounds N: only that latency, N rounds with torch's copy_ + event
  poll taking turns (p50 / p90 / p99 / p99.9 each);
- --latency-breakdown: where that latency goes (TorchScript call cost, io.py
  wrapper, submit alone, Wait() instead of polling, the kernel instead of the
  copy engines, torch's own copy_ of 4 KiB);
- --grid: kernel vs copy engines over segment count x segment size, the data
  behind XgmiBackendConfig's kernel_min_segments / kernel_max_avg_bytes.
"""
import argparse
import gc
import json
import platform
import random
import statistics
import time

import torch

from mori_torch.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, XgmiBackendConfig

KERNEL_ALWAYS = dict(kernel_min_segments=1, kernel_max_avg_bytes=1 << 40)
COPY_ENGINES_ALWAYS = dict(kernel_min_segments=1 << 30)


def cuda_time(fn, iters, warmup=3):
    """Mean seconds per call of fn, the device idle before and after."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def median_time(fn, iters, warmup=3):
    """Median seconds per call of fn (which must end its own work, e.g. with
    Wait()): robust to the odd stall of a shared or virtual machine."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_samples(once, n, warmup=200):
    """Microseconds of `once` (which returns its start, the end of its call
    and its end): the whole and the call alone, `n` samples after `warmup`
    untimed ones, with Python's cyclic GC off while timing (as timeit does)."""
    for _ in range(warmup):
        once()
    torch.cuda.synchronize()
    total, call = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(n):
            t0, t1, t2 = once()
            total.append((t2 - t0) * 1e6)
            call.append((t1 - t0) * 1e6)
    finally:
        gc.enable()
    return total, call


def percentiles(samples_us):
    s = sorted(samples_us)
    return s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]


class Bench:
    def __init__(self, args):
        self.args = args
        self.src_dev = "cuda:0"
        self.dst_dev = "cuda:0" if args.same_device or torch.cuda.device_count() < 2 else "cuda:1"
        self.machine = f"{platform.node()} {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
        self.baseline = f"torch copy_ {self.src_dev}->{self.dst_dev}"
        self.n = args.buffer_mib << 20
        self.src = torch.randint(0, 256, (self.n,), dtype=torch.uint8, device=self.src_dev)
        self.dst = torch.zeros(self.n, dtype=torch.uint8, device=self.dst_dev)
        self.engines = []
        self.records = []

    def session(self, **cfg):
        """A fresh engine pair with XgmiBackendConfig(**cfg) and its session."""
        tag = len(self.engines)
        a = IOEngine(f"bench-a{tag}", IOEngineConfig("127.0.0.1", 0))
        b = IOEngine(f"bench-b{tag}", IOEngineConfig("127.0.0.1", 0))
        for e in (a, b):
            e.create_backend(BackendType.XGMI, XgmiBackendConfig(**cfg))
        a.register_remote_engine(b.get_engine_desc())
        self.engines += [a, b]
        ld = a.register_torch_tensor(self.src)
        rd = MemoryDesc.unpack(b.register_torch_tensor(self.dst).pack())
        return a.create_session(ld, rd)

    def record(self, op, seg, segs, t, base_gbps, **extra):
        total = seg * segs
        r = dict(backend="xgmi", op=op, mem="gpu", segment_bytes=seg, segments=segs, gbps=total / t / 1e9,
                 baseline=self.baseline, baseline_gbps=base_gbps, machine=self.machine,
                 devices=f"{self.src_dev}->{self.dst_dev}", **extra)
        r["ratio"] = r["gbps"] / base_gbps
        r["baseline_label"] = f"{self.baseline}" + (f", {extra['vs']}" if "vs" in extra else ", same bytes")
        self.records.append(r)
        print(f"{op:5} seg {seg:>11} x {segs:>6}: {r['gbps']:8.1f} GB/s  baseline {base_gbps:8.1f}"
              f"  ratio {r['ratio']:.3f} {extra}", flush=True)
        return r

    def copy_gbps(self, size):
        t = cuda_time(lambda: self.dst[:size].copy_(self.src[:size], non_blocking=True), self.args.iters)
        return size / t / 1e9

    def permuted(self, seg, count, seed):
        lo = torch.arange(count, dtype=torch.int64) * seg
        ro = torch.tensor(random.Random(seed).sample(range(self.n // seg), count), dtype=torch.int64) * seg
        return lo, ro, torch.full((count,), seg, dtype=torch.int64)

    # ------------------------------------------------------------------
    def batches_in_flight(self, sess):
        """Page batches from int64 tensors and from Python lists (what serving
        engines pass), submitted --depth at a time (host work overlaps the
        copies of the batches before), against copy_ of the whole buffer, and
        one batch at a time (call to completion), against copy_ of the same
        bytes timed call to synchronize. Single segments, timed between two
        processes, are the CLI's: python -m mori_torch.benchmark --backend xgmi."""
        iters = self.args.iters
        base_1g = self.copy_gbps(self.n)
        self.base_1g = base_1g
        for seg in (4 << 10, 16 << 10, 64 << 10):
            count = min(16384, self.n // seg)
            tensors = self.permuted(seg, count, seg)
            forms = (("tensors", tensors), ("lists", tuple(t.tolist() for t in tensors)))
            base_same = count * seg / self.copy_call_to_sync(count * seg, iters) / 1e9
            for op in ("write", "read"):
                fn = getattr(sess, f"batch_{op}")
                got = {}
                for form, (lo, ro, sizes) in forms:
                    def deep():
                        for st in [fn(lo, ro, sizes, 1) for _ in range(self.args.depth)]:
                            st.Wait()
                    t = cuda_time(deep, max(2, iters // self.args.depth)) / self.args.depth
                    r = self.record(op, seg, count, t, base_1g, case=f"batch, {self.args.depth} in flight", form=form,
                                    vs="copy_ of the buffer")
                    got[(form, "deep")] = r["gbps"]
                    t = median_time(lambda: fn(lo, ro, sizes, 1).Wait(), iters)
                    r = self.record(op, seg, count, t, base_same, case="one batch at a time, call to completion",
                                    form=form, vs="copy_ of the same bytes, call to synchronize", timing="median")
                    got[(form, "one")] = r["gbps"]
                for mode in ("deep", "one"):
                    ratio = got[("lists", mode)] / got[("tensors", mode)]
                    print(f"  lists / tensors, {op} {seg >> 10} KiB, {mode}: {ratio:.3f}", flush=True)
                    self.records.append(dict(backend="xgmi", op=op, mem="gpu", segment_bytes=seg, segments=count,
                                             metric="lists_over_tensors", mode=mode, value=ratio,
                                             machine=self.machine, devices=f"{self.src_dev}->{self.dst_dev}"))

    def copy_call_to_sync(self, size, iters):
        """Median seconds of copy_ of `size` bytes, call to synchronize."""
        def once():
            self.dst[:size].copy_(self.src[:size], non_blocking=True)
            torch.cuda.synchronize()
        return median_time(once, iters)

    def submit_cost(self, sess):
        count = 16384
        lo = [i * 4096 for i in range(count)]
        ro = [s * 4096 for s in random.Random(1).sample(range(self.n // 4096), count)]
        sizes = [4096] * count
        for form, args3 in (("lists", (lo, ro, sizes)),
                            ("tensors", (torch.tensor(lo), torch.tensor(ro), torch.tensor(sizes)))):
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                st = sess.batch_write(*args3, 1)
                times.append(time.perf_counter() - t0)
                st.Wait()
            per_seg_ns = statistics.median(times[5:]) / count * 1e9
            print(f"submit host time per segment (16,384-segment session batch, {form}): {per_seg_ns:.1f} ns")
            self.records.append(dict(backend="xgmi", op="write", mem="gpu", segment_bytes=4096, segments=count,
                                     metric=f"submit_ns_per_segment_{form}", value=per_seg_ns,
                                     machine=self.machine, devices=f"{self.src_dev}->{self.dst_dev}"))

    @staticmethod
    def write_once(sess, use_wait=False, raw=False):
        """One 4 KiB write, call to Succeeded() polled (or to the end of
        Wait()), through io.py or the raw TorchScript session."""
        write = sess._s.write if raw else sess.write

        def once():
            t0 = time.perf_counter()
            st = write(0, 0, 4096, 1)
            t1 = time.perf_counter()
            if use_wait:
                st.Wait()
            else:
                while not st.Succeeded():
                    pass
            return t0, t1, time.perf_counter()
        return once

    def latency(self, sess, label, n=3000, use_wait=False, raw=False):
        """4 KiB write, call to Succeeded() (or to the end of Wait()); also
        the part spent in the submitting call alone."""
        lat, sub = timed_samples(self.write_once(sess, use_wait, raw), n)
        p50, p99 = percentiles(lat)
        s50, s99 = percentiles(sub)
        print(f"4 KiB write latency, {label}: p50 {p50:.1f} us, p99 {p99:.1f} us (the call itself: p50 {s50:.1f} us,"
              f" p99 {s99:.1f} us)", flush=True)
        self.records.append(dict(backend="xgmi", op="write", mem="gpu", segment_bytes=4096, segments=1,
                                 metric="latency", variant=label, p50_us=p50, p99_us=p99, submit_p50_us=s50,
                                 submit_p99_us=s99, machine=self.machine, devices=f"{self.src_dev}->{self.dst_dev}"))
        return p50

    def copy_and_poll_once(self):
        """torch's own 4 KiB copy between the same devices, polled by an event."""
        ev, src, dst = torch.cuda.Event(), self.src[:4096], self.dst[:4096]

        def once():
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            ev.record()
            t1 = time.perf_counter()
            while not ev.query():
                pass
            return t0, t1, time.perf_counter()
        return once

    def latency_rounds(self, sess, rounds, n=3000):
        """Issue #14's latency case `rounds` times: a 4 KiB write, call to
        Succeeded() polled, and torch's copy_ + event poll taking turns in
        each round, `n` samples each; p50, p90, p99, p99.9 and p99/p50."""
        ours = self.write_once(sess)
        cases = (("mori_torch write, call to Succeeded()", ours),
                 ("torch copy_ + event poll", self.copy_and_poll_once()))
        print(f"4 KiB latency, {rounds} rounds of {n} samples, us: p50 / p90 / p99 / p99.9, p99/p50")
        rows = {label: [] for label, _ in cases}
        for r in range(rounds):
            for label, once in cases:
                lat = sorted(timed_samples(once, n)[0])
                q = {k: lat[min(len(lat) - 1, int(len(lat) * f))] for k, f in
                     (("p50", .5), ("p90", .9), ("p99", .99), ("p999", .999))}
                rows[label].append(q)
                print(f"  round {r} {label:38} {q['p50']:6.1f} {q['p90']:6.1f} {q['p99']:6.1f} {q['p999']:7.1f}"
                      f"  {q['p99'] / q['p50']:.2f}", flush=True)
                self.records.append(dict(backend="xgmi" if once is ours else "torch", op="write", segment_bytes=4096,
                                         segments=1, metric="latency_round", variant=label, round=r, samples=n,
                                         p50_us=q["p50"], p90_us=q["p90"], p99_us=q["p99"], p999_us=q["p999"],
                                         machine=self.machine, devices=f"{self.src_dev}->{self.dst_dev}"))
        mine, base = rows[cases[0][0]], rows[cases[1][0]]
        print(f"  rounds with our p50 <= copy_ + poll's: {sum(m['p50'] <= b['p50'] for m, b in zip(mine, base))}"
              f"/{rounds}; our p99 <= 2 x p50: {sum(m['p99'] <= 2 * m['p50'] for m in mine)}/{rounds}"
              f" (copy_ + poll: {sum(b['p99'] <= 2 * b['p50'] for b in base)}/{rounds})", flush=True)

    def call_cost(self, label, fn, n=20000):
        for _ in range(500):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) / n * 1e6
        print(f"  {label}: {us:.2f} us", flush=True)
        self.records.append(dict(backend="xgmi", metric="call_us", variant=label, value=us, machine=self.machine))

    def latency_breakdown(self, sess, kernel_sess):
        self.latency(kernel_sess, "kernel for single segments (kernel_min_segments=1)")
        self.latency(sess, "Wait() instead of polling", use_wait=True)
        self.latency(sess, "native TorchScript objects, no io.py", raw=True)
        nat = sess._s
        done = sess.write(0, 0, 4096, 1)
        done.Wait()
        print("call costs:")
        self.call_cost("TorchScript method call, no work (Session.alive)", nat.alive)
        self.call_cost("same, method fetched each time", lambda: nat.alive())
        self.call_cost("io.py Succeeded() on a finished status", done.Succeeded)
        # torch's own 4 KiB copy between the same devices, polled by an event.
        p50, p99 = percentiles(timed_samples(self.copy_and_poll_once(), 3000)[0])
        print(f"torch copy_ of 4 KiB + event poll: p50 {p50:.1f} us, p99 {p99:.1f} us")
        self.records.append(dict(backend="torch", op="copy_", segment_bytes=4096, segments=1, metric="latency",
                                 variant="torch copy_ + event poll", p50_us=p50, p99_us=p99, machine=self.machine))

    def grid(self):
        """Kernel vs copy engines, one batch per transfer, permuted pages."""
        iters = max(5, self.args.iters // 2)
        kern, ce = self.session(**KERNEL_ALWAYS), self.session(**COPY_ENGINES_ALWAYS)
        counts = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 16384)
        sizes = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
        print("grid: GB/s kernel / copy engines (write, one batch, submit to Wait)")
        cells = {}
        for seg in sizes:
            for count in counts:
                if seg * count > self.n:
                    continue
                lo, ro, sz = self.permuted(seg, count, seg + count)
                res = {}
                for path, sess in (("kernel", kern), ("copy engines", ce)):
                    def run():
                        sess.batch_write(lo, ro, sz, 1).Wait()
                    res[path] = self.record("write", seg, count, median_time(run, iters), self.base_1g,
                                            case="grid", path=path, vs="copy_ of the buffer", timing="median")["gbps"]
                cells[(seg, count)] = {p: seg * count / g for p, g in res.items()}  # seconds x 1e9
                print(f"  {seg >> 10:>5} KiB x {count:>6}: kernel {res['kernel']:7.1f}  copy engines "
                      f"{res['copy engines']:7.1f}  -> {'kernel' if res['kernel'] >= res['copy engines'] else 'CE'}",
                      flush=True)

        self.suggest_thresholds(cells, counts, sizes)

    def suggest_thresholds(self, cells, counts, sizes):
        """The (kernel_min_segments, kernel_max_avg_bytes) whose choices lose
        least against the faster path of every grid cell (mean slowdown)."""
        def loss(min_segs, max_avg):
            total = 0.0
            for (seg, count), t in cells.items():
                path = "kernel" if count >= min_segs and seg < max_avg else "copy engines"
                total += t[path] / min(t.values())
            return total / len(cells)
        cands = [(loss(m, a), m, a) for m in counts for a in list(sizes[1:]) + [1 << 40]]
        best = min(cands)
        defaults = XgmiBackendConfig()
        now = loss(defaults.kernel_min_segments, defaults.kernel_max_avg_bytes)
        print(f"suggested: kernel_min_segments={best[1]} kernel_max_avg_bytes={best[2]} (mean slowdown vs the "
              f"faster path per cell {best[0]:.3f}; current defaults {now:.3f})")
        self.records.append(dict(backend="xgmi", metric="suggested_thresholds", kernel_min_segments=best[1],
                                 kernel_max_avg_bytes=best[2], mean_slowdown=best[0], defaults_slowdown=now,
                                 machine=self.machine, devices=f"{self.src_dev}->{self.dst_dev}"))

    def save_and_shutdown(self):
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(self.records, f, indent=1)
        for e in self.engines:
            e.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--depth", type=int, default=4, help="batches in flight for the throughput case")
    ap.add_argument("--buffer-mib", type=int, default=1024)
    ap.add_argument("--same-device", action="store_true", help="both buffers on cuda:0 even with two GPUs")
    ap.add_argument("--grid", action="store_true", help="kernel vs copy engines over count x size")
    ap.add_argument("--latency-breakdown", action="store_true")
    ap.add_argument("--latency-rounds", type=int, default=0,
                    help="only the 4 KiB latency against copy_ + event poll, this many rounds taking turns")
    args = ap.parse_args()
    bench = Bench(args)
    print(f"{bench.machine}: {bench.src_dev} -> {bench.dst_dev}", flush=True)
    sess = bench.session()
    if args.latency_rounds:
        bench.latency_rounds(sess, args.latency_rounds)
        bench.save_and_shutdown()
        return
    bench.batches_in_flight(sess)
    bench.submit_cost(sess)
    bench.latency(sess, "io.py, default config")
    if args.latency_breakdown:
        bench.latency_breakdown(sess, bench.session(**KERNEL_ALWAYS))
    if args.grid:
        bench.grid()
    bench.save_and_shutdown()


if __name__ == "__main__":
    main()
