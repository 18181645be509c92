"""One attention call of the bars' shapes, for Nsight Compute (`scripts/gpu_check.sh profile`).

Runs --warmup calls (compiles, fills the launch cache, ramps the clocks), then --calls more
between cudaProfilerStart and cudaProfilerStop, so that `ncu --profile-from-start off` sees only
those: forward, or forward and backward (--mode bwd).  Shapes as the bars: batch x seqlen =
--tokens, heads x head_dim = --hidden.  On a CPU (the interpreter) it runs the calls without
the profiler range, as a check of the script itself.
"""
import argparse

import torch

from flashtile import flash_attn_func


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--version", default="v3")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    heads = args.hidden // args.head_dim
    shape = (args.tokens // args.seqlen, args.seqlen, heads, args.head_dim)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device=args.device, requires_grad=args.mode == "bwd")
               for _ in range(3))
    dout = torch.randn_like(q)

    def call():
        out = flash_attn_func(q, k, v, causal=args.causal, version=args.version)
        if args.mode == "bwd":
            torch.autograd.grad(out, (q, k, v), dout)

    for _ in range(args.warmup):
        call()
    profiling = q.is_cuda
    if profiling:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.calls):
        call()
    if profiling:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"{args.version} {args.mode} b{shape[0]} s{args.seqlen} h{heads} d{args.head_dim} "
          f"causal={args.causal}: {args.warmup} warmup + {args.calls} profiled calls")


if __name__ == "__main__":
    main()
