"""FP8 attention through FlashAttention-3's interface: q, k, v in float8 with per-(batch, KV head)
descales, the output bf16.  The oracle is float64 attention on the dequantized inputs; the
same-precision reference emulates the kernel's roundings in PyTorch (float32 scores, the
probabilities scaled by 2**8 and rounded to the float8 type, a bf16 output)."""
import pytest
import torch
import triton
import triton.language as tl
from attention_check import GRAD_RULE, OUT_RULE, assert_within_rule
from conftest import DEVICE, ON_GPU

import flashtile
from flashtile import dispatch, flash_attn_interface as fa3, fp8, options, standard_attention
from flashtile.kernels import configs, keys_contiguous, score, tiles
from flashtile.kernels.quantize import blocks as fused_quantize_blocks
from flashtile.reference import band_mask
from flashtile.validation import band

HEAD_DIM = 128 if ON_GPU else 32
# The GPU's kernels differ per head dim (the Gluon forward: tiles, and a float32 P V sum up to d128).
HEAD_DIMS = (32, 64, 128, 256) if ON_GPU else (HEAD_DIM,)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize(x, heads_k, dtype):
    """x (batch, seqlen, heads, d) in float8 and its descale (batch, heads_k): the amax of each
    (batch, KV head group) mapped to the type's largest value."""
    batch, seqlen, heads, d = x.shape
    grouped = x.float().view(batch, seqlen, heads_k, heads // heads_k, d)
    descale = grouped.abs().amax(dim=(1, 3, 4)).clamp(min=1e-6) / FP8_MAX[dtype]
    return (grouped / descale[:, None, :, None, None]).view_as(x).to(dtype), descale


def dequantized(x, descale):
    batch, seqlen, heads, d = x.shape
    heads_k = descale.shape[1]
    return (x.double().view(batch, seqlen, heads_k, -1, d) * descale.double()[:, None, :, None, None]).view_as(x)


def emulated(q, k, v, causal, dtype, softcap=0.0):
    """The kernel's arithmetic in PyTorch on dequantized inputs: float32 scores (capped) and
    softmax statistics, probabilities x 2**8 rounded to ``dtype`` for the product with V, bf16
    out."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = score.reference(s, softcap)
    if causal:
        left, right = band(True, (-1, -1), q.shape[1], k.shape[1])
        s = s.masked_fill(~band_mask(q.shape[1], k.shape[1], left, right, device=s.device), float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))  # a row that sees no key: all 0
    rounded = (e * 256).to(dtype).float() / 256
    out = torch.einsum("bhqk,bkhd->bqhd", rounded, v) / e.sum(-1).clamp_min(1e-30).transpose(1, 2)[..., None]
    return out.to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fp8_forward_against_dequantized_oracle(dtype, causal, head_dim):
    # Several K/V blocks; more queries than keys: causal rows that see no key come out 0.
    for seqlen_q, seqlen_k in ((300, 420), (420, 300)) if ON_GPU else ((70, 90), (90, 70)):
        check_forward(dtype, causal, head_dim, seqlen_q, seqlen_k)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_three_consumers(monkeypatch, causal):
    # d64's three consumer warpgroups (192-row tiles) on float8 inputs, which take them from 2k
    # query rows (4k with a band): here from any length (lengths no other test plans for).
    monkeypatch.setitem(configs.THREE_CONSUMERS_FROM_FP8, causal, 0)
    plans = []
    plan_of = dispatch.forward_plan
    monkeypatch.setattr(dispatch, "forward_plan", lambda *a: plans.append(plan_of(*a)) or plans[-1])
    plan_of.cache_clear()  # plans made before the patch (and after: below)
    try:
        check_forward(torch.float8_e4m3fn, causal, 64, 333, 451)
        check_block_scales(causal, 64, 333, 451)  # (fp8_attn_func: descales per block)
    finally:
        plan_of.cache_clear()
    assert plans and all(p.kernel == "v3-gluon" and p.config.consumers == 3 for p in plans)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
@pytest.mark.parametrize("share", [2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_forward_with_exponentials_on_the_fma_pipe(monkeypatch, share, head_dim):
    # tiles.v3_gluon's fourth integer: 1/share of the exponentials by tiles.exp2_fma.
    cfg = configs.by_head_dim(configs.V3_GLUON_FP8, head_dim)
    monkeypatch.setattr(options, "ENVIRONMENT",
                        options.KernelOptions(tiles={"v3_gluon": (cfg.block_n, cfg.num_stages, 2, share)}))
    for causal in (False, True):
        check_forward(torch.float8_e4m3fn, causal, head_dim, 300, 420)


def check_forward(dtype, causal, head_dim, seqlen_q, seqlen_k):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, n, h, head_dim, device=DEVICE) * 3 for n, h in ((seqlen_q, 4), (seqlen_k, 2),
                                                                              (seqlen_k, 2)))
    (q8, qd), (k8, kd), (v8, vd) = (quantize(x, 2, dtype) for x in (q, k, v))
    out, lse = fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                   return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, seqlen_q, 4, head_dim)
    qx, kx, vx = dequantized(q8, qd), dequantized(k8, kd), dequantized(v8, vd)
    oracle, oracle_lse = standard_attention(qx, kx, vx, causal=causal, upcast=True, return_lse=True)
    assert_within_rule("out", out, emulated(qx, kx, vx, causal, dtype), oracle, OUT_RULE)
    # float8 wgmma accumulates in fewer bits than float32 (scores agree to about 2**-11 relative);
    # the error grows with the products summed, the head dim (d256: 1.3e-3 on a logsumexp near 0).
    oracle_lse = oracle_lse.float().masked_fill(oracle_lse == float("inf"), float("-inf"))  # (FA3's, no key)
    torch.testing.assert_close(lse, oracle_lse, atol=1e-3 * max(1, head_dim / 128),
                               rtol=2e-3 if ON_GPU else 1e-4)


def test_fp8_forward_with_softcap():
    # The cap sees dequantized scores (the descales are on the scale the score hook takes):
    # against the float64 oracle with the same cap, by the FA rule.
    torch.manual_seed(4)
    dtype = torch.float8_e4m3fn
    seqlen_q, seqlen_k = (300, 420) if ON_GPU else (70, 90)
    q, k, v = (torch.randn(2, n, h, HEAD_DIM, device=DEVICE) * 3 for n, h in ((seqlen_q, 4), (seqlen_k, 2),
                                                                              (seqlen_k, 2)))
    (q8, qd), (k8, kd), (v8, vd) = (quantize(x, 2, dtype) for x in (q, k, v))
    out = fa3.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, softcap=5.0)
    qx, kx, vx = dequantized(q8, qd), dequantized(k8, kd), dequantized(v8, vd)
    oracle = standard_attention(qx, kx, vx, causal=True, upcast=True, softcap=5.0)
    assert_within_rule("out", out, emulated(qx, kx, vx, True, dtype, softcap=5.0), oracle, OUT_RULE)


def test_fp8_varlen_with_and_without_descales():
    # Each sequence against its own oracle: inputs quantized per (sequence, KV head) with their
    # descales, and inputs cast as they are with none (1).
    torch.manual_seed(1)
    dtype, bounds = torch.float8_e4m3fn, ((0, 23), (23, 64))
    cu = torch.tensor([0, 23, 64], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(1, 64, h, HEAD_DIM, device=DEVICE) * 2 for h in (4, 2, 2))
    quantized = [[quantize(x[:, s0:s1], 2, dtype) for s0, s1 in bounds] for x in (q, k, v)]
    scaled = [torch.cat([part[0] for part in parts], 1)[0] for parts in quantized]
    descales = [torch.cat([part[1] for part in parts]) for parts in quantized]
    ones = torch.ones(2, 2, device=DEVICE)
    for inputs, given in ((scaled, descales), ([x[0].to(dtype) for x in (q, k, v)], [None] * 3)):
        out = fa3.flash_attn_varlen_func(*inputs, cu, cu, 41, 41, causal=True, q_descale=given[0],
                                         k_descale=given[1], v_descale=given[2])
        for b, (s0, s1) in enumerate(bounds):
            qx, kx, vx = (dequantized(x[None, s0:s1], (ones if d is None else d)[b:b + 1])
                          for x, d in zip(inputs, given))
            oracle = standard_attention(qx, kx, vx, causal=True, upcast=True)
            assert_within_rule("out", out[None, s0:s1], emulated(qx, kx, vx, True, dtype), oracle, OUT_RULE)


@pytest.mark.parametrize("seqlen_q", [64, 50])
def test_fp8_attention_chunk(seqlen_q):
    # FlashAttention-3's attention_chunk on float8 inputs: each piece takes its sequence's
    # descales, so every chunk's output is that chunk's own call (batches quantized apart).
    torch.manual_seed(6)
    dtype, chunk = torch.float8_e4m3fn, 16
    q, k, v = (torch.randn(2, n, h, HEAD_DIM, device=DEVICE) * (1 + torch.arange(2, device=DEVICE))[:, None, None, None]
               for n, h in ((seqlen_q, 4), (64, 2), (64, 2)))
    (q8, qd), (k8, kd), (v8, vd) = (quantize(x, 2, dtype) for x in (q, k, v))
    out = fa3.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                              attention_chunk=chunk)
    offset = 64 - seqlen_q
    for b in range(2):
        for first in range(0, 64, chunk):
            rows = slice(max(first - offset, 0), first + chunk - offset)
            piece = fa3.flash_attn_func(q8[b:b + 1, rows], k8[b:b + 1, first:first + chunk],
                                        v8[b:b + 1, first:first + chunk], causal=True, q_descale=qd[b:b + 1],
                                        k_descale=kd[b:b + 1], v_descale=vd[b:b + 1])
            torch.testing.assert_close(out[b:b + 1, rows], piece, atol=2e-2, rtol=0)
    for wrong in (qd[:1], torch.cat([qd, qd])):  # checked before the pieces take their rows
        with pytest.raises(ValueError, match="q_descale must have shape"):
            fa3.flash_attn_func(q8, k8, v8, causal=True, q_descale=wrong, attention_chunk=chunk)


@triton.jit
def _exp2_fma_kernel(X, Y, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tiles.exp2_fma(tl.load(X + offs)))


def test_exp2_on_the_fma_pipe():
    # The FP8 forward's share of exponentials on the FMA pipe: within 1.02e-4 of 2**x (relative)
    # from 2**-126 up (the probabilities times 2**8 reach 2**8), exact at integers, +0.0 exactly
    # from -127 down and at -inf, so that masked keys and empty rows keep their zeros.
    n = 4096
    x = torch.cat([torch.linspace(-126.0, 9.0, n - 512), torch.rand(128) * 4 - 2,
                   torch.arange(-126.0, 10.0), torch.tensor([-127.0, -127.5, -300.0, -1e30, float("-inf")])])
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    y = torch.full_like(x, float("nan"))
    _exp2_fma_kernel[(1,)](x, y, BLOCK=n)
    exact = torch.exp2(x.double())
    normal = x >= -126
    assert ((y.double()[normal] - exact[normal]).abs() / exact[normal]).max() <= 1.02e-4
    integers = normal & (x == x.round())
    assert torch.equal(y[integers].double(), exact[integers])
    assert torch.equal(y[x <= -127], torch.zeros_like(y[x <= -127])) and not y.signbit().any()


def test_fp8_refusals():
    q = torch.randn(1, 8, 2, 32, device=DEVICE)
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="apply to float8"):
        fa3.flash_attn_func(q.half(), q.half(), q.half(), q_descale=torch.ones(1, 2, device=DEVICE))
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, nheads_k\)"):
        fa3.flash_attn_func(q8, q8, q8, q_descale=torch.ones(2, device=DEVICE))
    with pytest.raises(TypeError, match="k_descale must be float32"):
        fa3.flash_attn_func(q8, q8, q8, k_descale=torch.ones(1, 2, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="multiples of 16"):
        fa3.flash_attn_func(q8[..., :24], q8[..., :24], q8[..., :24])
    with pytest.raises(NotImplementedError, match="head dim 16; float8 tensor-core products reduce 32"):
        fa3.flash_attn_func(q8[..., :16], q8[..., :16], q8[..., :16])
    with pytest.raises(NotImplementedError, match="head dim 16"):
        flashtile.fp8_attn_func(q[..., :16].bfloat16(), q[..., :16].bfloat16(), q[..., :16].bfloat16())
    with pytest.raises(TypeError, match="flash_attn_interface"):
        from flashtile import flash_attn_func
        flash_attn_func(q8, q8, q8)


def test_fp8_attn_func_is_differentiable_once_in_reverse_mode():
    # As flash_attn_func: differentiating its gradients raises (a gradient penalty's second-order
    # term would otherwise be missing), first derivatives under create_graph stay right, and
    # torch.func transforms are refused by name.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    g, = torch.autograd.grad(flashtile.fp8_attn_func(*leaves).float().square().sum(), leaves[0], create_graph=True)
    plain, = torch.autograd.grad(flashtile.fp8_attn_func(*leaves).float().square().sum(), leaves[0])
    assert torch.equal(g.detach(), plain)
    with pytest.raises(RuntimeError, match="differentiable once"):
        (g.float().square().sum() + leaves[0].float().sum()).backward()
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        torch.func.grad(lambda x: flashtile.fp8_attn_func(x, k, v).float().sum())(q)


@pytest.mark.parametrize("scaling", ["block", "head"])
def test_fp8_attn_func_on_empty_inputs(scaling):
    # No key, no query or no sequence: nothing to quantize; zeros and logsumexp +inf, as
    # flash_attn_func gives, and zero gradients.
    for (batch, seqlen_q), seqlen_k in (((1, 5), 0), ((1, 0), 5), ((0, 5), 5)):
        q = torch.randn(batch, seqlen_q, 4, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, seqlen_k, 2, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        out, lse = flashtile.fp8_attn_func(q, k, v, scaling=scaling, return_softmax_lse=True)
        assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
        assert lse.shape == (batch, 4, seqlen_q) and (lse == float("inf")).all()
        out.float().sum().backward()
        assert all(x.grad is None or not x.grad.any() for x in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantizing_leaves_non_finite_values_in_place(dtype):
    # inf, -inf and NaN set no scale (each block's descale is that of its finite values) and come
    # out as float8's NaN; every other value as if they were 0: the fused kernel, its PyTorch
    # reference and the per-(sequence, KV head) scales alike.
    torch.manual_seed(2)
    x = torch.randn(2, 70, 4, 48, device=DEVICE, dtype=torch.bfloat16) * 5
    for where, value in (((0, 3, 1, 5), float("inf")), ((1, 40, 2, 0), float("nan")), ((1, 41, 0, 7), -float("inf"))):
        x[where] = value
    bad = ~x.isfinite()
    cleared = x.masked_fill(bad, 0)
    for quantizer in (lambda y: fused_quantize_blocks(y, 32, dtype, fp8.FP8_MAX[dtype]),
                      lambda y: fp8.quantize_blocks(y, 32, dtype), lambda y: fp8.quantize(y, 2, dtype)):
        (got, got_descale), (ref, ref_descale) = quantizer(x), quantizer(cleared)
        assert torch.equal(got_descale, ref_descale) and got_descale.isfinite().all()
        assert got.float()[bad].isnan().all() and torch.equal(got.float()[~bad], ref.float()[~bad])
    # A float32 input (the rotated q and k of incoherent processing) is read, never written.
    wide = x.float()
    kept = wide.clone()
    for quantizer in (lambda y: fp8.quantize_blocks(y, 32, dtype), lambda y: fp8.quantize(y, 2, dtype)):
        quantizer(wide)
        assert torch.equal(wide.nan_to_num(), kept.nan_to_num())


@pytest.mark.skipif(not ON_GPU, reason="the interpreter reads a float8 NaN as a number")
@pytest.mark.parametrize("scaling", ["block", "head"])
def test_fp8_attn_func_keeps_a_non_finite_input_to_its_row(scaling):
    # An inf in one query row: that row's output is NaN, as attention in float64 gives, and no
    # other (it would otherwise set its block's scale to inf and every value there to NaN).
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 300, 4, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    q[0, 3, 1, 5] = float("inf")
    out = flashtile.fp8_attn_func(q, k, v, scaling=scaling)
    row = torch.zeros(out.shape[:3], dtype=torch.bool, device=DEVICE)
    row[0, 3, 1] = True
    assert out[row].isnan().all() and out[~row].isfinite().all()


def test_fp8_qkvpacked_takes_float8_as_flash_attn_func():
    # FA3's packed call with float8 qkv and descales: the same as the unpacked call, with and
    # without num_heads_q (GQA).
    torch.manual_seed(1)
    qkv = (torch.randn(1, 40, 8, HEAD_DIM, device=DEVICE) * 3).to(torch.float8_e4m3fn)
    descales = {name: torch.rand(1, 2, device=DEVICE) + 0.5 for name in ("q_descale", "k_descale", "v_descale")}
    q, k, v = qkv.split([4, 2, 2], dim=2)
    expected = fa3.flash_attn_func(q, k, v, causal=True, **descales)
    torch.testing.assert_close(fa3.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=4, **descales), expected,
                               atol=0, rtol=0)
    stacked = torch.stack([q[:, :, :2], k, v], dim=2)
    torch.testing.assert_close(fa3.flash_attn_qkvpacked_func(stacked, causal=True, **descales),
                               fa3.flash_attn_func(q[:, :, :2], k, v, causal=True, **descales), atol=0, rtol=0)


def _outlier_inputs(batch, seqlen, heads, heads_k, seed):
    """FlashAttention-3's accuracy protocol: N(0, 1) + N(0, 100) * Bernoulli(0.001)."""
    g = torch.Generator().manual_seed(seed)

    def one(h):
        base = torch.randn(batch, seqlen, h, HEAD_DIM, generator=g)
        spikes = torch.randn(batch, seqlen, h, HEAD_DIM, generator=g) * 10
        return (base + spikes * (torch.rand(batch, seqlen, h, HEAD_DIM, generator=g) < 0.001)).to(DEVICE)
    return one(heads), one(heads_k), one(heads_k)


def rmse(x, ref):
    return (x.double() - ref).square().mean().sqrt().item()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_attn_func_with_incoherent_processing(dtype):
    # The bf16 user's call: output and (straight-through) gradients near the float64 attention
    # of the unquantized inputs; incoherent processing lowers the output's RMSE on inputs with
    # outliers, as in FlashAttention-3's Table 3.
    torch.manual_seed(0)
    q, k, v = (x.to(torch.bfloat16) for x in _outlier_inputs(2, 96, 4, 2, seed=3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flashtile.fp8_attn_func(*leaves, causal=True, dtype=dtype)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    dout = torch.randn_like(out)
    out.backward(dout)
    doubles = [x.double().requires_grad_() for x in (q, k, v)]
    oracle = standard_attention(*doubles, causal=True, upcast=True)
    oracle.backward(dout.double())
    plain = flashtile.fp8_attn_func(q, k, v, causal=True, dtype=dtype, incoherent=False)
    # On the GPU (d128) incoherent processing halves the RMSE; at the interpreter's d32 and 96 rows
    # the probabilities' rounding dominates and it may only match the plain call.
    assert rmse(out, oracle) < (1.0 if ON_GPU else 1.05) * rmse(plain, oracle)
    # Relative RMSE bounds near twice what these inputs give under the interpreter (e4m3: 0.044
    # out, about 0.04 gradients; e5m2, one mantissa bit less: 0.093, up to 0.16); the gradients carry
    # the output's and logsumexp's quantization error through D and P.
    out_bound, grad_bound = (0.08, 0.15) if dtype == torch.float8_e4m3fn else (0.15, 0.3)
    assert rmse(out, oracle) < out_bound * oracle.square().mean().sqrt()
    for leaf, ref in zip(leaves, doubles):
        assert rmse(leaf.grad, ref.grad) < grad_bound * ref.grad.square().mean().sqrt()


@pytest.mark.parametrize("feature", ["alibi", "sinks"])
@pytest.mark.parametrize("fp8_backward", [False, True])
def test_fp8_attn_func_with_alibi_or_sinks(fp8_backward, feature):
    # ALiBi's bias, or a sink logit per head, on the scores the float8 product forms, forward and
    # both backwards: output and gradients (the sinks' too) near the float64 attention with the
    # same feature, and the feature applied (far nearer that than the attention without it).
    q, k, v = (x.to(torch.bfloat16) for x in _outlier_inputs(2, 96, 4, 2, seed=4))
    if feature == "alibi":
        features = dict(alibi_slopes=torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.2, 0.1, 0.05]],
                                                  device=DEVICE))
    else:
        features = dict(sinks=torch.tensor([3.0, 1.0, -1.0, 4.0], device=DEVICE, requires_grad=True))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flashtile.fp8_attn_func(*leaves, causal=True, fp8_backward=fp8_backward, return_softmax_lse=True,
                                       **features)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
    out.backward(dout)
    doubles = [x.double().requires_grad_() for x in (q, k, v)]
    oracle_features = dict(features)
    if feature == "sinks":
        oracle_features["sinks"] = features["sinks"].detach().double().requires_grad_()
    oracle = standard_attention(*doubles, causal=True, upcast=True, **oracle_features)
    oracle.backward(dout.double())
    plain = standard_attention(*(x.double() for x in (q, k, v)), causal=True, upcast=True)
    assert rmse(out, oracle) < 0.08 * oracle.square().mean().sqrt()
    assert rmse(out, oracle) < 0.3 * rmse(plain, oracle)
    for leaf, ref in zip(leaves, doubles):
        assert rmse(leaf.grad, ref.grad) < 0.15 * ref.grad.square().mean().sqrt()
    if feature == "sinks":
        # The sinks' gradient, -sum over rows of exp(sink - lse) rowsum(dO O), is the call's own
        # output and logsumexp put through that formula; against the float64 attention it carries
        # the output's float8 error, 2-12% of its size depending on dO (hence one fixed dO).
        sinks64 = features["sinks"].detach().double()
        own = -(torch.exp(sinks64[None, :, None] - lse.double()) *
                (dout.double() * out.detach().double()).sum(-1).transpose(1, 2)).sum((0, 2))
        torch.testing.assert_close(features["sinks"].grad.double(), own, rtol=1e-4, atol=1e-4)
        ref = oracle_features["sinks"].grad
        assert rmse(features["sinks"].grad, ref) < 0.1 * ref.square().mean().sqrt()
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flashtile.fp8_attn_func(q, k, v, alibi_slopes=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="sinks must have shape"):
        flashtile.fp8_attn_func(q, k, v, sinks=torch.zeros(2, device=DEVICE))


