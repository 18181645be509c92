"""fp8_attn_func's FP8 backward in Gluon: the dK/dV pass on Hopper's float8 warpgroup MMAs.

The pass is the bf16 dK/dV pass's walk, producer and ring (backward.py: 128 K/V rows of a KV
head stationary, a consumer warpgroup per 64 of them, every query head of the group streaming its
Q and dO blocks by) on the forward's float8 Q, K, V and dO quantized per block of BLOCK_M rows.
Its four products are float8 MMAs:

- S^T = K Q^T and dP^T = V dO^T read Q, K, V and dO as they are (the head dim, which they reduce
  over, is contiguous); the scores take K's descale per key row and Q's per block, dP^T V's and
  dO's, before the score hook (softcap, ALiBi) and the softmax see them.
- dV += P^T dO and dK += dS^T Q reduce over the query rows, which a float8 MMA reads from shared
  memory only where they are contiguous: the producer streams keys-contiguous copies of Q and dO
  beside them (tma.keys_contiguous_operand, rows in the register operand's order: float8.py).
  P^T (at most 1) goes to float8 times 2^8 and times its block's dO descale over the largest
  of its KV head (``DO_BOUND``), so that dV sums in one unit; dS^T times Q's block descale is
  scaled per key row by a running scale, the largest row amax over the float8 type's top seen
  so far, and dK is rescaled when it grows, as the online softmax rescales O.

dQ, D = rowsum(dO * O) - dlse and the lse come from the bf16 dQ pass on Q, K, V dequantized
(backward.launch_dq): run first, its D feeds this pass.  Batched problems up to d128 with one
head dim; dK and dV leave in float32 by pointer.  Gluon does not run under the interpreter: the
CPU suite compiles the kernel for sm_90, the GPU suite checks its numerics.
"""
from dataclasses import replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.language.core import _aggregate as aggregate

from flashtile.kernels import quantize, score
from flashtile.kernels import tma as tma_host
from flashtile.kernels.configs import gluon_bwd_stationary_rows
from flashtile.kernels.gluon import backward as bwd
from flashtile.kernels.gluon import float8
from flashtile.kernels.gluon.pipeline import release
from flashtile.kernels.gluon.scheduler import read_next_tile, read_tile, value, values, Value
from flashtile.kernels.launch import Descriptor, launch
from flashtile.kernels.tiles import FP8_P_SCALE, LOG2E, TINY


@gluon.constexpr_function
def _float8_top(dtype):
    """The float8 type's largest finite value."""
    return gl.constexpr(448.0 if dtype == gl.float8e4nv else 57344.0)


