"""v3's backward for Hopper in Gluon, warp-specialized.

Each kernel is one CTA of two consumer warpgroups (64 rows each) and a producer warp streaming
tiles by TMA through a ``STAGES``-deep shared-memory ring, products on warpgroup MMA with the
probabilities as register operands (up to d128).  In the two passes up to d128 each consumer
warpgroup is a partition of its own, so no barrier spans both and they drift apart (as the
forward's consumers do).  The single pass and d256, whose warpgroups share each block's dS,
keep one partition of both.

- dK/dV pass (K/V-stationary, FlashAttention-3's structure): 128 K/V rows against every Q/dO
  block of every query head of their K/V head; S^T = K Q^T, dP^T = V dO^T, dV += P^T dO,
  dK += dS^T Q.  Results leave by TMA store through the buffers of operands no longer read.
  The producer also copies each Q block's lse and D into the ring beside it (cp.async), so
  that no block waits on global memory for them.
- Single pass (plan "v3-gluon-reduce", FlashAttention-3's): the dK/dV pass also writes dS to
  shared memory and computes each Q block's share of dQ, dS K (each warpgroup half the head
  dim), which a TMA reduce-add adds to an fp32 dQ in global memory; dS and the fp32 staging
  have two buffers each, so a block waits only for the reduce of two blocks back.  5 matmuls
  per block pair, but the summation order of dQ varies from run to run.  With 128-row Q blocks
  (d64, FlashAttention-3's tiles: _kv_consumers_shared_scores) P^T goes through shared memory
  too and every gradient product reads its operands from there.
- Two passes (plan "v3-gluon", deterministic): first a dQ pass (Q-stationary: 128 query rows
  against every K/V block of their band; S = Q K^T, dP = dO V^T, dQ += dS K), which also writes
  D = rowsum(dO * O) - dlse, then the dK/dV pass.  7 matmuls per block pair, no atomics.

Tiles (a stationary row block of one head) are walked as the forward's are
(scheduler.stationary_tile): without a band one head's row blocks adjacent, so the CTAs resident
together stream the same head's blocks through L2; a band's (causal, window: uneven) longest
first across groups of heads whose streamed blocks share L2 (heads_sharing_l2), so that CTAs
taking tiles as they free up end together.  The two passes up to d128 run persistent CTAs, one
per SM (pass_schedule): the stationary tile has two slots, so the next tile's loads land while
this one's gradients leave.  Tiles of equal length are strided over; a band's are taken from
the scheduler's atomic tile counter as CTAs free up.  d256 and the single pass run a CTA per
tile (one slot: no shared memory for a second), which the GPU starts in the walk's order.

Packed sequences (varlen; the two passes up to d128, when kernel options ask for the Gluon
backward) are walked as the forward walks them: down device-side lists of (sequence, block)
tiles (packed_tiles.py), one per pass, each tile's band and masks from its sequence's lengths;
TMA sees the packed tensors as (1, total, heads, head dim), and a tile whose stationary rows run
past its sequence stores those gradients by pointer (the next sequence's rows follow them).

Head dims up to 128 keep the accumulators of 128 rows in registers; at d256 the two passes
split the head dim (SPLIT_D): 64 stationary rows shared by both warpgroups, each holding half
the head dim of the gradients, S / dP split by streamed rows, P and dS through shared memory.
In the two passes V, dO and dV may have a head dim of their own (HEAD_DIM_V_PAD); S reduces over
QK_LANES of Q's and K's lanes (configs.qk_lanes).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.language.core import _aggregate as aggregate
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from flashtile import gpu
from flashtile.kernels import configs, dropout, packed_tiles, score
from flashtile.kernels import tma as tma_host
from flashtile.kernels.blocks import band_blocks, band_mask, band_rows_mask
from flashtile.kernels.configs import gluon_bwd_stationary_rows, split_head_dim
from flashtile.kernels.gluon.pipeline import buffer_of, lanes_product, release, tma_reduce_add
from flashtile.kernels.gluon.scheduler import (end_tiles, heads_sharing_l2, next_tile, no_counter,
                                               packed_tile, publish_tile, read_next_tile, read_tile,
                                               start_tiles, stationary_tile, tile_counter, Sequences, Value, value,
                                               values)
from flashtile.kernels.launch import Descriptor, Prepared, launch
from flashtile.kernels.problem import remembered
from flashtile.kernels.tiles import LOG2E, load_tile, row_delta

# 12 warps (8 consumer, one producer warp rounded up to a warpgroup): 168 registers each at
# launch, moved to 240 for the consumers (dK, dV, S^T, dP^T live there) and 24 for the producer.
# The consumers are two partitions of a warpgroup each (TWO_PARTITION_OPTIONS: 4 warps at
# launch), or with SPLIT_D and in the single pass one of 8 warps (LAUNCH_OPTIONS).
LAUNCH_OPTIONS = dict(num_warps=8, maxnreg=168)
TWO_PARTITION_OPTIONS = dict(num_warps=4, maxnreg=168)
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
WARPGROUP_ROWS = gl.constexpr(configs.WARPGROUP_ROWS)  # the rows of an accumulator one warpgroup's MMA covers
# Probabilities and dS shared between the consumer warpgroups (16-bit, rows of 64 elements).
_SCORES_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
# Per-row statistics (lse, D) of the streamed blocks, one fp32 row per ring slot.
_STATS_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
# Which streamed tiles ride a pass's ring (PassBuffers.allocate, _stream; c always): the pair c,
# d the scores read, and the float8 passes' keys-contiguous copies e of c and f of d.
RING_D = gl.constexpr(2)
RING_E = gl.constexpr(4)
RING_F = gl.constexpr(8)
RING_PAIR = gl.constexpr(1 | 2)




@aggregate
class PassBuffers:
    """Shared memory of one pass: SLOTS buffers of the stationary pair of tiles (a, b), one per
    tile in flight, and a ring of STAGES streamed tiles, those RING names (RING_C | RING_D ...):
    the pair (c, d) and the float8 passes' keys-contiguous copies e of c and f of d (a tile not
    in the ring is an alias of c, never read); mbarriers (stationary slot ready, stationary slot empty, ring slot
    ready, ring slot empty; "empty" ones take one arrival from each consumer partition); the
    producer's tile numbers for the consumers (two: tile parity)."""
    a: gl.shared_memory_descriptor
    b: gl.shared_memory_descriptor
    c: gl.shared_memory_descriptor
    d: gl.shared_memory_descriptor
    e: gl.shared_memory_descriptor
    f: gl.shared_memory_descriptor
    tile_ids: gl.shared_memory_descriptor
    stationary_ready: gl.shared_memory_descriptor
    stationary_empty: gl.shared_memory_descriptor
    ring_ready: gl.shared_memory_descriptor
    ring_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, a, b, c, d, e, f, tile_ids, stationary_ready, stationary_empty, ring_ready, ring_empty):
        self.a = a
        self.b = b
        self.c = c
        self.d = d
        self.e = e
        self.f = f
        self.tile_ids = tile_ids
        self.stationary_ready = stationary_ready
        self.stationary_empty = stationary_empty
        self.ring_ready = ring_ready
        self.ring_empty = ring_empty

    @gluon.jit
    def allocate(a_desc, b_desc, c_desc, d_desc, e_desc, f_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                 SLOTS: gl.constexpr, RING: gl.constexpr):
        a = gl.allocate_shared_memory(a_desc.dtype, [SLOTS] + a_desc.block_type.shape, a_desc.layout)
        b = gl.allocate_shared_memory(b_desc.dtype, [SLOTS] + b_desc.block_type.shape, b_desc.layout)
        c = gl.allocate_shared_memory(c_desc.dtype, [STAGES] + c_desc.block_type.shape, c_desc.layout)
        d, e, f = c, c, c
        if RING & RING_D:
            d = gl.allocate_shared_memory(d_desc.dtype, [STAGES] + d_desc.block_type.shape, d_desc.layout)
        if RING & RING_E:
            e = gl.allocate_shared_memory(e_desc.dtype, [STAGES] + e_desc.block_type.shape, e_desc.layout)
        if RING & RING_F:
            f = gl.allocate_shared_memory(f_desc.dtype, [STAGES] + f_desc.block_type.shape, f_desc.layout)
        stationary_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        stationary_empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        ring_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ring_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SLOTS):
            mbarrier.init(stationary_ready.index(i), count=1)
            mbarrier.init(stationary_empty.index(i), count=CONSUMERS)
        for i in gl.static_range(STAGES):
            mbarrier.init(ring_ready.index(i), count=1)
            mbarrier.init(ring_empty.index(i), count=CONSUMERS)
        tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        return PassBuffers(a, b, c, d, e, f, tile_ids, stationary_ready, stationary_empty, ring_ready, ring_empty)


@aggregate
class PassWalk:
    """A pass's tiles (stationary row blocks of one head each), walked in groups of
    ``head_group`` heads (scheduler.stationary_tile), and the band.  VARLEN: the batch's
    sequences are packed (``CU_Q``/``CU_K``), each tile's lengths are its sequence's, and the
    walk runs down the list ``TILES`` of (sequence, block) entries (packed_tiles.py; ``m_blocks``
    counts the longest sequence's blocks), the heads of an entry on consecutive tiles."""
    num_tiles: Value
    heads: Value
    group: Value
    head_group: Value
    window_left: Value
    window_right: Value
    seqs: Sequences
    TILES: gl.tensor
    m_blocks: Value

    @gluon.constexpr_function
    def __init__(self, num_tiles, heads, group, head_group, seqlen_q, seqlen_k, window_left, window_right, CU_Q,
                 CU_K, totals, TILES, m_blocks, VARLEN):
        self.num_tiles = value(num_tiles)
        self.heads = value(heads)
        self.group = value(group)
        self.head_group = value(head_group)
        self.window_left = value(window_left)
        self.window_right = value(window_right)
        self.seqs = Sequences(seqlen_q, seqlen_k, CU_Q, CU_K, totals, VARLEN)
        self.TILES = TILES
        self.m_blocks = value(m_blocks)

    @gluon.jit
    def tile(self, t, ROWS: gl.constexpr, KEY_ROWS: gl.constexpr):
        """(batch, head, first row, sequence) of tile ``t``: ROWS key rows of a K/V head
        (KEY_ROWS, the dK/dV pass; a band's longest first from the first row), else ROWS query
        rows of one query head (longest first from the last).  The sequence: (its TMA batch
        coordinate, first query row, first key row, query rows, keys); batched, the batch entry
        from row 0."""
        if self.seqs.VARLEN:
            batch, head, r0 = packed_tile(t, self.TILES, self.heads, self.m_blocks, ROWS)
        elif KEY_ROWS:
            batch, head, r0 = stationary_tile(t, self.num_tiles, self.heads, self.seqs.seqlen_k, self.head_group,
                                              ROWS, False)
        else:
            batch, head, r0 = stationary_tile(t, self.num_tiles, self.heads, self.seqs.seqlen_q, self.head_group,
                                              ROWS, True)
        return batch, head, r0, self.seqs.of(batch)


@aggregate
class RowStats:
    """The logsumexp and D of the query rows, in global memory, and (the dK/dV pass) a slot in
    shared memory per ring slot that the producer copies each streamed block's into."""
    LSE: gl.tensor
    DELTA: gl.tensor
    lse_smem: gl.shared_memory_descriptor
    delta_smem: gl.shared_memory_descriptor
    slb: Value
    slh: Value

    @gluon.constexpr_function
    def __init__(self, LSE, DELTA, lse_smem, delta_smem, slb, slh):
        self.LSE = LSE
        self.DELTA = DELTA
        self.lse_smem = lse_smem
        self.delta_smem = delta_smem
        self.slb = value(slb)
        self.slh = value(slh)


