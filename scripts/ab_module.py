"""Same-run A/B of one kernel module: the working tree's file against the same file at a git
revision, on bars cells, with a null pair and baseline providers.

    python scripts/ab_module.py flashtile/kernels/v3_gluon_bwd.py --rev HEAD~1 --at flashtile.kernels.v3 \\
        --cells "128 1024 causal bwd; 64 2048 plain bwd" --env FLASHTILE_V3_BWD=gluon --check

The file at REV (``git show``) is loaded as a module of its own and put in place of the tree's
where module ``--at`` refers to it (its attribute of the file's name), for that variant's
measurements only.  Variants: "tree", "rev", "tree_again" (the tree's once more: the spread
two identical variants show on the machine) and the --baseline providers, all measured in the
same rounds, their order rotated by one each round (bench.compare), --env set for all of them.
Cells: "HEAD_DIM SEQLEN causal|plain fwd|bwd", ';'-separated (as gpu_check.sh's PROFILE_CASES),
shapes as the bars (batch x seqlen = --tokens, heads x head_dim = --hidden).  --check compares
each cell's output (fwd) or gradients (bwd) of tree and rev bit for bit on one set of inputs
(meaningful for kernels that are deterministic).  Prints Markdown (each variant's best time, and tree's time over each
other's: > 1, that variant faster); --out writes JSON.
"""
import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

import torch

from flashtile import bench


def module_at_revision(path, rev, directory, rev_file=None):
    """The file ``path`` as it was at git revision ``rev`` (or the copy of it in ``rev_file``),
    loaded as a module of its own (from a copy in ``directory``: Triton reads a kernel's source
    from its file)."""
    if rev_file:
        with open(rev_file) as f:
            source = f.read()
    else:
        source = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                                check=True).stdout
    name = f"{os.path.splitext(os.path.basename(path))[0]}_at_{rev.replace('~', '_').replace('^', '_')}"
    copy = os.path.join(directory, f"{name}.py")
    with open(copy, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def swapped(owner, attribute, module, env):
    """``owner.attribute`` is ``module`` and ``env`` is set, inside the block only."""
    saved = getattr(owner, attribute)
    setattr(owner, attribute, module)
    try:
        with mock.patch.dict(os.environ, env):
            yield
    finally:
        setattr(owner, attribute, saved)


def parse_cells(text, tokens, hidden):
    cases = []
    for cell in filter(None, (c.strip() for c in text.split(";"))):
        head_dim, seqlen, mask, mode = cell.split()
        if mask not in ("causal", "plain") or mode not in ("fwd", "bwd"):
            raise ValueError(f"cell {cell!r}: expected 'HEAD_DIM SEQLEN causal|plain fwd|bwd'")
        d, s = int(head_dim), int(seqlen)
        cases.append(bench.Case(tokens // s, hidden // d, hidden // d, s, s, d, mask == "causal", mode))
    return cases


def add_measurement_arguments(ap):
    """What the A/B scripts share: the cells, the provider measured, baselines, rounds, the bars'
    shapes, the bitwise check and the JSON output."""
    ap.add_argument("--cells", required=True)
    ap.add_argument("--provider", default="flashtile-v3")
    ap.add_argument("--baseline", default="sdpa-cudnn", help="','-separated providers; '' for none")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", help="JSON file of the results")


def results(case, provider, device):
    """The provider's output (fwd) or q, k, v gradients (bwd) on inputs seeded the same each call."""
    torch.manual_seed(0)
    q = torch.randn(case.b, case.sq, case.h, case.d, dtype=case.torch_dtype, device=device)
    k = torch.randn(case.b, case.sk, case.h_k, case.d, dtype=case.torch_dtype, device=device)
    v = torch.randn_like(k)
    if case.mode == "fwd":
        with torch.no_grad():
            return (bench.PROVIDERS[provider](q, k, v, case.causal),)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = bench.PROVIDERS[provider](q, k, v, case.causal)
    return torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="the module's file, relative to the repository root")
    ap.add_argument("--rev", default="HEAD", help="the git revision to compare the working tree's file with")
    ap.add_argument("--rev-file", help="the file as it was at --rev, where git does not have that revision")
    ap.add_argument("--at", required=True, help="the module that refers to it, e.g. flashtile.kernels.v3")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    add_measurement_arguments(ap)
    args = ap.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env)
    owner = importlib.import_module(args.at)
    attribute = os.path.splitext(os.path.basename(args.path))[0]
    tree = getattr(owner, attribute, None)
    if tree is None or os.path.abspath(tree.__file__) != os.path.abspath(args.path):
        sys.exit(f"{args.at} has no attribute {attribute} that is {args.path}")
    cases = parse_cells(args.cells, args.tokens, args.hidden)
    with tempfile.TemporaryDirectory() as directory:
        rev = module_at_revision(args.path, args.rev, directory, args.rev_file)
        variants = {"tree": (args.provider, lambda: swapped(owner, attribute, tree, env)),
                    "rev": (args.provider, lambda: swapped(owner, attribute, rev, env)),
                    "tree_again": (args.provider, lambda: swapped(owner, attribute, tree, env))}
        for provider in filter(None, args.baseline.split(",")):
            variants[provider] = (provider, contextlib.nullcontext)
        if args.check:
            device = bench.default_device()
            for case in cases:
                with swapped(owner, attribute, tree, env):
                    mine = results(case, args.provider, device)
                with swapped(owner, attribute, rev, env):
                    theirs = results(case, args.provider, device)
                same = all(torch.equal(a, b) for a, b in zip(mine, theirs))
                print(f"{case}: tree and {args.rev} bitwise equal: {same}", file=sys.stderr)
        best = bench.compare(variants, cases, args.rounds)
    report(f"{args.path}: working tree against {args.rev}; {args.provider}, {env or 'no switches'}", variants,
           cases, best, args.rounds, args.out, dict(path=args.path, rev=args.rev, provider=args.provider, env=env))


def report(title, variants, cases, best, rounds, out=None, meta=None):
    """Markdown of bench.compare's result: each variant's best ms per cell, and the first
    variant's time over each other's (> 1: that variant faster); ``out``: the same as JSON."""
    names = list(variants)
    first = names[0]
    print(f"{title}; {bench.environment()['gpu']}; ms, best of {rounds} rounds\n")
    print("| d | causal | seqlen | mode | " + " | ".join(names) + " | " +
          " | ".join(f"{first}/{n}" for n in names[1:]) + " |")
    print("|---" * (4 + 2 * len(names) - 1) + "|")
    rows = []
    for case, times in zip(cases, best):
        rows.append(dict(d=case.d, causal=case.causal, seqlen=case.sq, mode=case.mode, **times))
        print(f"| {case.d} | {case.causal} | {case.sq} | {case.mode} | " +
              " | ".join(f"{times[n]:.3f}" for n in names) + " | " +
              " | ".join(f"{times[first] / times[n]:.3f}" for n in names[1:]) + " |")
    if out:
        with open(out, "w") as f:
            json.dump(dict(**(meta or {}), rounds=rounds, **bench.environment(), rows=rows), f, indent=1)

if __name__ == "__main__":
    main()
