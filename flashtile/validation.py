"""Argument checks for the public API: every bad input is refused before any kernel launches."""
import torch

from flashtile.runtime import VERSION_CHOICES

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256


def _check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_qkv(q, k, v, varlen: bool):
    """Validate q, k, v of the batched (b, s, h, d) or varlen (total, h, d) layout."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; flashtile supports torch.float16 and torch.bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q is on {q.device}; flashtile runs on CUDA GPUs (or CPU tensors)")
    rank, form = (3, "(total_tokens, nheads, headdim)") if varlen else (4, "(batch, seqlen, nheads, headdim)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {form}, got shape {tuple(x.shape)}")
        if x.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); every dimension must be >= 1")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"q and k must have the same head dim, got {head_dim} and {k.shape[-1]}")
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0):
        raise ValueError(f"head dim must be a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")
    heads_q, heads_k = q.shape[-2], k.shape[-2]
    if heads_q % heads_k != 0:
        raise ValueError(f"nheads of q ({heads_q}) must be a multiple of nheads of k/v ({heads_k})")


# The GPU kernels address a row inside one sequence with 32-bit offsets (row x row stride).
MAX_SEQUENCE_SPAN = 2**31


def sequence_span(x, seqlen: int, varlen: bool) -> int:
    """Elements between a sequence's first row and the end of its last, in ``x`` or in a
    contiguous tensor of its shape (outputs and gradients may be allocated contiguous)."""
    heads, head_dim = x.shape[-2], x.shape[-1]
    return seqlen * max(x.stride(0 if varlen else 1), heads * head_dim)


def check_sequence_span(q, k, v, seqlen_q: int, seqlen_k: int, varlen: bool):
    """Refuse sequences the GPU kernels' 32-bit row offsets cannot address."""
    for name, x, seqlen in (("q", q, seqlen_q), ("k", k, seqlen_k), ("v", v, seqlen_k)):
        span = sequence_span(x, seqlen, varlen)
        if span >= MAX_SEQUENCE_SPAN:
            raise ValueError(f"{name}: one sequence spans {span} elements (seqlen {seqlen} x row stride), "
                             f"beyond the GPU kernels' 32-bit row offsets (< 2**31); pass fewer heads per "
                             f"call or version='tiled'")


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
    """Validate varlen offsets: int32, 1-D, equal length, from 0, non-decreasing, matching totals.

    Reading the values costs one device-to-host copy; it is what keeps a malformed offset
    table from becoming an out-of-bounds read.
    """
    for name, cu, total, max_len in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        _check_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D (batch + 1,) with batch >= 1, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
        values = cu.cpu()
        lengths = values[1:] - values[:-1]
        if values[0] != 0 or (lengths < 0).any():
            raise ValueError(f"{name} must start at 0 and be non-decreasing, got {values.tolist()}")
        if values[-1] != total:
            raise ValueError(f"{name}[-1] = {int(values[-1])} but the tensor has {total} tokens")
        if not isinstance(max_len, int) or max_len < int(lengths.max()):
            raise ValueError(f"max_seqlen for {name} must be an int >= the longest sequence "
                             f"({int(lengths.max())}), got {max_len!r}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")


def check_options(dropout_p, softcap, alibi_slopes, window_size, softmax_scale, version):
    """Refuse features that are not implemented and malformed keyword values."""
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p != 0 is not supported yet")
    if softcap != 0.0:
        raise NotImplementedError("softcap != 0 is not supported yet")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported yet")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1: unbounded), got {window_size!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    if version not in VERSION_CHOICES:
        raise ValueError(f"version must be one of {VERSION_CHOICES}, got {version!r}")


def last_dim_contiguous(x):
    """Kernels need unit stride along head_dim; any other strides are used as they are."""
    return x if x.stride(-1) == 1 else x.contiguous()
