#!/usr/bin/env python
"""Plots GB/s against segment size, engine vs baseline, from the JSON
records of `python -m mori_torch.benchmark --all ... --json PATH` or of
benchmarks/bench_xgmi.py (--where picks records, e.g. case=grid).

    python benchmarks/plot.py docs/results/tcp_cpu_sweep.json -o docs/results/tcp_cpu_sweep.png
    python benchmarks/plot.py docs/results/xgmi_h200x1.json --where case=grid --where segments=16384 \
        -o docs/results/xgmi_h200x1.png
"""
import argparse
import json
import sys
from collections import defaultdict


def baseline_label(r):
    """What the record's baseline was (the CLI names its kind)."""
    kind = (r.get("baseline") or {}).get("kind") if isinstance(r.get("baseline"), dict) else None
    if kind == "torch_copy":
        return "torch copy_ baseline, same bytes"
    return "socket loopback baseline, same bytes"


def _size_label(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            return f"{n // div}{unit}"
    return str(n)


def timing_of(records):
    """'median' when every record says it was timed by its median, else 'mean'."""
    return "median" if all(r.get("timing") == "median" for r in records) else "mean"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="benchmark JSON file(s)")
    p.add_argument("-o", "--output", default="tcp_cpu_sweep.png", help="PNG to write")
    p.add_argument("--title", default=None)
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="keep only records whose KEY prints as VALUE (repeatable)")
    args = p.parse_args(argv)
    wanted = [w.split("=", 1) for w in args.where]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = []
    for path in args.json:
        with open(path) as f:
            records += json.load(f)
    records = [r for r in records if "gbps" in r and all(str(r.get(k)) == v for k, v in wanted)]
    # One line per (op, segments, api, shuffle, path) series, engine and baseline.
    series = defaultdict(list)
    for r in records:
        api = "session" if r.get("sess") else ("engine" if r["backend"] == "tcp" else None)
        key = (r["op"], r["segments"], api, bool(r.get("shuffle")), r.get("path"))
        series[key].append(r)
    if not series:
        print("no records", file=sys.stderr)
        return 1

    fig, (ax, rax) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    for (op, nseg, api, shuffle, path), rs in sorted(series.items(), key=lambda kv: str(kv[0])):
        rs.sort(key=lambda r: r["segment_bytes"])
        x = [r["segment_bytes"] for r in rs]
        label = ", ".join(str(p) for p in (op, f"{nseg} seg/transfer", api, path) if p is not None)
        label += ", shuffled" if shuffle else ""
        (line,) = ax.plot(x, [r["gbps"] for r in rs], "o-", label=f"mori_torch ({label})")
        base = [r for r in rs if r.get("baseline_gbps")]
        if base:
            ax.plot([r["segment_bytes"] for r in base], [r["baseline_gbps"] for r in base], "s--",
                    color=line.get_color(), alpha=0.6,
                    label=base[0].get("baseline_label", baseline_label(base[0])))
            rax.plot([r["segment_bytes"] for r in base], [r["ratio"] for r in base], "o-", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["segment_bytes"] for r in records})
    if len(ticks) > 12:
        ticks = ticks[:: max(1, len(ticks) // 12)]
    rax.set_xticks(ticks)
    rax.set_xticklabels([_size_label(t) for t in ticks])
    rax.set_xlabel("segment size (bytes)")
    rax.set_ylabel("engine / baseline")
    rax.axhline(1.0, color="gray", lw=0.8)
    rax.grid(True, which="both", alpha=0.3)
    ax.set_ylabel(f"GB/s (1e9 B/s, total bytes / {timing_of(records)} time per transfer)")
    r0 = records[0]
    setup = (  # the CLI's records (TCP) come from two processes; bench_xgmi's from one
        f": two processes on one machine (num_data_conns={r0['num_data_conns']})"
        if r0.get("num_data_conns") is not None
        else ""
    )
    title = args.title or (
        f"mori_torch {r0['backend']} {r0['mem']}{setup}\n{r0['machine']}"
    )
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
