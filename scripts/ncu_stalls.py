"""Where a kernel's warps wait, from Nsight Compute's per-instruction stall sampling.

Reads the SASS page of a report (`ncu --import R.ncu-rep --page source --csv --print-source sass`,
the report taken with `--section SourceCounters`) and prints, as Markdown, the samples of each
region of the code: the hot loops (instructions executed at least half as often as the most
executed one), the rest, and warps idling at a barrier (partition padding), each split by stall
reason, and the hot loops' samples by opcode.

    python scripts/ncu_stalls.py ncu_fwd_d64_s4096_causal_sass.csv
"""
import argparse
import collections
import csv

from sass_loops import opcode

SAMPLES = "Warp Stall Sampling (All Samples)"


def read(path):
    """The SASS rows of the report's kernel with the most stall samples (a report of several
    kernels has one "Kernel Name" section each)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    sections, header = [], None
    for r in rows:
        if r and r[0] == "Kernel Name":
            sections.append((r[1] if len(r) > 1 else "", []))
        elif r and r[0] == "Address":
            header = r
            if not sections:
                sections.append(("", []))
        elif header and len(r) == len(header):
            sections[-1][1].append(dict(zip(header, r)))
    name, kernel_rows = max(sections, key=lambda s: sum(number(r[SAMPLES]) for r in s[1]))
    return name, header, kernel_rows


def number(text):
    return float(text.replace(",", "") or 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    args = ap.parse_args(argv)
    name, header, rows = read(args.csv)
    print(f"Kernel: `{name[:80]}`\n")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = SAMPLES
    most = max(number(r["Instructions Executed"]) for r in rows)
    regions = collections.defaultdict(collections.Counter)
    ops = collections.Counter()
    for r in rows:
        if all(number(r[x]) == 0 for x in reasons if x != "stall_barrier") and number(r["stall_barrier"]) > 0 \
                and opcode(r["Source"]) == "NOP":
            region = "idle at a barrier"
        elif number(r["Instructions Executed"]) >= most / 2:
            region = "hot loops"
            ops[opcode(r["Source"])] += number(r[samples])
        else:
            region = "rest"
        for x in reasons:
            regions[region][x[len("stall_"):]] += number(r[x])
    total = sum(sum(c.values()) for c in regions.values())
    print("| region | share of samples | top stall reasons (share of the region's) |\n|---|---|---|")
    for region, c in sorted(regions.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(c.values())
        top = ", ".join(f"{k} {v / n:.1%}" for k, v in c.most_common(6) if v)
        print(f"| {region} | {n / total:.1%} | {top} |")
    n = sum(ops.values())
    print("\nHot loops' samples by opcode: " + ", ".join(f"{k} {v / n:.1%}" for k, v in ops.most_common(12)))


if __name__ == "__main__":
    main()
