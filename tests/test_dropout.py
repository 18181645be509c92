"""Attention dropout: the kernels' mask is Philox-drawn from a seed taken from torch's generator;
against the float64 reference given the same mask, outputs and gradients follow the FA rule."""
import math

import pytest
import torch
import triton
import triton.language as tl
from attention_check import GRAD_RULE, OUT_RULE, assert_within_rule, make_qkv, run_and_grad
from conftest import DEVICE, ON_GPU, run_outside_the_interpreter

from flashtile import flash_attn_func, flash_attn_varlen_func, standard_attention
from flashtile.kernels import dropout
from flashtile.options import KernelOptions

DTYPE = torch.bfloat16 if ON_GPU else torch.float16


def seeded(seed, fn):
    """fn run right after torch.manual_seed(seed): its dropout seed is the next draw."""
    def run(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return run


def mask_of(seed, batch, heads, seqlen_q, seqlen_k, p):
    """The mask a call made right after torch.manual_seed(seed) draws."""
    torch.manual_seed(seed)
    return dropout.kept(dropout.new_seed(torch.device(DEVICE)), batch, heads, seqlen_q, seqlen_k, dropout.rate(p))


def check_with_mask(call, q, k, v, mask, p, **features):
    """call(q, k, v) (seeded) against standard_attention with the same mask: out and gradients."""
    dout = torch.randn_like(q)
    out, _, grads = run_and_grad(call, q, k, v, dout)
    kw = dict(dropout_mask=mask, dropout_p=dropout.rate(p), **features)
    oracle, _, oracle_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, upcast=True, **kw),
                                           q, k, v, dout.double())
    pt, _, pt_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, **kw), q, k, v, dout)
    assert_within_rule("out", out, pt, oracle, OUT_RULE)
    for name, g, g_pt, g_ref in zip(("dq", "dk", "dv"), grads, pt_grads, oracle_grads):
        assert_within_rule(name, g, g_pt, g_ref, GRAD_RULE)
    return out


@pytest.mark.parametrize("version", ["v1", "v2", "v3", "tiled"])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_reference_with_its_mask(version, causal):
    torch.manual_seed(1)
    q, k, v = make_qkv(2, 70, 90, 4, 2, 32, DTYPE, DEVICE)  # GQA, lengths off the block sizes
    p = 0.17
    mask = mask_of(5, 2, 4, 70, 90, p)
    call = seeded(5, lambda a, b, c: flash_attn_func(a, b, c, dropout_p=p, causal=causal, version=version))
    check_with_mask(call, q, k, v, mask, p, causal=causal)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernels run on Hopper")
