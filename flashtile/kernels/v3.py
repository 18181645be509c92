"""FlashAttention-3-style kernels for Hopper.

On the GPU, batched forwards run kernels/v3_gluon.py: FlashAttention-3's schedule in Gluon
(ping-pong consumer warpgroups, softmax overlapped with the GEMMs, a persistent scheduler;
configs.v3_forward_kernel).  This file holds v3's plain-Triton kernels, which run everything
else (varlen, layouts the Gluon kernel does not take, the CPU interpreter), and routes the
backward.

What Hopper changes relative to kernels/v2.py, forward:
- Q, K, V and O move through TMA: tensor descriptors built on the device, one per (sequence,
  head), whose shape ends at the sequence end, so the copy engine zero-fills the tail of the
  last block and clips the output store (no address arithmetic or load masks);
- ``tl.dot`` on descriptor-loaded tiles lowers to asynchronous warpgroup MMA (wgmma) fed
  from a multi-stage shared-memory pipeline; P stays in registers as the PV product's A operand;
- on unmasked problems (no causal/window band, seqlen_k a multiple of BLOCK_N) one unmasked
  loop runs, which a config may warp-specialize (a producer warpgroup issuing the TMA loads,
  consumer warpgroups running the GEMMs and the softmax).  Triton 3.6 applies that only to a
  single loop with 4 warps, so banded problems keep v2's three-segment loop on TMA.  The
  shipped configs use it at d128 (configs.py).

Backward (configs.v3_backward): Gluon kernels (kernels/v3_gluon_bwd.py): FlashAttention-3's
single K/V-stationary pass with dQ added in fp32 by TMA reduce-add on long keys (d64, d128),
two deterministic passes (dQ, then dK/dV) on short ones, at d256 (the head dim split between
the warpgroups) and under ``deterministic=True``; elsewhere (varlen, head dims up to 32,
stride-0 layouts) v2's backward.  The same single pass written in plain Triton is here too
(one program per K/V tile, Q/dO blocks through device TMA descriptors, a conversion at the
end), but measured slower than v2's backward on the H200: it runs only on request
(FLASHTILE_V3_DQ=reduce), and never with ``deterministic=True``.
"""
import torch
import triton
import triton.language as tl

from flashtile import runtime
from flashtile.kernels import v2, v3_gluon, v3_gluon_bwd
from flashtile.kernels.blocks import band_mask, program_sequence, program_tile, sequence_bounds, visited_blocks
from flashtile.kernels.configs import (v3_backward, v3_bwd_reduce_config, v3_fallback_forward, v3_forward_kernel,
                                       v3_fwd_config, v3_gluon_schedule)
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import Problem
from flashtile.kernels.v3_gluon import tma_ready
from flashtile.kernels.tiles import (LOG2E, as_operand, finalize_rows, load_tile, online_softmax_step,
                                     row_delta)


@triton.jit
def _head_desc(base, seq_start, seqlen, row_stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PAD: tl.constexpr):
    """TMA descriptor over one sequence of one head: (seqlen, HEAD_DIM) rows from ``base``.

    Its shape ends where the sequence and the head dim end, so loads past them read zeros and
    stores past them are dropped."""
    return tl.make_tensor_descriptor(base + seq_start * row_stride, shape=[seqlen, HEAD_DIM],
                                     strides=[row_stride, 1], block_shape=[BLOCK, HEAD_DIM_PAD])


