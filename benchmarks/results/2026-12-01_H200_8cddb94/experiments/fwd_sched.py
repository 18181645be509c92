"""Gluon forward tile walks side by side: static persistent (shipped for unbanded), dynamic
(atomic counter), one CTA per tile; and cuDNN. TFLOP/s, median of 3 measurements."""
import dataclasses, statistics, sys
from unittest import mock
from flashtile import bench
from flashtile.kernels import v3, configs

def variant(**kw):
    orig = configs.v3_gluon_schedule
    return mock.patch.object(v3, "v3_gluon_schedule", lambda p: dataclasses.replace(orig(p), **kw))

rows = []
print("events / CUDA-graph replays")
print("| d | causal | s | static | dynamic | one CTA/tile | cuDNN |")
print("|---|---|---|---|---|---|---|")
cells = [(d, False, s) for d in (64, 128, 256) for s in (1024, 2048, 4096)] + \
        [(d, True, s) for d in (64, 128, 256) for s in (2048, 8192)]
for d, causal, s in cells:
    case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "fwd")
    res = {}
    for name, ctx in (("static", variant(dynamic=False)), ("dynamic", variant(dynamic=True)),
                      ("off", variant(persistent=False, dynamic=False)), ("cudnn", None)):
        cell = []
        for graph in (False, True):
            ms = []
            for _ in range(3):
                if ctx is None:
                    ms.append(bench.measure("sdpa-cudnn", case, cuda_graph=graph)[0])
                else:
                    with ctx:
                        ms.append(bench.measure("flashtile-v3", case, cuda_graph=graph)[0])
            cell.append("/".join(f"{case.flops() / x / 1e9:.0f}" for x in sorted(ms)))
        res[name] = " ; ".join(cell)
    print(f"| {d} | {causal} | {s} | {res['static']} | {res['dynamic']} | {res['off']} | {res['cudnn']} |",
          flush=True)