@pytest.mark.parametrize("backward", ["", "backward=gluon"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_v3_gluon_kernels_draw_the_same_mask(head_dim, causal, backward):
    # Each thread of the Gluon forward draws the numbers of the keys it holds (dropout.kept_mma),
    # as do the Gluon backward's two passes (kept_mma, kept_words_t) when asked for (up to d128;
    # v2's backward otherwise): the mask must be dropout.kept's, at every head dim, past block
    # edges, under GQA, in the output and the gradients.
    torch.manual_seed(6)
    q, k, v = make_qkv(2, 300, 433, 4, 2, head_dim, DTYPE, DEVICE)
    p = 0.1
    assert forward_kernel(q, k, p, causal) == "v3-gluon"
    mask = mask_of(7, 2, 4, 300, 433, p)
    call = seeded(7, lambda a, b, c: flash_attn_func(a, b, c, dropout_p=p, causal=causal, version="v3",
                                                     kernel_options=backward))
    check_with_mask(call, q, k, v, mask, p, causal=causal)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward runs on Hopper")
def test_v3_gluon_forward_dropout_on_packed_sequences_and_windows():
    torch.manual_seed(8)
    q, k, v = make_qkv(1, 200, 200, 2, 2, 128, DTYPE, DEVICE)
    p = 0.2
    mask = mask_of(3, 1, 2, 200, 200, p)
    features = dict(window_size=(70, 5), softcap=20.0)
    call = seeded(3, lambda a, b, c: flash_attn_func(a, b, c, dropout_p=p, version="v3", **features))
    check_with_mask(call, q, k, v, mask, p, **features)
    # One packed sequence walks the Gluon forward's tile list: the same numbers as batched.
    cu = torch.tensor([0, 200], dtype=torch.int32, device=DEVICE)
    for options in ("forward=gluon", "forward=gluon;backward=gluon"):
        packed = seeded(3, lambda a, b, c: flash_attn_varlen_func(a[0], b[0], c[0], cu, cu, 200, 200, dropout_p=p,
                                                                  version="v3", kernel_options=options,
                                                                  **features)[None])
        check_with_mask(packed, q, k, v, mask, p, **features)


def forward_kernel(q, k, p, causal):
    """The forward kernel flash_attn_func runs for these inputs with dropout ``p``."""
    from flashtile import dispatch
    from flashtile.kernels.problem import Problem
    prob = Problem.of(q, k, None, None, 0, 0, q.shape[-1] ** -0.5, -1, 0 if causal else -1, dropout_p=p,
                      dropout_seed=dropout.new_seed(q.device))
    return dispatch.forward_plan(prob, "v3", dispatch.target_of(prob, q, k, k), KernelOptions()).kernel


def test_dropout_with_window_softcap_and_alibi():
    torch.manual_seed(2)
    q, k, v = make_qkv(1, 48, 48, 2, 2, 32, DTYPE, DEVICE)
    p, slopes = 0.3, torch.tensor([0.25, 0.5], device=DEVICE)
    features = dict(window_size=(20, 3), softcap=5.0, alibi_slopes=slopes)
    mask = mask_of(9, 1, 2, 48, 48, p)
    call = seeded(9, lambda a, b, c: flash_attn_func(a, b, c, dropout_p=p, version="v2", **features))
    check_with_mask(call, q, k, v, mask, p, **features)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon backward runs on Hopper")
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_backward_dropout_with_softcap_and_alibi(causal):
    # The dK/dV pass carries the mask in the sign bit of P^T f': softcap's f' under ALiBi, on
    # blocks the diagonal crosses too, with a window.
    torch.manual_seed(12)
    q, k, v = make_qkv(1, 300, 300, 2, 2, 64, DTYPE, DEVICE)
    p, slopes = 0.3, torch.tensor([0.25, 0.5], device=DEVICE)
    features = dict(window_size=(150, 40), softcap=5.0, alibi_slopes=slopes, causal=causal)
    mask = mask_of(13, 1, 2, 300, 300, p)
    call = seeded(13, lambda a, b, c: flash_attn_func(a, b, c, dropout_p=p, version="v3",
                                                      kernel_options="backward=gluon", **features))
    check_with_mask(call, q, k, v, mask, p, **features)


@pytest.mark.parametrize("version", ["v1", "auto", "tiled"])
def test_varlen_dropout_per_sequence(version):
    torch.manual_seed(3)
    lengths_q, lengths_k = [17, 40, 1], [30, 40, 9]
    heads, p = 2, 0.25
    q = torch.randn(sum(lengths_q), heads, 32, dtype=DTYPE, device=DEVICE)
    k = torch.randn(sum(lengths_k), heads, 32, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
          for x in (lengths_q, lengths_k)]
    mask = mask_of(4, 3, heads, max(lengths_q), max(lengths_k), p)
    dout = torch.randn_like(q)
    call = seeded(4, lambda a, b, c: flash_attn_varlen_func(a, b, c, cu[0], cu[1], max(lengths_q), max(lengths_k),
                                                            dropout_p=p, causal=True, version=version))
    out, _, grads = run_and_grad(call, q, k, v, dout)
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        rows, keys = slice(int(cu[0][i]), int(cu[0][i + 1])), slice(int(cu[1][i]), int(cu[1][i + 1]))
        kw = dict(causal=True, dropout_mask=mask[i:i + 1, :, :lq, :lk], dropout_p=p)
        parts = (q[None, rows], k[None, keys], v[None, keys])
        oracle, _, oracle_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, upcast=True, **kw),
                                               *parts, dout[None, rows].double())
        pt, _, pt_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, **kw), *parts, dout[None, rows])
        assert_within_rule(f"sequence {i}", out[None, rows], pt, oracle, OUT_RULE)
        for name, g, sl, g_pt, g_ref in zip(("dq", "dk", "dv"), grads, (rows, keys, keys), pt_grads, oracle_grads):
            assert_within_rule(f"sequence {i} {name}", g[None, sl], g_pt, g_ref, GRAD_RULE)