def dequantize_blocks(x8, descale, rows):
    """float64 values of x8 (batch, seqlen, heads, d) with one descale per ``rows`` rows of a
    head (descale (batch, heads or more, blocks))."""
    per_row = descale[:, :x8.shape[2]].repeat_interleave(rows, dim=2)[:, :, :x8.shape[1]]  # (batch, heads, seqlen)
    return x8.double() * per_row.transpose(1, 2)[..., None].double()


# Tiles that separate the descale blocks from the backward's tiles: the forward's 64-row blocks,
# the backward's 32-row tiles (the least a float8 MMA reduces over).
SMALL_BACKWARD_TILES = "tiles.v2_bwd_kv=32,32,4,1;tiles.v2_bwd_q=32,32,4,1;tiles.v2_fwd=64,64,4,1"


def round_tiles(x, rows, cols, dtype):
    """x (..., n, m) rounded to float8 ``dtype`` with one scale per (rows x cols) tile, its amax
    mapped to the type's largest value, back in float64 (rows = 1: tiles.fp8_row_scaled on a
    transposed tile, cols = 1: on a tile)."""
    n, m = x.shape[-2:]
    padded = torch.nn.functional.pad(x, (0, -m % cols, 0, -n % rows))
    tiles = padded.unflatten(-1, (-1, cols)).unflatten(-3, (-1, rows))  # (..., n / rows, rows, m / cols, cols)
    descale = (tiles.abs().amax(dim=(-3, -1), keepdim=True) / FP8_MAX[dtype]).clamp(min=torch.finfo(torch.float32).tiny)
    rounded = (tiles / descale).float().to(dtype).double() * descale
    return rounded.flatten(-2).flatten(-3, -2)[..., :n, :m]