@aggregate
class DeltaInputs:
    """What the dQ pass computes D = rowsum(dO * O) - dlse from: O (by pointer, of V's head dim)
    and dlse."""
    O: gl.tensor
    sob: Value
    sos: Value
    soh: Value
    head_dim: Value
    DLSE: gl.tensor

    @gluon.constexpr_function
    def __init__(self, O, sob, sos, soh, head_dim, DLSE):
        self.O = O
        self.sob = value(sob)
        self.sos = value(sos)
        self.soh = value(soh)
        self.head_dim = value(head_dim)
        self.DLSE = DLSE


@gluon.jit
def _producer(a_desc, b_desc, c_desc, d_desc, e_desc, f_desc, buf, walk, stats, counter, ROWS: gl.constexpr,
              BLOCK: gl.constexpr, STAGES: gl.constexpr, KEY_ROWS: gl.constexpr, STATS_IN_RING: gl.constexpr,
              PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr, RING: gl.constexpr):
    """The producer warp of either pass, over the CTA's tiles of ``walk`` (scheduler.next_tile:
    one, every num_programs-th, or taken from the counter), each tile's number handed to the
    consumers: its stationary pair (a, b), ROWS rows of one head, into a free slot of its
    buffers; then the streamed tiles RING names (c, d and their keys-contiguous copies e, f:
    (batch, heads, head dim, rows); PassBuffers), BLOCK rows at a time, over the band of the
    stationary rows, through the STAGES-slot ring.  KEY_ROWS (the
    dK/dV pass): the stationary rows are key rows of a K/V head, and every query head of its
    group streams by; else one query head's rows, against its K/V head's blocks."""
    num_tiles, group = walk.num_tiles, walk.group
    SLOTS: gl.constexpr = buf.a.shape[0]
    stats_layout: gl.constexpr = gl.BlockedLayout([BLOCK // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK, layout=stats_layout)
    it = 0  # streamed blocks issued so far: ring slot and mbarrier phase
    tile_i = 0
    t = gl.program_id(0)
    start_tiles(counter, DYNAMIC)
    while t < num_tiles:
        batch, head, r0, seq = walk.tile(t, ROWS, KEY_ROWS)
        coord_b, q_start, k_start, seqlen_q, seqlen_k = seq
        if KEY_ROWS:
            first_head = head * group
            streamed_heads = group
            row0, streamed_row0 = k_start + r0, q_start
        else:
            first_head = head // group
            streamed_heads = 1
            row0, streamed_row0 = q_start + r0, k_start
        s, s_phase = buffer_of(tile_i, SLOTS)
        stationary = buf.stationary_ready.index(s)
        mbarrier.wait(buf.stationary_empty.index(s), s_phase ^ 1)
        publish_tile(buf.tile_ids, tile_i, t)
        following = next_tile(t, num_tiles, counter, PERSISTENT, DYNAMIC)
        mbarrier.expect(stationary, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [coord_b, row0, head, 0], stationary, buf.a.index(s))
        tma.async_copy_global_to_shared(b_desc, [coord_b, row0, head, 0], stationary, buf.b.index(s))
        dlo, dhi, lo, full_lo, full_hi, n_blocks = band_blocks(r0, ROWS, BLOCK, seqlen_q, seqlen_k,
                                                               walk.window_left, walk.window_right, KEY_ROWS)
        it = _stream(c_desc, d_desc, e_desc, f_desc, buf, batch, coord_b, streamed_row0, q_start, first_head,
                     streamed_heads, lo, n_blocks, it, seqlen_q, stats, offs, BLOCK, STAGES, STATS_IN_RING, RING)
        t = following
        tile_i += 1
    end_tiles(buf.tile_ids, tile_i, buf.stationary_ready, buf.stationary_empty, num_tiles, PERSISTENT)


@gluon.jit
def _stream(c_desc, d_desc, e_desc, f_desc, buf, batch, coord_b, row0, q_start, first_head, heads, lo, n_blocks, it,
            seqlen_q, stats, offs, BLOCK: gl.constexpr, STAGES: gl.constexpr, STATS_IN_RING: gl.constexpr,
            RING: gl.constexpr):
    """One tile's streamed tiles (those RING names): n_blocks blocks from row lo (of the sequence that starts at
    row ``row0`` of TMA batch entry ``coord_b``) of each of ``heads`` heads from ``first_head``,
    the first into the ring's slot of block ``it``; returns the next block's count.  Their
    query rows' statistics from row ``q_start`` of sequence ``batch``'s."""
    for g in range(heads):
        for i in range(n_blocks):
            slot, phase = buffer_of(it, STAGES)
            mbarrier.wait(buf.ring_empty.index(slot), phase ^ 1)
            if STATS_IN_RING:
                # lse and D of the block's query rows beside it, by cp.async: the slot's barrier
                # also waits for them (each lane's arrive counts once its copies land).  Rows past
                # the sequence read 0: their Q and dO rows are zero (packed: the next sequence's)
                # and the band mask drops them.
                rows = lo + i * BLOCK + offs
                at = batch.to(gl.int64) * stats.slb + (first_head + g) * stats.slh + q_start + rows
                async_copy.async_copy_global_to_shared(stats.lse_smem.index(slot), stats.LSE + at,
                                                       mask=rows < seqlen_q)
                async_copy.async_copy_global_to_shared(stats.delta_smem.index(slot), stats.DELTA + at,
                                                       mask=rows < seqlen_q)
                async_copy.mbarrier_arrive(buf.ring_ready.index(slot))
            nbytes: gl.constexpr = (c_desc.block_type.nbytes
                                    + (d_desc.block_type.nbytes if RING & RING_D else 0)
                                    + (e_desc.block_type.nbytes if RING & RING_E else 0)
                                    + (f_desc.block_type.nbytes if RING & RING_F else 0))
            mbarrier.expect(buf.ring_ready.index(slot), nbytes)
            coord = [coord_b, row0 + lo + i * BLOCK, first_head + g, 0]
            tma.async_copy_global_to_shared(c_desc, coord, buf.ring_ready.index(slot), buf.c.index(slot))
            if RING & RING_D:
                tma.async_copy_global_to_shared(d_desc, coord, buf.ring_ready.index(slot), buf.d.index(slot))
            coord_t = [coord_b, first_head + g, 0, row0 + lo + i * BLOCK]
            if RING & RING_E:
                tma.async_copy_global_to_shared(e_desc, coord_t, buf.ring_ready.index(slot), buf.e.index(slot))
            if RING & RING_F:
                tma.async_copy_global_to_shared(f_desc, coord_t, buf.ring_ready.index(slot), buf.f.index(slot))
            it += 1
    return it


@gluon.jit
def _add_dq(dq, staging, dq_desc, batch, m0, head):
    """A Q block's dQ share (fp32, both warpgroups' halves) staged and added by TMA reduce-add."""
    staging.reshape(dq.shape).store(dq)
    fence_async_shared()
    gl.thread_barrier()  # staged by both warpgroups
    tma_reduce_add(dq_desc, [batch, m0, head, 0], staging)


@gluon.constexpr_function
def _wgmma_layout(columns, row_groups, col_groups, k=16):
    """The accumulator layout of a consumer partition's tile of ``columns`` columns: its
    warpgroups stack ``row_groups`` 64-row slices, or take 1/``col_groups`` of the columns each;
    ``k``: what one MMA instruction reduces over (32 bytes of its operands' type)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * row_groups, col_groups],
                                     instr_shape=[16, columns // col_groups, k])


@gluon.jit
def _column_stats(LSE, DELTA, stats, cols, seqlen_q, valid):
    """lse (log2 units) and D of the query rows a dK/dV block sees as its columns.  Rows past
    the sequence (or of no block: ``valid`` false) read lse = +inf: their probabilities are
    exactly 0."""
    inside = (cols < seqlen_q) & valid
    lse = gl.load(LSE + stats + cols, mask=inside, other=float("inf")) * LOG2E
    delta = gl.load(DELTA + stats + cols, mask=inside, other=0.0)
    return lse, delta


@gluon.jit
def _in_band_t(x, rows_k, m0, band, seqlen_q, ROW_BOUNDS: gl.constexpr):
    """``x`` (key rows x the Q block from m0) with 0 outside the band, where the block crosses an
    edge of it (its column indices built only there).  ROW_BOUNDS: by two bounds per key row
    (band_rows_mask: fewer instructions in the loop), else by band_mask (d64's single pass: there
    the row bounds spill)."""
    dlo, dhi, full_lo, full_hi = band
    if (m0 < full_lo) | (m0 >= full_hi):
        cols = m0 + gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, x.type.layout))
        if ROW_BOUNDS:
            x = gl.where(band_rows_mask(rows_k, cols, seqlen_q, -dhi, -dlo), x, 0.0)
        else:
            x = gl.where(band_mask(rows_k, cols, seqlen_q, -dhi, -dlo), x, 0.0)
    return x


@gluon.jit
def _hook_probs_t(sT, lse, cols, rows_k, m0, band, seqlen_q, scale_log2, unit, site, SCORE: gl.constexpr,
                  ROW_BOUNDS: gl.constexpr):
    """_probs_t through the score hook whole: (P^T, P^T f')."""
    yT = score.logits(sT, scale_log2, cols[None, :], rows_k[:, None], site, SCORE)
    pT = _in_band_t(gl.exp2(yT * unit - lse[None, :]), rows_k, m0, band, seqlen_q, ROW_BOUNDS)
    return pT, score.grad(pT, yT, cols[None, :], rows_k[:, None], site, SCORE)


@gluon.jit
def _probs_t(sT, lse, rows_k, k0, m0, band, seqlen_q, scale_log2, site, SCORE: gl.constexpr,
             ROW_BOUNDS: gl.constexpr, SPLIT_CROSSING: gl.constexpr, positions=None):
    """P^T of the Q block from m0 from S^T (key rows ``rows_k`` from k0; through the score hook),
    and P^T times the hook's derivative f', what dS^T is formed from (dS^T = P^T f' (dP^T - D)):
    taken now, the logits need not stay in registers until dP^T has landed.  A distance bias is
    split (score.one_side_logits): its key part per row, its query part into lse; on blocks the
    diagonal crosses too with SPLIT_CROSSING (score.crossing_part), else there through the hook
    (the single pass spills less with the first, the two passes with the second).  ``positions``
    (None, or _write_positions' table): the query part as the block's scalar plus the slope
    times a position read from shared memory, so that the columns' indices and their
    conversions to float are neither held across the loop nor rebuilt every block (either
    spills in the single pass)."""
    unit = score.exp_scale(scale_log2, site, SCORE)
    if score.splits_distance(SCORE):
        side = score.diagonal_side(k0, k0 + sT.shape[0] - 1, m0, m0 + sT.shape[1] - 1, site[2])
        crossing = side == 0.0
        if SPLIT_CROSSING:
            side += crossing.to(gl.float32)  # the left side's split, and crossing_part
        if (side != 0.0) | SPLIT_CROSSING:
            slope = score.distance_slope(site, SCORE) * unit  # log2 units
            key_part = (slope * side) * (rows_k - k0).to(gl.float32)
            if positions is None:
                lse_part = lse - (slope * side) * (k0 - site[2] - _cols_t(sT, m0)).to(gl.float32)
            else:
                block_part = (slope * side) * (k0 - site[2] - m0).to(gl.float32)
                lse_part = (lse - block_part) + (slope * side) * positions.load(gl.SliceLayout(0, sT.type.layout))
            xT, tT = score.biased_inner_logits(sT, scale_log2, unit, key_part[:, None], _cols_t(sT, m0)[None, :],
                                               rows_k[:, None], site, SCORE)
            if SPLIT_CROSSING:
                if crossing:
                    xT += score.crossing_part(_cols_t(sT, m0)[None, :], rows_k[:, None], site[2], slope)
            pT = _in_band_t(gl.exp2(xT - lse_part[None, :]), rows_k, m0, band, seqlen_q, ROW_BOUNDS)
            pT_ds = score.inner_grad(pT, tT, _cols_t(sT, m0)[None, :], rows_k[:, None], site, SCORE)
        else:
            pT, pT_ds = _hook_probs_t(sT, lse, _cols_t(sT, m0), rows_k, m0, band, seqlen_q, scale_log2, unit, site,
                                      SCORE, ROW_BOUNDS)
        return pT, pT_ds
    else:
        return _hook_probs_t(sT, lse, _cols_t(sT, m0), rows_k, m0, band, seqlen_q, scale_log2, unit, site, SCORE,
                             ROW_BOUNDS)


@gluon.constexpr_function
def _lse_rows(STAGES, SCORE):
    """Rows of the dK/dV pass's lse buffer: one per ring slot, and with a distance bias one
    more for _write_positions' table."""
    return STAGES + 1 if score.splits_distance(SCORE) else STAGES


@gluon.jit
def _positions(lse_smem, STAGES: gl.constexpr, SCORE: gl.constexpr):
    """The table of a streamed block's column positions (0, 1, ... as floats) that _probs_t reads
    with a distance bias: the dK/dV pass's lse buffer's row after its ring slots (_lse_rows);
    None without one."""
    positions = None
    if score.splits_distance(SCORE):
        positions = lse_smem.index(STAGES)
    return positions


@gluon.jit
def _write_positions(lse_smem, STAGES: gl.constexpr, SCORE: gl.constexpr):
    """Fill _positions' table, if any, and wait for the partition's warps.  Every consumer
    partition writes the same values."""
    positions = _positions(lse_smem, STAGES, SCORE)
    if positions is not None:
        n: gl.constexpr = positions.shape[0]
        positions.store(gl.arange(0, n, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0])).to(gl.float32))
        gl.thread_barrier()


@gluon.jit
def _cols_t(sT, m0):
    """The query rows of S^T's columns, from m0; built where each use is, so that none is
    computed ahead of a branch that alone reads it."""
    return m0 + gl.arange(0, sT.shape[1], layout=gl.SliceLayout(0, sT.type.layout))


@gluon.jit
def _ds_t(pT_ds, dpT, delta, rows_k, m0, band, seqlen_q, dp_scale, ROW_BOUNDS: gl.constexpr):
    """dS^T = P^T f' (dP^T - D), with respect to the scaled scores (``pT_ds``: P^T f', _probs_t;
    dP^T the product times ``dp_scale``: 1, or the float8 pass's descales per key row); a pair
    outside the band adds nothing, even where dP^T or D is not finite (a masked key's V, or the
    row's output, holding inf)."""
    return _in_band_t(pT_ds * (dpT * dp_scale - delta[None, :]), rows_k, m0, band, seqlen_q, ROW_BOUNDS)


@gluon.jit
def _store_dkdv(dk, dv, k_tile, v_tile, k_smem, v_smem, dk_desc, dv_desc, batch, n0, head_k, softmax_scale):
    """K and V are no longer read: their buffers stage dK and dV for the TMA stores, which drop
    rows past the sequence and lanes past the head dim."""
    k_tile.store((dk * softmax_scale).to(k_tile.dtype))
    v_tile.store(dv.to(v_tile.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [batch, n0, head_k, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [batch, n0, head_k, 0], v_smem)
    tma.store_wait(0)


@gluon.jit
def _store_rows(x, PTR, row0, rows_left, head, sgs, sgh, head_dim):
    """``x`` (rows x head dim) from registers into rows row0... of ``head`` of a packed gradient,
    its first ``rows_left`` rows (those after them are the next sequence's) and ``head_dim``
    columns; ``sgs``, ``sgh``: the gradient's row and head strides."""
    layout: gl.constexpr = x.type.layout
    rows = gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = PTR + (row0 + rows)[:, None].to(gl.int64) * sgs + head * sgh + cols[None, :]
    gl.store(ptrs, x.to(PTR.dtype.element_ty), mask=(rows[:, None] < rows_left) & (cols[None, :] < head_dim))


@gluon.jit
def _landed(c_smem, ready, count, ROWS: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr):
    """Streamed tile c of block ``count``, once landed in its ring slot: (the slot, c as a 2-D
    tile of ROWS rows)."""
    slot, phase = buffer_of(count, STAGES)
    mbarrier.wait(ready.index(slot), phase)
    return slot, c_smem.index(slot).reshape([ROWS, HEAD_DIM_PAD])


@gluon.jit
def _scores(a, b, c_smem, d_smem, ready, count, s_zero, ROWS: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
            STAGES: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr, QK_LANES: gl.constexpr):
    """The streamed pair (c, d) of block ``count`` in its ring slot, once landed, and the
    stationary rows' scores against it from shared memory, issued and left in flight: a c^T and
    b d^T (S and dP in the dQ pass, S^T and dP^T in the dK/dV pass; c is Q or K, of Q's head
    dim, d dO or V, of V's; a c^T over the first QK_LANES lanes: pipeline.lanes_product).  Returns the
    slot, the pair as 2-D tiles of ROWS rows and the two products."""
    slot, c = _landed(c_smem, ready, count, ROWS, HEAD_DIM_PAD, STAGES)
    d = d_smem.index(slot).reshape([ROWS, HEAD_DIM_V_PAD])
    s = lanes_product(a, c, s_zero, QK_LANES)
    dp = warpgroup_mma(b, d.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return slot, c, d, s, dp


@gluon.jit
def _dkdv_products(sT, dpT, q, do, lse_ref, delta_ref, dk, dv, s_zero, rows_k, k0, m0, band, seqlen_q, scale_log2,
                   site, drop, op_layout: gl.constexpr, v_op_layout: gl.constexpr, SCORE: gl.constexpr,
                   DQ_REDUCE: gl.constexpr, DROPOUT: gl.constexpr, positions=None):
    """One streamed Q block's products against a consumer partition's K/V rows, once its S^T and
    dP^T are in flight (_scores): dV += P^T dO and dK += dS^T Q with P^T and dS^T as register
    operands; lse and D from the block's ring slot.  dV and dK are left in flight (with the
    operands they read): the caller waits for them.  P^T takes dV's operand layout
    (``v_op_layout``: V's head dim), dS^T dK's (``op_layout``).  With DROPOUT (``drop``: dropout.stream_of)
    dV takes the kept P^T (the caller scales dV by 1 / (1 - p)) and dS^T the kept dP^T, scaled."""
    lse = lse_ref.load(gl.SliceLayout(0, s_zero.type.layout)) * LOG2E
    sT = warpgroup_mma_wait(1, deps=[sT])
    pT, pT_ds = _probs_t(sT, lse, rows_k, k0, m0, band, seqlen_q, scale_log2, site, SCORE, True, DQ_REDUCE,
                         positions)
    if DROPOUT:
        s_layout: gl.constexpr = s_zero.type.layout
        kept = dropout.kept_words_t(drop[0], drop[1], k0, m0, drop[2], sT.shape[0], sT.shape[1], s_layout)
        # The mask rides across the dP^T wait in P^T f''s sign bit (a tile of predicates held
        # there goes to bit-packed registers, unpacked score by score); f' >= 0 for every hook
        # (softcap's 1 - tanh^2) but for rounding, so its magnitude is kept.
        pT, pT_ds = dropout.kept_only_t(pT, pT_ds, kept)
    pT_op = gl.convert_layout(pT.to(q.dtype), v_op_layout)
    dv = warpgroup_mma(pT_op, do, dv, is_async=True)
    # D only now: loaded with lse, its registers were held across the S^T wait (d128 spilled more).
    delta = delta_ref.load(gl.SliceLayout(0, s_zero.type.layout))
    dpT = warpgroup_mma_wait(1, deps=[dpT])
    if DROPOUT:
        # Kept: P^T f' (dP^T / (1 - p) - D).  Dropped: -P^T f' D, the negated P^T f' times D, which
        # _ds_t forms from dP^T = 2 D (a dropped 0, -0.0, reads as kept: 0 either way).
        dpT = gl.where(pT_ds >= 0.0, dpT * (1.0 / (1.0 - drop[2])), 2.0 * delta[None, :])
    dsT = _ds_t(pT_ds, dpT, delta, rows_k, m0, band, seqlen_q, 1.0, True).to(q.dtype)
    dsT_op = gl.convert_layout(dsT, op_layout)
    dk = warpgroup_mma(dsT_op, q, dk, is_async=True)
    return dk, dv, dsT, pT_op, dsT_op


@gluon.jit
def _kv_tile(t, tile_i, walk, k_smem, v_smem, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile ``t`` of the dK/dV pass (BLOCK_N key rows), the CTA's ``tile_i``-th: (batch, K/V
    head, first key row), its stationary slot and the K and V blocks there, the band of
    BLOCK_M-row Q blocks its rows see (blocks.band_blocks: dlo, dhi, lo, full_lo, full_hi,
    n_blocks), and its sequence (PassWalk.tile)."""
    batch, head_k, n0, seq = walk.tile(t, BLOCK_N, True)
    kv_slot = buffer_of(tile_i, k_smem.shape[0])[0]
    band = band_blocks(n0, BLOCK_N, BLOCK_M, seq[3], seq[4], walk.window_left, walk.window_right, True)
    return batch, head_k, n0, kv_slot, k_smem.index(kv_slot), v_smem.index(kv_slot), band, seq


@gluon.jit
def _kv_consumer(WHICH: gl.constexpr, WARPGROUPS: gl.constexpr, buf, walk, stats, dk_desc, dv_desc, ds_smem, dq_smem,
                 dq_desc, packed_grads, softmax_scale, scale_log2, score_args, dropped, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, DQ_REDUCE: gl.constexpr,
                 PERSISTENT: gl.constexpr, SCORE: gl.constexpr, DROPOUT: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
                 QK_LANES: gl.constexpr):
    """dK and dV of a consumer partition's K/V rows: of WARPGROUPS warpgroups (64 rows each),
    partition WHICH of the CTA's.

    The two passes run a partition per warpgroup (WARPGROUPS 1), which share nothing but the
    ring, so the two drift apart instead of meeting at every barrier.  The single pass
    (DQ_REDUCE) runs one partition of both (WARPGROUPS 2): each Q block's dQ share, dS K, needs
    both warpgroups' dS^T, which meet in shared memory, and the two add the block's fp32 dQ by
    one TMA reduce-add.  (A partition per warpgroup measured up to 17% slower there at d128:
    it spilled more.)  Packed sequences (the two passes): a tile whose rows run past its
    sequence stores them by pointer (``packed_grads``: dK, dV, their row and head strides, the
    head dims as _dkdv_kernel takes them), the rows after them being the next sequence's.
    ``dropped``: the dropout's seed pointer and rate (DROPOUT).  dV and V are of V's head dim
    (HEAD_DIM_V_PAD), dK and K of Q's."""
    k_smem, v_smem, q_smem, do_smem, tile_ids = buf.a, buf.b, buf.c, buf.d, buf.tile_ids
    kv_ready, kv_empty, q_ready, q_empty = buf.stationary_ready, buf.stationary_empty, buf.ring_ready, buf.ring_empty
    num_tiles, group = walk.num_tiles, walk.group  # (the sequence's lengths: each tile's)
    lse_smem, delta_smem = stats.lse_smem, stats.delta_smem
    _write_positions(lse_smem, STAGES, SCORE)
    SLOTS: gl.constexpr = k_smem.shape[0]
    ROWS: gl.constexpr = WARPGROUP_ROWS * WARPGROUPS
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M, WARPGROUPS, 1)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM_PAD, WARPGROUPS, 1)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    v_acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM_V_PAD, WARPGROUPS, 1)
    v_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v_acc_layout, k_width=2)
    s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    it = 0  # streamed blocks consumed so far: ring slot and mbarrier phase
    tile_i = 0
    t = read_tile(tile_ids, tile_i, kv_ready, SLOTS)  # the tile's K and V landed
    while t < num_tiles:
        batch, head_k, n0, kv_slot, k_block, v_block, band, seq = _kv_tile(t, tile_i, walk, k_smem, v_smem, BLOCK_M,
                                                                            BLOCK_N)
        coord_b, q_start, k_start, seqlen_q, seqlen_k = seq
        # The band of the whole CTA's rows: every partition steps through the same blocks.
        dlo, dhi, lo, full_lo, full_hi, n_blocks = band
        r0 = n0 + WHICH * ROWS
        rows_k = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([ROWS, HEAD_DIM_PAD], gl.float32, acc_layout)
        dv = gl.zeros([ROWS, HEAD_DIM_V_PAD], gl.float32, v_acc_layout)
        for g in range(group):
            head = head_k * group + g
            site = (batch, head, seqlen_k - seqlen_q, score_args)
            drop = dropout.stream_of(dropped[0], batch, head, walk.heads * group, dropped[1], DROPOUT)
            for i in range(n_blocks):
                dk, dv = _kv_block(k_smem, v_smem, kv_slot, q_smem, do_smem, q_ready, q_empty, lse_smem, delta_smem,
                                   ds_smem, dq_smem, dq_desc, dk, dv, s_zero, rows_k, r0, it, lo + i * BLOCK_M,
                                   (dlo, dhi, full_lo, full_hi), batch, head, seqlen_q, softmax_scale, scale_log2, site,
                                   drop, op_layout, v_op_layout, WHICH * ROWS, ROWS, BLOCK_M, BLOCK_N, HEAD_DIM_PAD,
                                   STAGES, DQ_REDUCE, HEAD_DIM_PAD > 64, SCORE, DROPOUT, HEAD_DIM_V_PAD, QK_LANES)
                it += 1
        if DROPOUT:
            dv = dv * (1.0 / (1.0 - dropped[1]))  # the kept P^T's 1 / (1 - p), once
        # The partition's rows of K and V stage its dK and dV (as 2-D tiles, and as TMA sees them).
        k_rows = k_block.reshape([BLOCK_N, HEAD_DIM_PAD]).slice(WHICH * ROWS, ROWS)
        v_rows = v_block.reshape([BLOCK_N, HEAD_DIM_V_PAD]).slice(WHICH * ROWS, ROWS)
        if walk.seqs.VARLEN:  # (batched launches compile the staged stores alone)
            if r0 + ROWS > seqlen_k:
                DK, DV, sgs, sgh, svs, svh, head_dims = packed_grads
                _store_rows(dk * softmax_scale, DK, k_start + r0, seqlen_k - r0, head_k, sgs, sgh, head_dims & 0xFFFF)
                _store_rows(dv, DV, k_start + r0, seqlen_k - r0, head_k, svs, svh, head_dims >> 16)
            else:
                _store_dkdv(dk, dv, k_rows, v_rows, k_block.slice(WHICH * ROWS, ROWS, dim=1),
                            v_block.slice(WHICH * ROWS, ROWS, dim=1), dk_desc, dv_desc, coord_b, k_start + r0, head_k,
                            softmax_scale)
        else:
            _store_dkdv(dk, dv, k_rows, v_rows, k_block.slice(WHICH * ROWS, ROWS, dim=1),
                        v_block.slice(WHICH * ROWS, ROWS, dim=1), dk_desc, dv_desc, batch, r0, head_k, softmax_scale)
        release(kv_empty, kv_slot)
        tile_i += 1
        t = read_next_tile(tile_ids, tile_i, kv_ready, num_tiles, SLOTS, PERSISTENT)


