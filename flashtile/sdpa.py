"""``torch.nn.functional.scaled_dot_product_attention``'s call, served by flashtile.

PyTorch's layout (batch, heads, seqlen, headdim) and semantics for the cases flashtile covers:
no mask, ``is_causal`` (aligned top-left, as PyTorch aligns it), and boolean key-padding masks
(True: the key takes part), which run the varlen kernels over each batch's kept keys.  Anything
else is refused by name before any launch.  A row whose keys are all masked gives 0, never NaN.
"""
import torch

from flashtile import api


def _key_padding(attn_mask, batch, heads, seqlen_q, seqlen_k, device):
    """The (batch, seqlen_k) keep-mask of a boolean mask that varies over batch and keys only."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.device != device:
        raise ValueError(f"attn_mask must be on the query's device ({device}), got {attn_mask.device}")
    if attn_mask.dtype != torch.bool:
        raise NotImplementedError(f"attn_mask: only boolean key-padding masks are supported, got {attn_mask.dtype} "
                                  "(an additive float mask would need a score bias)")
    if attn_mask.dim() > 4:
        raise ValueError("attn_mask must broadcast to (batch, heads, seqlen_q, seqlen_k), "
                         f"got {tuple(attn_mask.shape)}")
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    if shape[1] != 1 or shape[2] != 1:
        raise NotImplementedError(f"attn_mask: only key-padding masks, of shape (batch, 1, 1, seqlen_k), are "
                                  f"supported; got {tuple(attn_mask.shape)}, which varies over heads or queries")
    if shape[0] not in (1, batch) or shape[3] not in (1, seqlen_k):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"({batch}, {heads}, {seqlen_q}, {seqlen_k})")
    return attn_mask.reshape(shape[0], shape[3]).expand(batch, seqlen_k)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, version="auto"):
    """softmax(query key^T * scale) value with PyTorch's layout: query (batch, heads, seqlen_q,
    headdim), key and value (batch, heads_k, seqlen_k, headdim); returns (batch, heads,
    seqlen_q, headdim).  ``enable_gqa``: heads a multiple of heads_k.  ``attn_mask``: None or a
    boolean key-padding mask broadcasting from (batch, 1, 1, seqlen_k); not with ``is_causal``.
    ``version`` as in flash_attn_func."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, seqlen, headdim), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    batch, heads, seqlen_q, _ = query.shape
    heads_k, seqlen_k = key.shape[1], key.shape[2]
    if heads != heads_k and not enable_gqa:
        raise ValueError(f"query has {heads} heads and key {heads_k}: pass enable_gqa=True for grouped-query attention")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal cannot both be set (as in PyTorch)")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (batch, seqlen, heads, headdim) views
    options = dict(dropout_p=dropout_p, softmax_scale=scale, version=version)
    keep = None if attn_mask is None else _key_padding(attn_mask, batch, heads, seqlen_q, seqlen_k, query.device)
    if keep is not None and batch:  # (no sequence: nothing to mask)
        counts = keep.sum(1, dtype=torch.int32)
        cu_k = torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=query.device) * seqlen_q
        # The kept keys packed (one nonzero: one device-to-host wait); seqlen_k bounds every
        # sequence's count, which is all max_seqlen_k must do.
        kept = keep.nonzero(as_tuple=True)
        out = api.flash_attn_varlen_func(q.reshape(batch * seqlen_q, heads, q.shape[-1]), k[kept], v[kept], cu_q,
                                         cu_k, seqlen_q, seqlen_k, **options)
        return out.view(batch, seqlen_q, heads, value.shape[-1]).transpose(1, 2)
    if is_causal and seqlen_q <= seqlen_k:
        # Top-left: query i sees keys 0..i, so no query sees a key past seqlen_q - 1, and on the
        # square that remains top-left and bottom-right agree.
        k, v = k[:, :seqlen_q], v[:, :seqlen_q]
        out = api.flash_attn_func(q, k, v, causal=True, **options)
    elif is_causal:
        # seqlen_q > seqlen_k: keys up to i, the band's right edge at seqlen_q - seqlen_k past
        # flash_attn's bottom-right diagonal.
        out = api.flash_attn_func(q, k, v, window_size=(-1, seqlen_q - seqlen_k), **options)
    else:
        out = api.flash_attn_func(q, k, v, **options)
    return out.transpose(1, 2)
