"""FlashAttention-3's Python interface (``flash_attn_interface``), served by flashtile.

Code written for FA3 runs unchanged with ``from flashtile.flash_attn_interface import ...``:
the same signatures, returning ``out``, or ``(out, softmax_lse)`` with ``return_attn_probs``.
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

from flashtile import api, chunks, kvcache, validation


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descales, softmax_scale, causal,
               window_size, softcap, deterministic, return_attn_probs, seqused=None, attention_chunk=0):
    """flashtile's attention, FP8 where q is float8 (descales apply to nothing else), in chunks
    of ``attention_chunk`` keys if it is not 0 (chunks.py)."""
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
        return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descales)
    if seqused is not None and any(x is not None for x in seqused):
        raise NotImplementedError("attention_chunk with seqused_q / seqused_k is not supported")
    validation.check_qkv(q, k, v, cu_seqlens_q is not None, fp8)
    if cu_seqlens_q is not None:  # checked before the pieces are cut from them
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = validation.varlen_arguments(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
        validation.check_offset_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0],
                                       k.shape[0])
    if fp8:  # (expanded to the pieces: checked first)
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
        validation.fp8_descales(descales, batch, k.shape[-2], q.device)
    out, lse = chunks.attend(functools.partial(run, lse=True), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, chunk, descales)
    return (out, lse) if return_attn_probs else out


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
    if num_heads_q is None:
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
    ``block_table``, queries of varying counts packed by ``cu_seqlens_q`` and ``max_seqlen_q``.
    New keys of varying counts (``cu_seqlens_k_new``), ``qv``, ``rotary_seqlens``, float8
    descales and ``scheduler_metadata`` are refused by name.  ``attention_chunk`` takes one
    query token per sequence (decoding): each sequence's keys start at its chunk
    (chunks.cache_starts)."""
    _refuse_unsupported(qv=qv, cu_seqlens_k_new=cu_seqlens_k_new, rotary_seqlens=rotary_seqlens,
                        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                        scheduler_metadata=scheduler_metadata)
    _hints(num_splits, pack_gqa, sm_margin)
    chunk = chunks.check(attention_chunk)
    if chunk:
        cache_leftpad = chunks.cache_starts(q, k_cache, k, cache_seqlens, cache_leftpad, page_table, chunk)
    return kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                           window_size, softcap, rotary_interleaved, None, num_splits,
                                           return_softmax_lse, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)
