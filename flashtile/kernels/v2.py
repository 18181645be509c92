"""FlashAttention-2 (Dao, 2023) in Triton: forward and backward.

Forward: one program per (Q block, batch x head); K/V blocks stream through an on-chip online
softmax, O stays unnormalised until one final division, only the logsumexp is saved.  Blocks
outside the causal/window band are never visited and only boundary blocks are masked.

Backward: a Q-parallel pass computes dQ and, on the way, D = rowsum(dO * O); then one program
per K/V block recomputes P from Q, K and the saved logsumexp and accumulates dK, dV on chip.
dQ comes from its own pass instead of fp32 atomics.  That pass recomputes QK^T and dO V^T
(7 matmuls instead of 5), in exchange for no fp32 dQ buffer, no atomic traffic, and gradients
that are bitwise deterministic.  GQA heads sharing a K/V head are summed inside the dK/dV
program, so repeated K/V is never materialised.

Scores go through the score hook (score.py) where they are formed, dS where it is formed.
With dropout (kernels/dropout.py) the forward scales each probability by its keep factor after
the row sum has counted it; the backward applies the same factor to P for dV and to dP.
"""
import torch
import triton
import triton.language as tl

from flashtile.kernels import dropout, score, tma
from flashtile.kernels.blocks import band_mask, program_sequence, program_tile, visited_blocks
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import Problem
from flashtile.kernels import quantize
from flashtile.kernels.tiles import (FP8_P_SCALE, FP8_PER_BLOCK, FP8_PER_HEAD, LOG2E, as_operand, finalize_rows,
                                     finite_or_zero, fp8_operand, fp8_row_scaled, load_tile, online_softmax_step,
                                     row_delta, store_tile, values_product)




