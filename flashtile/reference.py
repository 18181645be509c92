"""Standard attention: the textbook algorithm that materialises the (seqlen_q x seqlen_k) scores.

It is the baseline of every speed and memory claim, and with ``upcast=True`` (float64) the
oracle every kernel is tested against.
"""
import math

import torch

from flashtile import validation
from flashtile.kernels import score


def band_mask(seqlen_q, seqlen_k, window_left=-1, window_right=-1, device=None,
              rows=None, cols=None):
    """Bool (rows x cols): key c visible from query r, aligned bottom-right like flash_attn.

    Visible when ``off - window_left <= c - r <= off + window_right`` with
    ``off = seqlen_k - seqlen_q``; a negative window side is unbounded.  Causal is
    ``window_right = 0``.  ``rows``/``cols`` (ranges) select a block; by default the whole
    matrix.  The kernels implement the same rule in kernels/blocks.py.
    """
    r = torch.arange(seqlen_q, device=device)[rows or slice(None), None]
    c = torch.arange(seqlen_k, device=device)[None, cols or slice(None)]
    diff = c - r - (seqlen_k - seqlen_q)
    visible = torch.ones(r.shape[0], c.shape[1], dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= diff >= -window_left
    if window_right >= 0:
        visible &= diff <= window_right
    return visible


def _scores(q, k, left, right, scale, softcap, alibi_slopes):
    """Scores (batch, nheads, seqlen_q, seqlen_k) in q's dtype, -inf outside the band.  K is
    repeated over its query heads (GQA)."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k * scale)
    bias = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)
        bias = score.alibi_bias(slopes if slopes.dim() == 2 else slopes[None], q.shape[1], k.shape[1])
    scores = score.reference(scores, softcap, bias)
    visible = None
    if left >= 0 or right >= 0:
        visible = band_mask(q.shape[1], k.shape[1], left, right, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _dropped(probs, dropout_mask, dropout_p):
    """Probabilities with dropout applied: kept ones scaled by 1 / (1 - p), the others 0."""
    if dropout_mask is None:
        return probs
    return probs * dropout_mask.to(probs.dtype) / (1.0 - dropout_p)


def probabilities(q, k, band, softmax_scale, softcap=0.0, alibi_slopes=None, sinks=None):
    """The softmax probabilities, float32 (batch, nheads, seqlen_q, seqlen_k), ``band`` the
    (window_left, window_right) of validation.band; rows that see no key are 0.  The scores are
    float32's, as the kernels form them (in fp16 they could overflow)."""
    scores = _scores(q.float(), k.float(), *band, softmax_scale, softcap, alibi_slopes)
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1].nan_to_num(0.0)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


def standard_attention(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None,
                       upcast=False, return_lse=False, softcap=0.0, alibi_slopes=None, sinks=None,
                       dropout_mask=None, dropout_p=0.0):
    """softmax(Q K^T * scale) V with the full score matrix in memory.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim) with
    nheads a multiple of nheads_k (GQA/MQA).  With ``upcast=False`` it is what a plain PyTorch
    program does, in the input dtype: scores = Q K^T, masked, ``torch.softmax`` (fp32 inside,
    input dtype out), probabilities @ V.  With ``upcast=True`` everything runs in float64 and
    the float64 result is returned.  Rows that see no key give 0 (and logsumexp +inf).
    ``softcap`` > 0 replaces the scaled scores x by softcap * tanh(x / softcap); ``alibi_slopes``
    (float32, (nheads,) or (batch, nheads)) then adds -slope * |i + seqlen_k - seqlen_q - j|.
    ``sinks`` (nheads,): one more logit per row, of value zero, in the softmax (the lse includes it).
    ``dropout_mask`` (batch, nheads, seqlen_q, seqlen_k) bool: the probabilities kept, scaled by
    1 / (1 - dropout_p) (the lse is the one before dropout).
    Returns ``out`` or ``(out, lse)`` with lse (batch, nheads, seqlen_q).
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    v = v.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    left, right = validation.band(causal, window_size, q.shape[1], k.shape[1])
    scores = _scores(q, k, left, right, scale, softcap, alibi_slopes)
    sink = None if sinks is None else sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
    if not (upcast or return_lse):
        if sink is not None:  # a column of its own, dropped after the softmax
            probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        # Query r sees keys up to r + (seqlen_k - seqlen_q) + right, so the first rows see none
        # when seqlen_q > seqlen_k + right: their softmax of -inf is NaN, and their output is 0.
        if sink is None and right >= 0 and q.shape[1] > k.shape[1] + right:
            probs = probs.nan_to_num(0.0)
        return torch.einsum("bhqk,bkhd->bqhd", _dropped(probs, dropout_mask, dropout_p), v)
    s = scores.to(torch.float64 if upcast else torch.float32)
    # No key at all (seqlen_k 0): no max to take, every row's output 0 and logsumexp +inf.
    m = s.amax(dim=-1, keepdim=True).detach() if s.shape[-1] else s.new_full((*s.shape[:-1], 1), float("-inf"))
    if sink is not None:
        m = torch.maximum(m, sink.to(s.dtype).detach())
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        l = l + torch.exp(sink.to(s.dtype) - m)
    probs = e / torch.where(l == 0, torch.ones_like(l), l)
    out = torch.einsum("bhqk,bkhd->bqhd", _dropped(probs, dropout_mask, dropout_p).to(v.dtype), v)
    if not return_lse:
        return out
    lse = torch.where(l == 0, torch.full_like(l, float("inf")), torch.log(l) + m).squeeze(-1)
    return out, lse.float()
