"""The score hook: what every kernel applies to the scores where it forms them.

Kernels keep raw scores s = q . k and fold the softmax scale into the exponent: p =
exp2(s * scale_log2 - m).  A score modification turns the scaled scores x = s * scale * log2(e)
into other logits f(x), log2 units.  It works in a unit u of its own, the first of its run-time
arguments (the softcap in log2 units, else 1): ``logits`` returns y = f(x) / u where S is formed
(forward, and the backward's recomputation of P), ``exp_scale`` the u the softmax's exponent
multiplies y by, and ``grad`` multiplies dS by f'(x) where dS is formed.  The unit lets a
softcap cost what FlashAttention-3's does: y = tanh(s * scale_log2 / u) is one multiply and a
tanh per score, and u joins the exponent's existing multiply-add.  Without a modification
(``MOD`` None) y = s and u = scale_log2: exactly the kernel's plain code.

A ``ScoreMod`` is a pair of ``@triton.jit`` functions, plugged into every kernel as a
compile-time argument, with this signature (in units of u = args[0]):

    forward(x / u, q_idx, kv_idx, batch, head, offset, args) -> f(x) / u
    backward(ds, y, q_idx, kv_idx, batch, head, offset, args) -> ds * f'(x), with y = f(x) / u

f'(x) must be >= 0 (softcap's 1 - tanh^2, a bias's 1): the Gluon dK/dV pass carries dropout's
keep mask across the dP wait in the sign bit of P f' (kernels/dropout.py, kept_only_t).
``q_idx`` and ``kv_idx`` are the positions of the rows and columns inside their sequences,
shaped to broadcast against the score tile; ``batch`` the sequence (varlen: its index) and
``head`` the query head; ``offset`` is seqlen_k - seqlen_q of the sequence (the bottom-right
diagonal); ``args`` a tuple of run-time values (``args_of``), tensors among them as pointers.  A
feature is one such pair here and its arguments; no kernel changes.
"""
import hashlib
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
    # A distance bias, f(x) = inner(x) - slope * |i + offset - j| (ALiBi): ``slope(batch, head,
    # args)`` in the hook's unit, ``inner`` the modification under the bias (None: the identity).
    # On a block whose keys all lie on one side of every row's diagonal the bias is a column part
    # plus a row part (one_side_logits); kernels that know their blocks use it, the rest forward.
    slope: object = None
    inner: object = None
    # Whether the single-pass Gluon backward runs it without spilling: a modification whose
    # gradient needs the logits kept beside the bias's parts does not fit its registers.
    single_pass: bool = True

    @property
    def cache_key(self) -> str:
        """What compiled kernels are keyed by: the name, the flag and the code of every function
        (each JIT function's key covers its source and the functions it calls).  Triton keys a
        constexpr by its ``cache_key`` where it has one, else by its repr, which would name the
        functions but not their code: a kernel compiled against an older hook would be taken
        from the cache for a newer one."""
        parts = [self.name, str(self.single_pass), *map(_code_key, (self.forward, self.backward, self.slope, self.inner))]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()

    def __repr__(self) -> str:  # (triton's in-process kernel key takes the repr)
        return f"ScoreMod({self.name}, {self.cache_key})"


def _code_key(x) -> str:
    # A JIT function's or ScoreMod's cache key; under the interpreter (which compiles nothing)
    # the functions have none, and their repr stands in.
    return "-" if x is None else getattr(x, "cache_key", None) or repr(x)


@triton.jit
def _tanh_exp2(x):
    # Exact to fp32 rounding (the interpreter has no inline assembly): near 0, where
    # 1 - 2 / (e^2x + 1) cancels (a cap far above the scores), the series to x^7.
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.125, series, 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0))


@triton.jit
def _tanh_approx(x):
    # One MUFU instruction, as FlashAttention-3's softcap (relative error about 2**-11).
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


_tanh = _tanh_exp2 if options.interpreting() else _tanh_approx


@triton.jit
def _softcap(x, q_idx, kv_idx, batch, head, offset, args):
    # In units of the cap (args[0] = softcap * log2(e)): cap * tanh(x / cap) is tanh(x / cap) caps.
    return _tanh(x)


@triton.jit
def _softcap_grad(ds, y, q_idx, kv_idx, batch, head, offset, args):
    return ds * (1.0 - y * y)


@triton.jit
def _alibi_slope(batch, head, args):
    """ALiBi's slope of (batch, head) in the hook's unit (log2(e) / args[0] per unit of flash_attn's),
    read from args[1] with batch stride args[2] (0: one slope per head)."""
    return tl.load(args[1] + batch * args[2] + head) * tiles.LOG2E / args[0]


@triton.jit
def _alibi_bias(q_idx, kv_idx, batch, head, offset, args):
    """flash_attn's ALiBi bias, negated, in the hook's unit: slope * |i + offset - j|.  The
    positions turn into floats before they broadcast (a conversion per row and per column, not
    per score); their difference is exact below 2**24."""
    slope = _alibi_slope(batch, head, args)
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
ALIBI = ScoreMod("alibi", _alibi, slope=_alibi_slope)  # a bias: f'(x) = 1
SOFTCAP_ALIBI = ScoreMod("softcap+alibi", _softcap_alibi, _softcap_alibi_grad, slope=_alibi_slope, inner=SOFTCAP,
                         single_pass=False)


def mod_of(p):
    """The problem's score modification, or None."""
    return modification(p.softcap, p.alibi_slopes is not None)


def modification(softcap: float, alibi: bool):
    """The score modification of a softcap (0: none) and ALiBi or not, or None."""
    if alibi:
        return SOFTCAP_ALIBI if softcap > 0 else ALIBI
    return SOFTCAP if softcap > 0 else None


