"""Every version's kernels, forward and all three gradients, against the float64 oracle: the
feature grid (causal, windows, GQA, head dims, varlen, softcap, ALiBi, sinks, strides, empty and non-finite
inputs) and each v3 kernel forced where it would not run by default."""
import math

import pytest
import torch
from attention_check import check_against_reference, make_qkv, max_err
from conftest import DEVICE, ON_GPU

from flashtile import flash_attn_func, flash_attn_varlen_func, gpu, standard_attention
from flashtile.kernels import configs
from flashtile.kernels.gluon import backward as gluon_bwd
from flashtile.kernels.gluon import forward as gluon_fwd
from flashtile.kernels.gluon import scheduler
from flashtile.kernels.problem import Problem

VERSIONS = ["v1", "v2", "v3", "tiled"]
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
# Sequence lengths that are not block multiples, with seqlen_q < / = / > seqlen_k.
SEQLENS = ([(1000, 1000), (511, 1537), (2049, 700), (4096, 4096)] if ON_GPU
           else [(113, 113), (70, 131), (131, 70)])
BATCH, HEADS = (2, 4) if ON_GPU else (1, 2)
# Softcap's tanh runs as one MUFU instruction on the GPU (relative error about 2**-11), as in
# FlashAttention-3, whose tests allow 3x the PyTorch error with softcap.
SOFTCAP_RULE = (3.0, 1e-5)


def attention(version, **kw):
    return lambda a, b, c: flash_attn_func(a, b, c, version=version, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_matches_oracle(version, causal, seqlens, dtype):
    # GQA: 2 query heads per K/V head.
    q, k, v = make_qkv(BATCH, *seqlens, 2 * HEADS, HEADS, 64, dtype, DEVICE)
    check_against_reference(attention(version, causal=causal), q, k, v, causal=causal)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("share", [2, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_forward_with_exponentials_on_the_fma_pipe(head_dim, share, dtype):
    # tiles.v3_gluon's fourth integer: 1/share of the exponentials by tiles.exp2_fma, causal
    # (masked keys and rows must stay exactly 0) and not, lengths off the blocks.
    cfg = configs.by_head_dim(configs.V3_GLUON, head_dim)
    options = f"tiles.v3_gluon={cfg.block_n},{cfg.num_stages},2,{share}"
    for causal in (False, True):
        q, k, v = make_qkv(BATCH, 1000, 1537, 2 * HEADS, HEADS, head_dim, dtype, DEVICE)
        check_against_reference(attention("v3", causal=causal, kernel_options=options), q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim", [20, 96, 128, 192, 256] if ON_GPU else [20, 96, 256])
@pytest.mark.parametrize("version", VERSIONS)
def test_head_dims(version, head_dim):
    # 20 is padded to 24 (a multiple of 8, as flash_attn pads), the scale staying 20's.
    seqlen = 777 if ON_GPU else 67
    q, k, v = make_qkv(BATCH, seqlen, seqlen, HEADS, HEADS, head_dim, DTYPES[0], DEVICE)
    check_against_reference(attention(version, causal=True), q, k, v, causal=True)


@pytest.mark.parametrize("window", [(16, 8), (-1, 5), (40, -1)])
@pytest.mark.parametrize("version", VERSIONS)
def test_sliding_window(version, window):
    sq, sk = (900, 1300) if ON_GPU else (90, 130)
    q, k, v = make_qkv(BATCH, sq, sk, HEADS, 1, 64, DTYPES[0], DEVICE)  # MQA
    check_against_reference(attention(version, window_size=window), q, k, v, window_size=window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_softcap(version, causal):
    # Gemma 2's score cap, forward and backward, with GQA and lengths off the block grid; the
    # scores are scaled up so that the cap bends them (a cap of 5 on scores reaching ~15).
    sq, sk = (700, 1000) if ON_GPU else (70, 100)
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, 64, DTYPES[0], DEVICE)
    q = q * 3
    check_against_reference(attention(version, causal=causal, softcap=5.0), q, k, v, causal=causal, softcap=5.0,
                            rules=(SOFTCAP_RULE, (3.0, 1e-4)))


@pytest.mark.parametrize("version", VERSIONS)
def test_softcap_rows_far_below_the_cap(version):
    # Rows whose every score is far below the cap, the cap high: with the cap as the reference
    # point (the Gluon forward's bound, bf16) their probabilities sit about 2**-86 below it and
    # must still average V, as the reference does.
    sq, sk = (300, 700) if ON_GPU else (40, 70)
    q, k, v = make_qkv(BATCH, sq, sk, HEADS, HEADS, 64, DTYPES[0], DEVICE)
    k = k[:, :1].expand_as(k).contiguous()  # one key repeated: every score of a row is equal
    q[:, ::2] = -8 * k[:, :1]                # half the rows score about -8 * |k|^2 / sqrt(d) on every key
    check_against_reference(attention(version, softcap=30.0), q, k, v, softcap=30.0,
                            rules=(SOFTCAP_RULE, (3.0, 1e-4)))


@pytest.mark.parametrize("version", VERSIONS)
def test_softcap_far_above_the_scores(version):
    # A cap far above every score bends none of them: tanh(x / cap) near 0, where a tanh formed
    # from exponentials loses its digits, must still give the scores back.
    sq, sk = (300, 700) if ON_GPU else (40, 70)
    q, k, v = make_qkv(BATCH, sq, sk, HEADS, HEADS, 64, torch.bfloat16, DEVICE)  # (a cap past fp16's range)
    check_against_reference(attention(version, softcap=1e6), q, k, v, softcap=1e6,
                            rules=(SOFTCAP_RULE, (3.0, 1e-4)))


def alibi_slopes(*shape):
    """BLOOM's slopes 2^(-8 i / heads) over the last dim, scaled per leading index so that rows
    of a (batch, heads) table differ."""
    heads = shape[-1]
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=DEVICE) / heads)
    return (slopes * (1 + torch.rand(shape[:-1] + (1,), device=DEVICE))).float().expand(shape).contiguous()


@pytest.mark.parametrize("shape", [(700, 1000, 64), (1100, 600, 128), (500, 900, 256)] if ON_GPU else [(70, 100, 64)])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_alibi(version, causal, per_batch, shape):
    # flash_attn's ALiBi bias -slope * |i + seqlen_k - seqlen_q - j| on the scaled scores, one
    # slope per query head or per (batch, head), with GQA and seqlen_q != seqlen_k (the bias is
    # zero on the bottom-right diagonal), forward and backward.  On the GPU the diagonal sits
    # right and left of the first row (the Gluon kernels' blocks left and right of every row's
    # diagonal take the bias as a column and a row part), d64 to d256.
    sq, sk, head_dim = shape
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, head_dim, DTYPES[0], DEVICE)
    slopes = alibi_slopes(BATCH, 2 * HEADS) if per_batch else alibi_slopes(2 * HEADS)
    check_against_reference(attention(version, causal=causal, alibi_slopes=slopes), q, k, v, causal=causal,
                            alibi_slopes=slopes)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernels run on the GPU")
@pytest.mark.parametrize("feature", ["alibi", "softcap"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backward", ["gluon", "gluon-reduce"])
@pytest.mark.parametrize("causal", [False, True])
def test_score_mods_v3_backward_kernels(causal, backward, head_dim, feature):
    # Both Gluon backwards with ALiBi or a softcap, forced (the single pass runs by default only
    # from 2k keys): ALiBi's blocks left and right of the diagonal split the bias, those across
    # it too in the single pass and the dQ pass, through the hook in the dK/dV pass.
    q, k, v = make_qkv(BATCH, 1100, 900, 2 * HEADS, HEADS, head_dim, DTYPES[0], DEVICE)
    if feature == "alibi":
        kw, rules = dict(alibi_slopes=alibi_slopes(BATCH, 2 * HEADS)), {}
    else:
        q, kw, rules = q * 3, dict(softcap=5.0), dict(rules=(SOFTCAP_RULE, (3.0, 1e-4)))
    check_against_reference(attention("v3", causal=causal, kernel_options=f"backward={backward}", **kw), q, k, v,
                            causal=causal, **rules, **kw)


@pytest.mark.parametrize("version", VERSIONS)
def test_alibi_with_softcap_and_window(version):
    # ALiBi after the cap, inside a sliding window: the two score modifications composed.
    sq, sk = (900, 700) if ON_GPU else (90, 70)
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, 64, DTYPES[0], DEVICE)
    q = q * 3
    slopes, window = alibi_slopes(BATCH, 2 * HEADS), (30, 10)
    check_against_reference(attention(version, window_size=window, softcap=5.0, alibi_slopes=slopes), q, k, v,
                            window_size=window, softcap=5.0, alibi_slopes=slopes, rules=(SOFTCAP_RULE, (3.0, 1e-4)))


def _sink_case(flash, reference, q, k, v, sinks):
    """Output, logsumexp and the gradients of q, k, v and the sinks (a loss reaching the output
    and the logsumexp) of flash and of the reference in float64 and in the input dtype."""
    dout, dlse = torch.randn_like(q), None

    def run(fn, inputs, upcast):
        nonlocal dlse
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out, lse = fn(*leaves)
        if dlse is None:
            dlse = torch.randn_like(lse)
        loss = (out * (dout.double() if upcast else dout)).sum() + (lse * dlse).sum()
        return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)

    ours = run(flash, (q, k, v, sinks), False)
    oracle = run(lambda *t: reference(*t, upcast=True), (q, k, v, sinks), True)
    pytorch = run(lambda *t: reference(*t, upcast=False), (q, k, v, sinks), False)
    return ours, oracle, pytorch


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_sinks(version, causal):
    # A learnable logit per head in every row's softmax (gpt-oss): output, logsumexp (which
    # includes it) and the gradients of q, k, v and the sinks, through a loss that also reaches
    # the logsumexp.  seqlen_q > seqlen_k: with causal, the first rows see only the sink.
    sq, sk = (1100, 700) if ON_GPU else (110, 70)
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, 64, DTYPES[0], DEVICE)
    sinks = torch.randn(2 * HEADS, device=DEVICE) * 2

    def flash(a, b, c, s):
        out, lse, _ = flash_attn_func(a, b, c, causal=causal, sinks=s, return_attn_probs=True, version=version)
        return out, lse

    def reference(a, b, c, s, upcast):
        return standard_attention(a, b, c, causal=causal, sinks=s, upcast=upcast, return_lse=True)

    (out, lse, grads), (ref, ref_lse, ref_grads), (pt, _, pt_grads) = _sink_case(flash, reference, q, k, v, sinks)
    assert max_err(out, ref) <= 2 * max_err(pt, ref) + 1e-5
    assert max_err(lse, ref_lse) <= 1e-3
    if causal:  # rows that see no key: output 0, logsumexp = the sink
        assert (out[:, :sq - sk] == 0).all()
        torch.testing.assert_close(lse[:, :, :sq - sk], sinks[None, :, None].expand(BATCH, -1, sq - sk))
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, pt_grads):
        assert torch.isfinite(g).all(), name
        assert max_err(g, g_ref) <= 3 * max_err(g_pt, g_ref) + 1e-4, name


