import torch
from flashtile import flash_attn_func
from flashtile.kernels import v3_gluon
for (b, s, h, d, causal) in [(4, 1000, 8, 64, True), (2, 2048, 16, 128, True), (3, 777, 8, 256, False)]:
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v3_gluon.DYNAMIC = False
    o1, l1, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, version="v3")
    v3_gluon.DYNAMIC = True
    o2, l2, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, version="v3")
    o3 = flash_attn_func(q, k, v, causal=causal, version="v2")
    print(b, s, h, d, causal, "dyn==static", torch.equal(o1, o2), torch.equal(l1, l2), "vs v2 max", (o1.float() - o3.float()).abs().max().item(), flush=True)
v3_gluon.DYNAMIC = False