def args_of(p) -> tuple:
    """The run-time arguments of the problem's score modification (``arguments``)."""
    return arguments(p.softcap, p.alibi_slopes)


def arguments(softcap: float, alibi_slopes) -> tuple:
    """The run-time arguments of a score modification: its unit (the softcap in log2 units, else
    1), then with ALiBi its slopes and their batch stride."""
    unit = softcap * LOG2E if softcap > 0 else 1.0
    if alibi_slopes is not None:
        return (unit, alibi_slopes, alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0)
    return (unit,)


@triton.jit
def logits(s, scale_log2, q_idx, kv_idx, site, MOD: tl.constexpr):
    """Raw scores as the online softmax takes them: unchanged without a modification (the
    softmax applies scale_log2: exp_scale), else f(s * scale_log2) / u, u = args[0].  ``site``:
    (batch, head, offset, args) of the tile (see the module doc)."""
    if MOD is None:
        return s
    else:
        batch, head, offset, args = site
        return MOD.forward(s * (scale_log2 / args[0]), q_idx, kv_idx, batch, head, offset, args)


@triton.jit
def exp_scale(scale_log2, site, MOD: tl.constexpr):
    """The factor the softmax's exponent applies to what ``logits`` returns: log2 units per unit."""
    if MOD is None:
        return scale_log2
    else:
        return site[3][0]


@triton.jit
def scaled_logits(s, scale_log2, q_idx, kv_idx, site, MOD: tl.constexpr):
    """Logits in log2 units, for kernels that scale the scores before the softmax (and take no
    ``grad``, which reads logits' own units)."""
    return logits(s, scale_log2, q_idx, kv_idx, site, MOD) * exp_scale(scale_log2, site, MOD)


@triton.jit
def distance_slope(site, MOD: tl.constexpr):
    """The slope of MOD's distance bias (MOD.slope set) for the tile's (batch, head), in the unit."""
    batch, head, offset, args = site
    return MOD.slope(batch, head, args)


def is_distance_bias(mod) -> bool:
    """Whether ``mod`` is a distance bias (ALiBi), which one_side_logits can split."""
    return mod is not None and mod.slope is not None


# The same test inside kernels (on the host, a constexpr function goes through the JIT's call path).
splits_distance = triton.constexpr_function(is_distance_bias)


@triton.jit
def diagonal_side(k_first, k_last, q_first, q_last, offset):
    """+1.0 if keys k_first..k_last all lie at or before the diagonal i + offset of every query
    q_first..q_last, -1.0 if all at or after it, 0.0 if the diagonal crosses the block (then the
    left side's split and crossing_part)."""
    left = k_last <= q_first + offset
    right = k_first >= q_last + offset
    return left.to(tl.float32) - right.to(tl.float32)


@triton.jit
def crossing_part(q_idx, kv_idx, offset, slope):
    """What the left side's split (diagonal_side +1) lacks right of the diagonal, on a block the
    diagonal crosses: 2 * slope * min(i + offset - j, 0), for -slope * |i + offset - j| =
    slope * (j - i - offset) + that.  Integers until the min: exact."""
    return (2.0 * slope) * tl.minimum(q_idx + offset - kv_idx, 0).to(tl.float32)


@triton.jit
def inner_logits(s, scale_log2, q_idx, kv_idx, site, MOD: tl.constexpr):
    """A distance bias's ``logits`` without the bias: inner(s * scale_log2 / u)."""
    batch, head, offset, args = site
    x = s * (scale_log2 / args[0])
    if MOD.inner is None:
        return x
    else:
        return MOD.inner.forward(x, q_idx, kv_idx, batch, head, offset, args)


@triton.jit
def biased_inner_logits(s, scale_log2, unit, bias, q_idx, kv_idx, site, MOD: tl.constexpr):
    """(inner_logits * unit + bias, in log2 units, and the inner logits t for inner_grad): for a
    bias with no inner modification s * scale_log2 + bias, one multiply-add a score (t, unused
    there, is s)."""
    if MOD.inner is None:
        return s * scale_log2 + bias, s
    else:
        t = inner_logits(s, scale_log2, q_idx, kv_idx, site, MOD)
        return t * unit + bias, t


@triton.jit
def inner_grad(ds, t, q_idx, kv_idx, site, MOD: tl.constexpr):
    """A distance bias's ``grad`` (f' = inner'), ``t`` what inner_logits returned."""
    if MOD.inner is None:
        return ds
    elif MOD.inner.backward is None:
        return ds
    else:
        batch, head, offset, args = site
        return MOD.inner.backward(ds, t, q_idx, kv_idx, batch, head, offset, args)


@triton.jit
def one_side_logits(s, scale_log2, col_bias, q_idx, kv_idx, site, MOD: tl.constexpr):
    """``logits`` of a block whose keys lie all left (at or before) or all right of every row's
    diagonal i + offset (diagonal_side +1 or -1), for a distance bias: there -slope * |i + offset
    - j| is side * slope * (j - n0) + side * slope * (n0 - i - offset).  ``col_bias`` is the
    first part, the same for every block of a side; the caller adds the second, one per row, to
    the softmax (tiles.scaled_softmax_step's row_log2).  A score costs one multiply-add for the
    bias, not four.  (The Gluon backward forms the same two parts from inner_logits itself, the
    query part folded into the logsumexp it subtracts.)"""
    return inner_logits(s, scale_log2, q_idx, kv_idx, site, MOD) + col_bias


@triton.jit
def grad(ds, y, q_idx, kv_idx, site, MOD: tl.constexpr):
    """dS with respect to the scaled scores: ``ds`` (with respect to the logits) times f', ``y``
    what ``logits`` returned."""
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