@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, sks, svs, svd, rows, offs_n, offs_d, lo, hi,
                seqlen_k, dlo, dhi, scale_log2, site, drop, kv_descale, sdt,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK: tl.constexpr, UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr, SCORE: tl.constexpr,
                DROPOUT: tl.constexpr, FP8: tl.constexpr):
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        cols = n0 + offs_n
        k = load_tile(k_base + cols[:, None] * sks + offs_d[None, :], cols, seqlen_k, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, MASK, UPCAST)
        # The scale stays on the scores here (scale 1 below), unlike v3's exponent.
        tile_scale = scale_log2
        if FP8 == FP8_PER_BLOCK:  # this K block's descale; V's sits one part (sdt) further
            tile_scale = scale_log2 * tl.load(kv_descale + n0 // BLOCK_N)
        s = score.scaled_logits(tl.dot(q, tl.trans(k)), tile_scale, rows[:, None], cols[None, :], site, SCORE)
        if MASK:
            s = tl.where(band_mask(rows, cols, seqlen_k, dlo, dhi), s, float("-inf"))
        p, alpha, m_i = online_softmax_step(s, m_i, 1.0)
        l_i = l_i * alpha + tl.sum(p, 1)  # the denominator counts every probability, dropped or not
        if DROPOUT:
            p *= dropout.kept_scale(drop[0], drop[1], rows, n0, drop[2], BLOCK_N, False)
        v = load_tile(v_base + cols[:, None] * svs + offs_dv[None, :] * svd, cols, seqlen_k, offs_dv,
                      HEAD_DIM_V, HEAD_DIM_V_PAD, MASK, UPCAST)
        if FP8 == FP8_PER_BLOCK:  # P scaled into the float8 type's normal range for its matmul with V
            pv = tl.dot(fp8_operand(p * FP8_P_SCALE, v_base.dtype.element_ty, UPCAST), v)
            acc = acc * alpha[:, None] + pv * tl.load(kv_descale + sdt + n0 // BLOCK_N)
        elif FP8:
            acc = acc * alpha[:, None] + tl.dot(fp8_operand(p * FP8_P_SCALE, v_base.dtype.element_ty, UPCAST), v)
        else:
            acc = acc * alpha[:, None] + values_product(p, v, v_base.dtype.element_ty, UPCAST, MASK)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, SEED, DESCALE,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, svd, sob, sos, soh, slb, slh, sdt, sdb, sdh,
                seqlen_q, seqlen_k, totals, heads_q, group, scale_log2, window_left, window_right, score_args,
                dropout_p,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr, SCORE: tl.constexpr, DROPOUT: tl.constexpr,
                FP8: tl.constexpr):
    """FP8 (FP8_PER_HEAD or FP8_PER_BLOCK): q, k, v in float8, dequantized by DESCALE, q's, k's
    and v's descales (part stride sdt): per head (3, batch, heads_k), q's and k's multiplying
    the scores' scale and v's the output; or per block (3, batch, heads_q, blocks), q's per
    BLOCK_M rows of a query head, k's and v's per BLOCK_N rows of a KV head (the heads past
    heads_k unused), applied to each tile's scores and product."""
    bh, block, blocks = program_tile(seqlen_q, BLOCK_M)
    # Each head's heaviest (latest, for causal) Q blocks first: better balance on the last wave.
    m0 = (blocks - 1 - block) * BLOCK_M
    batch, head, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi = program_sequence(
        bh, heads_q, CU_Q, CU_K, seqlen_q, seqlen_k, totals, window_left, window_right, IS_VARLEN)
    if m0 >= seqlen_q:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_base = Q + batch * sqb + q_start * sqs + head * sqh
    k_base = K + batch * skb + k_start * sks + (head // group) * skh
    v_base = V + batch * svb + k_start * svs + (head // group) * svh
    q = load_tile(q_base + rows[:, None] * sqs + offs_d[None, :], rows, seqlen_q, offs_d,
                  HEAD_DIM, HEAD_DIM_PAD, True, UPCAST)
    site = (batch, head, seqlen_k - seqlen_q, score_args)
    drop = dropout.stream_of(SEED, batch, head, heads_q, dropout_p, DROPOUT)
    descale = DESCALE + batch * sdb + (head // group) * sdh  # this KV head's (per block: its blocks')
    if FP8 == FP8_PER_HEAD:
        scale_log2 = scale_log2 * tl.load(descale) * tl.load(descale + sdt)
    elif FP8 == FP8_PER_BLOCK:
        scale_log2 = scale_log2 * tl.load(DESCALE + batch * sdb + head * sdh + m0 // BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], tl.float32)
    lo, full_lo, full_hi, hi = visited_blocks(m0, BLOCK_M, BLOCK_N, seqlen_k, dlo, dhi)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, sks, svs, svd, rows, offs_n, offs_d,
                                full_lo, full_hi, seqlen_k, dlo, dhi, scale_log2, site, drop, descale + sdt, sdt,
                                HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                                BLOCK_N, False, UPCAST, NUM_STAGES, SCORE, DROPOUT, FP8)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, sks, svs, svd, rows, offs_n, offs_d,
                                lo, full_lo, seqlen_k, dlo, dhi, scale_log2, site, drop, descale + sdt, sdt,
                                HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                                BLOCK_N, True, UPCAST, NUM_STAGES, SCORE, DROPOUT, FP8)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, sks, svs, svd, rows, offs_n, offs_d,
                                full_hi, hi, seqlen_k, dlo, dhi, scale_log2, site, drop, descale + sdt, sdt,
                                HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                                BLOCK_N, True, UPCAST, NUM_STAGES, SCORE, DROPOUT, FP8)
    if FP8 == FP8_PER_HEAD:
        acc *= tl.load(descale + 2 * sdt) / FP8_P_SCALE
    elif FP8 == FP8_PER_BLOCK:
        acc /= FP8_P_SCALE
    out, lse = finalize_rows(acc, m_i, l_i)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    store_tile(O + batch * sob + q_start * sos + head * soh + rows[:, None] * sos + offs_dv[None, :],
               out, rows, seqlen_q, offs_dv, HEAD_DIM_V)
    tl.store(LSE + batch * slb + head * slh + q_start + rows, lse, mask=rows < seqlen_q)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqs, sds, n0, rows_k, offs_m, offs_d,
                 lo, hi, seqlen_q, dlo, dhi, scale_log2, site, drop, fp8_scales,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 MASK: tl.constexpr, UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr, SCORE: tl.constexpr,
                 DROPOUT: tl.constexpr, FP8: tl.constexpr, Q_ROWS: tl.constexpr, DO_ROWS: tl.constexpr):
    """Accumulate dK, dV of the K tile at n0 (rows rows_k) over the Q blocks [lo, hi), working on
    transposed scores.  FP8: ``fp8_scales`` is (K's and V's descales of the tile's rows, each
    (BLOCK_N, 1), and pointers to this head's Q and dO descales, one per Q_ROWS and DO_ROWS rows)."""
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    dtype = q_base.dtype.element_ty
    for m0 in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        cols = m0 + offs_m
        q = load_tile(q_base + cols[:, None] * sqs + offs_d[None, :], cols, seqlen_q, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, MASK, UPCAST)
        # Rows past the sequence read lse = +inf, so their probabilities are exactly 0.
        lse = tl.load(lse_base + cols, mask=cols < seqlen_q, other=float("inf")) * LOG2E
        s_scale = scale_log2
        if FP8:  # this Q block's descale and its dO's (BLOCK_M divides Q_ROWS and DO_ROWS)
            q_descale = tl.load(fp8_scales[2] + m0 // Q_ROWS)
            do_descale = tl.load(fp8_scales[3] + m0 // DO_ROWS)
            s_scale = scale_log2 * fp8_scales[0] * q_descale
        yT = score.logits(tl.dot(k, tl.trans(q)), s_scale, cols[None, :], rows_k[:, None], site, SCORE)
        pT = tl.math.exp2(yT * score.exp_scale(s_scale, site, SCORE) - lse[None, :])
        if MASK:
            visible = band_mask(rows_k, cols, seqlen_q, -dhi, -dlo)
            pT = tl.where(visible, pT, 0.0)
        do = load_tile(do_base + cols[:, None] * sds + offs_dv[None, :], cols, seqlen_q, offs_dv,
                       HEAD_DIM_V, HEAD_DIM_V_PAD, MASK, UPCAST)
        dpT = tl.dot(v, tl.trans(do))
        if DROPOUT:  # dV sees the dropped probabilities; dP reaches P through the same mask
            zT = dropout.kept_scale(drop[0], drop[1], cols, n0, drop[2], rows_k.shape[0], True)
            dv += tl.dot(as_operand(pT * zT, dtype, UPCAST), do)
            dpT *= zT
        elif FP8:  # P as the forward rounds it
            dpT *= fp8_scales[1] * do_descale
            dv += tl.dot(fp8_operand(pT * FP8_P_SCALE, dtype, UPCAST), do) * (do_descale / FP8_P_SCALE)
        else:
            dv += tl.dot(as_operand(pT, dtype, UPCAST), do)
        delta = tl.load(delta_base + cols, mask=cols < seqlen_q, other=0.0)
        dsT = score.grad(pT * (dpT - delta[None, :]), yT, cols[None, :], rows_k[:, None], site, SCORE)
        if MASK:  # a masked pair adds nothing, even where dP or its score is not finite
            dsT = tl.where(visible, dsT, 0.0)
        if FP8:
            ds_operand, ds_descale = fp8_row_scaled(dsT, dtype, UPCAST)
            dk += tl.dot(ds_operand, q) * (ds_descale * q_descale)
        else:
            dk += tl.dot(as_operand(dsT, dtype, UPCAST), q)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, SEED, DESCALE, DO_DESCALE,
                     sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
                     sdkb, sdks, sdkh, sdvb, sdvs, sdvh, slb, slh, sft, sfb, sfh, sgb, sgh,
                     seqlen_q, seqlen_k, totals, heads_k, group, softmax_scale, scale_log2,
                     window_left, window_right, score_args, dropout_p,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                     UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr, SCORE: tl.constexpr, DROPOUT: tl.constexpr,
                     FP8: tl.constexpr, Q_ROWS: tl.constexpr, KV_ROWS: tl.constexpr, DO_ROWS: tl.constexpr):
    """FP8: q, k, v and do in float8: q's, k's and v's descales DESCALE (3, batch, heads_q,
    blocks; strides sft, sfb, sfh), one per Q_ROWS rows of a query head or KV_ROWS rows of a KV
    head; do's DO_DESCALE (batch, heads_q, blocks; sgb, sgh), one per DO_ROWS rows.  dK and dV
    are with respect to the dequantized values; every matmul takes float8 operands, dS scaled
    per row of each product's output (tiles.fp8_row_scaled)."""
    tl.static_assert(not (FP8 and DROPOUT), "the FP8 backward takes no dropout")
    bh, block, _ = program_tile(seqlen_k, BLOCK_N)
    n0 = block * BLOCK_N
    batch, head_k, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi = program_sequence(
        bh, heads_k, CU_Q, CU_K, seqlen_q, seqlen_k, totals, window_left, window_right, IS_VARLEN)
    if n0 >= seqlen_k:
        return
    rows_k = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = load_tile(K + batch * skb + (k_start + rows_k[:, None]) * sks + head_k * skh + offs_d[None, :],
                  rows_k, seqlen_k, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, UPCAST)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    v = load_tile(V + batch * svb + (k_start + rows_k[:, None]) * svs + head_k * svh + offs_dv[None, :],
                  rows_k, seqlen_k, offs_dv, HEAD_DIM_V, HEAD_DIM_V_PAD, True, UPCAST)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], tl.float32)
    if FP8:  # the tile's rows' K and V descales (a row's block: its KV_ROWS)
        kv_descale = DESCALE + sft + batch * sfb + head_k * sfh + rows_k // KV_ROWS
        k_descale = tl.load(kv_descale, mask=rows_k < seqlen_k, other=1.0)[:, None]
        v_descale = tl.load(kv_descale + sft, mask=rows_k < seqlen_k, other=1.0)[:, None]
    # Q rows that see this K tile: the band with rows and columns swapped.
    lo, full_lo, full_hi, hi = visited_blocks(n0, BLOCK_N, BLOCK_M, seqlen_q, -dhi, -dlo)
    for g in range(group):
        head = head_k * group + g
        site = (batch, head, seqlen_k - seqlen_q, score_args)
        drop = dropout.stream_of(SEED, batch, head, heads_k * group, dropout_p, DROPOUT)
        q_base = Q + batch * sqb + q_start * sqs + head * sqh
        do_base = DO + batch * sdb + q_start * sds + head * sdh
        lse_base = LSE + batch * slb + head * slh + q_start
        delta_base = DELTA + batch * slb + head * slh + q_start
        fp8_scales = (DESCALE, DO_DESCALE)  # not read
        if FP8:
            fp8_scales = (k_descale, v_descale, DESCALE + batch * sfb + head * sfh,
                          DO_DESCALE + batch * sgb + head * sgh)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqs, sds, n0, rows_k,
                              offs_m, offs_d, full_lo, full_hi, seqlen_q, dlo, dhi, scale_log2, site, drop,
                              fp8_scales, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                              BLOCK_M, False, UPCAST, NUM_STAGES, SCORE, DROPOUT, FP8, Q_ROWS, DO_ROWS)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqs, sds, n0, rows_k,
                              offs_m, offs_d, lo, full_lo, seqlen_q, dlo, dhi, scale_log2, site, drop,
                              fp8_scales, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                              BLOCK_M, True, UPCAST, NUM_STAGES, SCORE, DROPOUT, FP8, Q_ROWS, DO_ROWS)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqs, sds, n0, rows_k,
                              offs_m, offs_d, full_hi, hi, seqlen_q, dlo, dhi, scale_log2, site, drop,
                              fp8_scales, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                              BLOCK_M, True, UPCAST, NUM_STAGES, SCORE, DROPOUT, FP8, Q_ROWS, DO_ROWS)
    store_tile(DK + batch * sdkb + (k_start + rows_k[:, None]) * sdks + head_k * sdkh + offs_d[None, :],
               dk * softmax_scale, rows_k, seqlen_k, offs_d, HEAD_DIM)
    store_tile(DV + batch * sdvb + (k_start + rows_k[:, None]) * sdvs + head_k * sdvh + offs_dv[None, :],
               dv, rows_k, seqlen_k, offs_dv, HEAD_DIM_V)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, k_base, v_base, sks, svs, rows, offs_n, offs_d, lo, hi,
               seqlen_k, dlo, dhi, scale_log2, site, drop, kv_descale, sft, do_descale,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK: tl.constexpr, UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr, SCORE: tl.constexpr,
               DROPOUT: tl.constexpr, FP8: tl.constexpr, KV_ROWS: tl.constexpr):
    """FP8: ``scale_log2`` holds each row's Q descale ((BLOCK_M, 1)), ``kv_descale`` points to this
    KV head's K descales (V's ``sft`` further), one per KV_ROWS keys; ``do_descale`` (BLOCK_M, 1)."""
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    dtype = k_base.dtype.element_ty
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        cols = n0 + offs_n
        k = load_tile(k_base + cols[:, None] * sks + offs_d[None, :], cols, seqlen_k, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, MASK, UPCAST)
        v = load_tile(v_base + cols[:, None] * svs + offs_dv[None, :], cols, seqlen_k, offs_dv,
                      HEAD_DIM_V, HEAD_DIM_V_PAD, MASK, UPCAST)
        s_scale = scale_log2
        if FP8:  # this K/V block's descales (BLOCK_N divides KV_ROWS)
            k_descale = tl.load(kv_descale + n0 // KV_ROWS)
            s_scale = scale_log2 * k_descale
        y = score.logits(tl.dot(q, tl.trans(k)), s_scale, rows[:, None], cols[None, :], site, SCORE)
        p = tl.math.exp2(y * score.exp_scale(s_scale, site, SCORE) - lse[:, None])
        if MASK:
            visible = band_mask(rows, cols, seqlen_k, dlo, dhi)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        if FP8:
            dp *= do_descale * tl.load(kv_descale + sft + n0 // KV_ROWS)
        if DROPOUT:
            dp *= dropout.kept_scale(drop[0], drop[1], rows, n0, drop[2], BLOCK_N, False)
        ds = score.grad(p * (dp - delta[:, None]), y, rows[:, None], cols[None, :], site, SCORE)
        if MASK:  # a masked pair adds nothing, even where dP, its score or its key is not finite
            ds = tl.where(visible, ds, 0.0)
            if not FP8:  # (float8 keys come from finite values)
                k = finite_or_zero(k)
        if FP8:
            ds_operand, ds_descale = fp8_row_scaled(ds, dtype, UPCAST)
            dq += tl.dot(ds_operand, k) * (ds_descale * k_descale)
        else:
            dq += tl.dot(as_operand(ds, dtype, UPCAST), k)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, O, DO, LSE, DLSE, DELTA, DQ, CU_Q, CU_K, SEED, DESCALE, DO8, DO_DESCALE,
                   sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, sdb, sds, sdh,
                   sdqb, sdqs, sdqh, slb, slh, sft, sfb, sfh, sgb, sgh, seqlen_q, seqlen_k, totals, heads_q, group,
                   softmax_scale, scale_log2, window_left, window_right, score_args, dropout_p,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                   UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_DLSE: tl.constexpr, SCORE: tl.constexpr,
                   DROPOUT: tl.constexpr, FP8: tl.constexpr, Q_ROWS: tl.constexpr, KV_ROWS: tl.constexpr,
                   DO_ROWS: tl.constexpr):
    """dQ of one Q block; also D = rowsum(dO * O) - dlse of its rows, stored for the dK/dV kernel.

    Computing D here, where dO is loaded anyway, saves the separate pass over O and dO that
    FlashAttention-2 runs first; it is why this kernel runs before the dK/dV kernel.  FP8: as
    _bwd_dkdv_kernel, dO's float8 copy DO8 (DO's strides) in the matmuls, DO in D.
    """
    bh, block, blocks = program_tile(seqlen_q, BLOCK_M)
    m0 = (blocks - 1 - block) * BLOCK_M
    batch, head, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi = program_sequence(
        bh, heads_q, CU_Q, CU_K, seqlen_q, seqlen_k, totals, window_left, window_right, IS_VARLEN)
    if m0 >= seqlen_q:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    drop = dropout.stream_of(SEED, batch, head, heads_q, dropout_p, DROPOUT)
    q = load_tile(Q + batch * sqb + (q_start + rows[:, None]) * sqs + head * sqh + offs_d[None, :],
                  rows, seqlen_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, UPCAST)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    do = load_tile(DO + batch * sdb + (q_start + rows[:, None]) * sds + head * sdh + offs_dv[None, :],
                   rows, seqlen_q, offs_dv, HEAD_DIM_V, HEAD_DIM_V_PAD, True, UPCAST)
    o = load_tile(O + batch * sob + (q_start + rows[:, None]) * sos + head * soh + offs_dv[None, :],
                  rows, seqlen_q, offs_dv, HEAD_DIM_V, HEAD_DIM_V_PAD, True, UPCAST)
    stat = batch * slb + head * slh + q_start + rows
    delta = row_delta(o, do, DLSE, stat, rows, seqlen_q, HAS_DLSE)
    tl.store(DELTA + stat, delta, mask=rows < seqlen_q)
    lse = tl.load(LSE + stat, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    k_base = K + batch * skb + k_start * sks + (head // group) * skh
    v_base = V + batch * svb + k_start * svs + (head // group) * svh
    kv_descale = DESCALE  # not read
    do_descale = scale_log2
    if FP8:  # each row's Q and dO descales; this KV head's K (and V) descales
        do = load_tile(DO8 + batch * sdb + (q_start + rows[:, None]) * sds + head * sdh + offs_dv[None, :],
                       rows, seqlen_q, offs_dv, HEAD_DIM_V, HEAD_DIM_V_PAD, True, UPCAST)
        do_descale = tl.load(DO_DESCALE + batch * sgb + head * sgh + rows // DO_ROWS, mask=rows < seqlen_q,
                             other=1.0)[:, None]
        scale_log2 = scale_log2 * tl.load(DESCALE + batch * sfb + head * sfh + rows // Q_ROWS,
                                          mask=rows < seqlen_q, other=1.0)[:, None]
        kv_descale = DESCALE + sft + batch * sfb + (head // group) * sfh
    site = (batch, head, seqlen_k - seqlen_q, score_args)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    lo, full_lo, full_hi, hi = visited_blocks(m0, BLOCK_M, BLOCK_N, seqlen_k, dlo, dhi)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, sks, svs, rows, offs_n, offs_d,
                    full_lo, full_hi, seqlen_k, dlo, dhi, scale_log2, site, drop, kv_descale, sft, do_descale,
                    HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                    BLOCK_N, False, UPCAST, NUM_STAGES, SCORE, DROPOUT,
                    FP8, KV_ROWS)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, sks, svs, rows, offs_n, offs_d,
                    lo, full_lo, seqlen_k, dlo, dhi, scale_log2, site, drop, kv_descale, sft, do_descale,
                    HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                    BLOCK_N, True, UPCAST, NUM_STAGES, SCORE, DROPOUT,
                    FP8, KV_ROWS)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, sks, svs, rows, offs_n, offs_d,
                    full_hi, hi, seqlen_k, dlo, dhi, scale_log2, site, drop, kv_descale, sft, do_descale,
                    HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                    BLOCK_N, True, UPCAST, NUM_STAGES, SCORE, DROPOUT,
                    FP8, KV_ROWS)
    store_tile(DQ + batch * sdqb + (q_start + rows[:, None]) * sdqs + head * sdqh + offs_d[None, :],
               dq * softmax_scale, rows, seqlen_q, offs_d, HEAD_DIM)


def forward(plan, p: Problem, q, k, v):
    """Returns (out, lse, saved); lse is (b, h, sq) or, for varlen, (h, total_q), natural log.

    ``saved`` (what the backward needs beyond lse) is empty for this version."""
    out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=p.out_dtype(q))
    lse = torch.empty(p.row_stat_shape(q.shape[0]), dtype=torch.float32, device=q.device)
    cfg = plan.config
    cu_q, cu_k = p.cu_pointers(q.device)
    grid = (p.batch * p.heads_q * p.query_blocks(cfg.block_m),)
    descale = p.fp8_descale if p.fp8 else lse
    if p.fp8:  # the same shape, its keys contiguous
        v = tma.keys_contiguous(v).movedim(-1, -3)
    launch(
        _fwd_kernel, grid,
        q, k, v, out, lse, cu_q, cu_k, dropout.seed_argument(p, cu_q), descale,
        *p.seq_strides(q), *p.seq_strides(k), *p.seq_strides(v), v.stride(-1), *p.seq_strides(out),
        *p.row_stat_strides(lse), *p.fp8_descale_strides(),
        p.seqlen_q, p.seqlen_k, p.totals, p.heads_q, p.group, p.scale_log2, p.window_left, p.window_right,
        score.args_of(p), p.dropout_p,
        HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad, HEAD_DIM_V=p.head_dim_v, HEAD_DIM_V_PAD=p.head_dim_v_pad,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        IS_VARLEN=p.varlen, UPCAST=p.upcast(q), NUM_STAGES=cfg.num_stages, SCORE=score.mod_of(p),
        DROPOUT=p.dropout, FP8=p.fp8_mode, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse, lse.new_empty(0)


def _fp8_backward_operands(p: Problem, dout, do_rows: int, dtype, placeholder):
    """(do8, descales, do's descales, their strides, rows) the backward kernels read: FP8
    problems quantize dO to ``dtype`` (q's float8 type), one descale per ``do_rows`` rows of a head;
    without FP8, placeholders never read."""
    if not p.fp8:
        return dout, placeholder, placeholder, (0,) * 5, dict(FP8=False, Q_ROWS=1, KV_ROWS=1, DO_ROWS=1)
    d = p.fp8_descale
    do8, do_descale = quantize.blocks(dout, do_rows, dtype, torch.finfo(dtype).max)
    q_rows, kv_rows = p.fp8_rows
    return (do8, d, do_descale, (d.stride(0), d.stride(1), d.stride(2), do_descale.stride(0), do_descale.stride(1)),
            dict(FP8=True, Q_ROWS=q_rows, KV_ROWS=kv_rows, DO_ROWS=do_rows))


def backward(plan, p: Problem, dout, dlse, q, k, v, out, lse, saved):
    """dq, dk, dv.  ``dlse`` (the gradient reaching the logsumexp) may be None.  FP8 problems
    (descales per block, ``p.fp8_rows``): float32 gradients with respect to the dequantized q, k, v."""
    dq, dk, dv = p.gradients(q, k, v)
    delta = torch.empty_like(lse)
    cu_q, cu_k = p.cu_pointers(q.device)
    kv_cfg, q_cfg = plan.config
    if p.fp8:  # dO8 shares dO's strides
        dout = dout.contiguous()
    do8, descale, do_descale, fp8_strides, fp8 = _fp8_backward_operands(p, dout, kv_cfg.block_m, q.dtype, lse)
    common = dict(HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad, HEAD_DIM_V=p.head_dim_v,
                  HEAD_DIM_V_PAD=p.head_dim_v_pad, IS_VARLEN=p.varlen, UPCAST=p.upcast(q),
                  SCORE=score.mod_of(p), DROPOUT=p.dropout, **fp8)
    # The dQ pass writes D, which the dK/dV pass reads: launched first, on the same stream.
    launch(
        _bwd_dq_kernel, (p.batch * p.heads_q * p.query_blocks(q_cfg.block_m),),
        q, k, v, out, dout, lse, delta if dlse is None else dlse, delta, dq, cu_q, cu_k, dropout.seed_argument(p, cu_q),
        descale, do8, do_descale,
        *p.seq_strides(q), *p.seq_strides(k), *p.seq_strides(v), *p.seq_strides(out),
        *p.seq_strides(dout), *p.seq_strides(dq), *p.row_stat_strides(lse), *fp8_strides,
        p.seqlen_q, p.seqlen_k, p.totals, p.heads_q, p.group, p.softmax_scale, p.scale_log2,
        p.window_left, p.window_right, score.args_of(p), p.dropout_p, BLOCK_M=q_cfg.block_m, BLOCK_N=q_cfg.block_n,
        NUM_STAGES=q_cfg.num_stages, HAS_DLSE=dlse is not None, num_warps=q_cfg.num_warps,
        num_stages=q_cfg.num_stages, **common)
    launch(
        _bwd_dkdv_kernel, (p.batch * p.heads_k * p.key_blocks(kv_cfg.block_n),),
        q, k, v, do8, lse, delta, dk, dv, cu_q, cu_k, dropout.seed_argument(p, cu_q), descale, do_descale,
        *p.seq_strides(q), *p.seq_strides(k), *p.seq_strides(v), *p.seq_strides(dout),
        *p.seq_strides(dk), *p.seq_strides(dv), *p.row_stat_strides(lse), *fp8_strides,
        p.seqlen_q, p.seqlen_k, p.totals, p.heads_k, p.group, p.softmax_scale, p.scale_log2,
        p.window_left, p.window_right, score.args_of(p), p.dropout_p, BLOCK_M=kv_cfg.block_m, BLOCK_N=kv_cfg.block_n,
        NUM_STAGES=kv_cfg.num_stages, num_warps=kv_cfg.num_warps, num_stages=kv_cfg.num_stages, **common)
    return dq, dk, dv
