"""FlashAttention-3's forward for Hopper, written in Gluon: the scheduling plain Triton cannot express.

One CTA runs a producer and ``CONSUMERS`` consumer partitions (``gl.warp_specialize``) over a
persistent loop of tiles (scheduler.py):

- a producer warp issues the TMA loads: the tile's Q, 64 rows per consumer, once per tile, into
  one of ``Q_SLOTS`` buffers, then K and V blocks into a ``STAGES``-deep shared-memory ring
  (``*_ready`` / ``*_empty`` mbarriers);
- two consumer warpgroups (three at d64 on long sequences: 192-row tiles, fewer registers each),
  each owning 64 query rows of the tile, run the GEMMs on warpgroup MMA (P stays in registers as
  the PV product's A operand; up to d128 with two consumers Q is S = Q K^T's register operand,
  loaded once per tile: q_in_registers) and the online softmax.

Ping-pong: the consumers take turns to issue their GEMMs (the ``turn`` mbarriers, passed round
them in order), so one warpgroup's softmax runs while another's GEMMs occupy the tensor cores.
Intra-warpgroup overlap: inside a consumer, S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued
together, and the softmax of S_j is written to run while the PV product is in flight (ptxas
hoists the PV product's wait above the exponentials; what remains is the two GEMMs in flight
together: docs/v3.md).  Persistent scheduler: ``min(tiles, SMs)`` CTAs loop over tiles.  With
two Q buffers (where shared memory has room: d64, d128) the producer loads the next tile's Q
and first K/V blocks while the consumers finish this one; with one (d256) the consumers free it
once their last S = Q K^T is done, so the next tile's Q loads under the last PV product and the
epilogue.  Tiles of uneven length (causal, window) come from an atomic counter, longest first,
across groups of heads whose K/V share L2 (heads_sharing_l2); tiles of equal length are strided
over, one head after another.

Batched (non-varlen) problems only: Q/K/V/O are seen by TMA as (batch, seqlen, heads, head_dim),
so loads past a sequence or head dim read zeros and stores past them are dropped.  O leaves by
TMA store from shared memory: a staging buffer per consumer (d64, d128), or at d256 one that
the two consumers take in turn (o_staging_buffers).  Band masks cost one comparison per key
(two where a sliding window has a left edge: LEFT_EDGE), only on blocks crossing an edge of the
consumer's rows (blocks.band_edge_masks).  Gluon does not run under the interpreter: the CPU
suite compiles this file for sm_90; numerics are checked on the GPU.

Float8 inputs (``FP8``, FlashAttention-3's FP8 forward): both products are float8 MMAs, V is
read from a keys-contiguous copy, Q's and K's descales go into the scores' scale and V's into
O (``Descales``); up to d128 each block's P V product is added to O in float32 (``FRESH_PV``).
The output is bf16.

V and O may have a head dim of their own (HEAD_DIM_V_PAD: V's ring slots, O's accumulator and
staging, the P V product).  S = Q K^T reduces over the padded head dim, or for head dims 129 to
192 over 192 lanes loaded as three slices of 64 (QK_SLICES: configs.qk_slices), each slice a
buffer of its own, so that Q and K take 192 lanes of shared memory rather than d256's 256.

Score modifications (softcap, ALiBi) go through the score hook (score.py) where S is formed.
Two take a shorter way here: ALiBi off the diagonal as a column part and a row part
(``DISTANCE``: _block_softmax), and on bf16 a softcap as every row's max (``BOUNDED``:
softcap_bounds_logits).
"""
import torch
from triton.experimental import gluon
from triton.language.core import _aggregate as aggregate
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from flashtile import gpu
from flashtile.kernels import configs, dropout, packed_tiles, score
from flashtile.kernels import tma as tma_host
from flashtile.kernels.blocks import band_blocks, band_edge_masks, grouped_tile
from flashtile.kernels.configs import WARPGROUP_ROWS
from flashtile.kernels.gluon import float8
from flashtile.kernels.gluon.pipeline import slices_product
from flashtile.kernels.gluon.scheduler import (end_tiles, heads_sharing_l2, next_tile, no_counter,
                                               packed_tile, publish_tile, read_next_tile, read_tile,
                                               start_tiles, tile_counter, Sequences, Value, value, values)
from flashtile.kernels.launch import Descriptor, Prepared
from flashtile.kernels.problem import contiguous_strides, remembered
from flashtile.kernels.tiles import (FP8_P_SCALE, FP8_PER_BLOCK, LOG2E, exp2_fma, finalize_rows, scaled_softmax_step,
                                    softmax_exponents)

PRODUCER_REGS = gl.constexpr(24)      # the TMA-issuing warp needs almost none
SHARED_MEMORY = 232448 - 1024         # the H100/H200 per-block limit, less room for the mbarriers and row flags


@aggregate
class Schedule:
    """The kernel's compile-time schedule (kernel_constants says what each is)."""
    ROWS: gl.constexpr
    BLOCK_N: gl.constexpr
    HEAD_DIM_PAD: gl.constexpr
    HEAD_DIM_V_PAD: gl.constexpr
    QK_SLICES: gl.constexpr
    STAGES: gl.constexpr
    CONSUMERS: gl.constexpr
    Q_SLOTS: gl.constexpr
    O_BUFFERS: gl.constexpr
    PINGPONG: gl.constexpr
    OVERLAP: gl.constexpr
    PERSISTENT: gl.constexpr
    DYNAMIC: gl.constexpr
    Q_IN_REGISTERS: gl.constexpr
    LEFT_EDGE: gl.constexpr
    SCORE: gl.constexpr
    DISTANCE: gl.constexpr
    BOUNDED: gl.constexpr
    FP8: gl.constexpr
    FRESH_PV: gl.constexpr
    CHECK_FINITE: gl.constexpr
    VARLEN: gl.constexpr
    DROPOUT: gl.constexpr
    FMA_EXP2: gl.constexpr
    ROW_TREES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ROWS, BLOCK_N, HEAD_DIM_PAD, HEAD_DIM_V_PAD, QK_SLICES, STAGES, CONSUMERS, Q_SLOTS,
                 O_BUFFERS, PINGPONG, OVERLAP, PERSISTENT, DYNAMIC, Q_IN_REGISTERS, LEFT_EDGE, SCORE, DISTANCE,
                 BOUNDED, FP8, FRESH_PV, CHECK_FINITE, VARLEN, DROPOUT, FMA_EXP2, ROW_TREES):
        self.ROWS = gl.constexpr(ROWS)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.HEAD_DIM_PAD = gl.constexpr(HEAD_DIM_PAD)
        self.HEAD_DIM_V_PAD = gl.constexpr(HEAD_DIM_V_PAD)
        self.QK_SLICES = gl.constexpr(QK_SLICES)
        self.STAGES = gl.constexpr(STAGES)
        self.CONSUMERS = gl.constexpr(CONSUMERS)
        self.Q_SLOTS = gl.constexpr(Q_SLOTS)
        self.O_BUFFERS = gl.constexpr(O_BUFFERS)
        self.PINGPONG = gl.constexpr(PINGPONG)
        self.OVERLAP = gl.constexpr(OVERLAP)
        self.PERSISTENT = gl.constexpr(PERSISTENT)
        self.DYNAMIC = gl.constexpr(DYNAMIC)
        self.Q_IN_REGISTERS = gl.constexpr(Q_IN_REGISTERS)
        self.LEFT_EDGE = gl.constexpr(LEFT_EDGE)
        self.SCORE = gl.constexpr(SCORE)
        self.DISTANCE = gl.constexpr(DISTANCE)
        self.BOUNDED = gl.constexpr(BOUNDED)
        self.FP8 = gl.constexpr(FP8)
        self.FRESH_PV = gl.constexpr(FRESH_PV)
        self.CHECK_FINITE = gl.constexpr(CHECK_FINITE)
        self.VARLEN = gl.constexpr(VARLEN)
        self.DROPOUT = gl.constexpr(DROPOUT)
        self.FMA_EXP2 = gl.constexpr(FMA_EXP2)
        self.ROW_TREES = gl.constexpr(ROW_TREES)