@pytest.mark.parametrize("version", VERSIONS)
def test_sinks_of_minus_and_plus_infinity(version):
    # A sink of -inf is no sink (rows that see no key: 0 and lse +inf, not NaN); one of +inf takes
    # every row's mass (0, lse +inf, no gradient through the scores); the other heads are as
    # with finite sinks alone.  Output, logsumexp and every gradient, causal with rows that see
    # no key.
    sq, sk = (300, 200) if ON_GPU else (30, 20)
    q, k, v = make_qkv(1, sq, sk, 4, 4, 32, DTYPES[0], DEVICE)
    finite = torch.randn(4, device=DEVICE)
    dout, dlse = torch.randn_like(q), torch.randn(1, 4, sq, device=DEVICE)

    def run(sinks):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        table = None if sinks is None else sinks.clone().requires_grad_()
        out, lse, _ = flash_attn_func(*leaves, causal=True, sinks=table, return_attn_probs=True, version=version)
        seen = torch.isfinite(lse)
        loss = (out.float() * dout).sum() + (torch.where(seen, lse, 0.0) * dlse).sum()
        grads = torch.autograd.grad(loss, leaves + ([] if table is None else [table]))
        return out, lse, grads
    out, lse, (dq, dk, dv, dsinks) = run(torch.tensor([float("-inf"), float("inf"), 0, 0], device=DEVICE) +
                                         torch.cat([torch.zeros(2, device=DEVICE), finite[2:]]))
    plain, plain_lse, plain_grads = run(None)
    with_finite, finite_lse, finite_grads = run(finite)
    assert not any(x.isnan().any() for x in (out, lse, dq, dk, dv, dsinks))
    torch.testing.assert_close(out[:, :, 0], plain[:, :, 0], atol=0, rtol=0)
    assert torch.equal(lse[:, 0], plain_lse[:, 0]) and (lse[:, 0, :sq - sk] == float("inf")).all()
    assert (out[:, :, 1] == 0).all() and (lse[:, 1] == float("inf")).all()
    torch.testing.assert_close(out[:, :, 2:], with_finite[:, :, 2:], atol=0, rtol=0)
    torch.testing.assert_close(lse[:, 2:], finite_lse[:, 2:], atol=0, rtol=0)
    for g, g_plain, g_finite in zip((dq, dk, dv), plain_grads, finite_grads):
        torch.testing.assert_close(g[:, :, 0], g_plain[:, :, 0], atol=1e-3, rtol=0)
        assert (g[:, :, 1] == 0).all()
        torch.testing.assert_close(g[:, :, 2:], g_finite[:, :, 2:], atol=1e-3, rtol=0)
    # d sink: 0 where the sink takes no mass, and where it takes all (the output stays 0 and the
    # loss reads no infinite logsumexp).
    assert dsinks[0] == 0 and dsinks[1] == 0
    torch.testing.assert_close(dsinks[2:], finite_grads[3][2:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("version", VERSIONS)
def test_sinks_given_as_a_strided_view(version):
    # One logit per head read at its stride: a column of a (heads, 2) table gives the same output
    # and gradients as its contiguous copy.
    q, k, v = make_qkv(1, 40, 40, HEADS, HEADS, 32, DTYPES[0], DEVICE)
    values = torch.randn(HEADS, 2, device=DEVICE)
    results = []
    for strided in (True, False):
        table = values.clone().requires_grad_()
        sinks = table[:, 0] if strided else table[:, 0].contiguous()
        assert sinks.is_contiguous() != strided
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_attn_func(*leaves, causal=True, sinks=sinks, version=version)
        results.append((out, *torch.autograd.grad(out, (*leaves, table), torch.ones_like(out))))
    for strided, contiguous in zip(*results):
        assert torch.equal(strided, contiguous)


@pytest.mark.parametrize("varlen", [False, True])
def test_sink_join_and_gradient_kernels_match_their_pytorch_form(varlen, monkeypatch):
    # The join and the sinks' gradient run as Triton kernels wherever Triton runs, as PyTorch
    # operations elsewhere: the same results, rows that saw no key (lse +inf) included.
    from flashtile import sinks as attention_sinks
    heads, d = 3, 40
    shape = (57, heads, d) if varlen else (2, 29, heads, d)
    out = torch.randn(shape, device=DEVICE).to(DTYPES[0])
    lse = torch.randn((heads, 57) if varlen else (2, heads, 29), device=DEVICE) + 2
    lse[..., 5:9] = float("inf")
    out[(slice(5, 9),) if varlen else (slice(None), slice(5, 9))] = 0
    sinks, dout, dlse = torch.randn(heads, device=DEVICE), torch.randn_like(out), torch.randn_like(lse)
    saved = torch.empty(0, device=DEVICE)
    results = []
    for on_triton in (True, False):
        monkeypatch.setattr(attention_sinks, "_on_triton", lambda x: on_triton)
        joined_out, joined_lse, _ = attention_sinks.join(varlen, out.clone(), lse, saved, sinks)
        grads = [attention_sinks.gradient(varlen, sinks, joined_out, joined_lse, dout, g) for g in (None, dlse)]
        results.append((joined_out.float(), joined_lse, *grads))
    assert torch.isfinite(results[0][1]).all()
    for triton_result, pytorch_result in zip(*results):
        torch.testing.assert_close(triton_result, pytorch_result, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kernel", ["gluon", "triton"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_v3_both_forward_kernels_on_short_bands(kernel, head_dim):
    # v3's two forwards, the Gluon one (its default on the GPU) and the plain-Triton fallback
    # (varlen, stride-0 layouts), each on short causal bands.
    sq, sk = (300, 1000) if ON_GPU else (40, 70)
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, head_dim, DTYPES[-1], DEVICE)
    check_against_reference(attention("v3", causal=True, kernel_options=f"forward={kernel}"), q, k, v, causal=True)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
@pytest.mark.parametrize("window", [(-1, 0), (40, 8)])
def test_v3_forward_three_consumers_on_bands(monkeypatch, window):
    # d64's three consumer warpgroups (192-row tiles, tails that are not tile multiples) on bands,
    # which take them only from 8k queries by default: here from any length.
    monkeypatch.setitem(configs.THREE_CONSUMERS_FROM, True, 0)
    q, k, v = make_qkv(BATCH, 1000, 1300, 2 * HEADS, HEADS, 64, DTYPES[0], DEVICE)
    check_against_reference(attention("v3", window_size=window, kernel_options="tiles.v3_gluon=128,3,3"), q, k, v,
                            window_size=window)


def _causal_gluon_forward():
    """A causal v3 forward on the Gluon kernel (tiles from its counter): the call and its eager output."""
    q, k, v = make_qkv(BATCH, 1000, 1000, 2 * HEADS, HEADS, 128, DTYPES[0], DEVICE)

    def call():
        return flash_attn_func(q, k, v, causal=True, version="v3")
    return call, call()


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
def test_v3_tile_counter_survives_a_stale_value():
    # Causal tiles come from an epoch-tagged counter per stream: a launch raises it to its own
    # epoch before taking a tile, so garbage left in it (a launch that died half-way) skips
    # nothing.  Launches back to back, on the default and a side stream, with the counters
    # poisoned in between, give the same output bit for bit.
    call, first = _causal_gluon_forward()
    stream = torch.cuda.current_stream().cuda_stream
    counter = scheduler._stream_counter(first.device.index, stream)
    for poison in (1 << 40, counter.epoch << scheduler.EPOCH_BITS | 12345, 2**62):
        counter.buffer.fill_(poison)
        assert torch.equal(call(), first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = [call() for _ in range(3)]
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in again)
    # At the end of its epochs a counter is zeroed and starts again.
    counter.epoch = scheduler.MAX_EPOCH
    assert torch.equal(call(), first) and counter.epoch == 1


@pytest.mark.skipif(not ON_GPU, reason="the Gluon backward runs on the GPU only")
def test_v3_causal_backward_takes_its_tiles_from_the_counter(monkeypatch, fresh_launches):
    # The two Gluon passes over causal tiles on persistent CTAs (here 3) take each tile from the
    # stream's counter, as the forward does: backwards back to back give the same gradients bit
    # for bit.
    monkeypatch.setattr(gpu, "sm_count", lambda index: 3)
    q, k, v = (x.requires_grad_() for x in make_qkv(BATCH, 1000, 1000, 2 * HEADS, HEADS, 64, DTYPES[0], DEVICE))
    out = flash_attn_func(q, k, v, causal=True, version="v3", kernel_options="backward=gluon")
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(2):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_v3_causal_forward_replays_in_a_cuda_graph():
    # A captured launch takes a tile counter of its own, zeroed at each replay: replays of the
    # causal Gluon forward overwrite a poisoned output with the eager result, bit for bit.
    call, eager = _causal_gluon_forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("kernels, head_dim", [("gluon", 64), ("gluon", 128), ("gluon", 192), ("gluon", 256),
                                               ("gluon-reduce", 64), ("gluon-reduce", 128)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 8)])
def test_v3_gluon_backward(monkeypatch, fresh_launches, kernels, head_dim, window, tiles=""):
    # v3's Gluon backwards (on the GPU; the interpreter keeps v2's), two passes or one with dQ by
    # TMA reduce-add (d64 and d128; the two passes split the head dim at d256), against the
    # oracle: GQA, seqlens that are not block multiples, causal and a sliding window.  As if the
    # GPU had 3 SMs: where a pass runs persistent CTAs each takes several tiles.
    monkeypatch.setattr(gpu, "sm_count", lambda index: 3)
    sq, sk = (700, 1000) if ON_GPU else (40, 70)
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, head_dim, DTYPES[0], DEVICE)
    check_against_reference(attention("v3", window_size=window, kernel_options=f"backward={kernels};{tiles}"),
                            q, k, v, window_size=window)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernels run on the GPU only")
