"""Where the host time of v3's forward and backward goes (d128 s1k b16 h16, causal), cProfile."""
import cProfile, pstats, time, os
import torch
from flashtile import flash_attn_func
b, s, h, d = 16, 1024, 16, 128
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
for mode in ("gluon", "gluon-reduce"):
    os.environ["FLASHTILE_V3_BWD"] = mode
    out = flash_attn_func(q, k, v, causal=True, version="v3")
    g = torch.randn_like(out)
    for _ in range(10):
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    torch.cuda.synchronize()
    n = 100
    t = time.perf_counter()
    for _ in range(n):
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    print(f"{mode}: host {host * 1e6:.0f} us per backward call")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n):
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    pr.disable(); torch.cuda.synchronize()
    st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(18); st.sort_stats("cumtime").print_stats(25)
with torch.no_grad():
    for _ in range(10):
        flash_attn_func(q, k, v, causal=True, version="v3")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(100):
        flash_attn_func(q, k, v, causal=True, version="v3")
    print(f"forward: host {(time.perf_counter() - t) / 100 * 1e6:.0f} us per call")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(100):
        flash_attn_func(q, k, v, causal=True, version="v3")
    pr.disable(); torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