@aggregate
class Float8Scales:
    """The descales the pass reads: Q's, K's and V's, DESCALE (3, batch, heads_q, blocks; part,
    batch and head strides sdt, sdb, sdh), one per Q_ROWS rows of a query head and KV_ROWS rows
    of a KV head (the forward's blocks); per BLOCK_M rows of dO, DO_FACTORS (3, batch, heads_q,
    blocks; part, batch and head strides sgt, sgb, sgh): dO's descale, log2 f and 1 / f for f = 2^8
    x that descale over the largest of its (sequence, KV head), DO_BOUND (batch, heads_k),
    contiguous (do_factors)."""
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
    def query_block(self, batch, head, m0, Q_ROWS: gl.constexpr):
        """Q's descale of the block of query rows from m0 (within one of Q's descale blocks)."""
        return gl.load(self.at + batch * self.sdb + head * self.sdh + m0 // Q_ROWS)

    @gluon.jit
    def do_block(self, batch, head, m0, BLOCK_M: gl.constexpr):
        """(dO's descale, log2 f, 1 / f) of the block of query rows from m0."""
        at = self.do_at + batch * self.sgb + head * self.sgh + m0 // BLOCK_M
        return gl.load(at), gl.load(at + self.sgt), gl.load(at + 2 * self.sgt)

    @gluon.jit
    def do_bound(self, batch, head_k):
        """The largest dO descale of the KV head's query heads: dV's unit, over 2^8."""
        return gl.load(self.bound + batch * self.heads_k + head_k)


@gluon.jit
def _block(k_smem, v_smem, kv_slot, buf, stats, scales, dk, dv, dk_unit, s_zero, rows_k, k0, it, m0, band, batch, head,
           seqlen_q, scale_log2, site, k_scale, v_scale, op_layout: gl.constexpr,
           v_op_layout: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
           BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, SCORE: gl.constexpr,
           HEAD_DIM_V_PAD: gl.constexpr, Q_ROWS: gl.constexpr):
    """One streamed Q block (query rows from m0 of ``head``, ring block ``it``) against the
    partition's ROWS key rows from ROW0 of the K/V tile in stationary slot ``kv_slot``: returns
    dK, dV and dK's running row scale ``dk_unit`` after it."""
    dtype: gl.constexpr = buf.c.dtype
    TOP: gl.constexpr = _float8_top(dtype)
    s_layout: gl.constexpr = s_zero.type.layout
    if HEAD_DIM_PAD > 64:  # (as backward._kv_block: the wgmma descriptors are not held across the loop)
        kv_slot = bwd._per_iteration(kv_slot, it)
    k_rows = k_smem.index(kv_slot).reshape([BLOCK_N, HEAD_DIM_PAD]).slice(ROW0, ROWS)
    v_rows = v_smem.index(kv_slot).reshape([BLOCK_N, HEAD_DIM_V_PAD]).slice(ROW0, ROWS)
    slot, q, do, sT, dpT = bwd._scores(k_rows, v_rows, buf.c, buf.d, buf.ring_ready, it, s_zero, BLOCK_M,
                                       HEAD_DIM_PAD, STAGES, HEAD_DIM_V_PAD, HEAD_DIM_PAD)
    q_scale = scales.query_block(batch, head, m0, Q_ROWS)
    # P^T comes out times f = 2^8 x this block's dO descale over the head's largest: dV's
    # operand, in dV's unit; f goes into the exponent through lse (a subtraction per column).
    do_scale, log2_f, inverse_f = scales.do_block(batch, head, m0, BLOCK_M)
    lse = stats.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout)) * LOG2E - log2_f
    sT = warpgroup_mma_wait(1, deps=[sT])
    # The dequantized scores' scale per key row: K's descale, Q's block's and the softmax's.
    pT, pT_ds = bwd._probs_t(sT, lse, rows_k, k0, m0, band, seqlen_q, (scale_log2 * q_scale * k_scale)[:, None],
                             site, SCORE, True, False)
    pT_op = float8.packed_operand(pT, dtype, v_op_layout)
    do_keys = buf.f.index(slot).reshape([HEAD_DIM_V_PAD, BLOCK_M]).permute((1, 0))
    dv = warpgroup_mma(float8.register_operand(pT_op, dtype, v_op_layout), do_keys, dv, is_async=True)
    delta = stats.delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
    dpT = warpgroup_mma_wait(1, deps=[dpT])
    # f dS^T = (f P^T f') (dP^T - D), dP^T dequantized by V's descale per row and dO's block's.
    ds_f = bwd._in_band_t(pT_ds * (dpT * (v_scale * do_scale)[:, None] - delta[None, :]), rows_k, m0, band, seqlen_q,
                          True)
    # dK += dS^T Q: dS^T times Q's block descale (q_scale / f from f dS^T), each key row in dK's
    # running unit.
    q_scale = q_scale * inverse_f
    unit = gl.maximum(dk_unit, gl.max(gl.abs(ds_f), 1) * (q_scale / TOP))
    # A row of zeros so far keeps unit 0 (and multiplies by 0); a unit down in float32's
    # subnormals divides as the smallest normal, its multiplier kept finite (never 0 x inf).
    denominator = gl.maximum(unit, TINY)
    multiplier = gl.where(unit > 0.0, gl.minimum(q_scale / denominator, 3.0e38), 0.0)
    acc_rows: gl.constexpr = gl.SliceLayout(1, dk.type.layout)
    dk = dk * gl.convert_layout(dk_unit / denominator, acc_rows)[:, None]
    ds_op = float8.packed_operand(ds_f * multiplier[:, None], dtype, op_layout)
    q_keys = buf.e.index(slot).reshape([HEAD_DIM_PAD, BLOCK_M]).permute((1, 0))
    dk = warpgroup_mma(float8.register_operand(ds_op, dtype, op_layout), q_keys, dk, is_async=True)
    dv, dk, pT_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, pT_op, ds_op])
    mbarrier.arrive(buf.ring_empty.index(slot))
    return dk, dv, unit


