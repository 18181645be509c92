"""Every version, forward and all three gradients, against the float64 oracle."""
import math
import os
from unittest import mock

import pytest
import torch
from attention_check import check_against_reference, make_qkv, max_err
from conftest import DEVICE, ON_GPU

from flashtile import flash_attn_func, flash_attn_varlen_func, standard_attention
from flashtile.kernels import v3_gluon_bwd

VERSIONS = ["v1", "v2", "v3", "tiled"]
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
# Sequence lengths that are not block multiples, with seqlen_q < / = / > seqlen_k.
SEQLENS = ([(1000, 1000), (511, 1537), (2049, 700), (4096, 4096)] if ON_GPU
           else [(113, 113), (70, 131), (131, 70)])
BATCH, HEADS = (2, 4) if ON_GPU else (1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_matches_oracle(version, causal, seqlens, dtype):
    # GQA: 2 query heads per K/V head.
    q, k, v = make_qkv(BATCH, *seqlens, 2 * HEADS, HEADS, 64, dtype, DEVICE)
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, causal=causal, version=version),
                            q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim", [16, 96, 128, 192, 256] if ON_GPU else [16, 96, 256])
@pytest.mark.parametrize("version", VERSIONS)
def test_head_dims(version, head_dim):
    seqlen = 777 if ON_GPU else 67
    q, k, v = make_qkv(BATCH, seqlen, seqlen, HEADS, HEADS, head_dim, DTYPES[0], DEVICE)
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, causal=True, version=version),
                            q, k, v, causal=True)


@pytest.mark.parametrize("window", [(16, 8), (-1, 5), (40, -1)])
@pytest.mark.parametrize("version", VERSIONS)
def test_sliding_window(version, window):
    sq, sk = (900, 1300) if ON_GPU else (90, 130)
    q, k, v = make_qkv(BATCH, sq, sk, HEADS, 1, 64, DTYPES[0], DEVICE)  # MQA
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, window_size=window, version=version),
                            q, k, v, window_size=window)


@pytest.mark.parametrize("kernel", ["gluon", "triton"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_v3_both_forward_kernels_on_short_bands(monkeypatch, kernel, head_dim):
    # v3's two forwards, the Gluon one (its default on the GPU) and the plain-Triton fallback
    # (varlen, stride-0 layouts), each on short causal bands.
    monkeypatch.setenv("FLASHTILE_V3_FWD", kernel)
    sq, sk = (300, 1000) if ON_GPU else (40, 70)
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, head_dim, DTYPES[-1], DEVICE)
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, causal=True, version="v3"),
                            q, k, v, causal=True)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
@pytest.mark.parametrize("window", [(-1, 0), (40, 8)])
def test_v3_forward_three_consumers_on_bands(monkeypatch, window):
    # d64's three consumer warpgroups (192-row tiles, tails that are not tile multiples) on bands,
    # which take them only from 8k queries by default: here from any length.  (Non-causal ones
    # from 2k: test_matches_oracle's long cases.)
    from flashtile.kernels import configs, v3_gluon
    monkeypatch.setitem(configs.THREE_CONSUMERS_FROM, True, 0)
    consumers = []
    launch = v3_gluon.forward
    monkeypatch.setattr(v3_gluon, "forward", lambda p, q, k, v, cfg: consumers.append(cfg.consumers) or
                        launch(p, q, k, v, cfg))
    q, k, v = make_qkv(BATCH, 1000, 1300, 2 * HEADS, HEADS, 64, DTYPES[0], DEVICE)
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, window_size=window, version="v3"),
                            q, k, v, window_size=window)
    assert consumers and set(consumers) == {3}


def _causal_gluon_forward(monkeypatch):
    """A causal v3 forward on the Gluon kernel (tiles from its counter): the call and its eager output."""
    monkeypatch.setenv("FLASHTILE_V3_FWD", "gluon")
    q, k, v = make_qkv(BATCH, 1000, 1000, 2 * HEADS, HEADS, 128, DTYPES[0], DEVICE)

    def call():
        return flash_attn_func(q, k, v, causal=True, version="v3")
    return call, call()


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on the GPU only")
def test_v3_tile_counter_resets_itself_per_stream(monkeypatch):
    # Causal tiles come from a counter per stream that each launch's last CTA sets back to 0:
    # launches back to back, on the default and a side stream, give the same output bit for bit
    # and leave every counter at 0.
    from flashtile.kernels import v3_gluon
    call, first = _causal_gluon_forward(monkeypatch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = [call() for _ in range(3)]
        side_counter = v3_gluon.tile_counter(first.device)
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in again)
    counter = v3_gluon.tile_counter(first.device)
    assert side_counter is not counter
    assert side_counter.tolist() == [0, 0] and counter.tolist() == [0, 0]