@gluon.jit
def _per_iteration(x, it):
    """``x``, as a value the compiler takes to change with the loop counter ``it``.  The K/V
    slot of a tile goes through it: seen as invariant, the wgmma descriptors of every K and V
    slice built from it were hoisted out of the streamed-block loop and held across it, and the
    d128 consumer spilled."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [x, it], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _kv_block(k_smem, v_smem, kv_slot, q_smem, do_smem, q_ready, q_empty, lse_smem, delta_smem, ds_smem, dq_smem,
              dq_desc, dk, dv, s_zero, rows_k, k0, it, m0, band, batch, head, seqlen_q, softmax_scale, scale_log2, site,
              drop, op_layout: gl.constexpr, v_op_layout: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr,
              DQ_REDUCE: gl.constexpr, SLOT_PER_ITERATION: gl.constexpr, SCORE: gl.constexpr, DROPOUT: gl.constexpr,
              HEAD_DIM_V_PAD: gl.constexpr,
              QK_LANES: gl.constexpr):
    """_kv_consumer's step: the streamed block ``it`` of the ring (query rows from m0 of ``head``)
    against the partition's ROWS rows from ROW0 of the K/V tile in stationary slot ``kv_slot``.
    SLOT_PER_ITERATION (from d128): the slot is taken as this iteration's value (_per_iteration),
    so the wgmma descriptors built from it are not held across the loop (at d64 they fit in
    registers, and holding them is faster)."""
    if SLOT_PER_ITERATION:
        kv_slot = _per_iteration(kv_slot, it)
    k_tile = k_smem.index(kv_slot).reshape([BLOCK_N, HEAD_DIM_PAD])
    k_rows = k_tile.slice(ROW0, ROWS)
    v_rows = v_smem.index(kv_slot).reshape([BLOCK_N, HEAD_DIM_V_PAD]).slice(ROW0, ROWS)
    slot, q, do, sT, dpT = _scores(k_rows, v_rows, q_smem, do_smem, q_ready, it, s_zero, BLOCK_M, HEAD_DIM_PAD,
                                   STAGES, HEAD_DIM_V_PAD, QK_LANES)
    dk, dv, dsT, pT_op, dsT_op = _dkdv_products(sT, dpT, q, do, lse_smem.index(slot), delta_smem.index(slot),
                                                dk, dv, s_zero, rows_k, k0, m0, band, seqlen_q, scale_log2, site,
                                                drop, op_layout, v_op_layout, SCORE, DQ_REDUCE, DROPOUT,
                                                _positions(lse_smem, STAGES, SCORE))
    if DQ_REDUCE:
        # dS and the fp32 dQ staging have two buffers each: one written here was last read two
        # blocks ago (dS by that block's dQ product, the staging by its reduce, which
        # store_wait(1) leaves done), so two barriers per block order it all.
        buf = it % 2
        ds_smem.index(buf).store(dsT)
        fence_async_shared()
        tma.store_wait(1)
        gl.thread_barrier()  # dS written by both warpgroups; the staging buffer free
        # The block's dQ share: the two warpgroups take half the head dim each.
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM_PAD], gl.float32, _wgmma_layout(HEAD_DIM_PAD, 1, 2))
        dq = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_tile, dq_zero, use_acc=False)
        _add_dq(dq * softmax_scale, dq_smem.index(buf), dq_desc, batch, m0, head)
    dv, dk, pT_op, dsT_op = warpgroup_mma_wait(0, deps=[dv, dk, pT_op, dsT_op])
    mbarrier.arrive(q_empty.index(slot))
    return dk, dv


@gluon.jit
def _kv_consumers_split_d(bufs, walk, row_stats, dk_desc, dv_desc, ds_smem, p_smem, softmax_scale, scale_log2,
                          score_args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                          STAGES: gl.constexpr, PERSISTENT: gl.constexpr, SCORE: gl.constexpr,
                          HEAD_DIM_V_PAD: gl.constexpr,
                          QK_LANES: gl.constexpr):
    """SPLIT_D (d256, where one warpgroup's registers do not hold dK and dV of 64 rows): both
    consumer warpgroups, one partition of 8 warps, own the same 64 K/V rows and half the head
    dim each; each computes S^T and dP^T for half of the Q block's rows, and P^T and dS^T meet
    in shared memory (two buffers each: one written here was last read two blocks ago), where
    both read them whole for their half of dV and dK: one barrier per block.

    Each Q block's lse and D are loaded from global memory one block ahead (the registers have
    room for them here, and that is faster than through the ring)."""
    k_smem, v_smem, q_smem, do_smem, tile_ids = bufs.a, bufs.b, bufs.c, bufs.d, bufs.tile_ids
    kv_ready, kv_empty, q_ready, q_empty = bufs.stationary_ready, bufs.stationary_empty, bufs.ring_ready, bufs.ring_empty
    num_tiles, group, seqlen_q = walk.num_tiles, walk.group, walk.seqs.seqlen_q
    LSE, DELTA, slb, slh = row_stats.LSE, row_stats.DELTA, row_stats.slb, row_stats.slh
    SLOTS: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M, 1, 2)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM_PAD, 1, 2)
    v_acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM_V_PAD, 1, 2)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    it = 0  # streamed blocks consumed so far: ring slot and mbarrier phase
    tile_i = 0
    t = read_tile(tile_ids, tile_i, kv_ready, SLOTS)  # the tile's K and V landed
    while t < num_tiles:
        batch, head_k, n0, kv_slot, k_block, v_block, band, _ = _kv_tile(t, tile_i, walk, k_smem, v_smem, BLOCK_M,
                                                                          BLOCK_N)
        dlo, dhi, lo, full_lo, full_hi, n_blocks = band
        k_tile = k_block.reshape([BLOCK_N, HEAD_DIM_PAD])
        v_tile = v_block.reshape([BLOCK_N, HEAD_DIM_V_PAD])
        rows_k = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([BLOCK_N, HEAD_DIM_PAD], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM_V_PAD], gl.float32, v_acc_layout)
        stats = batch.to(gl.int64) * slb + head_k * group * slh
        lse, delta = _column_stats(LSE, DELTA, stats, lo + offs_m, seqlen_q, n_blocks > 0)
        for g in range(group):
            for i in range(n_blocks):
                m0 = lo + i * BLOCK_M
                slot, q, do, sT, dpT = _scores(k_tile, v_tile, q_smem, do_smem, q_ready, it, s_zero, BLOCK_M,
                                               HEAD_DIM_PAD, STAGES, HEAD_DIM_V_PAD, QK_LANES)
                # The next block's: this head's next one, or the next head's first.
                next_head = (i + 1) // n_blocks
                next_stats = stats + next_head * slh
                next_cols = lo + (i + 1 - next_head * n_blocks) * BLOCK_M + offs_m
                lse_next, delta_next = _column_stats(LSE, DELTA, next_stats, next_cols, seqlen_q,
                                                     g + next_head < group)
                sT = warpgroup_mma_wait(1, deps=[sT])
                site = (batch, head_k * group + g, walk.seqs.seqlen_k - seqlen_q, score_args)
                pT, pT_ds = _probs_t(sT, lse, rows_k, n0, m0, (dlo, dhi, full_lo, full_hi), seqlen_q, scale_log2,
                                     site, SCORE, True, False)
                dpT = warpgroup_mma_wait(0, deps=[dpT])
                buf = it % 2
                p_smem.index(buf).store(pT.to(dtype))
                dsT = _ds_t(pT_ds, dpT, delta, rows_k, m0, (dlo, dhi, full_lo, full_hi), seqlen_q, 1.0, True)
                ds_smem.index(buf).store(dsT.to(dtype))
                fence_async_shared()
                gl.thread_barrier()  # both warpgroups' halves of P^T and dS^T written
                dv = warpgroup_mma(p_smem.index(buf), do, dv, is_async=True)
                dk = warpgroup_mma(ds_smem.index(buf), q, dk, is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
                mbarrier.arrive(q_empty.index(slot))
                lse, delta, stats = lse_next, delta_next, next_stats
                it += 1
        _store_dkdv(dk, dv, k_tile, v_tile, k_block, v_block, dk_desc, dv_desc, batch, n0, head_k, softmax_scale)
        release(kv_empty, kv_slot)
        tile_i += 1
        t = read_next_tile(tile_ids, tile_i, kv_ready, num_tiles, SLOTS, PERSISTENT)


@gluon.jit
def _kv_consumers_shared_scores(buf, walk, stats, dk_desc, dv_desc, p_smem, ds_smem, staging, dq_desc, softmax_scale,
                                scale_log2, score_args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
                                SCORE: gl.constexpr):
    """The single pass with 128-row Q blocks (FlashAttention-3's d64 tiles: 128 x 128), both
    consumer warpgroups one partition: each computes S^T and dP^T of all BLOCK_N key rows against
    half the Q block's columns (so a thread holds the lse and D of 16 columns, not 32), and P^T
    and dS^T meet in shared memory, from where every gradient product reads them: dV and dK (64
    key rows per warpgroup) and the block's dQ share (64 query rows per warpgroup), added by TMA
    reduce-add.  Two barriers per block: P^T and dS^T written (and the previous reduce done
    reading the dQ staging), dQ staged (and, each warpgroup having waited for its products,
    P^T and dS^T read: the next block may overwrite them)."""
    k_smem, v_smem, q_smem, do_smem, tile_ids = buf.a, buf.b, buf.c, buf.d, buf.tile_ids
    kv_ready, kv_empty, q_ready, q_empty = buf.stationary_ready, buf.stationary_empty, buf.ring_ready, buf.ring_empty
    num_tiles, group, seqlen_q = walk.num_tiles, walk.group, walk.seqs.seqlen_q
    lse_smem, delta_smem = stats.lse_smem, stats.delta_smem
    SLOTS: gl.constexpr = k_smem.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M, 1, 2)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM_PAD, 2, 1)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM_PAD], gl.float32, acc_layout)
    it = 0  # streamed blocks consumed so far: ring slot and mbarrier phase
    tile_i = 0
    t = read_tile(tile_ids, tile_i, kv_ready, SLOTS)  # the tile's K and V landed
    while t < num_tiles:
        batch, head_k, n0, kv_slot, k_block, v_block, band, _ = _kv_tile(t, tile_i, walk, k_smem, v_smem, BLOCK_M,
                                                                          BLOCK_N)
        dlo, dhi, lo, full_lo, full_hi, n_blocks = band
        rows_k = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([BLOCK_N, HEAD_DIM_PAD], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM_PAD], gl.float32, acc_layout)
        for g in range(group):
            head = head_k * group + g
            for i in range(n_blocks):
                m0 = lo + i * BLOCK_M
                # K and V's slot as this iteration's value: their wgmma descriptors are not held
                # across the loop (_per_iteration; no spills, against 156 bytes without).
                slot_i = _per_iteration(kv_slot, it)
                k_tile = k_smem.index(slot_i).reshape([BLOCK_N, HEAD_DIM_PAD])
                v_tile = v_smem.index(slot_i).reshape([BLOCK_N, HEAD_DIM_PAD])
                slot, q, do, sT, dpT = _scores(k_tile, v_tile, q_smem, do_smem, q_ready, it, s_zero, BLOCK_M,
                                               HEAD_DIM_PAD, STAGES, HEAD_DIM_PAD, HEAD_DIM_PAD)
                lse = lse_smem.index(slot).load(cols_layout) * LOG2E
                sT = warpgroup_mma_wait(1, deps=[sT])
                site = (batch, head, walk.seqs.seqlen_k - seqlen_q, score_args)
                pT, pT_ds = _probs_t(sT, lse, rows_k, n0, m0, (dlo, dhi, full_lo, full_hi), seqlen_q, scale_log2,
                                     site, SCORE, False, True)
                p_smem.store(pT.to(dtype))
                delta = delta_smem.index(slot).load(cols_layout)
                dpT = warpgroup_mma_wait(0, deps=[dpT])
                dsT = _ds_t(pT_ds, dpT, delta, rows_k, m0, (dlo, dhi, full_lo, full_hi), seqlen_q, 1.0, False)
                ds_smem.store(dsT.to(dtype))
                fence_async_shared()
                tma.store_wait(0)  # the previous block's reduce has read the staging buffer
                gl.thread_barrier()  # both warpgroups' halves of P^T and dS^T written
                dv = warpgroup_mma(p_smem, do, dv, is_async=True)
                dk = warpgroup_mma(ds_smem, q, dk, is_async=True)
                dq = warpgroup_mma(ds_smem.permute((1, 0)), k_tile, dq_zero, use_acc=False)
                dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
                mbarrier.arrive(q_empty.index(slot))
                _add_dq(dq * softmax_scale, staging, dq_desc, batch, m0, head)
                it += 1
        _store_dkdv(dk, dv, k_block.reshape([BLOCK_N, HEAD_DIM_PAD]), v_block.reshape([BLOCK_N, HEAD_DIM_PAD]),
                    k_block, v_block, dk_desc, dv_desc, batch, n0, head_k, softmax_scale)
        release(kv_empty, kv_slot)
        tile_i += 1
        t = read_next_tile(tile_ids, tile_i, kv_ready, num_tiles, SLOTS, PERSISTENT)
    tma.store_wait(0)


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, DELTA, slb, slh, num_tiles,
                 heads_k, group, head_group, seqlen_q, seqlen_k, window_left, window_right, softmax_scale, scale_log2,
                 counter, score_args, CU_Q, CU_K, totals, TILES, COUNT, m_blocks, DK, DV, sgs, sgh, svs, svh, head_dims,
                 SEED, dropout_p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                 STAGES: gl.constexpr, SLOTS: gl.constexpr, DQ_REDUCE: gl.constexpr, SPLIT_D: gl.constexpr,
                 SHARED_SCORES: gl.constexpr, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr, SCORE: gl.constexpr,
                 VARLEN: gl.constexpr, DROPOUT: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
                 QK_LANES: gl.constexpr):
    """VARLEN (the two passes up to d128): packed sequences, their tiles listed in TILES (COUNT
    entries, packed_tiles.py), the tensors seen by TMA as (1, total, heads, head dim); dK and dV
    of a tile running past its sequence leave by pointer (DK, DV: row and head strides sgs, sgh and svs, svh;
    ``head_dims``: Q's head dim in the low 16 bits, V's in the high ones).  V, dO and dV are of
    V's head dim (HEAD_DIM_V_PAD; the two passes, not the single one)."""
    gl.static_assert(not (DQ_REDUCE and HEAD_DIM_V_PAD != HEAD_DIM_PAD), "a V head dim of its own: the two passes")
    # The two passes: a partition per consumer warpgroup; SPLIT_D and DQ_REDUCE: one of both.
    ONE_PARTITION: gl.constexpr = SPLIT_D or DQ_REDUCE
    gl.static_assert(not (VARLEN and ONE_PARTITION), "packed sequences: the two passes up to d128")
    gl.static_assert(not (DROPOUT and ONE_PARTITION), "dropout: the two passes up to d128")
    dropped = (SEED, dropout_p)
    # The stationary pair is K and V, the streamed one Q and dO.
    buf = PassBuffers.allocate(k_desc, v_desc, q_desc, do_desc, q_desc, do_desc, STAGES, 1 if ONE_PARTITION else 2,
                               SLOTS, RING_PAIR)
    if VARLEN:  # the packed list's length, written on the device
        num_tiles = gl.load(COUNT) * heads_k
    score_args = values(score_args)  # an ALiBi batch stride of 1 comes specialised
    walk = PassWalk(num_tiles, heads_k, group, head_group, seqlen_q, seqlen_k, window_left, window_right, CU_Q, CU_K,
                    totals, TILES, m_blocks, VARLEN)
    packed_grads = (DK, DV, sgs, sgh, svs, svh, head_dims)
    if SPLIT_D:
        # dS^T and P^T of both warpgroups, two buffers each.
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], _SCORES_LAYOUT)
        p_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], _SCORES_LAYOUT)
        stats = RowStats(LSE, DELTA, buf.a, buf.a, slb, slh)  # (lse and D loaded from global memory here)
        gl.warp_specialize([
            (_kv_consumers_split_d, (buf, walk, stats, dk_desc, dv_desc, ds_smem, p_smem, softmax_scale, scale_log2,
                                     score_args, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES, PERSISTENT, SCORE,
                                     HEAD_DIM_V_PAD, QK_LANES)),
            (_producer, (k_desc, v_desc, q_desc, do_desc, q_desc, do_desc, buf, walk, stats, counter, BLOCK_N, BLOCK_M,
                         STAGES, True, False, PERSISTENT, DYNAMIC, RING_PAIR)),
        ], [1], [PRODUCER_REGS])
    else:
        # lse and D of each streamed block, in the ring beside it (SPLIT_D's: _kv_consumers_split_d).
        lse_smem = gl.allocate_shared_memory(gl.float32, [_lse_rows(STAGES, SCORE), BLOCK_M], _STATS_LAYOUT)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], _STATS_LAYOUT)
        stats = RowStats(LSE, DELTA, lse_smem, delta_smem, slb, slh)
        if SHARED_SCORES:
            # P^T and dS^T of both warpgroups, and the fp32 dQ block the TMA reduce reads.
            p_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N, BLOCK_M], _SCORES_LAYOUT)
            ds_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N, BLOCK_M], _SCORES_LAYOUT)
            staging = gl.allocate_shared_memory(dq_desc.dtype, dq_desc.block_type.shape, dq_desc.layout)
            gl.warp_specialize([
                (_kv_consumers_shared_scores, (buf, walk, stats, dk_desc, dv_desc, p_smem, ds_smem, staging, dq_desc,
                                               softmax_scale, scale_log2, score_args, BLOCK_M, BLOCK_N, HEAD_DIM_PAD,
                                               STAGES, PERSISTENT, SCORE)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, q_desc, do_desc, buf, walk, stats, counter, BLOCK_N,
                             BLOCK_M, STAGES, True, True, PERSISTENT, DYNAMIC, RING_PAIR)),
            ], [1], [PRODUCER_REGS])
        elif DQ_REDUCE:
            # dS^T of both warpgroups and the fp32 dQ block the TMA reduce reads, two buffers each.
            ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], _SCORES_LAYOUT)
            dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [2] + dq_desc.block_type.shape, dq_desc.layout)
            gl.warp_specialize([
                (_kv_consumer, (0, 2, buf, walk, stats, dk_desc, dv_desc, ds_smem, dq_smem, dq_desc, packed_grads,
                                softmax_scale, scale_log2, score_args, dropped, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES,
                                True, PERSISTENT, SCORE, DROPOUT, HEAD_DIM_V_PAD, QK_LANES)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, q_desc, do_desc, buf, walk, stats, counter, BLOCK_N,
                             BLOCK_M, STAGES, True, True, PERSISTENT, DYNAMIC, RING_PAIR)),
            ], [1], [PRODUCER_REGS])
        else:  # (buf.a stands for the buffers only DQ_REDUCE reads)
            gl.warp_specialize([
                (_kv_consumer, (0, 1, buf, walk, stats, dk_desc, dv_desc, buf.a, buf.a, dq_desc, packed_grads,
                                softmax_scale, scale_log2, score_args, dropped, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES,
                                False, PERSISTENT, SCORE, DROPOUT, HEAD_DIM_V_PAD, QK_LANES)),
                (_kv_consumer, (1, 1, buf, walk, stats, dk_desc, dv_desc, buf.a, buf.a, dq_desc, packed_grads,
                                softmax_scale, scale_log2, score_args, dropped, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES,
                                False, PERSISTENT, SCORE, DROPOUT, HEAD_DIM_V_PAD, QK_LANES)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, q_desc, do_desc, buf, walk, stats, counter, BLOCK_N,
                             BLOCK_M, STAGES, True, True, PERSISTENT, DYNAMIC, RING_PAIR)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _dq_row_stats(O, sob, sos, soh, head_dim, LSE, DLSE, DELTA, slb, slh, batch, head, m0, seqlen_q, start, do,
                  rows_layout: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                  HAS_DLSE: gl.constexpr, WARPS: gl.constexpr):
    """BLOCK_M query rows of the dQ pass from m0 (of the sequence from row ``start``), their lse
    (log2 units) and D = rowsum(dO * O) - dlse, also written for the dK/dV pass, by a partition of
    WARPS warps (``do``: the rows' dO, landed; ``head_dim``, HEAD_DIM_PAD: O's and dO's)."""
    tile_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    tile_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, tile_layout))
    offs_d = gl.arange(0, HEAD_DIM_PAD, layout=gl.SliceLayout(0, tile_layout))
    o_ptrs = (O + batch.to(gl.int64) * sob + (start + tile_rows)[:, None].to(gl.int64) * sos + head * soh
              + offs_d[None, :])
    o = gl.load(o_ptrs, mask=(tile_rows[:, None] < seqlen_q) & (offs_d[None, :] < head_dim), other=0.0)
    stats = batch.to(gl.int64) * slb + head * slh + start
    delta = row_delta(o, do.load(tile_layout), DLSE, stats + tile_rows, tile_rows, seqlen_q, HAS_DLSE)
    gl.store(DELTA + stats + tile_rows, delta, mask=tile_rows < seqlen_q)
    rows = m0 + gl.arange(0, BLOCK_M, layout=rows_layout)
    delta = gl.convert_layout(delta, rows_layout)
    # Rows past the sequence read lse = +inf: their probabilities are exactly 0.
    lse = gl.load(LSE + stats + rows, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    return rows, lse, delta


@gluon.jit
def _in_band(x, rows, n0, band, seqlen_k, BLOCK_N: gl.constexpr, col_layout: gl.constexpr):
    """``x`` (the dQ pass's rows x the K/V block from n0) with 0 outside the band, where the block
    crosses an edge of it."""
    dlo, dhi, full_lo, full_hi = band
    if (n0 < full_lo) | (n0 >= full_hi):
        cols = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
        x = gl.where(band_rows_mask(rows, cols, seqlen_k, dlo, dhi), x, 0.0)
    return x


@gluon.jit
def _probs(s, lse, rows, q0, n0, band, seqlen_k, scale_log2, site, BLOCK_N: gl.constexpr, col_layout: gl.constexpr,
           SCORE: gl.constexpr):
    """P of one K/V block in the dQ pass from S (query rows ``rows`` from q0; through the score
    hook), and P f' (as _probs_t; a distance bias's query part goes into lse, its key part is
    the block's columns')."""
    cols = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
    unit = score.exp_scale(scale_log2, site, SCORE)
    if score.splits_distance(SCORE):
        side = score.diagonal_side(n0, n0 + BLOCK_N - 1, q0, q0 + s.shape[0] - 1, site[2])
        crossing = side == 0.0
        side += crossing.to(gl.float32)  # the left side's split, and crossing_part
        slope = score.distance_slope(site, SCORE) * unit  # log2 units
        key_part = (slope * side) * (cols - n0).to(gl.float32)
        lse_part = lse - (slope * side) * (n0 - site[2] - rows).to(gl.float32)
        x, t = score.biased_inner_logits(s, scale_log2, unit, key_part[None, :], rows[:, None], cols[None, :], site,
                                         SCORE)
        if crossing:
            x += score.crossing_part(rows[:, None], cols[None, :], site[2], slope)
        p = _in_band(gl.exp2(x - lse_part[:, None]), rows, n0, band, seqlen_k, BLOCK_N, col_layout)
        return p, score.inner_grad(p, t, rows[:, None], cols[None, :], site, SCORE)
    else:
        y = score.logits(s, scale_log2, rows[:, None], cols[None, :], site, SCORE)
        p = _in_band(gl.exp2(y * unit - lse[:, None]), rows, n0, band, seqlen_k, BLOCK_N, col_layout)
        return p, score.grad(p, y, rows[:, None], cols[None, :], site, SCORE)


@gluon.jit
def _ds(p_ds, dp, delta, n0, band, dp_scale):
    """dS = P f' (dP - D), with respect to the scaled scores (``p_ds``: P f', _probs; dP the
    product times ``dp_scale``: 1, or the float8 pass's descales); where the block crosses an
    edge of the band, a pair of probability 0 (outside it) adds nothing, even where dP or D is
    not finite."""
    ds = p_ds * (dp * dp_scale - delta[:, None])
    dlo, dhi, full_lo, full_hi = band
    if (n0 < full_lo) | (n0 >= full_hi):
        ds = gl.where(p_ds == 0.0, 0.0, ds)
    return ds


@gluon.jit
def _store_dq(dq, q, q_smem, dq_desc, batch, m0, head, softmax_scale):
    """Q is no longer read: its buffer stages dQ for the TMA store."""
    q.store((dq * softmax_scale).to(q.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [batch, m0, head, 0], q_smem)
    tma.store_wait(0)


@gluon.jit
def _q_tile(t, tile_i, walk, q_smem, do_smem, WHICH: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
            HEAD_DIM_PAD: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr):
    """Tile ``t`` of the dQ pass (BLOCK_M query rows), the CTA's ``tile_i``-th: (batch, head, first
    row, its sequence (PassWalk.tile), its stationary slot, the Q block there, and the first row,
    Q and dO of consumer WHICH's ROWS rows)."""
    batch, head, m0, seq = walk.tile(t, BLOCK_M, False)
    q_slot = buffer_of(tile_i, q_smem.shape[0])[0]
    q_block = q_smem.index(q_slot)
    q = q_block.reshape([BLOCK_M, HEAD_DIM_PAD]).slice(WHICH * ROWS, ROWS)
    do = do_smem.index(q_slot).reshape([BLOCK_M, HEAD_DIM_V_PAD]).slice(WHICH * ROWS, ROWS)
    return batch, head, m0, seq, q_slot, q_block, m0 + WHICH * ROWS, q, do


@gluon.jit
def _dq_consumers(WHICH: gl.constexpr, bufs, walk, row_stats, delta_in, ds_smem, dq_desc, packed_grads, softmax_scale,
                  scale_log2, score_args, dropped, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, HAS_DLSE: gl.constexpr, SPLIT_D: gl.constexpr,
                  PERSISTENT: gl.constexpr, SCORE: gl.constexpr, DROPOUT: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
                  QK_LANES: gl.constexpr):
    """Consumer warpgroup WHICH, a partition of its own: dQ of query rows [64 * WHICH, 64 * WHICH +
    64) of each of the CTA's tiles, and their D.  With SPLIT_D (d256) both warpgroups are one
    partition (WHICH 0) and own the tile's 64 rows, half the head dim of dQ each; S and dP are
    split by K/V rows and dS meets in shared memory (two buffers, one barrier per block).  Packed
    sequences: rows running past the tile's sequence leave by pointer (``packed_grads``: dQ,
    its row and head strides, the head dims: Problem.head_dims).  DROPOUT: dS takes the kept dP,
    scaled (``dropped``: the seed
    pointer and the rate)."""
    q_smem, do_smem, k_smem, v_smem, tile_ids = bufs.a, bufs.b, bufs.c, bufs.d, bufs.tile_ids
    q_ready, q_empty, kv_ready, kv_empty = bufs.stationary_ready, bufs.stationary_empty, bufs.ring_ready, bufs.ring_empty
    num_tiles = walk.num_tiles  # (the sequence's lengths: each tile's)
    window_left, window_right = walk.window_left, walk.window_right
    LSE, DELTA, slb, slh = row_stats.LSE, row_stats.DELTA, row_stats.slb, row_stats.slh
    O, sob, sos, soh, DLSE = delta_in.O, delta_in.sob, delta_in.sos, delta_in.soh, delta_in.DLSE
    head_dim_v = delta_in.head_dim
    SLOTS: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = WARPGROUP_ROWS
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N, 1, 2 if SPLIT_D else 1)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM_PAD, 1, 2 if SPLIT_D else 1)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    j = 0  # streamed blocks consumed so far: ring slot and mbarrier phase
    tile_i = 0
    t = read_tile(tile_ids, tile_i, q_ready, SLOTS)  # the tile's Q and dO landed
    while t < num_tiles:
        batch, head, m0, seq, q_slot, q_block, r0, q, do = _q_tile(t, tile_i, walk, q_smem, do_smem, WHICH, ROWS,
                                                                   BLOCK_M, HEAD_DIM_PAD, HEAD_DIM_V_PAD)
        coord_b, q_start, k_start, seqlen_q, seqlen_k = seq
        rows, lse, delta = _dq_row_stats(O, sob, sos, soh, head_dim_v, LSE, DLSE, DELTA, slb, slh, batch, head,
                                         r0, seqlen_q, q_start, do, gl.SliceLayout(1, s_layout), ROWS, HEAD_DIM_V_PAD,
                                         HAS_DLSE, 8 if SPLIT_D else 4)
        dq = gl.zeros([ROWS, HEAD_DIM_PAD], gl.float32, acc_layout)
        site = (batch, head, seqlen_k - seqlen_q, score_args)
        drop = dropout.stream_of(dropped[0], batch, head, walk.heads, dropped[1], DROPOUT)
        # The band of the whole tile's rows: both warpgroups step through the same blocks.
        dlo, dhi, lo, full_lo, full_hi, n_blocks = band_blocks(m0, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k,
                                                               window_left, window_right, False)
        for i in range(n_blocks):
            n0 = lo + i * BLOCK_N
            slot, k, v, s, dp = _scores(q, do, k_smem, v_smem, kv_ready, j, s_zero, BLOCK_N, HEAD_DIM_PAD, STAGES,
                                        HEAD_DIM_V_PAD, QK_LANES)
            s = warpgroup_mma_wait(1, deps=[s])
            p, p_ds = _probs(s, lse, rows, r0, n0, (dlo, dhi, full_lo, full_hi), seqlen_k, scale_log2, site, BLOCK_N,
                             gl.SliceLayout(0, s_layout), SCORE)
            dp = warpgroup_mma_wait(0, deps=[dp])
            if DROPOUT:
                kept = dropout.kept_mma(drop[0], drop[1], rows, n0, drop[2], BLOCK_N, s_layout)
                dp = gl.where(kept, dp * (1.0 / (1.0 - drop[2])), 0.0)
            ds = _ds(p_ds, dp, delta, n0, (dlo, dhi, full_lo, full_hi), 1.0).to(dtype)
            if SPLIT_D:
                buf = j % 2
                ds_smem.index(buf).store(ds)
                fence_async_shared()
                gl.thread_barrier()  # both warpgroups' halves of dS written
                dq = warpgroup_mma(ds_smem.index(buf), k, dq, is_async=True)
                dq = warpgroup_mma_wait(0, deps=[dq])
            else:
                ds_op = gl.convert_layout(ds, op_layout)
                dq = warpgroup_mma(ds_op, k, dq, is_async=True)
                dq, ds_op = warpgroup_mma_wait(0, deps=[dq, ds_op])
            mbarrier.arrive(kv_empty.index(slot))
            j += 1
        if walk.seqs.VARLEN:  # (batched launches compile the staged store alone)
            if r0 + ROWS > seqlen_q:
                DQ, sgs, sgh, head_dims = packed_grads
                _store_rows(dq * softmax_scale, DQ, q_start + r0, seqlen_q - r0, head, sgs, sgh, head_dims & 0xFFFF)
            else:
                _store_dq(dq, q, q_block.slice(WHICH * ROWS, ROWS, dim=1), dq_desc, coord_b, q_start + r0, head,
                          softmax_scale)
        else:
            _store_dq(dq, q, q_block.slice(WHICH * ROWS, ROWS, dim=1), dq_desc, batch, r0, head, softmax_scale)
        release(q_empty, q_slot)
        tile_i += 1
        t = read_next_tile(tile_ids, tile_i, q_ready, num_tiles, SLOTS, PERSISTENT)