@gluon.jit
def _consumer(WHICH: gl.constexpr, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr,
              PERSISTENT: gl.constexpr, SCORE: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr, Q_ROWS: gl.constexpr,
              KV_ROWS: gl.constexpr):
    """dK and dV of consumer warpgroup WHICH's 64 key rows of each of the CTA's tiles, a
    partition of its own (as backward._kv_consumer's two passes); ``grads``: dK, dV (float32),
    their batch, row and head strides, and the head dims (Problem.head_dims)."""
    k_smem, v_smem, tile_ids = buf.a, buf.b, buf.tile_ids
    kv_ready, kv_empty = buf.stationary_ready, buf.stationary_empty
    num_tiles, group = walk.num_tiles, walk.group
    DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, head_dims = grads
    SLOTS: gl.constexpr = k_smem.shape[0]
    ROWS: gl.constexpr = bwd.WARPGROUP_ROWS
    s_layout: gl.constexpr = bwd._wgmma_layout(BLOCK_M, 1, 1, 32)  # (float8 MMAs reduce over 32)
    acc_layout: gl.constexpr = bwd._wgmma_layout(HEAD_DIM_PAD, 1, 1, 32)
    v_acc_layout: gl.constexpr = bwd._wgmma_layout(HEAD_DIM_V_PAD, 1, 1, 32)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    v_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v_acc_layout, k_width=4)
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
        dv_unit = scales.do_bound(batch, head_k)
        dk = gl.zeros([ROWS, HEAD_DIM_PAD], gl.float32, acc_layout)
        dv = gl.zeros([ROWS, HEAD_DIM_V_PAD], gl.float32, v_acc_layout)
        dk_unit = gl.zeros([ROWS], gl.float32, rows_layout)
        for g in range(group):
            head = head_k * group + g
            site = (batch, head, seqlen_k - seqlen_q, score_args)
            for i in range(n_blocks):
                dk, dv, dk_unit = _block(k_smem, v_smem, kv_slot, buf, stats, scales, dk, dv, dk_unit, s_zero, rows_k,
                                         r0, it, lo + i * BLOCK_M, (dlo, dhi, full_lo, full_hi), batch, head,
                                         seqlen_q, scale_log2, site, k_scale, v_scale, op_layout,
                                         v_op_layout, WHICH * ROWS, ROWS, BLOCK_M, BLOCK_N, HEAD_DIM_PAD, STAGES,
                                         SCORE, HEAD_DIM_V_PAD, Q_ROWS)
                it += 1
        dk_rows = gl.convert_layout(dk_unit * softmax_scale, gl.SliceLayout(1, acc_layout))
        bwd._store_rows(dk * dk_rows[:, None], DK + batch.to(gl.int64) * sdkb, r0, seqlen_k - r0, head_k, sdks, sdkh,
                        head_dims & 0xFFFF)
        bwd._store_rows(dv * (dv_unit / FP8_P_SCALE), DV + batch.to(gl.int64) * sdvb, r0, seqlen_k - r0, head_k, sdvs,
                        sdvh, head_dims >> 16)
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
                 Q_ROWS: gl.constexpr, KV_ROWS: gl.constexpr):
    """The stationary pair is K and V (float8), the streamed ones Q and dO (float8) and their
    keys-contiguous copies (qt_desc, dot_desc: (batch, heads, head dim, rows)); lse and D of
    each streamed block ride the ring beside it.  CU_Q, CU_K, totals, TILES, m_blocks: the
    walk's placeholders for packed sequences (never read)."""
    gl.static_assert(HEAD_DIM_PAD <= 128, "the float8 dK/dV pass takes head dims up to 128")
    buf = bwd.PassBuffers.allocate(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, STAGES, 2, SLOTS, True)
    score_args = values(score_args)  # an ALiBi batch stride of 1 comes specialised
    walk = bwd.PassWalk(num_tiles, heads_k, group, head_group, seqlen_q, seqlen_k, window_left, window_right, CU_Q,
                        CU_K, totals, TILES, m_blocks, False)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], bwd._STATS_LAYOUT)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], bwd._STATS_LAYOUT)
    stats = bwd.RowStats(LSE, DELTA, lse_smem, delta_smem, slb, slh)
    scales = Float8Scales(DESCALE, sdt, sdb, sdh, DO_FACTORS, sgt, sgb, sgh, DO_BOUND, heads_k)
    grads = (DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, head_dims)
    gl.warp_specialize([
        (_consumer, (0, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args, BLOCK_M, BLOCK_N,
                     HEAD_DIM_PAD, STAGES, PERSISTENT, SCORE, HEAD_DIM_V_PAD, Q_ROWS, KV_ROWS)),
        (_consumer, (1, buf, walk, stats, scales, grads, softmax_scale, scale_log2, score_args, BLOCK_M, BLOCK_N,
                     HEAD_DIM_PAD, STAGES, PERSISTENT, SCORE, HEAD_DIM_V_PAD, Q_ROWS, KV_ROWS)),
        (bwd._producer, (k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, buf, walk, stats, counter, BLOCK_N,
                         BLOCK_M, STAGES, True, True, PERSISTENT, DYNAMIC, True)),
    ], [4, 1], [bwd.CONSUMER_REGS, bwd.PRODUCER_REGS])