@pytest.mark.skipif(not ON_GPU, reason="the Gluon backward runs on the GPU only")
def test_v3_causal_backward_takes_its_tiles_from_the_counter(monkeypatch):
    # The two Gluon passes over causal tiles on persistent CTAs (here 3) take each tile from the
    # stream's counter, as the forward does: backwards back to back give the same gradients bit
    # for bit, and each launch leaves the counter at 0 for the next.
    from flashtile.kernels import v3_gluon
    monkeypatch.setenv("FLASHTILE_V3_BWD", "gluon")
    monkeypatch.setattr(v3_gluon_bwd, "sm_count", lambda device_index: 3)
    q, k, v = (x.requires_grad_() for x in make_qkv(BATCH, 1000, 1000, 2 * HEADS, HEADS, 64, DTYPES[0], DEVICE))
    out = flash_attn_func(q, k, v, causal=True, version="v3")
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(2):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    torch.cuda.synchronize()
    assert v3_gluon.tile_counter(q.device).tolist() == [0, 0]


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_v3_causal_forward_replays_in_a_cuda_graph(monkeypatch):
    # A captured launch takes a tile counter of its own, zeroed at each replay: replays of the
    # causal Gluon forward overwrite a poisoned output with the eager result, bit for bit.
    call, eager = _causal_gluon_forward(monkeypatch)
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
def test_v3_gluon_backward(monkeypatch, kernels, head_dim, window):
    # v3's Gluon backwards (on the GPU; the interpreter keeps v2's), two passes or one with dQ by
    # TMA reduce-add (d64 and d128; the two passes split the head dim at d256), against the
    # oracle: GQA, seqlens that are not block multiples, causal and a sliding window.
    monkeypatch.setenv("FLASHTILE_V3_BWD", kernels)
    # As if the GPU had 3 SMs: where a pass runs persistent CTAs (the two passes up to d128) each
    # takes several tiles, strided over or (a band's) from the tile counter, their number not a
    # multiple of the CTAs'.
    monkeypatch.setattr(v3_gluon_bwd, "sm_count", lambda device_index: 3)
    sq, sk = (700, 1000) if ON_GPU else (40, 70)
    q, k, v = make_qkv(BATCH, sq, sk, 2 * HEADS, HEADS, head_dim, DTYPES[0], DEVICE)
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, window_size=window, version="v3"),
                            q, k, v, window_size=window)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 8)])
def test_v3_single_pass_with_64_row_q_blocks(monkeypatch, window):
    # d64's single pass runs 128-row Q blocks (v3_gluon_bwd._kv_consumers_shared_scores, in
    # test_v3_gluon_backward); with 64-row ones (an override) it runs d128's consumers.
    monkeypatch.setenv("FLASHTILE_V3_BWD", "gluon-reduce")
    monkeypatch.setenv("FLASHTILE_CONFIG_V3_GLUON_BWD", "64,128,3")
    test_v3_gluon_backward(monkeypatch, "gluon-reduce", 64, window)


@pytest.mark.parametrize("kernels", ["gluon", "gluon-reduce"])
def test_v3_gluon_backward_through_logsumexp(monkeypatch, kernels):
    monkeypatch.setenv("FLASHTILE_V3_BWD", kernels)
    test_gradient_through_logsumexp("v3", head_dim=64)


@pytest.mark.parametrize("version", VERSIONS)
def test_bf16(version):
    q, k, v = make_qkv(1, 77, 93, 2, 1, 32, torch.bfloat16, DEVICE)
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, causal=True, version=version),
                            q, k, v, causal=True)


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


@pytest.mark.parametrize("version", VERSIONS)
def test_gradient_through_logsumexp(version, head_dim=32):
    """A loss that uses softmax_lse gets its gradient too (it folds into D in the backward)."""
    q, k, v = make_qkv(1, 45, 60, 2, 2, head_dim, DTYPES[0], DEVICE)
    w = torch.randn(1, 2, 45, device=DEVICE)

    def grads(fn, dtype=None):
        leaves = [x.clone().to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves)
        (out.double().sum() + (lse.double() * w).sum()).backward()
        return [x.grad for x in leaves]

    ours = grads(lambda *a: flash_attn_func(*a, causal=True, return_attn_probs=True, version=version)[:2])
    oracle = grads(lambda *a: standard_attention(*a, causal=True, upcast=True, return_lse=True), torch.float64)
    pt = grads(lambda *a: standard_attention(*a, causal=True, return_lse=True))
    for g, g_ref, g_pt in zip(ours, oracle, pt):
        assert max_err(g, g_ref) <= 3 * max_err(g_pt, g_ref) + 1e-4


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_varlen(version, causal):
    lengths_q = [37, 0, 93, 70] if not ON_GPU else [370, 1, 930, 2000]
    lengths_k = [50, 20, 93, 33] if not ON_GPU else [500, 200, 930, 1333]
    heads_q, heads_k, d = 4, 2, 64
    cu_q = torch.tensor([0] + lengths_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths_q), heads_q, d, dtype=DTYPES[0], device=DEVICE)
    k = torch.randn(sum(lengths_k), heads_k, d, dtype=DTYPES[0], device=DEVICE)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                         return_attn_probs=True, version=version)
    assert lse.shape == (heads_q, sum(lengths_q))
    grads = torch.autograd.grad(out, leaves, dout)
    # Each sequence on its own, through the batched path, must give the same numbers.  On the GPU,
    # v3's batched problems run Gluon kernels; varlen runs the plain-Triton forward and v2's
    # backward, so the batched calls here take those too (the Gluon kernels are checked against
    # the oracle elsewhere).
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            continue
        one = [x[None].clone().requires_grad_() for x in (q[qs], k[ks], v[ks])]
        with mock.patch.dict(os.environ, {"FLASHTILE_V3_FWD": "triton", "FLASHTILE_V3_BWD": "v2"}):
            o1 = flash_attn_func(*one, causal=causal, version=version)
            g1 = torch.autograd.grad(o1, one, dout[qs][None])
        torch.testing.assert_close(out[qs], o1[0], atol=2e-3, rtol=0)
        for g, gb, s in zip(grads, g1, (qs, ks, ks)):
            torch.testing.assert_close(g[s], gb[0], atol=5e-3, rtol=0)
    # and the batched path is itself checked against the oracle above; one direct check here:
    b = 2
    qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
    ref = standard_attention(q[qs][None], k[ks][None], v[ks][None], causal=causal, upcast=True)
    pt = standard_attention(q[qs][None], k[ks][None], v[ks][None], causal=causal)
    assert max_err(out[qs][None], ref) <= 2 * max_err(pt, ref) + 1e-5


