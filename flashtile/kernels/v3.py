"""The Hopper forward in plain Triton: what v3 runs where its Gluon kernel does not.

FlashAttention-3's own forward is kernels/v3_gluon.py; this kernel takes the rest (varlen,
broadcast layouts, the CPU interpreter: dispatch.py).  What Hopper changes relative to
kernels/v2.py:
- Q, K, V and O move through TMA: tensor descriptors built on the device, one per (sequence,
  head), whose shape ends at the sequence end, so the copy engine zero-fills the tail of the
  last block and clips the output store (no address arithmetic or load masks);
- ``tl.dot`` on descriptor-loaded tiles lowers to asynchronous warpgroup MMA (wgmma) fed
  from a multi-stage shared-memory pipeline; P stays in registers as the PV product's A operand;
- on unmasked problems (no causal/window band, seqlen_k a multiple of BLOCK_N) one unmasked
  loop runs, which a config may warp-specialize (a producer warpgroup issuing the TMA loads,
  consumer warpgroups running the GEMMs and the softmax).  Triton 3.6 applies that only to a
  single loop with 4 warps, so banded problems keep v2's three-segment loop on TMA.
"""
import torch
import triton
import triton.language as tl

from flashtile.kernels import score, tma
from flashtile.kernels.blocks import band_mask, program_sequence, program_tile, visited_blocks
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import Problem
from flashtile.kernels.tiles import finalize_rows, online_softmax_step, values_product


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
def _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, lo, hi, seqlen_k, dlo, dhi, scale_log2, site,
                BLOCK_N: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr,
                NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, SCORE: tl.constexpr):
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE,
                       flatten=False):
        k = _load(k_desc, n0, UPCAST)
        cols = n0 + offs_n
        s = score.logits(tl.dot(q, tl.trans(k)), scale_log2, rows[:, None], cols[None, :], site, SCORE)
        if MASK:
            s = tl.where(band_mask(rows, cols, seqlen_k, dlo, dhi), s, float("-inf"))
        p, alpha, m_i = online_softmax_step(s, m_i, score.exp_scale(scale_log2, site, SCORE))
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(v_desc, n0, UPCAST)
        acc = acc * alpha[:, None] + values_product(p, v, v_desc.dtype, UPCAST, MASK)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
                seqlen_q, seqlen_k, totals, heads_q, group, scale_log2, window_left, window_right, score_args,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
                UNMASKED: tl.constexpr, UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr,
                WARP_SPECIALIZE: tl.constexpr, SCORE: tl.constexpr):
    bh, block, blocks = program_tile(seqlen_q, BLOCK_M)
    m0 = (blocks - 1 - block) * BLOCK_M
    batch, head, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi = program_sequence(
        bh, heads_q, CU_Q, CU_K, seqlen_q, seqlen_k, totals, window_left, window_right, IS_VARLEN)
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
    site = (batch, head, seqlen_k - seqlen_q, score_args)
    q = _load(q_desc, m0, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if UNMASKED:
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, 0, seqlen_k, seqlen_k,
                                    dlo, dhi, scale_log2, site, BLOCK_N, False, UPCAST, NUM_STAGES, WARP_SPECIALIZE,
                                    SCORE)
    else:
        lo, full_lo, full_hi, hi = visited_blocks(m0, BLOCK_M, BLOCK_N, seqlen_k, dlo, dhi)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, full_lo, full_hi, seqlen_k,
                                    dlo, dhi, scale_log2, site, BLOCK_N, False, UPCAST, NUM_STAGES, False, SCORE)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, lo, full_lo, seqlen_k,
                                    dlo, dhi, scale_log2, site, BLOCK_N, True, UPCAST, NUM_STAGES, False, SCORE)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_desc, v_desc, rows, offs_n, full_hi, hi, seqlen_k,
                                    dlo, dhi, scale_log2, site, BLOCK_N, True, UPCAST, NUM_STAGES, False, SCORE)
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


def _set_allocator(device):
    # Device-side descriptors live in a small global scratch buffer Triton asks for at launch.
    if device.type == "cuda":
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def forward(plan, p: Problem, q, k, v):
    q, k, v = (tma.ready(x) for x in (q, k, v))
    cfg = plan.config
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.row_stat_shape(q.shape[0]), dtype=torch.float32, device=q.device)
    cu_q, cu_k = p.cu_pointers(q.device)
    _set_allocator(q.device)
    grid = (p.batch * p.heads_q * p.query_blocks(cfg.block_m),)
    launch(
        _fwd_kernel, grid,
        q, k, v, out, lse, cu_q, cu_k,
        *p.seq_strides(q), *p.seq_strides(k), *p.seq_strides(v), *p.seq_strides(out),
        *p.row_stat_strides(lse),
        p.seqlen_q, p.seqlen_k, p.totals, p.heads_q, p.group, p.scale_log2, p.window_left, p.window_right,
        score.args_of(p),
        HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        IS_VARLEN=p.varlen, UNMASKED=plan.unmasked, UPCAST=p.upcast(q), NUM_STAGES=cfg.num_stages,
        WARP_SPECIALIZE=plan.unmasked and cfg.warp_specialize, SCORE=score.mod_of(p),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse, lse.new_empty(0)
