"""The persistent tile scheduler of the Gluon kernels: which tile each CTA takes next.

A persistent launch runs ``min(tiles, SMs)`` CTAs that loop over tiles.  Tiles of equal length
are strided over (every num_programs-th: PERSISTENT); tiles of uneven length (a causal or
window band, ordered longest first) are taken from an atomic counter as CTAs free up (DYNAMIC),
so the walk balances itself.  A CTA's producer picks the tiles and hands each tile's number to
its consumers through shared memory (publish_tile / read_tile), ordered by the mbarrier of the
slot the tile's loads land in.

The counter is one int64 per stream, epoch-tagged: each launch gets a new epoch (its high 32
bits, ``counter = (pointer, epoch << 32)``), every CTA first raises the counter to the epoch's
base (atomic max: the first CTA of a launch resets it, the others find it there), then takes
tiles by atomic add, counting from the base.  Nothing has to set it back at the end, so a
launch that dies half-way leaves nothing a later launch can misread.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from flashtile.kernels.blocks import grouped_tile, sequence_bounds
from flashtile.kernels.problem import cdiv


@gluon.constexpr_function
def value(x):
    """A run-time integer, or one triton specialised to a constant (an argument equal to 1)."""
    return x if isinstance(x, gl.tensor) else gl.constexpr(x)


@gluon.constexpr_function
def values(xs):
    """``value`` of each element of a tuple argument: triton specialises elements equal to 1 too."""
    return gl.tuple([value(x) for x in xs])


# An aggregate's field holding ``value``'s result.
Value = (gl.tensor, gl.constexpr)


# Bytes of the streamed blocks of the heads a band's walk keeps together (the H200 has 50 MB of L2).
L2_BUDGET = 32 * 2**20


@gluon.jit
def start_tiles(counter, DYNAMIC: gl.constexpr):
    """Before a CTA's first take from the counter: raise it to this launch's epoch base."""
    if DYNAMIC:
        pointer, base = counter
        gl.atomic_max(pointer, base)


@gluon.jit
def next_tile(t, num_tiles, counter, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr):
    """The tile a CTA's producer takes after tile ``t``: DYNAMIC, the first no CTA has taken
    yet (the counter counts the tiles past the first num_programs, from the epoch's base);
    PERSISTENT, every num_programs-th (tiles of equal length); else none (one tile per CTA)."""
    if DYNAMIC:
        pointer, base = counter
        t = gl.num_programs(0) + (gl.atomic_add(pointer, 1) - base).to(gl.int32)
    elif PERSISTENT:
        t += gl.num_programs(0)
    else:
        t = num_tiles
    return t


@gluon.jit
def end_tiles(tile_ids, tile_i, ready, empty, num_tiles, PERSISTENT: gl.constexpr):
    """No tile left after the producer's ``tile_i`` tiles: it tells the consumers with a tile
    number past the end, in the next slot (barriers ``ready`` / ``empty`` of the slots) once
    that is free; a CTA of one tile (not PERSISTENT) ends without (read_next_tile)."""
    if PERSISTENT:
        SLOTS: gl.constexpr = ready.shape[0]
        slot = tile_i % SLOTS
        mbarrier.wait(empty.index(slot), (tile_i // SLOTS & 1) ^ 1)
        publish_tile(tile_ids, tile_i, num_tiles)
        mbarrier.arrive(ready.index(slot))


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
def packed_tile(t, TILES, heads, m_blocks, ROWS: gl.constexpr):
    """(sequence, head, first row) of tile ``t`` of a packed batch's walk: entry t // heads of the
    list TILES (packed_tiles.py: sequence * m_blocks + block), the heads of an entry on
    consecutive tiles."""
    entry = gl.load(TILES + t // heads)
    return entry // m_blocks, t % heads, entry % m_blocks * ROWS


@aggregate
class Sequences:
    """The batch's sequences as the kernels' walks see them.  Batched: each the batch entry,
    ``seqlen_q`` query rows and ``seqlen_k`` keys from row 0.  Packed (VARLEN): each from its
    offsets in CU_Q and CU_K (blocks.sequence_bounds; ``totals``: Problem.totals), in the
    (1, total, heads, head dim) views TMA sees; ``seqlen_q`` and ``seqlen_k`` the longest."""
    seqlen_q: Value
    seqlen_k: Value
    CU_Q: gl.tensor
    CU_K: gl.tensor
    totals: gl.tuple
    VARLEN: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, seqlen_q, seqlen_k, CU_Q, CU_K, totals, VARLEN):
        self.seqlen_q = value(seqlen_q)
        self.seqlen_k = value(seqlen_k)
        self.CU_Q = CU_Q
        self.CU_K = CU_K
        self.totals = values(totals)
        self.VARLEN = gl.constexpr(VARLEN)

    @gluon.jit
    def of(self, batch):
        """Sequence ``batch``: (its TMA batch coordinate, first query row, first key row, query
        rows, keys)."""
        if self.VARLEN:
            q_start, seqlen_q = sequence_bounds(batch, self.CU_Q, 0, self.totals[0], self.totals[2], True)
            k_start, seqlen_k = sequence_bounds(batch, self.CU_K, 0, self.totals[1], self.totals[3], True)
            return 0, q_start.to(gl.int32), k_start.to(gl.int32), seqlen_q, seqlen_k
        else:
            return batch, 0, 0, self.seqlen_q, self.seqlen_k


@gluon.jit
def stationary_tile(t, num_tiles, heads, seqlen, head_group, ROWS: gl.constexpr, LONGEST_FIRST: gl.constexpr):
    """(batch, head, first row) of tile ``t`` of ``num_tiles``: ROWS stationary rows of one head,
    walked in groups of ``head_group`` heads (blocks.grouped_tile; 1: one head's tiles
    adjacent); LONGEST_FIRST: the row blocks from the last (the dQ pass: causal rows that see
    the most keys first), else from the first (the dK/dV pass: causal keys seen by the most rows)."""
    blocks = gl.cdiv(seqlen, ROWS)
    bh, block = grouped_tile(t, num_tiles // blocks, head_group, blocks)
    if LONGEST_FIRST:
        block = blocks - 1 - block
    return bh // heads, bh % heads, block * ROWS


def heads_sharing_l2(p, batch_heads, streamed_bytes_per_head) -> int:
    """How many of a walk's ``batch_heads`` (batch, head) pairs blocks.grouped_tile keeps
    together.  Tiles of equal length: one, its row blocks adjacent, so the CTAs resident together
    read the same streamed blocks at about the same time.  A band's tiles (uneven, taken longest
    first): as many heads as have their streamed blocks fit in L2_BUDGET, at least one, at most
    all (one at a time leaves each head's short tiles to the end of the walk, unbalanced), in
    groups as even as their count allows (2 + 2 rather than 3 + 1: a last group much smaller
    than the others ends the walk unbalanced)."""
    if not p.banded:
        return 1
    most = max(1, min(batch_heads, L2_BUDGET // streamed_bytes_per_head))
    return cdiv(batch_heads, cdiv(batch_heads, most))


# Epochs run from 1 to below 2**31 (a launch's tiles are counted in the low 32 bits); at the
# end of that range a counter is zeroed and its epochs start again.
EPOCH_BITS = 32
MAX_EPOCH = 2**31 - 1


class _StreamCounter:
    """A stream's counter and the epoch its last launch used."""

    def __init__(self, device):
        self.buffer = torch.zeros(1, dtype=torch.int64, device=device)
        self.epoch = 0

    def next_launch(self):
        if self.epoch == MAX_EPOCH:
            self.buffer.zero_()  # on the stream, ahead of the launch
            self.epoch = 0
        self.epoch += 1
        return self.buffer, self.epoch << EPOCH_BITS


def tile_counter(device):
    """``(pointer, epoch base)`` of the dynamic walk for a launch on the current stream: one
    buffer per stream, allocated and zeroed once, a new epoch per launch (launches on one stream
    run in order, never sharing an epoch).  A CUDA graph being captured gets a buffer of its own,
    zeroed inside the graph, so each replay starts from nothing and never shares memory with
    eager launches."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int64, device=device), 1 << EPOCH_BITS
    return _stream_counter(device.index, torch.cuda.current_stream(device).cuda_stream).next_launch()


@functools.lru_cache(maxsize=None)
def _stream_counter(device_index, stream):
    return _StreamCounter(torch.device("cuda", device_index))


def no_counter(device):
    """What a static walk passes for the counter (never read)."""
    return _placeholder(device.index), 1 << EPOCH_BITS


@functools.lru_cache(maxsize=None)
def _placeholder(device_index):
    return torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", device_index))
