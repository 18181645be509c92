"""FlashAttention-3's forward for Hopper, written in Gluon: the scheduling plain Triton cannot express.

One CTA runs a producer and ``CONSUMERS`` consumer partitions (``gl.warp_specialize``) over a
persistent loop of tiles:

- a producer warp issues the TMA loads: the tile's Q, 64 rows per consumer, once per tile, into
  one of ``Q_SLOTS`` buffers, then K and V blocks into a ``STAGES``-deep shared-memory ring
  (``*_ready`` / ``*_empty`` mbarriers);
- two consumer warpgroups (three at d64, configs.gluon_consumers: 192-row tiles, fewer registers
  each), each owning 64 query rows of the tile, run the GEMMs on warpgroup MMA (P stays in
  registers as the PV product's A operand; up to d128 with two consumers Q as S = Q K^T's,
  loaded once per tile: q_in_registers) and the online softmax.

Ping-pong: the consumers take turns to issue their GEMMs (the ``turn`` mbarriers, passed round
them in order), so one warpgroup's softmax runs while another's GEMMs occupy the tensor cores.
Intra-warpgroup overlap: inside a consumer, S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued
together, and the softmax of S_j is written to run while the PV product is still in flight.  As
compiled, it does not: ptxas moves the wait for the PV product (WARPGROUP.DEPBAR) up to the top
of its basic block, above the softmax's exponentials (SASS of every head dim); what remains is
the two GEMMs in flight together.  The wait forced below the exponentials (a basic block of its
own behind a branch neither compiler resolves) measured 0.97-1.02x at d64-d256 1k-16k, within
the null pair's spread (H200, benchmarks/results/2026-12-02_H200_308ee87/experiments/
fwd_overlap.md): ping-pong already keeps the tensor cores busy during the softmax.
Persistent scheduler: ``min(tiles, SMs)`` CTAs loop over tiles, so no CTA launch is paid per
tile.  With two Q buffers (where shared memory has room: d64, d128) the producer loads the next
tile's Q and first K/V blocks while the consumers finish this one, so a tile starts on data
already landed.  With one (d256) the consumers free it once their last S = Q K^T is done, so the
next tile's Q loads under the last PV product and the epilogue (0.94-1.00x of the time before at
d256 1k-16k, null pair 0.97-1.06: benchmarks/results/2026-12-02_H200_e6341dc/INDEX.md).  Tiles
of uneven length (causal, window) are taken from an atomic counter so they balance themselves,
longest first (the last query blocks of a causal problem see the most keys); the launch's last
CTA sets the counter back to zero, so one buffer per stream serves every launch (tile_counter).
Tiles of equal length are strided over (every SMs-th), one head's after another's; the banded
walk interleaves groups of heads whose K/V share L2 (heads_sharing_l2).

Batched (non-varlen) problems only: Q/K/V/O are seen by TMA as (batch, seqlen, heads, head_dim),
so loads past a sequence or head dim read zeros and stores past them are dropped.  O leaves by
TMA store from shared memory: a staging buffer per consumer (d64, d128), or at d256 one that
the two consumers take in turn (o_staging_buffers).  Band masks cost one comparison per key
(two where a sliding window has a left edge: LEFT_EDGE), only on blocks crossing an edge of the
consumer's rows (blocks.band_edge_masks).
v3.py routes varlen problems to its plain-Triton kernel (configs.v3_forward_kernel).  Gluon
does not run under the interpreter: the CPU suite compiles this file for sm_90; numerics are
checked on the GPU.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from flashtile.kernels.blocks import band_blocks, band_edge_masks
from flashtile.kernels.configs import GLUON_HEAD_DIMS, WARPGROUP_ROWS
from flashtile.kernels.launch import Descriptor, descriptor_spec, launch
from flashtile.kernels.tiles import finalize_rows, online_softmax_step

PRODUCER_REGS = gl.constexpr(24)      # the TMA-issuing warp needs almost none
SHARED_MEMORY = 232448 - 1024         # the H100/H200 per-block limit, less room for the mbarriers
L2_BUDGET = 32 * 2**20                # K/V bytes of the heads walked together (the H200 has 50 MB of L2)


@gluon.jit
def _tile(t, walk, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile ``t`` of the persistent walk: (batch, head, first query row, band, visited K/V blocks).

    Heads are walked in groups of ``head_group`` whose K and V fit in L2 together, so the CTAs
    running at one time re-read K/V from L2 rather than HBM.  Inside a group, query blocks run
    from the last to the first (causal tiles come longest first), the group's heads adjacent."""
    num_tiles, batch_heads, heads_q, head_group, m_blocks, seqlen_q, seqlen_k, window_left, window_right = walk
    group_tiles = head_group * m_blocks
    first_head = t // group_tiles * head_group
    heads_here = gl.minimum(head_group, batch_heads - first_head)  # the last group may be smaller
    r = t % group_tiles
    m0 = (m_blocks - 1 - r // heads_here) * TILE_M
    bh = first_head + r % heads_here
    # (Which blocks need a mask the consumers decide for their own rows: band_edge_masks.)
    dlo, dhi, lo, _, _, n_blocks = band_blocks(m0, TILE_M, BLOCK_N, seqlen_q, seqlen_k, window_left, window_right,
                                               False)
    return bh // heads_q, bh % heads_q, m0, dlo, dhi, lo, n_blocks


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_ids, bars, walk, group, COUNTER,
              ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
              DYNAMIC: gl.constexpr, CONSUMERS: gl.constexpr):
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, o_free = bars
    num_tiles = walk[0]
    Q_SLOTS: gl.constexpr = q_smem.shape[0] // CONSUMERS
    it = 0  # K/V blocks issued so far: ring slot and mbarrier phase
    tile_i = 0
    t = gl.program_id(0)
    while t < num_tiles:
        batch, head, m0, dlo, dhi, lo, n_blocks = _tile(t, walk, CONSUMERS * ROWS, BLOCK_N)
        head_k = head // group
        # Every consumer is done with the Q this slot held (and has read that tile's number).
        q_slot = tile_i % Q_SLOTS
        mbarrier.wait(q_empty.index(q_slot), (tile_i // Q_SLOTS & 1) ^ 1)
        publish_tile(tile_ids, tile_i, t)
        t = next_tile(t, num_tiles, COUNTER, PERSISTENT, DYNAMIC)
        q_bar = q_ready.index(q_slot)
        mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(q_desc, [batch, m0 + c * ROWS, head, 0], q_bar,
                                            q_smem.index(CONSUMERS * q_slot + c))
        for j in range(n_blocks):
            n0 = lo + j * BLOCK_N
            slot = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [batch, n0, head_k, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [batch, n0, head_k, 0], v_ready.index(slot), v_smem.index(slot))
            it += 1
        tile_i += 1
    end_tiles(tile_ids, tile_i, q_ready, q_empty, num_tiles, COUNTER, PERSISTENT, DYNAMIC)


@gluon.jit
def next_tile(t, num_tiles, COUNTER, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr):
    """The tile a CTA's producer takes after tile ``t``: DYNAMIC, the first no CTA has taken
    yet (COUNTER[0] counts the tiles past the first num_programs); PERSISTENT, every
    num_programs-th (tiles of equal length); else none (one tile per CTA)."""
    if DYNAMIC:
        t = gl.num_programs(0) + gl.atomic_add(COUNTER, 1)
    elif PERSISTENT:
        t += gl.num_programs(0)
    else:
        t = num_tiles
    return t


@gluon.jit
def end_tiles(tile_ids, tile_i, ready, empty, num_tiles, COUNTER, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr):
    """No tile left after the producer's ``tile_i`` tiles: it tells the consumers with a tile
    number past the end, in the next slot (barriers ``ready`` / ``empty`` of the slots) once
    that is free; a CTA of one tile (not PERSISTENT) ends without (read_next_tile).  DYNAMIC:
    COUNTER[1] counts the CTAs past their last take from COUNTER[0]; the last of them sets both
    back to 0, ready for the next launch on this stream (no fill per call)."""
    if PERSISTENT:
        SLOTS: gl.constexpr = ready.shape[0]
        slot = tile_i % SLOTS
        mbarrier.wait(empty.index(slot), (tile_i // SLOTS & 1) ^ 1)
        publish_tile(tile_ids, tile_i, num_tiles)
        mbarrier.arrive(ready.index(slot))
    if DYNAMIC:
        if gl.atomic_add(COUNTER + 1, 1) == gl.num_programs(0) - 1:
            gl.atomic_xchg(COUNTER, 0)
            gl.atomic_xchg(COUNTER + 1, 0)


@gluon.jit
def publish_tile(tile_ids, tile_i, t):
    """The producer's tile number for the consumers (tile_i: how many tiles this CTA has taken)."""
    # Written before the slot's ready barrier's arrival, read after its phase completes: the
    # mbarrier orders the two.  Two slots: the producer runs at most one tile ahead of a consumer
    # still reading its number.
    tile_ids.index(tile_i & 1).store(gl.full([1], t, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))


@gluon.jit
def read_tile(tile_ids, tile_i, ready, SLOTS: gl.constexpr):
    """Wait for the loads of the CTA's ``tile_i``-th tile (the barriers ``ready`` of its SLOTS
    slots) to land; its tile number (past the end: no tile left)."""
    mbarrier.wait(ready.index(tile_i % SLOTS), tile_i // SLOTS & 1)
    ids = tile_ids.index(tile_i & 1).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    return gl.max(ids, 0)


@gluon.jit
def read_next_tile(tile_ids, tile_i, ready, num_tiles, SLOTS: gl.constexpr, PERSISTENT: gl.constexpr):
    """The consumers' ``tile_i``-th tile after their first (read_tile); past the end: none left.
    A CTA of one tile (not PERSISTENT) takes no second (its producer says nothing more)."""
    t = num_tiles
    if PERSISTENT:
        t = read_tile(tile_ids, tile_i, ready, SLOTS)
    return t


@gluon.jit
def _masked_scores(s, rows, row0, n0, seqlen_k, dlo, dhi, BLOCK_N: gl.constexpr, col_layout: gl.constexpr,
                   LEFT_EDGE: gl.constexpr):
    """Scores of block n0 with -inf outside the band (the edges the block crosses: blocks.band_edge_masks)."""
    offs = gl.arange(0, BLOCK_N, layout=col_layout)
    return band_edge_masks(s, rows, offs, n0, BLOCK_N, seqlen_k, row0, row0 + rows.shape[0] - 1, dlo, dhi,
                           float("-inf"), LEFT_EDGE)


@gluon.jit
def _issue_scores(q_op, k_smem, k_ready, turn, slot, phase, turns, s_zero, WHICH: gl.constexpr,
                  PINGPONG: gl.constexpr):
    """Start S = Q K^T on K/V ring slot ``slot`` once it is this consumer's turn and K has landed.
    Turns go round the consumers in order; consumer 0 takes the first without waiting."""
    if PINGPONG:
        mbarrier.wait(turn.index(WHICH), (turns & 1) ^ (WHICH == 0))
    mbarrier.wait(k_ready.index(slot), phase)
    k = k_smem.index(slot)
    kT = k.reshape([k.shape[1], k.shape[3]]).permute((1, 0))
    return warpgroup_mma(q_op, kT, s_zero, use_acc=False, is_async=True)


@gluon.jit
def _pass_turn(turn, WHICH: gl.constexpr):
    """The tensor cores' turn goes to the next consumer (ping-pong with two)."""
    mbarrier.arrive(turn.index((WHICH + 1) % turn.shape[0]))


@gluon.jit
def _consumer(WHICH: gl.constexpr, q_smem, k_smem, v_smem, o_smem, tile_ids, bars, walk, outputs, scale_log2,
              ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr,
              PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, O_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr,
              Q_IN_REGISTERS: gl.constexpr, LEFT_EDGE: gl.constexpr):
    """Consumer warpgroup WHICH: rows [64 * WHICH, 64 * WHICH + 64) of every tile handed over.

    Per K/V block j: (wait for its turn) issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}, (pass the
    turn), wait for S_j only, softmax, wait for the PV product, rescale O.  The first block has
    no PV product to overlap; the last one follows the loop."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, o_free = bars
    num_tiles, seqlen_q, seqlen_k = walk[0], walk[5], walk[6]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM_PAD, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    CONSUMERS: gl.constexpr = turn.shape[0]
    Q_SLOTS: gl.constexpr = q_smem.shape[0] // CONSUMERS
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    it = 0     # K/V blocks consumed so far: ring slot and mbarrier phase
    turns = 0  # ping-pong turns taken so far
    tile_i = 0
    t = read_tile(tile_ids, tile_i, q_ready, Q_SLOTS)
    while t < num_tiles:
        batch, head, m0, dlo, dhi, lo, n_blocks = _tile(t, walk, CONSUMERS * ROWS, BLOCK_N)
        q_slot = tile_i % Q_SLOTS
        q_op = q_smem.index(CONSUMERS * q_slot + WHICH).reshape([ROWS, HEAD_DIM_PAD])  # S = Q K^T's A
        if Q_IN_REGISTERS:
            # Q as the register operand: only K is read from shared memory, and Q's buffer is
            # free for the producer's next tile at once.
            q_op = q_op.load(q_layout)
            mbarrier.arrive(q_empty.index(q_slot))
        row0 = m0 + WHICH * ROWS  # this consumer's first row
        rows = row0 + gl.arange(0, ROWS, layout=s_rows)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)
        l_i = gl.zeros([ROWS], gl.float32, s_rows)
        acc = gl.zeros([ROWS, HEAD_DIM_PAD], gl.float32, o_layout)
        if n_blocks > 0:
            # First block: nothing to overlap with yet.
            slot = it % STAGES
            phase = (it // STAGES) & 1
            s = _issue_scores(q_op, k_smem, k_ready, turn, slot, phase, turns, s_zero, WHICH, PINGPONG)
            if PINGPONG:
                _pass_turn(turn, WHICH)
                turns += 1
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(k_empty.index(slot))
            s = _masked_scores(s, rows, row0, lo, seqlen_k, dlo, dhi, BLOCK_N, s_cols, LEFT_EDGE)
            p, alpha, m_i = online_softmax_step(s, m_i, scale_log2)
            l_i = gl.sum(p, 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            prev_slot = slot
            prev_phase = phase
            it += 1
            for j in range(1, n_blocks):
                n0 = lo + j * BLOCK_N
                slot = it % STAGES
                phase = (it // STAGES) & 1
                v_prev = v_smem.index(prev_slot).reshape([BLOCK_N, HEAD_DIM_PAD])
                s = _issue_scores(q_op, k_smem, k_ready, turn, slot, phase, turns, s_zero, WHICH, PINGPONG)
                if OVERLAP:
                    # O += P_{j-1} V_{j-1} goes out with S_j; the softmax below runs under it.
                    mbarrier.wait(v_ready.index(prev_slot), prev_phase)
                    acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                if PINGPONG:
                    _pass_turn(turn, WHICH)
                    turns += 1
                if OVERLAP:
                    s = warpgroup_mma_wait(1, deps=[s])
                else:
                    s = warpgroup_mma_wait(0, deps=[s])
                    mbarrier.wait(v_ready.index(prev_slot), prev_phase)
                    acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                mbarrier.arrive(k_empty.index(slot))
                s = _masked_scores(s, rows, row0, n0, seqlen_k, dlo, dhi, BLOCK_N, s_cols, LEFT_EDGE)
                p, alpha, m_i = online_softmax_step(s, m_i, scale_log2)
                l_i = l_i * alpha + gl.sum(p, 1)
                # p_op of the previous block is read by the in-flight wgmma: keep it alive until here.
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                mbarrier.arrive(v_empty.index(prev_slot))
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                prev_slot = slot
                prev_phase = phase
                it += 1
            if not Q_IN_REGISTERS:
                # The last S = Q K^T has completed: the producer may load the next tile's Q into
                # this buffer under the last PV product and the epilogue (d256 has one Q buffer).
                # Not inside the loop: a branch there costs d256 spills.
                mbarrier.arrive(q_empty.index(q_slot))
            mbarrier.wait(v_ready.index(prev_slot), prev_phase)
            v_prev = v_smem.index(prev_slot).reshape([BLOCK_N, HEAD_DIM_PAD])
            acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(prev_slot))
        elif not Q_IN_REGISTERS:
            mbarrier.arrive(q_empty.index(q_slot))  # a tile with no K/V block
        out, lse = finalize_rows(acc, gl.convert_layout(m_i, o_rows), gl.convert_layout(l_i, o_rows))
        _store_rows(out.to(dtype), lse, o_smem, o_free, tile_i * CONSUMERS + WHICH, WHICH, outputs, batch, head,
                    row0, seqlen_q, ROWS, HEAD_DIM_PAD, o_layout, O_BUFFERS)
        tile_i += 1
        t = read_next_tile(tile_ids, tile_i, q_ready, num_tiles, Q_SLOTS, PERSISTENT)
    tma.store_wait(0)


@gluon.jit
def _store_rows(out, lse, o_smem, o_free, use, WHICH: gl.constexpr, outputs, batch, head, row0, seqlen_q,
                ROWS: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, o_layout: gl.constexpr, O_BUFFERS: gl.constexpr):
    """One consumer's O rows and their logsumexp; rows past the sequence, lanes past the head dim
    dropped.  O goes by TMA store through a staging buffer in shared memory: one per consumer,
    or one the two consumers take in turn (``use``: this consumer's turn, counted over the CTA),
    or, with O_BUFFERS == 0, straight from registers."""
    o_desc, O, sob, sos, soh, head_dim, LSE, slb, slh = outputs
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    if O_BUFFERS > 0:
        SHARED: gl.constexpr = O_BUFFERS == 1
        o_buf = o_smem.index(0 if SHARED else WHICH)
        if SHARED:
            # Turns alternate (each waits for the one before), so a parity names the turn awaited.
            mbarrier.wait(o_free.index(0), (use & 1) ^ 1)
        else:
            tma.store_wait(0)  # this consumer's previous store has left its buffer
        o_buf.reshape([ROWS, HEAD_DIM_PAD]).store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [batch, row0, head, 0], o_buf)
        if SHARED:
            tma.store_wait(0)
            gl.thread_barrier()  # every thread past the wait before the buffer is handed on
            mbarrier.arrive(o_free.index(0))
    else:  # without shared memory for staging: two-byte stores (the head dim's mask splits pairs)
        cols = gl.arange(0, HEAD_DIM_PAD, layout=gl.SliceLayout(0, o_layout))
        ptrs = O + batch.to(gl.int64) * sob + rows[:, None].to(gl.int64) * sos + head * soh + cols[None, :]
        gl.store(ptrs, out, mask=(rows[:, None] < seqlen_q) & (cols[None, :] < head_dim))
    gl.store(LSE + batch.to(gl.int64) * slb + head * slh + rows, lse, mask=rows < seqlen_q)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, O, sob, sos, soh, head_dim, LSE, slb, slh,
                batch_heads, heads_q, group, head_group, m_blocks, num_tiles,
                seqlen_q, seqlen_k, window_left, window_right, scale_log2, COUNTER,
                ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr,
                PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, O_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr,
                DYNAMIC: gl.constexpr, Q_SLOTS: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                Q_IN_REGISTERS: gl.constexpr, LEFT_EDGE: gl.constexpr):
    # Q_SLOTS tiles' Q, a part per consumer each (slot s: buffers CONSUMERS * s + consumer).
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS * Q_SLOTS] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if O_BUFFERS > 0:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [O_BUFFERS] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_smem = q_smem  # a placeholder: O leaves from registers
    # The producer hands each tile's number to the consumers here (two slots: tile parity).
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    o_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())  # one O buffer, shared
    # "ready" barriers complete when TMA has landed the bytes; "empty" ones when every consumer
    # is done with the buffer.
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.init(o_free.index(0), count=1)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, o_free)
    # The tile walk (see _tile) and where results go, as tuples: Gluon has no struct arguments.
    walk = (num_tiles, batch_heads, heads_q, head_group, m_blocks, seqlen_q, seqlen_k, window_left, window_right)
    outputs = (o_desc, O, sob, sos, soh, head_dim, LSE, slb, slh)
    # The partitions are listed as written (Gluon builds no list at run time): one list per count.
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, o_smem, tile_ids, bars, walk, outputs, scale_log2,
                         ROWS, BLOCK_N, HEAD_DIM_PAD, STAGES, PINGPONG, OVERLAP, O_BUFFERS, PERSISTENT,
                         Q_IN_REGISTERS, LEFT_EDGE)),
            (_consumer, (1, q_smem, k_smem, v_smem, o_smem, tile_ids, bars, walk, outputs, scale_log2,
                         ROWS, BLOCK_N, HEAD_DIM_PAD, STAGES, PINGPONG, OVERLAP, O_BUFFERS, PERSISTENT,
                         Q_IN_REGISTERS, LEFT_EDGE)),
            (_consumer, (2, q_smem, k_smem, v_smem, o_smem, tile_ids, bars, walk, outputs, scale_log2,
                         ROWS, BLOCK_N, HEAD_DIM_PAD, STAGES, PINGPONG, OVERLAP, O_BUFFERS, PERSISTENT,
                         Q_IN_REGISTERS, LEFT_EDGE)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_ids, bars, walk, group, COUNTER,
                         ROWS, BLOCK_N, STAGES, PERSISTENT, DYNAMIC, CONSUMERS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, o_smem, tile_ids, bars, walk, outputs, scale_log2,
                         ROWS, BLOCK_N, HEAD_DIM_PAD, STAGES, PINGPONG, OVERLAP, O_BUFFERS, PERSISTENT,
                         Q_IN_REGISTERS, LEFT_EDGE)),
            (_consumer, (1, q_smem, k_smem, v_smem, o_smem, tile_ids, bars, walk, outputs, scale_log2,
                         ROWS, BLOCK_N, HEAD_DIM_PAD, STAGES, PINGPONG, OVERLAP, O_BUFFERS, PERSISTENT,
                         Q_IN_REGISTERS, LEFT_EDGE)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_ids, bars, walk, group, COUNTER,
                         ROWS, BLOCK_N, STAGES, PERSISTENT, DYNAMIC, CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def supports(p, q, k, v) -> bool:
    """Whether this kernel runs the problem: batched, on a GPU, a head dim and layouts TMA can
    address; q, k, v as tma_ready returns them (aligned: only a broadcast is left to refuse)."""
    return (q.is_cuda and not p.varlen and p.head_dim_pad in GLUON_HEAD_DIMS and p.head_dim % 8 == 0
            and q.dtype in (torch.float16, torch.bfloat16) and not any(map(broadcast, (q, k, v))))


def tma_aligned(x) -> bool:
    """TMA reads from a 16-byte aligned base with strides in 16-byte multiples (the last is 1)."""
    return x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])


def tma_ready(x):
    """``x``, or an aligned copy of the rare tensor that is not (a fresh allocation: ``contiguous``
    would hand back a contiguous tensor whose base is misaligned)."""
    return x if tma_aligned(x) else x.clone(memory_format=torch.contiguous_format)


def broadcast(x) -> bool:
    """A stride 0 (a broadcast batch or head): left to the plain kernels, whose per-head
    descriptors do not see it."""
    return 0 in x.stride()[:-1]


@functools.lru_cache(maxsize=None)
def sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@functools.lru_cache(maxsize=None)
def block_layout(rows, head_dim_pad, dtype):
    # Cached: computing it costs ~20 us of Python, a tenth of a short forward.
    block = [1, rows, 1, head_dim_pad]
    return block, gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[dtype])


@functools.lru_cache(maxsize=None)
def _block_spec(rows, head_dim_pad, dtype):
    block, layout = block_layout(rows, head_dim_pad, dtype)
    return block, layout, descriptor_spec(dtype, block, layout)


def tma_descriptor(x, rows, head_dim_pad):
    """(batch, seqlen, heads, head_dim) as TMA sees it; one block is ``rows`` rows of one head."""
    return Descriptor(x, *_block_spec(rows, head_dim_pad, x.dtype))


# The consumer warpgroups and the producer warp (rounded up to a warpgroup) share the SM's 64K
# registers: an even share each at launch, rebalanced by setmaxnreg to CONSUMER_REGS per
# consumer thread (O, S and P of 64 rows live there) and PRODUCER_REGS, as in FlashAttention-3:
# 240 with two consumers, 160 with three.
CONSUMER_REGS = {2: 240, 3: 160}
REGISTERS = 65536


def launch_options(consumers):
    """num_warps (the first consumer's, the default partition) and the launch's register cap."""
    threads = (consumers + 1) * 128
    return dict(num_warps=4, maxnreg=REGISTERS // threads // 8 * 8)


def kernel_constants(p, cfg, element_size):
    """The kernel's compile-time arguments for problem ``p`` under schedule ``cfg``."""
    rows = WARPGROUP_ROWS
    tile_bytes = cfg.tile_m * p.head_dim_pad * element_size  # Q or O of one tile
    ring_bytes = 2 * cfg.num_stages * cfg.block_n * p.head_dim_pad * element_size
    # O staged for its TMA store, then a second Q buffer, where shared memory holds them.
    o_buffers = o_staging_buffers(tile_bytes, ring_bytes, cfg.consumers)
    next_q = (cfg.next_q and cfg.persistent and o_buffers == cfg.consumers
              and 3 * tile_bytes + ring_bytes <= SHARED_MEMORY)
    return dict(ROWS=rows, BLOCK_N=cfg.block_n, HEAD_DIM_PAD=p.head_dim_pad, STAGES=cfg.num_stages,
                PINGPONG=cfg.pingpong, OVERLAP=cfg.overlap, O_BUFFERS=o_buffers, PERSISTENT=cfg.persistent,
                # Tiles of uneven length (a band) from the atomic counter; equal ones strided over.
                DYNAMIC=cfg.persistent and p.banded, Q_SLOTS=2 if next_q else 1, CONSUMERS=cfg.consumers,
                CONSUMER_REGS=CONSUMER_REGS[cfg.consumers],
                Q_IN_REGISTERS=q_in_registers(p.head_dim_pad, cfg),
                # A sliding window's left edge: without one (causal, none) only the right is tested.
                LEFT_EDGE=p.window_left >= 0)


def o_staging_buffers(tile_bytes, ring_bytes, consumers):
    """Shared-memory buffers O is staged in for its TMA store: one per consumer where Q, the K/V
    ring and those fit (d64, d128); else one that two consumers take in turn (d256: Q and the
    two-slot ring leave 32 KB, one consumer's rows); else none, and O leaves from registers.
    From registers, d256's O was 128 two-byte stores per thread (the head dim's mask splits the
    pairs), the LSU busy through the epilogue; through the shared buffer the d256 forward took
    0.90-0.93x of that time at 1k-4k, 0.98-0.99x at 16k (H200, null pair 0.97-1.01:
    benchmarks/results/2026-12-02_H200_51cc382/INDEX.md)."""
    if 2 * tile_bytes + ring_bytes <= SHARED_MEMORY:
        return consumers
    if consumers == 2 and tile_bytes + tile_bytes // consumers + ring_bytes <= SHARED_MEMORY:
        return 1
    return 0


def q_in_registers(head_dim_pad, cfg) -> bool:
    """Whether S = Q K^T takes Q from registers (loaded once per tile) rather than shared memory.
    With both operands there, each consumer reads Q and K from shared memory for every K/V block:
    with V and the blocks landing, about 110 of the 128 bytes per clock an SM's shared memory
    serves, by count at d128 and d64 (an estimate, not a profile).  From registers only K is read:
    1.015 / 1.021 / 1.033x at d128 1k / 4k / 16k, 1.046 / 1.020x causal 1k / 4k; on d64's
    two-consumer schedules 1.004x at 1k, 1.039 / 1.024x causal 1k / 4k; outputs bitwise equal
    (H200, same run, null pair 0.974-1.005: benchmarks/results/2026-12-02_H200_308ee87/
    experiments/q_registers.md).  Up to d128 with two consumers: d256's O takes half of a
    consumer's registers, and three consumers' 160 registers spill (852 bytes; 1.8x slower)."""
    return cfg.q_registers and head_dim_pad <= 128 and cfg.consumers == 2


def tile_counter(device):
    """The dynamic walk's counters (next tile, CTAs done) for launches on the current stream: one
    buffer per stream, zeroed once and set back to zero by each launch's last CTA, so a call
    allocates and fills nothing.  Launches on one stream run in order, never sharing it.  A CUDA
    graph being captured gets a buffer of its own (allocated and zeroed in the graph), so its
    replays never share memory the eager launches or the graph's allocator reuse."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    return _tile_counter(device.index, torch.cuda.current_stream(device).cuda_stream)


@functools.lru_cache(maxsize=None)
def _tile_counter(device_index, stream):
    return torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", device_index))


def heads_sharing_l2(p, element_size):
    """How many (batch, head) pairs the tile walk keeps together.  Tiles of equal length: one,
    its row blocks adjacent, so the CTAs resident together read the same K/V blocks at about the
    same time (1.00-1.08x interleaving 32 MB of heads, d64-d256 1k-16k).  A band's tiles, taken
    longest first: as many as have K and V fit in L2_BUDGET, at least one, at most all (one at a
    time lost 2-13% there: the tail of each head's short tiles ends the walk unbalanced) (H200,
    benchmarks/results/2026-12-01_H200_86cee91/experiments/fwd_walk.md)."""
    if not p.banded:
        return 1
    kv_bytes_per_head = 2 * p.seqlen_k * p.head_dim_pad * element_size
    return max(1, min(p.batch * p.heads_q, L2_BUDGET // kv_bytes_per_head))


def forward(p, q, k, v, cfg):
    """Output and logsumexp; q, k, v are TMA-ready (16-byte aligned rows)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((p.batch, p.heads_q, p.seqlen_q), dtype=torch.float32, device=q.device)
    consts = kernel_constants(p, cfg, q.element_size())
    rows = consts["ROWS"]
    m_blocks = p.query_blocks(cfg.tile_m)
    batch_heads = p.batch * p.heads_q
    num_tiles = m_blocks * batch_heads
    programs = min(num_tiles, sm_count(q.device.index)) if cfg.persistent else num_tiles
    head_group = heads_sharing_l2(p, q.element_size())
    pad = p.head_dim_pad
    launch(
        _fwd_kernel, (programs,),
        tma_descriptor(q, rows, pad), tma_descriptor(k, cfg.block_n, pad), tma_descriptor(v, cfg.block_n, pad),
        tma_descriptor(out, rows, pad),
        out, out.stride(0), out.stride(1), out.stride(2), p.head_dim, lse, lse.stride(0), lse.stride(1),
        batch_heads, p.heads_q, p.group, head_group, m_blocks, num_tiles,
        p.seqlen_q, p.seqlen_k, p.window_left, p.window_right, p.scale_log2,
        # The tile counter; a static walk reads none (lse's first word stands in, untouched).
        tile_counter(q.device) if consts["DYNAMIC"] else lse.view(torch.int32),
        **consts, **launch_options(cfg.consumers))
    return out, lse