@triton.jit
def _load(desc, row, UPCAST: tl.constexpr):
    x = desc.load([row, 0])
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, lo, hi, seqlen_k, dlo, dhi, scale_log2,
                BLOCK_N: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr,
                NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE,
                       flatten=False):
        k = _load(k_desc, n0, UPCAST)
        s = tl.dot(q, tl.trans(k))
        if MASK:
            s = tl.where(band_mask(rows, n0 + offs_n, seqlen_k, dlo, dhi), s, float("-inf"))
        p, alpha, m_i = online_softmax_step(s, m_i, scale_log2)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(v_desc, n0, UPCAST)
        acc = acc * alpha[:, None] + tl.dot(as_operand(p, v_desc.dtype, UPCAST), v)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
                seqlen_q, seqlen_k, heads_q, group, scale_log2, window_left, window_right,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                UNMASKED: tl.constexpr, UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr,
                WARP_SPECIALIZE: tl.constexpr):
    bh, block, blocks = program_tile(seqlen_q, BLOCK_M)
    m0 = (blocks - 1 - block) * BLOCK_M
    batch, head, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi = program_sequence(
        bh, heads_q, CU_Q, CU_K, seqlen_q, seqlen_k, window_left, window_right, IS_VARLEN)
    head_k = head // group
    if IS_VARLEN:  # the grid covers the longest sequence; padded grids need no check (WS rejects it)
        if m0 >= seqlen_q:
            return
    q_desc = _head_desc(Q + batch * sqb + head * sqh, q_start, seqlen_q, sqs, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
    k_desc = _head_desc(K + batch * skb + head_k * skh, k_start, seqlen_k, sks, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    v_desc = _head_desc(V + batch * svb + head_k * svh, k_start, seqlen_k, svs, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    o_desc = _head_desc(O + batch * sob + head * soh, q_start, seqlen_q, sos, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = _load(q_desc, m0, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if UNMASKED:
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, 0, seqlen_k, seqlen_k,
                                    dlo, dhi, scale_log2, BLOCK_N, False, UPCAST, NUM_STAGES, WARP_SPECIALIZE)
    else:
        lo, full_lo, full_hi, hi = visited_blocks(m0, BLOCK_M, BLOCK_N, seqlen_k, dlo, dhi)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, full_lo, full_hi, seqlen_k,
                                    dlo, dhi, scale_log2, BLOCK_N, False, UPCAST, NUM_STAGES, False)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, lo, full_lo, seqlen_k,
                                    dlo, dhi, scale_log2, BLOCK_N, True, UPCAST, NUM_STAGES, False)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, full_hi, hi, seqlen_k,
                                    dlo, dhi, scale_log2, BLOCK_N, True, UPCAST, NUM_STAGES, False)
    out, lse = finalize_rows(acc, m_i, l_i)
    o_desc.store([m0, 0], out.to(o_desc.dtype))
    if WARP_SPECIALIZE:
        # Triton 3.6 splits the tile's rows between the two consumer warpgroups and offsets the
        # second half twice in `m0 + tl.arange(...)` (rows m0+128.. instead of m0+64..), so a
        # pointer store would write the wrong rows; a descriptor store gets the right offset.
        lse_desc = tl.make_tensor_descriptor(LSE + batch * slb + head * slh + q_start, shape=[seqlen_q],
                                             strides=[1], block_shape=[BLOCK_M])
        lse_desc.store([m0], lse)
    else:
        tl.store(LSE + batch * slb + head * slh + q_start + rows, lse, mask=rows < seqlen_q)


@triton.jit
def _bwd_preprocess_kernel(O, DO, DLSE, DELTA, CU_Q, sob, sos, soh, sdb, sds, sdh, slb, slh,
                           seqlen_q, heads_q, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr):
    """D = rowsum(dO * O) - dlse for the rows of one block, before the K/V-stationary kernel."""
    bh = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    batch = (bh // heads_q).to(tl.int64)
    head = (bh % heads_q).to(tl.int64)
    q_start, seqlen_q = sequence_bounds(batch, CU_Q, seqlen_q, IS_VARLEN)
    if m0 >= seqlen_q:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = load_tile(O + batch * sob + (q_start + rows[:, None]) * sos + head * soh + offs_d[None, :],
                  rows, seqlen_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, True)
    do = load_tile(DO + batch * sdb + (q_start + rows[:, None]) * sds + head * sdh + offs_d[None, :],
                   rows, seqlen_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, True)
    stat = batch * slb + head * slh + q_start + rows
    tl.store(DELTA + stat, row_delta(o, do, DLSE, stat, rows, seqlen_q, HAS_DLSE), mask=rows < seqlen_q)


@triton.jit
def _bwd_blocks(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, sas, d_ok, lse_base, delta_base, rows_k,
                offs_m, lo, hi, seqlen_q, dlo, dhi, softmax_scale, scale_log2, BLOCK_M: tl.constexpr,
                MASK: tl.constexpr,
                UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr, TMA_REDUCE: tl.constexpr):
    """One K/V tile against the Q blocks [lo, hi): dK, dV on chip, dQ added to fp32 in memory."""
    for m0 in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        cols = m0 + offs_m
        q = _load(q_desc, m0, UPCAST)
        # Rows past the sequence read lse = +inf, so their probabilities are exactly 0.
        lse = tl.load(lse_base + cols, mask=cols < seqlen_q, other=float("inf")) * LOG2E
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :])
        if MASK:
            pT = tl.where(band_mask(rows_k, cols, seqlen_q, -dhi, -dlo), pT, 0.0)
        do = _load(do_desc, m0, UPCAST)
        dv += tl.dot(as_operand(pT, do_desc.dtype, UPCAST), do)
        delta = tl.load(delta_base + cols, mask=cols < seqlen_q, other=0.0)
        dsT = as_operand(pT * (tl.dot(v, tl.trans(do)) - delta[None, :]), do_desc.dtype, UPCAST)
        dk += tl.dot(dsT, q)
        # Scaled here, so the fp32 sum needs only a cast afterwards, not another pass.
        dq = tl.dot(tl.trans(dsT), k) * softmax_scale
        if TMA_REDUCE:
            # One bulk reduce-add per tile (cp.reduce.async.bulk.tensor); rows past the
            # sequence fall outside the descriptor and are dropped.
            dq_desc.atomic_add([m0, 0], dq)
        else:  # the interpreter has no descriptor reduce: element atomics, same arithmetic
            tl.atomic_add(dq_ptrs + m0 * sas, dq, mask=(cols[:, None] < seqlen_q) & d_ok[None, :])
    return dk, dv