@gluon.jit
def _dq_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, O, sob, sos, soh, head_dims, LSE, DLSE, DELTA, slb, slh,
               num_tiles, heads_q, group, head_group, seqlen_q, seqlen_k, window_left, window_right, softmax_scale,
               scale_log2, counter, score_args, CU_Q, CU_K, totals, TILES, COUNT, m_blocks, DQ, sgs, sgh,
               SEED, dropout_p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, SLOTS: gl.constexpr, HAS_DLSE: gl.constexpr,
               SPLIT_D: gl.constexpr, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr, SCORE: gl.constexpr,
               VARLEN: gl.constexpr, DROPOUT: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
               QK_LANES: gl.constexpr):
    """VARLEN: as _dkdv_kernel's, dQ of a tile running past its sequence by pointer (DQ).
    ``head_dims`` and HEAD_DIM_V_PAD as _dkdv_kernel's (O, dO and V of V's head dim)."""
    gl.static_assert(not (VARLEN and SPLIT_D), "packed sequences: the two passes up to d128")
    gl.static_assert(not (DROPOUT and SPLIT_D), "dropout: the two passes up to d128")
    dropped = (SEED, dropout_p)
    # With SPLIT_D both consumer warpgroups are one partition; else each is its own.  The
    # stationary pair is Q and dO, the streamed one K and V.
    buf = PassBuffers.allocate(q_desc, do_desc, k_desc, v_desc, k_desc, v_desc, STAGES, 1 if SPLIT_D else 2, SLOTS,
                               RING_PAIR)
    if VARLEN:  # the packed list's length, written on the device
        num_tiles = gl.load(COUNT) * heads_q
    score_args = values(score_args)  # an ALiBi batch stride of 1 comes specialised
    walk = PassWalk(num_tiles, heads_q, group, head_group, seqlen_q, seqlen_k, window_left, window_right, CU_Q, CU_K,
                    totals, TILES, m_blocks, VARLEN)
    packed_grads = (DQ, sgs, sgh, head_dims)
    stats = RowStats(LSE, DELTA, buf.a, buf.a, slb, slh)  # (the dQ pass reads no statistics from the ring)
    delta_in = DeltaInputs(O, sob, sos, soh, head_dims >> 16, DLSE)
    if SPLIT_D:
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, BLOCK_N], _SCORES_LAYOUT)  # both halves
        gl.warp_specialize([
            (_dq_consumers, (0, buf, walk, stats, delta_in, ds_smem, dq_desc, packed_grads, softmax_scale,
                             scale_log2, score_args, dropped, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES, HAS_DLSE,
                             SPLIT_D, PERSISTENT, SCORE, DROPOUT, HEAD_DIM_V_PAD, QK_LANES)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, k_desc, v_desc, buf, walk, stats, counter, BLOCK_M, BLOCK_N,
                         STAGES, False, False, PERSISTENT, DYNAMIC, RING_PAIR)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_dq_consumers, (0, buf, walk, stats, delta_in, buf.a, dq_desc, packed_grads, softmax_scale, scale_log2,
                             score_args, dropped, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES, HAS_DLSE, SPLIT_D,
                             PERSISTENT, SCORE, DROPOUT, HEAD_DIM_V_PAD, QK_LANES)),
            (_dq_consumers, (1, buf, walk, stats, delta_in, buf.a, dq_desc, packed_grads, softmax_scale, scale_log2,
                             score_args, dropped, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES, HAS_DLSE, SPLIT_D,
                             PERSISTENT, SCORE, DROPOUT, HEAD_DIM_V_PAD, QK_LANES)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, k_desc, v_desc, buf, walk, stats, counter, BLOCK_M, BLOCK_N,
                         STAGES, False, False, PERSISTENT, DYNAMIC, RING_PAIR)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def backward(plan, p, dout, dlse, q, k, v, out, lse, saved):
    """dq, dk, dv by the plan's kernels: the two passes ("v3-gluon") or the single pass adding dQ
    by TMA reduce-add ("v3-gluon-reduce").  ``dlse`` (gradient reaching the logsumexp) may be None."""
    q, k, v, dout = (tma_host.ready(x) for x in (q, k, v, dout))
    dq_reduce = plan.kernel == "v3-gluon-reduce"
    if dq_reduce:
        _check_single_pass(p)
    # Everything but the tensors' addresses fixes the launches' arguments: the tensors TMA reads
    # are aligned (ready), the gradients fresh; out, lse and dlse come from outside: their alignment.
    kind = (plan.config, dq_reduce, q.dtype, q.stride(), k.stride(), v.stride(), dout.stride(), out.stride(),
            lse.stride(), tuple(x.data_ptr() % 16 == 0 for x in (out, lse)),
            None if dlse is None else dlse.data_ptr() % 16 == 0, q.device.index)
    launches = _backward_launches(p, *kind)
    if dq_reduce:
        return _single_pass(launches, p, dout, dlse, q, k, v, out, lse)
    return _two_passes(launches, p, dout, dlse, q, k, v, out, lse)


class PassTiles(NamedTuple):
    """A pass's tiles as its kernel takes them besides their count (pass_count): for packed
    sequences their list, its length on the device, and the blocks a sequence may have
    (placeholders batched, never read)."""
    tiles: torch.Tensor
    listed: torch.Tensor
    m_blocks: int


def pass_count(p, rows, heads, keys) -> int:
    """How many tiles of ``rows`` stationary rows a pass has (packed: at most)."""
    if p.varlen:
        return packed_tiles.entries(p, rows, keys) * heads
    return p.batch * heads * (p.key_blocks(rows) if keys else p.query_blocks(rows))


def pass_tiles(p, rows, keys, device) -> PassTiles:
    """The tiles of ``rows`` stationary query rows (``keys``: key rows)."""
    if p.varlen:
        tiles, listed = packed_tiles.tile_list(p, rows, device, keys)
        return PassTiles(tiles, listed, p.key_blocks(rows) if keys else p.query_blocks(rows))
    placeholder = p.cu_pointers(device)[0]
    return PassTiles(placeholder, placeholder, 1)


def _packed_views(p, *tensors):
    """Packed tensors (total, heads, head dim) as TMA sees them, (1, total, heads, head dim)."""
    return tuple(x.unsqueeze(0) for x in tensors) if p.varlen else tensors


def _two_passes(launches, p, dout, dlse, q, k, v, out, lse):
    dq, dk, dv = p.gradients(q, k, v)
    delta = torch.empty_like(lse)
    q4, k4, v4, dout4, dq4 = _packed_views(p, q, k, v, dout, dq)
    cu_q, cu_k = p.cu_pointers(q.device)
    dq_pass = launches.dq
    walked = dq_pass.walked(p, q.device)
    specs = dq_pass.specs
    dq_pass.launch(
        Descriptor(q4, *specs["q_desc"]), Descriptor(dout4, *specs["do_desc"]), Descriptor(k4, *specs["k_desc"]),
        Descriptor(v4, *specs["v_desc"]), Descriptor(dq4, *specs["dq_desc"]),
        out, *p.seq_strides(out), p.head_dims, lse, delta if dlse is None else dlse, delta,
        *p.row_stat_strides(lse), *dq_pass.walk,
        dq_pass.counter(lse.device), score.args_of(p), cu_q, cu_k, p.totals, walked.tiles, walked.listed,
        walked.m_blocks, dq, dq.stride(-3), dq.stride(-2), dropout.seed_argument(p, cu_q), p.dropout_p)
    # D, written by the dQ pass, is read here: launched after it on the same stream.
    _launch_dkdv(launches.dkdv, p, q, k, v, dout, lse, delta, dk, dv, None)
    return dq, dk, dv


def _check_single_pass(p):
    if split_head_dim(p.head_dim_pad):
        raise ValueError("the single-pass Gluon backward takes head dims up to 128")
    if p.own_head_dim_v:  # (D's kernel and the dQ staging take one head dim)
        raise ValueError("the single-pass Gluon backward takes one head dim for Q, K and V")


def _single_pass(launches, p, dout, dlse, q, k, v, out, lse):
    """dq, dk, dv in one K/V-stationary pass, FlashAttention-3's: each Q block's dQ share added
    in fp32 by TMA reduce-add (summation order varies from run to run), after D = rowsum(dO * O)
    - dlse (delta_of).  Head dims up to 128 (the fp32 dQ staging of SPLIT_D's 64-row blocks does
    not fit in shared memory next to its operands: _check_single_pass)."""
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    delta = delta_of(p, out, dout, dlse, lse, dq_acc)
    _launch_dkdv(launches.dkdv, p, q, k, v, dout, lse, delta, dk, dv, dq_acc)
    return dq_acc.to(q.dtype), dk, dv


@triton.jit
def _delta_kernel(O, DO, DLSE, DELTA, DQACC, sob, sos, soh, sdb, sds, sdh, slb, slh, sqb, sqs, sqh, seqlen_q,
                  heads_q, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  HAS_DLSE: tl.constexpr, ZERO_DQ: tl.constexpr):
    """D = rowsum(dO * O) - dlse for the rows of one block, before the single pass (or the float8
    passes), and with ZERO_DQ the rows' float32 dQ accumulator zeroed for the single pass's
    reduce-adds (no memset launch of its own)."""
    bh = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    batch = (bh // heads_q).to(tl.int64)
    head = (bh % heads_q).to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = load_tile(O + batch * sob + rows[:, None] * sos + head * soh + offs_d[None, :],
                  rows, seqlen_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, True)
    do = load_tile(DO + batch * sdb + rows[:, None] * sds + head * sdh + offs_d[None, :],
                   rows, seqlen_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, True)
    stat = batch * slb + head * slh + rows
    tl.store(DELTA + stat, row_delta(o, do, DLSE, stat, rows, seqlen_q, HAS_DLSE), mask=rows < seqlen_q)
    if ZERO_DQ:
        tl.store(DQACC + batch * sqb + rows[:, None] * sqs + head * sqh + offs_d[None, :],
                 tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32),
                 mask=(rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))


def delta_of(p, out, dout, dlse, lse, dq_acc=None):
    """D = rowsum(dO * O) - dlse, for the single pass and the float8 passes (the two passes
    compute it in their dQ pass), and ``dq_acc`` zeroed where given."""
    delta = torch.empty_like(lse)
    zero_dq = dq_acc is not None
    if not zero_dq:
        dq_acc = out.new_empty(0, 0, 0, dtype=torch.float32)  # (never written)
    launch(
        _delta_kernel, (p.batch * p.heads_q, p.query_blocks(64)),
        out, dout, delta if dlse is None else dlse, delta, dq_acc, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), lse.stride(0), lse.stride(1), dq_acc.stride(0),
        dq_acc.stride(1), dq_acc.stride(2), p.seqlen_q, p.heads_q,
        HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad, BLOCK_M=64, HAS_DLSE=dlse is not None, ZERO_DQ=zero_dq,
        num_warps=4)
    return delta


