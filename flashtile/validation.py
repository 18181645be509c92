"""Argument checks for the public API: every bad input is refused, by name, before any launch.

Numbers are accepted as what they are (``numbers.Real``/``numbers.Integral``: Python, numpy
scalars, and 0-d tensors where flash_attn takes them) and turned into plain Python values, so
that nothing downstream sees a numpy or tensor scalar.
"""
import math
import numbers

import torch
from torch.utils.weak import WeakIdKeyDictionary

from flashtile import gpu
from flashtile.tensor_state import KeptByTensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # head dims are padded to a multiple of this (as flash_attn does)
# Scores are multiplied by the scale in fp32: bound it so that any score an fp16/bf16 product
# makes stays finite after scaling.
MAX_SOFTMAX_SCALE = 2.0**16


def check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _scalar(name, x):
    """A 0-d (or one-element) tensor's value; anything else as given."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a number, got a tensor of shape {tuple(x.shape)}")
        return x.item()
    return x


def integer(name, x, minimum=None) -> int:
    """``x`` as a Python int: an Integral (not a bool) or an integer 0-d tensor."""
    if type(x) is int and (minimum is None or x >= minimum):  # the common case, at once
        return x
    x = _scalar(name, x)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {x!r} ({type(x).__name__})")
    x = int(x)
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def real(name, x, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """``x`` as a finite Python float inside [lo, hi] (open ends where asked)."""
    if type(x) is float and x == 0.0 and lo == 0.0 and not lo_open:  # an option left off, at once
        return x
    x = _scalar(name, x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {x!r} ({type(x).__name__})")
    try:
        value = float(x)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got an integer beyond the float range") from None
    if not -math.inf < value < math.inf:  # (comparisons, which torch.compile traces on a symbolic float)
        raise ValueError(f"{name} must be finite, got {value!r}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if below or above:
        if hi is None:
            raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return value


def window(window_size) -> tuple[int, int]:
    """(left, right) of ``window_size``: a pair of ints >= -1 (a sequence, numpy array or tensor of two)."""
    if type(window_size) is tuple and len(window_size) == 2:  # the common case, at once
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return window_size
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.is_floating_point() or window_size.dtype == torch.bool:
            raise ValueError(f"window_size must hold two integers, got {window_size!r}")
        window_size = window_size.tolist()
    try:
        sides = list(window_size)
    except TypeError:
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1: unbounded), got {window_size!r}") from None
    if len(sides) != 2:
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1: unbounded), got {window_size!r}")
    return tuple(integer(f"window_size[{i}]", side, minimum=-1) for i, side in enumerate(sides))


def band(causal: bool, window_size, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(left, right) of the key band, -1 for an unbounded side; causal caps the right side at 0.

    A side as wide as the sequences allow is the same band as an unbounded one (key c is seen
    from query r when -left <= c - r - (seqlen_k - seqlen_q) <= right, and c - r lies in
    [1 - seqlen_q, seqlen_k - 1]): left >= seqlen_k and right >= seqlen_q become -1, so the
    kernels' band arithmetic never sees values near the integer limits.  (flash_attn clamps the
    right side at seqlen_k, which changes the band when seqlen_q > seqlen_k + 1; this does not.)
    """
    left, right = window(window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_q:
        right = -1
    return left, right


def check_qkv(q, k, v, varlen: bool, fp8: bool = False):
    """Validate q, k, v of the batched (b, s, h, d) or varlen (total, h, d) layout (``fp8``: in
    float8, as FlashAttention-3's interface takes them)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
    if fp8 and q.dtype not in FP8_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; with descales, flashtile takes torch.float8_e4m3fn and "
                        f"torch.float8_e5m2")
    if not fp8 and q.dtype not in SUPPORTED_DTYPES:
        hint = " (float8 inputs go through flashtile.flash_attn_interface)" if q.dtype in FP8_DTYPES else ""
        raise TypeError(f"q has dtype {q.dtype}; flashtile supports torch.float16 and torch.bfloat16{hint}")
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
        if x.shape[-1] == 0 or x.shape[-2] == 0:
            raise ValueError(f"{name} has no heads or an empty head dim (shape {tuple(x.shape)})")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"q and k must have the same head dim, got {head_dim} and {k.shape[-1]}")
    for name, dim in (("head dim", head_dim), ("v's head dim", v.shape[-1])):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name} must be at most {MAX_HEAD_DIM}, got {dim}")
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


def offsets(name, cu, device, batch=None):
    """A varlen offsets table as the kernels read it: int32, 1-D (batch + 1,) (of the ``batch``
    given), on ``device``, contiguous (a strided view is copied: the kernels index it as
    contiguous)."""
    check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D (batch + 1,) with batch >= 1, got shape {tuple(cu.shape)}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} must be (batch + 1,) = ({batch + 1},), got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    return cu.contiguous()


def varlen_arguments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device):
    """A varlen call's offsets (``offsets``, of one length) and longest sequences (integers),
    as the kernels take them; their values are check_offset_values'."""
    cu_seqlens_q = offsets("cu_seqlens_q", cu_seqlens_q, device)
    cu_seqlens_k = offsets("cu_seqlens_k", cu_seqlens_k, device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    return (cu_seqlens_q, cu_seqlens_k, integer("max_seqlen_q", max_seqlen_q, minimum=0),
            integer("max_seqlen_k", max_seqlen_k, minimum=0))


# Offsets whose values passed check_offset_values (or were built valid: trust_offsets) -> (their
# last value, their longest sequence).  A model passes the same offsets to every layer, so they
# are read on the host once, not once a layer (tensor_state: re-read after a change through
# PyTorch); offsets kept in a buffer written behind PyTorch's back are re-read only when a call's
# token counts or longest sequence disagree with what was read.
_CHECKED_OFFSETS = KeptByTensor()


# used_rows tables api.py made from offsets it checked, which the op they go to takes as checked
# once, unread (made and used in one call: inference-mode tensors too, which count no versions).
_CHECKED_BOUNDS = WeakIdKeyDictionary()


def trust_row_bounds(*tables):
    """Take used_rows tables just made from checked offsets as checked, by their next check."""
    for table in tables:
        _CHECKED_BOUNDS[table] = True


def check_row_bounds(bounds_q, bounds_k, max_seqlen_q, max_seqlen_k, total_q, total_k):
    """used_rows' (start, end) tables: from row 0 on, each end at or after its start and at most
    the tensor's rows, no span longer than the max_seqlen given.  Read on the host unless made
    from checked offsets (trust_row_bounds) or under CUDA-graph capture (the kernels clamp)."""
    if bounds_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    for name, bounds, total, max_len in (("cu_seqlens_q", bounds_q, total_q, max_seqlen_q),
                                         ("cu_seqlens_k", bounds_k, total_k, max_seqlen_k)):
        if _CHECKED_BOUNDS.pop(bounds, None) or not bounds.numel():
            continue
        values = bounds.cpu()
        spans = values[:, 1] - values[:, 0]
        if (values[:, 0] < 0).any() or (spans < 0).any() or (values[:, 1] > total).any():
            raise ValueError(f"{name} must start at 0 and be non-decreasing, ending at most at the tensor's {total} "
                             f"rows")
        if int(spans.max()) > max_len:
            raise ValueError(f"max_seqlen for {name} must be >= the longest sequence's used rows "
                             f"({int(spans.max())}), got {max_len}")


def read_offsets(cu) -> tuple[int, int]:
    """(last value, longest sequence) of offsets check_offset_values has read."""
    return _CHECKED_OFFSETS.get(cu)


def trust_offsets(cu, last: int, longest: int):
    """Take offsets built from checked ones as checked: from 0 (or a checked start), non-decreasing,
    ending at ``last``, no sequence longer than ``longest``."""
    _CHECKED_OFFSETS.put(cu, (last, longest))


def check_offset_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k,
                        spare_rows=False, names=("cu_seqlens_q", "cu_seqlens_k")) -> bool:
    """The offsets' values (of offsets of one length: varlen_arguments): from 0,
    non-decreasing, ending at the token counts (with ``spare_rows``, at or before them: rows after
    the last sequence, as flash_attn takes from padded buffers), within the max_seqlen given.
    Whether either ends before its tensor's rows.  Reading them costs one device-to-host copy, once
    for offsets passed again unchanged (skipped where that cannot happen: under CUDA-graph capture
    the kernels clamp every offset to the tensors instead, and no rows are taken as spare)."""
    if cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    early = False
    for name, cu, total, max_len in ((names[0], cu_seqlens_q, total_q, max_seqlen_q),
                                     (names[1], cu_seqlens_k, total_k, max_seqlen_k)):
        known = _CHECKED_OFFSETS.get(cu)
        if known is not None and (known[0] == total or spare_rows and known[0] < total) and known[1] <= max_len:
            early = early or known[0] < total
            continue
        values = cu.cpu()  # (read again where what was kept disagrees: it may have been written since)
        lengths = values[1:] - values[:-1]
        if values[0] != 0 or (lengths < 0).any():
            raise ValueError(f"{name} must start at 0 and be non-decreasing, got {values.tolist()}")
        last, longest = int(values[-1]), int(lengths.max()) if lengths.numel() else 0
        if last > total or last < total and not spare_rows:
            raise ValueError(f"{name}[-1] = {last} but the tensor has {total} tokens")
        if max_len < longest:
            raise ValueError(f"max_seqlen for {name} must be >= the longest sequence ({longest}), got {max_len}")
        trust_offsets(cu, last, longest)
        early = early or last < total
    return early


def feature_options(dropout_p, softcap) -> tuple[float, float]:
    """Refuse invalid values by name; (dropout_p, softcap) as floats."""
    return real("dropout_p", dropout_p, 0.0, 1.0, hi_open=True), real("softcap", softcap, 0.0)


def fp8_capable(device) -> str | None:
    """None where float8 matmuls run on ``device`` (compute capability 8.9 or newer, or the
    interpreter on CPU tensors); otherwise why not."""
    if device.type == "cuda" and gpu.capability(device.index) < (8, 9):
        major, minor = gpu.capability(device.index)
        return f"float8 matmuls need compute capability 8.9 or newer; this GPU is {major}.{minor}"
    return None


def fp8_takes(version: str, head_dim: int, device=None):
    """Refuse FP8 inputs where they cannot run: FP8 runs in v2's forward and v3's Gluon forward
    (dropout and a V head dim of their own run in every version)."""
    if device is not None and fp8_capable(device):
        raise NotImplementedError(f"FP8 inputs: {fp8_capable(device)}")
    if head_dim <= 16:
        raise NotImplementedError(f"FP8 inputs: head dim {head_dim}; float8 tensor-core products reduce 32 values at a "
                                  f"time, so the FP8 kernels take head dims above 16")
    if version in ("v1", "tiled"):
        raise NotImplementedError(f"FP8 inputs: version={version!r} has no FP8 path; v2 and v3 do (on CPU "
                                  f"tensors, under TRITON_INTERPRET=1)")


def alibi_slopes(slopes, batch: int, heads: int, device):
    """ALiBi's slopes as the kernels read them: float32, (heads,) or (batch, heads) as flash_attn
    takes them, on the tensors' device, contiguous; None stays None."""
    if slopes is None:
        return None
    check_tensor("alibi_slopes", slopes)
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}) (nheads or "
                         f"(batch, nheads)), got {tuple(slopes.shape)}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes must be on {device}, like q, got {slopes.device}")
    return slopes.contiguous()


