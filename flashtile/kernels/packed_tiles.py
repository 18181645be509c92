"""The tiles of a packed batch, listed on the device for the Gluon forward's walk.

A packed (varlen) batch's sequences have lengths only the device knows (reading the offsets on
the host would stall the stream).  A walk over batch x heads x the longest sequence's query
blocks would meet a tile past its sequence's end for every block a shorter sequence lacks; the
Gluon forward walks a list instead: one entry per (sequence, query block) that holds rows,
``sequence * m_blocks + block``, the query heads of an entry taking consecutive tiles.

The list runs step by step from the last query block down to the first (causal tiles longest
first), and inside a step the sequences that reach that block in batch order.  One program per
step writes its entries: where its step starts is the number of entries of the steps before it
(a sequence of n blocks has entries at the last n steps), and each sequence's place inside the
step the count of the sequences before it that reach the block.  Program 0 writes the entry
count, which the walk reads as its length.  Tables on the device stay unread on the host; their
offsets are clamped as every kernel clamps them (blocks.sequence_bounds), and a malformed table
(overlapping sequences) lists no more entries than the list has room for.
"""
import torch
import triton
import triton.language as tl

from flashtile.kernels.blocks import sequence_bounds
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import cdiv, next_power_of_2

SEQUENCES = 1024  # sequences a program reads at a time


@triton.jit
def _blocks_of(CU_Q, first, batch, totals, m_blocks, TILE_M: tl.constexpr, SEQUENCES: tl.constexpr):
    """(sequence indices, their query blocks: at most m_blocks, 0 past the batch) from ``first``."""
    b = first + tl.arange(0, SEQUENCES)
    _, length = sequence_bounds(tl.minimum(b, batch - 1), CU_Q, 0, totals[0], totals[2], True)
    return b, tl.where(b < batch, tl.minimum(tl.cdiv(length, TILE_M), m_blocks), 0)


@triton.jit
def _list_kernel(CU_Q, TILES, COUNT, batch, m_blocks, capacity, totals, TILE_M: tl.constexpr,
                 SEQUENCES: tl.constexpr):
    step = tl.program_id(0)
    block = m_blocks - 1 - step
    # A sequence of n blocks has entries at steps m_blocks - n to m_blocks - 1.
    start = 0
    count = 0
    for first in range(0, batch, SEQUENCES):
        _, n = _blocks_of(CU_Q, first, batch, totals, m_blocks, TILE_M, SEQUENCES)
        start += tl.sum(tl.maximum(step - (m_blocks - n), 0))
        count += tl.sum(n)
    if step == 0:
        tl.store(COUNT, tl.minimum(count, capacity))
    placed = 0
    for first in range(0, batch, SEQUENCES):
        b, n = _blocks_of(CU_Q, first, batch, totals, m_blocks, TILE_M, SEQUENCES)
        reach = n > block
        rank = placed + tl.cumsum(reach.to(tl.int32), 0) - 1
        tl.store(TILES + start + rank, b * m_blocks + block, mask=reach & (start + rank < capacity))
        placed += tl.sum(reach.to(tl.int32))


def tile_list(p, tile_m, device):
    """(entries, count): problem ``p``'s packed tiles of ``tile_m`` query rows as the Gluon
    forward walks them, and the number of entries (one int32, on the device)."""
    m_blocks = p.query_blocks(tile_m)
    # Entries: at most a block per tile_m rows of the packed q, plus one partial block a sequence.
    entries = min(p.batch * m_blocks, cdiv(p.total_q, tile_m) + p.batch)
    tiles = torch.empty(max(1, entries), dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    launch(_list_kernel, (m_blocks,), p.cu_seqlens_q, tiles, count, p.batch, m_blocks, tiles.numel(), p.totals,
           TILE_M=tile_m, SEQUENCES=min(SEQUENCES, next_power_of_2(p.batch)))
    return tiles, count
