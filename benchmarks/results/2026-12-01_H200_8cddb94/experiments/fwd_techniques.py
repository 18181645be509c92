"""The Gluon forward's ping-pong and in-warpgroup overlap switched off, short to long cells,
timed as CUDA-graph replays (kernel time, no launch); TFLOP/s, two measurements each."""
from flashtile import bench
print("| d | causal | s | shipped | no ping-pong | no overlap | cuDNN |")
print("|---|---|---|---|---|---|---|")
cells = [(d, False, s) for d in (64, 128, 256) for s in (1024, 4096, 16384)] + \
        [(d, True, s) for d in (64, 128, 256) for s in (2048, 8192)]
for d, causal, s in cells:
    case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "fwd")
    res = []
    for provider, env in (("flashtile-v3", {}), ("flashtile-v3", {"FLASHTILE_V3_ABLATE": "pingpong"}),
                          ("flashtile-v3", {"FLASHTILE_V3_ABLATE": "overlap"}), ("sdpa-cudnn", {})):
        ms = [bench.measure(provider, case, cuda_graph=True, env=env)[0] for _ in range(2)]
        res.append("/".join(f"{case.flops() / x / 1e9:.0f}" for x in ms))
    print(f"| {d} | {causal} | {s} | " + " | ".join(res) + " |", flush=True)
