"""Same-run measurements of the Gluon backward (H200): the working tree's module against
old_bwd.py (the last commit's) with a null pair; d64 tile configs; the single pass against the
two passes at the routing boundaries; each with cuDNN."""
import contextlib
import importlib.util
import json
import os
import sys
from unittest import mock

import torch

from flashtile import bench, flash_attn_func
from flashtile.kernels import v3, v3_gluon_bwd

spec = importlib.util.spec_from_file_location("old_bwd", os.path.join(os.path.dirname(__file__), "old_bwd.py"))
old_bwd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old_bwd)
out_dir = sys.argv[1]
part = sys.argv[2]


@contextlib.contextmanager
def setup(module=v3_gluon_bwd, **env):
    saved = v3.v3_gluon_bwd
    v3.v3_gluon_bwd = module
    try:
        with mock.patch.dict(os.environ, env):
            yield
    finally:
        v3.v3_gluon_bwd = saved


def case(d, causal, s):
    return bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "bwd")


def run(name, variants, cells, rounds):
    rows = []
    for kernel, group in cells:
        cases = [case(*c) for c in group]
        vs = {n: (p, (lambda f=f, kernel=kernel: f(kernel))) for n, (p, f) in variants.items()}
        for c, times in zip(cases, bench.compare(vs, cases, rounds)):
            row = dict(d=c.d, causal=c.causal, seqlen=c.sq, kernel=kernel, **times)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    json.dump(rows, open(os.path.join(out_dir, f"{name}.json"), "w"), indent=1)
    names = list(variants)
    base = names[0]
    print(f"\n### {name}: backward ms, best of {rounds} (variant order reversed every other round); "
          f"ratios {base} time / variant time (> 1: the variant faster)\n")
    print("| d | causal | seqlen | kernel | " + " | ".join(names) + " | " +
          " | ".join(f"{base}/{n}" for n in names[1:]) + " |")
    print("|---" * (4 + 2 * len(names) - 1) + "|")
    for r in rows:
        print(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['kernel']} | " +
              " | ".join(f"{r[n]:.3f}" for n in names) + " | " +
              " | ".join(f"{r[base] / r[n]:.3f}" for n in names[1:]) + " |", flush=True)


def kernel_env(kernel, **extra):
    return dict(FLASHTILE_V3_BWD=kernel, **extra) if kernel else extra


if part == "ab":
    # Gradients of the two passes, HEAD against 146aa2b (also with 3 persistent CTAs).
    for d, causal, hq, hk in ((64, False, 16, 16), (128, False, 16, 4), (128, True, 16, 16), (256, True, 8, 8)):
        q = torch.randn(4, 1000, hq, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        k, v = (torch.randn(4, 1000, hk, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        grads = {}
        for name, module in (("old", old_bwd), ("head", v3_gluon_bwd)):
            with setup(module):
                out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
                grads[name] = torch.autograd.grad(out, (q, k, v), dout)
        same = all(torch.equal(a, b) for a, b in zip(grads["old"], grads["head"]))
        print(f"d{d} causal={causal} h{hq}/{hk}: two-pass gradients of HEAD bitwise equal 146aa2b's: {same}",
              file=sys.stderr, flush=True)
    variants = {"head": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, **kernel_env(k))),
                "old": ("flashtile-v3", lambda k: setup(old_bwd, **kernel_env(k))),
                "head_again": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, **kernel_env(k))),
                "cudnn": ("sdpa-cudnn", lambda k: setup())}
    run("ab_head_146aa2b", variants,
        [("gluon", [(128, True, 1024), (128, True, 2048), (128, True, 4096), (64, True, 2048), (128, False, 2048),
                    (64, False, 2048), (256, False, 1024), (256, True, 2048)]),
         ("gluon-reduce", [(128, False, 16384), (128, True, 16384), (64, False, 8192)])], 3)