def _launch_dkdv(kv_pass, p, q, k, v, dout, lse, delta, dk, dv, dq_acc):
    q4, k4, v4, dout4, dk4, dv4 = _packed_views(p, q, k, v, dout, dk, dv)
    specs = kv_pass.specs
    dk_desc = Descriptor(dk4, *specs["dk_desc"])
    walked = kv_pass.walked(p, q.device)
    cu_q, cu_k = p.cu_pointers(q.device)
    kv_pass.launch(
        Descriptor(q4, *specs["q_desc"]), Descriptor(k4, *specs["k_desc"]), Descriptor(v4, *specs["v_desc"]),
        Descriptor(dout4, *specs["do_desc"]), dk_desc, Descriptor(dv4, *specs["dv_desc"]),
        dk_desc if dq_acc is None else Descriptor(dq_acc, *specs["dq_desc"]),
        lse, delta, *p.row_stat_strides(lse), *kv_pass.walk, kv_pass.counter(lse.device), score.args_of(p), cu_q, cu_k,
        p.totals, walked.tiles, walked.listed, walked.m_blocks, dk, dv, dk.stride(-3), dk.stride(-2), dv.stride(-3),
        dv.stride(-2), p.head_dims, dropout.seed_argument(p, cu_q), p.dropout_p)