@pytest.mark.parametrize("version", ["v2", "tiled"] + (["v1", "v3"] if ON_GPU else []))
def test_strided_inputs(version):
    """Tensors viewed from (b, h, s, d) storage, and a head dim that is not unit-stride."""
    b, s, h, d = 1, 70, 2, 32
    q = torch.randn(b, h, s, d, dtype=DTYPES[0], device=DEVICE).transpose(1, 2)
    k = torch.randn(b, h, s, d, dtype=DTYPES[0], device=DEVICE).transpose(1, 2)
    v = torch.randn(b, h, d, s, dtype=DTYPES[0], device=DEVICE).permute(0, 3, 1, 2)  # stride(-1) != 1
    assert v.stride(-1) != 1
    check_against_reference(lambda a, b_, c: flash_attn_func(a, b_, c, version=version), q, k, v)


@pytest.mark.parametrize("version", VERSIONS)
def test_backward_is_deterministic(version):
    q, k, v = make_qkv(1, 90, 90, 4, 1, 32, DTYPES[0], DEVICE)
    dout = torch.randn_like(q)

    def grads():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad(flash_attn_func(*leaves, causal=True, deterministic=True, version=version),
                                   leaves, dout)

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = make_qkv(1, 20, 20, 1, 1, 64, DTYPES[0], DEVICE)
    a = flash_attn_func(q, k, v, version="v2")
    b = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(64), version="v2")
    assert torch.equal(a, b)


@pytest.mark.parametrize("n_splits", ["1", "3"])
def test_v1_split_over_programs(n_splits, monkeypatch):
    # FA1's num_splits: one program per (batch, head) as in the paper, or rows/columns shared by 3.
    monkeypatch.setenv("FLASHTILE_V1_SPLITS", n_splits)
    q, k, v = make_qkv(BATCH, 131, 97, 2 * HEADS, HEADS, 32, DTYPES[0], DEVICE)
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, causal=True, version="v1"),
                            q, k, v, causal=True)


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


# v3's K/V-stationary backward with dQ by (TMA) reduce-add runs only when selected: check it
# on GQA + a padded head dim + bottom-right causal, on a sliding window, and on varlen.
@pytest.mark.parametrize("shape, mask", [
    ((131, 97, 4, 2, 48), dict(causal=True)),
    ((113, 113, 2, 2, 64), dict()),
    ((70, 131, 2, 1, 32), dict(window_size=(16, 8))),
])
def test_v3_reduce_add_backward(shape, mask, monkeypatch):
    monkeypatch.setenv("FLASHTILE_V3_DQ", "reduce")
    sq, sk, hq, hk, d = shape
    scale = 8 if ON_GPU else 1
    q, k, v = make_qkv(BATCH, sq * scale, sk * scale, hq, hk, d, DTYPES[0], DEVICE)
    check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, version="v3", **mask), q, k, v, **mask)


def test_v3_reduce_add_varlen(monkeypatch):
    monkeypatch.setenv("FLASHTILE_V3_DQ", "reduce")
    test_varlen("v3", causal=True)


@pytest.mark.parametrize("switch", [("FLASHTILE_V3_DQ", "reduce"), ("FLASHTILE_V3_BWD", "gluon-reduce")])
def test_deterministic_never_takes_reduce_add(monkeypatch, switch):
    monkeypatch.setenv(*switch)
    test_backward_is_deterministic("v3")
