"""FP8 accuracy by FlashAttention-3's protocol (its Table 3): output RMSE against float64.

Q, K, V are N(0, 1) + N(0, 100) * Bernoulli(0.001) in bf16; each float8 type (e4m3, e5m2) is
measured with one scale per tensor (FlashAttention-3's interface, descales per (sequence, KV
head) all equal), per (sequence, KV head) and per block of the kernel's tiles (fp8_attn_func),
each without and with incoherent processing; beside them bf16 v3 and PyTorch's bf16 attention.
Gradients: fp8_attn_func's (per block + incoherent) default backward and its FP8 backward against
bf16 v3's.  Writes the JSON
and prints the Markdown table docs/README.md shows.

    python scripts/fp8_accuracy.py --out fp8_accuracy.json          (GPU: b1, 4k, h16, d128)
    TRITON_INTERPRET=1 python scripts/fp8_accuracy.py --seqlen 64 --heads 2 --head-dim 32
"""
import argparse
import functools
import json

import torch

from flashtile import api, fp8, standard_attention
from flashtile import flash_attn_interface as fa3

TYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALINGS = ("tensor", "head", "block")


def protocol(shape, generator, device):
    """N(0, 1) + N(0, 100) * Bernoulli(0.001), in bf16."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    spikes = torch.randn(shape, generator=generator, dtype=torch.float64) * 10
    x = x + spikes * (torch.rand(shape, generator=generator, dtype=torch.float64) < 0.001)
    return x.to(device=device, dtype=torch.bfloat16)


def rmse(x, ref):
    return (x.double() - ref).square().mean().sqrt().item()


def per_tensor(q, k, v, causal, dtype, incoherent):
    """FlashAttention-3's interface with one scale per tensor (every (sequence, KV head) alike)."""
    if incoherent:
        rotation = fp8.rotation(q.shape[-1], q.device)
        q, k = ((x.float() @ rotation).to(torch.bfloat16) for x in (q, k))
    quantized, descales = [], []
    for x in (q, k, v):
        scale = x.float().abs().amax() / fp8.FP8_MAX[dtype]
        quantized.append((x.float() / scale).to(dtype))
        descales.append(scale.expand(x.shape[0], k.shape[2]).contiguous())
    return fa3.flash_attn_func(*quantized, causal=causal, q_descale=descales[0], k_descale=descales[1],
                               v_descale=descales[2])


def outputs(q, k, v, causal):
    """RMSE against float64 of every variant, by name."""
    ref = standard_attention(q.double(), k.double(), v.double(), causal=causal)
    errors = {"bf16_v3": rmse(api.flash_attn_func(q, k, v, causal=causal), ref),
              "bf16_pytorch": rmse(standard_attention(q, k, v, causal=causal), ref)}
    for name, dtype in TYPES.items():
        for incoherent in (False, True):
            suffix = "_incoherent" if incoherent else ""
            errors[f"{name}_tensor{suffix}"] = rmse(per_tensor(q, k, v, causal, dtype, incoherent), ref)
            for scaling in ("head", "block"):
                out = fp8.fp8_attn_func(q, k, v, causal=causal, dtype=dtype, incoherent=incoherent, scaling=scaling)
                errors[f"{name}_{scaling}{suffix}"] = rmse(out, ref)
    return errors


def gradients(q, k, v, generator):
    """dQ, dK, dV RMSE against float64 (non-causal) of bf16 v3 and of fp8_attn_func's two backwards."""
    doubles = [x.double().requires_grad_() for x in (q, k, v)]
    dout = torch.randn(q.shape, generator=generator, dtype=torch.float64).to(q.device)
    ref = torch.autograd.grad(standard_attention(*doubles), doubles, dout)
    errors = {}
    for name, fn in (("bf16_v3", api.flash_attn_func), ("e4m3_block_incoherent", fp8.fp8_attn_func),
                     ("e4m3_block_incoherent_fp8_backward", functools.partial(fp8.fp8_attn_func, fp8_backward=True))):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        grads = torch.autograd.grad(fn(*leaves), leaves, dout.to(q.dtype))
        errors[name] = [rmse(g, r) for g, r in zip(grads, ref)]
    return errors


def table(result):
    """The Markdown table of docs/README.md: non-causal / causal RMSE per type and scaling."""
    columns = [(s, inc) for inc in (False, True) for s in SCALINGS]
    names = {"tensor": "per tensor", "head": "per (sequence, KV head)", "block": "per block"}
    head = " | ".join(names[s] + (" + incoherent" if inc else "") for s, inc in columns)
    lines = [f"| | {head} |", "|---" * (len(columns) + 1) + "|"]
    for name in TYPES:
        cells = [" / ".join(f"{result[c][f'{name}_{s}' + ('_incoherent' if inc else '')]:.2e}"
                            for c in ("non-causal", "causal")) for s, inc in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "bf16 v3: " + " / ".join(f"{result[c]['bf16_v3']:.2e}" for c in ("non-causal", "causal"))
              + "; PyTorch bf16: " + " / ".join(f"{result[c]['bf16_pytorch']:.2e}" for c in ("non-causal", "causal")),
              "gradients dQ, dK, dV: " + "; ".join(f"{k} " + ", ".join(f"{x:.2e}" for x in v)
                                                 for k, v in result["gradients"].items())]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="fp8_accuracy.json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (protocol(shape, generator, device) for _ in range(3))
    result = dict(shape=dict(zip(("batch", "seqlen", "heads", "head_dim"), shape)),
                  **{name: outputs(q, k, v, causal) for name, causal in (("non-causal", False), ("causal", True))},
                  gradients=gradients(q, k, v, generator))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
