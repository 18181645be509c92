"""One small forward + backward of every kernel, for ``compute-sanitizer --tool memcheck``.

Each version (v1, v2, v3) on shapes that hit every code path once: sequence lengths that are not
block multiples (masked tails), a block-multiple length (v3's unmasked TMA path), causal with
seqlen_q != seqlen_k, a sliding window, GQA, varlen (with offsets given as a strided view),
softcap, ALiBi, sinks, head dims that need padding, and V with a head dim of its own; with v3,
float8 inputs (FlashAttention-3's interface, and fp8_attn_func per block with both backwards:
the FP8 one on the float8 Gluon passes, or with ``backward=v2`` on v2's kernels); with
"kvcache", flash_attn_with_kvcache's kernels (append, rotation, split, combine) over contiguous
and paged caches, batched and packed, on valid tables and on tables out of every range (which
the kernels clamp).  Prints one line per case; memcheck
reports any out-of-bounds or misaligned access.

    compute-sanitizer --tool memcheck python scripts/sanitize_cases.py --kernel-options "backward=gluon"
"""
import argparse

import torch

from flashtile import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, fp8
from flashtile import flash_attn_interface as fa3

# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window, softcap)
CASES = [
    (1, 200, 200, 2, 2, 64, False, (-1, -1), 0.0),
    (1, 256, 256, 2, 2, 128, False, (-1, -1), 0.0),
    (2, 77, 300, 4, 2, 96, True, (-1, -1), 0.0),
    (1, 190, 190, 2, 1, 256, False, (32, 0), 0.0),
    (1, 190, 190, 2, 1, 60, True, (-1, -1), 0.0),  # a head dim padded to a multiple of 8
    (4, 1000, 1000, 8, 8, 64, True, (-1, -1), 0.0),  # more tiles than SMs: v3's persistent walks wrap
    (4, 1000, 1000, 8, 8, 64, False, (-1, -1), 0.0),  # (the counter's for causal tiles, the stride's here)
    (4, 1000, 1000, 8, 8, 128, True, (-1, -1), 30.0),
    (4, 1000, 1000, 8, 4, 256, False, (-1, -1), 0.0),  # d256's shared O staging buffer, over many tiles per CTA
    (2, 2100, 2100, 8, 8, 64, False, (-1, -1), 0.0),  # v3's three-consumer forward (192-row tiles), wrapping
    (1, 8200, 8200, 2, 2, 64, True, (-1, -1), 0.0),   # the same on a band (tiles from the counter)
]
# Run with ALiBi, one slope per (batch, head): the slopes read through the score hook's pointer;
# and with sinks (their join and gradient kernels).
ALIBI_CASES = [
    (2, 77, 300, 4, 2, 96, True, (-1, -1), 0.0),
    (2, 300, 200, 4, 4, 128, False, (64, 16), 30.0),
]

# V with a head dim of its own (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, head_dim_v,
# causal): MLA's 192 / 128 (d256's tiles, S over 192 lanes), 128 / 64, lengths off the blocks.
OWN_V_CASES = [
    (1, 190, 333, 2, 1, 192, 128, True),
    (2, 300, 300, 4, 2, 128, 64, False),
]

# Float8 inputs (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal): key counts off
# 16 (V's keys-contiguous copy is padded), GQA, each head dim, and a d64 band (v2's FP8 forward).
FP8_CASES = [
    (2, 77, 300, 4, 2, 128, True),
    (1, 190, 190, 2, 1, 256, False),
    (4, 1000, 1000, 8, 8, 64, False),
    (1, 421, 421, 2, 2, 64, True),
]


def slopes(batch, heads, device):
    return torch.rand(batch, heads, device=device) * 0.5


def run(version, case, device, kernel_options, alibi=False):
    b, sq, sk, hq, hk, d, causal, window, softcap = case
    q = torch.randn(b, sq, hq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.randn(hq, device=device, requires_grad=True) if alibi else None
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, version=version,
                          alibi_slopes=slopes(b, hq, device) if alibi else None, sinks=sinks,
                          kernel_options=kernel_options)
    out.backward(torch.randn_like(out))
    if device == "cuda":
        torch.cuda.synchronize()


def run_own_v(version, case, device, kernel_options):
    b, sq, sk, hq, hk, d, dv, causal = case
    q = torch.randn(b, sq, hq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hk, dv, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal, version=version, kernel_options=kernel_options)
    out.backward(torch.randn_like(out))
    if device == "cuda":
        torch.cuda.synchronize()


