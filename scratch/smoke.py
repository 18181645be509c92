import os, sys, time, torch, itertools
from flashtile import flash_attn_func, standard_attention
torch.manual_seed(0)
cases = [(2, 256, 256, 4, 4, 128, False), (2, 300, 300, 4, 4, 128, False), (1, 1000, 777, 4, 2, 128, True),
         (2, 512, 512, 4, 4, 64, False), (1, 333, 512, 2, 2, 64, True), (1, 640, 640, 2, 2, 256, False),
         (1, 200, 300, 2, 2, 256, True), (1, 129, 1000, 2, 1, 96, True), (2, 4096, 4096, 8, 8, 128, True),
         (2, 4096, 4096, 8, 8, 128, False)]
for b, sq, sk, hq, hk, d, causal in cases:
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, version="v3", return_attn_probs=True)
    torch.cuda.synchronize()
    ref = flash_attn_func(q.float(), k.float(), v.float(), causal=causal, version="v2") if False else None
    kk = k.repeat_interleave(hq // hk, 2).float(); vv = v.repeat_interleave(hq // hk, 2).float()
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) / d ** 0.5
    if causal:
        i = torch.arange(sq, device="cuda")[:, None]; j = torch.arange(sk, device="cuda")[None, :]
        s = s.masked_fill(j - i > sk - sq, float("-inf"))
    lse_ref = torch.logsumexp(s, -1)
    o_ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0), vv)
    ok_rows = torch.isfinite(lse_ref)
    err = (out.float() - o_ref).abs().max().item()
    lerr = (lse - lse_ref)[ok_rows].abs().max().item()
    print(f"b{b} sq{sq} sk{sk} h{hq}/{hk} d{d} causal={causal}: out err {err:.4f} lse err {lerr:.5f} nan={out.isnan().any().item()}", flush=True)
