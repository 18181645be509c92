"""FlashAttention-3's Python interface (``flash_attn_interface``), served by flashtile.

Code written for FA3 runs unchanged with ``from flashtile.flash_attn_interface import ...``:
the same signatures, returning ``out``, or ``(out, softmax_lse)`` with ``return_attn_probs``;
a row that sees no key has logsumexp -inf, as FA3's (flashtile's own functions follow
FlashAttention-2: +inf).
FA3's tuning hints (``num_splits``, ``pack_gqa``, ``sm_margin``) are accepted and leave the
choice to flashtile's dispatcher; ``attention_chunk`` (Llama 4's chunked attention) runs
through chunks.py, forward and backward; ``qv`` is refused by name.  ``flash_attn_with_kvcache``
is flashtile's, its ``page_table`` the block table, ``cu_seqlens_q`` packed queries
(``attention_chunk`` there: decoding steps).  ``seqused_q`` / ``seqused_k`` (batch,) int32: the
rows of each varlen sequence used; the output's other rows are 0.

FP8, as FA3 has it: q, k, v in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` with float32
``q_descale``, ``k_descale``, ``v_descale`` of shape (batch, nheads_k) (None: 1), the output
bf16, forward only.
"""
import functools

import torch

from flashtile import api, chunks, kvcache, validation


def _fa3_lse(lse):
    """flashtile's logsumexp with FA3's value for a row that sees no key: -inf (FlashAttention-2
    and flashtile give +inf), so merging partial results by logsumexp leaves such a row out."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descales, softmax_scale, causal,
               window_size, softcap, deterministic, return_attn_probs, seqused=None, attention_chunk=0):
    """flashtile's attention, FP8 where q is float8 (descales apply to nothing else), in chunks
    of ``attention_chunk`` keys if it is not 0 (chunks.py); the lse in FA3's convention."""
    fp8 = getattr(q, "dtype", None) in validation.FP8_DTYPES
    if not fp8 and any(x is not None for x in descales):
        raise ValueError("q_descale, k_descale and v_descale apply to float8 q, k, v only")
    chunk = chunks.check(attention_chunk)

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descales, lse=return_attn_probs):
        res = api._attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale,
                             causal, window_size, softcap, None, deterministic, lse, None, "auto", None,
                             fp8_descales=descales if fp8 else None, seqused=seqused)
        return res[:2] if lse else res

    if not chunk:
        res = run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descales)
        return (res[0], _fa3_lse(res[1])) if return_attn_probs else res
    if seqused is not None and any(x is not None for x in seqused):
        raise NotImplementedError("attention_chunk with seqused_q / seqused_k is not supported")
    validation.check_qkv(q, k, v, cu_seqlens_q is not None, fp8)
    if cu_seqlens_q is not None:  # checked before the pieces are cut from them
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = validation.varlen_arguments(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
        if not torch.compiler.is_compiling():  # (traced: the pieces' own check, in the attention op)
            validation.check_offset_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0],
                                           k.shape[0], spare_rows=True)
    if fp8:  # (expanded to the pieces: checked first)
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
        validation.fp8_descales(descales, batch, k.shape[-2], q.device)
    out, lse = chunks.attend(functools.partial(run, lse=True), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, chunk, descales)
    return (out, _fa3_lse(lse)) if return_attn_probs else out


def _refuse_unsupported(**given):
    for name, value in given.items():
        if value is not None:
            raise NotImplementedError(f"{name} is not supported by flashtile's FlashAttention-3 interface yet")


