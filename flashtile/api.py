"""Public functions with the flash_attn call conventions.

Layout (batch, seqlen, nheads, headdim); varlen (total_tokens, nheads, headdim) with int32
cu_seqlens; causal masks are aligned bottom-right when seqlen_q != seqlen_k; the logsumexp is
float32 in natural log, +inf for rows that see no key (their output is 0).
"""
import torch
import torch.nn.functional as F

from flashtile import dispatch, kept_calls, kvcache, ops, options, reference, validation
from flashtile.kernels import dropout


# Batched calls with no tensor besides q, k, v checked once per kind (kept_calls): the arguments
# ops.attention takes after q, k, v.
_KEPT_CALLS = kept_calls.KeptCalls()


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               window_size, softcap, alibi_slopes, deterministic, return_attn_probs, sinks, version, kernel_options,
               fp8_descales=None, seqused=None):
    """``fp8_descales``: (q_descale, k_descale, v_descale) for float8 q, k, v (forward only; the
    output bf16), as flash_attn_interface passes them; None for fp16 and bf16.  ``seqused``:
    (seqused_q, seqused_k), each None or (batch,) int32, varlen only: the rows of each
    sequence used; the others of the output are 0 (logsumexp +inf) and get no gradient."""
    varlen = cu_seqlens_q is not None
    fp8 = fp8_descales is not None
    given, kind = (q, k, v), None
    # (a dropout call draws a new seed each time: never kept.  A plain dropout_p that passes
    # validation and is not a float above 0 is 0, so a kept kind never draws a seed.)
    if not (torch.compiler.is_compiling() or varlen or fp8 or return_attn_probs or alibi_slopes is not None
            or sinks is not None or (type(dropout_p) is float and dropout_p > 0.0)):
        kind = kept_calls.kind((q, k, v), (dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                                           version, kernel_options))
        kept = _KEPT_CALLS.get(kind)
        if kept is not None:
            ops.check_differentiation_mode(q, k, v)
            return ops.attention(q, k, v, *kept)[0]
    dropout_p, softcap = validation.feature_options(dropout_p, softcap)
    dropout_p = dropout.rate(dropout_p)
    if version not in dispatch.VERSION_CHOICES:
        raise ValueError(f"version must be one of {dispatch.VERSION_CHOICES}, got {version!r}")
    validation.check_qkv(q, k, v, varlen, fp8)
    ops.check_differentiation_mode(q, k, v)
    if varlen:
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = validation.varlen_arguments(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
        used = seqused if seqused is not None else (None, None)
        # Rows after the last sequence (padded buffers, as flash_attn takes them) are unused rows:
        # the used-rows tables, whose other rows get output 0, logsumexp +inf and no gradient.
        # (Not while torch.compile traces: the host read would break the graph, and the
        # attention op's own check refuses such rows.)
        spare = not torch.compiler.is_compiling() and validation.check_offset_values(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0], spare_rows=True)
        if spare or any(x is not None for x in used):
            cu_seqlens_q, cu_seqlens_k = (validation.used_rows(name, rows, cu, q.device) for name, rows, cu in (
                ("seqused_q", used[0], cu_seqlens_q), ("seqused_k", used[1], cu_seqlens_k)))
            if not torch.compiler.is_compiling():  # (made from the offsets just checked)
                validation.trust_row_bounds(cu_seqlens_q, cu_seqlens_k)
    else:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    batch = (cu_seqlens_q.shape[0] if cu_seqlens_q.dim() == 2 else cu_seqlens_q.numel() - 1) if varlen else q.shape[0]
    alibi_slopes = validation.alibi_slopes(alibi_slopes, batch, q.shape[-2], q.device)
    sinks = validation.sinks(sinks, q.shape[-2], q.device)
    opts = options.resolve(kernel_options)
    version = dispatch.resolve_version(version, q.device)
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    fp8_descale = None
    if fp8:
        validation.fp8_takes(version, head_dim, q.device)
        if dropout_p or any(x.requires_grad for x in (q, k, v)):
            raise NotImplementedError("FP8 attention is a forward without dropout (as FlashAttention-3's)")
        if head_dim % 16 or head_dim_v % 16:
            raise ValueError(f"FP8 head dims must be multiples of 16, got {head_dim} and {head_dim_v}")
        fp8_descale = validation.fp8_descales(fp8_descales, batch, k.shape[-2], q.device)
    scale = validation.softmax_scale(softmax_scale, head_dim)
    left, right = validation.band(bool(causal), window_size, max_seqlen_q, max_seqlen_k)
    if version != "tiled":
        validation.check_sequence_span(q, k, v, max_seqlen_q, max_seqlen_k, varlen)
    # Head dims are padded with zeros to a multiple of 8, as flash_attn does; the scale is the
    # one of the true head dim.
    pad, pad_v = (-d % validation.HEAD_DIM_MULTIPLE for d in (head_dim, head_dim_v))
    if pad:
        q, k = (F.pad(x, (0, pad)) for x in (q, k))
    if pad_v:
        v = F.pad(v, (0, pad_v))
    q, k, v = (validation.last_dim_contiguous(x) for x in (q, k, v))
    seed = dropout.new_seed(q.device) if dropout_p else None
    args = (cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, seed, fp8_descale, max_seqlen_q, max_seqlen_k, scale, left,
            right, softcap, dropout_p, version, bool(deterministic), options.text(opts))
    if all(x is y for x, y in zip((q, k, v), given)):
        # (no padding, unit stride along the head dim: the caller's tensors are the kernels')
        _KEPT_CALLS.keep(kind, args)
    out, lse, _ = ops.attention(q, k, v, *args)
    if pad_v:
        out = out[..., :head_dim_v]
    if not return_attn_probs:
        return out
    # flash_attn's third element: with dropout on batched inputs, the probabilities, negative where
    # dropped (for tests: (batch, nheads, seqlen_q, seqlen_k) in memory); else an empty tensor.
    if not dropout_p or varlen:
        return out, lse, out.new_empty(0)
    kept = dropout.kept(seed, q.shape[0], q.shape[2], max_seqlen_q, max_seqlen_k, dropout_p)
    probs = reference.probabilities(q[..., :head_dim], k[..., :head_dim], (left, right), scale, softcap, alibi_slopes,
                                    sinks)
    return out, lse, torch.where(kept, probs, -probs)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    sinks=None, version="auto", kernel_options=None):
    """Exact attention softmax(q k^T * scale) v without materialising the score matrix.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads a multiple of nheads_k (GQA/MQA).  fp16 or bf16, head dim up to 256 (padded to a
    multiple of 8).  window_size=(left, right) limits keys to [i - left, i + right] around the
    aligned diagonal (-1: unbounded).  softcap > 0 caps the scaled scores at softcap * tanh(x /
    softcap) (Gemma 2).  alibi_slopes: float32 (nheads,) or (batch, nheads); adds ALiBi's bias
    -slope * |i + seqlen_k - seqlen_q - j| to the scaled (and capped) scores.  sinks: (nheads,),
    one learnable logit per query head that joins each row's softmax denominator and adds
    nothing to the output (gpt-oss); softmax_lse then includes it.  ``version``: "v1", "v2", "v3",
    "auto" (the best this device runs) or "tiled" (the PyTorch implementation).
    ``deterministic=True`` guarantees bitwise reproducible gradients (v3 then runs its two-pass
    backward rather than the single pass whose dQ reduce-add order varies).  Returns ``out``, or
    ``(out, softmax_lse, S_dmask)`` when ``return_attn_probs``: S_dmask the probabilities,
    negative where dropped, with dropout on batched inputs; otherwise an empty tensor.
    ``kernel_options``: developer switches (options.KernelOptions).
    """
    return _attention(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, sinks, version, kernel_options)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, sinks=None, version="auto",
                              kernel_options=None):
    """qkv: (batch, seqlen, 3, nheads, headdim)."""
    if getattr(qkv, "dim", lambda: 0)() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(getattr(qkv, 'shape', ()))}")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, version=version,
                           kernel_options=kernel_options)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, sinks=None, version="auto",
                             kernel_options=None):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    if getattr(kv, "dim", lambda: 0)() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(getattr(kv, 'shape', ()))}")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, version=version,
                           kernel_options=kernel_options)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, sinks=None, version="auto",
                           kernel_options=None):
    """Sequences of different lengths packed along the token dim.

    q: (total_q, nheads, headdim), k/v: (total_k, nheads_k, headdim); cu_seqlens_*: int32
    (batch + 1,) offsets; max_seqlen_*: at least the longest sequence.  softmax_lse is
    (nheads, total_q).  Rows after cu_seqlens_*[-1] (padded buffers) belong to no sequence: their
    output is 0, their logsumexp +inf, and they get no gradient (refused while torch.compile
    traces: that would read the offsets on the host).  The offsets' values are checked
    on the host (one device-to-host copy), except while a CUDA graph is being captured, where the
    kernels clamp them to the tensors and such rows are left as they are.  ``block_table``
    (batch, max_blocks) int32, flash_attn's paged K/V: k and v are (num_blocks, page_size,
    nheads_k, headdim) pages, sequence b's keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b]
    rows of its pages in order; read in place by flash_attn_with_kvcache's kernels where no
    gradient, dropout or sinks are asked for, else gathered into a packed copy before the call
    (gradients flow back to the pages).
    """
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k are required for flash_attn_varlen_func")
    if block_table is not None:
        # Inference (no gradient, dropout or sinks): the pages read in place by the split-KV kernels.
        if kvcache.reads_pages_in_place(q, k, v, dropout_p, sinks, alibi_slopes):
            attended = kvcache.paged_varlen_attention(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                      max_seqlen_k, softmax_scale, causal, window_size, softcap,
                                                      alibi_slopes, version, kernel_options)
            if attended is not None:
                return (*attended, attended[0].new_empty(0)) if return_attn_probs else attended[0]
        k, v = kvcache.paged_varlen_keys(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, sinks, version,
                      kernel_options)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, sinks=None, version="auto", kernel_options=None):
    """qkv: (total_tokens, 3, nheads, headdim); one offsets table for queries and keys."""
    if getattr(qkv, "dim", lambda: 0)() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (total_tokens, 3, nheads, headdim), got {tuple(getattr(qkv, 'shape', ()))}")
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  sinks=sinks, version=version, kernel_options=kernel_options)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None,
                                    version="auto", kernel_options=None):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    if getattr(kv, "dim", lambda: 0)() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must be (total_k, 2, nheads_k, headdim), got {tuple(getattr(kv, 'shape', ()))}")
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, version=version, kernel_options=kernel_options)
