"""The other ways in: PyTorch's scaled_dot_product_attention call, flash_attn's varlen packed
functions and FlashAttention-3's interface, each against the float64 oracle or the function it
stands for."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from attention_check import assert_within_rule, make_qkv, max_err, run_and_grad
from conftest import DEVICE

import flashtile
from flashtile import flash_attn_func, flash_attn_varlen_func, kvcache, standard_attention
from flashtile import flash_attn_interface as fa3
from flashtile.bert_padding import (index_first_axis_residual, pad_input, unpad_input,
                                    unpad_input_for_concatenated_sequences)

DTYPE = torch.float16


def sdpa_inputs(batch, heads, heads_k, seqlen_q, seqlen_k, head_dim=32):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, DTYPE, DEVICE)
    return tuple(x.transpose(1, 2) for x in (q, k, v))  # PyTorch's (batch, heads, seqlen, headdim)


def check_like_pytorch(q, k, v, **kw):
    """flashtile.scaled_dot_product_attention against PyTorch's in float64 (the oracle) and in
    the input dtype, output and gradients, by the FlashAttention rule."""
    dout = torch.randn_like(q)
    ours = run_and_grad(lambda a, b, c: flashtile.scaled_dot_product_attention(a, b, c, **kw), q, k, v, dout)
    oracle = run_and_grad(lambda a, b, c: F.scaled_dot_product_attention(a.double(), b.double(), c.double(), **kw),
                          q, k, v, dout.double())
    pytorch = run_and_grad(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kw), q, k, v, dout)
    assert ours[0].shape == q.shape
    assert_within_rule("out", ours[0], pytorch[0], oracle[0], (2.0, 1e-5))
    for name, g, g_pt, g_ref in zip(("dq", "dk", "dv"), ours[2], pytorch[2], oracle[2]):
        assert_within_rule(name, g, g_pt, g_ref, (3.0, 1e-4))


@pytest.mark.parametrize("seqlens", [(50, 50), (30, 70), (70, 30)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_pytorch(seqlens, is_causal):
    # is_causal aligned top-left as PyTorch aligns it, on both sides of the square; GQA.
    q, k, v = sdpa_inputs(2, 4, 2, *seqlens)
    check_like_pytorch(q, k, v, is_causal=is_causal, enable_gqa=True, scale=0.3)


def test_sdpa_key_padding_mask():
    # A boolean (batch, 1, 1, seqlen_k) mask: each batch attends to its own kept keys (not a
    # prefix), through the varlen kernels.
    q, k, v = sdpa_inputs(3, 4, 4, 40, 60)
    keep = torch.rand(3, 1, 1, 60, device=DEVICE) < 0.7
    keep[..., 0] = True  # every row sees a key (PyTorch gives NaN where none)
    check_like_pytorch(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("batch, seqlen_q", [(2, 0), (0, 8)])
def test_sdpa_key_padding_mask_on_empty_inputs(batch, seqlen_q):
    # No query or no sequence: PyTorch's empty output (and gradients) with a mask too.
    q, k, v = (x.detach().requires_grad_() for x in sdpa_inputs(batch, 2, 2, seqlen_q, 8))
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(batch, 1, 1, 8, dtype=bool,
                                                                                device=DEVICE))
    assert out.shape == (batch, 2, seqlen_q, 32)
    out.float().sum().backward()
    assert all(x.grad is None or not x.grad.any() for x in (q, k, v))


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k, v: flashtile.scaled_dot_product_attention(q, k[:, :1], v[:, :1]), ValueError, "enable_gqa=True"),
    (lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(2, 1, 1, 8)),
     NotImplementedError, "only boolean key-padding masks"),
    (lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(2, 1, 8, 8, dtype=bool)),
     NotImplementedError, "varies over heads or queries"),
    (lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(2, 1, 1, 8, dtype=bool),
                                                            is_causal=True), ValueError, "cannot both be set"),
    (lambda q, k, v: flashtile.scaled_dot_product_attention(q[0], k, v), ValueError, "query must be a 4-D tensor"),
    (lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, dropout_p=1.0), ValueError, "dropout_p"),
    (lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, attn_mask=[[True] * 8] * 2), TypeError,
     "attn_mask must be a torch.Tensor or None, got list"),
    (lambda q, k, v: flashtile.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(2, 1, 1, 8, dtype=bool, device="meta")), ValueError, "query's device"),
])
def test_sdpa_refuses_by_name(call, error, match):
    q, k, v = sdpa_inputs(2, 2, 2, 8, 8)
    with pytest.raises(error, match=match):
        call(q, k, v)


def _varlen(lengths, heads=4, heads_k=2, d=32):
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths), heads, d, dtype=DTYPE, device=DEVICE)
    k, v = (torch.randn(sum(lengths), heads_k, d, dtype=DTYPE, device=DEVICE) for _ in range(2))
    return q, k, v, cu


def test_varlen_packed_functions_are_the_varlen_call():
    q, k, v, cu = _varlen([17, 0, 40], heads=2, heads_k=2)
    expected = flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True)
    qkv = flashtile.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu, 40, causal=True)
    kv = flashtile.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, cu, 40, 40, causal=True)
    assert torch.equal(qkv, expected) and torch.equal(kv, expected)
    with pytest.raises(ValueError, match=r"qkv must be \(total_tokens, 3, nheads, headdim\)"):
        flashtile.flash_attn_varlen_qkvpacked_func(torch.stack([q, k], 1), cu, 40)


def test_flash_attention_3_interface():
    # FA3's signatures: out, or (out, lse) with return_attn_probs; its tuning hints accepted.
    q, k, v = make_qkv(2, 30, 50, 4, 2, 32, DTYPE, DEVICE)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, softcap=5.0, return_attn_probs=True)
    got = fa3.flash_attn_func(q, k, v, causal=True, softcap=5.0, num_splits=4, pack_gqa=True, sm_margin=8,
                              return_attn_probs=True)
    assert len(got) == 2 and torch.equal(got[0], out) and torch.equal(got[1], lse)
    assert torch.equal(fa3.flash_attn_func(q, k, v, causal=True, softcap=5.0), out)
    # The packed form with GQA: query heads, then K's, then V's along the head dim.
    qs, ks, vs = make_qkv(2, 40, 40, 4, 2, 32, DTYPE, DEVICE)
    packed = fa3.flash_attn_qkvpacked_func(torch.cat([qs, ks, vs], 2), causal=True, num_heads_q=4)
    assert torch.equal(packed, flash_attn_func(qs, ks, vs, causal=True))
    vq, vk, vv, cu = _varlen([17, 40])
    assert torch.equal(fa3.flash_attn_varlen_func(vq, vk, vv, cu, cu, 40, 40, causal=True),
                       flash_attn_varlen_func(vq, vk, vv, cu, cu, 40, 40, causal=True))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(qv=torch.ones(1)), NotImplementedError, "qv"),
    (dict(attention_chunk=-1), ValueError, "attention_chunk"),
    (dict(attention_chunk=2.5), TypeError, "attention_chunk"),
])
def test_flash_attention_3_interface_refuses_what_it_lacks(kwargs, error, match):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32, DTYPE, DEVICE)
    with pytest.raises(error, match=match):
        fa3.flash_attn_func(q, k, v, **kwargs)


def chunked_attention(q, k, v, chunk, causal, window_size=(-1, -1), upcast=False):
    """Attention under FlashAttention-3's attention_chunk mask, written out: query i sits at key
    position i + seqlen_k - seqlen_q and sees the keys of its own chunk of ``chunk`` positions
    (within the causal mask and the window); a row that sees none gives 0.  In float64 with
    ``upcast``, else in the inputs' dtype (float32 softmax)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    at = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
    key = torch.arange(seqlen_k, device=q.device)[None, :]
    seen = (key // chunk == torch.div(at, chunk, rounding_mode="floor")) & (at >= 0)
    if causal:
        seen &= key <= at
    if window_size[0] >= 0:
        seen &= key >= at - window_size[0]
    if window_size[1] >= 0:
        seen &= key <= at + window_size[1]
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.double() if upcast else x for x in (q, k, v))
    k, v = (x.repeat_interleave(group, 2).transpose(1, 2) for x in (k, v))
    scores = (q.transpose(1, 2) @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = (scores if upcast else scores.float()).masked_fill(~seen, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return (probs.to(v.dtype) @ v).transpose(1, 2)


@pytest.mark.parametrize("seqlen_q, seqlen_k, chunk, window_size", [
    (64, 64, 16, (-1, -1)),   # whole chunks: a batch of them
    (50, 70, 16, (-1, -1)),   # queries from mid-chunk
    (70, 50, 16, (-1, -1)),   # queries before the first key
    (37, 37, 10, (3, 2)),     # a window inside the chunks
    (30, 30, 64, (-1, -1)),   # one chunk
])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_3_attention_chunk(seqlen_q, seqlen_k, chunk, window_size, causal):
    # Llama 4's chunked attention: output and gradients by the FA rule against the mask written
    # out in float64.
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, DTYPE, DEVICE)
    dout = torch.randn_like(q)
    mask = dict(chunk=chunk, causal=causal, window_size=window_size)
    out, _, grads = run_and_grad(lambda a, b, c: fa3.flash_attn_func(
        a, b, c, causal=causal, window_size=window_size, attention_chunk=chunk), q, k, v, dout)
    oracle, _, oracle_grads = run_and_grad(lambda a, b, c: chunked_attention(a, b, c, upcast=True, **mask), q, k, v,
                                           dout.double())
    pt, _, pt_grads = run_and_grad(lambda a, b, c: chunked_attention(a, b, c, **mask), q, k, v, dout)
    assert_within_rule("out", out, pt, oracle, (2.0, 1e-5))
    for name, g, g_pt, g_ref in zip(("dq", "dk", "dv"), grads, pt_grads, oracle_grads):
        assert_within_rule(name, g, g_pt, g_ref, (3.0, 1e-4))


def test_flash_attention_3_attention_chunk_compiles_without_a_break():
    # The pieces' offsets are made inside the traced graph: torch.compile(fullgraph=True) takes
    # the chunked call, and it matches eager.
    q, k, v = make_qkv(1, 40, 40, 2, 2, 32, DTYPE, DEVICE)
    chunked = lambda a, b, c: fa3.flash_attn_func(a, b, c, causal=True, attention_chunk=16)
    compiled = torch.compile(chunked, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), chunked(q, k, v))
    # Packed: the offsets are read where the attention op runs, not while tracing.
    cu = torch.tensor([0, 10, 25, 40], dtype=torch.int32, device=DEVICE)
    packed = lambda a, b, c: fa3.flash_attn_varlen_func(a, b, c, cu, cu, 15, 15, causal=True,  # noqa: E731
                                                        attention_chunk=8)
    rows = [x[0] for x in (q, k, v)]
    torch.testing.assert_close(torch.compile(packed, fullgraph=True, backend="eager")(*rows), packed(*rows))


