"""FlashAttention-1 (Dao et al., 2022), as in the paper's Algorithm 1 and its backward.

Deliberately without FlashAttention-2's changes, so that it shows what they bought:
- the K/V loop is outside and the Q loop inside, so O (fp32), the row max m and the row sum l
  travel through HBM at every inner step, and O is renormalised at every step;
- every visited block is masked (no unmasked fast path), and the backward recomputes
  P = exp(S - m) / l from the saved m and l, computes D = rowsum(dO * O) inside its inner
  loop, and accumulates dQ in HBM;
- one program per (batch, head), as in the paper, whenever batch x heads fills the GPU.
  When it does not (long sequences, small batch), the FA1 code release split the work of one
  (batch, head) over several thread blocks (its ``num_splits``: query rows in the forward, key
  columns in the backward); so does this module, each program keeping Algorithm 1's loop order
  on its share.  ``KernelOptions(v1_splits=1)`` forces the paper's one program per (batch, head).
In the forward, K/V blocks that no query sees are not visited (the FA1 CUDA code skipped them
too); the backward visits every K/V block so that all of dK, dV is written.  Dropout is the
paper's Algorithm 2 (m and l count every probability, O the kept ones), drawn as v2 draws it
(kernels/dropout.py); V may have a head dim of its own (HEAD_DIM_V).
"""
import math

import torch
import triton
import triton.language as tl

from flashtile import gpu, options
from flashtile.kernels import dropout, score
from flashtile.kernels.blocks import band_mask, program_sequence, visited_blocks
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import Problem, cdiv
from flashtile.kernels.tiles import as_operand, finite_or_zero, load_tile, store_tile, values_product

