"""Same-run A/B of the Gluon backward's program order: one head's row blocks adjacent in a 1-D
grid (the working tree) against the head index varying fastest in a 2-D grid (old_bwd.py beside
this script: `git show 7202f13:flashtile/kernels/v3_gluon_bwd.py > old_bwd.py`), each kernel
forced, with cuDNN; the two passes' gradients are compared bitwise (the order changes no CTA's
arithmetic)."""
import importlib.util
import json
import os
import sys

import torch

from flashtile import bench, flash_attn_func
from flashtile.kernels import v3, v3_gluon_bwd

spec = importlib.util.spec_from_file_location("old_bwd", os.path.join(os.path.dirname(__file__), "old_bwd.py"))
old_bwd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old_bwd)
MODULES = {"new": v3_gluon_bwd, "old": old_bwd}


def use(name):
    v3.v3_gluon_bwd = MODULES[name]


# Bitwise check of the two passes, new against old order.
for d, causal in ((64, False), (128, True), (256, False)):
    q, k, v = (torch.randn(2, 1000, 4, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    grads = {}
    for name in MODULES:
        use(name)
        out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        grads[name] = torch.autograd.grad(out, (q, k, v), dout)
    same = all(torch.equal(a, b) for a, b in zip(grads["new"], grads["old"]))
    print(f"d{d} causal={causal}: two-pass gradients bitwise equal new/old: {same}", file=sys.stderr, flush=True)
    assert same

rows = []
for d in (64, 128, 256):
    kernels = ("gluon", "gluon-reduce") if d < 256 else ("gluon",)
    for causal in (False, True):
        for s in (1024, 2048, 4096, 16384):
            case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "bwd")
            row = dict(d=d, causal=causal, seqlen=s)
            for rnd in range(2):
                for kernel in kernels:
                    for name in MODULES:
                        use(name)
                        ms, _ = bench.measure("flashtile-v3", case, env={"FLASHTILE_V3_BWD": kernel})
                        key = f"{kernel}_{name}"
                        row[key] = min(row.get(key, float("inf")), ms)
                use("new")
                ms, _ = bench.measure("sdpa-cudnn", case)
                row["cudnn"] = min(row.get("cudnn", float("inf")), ms)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

print("Backward time ratios (old / new: > 1 is the new order faster; cuDNN / new: >= 1 beats cuDNN), best of 2\n")
print("| d | causal | seqlen | two passes: old/new | cuDNN/new | single pass: old/new | cuDNN/new |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    cells = []
    for kernel in ("gluon", "gluon-reduce"):
        if f"{kernel}_new" in r:
            cells += [f"{r[kernel + '_old'] / r[kernel + '_new']:.2f}", f"{r['cudnn'] / r[kernel + '_new']:.2f}"]
        else:
            cells += ["", ""]
    print(f"| {r['d']} | {r['causal']} | {r['seqlen']} | " + " | ".join(cells) + " |")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