@pytest.mark.parametrize("l2_budget", [768_000, 1_100_000])
@pytest.mark.parametrize("kernels", ["gluon", "gluon-reduce"])
def test_v3_bands_walk_heads_in_uneven_groups(monkeypatch, fresh_launches, kernels, l2_budget):
    # A band's tiles are walked in groups of the heads whose streamed blocks fit in L2: with this
    # budget 3 heads (16 = 5 x 3 + 1) in the forward and the dQ pass and 2 in the dK/dV pass,
    # or 4 and 3 (8 = 3 + 3 + 2), on 3 persistent CTAs (the backward's passes walk heads
    # together whatever their tile count here).
    monkeypatch.setattr(scheduler, "L2_BUDGET", l2_budget)
    monkeypatch.setattr(gpu, "sm_count", lambda index: 3)
    monkeypatch.setattr(gluon_bwd, "BALANCE_TILES_PER_SM", 10**6)
    groups = []  # the head groups the launches take

    def recorded(choose):
        def choose_and_record(*args):
            groups.append(choose(*args))
            return groups[-1]
        return choose_and_record

    for module in (gluon_fwd, gluon_bwd):
        monkeypatch.setattr(module, "heads_sharing_l2", recorded(module.heads_sharing_l2))
    q, k, v = make_qkv(BATCH, 700, 1000, 2 * HEADS, HEADS, 64, DTYPES[0], DEVICE)
    check_against_reference(attention("v3", causal=True, kernel_options=f"backward={kernels}"), q, k, v, causal=True)
    assert set(groups) == ({3, 2} if l2_budget == 768_000 else {4, 3})


