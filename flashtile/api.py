"""Public functions with the flash_attn call conventions.

Layout (batch, seqlen, nheads, headdim); varlen (total_tokens, nheads, headdim) with int32
cu_seqlens; causal masks are aligned bottom-right when seqlen_q != seqlen_k; the logsumexp is
float32 in natural log, +inf for rows that see no key (their output is 0).
"""
import math

from flashtile import ops, runtime
from flashtile.reference import window_bounds
from flashtile.validation import (check_cu_seqlens, check_options, check_qkv, check_sequence_span,
                                  last_dim_contiguous)


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
               version):
    varlen = cu_seqlens_q is not None
    check_options(dropout_p, softcap, alibi_slopes, window_size, softmax_scale, version)
    check_qkv(q, k, v, varlen)
    if varlen:
        check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    else:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    version = runtime.resolve_version(version, q.device)
    if version != "tiled":
        check_sequence_span(q, k, v, max_seqlen_q, max_seqlen_k, varlen)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    left, right = window_bounds(causal, window_size)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    out, lse, _ = ops.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, scale, left, right, version, bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    version="auto"):
    """Exact attention softmax(q k^T * scale) v without materialising the score matrix.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads a multiple of nheads_k (GQA/MQA).  fp16 or bf16, head dim a multiple of 8 up to 256.
    window_size=(left, right) limits keys to [i - left, i + right] around the aligned
    diagonal (-1: unbounded).  ``version``: "v1", "v2", "v3", "auto" (the best this device
    runs) or "tiled" (the PyTorch implementation).  ``deterministic=True`` guarantees bitwise
    reproducible gradients: v3 then runs a two-pass backward instead of the single pass that
    adds dQ by TMA reduce-add (its default at head dims 64 and 128 on long keys, as
    FlashAttention-3's), whose summation order varies from run to run; the other backwards are
    reproducible anyway.  Returns ``out``, or
    ``(out, softmax_lse, None)`` when ``return_attn_probs``.
    """
    return _attention(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, deterministic, return_attn_probs, version)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, version="auto"):
    """qkv: (batch, seqlen, 3, nheads, headdim)."""
    if getattr(qkv, "dim", lambda: 0)() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(getattr(qkv, 'shape', ()))}")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, version=version)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, version="auto"):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    if getattr(kv, "dim", lambda: 0)() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(getattr(kv, 'shape', ()))}")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, version=version)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, *, version="auto"):
    """Sequences of different lengths packed along the token dim.

    q: (total_q, nheads, headdim), k/v: (total_k, nheads_k, headdim); cu_seqlens_*: int32
    (batch + 1,) offsets.  softmax_lse is (nheads, total_q).
    """
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k are required for flash_attn_varlen_func")
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                      version)