class _BackwardLaunches(NamedTuple):
    dq: "_PassLaunch"  # None for the single pass
    dkdv: "_PassLaunch"


@remembered
def _backward_launches(p, cfg, dq_reduce, dtype, q_strides, k_strides, v_strides, dout_strides, out_strides,
                       lse_strides, aligned, dlse_aligned, device_index) -> _BackwardLaunches:
    """The backward's launches for one kind of call (the arguments besides the problem: what fixes
    every launch argument's class; remembered where the problem holds no tensor)."""
    has_dlse = dlse_aligned is not None
    dq = None if dq_reduce else _PassLaunch(_dq_kernel, p, cfg, dtype, device_index, False, False, has_dlse)
    return _BackwardLaunches(dq, _PassLaunch(_dkdv_kernel, p, cfg, dtype, device_index, True, dq_reduce, has_dlse))


class _PassLaunch:
    """One pass's launch for a kind of call (_backward_launches): its grid and constexprs
    (launch.Prepared, vouched), the tensors' TMA blocks, and its walk's arguments from the tile count to the
    scale; ``walked`` and ``counter`` what each call takes anew (packed sequences' tile lists,
    the stream's tile counter)."""

    def __init__(self, kernel, p, cfg, dtype, device_index, keys, dq_reduce, has_dlse):
        pad, pad_v = p.head_dim_pad, p.head_dim_v_pad
        rows = gluon_bwd_stationary_rows(pad)
        block = cfg.kv_block_m if keys else cfg.dq_block_n  # the streamed tensors' rows
        heads = p.heads_k if keys else p.heads_q
        device = torch.device("cuda", device_index)
        count = pass_count(p, rows, heads, keys)
        self.schedule = pass_schedule(p, cfg, count, device, dq_reduce)
        self.rows, self.keys = rows, keys
        # The stationary tensors' blocks are ``rows`` rows, the streamed ones' ``block``; the
        # gradients (dQ; dK and dV) leave a consumer partition's rows at a time.
        q_rows, kv_rows = (block, rows) if keys else (rows, block)
        out_rows, grad_dtype = partition_rows(pad, dq_reduce), torch.float32 if p.fp8 else dtype  # (p.gradients')
        # Each tensor descriptor's (block_shape, layout, spec), by the kernel's parameter name.
        spec = tma_host.block_spec
        self.specs = dict(q_desc=spec(q_rows, pad, dtype), do_desc=spec(q_rows, pad_v, dtype),
                          k_desc=spec(kv_rows, pad, dtype), v_desc=spec(kv_rows, pad_v, dtype))
        out_spec = spec(out_rows, pad, grad_dtype)  # dQ's, or dK's
        if keys:  # dQ's: the single pass's fp32 accumulator, else dK's stands in (not read)
            self.specs.update(dk_desc=out_spec, dv_desc=spec(out_rows, pad_v, grad_dtype),
                              dq_desc=spec(block, pad, torch.float32) if dq_reduce else out_spec)
        else:
            self.specs.update(dq_desc=out_spec)
        if keys:
            streamed_bytes, batch_heads = p.group * p.seqlen_q * (pad + pad_v) * dtype.itemsize, p.batch * p.heads_k
        else:
            streamed_bytes, batch_heads = p.seqlen_k * (pad + pad_v) * dtype.itemsize, p.batch * p.heads_q
        self.walk = (count, heads, p.group, walk_head_group(p, count, batch_heads, streamed_bytes, device),
                     p.seqlen_q, p.seqlen_k, p.window_left, p.window_right, p.softmax_scale, p.scale_log2)
        common = dict(HEAD_DIM_PAD=pad, STAGES=cfg.num_stages, SPLIT_D=split_head_dim(pad), SCORE=score.mod_of(p),
                      VARLEN=p.varlen, DROPOUT=p.dropout, HEAD_DIM_V_PAD=pad_v, QK_LANES=configs.qk_lanes(p),
                      **self.schedule.constants())
        if keys:
            constants = dict(BLOCK_M=block, BLOCK_N=rows, DQ_REDUCE=dq_reduce,
                             SHARED_SCORES=shared_scores(cfg, pad, dq_reduce), **common,
                             **launch_options(pad, dq_reduce))
        else:
            constants = dict(BLOCK_M=rows, BLOCK_N=block, HAS_DLSE=has_dlse, **common, **launch_options(pad))
        self.launch = Prepared(kernel, (self.schedule.ctas,), (), constants, vouched=True)

    def walked(self, p, device) -> "PassTiles":
        return pass_tiles(p, self.rows, self.keys, device)

    def counter(self, device):
        return self.schedule.counter(device)


