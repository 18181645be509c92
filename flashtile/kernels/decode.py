"""A few new query tokens against a KV cache (decoding, chunked prefill): split-KV attention.

One program per (row block, batch x KV head, split).  A block's rows are the query tokens times
the query heads that share the KV head (GQA packed: the cache of a KV head is read once for all
of them).  The keys a row block sees (its band of the sequence's valid keys) are divided among
``splits`` programs; each writes its rows' normalised partial output and logsumexp, and
``_combine_kernel`` merges them by their logsumexp (FlashDecoding).  With one split the
programs write the output directly.

The cache is contiguous, (batch_cache, seqlen_cache, heads_k, head_dim) read at row
``cache_batch_idx[b]``, or paged, (pages, page_size, heads_k, head_dim) with key j of sequence
b in page ``block_table[b, j // page_size]``.  Sequence b's keys are [leftpad_b, end_b) of its
cache row; positions (masks, ALiBi) count from leftpad_b, and causal is aligned bottom-right to
end_b.  Scores go through the score hook (score.py), with each row's own query head.

New keys and values go into the cache first, by ``append``: one launch that computes each new
key's position, row or page, rotates it (rotary embedding) and writes it, where the same in
PyTorch operations (the reference: kvcache._append, rotary.apply) takes many small launches,
each paid on the host at every decoding step; ``rotate`` rotates the queries in one more.
"""
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels import score
from flashtile.kernels.blocks import band_mask, diagonal_band, visited_blocks
from flashtile.kernels.launch import Prepared
from flashtile.kernels.problem import cdiv, contiguous_strides, next_power_of_2, padded_head_dim
from flashtile.kernels.tiles import LOG2E, finalize_rows, load_tile, online_softmax_step, values_product


