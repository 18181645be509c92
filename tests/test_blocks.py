"""The band's element masks: band_edge_masks (the Gluon forward's, testing only the edges a block
crosses, with and without the left one) and band_rows_mask (the Gluon backward's) against
band_mask (every rule at once), over blocks on and off the band's edges."""
import itertools

import pytest
import torch
import triton
import triton.language as tl

from flashtile.kernels.blocks import band_edge_masks, band_mask, band_rows_mask, diagonal_band
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