@triton.jit
def _bwd_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQACC, CU_Q, CU_K,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
                sdkb, sdks, sdkh, sdvb, sdvs, sdvh, sab, sas, sah, slb, slh,
                seqlen_q, seqlen_k, heads_k, group, softmax_scale, scale_log2, window_left, window_right,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr,
                NUM_STAGES: tl.constexpr, TMA_REDUCE: tl.constexpr):
    """K/V-stationary backward (FlashAttention-3): one program per K/V tile, every Q block of
    the band streamed through TMA, dQ accumulated in fp32 by reduce-adds instead of a second pass."""
    bh, block, _ = program_tile(seqlen_k, BLOCK_N)
    n0 = block * BLOCK_N
    batch, head_k, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi = program_sequence(
        bh, heads_k, CU_Q, CU_K, seqlen_q, seqlen_k, window_left, window_right, IS_VARLEN)
    if n0 >= seqlen_k:
        return
    k_desc = _head_desc(K + batch * skb + head_k * skh, k_start, seqlen_k, sks, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    v_desc = _head_desc(V + batch * svb + head_k * svh, k_start, seqlen_k, svs, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    k = _load(k_desc, n0, UPCAST)
    v = _load(v_desc, n0, UPCAST)
    rows_k = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    lo, full_lo, full_hi, hi = visited_blocks(n0, BLOCK_N, BLOCK_M, seqlen_q, -dhi, -dlo)
    for g in range(group):
        head = head_k * group + g
        q_desc = _head_desc(Q + batch * sqb + head * sqh, q_start, seqlen_q, sqs, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
        do_desc = _head_desc(DO + batch * sdb + head * sdh, q_start, seqlen_q, sds, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD)
        dq_desc = _head_desc(DQACC + batch * sab + head * sah, q_start, seqlen_q, sas, BLOCK_M, HEAD_DIM,
                             HEAD_DIM_PAD)
        dq_ptrs = DQACC + batch * sab + head * sah + (q_start + offs_m[:, None]) * sas + offs_d[None, :]
        lse_base = LSE + batch * slb + head * slh + q_start
        delta_base = DELTA + batch * slb + head * slh + q_start
        dk, dv = _bwd_blocks(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, sas, d_ok, lse_base, delta_base,
                             rows_k, offs_m, full_lo, full_hi, seqlen_q, dlo, dhi, softmax_scale, scale_log2,
                             BLOCK_M, False, UPCAST, NUM_STAGES, TMA_REDUCE)
        dk, dv = _bwd_blocks(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, sas, d_ok, lse_base, delta_base,
                             rows_k, offs_m, lo, full_lo, seqlen_q, dlo, dhi, softmax_scale, scale_log2,
                             BLOCK_M, True, UPCAST, NUM_STAGES, TMA_REDUCE)
        dk, dv = _bwd_blocks(dk, dv, k, v, q_desc, do_desc, dq_desc, dq_ptrs, sas, d_ok, lse_base, delta_base,
                             rows_k, offs_m, full_hi, hi, seqlen_q, dlo, dhi, softmax_scale, scale_log2,
                             BLOCK_M, True, UPCAST, NUM_STAGES, TMA_REDUCE)
    dk_desc = _head_desc(DK + batch * sdkb + head_k * sdkh, k_start, seqlen_k, sdks, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    dv_desc = _head_desc(DV + batch * sdvb + head_k * sdvh, k_start, seqlen_k, sdvs, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD)
    dk_desc.store([n0, 0], (dk * softmax_scale).to(dk_desc.dtype))
    dv_desc.store([n0, 0], dv.to(dv_desc.dtype))


def _set_allocator(device):
    # Device-side descriptors live in a small global scratch buffer Triton asks for at launch.
    if device.type == "cuda":
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def forward(p: Problem, q, k, v):
    kernel = v3_forward_kernel(p)
    if kernel != "v2":  # both v3 kernels read through TMA
        q, k, v = (tma_ready(x) for x in (q, k, v))
    if kernel == "gluon":
        if v3_gluon.supports(p, q, k, v):
            out, lse = v3_gluon.forward(p, q, k, v, v3_gluon_schedule(p))
            return out, lse, lse.new_empty(0)
        kernel = v3_fallback_forward(p)
    if kernel == "v2":
        return v2.forward(p, q, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.row_stat_shape(q.shape[0]), dtype=torch.float32, device=q.device)
    unmasked = (p.window_left < 0 and p.window_right < 0 and not p.varlen)
    cfg = v3_fwd_config(p, unmasked)
    unmasked = unmasked and p.seqlen_k % cfg.block_n == 0
    # The logsumexp's 1-D TMA store needs 16-byte aligned rows: seqlen_q % 4 == 0.
    warp_specialize = unmasked and not runtime.interpreting() and p.seqlen_q % 4 == 0
    if cfg.warp_specialize and not warp_specialize:
        cfg = v3_fwd_config(p, unmasked, warp_specialize=False)
    cu_q, cu_k = p.cu_pointers(q.device)
    _set_allocator(q.device)
    grid = (p.batch * p.heads_q * p.query_blocks(cfg.block_m),)
    launch(
        _fwd_kernel, grid,
        q, k, v, out, lse, cu_q, cu_k,
        *p.seq_strides(q), *p.seq_strides(k), *p.seq_strides(v), *p.seq_strides(out),
        *p.row_stat_strides(lse),
        p.seqlen_q, p.seqlen_k, p.heads_q, p.group, p.scale_log2, p.window_left, p.window_right,
        HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        IS_VARLEN=p.varlen, UNMASKED=unmasked, UPCAST=p.upcast(q), NUM_STAGES=cfg.num_stages,
        WARP_SPECIALIZE=warp_specialize and cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse, lse.new_empty(0)


def _delta(p: Problem, out, dout, dlse, lse):
    """D = rowsum(dO * O) - dlse, for the single-pass backwards (the two-pass ones compute it in
    their dQ pass)."""
    delta = torch.empty_like(lse)
    cu_q, _ = p.cu_pointers(out.device)
    launch(
        _bwd_preprocess_kernel, (p.batch * p.heads_q, p.query_blocks(64)),
        out, dout, delta if dlse is None else dlse, delta, cu_q, *p.seq_strides(out), *p.seq_strides(dout),
        *p.row_stat_strides(lse), p.seqlen_q, p.heads_q, HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad,
        BLOCK_M=64, IS_VARLEN=p.varlen, HAS_DLSE=dlse is not None, num_warps=4)
    return delta


def backward(p: Problem, dout, dlse, q, k, v, out, lse, saved):
    """dq, dk, dv, from the kernels configs.v3_backward picks: two passes (Gluon's or v2's,
    bitwise reproducible), or one K/V-stationary pass adding dQ by TMA reduce-add (Gluon's or the
    plain-Triton one here), whose summation order varies from run to run."""
    kernels = v3_backward(p)
    if kernels == "v2":
        return v2.backward(p, dout, dlse, q, k, v, out, lse, saved)
    q, k, v, dout = (tma_ready(x) for x in (q, k, v, dout))
    if kernels in ("gluon", "gluon-reduce"):
        if not v3_gluon_bwd.supports(p, q, k, v, dout):
            return v2.backward(p, dout, dlse, q, k, v, out, lse, saved)
        if kernels == "gluon":
            return v3_gluon_bwd.backward(p, dout, dlse, q, k, v, out, lse)
        return v3_gluon_bwd.backward_reduce(p, dout, q, k, v, lse, _delta(p, out, dout, dlse, lse))
    cfg = v3_bwd_reduce_config(p)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    delta = _delta(p, out, dout, dlse, lse)
    cu_q, cu_k = p.cu_pointers(q.device)
    common = dict(HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad, IS_VARLEN=p.varlen)
    _set_allocator(q.device)
    launch(
        _bwd_kernel, (p.batch * p.heads_k * p.key_blocks(cfg.block_n),),
        q, k, v, dout, lse, delta, dk, dv, dq_acc, cu_q, cu_k,
        *p.seq_strides(q), *p.seq_strides(k), *p.seq_strides(v), *p.seq_strides(dout),
        *p.seq_strides(dk), *p.seq_strides(dv), *p.seq_strides(dq_acc), *p.row_stat_strides(lse),
        p.seqlen_q, p.seqlen_k, p.heads_k, p.group, p.softmax_scale, p.scale_log2,
        p.window_left, p.window_right, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, UPCAST=p.upcast(q),
        NUM_STAGES=cfg.num_stages, TMA_REDUCE=not runtime.interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
    return dq_acc.to(q.dtype), dk, dv
