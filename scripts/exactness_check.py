"""Exactness on the GPU: max |error| against float64 of flashtile v1/v2/v3 and of standard
attention in the same dtype, for the output and the three gradients (bf16, b2 h8).

Writes JSON records and prints a Markdown table; the error ratio to standard attention is
what the FlashAttention accuracy rule bounds (<= 2 for the output, <= 3 for gradients).

    python scripts/exactness_check.py --out exactness.json > exactness.md
"""
import argparse
import json

import torch

from flashtile import bench, flash_attn_func, standard_attention

NAMES = ("out", "dq", "dk", "dv")


def errors(fn, q, k, v, dout, oracle):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    values = (out, *torch.autograd.grad(out, leaves, dout))
    return {n: (x.double() - ref).abs().max().item() for n, x, ref in zip(NAMES, values, oracle)}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--out", default="exactness.json")
    args = ap.parse_args()
    env = bench.environment()
    records = []
    print("| d | causal | seqlen | implementation | out | dq | dk | dv | out / standard |")
    print("|---" * 9 + "|")
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in args.seqlens.split(",")):
                q, k, v = (torch.randn(2, s, 8, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                dout = torch.randn_like(q)
                leaves = [x.double().requires_grad_() for x in (q, k, v)]
                ref = standard_attention(*leaves, causal=causal, upcast=True)
                oracle = (ref.detach(), *torch.autograd.grad(ref, leaves, dout.double()))
                del leaves, ref
                impls = {"standard": lambda a, b, c: standard_attention(a, b, c, causal=causal)}
                for version in ("v1", "v2", "v3"):
                    impls[f"flashtile-{version}"] = (
                        lambda a, b, c, version=version: flash_attn_func(a, b, c, causal=causal, version=version))
                base = None
                for name, fn in impls.items():
                    err = errors(fn, q, k, v, dout, oracle)
                    base = base or err
                    records.append(dict(provider=name, d=d, causal=causal, sq=s, sk=s, b=2, h=8,
                                        dtype="bf16", **{f"max_err_{n}": e for n, e in err.items()}, **env))
                    print(f"| {d} | {causal} | {s} | {name} | " + " | ".join(f"{err[n]:.2e}" for n in NAMES)
                          + f" | {err['out'] / base['out']:.2f} |", flush=True)
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
