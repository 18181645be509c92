import os, itertools
from unittest import mock
from flashtile import bench
from flashtile.kernels import v3_gluon
VARIANTS = [("shipped", {}, None), ("dynamic", {}, "dyn"), ("nonpersistent", {"FLASHTILE_V3_ABLATE": "persistent"}, None),
            ("flat", {}, 1 << 60), ("group1", {}, 0), ("nonpersistent+flat", {"FLASHTILE_V3_ABLATE": "persistent"}, 1 << 60)]
CASES = [(d, True, s) for d in (64, 128, 256) for s in (1024, 4096)] + [(128, False, 1024), (128, True, 16384), (256, False, 1024)]
base = v3_gluon.L2_BUDGET
for d, causal, s in CASES:
    case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "fwd")
    cells = []
    ms, _ = bench.measure("sdpa-cudnn", case); cud = case.flops() / ms / 1e9
    for name, env, budget in VARIANTS:
        v3_gluon.DYNAMIC = budget == "dyn"
        v3_gluon.L2_BUDGET = base if budget in (None, "dyn") else budget
        with mock.patch.dict(os.environ, env):
            ms, _ = bench.measure("flashtile-v3", case)
        cells.append(f"{name} {case.flops() / ms / 1e9:.0f}")
    print(f"d{d} causal={causal} s{s}: cudnn {cud:.0f} | " + " | ".join(cells), flush=True)
