"""One small forward + backward of every kernel, for ``compute-sanitizer --tool memcheck``.

Each version (v1, v2, v3) on shapes that hit every code path once: sequence lengths that are not
block multiples (masked tails), a block-multiple length (v3's unmasked TMA path), causal with
seqlen_q != seqlen_k, a sliding window, GQA, varlen, and head dims that need padding.  Prints
one line per case; memcheck reports any out-of-bounds or misaligned access.
"""
import argparse

import torch

from flashtile import flash_attn_func, flash_attn_varlen_func

# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window)
CASES = [
    (1, 200, 200, 2, 2, 64, False, (-1, -1)),
    (1, 256, 256, 2, 2, 128, False, (-1, -1)),
    (2, 77, 300, 4, 2, 96, True, (-1, -1)),
    (1, 190, 190, 2, 1, 256, False, (32, 0)),
    (4, 1000, 1000, 8, 8, 64, True, (-1, -1)),  # more tiles than SMs: v3's persistent walks wrap
    (4, 1000, 1000, 8, 8, 64, False, (-1, -1)),  # (the counter's for causal tiles, the stride's here)
    (4, 1000, 1000, 8, 8, 128, True, (-1, -1)),
    (4, 1000, 1000, 8, 4, 256, False, (-1, -1)),  # d256's shared O staging buffer, over many tiles per CTA
    (2, 2100, 2100, 8, 8, 64, False, (-1, -1)),  # v3's three-consumer forward (192-row tiles), wrapping
    (1, 8200, 8200, 2, 2, 64, True, (-1, -1)),   # the same on a band (tiles from the counter)
]


def run(version, case, device):
    b, sq, sk, hq, hk, d, causal, window = case
    q = torch.randn(b, sq, hq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, version=version)
    out.backward(torch.randn_like(out))
    if device == "cuda":
        torch.cuda.synchronize()


def run_varlen(version, device):
    lens = torch.tensor([0, 37, 37 + 130, 37 + 130 + 64], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(int(lens[-1]), 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, lens, lens, 130, 130, causal=True, version=version)
    out.backward(torch.randn_like(out))
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--versions", default="v1,v2,v3")
    ap.add_argument("--device", default="cuda", help="cpu runs the kernels under TRITON_INTERPRET=1")
    args = ap.parse_args()
    for version in args.versions.split(","):
        for case in CASES:
            run(version, case, args.device)
            print(f"{version} {case} ok", flush=True)
        run_varlen(version, args.device)
        print(f"{version} varlen ok", flush=True)


if __name__ == "__main__":
    main()
