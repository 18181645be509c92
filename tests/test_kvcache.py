"""flash_attn_with_kvcache: decoding and chunked prefill over contiguous and paged caches, new
keys appended (with rotary), split-KV, against the float64 oracle per sequence, on the split-KV
kernel and on the PyTorch path (CPU tensors outside the interpreter, or version="tiled")."""
import functools
import types

import pytest
import torch
from attention_check import assert_within_rule, max_err
from conftest import DEVICE, ON_GPU, run_outside_the_interpreter

from flashtile import dispatch, flash_attn_with_kvcache, kept_calls, kvcache, options, standard_attention
from flashtile.kernels import decode

DTYPE = torch.bfloat16 if ON_GPU else torch.float16
HEAD_DIM = 64 if ON_GPU else 32
# "auto": the split-KV kernel here (a GPU or the interpreter); "tiled": the PyTorch path.
VERSIONS = ["auto", "tiled"]


def attend(plan, q, k_cache, v_cache, seqlens, new_keys, leftpad, batch_idx, block_table, scale, window, features):
    """decode.Attend for one call."""
    step = decode.Attend(plan, q, k_cache, v_cache, seqlens is not None, leftpad is not None, batch_idx is not None,
                         block_table, scale, window, features.softcap, features.alibi_slopes is not None)
    return step(q, k_cache, v_cache, seqlens, new_keys, leftpad, batch_idx, block_table, features.alibi_slopes)


def queries_advance(causal, window_size, capacity):
    """Whether flash_attn rotates query i at cache_seqlens + i (else all at cache_seqlens): causal,
    or a window side narrower than the cache (wider ones it drops)."""
    return causal or any(0 <= side < capacity for side in window_size)


def rotate(x, cos, sin, positions, interleaved):
    """The rotary embedding, pair by pair in float64 (the oracle's)."""
    x = x.double().clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            c, s = cos[positions[b, t]].double(), sin[positions[b, t]].double()
            for i in range(half):
                a, z = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                xa, xz = x[b, t, :, a].clone(), x[b, t, :, z].clone()
                x[b, t, :, a] = xa * c[i] - xz * s[i]
                x[b, t, :, z] = xz * c[i] + xa * s[i]
    return x


