"""The band's element masks: band_edge_masks (the Gluon forward's, testing only the edges a block
crosses, with and without the left one) and band_rows_mask (the Gluon backward's) against
band_mask (every rule at once), over blocks on and off the band's edges; the walk over a band's tiles
(grouped_tile); the list of a packed batch's tiles (packed_tiles)."""
import itertools

import pytest
import torch
import triton
import triton.language as tl

from flashtile.kernels import packed_tiles
from flashtile.kernels.blocks import band_edge_masks, band_mask, band_rows_mask, diagonal_band, grouped_tile
from flashtile.kernels.problem import Problem, cdiv
from conftest import DEVICE

ROWS, COLS = 16, 16


@triton.jit
def _masks(EDGE, ROW_BOUNDS, BAND, r0, n0, seqlen_q, n_cols, window_left, window_right, ROWS: tl.constexpr,
           COLS: tl.constexpr, LEFT_EDGE: tl.constexpr):
    dlo, dhi = diagonal_band(seqlen_q, n_cols, window_left, window_right)
    rows = r0 + tl.arange(0, ROWS)
    offs = tl.arange(0, COLS)
    s = tl.zeros([ROWS, COLS], tl.float32)
    edge = band_edge_masks(s, rows, offs, n0, COLS, n_cols, r0, r0 + ROWS - 1, dlo, dhi, float("-inf"), LEFT_EDGE)
    row_bounds = tl.where(band_rows_mask(rows, n0 + offs, n_cols, dlo, dhi, LEFT_EDGE), s, float("-inf"))
    band = tl.where(band_mask(rows, n0 + offs, n_cols, dlo, dhi), s, float("-inf"))
    at = tl.arange(0, ROWS)[:, None] * COLS + offs[None, :]
    tl.store(EDGE + at, edge)
    tl.store(ROW_BOUNDS + at, row_bounds)
    tl.store(BAND + at, band)


# (seqlen_q, seqlen_k, window_left, window_right): causal, causal with more keys than queries
# (bottom-right) and fewer, a sliding window narrower than a block, one-sided windows, no band.
BANDS = [(64, 64, -1, 0), (40, 70, -1, 0), (70, 40, -1, 0), (64, 64, 5, 3), (64, 64, 20, -1),
         (50, 50, -1, -1), (64, 64, 0, 0)]


@pytest.mark.parametrize("seqlen_q,seqlen_k,window_left,window_right", BANDS)
def test_edge_masks_equal_the_band_mask(seqlen_q, seqlen_k, window_left, window_right):
    edge, row_bounds, full = (torch.empty(ROWS, COLS, device=DEVICE) for _ in range(3))
    masked = 0
    # The left edge tested always, and left out where the window has none (as the forward
    # launches it: LEFT_EDGE = window_left >= 0).
    for left_edge in {True, window_left >= 0}:
        for r0, n0 in itertools.product(range(0, seqlen_q, ROWS), range(0, seqlen_k, COLS)):
            _masks[(1,)](edge, row_bounds, full, r0, n0, seqlen_q, seqlen_k, window_left, window_right, ROWS, COLS,
                         left_edge)
            assert torch.equal(edge, full), (r0, n0, left_edge)
            assert torch.equal(row_bounds, full), (r0, n0, left_edge)
            masked += int(torch.isinf(full).any())
    assert masked > 0 or window_left < 0 and window_right < 0  # the edges were tested, not skipped


@triton.jit
def _walk(BH, STEP, num_tiles, batch_heads, head_group, blocks, TILES: tl.constexpr):
    t = tl.arange(0, TILES)
    bh, step = grouped_tile(tl.where(t < num_tiles, t, 0), batch_heads, head_group, blocks)  # tiles that exist
    tl.store(BH + t, bh, mask=t < num_tiles)
    tl.store(STEP + t, step, mask=t < num_tiles)


@pytest.mark.parametrize("batch_heads,blocks,head_group", [(8, 5, 3), (7, 4, 7), (6, 3, 1), (5, 4, 2), (4, 1, 3)])
def test_grouped_walk_takes_every_tile_once_a_group_a_step_at_a_time(batch_heads, blocks, head_group):
    # The tile walk of the Gluon kernels' bands: heads in groups (the last one smaller where
    # head_group does not divide them), a group's tiles one step at a time with its heads adjacent.
    tiles = batch_heads * blocks
    bh, step = (torch.full((tiles,), -1, dtype=torch.int32, device=DEVICE) for _ in range(2))
    _walk[(1,)](bh, step, tiles, batch_heads, head_group, blocks, triton.next_power_of_2(tiles))
    walked = list(zip(bh.tolist(), step.tolist()))
    expected = [(h, s) for first in range(0, batch_heads, head_group) for s in range(blocks)
                for h in range(first, min(first + head_group, batch_heads))]
    assert walked == expected
    assert sorted(walked) == [(h, s) for h in range(batch_heads) for s in range(blocks)]


