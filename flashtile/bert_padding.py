"""flash_attn.bert_padding's helpers, for code that pads batches and calls the varlen functions:
``from flashtile.bert_padding import unpad_input, pad_input`` in place of flash_attn's import.

``unpad_input`` packs the tokens a (batch, seqlen) mask keeps into (total, ...) rows with the
int32 offsets the varlen functions take; ``unpad_input_for_concatenated_sequences`` does the
same for rows that each hold several documents one after another; ``pad_input`` puts rows back
at their places, zeros elsewhere.  Plain indexing, differentiable both ways.  Reading the
longest sequence's length (``max_seqlen``) copies one number to the host, as flash_attn's does
(and the concatenated documents' check of their lengths one more).
"""
import torch
import torch.nn.functional as F


def index_first_axis(x, indices):
    """Rows ``indices`` of ``x`` along its first axis."""
    return x[indices]


def index_first_axis_residual(x, indices):
    """(rows ``indices`` of ``x``, ``x`` itself): both outputs pass their gradients back to ``x``
    (flash_attn's form for a layer that keeps its input as a residual)."""
    return index_first_axis(x, indices), x.view_as(x)


def index_put_first_axis(values, indices, first_axis_dim: int):
    """A (first_axis_dim, ...) tensor of zeros with ``values`` at rows ``indices``."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    out[indices] = values
    return out


def _packed(hidden_states, kept, seqlens):
    """(rows of ``hidden_states`` (batch, seqlen, ...) where ``kept`` (batch, seqlen), their
    indices in the flattened batch, int32 offsets of the sequences of ``seqlens`` packed one
    after another, the longest of them)."""
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return rows, indices, cu_seqlens, int(seqlens.max()) if seqlens.numel() else 0


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen), 1 or True where a token
    is kept.  Returns (rows (total, ...), indices of the kept tokens in the flattened batch,
    cu_seqlens (batch + 1,) int32, max_seqlen (int), used_seqlens (batch,) int32).
    ``unused_mask`` (batch, seqlen): tokens packed too but not counted as used (flash_attn's
    seqused); without it used_seqlens are the sequences' lengths."""
    kept = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    return (*_packed(hidden_states, kept, seqlens), used)


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """hidden_states (batch, seqlen, ...) whose rows each hold documents one after another from
    position 0; attention_mask_in_length (batch, seqlen) the lengths of row b's documents in
    order, zeros elsewhere (e.g. [[2, 3, 0, 0], [4, 0, 0, 0]]: documents of 2 and 3 tokens, then
    one of 4).  Each document attends within itself.  Returns (rows (total, ...), indices of the
    documents' tokens in the flattened batch, cu_seqlens (documents + 1,) int32, max_seqlen)."""
    lengths = attention_mask_in_length
    if lengths.dim() != 2 or lengths.shape != hidden_states.shape[:2] or lengths.dtype.is_floating_point or \
            lengths.dtype.is_complex or bool(((lengths < 0).any() | (lengths.sum(-1) > lengths.shape[-1]).any())):
        raise ValueError(f"attention_mask_in_length must be hidden_states' (batch, seqlen) "
                         f"{tuple(hidden_states.shape[:2])} of non-negative integer lengths summing to at most "
                         f"seqlen a row, got {tuple(lengths.shape)} {lengths.dtype}")
    seqlen = lengths.shape[-1]
    documents = lengths.flatten()[lengths.flatten() > 0].int()
    kept = torch.arange(seqlen, device=lengths.device) < lengths.sum(-1, keepdim=True)
    return _packed(hidden_states, kept, documents)


def pad_input(hidden_states, indices, batch: int, seqlen: int):
    """Rows (total, ...) from ``unpad_input`` back to (batch, seqlen, ...), zeros at the tokens
    the mask dropped."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
