"""Same-run A/B: v3 with launch.launch (cached binaries, unchecked descriptors) against the
launch it replaced (checked TensorDescriptors, kernel[grid] = JITFunction.run), and cuDNN:
do_bench times and host time per call, d64/d128/d256, causal and not, 1k and 2k, fwd and bwd."""
import json
import sys

import torch

from flashtile import bench
from flashtile.kernels import launch, v3_gluon, v3_gluon_bwd


def previous_launch(kernel, grid, *args, **constants):
    return kernel[grid](*(a.checked() if isinstance(a, launch.Descriptor) else a for a in args), **constants)


def use(fn):
    v3_gluon.launch = fn
    v3_gluon_bwd.launch = fn


rows = []
for d in (64, 128, 256):
    for causal in (False, True):
        for s in (1024, 2048):
            for mode in ("fwd", "bwd"):
                case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, mode)
                row = dict(d=d, causal=causal, seqlen=s, mode=mode)
                for rnd in range(2):
                    for name, provider, fn in (("cached", "flashtile-v3", launch.launch),
                                               ("previous", "flashtile-v3", previous_launch),
                                               ("cudnn", "sdpa-cudnn", launch.launch)):
                        use(fn)
                        ms, _ = bench.measure(provider, case)
                        row[f"{name}_ms_{rnd}"] = ms
                        if rnd == 0 and s == 1024:
                            host, wall = bench.host_cost(provider, case, calls=200)
                            row[f"{name}_host_ms"], row[f"{name}_wall_ms"] = host, wall
                use(launch.launch)
                for name in ("cached", "previous", "cudnn"):
                    row[f"{name}_ms"] = min(row[f"{name}_ms_0"], row[f"{name}_ms_1"])
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)

print("| d | causal | seqlen | mode | cached / previous | cached / cuDNN | previous / cuDNN | host us: cached, previous, cuDNN |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    host = (", ".join(f"{1e3 * r[n + '_host_ms']:.0f}" for n in ("cached", "previous", "cudnn"))
            if "cached_host_ms" in r else "")
    print(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['mode']} | {r['previous_ms'] / r['cached_ms']:.2f} | "
          f"{r['cudnn_ms'] / r['cached_ms']:.2f} | {r['cudnn_ms'] / r['previous_ms']:.2f} | {host} |")
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
