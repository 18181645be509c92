"""Time candidate tile configs per kernel on the GPU (tile overrides of options.KernelOptions), best first.

Writes one JSON line per measurement to --out; used to fill flashtile/kernels/configs.py.

    python scripts/sweep_configs.py --only v3-gluon --seqlen 16384 --out sweep.jsonl
"""
import argparse
import json

from flashtile import bench

# (config table entry, provider, mode, head dim, causal, candidates "bm,bn,warps,stages[,ws]")
SWEEPS_D256_BWD = [
    ("V2_BWD_KV", "flashtile-v2", "bwd", 256, False, ["32,64,4,2", "64,64,8,2", "32,64,8,2", "64,64,8,1", "32,64,4,1"]),
    ("V2_BWD_Q", "flashtile-v2", "bwd", 256, False, ["64,32,4,2", "64,64,8,2", "64,32,8,2", "128,32,8,2", "64,64,4,1"]),
]
SWEEPS_D128_SHORT = [  # run with --seqlen 1024 / 2048: where short sequences leave the GPU underfilled
    ("V2_FWD", "flashtile-v2", "fwd", 128, True, ["128,64,8,3", "128,64,8,2", "128,32,8,3", "64,64,4,2",
                                                  "128,64,4,2", "128,128,8,2", "64,64,4,3", "64,32,4,3"]),
    ("V2_BWD_KV", "flashtile-v2", "bwd", 128, False, ["64,128,8,2", "64,128,8,3", "32,128,4,3", "32,128,4,2",
                                                      "64,128,4,2", "128,128,8,2", "64,64,4,3", "32,128,8,3"]),
    ("V2_BWD_Q", "flashtile-v2", "bwd", 128, False, ["128,32,4,3", "128,32,4,2", "128,64,8,2", "128,64,8,3",
                                                     "64,64,4,3", "64,32,4,3", "128,32,8,3", "64,64,4,2"]),
    ("V2_BWD_KV", "flashtile-v2", "bwd", 128, True, ["32,64,4,3", "64,128,8,2", "32,128,4,3", "64,64,4,3"]),
]
SWEEPS_D64_CAUSAL_SHORT = [  # run with --seqlen 1024
    ("V2_FWD", "flashtile-v2", "fwd", 64, True, ["128,64,4,3", "64,64,4,3", "128,32,4,3", "64,32,4,3",
                                                 "128,64,8,3", "128,128,8,3", "64,64,4,2"]),
]
SWEEPS_V1 = [  # FlashAttention-1 tiles (one pipeline stage: the paper's kernel has none)
    ("V1_FWD", "flashtile-v1", "fwd", 64, False, ["64,128,4,1", "64,64,4,1", "64,128,8,1", "128,128,8,1"]),
    ("V1_FWD", "flashtile-v1", "fwd", 128, False, ["128,128,8,1", "64,64,4,1", "64,128,8,1", "128,64,8,1", "64,64,8,1"]),
    ("V1_BWD", "flashtile-v1", "bwd", 64, False, ["64,128,4,1", "64,64,4,1", "32,64,4,1", "64,128,8,1", "64,64,8,1"]),
    ("V1_BWD", "flashtile-v1", "bwd", 128, False, ["128,128,8,1", "64,64,4,1", "64,64,8,1", "32,64,4,1", "64,128,8,1",
                                                   "128,64,8,1"]),
]
SWEEPS_V3_GLUON = [  # v3's Gluon forward: "block_n,stages,consumers" (run at --seqlen 1024 and 16384)
    ("V3_GLUON", "flashtile-v3", "fwd", 64, False, ["128,2,2", "128,3,2", "128,4,2", "64,4,2", "128,2,3", "128,3,3",
                                                     "128,4,3"]),
    ("V3_GLUON", "flashtile-v3", "fwd", 64, True, ["128,2,2", "128,3,2", "64,4,2", "128,3,3"]),
    ("V3_GLUON", "flashtile-v3", "fwd", 128, False, ["128,2,2", "128,3,2", "64,3,2", "64,4,2"]),
    ("V3_GLUON", "flashtile-v3", "fwd", 128, True, ["128,2,2", "64,3,2", "64,4,2"]),
    ("V3_GLUON", "flashtile-v3", "fwd", 256, False, ["64,2,2", "32,4,2", "64,1,2"]),
    ("V3_GLUON", "flashtile-v3", "fwd", 256, True, ["64,2,2", "32,4,2", "64,1,2"]),
]
SWEEPS_V3_GLUON_BWD = [  # v3's Gluon backward, two passes: "kv_block_m,dq_block_n,stages"
    ("V3_GLUON_BWD", "flashtile-v3", "bwd", 64, False, ["64,64,2", "64,64,3", "64,64,4", "64,128,2", "64,128,3",
                                                        "128,64,2"]),
    ("V3_GLUON_BWD", "flashtile-v3", "bwd", 64, True, ["64,64,2", "64,64,3", "64,128,2"]),
    ("V3_GLUON_BWD", "flashtile-v3", "bwd", 128, False, ["64,64,2", "64,64,3", "64,128,2"]),
    ("V3_GLUON_BWD", "flashtile-v3", "bwd", 128, True, ["64,64,2", "64,64,3", "64,128,2"]),
]
SWEEPS = [
    ("V2_FWD", "flashtile-v2", "fwd", 128, False, ["128,64,8,3", "128,128,8,3", "128,64,4,3", "128,128,8,2", "64,64,4,3"]),
    ("V2_FWD", "flashtile-v2", "fwd", 64, False, ["128,64,4,3", "128,128,8,3", "128,128,4,3", "64,64,4,4"]),
    ("V2_FWD", "flashtile-v2", "fwd", 256, False, ["64,64,4,2", "128,64,8,2", "64,32,4,3", "128,32,8,2"]),
    ("V2_BWD_KV", "flashtile-v2", "bwd", 128, False, ["64,128,8,2", "32,128,4,3", "64,128,4,2", "64,64,4,3", "128,128,8,2"]),
    ("V2_BWD_Q", "flashtile-v2", "bwd", 128, False, ["128,64,8,2", "64,64,4,3", "128,32,4,3", "128,128,8,2"]),
    ("V2_BWD_KV", "flashtile-v2", "bwd", 64, False, ["64,128,8,2", "32,128,4,3", "64,128,4,3", "64,64,4,3"]),
    ("V3_FWD", "flashtile-v3", "fwd", 128, False, ["128,128,4,2,1", "128,64,4,2,1", "128,128,8,3,0", "128,128,4,3,0"]),
    ("V3_FWD", "flashtile-v3", "fwd", 128, True, ["128,128,8,3", "128,64,8,3", "128,64,4,3", "128,128,8,2"]),
    ("V3_FWD", "flashtile-v3", "fwd", 64, False, ["128,128,4,3,0", "128,128,4,2,1", "128,64,4,3,0", "128,128,8,3,0"]),
    ("V3_FWD", "flashtile-v3", "fwd", 256, False, ["128,64,4,2,1", "128,64,8,2,0", "64,64,4,2,0", "128,32,4,2,1"]),
]

