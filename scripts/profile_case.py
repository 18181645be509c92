"""One bars cell's calls, for Nsight Compute (`scripts/gpu_check.sh profile`).

The benchmark's own step (bench.make_step: the forward without gradients, or the backward
alone) runs --warmup times (compiles, fills the launch cache, ramps the clocks), then --calls
times between cudaProfilerStart and cudaProfilerStop, so that `ncu --profile-from-start off`
sees only those.  Shapes as the bars: batch x seqlen = --tokens, heads x head_dim = --hidden.
On a CPU (the interpreter) it runs the calls without the profiler range, as a check of itself.

    ncu --profile-from-start off python scripts/profile_case.py --head-dim 128 --seqlen 2048 --mode bwd
"""
import argparse

import torch

from flashtile import bench


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--dtype", choices=bench.DTYPES, default="bf16", help="e4m3/e5m2: the FP8 forward")
    ap.add_argument("--provider", default="flashtile-v3")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    heads = args.hidden // args.head_dim
    case = bench.Case(args.tokens // args.seqlen, heads, heads, args.seqlen, args.seqlen, args.head_dim,
                      args.causal, args.mode, args.dtype)
    step = bench.make_step(args.provider, case, torch.device(args.device))
    for _ in range(args.warmup):
        step()
    profiling = args.device != "cpu"
    if profiling:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.calls):
        step()
    if profiling:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"{args.provider} {case}: {args.warmup} warmup + {args.calls} profiled calls")


if __name__ == "__main__":
    main()