def test_flash_attention_3_attention_chunk_varlen_packed_and_lse():
    # Packed sequences are cut sequence by sequence; the logsumexp comes back in the call's
    # layout; the packed-qkv form takes the same chunks.
    lengths, chunk = [30, 7, 45], 16
    cu = torch.tensor([0, 30, 37, 82], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(82, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(3))
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 45, 45, causal=True, attention_chunk=chunk,
                                          return_attn_probs=True)
    for s0, n in zip((0, 30, 37), lengths):
        rows = slice(s0, s0 + n)
        one, one_lse = fa3.flash_attn_func(q[None, rows], k[None, rows], v[None, rows], causal=True,
                                           attention_chunk=chunk, return_attn_probs=True)
        torch.testing.assert_close(out[rows], one[0], atol=2e-3, rtol=0)
        torch.testing.assert_close(lse[:, rows], one_lse[0], atol=1e-4, rtol=0)
        oracle = chunked_attention(q[None, rows], k[None, rows], v[None, rows], chunk, True, upcast=True)
        assert (one.double() - oracle).abs().max() < 1e-2
    qkv = torch.stack([q[None, :30], k[None, :30], v[None, :30]], 2)
    torch.testing.assert_close(fa3.flash_attn_qkvpacked_func(qkv, causal=True, attention_chunk=chunk), out[None, :30],
                               atol=2e-3, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_3_attention_chunk_varlen_queries_and_keys_apart(causal):
    # Packed sequences with their own query and key counts, empty ones and more queries than
    # keys among them: the pieces are cut on the device, as many per sequence as the longest
    # sequences need, and each sequence's rows equal its own batched call (output, logsumexp,
    # gradients); the queries before the first key get 0.
    torch.manual_seed(3)
    lengths_q, lengths_k, chunk = [5, 0, 40, 12, 9], [20, 3, 17, 0, 9], 8
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=DEVICE)
                  for n in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), 2, 32, dtype=DTYPE, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), 1, 32, dtype=DTYPE, device=DEVICE, requires_grad=True) for _ in range(2))
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                          attention_chunk=chunk, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if n_q == 0:
            continue
        leaves = [x[None, s].detach().clone().requires_grad_() for x, s in ((q, rows), (k, keys), (v, keys))]
        one, one_lse = fa3.flash_attn_func(*leaves, causal=causal, attention_chunk=chunk, return_attn_probs=True)
        one.backward(dout[None, rows])
        torch.testing.assert_close(out[rows], one[0], atol=2e-3, rtol=0)
        seen = torch.isfinite(one_lse[0])
        torch.testing.assert_close(lse[:, rows][seen], one_lse[0][seen], atol=1e-4, rtol=0)
        torch.testing.assert_close(q.grad[rows], leaves[0].grad[0], atol=2e-3, rtol=0)
        if n_k:
            torch.testing.assert_close(k.grad[keys], leaves[1].grad[0], atol=2e-3, rtol=0)
            torch.testing.assert_close(v.grad[keys], leaves[2].grad[0], atol=2e-3, rtol=0)
        unseen = max(n_q - n_k, 0)
        assert torch.equal(out[rows][:unseen], torch.zeros_like(out[rows][:unseen]))
        oracle = chunked_attention(q[None, rows].detach(), k[None, keys].detach(), v[None, keys].detach(), chunk,
                                   causal, upcast=True)
        assert (one.detach().double() - oracle).abs().max() < 1e-2


