"""Host cost per call (Python + launch), and where it goes, for short v3 calls."""
import cProfile, pstats, time, io, torch
import torch.nn.functional as F
from flashtile import flash_attn_func

def per_call(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e3 * (t1 - t0) / n, 1e3 * (t2 - t0) / n

b, s, h, d = 16, 1024, 16, 128
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = torch.randn_like(q, requires_grad=True), torch.randn_like(q, requires_grad=True)
dout = torch.randn_like(q)
qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
from torch.nn.attention import sdpa_kernel, SDPBackend
def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(qt, kt, vt)
def ours(version, causal=False):
    def f():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=causal, version=version)
    return f
out3 = flash_attn_func(q, k, v, version="v3")
def bwd3():
    torch.autograd.grad(out3, (q, k, v), dout, retain_graph=True)
out2 = flash_attn_func(q, k, v, version="v2")
def bwd2():
    torch.autograd.grad(out2, (q, k, v), dout, retain_graph=True)
for name, fn in [("cudnn fwd", cudnn), ("v3 fwd", ours("v3")), ("v3 fwd causal", ours("v3", True)),
                 ("v2 fwd", ours("v2")), ("v3 bwd", bwd3), ("v2 bwd", bwd2)]:
    host, wall = per_call(fn)
    print(f"{name}: host {host:.3f} ms/call, wall {wall:.3f} ms/call", flush=True)
for name, fn in [("v3 fwd", ours("v3")), ("v3 bwd", bwd3)]:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(28)
    print(f"==== {name} by tottime (300 calls)\n" + sio.getvalue()[-6000:], flush=True)
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("cumulative").print_stats(30)
    print(f"==== {name} cumulative\n" + sio.getvalue()[-6000:], flush=True)