class Schedule(NamedTuple):
    """How a pass's CTAs take its tiles: ``ctas`` CTAs, each tile's stationary rows in one of
    ``slots`` shared-memory slots; with fewer CTAs than tiles each takes every ctas-th tile, or
    (``dynamic``) the next no CTA has taken, from an atomic counter (scheduler.next_tile)."""
    ctas: int
    slots: int
    persistent: bool
    dynamic: bool

    def constants(self):
        return dict(SLOTS=self.slots, PERSISTENT=self.persistent, DYNAMIC=self.dynamic)

    def counter(self, device):
        """The tile counter of the current stream (dynamic), else a stand-in never read."""
        return tile_counter(device) if self.dynamic else no_counter(device)


def pass_schedule(p, cfg, tiles, device, dq_reduce=False) -> Schedule:
    """The schedule of a pass of ``tiles`` tiles.  Up to d128 in the two passes, more tiles than
    SMs: a CTA per SM (the most that fit), two slots for the stationary tile, so that a tile's
    loads and its predecessor's stores overlap the streaming instead of a CTA's teardown and
    launch coming between them; tiles of equal length are strided over, a band's (causal,
    window: uneven lengths, longest first) taken as CTAs free up.  Otherwise (or without
    ``cfg.persistent``) a CTA per tile, one slot: d256 and the single pass have no shared
    memory for a second slot."""
    sms = gpu.sm_count(device.index)
    if p.varlen:
        # Packed sequences: ``tiles`` bounds the listed ones, whose number only the device
        # knows; CTAs take them from the counter (as the forward's walk, whatever the options:
        # a CTA per tile would leave one past the count with no tile to end on).
        return Schedule(min(tiles, sms), 2, True, True)
    if cfg.persistent and not one_consumer_partition(p.head_dim_pad, dq_reduce) and tiles > sms:
        return Schedule(sms, 2, True, p.banded)
    return Schedule(tiles, 1, False, False)


