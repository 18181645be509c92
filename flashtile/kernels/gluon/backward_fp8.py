"""fp8_attn_func's FP8 backward in Gluon: both passes on Hopper's float8 warpgroup MMAs.

The two passes are the bf16 two passes' walks, producer and ring (backward.py): a dQ pass (128
query rows of one head stationary, a consumer warpgroup per 64 of them, its KV head's K and V
blocks streaming by), then a dK/dV pass (128 K/V rows of a KV head stationary, every query head
of the group streaming its Q and dO blocks by), on the forward's float8 Q, K, V and dO quantized
per block of DO_ROWS rows.  D = rowsum(dO * O) - dlse comes first from backward.delta_of, on the
bf16 dO and output.  Every product is a float8 MMA:

- S = Q K^T, dP = dO V^T (and their transposes) read Q, K, V and dO as they are (the head dim,
  which they reduce over, is contiguous); the scores take Q's and K's descales (per block, or
  K's per key row in the dK/dV pass) in the score hook's scale, dP V's and dO's before dS is
  formed.
- dQ += dS K, dV += P^T dO and dK += dS^T Q reduce over key or query rows, which a float8 MMA
  reads from shared memory only where they are contiguous: the producer streams keys-contiguous
  copies of K (dQ pass), Q and dO (dK/dV pass) beside them (tma.keys_contiguous_operand, rows in
  the register operand's order: float8.py).
- P^T (at most 1) goes to float8 times f = 2^8 x its block's dO descale over the largest of its
  KV head (DO_FACTORS, DO_BOUND: do_factors), so that dV sums in one unit;
  dS and dS^T, times K's or Q's block descale, are scaled per row of the gradient by a running
  unit, the largest row amax over the float8 type's top seen so far, the gradient rescaled when
  it grows, as the online softmax rescales O (_running_unit_operand).

Above d128 a consumer warpgroup's registers hold one gradient of its 64 rows, not two: the
dK/dV kernel runs as a dV pass (S^T and dV: Q and dO's copy stream) and then a dK pass (S^T,
dP^T and dK: Q, dO and Q's copy), 8 products a block where one pass would make 7 (key_passes).
Batched problems with one head dim; the gradients leave in dO's type by pointer (one rounding,
at the end: no float32 copies written and read back).  Gluon
does not run under the interpreter: the CPU suite compiles the kernels for sm_90, the GPU suite
checks their numerics.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

from flashtile.kernels import quantize, score
from flashtile.kernels import tma as tma_host
from flashtile.kernels.blocks import band_blocks
from flashtile.kernels.configs import GLUON_TILE_M, split_head_dim
from flashtile.kernels.gluon import backward as bwd
from flashtile.kernels.gluon import float8
from flashtile.kernels.gluon.pipeline import lanes_product, release
from flashtile.kernels.gluon.scheduler import read_next_tile, read_tile, value, values, Value
from flashtile.kernels.launch import Descriptor, launch
from flashtile.kernels.tiles import FP8_P_SCALE, LOG2E, TINY


# The gradients a dK/dV pass forms (GRADS): both up to d128; above, where a warpgroup's
# registers hold one of them for its 64 rows, a pass each.
GRAD_DK = gl.constexpr(1)
GRAD_DV = gl.constexpr(2)


@gluon.constexpr_function
def _float8_top(dtype):
    """The float8 type's largest finite value."""
    return gl.constexpr(448.0 if dtype == gl.float8e4nv else 57344.0)


@gluon.constexpr_function
def _float8_layouts(columns, head_dim_pad):
    """(scores', gradient's, register operand's) layouts of a consumer warpgroup's float8 products
    (k32): the scores ``columns`` wide, the gradient ``head_dim_pad``."""
    acc = bwd._wgmma_layout(head_dim_pad, 1, 1, 32)
    layouts = (bwd._wgmma_layout(columns, 1, 1, 32), acc, gl.DotOperandLayout(operand_index=0, parent=acc, k_width=4))
    return gl.tuple([gl.constexpr(x) for x in layouts])