def run_fp8(case, device, kernel_options):
    b, sq, sk, hq, hk, d, causal = case
    q = torch.randn(b, sq, hq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x.detach(), hk, torch.float8_e4m3fn) for x in (q, k, v))
    fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    for fp8_backward in (False, True):
        out = fp8.fp8_attn_func(q, k, v, causal=causal, fp8_backward=fp8_backward, kernel_options=kernel_options)
        out.backward(torch.randn_like(out))
    if device == "cuda":
        torch.cuda.synchronize()


def run_varlen(version, device, kernel_options):
    # The offsets as one column of a (batch + 1, 2) table: a strided view.
    table = torch.tensor([[0, 0], [37, 37], [167, 167], [231, 231]], dtype=torch.int32, device=device)
    lens = table[:, 0]
    q, k, v = (torch.randn(231, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, lens, lens, 130, 130, causal=True, version=version,
                                 alibi_slopes=slopes(3, 2, device), kernel_options=kernel_options)
    out.backward(torch.randn_like(out))
    if device == "cuda":
        torch.cuda.synchronize()


def run_kvcache(device, paged, wrong):
    """One decoding call and one packed chunked-prefill call (new keys with rotary from
    rotary_seqlens, queries and keys packed by offsets) over a cache of 100 keys a sequence;
    ``wrong``: every table and offset out of range."""
    int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    batch, heads_k, d = 3, 2, 64
    shape = (batch * 7 + 2, 16, heads_k, d) if paged else (batch + 1, 100, heads_k, d)
    k_cache, v_cache = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2))
    tables = dict(block_table=int32([[j * batch + b for j in range(7)] for b in range(batch)]) if not wrong else
                  int32([[10**6, -3] + [b] * 5 for b in range(batch)])) if paged else \
        dict(cache_batch_idx=int32([2, 10**6, -1] if wrong else [2, 0, 1]))
    cos = torch.rand(120, d // 4, device=device, dtype=torch.bfloat16)
    lengths = int32([10**6, -9, 99] if wrong else [10, 97, 50])
    q = torch.randn(batch, 1, 8, d, device=device, dtype=torch.bfloat16)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=4, cache_leftpad=lengths // 2,
                            **tables)
    k, v = (torch.randn(9, heads_k, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    flash_attn_with_kvcache(torch.randn(7, 8, d, device=device, dtype=torch.bfloat16), k_cache, v_cache, k, v,
                            rotary_cos=cos, rotary_sin=cos, cache_seqlens=lengths, causal=True, num_splits=2,
                            cu_seqlens_q=int32([0, -4, 10**6, 3] if wrong else [0, 3, 3, 7]), max_seqlen_q=4,
                            cu_seqlens_k_new=int32([0, 12, -5, 10**6] if wrong else [0, 2, 2, 9]),
                            rotary_seqlens=int32([10**6, -2, 5] if wrong else [0, 100, 7]), **tables)
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--versions", default="v1,v2,v3,fp8,kvcache",
                    help="fp8: the FP8 forwards (the version the device runs best); kvcache: the decoding kernels")
    ap.add_argument("--device", default="cuda", help="cpu runs the kernels under TRITON_INTERPRET=1")
    ap.add_argument("--kernel-options", default="", help="developer switches (options.KernelOptions text)")
    args = ap.parse_args()
    versions = args.versions.split(",")
    for version in (v for v in versions if v not in ("fp8", "kvcache")):
        for case in CASES:
            run(version, case, args.device, args.kernel_options)
            print(f"{version} {case} ok", flush=True)
        for case in ALIBI_CASES:
            run(version, case, args.device, args.kernel_options, alibi=True)
            print(f"{version} {case} alibi, sinks ok", flush=True)
        run_varlen(version, args.device, args.kernel_options)
        print(f"{version} varlen ok", flush=True)
        if version != "v1":  # (v1 takes one head dim)
            for case in OWN_V_CASES:
                run_own_v(version, case, args.device, args.kernel_options)
                print(f"{version} {case} own V head dim ok", flush=True)
    if "fp8" in versions:
        for case in FP8_CASES:
            run_fp8(case, args.device, args.kernel_options)
            print(f"fp8 {case} ok", flush=True)
    if "kvcache" in versions:
        for paged in (False, True):
            for wrong in (False, True):
                run_kvcache(args.device, paged, wrong)
                print(f"kvcache {'paged' if paged else 'contiguous'}{', tables out of range' if wrong else ''} ok",
                      flush=True)


if __name__ == "__main__":
    main()
