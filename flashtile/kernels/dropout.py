"""Attention dropout: which probabilities are kept, from a counter-based RNG (Philox).

One Philox-4x32-10 call gives 128 bits, eight 16-bit numbers: the numbers of keys 8g .. 8g + 7
of one query row, key 8g + i taking half i % 2 of word i // 2.  The call for key group g of row
r of query head h in sequence b has the counter (g, r, b * heads_q + h, 0) and the seed as its
key, so every score has its own number, whatever the tiles or the sequences' lengths.  A score
is kept when its number is at least round(dropout_p * 2**16) (dropout_p rounded to a multiple of
2**-16) and then scaled by 1 / (1 - dropout_p).  Nothing is stored: the backward draws the same
numbers from the same seed.  The seed is a one-element int64 tensor on the device, drawn from
torch's generator (``new_seed``): ``torch.manual_seed`` reproduces a run, a CUDA graph replays
the draw, and no value crosses to the host.
"""
import torch
import triton
import triton.language as tl

from flashtile.kernels.launch import launch
from flashtile.kernels.problem import cdiv

KEYS_PER_CALL = tl.constexpr(8)


@triton.jit
def _halves_kept(word, threshold):
    """(low half >= threshold, high half >= threshold) of ``word``, joined along a new last axis."""
    return tl.join(((word & 0xFFFF) >= threshold).to(tl.int8), ((word >> 16) >= threshold).to(tl.int8))


@triton.jit
def kept_scale(seed, stream, rows, col0, dropout_p, BLOCK_COLS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """1 / (1 - dropout_p) where score (row, col) of ``stream`` (sequence * heads_q + query head)
    is kept, else 0: a (len(rows), BLOCK_COLS) tile for the keys col0 .. col0 + BLOCK_COLS - 1
    (col0 a multiple of 8), or its transpose."""
    groups = col0 // KEYS_PER_CALL + tl.arange(0, BLOCK_COLS // KEYS_PER_CALL)
    zero = (rows[:, None] * 0 + groups[None, :] * 0).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, zero + groups[None, :].to(tl.uint32), zero + rows[:, None].to(tl.uint32),
                               zero + stream.to(tl.uint32), zero)
    threshold = tl.cast(dropout_p * 65536.0 + 0.5, tl.uint32)
    kept = tl.join(tl.join(_halves_kept(w0, threshold), _halves_kept(w1, threshold)),
                   tl.join(_halves_kept(w2, threshold), _halves_kept(w3, threshold)))
    # (rows, groups, word // 2, word % 2, half): key 8g + i is word i // 2, half i % 2.
    kept = tl.reshape(kept, (rows.shape[0], BLOCK_COLS))
    scale = tl.where(kept != 0, 1.0 / (1.0 - dropout_p), 0.0)
    if TRANSPOSED:
        scale = tl.trans(scale)
    return scale


@triton.jit
def _kept_kernel(SEED, KEPT, heads_q, seqlen_q, seqlen_k, dropout_p, BLOCK: tl.constexpr):
    """KEPT (batch, heads_q, seqlen_q, seqlen_k) int8: 1 where kept (rows of one (b, h) per program row)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    seed = tl.load(SEED)
    first = bh.to(tl.int64) * seqlen_q * seqlen_k
    for c0 in range(0, seqlen_k, BLOCK):
        scale = kept_scale(seed, bh, rows, c0, dropout_p, BLOCK, False)
        inside = (rows[:, None] < seqlen_q) & (c0 + cols[None, :] < seqlen_k)
        tl.store(KEPT + first + rows[:, None].to(tl.int64) * seqlen_k + c0 + cols[None, :], (scale > 0).to(tl.int8),
                 mask=inside)


def new_seed(device) -> torch.Tensor:
    """A fresh seed from torch's generator for ``device``, as a one-element int64 tensor there."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def kept(seed, batch, heads_q, seqlen_q, seqlen_k, dropout_p) -> torch.Tensor:
    """Bool (batch, heads_q, seqlen_q, seqlen_k): the probabilities the kernels keep under ``seed``."""
    out = torch.empty(batch, heads_q, seqlen_q, seqlen_k, dtype=torch.int8, device=seed.device)
    block = 16
    if out.numel():
        launch(_kept_kernel, (cdiv(seqlen_q, block), batch * heads_q), seed, out, heads_q, seqlen_q, seqlen_k,
               dropout_p, BLOCK=block)
    return out.bool()
