"""Attention sinks: a learnable logit per head that joins every row's softmax denominator.

With sink ``s_h`` (natural log, not scaled) row i's probabilities are ``exp(x_ij - lse_i)`` with
``lse_i = log(exp(s_h) + sum_j exp(x_ij))``: the sink takes its share of the mass and adds
nothing to the output (gpt-oss's form).  That is the kernels' result rescaled, whichever kernel
ran: ``join`` turns a forward's (out, lse) without the sink into the ones with it, and the
backward kernels, given those, recompute the right probabilities from ``lse``, so dQ, dK and dV
need nothing more; the sink's own gradient is ``gradient``'s reduction.
"""
import math

import torch


def _per_row(varlen, sinks):
    """``sinks`` (heads,) shaped to broadcast against the logsumexp: (b, h, sq) or varlen (h, total_q)."""
    return sinks.float().view(-1, 1) if varlen else sinks.float().view(1, -1, 1)


def _as_output_rows(varlen, x):
    """A logsumexp-shaped tensor laid out as the output's rows: (b, sq, h, 1) or varlen (total_q, h, 1)."""
    return (x.transpose(0, 1) if varlen else x.transpose(1, 2))[..., None]


def join(varlen, out, lse, saved, sinks):
    """(out, lse, saved) of a forward without the sinks turned into those with them.  A row that
    sees no key (lse +inf, out 0) keeps out 0 and gets lse = its sink.  ``saved`` holding a
    running max and row sum (v1's m and l, base 2) becomes the same statistics of the new lse."""
    base = torch.where(lse == float("inf"), float("-inf"), lse)
    joined = torch.logaddexp(base, _per_row(varlen, sinks))
    out = (out.float() * _as_output_rows(varlen, torch.exp(base - joined))).to(out.dtype)
    if saved.numel():
        saved = torch.stack([joined * (1 / math.log(2.0)), torch.ones_like(joined)])
    return out, joined, saved


def gradient(varlen, sinks, out, lse, dout, dlse):
    """d loss / d sinks: -sum over rows of P_sink * D, with P_sink = exp(sink - lse) and
    D = rowsum(dO * O) - dlse (the softmax's gradient at a column whose value is 0)."""
    rows = (dout.float() * out.float()).sum(-1)
    delta = rows.transpose(0, 1) if varlen else rows.transpose(1, 2)
    if dlse is not None:
        delta = delta - dlse
    share = torch.exp(_per_row(varlen, sinks) - lse) * delta
    return -(share.sum(-1) if varlen else share.sum((0, 2))).to(sinks.dtype)
