"""Same-run A/B of the whole package: the working tree against a git revision, on bars cells,
with a null pair and baseline providers.

    python scripts/ab_revision.py extract cba9634        # here: .ab/flashtile_cba9634 (carry .ab to a GPU)
    python scripts/ab_revision.py run cba9634 --cells "128 8192 plain fwd; 64 1024 causal bwd" --out ab.json

``warm`` compiles every cell's kernels of both (one process per cell, --jobs at a time), so
that ``run`` measures with triton's cache filled.  ``extract`` copies the package as it was at
the revision (``git archive``) into
``.ab/flashtile_<rev>``, renamed so that it imports next to the tree's: its imports and its
torch.library namespace point at the new name.  ``run`` loads it and measures, in the same
rounds with their order rotated (bench.compare): "tree" (the working tree's v3), "rev" (the
revision's v3), "tree_again" (the spread two identical variants show on the machine) and the
--baseline providers.  Cells: "HEAD_DIM SEQLEN causal|plain fwd|bwd", ';'-separated, shapes as
the bars (batch x seqlen = --tokens, heads x head_dim = --hidden), or --bars for the bars grid
of some head dims.  Prints Markdown (each variant's best time, and tree's time over each other's: > 1, that
variant faster); --out writes JSON.
"""
import argparse
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

from flashtile import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BARS = [f"{d} {s} {mask} {mode}" for d in (64, 128, 256) for mask in ("plain", "causal")
        for s in (1024, 2048, 4096, 8192, 16384) for mode in ("fwd", "bwd")]


def package_name(rev):
    return "flashtile_" + re.sub(r"\W", "_", rev)


def extract(rev):
    """The package at ``rev`` as .ab/flashtile_<rev>, importable beside the tree's."""
    name = package_name(rev)
    target = os.path.join(ROOT, ".ab", name)
    shutil.rmtree(target, ignore_errors=True)
    archive = subprocess.run(["git", "archive", rev, "flashtile"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = os.path.join(target, os.path.relpath(member.name, "flashtile"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            text = tar.extractfile(member).read().decode()
            text = re.sub(r"\bflashtile(?=[.:\s])", name, text)  # imports and the op namespace
            with open(path, "w") as f:
                f.write(text)
    return target


def parse_cells(cells, tokens, hidden):
    cases = []
    for cell in cells:
        head_dim, seqlen, mask, mode = cell.split()
        if mask not in ("causal", "plain") or mode not in ("fwd", "bwd"):
            raise ValueError(f"cell {cell!r}: expected 'HEAD_DIM SEQLEN causal|plain fwd|bwd'")
        d, s = int(head_dim), int(seqlen)
        cases.append(bench.Case(tokens // s, hidden // d, hidden // d, s, s, d, mask == "causal", mode))
    return cases


def report(title, names, cases, best, rounds, out=None, meta=None):
    """Markdown of bench.compare's result: each variant's best ms per cell, and the first
    variant's time over each other's (> 1: that variant faster); ``out``: the same as JSON."""
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
              " | ".join(f"{times[first] / times[n]:.3f}" for n in names[1:]) + " |", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(dict(**(meta or {}), rounds=rounds, **bench.environment(), rows=rows), f, indent=1)


def add_revision_provider(rev_name):
    """Provider "rev-v3": the revision's v3, imported from .ab."""
    sys.path.insert(0, os.path.join(ROOT, ".ab"))
    rev = importlib.import_module(package_name(rev_name))

    def rev_v3(q, k, v, causal, kernel_options=None, **features):
        bench.plain_only("the revision's v3", features)
        return rev.flash_attn_func(q, k, v, causal=causal, version="v3")

    bench.PROVIDERS["rev-v3"] = rev_v3


def cells_of(args):
    if args.bars:
        dims = {int(d) for d in args.bars.split(",")}
        return [c for c in BARS if int(c.split()[0]) in dims]
    return [c.strip() for c in args.cells.split(";") if c.strip()]


def warm(args):
    """Each cell's kernels compiled, tree's and the revision's, a process per cell; exits
    non-zero if any process failed."""
    pending, cells, failed = [], cells_of(args), 0
    while cells or pending:
        while cells and len(pending) < args.jobs:
            pending.append(subprocess.Popen([sys.executable, __file__, "warm-one", args.rev, "--cells", cells.pop(),
                                             "--tokens", str(args.tokens), "--hidden", str(args.hidden)]))
        pending[0].wait()
        failed += sum(p.returncode != 0 for p in pending if p.poll() is not None)
        pending = [p for p in pending if p.poll() is None]
    if failed:
        sys.exit(f"{failed} warm-up process(es) failed")


def warm_one(args):
    import torch
    add_revision_provider(args.rev)
    for case in parse_cells(cells_of(args), args.tokens, args.hidden):
        for provider in ("flashtile-v3", "rev-v3"):
            bench.make_step(provider, case, torch.device("cuda"))()
    torch.cuda.synchronize()


def run(args):
    add_revision_provider(args.rev)
    cases = parse_cells(cells_of(args), args.tokens, args.hidden)
    variants = {"tree": ("flashtile-v3", None), "rev": ("rev-v3", None), "tree_again": ("flashtile-v3", None)}
    for provider in filter(None, args.baseline.split(",")):
        variants[provider] = (provider, None)
    best = bench.compare(variants, cases, args.rounds)
    report(f"flashtile v3, working tree against {args.rev}", list(variants), cases, best, args.rounds, args.out,
           dict(rev=args.rev))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("extract", "warm", "warm-one", "run"))
    ap.add_argument("rev")
    ap.add_argument("--cells", default="")
    ap.add_argument("--bars", default="", metavar="HEAD_DIMS",
                    help="the bars cells of these head dims (e.g. 64,128,256): causal and not x 1k-16k x fwd/bwd")
    ap.add_argument("--baseline", default="sdpa-cudnn", help="','-separated providers; '' for none")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--out", help="JSON file of the results")
    ap.add_argument("--jobs", type=int, default=12, help="warm: processes compiling at a time")
    args = ap.parse_args(argv)
    {"extract": lambda a: print(extract(a.rev)), "warm": warm, "warm-one": warm_one, "run": run}[args.action](args)


if __name__ == "__main__":
    main()
