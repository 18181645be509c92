"""The Gluon forward with and without the second Q buffer (next_q), against v2's forward and
cuDNN; event-timed as the bars (L2 flushed), TFLOP/s, two measurements each."""
from flashtile import bench
env = bench.environment()
print(f"Gluon forward next_q, bf16, {env['gpu']}, commit {env['commit']}, {env['date']}; TFLOP/s (two measurements)\n")
cols = [("Gluon (two Q buffers)", "flashtile-v3", {"FLASHTILE_V3_FWD": "gluon"}),
        ("Gluon, one Q buffer", "flashtile-v3", {"FLASHTILE_V3_FWD": "gluon", "FLASHTILE_V3_ABLATE": "next_q"}),
        ("v2", "flashtile-v2", {}), ("cuDNN", "sdpa-cudnn", {})]
print("| d | causal | s | " + " | ".join(c[0] for c in cols) + " |")
print("|---" * (3 + len(cols)) + "|")
for d in (64, 128, 256):
    for causal in (False, True):
        for s in (1024, 2048, 4096, 16384):
            case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "fwd")
            res = []
            for name, provider, e in cols:
                ms = [bench.measure(provider, case, env=e)[0] for _ in range(2)]
                res.append("/".join(f"{case.flops() / x / 1e9:.0f}" for x in ms))
            print(f"| {d} | {causal} | {s} | " + " | ".join(res) + " |", flush=True)
