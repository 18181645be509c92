"""Gluon backward vs fp32 reference: max error per gradient, next to v2's backward error."""
import os, sys, time, torch
from flashtile import flash_attn_func
from flashtile.reference import standard_attention
torch.manual_seed(0)
cases = [(1, 700, 1000, 4, 2, 64, False, (-1, -1)), (1, 700, 1000, 4, 2, 128, False, (-1, -1)),
         (1, 700, 1000, 4, 2, 128, True, (-1, -1)), (1, 700, 1000, 4, 2, 256, False, (-1, -1)),
         (2, 1024, 1024, 4, 4, 128, False, (-1, -1)), (1, 513, 513, 2, 1, 64, False, (100, 0)),
         (1, 256, 256, 2, 2, 96, True, (-1, -1))]
def grads(q, k, v, do, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = flash_attn_func(q, k, v, **kw); o.backward(do)
    return [q.grad, k.grad, v.grad]
for b, sq, sk, hq, hk, d, causal, win in cases:
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    standard_attention(qr, kr, vr, causal=causal, window_size=win, upcast=True).backward(do.double())
    ref = [qr.grad.float(), kr.grad.float(), vr.grad.float()]
    os.environ["FLASHTILE_V3_BWD"] = "v2"
    base = grads(q, k, v, do, causal=causal, window_size=win, version="v3")
    os.environ["FLASHTILE_V3_BWD"] = sys.argv[1] if len(sys.argv) > 1 else "gluon"
    try:
        g = grads(q, k, v, do, causal=causal, window_size=win, version="v3")
        torch.cuda.synchronize()
        errs = " ".join(f"{n}={(a.float()-r).abs().max().item():.3g}/{(c.float()-r).abs().max().item():.3g}"
                        for n, a, c, r in zip("qkv", g, base, ref))
        print((b, sq, sk, hq, hk, d, causal, win), "gluon/v2:", errs, flush=True)
    except Exception as e:
        print((b, sq, sk, hq, hk, d, causal, win), "FAILED", type(e).__name__, str(e)[:2000], flush=True)
