#!/usr/bin/env python
"""Plots GB/s against segment size, engine vs socket baseline, from the JSON
records of `python -m mori_torch.benchmark --all ... --json PATH`.

    python benchmarks/plot.py docs/results/tcp_cpu_sweep.json -o docs/results/tcp_cpu_sweep.png
"""
import argparse
import json
import sys
from collections import defaultdict


def _size_label(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            return f"{n // div}{unit}"
    return str(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="benchmark JSON file(s)")
    p.add_argument("-o", "--output", default="tcp_cpu_sweep.png", help="PNG to write")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = []
    for path in args.json:
        with open(path) as f:
            records += json.load(f)
    # One line per (op, segments, api, shuffle) series, engine and baseline.
    series = defaultdict(list)
    for r in records:
        key = (r["op"], r["segments"], "session" if r.get("sess") else "engine", bool(r.get("shuffle")))
        series[key].append(r)
    if not series:
        print("no records", file=sys.stderr)
        return 1

    fig, (ax, rax) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    for (op, nseg, api, shuffle), rs in sorted(series.items()):
        rs.sort(key=lambda r: r["segment_bytes"])
        x = [r["segment_bytes"] for r in rs]
        label = f"{op}, {nseg} seg/transfer, {api}" + (", shuffled" if shuffle else "")
        (line,) = ax.plot(x, [r["gbps"] for r in rs], "o-", label=f"mori_torch ({label})")
        base = [r for r in rs if r.get("baseline_gbps")]
        if base:
            ax.plot([r["segment_bytes"] for r in base], [r["baseline_gbps"] for r in base], "s--",
                    color=line.get_color(), alpha=0.6, label="socket loopback baseline, same bytes")
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
    ax.set_ylabel("GB/s (1e9 B/s, total bytes / mean transfer time)")
    r0 = records[0]
    title = args.title or (
        f"mori_torch {r0['backend']} {r0['mem']}: two processes on one machine "
        f"(num_data_conns={r0['num_data_conns']})\n{r0['machine']}"
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