# Tiles per SM up to which a band's tiles are walked longest first across heads.
BALANCE_TILES_PER_SM = 4


def walk_head_group(p, tiles, batch_heads, streamed_bytes_per_head, device) -> int:
    """How many heads a pass walks together (PassWalk.head_group): with few tiles a SM (up to
    BALANCE_TILES_PER_SM) a band's heads sharing L2 (scheduler.heads_sharing_l2), longest tiles
    first across them; one head's tiles at a time would leave the last heads' longest tiles
    to the end of the walk (GQA at batch 2, 4k keys: 1.3-1.5x the time).  With more, one head at
    a time: the walk ends about as balanced, and fewer heads stream through L2 at once (their
    grouped walk measured 1-2% slower, d64 1k-16k)."""
    if p.varlen or tiles > BALANCE_TILES_PER_SM * gpu.sm_count(device.index):
        return 1  # (packed sequences: the list's order)
    return heads_sharing_l2(p, batch_heads, streamed_bytes_per_head)


def shared_scores(cfg, head_dim_pad, dq_reduce) -> bool:
    """Whether the single pass runs _kv_consumers_shared_scores: with Q blocks of more than a
    warpgroup's rows (up to d64: shared memory)."""
    return dq_reduce and cfg.kv_block_m > WARPGROUP_ROWS.value and head_dim_pad <= 64


def one_consumer_partition(head_dim_pad, dq_reduce=False) -> bool:
    """Whether both consumer warpgroups are one partition (SPLIT_D, and the single pass), not one
    each: the host's side of the choice the kernels make from SPLIT_D and DQ_REDUCE."""
    return split_head_dim(head_dim_pad) or dq_reduce


def partition_rows(head_dim_pad, dq_reduce=False) -> int:
    """The stationary rows one consumer partition owns, and so the block its gradients (dQ in the
    dQ pass, dK and dV in the other) leave in by TMA store."""
    if one_consumer_partition(head_dim_pad, dq_reduce):
        return gluon_bwd_stationary_rows(head_dim_pad)
    return WARPGROUP_ROWS.value


def launch_options(head_dim_pad, dq_reduce=False):
    return LAUNCH_OPTIONS if one_consumer_partition(head_dim_pad, dq_reduce) else TWO_PARTITION_OPTIONS