@aggregate
class Buffers:
    """Shared memory: Q (Q_SLOTS tiles, a part per consumer: slot s is buffers CONSUMERS * s +
    consumer; QK_SLICES buffers each, as K's ring slots), the K/V ring, O's staging buffers, the
    tile numbers the producer hands over (two slots: tile parity), and the mbarriers.  "ready"
    barriers complete when TMA has landed the bytes; "empty" ones when every consumer is done
    with the buffer; ``turn`` passes the tensor cores round the consumers; ``o_free`` hands a
    shared O buffer on."""
    q: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    o: gl.shared_memory_descriptor
    tile_ids: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    o_free: gl.shared_memory_descriptor
    not_finite: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q, k, v, o, tile_ids, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, o_free,
                 not_finite):
        self.q = q
        self.k = k
        self.v = v
        self.o = o
        self.tile_ids = tile_ids
        self.q_ready = q_ready
        self.q_empty = q_empty
        self.k_ready = k_ready
        self.k_empty = k_empty
        self.v_ready = v_ready
        self.v_empty = v_empty
        self.turn = turn
        self.o_free = o_free
        self.not_finite = not_finite

    @gluon.jit
    def allocate(q_desc, k_desc, v_desc, o_desc, S: gl.constexpr):
        q = gl.allocate_shared_memory(q_desc.dtype,
                                      [S.CONSUMERS * S.Q_SLOTS * S.QK_SLICES] + q_desc.block_type.shape, q_desc.layout)
        k = gl.allocate_shared_memory(k_desc.dtype, [S.STAGES * S.QK_SLICES] + k_desc.block_type.shape,
                                      k_desc.layout)
        v = gl.allocate_shared_memory(v_desc.dtype, [S.STAGES] + v_desc.block_type.shape, v_desc.layout)
        if S.O_BUFFERS > 0:
            o = gl.allocate_shared_memory(o_desc.dtype, [S.O_BUFFERS] + o_desc.block_type.shape, o_desc.layout)
        else:
            o = q  # a placeholder: O leaves from registers
        tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        q_ready = gl.allocate_shared_memory(gl.int64, [S.Q_SLOTS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [S.Q_SLOTS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [S.STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [S.STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [S.STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [S.STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [S.CONSUMERS, 1], mbarrier.MBarrierLayout())
        o_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())  # one O buffer, shared
        if S.CHECK_FINITE:  # each consumer's rows: whether the row's output came out not finite
            not_finite = gl.allocate_shared_memory(gl.int32, [S.CONSUMERS, S.ROWS],
                                                   gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            not_finite = tile_ids  # a placeholder, never used
        for i in gl.static_range(S.Q_SLOTS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=S.CONSUMERS)
        for i in gl.static_range(S.STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=S.CONSUMERS)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=S.CONSUMERS)
        for i in gl.static_range(S.CONSUMERS):
            mbarrier.init(turn.index(i), count=1)
        mbarrier.init(o_free.index(0), count=1)
        return Buffers(q, k, v, o, tile_ids, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, o_free,
                       not_finite)




@aggregate
class TileWalk:
    """The persistent walk over (batch x head, query block) tiles: its sizes and the band.
    VARLEN: the batch's sequences are packed (``CU_Q``/``CU_K``, blocks.sequence_bounds), each
    tile's lengths are its sequence's, and the walk runs down the list of (sequence, query
    block) entries ``TILES`` (packed_tiles.py; ``m_blocks`` counts the longest sequence's
    blocks), the query heads of an entry on consecutive tiles."""
    num_tiles: Value
    batch_heads: Value
    heads_q: Value
    group: Value
    head_group: Value
    m_blocks: Value
    window_left: Value
    window_right: Value
    seqs: Sequences
    TILES: gl.tensor

    @gluon.constexpr_function
    def __init__(self, num_tiles, batch_heads, heads_q, group, head_group, m_blocks, seqlen_q, seqlen_k,
                 window_left, window_right, CU_Q, CU_K, totals, TILES, VARLEN):
        self.num_tiles = value(num_tiles)
        self.batch_heads = value(batch_heads)
        self.heads_q = value(heads_q)
        self.group = value(group)
        self.head_group = value(head_group)
        self.m_blocks = value(m_blocks)
        self.window_left = value(window_left)
        self.window_right = value(window_right)
        self.seqs = Sequences(seqlen_q, seqlen_k, CU_Q, CU_K, totals, VARLEN)
        self.TILES = TILES

    @gluon.jit
    def tile(self, t, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Tile ``t``: (batch, head, first query row, band, first visited K/V block, their count,
        the sequence as ``sequence`` gives it).

        Heads are walked in groups of ``head_group`` whose K and V fit in L2 together, so the
        CTAs running at one time re-read K/V from L2 rather than HBM.  Inside a group, query
        blocks run from the last to the first (causal tiles come longest first), the group's
        heads adjacent.  (Which blocks need a mask the consumers decide for their own rows.)"""
        if self.seqs.VARLEN:
            batch, head, m0 = packed_tile(t, self.TILES, self.heads_q, self.m_blocks, TILE_M)
            seq = self.seqs.of(batch)
            dlo, dhi, lo, _, _, n_blocks = band_blocks(m0, TILE_M, BLOCK_N, seq[3], seq[4], self.window_left,
                                                       self.window_right, False)
            return batch, head, m0, dlo, dhi, lo, n_blocks, seq
        else:
            bh, step = grouped_tile(t, self.batch_heads, self.head_group, self.m_blocks)
            m0 = (self.m_blocks - 1 - step) * TILE_M
            dlo, dhi, lo, _, _, n_blocks = band_blocks(m0, TILE_M, BLOCK_N, self.seqs.seqlen_q, self.seqs.seqlen_k,
                                                       self.window_left, self.window_right, False)
            batch = bh // self.heads_q
            return batch, bh % self.heads_q, m0, dlo, dhi, lo, n_blocks, self.seqs.of(batch)


@aggregate
class Outputs:
    """Where a consumer's rows go: O (V's head dim: ``head_dims``, as the kernel takes them) by TMA
    (``o_desc``) or, without staging, by pointer; the logsumexp by pointer."""
    o_desc: tma.tensor_descriptor
    O: gl.tensor
    sob: Value
    sos: Value
    soh: Value
    head_dims: Value
    LSE: gl.tensor
    slb: Value
    slh: Value

    @gluon.constexpr_function
    def __init__(self, o_desc, O, sob, sos, soh, head_dims, LSE, slb, slh):
        self.o_desc = o_desc
        self.O = O
        self.sob = value(sob)
        self.sos = value(sos)
        self.soh = value(soh)
        self.head_dims = value(head_dims)
        self.LSE = LSE
        self.slb = value(slb)
        self.slh = value(slh)


@aggregate
class Descales:
    """What dequantizes float8 Q, K and V (S.FP8): FP8_PER_HEAD, ``at`` (3, batch, heads_k) of q's,
    k's and v's descales (part stride sdt), FlashAttention-3's; FP8_PER_BLOCK, (3, batch,
    heads_q, blocks): q's per 64 rows (ROWS) of a query head, k's and v's per BLOCK_N keys of a
    KV head.  Q's and K's multiply the scores' scale; V's per head multiplies the output at the
    end, and per block weighs each block's P V product through O's unit (_add_values)."""
    at: gl.tensor
    sdt: Value
    sdb: Value
    sdh: Value

    @gluon.constexpr_function
    def __init__(self, at, sdt, sdb, sdh):
        self.at = at
        self.sdt = value(sdt)
        self.sdb = value(sdb)
        self.sdh = value(sdh)

    @gluon.jit
    def rows_scale(self, batch, head, head_k, row0, S: gl.constexpr):
        """The factor on the scores of one consumer's rows: q's descale (and k's, per head)."""
        if S.FP8 == FP8_PER_BLOCK:
            return gl.load(self.at + batch * self.sdb + head * self.sdh + row0 // S.ROWS)
        else:
            at = self.at + batch * self.sdb + head_k * self.sdh
            return gl.load(at) * gl.load(at + self.sdt)

    @gluon.jit
    def key_scale(self, batch, head_k, n0, S: gl.constexpr):
        """K block n0's descale (1 per head: rows_scale has it)."""
        if S.FP8 == FP8_PER_BLOCK:
            return gl.load(self.at + self.sdt + batch * self.sdb + head_k * self.sdh + n0 // S.BLOCK_N)
        else:
            return 1.0

    @gluon.jit
    def output_scale(self, batch, head_k, S: gl.constexpr):
        """What the output is multiplied by at the end, besides O's unit: V's descale per head
        over P's float8 factor."""
        if S.FP8 == FP8_PER_BLOCK:
            return 1.0 / FP8_P_SCALE
        else:
            return gl.load(self.at + 2 * self.sdt + batch * self.sdb + head_k * self.sdh) / FP8_P_SCALE

    @gluon.jit
    def value_scale(self, batch, head_k, n0, S: gl.constexpr):
        """V block n0's descale per block (O's unit while its product is added), else 1."""
        if S.FP8 == FP8_PER_BLOCK:
            return gl.load(self.at + 2 * self.sdt + batch * self.sdb + head_k * self.sdh + n0 // S.BLOCK_N)
        else:
            return 1.0

    @gluon.jit
    def p_scale(self, S: gl.constexpr):
        """(log2 f, 1 / f) of the factor f P is computed with for its float8 cast, FP8_P_SCALE
        (the small probabilities in the type's normal range); f = 1 without FP8.  The softmax
        applies it in the exponent (scaled_softmax_step) and takes it out of the row sums."""
        if S.FP8:
            return 8.0, 1.0 / FP8_P_SCALE  # log2(FP8_P_SCALE)
        else:
            return 0.0, 1.0


# Where _exact_rows finds Q, K, V and O: 64-bit words in shared memory (each pointer as an
# integer, then its batch, sequence and head strides; then the head dims: Problem.head_dims), written before the
# partitions start.  As kernel arguments captured by the consumer partitions they would take
# registers through the main loop for a path that almost never runs.
_STASH_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
Q_AT, K_AT, V_AT, O_AT = gl.constexpr(0), gl.constexpr(4), gl.constexpr(8), gl.constexpr(12)
HEAD_DIMS_AT = gl.constexpr(16)
STASH_WORDS = gl.constexpr(32)


@gluon.jit
def _stash_tensor(words, i, AT: gl.constexpr, ptr, stride_b, stride_s, stride_h):
    """One tensor's address and strides, as words AT to AT + 3."""
    words = gl.where(i == AT, ptr.to(gl.int64, bitcast=True), words)
    words = gl.where(i == AT + 1, stride_b, words)
    words = gl.where(i == AT + 2, stride_s, words)
    return gl.where(i == AT + 3, stride_h, words)


@gluon.jit
def _stash_tensors(Q, sqb, sqs, sqh, K, skb, sks, skh, V, svb, svs, svh, O, sob, sos, soh, head_dims):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, STASH_WORDS, layout=layout)
    words = gl.zeros([STASH_WORDS], gl.int64, layout)
    words = _stash_tensor(words, i, Q_AT, Q, sqb, sqs, sqh)
    words = _stash_tensor(words, i, K_AT, K, skb, sks, skh)
    words = _stash_tensor(words, i, V_AT, V, svb, svs, svh)
    words = _stash_tensor(words, i, O_AT, O, sob, sos, soh)
    words = gl.where(i == HEAD_DIMS_AT, head_dims, words)
    stash = gl.allocate_shared_memory(gl.int64, [STASH_WORDS], _STASH_LAYOUT)
    stash.store(words)
    return stash


@gluon.jit
def _stashed(stash, AT: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, STASH_WORDS, layout=layout)
    return gl.max(gl.where(i == AT, stash.load(layout), 0), 0)


@gluon.jit
def _rows_of(stash, AT: gl.constexpr, batch, start, head, dtype: gl.constexpr):
    """The pointer to (batch, row ``start``, head) of the tensor stashed at AT, and its row stride."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, STASH_WORDS, layout=layout)
    words = stash.load(layout)
    base = gl.max(gl.where(i == AT, words, 0), 0).to(gl.pointer_type(dtype), bitcast=True)
    sb = gl.max(gl.where(i == AT + 1, words, 0), 0)
    ss = gl.max(gl.where(i == AT + 2, words, 0), 0)
    sh = gl.max(gl.where(i == AT + 3, words, 0), 0)
    return base + batch.to(gl.int64) * sb + ss * start + head.to(gl.int64) * sh, ss


@gluon.jit
def _producer(q_desc, k_desc, v_desc, buf, walk, counter, S: gl.constexpr):
    it = 0  # K/V blocks issued so far: ring slot and mbarrier phase
    tile_i = 0
    t = gl.program_id(0)
    start_tiles(counter, S.DYNAMIC)
    SLICE: gl.constexpr = q_desc.block_type.shape[3]  # lanes a Q or K buffer holds
    while t < walk.num_tiles:
        batch, head, m0, dlo, dhi, lo, n_blocks, seq = walk.tile(t, S.CONSUMERS * S.ROWS, S.BLOCK_N)
        at, q_start, k_start, _, _ = seq
        head_k = head // walk.group
        # Every consumer is done with the Q this slot held (and has read that tile's number).
        q_slot = tile_i % S.Q_SLOTS
        mbarrier.wait(buf.q_empty.index(q_slot), (tile_i // S.Q_SLOTS & 1) ^ 1)
        publish_tile(buf.tile_ids, tile_i, t)
        t = next_tile(t, walk.num_tiles, counter, S.PERSISTENT, S.DYNAMIC)
        q_bar = buf.q_ready.index(q_slot)
        mbarrier.expect(q_bar, S.CONSUMERS * S.QK_SLICES * q_desc.block_type.nbytes)
        for c in gl.static_range(S.CONSUMERS):
            for i in gl.static_range(S.QK_SLICES):
                tma.async_copy_global_to_shared(q_desc, [at, m0 + c * S.ROWS + q_start, head, i * SLICE], q_bar,
                                                buf.q.index((S.CONSUMERS * q_slot + c) * S.QK_SLICES + i))
        for j in range(n_blocks):
            n0 = lo + j * S.BLOCK_N + k_start
            slot = it % S.STAGES
            phase = (it // S.STAGES) & 1
            mbarrier.wait(buf.k_empty.index(slot), phase ^ 1)
            mbarrier.expect(buf.k_ready.index(slot), S.QK_SLICES * k_desc.block_type.nbytes)
            for i in gl.static_range(S.QK_SLICES):
                tma.async_copy_global_to_shared(k_desc, [at, n0, head_k, i * SLICE], buf.k_ready.index(slot),
                                                buf.k.index(slot * S.QK_SLICES + i))
            mbarrier.wait(buf.v_empty.index(slot), phase ^ 1)
            mbarrier.expect(buf.v_ready.index(slot), v_desc.block_type.nbytes)
            if S.FP8:  # V keys-contiguous: (batch, heads, head_dim, seqlen)
                tma.async_copy_global_to_shared(v_desc, [at, head_k, 0, n0], buf.v_ready.index(slot),
                                                buf.v.index(slot))
            else:
                tma.async_copy_global_to_shared(v_desc, [at, n0, head_k, 0], buf.v_ready.index(slot),
                                                buf.v.index(slot))
            it += 1
        tile_i += 1
    end_tiles(buf.tile_ids, tile_i, buf.q_ready, buf.q_empty, walk.num_tiles, S.PERSISTENT)


@gluon.jit
def _distance_bias(site, col_layout: gl.constexpr, S: gl.constexpr):
    """A distance bias's column part for the tile (score.one_side_logits), slope * (j - n0) for
    the columns of a block, and the slope."""
    slope = score.distance_slope(site, S.SCORE)
    return slope * gl.arange(0, S.BLOCK_N, layout=col_layout).to(gl.float32), slope


@gluon.jit
def _block_softmax(s, m_i, site, rows, row0, n0, seqlen_k, dlo, dhi, scale_log2, log2_factor, distance,
                   col_layout: gl.constexpr, S: gl.constexpr):
    """The online softmax step (tiles.scaled_softmax_step) of block n0's scores: through the
    score hook (score.logits; a distance bias off the diagonal as a column part and a row part:
    score.one_side_logits), -inf outside the band (the edges the block crosses:
    blocks.band_edge_masks).  Returns P, the rescale factor and the new running max."""
    offs = gl.arange(0, S.BLOCK_N, layout=col_layout)
    unit = score.exp_scale(scale_log2, site, S.SCORE)
    if S.DISTANCE:
        col_bias, slope = distance
        side = score.diagonal_side(n0, n0 + S.BLOCK_N - 1, row0, row0 + rows.shape[0] - 1, site[2])
        if side != 0.0:
            y = score.one_side_logits(s, scale_log2, (col_bias * side)[None, :], rows[:, None], (n0 + offs)[None, :],
                                      site, S.SCORE)
            # The distances as integers, converted once: exact where they are large.
            row_log2 = (slope * side * unit) * (n0 - site[2] - rows).to(gl.float32)
        else:  # across the diagonal, through the hook (score.crossing_part there spills)
            y = score.logits(s, scale_log2, rows[:, None], (n0 + offs)[None, :], site, S.SCORE)
            row_log2 = (rows * 0).to(gl.float32)
        y = band_edge_masks(y, rows, offs, n0, S.BLOCK_N, seqlen_k, row0, row0 + rows.shape[0] - 1, dlo, dhi,
                            float("-inf"), S.LEFT_EDGE)
        return scaled_softmax_step(y, m_i, unit, log2_factor, row_log2, _row_reduced(y, True, S.ROW_TREES))
    else:
        y = score.logits(s, scale_log2, rows[:, None], (n0 + offs)[None, :], site, S.SCORE)
        y = band_edge_masks(y, rows, offs, n0, S.BLOCK_N, seqlen_k, row0, row0 + rows.shape[0] - 1, dlo, dhi,
                            float("-inf"), S.LEFT_EDGE)
        if S.BOUNDED:
            # m_i is the logits' bound (the consumer's start): no row max, O is never rescaled;
            # P times 2**log2_factor, as scaled_softmax_step's.
            p = gl.exp2(y * unit - (m_i - log2_factor)[:, None])
            return p, gl.full(m_i.shape, 1.0, gl.float32, m_i.type.layout), m_i
        else:
            # A share of the exponentials on the FMA pipe (not in the two forms above).
            x, m_ref, m_new = softmax_exponents(y, m_i, unit, log2_factor, None, _row_reduced(y, True, S.ROW_TREES))
            return _exp2_fma_share(x, S.FMA_EXP2), gl.exp2(m_i - m_ref), m_new


@gluon.jit
def _key_halves(x):
    """An MMA accumulator's (rows, keys) tile as its two (rows, g, t) halves along e: a thread
    holds keys 8g + 2t + e of its rows, t its lane of 4, e and g in its registers (so no value
    moves between threads; _row_tree and _exp2_fma_share take their parts along e and g)."""
    return gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 8, 4, 2]))


@gluon.jit
def _combined(a, b, IS_MAX: gl.constexpr):
    if IS_MAX:
        return gl.maximum(a, b)
    else:
        return a + b


@gluon.jit
def _halve(y, IS_MAX: gl.constexpr):
    """(rows, 4, G) to (rows, 4, G / 2): a thread's registers combined in pairs."""
    R: gl.constexpr = y.shape[0]
    G: gl.constexpr = y.shape[2]
    a, b = gl.split(gl.reshape(y, [R, 4, G // 2, 2]))
    return _combined(a, b, IS_MAX)


@gluon.jit
def _row_tree(x, IS_MAX: gl.constexpr):
    """Each row's maximum (IS_MAX) or sum of an MMA accumulator tile (rows, keys): over a
    thread's registers as a tree, then across the row's 4 lanes.  Triton's reduction folds a
    thread's keys of a row (32 of 128) in a chain as long, on the softmax's critical path; the
    tree takes the same instructions at a depth of 5: pairs along e first, then along g
    (_key_halves)."""
    R: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    gl.static_assert(N >= 16 and N <= 256 and (N & (N - 1)) == 0, "keys a power of two, 16 to 256")
    a, b = _key_halves(x)
    y = gl.permute(_combined(a, b, IS_MAX), (0, 2, 1))  # (rows, t, g)
    if N >= 256:
        y = _halve(y, IS_MAX)
    if N >= 128:
        y = _halve(y, IS_MAX)
    if N >= 64:
        y = _halve(y, IS_MAX)
    if N >= 32:
        y = _halve(y, IS_MAX)
    y = gl.reshape(_halve(y, IS_MAX), [R, 4])
    return gl.convert_layout(_row_reduced(y, IS_MAX, False), gl.SliceLayout(1, x.type.layout))


@gluon.jit
def _row_reduced(x, IS_MAX: gl.constexpr, TREE: gl.constexpr):
    """Each row's maximum (IS_MAX) or sum of x: by _row_tree (TREE), else Triton's reduction."""
    if TREE:
        return _row_tree(x, IS_MAX)
    elif IS_MAX:
        return gl.max(x, 1)
    else:
        return gl.sum(x, 1)


@gluon.jit
def _key_groups(x, fma_part):
    """2**x of (rows, G, 4) groups of keys (a thread's registers along G): the even groups on
    the MUFU, the odd ones by ``fma_part`` (exp2_fma, or _fma_quarter to halve its share again)."""
    R: gl.constexpr = x.shape[0]
    G: gl.constexpr = x.shape[1]
    even, odd = gl.split(gl.permute(gl.reshape(x, [R, G // 2, 2, 4]), (0, 1, 3, 2)))
    y = gl.join(gl.exp2(even), gl.convert_layout(fma_part(odd), even.type.layout))
    return gl.reshape(gl.permute(y, (0, 1, 3, 2)), [R, G, 4])


@gluon.jit
def _fma_quarter(x):
    """2**x of (rows, G, 4) groups of keys, a quarter of them on the FMA pipe."""
    return _key_groups(x, exp2_fma)


@gluon.jit
def _exp2_fma_share(x, SHARE: gl.constexpr):
    """2**x of an MMA accumulator's (rows, keys) tile with 1 / SHARE of its keys (2, 4, 8; 0: none)
    on the FMA pipe (tiles.exp2_fma), the rest on the MUFU: the parts are taken along e and g of
    each thread's keys (_key_halves), so no value moves."""
    if SHARE == 0:
        p = gl.exp2(x)
    else:
        gl.static_assert(SHARE == 2 or SHARE == 4 or SHARE == 8, "a half, a quarter or an eighth of the keys")
        R: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        even, odd = _key_halves(x)
        if SHARE == 2:
            odd = exp2_fma(odd)
        elif SHARE == 4:
            odd = _fma_quarter(odd)
        else:
            odd = _key_groups(odd, _fma_quarter)
        odd = gl.convert_layout(odd, even.type.layout)
        p = gl.convert_layout(gl.reshape(gl.join(gl.exp2(even), odd), [R, N]), x.type.layout)
    return p


@gluon.jit
def _dropped(p, drop, rows, n0, dtype: gl.constexpr, layout: gl.constexpr, S: gl.constexpr):
    """P with dropout applied (kernels/dropout.py) to block n0's keys, for O += P V: in ``dtype``,
    the dropped ones 0 (their bits masked), the kept ones scaled by 1 / (1 - dropout_p) once at the
    end (_store_rows' caller); the denominator has taken P before it."""
    if S.DROPOUT:
        gl.static_assert(not S.FP8, "FP8 attention takes no dropout")
        p = dropout.dropped_mma(p.to(dtype), drop[0], drop[1], rows, n0, drop[2], S.BLOCK_N, layout)
    return p


@gluon.jit
def _issue_scores(q_op, buf, slot, phase, turns, s_zero, WHICH: gl.constexpr, S: gl.constexpr):
    """Start S = Q K^T on K/V ring slot ``slot`` once it is this consumer's turn and K has landed.
    Turns go round the consumers in order; consumer 0 takes the first without waiting.  ``q_op``
    is Q in registers (Q_IN_REGISTERS, one slice) or the index of Q's first buffer: the product
    reduces over its QK_SLICES slices (pipeline.slices_product)."""
    if S.PINGPONG:
        mbarrier.wait(buf.turn.index(WHICH), (turns & 1) ^ (WHICH == 0))
    mbarrier.wait(buf.k_ready.index(slot), phase)
    if S.Q_IN_REGISTERS:
        gl.static_assert(S.QK_SLICES == 1, "Q in registers is one slice")
        k = buf.k.index(slot)
        return warpgroup_mma(q_op, k.reshape([k.shape[1], k.shape[3]]).permute((1, 0)), s_zero, use_acc=False,
                             is_async=True)
    else:
        return slices_product(buf.q, q_op, buf.k, slot * S.QK_SLICES, s_zero, S.QK_SLICES)


@gluon.jit
def _values(buf, slot, S: gl.constexpr):
    """V block in ring slot ``slot`` as O += P V's second operand, (keys, head dim).  Float8 V
    sits keys-contiguous, (head dim, keys), and is read transposed: float8 warpgroup MMA takes
    shared operands only along the reduced dimension."""
    v = buf.v.index(slot)
    if S.FP8:
        return v.reshape([S.HEAD_DIM_V_PAD, S.BLOCK_N]).permute((1, 0))
    else:
        return v.reshape([S.BLOCK_N, S.HEAD_DIM_V_PAD])


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, layout: gl.constexpr, FP8: gl.constexpr):
    """P as O += P V's register operand (_issue_values takes it).  Float8 P takes its keys in the
    order V's copy holds them (kernels/keys_contiguous.py), so that the change of layout moves no
    value between threads, and is kept four keys to an int32 until its MMA (float8.py)."""
    if FP8:
        return float8.packed_operand(p, dtype, layout)
    else:
        return gl.convert_layout(p.to(dtype), layout)


@gluon.jit
def _issue_values(p_op, v, acc, o_zero, S: gl.constexpr):
    """Start O += P V; with FRESH_PV the product goes to a zeroed accumulator (_add_values)."""
    if S.FP8:
        p_op = float8.register_operand(p_op, v.dtype, gl.DotOperandLayout(operand_index=0, parent=acc.type.layout,
                                                                   k_width=4))
    if S.FRESH_PV:
        return warpgroup_mma(p_op, v, o_zero, use_acc=False, is_async=True)
    else:
        return warpgroup_mma(p_op, v, acc, is_async=True)


@gluon.jit
def _add_values(acc, pv, alpha, alpha_prev, v_unit, v_pv, v_next, FRESH_PV: gl.constexpr):
    """O after the previous block's P V product ``pv``, rescaled to this block's running max
    (factor ``alpha``; 1 after the last block), with the ``alpha_prev`` and ``v_unit`` of the
    next call.  O is kept in units of a V descale (``v_unit``; Descales.value_scale, 1 but per
    block), so that V's descale per block costs a multiply per row, not per element.

    The MMA accumulated the product into O, in the unit of its block's V (``v_pv``): O times
    alpha, brought to the next block's unit ``v_next``.  FRESH_PV (float8 MMAs sum in fewer
    bits than float32): the product is apart, in ``v_pv``'s unit; O times the previous block's
    factor, in that unit, plus the product: one fused multiply-add per element."""
    if FRESH_PV:
        return acc * (alpha_prev * (v_unit / v_pv)) + pv, alpha, v_pv
    else:
        return pv * (alpha * (v_pv / v_next)), alpha, v_next


@gluon.jit
def _wait_values(pv, p_op):
    """Wait for the P V product; P's registers (read by it in flight) are kept alive up to here.
    Float8 P is tied as the packed int32 that float8.register_operand unpacks into the MMA's operand
    (the same registers once the compiler folds the unpacking; ptxas keeps an asynchronous MMA's
    registers until its wait either way)."""
    pv, p_op = warpgroup_mma_wait(0, deps=[pv, p_op])
    return pv, p_op


@gluon.constexpr_function
def _mma_k(dtype):
    """The K of one warpgroup MMA instruction: 32 bytes of the operands' type."""
    return gl.constexpr(256 // dtype.primitive_bitwidth)


@gluon.constexpr_function
def _register_k_width(dtype):
    """Consecutive K elements a thread holds of a register operand: 32 bits of them."""
    return gl.constexpr(32 // dtype.primitive_bitwidth)


@gluon.jit
def _pass_turn(turn, WHICH: gl.constexpr):
    """The tensor cores' turn goes to the next consumer (ping-pong with two)."""
    mbarrier.arrive(turn.index((WHICH + 1) % turn.shape[0]))


@gluon.jit
def _consumer(WHICH: gl.constexpr, buf, walk, stash, outputs, descales, scale_log2, score_args, dropped,
              S: gl.constexpr):
    """Consumer warpgroup WHICH: rows [64 * WHICH, 64 * WHICH + 64) of every tile handed over.

    Per K/V block j: (wait for its turn) issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}, (pass the
    turn), wait for S_j only, softmax, wait for the PV product, rescale O.  The first block has
    no PV product to overlap; the last one follows the loop."""
    ROWS: gl.constexpr = S.ROWS
    BLOCK_N: gl.constexpr = S.BLOCK_N
    HEAD_DIM_PAD: gl.constexpr = S.HEAD_DIM_PAD
    HEAD_DIM_V_PAD: gl.constexpr = S.HEAD_DIM_V_PAD
    STAGES: gl.constexpr = S.STAGES
    dtype: gl.constexpr = buf.q.dtype
    MMA_K: gl.constexpr = _mma_k(dtype)
    K_WIDTH: gl.constexpr = _register_k_width(dtype)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM_V_PAD, MMA_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=K_WIDTH)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=K_WIDTH)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    o_zero = gl.zeros([ROWS, HEAD_DIM_V_PAD], gl.float32, o_layout)
    it = 0     # K/V blocks consumed so far: ring slot and mbarrier phase
    turns = 0  # ping-pong turns taken so far
    tile_i = 0
    t = read_tile(buf.tile_ids, tile_i, buf.q_ready, S.Q_SLOTS)
    while t < walk.num_tiles:
        batch, head, m0, dlo, dhi, lo, n_blocks, seq = walk.tile(t, S.CONSUMERS * ROWS, BLOCK_N)
        seqlen_q = seq[3]
        seqlen_k = seq[4]
        q_slot = tile_i % S.Q_SLOTS
        q_op = (S.CONSUMERS * q_slot + WHICH) * S.QK_SLICES  # S = Q K^T's A: Q's (first) buffer
        if S.Q_IN_REGISTERS:
            # Q as the register operand: only K is read from shared memory, and Q's buffer is
            # free for the producer's next tile at once.
            q_op = buf.q.index(q_op).reshape([ROWS, HEAD_DIM_PAD]).load(q_layout)
            mbarrier.arrive(buf.q_empty.index(q_slot))
        row0 = m0 + WHICH * ROWS  # this consumer's first row
        rows = row0 + gl.arange(0, ROWS, layout=s_rows)
        head_k = head // walk.group
        rows_scale = scale_log2  # on the scores of these rows (block_scale: of one K block)
        out_scale = 1.0
        if S.FP8:
            rows_scale = scale_log2 * descales.rows_scale(batch, head, head_k, row0, S)
            out_scale = descales.output_scale(batch, head_k, S)
        site = (batch, head, seqlen_k - seqlen_q, score_args)
        drop = dropout.stream_of(dropped[0], batch, head, walk.heads_q, dropped[1], S.DROPOUT)
        distance = None
        if S.DISTANCE:
            distance = _distance_bias(site, s_cols, S)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)
        if S.BOUNDED:
            m_i = gl.full([ROWS], score.exp_scale(scale_log2, site, S.SCORE), gl.float32, s_rows)
        l_i = gl.zeros([ROWS], gl.float32, s_rows)
        acc = gl.zeros([ROWS, HEAD_DIM_V_PAD], gl.float32, o_layout)
        v_unit = descales.value_scale(batch, head_k, 0, S)  # O's unit before any block: any (O is 0)
        if n_blocks > 0:
            # First block: nothing to overlap with yet.
            slot = it % STAGES
            phase = (it // STAGES) & 1
            s = _issue_scores(q_op, buf, slot, phase, turns, s_zero, WHICH, S)
            if S.PINGPONG:
                _pass_turn(buf.turn, WHICH)
                turns += 1
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(buf.k_empty.index(slot))
            block_scale = rows_scale * descales.key_scale(batch, head_k, lo, S)
            log2_factor, inverse = descales.p_scale(S)
            p, alpha, m_i = _block_softmax(s, m_i, site, rows, row0, lo, seqlen_k, dlo, dhi, block_scale,
                                           log2_factor, distance, s_cols, S)
            l_i = _row_reduced(p, False, S.ROW_TREES) * inverse
            p = _dropped(p, drop, rows, lo, dtype, s_layout, S)
            p_op = _p_operand(p, dtype, p_layout, S.FP8)
            alpha_prev = gl.convert_layout(alpha, o_rows)[:, None]
            prev_slot = slot
            prev_phase = phase
            it += 1
            for j in range(1, n_blocks):
                n0 = lo + j * BLOCK_N
                slot = it % STAGES
                phase = (it // STAGES) & 1
                v_prev = _values(buf, prev_slot, S)
                s = _issue_scores(q_op, buf, slot, phase, turns, s_zero, WHICH, S)
                if S.OVERLAP:
                    # O += P_{j-1} V_{j-1} goes out with S_j; the softmax below runs under it.
                    mbarrier.wait(buf.v_ready.index(prev_slot), prev_phase)
                    pv = _issue_values(p_op, v_prev, acc, o_zero, S)
                if S.PINGPONG:
                    _pass_turn(buf.turn, WHICH)
                    turns += 1
                if S.OVERLAP:
                    s = warpgroup_mma_wait(1, deps=[s])
                else:
                    s = warpgroup_mma_wait(0, deps=[s])
                    mbarrier.wait(buf.v_ready.index(prev_slot), prev_phase)
                    pv = _issue_values(p_op, v_prev, acc, o_zero, S)
                mbarrier.arrive(buf.k_empty.index(slot))
                block_scale = rows_scale * descales.key_scale(batch, head_k, n0, S)
                log2_factor, inverse = descales.p_scale(S)
                p, alpha, m_i = _block_softmax(s, m_i, site, rows, row0, n0, seqlen_k, dlo, dhi, block_scale,
                                               log2_factor, distance, s_cols, S)
                l_i = l_i * alpha + _row_reduced(p, False, S.ROW_TREES) * inverse
                # p_op of the previous block is read by the in-flight wgmma: keep it alive until here.
                pv, p_op = _wait_values(pv, p_op)
                mbarrier.arrive(buf.v_empty.index(prev_slot))
                acc, alpha_prev, v_unit = _add_values(acc, pv, gl.convert_layout(alpha, o_rows)[:, None], alpha_prev,
                                                      v_unit, descales.value_scale(batch, head_k, n0 - BLOCK_N, S),
                                                      descales.value_scale(batch, head_k, n0, S), S.FRESH_PV)
                p = _dropped(p, drop, rows, n0, dtype, s_layout, S)
                p_op = _p_operand(p, dtype, p_layout, S.FP8)
                prev_slot = slot
                prev_phase = phase
                it += 1
            if not S.Q_IN_REGISTERS:
                # The last S = Q K^T has completed: the producer may load the next tile's Q into
                # this buffer under the last PV product and the epilogue (d256 has one Q buffer).
                # Not inside the loop: a branch there costs d256 spills.
                mbarrier.arrive(buf.q_empty.index(q_slot))
            mbarrier.wait(buf.v_ready.index(prev_slot), prev_phase)
            v_prev = _values(buf, prev_slot, S)
            pv = _issue_values(p_op, v_prev, acc, o_zero, S)
            pv, p_op = _wait_values(pv, p_op)
            last = descales.value_scale(batch, head_k, lo + (n_blocks - 1) * BLOCK_N, S)
            acc, alpha_prev, v_unit = _add_values(acc, pv, 1.0, alpha_prev, v_unit, last, last, S.FRESH_PV)
            mbarrier.arrive(buf.v_empty.index(prev_slot))
        elif not S.Q_IN_REGISTERS:
            mbarrier.arrive(buf.q_empty.index(q_slot))  # a tile with no K/V block
        if S.FP8:
            acc = acc * (v_unit * out_scale)
        if S.DROPOUT:
            acc = acc * (1.0 / (1.0 - drop[2]))
        out, lse = finalize_rows(acc, gl.convert_layout(m_i, o_rows), gl.convert_layout(l_i, o_rows))
        use = tile_i * S.CONSUMERS + WHICH
        out_dtype: gl.constexpr = outputs.o_desc.dtype
        not_finite = _store_rows(out.to(out_dtype), lse, acc, buf, use, WHICH, outputs, batch, head, row0, seq,
                                 o_layout, S)
        if S.CHECK_FINITE and not_finite > 0:  # a constexpr test first: no check, no recomputation compiled
            _exact_rows(batch, head, row0, seq, WHICH, buf, stash, outputs, walk, scale_log2, score_args, drop, S)
        tile_i += 1
        t = read_next_tile(buf.tile_ids, tile_i, buf.q_ready, walk.num_tiles, S.Q_SLOTS, S.PERSISTENT)
    tma.store_wait(0)


@gluon.jit
def _exact_rows(batch, head, row0, seq, WHICH: gl.constexpr, buf, stash, outputs, walk, scale_log2, score_args,
                drop, S: gl.constexpr):
    """The consumer's rows computed again by the masking rule, with the logsumexp of the main
    loop (natural log): a key outside a row's band contributes nothing, whatever its value.  The
    tensor cores' P V turns a masked key's probability of 0 times an infinite value into NaN; a
    consumer whose output came out not finite (rare: V holds inf or NaN) comes here, its rows
    and their logsumexp already stored (_store_rows).  The work is a function of its own
    (_exact_rows_cold, not inlined, scalar arguments only), so that the main loop's register
    allocation does not see it."""
    _, q_start, k_start, seqlen_q, seqlen_k = seq
    lse_rows = outputs.LSE + batch.to(gl.int64) * outputs.slb + head * outputs.slh + q_start
    # The rows' TMA store written to global memory (not only read from shared memory, as
    # tma.store_wait waits for) before they are written again, and every thread's logsumexp
    # there for the function to read back.
    _bulk_stores_done(lse_rows)
    gl.thread_barrier()
    dlo, dhi, lo, _, _, n_blocks = band_blocks(row0 - WHICH * S.ROWS, S.CONSUMERS * S.ROWS, S.BLOCK_N, seqlen_q,
                                               seqlen_k, walk.window_left, walk.window_right, False)
    dtype: gl.constexpr = buf.q.dtype
    head_k = head // walk.group
    q_base, sqs = _rows_of(stash, Q_AT, batch, q_start, head, dtype)
    k_base, sks = _rows_of(stash, K_AT, batch, k_start, head_k, dtype)
    v_base, svs = _rows_of(stash, V_AT, batch, k_start, head_k, dtype)
    o_base, sos = _rows_of(stash, O_AT, batch, q_start, head, dtype)
    _exact_rows_cold(q_base, sqs, k_base, sks, v_base, svs, o_base, sos, lse_rows, _stashed(stash, HEAD_DIMS_AT),
                     row0, dlo, dhi, lo, gl.minimum(lo + n_blocks * S.BLOCK_N, seqlen_k), seqlen_q,
                     seqlen_k - seqlen_q, batch, head, scale_log2, score_args, drop[0], drop[1], drop[2], S.ROWS,
                     S.HEAD_DIM_PAD, S.HEAD_DIM_V_PAD, S.SCORE, S.DROPOUT)


@gluon.jit
def _bulk_stores_done(anchor):
    """Wait until this thread's TMA stores have completed their writes to global memory, and
    order those writes before its later generic stores (``anchor``: any scalar; asm needs one).
    Only the threads that issued the stores wait: a barrier after it holds the others."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
                              "=r,l", [anchor], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit(noinline=True)
def _exact_rows_cold(q_base, sqs, k_base, sks, v_base, svs, o_base, sos, lse_rows, head_dims, row0, dlo,
                     dhi, lo, hi, seqlen_q, offset, batch, head, scale_log2, score_args, seed, stream, dropout_p,
                     ROWS: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
                     SCORE: gl.constexpr, DROPOUT: gl.constexpr):
    """_exact_rows' work, key by key, 64 columns of the output at a time (few registers)."""
    CHUNK: gl.constexpr = 64
    head_dim = head_dims & 0xFFFF
    head_dim_v = head_dims >> 16
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    rows = row0 + gl.arange(0, ROWS, layout=rows_layout)
    offs = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
    in_seq = rows < seqlen_q
    site = (batch, head, offset, score_args)
    # +inf for rows that see no key: p = 0
    lse2 = gl.load(lse_rows + rows, mask=in_seq, other=float("inf")) * LOG2E
    q_rows = q_base + rows.to(gl.int64)[:, None] * sqs
    o_rows = o_base + rows.to(gl.int64)[:, None] * sos
    for c in range(HEAD_DIM_V_PAD // CHUNK):
        cols = c * CHUNK + offs
        acc = gl.zeros([ROWS, CHUNK], gl.float32, layout)
        for key in range(lo, hi):
            s = gl.zeros([ROWS], gl.float32, rows_layout)
            for d in range(HEAD_DIM_PAD // CHUNK):
                dims = d * CHUNK + offs
                in_dim = dims < head_dim
                q = gl.load(q_rows + dims[None, :], mask=in_seq[:, None] & in_dim[None, :], other=0.0)
                k = gl.load(k_base + key.to(gl.int64) * sks + dims, mask=in_dim, other=0.0)
                s += gl.sum(q.to(gl.float32) * k.to(gl.float32)[None, :], 1)
            y = score.logits(s, scale_log2, rows, key, site, SCORE)
            visible = (key - rows >= dlo) & (key - rows <= dhi) & in_seq
            p = gl.where(visible, gl.exp2(y * score.exp_scale(scale_log2, site, SCORE) - lse2), 0.0)
            if DROPOUT:
                p *= dropout.key_scale((seed, stream, dropout_p), rows, key)
            v = gl.load(v_base + key.to(gl.int64) * svs + cols, mask=cols < head_dim_v, other=0.0)
            acc += gl.where(visible[:, None], p[:, None] * v.to(gl.float32)[None, :], 0.0)
        gl.store(o_rows + cols[None, :], acc.to(o_base.dtype.element_ty),
                 mask=in_seq[:, None] & (cols[None, :] < head_dim_v))


@gluon.jit
def _store_rows(out, lse, acc, buf, use, WHICH: gl.constexpr, outputs, batch, head, row0, seq,
                o_layout: gl.constexpr, S: gl.constexpr):
    """One consumer's O rows and their logsumexp; rows past the sequence, lanes past the head dim
    dropped.  O goes by TMA store through a staging buffer in shared memory (_store_staged): one
    per consumer, or one the two consumers take in turn (``use``: this consumer's turn, counted
    over the CTA), or, with O_BUFFERS == 0, straight from registers (_store_unstaged).  A packed
    sequence's (VARLEN) rows that run past its end go straight from registers too: the TMA
    store would write the next sequence's first rows.

    With CHECK_FINITE it returns non-zero where a row came out not finite, for the caller to
    recompute the rows."""
    ROWS: gl.constexpr = S.ROWS
    _, q_start, _, seqlen_q, _ = seq
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    if S.O_BUFFERS > 0:
        SHARED: gl.constexpr = S.O_BUFFERS == 1
        o_buf = buf.o.index(0 if SHARED else WHICH)
        if SHARED:
            # Turns alternate (each waits for the one before), so a parity names the turn awaited.
            mbarrier.wait(buf.o_free.index(0), (use & 1) ^ 1)
        else:
            tma.store_wait(0)  # this consumer's previous store has left its buffer
        if S.VARLEN:  # (batched launches compile the staged store alone, no branch around it)
            if row0 + ROWS > seqlen_q:
                not_finite = _store_unstaged(out, acc, buf, WHICH, outputs, batch, head, rows, seq, o_layout, S)
            else:
                not_finite = _store_staged(out, acc, buf, o_buf, WHICH, outputs, batch, head, row0, seq, S)
        else:
            not_finite = _store_staged(out, acc, buf, o_buf, WHICH, outputs, batch, head, row0, seq, S)
        if SHARED:
            tma.store_wait(0)
            gl.thread_barrier()  # every thread past the wait before the buffer is handed on
            mbarrier.arrive(buf.o_free.index(0))
    else:
        not_finite = _store_unstaged(out, acc, buf, WHICH, outputs, batch, head, rows, seq, o_layout, S)
    gl.store(outputs.LSE + batch.to(gl.int64) * outputs.slb + head * outputs.slh + q_start + rows, lse,
             mask=rows < seqlen_q)
    return not_finite


@gluon.jit
def _store_staged(out, acc, buf, o_buf, WHICH: gl.constexpr, outputs, batch, head, row0, seq, S: gl.constexpr):
    """O's rows by TMA store from the staging buffer ``o_buf``.  The not-finite flags go through
    shared memory beside O, so the barrier O's TMA store needs anyway makes every warp's visible,
    and they are read once the store is under way: the check costs a sum per row, off the
    store's path."""
    at, q_start, _, _, _ = seq
    not_finite = 0
    o_buf.reshape([S.ROWS, S.HEAD_DIM_V_PAD]).store(out)
    if S.CHECK_FINITE:
        _flag_rows(acc, buf.not_finite.index(WHICH))
    fence_async_shared()
    tma.async_copy_shared_to_global(outputs.o_desc, [at, row0 + q_start, head, 0], o_buf)
    if S.CHECK_FINITE:
        not_finite = _flagged(buf.not_finite.index(WHICH))
    return not_finite


@gluon.jit
def _store_unstaged(out, acc, buf, WHICH: gl.constexpr, outputs, batch, head, rows, seq, o_layout: gl.constexpr,
                    S: gl.constexpr):
    """O's ``rows`` by pointer from registers, rows past the sequence and lanes past the head dim
    dropped: two-byte stores (the head dim's mask splits the pairs)."""
    _, q_start, _, seqlen_q, _ = seq
    not_finite = 0
    cols = gl.arange(0, S.HEAD_DIM_V_PAD, layout=gl.SliceLayout(0, o_layout))
    ptrs = (outputs.O + batch.to(gl.int64) * outputs.sob + (rows + q_start)[:, None].to(gl.int64) * outputs.sos
            + head * outputs.soh + cols[None, :])
    gl.store(ptrs, out, mask=(rows[:, None] < seqlen_q) & (cols[None, :] < outputs.head_dims >> 16))
    if S.CHECK_FINITE:
        if S.VARLEN:  # rows past a packed sequence are the next one's: theirs is not this tile's to check
            _flag_rows(gl.where((rows < seqlen_q)[:, None], acc, 0.0), buf.not_finite.index(WHICH))
        else:
            _flag_rows(acc, buf.not_finite.index(WHICH))
        not_finite = _flagged(buf.not_finite.index(WHICH))
    return not_finite


@gluon.jit
def _flag_rows(acc, flags):
    """Whether each row of ``acc`` holds a value that is not finite, into ``flags`` (one int per
    row in shared memory).  A row's sum is not finite then; finite values that overflow it count
    too (rare: those rows are recomputed, still exact)."""
    row_sums = gl.sum(acc, 1)
    flags.store(((row_sums - row_sums) != 0).to(gl.int32))


@gluon.jit
def _flagged(flags):
    """Whether any of ``flags`` is set, read by every thread whole once a barrier has passed (with
    O staged in shared memory, the one before its TMA store): a warp's read spans the rows, so
    the reduction is one warp instruction, with no shared scratch."""
    ROWS: gl.constexpr = flags.shape[0]
    return gl.max(flags.load(gl.BlockedLayout([ROWS // 32], [32], [gl.num_warps()], [0])), 0)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, Q, sqb, sqs, sqh, K, skb, sks, skh, V, svb, svs, svh,
                O, sob, sos, soh, head_dims, LSE, slb, slh,
                batch_heads, heads_q, group, head_group, m_blocks, num_tiles,
                seqlen_q, seqlen_k, window_left, window_right, CU_Q, CU_K, totals, TILES, COUNT, scale_log2,
                counter, score_args,
                DESCALE, sdt, sdb, sdh, SEED, dropout_p,
                ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
                QK_SLICES: gl.constexpr, STAGES: gl.constexpr,
                PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, O_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr,
                DYNAMIC: gl.constexpr, Q_SLOTS: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                Q_IN_REGISTERS: gl.constexpr, LEFT_EDGE: gl.constexpr, SCORE: gl.constexpr, DISTANCE: gl.constexpr,
                BOUNDED: gl.constexpr, FP8: gl.constexpr, FRESH_PV: gl.constexpr, CHECK_FINITE: gl.constexpr,
                VARLEN: gl.constexpr, DROPOUT: gl.constexpr, FMA_EXP2: gl.constexpr,
                ROW_TREES: gl.constexpr):
    S: gl.constexpr = Schedule(ROWS, BLOCK_N, HEAD_DIM_PAD, HEAD_DIM_V_PAD, QK_SLICES, STAGES, CONSUMERS, Q_SLOTS,
                               O_BUFFERS, PINGPONG, OVERLAP, PERSISTENT, DYNAMIC, Q_IN_REGISTERS, LEFT_EDGE, SCORE,
                               DISTANCE, BOUNDED, FP8, FRESH_PV, CHECK_FINITE, VARLEN, DROPOUT, FMA_EXP2,
                               ROW_TREES)
    buf = Buffers.allocate(q_desc, k_desc, v_desc, o_desc, S)
    score_args = values(score_args)  # an ALiBi batch stride of 1 comes specialised
    if VARLEN:  # the packed list's length, written on the device (packed_tiles.py)
        num_tiles = gl.load(COUNT) * heads_q
    walk = TileWalk(num_tiles, batch_heads, heads_q, group, head_group, m_blocks, seqlen_q, seqlen_k, window_left,
                    window_right, CU_Q, CU_K, totals, TILES, VARLEN)
    stash = _stash_tensors(Q, sqb, sqs, sqh, K, skb, sks, skh, V, svb, svs, svh, O, sob, sos, soh, head_dims)
    outputs = Outputs(o_desc, O, sob, sos, soh, head_dims, LSE, slb, slh)
    descales = Descales(DESCALE, sdt, sdb, sdh)
    dropped = (SEED, dropout_p)
    # The partitions are listed as written (Gluon builds no list at run time): one list per count.
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (0, buf, walk, stash, outputs, descales, scale_log2, score_args, dropped, S)),
            (_consumer, (1, buf, walk, stash, outputs, descales, scale_log2, score_args, dropped, S)),
            (_consumer, (2, buf, walk, stash, outputs, descales, scale_log2, score_args, dropped, S)),
            (_producer, (q_desc, k_desc, v_desc, buf, walk, counter, S)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, buf, walk, stash, outputs, descales, scale_log2, score_args, dropped, S)),
            (_consumer, (1, buf, walk, stash, outputs, descales, scale_log2, score_args, dropped, S)),
            (_producer, (q_desc, k_desc, v_desc, buf, walk, counter, S)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


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


@remembered
def kernel_constants(p, cfg, element_size, out_element_size=None, dtype=None):
    """The kernel's compile-time arguments for problem ``p`` under schedule ``cfg``; Q, K and V
    of ``element_size`` bytes and type ``dtype`` (None: unknown, so no bounded softcap), O of
    ``out_element_size`` (the same by default)."""
    rows = WARPGROUP_ROWS
    lanes = configs.qk_lanes(p)  # of Q and K in shared memory
    q_bytes = cfg.tile_m * lanes * element_size  # Q of one tile
    o_bytes = cfg.tile_m * p.head_dim_v_pad * (out_element_size or element_size)
    ring_bytes = cfg.num_stages * cfg.block_n * (lanes + p.head_dim_v_pad) * element_size
    # O staged for its TMA store, then a second Q buffer, where shared memory holds them.
    o_buffers = o_staging_buffers(q_bytes, o_bytes, ring_bytes, cfg.consumers)
    next_q = (cfg.next_q and cfg.persistent and o_buffers == cfg.consumers
              and 2 * q_bytes + o_bytes + ring_bytes <= SHARED_MEMORY)
    fresh_pv = configs.fresh_pv(p)
    # A distance bias (ALiBi) split into column and row parts off the diagonal: its column part
    # takes 32 registers a thread, which two consumers up to d128 have once Q stays in shared
    # memory (three consumers' 160 registers, and d256's, spill).
    distance = score.is_distance_bias(score.mod_of(p)) and cfg.consumers == 2 and p.widest_head_dim_pad <= 128
    # Packed sequences are walked persistently whatever the schedule: a CTA whose tiles all lie
    # past their sequences must still tell its consumers that no tile is coming (end_tiles).
    persistent = cfg.persistent or p.varlen
    return dict(ROWS=rows, BLOCK_N=cfg.block_n, HEAD_DIM_PAD=p.head_dim_pad, HEAD_DIM_V_PAD=p.head_dim_v_pad,
                QK_SLICES=configs.qk_slices(p), STAGES=cfg.num_stages,
                PINGPONG=cfg.pingpong, OVERLAP=cfg.overlap, O_BUFFERS=o_buffers, PERSISTENT=persistent,
                # Tiles of uneven length (a band, packed sequences) from the atomic counter; equal
                # ones strided over.
                DYNAMIC=persistent and (p.banded or p.varlen), Q_SLOTS=2 if next_q else 1, CONSUMERS=cfg.consumers,
                CONSUMER_REGS=CONSUMER_REGS[cfg.consumers],
                # The float32 accumulator of FRESH_PV takes the registers Q would.
                Q_IN_REGISTERS=q_in_registers(p.widest_head_dim_pad, cfg) and not fresh_pv and not distance,
                # A sliding window's left edge: without one (causal, none) only the right is tested.
                LEFT_EDGE=p.window_left >= 0, SCORE=score.mod_of(p), FP8=p.fp8_mode, FRESH_PV=fresh_pv,
                DISTANCE=distance, BOUNDED=softcap_bounds_logits(p, dtype),
                # Only a band, or a packed sequence's end (the next sequence's keys follow it),
                # masks keys that lie inside the tensors (past the end TMA reads zeros), whose
                # values could turn P V non-finite: an output that comes out so is recomputed by
                # the masking rule (_exact_rows).  Not float8 (the recomputation reads operands
                # without their descales): a non-finite input stays so.
                CHECK_FINITE=(p.banded or p.varlen) and not p.fp8, VARLEN=p.varlen, DROPOUT=p.dropout,
                FMA_EXP2=cfg.exp2_on_fma, ROW_TREES=cfg.row_trees)


# The widest logit range (log2 units) the softmax takes from a fixed reference point: P stays at
# 2**-100 or more, normal in float32 and bf16 with room for its products with V (a softcap's
# logits span 2 * softcap * log2(e): softcaps up to 34.6).
BOUNDED_RANGE = 100.0


def softcap_bounds_logits(p, dtype) -> bool:
    """Whether the softmax takes the softcap as every row's max (score logits ``y`` at most 1 unit,
    u = softcap * log2(e)): no running max, O never rescaled, the result the same.  Only a softcap
    alone (a bias is unbounded below: a row could underflow whole), on bf16 (fp16's P and float8's
    would underflow where bf16's is normal), of range within BOUNDED_RANGE."""
    return (p.softcap > 0 and p.alibi_slopes is None and dtype == torch.bfloat16 and not p.fp8
            and 2 * p.softcap * score.LOG2E <= BOUNDED_RANGE)


def o_staging_buffers(q_bytes, o_bytes, ring_bytes, consumers):
    """Shared-memory buffers O is staged in for its TMA store: one per consumer where Q, the K/V
    ring and those fit (d64, d128); else one that two consumers take in turn (d256: Q and the
    two-slot ring leave 32 KB, one consumer's rows); else none, and O leaves from registers (as
    two-byte stores: the head dim's mask splits the pairs)."""
    if q_bytes + o_bytes + ring_bytes <= SHARED_MEMORY:
        return consumers
    if consumers == 2 and q_bytes + o_bytes // consumers + ring_bytes <= SHARED_MEMORY:
        return 1
    return 0


def q_in_registers(head_dim_pad, cfg) -> bool:
    """Whether S = Q K^T takes Q from registers (loaded once per tile) rather than shared memory:
    with both operands there each consumer reads Q and K from shared memory for every K/V block,
    near the bandwidth shared memory serves at d64 and d128.  Up to d128 with two consumers:
    d256's O takes half of a consumer's registers, and three consumers' 160 registers spill."""
    return cfg.q_registers and head_dim_pad <= 128 and cfg.consumers == 2


def forward(plan, p, q, k, v):
    """Output (V's head dim) and logsumexp (and an empty ``saved``) under the plan's schedule.
    Packed sequences (varlen: (total, heads, head dim)) are seen by TMA as one batch entry, (1,
    total, heads, head dim)."""
    q, k, v = (tma_host.ready(x) for x in (q, k, v))
    prepared = _forward_launch(p, plan.config, q.dtype, q.shape, q.stride(), k.stride(), v.stride(), q.device.index)
    return prepared(p, q, k, v)


class _ForwardLaunch:
    """The forward's launch for one kind of call: problem ``p``, schedule ``cfg``, the inputs'
    dtype, q's shape and the strides of q, k and v (aligned for TMA), the device.  Everything
    derived from them is computed once per kind (``_forward_launch``: remembered where the
    problem holds no tensor), so that a call allocates the output, describes the tensors and
    launches: every argument's class is then fixed by the kind (launch.Prepared, vouched)."""

    def __init__(self, p, cfg, dtype, q_shape, q_strides, k_strides, v_strides, device_index):
        self.out_dtype = torch.bfloat16 if p.fp8 else dtype
        self.out_shape = (*q_shape[:-1], p.head_dim_v)
        self.lse_shape = p.row_stat_shape(q_shape[0])
        consts = kernel_constants(p, cfg, dtype.itemsize, self.out_dtype.itemsize, dtype)
        rows, pad_v = consts["ROWS"], p.head_dim_v_pad
        pad = configs.qk_lanes(p)  # of Q and K in shared memory
        lanes = pad // consts["QK_SLICES"]  # of one Q or K buffer
        self.dynamic = consts["DYNAMIC"]
        self.tile_m = cfg.tile_m
        # Each tensor descriptor's (block_shape, layout, spec), by the kernel's parameter name;
        # float8 V is read from its keys-contiguous copy (tma.keys_contiguous_operand).
        self.specs = dict(
            q_desc=tma_host.block_spec(rows, lanes, dtype), k_desc=tma_host.block_spec(cfg.block_n, lanes, dtype),
            v_desc=(tma_host.keys_block_spec(pad_v, cfg.block_n, dtype) if p.fp8 else
                    tma_host.block_spec(cfg.block_n, pad_v, dtype)),
            o_desc=tma_host.block_spec(rows, pad_v, self.out_dtype))
        out_strides = contiguous_strides(self.out_shape)
        self.strides = tuple(p.seq_strides_of(x) for x in (q_strides, k_strides, v_strides, out_strides))
        self.lse_strides = p.row_stat_strides_of(contiguous_strides(self.lse_shape))
        m_blocks = p.query_blocks(cfg.tile_m)
        batch_heads = p.batch * p.heads_q
        num_tiles = m_blocks * batch_heads
        programs = min(num_tiles, gpu.sm_count(device_index)) if consts["PERSISTENT"] else num_tiles
        kv_bytes = p.seqlen_k * (pad + pad_v) * dtype.itemsize
        self.walk = (batch_heads, p.heads_q, p.group, heads_sharing_l2(p, batch_heads, kv_bytes), m_blocks, num_tiles,
                     p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)
        self.launch = Prepared(_fwd_kernel, (programs,), (), dict(consts, **launch_options(cfg.consumers)),
                               vouched=True)

    def __call__(self, p, q, k, v):
        device = q.device
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        q4, k4, v4, out4 = (x.unsqueeze(0) for x in (q, k, v, out)) if p.varlen else (q, k, v, out)
        cu_q, cu_k = p.cu_pointers(device)
        # A packed batch's tiles, listed on the device (num_tiles bounds their count); else placeholders.
        tiles, count = packed_tiles.tile_list(p, self.tile_m, device) if p.varlen else (cu_q, cu_q)
        specs = self.specs
        if p.fp8:
            v_desc = Descriptor(tma_host.keys_contiguous_operand(v4), *specs["v_desc"])
            descale, descale_strides = p.fp8_descale, p.fp8_descale.stride()[:3]
        else:
            v_desc = Descriptor(v4, *specs["v_desc"])
            descale, descale_strides = lse, (0, 0, 0)  # a placeholder, never read
        sq, sk, sv, so = self.strides
        self.launch(
            Descriptor(q4, *specs["q_desc"]), Descriptor(k4, *specs["k_desc"]), v_desc,
            Descriptor(out4, *specs["o_desc"]),
            q, *sq, k, *sk, v, *sv, out, *so, p.head_dims, lse, *self.lse_strides, *self.walk, cu_q, cu_k, p.totals,
            tiles, count, p.scale_log2, tile_counter(device) if self.dynamic else no_counter(device), score.args_of(p),
            descale, *descale_strides, dropout.seed_argument(p, cu_q), p.dropout_p)
        return out, lse, lse.new_empty(0)


@remembered
def _forward_launch(p, *kind) -> _ForwardLaunch:
    return _ForwardLaunch(p, *kind)
