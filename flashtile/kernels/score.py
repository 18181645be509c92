"""The score hook: what every kernel applies to the scores where it forms them.

Kernels keep raw scores s = q . k and fold the softmax scale into the exponent: p =
exp2(s * scale_log2 - m).  A score modification turns the scaled scores into other logits
first, x -> f(x), in log2 units (x = s * scale * log2(e)): ``logits`` applies it where S is
formed (forward, and the backward's recomputation of P), ``grad`` multiplies dS by f'(x) where
dS is formed.  Without one (``MOD`` None) both are the identity and compile to exactly the
kernel's plain code.

A ``ScoreMod`` is a pair of ``@triton.jit`` functions, plugged into every kernel as a
compile-time argument, with this signature:

    forward(x, q_idx, kv_idx, batch, head, offset, args) -> f(x)
    backward(ds, y, q_idx, kv_idx, batch, head, offset, args) -> ds * f'(x), with y = f(x)

``q_idx`` and ``kv_idx`` are the positions of the rows and columns inside their sequences,
shaped to broadcast against the score tile; ``batch`` the sequence (varlen: its index) and
``head`` the query head; ``offset`` is seqlen_k - seqlen_q of the sequence (the bottom-right
diagonal); ``args`` a tuple of run-time values (``args_of``), tensors among them as pointers.  A
feature is one such pair here and its arguments; no kernel changes.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtile import options
from flashtile.kernels import tiles

LOG2E = tiles.LOG2E.value  # on the host; kernels read tiles.LOG2E


@dataclass(frozen=True)
class ScoreMod:
    name: str
    forward: object
    backward: object = None  # None: f'(x) = 1


@triton.jit
def _tanh_exp2(x):
    # Exact to fp32 rounding; the interpreter has no inline assembly.
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _tanh_approx(x):
    # One MUFU instruction, as FlashAttention-3's softcap (relative error about 2**-11).
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


_tanh = _tanh_exp2 if options.interpreting() else _tanh_approx


@triton.jit
def _softcap(x, q_idx, kv_idx, batch, head, offset, args):
    cap = args[0]  # in log2 units: softcap * log2(e)
    return cap * _tanh(x / cap)


@triton.jit
def _softcap_grad(ds, y, q_idx, kv_idx, batch, head, offset, args):
    t = y / args[0]
    return ds * (1.0 - t * t)


@triton.jit
def _alibi_bias(q_idx, kv_idx, batch, head, offset, args):
    """flash_attn's ALiBi bias, negated and in log2 units: slope * |i + offset - j| * log2(e),
    the slope of (batch, head) read from args[1] with batch stride args[2] (0: one per head).
    The positions turn into floats before they broadcast (a conversion per row and per column,
    not per score); their difference is exact below 2**24."""
    slope = tl.load(args[1] + batch * args[2] + head) * tiles.LOG2E
    return slope * tl.abs((q_idx + offset).to(tl.float32) - kv_idx.to(tl.float32))


@triton.jit
def _alibi(x, q_idx, kv_idx, batch, head, offset, args):
    return x - _alibi_bias(q_idx, kv_idx, batch, head, offset, args)


@triton.jit
def _softcap_alibi(x, q_idx, kv_idx, batch, head, offset, args):
    # As flash_attn: the cap on the scaled scores first, then the bias.
    return _softcap(x, q_idx, kv_idx, batch, head, offset, args) - _alibi_bias(q_idx, kv_idx, batch, head, offset,
                                                                               args)


@triton.jit
def _softcap_alibi_grad(ds, y, q_idx, kv_idx, batch, head, offset, args):
    capped = y + _alibi_bias(q_idx, kv_idx, batch, head, offset, args)
    return _softcap_grad(ds, capped, q_idx, kv_idx, batch, head, offset, args)


SOFTCAP = ScoreMod("softcap", _softcap, _softcap_grad)
ALIBI = ScoreMod("alibi", _alibi)  # a bias: f'(x) = 1
SOFTCAP_ALIBI = ScoreMod("softcap+alibi", _softcap_alibi, _softcap_alibi_grad)


def mod_of(p):
    """The problem's score modification, or None."""
    if p.alibi_slopes is not None:
        return SOFTCAP_ALIBI if p.softcap > 0 else ALIBI
    return SOFTCAP if p.softcap > 0 else None


def args_of(p) -> tuple:
    """The run-time arguments of the problem's score modification: the softcap in log2 units
    (one float also when there is none), then with ALiBi its slopes and their batch stride."""
    if p.alibi_slopes is not None:
        slopes = p.alibi_slopes
        return (p.softcap * LOG2E, slopes, slopes.stride(0) if slopes.dim() == 2 else 0)
    return (p.softcap * LOG2E,)


@triton.jit
def logits(s, scale_log2, q_idx, kv_idx, site, MOD: tl.constexpr):
    """Raw scores as the online softmax takes them: unchanged without a modification (the
    softmax applies scale_log2: exp_scale), else f(s * scale_log2), log2 units.  ``site``:
    (batch, head, offset, args) of the tile (see the module doc)."""
    if MOD is None:
        return s
    else:
        batch, head, offset, args = site
        return MOD.forward(s * scale_log2, q_idx, kv_idx, batch, head, offset, args)


@triton.jit
def exp_scale(scale_log2, MOD: tl.constexpr):
    """The factor the softmax's exponent applies to what ``logits`` returns."""
    if MOD is None:
        return scale_log2
    else:
        return 1.0


@triton.jit
def scaled_logits(s, scale_log2, q_idx, kv_idx, site, MOD: tl.constexpr):
    """Logits in log2 units, for kernels that scale the scores before the softmax."""
    return logits(s, scale_log2, q_idx, kv_idx, site, MOD) * exp_scale(scale_log2, MOD)


@triton.jit
def grad(ds, y, q_idx, kv_idx, site, MOD: tl.constexpr):
    """dS with respect to the scaled scores: ``ds`` (with respect to the logits ``y``) times f'."""
    if MOD is None:
        return ds
    elif MOD.backward is None:
        return ds
    else:
        batch, head, offset, args = site
        return MOD.backward(ds, y, q_idx, kv_idx, batch, head, offset, args)


def alibi_bias(slopes, seqlen_q: int, seqlen_k: int, rows=slice(None), cols=slice(None)):
    """flash_attn's ALiBi bias -slope * |i + seqlen_k - seqlen_q - j| in PyTorch: ``slopes`` of
    shape (..., heads) gives (..., heads, rows, cols) (``rows``/``cols``: ranges of a block)."""
    i = torch.arange(seqlen_q, device=slopes.device)[rows]
    j = torch.arange(seqlen_k, device=slopes.device)[cols]
    distance = (i[:, None] + (seqlen_k - seqlen_q) - j[None, :]).abs().to(slopes.dtype)
    return -slopes[..., None, None] * distance


def reference(scores, softcap: float, bias=None):
    """The same modification on natural-log scores in PyTorch (tiled path, standard attention):
    the cap, then the bias (ALiBi's, from :func:`alibi_bias`)."""
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    return scores if bias is None else scores + bias


def reference_grad(ds, logits, softcap: float, bias=None):
    """dS with respect to the scaled scores, given dS with respect to ``logits`` = reference(...)."""
    if softcap > 0:
        capped = logits if bias is None else logits - bias
        ds = ds * (1 - (capped / softcap) ** 2)
    return ds
