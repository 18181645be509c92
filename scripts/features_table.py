"""v3 with each score feature against v3 without, as one record file and one table: the
``flashtile bench`` JSON of each feature's run (one run per feature: the bench takes one at a
time) joined into ``--out`` (JSON), and a Markdown table of TFLOP/s and the ratio to the run
without any feature, per mode and causal, printed (and written beside the JSON as .md).

    python scripts/features_table.py R/features_none.json R/features_softcap.json --out R/features.json
"""
import argparse
import json
import os

MODES = ("fwd", "bwd")


def feature_of(record) -> str:
    """The score feature a bench record was timed with: softcap N, alibi, sinks, dropout P, or none."""
    names = []
    if record.get("softcap"):
        names.append(f"softcap {record['softcap']:g}")
    if record.get("alibi"):
        names.append("alibi")
    if record.get("sinks"):
        names.append("sinks")
    if record.get("dropout"):
        names.append(f"dropout {record['dropout']:g}")
    return " + ".join(names) or "none"


def table(records):
    """Markdown lines: a row per feature, a TFLOP/s and a ratio to "none" column per (mode, causal)."""
    cells = {(feature_of(r), r["mode"], r["causal"]): r["tflops"] for r in records if r.get("tflops") is not None}
    features = sorted({f for f, _, _ in cells}, key=lambda f: (f != "none", f))
    columns = [(m, c) for m in MODES for c in (False, True) if any(k[1:] == (m, c) for k in cells)]
    head = ["feature"] + [f"{m} {'causal' if c else 'non-causal'}" for m, c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for feature in features:
        row = [feature]
        for m, c in columns:
            mine, plain = cells.get((feature, m, c)), cells.get(("none", m, c))
            if mine is None:
                row.append("")
            elif plain is None or feature == "none":
                row.append(f"{mine:.0f}")
            else:
                row.append(f"{mine:.0f} ({mine / plain:.2f}x)")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def header(records) -> str:
    """The run's line: GPU, versions, commit, date, shape (from the first record)."""
    r = records[0]
    return (f"GPU {r.get('gpu')}, torch {r.get('torch')}, triton {r.get('triton')}, commit {r.get('commit')}, "
            f"{r.get('date')}; {r['provider']}, {r.get('dtype')}, d{r['d']}, seqlen {r['sq']}, batch {r['b']} x "
            f"{r['h']} heads; TFLOP/s (forward 4*b*h*sq*sk*d, half when causal; backward 2.5x), in brackets "
            f"the ratio to the same run without a feature.")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="flashtile bench JSON files, one per feature")
    parser.add_argument("--out", help="the joined records (JSON); the table goes beside it as .md")
    args = parser.parse_args(argv)
    records = []
    for path in args.runs:
        with open(path) as f:
            records += json.load(f)
    text = "\n".join([header(records), ""] + table(records)) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
