"""v3's Hopper techniques switched off one at a time: d128, seqlen 8k, non-causal, bf16 (b2 h16).

Each row is v3 under one set of kernel options (options.KernelOptions), timed in this process
next to v3 as shipped and the SDPA peers, --repeats passes (median).  Techniques without a
switch are listed without a time.  Writes JSON records and prints Markdown.

    python scripts/ablation_v3.py --out ablation_v3.json > ablation_v3.md
"""
import argparse
import json
import statistics

from flashtile import bench

# (row, provider, kernel options, modes it changes)
ROWS = [
    ("v3 as shipped (Gluon forward and backward)", "flashtile-v3", "", ("fwd", "bwd")),
    ("no ping-pong between the consumer warpgroups", "flashtile-v3", "ablate=pingpong", ("fwd",)),
    ("no softmax / GEMM overlap inside a warpgroup", "flashtile-v3", "ablate=overlap", ("fwd",)),
    ("no persistent scheduler (one CTA per tile, same longest-first order)", "flashtile-v3", "ablate=persistent",
     ("fwd",)),
    ("no second Q buffer (the next tile's Q loads after this tile ends)", "flashtile-v3", "ablate=next_q",
     ("fwd",)),
    ("no Q in registers (S = QK^T with both operands from shared memory)", "flashtile-v3", "ablate=q_registers",
     ("fwd",)),
    ("none of those five (producer/consumer warp specialization, TMA, wgmma left)", "flashtile-v3",
     "ablate=pingpong,overlap,persistent,next_q,q_registers", ("fwd",)),
    ("no multi-stage pipeline (a one-slot K/V ring)", "flashtile-v3", "tiles.v3_gluon=128,1,2", ("fwd",)),
    ("no explicit warp specialization: plain Triton (its automatic producer/consumer split)", "flashtile-v3",
     "forward=triton", ("fwd",)),
    ("no warp specialization at all (plain Triton, 128x128 tiles, 8 warps, 3 stages)", "flashtile-v3",
     "forward=triton;tiles.v3_fwd=128,128,8,3,0", ("fwd",)),
    ("no TMA: pointer loads (v2's kernel on the same plain tiles)", "flashtile-v2", "tiles.v2_fwd=128,128,8,3",
     ("fwd",)),
    ("backward: no TMA reduce-add: two Gluon passes, dQ then dK/dV (what deterministic=True runs)",
     "flashtile-v3", "backward=gluon", ("bwd",)),
    ("backward: the two Gluon passes without their persistent scheduler (a CTA per tile, one stationary slot)",
     "flashtile-v3", "backward=gluon;ablate=persistent", ("bwd",)),
    ("backward: no warp specialization, no TMA (v2's two passes)", "flashtile-v3", "backward=v2", ("bwd",)),
    ("peer: SDPA cuDNN", "sdpa-cudnn", "", ("fwd", "bwd")),
    ("peer: SDPA flash (FlashAttention-2)", "sdpa-flash", "", ("fwd", "bwd")),
]
WITHOUT_SWITCH = [
    ("wgmma, P kept in registers for PV", "no switch: the Gluon kernel issues warpgroup MMA with P as its "
                                          "register operand (compiled PTX: wgmma m64nNk16 with register A)"),
    ("backward: shipped v3 backward", "the first row's bwd: FlashAttention-3's K/V-stationary pass in Gluon "
                                      "(TMA producer warp, 8 consumer warps, dQ by TMA reduce-add)"),
]


def measure(provider, kernel_options, case, repeats):
    return statistics.median(bench.measure(provider, case, kernel_options=kernel_options)[0]
                             for _ in range(repeats))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    ap.add_argument("--out", default="ablation_v3.json")
    args = ap.parse_args()
    env = bench.environment()
    records, shipped = [], {}
    print(f"v3 ablation, d128 seqlen {args.seqlen} non-causal bf16, {env['gpu']}, commit {env['commit']}, "
          f"{env['date']}; TFLOP/s (ratio to v3 as shipped, same run)\n")
    print("| technique switched off | fwd | bwd |\n|---|---|---|")
    for row, provider, overrides, modes in ROWS:
        cells = []
        for mode in ("fwd", "bwd"):
            if mode not in modes:
                cells.append("(unchanged)")
                continue
            case = bench.Case(max(1, args.tokens // args.seqlen), 16, 16, args.seqlen, args.seqlen, 128, False, mode)
            try:
                ms = measure(provider, overrides, case, args.repeats)
            except Exception as e:  # a peer missing here (no cuDNN on a CPU) is a result too
                cells.append(f"failed: {type(e).__name__}")
                continue
            shipped.setdefault(mode, ms)
            tflops = case.flops() / ms / 1e9
            cells.append(f"{tflops:.0f} ({shipped[mode] / ms:.2f}x)")
            records.append(dict(row=row, provider=provider, kernel_options=overrides, mode=mode, b=case.b, h=case.h,
                                sq=case.sq, sk=case.sk, d=case.d, causal=False, dtype="bf16", ms=ms,
                                tflops=tflops, **env))
        print(f"| {row} | {cells[0]} | {cells[1]} |", flush=True)
    for row, why in WITHOUT_SWITCH:
        print(f"| {row} | {why} | |")
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
