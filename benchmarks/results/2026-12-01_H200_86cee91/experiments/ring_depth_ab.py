"""Same-run A/B of the d128 Gluon two-pass backward's ring depth: 64,64,2 (the table) against
64,64,3 and 64,64,4, 1k-4k, causal and not; best of 2 rounds, interleaved."""
import json
import sys

from flashtile import bench

VARIANTS = {"64,64,2": {"FLASHTILE_V3_BWD": "gluon"},
            "64,64,3": {"FLASHTILE_CONFIG_V3_GLUON_BWD": "64,64,3"},
            "64,64,4": {"FLASHTILE_CONFIG_V3_GLUON_BWD": "64,64,4"}}
rows = []
for causal in (False, True):
    for s in (1024, 2048, 4096):
        case = bench.Case(16384 // s, 16, 16, s, s, 128, causal, "bwd")
        row = dict(causal=causal, seqlen=s)
        for rnd in range(2):
            for name, env in VARIANTS.items():
                try:
                    ms, _ = bench.measure("flashtile-v3", case, env=env)
                except Exception as e:  # a tile that does not fit: recorded, not fatal
                    print(name, repr(e)[:300], file=sys.stderr)
                    ms = float("inf")
                row[name] = min(row.get(name, float("inf")), ms)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
print("| causal | seqlen | " + " | ".join(f"{n} / 64,64,2" for n in VARIANTS) + " |")
print("|---|---|" + "---|" * len(VARIANTS))
for r in rows:
    print(f"| {r['causal']} | {r['seqlen']} | " + " | ".join(f"{r['64,64,2'] / r[n]:.2f}" for n in VARIANTS) + " |")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
