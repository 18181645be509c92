"""The tiles of a packed batch, listed on the device for the Gluon kernels' walks.

A packed (varlen) batch's sequences have lengths only the device knows (reading the offsets on
the host would stall the stream).  A walk over batch x heads x the longest sequence's query
blocks would meet a tile past its sequence's end for every block a shorter sequence lacks; the
Gluon kernels walk a list instead: one entry per (sequence, block) that holds rows,
``sequence * m_blocks + block``, the heads of an entry taking consecutive tiles.  Blocks of query
rows (the forward, the backward's dQ pass) or of keys (its dK/dV pass: ``keys``).

The list runs sequence by sequence, in batch order, each sequence's causal tiles longest first
(query blocks from its last down to its first, key blocks from its first up), so that the CTAs
running at one time work on one sequence's heads and blocks and re-read its K/V from L2 (a list
block by block across the batch would have them read every sequence's K/V at once).  A program per SEQUENCES sequences writes
their entries: each sequence's first entry is the blocks of the sequences before it; the last
program writes the entry count, which the walk reads as its length.  Tables on the device stay
unread on the host; their offsets are clamped as every kernel clamps them
(blocks.sequence_bounds), and a malformed table (overlapping sequences) lists no more entries
than the list has room for.
"""
import torch
import triton
import triton.language as tl

from flashtile.kernels.blocks import sequence_bounds
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import cdiv, next_power_of_2

SEQUENCES = 1024  # sequences a program reads at a time


@triton.jit
def _blocks_of(CU, first, batch, total, stride, m_blocks, TILE_M: tl.constexpr, SEQUENCES: tl.constexpr):
    """(sequence indices, their blocks: at most m_blocks, 0 past the batch) from ``first``; the
    sequences' (start, end) in CU (entry stride ``stride``), clamped to ``total`` rows."""
    b = first + tl.arange(0, SEQUENCES)
    _, length = sequence_bounds(tl.minimum(b, batch - 1), CU, 0, total, stride, True)
    return b, tl.where(b < batch, tl.minimum(tl.cdiv(length, TILE_M), m_blocks), 0)


@triton.jit
def _list_kernel(CU, TILES, COUNT, batch, m_blocks, capacity, total, stride, TILE_M: tl.constexpr,
                 SEQUENCES: tl.constexpr, LAST_FIRST: tl.constexpr):
    first = tl.program_id(0) * SEQUENCES
    start = 0  # the entries of the sequences before this program's
    for before in range(0, first, SEQUENCES):
        _, n = _blocks_of(CU, before, batch, total, stride, m_blocks, TILE_M, SEQUENCES)
        start += tl.sum(n)
    b, n = _blocks_of(CU, first, batch, total, stride, m_blocks, TILE_M, SEQUENCES)
    at = start + tl.cumsum(n, 0) - n  # each sequence's first entry
    for j in range(0, tl.max(n, 0)):  # each sequence's j-th entry: its block n - 1 - j (LAST_FIRST), or j
        block = n - 1 - j if LAST_FIRST else j
        tl.store(TILES + at + j, b * m_blocks + block, mask=(j < n) & (at + j < capacity))
    if first + SEQUENCES >= batch:
        tl.store(COUNT, tl.minimum(start + tl.sum(n), capacity))


def entries(p, tile_m, keys=False) -> int:
    """The length of tile_list's list (at least 1): at most a block per ``tile_m`` rows of the
    packed tensor, plus one partial block a sequence."""
    m_blocks, total = (p.key_blocks(tile_m), p.total_k) if keys else (p.query_blocks(tile_m), p.total_q)
    return max(1, min(p.batch * m_blocks, cdiv(total, tile_m) + p.batch))


def tile_list(p, tile_m, device, keys=False):
    """(entries, count): problem ``p``'s packed tiles of ``tile_m`` query rows (``keys``: key
    rows) as the Gluon kernels walk them, and the number of entries (one int32, on the device)."""
    if keys:
        m_blocks, cu, total, stride = p.key_blocks(tile_m), p.cu_seqlens_k, p.total_k, p.totals[3]
    else:
        m_blocks, cu, total, stride = p.query_blocks(tile_m), p.cu_seqlens_q, p.total_q, p.totals[2]
    tiles = torch.empty(entries(p, tile_m, keys), dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    sequences = min(SEQUENCES, next_power_of_2(p.batch))
    launch(_list_kernel, (cdiv(p.batch, sequences),), cu, tiles, count, p.batch, m_blocks, tiles.numel(), total,
           stride, TILE_M=tile_m, SEQUENCES=sequences, LAST_FIRST=not keys)
    return tiles, count