def test_return_attn_probs_third_element_is_a_tensor():
    # flash_attn's (out, softmax_lse, S_dmask): without dropout S_dmask is an empty tensor of q's
    # dtype, never None (code that moves or inspects it keeps working).
    q, k, v = make_qkv(1, 20, 20, 2, 2, 32, DTYPE, DEVICE)
    for result in (flash_attn_func(q, k, v, return_attn_probs=True),
                   flashtile.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), return_attn_probs=True)):
        out, lse, s_dmask = result
        assert isinstance(s_dmask, torch.Tensor) and s_dmask.numel() == 0 and s_dmask.dtype == q.dtype
        assert torch.equal(out, flash_attn_func(q, k, v))


def test_flash_attention_3_seqused():
    # seqused_q / seqused_k: each varlen sequence uses its first rows only; on those rows output,
    # logsumexp and gradients follow the FA rule against the float64 reference; the other output
    # rows are 0 with lse -inf, and no gradient reaches the unused rows of q, k or v.
    torch.manual_seed(0)
    lengths, used_q, used_k = [20, 33], [12, 33], [15, 9]
    total = sum(lengths)
    q, k, v = (torch.randn(total, 2, 32, dtype=DTYPE, device=DEVICE, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 20, 53], dtype=torch.int32, device=DEVICE)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, seqused_q=as_tensor(used_q),
                                          seqused_k=as_tensor(used_k), causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b, (s0, uq, uk) in enumerate(zip((0, 20), used_q, used_k)):
        rows, keys = slice(s0, s0 + uq), slice(s0, s0 + uk)
        parts = [x.detach()[None, sl] for x, sl in ((q, rows), (k, keys), (v, keys))]
        oracle, _, oracle_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, causal=True, upcast=True),
                                               *parts, dout[None, rows].double())
        pt, _, pt_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, causal=True), *parts,
                                       dout[None, rows])
        assert_within_rule("out", out[None, rows], pt, oracle, (2.0, 1e-5))
        for name, x, sl, g_pt, g_ref in zip("qkv", (q, k, v), (rows, keys, keys), pt_grads, oracle_grads):
            assert_within_rule(f"d{name}", x.grad[None, sl], g_pt, g_ref, (3.0, 1e-4))
        unused_q, unused_k = slice(s0 + uq, s0 + lengths[b]), slice(s0 + uk, s0 + lengths[b])
        assert (out[unused_q] == 0).all() and (lse[:, unused_q] == float("-inf")).all()  # (FA3's: -inf)
        assert (q.grad[unused_q] == 0).all() and (k.grad[unused_k] == 0).all() and (v.grad[unused_k] == 0).all()


