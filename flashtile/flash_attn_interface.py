"""FlashAttention-3's Python interface (``flash_attn_interface``), served by flashtile.

Code written for FA3 runs unchanged with ``from flashtile.flash_attn_interface import ...``:
the same signatures, returning ``out``, or ``(out, softmax_lse)`` with ``return_attn_probs``.
FA3's tuning hints (``num_splits``, ``pack_gqa``, ``sm_margin``) are accepted and leave the
choice to flashtile's dispatcher; what flashtile does not compute yet (``qv``,
``attention_chunk``) is refused by name.  ``seqused_q`` / ``seqused_k`` (batch,) int32: the
rows of each varlen sequence used; the output's other rows are 0.

FP8, as FA3 has it: q, k, v in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` with float32
``q_descale``, ``k_descale``, ``v_descale`` of shape (batch, nheads_k) (None: 1), the output
bf16, forward only.
"""
from flashtile import api, validation


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descales, softmax_scale, causal,
               window_size, softcap, deterministic, return_attn_probs, seqused=None):
    """flashtile's attention, FP8 where q is float8 (descales apply to nothing else)."""
    fp8 = getattr(q, "dtype", None) in validation.FP8_DTYPES
    if not fp8 and any(x is not None for x in descales):
        raise ValueError("q_descale, k_descale and v_descale apply to float8 q, k, v only")
    res = api._attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale,
                         causal, window_size, softcap, None, deterministic, return_attn_probs, None, "auto", None,
                         fp8_descales=descales if fp8 else None, seqused=seqused)
    return res[:2] if return_attn_probs else res


def _refuse_unsupported(**given):
    for name, value in given.items():
        if value is not None and not (name == "attention_chunk" and value == 0):
            raise NotImplementedError(f"{name} is not supported by flashtile's FlashAttention-3 interface yet")


def _hints(num_splits, pack_gqa, sm_margin):
    """FA3's tuning hints, checked for type and otherwise left to the dispatcher."""
    validation.integer("num_splits", num_splits, minimum=0)
    validation.integer("sm_margin", sm_margin, minimum=0)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None or a bool, got {pack_gqa!r}")


def _result(res, return_attn_probs):
    return res[:2] if return_attn_probs else res


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)."""
    _refuse_unsupported(qv=qv, attention_chunk=attention_chunk)
    _hints(num_splits, pack_gqa, sm_margin)
    return _attention(q, k, v, None, None, None, None, (q_descale, k_descale, v_descale), softmax_scale, causal,
                      window_size, softcap, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim), or with ``num_heads_q`` (batch, seqlen,
    nheads_q + 2 * nheads_k, headdim): the query heads, then K's, then V's (GQA)."""
    _refuse_unsupported(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                        attention_chunk=attention_chunk)
    validation.integer("sm_margin", sm_margin, minimum=0)
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   deterministic=deterministic, return_attn_probs=return_attn_probs)
    if num_heads_q is None:
        return _result(api.flash_attn_qkvpacked_func(qkv, **options), return_attn_probs)
    heads_q = validation.integer("num_heads_q", num_heads_q, minimum=1)
    validation.check_tensor("qkv", qkv)
    heads_k, odd = divmod(qkv.shape[2] - heads_q, 2) if qkv.dim() == 4 else (0, 0)
    if qkv.dim() != 4 or odd or heads_k < 1:
        raise ValueError(f"with num_heads_q={heads_q}, qkv must be (batch, seqlen, num_heads_q + 2 * nheads_k, "
                         f"headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.split([heads_q, heads_k, heads_k], dim=2)
    return _result(api.flash_attn_func(q, k, v, **options), return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                           num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); int32 offsets."""
    _refuse_unsupported(qv=qv, attention_chunk=attention_chunk)
    _hints(num_splits, pack_gqa, sm_margin)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, (q_descale, k_descale, v_descale),
                      softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                      (seqused_q, seqused_k))
