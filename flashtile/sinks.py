"""Attention sinks: a learnable logit per head that joins every row's softmax denominator.

With sink ``s_h`` (natural log, not scaled) row i's probabilities are ``exp(x_ij - lse_i)`` with
``lse_i = log(exp(s_h) + sum_j exp(x_ij))``: the sink takes its share of the mass and adds
nothing to the output (gpt-oss's form).  That is the kernels' result rescaled, whichever kernel
ran: ``join`` turns a forward's (out, lse) without the sink into the ones with it, and the
backward kernels, given those, recompute the right probabilities from ``lse``, so dQ, dK and dV
need nothing more; the sink's own gradient is ``gradient``'s reduction.

Both are one pass over the output rows: a Triton kernel wherever Triton runs (a GPU, or the
interpreter), PyTorch operations otherwise.
"""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from flashtile import options
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import cdiv, next_power_of_2
from flashtile.kernels.tiles import LOG2E, row_delta


def _per_row(varlen, sinks):
    """``sinks`` (heads,) shaped to broadcast against the logsumexp: (b, h, sq) or varlen (h, total_q)."""
    return sinks.float().view(-1, 1) if varlen else sinks.float().view(1, -1, 1)


def _as_output_rows(varlen, x):
    """A logsumexp-shaped tensor laid out as the output's rows: (b, sq, h, 1) or varlen (total_q, h, 1)."""
    return (x.transpose(0, 1) if varlen else x.transpose(1, 2))[..., None]


def _batched(varlen, rows, lse):
    """Output-shaped rows as (b, s, h, d) and the logsumexp as (b, h, s): varlen as one batch."""
    return (rows[None], lse[None]) if varlen else (rows, lse)


def _on_triton(x):
    return x.is_cuda or options.interpreting()