@aggregate
class Float8Scales:
    """The descales the passes read: Q's, K's and V's, DESCALE (3, batch, heads_q, blocks; part,
    batch and head strides sdt, sdb, sdh), one per Q_ROWS rows of a query head and KV_ROWS rows
    of a KV head (the forward's blocks); per DO_ROWS rows of dO, DO_FACTORS (2, batch, heads_q,
    blocks; part, batch and head strides sgt, sgb, sgh): dO's descale and f = 2^8 x that descale
    over the largest of its (sequence, KV head), DO_BOUND (batch, heads_k), contiguous
    (do_factors)."""
    at: gl.tensor
    sdt: Value
    sdb: Value
    sdh: Value
    do_at: gl.tensor
    sgt: Value
    sgb: Value
    sgh: Value
    bound: gl.tensor
    heads_k: Value

    @gluon.constexpr_function
    def __init__(self, at, sdt, sdb, sdh, do_at, sgt, sgb, sgh, bound, heads_k):
        self.at = at
        self.sdt = value(sdt)
        self.sdb = value(sdb)
        self.sdh = value(sdh)
        self.do_at = do_at
        self.sgt = value(sgt)
        self.sgb = value(sgb)
        self.sgh = value(sgh)
        self.bound = bound
        self.heads_k = value(heads_k)

    @gluon.jit
    def key_rows(self, batch, head_k, rows, seqlen_k, KV_ROWS: gl.constexpr):
        """K's and V's descales of key rows ``rows`` (1 past the sequence)."""
        at = self.at + batch * self.sdb + head_k * self.sdh + rows // KV_ROWS
        inside = rows < seqlen_k
        return gl.load(at + self.sdt, mask=inside, other=1.0), gl.load(at + 2 * self.sdt, mask=inside, other=1.0)

    @gluon.jit
    def key_block(self, batch, head_k, n0, KV_ROWS: gl.constexpr):
        """K's and V's descales of the block of keys from n0 (within one of their blocks)."""
        at = self.at + batch * self.sdb + head_k * self.sdh + n0 // KV_ROWS
        return gl.load(at + self.sdt), gl.load(at + 2 * self.sdt)

    @gluon.jit
    def query_block(self, batch, head, m0, Q_ROWS: gl.constexpr):
        """Q's descale of the block of query rows from m0 (within one of Q's descale blocks)."""
        return gl.load(self.at + batch * self.sdb + head * self.sdh + m0 // Q_ROWS)

    @gluon.jit
    def _do_at(self, batch, head, m0, DO_ROWS: gl.constexpr):
        return self.do_at + batch * self.sgb + head * self.sgh + m0 // DO_ROWS

    @gluon.jit
    def do_block(self, batch, head, m0, DO_ROWS: gl.constexpr):
        """(dO's descale, f) of the block of query rows from m0."""
        at = self._do_at(batch, head, m0, DO_ROWS)
        return gl.load(at), gl.load(at + self.sgt)

    @gluon.jit
    def do_descale(self, batch, head, m0, DO_ROWS: gl.constexpr):
        """dO's descale of the block of query rows from m0."""
        return gl.load(self._do_at(batch, head, m0, DO_ROWS))

    @gluon.jit
    def do_bound(self, batch, head_k):
        """The largest dO descale of the KV head's query heads: dV's unit, over 2^8."""
        return gl.load(self.bound + batch * self.heads_k + head_k)


@gluon.jit
def _running_unit_operand(x, scale, unit, acc, dtype: gl.constexpr, op_layout: gl.constexpr):
    """x times ``scale`` as a float8 register operand of ``op_layout`` whose rows are in the
    running unit of the gradient ``acc`` they are added to (no MMA of it in flight): each row's
    unit grows to the largest amax over the float8 type's top seen so far, and ``acc`` is
    rescaled to it, as the online softmax rescales O; rows whose unit stays are not touched (a
    division of a number by itself need not give 1).  Returns (operand, acc, unit).  A row of
    zeros so far keeps unit 0 (and multiplies by 0); a unit is at least float32's smallest
    normal, its multiplier kept finite (never 0 x inf)."""
    TOP: gl.constexpr = _float8_top(dtype)
    needed = gl.max(gl.abs(x), 1) * (scale / TOP)
    grown = gl.where(needed > unit, gl.maximum(needed, TINY), unit)
    multiplier = gl.where(grown > 0.0, gl.minimum(scale / gl.maximum(grown, TINY), 3.0e38), 0.0)
    ratio = gl.where(grown > unit, unit / gl.maximum(grown, TINY), 1.0)
    acc = acc * gl.convert_layout(ratio, gl.SliceLayout(1, acc.type.layout))[:, None]
    return float8.packed_operand(x * multiplier[:, None], dtype, op_layout), acc, grown


@gluon.jit
def _store_scaled(acc, unit, factor, PTR, batch, row0, rows_left, head, sgb, sgs, sgh, head_dim):
    """A gradient in its running ``unit`` (per row) times ``factor``, by pointer
    (backward._store_rows: rows from row0, the first ``rows_left`` of them); the unit first, so
    that a unit near float32's smallest normal is not taken below it."""
    rows_unit = gl.convert_layout(unit, gl.SliceLayout(1, acc.type.layout))
    bwd._store_rows(acc * rows_unit[:, None] * factor, PTR + batch.to(gl.int64) * sgb, row0, rows_left, head, sgs, sgh,
                    head_dim)


@gluon.jit
def _kv_block(k_smem, v_smem, kv_slot, buf, stats, scales, dk, dv, dk_unit, s_zero, rows_k, k0, it, m0, band, batch,
              head, seqlen_q, scale_log2, site, k_scale, v_scale, op_layout: gl.constexpr,
              v_op_layout: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, SCORE: gl.constexpr,
              HEAD_DIM_V_PAD: gl.constexpr, Q_ROWS: gl.constexpr, DO_ROWS: gl.constexpr, GRADS: gl.constexpr):
    """The dK/dV pass's step: one streamed Q block (query rows from m0 of ``head``, ring block
    ``it``) against the partition's ROWS key rows from ROW0 of the K/V tile in stationary slot
    ``kv_slot``; returns dK, dV and dK's running row unit after it (GRADS: those of GRAD_DK,
    GRAD_DV it forms; the others pass through)."""
    dtype: gl.constexpr = buf.c.dtype
    s_layout: gl.constexpr = s_zero.type.layout
    if HEAD_DIM_PAD > 64:  # (as backward._kv_block: the wgmma descriptors are not held across the loop)
        kv_slot = bwd._per_iteration(kv_slot, it)
    k_rows = k_smem.index(kv_slot).reshape([BLOCK_N, HEAD_DIM_PAD]).slice(ROW0, ROWS)
    if GRADS & GRAD_DK:
        v_rows = v_smem.index(kv_slot).reshape([BLOCK_N, HEAD_DIM_V_PAD]).slice(ROW0, ROWS)
        slot, q, do, sT, dpT = bwd._scores(k_rows, v_rows, buf.c, buf.d, buf.ring_ready, it, s_zero, BLOCK_M,
                                           HEAD_DIM_PAD, STAGES, HEAD_DIM_V_PAD, HEAD_DIM_PAD)
        sT = warpgroup_mma_wait(1, deps=[sT])
    else:
        # (no dP^T: dV needs P alone)
        slot, q = bwd._landed(buf.c, buf.ring_ready, it, BLOCK_M, HEAD_DIM_PAD, STAGES)
        sT = lanes_product(k_rows, q, s_zero, HEAD_DIM_PAD)
        sT = warpgroup_mma_wait(0, deps=[sT])
    q_scale = scales.query_block(batch, head, m0, Q_ROWS)
    lse = stats.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout)) * LOG2E
    # The dequantized scores' scale per key row: K's descale, Q's block's and the softmax's.
    pT, pT_ds = bwd._probs_t(sT, lse, rows_k, k0, m0, band, seqlen_q, (scale_log2 * q_scale * k_scale)[:, None],
                             site, SCORE, True, False)
    if GRADS & GRAD_DV:
        # dV's operand: P^T times 2^8 x this block's dO descale over the head's largest, dV's unit.
        do_scale, p_factor = scales.do_block(batch, head, m0, DO_ROWS)
        pT_op = float8.packed_operand(pT * p_factor, dtype, v_op_layout)
        do_keys = buf.f.index(slot).reshape([HEAD_DIM_V_PAD, BLOCK_M]).permute((1, 0))
        dv = warpgroup_mma(float8.register_operand(pT_op, dtype, v_op_layout), do_keys, dv, is_async=True)
    else:
        do_scale = scales.do_descale(batch, head, m0, DO_ROWS)
    if GRADS & GRAD_DK:
        delta = stats.delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        if GRADS & GRAD_DV:
            dpT = warpgroup_mma_wait(1, deps=[dpT])
        else:
            dpT = warpgroup_mma_wait(0, deps=[dpT])
        # dS^T = P^T f' (dP^T - D), dP^T dequantized by V's descale per row and dO's block's; dK's
        # operand dS^T times Q's block descale.
        dsT = bwd._ds_t(pT_ds, dpT, delta, rows_k, m0, band, seqlen_q, (v_scale * do_scale)[:, None], True)
        ds_op, dk, dk_unit = _running_unit_operand(dsT, q_scale, dk_unit, dk, dtype, op_layout)
        q_keys = buf.e.index(slot).reshape([HEAD_DIM_PAD, BLOCK_M]).permute((1, 0))
        dk = warpgroup_mma(float8.register_operand(ds_op, dtype, op_layout), q_keys, dk, is_async=True)
        if GRADS & GRAD_DV:
            dv, dk, pT_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, pT_op, ds_op])
        else:
            dk, ds_op = warpgroup_mma_wait(0, deps=[dk, ds_op])
    else:
        dv, pT_op = warpgroup_mma_wait(0, deps=[dv, pT_op])
    mbarrier.arrive(buf.ring_empty.index(slot))
    return dk, dv, dk_unit