elif part == "dynamic":
    for d, causal, window, hq, hk in ((64, True, (-1, -1), 16, 16), (128, True, (-1, -1), 16, 4),
                                      (128, False, (100, 20), 16, 16), (64, False, (-1, -1), 16, 16)):
        q = torch.randn(4, 1000, hq, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        k, v = (torch.randn(4, 1000, hk, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        grads = {}
        for name, module in (("old", old_bwd), ("new", v3_gluon_bwd)):
            with setup(module):
                out = flash_attn_func(q, k, v, causal=causal, window_size=window, deterministic=True)
                grads[name] = torch.autograd.grad(out, (q, k, v), dout)
        same = all(torch.equal(a, b) for a, b in zip(grads["old"], grads["new"]))
        print(f"d{d} causal={causal} window={window} h{hq}/{hk}: two-pass gradients bitwise equal the last "
              f"commit's: {same}", file=sys.stderr, flush=True)
    variants = {"new": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, **kernel_env(k))),
                "old": ("flashtile-v3", lambda k: setup(old_bwd, **kernel_env(k))),
                "new_again": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, **kernel_env(k))),
                "cudnn": ("sdpa-cudnn", lambda k: setup())}
    run("dynamic_bwd", variants,
        [("gluon", [(64, True, 1024), (64, True, 2048), (64, True, 4096), (64, True, 8192), (128, True, 1024),
                    (128, True, 2048), (128, True, 4096), (128, False, 1024), (64, False, 2048),
                    (256, True, 1024)]),
         ("gluon-reduce", [(128, False, 4096), (64, True, 8192)])], 3)
elif part == "dynamic2":
    variants = {"new": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, **kernel_env(k))),
                "old": ("flashtile-v3", lambda k: setup(old_bwd, **kernel_env(k))),
                "new_again": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, **kernel_env(k))),
                "cudnn": ("sdpa-cudnn", lambda k: setup())}
    run("dynamic_bwd_2", variants,
        [("gluon", [(64, True, 1024), (64, True, 2048), (64, True, 4096), (128, True, 1024), (256, True, 1024),
                    (256, False, 2048)]),
         ("gluon-reduce", [(128, False, 4096), (128, True, 4096), (64, True, 8192)])], 3)
elif part == "route2":
    variants = {"two": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, FLASHTILE_V3_BWD="gluon")),
                "one": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, FLASHTILE_V3_BWD="gluon-reduce")),
                "cudnn": ("sdpa-cudnn", lambda k: setup())}
    run("routing_2", variants,
        [("", [(128, True, 2048), (128, True, 4096), (128, False, 2048), (64, True, 4096), (64, True, 8192),
               (64, False, 4096)])], 2)
elif part == "tiles":
    cfg = lambda c: (lambda k: setup(v3_gluon_bwd, **kernel_env(k, FLASHTILE_CONFIG_V3_GLUON_BWD=c)))
    variants = {"64,64,3": ("flashtile-v3", cfg("64,64,3")), "64,128,3": ("flashtile-v3", cfg("64,128,3")),
                "64,64,4": ("flashtile-v3", cfg("64,64,4")), "64,128,4": ("flashtile-v3", cfg("64,128,4")),
                "cudnn": ("sdpa-cudnn", lambda k: setup())}
    run("d64_tiles", variants,
        [("gluon", [(64, False, 1024), (64, False, 4096), (64, True, 4096)]),
         ("gluon-reduce", [(64, False, 16384), (64, True, 16384)])], 2)
elif part == "route":
    variants = {"two": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, FLASHTILE_V3_BWD="gluon")),
                "one": ("flashtile-v3", lambda k: setup(v3_gluon_bwd, FLASHTILE_V3_BWD="gluon-reduce")),
                "cudnn": ("sdpa-cudnn", lambda k: setup())}
    run("routing", variants,
        [("", [(128, False, 2048), (128, False, 4096), (128, False, 8192), (128, True, 4096), (128, True, 8192),
               (64, False, 4096), (64, False, 8192), (64, False, 16384), (64, True, 8192), (64, True, 16384)])], 2)
