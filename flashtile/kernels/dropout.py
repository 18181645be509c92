"""Attention dropout: which probabilities are kept, from a counter-based RNG (Philox).

Probability (r, c) of query head h in sequence b is kept when ``tl.rand(seed, counter) >=
dropout_p`` and then scaled by 1 / (1 - dropout_p), with counter
``((b * heads_q + h) * seqlen_q + r) * seqlen_k + c`` (the problem's longest lengths: every
score has its own counter, whatever the sequences' lengths).  Nothing is stored: the backward
draws the same numbers from the same seed.  The seed is a one-element int64 tensor on the
device, drawn from torch's generator (``new_seed``): ``torch.manual_seed`` reproduces a run, a
CUDA graph replays the draw, and no value crosses to the host.
"""
import torch
import triton
import triton.language as tl

from flashtile.kernels.launch import launch


@triton.jit
def stream(batch, head, heads_q, seqlen_q, seqlen_k):
    """The first counter of (sequence ``batch``, query head ``head``)."""
    return (batch.to(tl.int64) * heads_q + head) * seqlen_q * seqlen_k


@triton.jit
def kept_scale(seed, first, q_rows, k_cols, seqlen_k, dropout_p):
    """1 / (1 - dropout_p) where score (q_rows, k_cols) is kept, else 0; the two index tensors
    broadcast to the tile (rows[:, None] and cols[None, :], or the transpose)."""
    counters = first + q_rows.to(tl.int64) * seqlen_k + k_cols
    kept = tl.rand(seed, counters) >= dropout_p
    return tl.where(kept, 1.0 / (1.0 - dropout_p), 0.0)


@triton.jit
def _kept_kernel(SEED, KEPT, heads_q, seqlen_q, seqlen_k, dropout_p, BLOCK: tl.constexpr):
    """KEPT (batch, heads_q, seqlen_q, seqlen_k) int8: 1 where kept (rows of one (b, h) per program row)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    first = stream(bh // heads_q, bh % heads_q, heads_q, seqlen_q, seqlen_k)
    seed = tl.load(SEED)
    for c0 in range(0, seqlen_k, BLOCK):
        scale = kept_scale(seed, first, rows[:, None], c0 + cols[None, :], seqlen_k, dropout_p)
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
        launch(_kept_kernel, (triton.cdiv(seqlen_q, block), batch * heads_q), seed, out, heads_q, seqlen_q, seqlen_k,
               dropout_p, BLOCK=block)
    return out.bool()
