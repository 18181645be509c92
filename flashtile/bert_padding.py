"""flash_attn.bert_padding's helpers, for code that pads batches and calls the varlen functions:
``from flashtile.bert_padding import unpad_input, pad_input`` in place of flash_attn's import.

``unpad_input`` packs the tokens a (batch, seqlen) mask keeps into (total, ...) rows with the
int32 offsets the varlen functions take; ``pad_input`` puts rows back at their places, zeros
elsewhere.  Plain indexing, differentiable both ways.  Reading the longest sequence's length
(``max_seqlen``) copies one number to the host, as flash_attn's does.
"""
import torch
import torch.nn.functional as F


def index_first_axis(x, indices):
    """Rows ``indices`` of ``x`` along its first axis."""
    return x[indices]


def index_put_first_axis(values, indices, first_axis_dim: int):
    """A (first_axis_dim, ...) tensor of zeros with ``values`` at rows ``indices``."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    out[indices] = values
    return out


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen), 1 or True where a token
    is kept.  Returns (rows (total, ...), indices of the kept tokens in the flattened batch,
    cu_seqlens (batch + 1,) int32, max_seqlen (int), used_seqlens (batch,) int32).
    ``unused_mask`` (batch, seqlen): tokens packed too but not counted as used (flash_attn's
    seqused); without it used_seqlens are the sequences' lengths."""
    kept = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return rows, indices, cu_seqlens, int(seqlens.max()) if seqlens.numel() else 0, used


def pad_input(hidden_states, indices, batch: int, seqlen: int):
    """Rows (total, ...) from ``unpad_input`` back to (batch, seqlen, ...), zeros at the tokens
    the mask dropped."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