@triton.jit
def _cache_index(batch_row, keys, in_seq, page_size, BLOCK_TABLE, sbt, batch, outer_count, PAGED: tl.constexpr,
                 MASKED: tl.constexpr):
    """(outer, inner) indices of absolute key indices ``keys`` in the cache: (page, slot) or
    (batch row, key), ``page_size`` a constant (each page size compiles kernels of its own: a
    division by a constant is a multiply, by a run-time value a long sequence); with MASKED,
    keys past the sequence (not ``in_seq``) go to (0, 0) and are masked by the caller.  Outer
    indices are clamped to the cache's ``outer_count`` pages or rows: a table entry out of range
    (the tables' values are not read on the host) reads the wrong keys, never outside the
    cache."""
    if MASKED:
        keys = tl.where(in_seq, keys, 0)
    if PAGED:
        if MASKED:
            outer = tl.load(BLOCK_TABLE + batch * sbt + keys // page_size, mask=in_seq, other=0)
        else:
            outer = tl.load(BLOCK_TABLE + batch * sbt + keys // page_size)
        inner = keys % page_size
    else:
        outer = batch_row + tl.zeros_like(keys)
        if MASKED:
            outer = tl.where(in_seq, outer, 0)
        inner = keys
    # (clamped as 32-bit indices, widened only for the products with the strides)
    return tl.minimum(tl.maximum(outer, 0), outer_count - 1).to(tl.int64), inner.to(tl.int64)


@triton.jit
def _attend(acc, m_i, l_i, q, lo, hi, K, V, BLOCK_TABLE, skb, sks, skh, svb, svs, svh, sbt, batch, batch_row, head_k,
            start, token, seqlen_k, dlo, dhi, page_size, outer_count, scale_log2, site,
            HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
            UPCAST: tl.constexpr, SCORE: tl.constexpr, MASKED: tl.constexpr, SAME_STRIDES: tl.constexpr):
    """The online softmax over key blocks [lo, hi) (hi a multiple of BLOCK_N unless MASKED).
    Blocks entirely inside the band and the sequence are not MASKED: no element mask, no
    bounds on the loads, the plain P @ V."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        in_seq = cols < seqlen_k
        outer, inner = _cache_index(batch_row, start + cols, in_seq, page_size, BLOCK_TABLE, sbt, batch, outer_count,
                                    PAGED, MASKED)
        k_rows = head_k * skh + outer * skb + inner * sks
        k_ptrs = (K + k_rows)[:, None] + offs_d[None, :]
        if SAME_STRIDES:  # (one row offset for both caches: the paged one costs a 64-bit product a key)
            v_ptrs = (V + k_rows)[:, None] + offs_d[None, :]
        else:
            v_ptrs = (V + head_k * svh + outer * svb + inner * svs)[:, None] + offs_d[None, :]
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, HEAD_DIM_PAD, MASKED, UPCAST)
        s = score.scaled_logits(tl.dot(q, tl.trans(k)), scale_log2, token[:, None], cols[None, :], site, SCORE)
        if MASKED:
            s = tl.where(band_mask(token, cols, seqlen_k, dlo, dhi), s, float("-inf"))
        p, alpha, m_i = online_softmax_step(s, m_i, 1.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, HEAD_DIM_PAD, MASKED, UPCAST)
        acc = acc * alpha[:, None] + values_product(p, v, V.dtype.element_ty, UPCAST, MASKED)
    return acc, m_i, l_i


@triton.jit
def _clear_spare_rows(O, LSE, CU_Q, batch_count, total_q, part, head0, heads_here, sos, soh, slh,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROWS: tl.constexpr):
    """Packed rows after every sequence's queries (past the largest offset of CU_Q (batch_count
    + 1,), clamped to [0, ``total_q``]) of heads head0 .. head0 + heads_here - 1: output 0 and
    logsumexp +inf, as the varlen call gives a padded buffer's rows (torch.empty would leave what
    it held).  The rows are shared out among batch_count programs, this one taking share
    ``part``.  (The largest offset, not the last: rows no sequence's programs write whatever the
    offsets, which on a GPU are not read on the host.)"""
    offs = tl.arange(0, ROWS)
    first = tl.full([], 0, tl.int32)
    for b0 in range(0, batch_count + 1, ROWS):
        first = tl.maximum(first, tl.max(tl.load(CU_Q + b0 + offs, mask=b0 + offs <= batch_count, other=0), 0))
    first = tl.minimum(first, total_q)
    share = tl.cdiv(total_q - first, batch_count)
    lo = first + part * share
    count = (tl.minimum(lo + share, total_q) - lo) * heads_here
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    for i0 in range(0, count, ROWS):
        i = i0 + offs
        live = i < count
        row = (lo + i // heads_here).to(tl.int64)
        head = head0 + i % heads_here
        tl.store(O + (row * sos + head * soh)[:, None] + offs_d[None, :],
                 tl.zeros([ROWS, HEAD_DIM_PAD], O.dtype.element_ty), mask=live[:, None] & (offs_d[None, :] < HEAD_DIM))
        tl.store(LSE + head * slh + row, tl.full([ROWS], float("inf"), tl.float32), mask=live)


@triton.jit
def _split_kernel(Q, K, V, O, LSE, ENDS, LEFTPAD, BATCH_IDX, BLOCK_TABLE, CU_Q, new_keys, score_args,
                  sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, sop, slb, slh, slp, sbt,
                  seqlen_q, heads_k, group, capacity, outer_count, scale_log2, window_left,
                  window_right,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGED: tl.constexpr, HAS_ENDS: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                  HAS_BATCH_IDX: tl.constexpr, UPCAST: tl.constexpr, SCORE: tl.constexpr, PDL: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, VARLEN_Q: tl.constexpr, SAME_STRIDES: tl.constexpr):
    """Rows [m0, m0 + BLOCK_M) of (query token, query head of the group) for one KV head, over
    this split's share of the keys.  O and LSE: the output and logsumexp, or with several splits
    (the grid's third dimension) the per-split partials (split stride sop, slp).  Sequence b
    ends at ENDS[b] + new_keys (HAS_ENDS), else at new_keys, clamped to the cache's capacity.
    VARLEN_Q: sequence b's queries are rows CU_Q[b] .. CU_Q[b + 1] of packed q, O and LSE
    (offsets clamped to [0, ``seqlen_q``], the packed rows: a wrong entry reads the wrong rows,
    never outside), its own count of them aligned to its end."""
    m0 = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // heads_k
    head_k = tl.program_id(1) % heads_k
    split = tl.program_id(2)
    q_first = 0  # the sequence's first row in packed q, O, LSE
    total_rows = seqlen_q
    if VARLEN_Q:
        q_first = tl.minimum(tl.maximum(tl.load(CU_Q + batch), 0), seqlen_q)
        seqlen_q = tl.minimum(tl.maximum(tl.load(CU_Q + batch + 1), q_first), seqlen_q) - q_first
    rows = m0 + tl.arange(0, BLOCK_M)
    token = rows // group
    head = head_k * group + rows % group
    in_rows = token < seqlen_q
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    in_dim = offs_d < HEAD_DIM
    # The sequence's keys: [start, end) of its cache row.
    end = new_keys
    if HAS_ENDS:
        end += tl.load(ENDS + batch)
    end = tl.minimum(end, capacity)
    start = 0
    if HAS_LEFTPAD:
        start = tl.minimum(tl.maximum(tl.load(LEFTPAD + batch), 0), end)
    seqlen_k = end - start
    batch_row = batch
    if HAS_BATCH_IDX:
        batch_row = tl.load(BATCH_IDX + batch)
    q = tl.load(Q + batch.to(tl.int64) * sqb + (q_first + token[:, None]).to(tl.int64) * sqs + head[:, None] * sqh
                + offs_d[None, :], mask=in_rows[:, None] & in_dim[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    dlo, dhi = diagonal_band(seqlen_q, seqlen_k, window_left, window_right)
    first = m0 // group
    last = tl.minimum((m0 + BLOCK_M - 1) // group, seqlen_q - 1)
    lo, full_lo, full_hi, hi = visited_blocks(first, last - first + 1, BLOCK_N, seqlen_k, dlo, dhi)
    if VARLEN_Q:  # a row block past this sequence's queries visits nothing
        hi = tl.where(first < seqlen_q, hi, lo)
    # This split's share: whole blocks of the band, in order; its blocks inside the band and the
    # sequence go unmasked.
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), tl.num_programs(2)) * BLOCK_N
    split_lo = lo + split * per_split
    split_hi = tl.minimum(hi, split_lo + per_split)
    full_lo = tl.minimum(tl.maximum(full_lo, split_lo), split_hi)
    full_hi = tl.maximum(tl.minimum(full_hi, split_hi), full_lo)
    site = (batch, head[:, None], seqlen_k - seqlen_q, score_args)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for part in tl.static_range(3):
        if part == 1:
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, full_lo, full_hi, K, V, BLOCK_TABLE, skb, sks, skh, svb, svs,
                                    svh, sbt, batch, batch_row, head_k, start, token, seqlen_k, dlo, dhi, PAGE_SIZE,
                                    outer_count, scale_log2, site, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGED, UPCAST,
                                    SCORE, False, SAME_STRIDES)
        else:
            part_lo = split_lo if part == 0 else full_hi
            part_hi = full_lo if part == 0 else split_hi
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, part_lo, part_hi, K, V, BLOCK_TABLE, skb, sks, skh, svb, svs,
                                    svh, sbt, batch, batch_row, head_k, start, token, seqlen_k, dlo, dhi, PAGE_SIZE,
                                    outer_count, scale_log2, site, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGED, UPCAST,
                                    SCORE, True, SAME_STRIDES)
    if PDL:  # the combine may start launching: it waits for this grid before reading
        gdc_launch_dependents()
    out, lse = finalize_rows(acc, m_i, l_i)
    row = (q_first + token).to(tl.int64)
    o_rows = O + split.to(tl.int64) * sop + batch.to(tl.int64) * sob + row * sos + head * soh
    tl.store(o_rows[:, None] + offs_d[None, :], out.to(O.dtype.element_ty), mask=in_rows[:, None] & in_dim[None, :])
    tl.store(LSE + split.to(tl.int64) * slp + batch.to(tl.int64) * slb + head * slh + row, lse, mask=in_rows)
    if VARLEN_Q:  # (with one split, the output's: each sequence's first row block clears a share of the spare rows)
        if (tl.num_programs(2) == 1) & (m0 == 0):
            _clear_spare_rows(O, LSE, CU_Q, tl.num_programs(1) // heads_k, total_rows, batch, head_k * group, group,
                              sos, soh, slh, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M)


@triton.jit
def _combine_kernel(PART_O, PART_LSE, O, LSE, CU_Q, heads, splits, total_q,
                    sop, sob, sos, soh, slp, slb, slh, tob, tos, toh, tlb, tlh,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    PDL: tl.constexpr, VARLEN_Q: tl.constexpr):
    """The splits' partial outputs of one row (token, batch x head), weighted by
    exp(lse_split - lse).  Every split's logsumexp in one load and every partial output in a
    second (a (splits, head_dim) tile): two round trips, where a loop over the splits would
    wait for each.  A split that saw no key (lse +inf, output 0) weighs nothing; a row that saw
    none at all gives 0 and lse +inf.  PDL: launched as the split kernel's programmatic
    dependent (its launch overlaps the split kernel's end), so it first waits for that grid."""
    if PDL:
        gdc_wait()
    token = tl.program_id(0)
    batch = (tl.program_id(1) // heads).to(tl.int64)
    head = tl.program_id(1) % heads
    valid = token >= 0
    if VARLEN_Q:  # the split kernel's packed rows; a row past its sequence is left alone
        q_first = tl.minimum(tl.maximum(tl.load(CU_Q + batch), 0), total_q)
        valid = token < tl.minimum(tl.maximum(tl.load(CU_Q + batch + 1), q_first), total_q) - q_first
        token += q_first
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    in_splits = (offs_s < splits) & valid
    lse = tl.load(PART_LSE + offs_s.to(tl.int64) * slp + batch * slb + head * slh + token, mask=in_splits,
                  other=float("inf"))
    top = tl.max(tl.where(lse == float("inf"), float("-inf"), lse), 0)
    ref = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(lse == float("inf"), 0.0, tl.math.exp2((lse - ref) * LOG2E))
    total = tl.sum(weight, 0)
    parts = tl.load(PART_O + offs_s[:, None].to(tl.int64) * sop + batch * sob + token.to(tl.int64) * sos + head * soh
                    + offs_d[None, :], mask=in_splits[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    empty = total == 0.0
    out = tl.sum(weight[:, None] * parts, 0) / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("inf"), ref + tl.log(tl.where(empty, 1.0, total)))
    tl.store(O + batch * tob + token.to(tl.int64) * tos + head * toh + offs_d, out.to(O.dtype.element_ty),
             mask=(offs_d < HEAD_DIM) & valid)
    tl.store(LSE + batch * tlb + head * tlh + token, lse, mask=valid)
    if VARLEN_Q:  # (each sequence's first row of each head clears a share of the spare rows)
        if tl.program_id(0) == 0:
            _clear_spare_rows(O, LSE, CU_Q, tl.num_programs(1) // heads, total_q, batch, head, 1, tos, toh, tlh,
                              HEAD_DIM, HEAD_DIM_PAD, 16)


COMBINE_WARPS = 4


@triton.jit
def _load_rotated(rows_ptr, offs_d, in_rows, positions, COS, SIN, scs, half, HEAD_DIM: tl.constexpr,
                  ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The rows at ``rows_ptr`` ((rows, 1) pointers to each row's first element; ``in_rows`` those
    that exist), with ROTARY their first 2 * half channels rotated at ``positions`` of the
    (seqlen_ro, half) tables COS and SIN (row stride ``scs``), in pairs (2j, 2j + 1) when
    INTERLEAVED, else (j, j + half); in float32, returned in the rows' type (rotary.apply's)."""
    mask = in_rows[:, None] & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(rows_ptr + offs_d[None, :], mask=mask, other=0.0)
    if ROTARY:
        rotating = offs_d < 2 * half
        if INTERLEAVED:
            partner, j, sign = offs_d ^ 1, offs_d // 2, tl.where(offs_d % 2 == 0, -1.0, 1.0)
        else:
            first = offs_d < half
            partner = tl.where(first, offs_d + half, offs_d - half)
            j, sign = tl.where(first, offs_d, offs_d - half), tl.where(first, -1.0, 1.0)
        table = in_rows[:, None] & rotating[None, :]
        other = tl.load(rows_ptr + partner[None, :], mask=table, other=0.0).to(tl.float32)
        at = positions[:, None].to(tl.int64) * scs + j[None, :]
        cos = tl.load(COS + at, mask=table, other=1.0).to(tl.float32)
        sin = tl.load(SIN + at, mask=table, other=0.0).to(tl.float32)
        rotated = x.to(tl.float32) * cos + sign[None, :] * (other * sin)
        x = tl.where(rotating[None, :], rotated, x.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _packed_rows(CU, rows, batch_count, total, search_steps):
    """(sequence, index in it, whether it belongs to it) of each of ``rows``, rows of a tensor
    packed by the offsets CU (batch_count + 1,): a binary search for the last sequence starting at
    or before the row (``search_steps`` >= log2(batch_count), a run-time count: a new batch
    size compiles nothing).  The offsets are clamped to [0,
    ``total``]: wrong ones (not read on the host) give wrong sequences, never a row outside."""
    lo = tl.zeros_like(rows)
    hi = lo + batch_count
    for _ in range(search_steps):
        open_ = hi - lo > 1
        mid = (lo + hi) // 2
        right = open_ & (tl.load(CU + mid, mask=open_, other=0) <= rows)
        lo = tl.where(right, mid, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    first = tl.minimum(tl.maximum(tl.load(CU + lo), 0), total)
    last = tl.minimum(tl.maximum(tl.load(CU + lo + 1), first), total)
    return lo, rows - first, (rows >= first) & (rows < last)


def search_steps(batch: int) -> int:
    """_packed_rows' ``search_steps`` for ``batch`` sequences."""
    return max(1, (batch - 1).bit_length())


@triton.jit
def _append_kernel(K_NEW, V_NEW, K, V, ENDS, BATCH_IDX, BLOCK_TABLE, COS, SIN, CU_NEW, ROTARY_STARTS, start, snb, sns,
                   snh, swb, sws, swh, skb, sks, skh, svb, svs, svh, sbt, scs, seqlen_new, capacity, outer_count, half,
                   batch_count, search_steps, rotary_rows,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROWS: tl.constexpr, PAGED: tl.constexpr,
                   HAS_ENDS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, ROTARY: tl.constexpr,
                   INTERLEAVED: tl.constexpr, PAGE_SIZE: tl.constexpr, PACKED: tl.constexpr,
                   HAS_ROTARY_STARTS: tl.constexpr):
    """ROWS new keys and values of one (sequence, KV head), K_NEW and V_NEW (batch, seqlen_new,
    heads_k, head_dim), written into the caches at positions start + i of the sequence (start:
    ENDS[batch], or the ``start`` given), clamped to [0, capacity) as kvcache._positions clamps
    them; its cache row or pages through _cache_index (clamped to the cache).  PACKED: ROWS rows
    of K_NEW and V_NEW (seqlen_new, heads_k, head_dim), sequence b's the rows CU_NEW[b] ..
    CU_NEW[b + 1] (_packed_rows).  ROTARY: the keys rotated first, at their positions in the
    cache, or with HAS_ROTARY_STARTS at ROTARY_STARTS[b] + i, clamped to [0, rotary_rows)
    (_load_rotated)."""
    head = tl.program_id(2)
    if PACKED:
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        batch, i, in_seq = _packed_rows(CU_NEW, rows, batch_count, seqlen_new, search_steps)
        new_rows = rows.to(tl.int64)
    else:
        i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        batch = tl.program_id(1)
        in_seq = i < seqlen_new
        new_rows = i.to(tl.int64)
    if HAS_ENDS:
        start = tl.load(ENDS + batch)
    keys = tl.minimum(tl.maximum(start + i, 0), capacity - 1)
    batch_row = batch
    if HAS_BATCH_IDX:
        batch_row = tl.load(BATCH_IDX + batch)
    outer, inner = _cache_index(batch_row, keys, in_seq, PAGE_SIZE, BLOCK_TABLE, sbt, batch, outer_count, PAGED,
                                True)
    positions = keys
    if HAS_ROTARY_STARTS:
        positions = tl.minimum(tl.maximum(tl.load(ROTARY_STARTS + batch) + i, 0), rotary_rows - 1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = in_seq[:, None] & (offs_d[None, :] < HEAD_DIM)
    # (each row's offset a vector first: ``batch`` is one sequence, or PACKED one a row)
    k_rows = batch.to(tl.int64) * snb + new_rows * sns + head * snh
    k = _load_rotated(K_NEW + k_rows[:, None], offs_d, in_seq, positions, COS, SIN, scs, half, HEAD_DIM, ROTARY,
                      INTERLEAVED)
    tl.store(K + outer[:, None] * skb + inner[:, None] * sks + head * skh + offs_d[None, :], k, mask=mask)
    v_rows = batch.to(tl.int64) * swb + new_rows * sws + head * swh
    v = tl.load(V_NEW + v_rows[:, None] + offs_d[None, :], mask=mask)
    tl.store(V + outer[:, None] * svb + inner[:, None] * svs + head * svh + offs_d[None, :], v, mask=mask)


class Append:
    """New keys and values written into the caches in place, one launch, prepared for one kind of
    call: ``append(k_cache, v_cache, k, v, seqlens, batch_idx, block_table, cos, sin, cu_new,
    rotary_starts)`` writes k, v (batch, seqlen_new, heads_k, head_dim), unit stride along
    head_dim, at positions seqlens + [0, seqlen_new) of each sequence's cache row (``batch_idx``)
    or pages (``block_table``), rotating the keys there first with the rotary tables ``cos``,
    ``sin`` (or None), or at rotary_starts + [0, seqlen_new) where that (batch,) int32 table is
    given.  ``seqlens``: an int (checked by the caller), or (batch,) int32 on the device, whose
    positions are clamped to the capacity.  With ``packed`` (the batch), k and v are packed
    (total, heads_k, head_dim), sequence b's rows cu_new[b] .. cu_new[b + 1].

    The kind: the shapes, strides and dtypes of the caches, k, v, ``block_table`` and ``cos``
    (None without rotary); ``has_ends`` (seqlens a tensor), ``has_batch_idx``, ``interleaved``,
    ``packed``, ``rotary_starts`` (whether that table is given)."""

    def __init__(self, k_cache, v_cache, k, v, has_ends, has_batch_idx, block_table, cos, interleaved, packed=None,
                 rotary_starts=False):
        heads_k, head_dim = k.shape[-2:]
        self._launch = None
        if k.numel() == 0:
            return
        if packed is None:
            batch, seqlen_new = k.shape[:2]
            strides = (*k.stride()[:3], *v.stride()[:3])
        else:  # (one row of k and v a packed key: no batch stride)
            batch, seqlen_new = 1, k.shape[0]
            strides = (0, *k.stride()[:2], 0, *v.stride()[:2])
        paged = block_table is not None
        capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
        rows = max(16, min(64, next_power_of_2(seqlen_new)))
        rotary = cos is not None
        self._launch = Prepared(
            _append_kernel, (cdiv(seqlen_new, rows), batch, heads_k),
            (*strides, *k_cache.stride()[:3], *v_cache.stride()[:3],
             block_table.stride(0) if paged else 0, cos.stride(0) if rotary else 0,
             seqlen_new, capacity, k_cache.shape[0], cos.shape[1] if rotary else 0, packed or 1,
             search_steps(packed or 1),
             cos.shape[0] if rotary else 1),
            dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), ROWS=rows, PAGED=paged,
                 PAGE_SIZE=k_cache.shape[1] if paged else 1, HAS_ENDS=has_ends,
                 HAS_BATCH_IDX=has_batch_idx, ROTARY=rotary, INTERLEAVED=rotary and bool(interleaved),
                 PACKED=packed is not None,
                 HAS_ROTARY_STARTS=rotary and rotary_starts, num_warps=4))

    def __call__(self, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, cos, sin, cu_new=None,
                 rotary_starts=None):
        if self._launch is None:
            return
        tables = isinstance(seqlens, torch.Tensor)
        # (k stands for the absent tables: a pointer never read)
        self._launch(k, v, k_cache, v_cache, seqlens if tables else k, k if batch_idx is None else batch_idx,
                     k if block_table is None else block_table, k if cos is None else cos, k if sin is None else sin,
                     k if cu_new is None else cu_new, k if rotary_starts is None else rotary_starts,
                     0 if tables else seqlens)


@triton.jit
def _rotate_kernel(X, ROTATED, ENDS, COS, SIN, CU, start, sxb, sxs, sxh, sob, sos, soh, scs, seqlen, limit, half,
                   batch_count, search_steps, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   ROWS: tl.constexpr, HAS_ENDS: tl.constexpr, ADVANCE: tl.constexpr, INTERLEAVED: tl.constexpr,
                   PACKED: tl.constexpr):
    """ROWS rows of one (sequence, head) of X (batch, seqlen, heads, head_dim) rotated into ROTATED
    at positions start + i (ADVANCE) or start, clamped to [0, limit) (start: ENDS[batch], or the
    ``start`` given).  PACKED: ROWS rows of X (seqlen, heads, head_dim), sequence b's the rows
    CU[b] .. CU[b + 1] (_packed_rows; rows past the last sequence rotated as any)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    head = tl.program_id(2)
    if PACKED:
        batch, i, _ = _packed_rows(CU, rows, batch_count, seqlen, search_steps)
    else:
        batch, i = tl.program_id(1), rows
    if HAS_ENDS:
        start = tl.load(ENDS + batch)
    positions = start + i if ADVANCE else start + i * 0
    positions = tl.minimum(tl.maximum(positions, 0), limit - 1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    in_rows = rows < seqlen
    x_rows = batch.to(tl.int64) * sxb + rows.to(tl.int64) * sxs + head * sxh
    x = _load_rotated(X + x_rows[:, None], offs_d, in_rows, positions, COS, SIN, scs, half, HEAD_DIM, True,
                      INTERLEAVED)
    out_rows = batch.to(tl.int64) * sob + rows.to(tl.int64) * sos + head * soh
    tl.store(ROTATED + out_rows[:, None] + offs_d[None, :], x, mask=in_rows[:, None] & (offs_d[None, :] < HEAD_DIM))


class Rotate:
    """Queries rotated (a new contiguous tensor), one launch, prepared for one kind of call:
    ``rotate(x, cos, sin, seqlens, cu)`` rotates x (batch, seqlen, heads, head_dim), unit stride
    along head_dim, at positions seqlens + [0, seqlen) (``advance``) or seqlens, clamped to [0,
    ``limit``): what rotary.apply gives at kvcache._positions' positions.  ``seqlens``: an int or
    a (batch,) int32 table on the device.  With ``packed`` (the batch), x is packed (total,
    heads, head_dim), sequence b's rows cu[b] .. cu[b + 1], its own rows counted from 0.

    The kind: the shapes, strides and dtypes of x and the tables ``cos``; ``has_ends`` (seqlens a
    tensor), ``advance``, ``limit``, ``interleaved``, ``packed``."""

    def __init__(self, x, cos, has_ends, advance, limit, interleaved, packed=None):
        heads, head_dim = x.shape[-2:]
        self.shape, self.dtype, self.advance = tuple(x.shape), x.dtype, advance
        self._launch = None
        if x.numel() == 0:
            return
        if packed is None:
            batch, seqlen = x.shape[:2]
            strides = (*x.stride()[:3], *contiguous_strides(self.shape)[:3])
        else:
            batch, seqlen = 1, x.shape[0]
            strides = (0, *x.stride()[:2], 0, *contiguous_strides(self.shape)[:2])
        rows = max(16, min(64, next_power_of_2(seqlen)))
        self._launch = Prepared(
            _rotate_kernel, (cdiv(seqlen, rows), batch, heads),
            (*strides, cos.stride(0), seqlen, limit, cos.shape[1], packed or 1, search_steps(packed or 1)),
            dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), ROWS=rows, HAS_ENDS=has_ends,
                 ADVANCE=advance, INTERLEAVED=bool(interleaved), PACKED=packed is not None,
                 num_warps=4))

    def __call__(self, x, cos, sin, seqlens, cu=None):
        out = torch.empty(self.shape, dtype=self.dtype, device=x.device)
        if self._launch is not None:
            tables = isinstance(seqlens, torch.Tensor)
            self._launch(x, out, seqlens if tables else x, cos, sin, x if cu is None else cu,
                         0 if tables else seqlens)
        return out


class Attend:
    """The split-KV attention of one kind of call, its launches prepared: ``attend(q, k_cache,
    v_cache, seqlens, new_keys, leftpad, batch_idx, block_table, alibi_slopes, cu_seqlens_q)``
    -> (out, lse) of q (batch, seqlen_q, heads, head_dim), or packed (total_q, heads, head_dim)
    with the int32 offsets ``cu_seqlens_q``, unit stride along head_dim, over the caches, each
    sequence ending at ``seqlens[b] + new_keys`` in its cache row (``seqlens`` (batch,) int32,
    or None: at ``new_keys``), ALiBi's ``alibi_slopes`` (float32 (heads,) or (batch, heads),
    contiguous) where the kind has them; out (q's shape) and lse ((batch, heads, seqlen_q), or
    packed (heads, total_q)) are new contiguous tensors.

    The kind: ``plan`` (dispatch.DecodePlan); the shapes, strides, dtype and device of q and the
    caches; which tables there are (``has_ends``, ``has_leftpad``, ``has_batch_idx``;
    ``block_table``, whose shape and row stride are read, or None); scale, window, softcap and
    ``alibi``; packed queries: the batch and ``max_seqlen_q``."""

    def __init__(self, plan, q, k_cache, v_cache, has_ends, has_leftpad, has_batch_idx, block_table, scale, window,
                 softcap, alibi, packed=None):
        heads_k = k_cache.shape[2]
        if packed is None:
            batch, seqlen_q, heads, head_dim = q.shape
            rows_q = seqlen_q
            self.out_shape, self.lse_shape = tuple(q.shape), (batch, heads, seqlen_q)
            q_strides = q.stride()[:3]
            o_strides = contiguous_strides(self.out_shape)[:3]
            lse_strides = contiguous_strides(self.lse_shape)[:2]
        else:  # (batch, max_seqlen_q): a sequence's rows follow its offsets, no batch stride
            (batch, seqlen_q), (rows_q, heads, head_dim) = packed, q.shape
            self.out_shape, self.lse_shape = tuple(q.shape), (heads, rows_q)
            q_strides = (0, *q.stride()[:2])
            o_strides, lse_strides = (0, heads * head_dim, head_dim), (0, rows_q)
        self.dtype, self.packed = q.dtype, packed
        group = heads // heads_k
        paged = block_table is not None
        capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
        self.splits = plan.splits
        self.part_o_shape, self.part_lse_shape = (plan.splits, *self.out_shape), (plan.splits, *self.lse_shape)
        # The (part) output's and logsumexp's strides, as allocated at each call: a split's
        # partials follow the previous split's.
        o_numel, lse_numel = math.prod(self.out_shape), math.prod(self.lse_shape)
        several = plan.splits > 1
        split_strides = (*o_strides, o_numel if several else 0, *lse_strides, lse_numel if several else 0)
        head_dim_pad = padded_head_dim(head_dim)
        self._split = Prepared(
            _split_kernel, (cdiv(seqlen_q * group, plan.block_m), batch * heads_k, plan.splits),
            (*q_strides, *k_cache.stride()[:3], *v_cache.stride()[:3], *split_strides,
             block_table.stride(0) if paged else 0,
             rows_q, heads_k, group, capacity, k_cache.shape[0],
             scale * score.LOG2E, window[0], window[1]),
            dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                 PAGED=paged, HAS_ENDS=has_ends, HAS_LEFTPAD=has_leftpad, HAS_BATCH_IDX=has_batch_idx,
                 UPCAST=plan.upcast, SCORE=score.modification(softcap, alibi), PDL=plan.pdl,
                 PAGE_SIZE=k_cache.shape[1] if paged else 1, VARLEN_Q=packed is not None,
                 SAME_STRIDES=k_cache.stride()[:3] == v_cache.stride()[:3],
                 num_warps=plan.num_warps, num_stages=plan.num_stages, maxnreg=plan.maxnreg))
        self._softcap = softcap
        self._score_args = score.arguments(softcap, None)  # without ALiBi, the same at every call
        self._combine = None
        if several:
            self._combine = Prepared(
                _combine_kernel, (seqlen_q, batch * heads),
                (heads, plan.splits, rows_q, o_numel, *o_strides, lse_numel, *lse_strides, *o_strides, *lse_strides),
                dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=max(2, next_power_of_2(plan.splits)),
                     PDL=plan.pdl, VARLEN_Q=packed is not None, num_warps=COMBINE_WARPS, launch_pdl=plan.pdl))

    def __call__(self, q, k_cache, v_cache, seqlens, new_keys, leftpad, batch_idx, block_table, alibi_slopes=None,
                 cu_seqlens_q=None):
        device = q.device
        out = torch.empty(self.out_shape, dtype=self.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        if self.packed is not None and self.packed[1] == 0:  # no sequence has a query: every row spare
            return out.zero_(), lse.fill_(float("inf"))
        if self._combine is None:
            part_o, part_lse = out, lse
        else:
            part_o = torch.empty(self.part_o_shape, dtype=torch.float32, device=device)
            part_lse = torch.empty(self.part_lse_shape, dtype=torch.float32, device=device)
        cu_q = q if cu_seqlens_q is None else cu_seqlens_q
        # (q stands for the absent tables: a pointer never read)
        self._split(q, k_cache, v_cache, part_o, part_lse, q if seqlens is None else seqlens,
                    q if leftpad is None else leftpad, q if batch_idx is None else batch_idx,
                    q if block_table is None else block_table, cu_q, new_keys,
                    self._score_args if alibi_slopes is None else score.arguments(self._softcap, alibi_slopes))
        if self._combine is not None:
            self._combine(part_o, part_lse, out, lse, cu_q)
        return out, lse