@pytest.mark.parametrize("version", ["v1", "v2", "v3", "tiled"])
def test_varlen_buffers_with_rows_after_the_last_sequence(version):
    # Padded buffers (as flash_attn takes them): q, k and v hold rows after cu_seqlens[-1], here
    # NaN, which no sequence reads; those rows of the output are 0 (lse +inf) and get no gradient,
    # the sequences' follow the FA rule against the float64 reference.
    torch.manual_seed(1)
    lengths, spare_q, spare_k = [20, 13], 7, 5
    cu = torch.tensor([0, 20, 33], dtype=torch.int32, device=DEVICE)
    q = torch.randn(33 + spare_q, 2, 32, dtype=DTYPE, device=DEVICE)
    k, v = (torch.randn(33 + spare_k, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2))
    for x in (q, k, v):
        x[33:] = float("nan")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, causal=True, return_attn_probs=True,
                                         version=version)
    dout = torch.randn_like(out)
    out.backward(dout)
    for s0, n in zip((0, 20), lengths):
        rows = slice(s0, s0 + n)
        parts = [x.detach()[None, rows] for x in (q, k, v)]
        oracle, _, oracle_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, causal=True, upcast=True),
                                               *parts, dout[None, rows].double())
        pt, _, pt_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, causal=True), *parts,
                                       dout[None, rows])
        assert_within_rule("out", out[None, rows], pt, oracle, (2.0, 1e-5))
        for name, x, g_pt, g_ref in zip("qkv", (q, k, v), pt_grads, oracle_grads):
            assert_within_rule(f"d{name}", x.grad[None, rows], g_pt, g_ref, (3.0, 1e-4))
    assert (out[33:] == 0).all() and (lse[:, 33:] == float("inf")).all()
    assert all((x.grad[33:] == 0).all() for x in (q, k, v))
    # With sinks: their gradient takes nothing from the spare rows (the same as without them).
    sinks = [torch.randn(2, device=DEVICE)] * 2
    sinks = [x.clone().requires_grad_() for x in sinks]
    for buffers, leaf in (((q, k, v), sinks[0]), ((q[:33], k[:33], v[:33]), sinks[1])):
        spared = flash_attn_varlen_func(*(x.detach() for x in buffers), cu, cu, 20, 20, causal=True, sinks=leaf,
                                        version=version)
        spared.backward(dout[:spared.shape[0]])
    assert sinks[0].grad.isfinite().all()
    torch.testing.assert_close(sinks[0].grad, sinks[1].grad, rtol=1e-3, atol=1e-4)
    # Offsets past the tensor's rows are refused by name.
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] = 33 but the tensor has 30 tokens"):
        flash_attn_varlen_func(q, k[:30], v[:30], cu, cu, 20, 20, version=version)