NAMED = {"all": SWEEPS, "d256-bwd": SWEEPS_D256_BWD, "d128-short": SWEEPS_D128_SHORT,
         "d64-causal-short": SWEEPS_D64_CAUSAL_SHORT, "v1": SWEEPS_V1,
         "v3-gluon": SWEEPS_V3_GLUON, "v3-gluon-bwd": SWEEPS_V3_GLUON_BWD}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--out", default="sweep.jsonl")
    ap.add_argument("--only", choices=tuple(NAMED), default="all")
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for entry, provider, mode, d, causal, candidates in NAMED[args.only]:
            # The kernel the entry tunes is forced: v3 runs others by default.
            provider_options = {"V3_GLUON_BWD": "backward=gluon;", "V3_FWD": "forward=triton;"}.get(entry, "")
            results = []
            case = bench.Case(16384 // args.seqlen, 2048 // d, 2048 // d, args.seqlen, args.seqlen, d, causal, mode)
            for cand in candidates:
                try:
                    ms, _ = bench.measure(provider, case, kernel_options=f"{provider_options}tiles.{entry.lower()}={cand}")
                    results.append((case.flops() / ms / 1e9, cand))
                except Exception as e:  # a config that does not fit is a result too
                    results.append((0.0, f"{cand} failed: {type(e).__name__}: {str(e)[:120]}"))
                f.write(json.dumps(dict(entry=entry, d=d, causal=causal, mode=mode, config=cand,
                                        tflops=results[-1][0])) + "\n")
            ranked = ", ".join(f"{c}: {t:.0f}" for t, c in sorted(results, reverse=True))
            print(f"{entry:10} d{d:<4} {'causal' if causal else 'full':6} {mode}: {ranked}", flush=True)


if __name__ == "__main__":
    main()
