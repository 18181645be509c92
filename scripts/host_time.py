"""Host time per call: flashtile against SDPA on calls whose GPU time is well below their host
time (b1, 256 tokens, 16/4 heads, d64, causal: forward, forward + backward; a decoding step of
one query, 32/8 heads, d128, cache 4k), as bench.host_cost and the decode benchmark time them.
The CPU's speed varies from one process to the next: run it several times, alternating trees,
and join the runs with --table.

    python scripts/host_time.py --out host_tree_1.json          (on a GPU; the flashtile imported)
    python scripts/host_time.py --table host_*.json              (median per tree and call)
"""
import argparse
import json
import os
import statistics
import sys

CALLS = 300


def measure():
    """{call: best of three host microseconds per call} for flashtile (the one imported) and SDPA."""
    import flashtile
    from flashtile import bench, decode_bench
    result = {}
    for name, provider in (("flashtile", "flashtile-v3"), ("sdpa", "sdpa-cudnn")):
        for label, mode in (("forward", "fwd"), ("forward+backward", "fwdbwd")):
            case = bench.Case(1, 16, 4, 256, 256, 64, True, mode)
            result[f"{name} {label}"] = 1e3 * min(bench.host_cost(provider, case, CALLS)[0] for _ in range(3))
        decode = decode_bench.make_call(name if name == "flashtile" else provider, 1, 4096)
        decode()
        host_us = getattr(decode_bench, "host_us", None) or decode_bench._host_us  # (older trees: private)
        result[f"{name} decode"] = min(host_us(decode, CALLS) for _ in range(3))
    return dict(tree=os.path.dirname(os.path.dirname(os.path.abspath(flashtile.__file__))), host_us=result)


def table(runs) -> str:
    """Markdown: per call, each tree's median host time over its runs (µs)."""
    trees = sorted({run["tree"] for run in runs})
    calls = list(dict.fromkeys(call for run in runs for call in run["host_us"]))
    lines = ["| call | " + " | ".join(trees) + " |", "|---|" + "---|" * len(trees)]
    for call in calls:
        cells = []
        for tree in trees:
            values = [run["host_us"][call] for run in runs if run["tree"] == tree and call in run["host_us"]]
            cells.append(f"{statistics.median(values):.1f} ({len(values)})" if values else "")
        lines.append(f"| {call} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write this process's measurement here (JSON)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="join earlier measurements instead")
    args = ap.parse_args(argv)
    if args.table:
        print(table([json.load(open(path)) for path in args.table]))
        return
    run = measure()
    for call, us in run["host_us"].items():
        print(f"{call:26s} {us:8.1f} us")
    if args.out:
        json.dump(run, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
