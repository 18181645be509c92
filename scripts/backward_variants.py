"""v3's backward kernels side by side, in one run: the single Gluon pass with dQ by TMA
reduce-add, the two Gluon passes, v2's two passes, and SDPA cuDNN; TFLOP/s, best of --repeats.

Each kernel is forced with FLASHTILE_V3_BWD, so the cells where configs.v3_backward would pick
another one show what that choice costs.  Shapes as the bars: batch x seqlen = --tokens,
heads x head_dim = --hidden.  Prints Markdown; --out writes JSON records.
"""
import argparse
import json

from flashtile import bench

VARIANTS = [("one Gluon pass, TMA reduce-add", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon-reduce"}),
            ("two Gluon passes", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon"}),
            ("v2's two passes", "flashtile-v3", {"FLASHTILE_V3_BWD": "v2"}),
            ("SDPA cuDNN", "sdpa-cudnn", {})]


def _variant(spec):
    """"NAME:KEY=VALUE;KEY=VALUE" -> (NAME, "flashtile-v3", {KEY: VALUE, ...})."""
    name, _, switches = spec.partition(":")
    return name, "flashtile-v3", dict(kv.split("=", 1) for kv in switches.split(";") if kv)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="1024,2048,4096,16384")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE;...",
                    help="one more column: flashtile-v3 under these kernel switches (repeatable)")
    ap.add_argument("--out")
    args = ap.parse_args()
    variants = VARIANTS[:-1] + [_variant(v) for v in args.variant] + VARIANTS[-1:]
    env = bench.environment()
    print(f"v3 backward kernels, bf16, {env['gpu']}, commit {env['commit']}, {env['date']}; TFLOP/s\n")
    print("| d | causal | seqlen | " + " | ".join(name for name, _, _ in variants) + " |")
    print("|---" * (3 + len(variants)) + "|")
    records = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in args.seqlens.split(",")):
                case = bench.Case(max(1, args.tokens // s), args.hidden // d, args.hidden // d, s, s, d, causal, "bwd")
                cells = []
                for name, provider, overrides in variants:
                    try:
                        ms = min(bench.measure(provider, case, env=overrides)[0] for _ in range(args.repeats))
                    except Exception as e:  # a peer missing here (no cuDNN on a CPU) is a result too
                        cells.append(f"failed: {type(e).__name__}")
                        continue
                    tflops = case.flops() / ms / 1e9
                    cells.append(f"{tflops:.0f}")
                    records.append(dict(kernels=name, provider=provider, overrides=overrides, d=d, causal=causal,
                                        seqlen=s, b=case.b, h=case.h, ms=ms, tflops=tflops, **env))
                print(f"| {d} | {'yes' if causal else 'no'} | {s} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