@gluon.jit
def _kv_consumer(WHICH: gl.constexpr, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr,
                 PERSISTENT: gl.constexpr, SCORE: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr, Q_ROWS: gl.constexpr,
                 KV_ROWS: gl.constexpr, DO_ROWS: gl.constexpr, GRADS: gl.constexpr):
    """dK and dV (those GRADS names) of consumer warpgroup WHICH's 64 key rows of each of the
    CTA's tiles, a partition of its own (as backward._kv_consumer's two passes); ``grads``: dK,
    dV (dO's type), their batch, row and head strides, and the head dims (Problem.head_dims)."""
    k_smem, v_smem, tile_ids = buf.a, buf.b, buf.tile_ids
    kv_ready, kv_empty = buf.stationary_ready, buf.stationary_empty
    num_tiles, group = walk.num_tiles, walk.group
    DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, head_dims = grads
    SLOTS: gl.constexpr = k_smem.shape[0]
    ROWS: gl.constexpr = bwd.WARPGROUP_ROWS
    s_layout, acc_layout, op_layout = _float8_layouts(BLOCK_M, HEAD_DIM_PAD)
    _, v_acc_layout, v_op_layout = _float8_layouts(BLOCK_M, HEAD_DIM_V_PAD)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    it = 0  # streamed blocks consumed so far: ring slot and mbarrier phase
    tile_i = 0
    t = read_tile(tile_ids, tile_i, kv_ready, SLOTS)  # the tile's K and V landed
    while t < num_tiles:
        batch, head_k, n0, kv_slot, k_block, v_block, band, seq = bwd._kv_tile(t, tile_i, walk, k_smem, v_smem,
                                                                                BLOCK_M, BLOCK_N)
        coord_b, q_start, k_start, seqlen_q, seqlen_k = seq
        dlo, dhi, lo, full_lo, full_hi, n_blocks = band
        r0 = n0 + WHICH * ROWS
        rows_k = r0 + gl.arange(0, ROWS, layout=rows_layout)
        k_scale, v_scale = scales.key_rows(batch, head_k, rows_k, seqlen_k, KV_ROWS)
        # (a gradient the pass does not form is a scalar carried along, never read)
        dk = gl.zeros([ROWS, HEAD_DIM_PAD], gl.float32, acc_layout) if GRADS & GRAD_DK else 0.0
        dv = gl.zeros([ROWS, HEAD_DIM_V_PAD], gl.float32, v_acc_layout) if GRADS & GRAD_DV else 0.0
        dk_unit = gl.zeros([ROWS], gl.float32, rows_layout)
        for g in range(group):
            head = head_k * group + g
            site = (batch, head, seqlen_k - seqlen_q, score_args)
            for i in range(n_blocks):
                dk, dv, dk_unit = _kv_block(k_smem, v_smem, kv_slot, buf, stats, scales, dk, dv, dk_unit, s_zero,
                                            rows_k, r0, it, lo + i * BLOCK_M, (dlo, dhi, full_lo, full_hi), batch,
                                            head, seqlen_q, scale_log2, site, k_scale, v_scale, op_layout,
                                            v_op_layout, WHICH * ROWS, ROWS, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES,
                                            SCORE, HEAD_DIM_V_PAD, Q_ROWS, DO_ROWS, GRADS)
                it += 1
        if GRADS & GRAD_DK:
            _store_scaled(dk, dk_unit, softmax_scale, DK, batch, r0, seqlen_k - r0, head_k, sdkb, sdks, sdkh,
                          head_dims & 0xFFFF)
        if GRADS & GRAD_DV:
            bwd._store_rows(dv * (scales.do_bound(batch, head_k) / FP8_P_SCALE), DV + batch.to(gl.int64) * sdvb, r0,
                            seqlen_k - r0, head_k, sdvs, sdvh, head_dims >> 16)
        release(kv_empty, kv_slot)
        tile_i += 1
        t = read_next_tile(tile_ids, tile_i, kv_ready, num_tiles, SLOTS, PERSISTENT)


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, qt_desc, dot_desc, LSE, DELTA, slb, slh, num_tiles, heads_k, group,
                 head_group, seqlen_q, seqlen_k, window_left, window_right, softmax_scale, scale_log2, counter,
                 score_args, CU_Q, CU_K, totals, TILES, m_blocks, DESCALE, sdt, sdb, sdh, DO_FACTORS, sgt, sgb, sgh,
                 DO_BOUND, DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, head_dims, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, SLOTS: gl.constexpr,
                 PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr, SCORE: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
                 Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, DO_ROWS: gl.constexpr, GRADS: gl.constexpr):
    """The dK/dV pass, or (GRADS) a pass of dK or of dV alone: the stationary pair is K and V,
    the streamed ones what the gradients read of Q, dO and their keys-contiguous copies
    (qt_desc, dot_desc: (batch, heads, head dim, rows)); lse and D of each streamed block ride
    the ring beside it.  CU_Q, CU_K, totals, TILES, m_blocks: the walk's placeholders for packed
    sequences (never read)."""
    gl.static_assert(HEAD_DIM_PAD <= 256, "the float8 passes take head dims up to 256")
    gl.static_assert(HEAD_DIM_PAD <= 128 or GRADS != GRAD_DK | GRAD_DV, "one gradient a pass above d128")
    # S^T reads Q (c); dV dO's copy (f); dP^T dO (d) and dK Q's copy (e).
    RING: gl.constexpr = (1 | (bwd.RING_F if GRADS & GRAD_DV else 0)
                          | (bwd.RING_D | bwd.RING_E if GRADS & GRAD_DK else 0))
    buf = bwd.PassBuffers.allocate(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, STAGES, 2, SLOTS, RING)
    score_args = values(score_args)  # an ALiBi batch stride of 1 comes specialised
    walk = bwd.PassWalk(num_tiles, heads_k, group, head_group, seqlen_q, seqlen_k, window_left, window_right, CU_Q,
                        CU_K, totals, TILES, m_blocks, False)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], bwd._STATS_LAYOUT)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], bwd._STATS_LAYOUT)
    stats = bwd.RowStats(LSE, DELTA, lse_smem, delta_smem, slb, slh)
    scales = Float8Scales(DESCALE, sdt, sdb, sdh, DO_FACTORS, sgt, sgb, sgh, DO_BOUND, heads_k)
    grads = (DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, head_dims)
    gl.warp_specialize([
        (_kv_consumer, (0, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args, BLOCK_M, BLOCK_N,
                        HEAD_DIM_PAD, STAGES, PERSISTENT, SCORE, HEAD_DIM_V_PAD, Q_ROWS, KV_ROWS, DO_ROWS, GRADS)),
        (_kv_consumer, (1, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args, BLOCK_M, BLOCK_N,
                        HEAD_DIM_PAD, STAGES, PERSISTENT, SCORE, HEAD_DIM_V_PAD, Q_ROWS, KV_ROWS, DO_ROWS, GRADS)),
        (bwd._producer, (k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, buf, walk, stats, counter, BLOCK_N,
                         BLOCK_M, STAGES, True, True, PERSISTENT, DYNAMIC, RING)),
    ], [4, 1], [bwd.CONSUMER_REGS, bwd.PRODUCER_REGS])


