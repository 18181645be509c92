"""Short Gluon-forward cells: events vs CUDA graphs, persistent on/off, and host cost per call."""
import os, time, torch
from unittest import mock
from flashtile import bench, flash_attn_func
cells = [(256, False, 1024), (128, True, 2048), (128, False, 1024), (64, False, 1024)]
for d, causal, s in cells:
    case = bench.Case(16384 // s, 2048 // d, 2048 // d, s, s, d, causal, "fwd")
    for ablate in ("", "persistent"):
        with mock.patch.dict(os.environ, {"FLASHTILE_V3_ABLATE": ablate}):
            ev = [bench.measure("flashtile-v3", case)[0] for _ in range(5)]
            gr = [bench.measure("flashtile-v3", case, cuda_graph=True)[0] for _ in range(3)]
            q = torch.randn(case.b, s, case.h, d, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            with torch.no_grad():
                for _ in range(10):
                    flash_attn_func(q, k, v, causal=causal, version="v3")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    flash_attn_func(q, k, v, causal=causal, version="v3")
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
        print(f"d{d} causal={causal} s{s} ablate={ablate or '-'}: events {[round(x,3) for x in ev]} graphs "
              f"{[round(x,3) for x in gr]} host {1e3*(t1-t0)/200:.3f} ms/call, wall {1e3*(t2-t0)/200:.3f} ms/call",
              flush=True)