@pytest.mark.parametrize("head_dim, dlse", [(64, False), (40, True)])
def test_single_pass_delta_zeroes_the_dq_accumulator(head_dim, dlse):
    # The single pass's first kernel: D = rowsum(dO * O) - dlse per row, and the float32 dQ its
    # reduce-adds go into zeroed, whatever it held; rows off the 64-row grid, a padded head dim.
    seqlen = 100
    out, dout = (torch.randn(BATCH, seqlen, HEADS, head_dim, device=DEVICE).to(DTYPES[0]) for _ in range(2))
    lse = torch.randn(BATCH, HEADS, seqlen, device=DEVICE)
    grad_lse = torch.randn_like(lse) if dlse else None
    dq_acc = torch.full((BATCH, seqlen, HEADS, head_dim), float("nan"), device=DEVICE)
    p = Problem(BATCH, HEADS, HEADS, seqlen, seqlen, head_dim, 0.1, -1, -1, None, None)
    delta = gluon_bwd.delta_of(p, out, dout, grad_lse, lse, dq_acc)
    expected = (out.float() * dout.float()).sum(-1).transpose(1, 2) - (grad_lse if dlse else 0.0)
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(dq_acc, torch.zeros_like(dq_acc))
    # D alone (the float8 passes'): the same rows, no accumulator
    torch.testing.assert_close(gluon_bwd.delta_of(p, out, dout, grad_lse, lse), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 8)])
def test_v3_single_pass_with_64_row_q_blocks(monkeypatch, fresh_launches, window):
    # d64's single pass runs 128-row Q blocks (_kv_consumers_shared_scores, in
    # test_v3_gluon_backward); with 64-row ones (a tile override) it runs d128's consumers.
    test_v3_gluon_backward(monkeypatch, fresh_launches, "gluon-reduce", 64, window, "tiles.v3_gluon_bwd_reduce=64,128,3")


@pytest.mark.parametrize("kernels", ["gluon", "gluon-reduce"])
def test_v3_gluon_backward_through_logsumexp(kernels):
    test_gradient_through_logsumexp("v3", head_dim=64, kernel_options=f"backward={kernels}")