class Case:
    """A cache with random contents, its sequences' lengths, and the flashtile call on it."""

    def __init__(self, batch=3, seqlen_q=1, heads=4, heads_k=2, capacity=90, seqlen_new=0, page_size=None,
                 leftpad=False, batch_idx=False, rotary=None):
        g = torch.Generator().manual_seed(batch * 1000 + seqlen_q * 10 + seqlen_new)
        self.seqlen_new = seqlen_new
        self.lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), generator=g)
        self.lengths[0] = capacity - seqlen_new  # one sequence fills the cache
        self.q = torch.randn(batch, seqlen_q, heads, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE)
        rows = batch + 2 if batch_idx else batch
        self.k_dense = torch.randn(rows, capacity, heads_k, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE)
        self.v_dense = torch.randn(rows, capacity, heads_k, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE)
        self.k_new = self.v_new = None
        if seqlen_new:
            self.k_new = torch.randn(batch, seqlen_new, heads_k, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE)
            self.v_new = torch.randn(batch, seqlen_new, heads_k, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE)
        self.batch_idx = torch.randperm(rows, generator=g)[:batch].int().to(DEVICE) if batch_idx else None
        self.leftpad = None
        if leftpad:
            self.leftpad = (torch.rand(batch, generator=g) * self.lengths).int().to(DEVICE)
        blocks = -(-capacity // page_size) if page_size else None
        # What the call sees: pages hold whole blocks.
        self.capacity = blocks * page_size if page_size else capacity
        self.rotary = None
        if rotary is not None:  # tables as long as the cache, as flash_attn requires
            angle = torch.rand(self.capacity, HEAD_DIM // 4, generator=g) * 6.28
            self.rotary = (torch.cos(angle).to(DTYPE).to(DEVICE), torch.sin(angle).to(DTYPE).to(DEVICE), rotary)
        self.page_size = page_size
        self.block_table = None
        if page_size:
            # The dense rows cut into pages, scattered over a larger pool in a random order.
            pool = batch * blocks + 3
            order = torch.randperm(pool, generator=g)[:batch * blocks]
            self.block_table = order.view(batch, blocks).int().to(DEVICE)
            self.k_pages = torch.randn(pool, page_size, heads_k, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE)
            self.v_pages = torch.randn_like(self.k_pages)
            for b in range(batch):
                for j in range(blocks):
                    n = min(page_size, capacity - j * page_size)
                    page = int(self.block_table[b, j])
                    self.k_pages[page, :n] = self.k_dense[b, j * page_size:j * page_size + n]
                    self.v_pages[page, :n] = self.v_dense[b, j * page_size:j * page_size + n]

    def run(self, **kw):
        caches = (self.k_pages, self.v_pages) if self.page_size else (self.k_dense, self.v_dense)
        rot = {}
        if self.rotary:
            rot = dict(rotary_cos=self.rotary[0], rotary_sin=self.rotary[1], rotary_interleaved=self.rotary[2])
        return flash_attn_with_kvcache(self.q, *caches, k=self.k_new, v=self.v_new,
                                       cache_seqlens=self.lengths.int().to(DEVICE), cache_batch_idx=self.batch_idx,
                                       cache_leftpad=self.leftpad, block_table=self.block_table,
                                       return_softmax_lse=True, **rot, **kw)

    def check(self, out, lse, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
        """Each sequence against the float64 oracle over its keys, the appended ones included."""
        for b in range(self.q.shape[0]):
            row = b if self.batch_idx is None else int(self.batch_idx[b])
            start = 0 if self.leftpad is None else int(self.leftpad[b])
            end = int(self.lengths[b])
            q, k, v = self.q[b:b + 1], self.k_dense[row:row + 1, start:end], self.v_dense[row:row + 1, start:end]
            if self.seqlen_new:
                k_new = self.k_new[b:b + 1]
                if self.rotary:
                    cos, sin, interleaved = self.rotary
                    positions = end + torch.arange(self.seqlen_new)[None]
                    k_new = rotate(k_new, cos, sin, positions, interleaved).to(DTYPE)
                    q_positions = end + torch.arange(q.shape[1])[None] \
                        if queries_advance(causal, window_size, self.capacity) else torch.full((1, q.shape[1]), end)
                    q = rotate(q, cos, sin, q_positions, interleaved).to(DTYPE)
                k, v = torch.cat([k, k_new], 1), torch.cat([v, self.v_new[b:b + 1]], 1)
            if k.shape[1] == 0:  # no key: output 0, logsumexp +inf
                assert (out[b] == 0).all() and (lse[b] == float("inf")).all()
                continue
            slopes = None if alibi_slopes is None else alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
            mask = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=slopes)
            oracle, oracle_lse = standard_attention(q, k, v, upcast=True, return_lse=True, **mask)
            pytorch = standard_attention(q, k, v, **mask)
            assert torch.isfinite(out[b]).all()
            assert_within_rule(f"out[{b}]", out[b:b + 1], pytorch, oracle, (2.0, 1e-5))
            ours_lse, seen = lse[b:b + 1], torch.isfinite(oracle_lse)
            assert torch.equal(torch.isfinite(ours_lse), seen)
            assert not seen.any() or max_err(ours_lse[seen], oracle_lse[seen]) <= 1e-3


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_contiguous(num_splits, causal, version):
    case = Case(batch=3, seqlen_q=1)
    out, lse = case.run(causal=causal, num_splits=num_splits, version=version)
    case.check(out, lse, causal=causal)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("page_size", [16, 7])
def test_chunked_prefill_paged_with_append(page_size, version):
    # Several new tokens per sequence, appended into pages of 16 (serving engines' size) and of
    # an odd size; causal aligned to the end of each sequence.
    case = Case(batch=2, seqlen_q=5, seqlen_new=5, page_size=page_size)
    out, lse = case.run(causal=True, num_splits=2, version=version)
    case.check(out, lse, causal=True)
    # The new keys landed in the pages, where the next call reads them.
    for b in range(2):
        end = int(case.lengths[b])
        for t in range(5):
            page = int(case.block_table[b, (end + t) // page_size])
            assert torch.equal(case.k_pages[page, (end + t) % page_size], case.k_new[b, t])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_append_with_rotary(interleaved, causal, version):
    case = Case(batch=2, seqlen_q=3, seqlen_new=3, rotary=interleaved)
    out, lse = case.run(causal=causal, version=version)
    case.check(out, lse, causal=causal)


@pytest.mark.parametrize("version", VERSIONS)
def test_rotary_paged_with_more_queries_than_new_keys(version):
    # Pages of 7 (a capacity of 91 for 90 dense keys: the tables cover it), GPT-NeoX's halves
    # (rotary=False: not interleaved); two new keys for four queries, rotated at
    # cache_seqlens + i as in flash_attn (the lengths leave room for their positions in the tables).
    case = Case(batch=2, seqlen_q=4, seqlen_new=2, page_size=7, rotary=False)
    case.lengths = case.lengths.clamp(max=case.capacity - 4)
    out, lse = case.run(causal=True, version=version)
    case.check(out, lse, causal=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("window_size", [(90, -1), (-1, 40)])
def test_rotary_queries_under_a_wide_window(window_size, version):
    # flash_attn drops a window side as wide as the cache (90 keys): queries all rotated at
    # cache_seqlens; a right side of 40 (wider than the queries, narrower than the cache) keeps
    # the window: query i at cache_seqlens + i.
    case = Case(batch=2, seqlen_q=3, seqlen_new=3, rotary=True)
    out, lse = case.run(window_size=window_size, version=version)
    case.check(out, lse, window_size=window_size)


@pytest.mark.parametrize("version", VERSIONS)
def test_batch_index_leftpad_window_softcap_alibi(version):
    case = Case(batch=3, seqlen_q=2, seqlen_new=2, leftpad=True, batch_idx=True)
    slopes = torch.rand(3, 4, device=DEVICE) * 0.3
    mask = dict(causal=True, window_size=(20, 0), softcap=5.0, alibi_slopes=slopes)
    out, lse = case.run(num_splits=2, version=version, **mask)
    case.check(out, lse, **mask)


@pytest.mark.parametrize("page_size", [None, 16])
def test_value_cache_of_its_own_strides(page_size):
    # K and V caches laid out alike share one row offset in the kernel; a V cache of other
    # strides (heads-major here) takes its own, with the same bits as the same values laid out
    # like K.
    case = Case(batch=3, seqlen_q=2, capacity=70, page_size=page_size)
    alike = case.run(causal=True)
    name = "v_pages" if page_size else "v_dense"
    same = getattr(case, name)
    setattr(case, name, same.transpose(1, 2).contiguous().transpose(1, 2))
    assert getattr(case, name).stride() != same.stride() and torch.equal(getattr(case, name), same)
    own = case.run(causal=True)
    assert torch.equal(own[0], alike[0]) and torch.equal(own[1], alike[1])
    case.check(*own, causal=True)


def test_paged_equals_contiguous_bitwise():
    # The same cache contents, tiles and split count: the same bits, paged or not.  (A paged
    # cache's default tiles take longer steps, dispatch.decode_plan: both are checked against
    # the oracle.)
    # On the GPU, caches long enough for the paged tiles' unmasked 128-key steps in every split.
    case = Case(batch=3, seqlen_q=4, heads=8, heads_k=2, capacity=1000 if ON_GPU else 90, page_size=16)
    features = types.SimpleNamespace(softcap=0.0, alibi_slopes=None)
    lengths = case.lengths.int().to(DEVICE)
    scale, window = case.q.shape[-1] ** -0.5, (-1, 0)
    for paged in (False, True):
        plan = dispatch.decode_plan(case.q, 2, case.k_dense.shape[1], 3, paged=paged)
        runs = [attend(plan, case.q, k, v, lengths, 0, None, None, table, scale, window, features)
                for k, v, table in ((case.k_pages, case.v_pages, case.block_table), (case.k_dense, case.v_dense, None))]
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), f"paged plan: {paged}"
    out, lse = case.run(causal=True, num_splits=3)
    case.check(out, lse, causal=True)


@pytest.mark.parametrize("seqlens,page_size", [("tensor", 16), ("int", None), (None, None)])
def test_repeated_steps_are_checked_once(seqlens, page_size, monkeypatch):
    # The common decoding step (attention over a cache its keys are already in) is checked and
    # planned at its first call; later calls of the same kind reuse that, reading the tensors
    # they are given: the same bits for the same inputs, the oracle's result for new queries.
    monkeypatch.setattr(kvcache, "_STEPS", kept_calls.KeptCalls())
    case = Case(batch=3, seqlen_q=1, heads=4, heads_k=2, capacity=90, page_size=page_size)
    if seqlens == "int":
        case.lengths[:] = 70
    elif seqlens is None:
        case.lengths[:] = 90
    caches = (case.k_pages, case.v_pages) if page_size else (case.k_dense, case.v_dense)

    def call(q):
        arg = case.lengths.int().to(DEVICE) if seqlens == "tensor" else 70 if seqlens == "int" else None
        return flash_attn_with_kvcache(q, *caches, cache_seqlens=arg, block_table=case.block_table, causal=True,
                                       num_splits=2, return_softmax_lse=True)
    first = call(case.q)
    assert len(kvcache._STEPS) == 1
    monkeypatch.setattr(kvcache, "_same_kind", lambda *args: pytest.fail("a repeated step was checked again"))
    second = call(case.q)
    assert len(kvcache._STEPS) == 1
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    case.check(*second, causal=True)
    case.q = torch.randn_like(case.q)
    case.check(*call(case.q), causal=True)


@pytest.mark.parametrize("layout", ["paged_rotary", "rows_leftpad_alibi"])
def test_repeated_steps_with_new_keys(layout, monkeypatch):
    # Steps that append (and rotate) are remembered too; ALiBi's slopes are read at each call.
    monkeypatch.setattr(kvcache, "_STEPS", kept_calls.KeptCalls())
    if layout == "paged_rotary":
        case, slopes = Case(batch=3, seqlen_q=2, seqlen_new=2, page_size=16, rotary=False), (None, None)
    else:
        case = Case(batch=3, seqlen_q=2, seqlen_new=2, leftpad=True, batch_idx=True)
        slopes = (torch.rand(4, device=DEVICE) * 0.3, torch.rand(3, 4, device=DEVICE) * 0.3)
    first = case.run(causal=True, alibi_slopes=slopes[0])
    assert len(kvcache._STEPS) == 1
    checks = kvcache._same_kind
    monkeypatch.setattr(kvcache, "_same_kind", lambda *args: pytest.fail("a repeated step was checked again"))
    second = case.run(causal=True, alibi_slopes=slopes[0])  # appends the same keys at the same places
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    case.check(*second, causal=True, alibi_slopes=slopes[0])
    if slopes[1] is not None:  # other slopes: another kind ((batch, heads)), checked once more
        monkeypatch.setattr(kvcache, "_same_kind", checks)
        case.check(*case.run(causal=True, alibi_slopes=slopes[1]), causal=True, alibi_slopes=slopes[1])
        new = torch.rand(3, 4, device=DEVICE) * 0.3
        case.check(*case.run(causal=True, alibi_slopes=new), causal=True, alibi_slopes=new)
        assert len(kvcache._STEPS) == 2


def test_repeated_steps_refuse_what_changes_between_calls(monkeypatch):
    monkeypatch.setattr(kvcache, "_STEPS", kept_calls.KeptCalls())
    case = Case(batch=2, capacity=40)
    run = functools.partial(flash_attn_with_kvcache, case.q, case.k_dense, case.v_dense)
    run(cache_seqlens=7)
    for bad in (41, -1):  # an int's value, checked at every call
        with pytest.raises(ValueError, match="cache_seqlens"):
            run(cache_seqlens=bad)
    with pytest.raises(NotImplementedError, match="forward only"):
        flash_attn_with_kvcache(case.q.clone().requires_grad_(), case.k_dense, case.v_dense, cache_seqlens=7)
    with pytest.raises(NotImplementedError, match="forward only"):  # a kept kind, but the cache takes gradients
        flash_attn_with_kvcache(case.q, case.k_dense.clone().requires_grad_(), case.v_dense, cache_seqlens=7)
    if not ON_GPU:  # tables in host memory (the interpreter): their values, at every call
        run(cache_seqlens=torch.tensor([3, 4], dtype=torch.int32))
        with pytest.raises(ValueError, match="cache_seqlens"):
            run(cache_seqlens=torch.tensor([3, 41], dtype=torch.int32))
    # Numbers of other types are checked as at a first call (a bool is not an int).
    with pytest.raises(TypeError, match="num_splits"):
        run(cache_seqlens=7, num_splits=True)
    assert len(kvcache._STEPS) == (1 if ON_GPU else 2)


@pytest.mark.parametrize("version", VERSIONS)
def test_table_columns_past_each_sequence_may_hold_anything(version):
    # Serving engines pad a block table with -1 past each sequence's pages: those columns are
    # never read, so they are not checked either (the output is the same bits); a -1 in a
    # column a sequence's keys reach is refused where the table is in host memory.
    case = Case(batch=3, seqlen_q=2, seqlen_new=1, page_size=16)
    reference = case.run(causal=True, version=version)
    used = torch.arange(case.block_table.shape[1], device=DEVICE) * 16 < (case.lengths + 1).to(DEVICE)[:, None]
    assert not used.all()  # (some sequence ends before its table does)
    case.block_table = case.block_table.masked_fill(~used, -1)
    for a, b in zip(case.run(causal=True, version=version), reference):
        assert torch.equal(a, b)
    if not ON_GPU:
        case.block_table[0, 0] = -1
        with pytest.raises(ValueError, match="block_table entries must index"):
            case.run(causal=True, version=version)


@pytest.mark.parametrize("version", VERSIONS)
def test_paged_cache_with_leftpad(version):
    # cache_leftpad with pages (which flash_attn refuses): each sequence's keys from its start,
    # new keys appended (rotated) through the table, against the oracle.
    case = Case(batch=3, seqlen_q=2, seqlen_new=2, page_size=16, leftpad=True, rotary=False)
    out, lse = case.run(causal=True, version=version)
    case.check(out, lse, causal=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("page_size", [None, 16])
def test_packed_queries_of_varying_counts(version, page_size, monkeypatch):
    # FlashAttention-3's cu_seqlens_q: each sequence's own count of queries (none too), packed,
    # aligned to the end of its keys; against the oracle, the second call of the kind too.
    monkeypatch.setattr(kvcache, "_STEPS", kept_calls.KeptCalls())
    case = Case(batch=3, heads=4, heads_k=2, capacity=90, page_size=page_size)
    counts = [3, 0, 5]
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEVICE)
    caches = (case.k_pages, case.v_pages) if page_size else (case.k_dense, case.v_dense)
    for _ in range(2):
        q = torch.randn(8, 4, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        out, lse = flash_attn_with_kvcache(q, *caches, cache_seqlens=case.lengths.int().to(DEVICE),
                                           block_table=case.block_table, causal=True, num_splits=2,
                                           return_softmax_lse=True, cu_seqlens_q=cu, max_seqlen_q=5, version=version)
        assert out.shape == q.shape and lse.shape == (4, 8)
        for b, n in enumerate(counts):
            if not n:
                continue
            rows, end = slice(int(cu[b]), int(cu[b + 1])), int(case.lengths[b])
            keys = (case.k_dense[b:b + 1, :end], case.v_dense[b:b + 1, :end])
            oracle, oracle_lse = standard_attention(q[None, rows], *keys, causal=True, upcast=True, return_lse=True)
            assert_within_rule(f"sequence {b}", out[None, rows], standard_attention(q[None, rows], *keys, causal=True),
                               oracle, (2.0, 1e-5))
            assert max_err(lse[:, rows], oracle_lse[0]) <= 1e-3
    nothing = flash_attn_with_kvcache(q[:0], *caches, block_table=case.block_table, version=version,
                                      cu_seqlens_q=torch.zeros(4, dtype=torch.int32, device=DEVICE), max_seqlen_q=0)
    assert nothing.shape == (0, 4, HEAD_DIM)
    # Batched, a step of no query token: empty out and lse.
    out, lse = flash_attn_with_kvcache(case.q[:, :0], *caches, block_table=case.block_table, version=version,
                                       cache_seqlens=case.lengths.int().to(DEVICE), return_softmax_lse=True)
    assert out.shape == case.q[:, :0].shape and lse.shape == (case.q.shape[0], case.q.shape[2], 0)
    with pytest.raises(ValueError, match="together"):
        flash_attn_with_kvcache(q, *caches, block_table=case.block_table, cu_seqlens_q=cu)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_packed_queries_rows_after_the_last_sequence(num_splits, version, monkeypatch):
    # A padded buffer of packed queries (rows after cu_seqlens_q[-1], as CUDA-graph batches pad
    # them): those rows come out 0 with logsumexp +inf, as the varlen call gives them, the others
    # as without them; every new tensor poisoned with NaN, so no row is left as allocated.  A
    # max_seqlen_q of 0: every row spare.
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() and x.device.type != "meta" else x
    case = Case(batch=3, heads=4, heads_k=2, capacity=90)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEVICE)
    q = torch.randn(11, 4, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    call = functools.partial(flash_attn_with_kvcache, k_cache=case.k_dense, v_cache=case.v_dense,
                             cache_seqlens=case.lengths.int().to(DEVICE), causal=True, num_splits=num_splits,
                             return_softmax_lse=True, version=version)
    expected = call(q[:8], cu_seqlens_q=cu, max_seqlen_q=5)
    monkeypatch.setattr(torch, "empty", poisoned)
    out, lse = call(q, cu_seqlens_q=cu, max_seqlen_q=5)
    torch.testing.assert_close(out[:8], expected[0], atol=0, rtol=0)
    torch.testing.assert_close(lse[:, :8], expected[1], atol=0, rtol=0)
    assert (out[8:] == 0).all() and (lse[:, 8:] == float("inf")).all()
    out, lse = call(q, cu_seqlens_q=torch.zeros(4, dtype=torch.int32, device=DEVICE), max_seqlen_q=0)
    assert (out == 0).all() and (lse == float("inf")).all()
    if version == "auto":
        # Offsets on a GPU go unread (the host's check switched off to stand for that): rows a
        # sequence's programs write are never cleared, though a later offset is smaller.
        monkeypatch.setattr(kvcache, "_host_counts", lambda *args: None)
        unordered = torch.tensor([0, 6, 6, 3], dtype=torch.int32, device=DEVICE)
        out, lse = call(q, cu_seqlens_q=unordered, max_seqlen_q=6)
        assert torch.isfinite(out[:6]).all() and (out[3:6] != 0).any(-1).all() and torch.isfinite(lse[:, :6]).all()
        assert (out[6:] == 0).all() and (lse[:, 6:] == float("inf")).all()


def test_traced_by_torch_compile(monkeypatch):
    # torch.compile(fullgraph=True) traces a decoding step as one op that writes the caches in
    # place: the same output, logsumexp and caches as eager calls, with cache_seqlens an int
    # (two values) or a table, and FA3's packed form; a wrong argument still refused by name.
    from flashtile import flash_attn_interface as fa3
    monkeypatch.setattr(kvcache, "_STEPS", kept_calls.KeptCalls())
    case = Case(batch=2, seqlen_q=1, seqlen_new=1, capacity=40, rotary=True)
    cos, sin, _ = case.rotary

    def step(q, k_cache, v_cache, k, v, seqlens):  # (ints where the op takes floats: converted)
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, causal=True, softcap=0, softmax_scale=1,
                                       return_softmax_lse=True)

    def packed(q, k_cache, v_cache, k, v, seqlens, cu):
        return fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cu_seqlens_q=cu,
                                           max_seqlen_q=2, cu_seqlens_k_new=cu, causal=True, return_softmax_lse=True)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    calls = [(step, (case.q, case.k_new, case.v_new, n)) for n in (5, 6, torch.tensor([3, 9], dtype=torch.int32,
                                                                                        device=DEVICE))]
    calls.append((packed, (case.q.view(2, 4, HEAD_DIM).repeat(2, 1, 1)[:3], case.k_new.view(2, 2, HEAD_DIM)
                           .repeat(2, 1, 1)[:3], case.v_new.view(2, 2, HEAD_DIM).repeat(2, 1, 1)[:3],
                           torch.tensor([4, 7], dtype=torch.int32, device=DEVICE), cu)))
    for fn, (q, k, v, *rest) in calls:
        eager, traced = ([x.clone() for x in (case.k_dense, case.v_dense)] for _ in range(2))
        expected = fn(q, *eager, k, v, *rest)
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, *traced, k, v, *rest)
        assert all(torch.equal(a, b) for a, b in zip(expected[:2], got[:2]))
        assert all(torch.equal(a, b) for a, b in zip(eager, traced)) and not torch.equal(eager[0], case.k_dense)
    with pytest.raises(ValueError, match="cache_seqlens"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(case.q, case.k_dense.clone(), case.v_dense.clone(),
                                                                 case.k_new, case.v_new, 40)


def cache_slot(case, cache, b, position):
    """Position ``position`` of sequence b in ``cache``, one of case's dense rows or pages."""
    if case.page_size:
        return cache[int(case.block_table[b, position // case.page_size]), position % case.page_size]
    return cache[b, position]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("rotary_from", [None, "cache_seqlens", "rotary_seqlens"])
def test_packed_new_keys_and_queries(rotary_from, page_size, version, monkeypatch):
    # FlashAttention-3's cu_seqlens_k_new with cu_seqlens_q (chunked prefill of a varlen batch):
    # each sequence appends its own count of new keys (packed, a spare row after them) at
    # cache_seqlens and attends with its own count of queries, aligned to the
    # end of its keys; rotary from cache_seqlens or from rotary_seqlens, each sequence's queries
    # and new keys from 0.  Against the oracle, twice (the kept step: fresh keys and queries), the
    # cache written where the new keys go and nowhere else.
    monkeypatch.setattr(kvcache, "_STEPS", kept_calls.KeptCalls())
    case = Case(batch=3, heads=4, heads_k=2, capacity=90, page_size=page_size)
    lengths, new_counts, q_counts = [40, 88, 61], [2, 0, 5], [2, 1, 3]
    as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    cu_new, cu_q = as_int32([0, 2, 2, 7]), as_int32([0, 2, 3, 6])
    g = torch.Generator().manual_seed(5)
    rows = case.capacity + 20
    angle = torch.rand(rows, HEAD_DIM // 4, generator=g) * 6.28
    cos, sin = torch.cos(angle).to(DTYPE).to(DEVICE), torch.sin(angle).to(DTYPE).to(DEVICE)
    bases = [3, 104, 10] if rotary_from == "rotary_seqlens" else lengths
    rot = {} if rotary_from is None else dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
    if rotary_from == "rotary_seqlens":
        rot["rotary_seqlens"] = as_int32(bases)
    caches = (case.k_pages, case.v_pages) if page_size else (case.k_dense, case.v_dense)
    for _ in range(2):
        k_new, v_new = (torch.randn(8, 2, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE) for _ in range(2))
        q = torch.randn(6, 4, HEAD_DIM, generator=g).to(DTYPE).to(DEVICE)
        before = [x.clone() for x in caches]
        out, lse = flash_attn_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=as_int32(lengths), causal=True,
                                           block_table=case.block_table, cu_seqlens_q=cu_q, max_seqlen_q=3,
                                           cu_seqlens_k_new=cu_new, num_splits=2, return_softmax_lse=True,
                                           version=version, **rot)
        written = [torch.zeros(x.shape[:2], dtype=torch.bool, device=DEVICE) for x in caches]
        for b in range(3):
            n, m, end = new_counts[b], q_counts[b], lengths[b]
            keys_new, queries = k_new[None, int(cu_new[b]):int(cu_new[b]) + n], q[None, int(cu_q[b]):int(cu_q[b]) + m]
            if rot:
                keys_new = rotate(keys_new, cos, sin, bases[b] + torch.arange(n)[None], False).to(DTYPE)
                queries = rotate(queries, cos, sin, bases[b] + torch.arange(m)[None], False).to(DTYPE)
            for i in range(n):  # the new key in its slot, its value as given
                got = cache_slot(case, caches[0], b, end + i)
                assert (got.float() - keys_new[0, i].float()).abs().max() <= keys_new.abs().max() * 2.0 ** -7
                assert torch.equal(cache_slot(case, caches[1], b, end + i), v_new[int(cu_new[b]) + i])
                for mark in written:
                    cache_slot(case, mark, b, end + i).fill_(True)
            keys = [torch.cat([x[b:b + 1, :end], new], 1) for x, new in
                    ((case.k_dense, keys_new), (case.v_dense, v_new[None, int(cu_new[b]):int(cu_new[b]) + n]))]
            oracle, oracle_lse = standard_attention(queries, *keys, causal=True, upcast=True, return_lse=True)
            rows_b = slice(int(cu_q[b]), int(cu_q[b]) + m)
            assert_within_rule(f"sequence {b}", out[None, rows_b], standard_attention(queries, *keys, causal=True),
                               oracle, (2.0, 1e-5))
            assert max_err(lse[:, rows_b], oracle_lse[0]) <= 1e-3
        for cache, old, mark in zip(caches, before, written):
            assert torch.equal(cache[~mark], old[~mark])


@pytest.mark.parametrize("version", VERSIONS)
def test_packed_new_keys_refusals(version):
    case = Case(batch=2, heads=4, heads_k=2, capacity=40)
    as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    k_new = torch.randn(5, 2, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    cos = torch.ones(40, HEAD_DIM // 4, dtype=DTYPE, device=DEVICE)
    call = functools.partial(flash_attn_with_kvcache, case.q, case.k_dense, case.v_dense, version=version)
    with pytest.raises(ValueError, match="cu_seqlens_k_new packs new keys: pass k and v"):
        call(cache_seqlens=3, cu_seqlens_k_new=as_int32([0, 2, 5]))
    with pytest.raises(ValueError, match="k must be 3-D"):
        call(k_new[None], k_new[None], cache_seqlens=3, cu_seqlens_k_new=as_int32([0, 2, 5]))
    with pytest.raises(ValueError, match=r"with cu_seqlens_k_new, k and v must be \(total_k_new, nheads_k=2"):
        call(k_new[:, :1], k_new[:, :1], cache_seqlens=3, cu_seqlens_k_new=as_int32([0, 2, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens_k_new must be \(batch \+ 1,\) = \(3,\)"):
        call(k_new, k_new, cache_seqlens=3, cu_seqlens_k_new=as_int32([0, 5]))
    with pytest.raises(ValueError, match="appends at cache_seqlens: pass it"):
        call(k_new, k_new, cu_seqlens_k_new=as_int32([0, 2, 5]))
    with pytest.raises(ValueError, match="rotary_seqlens sets where rotary positions start"):
        call(k_new, k_new, cache_seqlens=3, cu_seqlens_k_new=as_int32([0, 2, 5]), rotary_seqlens=as_int32([0, 0]))
    if ON_GPU:  # (tables on a GPU are not read: the kernels clamp)
        return
    with pytest.raises(ValueError, match="cu_seqlens_k_new must start at 0 and be non-decreasing"):
        call(k_new, k_new, cache_seqlens=3, cu_seqlens_k_new=as_int32([0, 3, 2]))
    with pytest.raises(ValueError, match=r"cache_seqlens \(\+ each sequence's new keys\) must lie in \[0, 40\]"):
        call(k_new, k_new, cache_seqlens=as_int32([30, 38]), cu_seqlens_k_new=as_int32([0, 2, 5]))
    with pytest.raises(ValueError, match=r"rotary_cos/rotary_sin have 40 rows, but the new keys and the queries .* "
                                         r"rotary_seqlens \+ i .* up to 40"):
        call(k_new, k_new, cache_seqlens=as_int32([3, 3]), cu_seqlens_k_new=as_int32([0, 2, 5]), rotary_cos=cos,
             rotary_sin=cos, rotary_seqlens=as_int32([0, 38]))
    # Sums that would wrap in int32 are refused, not wrapped into range.
    for lengths in (2**32, as_int32([2**31 - 1, 4])):
        with pytest.raises(ValueError, match="cache_seqlens"):
            call(k_new, k_new, cache_seqlens=lengths, cu_seqlens_k_new=as_int32([0, 2, 5]))
    for starts, message in (([2**31 - 1, 0], "rotary_cos/rotary_sin have 40 rows"),
                            ([-9, 0], "rotary_seqlens must be >= 0")):
        with pytest.raises(ValueError, match=message):
            call(k_new, k_new, cache_seqlens=as_int32([3, 3]), cu_seqlens_k_new=as_int32([0, 2, 5]), rotary_cos=cos,
                 rotary_sin=cos, rotary_seqlens=as_int32(starts))


def test_pytorch_path_checks_offsets_before_writing(monkeypatch):
    # Offsets on a GPU are not read by the call's checks (their first read stands for that here),
    # but the PyTorch path reads them: it refuses wrong ones before it writes the cache.
    reads = []
    checked = kvcache._host_counts
    monkeypatch.setattr(kvcache, "_host_counts",
                        lambda name, *args: reads.append(name) if name not in reads else checked(name, *args))
    case = Case(batch=2, heads=4, heads_k=2, capacity=40)
    as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    k_new = torch.randn(5, 2, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    cos = torch.ones(40, HEAD_DIM // 4, dtype=DTYPE, device=DEVICE)
    cache = case.k_dense.clone()
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and be non-decreasing"):
        flash_attn_with_kvcache(torch.randn(4, 4, HEAD_DIM, dtype=DTYPE, device=DEVICE), case.k_dense, case.v_dense,
                                k_new, k_new, rotary_cos=cos, rotary_sin=cos, cache_seqlens=as_int32([3, 3]),
                                cu_seqlens_k_new=as_int32([0, 2, 5]), cu_seqlens_q=as_int32([0, 3, 2]), max_seqlen_q=3,
                                version="tiled")
    assert torch.equal(case.k_dense, cache)


def test_rotary_tables_of_different_strides():
    # The kernels read cos and sin with one row stride: tables laid out apart are made alike.
    case = Case(batch=2, seqlen_q=1, seqlen_new=1, rotary=True)
    cos, sin, _ = case.rotary
    wide = torch.zeros(sin.shape[0], 2 * sin.shape[1], dtype=sin.dtype, device=DEVICE)
    wide[:, :sin.shape[1]] = sin
    case.rotary = (cos, wide[:, :sin.shape[1]], True)  # sin's rows twice as far apart
    out, lse = case.run(causal=True)
    case.check(out, lse, causal=True)


def test_every_split_count_agrees():
    case = Case(batch=2, seqlen_q=1, heads=8, heads_k=1, capacity=150)
    # 33: more splits than key blocks (the empty ones weigh nothing) and a padded combine tile.
    outs = [case.run(num_splits=n) for n in (1, 2, 4, 7, 16, 33)]
    for out, lse in outs:
        case.check(out, lse)


@pytest.mark.parametrize("version", VERSIONS)
def test_rows_that_see_no_key(version):
    # An empty cache, and causal rows before the first key: output 0, logsumexp +inf.
    case = Case(batch=2, seqlen_q=4, capacity=40)
    case.lengths[1] = 0
    out, lse = case.run(num_splits=2, version=version)
    assert (out[1] == 0).all() and (lse[1] == float("inf")).all()
    case.check(out, lse)
    case.lengths[:] = 2
    out, lse = case.run(causal=True, num_splits=2, version=version)
    assert (out[:, :2] == 0).all() and (lse[..., :2] == float("inf")).all()
    case.check(out, lse, causal=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_refusals(version):
    # The same errors on both paths, raised before the cache is written.
    case = Case(batch=2, seqlen_q=1, seqlen_new=1, capacity=20)
    q, k, v = case.q, case.k_dense, case.v_dense
    before = k.clone()
    lengths = case.lengths.int().to(DEVICE)
    short = torch.ones(19, 8, dtype=DTYPE, device=DEVICE)
    pages = torch.zeros(8, 16, *k.shape[2:], dtype=DTYPE, device=DEVICE)
    bad = [
        (dict(k=case.k_new), ValueError, "k and v must be given together"),
        (dict(rotary_cos=torch.ones(20, 8, device=DEVICE), rotary_sin=torch.ones(20, 8, device=DEVICE)),
         ValueError, "pass k and v"),
        (dict(cache_seqlens=20, k=case.k_new, v=case.v_new), ValueError, "capacity"),  # an int: no copy
        (dict(cache_seqlens=lengths.long()), TypeError, "cache_seqlens must be torch.int32"),
        (dict(cache_seqlens=lengths, block_table=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
              cache_batch_idx=torch.zeros(2, dtype=torch.int32, device=DEVICE)), NotImplementedError, "block_table"),
        (dict(cache_seqlens=lengths, num_splits=-1), ValueError, "num_splits"),
        (dict(cache_seqlens=lengths, k=torch.zeros(2, 21, *k.shape[2:], dtype=DTYPE, device=DEVICE),
              v=torch.zeros(2, 21, *k.shape[2:], dtype=DTYPE, device=DEVICE)), ValueError, "21 new keys"),
        # Rotary tables shorter than the cache's capacity (flash_attn's seqlen_ro >= seqlen_k), by shape.
        (dict(cache_seqlens=lengths, k=case.k_new, v=case.v_new, rotary_cos=short, rotary_sin=short),
         ValueError, r"rotary_cos/rotary_sin must have at least .* \(20\)"),
        (dict(cache_seqlens=lengths, version="v4"), ValueError, "version must be one of"),
        (dict(cache_seqlens=lengths, k=case.k_new, v=case.v_new, rotary_cos=torch.ones(20, 8, dtype=torch.int32,
              device=DEVICE), rotary_sin=torch.ones(20, 8, device=DEVICE)), TypeError, "rotary_cos must be a real"),
        # Forward only: any tensor that would take a gradient, by name (the PyTorch path's append
        # would otherwise chain the cache into the graph, the kernels drop the gradient).
        (dict(cache_seqlens=lengths, k=case.k_new.clone().requires_grad_(), v=case.v_new), NotImplementedError,
         r"forward only.*\(requiring grad: k\)"),
        (dict(cache_seqlens=lengths, k=case.k_new, v=case.v_new, rotary_cos=torch.ones(20, 8, device=DEVICE,
              requires_grad=True), rotary_sin=torch.ones(20, 8, device=DEVICE)), NotImplementedError,
         r"\(requiring grad: rotary_cos\)"),
    ]
    if not ON_GPU:  # the values of tables on a GPU are not read on the host
        bad += [
            (dict(cache_seqlens=torch.full((2,), 20, dtype=torch.int32), k=case.k_new, v=case.v_new),
             ValueError, "capacity"),
            (dict(cache_seqlens=lengths, cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)),
             ValueError, "cache_batch_idx must index"),
        ]
    for kw, error, message in bad:
        with pytest.raises(error, match=message):
            flash_attn_with_kvcache(q, k, v, **{"version": version, **kw})
    assert torch.equal(k, before)
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        flash_attn_with_kvcache(q, k.float(), v, cache_seqlens=lengths, version=version)
    with pytest.raises(ValueError, match="multiple of nheads"):
        flash_attn_with_kvcache(q[:, :, :3], k, v, cache_seqlens=lengths, version=version)
    with pytest.raises(NotImplementedError, match="forward only"):
        flash_attn_with_kvcache(q.clone().requires_grad_(), k, v, cache_seqlens=lengths, version=version)
    with pytest.raises(NotImplementedError, match=r"\(requiring grad: k_cache, v_cache\)"):
        flash_attn_with_kvcache(q, k.clone().requires_grad_(), v.clone().requires_grad_(), cache_seqlens=lengths,
                                version=version)
    with pytest.raises(NotImplementedError, match=r"V of q's head dim .* of its own \(16\)"):
        flash_attn_with_kvcache(q, k, v[..., :16], cache_seqlens=lengths, version=version)
    with pytest.raises(ValueError, match=r"head dim must be in \[1, 256\], got 0"):
        flash_attn_with_kvcache(q[..., :0], k[..., :0], v[..., :0], cache_seqlens=lengths, softmax_scale=1.0,
                                version=version)
    # Paged: the capacity is max_blocks x page_size (2 x 16), which the tables must cover.
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"rotary_cos/rotary_sin must have at least .* \(32 through block_table\)"):
        flash_attn_with_kvcache(q, pages, pages, case.k_new, case.v_new, rotary_cos=k.new_ones(31, 8),
                                rotary_sin=k.new_ones(31, 8), cache_seqlens=lengths, block_table=table,
                                version=version)
    assert not pages.any()


@pytest.mark.parametrize("version", VERSIONS)
def test_queries_rotated_past_the_rotary_tables_are_refused(version):
    # Three queries over one new key, causal: flash_attn rotates query i at cache_seqlens + i, so
    # with 6 cached keys the third query's position (8) lies past tables of the cache's 8 rows.
    # Where the lengths are on the host (an int, a CPU tensor) that is refused before any work.
    d = HEAD_DIM
    q = torch.randn(1, 3, 1, d, dtype=DTYPE, device=DEVICE)
    k_cache = torch.zeros(1, 8, 1, d, dtype=DTYPE, device=DEVICE)
    k = torch.randn(1, 1, 1, d, dtype=DTYPE, device=DEVICE)
    angle = torch.rand(8, d // 2, device=DEVICE)
    cos, sin = angle.cos().to(DTYPE), angle.sin().to(DTYPE)
    lengths = [6] + ([] if ON_GPU else [torch.tensor([6], dtype=torch.int32)])
    for cache_seqlens in lengths:
        with pytest.raises(ValueError, match=r"rotary_cos/rotary_sin have 8 rows, .* up to 8"):
            flash_attn_with_kvcache(q, k_cache, k_cache, k, k, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=cache_seqlens, causal=True, version=version)
        assert not k_cache.any()
    # Not causal, the queries all sit at cache_seqlens (flash_attn's): 7 fits the tables.
    out = flash_attn_with_kvcache(q, k_cache, k_cache, k, k, rotary_cos=cos, rotary_sin=sin, cache_seqlens=6,
                                  version=version)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("version", VERSIONS)
def test_unread_tables_index_inside_the_cache_and_the_rotary_tables(version, monkeypatch):
    # Tables on a GPU are not read on the host (CPU ones are, so the check is switched off here to
    # stand for them): whatever their values, the append, the rotary tables and the attention stay
    # inside the cache and the tables, on both paths.
    monkeypatch.setattr(kvcache, "_check_values", lambda *args: None)
    for page_size in (None, 16):
        case = Case(batch=2, seqlen_q=3, seqlen_new=1, capacity=40, page_size=page_size, batch_idx=not page_size,
                    rotary=True)
        caches = (case.k_pages, case.v_pages) if page_size else (case.k_dense, case.v_dense)
        tables = dict(block_table=case.block_table.clone()) if page_size else \
            dict(cache_batch_idx=torch.tensor([-3, 10**6], dtype=torch.int32, device=DEVICE))
        if page_size:
            tables["block_table"][0, 0], tables["block_table"][1, -1] = 10**6, -5
        for lengths in ([10**6, -7], [case.capacity - 1, 0]):  # past the cache; the last slot, 3 queries
            out, lse = flash_attn_with_kvcache(
                case.q, *caches, case.k_new, case.v_new, rotary_cos=case.rotary[0], rotary_sin=case.rotary[1],
                cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE), causal=True,
                return_softmax_lse=True, version=version, **tables)
            assert torch.isfinite(out).all() and not lse.isnan().any()


def test_unread_packed_offsets_index_inside_the_tensors(monkeypatch):
    # Packed offsets and rotary_seqlens on a GPU are not read on the host either (CPU ones are:
    # the checks are switched off to stand for them): whatever their values, the kernels' append,
    # rotation and attention run inside the tensors, and the sequences' rows of valid offsets
    # after them come out as the oracle's (the cache written again by the valid call).
    monkeypatch.setattr(kvcache, "_check_values", lambda *args: None)
    monkeypatch.setattr(kvcache, "_host_counts", lambda *args: None)
    as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    for page_size in (None, 16):
        case = Case(batch=3, heads=4, heads_k=2, capacity=40, page_size=page_size)
        caches = (case.k_pages, case.v_pages) if page_size else (case.k_dense, case.v_dense)
        k_new, v_new = (torch.randn(5, 2, HEAD_DIM, dtype=DTYPE, device=DEVICE) for _ in range(2))
        q = torch.randn(4, 4, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        angle = torch.rand(case.capacity, HEAD_DIM // 4, device=DEVICE)
        cos, sin = torch.cos(angle).to(DTYPE), torch.sin(angle).to(DTYPE)
        for cu_new, cu_q, starts, lengths in (([0, 9, -4, 10**6], [0, -2, 10**6, 3], [10**6, -5, 39], [10**6, -7, 39]),
                                              ([0, 2, 2, 5], [0, 1, 3, 4], [0, 5, 9], [3, 20, 30])):
            out, lse = flash_attn_with_kvcache(q, *caches, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                               cache_seqlens=as_int32(lengths), block_table=case.block_table,
                                               cu_seqlens_q=as_int32(cu_q), max_seqlen_q=4,
                                               cu_seqlens_k_new=as_int32(cu_new), rotary_seqlens=as_int32(starts),
                                               causal=True, return_softmax_lse=True)
            assert all(torch.isfinite(x).all() for x in caches)
        for b, (first, n, m) in enumerate(((0, 2, 1), (2, 0, 2), (2, 3, 1))):
            keys_new = rotate(k_new[None, first:first + n], cos, sin, starts[b] + torch.arange(n)[None], True)
            rows = slice(cu_q[b], cu_q[b + 1])
            queries = rotate(q[None, rows], cos, sin, starts[b] + torch.arange(m)[None], True).to(DTYPE)
            # (the old keys as the cache holds them now: the first call may have written anywhere)
            keys = [torch.cat([torch.stack([cache_slot(case, x, b, t) for t in range(lengths[b])])[None],
                               new.to(DTYPE)], 1) for x, new in ((caches[0], keys_new),
                                                                 (caches[1], v_new[None, first:first + n]))]
            oracle = standard_attention(queries, *keys, causal=True, upcast=True)
            assert_within_rule(f"sequence {b}", out[None, rows], standard_attention(queries, *keys, causal=True),
                               oracle, (2.0, 1e-5))


@pytest.mark.skipif(ON_GPU, reason="CPU tensors without the interpreter")
def test_cpu_default_is_the_pytorch_path(monkeypatch):
    # Outside the interpreter, CPU tensors take the PyTorch path under version="auto" (no Triton
    # kernel can launch there), with every feature; a kernel version is refused before the cache
    # is written.
    monkeypatch.setattr(options, "interpreting", lambda: False)

    def no_kernel(*args, **kwargs):
        raise RuntimeError("0 active drivers: no Triton kernel runs on CPU tensors outside the interpreter")
    monkeypatch.setattr(decode, "Attend", no_kernel)
    case = Case(batch=2, seqlen_q=3, seqlen_new=3, page_size=7, rotary=True)
    slopes = torch.rand(4) * 0.3
    mask = dict(causal=True, window_size=(30, 0), softcap=5.0, alibi_slopes=slopes)
    out, lse = case.run(num_splits=3, **mask)
    case.check(out, lse, **mask)
    case = Case(batch=3, seqlen_q=2, seqlen_new=2, leftpad=True, batch_idx=True)
    out, lse = case.run()
    case.check(out, lse)
    before = case.k_dense.clone()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        case.run(version="v2")
    assert torch.equal(case.k_dense, before)


def test_cpu_default_in_a_process_without_the_interpreter():
    # The same outside the test session's interpreter: a fresh process, TRITON_INTERPRET=0.
    script = (
        "import torch\n"
        "from flashtile import flash_attn_with_kvcache, standard_attention\n"
        "q = torch.randn(1, 1, 2, 32, dtype=torch.float16)\n"
        "kc = torch.randn(1, 16, 2, 32, dtype=torch.float16); vc = torch.randn_like(kc)\n"
        "out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=8)\n"
        "ref = standard_attention(q, kc[:, :8], vc[:, :8], upcast=True)\n"
        "assert (out.double() - ref).abs().max() < 1e-2, (out, ref)\n")
    res = run_outside_the_interpreter("-c", script)
    assert res.returncode == 0, res.stderr[-2000:]


def test_out_of_range_tables_stay_in_the_cache():
    # Tables on a GPU go unread on the host: the kernel clamps ends, pages and rows to the cache.
    case = Case(batch=2, seqlen_q=1, heads=4, heads_k=2, capacity=40, page_size=16)
    features = types.SimpleNamespace(softcap=0.0, alibi_slopes=None)
    plan = dispatch.decode_plan(case.q, 2, 48, 2)
    lengths = torch.tensor([1000, 7], dtype=torch.int32, device=DEVICE)
    table = case.block_table.clone()
    table[0, 0], table[1, -1] = 10**6, -5
    out, lse = attend(plan, case.q, case.k_pages, case.v_pages, lengths, 0, None, None, table,
                      case.q.shape[-1] ** -0.5, (-1, -1), features)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    contiguous = torch.tensor([1000, 7], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([-3, 10**6], dtype=torch.int32, device=DEVICE)
    out, lse = attend(plan, case.q, case.k_dense, case.v_dense, contiguous, 0, None, rows, None,
                      case.q.shape[-1] ** -0.5, (-1, -1), features)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # A negative leftpad starts the sequence at its row's first key, not in the row before.
    lengths = torch.tensor([40, 30], dtype=torch.int32, device=DEVICE)
    runs = [attend(plan, case.q, case.k_dense, case.v_dense, lengths, 0,
                   torch.tensor(pad, dtype=torch.int32, device=DEVICE), None, None, case.q.shape[-1] ** -0.5,
                   (-1, -1), features) for pad in ([-16, -1], [0, 0])]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged16", "paged7"])
def test_append_kernel_matches_the_pytorch_append(layout):
    # decode.Append (one launch) writes what kvcache._append (PyTorch operations, the reference)
    # writes, byte for byte: positions from an int or a device table, clamped to the capacity;
    # rows and pages from out-of-range tables clamped to the cache; a strided new k.
    torch.manual_seed(9)
    batch, heads_k, new = 3, 2, 37
    page = {"paged16": 16, "paged7": 7}.get(layout)
    capacity = 112
    if page:
        pages = batch * capacity // page + 2
        cache = torch.randn(pages, page, heads_k, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        block_table = torch.randperm(pages, device=DEVICE)[:batch * (capacity // page)].view(batch, -1).int()
        block_table[0, 0], block_table[2, -1] = 10**6, -4  # clamped to the cache
        capacity = block_table.shape[1] * page
    else:
        cache = torch.randn(batch + 1, capacity, heads_k, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        block_table = None
    batch_idx = torch.tensor([10**6, -2, 1], dtype=torch.int32, device=DEVICE) if layout == "batch_idx" else None
    k = torch.randn(batch, new, 2 * heads_k, HEAD_DIM, dtype=DTYPE, device=DEVICE)[:, :, ::2]  # strided heads
    v = torch.randn(batch, new, heads_k, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    for seqlens in (5, torch.tensor([0, capacity - new, capacity - 3], dtype=torch.int32, device=DEVICE),
                    torch.tensor([-9, 10**6, 40], dtype=torch.int32, device=DEVICE)):
        got_k, got_v, ref_k, ref_v = (cache.clone() for _ in range(4))
        decode.Append(got_k, got_v, k, v, isinstance(seqlens, torch.Tensor), batch_idx is not None, block_table, None,
                      False)(got_k, got_v, k, v, seqlens, batch_idx, block_table, None, None)
        positions = kvcache._positions(seqlens, new, batch, DEVICE, capacity)
        kvcache._append(ref_k, ref_v, k, v, positions, batch_idx, block_table)
        # Positions clamped to the first or last slot, and rows or pages clamped to the cache, put
        # several keys in one slot, which either writes in its own order: every other slot agrees.
        outer, inner = kvcache._cache_slots(ref_k, positions, batch_idx, block_table)
        slots, counts = torch.unique(outer * cache.shape[1] + inner, return_counts=True)
        keep = torch.ones(cache.shape[:2], dtype=torch.bool, device=DEVICE)
        shared = slots[counts > 1]
        keep[shared // cache.shape[1], shared % cache.shape[1]] = False
        assert torch.equal(got_k[keep], ref_k[keep]) and torch.equal(got_v[keep], ref_v[keep])
        assert shared.numel() < slots.numel() // 2  # (out-of-range tables and positions share a few)
        assert not torch.equal(got_k, cache)  # something was written


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("advance", [True, False])
def test_rotate_kernel_matches_rotary_apply(interleaved, advance):
    # decode.Rotate (one launch) against rotary.apply at kvcache._positions' positions: the
    # channels past rotary_dim untouched, the rotated ones within a float32 rounding of it (the
    # kernel may fuse a multiply-add) before the cast; positions from a table clamped to the limit.
    from flashtile import rotary
    torch.manual_seed(11)
    batch, seqlen, heads, limit = 3, 21, 4, 50
    x = torch.randn(batch, seqlen, heads, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    angle = torch.rand(limit, HEAD_DIM // 4, device=DEVICE) * 6
    cos, sin = torch.cos(angle).to(DTYPE), torch.sin(angle).to(DTYPE)  # rotary_dim: half the head dim
    for seqlens in (7, torch.tensor([0, 45, -3], dtype=torch.int32, device=DEVICE)):
        rotate = decode.Rotate(x, cos, isinstance(seqlens, torch.Tensor), advance, limit, interleaved)
        got = rotate(x, cos, sin, seqlens)
        positions = kvcache._positions(seqlens, seqlen if advance else 1, batch, DEVICE, limit)
        ref = rotary.apply(x, cos, sin, positions.expand(batch, seqlen), interleaved)
        half = HEAD_DIM // 2
        assert torch.equal(got[..., half:], x[..., half:])
        assert (got[..., :half].float() - ref[..., :half].float()).abs().max() <= 2 * ref.abs().max() * 2.0 ** -10
        assert not torch.equal(got[..., :half], x[..., :half])
