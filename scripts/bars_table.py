"""v3's bars as one table: v3 against a baseline provider (cuDNN) and against v2, forward and
backward, per (head dim, causal, seqlen), from ``flashtile bench`` JSON files (several: one run
per head dim), with how many cells v3 is at or above the baseline in; ``--previous`` adds the
v3/baseline ratios of an earlier run's JSON.

    python scripts/bars_table.py R/bars_abc_d64.json R/bars_abc_d128.json --previous OLD/bars.json
"""
import argparse
import json

MODES = ("fwd", "bwd")


def tflops_by_cell(paths):
    """{(provider, head dim, causal, seqlen, mode): TFLOP/s} over the records of ``paths``."""
    cells = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f):
                if r.get("tflops") is not None:
                    cells[(r["provider"], r["d"], r["causal"], r["sq"], r["mode"])] = r["tflops"]
    return cells


def table(cells, baseline, previous=None, v3="flashtile-v3", v2="flashtile-v2"):
    """Markdown lines, and {mode: (cells at or above the baseline, cells)}."""
    grid = sorted({(d, c, s) for p, d, c, s, _ in cells if p == v3})
    head = ["d", "causal", "seqlen"] + [f"{m} {x}" for m in MODES for x in ("v3", baseline, f"v3/{baseline}", "v3/v2")]
    if previous:
        head.append(f"before: {' / '.join(MODES)} v3/{baseline}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    counts = {m: [0, 0] for m in MODES}
    for d, c, s in grid:
        row = [str(d), "yes" if c else "no", str(s)]
        for m in MODES:
            mine, base, slow = (cells.get((p, d, c, s, m)) for p in (v3, baseline, v2))
            if mine is None or base is None:
                row += ["", "", "", ""]
                continue
            counts[m][0] += mine >= base
            counts[m][1] += 1
            row += [f"{mine:.0f}", f"{base:.0f}", f"{mine / base:.3f}", f"{mine / slow:.2f}" if slow else ""]
        if previous:
            row.append(" / ".join(f"{previous[(v3, d, c, s, m)] / previous[(baseline, d, c, s, m)]:.3f}"
                                  if (v3, d, c, s, m) in previous and (baseline, d, c, s, m) in previous else "-"
                                  for m in MODES))
        lines.append("| " + " | ".join(row) + " |")
    return lines, {m: tuple(n) for m, n in counts.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="flashtile bench JSON files of one run")
    ap.add_argument("--baseline", default="sdpa-cudnn")
    ap.add_argument("--previous", nargs="*", default=(), help="an earlier run's JSON files")
    args = ap.parse_args(argv)
    lines, counts = table(tflops_by_cell(args.json), args.baseline,
                          tflops_by_cell(args.previous) if args.previous else None)
    print(", ".join(f"{m}: v3 >= {args.baseline} in {n} of {total} cells" for m, (n, total) in counts.items()))
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