def test_varlen_with_paged_keys():
    # flash_attn's block_table in the varlen call: k and v as pages (of 4, shuffled), sequence b's
    # keys the first rows of its pages; the same output (bits) and gradients as the packed keys,
    # each page's gradient where its rows were read; tables too small or out of range refused.
    torch.manual_seed(2)
    lengths_k, page, pages = [13, 7], 4, 12
    cu_q = torch.tensor([0, 5, 14], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 13, 20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(14, 4, 32, dtype=DTYPE, device=DEVICE)
    k_pages, v_pages = (torch.randn(pages, page, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2))
    table = torch.randperm(pages, device=DEVICE)[:8].view(2, 4).int()
    rows = [table[b].long().repeat_interleave(page)[:n] * page + torch.arange(n, device=DEVICE) % page
            for b, n in enumerate(lengths_k)]
    index = torch.cat(rows)
    k, v = (x.flatten(0, 1)[index] for x in (k_pages, v_pages))
    dout = torch.randn(14, 4, 32, dtype=DTYPE, device=DEVICE)
    ref, _, ref_grads = run_and_grad(lambda a, b, c: flash_attn_varlen_func(a, b, c, cu_q, cu_k, 9, 13, causal=True),
                                     q, k, v, dout)
    out, _, grads = run_and_grad(lambda a, b, c: flash_attn_varlen_func(a, b, c, cu_q, cu_k, 9, 13, causal=True,
                                                                        block_table=table), q, k_pages, v_pages, dout)
    assert torch.equal(out, ref) and torch.equal(grads[0], ref_grads[0])
    for paged, packed in zip(grads[1:], ref_grads[1:]):
        expected = torch.zeros(pages * page, 2, 32, dtype=torch.float32, device=DEVICE).index_add_(
            0, index, packed.float())
        torch.testing.assert_close(paged.flatten(0, 1).float(), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="block_table holds 8 keys a sequence"):
        flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 9, 13, block_table=table[:, :2])
    with pytest.raises(ValueError, match=r"block_table must be \(batch=2, max_blocks\)"):
        flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 9, 13, block_table=table[:1])
    with pytest.raises(TypeError, match="block_table must be torch.int32"):
        flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 9, 13, block_table=table.long())
    if not table.is_cuda:
        with pytest.raises(ValueError, match="must index the cache's 12 pages"):
            flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 9, 13, block_table=table + pages)
    # Columns past a sequence's keys (the second's 7 keys use two pages of four) may hold -1.
    # (gathered where gradients are taken: the same bits; read in place without: to rounding)
    padded = table.clone()
    padded[1, 2:] = -1
    assert torch.equal(flash_attn_varlen_func(q.requires_grad_(), k_pages, v_pages, cu_q, cu_k, 9, 13, causal=True,
                                              block_table=padded), ref)
    torch.testing.assert_close(flash_attn_varlen_func(q.detach(), k_pages, v_pages, cu_q, cu_k, 9, 13, causal=True,
                                                      block_table=padded), ref, atol=2e-3, rtol=0)
    if not table.is_cuda:
        padded[1, 1] = -1
        with pytest.raises(ValueError, match="must index the cache's 12 pages"):
            flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 9, 13, block_table=padded)
    with pytest.raises(ValueError, match="with block_table, v must be"):
        flash_attn_varlen_func(q, k_pages, v_pages[:6], cu_q, cu_k, 9, 13, block_table=table)


def test_varlen_with_paged_keys_reads_pages_in_place_without_gradients(monkeypatch):
    # Inference (no gradient, dropout or sinks): the split-KV kernels read the pages in place (no
    # gathered copy), against the oracle of each sequence, lse (nheads, total_q) too, with ALiBi
    # and a window; a sequence without keys gives 0 and +inf; rows after the last query (a padded
    # buffer) give 0.  (dispatch.paged_varlen_in_place)
    torch.manual_seed(3)
    gathered = []
    gather = kvcache.paged_varlen_keys
    monkeypatch.setattr(kvcache, "paged_varlen_keys", lambda *args: gathered.append(1) or gather(*args))
    page, pages, lengths_q, lengths_k = 16, 9, [3, 1, 6], [40, 0, 21]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=DEVICE)
                  for n in (lengths_q, lengths_k))
    q = torch.randn(10, 4, 32, dtype=DTYPE, device=DEVICE)
    k_pages, v_pages = (torch.randn(pages, page, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2))
    table = torch.randperm(pages, device=DEVICE)[:9].view(3, 3).int()
    slopes = torch.rand(4, device=DEVICE) * 0.3
    mask = dict(causal=True, window_size=(25, -1), alibi_slopes=slopes)
    out, lse, _ = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 6, 40, block_table=table,
                                         return_attn_probs=True, **mask)
    assert not gathered and lse.shape == (4, 10)
    for b, (m, n) in enumerate(zip(lengths_q, lengths_k)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if not n:
            assert (out[rows] == 0).all() and (lse[:, rows] == float("inf")).all()
            continue
        keys = [x[table[b].long()].flatten(0, 1)[None, :n] for x in (k_pages, v_pages)]
        oracle, oracle_lse = standard_attention(q[None, rows], *keys, upcast=True, return_lse=True, **mask)
        assert_within_rule(f"sequence {b}", out[None, rows], standard_attention(q[None, rows], *keys, **mask), oracle,
                           (2.0, 1e-5))
        assert max_err(lse[:, rows], oracle_lse[0]) <= 1e-3
    spare = torch.cat([q, torch.randn(2, 4, 32, dtype=DTYPE, device=DEVICE)])
    padded = flash_attn_varlen_func(spare, k_pages, v_pages, cu_q, cu_k, 6, 40, block_table=table, **mask)
    assert not gathered and (padded[10:] == 0).all()
    torch.testing.assert_close(padded[:10], out, atol=0, rtol=0)
    # Pages strided along the head dim (which the kernels of flash_attn_with_kvcache do not take),
    # and many queries a sequence (a max_seqlen_q of 40 makes 80 rows a KV head, past one row
    # block): the varlen kernels on the gathered keys.
    strided = [torch.stack([x, x], -1)[..., 0] for x in (k_pages, v_pages)]
    torch.testing.assert_close(flash_attn_varlen_func(q, *strided, cu_q, cu_k, 6, 40, block_table=table, **mask), out,
                               atol=2e-3, rtol=0)
    assert gathered
    gathered.clear()
    torch.testing.assert_close(flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 40, 40, block_table=table,
                                                      **mask), out, atol=2e-3, rtol=0)
    assert gathered


