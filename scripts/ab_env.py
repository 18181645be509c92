"""Same-run A/B of settings: each variant is a set of environment variables (a forced kernel, a
tile override, a technique switched off), measured on bars cells in the same rounds as the
others and the baselines (bench.compare), the order rotated by one each round.

    python scripts/ab_env.py --cells "64 1024 plain fwd; 64 16384 causal fwd" \\
        --variant default: --variant again: --variant "three:FLASHTILE_CONFIG_V3_GLUON=128,3,3"

A variant is NAME: followed by space-separated KEY=VALUE pairs (none: the defaults); give one twice
under two names for the spread of a null comparison.  Cells and output as scripts/ab_module.py
(the first variant's time over each other's: > 1, that variant faster); --check compares each
variant's output (fwd) or gradients (bwd) with the first's, bit for bit.
"""
import argparse
import contextlib
import os
import sys
from unittest import mock

import torch

from ab_module import add_measurement_arguments, parse_cells, report, results
from flashtile import bench


def parse_variant(text):
    name, _, settings = text.partition(":")
    if not name or not _:
        raise ValueError(f"variant {text!r}: expected NAME:KEY=VALUE ...")
    return name, dict(kv.split("=", 1) for kv in settings.split())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME:KEY=VALUE ...")
    add_measurement_arguments(ap)
    args = ap.parse_args(argv)
    settings = dict(map(parse_variant, args.variant))
    cases = parse_cells(args.cells, args.tokens, args.hidden)
    variants = {name: (args.provider, lambda env=env: mock.patch.dict(os.environ, env)) for name, env in settings.items()}
    for provider in filter(None, args.baseline.split(",")):
        variants[provider] = (provider, contextlib.nullcontext)
    if args.check:
        device = bench.default_device()
        first, *others = settings
        for case in cases:
            with variants[first][1]():
                mine = results(case, args.provider, device)
            for name in others:
                with variants[name][1]():
                    theirs = results(case, args.provider, device)
                same = all(torch.equal(a, b) for a, b in zip(mine, theirs))
                print(f"{case}: {first} and {name} bitwise equal: {same}", file=sys.stderr)
    best = bench.compare(variants, cases, args.rounds)
    report(f"settings {settings}; {args.provider}", variants, cases, best, args.rounds, args.out,
           dict(provider=args.provider, variants=settings))


if __name__ == "__main__":
    main()