def emulated_backward(qx, kx, vx, dout, out, lse, causal, softcap, dtype=None, do_rows=0, dq_keys=0, kv_rows=0):
    """fp8_attn_func's backward in float64 on the dequantized float8 operands qx, kx, vx: P from
    the forward's lse, D from the bf16 dO and the forward's output.  ``dtype`` None (the default
    backward): the operands rounded to bf16, P and dS rounded to bf16 for their products.  A
    float8 ``dtype`` (fp8_backward=True): the scores as the forward formed them, dO rounded per
    ``do_rows`` rows of a head, P x 2**8 rounded for dV, dS rounded with one scale per row of
    each product's output: for dQ per query row over each of the dQ pass's key blocks
    (``dq_keys``), for dK per key over each of the dK/dV pass's query blocks (``kv_rows``).
    Returns dq, dk, dv with respect to qx, kx, vx."""
    if dtype is None:
        qx, kx, vx = (x.bfloat16().double() for x in (qx, kx, vx))
    batch, seqlen_q, heads, head_dim = qx.shape
    group = heads // kx.shape[2]
    k, v = kx.repeat_interleave(group, 2), vx.repeat_interleave(group, 2)
    scale = head_dim ** -0.5
    logits = score.reference(torch.einsum("bqhd,bkhd->bhqk", qx, k) * scale, softcap)
    if causal:
        left, right = band(True, (-1, -1), seqlen_q, k.shape[1])
        logits = logits.masked_fill(~band_mask(seqlen_q, k.shape[1], left, right, device=qx.device), float("-inf"))
    p = torch.exp(logits - lse.double()[..., None])
    do = dout.double() if dtype is None else dequantize_blocks(*fp8.quantize_blocks(dout, do_rows, dtype), do_rows)
    delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    ds = score.reference_grad(p * (torch.einsum("bqhd,bkhd->bhqk", do, v) - delta[..., None]), logits, softcap)
    ds = ds.masked_fill(logits == float("-inf"), 0.0)  # (the softcap's f' of a masked -inf logit is not finite)
    if dtype is None:
        p_op, ds_q, ds_k = p.bfloat16().double(), ds.bfloat16().double(), ds.bfloat16().double()
    else:
        p_op = (p.float() * 256).to(dtype).double() / 256
        ds_q, ds_k = round_tiles(ds, 1, dq_keys, dtype), round_tiles(ds, kv_rows, 1, dtype)
    dv = torch.einsum("bhqk,bqhd->bkhd", p_op, do)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds_q, k) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds_k, qx) * scale
    return dq, *(x.unflatten(2, (-1, group)).sum(3) for x in (dk, dv))


