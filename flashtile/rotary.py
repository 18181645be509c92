"""Rotary position embedding (RoPE) as flash_attn applies it to new queries and keys.

``cos`` and ``sin`` are (seqlen_ro, rotary_dim / 2); the first rotary_dim channels of each head
rotate in pairs, (0, 1), (2, 3), ... when ``interleaved`` (GPT-J), else (i, i + rotary_dim / 2)
(GPT-NeoX); the rest pass through.  Computed in float32, returned in the input's dtype.
"""
import torch


def apply(x, cos, sin, positions, interleaved: bool):
    """x (batch, seqlen, heads, head_dim) rotated at ``positions`` (batch, seqlen) of cos/sin."""
    half = cos.shape[1]
    cos = cos[positions].float()[:, :, None, :]  # (batch, seqlen, 1, half)
    sin = sin[positions].float()[:, :, None, :]
    rot = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)