@gluon.jit
def _dq_block(buf, scales, dq, dq_unit, s_zero, q, do, rows, q0, lse, delta, j, n0, band, batch, head_k, seqlen_k,
              scale_log2, do_scale, site, op_layout: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, SCORE: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
              KV_ROWS: gl.constexpr):
    """The dQ pass's step: the partition's query rows ``rows`` (from q0; Q and dO in shared
    memory, scale_log2 with Q's descale in it, dO's ``do_scale``) against the streamed K/V block
    from n0 (ring block ``j``); returns dQ and its running row unit after it."""
    dtype: gl.constexpr = buf.c.dtype
    s_layout: gl.constexpr = s_zero.type.layout
    slot, k, v, s, dp = bwd._scores(q, do, buf.c, buf.d, buf.ring_ready, j, s_zero, BLOCK_N, HEAD_DIM_PAD, STAGES,
                                    HEAD_DIM_V_PAD, HEAD_DIM_PAD)
    k_scale, v_scale = scales.key_block(batch, head_k, n0, KV_ROWS)
    s = warpgroup_mma_wait(1, deps=[s])
    p, p_ds = bwd._probs(s, lse, rows, q0, n0, band, seqlen_k, scale_log2 * k_scale, site, BLOCK_N,
                         gl.SliceLayout(0, s_layout), SCORE)
    dp = warpgroup_mma_wait(0, deps=[dp])
    # dS with dP dequantized; dQ's operand dS times K's block descale, in dQ's running unit.
    ds = bwd._ds(p_ds, dp, delta, n0, band, v_scale * do_scale)
    ds_op, dq, dq_unit = _running_unit_operand(ds, k_scale, dq_unit, dq, dtype, op_layout)
    k_keys = buf.e.index(slot).reshape([HEAD_DIM_PAD, BLOCK_N]).permute((1, 0))
    dq = warpgroup_mma(float8.register_operand(ds_op, dtype, op_layout), k_keys, dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=[dq, ds_op])
    mbarrier.arrive(buf.ring_empty.index(slot))
    return dq, dq_unit


