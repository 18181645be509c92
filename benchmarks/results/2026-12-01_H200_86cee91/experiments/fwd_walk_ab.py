"""Same-run A/B of the Gluon forward's tile walk: heads walked together as L2_BUDGET allows
(32 MB of K/V: the tiles of up to that many heads interleaved, the head varying fastest) against
one head at a time (its row blocks adjacent) and an 8 MB budget; with cuDNN. Outputs bitwise
compared (the walk changes no tile's arithmetic)."""
import json
import sys

import torch

from flashtile import bench, flash_attn_func
from flashtile.kernels import v3_gluon

BUDGETS = {"32MB": 32 * 2**20, "8MB": 8 * 2**20, "1head": 0}


def use(name):
    v3_gluon.L2_BUDGET = BUDGETS[name]


for d, causal in ((64, True), (128, False), (256, True)):
    q, k, v = (torch.randn(4, 1000, 8, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    outs = {}
    for name in BUDGETS:
        use(name)
        outs[name] = flash_attn_func(q, k, v, causal=causal)
    same = all(torch.equal(outs["32MB"], o) for o in outs.values())
    print(f"d{d} causal={causal}: outputs bitwise equal across walks: {same}", file=sys.stderr, flush=True)
    assert same

rows = []
for d in (64, 128, 256):
    for causal in (False, True):
        for s in (1024, 2048, 4096, 16384):
            case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "fwd")
            row = dict(d=d, causal=causal, seqlen=s)
            for rnd in range(2):
                for name in BUDGETS:
                    use(name)
                    ms, _ = bench.measure("flashtile-v3", case)
                    row[name] = min(row.get(name, float("inf")), ms)
                use("32MB")
                ms, _ = bench.measure("sdpa-cudnn", case)
                row["cudnn"] = min(row.get("cudnn", float("inf")), ms)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

print("Forward time ratios, best of 2: walk X against the 32 MB walk (32MB / X: > 1 is X faster); cuDNN / X\n")
print("| d | causal | seqlen | 8MB | 1head | cuDNN/32MB | cuDNN/8MB | cuDNN/1head |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['32MB'] / r['8MB']:.2f} | {r['32MB'] / r['1head']:.2f} | "
          f"{r['cudnn'] / r['32MB']:.2f} | {r['cudnn'] / r['8MB']:.2f} | {r['cudnn'] / r['1head']:.2f} |")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