def _hints(num_splits, pack_gqa, sm_margin):
    """FA3's tuning hints, checked for type and otherwise left to the dispatcher."""
    validation.integer("num_splits", num_splits, minimum=0)
    validation.integer("sm_margin", sm_margin, minimum=0)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None or a bool, got {pack_gqa!r}")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)."""
    _refuse_unsupported(qv=qv)
    _hints(num_splits, pack_gqa, sm_margin)
    return _attention(q, k, v, None, None, None, None, (q_descale, k_descale, v_descale), softmax_scale, causal,
                      window_size, softcap, deterministic, return_attn_probs, attention_chunk=attention_chunk)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim), or with ``num_heads_q`` (batch, seqlen,
    nheads_q + 2 * nheads_k, headdim): the query heads, then K's, then V's (GQA).  Float8 as
    flash_attn_func takes it."""
    validation.integer("sm_margin", sm_margin, minimum=0)
    validation.check_tensor("qkv", qkv)
    if num_heads_q is None or qkv.dim() == 5:  # (FA3 reads num_heads_q of the 4-D form only)
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(2)
    else:
        heads_q = validation.integer("num_heads_q", num_heads_q, minimum=1)
        heads_k, odd = divmod(qkv.shape[2] - heads_q, 2) if qkv.dim() == 4 else (0, 0)
        if qkv.dim() != 4 or odd or heads_k < 1:
            raise ValueError(f"with num_heads_q={heads_q}, qkv must be (batch, seqlen, num_heads_q + 2 * nheads_k, "
                             f"headdim), got {tuple(qkv.shape)}")
        q, k, v = qkv.split([heads_q, heads_k, heads_k], dim=2)
    return _attention(q, k, v, None, None, None, None, (q_descale, k_descale, v_descale), softmax_scale, causal,
                      window_size, softcap, deterministic, return_attn_probs, attention_chunk=attention_chunk)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                           num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); int32 offsets."""
    _refuse_unsupported(qv=qv)
    _hints(num_splits, pack_gqa, sm_margin)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, (q_descale, k_descale, v_descale),
                      softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                      (seqused_q, seqused_k), attention_chunk)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FA3's attention over a KV cache: flashtile.flash_attn_with_kvcache, ``page_table`` its
    ``block_table``, queries of varying counts packed by ``cu_seqlens_q`` and ``max_seqlen_q``,
    new keys of varying counts by ``cu_seqlens_k_new`` (ignored without k, as FA3 ignores it),
    rotary positions from ``rotary_seqlens`` (ignored without rotary tables, likewise).  ``qv``
    and float8 descales are refused by name; ``scheduler_metadata`` is get_scheduler_metadata's
    None.
    ``attention_chunk`` takes one query token per sequence (decoding): each sequence's keys
    start at its chunk (chunks.cache_starts).  Returns out, or as FA3 (out, softmax_lse,
    out_accum, softmax_lse_accum), the split accumulators None (not kept)."""
    _refuse_unsupported(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                        scheduler_metadata=scheduler_metadata)
    _hints(num_splits, pack_gqa, sm_margin)
    chunk = chunks.check(attention_chunk)
    if chunk:
        cache_leftpad = chunks.cache_starts(q, k_cache, k, cache_seqlens, cache_leftpad, page_table, chunk,
                                            cu_seqlens_k_new)
    res = kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                          cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                          window_size, softcap, rotary_interleaved, None, num_splits,
                                          return_softmax_lse, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                          cu_seqlens_k_new=cu_seqlens_k_new if k is not None else None,
                                          rotary_seqlens=rotary_seqlens if rotary_cos is not None else None)
    return (res[0], _fa3_lse(res[1]), None, None) if return_softmax_lse else res


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    """FA3's precomputed split schedule: None, which flash_attn_with_kvcache takes (flashtile
    plans each call's splits itself, remembered per shape).  The hints are checked as there."""
    _hints(num_splits, pack_gqa, sm_margin)
    chunks.check(attention_chunk)
    return None


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FA3's merge of split attention results: out_partial (num_splits, batch, seqlen, nheads,
    headdim) and lse_partial (num_splits, batch, seqlen, nheads), both float32, each split's
    output normalised over its keys and its logsumexp (-inf: no key, its output not read).
    Returns (out (batch, seqlen, nheads, headdim) in ``out_dtype`` (default float32; written into
    ``out`` where given, of that dtype), softmax_lse (batch, seqlen, nheads) float32, as FA3's a
    view of a (batch, nheads, seqlen) tensor); a row no split saw gives 0 and -inf."""
    for name, x, dims in (("out_partial", out_partial, 5), ("lse_partial", lse_partial, 4)):
        validation.check_tensor(name, x)
        if x.dtype != torch.float32 or x.dim() != dims:
            raise TypeError(f"{name} must be a {dims}-D float32 tensor, got {x.dim()}-D {x.dtype}")
    if lse_partial.shape != out_partial.shape[:4] or lse_partial.device != out_partial.device \
            or out_partial.shape[0] == 0:
        raise ValueError(f"lse_partial must be out_partial's (num_splits >= 1, batch, seqlen, nheads) on its device, "
                         f"got {tuple(lse_partial.shape)} against {tuple(out_partial.shape)}")
    out_dtype = out_dtype or torch.float32
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be torch.float32, bfloat16 or float16, got {out_dtype}")
    top = lse_partial.amax(0)
    top = torch.where(top.isfinite(), top, 0.0)  # (no split with a key: every weight 0)
    weights = torch.exp(lse_partial - top)
    total = weights.sum(0)
    # (a split without keys weighs 0 and its output, often never written, is not read)
    shares = torch.where(weights[..., None] > 0, out_partial * weights[..., None], 0.0)
    merged = shares.sum(0) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, top + total.log(), float("-inf")).transpose(1, 2).contiguous().transpose(1, 2)
    if out is None:
        return merged.to(out_dtype), lse
    if out.shape != merged.shape or out.dtype != out_dtype or out.device != merged.device:
        raise ValueError(f"out must be ({', '.join(map(str, merged.shape))}) {out_dtype} on {merged.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out.copy_(merged), lse