class PassLaunch:
    """The pass's launch for problem ``p``, tiles ``cfg`` (configs.GluonBackward: its kv_block_m
    query rows a streamed block, its ring depth) and float8 type ``dtype`` on a device: the
    descriptors' blocks by parameter name, the grid, the walk's arguments from the tile count to
    the scale, the schedule and the constexprs with the launch options."""

    def __init__(self, p, cfg, dtype, device_index):
        rows = gluon_bwd_stationary_rows(p.head_dim_pad)
        q_rows, kv_rows = p.fp8_rows
        block, pad = cfg.kv_block_m, p.head_dim_pad
        if q_rows % block:
            raise ValueError(f"the float8 dK/dV pass streams {block}-row Q blocks, which must lie within Q's descale "
                             f"blocks of {q_rows} rows (kernel option tiles.v3_gluon_bwd)")
        device = torch.device("cuda", device_index)
        spec, keys_spec = tma_host.block_spec, tma_host.keys_block_spec
        self.block = block
        self.specs = dict(q_desc=spec(block, pad, dtype), k_desc=spec(rows, pad, dtype), v_desc=spec(rows, pad, dtype),
                          do_desc=spec(block, pad, dtype), qt_desc=keys_spec(pad, block, dtype),
                          dot_desc=keys_spec(pad, block, dtype))
        count = bwd.pass_count(p, rows, p.heads_k, True)
        self.schedule = bwd.pass_schedule(p, cfg, count, device)
        streamed_bytes = p.group * p.seqlen_q * 4 * pad * dtype.itemsize  # Q, dO and their copies
        head_group = bwd.walk_head_group(p, count, p.batch * p.heads_k, streamed_bytes, device)
        self.walk = (count, p.heads_k, p.group, head_group, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
                     p.softmax_scale, p.scale_log2)
        self.grid = (self.schedule.ctas,)
        self.constants = dict(BLOCK_M=block, BLOCK_N=rows, HEAD_DIM_PAD=pad, STAGES=cfg.num_stages,
                              SCORE=score.mod_of(p), HEAD_DIM_V_PAD=p.head_dim_v_pad, Q_ROWS=q_rows, KV_ROWS=kv_rows,
                              **self.schedule.constants(), **bwd.TWO_PARTITION_OPTIONS)