@gluon.jit
def _dq_consumer(WHICH: gl.constexpr, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr,
                 PERSISTENT: gl.constexpr, SCORE: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr, Q_ROWS: gl.constexpr,
                 KV_ROWS: gl.constexpr, DO_ROWS: gl.constexpr):
    """dQ of consumer warpgroup WHICH's 64 query rows of each of the CTA's tiles, a partition of
    its own (as backward._dq_consumers'); lse and D by pointer (``stats``); ``grads``: dQ
    (float32), its batch, row and head strides, and the head dims (Problem.head_dims)."""
    q_smem, do_smem, tile_ids = buf.a, buf.b, buf.tile_ids
    q_ready, q_empty = buf.stationary_ready, buf.stationary_empty
    num_tiles, group = walk.num_tiles, walk.group
    DQ, sdqb, sdqs, sdqh, head_dims = grads
    SLOTS: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = bwd.WARPGROUP_ROWS
    s_layout, acc_layout, op_layout = _float8_layouts(BLOCK_N, HEAD_DIM_PAD)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    j = 0  # streamed blocks consumed so far: ring slot and mbarrier phase
    tile_i = 0
    t = read_tile(tile_ids, tile_i, q_ready, SLOTS)  # the tile's Q and dO landed
    while t < num_tiles:
        batch, head, m0, seq, q_slot, _, r0, q, do = bwd._q_tile(t, tile_i, walk, q_smem, do_smem, WHICH, ROWS,
                                                                 BLOCK_M, HEAD_DIM_PAD, HEAD_DIM_V_PAD)
        coord_b, q_start, k_start, seqlen_q, seqlen_k = seq
        rows = r0 + gl.arange(0, ROWS, layout=rows_layout)
        # Rows past the sequence read lse = +inf: their probabilities are exactly 0.
        at = batch.to(gl.int64) * stats.slb + head * stats.slh + rows
        lse = gl.load(stats.LSE + at, mask=rows < seqlen_q, other=float("inf")) * LOG2E
        delta = gl.load(stats.DELTA + at, mask=rows < seqlen_q, other=0.0)
        head_k = head // group
        # (a consumer whose rows all lie past the sequence reads the last block's)
        last = gl.minimum(r0, seqlen_q - 1)
        scale = scale_log2 * scales.query_block(batch, head, last, Q_ROWS)
        do_scale = scales.do_descale(batch, head, last, DO_ROWS)
        site = (batch, head, seqlen_k - seqlen_q, score_args)
        dq = gl.zeros([ROWS, HEAD_DIM_PAD], gl.float32, acc_layout)
        dq_unit = gl.zeros([ROWS], gl.float32, rows_layout)
        # The band of the whole tile's rows: both warpgroups step through the same blocks.
        dlo, dhi, lo, full_lo, full_hi, n_blocks = band_blocks(m0, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k,
                                                               walk.window_left, walk.window_right, False)
        for i in range(n_blocks):
            dq, dq_unit = _dq_block(buf, scales, dq, dq_unit, s_zero, q, do, rows, r0, lse, delta, j, lo + i * BLOCK_N,
                                    (dlo, dhi, full_lo, full_hi), batch, head_k, seqlen_k, scale, do_scale, site,
                                    op_layout, BLOCK_N, HEAD_DIM_PAD, STAGES, SCORE, HEAD_DIM_V_PAD, KV_ROWS)
            j += 1
        _store_scaled(dq, dq_unit, softmax_scale, DQ, batch, r0, seqlen_q - r0, head, sdqb, sdqs, sdqh,
                      head_dims & 0xFFFF)
        release(q_empty, q_slot)
        tile_i += 1
        t = read_next_tile(tile_ids, tile_i, q_ready, num_tiles, SLOTS, PERSISTENT)


