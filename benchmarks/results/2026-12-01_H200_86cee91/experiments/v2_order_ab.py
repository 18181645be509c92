"""Same-run A/B of v2's program order: one head's row blocks adjacent in a 1-D grid (the working
tree) against the head index varying fastest in a 2-D grid (old_v2.py beside this script:
`git show e0b3aaa:flashtile/kernels/v2.py > old_v2.py`), forward and backward, with outputs and
gradients compared bitwise first (the order changes no program's arithmetic)."""
import importlib.util
import json
import os
import sys

import torch

from flashtile import bench, flash_attn_func, ops

spec = importlib.util.spec_from_file_location("old_v2", os.path.join(os.path.dirname(__file__), "old_v2.py"))
sys.modules["old_v2"] = old_v2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old_v2)
MODULES = {"new": "flashtile.kernels.v2", "old": "old_v2"}


def use(name):
    ops._MODULES["v2"] = MODULES[name]


for d, causal in ((64, False), (128, True)):
    q, k, v = (torch.randn(2, 1000, 4, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    results = {}
    for name in MODULES:
        use(name)
        out = flash_attn_func(q, k, v, causal=causal, version="v2")
        results[name] = (out, *torch.autograd.grad(out, (q, k, v), dout))
    same = all(torch.equal(a, b) for a, b in zip(results["new"], results["old"]))
    print(f"d{d} causal={causal}: v2 outputs and gradients bitwise equal new/old: {same}", file=sys.stderr, flush=True)
    assert same

rows = []
for d in (64, 128):
    for causal in (False, True):
        for s in (1024, 4096, 16384):
            for mode in ("fwd", "bwd"):
                case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, mode)
                row = dict(d=d, causal=causal, seqlen=s, mode=mode)
                for rnd in range(2):
                    for name in MODULES:
                        use(name)
                        ms, _ = bench.measure("flashtile-v2", case)
                        row[name] = min(row.get(name, float("inf")), ms)
                use("new")
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)

print("v2 time, old order / new order (> 1: the new order faster), best of 2\n")
print("| d | causal | seqlen | fwd | bwd |")
print("|---|---|---|---|---|")
for i in range(0, len(rows), 2):
    f, b = rows[i], rows[i + 1]
    print(f"| {f['d']} | {f['causal']} | {f['seqlen']} | {f['old'] / f['new']:.2f} | {b['old'] / b['new']:.2f} |")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