@pytest.mark.parametrize("sequences_at_a_time", [4, 1024])
@pytest.mark.parametrize("tile_m", [128, 192])
@pytest.mark.parametrize("seqused", [False, True])
def test_packed_tile_list_lists_every_block_with_rows_longest_first(seqused, tile_m, sequences_at_a_time,
                                                                     monkeypatch):
    # One entry sequence * m_blocks + block per query block that holds rows, sequence by
    # sequence, each one's blocks from the last down; the count on the device.  With seqused
    # tables a sequence's rows are its used ones; programs of 4 sequences give the same list.
    monkeypatch.setattr(packed_tiles, "SEQUENCES", sequences_at_a_time)
    slots = [300, 0, 1, 1000, 129, 64, 2100, 255, 256, 7]
    used = [170, 0, 1, 1000, 0, 64, 1999, 255, 129, 7] if seqused else slots
    assert _packed_list(slots, used, max(used), tile_m) == _expected_list(used, max(used), tile_m)


def _packed_list(slots, used, longest, tile_m):
    """packed_tiles.tile_list's entries and count for sequences in ``slots`` rows using ``used``."""
    cu = torch.tensor([0] + slots, device=DEVICE).cumsum(0).to(torch.int32)
    offsets = torch.stack([cu[:-1], cu[:-1] + torch.tensor(used, device=DEVICE, dtype=torch.int32)], 1) \
        if used != slots else cu
    q = torch.empty(sum(slots), 2, 64, device=DEVICE)
    p = Problem.of(q, q, offsets, offsets, longest, longest, 0.1, -1, 0)
    tiles, count = packed_tiles.tile_list(p, tile_m, DEVICE)
    return tiles[:count.item()].tolist(), count.item()


def _expected_list(used, longest, tile_m):
    m_blocks = cdiv(longest, tile_m)
    entries = [b * m_blocks + block for b, n in enumerate(used) for block in reversed(range(min(cdiv(n, tile_m),
                                                                                                 m_blocks)))]
    return entries, len(entries)


def test_packed_tile_list_of_key_blocks():
    # keys=True: the key blocks of each sequence, from its key offsets (the Gluon backward's dK/dV
    # pass), whatever the queries' packing, from its first up (causal key blocks longest first);
    # the longest key sequence bounds the blocks.
    q_lengths, k_lengths = [300, 5, 0, 1000], [40, 700, 129, 0]
    cu_q, cu_k = (torch.tensor([0] + n, device=DEVICE).cumsum(0).to(torch.int32) for n in (q_lengths, k_lengths))
    q = torch.empty(sum(q_lengths), 2, 64, device=DEVICE)
    k = torch.empty(sum(k_lengths), 2, 64, device=DEVICE)
    p = Problem.of(q, k, cu_q, cu_k, max(q_lengths), max(k_lengths), 0.1, -1, 0)
    tiles, count = packed_tiles.tile_list(p, 128, DEVICE, keys=True)
    m_blocks = cdiv(max(k_lengths), 128)
    expected = [b * m_blocks + block for b, n in enumerate(k_lengths) for block in range(cdiv(n, 128))]
    assert (tiles[:count.item()].tolist(), count.item()) == (expected, len(expected))


def test_packed_tile_list_edges(monkeypatch):
    # A declared longest sequence above every one and below some (their blocks past it left out,
    # as every kernel clamps them); no row at all (an empty list); more sequences than a program
    # reads, not a power of two.
    monkeypatch.setattr(packed_tiles, "SEQUENCES", 8)
    lengths = [300, 0, 1, 1000, 129]
    for longest in (1500, 1000, 500):
        assert _packed_list(lengths, lengths, longest, 128) == _expected_list(lengths, longest, 128)
    assert _packed_list([5, 7], [0, 0], 10, 128) == ([], 0)
    many = [(7 * i) % 300 for i in range(37)]
    assert _packed_list(many, many, max(many), 128) == _expected_list(many, max(many), 128)