def test_bert_padding_round_trip_through_the_varlen_call():
    # flash_attn.bert_padding's helpers: padded q, k, v unpadded by a key-padding mask, the varlen
    # call, the output padded back: each sequence as its own call, zeros at padding, gradients
    # reaching the kept tokens only.
    lengths, seqlen = [5, 12, 0, 9], 12
    mask = torch.arange(seqlen, device=DEVICE)[None] < torch.tensor(lengths, device=DEVICE)[:, None]
    q, k, v = (x.requires_grad_() for x in make_qkv(4, seqlen, seqlen, 4, 2, 32, DTYPE, DEVICE))
    (qs, indices, cu, longest, used), (ks, _, _, _, _), (vs, _, _, _, _) = (unpad_input(x, mask) for x in (q, k, v))
    assert cu.tolist() == [0, 5, 17, 17, 26] and longest == 12 and used.tolist() == lengths
    assert qs.shape == (26, 4, 32) and torch.equal(pad_input(qs, indices, 4, seqlen), q * mask[..., None, None])
    out = pad_input(flash_attn_varlen_func(qs, ks, vs, cu, cu, longest, longest, causal=True), indices, 4, seqlen)
    out.sum().backward()
    for b, n in enumerate(lengths):
        if n:
            one = flash_attn_func(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
            torch.testing.assert_close(out[b:b + 1, :n], one, atol=2e-3, rtol=0)
        assert (out[b, n:] == 0).all()
        assert (q.grad[b, n:] == 0).all() and (k.grad[b, n:] == 0).all() and (n == 0 or (q.grad[b, :n] != 0).any())
    # flash_attn's unused_mask: tokens packed but not counted as used
    unused = ~mask & (torch.arange(seqlen, device=DEVICE)[None] < 12)
    _, _, cu_all, _, used = unpad_input(q.detach(), mask, unused)
    assert cu_all.tolist() == [0, 12, 24, 36, 48] and used.tolist() == lengths


def test_bert_padding_concatenated_documents_attend_within_themselves():
    # Rows holding documents one after another (flash_attn's attention_mask_in_length): each
    # document through the varlen call is its own call; padding after a row's documents stays 0.
    docs, seqlen = [[3, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0], [11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0] * 11], 11
    lengths = torch.tensor(docs, device=DEVICE)
    q, k, v = make_qkv(3, seqlen, seqlen, 4, 2, 32, DTYPE, DEVICE)
    (qs, indices, cu, longest), (ks, *_), (vs, *_) = (unpad_input_for_concatenated_sequences(x, lengths)
                                                      for x in (q, k, v))
    assert cu.tolist() == [0, 3, 9, 20] and longest == 11 and qs.shape == (20, 4, 32)
    out = pad_input(flash_attn_varlen_func(qs, ks, vs, cu, cu, longest, longest, causal=True), indices, 3, seqlen)
    for b, start, n in ((0, 0, 3), (0, 3, 6), (1, 0, 11)):
        one = flash_attn_func(*(x[b:b + 1, start:start + n] for x in (q, k, v)), causal=True)
        torch.testing.assert_close(out[b:b + 1, start:start + n], one, atol=2e-3, rtol=0)
    assert (out[0, 9:] == 0).all() and (out[2] == 0).all()
    for bad in (lengths[:1].float(), lengths[0], lengths[0, 0], lengths[:2], torch.tensor([[6, 6] + [0] * 9],
                device=DEVICE), torch.tensor([[-1, 3] + [0] * 9], device=DEVICE)):
        with pytest.raises(ValueError, match="attention_mask_in_length"):
            unpad_input_for_concatenated_sequences(q[:1], bad)
    # index_first_axis_residual: rows and the whole input, both passing gradients back.
    x = torch.randn(5, 3, device=DEVICE, requires_grad=True)
    rows, residual = index_first_axis_residual(x, torch.tensor([4, 1], device=DEVICE))
    (2 * rows.sum() + residual.sum()).backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 3, 1, 1, 3], device=DEVICE)[:, None].expand(5, 3))