@pytest.mark.parametrize("version", VERSIONS)
def test_bf16(version):
    q, k, v = make_qkv(1, 77, 93, 2, 1, 32, torch.bfloat16, DEVICE)
    check_against_reference(attention(version, causal=True), q, k, v, causal=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_logsumexp(version):
    q, k, v = make_qkv(BATCH, 100, 70, HEADS, HEADS, 32, DTYPES[0], DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, version=version)
    _, ref_lse = standard_attention(q, k, v, causal=True, upcast=True, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (BATCH, HEADS, 100)
    # bottom-right causal with seqlen_q > seqlen_k: the first 30 rows see no key.
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (out[:, :30] == 0).all()
    finite = torch.isfinite(ref_lse)
    assert max_err(lse[finite], ref_lse[finite]) < 1e-2


@pytest.mark.parametrize("version", VERSIONS)
def test_fully_masked_rows_have_zero_output_and_finite_grads(version):
    q, k, v = make_qkv(1, 50, 20, 2, 2, 32, DTYPES[0], DEVICE)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn_func(*leaves, causal=True, version=version)
    out.float().square().sum().backward()
    assert (out[:, :30] == 0).all()
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    assert (leaves[0].grad[:, :30] == 0).all()


def _one_key_poisoned(version, which, value, softcap=0.0):
    """Key J's K (``which`` 1) or V (2) set to ``value`` under a sliding window (4, 0), which
    rows J..J+4 see it through: flashtile's output and gradients, the float64 oracle's on the
    clean inputs, the rows that see key J and the keys those rows see."""
    seqlen, J = (1100, 700) if ON_GPU else (90, 50)
    window = (4, 0)
    clean = make_qkv(1, seqlen, seqlen, 2, 2, 64, DTYPES[0], DEVICE)
    poisoned = list(clean)
    poisoned[which] = clean[which].clone()
    poisoned[which][0, J] = value
    dout = torch.randn_like(clean[0])
    leaves = [x.clone().requires_grad_() for x in poisoned]
    out = flash_attn_func(*leaves, window_size=window, softcap=softcap, version=version)
    grads = torch.autograd.grad(out, leaves, dout)
    oracle = [x.double().requires_grad_() for x in clean]
    ref = standard_attention(*oracle, window_size=window, softcap=softcap, upcast=True)
    ref_grads = torch.autograd.grad(ref, oracle, dout.double())
    seeing = torch.zeros(seqlen, dtype=torch.bool, device=DEVICE)
    seeing[J:J + window[0] + 1] = True
    reached = torch.zeros(seqlen, dtype=torch.bool, device=DEVICE)
    reached[J - window[0]:J + window[0] + 1] = True
    return out, grads, ref, ref_grads, seeing, reached


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("version", VERSIONS)
def test_masked_keys_contribute_nothing_whatever_their_value(version, value):
    # The masking rule: a key outside a row's band adds nothing to it, even an infinite or NaN
    # value (the tensor cores' P V would make 0 * inf = NaN).  Key J is seen by rows J..J+4
    # only.  Their outputs (and the gradients through them) are not finite, as in exact
    # arithmetic; every other row, and the gradient of every key those rows do not reach,
    # equals attention with that value replaced by 0.  Rows that see no key stay 0.
    out, (dq, dk, dv), ref, (ref_dq, ref_dk, ref_dv), seeing, reached = _one_key_poisoned(version, 2, value)
    assert not torch.isfinite(out[0, seeing]).all(dim=-1).any()
    assert torch.isfinite(out[0, ~seeing]).all()
    assert max_err(out[0, ~seeing], ref[0, ~seeing]) < 2e-2
    assert torch.isfinite(dq[0, ~seeing]).all() and max_err(dq[0, ~seeing], ref_dq[0, ~seeing]) < 5e-2
    assert torch.isfinite(dk[0, ~reached]).all() and max_err(dk[0, ~reached], ref_dk[0, ~reached]) < 5e-2
    assert torch.isfinite(dv).all() and max_err(dv, ref_dv) < 5e-2


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("version", ["v1", "v2", "tiled"])
def test_masked_keys_send_no_gradient_whatever_their_key(version, value, softcap):
    # The masking rule in the backward, with K: key J's score is not finite for the rows that
    # see it; every other row's dQ (dS times K: 0 times inf would be NaN), and the dK and dV of
    # the keys those rows do not reach, are attention's with key J left out.  (v3's Gluon
    # backward does not keep this: docs/README.md, the masking rule.)
    out, (dq, dk, dv), ref, (ref_dq, ref_dk, ref_dv), seeing, reached = _one_key_poisoned(version, 1, value, softcap)
    assert torch.isfinite(out[0, ~seeing]).all() and max_err(out[0, ~seeing], ref[0, ~seeing]) < 2e-2
    assert torch.isfinite(dq[0, ~seeing]).all() and max_err(dq[0, ~seeing], ref_dq[0, ~seeing]) < 5e-2
    for g, g_ref in ((dk, ref_dk), (dv, ref_dv)):
        assert torch.isfinite(g[0, ~reached]).all() and max_err(g[0, ~reached], g_ref[0, ~reached]) < 5e-2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_storage_past_the_keys_and_head_dim_is_never_read(version, causal):
    # K and V viewed out of wider buffers that hold inf / NaN past seqlen_k and past the head
    # dim: no row sees any of it (the Gluon forward checks its rows for non-finite values only
    # on a band, relying on keys past the tensors being read as zeros).
    sq, sk, head_dim = (1000, 700, 96) if ON_GPU else (70, 50, 40)
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, head_dim, DTYPES[0], DEVICE)
    views = []
    for x, poison in ((k, float("nan")), (v, float("inf"))):
        wide = torch.full((BATCH, sk + 37, HEADS, head_dim + 32), poison, dtype=x.dtype, device=DEVICE)
        wide[:, :sk, :, :head_dim] = x
        views.append(wide[:, :sk, :, :head_dim])
    assert not views[1].is_contiguous()
    out = flash_attn_func(q, *views, causal=causal, version=version)
    ref = standard_attention(*(x.double() for x in (q, k, v)), causal=causal, upcast=True)
    rows = slice(sq - sk, None) if causal else slice(None)  # bottom-right: the first rows see no key
    assert torch.isfinite(out).all()
    assert max_err(out[:, rows], ref[:, rows]) < 2e-2


@pytest.mark.parametrize("version", VERSIONS)
def test_rows_that_see_no_key_stay_zero_next_to_non_finite_values(version):
    # Bottom-right causal with more queries than keys: the first rows see no key; the key they
    # sit next to in the diagonal block holds inf.
    q, k, v = make_qkv(1, 80, 40, 2, 2, 32, DTYPES[0], DEVICE)
    v[0, 39] = float("inf")
    out = flash_attn_func(q, k, v, causal=True, version=version)
    assert (out[0, :40] == 0).all()


@pytest.mark.parametrize("version", VERSIONS)
def test_gradient_through_logsumexp(version, head_dim=32, kernel_options=None):
    """A loss that uses softmax_lse gets its gradient too (it folds into D in the backward)."""
    q, k, v = make_qkv(1, 45, 60, 2, 2, head_dim, DTYPES[0], DEVICE)
    w = torch.randn(1, 2, 45, device=DEVICE)

    def grads(fn, dtype=None):
        leaves = [x.clone().to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves)
        (out.double().sum() + (lse.double() * w).sum()).backward()
        return [x.grad for x in leaves]

    ours = grads(lambda *a: flash_attn_func(*a, causal=True, return_attn_probs=True, version=version,
                                            kernel_options=kernel_options)[:2])
    oracle = grads(lambda *a: standard_attention(*a, causal=True, upcast=True, return_lse=True), torch.float64)
    pt = grads(lambda *a: standard_attention(*a, causal=True, return_lse=True))
    for g, g_ref, g_pt in zip(ours, oracle, pt):
        assert max_err(g, g_ref) <= 3 * max_err(g_pt, g_ref) + 1e-4


# Packed sequences' lengths: one without queries (on the GPU: one query), seqlen_q <, =, > seqlen_k.
VARLEN_Q = [37, 0, 93, 70] if not ON_GPU else [370, 1, 930, 2000]
VARLEN_K = [50, 20, 93, 33] if not ON_GPU else [500, 200, 930, 1333]


def _per_sequence(cu_q, cu_k, q, k, v):
    """(b, query rows, key rows, (q, k, v) of sequence b as a batch of one) for every sequence
    with queries."""
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop > qs.start:
            yield b, qs, ks, [x[None].detach() for x in (q[qs], k[ks], v[ks])]


def _varlen_case(lengths_q, lengths_k, heads_q=4, heads_k=2, d=64):
    cu_q = torch.tensor([0] + lengths_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths_q), heads_q, d, dtype=DTYPES[0], device=DEVICE)
    k = torch.randn(sum(lengths_k), heads_k, d, dtype=DTYPES[0], device=DEVICE)
    return q, k, torch.randn_like(k), cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_varlen(version, causal):
    q, k, v, cu_q, cu_k = _varlen_case(VARLEN_Q, VARLEN_K)
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), causal=causal,
                                         return_attn_probs=True, version=version)
    assert lse.shape == (4, sum(VARLEN_Q))
    grads = torch.autograd.grad(out, leaves, dout)
    # Each sequence on its own, through the batched path, gives the same numbers; on the GPU,
    # v3's varlen runs the plain-Triton forward and v2's backward, so the batched calls here take
    # those too (the Gluon kernels are checked against the oracle elsewhere).
    for _, qs, ks, one in _per_sequence(cu_q, cu_k, q, k, v):
        one = [x.clone().requires_grad_() for x in one]
        o1 = flash_attn_func(*one, causal=causal, version=version, kernel_options="forward=triton;backward=v2")
        g1 = torch.autograd.grad(o1, one, dout[qs][None])
        torch.testing.assert_close(out[qs], o1[0], atol=2e-3, rtol=0)
        for g, gb, s in zip(grads, g1, (qs, ks, ks)):
            torch.testing.assert_close(g[s], gb[0], atol=5e-3, rtol=0)
    b = 2
    qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
    ref = standard_attention(q[qs][None], k[ks][None], v[ks][None], causal=causal, upcast=True)
    pt = standard_attention(q[qs][None], k[ks][None], v[ks][None], causal=causal)
    assert max_err(out[qs][None], ref) <= 2 * max_err(pt, ref) + 1e-5