@gluon.jit
def _dq_kernel(q_desc, do_desc, k_desc, v_desc, kt_desc, LSE, DELTA, slb, slh, num_tiles, heads_q, group, head_group,
               seqlen_q, seqlen_k, window_left, window_right, softmax_scale, scale_log2, counter, score_args, CU_Q,
               CU_K, totals, TILES, m_blocks, DESCALE, sdt, sdb, sdh, DO_FACTORS, sgt, sgb, sgh, DQ, sdqb, sdqs, sdqh,
               head_dims, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
               STAGES: gl.constexpr, SLOTS: gl.constexpr, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr,
               SCORE: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr, Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr,
               DO_ROWS: gl.constexpr):
    """The dQ pass: the stationary pair is Q and dO, the streamed one K and V with K's
    keys-contiguous copy (kt_desc: (batch, heads_k, head dim, keys)); lse and D (delta_of) by
    pointer.  CU_Q, CU_K, totals, TILES, m_blocks: as _dkdv_kernel's."""
    gl.static_assert(HEAD_DIM_PAD <= 256, "the float8 passes take head dims up to 256")
    buf = bwd.PassBuffers.allocate(q_desc, do_desc, k_desc, v_desc, kt_desc, kt_desc, STAGES, 2, SLOTS,
                                   bwd.RING_PAIR | bwd.RING_E)
    score_args = values(score_args)  # an ALiBi batch stride of 1 comes specialised
    walk = bwd.PassWalk(num_tiles, heads_q, group, head_group, seqlen_q, seqlen_k, window_left, window_right, CU_Q,
                        CU_K, totals, TILES, m_blocks, False)
    stats = bwd.RowStats(LSE, DELTA, buf.a, buf.a, slb, slh)  # (read by pointer, not from the ring)
    scales = Float8Scales(DESCALE, sdt, sdb, sdh, DO_FACTORS, sgt, sgb, sgh, DO_FACTORS, 1)  # (no bound read)
    grads = (DQ, sdqb, sdqs, sdqh, head_dims)
    gl.warp_specialize([
        (_dq_consumer, (0, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args, BLOCK_M, BLOCK_N,
                        HEAD_DIM_PAD, STAGES, PERSISTENT, SCORE, HEAD_DIM_V_PAD, Q_ROWS, KV_ROWS, DO_ROWS)),
        (_dq_consumer, (1, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args, BLOCK_M, BLOCK_N,
                        HEAD_DIM_PAD, STAGES, PERSISTENT, SCORE, HEAD_DIM_V_PAD, Q_ROWS, KV_ROWS, DO_ROWS)),
        (bwd._producer, (q_desc, do_desc, k_desc, v_desc, kt_desc, kt_desc, buf, walk, stats, counter, BLOCK_M,
                         BLOCK_N, STAGES, False, False, PERSISTENT, DYNAMIC, bwd.RING_PAIR | bwd.RING_E)),
    ], [4, 1], [bwd.CONSUMER_REGS, bwd.PRODUCER_REGS])