def test_flash_attention_3_kvcache():
    # FA3's flash_attn_with_kvcache: flashtile's, page_table its block table (the same bits, new
    # keys appended in place); what it lacks is refused by name.
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 32, dtype=DTYPE, device=DEVICE)
    pages = [torch.randn(8, 16, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    table = torch.tensor([[3, 1, 6], [0, 7, 2]], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([20, 35], dtype=torch.int32, device=DEVICE)
    new = [torch.randn(2, 1, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    caches = [[x.clone() for x in pages] for _ in range(2)]
    out, lse, *accumulators = fa3.flash_attn_with_kvcache(q, *caches[0], *new, cache_seqlens=seqlens, page_table=table,
                                                          causal=True, return_softmax_lse=True)
    expected = flashtile.flash_attn_with_kvcache(q, *caches[1], *new, cache_seqlens=seqlens, block_table=table,
                                                 causal=True, return_softmax_lse=True)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1]) and accumulators == [None, None]
    assert all(torch.equal(a, b) for a, b in zip(*caches))
    # Queries packed by cu_seqlens_q: each sequence's, as its own batched call.
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    packed = torch.randn(3, 4, 32, dtype=DTYPE, device=DEVICE)
    out = fa3.flash_attn_with_kvcache(packed, *pages, cache_seqlens=seqlens, page_table=table, causal=True,
                                      cu_seqlens_q=cu, max_seqlen_q=2)
    for b in range(2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = fa3.flash_attn_with_kvcache(packed[None, rows], *pages, cache_seqlens=seqlens[b:b + 1],
                                          page_table=table[b:b + 1], causal=True)
        torch.testing.assert_close(out[rows], one[0], atol=2e-3, rtol=0)
    # New keys packed by cu_seqlens_k_new: as the batched call with the same keys; without k
    # (and rotary_seqlens without rotary tables) ignored, as FA3 ignores them.
    caches = [[x.clone() for x in pages] for _ in range(2)]
    cu_new = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    out = fa3.flash_attn_with_kvcache(q, *caches[0], new[0].flatten(0, 1), new[1].flatten(0, 1), cache_seqlens=seqlens,
                                      page_table=table, causal=True, cu_seqlens_k_new=cu_new)
    expected = flashtile.flash_attn_with_kvcache(q, *caches[1], *new, cache_seqlens=seqlens, block_table=table,
                                                 causal=True)
    assert torch.equal(out, expected) and all(torch.equal(a, b) for a, b in zip(*caches))
    assert torch.equal(fa3.flash_attn_with_kvcache(q, *pages, cache_seqlens=seqlens, page_table=table,
                                                   cu_seqlens_k_new=cu_new, rotary_seqlens=seqlens),
                       fa3.flash_attn_with_kvcache(q, *pages, cache_seqlens=seqlens, page_table=table))
    for kwargs, name in ((dict(qv=q), "qv"), (dict(scheduler_metadata=seqlens), "scheduler_metadata")):
        with pytest.raises(NotImplementedError, match=name):
            fa3.flash_attn_with_kvcache(q, *pages, cache_seqlens=seqlens, page_table=table, **kwargs)
    with pytest.raises(NotImplementedError, match="one query token"):
        fa3.flash_attn_with_kvcache(q.expand(2, 2, 4, 32), *pages, cache_seqlens=seqlens, page_table=table,
                                    attention_chunk=16)
    # FA3's precomputed schedule is None here, which the call takes: the same output.
    metadata = fa3.get_scheduler_metadata(2, 1, 48, 4, 2, 32, seqlens, page_size=16, causal=True)
    assert torch.equal(fa3.flash_attn_with_kvcache(q, *pages, cache_seqlens=seqlens, page_table=table, causal=True,
                                                   scheduler_metadata=metadata),
                       fa3.flash_attn_with_kvcache(q, *pages, cache_seqlens=seqlens, page_table=table, causal=True))


def test_flash_attention_3_kvcache_attention_chunk_counts_from_leftpad():
    # With cache_leftpad a sequence's positions, and so its chunks, start at its leftpad (FA3's
    # and transformers' Llama 4 mask): leftpads that are not chunk multiples, against the mask
    # written out in float64 over the keys from the leftpad on.
    torch.manual_seed(4)
    chunk, lengths, pads = 8, [20, 27, 9], [3, 5, 9]
    q = torch.randn(3, 1, 4, 32, dtype=DTYPE, device=DEVICE)
    cache = [torch.randn(3, 40, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, *cache, cache_seqlens=as_int32(lengths),
                                               cache_leftpad=as_int32(pads), causal=True, attention_chunk=chunk,
                                               return_softmax_lse=True)
    for b, (n, pad) in enumerate(zip(lengths, pads)):
        if n == pad:  # no key: 0, logsumexp -inf (FA3's)
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
            continue
        keys = [x[b:b + 1, pad:n] for x in cache]
        oracle = chunked_attention(q[b:b + 1], *keys, chunk, True, upcast=True)
        pt = chunked_attention(q[b:b + 1], *keys, chunk, True)
        assert_within_rule(f"sequence {b}", out[b:b + 1], pt, oracle, (2.0, 1e-5))
    with pytest.raises(ValueError, match="cache_leftpad"):
        fa3.flash_attn_with_kvcache(q, *cache, cache_seqlens=as_int32(lengths), cache_leftpad=as_int32(pads[:2]),
                                    causal=True, attention_chunk=chunk)


def test_flash_attention_3_combine_merges_splits_of_the_keys():
    # flash_attn_combine over the results of disjoint key ranges equals one call over all the
    # keys: output and logsumexp; a split that saw no key of a row (lse -inf, its output never
    # written: NaN here) is left out, and a row no split saw gives 0 and -inf.
    torch.manual_seed(5)
    q, k, v = make_qkv(2, 24, 40, 4, 2, 32, DTYPE, DEVICE)
    whole, whole_lse = fa3.flash_attn_func(q, k, v, return_attn_probs=True)
    parts = [fa3.flash_attn_func(q, k[:, a:b], v[:, a:b], causal=causal, return_attn_probs=True)
             for a, b, causal in ((0, 16, False), (16, 40, False))]
    out_partial = torch.stack([o.float() for o, _ in parts])
    lse_partial = torch.stack([lse.transpose(1, 2) for _, lse in parts])  # (splits, batch, seqlen, heads)
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=DTYPE)
    assert out.dtype == DTYPE and out.shape == whole.shape
    torch.testing.assert_close(out, whole, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, whole_lse.transpose(1, 2), atol=1e-4, rtol=0)
    assert lse.transpose(1, 2).is_contiguous()  # (FA3's layout: a view of (batch, nheads, seqlen))
    into = torch.full_like(out_partial[0], float("nan"))
    assert fa3.flash_attn_combine(out_partial, lse_partial, out=into)[0] is into
    torch.testing.assert_close(into, out.float(), atol=2e-3, rtol=0)
    lse_partial[1, 1, 5] = float("-inf")
    out_partial[1, 1, 5] = float("nan")
    lse_partial[:, 0, 3] = float("-inf")
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    assert (out[0, 3] == 0).all() and (lse[0, 3] == float("-inf")).all() and not out.isnan().any()
    assert torch.equal(out[1, 5], out_partial[0, 1, 5]) and torch.equal(lse[1, 5], lse_partial[0, 1, 5])
    with pytest.raises(TypeError, match="lse_partial"):
        fa3.flash_attn_combine(out_partial, lse_partial.double())
    with pytest.raises(ValueError, match="lse_partial"):
        fa3.flash_attn_combine(out_partial, lse_partial[:, :, :3])
    with pytest.raises(ValueError, match="out must be"):
        fa3.flash_attn_combine(out_partial, lse_partial, out=into.to(DTYPE))  # (out_dtype: float32 by default)


def test_flash_attention_3_lse_of_rows_without_keys_is_minus_inf():
    # FA3 gives a row that sees no key logsumexp -inf (flashtile's own functions +inf, as
    # FlashAttention-2): causal with more queries than keys, batched and packed, and a chunked
    # varlen call on a padded buffer (rows after the last sequence: 0).
    q, k, v = make_qkv(1, 12, 5, 2, 2, 32, DTYPE, DEVICE)
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert (lse[0, :, :7] == float("-inf")).all() and lse[0, :, 7:].isfinite().all()
    assert (out[0, :7] == 0).all()
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (12, 5))
    _, lse = fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 12, 5, causal=True, return_attn_probs=True)
    assert (lse[:, :7] == float("-inf")).all()
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    rows = torch.randn(12, 2, 32, dtype=DTYPE, device=DEVICE)
    rows[9:] = float("nan")  # (read by no sequence)
    out, lse = fa3.flash_attn_varlen_func(rows, rows, rows, cu, cu, 5, 5, causal=True, attention_chunk=4,
                                          return_attn_probs=True)
    assert (out[9:] == 0).all() and (lse[:, 9:] == float("-inf")).all()
    exact = fa3.flash_attn_varlen_func(rows[:9], rows[:9], rows[:9], cu, cu, 5, 5, causal=True, attention_chunk=4)
    assert torch.equal(out[:9], exact)


def test_flash_attention_3_qkvpacked_5d_ignores_num_heads_q():
    # FA3 reads num_heads_q of the (batch, seqlen, heads_q + 2 heads_k, d) form only.
    q, k, v = make_qkv(1, 20, 20, 2, 2, 32, DTYPE, DEVICE)
    qkv = torch.stack([q, k, v], 2)
    assert torch.equal(fa3.flash_attn_qkvpacked_func(qkv, num_heads_q=2), fa3.flash_attn_qkvpacked_func(qkv))


@pytest.mark.parametrize("paged", [False, True])
def test_flash_attention_3_kvcache_attention_chunk(paged):
    # A decoding step of Llama 4's chunked layers: the query (at its sequence's last key, the new
    # one included) sees its chunk's keys only, against the mask written out in float64.
    torch.manual_seed(1)
    chunk, lengths = 16, [20, 31, 32, 5]
    q = torch.randn(4, 1, 4, 32, dtype=DTYPE, device=DEVICE)
    dense = [torch.randn(4, 48, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    new = [torch.randn(4, 1, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    if paged:  # each sequence's 48 rows as 3 pages of 16, in a shuffled pool
        order = torch.randperm(12, device=DEVICE)
        caches = [torch.empty(12, 16, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2)]
        for c, d in zip(caches, dense):
            c[order] = d.reshape(12, 16, 2, 32)
        table = order.view(4, 3).int()
    else:
        caches, table = [d.clone() for d in dense], None
    out = fa3.flash_attn_with_kvcache(q, *caches, *new, cache_seqlens=seqlens, page_table=table, causal=True,
                                      attention_chunk=chunk)
    for b, n in enumerate(lengths):
        keys = [torch.cat([d[b:b + 1, :n], x[b:b + 1]], 1) for d, x in zip(dense, new)]
        oracle = chunked_attention(q[b:b + 1], *keys, chunk, True, upcast=True)
        pt = chunked_attention(q[b:b + 1], *keys, chunk, True)
        assert_within_rule(f"sequence {b}", out[b:b + 1], pt, oracle, (2.0, 1e-5))