@pytest.mark.parametrize("version", VERSIONS)
def test_varlen_alibi_takes_each_sequence_slopes(version):
    # (batch, heads) slopes with packed sequences: sequence b reads row b, and its bias follows
    # its own bottom-right diagonal.
    q, k, v, cu_q, cu_k = _varlen_case(VARLEN_Q, VARLEN_K)
    slopes = alibi_slopes(len(VARLEN_Q), q.shape[1])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), causal=True,
                                 alibi_slopes=slopes, version=version)
    dout = torch.randn_like(q)
    grads = torch.autograd.grad(out, leaves, dout)
    for b, qs, ks, one in _per_sequence(cu_q, cu_k, q, k, v):
        oracle, oracle_grads = _with_grads(lambda *t: standard_attention(*t, causal=True, alibi_slopes=slopes[b],
                                                                          upcast=True), one, dout[qs][None].double())
        pt, pt_grads = _with_grads(lambda *t: standard_attention(*t, causal=True, alibi_slopes=slopes[b]), one,
                                   dout[qs][None])
        assert max_err(out[qs][None], oracle) <= 2 * max_err(pt, oracle) + 1e-5
        for g, s, g_ref, g_pt in zip(grads, (qs, ks, ks), oracle_grads, pt_grads):
            assert max_err(g[s][None], g_ref) <= 3 * max_err(g_pt, g_ref) + 1e-4


@pytest.mark.parametrize("version", VERSIONS)
def test_varlen_sinks(version):
    # Sinks with packed sequences (softmax_lse as (nheads, total_q)): each sequence as the
    # batched call gives it, the sinks' gradient summed over all of them.
    q, k, v, cu_q, cu_k = _varlen_case(VARLEN_Q, VARLEN_K)
    sinks = torch.randn(q.shape[1], device=DEVICE)
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse, _ = flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), causal=True,
                                         sinks=leaves[3], return_attn_probs=True, version=version)
    grads = torch.autograd.grad(out, leaves, dout)
    dsinks = torch.zeros_like(sinks, dtype=torch.float64)
    pt_dsinks = torch.zeros_like(sinks)
    for _, qs, ks, one in _per_sequence(cu_q, cu_k, q, k, v):
        oracle, oracle_lse = standard_attention(*one, causal=True, sinks=sinks, upcast=True, return_lse=True)
        pt = standard_attention(*one, causal=True, sinks=sinks)
        assert max_err(out[qs][None], oracle) <= 2 * max_err(pt, oracle) + 1e-5
        assert max_err(lse[:, qs], oracle_lse[0]) <= 1e-3
        for upcast, total in ((True, dsinks), (False, pt_dsinks)):
            one_sinks = sinks.clone().requires_grad_()
            o1 = standard_attention(*one, causal=True, sinks=one_sinks, upcast=upcast)
            total += torch.autograd.grad(o1, one_sinks, dout[qs][None].to(o1.dtype))[0]
    # The sinks' gradient sums over every row: the rule against PyTorch's, summed the same way.
    assert max_err(grads[3], dsinks) <= 3 * max_err(pt_dsinks, dsinks) + 1e-4


# Packed lengths for the Gluon forward's packed walk: empty, one row, not tile multiples, longer
# queries than keys (causal rows that see no key), a sequence with no key, one of several tiles.
GLUON_PACKED_Q = [300, 0, 1, 1000, 129, 64, 2100]
GLUON_PACKED_K = [500, 7, 200, 700, 129, 0, 2100]


def _packed_gluon_forward(q, k, v, cu_q, cu_k, options="forward=gluon", **kw):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(GLUON_PACKED_Q), max(GLUON_PACKED_K), version="v3",
                                  return_attn_probs=True, kernel_options=options, **kw)


def _check_packed(out, lse, q, k, v, cu_q, cu_k, dout=None, grads=None, **mask):
    """Each sequence of a packed call against the float64 oracle (FA rule), its logsumexp too;
    with ``grads``, the gradients of ``dout``."""
    for b, qs, ks, one in _per_sequence(cu_q, cu_k, q, k, v):
        seq_mask = {key: (value[b] if key == "alibi_slopes" and value.dim() == 2 else value)
                    for key, value in mask.items()}
        oracle, oracle_lse = standard_attention(*one, upcast=True, return_lse=True, **seq_mask)
        pt = standard_attention(*one, **seq_mask)
        rule = 3 if "softcap" in mask else 2
        if not oracle.numel():  # a sequence without rows: nothing to compare
            continue
        assert max_err(out[qs][None], oracle) <= rule * max_err(pt, oracle) + 1e-5, b
        seen = torch.isfinite(oracle_lse[0])
        assert torch.equal(torch.isfinite(lse[:, qs]), seen), b
        assert not seen.any() or max_err(lse[:, qs][seen], oracle_lse[0][seen]) <= 1e-3, b
        if grads is not None:
            _, oracle_grads = _with_grads(lambda *t: standard_attention(*t, upcast=True, **seq_mask), one,
                                          dout[qs][None].double())
            _, pt_grads = _with_grads(lambda *t: standard_attention(*t, **seq_mask), one, dout[qs][None])
            for g, sl, g_ref, g_pt in zip(grads, (qs, ks, ks), oracle_grads, pt_grads):
                if g_ref.numel():  # (a sequence without keys has no dK, dV rows)
                    assert max_err(g[sl][None], g_ref) <= 3 * max_err(g_pt, g_ref) + 1e-4, b


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 0), (40, 30)])
def test_v3_gluon_forward_packed_sequences(head_dim, window):
    # The Gluon forward on packed sequences (kernel option forward=gluon): its walk runs down the
    # device-side list of the tiles that hold rows, a sequence's last partial tile is stored by
    # pointer (the next sequence's rows stay untouched), the next sequence's keys are masked.
    # GQA, 4 query heads over 2.
    q, k, v, cu_q, cu_k = _varlen_case(GLUON_PACKED_Q, GLUON_PACKED_K, d=head_dim)
    out, lse, _ = _packed_gluon_forward(q, k, v, cu_q, cu_k, window_size=window)
    _check_packed(out, lse, q, k, v, cu_q, cu_k, window_size=window)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