@triton.jit
def _join_kernel(OUT, LSE, SINKS, JOINED, seqlen, head_dim, sob, sos, soh, slb, slh,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [pid*BLOCK_S, +BLOCK_S) of one (batch, head): out *= exp(lse - joined), joined =
    logaddexp(lse, sink); a row that saw no key (lse +inf, out 0) gets its sink as lse.  A row
    left with no mass (no key and sink -inf) or whose sink takes all of it (+inf) gets out 0 and
    lse +inf, as a row without keys."""
    s0 = tl.program_id(0) * BLOCK_S
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rows = s0 + tl.arange(0, BLOCK_S)
    in_seq = rows < seqlen
    lse_ptrs = LSE + batch * slb + head * slh + rows
    lse = tl.load(lse_ptrs, mask=in_seq, other=0.0)
    sink = tl.load(SINKS + head).to(tl.float32)
    empty = lse == float("inf")
    top = tl.where(empty, sink, tl.maximum(lse, sink))
    below = tl.where(empty, 0.0, tl.exp2((lse - top) * LOG2E))
    total = below + tl.exp2((sink - top) * LOG2E)
    no_mass = tl.abs(top) == float("inf")  # (no key and sink -inf, or sink +inf)
    joined = tl.where(no_mass, float("inf"), top + tl.log2(total) / LOG2E)
    tl.store(JOINED + batch * slb + head * slh + rows, joined, mask=in_seq)
    factor = tl.where(no_mass, 0.0, below / total)
    cols = tl.arange(0, BLOCK_D)
    ptrs = OUT + batch * sob + head * soh + rows.to(tl.int64)[:, None] * sos + cols[None, :]
    mask = in_seq[:, None] & (cols[None, :] < head_dim)
    out = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (out * factor[:, None]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _share_kernel(OUT, DOUT, LSE, DLSE, SINKS, SHARE, seqlen, head_dim, sob, sos, soh, sdb, sds, sdh, slb, slh,
                  HAS_DLSE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per row: P_sink * D, with P_sink = exp(sink - lse) (1 for a sink of +inf, which takes
    every row's mass) and D = rowsum(dO * O) - dlse."""
    s0 = tl.program_id(0) * BLOCK_S
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rows = s0 + tl.arange(0, BLOCK_S)
    in_seq = rows < seqlen
    cols = tl.arange(0, BLOCK_D)
    mask = in_seq[:, None] & (cols[None, :] < head_dim)
    r64 = rows.to(tl.int64)[:, None]
    out = tl.load(OUT + batch * sob + head * soh + r64 * sos + cols[None, :], mask=mask, other=0.0)
    dout = tl.load(DOUT + batch * sdb + head * sdh + r64 * sds + cols[None, :], mask=mask, other=0.0)
    stat = batch * slb + head * slh + rows
    delta = row_delta(out, dout, DLSE, stat, rows, seqlen, HAS_DLSE)
    lse = tl.load(LSE + stat, mask=in_seq, other=float("inf"))
    sink = tl.load(SINKS + head).to(tl.float32)
    share = tl.where(sink == float("inf"), 1.0, tl.exp2((sink - lse) * LOG2E))
    tl.store(SHARE + stat, share * delta, mask=in_seq)


def tiles(head_dim):
    """(BLOCK_S, BLOCK_D) of both kernels: a row of the head dim, up to 8192 elements a program."""
    block_d = next_power_of_2(head_dim)
    return max(1, min(64, 8192 // block_d)), block_d


def _grid_and_blocks(rows, head_dim):
    block_s, block_d = tiles(head_dim)
    b, s, h, _ = rows.shape
    return (cdiv(s, block_s), h, b), block_s, block_d


def join(varlen, out, lse, saved, sinks):
    """(out, lse, saved) of a forward without the sinks turned into those with them.  A row that
    sees no key (lse +inf, out 0) keeps out 0 and gets lse = its sink; one with no mass left (no
    key, sink -inf) or a sink of +inf gets out 0 and lse +inf.  ``saved`` holding a
    running max and row sum (v1's m and l, base 2) becomes the same statistics of the new lse.
    ``out`` is rescaled in place."""
    if _on_triton(out) and out.numel():
        rows, stats = _batched(varlen, out, lse)
        joined = torch.empty_like(lse)
        grid, block_s, block_d = _grid_and_blocks(rows, rows.shape[-1])
        launch(_join_kernel, grid, rows, stats, sinks, _batched(varlen, out, joined)[1], rows.shape[1],
               rows.shape[-1], rows.stride(0), rows.stride(1), rows.stride(2), stats.stride(0), stats.stride(1),
               BLOCK_S=block_s, BLOCK_D=block_d)
    else:
        base = torch.where(lse == float("inf"), float("-inf"), lse)
        joined = torch.logaddexp(base, _per_row(varlen, sinks))
        joined = torch.where(joined == float("-inf"), float("inf"), joined)  # (no mass at all)
        out = (out.float() * _as_output_rows(varlen, torch.exp(base - joined))).to(out.dtype)
    if saved.numel():
        saved = torch.stack([joined * (1 / math.log(2.0)), torch.ones_like(joined)])
    return out, joined, saved


def gradient(varlen, sinks, out, lse, dout, dlse):
    """d loss / d sinks: -sum over rows of P_sink * D, with P_sink = exp(sink - lse) and
    D = rowsum(dO * O) - dlse (the softmax's gradient at a column whose value is 0)."""
    return _gradient(sinks, out, lse, dout, dlse, varlen)


@torch.library.custom_op("flashtile::sinks_gradient", mutates_args=())
def _gradient(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
              dlse: Optional[torch.Tensor], varlen: bool) -> torch.Tensor:
    # An operator of its own: the backward formula is traced (torch.compile), the kernel is not.
    if _on_triton(out) and out.numel():
        rows, stats = _batched(varlen, out, lse)
        drows = _batched(varlen, dout, lse)[0]
        share = torch.empty_like(lse)
        grid, block_s, block_d = _grid_and_blocks(rows, rows.shape[-1])
        launch(_share_kernel, grid, rows, drows, stats, stats if dlse is None else _batched(varlen, out, dlse)[1],
               sinks, _batched(varlen, out, share)[1], rows.shape[1], rows.shape[-1], rows.stride(0),
               rows.stride(1), rows.stride(2), drows.stride(0), drows.stride(1), drows.stride(2),
               stats.stride(0), stats.stride(1), HAS_DLSE=dlse is not None, BLOCK_S=block_s, BLOCK_D=block_d)
    else:
        products = (dout.float() * out.float()).sum(-1)
        delta = products.transpose(0, 1) if varlen else products.transpose(1, 2)
        if dlse is not None:
            delta = delta - dlse
        sink = _per_row(varlen, sinks)
        share = torch.where(sink == float("inf"), 1.0, torch.exp(sink - lse)) * delta
    return -(share.sum(-1) if varlen else share.sum((0, 2))).to(sinks.dtype)


@_gradient.register_fake
def _(sinks, out, lse, dout, dlse, varlen):
    return torch.empty_like(sinks)