def sinks(x, heads: int, device):
    """Attention sinks: one logit per query head, (heads,), floating point, on the tensors' device."""
    if x is None:
        return None
    check_tensor("sinks", x)
    if not x.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {x.dtype}")
    if tuple(x.shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},) (one logit per query head), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"sinks must be on {device}, like q, got {x.device}")
    return x.contiguous()  # the kernels read one logit per head at unit stride


def softmax_scale(scale, head_dim: int) -> float:
    """The softmax scale: 1 / sqrt(head_dim) by default, else a finite number in (0, MAX_SOFTMAX_SCALE]."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return real("softmax_scale", scale, 0.0, MAX_SOFTMAX_SCALE, lo_open=True)


def last_dim_contiguous(x):
    """Kernels need unit stride along head_dim; any other strides are used as they are."""
    return x if x.stride(-1) == 1 else x.contiguous()


def fp8_descales(descales, batch: int, heads_k: int, device) -> torch.Tensor:
    """FlashAttention-3's (q_descale, k_descale, v_descale), each None (1) or float32 (batch,
    nheads_k), as the kernels read them: one (3, batch, nheads_k) float32 tensor."""
    stacked = []
    for name, x in zip(("q_descale", "k_descale", "v_descale"), descales):
        if x is None:
            stacked.append(torch.ones(batch, heads_k, dtype=torch.float32, device=device))
            continue
        check_tensor(name, x)
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
        if tuple(x.shape) != (batch, heads_k):
            raise ValueError(f"{name} must have shape (batch, nheads_k) = ({batch}, {heads_k}), got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name} must be on {device}, like q, got {x.device}")
        stacked.append(x)
    return torch.stack(stacked)


def int32_table(name, x, shape, device):
    """An int32 table of ``shape`` on ``device``, contiguous; None stays None."""
    if x is None:
        return None
    check_tensor(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")
    return x.contiguous()


def used_rows(name, used, cu_seqlens, device) -> torch.Tensor:
    """FlashAttention-3's seqused_q / seqused_k as the kernels read them: (batch, 2) int32 tables of
    each sequence's (start, end) rows, the end clamped to the sequence (no value is read on the
    host); None uses the whole sequence."""
    batch = cu_seqlens.numel() - 1
    starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    if used is not None:
        check_tensor(name, used)
        if used.dtype != torch.int32:
            raise TypeError(f"{name} must be torch.int32, got {used.dtype}")
        if tuple(used.shape) != (batch,):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(used.shape)}")
        if used.device != device:
            raise ValueError(f"{name} is on {used.device} but q is on {device}")
        lengths = torch.minimum(used.clamp(min=0), lengths)
    return torch.stack([starts, starts + lengths], dim=1).contiguous()