def test_v3_gluon_forward_packed_gradients_and_score_mods():
    # Gradients (v2's backward over the Gluon forward's output and logsumexp), softcap, ALiBi
    # per sequence, FA3's seqused tables.
    q, k, v, cu_q, cu_k = _varlen_case(GLUON_PACKED_Q, GLUON_PACKED_K, d=128)
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = _packed_gluon_forward(*leaves, cu_q, cu_k, causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    _check_packed(out.detach(), lse, q, k, v, cu_q, cu_k, dout, grads, causal=True)
    slopes = alibi_slopes(len(GLUON_PACKED_Q), q.shape[1])
    for mods in (dict(softcap=30.0), dict(alibi_slopes=slopes), dict(softcap=20.0, alibi_slopes=slopes)):
        out, lse, _ = _packed_gluon_forward(q, k, v, cu_q, cu_k, causal=True, **mods)
        _check_packed(out, lse, q, k, v, cu_q, cu_k, causal=True, **mods)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon backward runs on the GPU only")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 0), (40, 30)])
@pytest.mark.parametrize("options", ["forward=gluon;backward=gluon", "forward=gluon;backward=gluon;ablate=persistent"])
def test_v3_gluon_backward_packed_sequences(head_dim, window, options):
    # The Gluon backward's two passes on packed sequences (kernel option backward=gluon): each
    # pass walks its device-side list of (sequence, block) tiles, a sequence's last partial tile
    # stores its dQ (dK, dV) rows by pointer, the next sequence's rows and keys are masked.
    # GQA, 4 query heads over 2; the persistence ablation too, which packed sequences ignore
    # (their walk takes tiles from the counter: a CTA per tile would find none to end on).
    q, k, v, cu_q, cu_k = _varlen_case(GLUON_PACKED_Q, GLUON_PACKED_K, d=head_dim)
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = _packed_gluon_forward(*leaves, cu_q, cu_k, options, window_size=window)
    grads = torch.autograd.grad(out, leaves, dout)
    _check_packed(out.detach(), lse, q, k, v, cu_q, cu_k, dout, grads, window_size=window)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon backward runs on the GPU only")
def test_v3_gluon_backward_packed_score_mods():
    q, k, v, cu_q, cu_k = _varlen_case(GLUON_PACKED_Q, GLUON_PACKED_K, d=128)
    dout = torch.randn_like(q)
    slopes = alibi_slopes(len(GLUON_PACKED_Q), q.shape[1])
    for mods in (dict(softcap=30.0), dict(alibi_slopes=slopes)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse, _ = _packed_gluon_forward(*leaves, cu_q, cu_k, "forward=gluon;backward=gluon", causal=True, **mods)
        grads = torch.autograd.grad(out, leaves, dout)
        _check_packed(out.detach(), lse, q, k, v, cu_q, cu_k, dout, grads, causal=True, **mods)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
@pytest.mark.parametrize("options, head_dim", [("forward=gluon;tiles.v3_gluon=128,3,3", 64),
                                               ("forward=gluon;ablate=persistent", 64),
                                               ("forward=gluon;ablate=persistent", 128)])
def test_v3_gluon_forward_packed_other_schedules(monkeypatch, options, head_dim):
    # d64's three consumer warpgroups (192-row tiles), and the ablation of the persistent walk
    # with three and two consumers (packed sequences keep the walk: a CTA may find no tile).
    monkeypatch.setitem(configs.THREE_CONSUMERS_FROM, True, 0)
    monkeypatch.setitem(configs.THREE_CONSUMERS_FROM, False, 0)
    q, k, v, cu_q, cu_k = _varlen_case(GLUON_PACKED_Q, GLUON_PACKED_K, d=head_dim)
    for causal in (False, True):
        out, lse, _ = _packed_gluon_forward(q, k, v, cu_q, cu_k, options, causal=causal)
        _check_packed(out, lse, q, k, v, cu_q, cu_k, causal=causal)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_v3_gluon_forward_packed_replays_in_a_cuda_graph():
    # The packed tile list and its count are written inside the graph, from the offsets as they
    # are at each replay: new lengths in the same offsets tensor (same total, within the declared
    # longest, another count of tiles) give the eager result for those lengths, bit for bit.
    lengths, other = [300, 1, 1000, 129, 570], [1000, 999, 1, 0, 0]
    q, k, v, cu, _ = _varlen_case(lengths, lengths, d=128)
    new_cu = torch.tensor([0] + other, device=DEVICE).cumsum(0).to(torch.int32)

    def call(offsets):
        return flash_attn_varlen_func(q, k, v, offsets, offsets, 1000, 1000, causal=True, version="v3",
                                      kernel_options="forward=gluon")
    eager, eager_new = call(cu), call(new_cu)
    offsets = cu.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(offsets)
    for source, expected in ((cu, eager), (new_cu, eager_new), (cu, eager)):
        offsets.copy_(source)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
def test_v3_gluon_forward_packed_neighbours_do_not_leak():
    # The keys after a sequence's end are the next sequence's, read by TMA with its last block
    # (d128: 128 keys): an infinite value there must not reach this sequence's output (its rows
    # are recomputed by the masking rule, from the sequence's own offsets).  Sequences at
    # [0, 70), [70, 200), [200, 264), [264, 314): key 100 (sequence 1's) lies in sequence 0's
    # only block, key 210 (sequence 2's) in sequence 1's second block, [198, 326).
    lengths = [70, 130, 64, 50]
    q, k, v, cu_q, cu_k = _varlen_case(lengths, lengths, d=128)
    for poisoned, checked in ((100, [0, 2, 3]), (210, [0, 1, 3])):
        bad = v.clone()
        bad[poisoned] = float("inf")
        out, lse, _ = flash_attn_varlen_func(q, k, bad, cu_q, cu_k, 130, 130, version="v3", return_attn_probs=True,
                                             kernel_options="forward=gluon")
        for b, qs, ks, one in _per_sequence(cu_q, cu_k, q, k, v):
            if b in checked:
                oracle, oracle_lse = standard_attention(*one, upcast=True, return_lse=True)
                pt = standard_attention(*one)
                assert torch.isfinite(out[qs]).all(), (poisoned, b)
                assert max_err(out[qs][None], oracle) <= 2 * max_err(pt, oracle) + 1e-5, (poisoned, b)
                assert max_err(lse[:, qs], oracle_lse[0]) <= 1e-3, (poisoned, b)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
def test_v3_gluon_forward_packed_writes_only_its_rows():
    # Straight through the dispatcher (the API would clear unused rows afterwards): with FA3's
    # seqused tables each sequence uses the first rows of its slot, and the rows between are
    # never written (they stay the NaN the allocation was filled with), whichever store a tile
    # takes (TMA for whole tiles, by pointer where rows run past the used ones).  A packed batch
    # with no key at all gives out 0 and lse +inf (an empty problem, no kernel).
    from flashtile import dispatch
    from flashtile.options import KernelOptions
    slots, used = [300, 200, 520], [170, 128, 509]
    q, k, v, cu, _ = _varlen_case(slots, slots, d=128)
    starts = cu[:-1]
    table = torch.stack([starts, starts + torch.tensor(used, device=DEVICE, dtype=torch.int32)], 1)
    p = Problem.of(q, k, table, table, max(used), max(used), 128 ** -0.5, -1, 0)
    plan = dispatch.forward_plan(p, "v3", dispatch.target_of(p, q, k, v), KernelOptions(forward="gluon"))
    assert plan.kernel == "v3-gluon"
    out, lse, _ = dispatch.run_forward(plan, p, q, k, v)
    for b, (start, n) in enumerate(zip(starts.tolist(), used)):
        rows = slice(start, start + n)
        one = [x[None, rows] for x in (q, k, v)]
        oracle, oracle_lse = standard_attention(*one, causal=True, upcast=True, return_lse=True)
        pt = standard_attention(*one, causal=True)
        assert max_err(out[rows][None], oracle) <= 2 * max_err(pt, oracle) + 1e-5, b
        assert max_err(lse[:, rows], oracle_lse[0]) <= 1e-3, b
        gap = slice(start + n, start + slots[b])
        assert torch.isnan(out[gap]).all() and torch.isnan(lse[:, gap]).all(), b
    none = torch.zeros_like(cu)
    out, lse, _ = flash_attn_varlen_func(q, k[:0], v[:0], cu, none, max(slots), 4, version="v3",
                                         return_attn_probs=True, kernel_options="forward=gluon")
    assert (out == 0).all() and (lse == float("inf")).all()


def _with_grads(fn, inputs, dout):
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("version", VERSIONS)
def test_varlen_offsets_given_as_a_strided_view(version):
    # Offsets as a column of a (batch + 1, 2) table, the other column poisoned: every kernel reads
    # offsets as contiguous, so the API hands them a contiguous copy.
    lengths = [30, 45, 17]
    q, k, v, cu, _ = _varlen_case(lengths, lengths)
    table = torch.stack([cu, torch.full_like(cu, 99)], dim=1)
    strided = table[:, 0]
    assert strided.stride(0) == 2
    out = flash_attn_varlen_func(q, k, v, strided, strided, 45, 45, causal=True, version=version)
    expected = flash_attn_varlen_func(q, k, v, cu, cu, 45, 45, causal=True, version=version)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("version", VERSIONS)
def test_empty_problems(version):
    # flash_attn's conventions: no key gives out 0 and logsumexp +inf; no query, or no batch,
    # empty outputs; gradients 0 (and of the right shapes).
    q, k, v = make_qkv(2, 9, 7, 2, 2, 32, DTYPES[0], DEVICE)
    for qq, kk, vv in ((q, k[:, :0], v[:, :0]), (q[:, :0], k, v), (q[:0], k[:0], v[:0])):
        leaves = [x.clone().requires_grad_() for x in (qq, kk, vv)]
        out, lse, _ = flash_attn_func(*leaves, causal=True, return_attn_probs=True, version=version)
        assert out.shape == qq.shape and (out == 0).all() and (lse == float("inf")).all()
        out.float().sum().backward()
        assert all(x.grad is not None and x.grad.shape == x.shape and (x.grad == 0).all() for x in leaves)
    # varlen with every key sequence empty
    lengths = [3, 4]
    q, k, v, cu_q, _ = _varlen_case(lengths, lengths)
    cu_k = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    for max_seqlen_k in (0, 4):  # (a longest key sequence declared longer than any there is)
        out, lse, _ = flash_attn_varlen_func(q, k[:0], v[:0], cu_q, cu_k, 4, max_seqlen_k, return_attn_probs=True,
                                             version=version)
        assert (out == 0).all() and (lse == float("inf")).all()


def test_reference_without_keys():
    # The oracle follows the same conventions (a packed batch's sequence may hold no key).
    q, k, v = make_qkv(1, 5, 0, 2, 1, 16, torch.float32, "cpu")
    for upcast in (False, True):
        out, lse = standard_attention(q, k, v, upcast=upcast, return_lse=True)
        assert out.shape == q.shape and (out == 0).all() and (lse == float("inf")).all()
    assert (standard_attention(q, k, v) == 0).all()


@pytest.mark.parametrize("version", VERSIONS)
def test_window_sides_as_wide_as_the_sequences_are_unbounded(version):
    # Sides at or beyond the sequence lengths (2**31 - 1, 2**63, 2**70) are the unbounded band:
    # the same output as -1, never an overflow in the kernels' band arithmetic; one short of that
    # is a real bound, matching the reference.
    sq, sk = 70, 90
    q, k, v = make_qkv(1, sq, sk, 2, 2, 32, DTYPES[0], DEVICE)
    unbounded = flash_attn_func(q, k, v, version=version)
    for side in (sk, 2**31 - 1, 2**31, 2**63, 2**70):
        assert torch.equal(flash_attn_func(q, k, v, window_size=(side, max(sq, side)), version=version), unbounded)
        assert torch.equal(flash_attn_func(q, k, v, window_size=(-1, side + sq), version=version), unbounded)
    for window in ((sk - 2, -1), (-1, sq - 2), (0, 0)):
        check_against_reference(attention(version, window_size=window), q, k, v, window_size=window)


@pytest.mark.parametrize("version", ["v2", "tiled"] + (["v1", "v3"] if ON_GPU else []))
def test_strided_inputs(version):
    """Tensors viewed from (b, h, s, d) storage, and a head dim that is not unit-stride."""
    b, s, h, d = 1, 70, 2, 32
    q = torch.randn(b, h, s, d, dtype=DTYPES[0], device=DEVICE).transpose(1, 2)
    k = torch.randn(b, h, s, d, dtype=DTYPES[0], device=DEVICE).transpose(1, 2)
    v = torch.randn(b, h, d, s, dtype=DTYPES[0], device=DEVICE).permute(0, 3, 1, 2)  # stride(-1) != 1
    assert v.stride(-1) != 1
    check_against_reference(attention(version), q, k, v)


@pytest.mark.parametrize("version", VERSIONS)
def test_backward_is_deterministic(version, kernel_options=None):
    q, k, v = make_qkv(1, 90, 90, 4, 1, 32, DTYPES[0], DEVICE)
    dout = torch.randn_like(q)

    def grads():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_attn_func(*leaves, causal=True, deterministic=True, version=version, kernel_options=kernel_options)
        return torch.autograd.grad(out, leaves, dout)

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


def test_deterministic_never_takes_reduce_add():
    test_backward_is_deterministic("v3", kernel_options="backward=gluon-reduce")


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = make_qkv(1, 20, 20, 1, 1, 64, DTYPES[0], DEVICE)
    a = flash_attn_func(q, k, v, version="v2")
    b = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(64), version="v2")
    assert torch.equal(a, b)


@pytest.mark.parametrize("n_splits", [1, 3])
def test_v1_split_over_programs(n_splits):
    # FA1's num_splits: one program per (batch, head) as in the paper, or rows/columns shared by 3.
    q, k, v = make_qkv(BATCH, 131, 97, 2 * HEADS, HEADS, 32, DTYPES[0], DEVICE)
    check_against_reference(attention("v1", causal=True, kernel_options=f"v1_splits={n_splits}"), q, k, v,
                            causal=True)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("version", VERSIONS)
def test_unmasked_fast_path(version, head_dim):
    # Block-multiple lengths, no mask: the kernels' unmasked single-loop path, with the
    # logsumexp checked too (the backward depends on it).
    seqlen = 1024 if ON_GPU else 64
    q, k, v = make_qkv(BATCH, seqlen, seqlen, HEADS, HEADS, head_dim, DTYPES[0], DEVICE)
    _, lse, ref_lse = check_against_reference(
        lambda a, b, c: flash_attn_func(a, b, c, return_attn_probs=True, version=version)[:2], q, k, v)
    assert max_err(lse, ref_lse) < 1e-2