class PassLaunch:
    """One float8 pass's launch for problem ``p``, tiles ``cfg`` (configs.GluonBackward: the dK/dV
    pass's kv_block_m query rows a streamed block, also dO's quantizing blocks; the dQ pass's
    dq_block_n keys; the ring depth) and float8 type ``dtype`` on a device: the descriptors'
    blocks by parameter name, the grid, the walk's arguments from the tile count to the scale,
    the schedule and the constexprs with the launch options.  ``keys``: the dK/dV pass, else the
    dQ pass."""

    def __init__(self, p, cfg, dtype, device_index, keys):
        rows = GLUON_TILE_M  # (64 a consumer warpgroup, d256 too: its passes hold one gradient each)
        q_rows, kv_rows = p.fp8_rows
        do_rows, pad = cfg.kv_block_m, p.head_dim_pad
        block = cfg.kv_block_m if keys else cfg.dq_block_n  # the streamed tensors' rows
        device = torch.device("cuda", device_index)
        spec, keys_spec = tma_host.block_spec, tma_host.keys_block_spec
        if keys:
            self.specs = dict(q_desc=spec(block, pad, dtype), k_desc=spec(rows, pad, dtype),
                              v_desc=spec(rows, pad, dtype), do_desc=spec(block, pad, dtype),
                              qt_desc=keys_spec(pad, block, dtype), dot_desc=keys_spec(pad, block, dtype))
            heads, streamed = p.heads_k, p.group * p.seqlen_q * 4 * pad  # Q, dO and their copies
        else:
            self.specs = dict(q_desc=spec(rows, pad, dtype), do_desc=spec(rows, pad, dtype),
                              k_desc=spec(block, pad, dtype), v_desc=spec(block, pad, dtype),
                              kt_desc=keys_spec(pad, block, dtype))
            heads, streamed = p.heads_q, p.seqlen_k * 3 * pad  # K, V and K's copy
        count = bwd.pass_count(p, rows, heads, keys)
        self.schedule = bwd.pass_schedule(p, cfg, count, device)
        head_group = bwd.walk_head_group(p, count, p.batch * heads, streamed * dtype.itemsize, device)
        self.walk = (count, heads, p.group, head_group, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
                     p.softmax_scale, p.scale_log2)
        self.grid = (self.schedule.ctas,)
        self.constants = dict(BLOCK_M=block if keys else rows, BLOCK_N=rows if keys else block, HEAD_DIM_PAD=pad,
                              STAGES=cfg.num_stages, SCORE=score.mod_of(p), HEAD_DIM_V_PAD=p.head_dim_v_pad,
                              Q_ROWS=q_rows, KV_ROWS=kv_rows, DO_ROWS=do_rows, **self.schedule.constants(),
                              **bwd.TWO_PARTITION_OPTIONS)


