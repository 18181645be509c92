import os, sys, statistics
from unittest import mock
from flashtile import bench
VARIANTS = [("gluon", {"FLASHTILE_V3_BWD": "gluon"}), ("gluon-reduce", {"FLASHTILE_V3_BWD": "gluon-reduce"}),
            ("v2", {"FLASHTILE_V3_BWD": "v2"})]
print("| d | causal | seqlen | " + " | ".join(n for n, _ in VARIANTS) + " | cudnn |")
for d in (64, 128):
    for causal in (False, True):
        for s in (1024, 4096, 16384):
            case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "bwd")
            row = []
            for name, env in VARIANTS:
                try:
                    with mock.patch.dict(os.environ, env):
                        ms = min(bench.measure("flashtile-v3", case)[0] for _ in range(2))
                    row.append(f"{case.flops() / ms / 1e9:.0f}")
                except Exception as e:
                    row.append(f"FAIL {type(e).__name__}: {str(e)[:200]}")
            ms = min(bench.measure("sdpa-cudnn", case)[0] for _ in range(2))
            row.append(f"{case.flops() / ms / 1e9:.0f}")
            print(f"| {d} | {causal} | {s} | " + " | ".join(row) + " |", flush=True)