def do_factors(p, do_descale):
    """(DO_FACTORS, DO_BOUND) of dO's descales (batch, heads_q, blocks): the largest of each
    (sequence, KV head) and, per block, (descale, log2 f, 1 / f) for f = 2^8 x descale / largest."""
    bound = do_descale.view(p.batch, p.heads_k, -1).amax(-1)  # over the group's query heads
    f = FP8_P_SCALE.value * do_descale / bound.repeat_interleave(p.group, 1)[..., None]
    return torch.stack((do_descale, f.log2(), 1.0 / f)), bound.contiguous()


def backward(plan, p, dout, dlse, q8, k8, v8, out, lse, saved):
    """(dq, dk, dv) of float8 q8, k8, v8 with descales per block (``p.fp8_descale``, ``p.fp8_rows``):
    dQ (in out's type) and D from the bf16 dQ pass on their dequantized copies, then dK and dV
    (float32) from the float8 pass; with respect to the dequantized values."""
    cfg = plan.config
    pass_launch = PassLaunch(p, cfg, q8.dtype, q8.device.index)
    device, dtype, descale = q8.device, out.dtype, p.fp8_descale
    q_rows, kv_rows = p.fp8_rows
    plain = replace(p, fp8=False, fp8_per_block=False, fp8_descale=None, fp8_rows=())
    q, k, v = (quantize.dequantize(x8, d, n, dtype) for x8, d, n in zip((q8, k8, v8), descale,
                                                                        (q_rows, kv_rows, kv_rows)))
    dout = tma_host.ready(dout)
    dq = torch.empty_like(q)
    dq_pass = bwd.kept_launches(plain, cfg, False, dout, dlse, q, k, v, out, lse).dq
    delta = bwd.launch_dq(dq_pass, plain, dout, dlse, q, k, v, out, lse, dq)

    block = pass_launch.block
    do8, do_descale = quantize.blocks(dout, block, q8.dtype, torch.finfo(q8.dtype).max)
    factors, do_bound = do_factors(p, do_descale)
    q8, k8, v8 = (tma_host.ready(x) for x in (q8, k8, v8))
    q_keys, do_keys = tma_host.keys_contiguous_operand(q8), tma_host.keys_contiguous_operand(do8)
    dk = torch.empty(k8.shape, dtype=torch.float32, device=device)
    dv = torch.empty(v8.shape, dtype=torch.float32, device=device)
    specs = pass_launch.specs
    cu_q, cu_k = p.cu_pointers(device)
    launch(
        _dkdv_kernel, pass_launch.grid,
        Descriptor(q8, *specs["q_desc"]), Descriptor(k8, *specs["k_desc"]), Descriptor(v8, *specs["v_desc"]),
        Descriptor(do8, *specs["do_desc"]), Descriptor(q_keys, *specs["qt_desc"]),
        Descriptor(do_keys, *specs["dot_desc"]), lse, delta, *p.row_stat_strides(lse), *pass_launch.walk,
        pass_launch.schedule.counter(device), score.args_of(p), cu_q, cu_k, p.totals, cu_q, 1, descale,
        *descale.stride()[:3], factors, *factors.stride()[:3], do_bound, dk, dv, *dk.stride()[:3],
        *dv.stride()[:3], p.head_dims, **pass_launch.constants)
    return dq, dk, dv