def do_factors(p, do_descale):
    """(DO_FACTORS, DO_BOUND) of dO's descales (batch, heads_q, blocks): the largest of each
    (sequence, KV head) and, per block, (descale, f) for f = 2^8 x descale / largest."""
    bound = do_descale.view(p.batch, p.heads_k, -1).amax(-1)  # over the group's query heads
    f = FP8_P_SCALE.value * do_descale / bound.repeat_interleave(p.group, 1)[..., None]
    return torch.stack((do_descale, f)), bound.contiguous()


def key_passes(head_dim_pad):
    """The GRADS of the dK/dV passes: one pass of both up to d128, else a pass of dV, then one of
    dK (a warpgroup's registers hold one d256 gradient of its 64 rows, not two)."""
    if not split_head_dim(head_dim_pad):
        return (GRAD_DK.value | GRAD_DV.value,)
    return GRAD_DV.value, GRAD_DK.value


def backward(plan, p, dout, dlse, q8, k8, v8, out, lse, saved):
    """(dq, dk, dv), in dout's type, of float8 q8, k8, v8 with descales per block (``p.fp8_descale``,
    ``p.fp8_rows``), with respect to their dequantized values: D, then the dQ pass, then the
    dK/dV pass (key_passes)."""
    cfg, device, dtype = plan.config, q8.device, q8.dtype
    dq_pass = PassLaunch(p, cfg, dtype, device.index, False)
    kv_pass = PassLaunch(p, cfg, dtype, device.index, True)
    dout = tma_host.ready(dout)
    delta = bwd.delta_of(p, out, dout, dlse, lse)
    do8, do_descale = quantize.blocks(dout, cfg.kv_block_m, dtype, torch.finfo(dtype).max)
    factors, do_bound = do_factors(p, do_descale)
    q8, k8, v8 = (tma_host.ready(x) for x in (q8, k8, v8))
    dq, dk, dv = (torch.empty(x.shape, dtype=dout.dtype, device=device) for x in (q8, k8, v8))
    descale, cu_q, cu_k = p.fp8_descale, *p.cu_pointers(device)
    scales = (descale, *descale.stride()[:3], factors, *factors.stride()[:3])
    walked = (score.args_of(p), cu_q, cu_k, p.totals, cu_q, 1)  # (the packed walk's placeholders)

    specs = dq_pass.specs
    launch(
        _dq_kernel, dq_pass.grid,
        Descriptor(q8, *specs["q_desc"]), Descriptor(do8, *specs["do_desc"]), Descriptor(k8, *specs["k_desc"]),
        Descriptor(v8, *specs["v_desc"]), Descriptor(tma_host.keys_contiguous_operand(k8), *specs["kt_desc"]),
        lse, delta, *p.row_stat_strides(lse), *dq_pass.walk, dq_pass.schedule.counter(device), *walked, *scales,
        dq, *dq.stride()[:3], p.head_dims, **dq_pass.constants)
    specs = kv_pass.specs
    descriptors = (Descriptor(q8, *specs["q_desc"]), Descriptor(k8, *specs["k_desc"]), Descriptor(v8, *specs["v_desc"]),
                   Descriptor(do8, *specs["do_desc"]),
                   Descriptor(tma_host.keys_contiguous_operand(q8), *specs["qt_desc"]),
                   Descriptor(tma_host.keys_contiguous_operand(do8), *specs["dot_desc"]))
    for grads in key_passes(p.head_dim_pad):
        launch(
            _dkdv_kernel, kv_pass.grid, *descriptors, lse, delta, *p.row_stat_strides(lse), *kv_pass.walk,
            kv_pass.schedule.counter(device), *walked, *scales, do_bound, dk, dv, *dk.stride()[:3], *dv.stride()[:3],
            p.head_dims, GRADS=grads, **kv_pass.constants)
    return dq, dk, dv