# On-chip memory of one SM that the paper's block-size rule divides up: the 227 KiB one
# Hopper thread block may use, counted in 2-byte elements.
SRAM_ELEMENTS = 232448 // 2


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def block_sizes(head_dim_pad: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((Br, Bc) of the forward, (Br, Bc) of the backward) by the paper's rule.

    Forward: Bc = ceil(M / 4d), Br = min(Bc, d), for the four tiles Q_i, K_j, V_j, O_i on chip.
    The backward also holds dK_j and dV_j next to K_j and V_j, so its column block halves:
    Bc = ceil(M / 8d).  Triton tiles must be powers of two, so each is rounded down to one and
    capped where the register file, not shared memory, runs out first: 128 rows, and 64
    columns in the backward.  (One stage: FA1 predates software pipelining of the K/V loads.)
    """
    bc = min(128, _pow2_floor(cdiv(SRAM_ELEMENTS, 4 * head_dim_pad)))
    br = min(bc, head_dim_pad)
    bwd_bc = min(64, _pow2_floor(cdiv(SRAM_ELEMENTS, 8 * head_dim_pad)))
    return (br, bc), (br, bwd_bc)


# The backward keeps one partial fp32 dQ per split (summed afterwards, in a fixed order, so
# gradients stay deterministic); this cap bounds that extra memory to 4x the size of Q in fp32.
MAX_BWD_SPLITS = 4


def splits(programs: int, n_blocks: int, device, cap: int, forced=None) -> int:
    """How many programs share one (batch, head), given ``programs`` (batch, head) pairs and
    ``n_blocks`` blocks to share: enough for two programs per SM (one alone cannot hide its
    HBM latency, as this kernel has no pipelining), as FA1's code did, at most ``cap``;
    ``forced`` (the plan's) if given."""
    if forced:
        return max(1, min(forced, n_blocks))
    # Under the interpreter a 2-SM "device" keeps the split path exercised by small CPU tests.
    sms = 2 if options.interpreting() else gpu.sm_count(device.index)
    target = 2 * sms
    if programs >= 0.8 * target:
        return 1
    return max(1, min(cdiv(target, programs), n_blocks, cap))


@triton.jit
def _fwd_kernel(Q, K, V, OACC, M, L, CU_Q, CU_K, SEED,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
                seqlen_q, seqlen_k, totals, heads_q, group, scale_log2, window_left, window_right, n_splits,
                score_args, dropout_p, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                UPCAST: tl.constexpr, SCORE: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                HEAD_DIM_V_PAD: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    batch, head, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi = program_sequence(
        bh, heads_q, CU_Q, CU_K, seqlen_q, seqlen_k, totals, window_left, window_right, IS_VARLEN)
    site = (batch, head, seqlen_k - seqlen_q, score_args)
    drop = dropout.stream_of(SEED, batch, head, heads_q, dropout_p, DROPOUT)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    q_base = Q + batch * sqb + q_start * sqs + head * sqh
    o_base = OACC + batch * sob + q_start * sos + head * soh
    stat_base = batch * slb + head * slh + q_start
    k_base = K + batch * skb + k_start * sks + (head // group) * skh
    v_base = V + batch * svb + k_start * svs + (head // group) * svh

    # Outer loop: K/V blocks (Algorithm 1, line 5).
    kv_lo, _, _, kv_hi = visited_blocks(0, seqlen_q, BLOCK_N, seqlen_k, dlo, dhi)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        cols = n0 + offs_n
        k = load_tile(k_base + cols[:, None] * sks + offs_d[None, :], cols, seqlen_k, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, True, UPCAST)
        v = load_tile(v_base + cols[:, None] * svs + offs_dv[None, :], cols, seqlen_k, offs_dv,
                      HEAD_DIM_V, HEAD_DIM_V_PAD, True, UPCAST)
        q_lo, _, _, q_hi = visited_blocks(n0, BLOCK_N, BLOCK_M, seqlen_q, -dhi, -dlo)
        # Inner loop: Q blocks (line 7); O_i, l_i, m_i come from and go back to HBM.  This
        # program's share is every n_splits-th block (interleaved, so causal work stays balanced).
        q_lo += (split + n_splits - (q_lo // BLOCK_M) % n_splits) % n_splits * BLOCK_M
        for m0 in range(q_lo, q_hi, n_splits * BLOCK_M):
            rows = m0 + offs_m
            in_seq = rows < seqlen_q
            q = load_tile(q_base + rows[:, None] * sqs + offs_d[None, :], rows, seqlen_q, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, True, UPCAST)
            o_ptrs = o_base + rows[:, None] * sos + offs_dv[None, :]
            o = tl.load(o_ptrs, mask=in_seq[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
            l_i = tl.load(L + stat_base + rows, mask=in_seq, other=0.0)
            m_i = tl.load(M + stat_base + rows, mask=in_seq, other=float("-inf"))
            s = score.scaled_logits(tl.dot(q, tl.trans(k)), scale_log2, rows[:, None], cols[None, :], site, SCORE)
            s = tl.where(band_mask(rows, cols, seqlen_k, dlo, dhi), s, float("-inf"))
            m_blk = tl.max(s, 1)
            p = tl.math.exp2(s - tl.where(m_blk == float("-inf"), 0.0, m_blk)[:, None])
            l_blk = tl.sum(p, 1)
            m_new = tl.maximum(m_i, m_blk)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            old_w = tl.math.exp2(m_i - m_ref)
            blk_w = tl.math.exp2(m_blk - m_ref)
            l_new = old_w * l_i + blk_w * l_blk
            if DROPOUT:  # l counts every probability; O sums the kept ones (the paper's Algorithm 2)
                p *= dropout.kept_scale(drop[0], drop[1], rows, n0, drop[2], BLOCK_N, False)
            pv = values_product(p, v, v_base.dtype.element_ty, UPCAST, True)
            o = (o * (l_i * old_w)[:, None] + pv * blk_w[:, None]) / tl.where(l_new == 0.0, 1.0, l_new)[:, None]
            tl.store(o_ptrs, o, mask=in_seq[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
            tl.store(L + stat_base + rows, l_new, mask=in_seq)
            tl.store(M + stat_base + rows, m_new, mask=in_seq)
        # The next outer step re-reads O, l, m written by other threads of this program.
        tl.debug_barrier()


@triton.jit
def _bwd_kernel(Q, K, V, O, DO, DLSE, M, L, DQACC, DK, DV, CU_Q, CU_K, SEED,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, sdb, sds, sdh,
                sqab, sqas, sqah, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, slb, slh,
                seqlen_q, seqlen_k, totals, heads_k, group, softmax_scale, scale_log2,
                window_left, window_right, n_splits, dq_split_stride, score_args, dropout_p,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                UPCAST: tl.constexpr, HAS_DLSE: tl.constexpr, SCORE: tl.constexpr, DROPOUT: tl.constexpr,
                HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    DQACC += split.to(tl.int64) * dq_split_stride  # this split's partial dQ (int64: it can pass 2**31)
    batch, head_k, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi = program_sequence(
        bh, heads_k, CU_Q, CU_K, seqlen_q, seqlen_k, totals, window_left, window_right, IS_VARLEN)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    # Every K/V block, also those no query sees: their dK, dV must still be written (as 0).
    # This program's share is every n_splits-th block.
    for n0 in range(split * BLOCK_N, seqlen_k, n_splits * BLOCK_N):
        cols = n0 + offs_n
        k = load_tile(K + batch * skb + (k_start + cols[:, None]) * sks + head_k * skh + offs_d[None, :],
                      cols, seqlen_k, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, UPCAST)
        v = load_tile(V + batch * svb + (k_start + cols[:, None]) * svs + head_k * svh + offs_dv[None, :],
                      cols, seqlen_k, offs_dv, HEAD_DIM_V, HEAD_DIM_V_PAD, True, UPCAST)
        k_dq = finite_or_zero(k)  # dQ's product: a masked pair (dS 0) adds nothing, even from an infinite key
        dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], tl.float32)
        q_lo, _, _, q_hi = visited_blocks(n0, BLOCK_N, BLOCK_M, seqlen_q, -dhi, -dlo)
        for g in range(group):
            head = head_k * group + g
            site = (batch, head, seqlen_k - seqlen_q, score_args)
            drop = dropout.stream_of(SEED, batch, head, heads_k * group, dropout_p, DROPOUT)
            stat_base = batch * slb + head * slh + q_start
            for m0 in range(q_lo, q_hi, BLOCK_M):
                rows = m0 + offs_m
                in_seq = rows < seqlen_q
                q = load_tile(Q + batch * sqb + (q_start + rows[:, None]) * sqs + head * sqh + offs_d[None, :],
                              rows, seqlen_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, UPCAST)
                o = load_tile(O + batch * sob + (q_start + rows[:, None]) * sos + head * soh + offs_dv[None, :],
                              rows, seqlen_q, offs_dv, HEAD_DIM_V, HEAD_DIM_V_PAD, True, True)
                do = load_tile(DO + batch * sdb + (q_start + rows[:, None]) * sds + head * sdh + offs_dv[None, :],
                               rows, seqlen_q, offs_dv, HEAD_DIM_V, HEAD_DIM_V_PAD, True, UPCAST)
                m_i = tl.load(M + stat_base + rows, mask=in_seq, other=0.0)
                l_i = tl.load(L + stat_base + rows, mask=in_seq, other=1.0)
                visible = band_mask(rows, cols, seqlen_k, dlo, dhi) & in_seq[:, None]
                s = score.logits(tl.dot(q, tl.trans(k)), scale_log2, rows[:, None], cols[None, :], site, SCORE)
                m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
                p = tl.math.exp2(s * score.exp_scale(scale_log2, site, SCORE) - m_ref[:, None])
                p = tl.where(visible, p / tl.where(l_i == 0.0, 1.0, l_i)[:, None], 0.0)
                if DROPOUT:  # dV sees the kept probabilities; dP reaches P through the same mask
                    z = dropout.kept_scale(drop[0], drop[1], rows, n0, drop[2], BLOCK_N, False)
                    dv += tl.dot(tl.trans(as_operand(p * z, Q.dtype.element_ty, UPCAST)), do)
                else:
                    dv += tl.dot(tl.trans(as_operand(p, Q.dtype.element_ty, UPCAST)), do)
                dp = tl.dot(do, tl.trans(v))
                if DROPOUT:
                    dp *= z
                # D_i = rowsum(dO_i * O_i) (Algorithm 4, line 19), minus any gradient of the logsumexp.
                d_i = tl.sum(o * do.to(tl.float32), 1)
                if HAS_DLSE:
                    d_i -= tl.load(DLSE + stat_base + rows, mask=in_seq, other=0.0)
                # A masked pair adds nothing, even where dP or its score is not finite.
                ds = tl.where(visible, score.grad(p * (dp - d_i[:, None]), s, rows[:, None], cols[None, :], site,
                                                  SCORE), 0.0)
                dq_ptrs = DQACC + batch * sqab + (q_start + rows[:, None]) * sqas + head * sqah + offs_d[None, :]
                dq_mask = in_seq[:, None] & (offs_d[None, :] < HEAD_DIM)
                dq = tl.load(dq_ptrs, mask=dq_mask, other=0.0)
                tl.store(dq_ptrs, dq + tl.dot(as_operand(ds, Q.dtype.element_ty, UPCAST), k_dq) * softmax_scale,
                         mask=dq_mask)
                dk += tl.dot(tl.trans(as_operand(ds, Q.dtype.element_ty, UPCAST)), q)
        store_tile(DK + batch * sdkb + (k_start + cols[:, None]) * sdks + head_k * sdkh + offs_d[None, :],
                   dk * softmax_scale, cols, seqlen_k, offs_d, HEAD_DIM)
        store_tile(DV + batch * sdvb + (k_start + cols[:, None]) * sdvs + head_k * sdvh + offs_dv[None, :],
                   dv, cols, seqlen_k, offs_dv, HEAD_DIM_V)
        # dQ rows are read back by other threads in the next outer step.
        tl.debug_barrier()


def forward(plan, p: Problem, q, k, v):
    """Returns (out, lse, saved) with saved = stack(m, l), the paper's statistics."""
    cfg = plan.config
    lse_shape = p.row_stat_shape(q.shape[0])
    # Algorithm 1, line 2: O = 0, l = 0, m = -inf in HBM.  O is kept in fp32 across steps.
    o_acc = torch.zeros((*q.shape[:-1], p.head_dim_v), dtype=torch.float32, device=q.device)
    saved = torch.stack([torch.full(lse_shape, float("-inf"), device=q.device),
                         torch.zeros(lse_shape, device=q.device)])
    m, l = saved[0], saved[1]
    cu_q, cu_k = p.cu_pointers(q.device)
    n_blocks = p.query_blocks(cfg.block_m)
    n_splits = splits(p.batch * p.heads_q, n_blocks, q.device, n_blocks, plan.splits)
    launch(
        _fwd_kernel, (p.batch * p.heads_q, n_splits),
        q, k, v, o_acc, m, l, cu_q, cu_k, dropout.seed_argument(p, cu_q),
        *p.seq_strides(q), *p.seq_strides(k), *p.seq_strides(v), *p.seq_strides(o_acc),
        *p.row_stat_strides(m),
        p.seqlen_q, p.seqlen_k, p.totals, p.heads_q, p.group, p.scale_log2, p.window_left, p.window_right,
        n_splits, score.args_of(p), p.dropout_p,
        HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        IS_VARLEN=p.varlen, UPCAST=p.upcast(q), SCORE=score.mod_of(p), DROPOUT=p.dropout,
        HEAD_DIM_V=p.head_dim_v, HEAD_DIM_V_PAD=p.head_dim_v_pad, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    lse = torch.where(l == 0, float("inf"), (m + torch.log2(l)) * math.log(2.0))
    return o_acc.to(q.dtype), lse, saved


def backward(plan, p: Problem, dout, dlse, q, k, v, out, lse, saved):
    cfg = plan.config
    m, l = saved[0], saved[1]
    n_splits = splits(p.batch * p.heads_k, p.key_blocks(cfg.block_n), q.device, MAX_BWD_SPLITS, plan.splits)
    dq_acc = torch.zeros((n_splits, *q.shape), dtype=torch.float32, device=q.device)
    dk, dv = p.gradient_of(k), p.gradient_of(v)  # (zeros past the used rows, which no program writes)
    cu_q, cu_k = p.cu_pointers(q.device)
    launch(
        _bwd_kernel, (p.batch * p.heads_k, n_splits),
        q, k, v, out, dout, m if dlse is None else dlse, m, l, dq_acc, dk, dv, cu_q, cu_k,
        dropout.seed_argument(p, cu_q),
        *p.seq_strides(q), *p.seq_strides(k), *p.seq_strides(v), *p.seq_strides(out),
        *p.seq_strides(dout), *p.seq_strides(dq_acc[0]), *p.seq_strides(dk), *p.seq_strides(dv),
        *p.row_stat_strides(m),
        p.seqlen_q, p.seqlen_k, p.totals, p.heads_k, p.group, p.softmax_scale, p.scale_log2,
        p.window_left, p.window_right, n_splits, dq_acc.stride(0), score.args_of(p), p.dropout_p,
        HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        IS_VARLEN=p.varlen, UPCAST=p.upcast(q), HAS_DLSE=dlse is not None, SCORE=score.mod_of(p),
        DROPOUT=p.dropout, HEAD_DIM_V=p.head_dim_v, HEAD_DIM_V_PAD=p.head_dim_v_pad,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # The splits' partial dQs, summed in a fixed order: deterministic, no atomics.  One split
    # needs no sum (and no extra pass over the fp32 dQ).
    dq = dq_acc[0] if n_splits == 1 else dq_acc.sum(0)
    return dq.to(q.dtype), dk, dv
