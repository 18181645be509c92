"""Same-run A/B of the Gluon backward: the working tree's module (a CTA per SM over tiles of
equal length with two stationary slots, "new"; the same module with a CTA per tile, "new1")
against old_bwd.py (HEAD's module), each kernel forced, with cuDNN.  The two passes'
gradients are compared bitwise, also with 3 CTAs each taking many tiles."""
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
real_sm_count = v3_gluon_bwd.sm_count


def use(name, sms=None):
    v3.v3_gluon_bwd = old_bwd if name == "old" else v3_gluon_bwd
    v3_gluon_bwd.PERSISTENT = name != "new1"  # new1: a CTA per tile, one slot
    v3_gluon_bwd.sm_count = (lambda index: sms) if sms else real_sm_count


for d, causal, hq, hk in ((64, False, 16, 16), (128, False, 16, 4), (128, True, 16, 16), (256, False, 8, 8)):
    q = torch.randn(4, 1000, hq, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k, v = (torch.randn(4, 1000, hk, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    grads = {}
    for name, sms in (("old", None), ("new", None), ("new", 3), ("new1", None)):
        use(name, sms)
        out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        grads[(name, sms)] = torch.autograd.grad(out, (q, k, v), dout)
    for key in grads:
        same = all(torch.equal(a, b) for a, b in zip(grads[key], grads[("old", None)]))
        print(f"d{d} causal={causal} h{hq}/{hk}: two-pass gradients {key} bitwise equal old: {same}",
              file=sys.stderr, flush=True)
use("new")

CELLS = []
for d in (64, 128):
    for causal in (False, True):
        for s in (1024, 2048, 4096):
            CELLS.append((d, causal, s, "gluon", ("old", "new") if causal else ("old", "new1", "new")))
CELLS += [(64, False, 8192, "gluon-reduce", ("old", "new")), (128, False, 16384, "gluon-reduce", ("old", "new")),
          (128, True, 16384, "gluon-reduce", ("old", "new")), (256, False, 1024, "gluon", ("old", "new")),
          (256, True, 1024, "gluon", ("old", "new"))]

rows = {}
for rnd in range(2):
    for d, causal, s, kernel, names in CELLS:
        case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "bwd")
        row = rows.setdefault((d, causal, s, kernel), dict(d=d, causal=causal, seqlen=s, kernel=kernel))
        for name in names:
            use(name)
            ms, _ = bench.measure("flashtile-v3", case, env={"FLASHTILE_V3_BWD": kernel})
            row[name] = min(row.get(name, float("inf")), ms)
        use("new")
        ms, _ = bench.measure("sdpa-cudnn", case)
        row["cudnn"] = min(row.get("cudnn", float("inf")), ms)
        print(json.dumps(row), file=sys.stderr, flush=True)
    json.dump(list(rows.values()), open(sys.argv[1], "w"), indent=1)

print("Backward time ratios, best of 2: old / new (> 1: the new module faster), cuDNN / new (>= 1: at or above cuDNN)\n")
print("| d | causal | seqlen | kernels | old/new | old/new1 (a CTA per tile) | cuDNN/new | cuDNN/old |")
print("|---|---|---|---|---|---|---|---|")
for r in rows.values():
    new1 = f"{r['old'] / r['new1']:.3f}" if "new1" in r else ""
    print(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['kernel']} | {r['old'] / r['new']:.3f} | {new1} | "
          f"{r['cudnn'] / r['new']:.3f} | {r['cudnn'] / r['old']:.3f} |")