class BackwardRun:
    """One fp8_attn_func forward and backward on inputs drawn for the backward tests: heads and
    rows of different magnitudes, so that a descale read for the wrong head or block is far off;
    ``zeros``: whole blocks of Q, K and dO zero (padded tokens), whose descales must stay usable.
    Keeps the leaves (their gradients), the float8 operands the kernels saw dequantized (qx, kx,
    vx), the FP8 backward's problem and plan, and the float64 oracle's gradients with respect
    to qx, kx, vx."""

    def __init__(self, fp8_backward, causal, heads_k, incoherent, scaling, softcap, zeros, tiles,
                 head_dim=HEAD_DIM):
        torch.manual_seed(5)
        dtype = torch.float8_e4m3fn
        seqlen_q, seqlen_k = (300, 420) if ON_GPU else (70, 90)

        def drawn(n, h, s):
            magnitudes = torch.linspace(0.5, 2.0, n, device=DEVICE)[:, None] * torch.arange(1, h + 1, device=DEVICE)
            return (torch.randn(2, n, h, head_dim, device=DEVICE) * s * magnitudes[..., None] ** 0.5).bfloat16()
        q, k, v = (drawn(n, h, s) for n, h, s in ((seqlen_q, 4, 1), (seqlen_k, heads_k, 2), (seqlen_k, heads_k, 0.5)))
        dout = torch.randn(2, seqlen_q, 4, head_dim, device=DEVICE, dtype=torch.bfloat16)
        if zeros:
            q[:, :seqlen_q // 2], k[:, -seqlen_k // 2:], dout[:, :seqlen_q // 2] = 0, 0, 0
        self.leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        self.out, self.lse = flashtile.fp8_attn_func(*self.leaves, causal=causal, incoherent=incoherent,
                                                     scaling=scaling, softcap=softcap, return_softmax_lse=True,
                                                     fp8_backward=fp8_backward, kernel_options=tiles)
        self.out.backward(dout)
        self.dout = dout
        # The operands the kernels saw: per block, the forward's float8 blocks (quantizing is
        # deterministic; tested against PyTorch's below); per head, this file's own quantize.
        scale = head_dim ** -0.5
        left, right = band(causal, (-1, -1), seqlen_q, seqlen_k)
        version = dispatch.resolve_version("auto", q.device)
        self.rows = rows = fp8._kernel_tiles(q, k, v, scale, left, right, softcap, None, version, tiles)
        q8, k8, v8, descale = fp8._quantized(q, k, v, dtype, True, rows, incoherent)
        if scaling == "head":
            m = fp8.rotation(head_dim, q.device) if incoherent else None
            self.operands = tuple(dequantized(*quantize(x.float() @ m if rotate else x, heads_k, dtype))
                                  for x, rotate in ((q, incoherent), (k, incoherent), (v, False)))
        else:
            self.operands = tuple(dequantize_blocks(x8, d, n)
                                  for x8, d, n in zip((q8, k8, v8), descale, (*rows, rows[1])))
        p = fp8.Problem.of(q8, k8, None, None, seqlen_q, seqlen_k, scale, left, right, softcap, fp8_descale=descale,
                           fp8_rows=tuple(rows))
        self.plan = dispatch.backward_plan(p, version, dispatch.target_of(p, q8, k8, v8), fp8.ops._options(tiles))
        doubles = [x.clone().requires_grad_() for x in self.operands]
        standard_attention(*doubles, causal=causal, upcast=True, softcap=softcap).backward(dout.double())
        self.oracle = [x.grad for x in doubles]
        self.rotation = fp8.rotation(head_dim, q.device).double() if incoherent else None

    def emulated(self, causal, softcap, *rounding):
        """emulated_backward of these operands (``rounding``: its float8 arguments, or none)."""
        return emulated_backward(*self.operands, self.dout, self.out, self.lse, causal, softcap, *rounding)

    def check(self, emulation, near="qkv"):
        """Each leaf's gradient against the oracle by the FA rule for gradients with ``emulation``
        (dq, dk, dv with respect to the operands) as the same-precision reference, and those
        named in ``near`` (rounded as the emulation rounds) near it."""
        oracle = self.oracle
        if self.rotation is not None:  # gradients of Q M and K M: back to Q's and K's
            m = self.rotation
            emulation = (emulation[0] @ m.T, emulation[1] @ m.T, emulation[2])
            oracle = (oracle[0] @ m.T, oracle[1] @ m.T, oracle[2])
        for name, leaf, ref, emulated_grad in zip("qkv", self.leaves, oracle, emulation):
            assert leaf.grad.dtype == torch.bfloat16
            emulated_grad = emulated_grad.bfloat16().double()  # as the gradients are returned
            assert_within_rule(f"d{name}", leaf.grad, emulated_grad, ref, GRAD_RULE)
            # and near the emulation itself, up to the bf16 gradients' own rounding: a descale
            # lost or applied twice, or other operands than the forward's, is far off
            if name in near:
                assert rmse(leaf.grad, emulated_grad) < (0.25 * rmse(emulated_grad, ref)
                                                         + 2 ** -7 * ref.square().mean().sqrt())


@pytest.mark.parametrize("fp8_backward, causal, heads_k, incoherent, scaling, softcap, zeros, tiles", [
    (True, False, 2, False, "block", 0.0, False, ""), (True, True, 2, False, "block", 0.0, False, ""),
    (True, True, 4, True, "block", 0.0, False, ""), (True, True, 2, False, "head", 0.0, False, ""),
    (True, False, 2, False, "block", 1.5, False, ""), (True, True, 2, False, "block", 0.0, True, ""),
    (True, True, 2, False, "block", 0.0, False, SMALL_BACKWARD_TILES),
    (True, False, 1, True, "head", 0.0, False, SMALL_BACKWARD_TILES),
    (False, False, 2, False, "block", 0.0, False, ""), (False, True, 4, True, "block", 0.0, False, ""),
    (False, True, 2, False, "head", 1.5, True, "")])
def test_fp8_backward_against_emulation(fp8_backward, causal, heads_k, incoherent, scaling, softcap, zeros, tiles):
    # fp8_attn_func's backward: by default the input type's kernels on the forward's dequantized
    # operands, with fp8_backward=True the five matmuls in float8 (v2's kernels, which kernel
    # option backward=v2 keeps on the GPU; the Gluon ones: below).  The gradients
    # with respect to those operands (rotated back) against float64, by the FA rule for
    # gradients with the emulated roundings as the same-precision reference; ``tiles``: descale
    # blocks larger than the backward's tiles.
    options = ";".join(x for x in ("backward=v2" if fp8_backward else "", tiles) if x)
    run = BackwardRun(fp8_backward, causal, heads_k, incoherent, scaling, softcap, zeros, options)
    if fp8_backward:
        rows = run.rows
        assert run.plan.kernel == "v2"
        kv_cfg, q_cfg = run.plan.config
        assert rows[0] % kv_cfg.block_m == 0 and rows[1] % q_cfg.block_n == 0
        if tiles and not ON_GPU:
            assert rows[0] > kv_cfg.block_m and rows[1] > q_cfg.block_n
        emulation = run.emulated(causal, softcap, torch.float8_e4m3fn, kv_cfg.block_m, q_cfg.block_n, kv_cfg.block_m)
    else:  # the kernels' gradients are bf16 before the rotation back
        emulation = [x.bfloat16().double() for x in run.emulated(causal, softcap)]
    run.check(emulation)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernels run on the GPU only")
@pytest.mark.parametrize("causal, heads_k, incoherent, scaling, softcap, zeros, head_dim", [
    (False, 2, False, "block", 0.0, False, HEAD_DIM), (True, 4, True, "block", 0.0, False, HEAD_DIM),
    (True, 2, False, "head", 1.5, True, HEAD_DIM), (False, 4, True, "block", 0.0, False, 256),
    (True, 2, False, "block", 1.5, True, 256), (True, 2, False, "block", 0.0, False, 192)])
def test_gluon_fp8_backward_against_emulation(causal, heads_k, incoherent, scaling, softcap, zeros, head_dim):
    # fp8_backward=True on the GPU: by default the float8 Gluon passes (gluon/backward_fp8.py:
    # dO per 64-row block, dV's P^T in one unit per KV head, dS and dS^T per row of the gradient
    # in a running unit; above d128 a dV pass and a dK pass).  The same-precision reference: the
    # float8 emulation (dS rounded per row of each block), which rounds otherwise: by the FA
    # rule only.
    run = BackwardRun(True, causal, heads_k, incoherent, scaling, softcap, zeros, "", head_dim)
    assert run.plan.kernel == "v3-gluon-fp8"
    cfg = run.plan.config
    run.check(run.emulated(causal, softcap, torch.float8_e4m3fn, cfg.kv_block_m, cfg.dq_block_n, cfg.kv_block_m),
              near="")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fp8_block_scales_against_dequantized_oracle(causal, head_dim):
    # Scales per block of the kernel's own tiles (a query head's BLOCK_M rows, a KV head's
    # BLOCK_N rows): the output against float64 on the same dequantized blocks, by the FA rule
    # with the emulated roundings as the same-precision reference.
    check_block_scales(causal, head_dim, *((300, 420) if ON_GPU else (70, 90)))  # several tiles


def check_block_scales(causal, head_dim, seqlen_q, seqlen_k):
    torch.manual_seed(2)
    dtype = torch.float8_e4m3fn
    q, k, v = (torch.randn(2, n, h, head_dim, device=DEVICE, dtype=torch.bfloat16) * s
               for n, h, s in ((seqlen_q, 4, 1), (seqlen_k, 2, 3), (seqlen_k, 2, 0.5)))
    scale = head_dim ** -0.5
    left, right = fp8.validation.band(causal, (-1, -1), seqlen_q, seqlen_k)
    tiles = fp8._kernel_tiles(q, k, v, scale, left, right, 0.0, None, fp8.dispatch.resolve_version("auto", q.device), "")
    out = flashtile.fp8_attn_func(q, k, v, causal=causal, incoherent=False)
    parts = [fp8.quantize_blocks(x, rows, dtype) for x, rows in zip((q, k, v), (*tiles, tiles[1]))]
    qx, kx, vx = (dequantize_blocks(x8, d, rows) for (x8, d), rows in zip(parts, (*tiles, tiles[1])))
    oracle = standard_attention(qx, kx, vx, causal=causal, upcast=True)
    assert_within_rule("out", out, emulated(qx, kx, vx, causal, dtype), oracle, OUT_RULE)
    assert tiles[0] < seqlen_q and tiles[1] < seqlen_k  # several blocks per sequence, so scales do differ


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rotate, head_dim", [(False, 48), (True, HEAD_DIM)])
def test_fused_quantize_matches_pytorch(dtype, rotate, head_dim):
    # The quantizing kernel (rotation, amax per block, scale, cast in one pass) against
    # fp8.quantize_blocks after a PyTorch matmul: the same descales, and the same float8 values,
    # with a rotation up to one step of the type where the product's rounding falls differently.
    torch.manual_seed(4)
    x = torch.randn(2, 70, 3, head_dim, device=DEVICE, dtype=torch.bfloat16) * 5
    m = fp8.rotation(head_dim, x.device) if rotate else None
    signs = fp8.rotation_signs(head_dim, x.dtype, x.device) if rotate else None
    if rotate:
        torch.testing.assert_close(signs.float() * head_dim ** -0.5, m, rtol=1e-6, atol=0)
    got, got_descale = fused_quantize_blocks(x, 32, dtype, fp8.FP8_MAX[dtype], signs)
    ref, ref_descale = fp8.quantize_blocks(x.float() @ m if rotate else x, 32, dtype)
    assert got.dtype == dtype and got.shape == x.shape and got_descale.shape == (2, 3, 3)
    torch.testing.assert_close(got_descale, ref_descale, rtol=1e-5, atol=0)
    step = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)
    a, b = got.float(), ref.float()
    differ = a != b
    assert differ.float().mean() < (0.01 if rotate else 1e-9)
    assert ((a - b).abs() <= step * b.abs() + 2.0 ** -6)[differ].all()