@triton.jit
def _words_by_key_kernel(SEED, OUT, stream, key0, query0, KEYS: tl.constexpr, QUERIES: tl.constexpr):
    # OUT (KEYS, QUERIES): the numbers of keys key0 + i against queries query0 + j, keys as rows,
    # unpacked from dropout.words_by_key's bytes.
    a = key0 // 16 + tl.arange(0, KEYS // 16)[:, None, None, None]
    c = tl.arange(0, 4)[None, :, None, None]
    r = query0 // 16 + tl.arange(0, QUERIES // 16)[None, None, :, None]
    i = tl.arange(0, 8)[None, None, None, :]
    words = dropout.words_by_key(tl.load(SEED), a, c, r * 8 + i, stream)  # (A, c, R, i, h)
    numbers = tl.join(tl.join(words & 0xFF, (words >> 8) & 0xFF), tl.join((words >> 16) & 0xFF, words >> 24))
    # byte 2a + b -> (A, c, R, i, h, b, a) -> (A, b, c, h, R, a, i)
    numbers = tl.reshape(tl.permute(numbers, (0, 5, 1, 4, 2, 6, 3)), (KEYS, QUERIES))
    offs = tl.arange(0, KEYS)[:, None] * QUERIES + tl.arange(0, QUERIES)[None, :]
    tl.store(OUT + offs, numbers.to(tl.int32))


@triton.jit
def _kept_bytes_kernel(WORDS, OUT, dropout_p, N: tl.constexpr):
    words = tl.load(WORDS + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    tl.store(OUT + tl.arange(0, N), dropout.kept_bytes(words, dropout_p).to(tl.int32, bitcast=True))


@pytest.mark.parametrize("levels", [0, 1, 26, 128, 129, 255])
def test_kept_bytes_compares_four_numbers_a_word(levels):
    # The Gluon draws compare a word's four 8-bit numbers with the threshold at once: each byte's
    # top bit must say number >= threshold, for every value in every byte, beside any neighbours.
    numbers = torch.arange(256, dtype=torch.int64)
    per_byte = (numbers, (numbers * 37 + 11) % 256, 255 - numbers, ((numbers * 37 + 11) % 256).flip(0))
    words = sum(values << (8 * byte) for byte, values in enumerate(per_byte))
    flags = torch.empty(256, dtype=torch.int32, device=DEVICE)
    _kept_bytes_kernel[(1,)](words.to(torch.uint32).view(torch.int32).to(DEVICE), flags, levels / 256, N=256)
    flags = flags.cpu().to(torch.int64) & 0xFFFFFFFF
    for byte, values in enumerate(per_byte):
        assert torch.equal((flags >> (8 * byte + 7)) & 1 == 1, values >= levels), byte


@pytest.mark.parametrize("key0, query0", [(0, 0), (16, 32), (48, 16)])
def test_words_by_key_draw_the_masks_numbers(key0, query0):
    # A Gluon backward's transposed tile (dropout.kept_words_t) draws one call for the eight
    # scores of two keys' threads: the same keep decisions as dropout.kept, transposed, from any
    # 16-row offset.
    seed = dropout.new_seed(torch.device(DEVICE))
    heads, queries, p = 3, 32, dropout.rate(0.35)
    mask = dropout.kept(seed, 1, heads, query0 + queries, key0 + 32, p)
    numbers = torch.empty(32, queries, dtype=torch.int32, device=DEVICE)
    _words_by_key_kernel[(1,)](seed, numbers, 2, key0, query0, KEYS=32, QUERIES=queries)
    assert torch.equal(numbers >= round(p * 256), mask[0, 2, query0:, key0:].T)


@triton.jit
def _key_scale_kernel(SEED, OUT, stream, dropout_p, ROWS: tl.constexpr, KEYS: tl.constexpr):
    # OUT (ROWS, KEYS): dropout.key_scale of each key, one key at a time (the Gluon forward's
    # recomputation of rows by the masking rule draws so).
    rows = tl.arange(0, ROWS)
    drop = (tl.load(SEED), stream, dropout_p)
    for key in range(KEYS):
        tl.store(OUT + rows * KEYS + key, dropout.key_scale(drop, rows, key))


def test_key_scale_draws_the_masks_numbers():
    seed = dropout.new_seed(torch.device(DEVICE))
    p = dropout.rate(0.3)
    mask = dropout.kept(seed, 1, 2, 16, 70, p)
    scale = torch.empty(16, 70, device=DEVICE)
    _key_scale_kernel[(1,)](seed, scale, 1, p, ROWS=16, KEYS=70)
    torch.testing.assert_close(scale, mask[0, 1].float() / (1 - p))


def test_pytorch_draws_the_kernels_numbers():
    # The PyTorch path's dropout (dropout.kept_block, Philox in int64 arithmetic) keeps exactly
    # what the kernels keep, from any row and key offset.
    seed = dropout.new_seed(torch.device(DEVICE))
    p = dropout.rate(0.17)
    mask = dropout.kept(seed, 2, 3, 37, 70, p).cpu()
    streams = torch.arange(6).view(2, 3)
    assert torch.equal(dropout.kept_block(int(seed), streams, torch.arange(37), torch.arange(70), p), mask)
    assert torch.equal(dropout.kept_block(int(seed), streams[1:, 2:], torch.arange(5, 37), torch.arange(40, 70), p),
                       mask[1:, 2:, 5:, 40:])


def test_keep_rate_and_seeds():
    # The keep rate is 1 - p (p as it runs, a multiple of 1/256) within 5 standard deviations;
    # torch.manual_seed reproduces a call, and successive calls draw new masks.
    p = 0.3
    kept = mask_of(0, 2, 4, 96, 96, p)
    n, rate = kept.numel(), dropout.rate(p)
    assert abs(kept.float().mean().item() - (1 - rate)) < 5 * math.sqrt(rate * (1 - rate) / n)
    q, k, v = make_qkv(1, 64, 64, 2, 2, 32, DTYPE, DEVICE)
    torch.manual_seed(7)
    first, second = (flash_attn_func(q, k, v, dropout_p=p) for _ in range(2))
    torch.manual_seed(7)
    again = flash_attn_func(q, k, v, dropout_p=p)
    assert torch.equal(first, again) and not torch.equal(first, second)
    assert torch.equal(flash_attn_func(q, k, v, dropout_p=0.0), flash_attn_func(q, k, v))


@pytest.mark.parametrize("magnitude", [1.0, 200.0])
def test_return_attn_probs_encodes_the_dropped_ones(magnitude):
    # flash_attn's S_dmask: the probabilities, negative where dropped; the output is the kept
    # ones, scaled by 1 / (1 - p), times V.  Scores past the input type's range (q and k of
    # magnitude 200) are float32's, as in the kernels.
    torch.manual_seed(5)
    q, k, v = make_qkv(1, 40, 56, 2, 1, 32, DTYPE, DEVICE)
    q, k = q * magnitude, k * magnitude
    p = 0.2
    torch.manual_seed(11)
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    assert s_dmask.shape == (1, 2, 40, 56)
    assert torch.equal(s_dmask >= 0, mask_of(11, 1, 2, 40, 56, p) | (s_dmask == 0))
    probs = s_dmask.abs()
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2, 40, device=DEVICE), atol=2e-3, rtol=0)
    expected = torch.einsum("bhqk,bkhd->bqhd", s_dmask.clamp(min=0) / (1 - dropout.rate(p)),
                            v.float().repeat_interleave(2, 2))
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_cpu_dropout_in_a_process_without_the_interpreter():
    # Outside the interpreter CPU tensors take the PyTorch path, dropout included: the output is
    # the kept probabilities (S_dmask's signs) times V, forward and backward.
    script = (
        "import torch\n"
        "from flashtile import flash_attn_func, standard_attention\n"
        "torch.manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))\n"
        "torch.manual_seed(1)\n"
        "out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=0.2, causal=True, return_attn_probs=True)\n"
        "kw = dict(causal=True, dropout_mask=s_dmask >= 0, dropout_p=51 / 256)  # 0.2 as it runs\n"
        "ref = standard_attention(q.double(), k.double(), v.double(), **kw)\n"
        "assert (s_dmask < 0).any() and (out.double() - ref).abs().max() < 1e-2, (out, ref)\n"
        "grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))\n"
        "refs = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))\n"
        "assert all((g.double() - r).abs().max() < 5e-2 for g, r in zip(grads, refs))\n"
        "out, lse, s_dmask = flash_attn_func(q, k[:, :0], v[:, :0], dropout_p=0.2, return_attn_probs=True)\n"
        "assert s_dmask.shape == (1, 2, 40, 0) and (out == 0).all()\n")
    res = run_outside_the_interpreter("-c", script)
    assert res.returncode == 0, res.stderr[-2000:]


def test_dropout_p_runs_as_a_multiple_of_1_256():
    # 8-bit numbers: dropout_p runs rounded to a multiple of 1/256, mask and scale alike (the
    # expectation stays exact); one that rounds to 1 is refused by name.
    assert dropout.rate(0.17) == 44 / 256 and dropout.rate(0.0) == 0.0 and dropout.rate(0.001) == 0.0
    q, k, v = make_qkv(1, 48, 40, 2, 1, 32, DTYPE, DEVICE)
    asked, runs = (seeded(3, lambda p: flash_attn_func(q, k, v, dropout_p=p))(p) for p in (0.17, 44 / 256))
    assert torch.equal(asked, runs)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=0.999)


def test_dropout_refusals():
    q, k, v = make_qkv(1, 16, 16, 1, 1, 32, DTYPE, DEVICE)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=1.0)