@pytest.mark.parametrize("mma_order", [False, True])
@pytest.mark.parametrize("shape, strided", [((2, 150, 3, 80), False), ((2, 150, 3, 80), True), ((131, 2, 64), False)],
                         ids=["batched", "heads-major view", "varlen"])
def test_keys_contiguous_copy(shape, strided, mma_order):
    # V with its keys contiguous (and, for the Gluon forward, in the float8 operand's order within
    # each 16) from the copy kernel: the same bytes as PyTorch's copies, zeros past seqlen; also
    # from a (batch, heads, seqlen, d) tensor seen as (batch, seqlen, heads, d).
    torch.manual_seed(5)
    if strided:
        b, n, h, d = shape
        v = (torch.randn(b, h, n, d, device=DEVICE) * 50).to(torch.float8_e4m3fn).transpose(1, 2)
    else:
        v = (torch.randn(shape, device=DEVICE) * 50).to(torch.float8_e4m3fn)
    row = -(-shape[-3] // 16) * 16 + 32
    got = keys_contiguous.copy(v, row, mma_order)
    ref = keys_contiguous.reference(v, row, mma_order)
    assert got.shape == ref.shape == (*shape[:-3], shape[-2], shape[-1], row)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    # (the operand's order mixes the keys of the last group of 16 with its padding)
    assert not got[..., -(-shape[-3] // 16) * 16 if mma_order else shape[-3]:].float().any()
    if mma_order:
        with pytest.raises(ValueError, match="row=20"):
            keys_contiguous.copy(v, 20, mma_order)


def test_gluon_fp8_backward_do_factors():
    # The float8 dK/dV pass's dO factors: per block (descale, f) with f = 2^8 x the block's
    # descale over the largest of its (sequence, KV head), that largest per KV head.
    from flashtile.kernels.gluon.backward_fp8 import do_factors
    p = fp8.Problem(2, 6, 3, 256, 256, 64, 0.125, -1, -1, None, None)
    descale = torch.rand(2, 6, 4) + 0.01
    factors, bound = do_factors(p, descale)
    largest = descale.view(2, 3, 8).amax(-1)
    assert torch.equal(bound, largest) and bound.is_contiguous()
    f = 256 * descale / largest.repeat_interleave(2, 1)[..., None]
    assert factors.shape == (2, 2, 6, 4) and torch.equal(factors[0], descale) and torch.allclose(factors[1], f)
    assert f.max() <= 256 and torch.allclose(f.amax(-1).view(2, 3, 2).amax(-1), torch.full((2, 3), 256.0))
