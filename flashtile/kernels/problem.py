"""What a kernel launch needs to know about one attention call, independent of the version.

Batched tensors are (batch, seqlen, heads, head_dim); varlen tensors (total_tokens, heads,
head_dim) are seen as batch 1 with per-sequence starts from cu_seqlens, so every kernel
handles both through one set of strides.
"""
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

from flashtile import options
from flashtile.kernels.tiles import LOG2E


# Host integer helpers in plain arithmetic: triton.next_power_of_2 and triton.cdiv go through
# the JIT's call path (microseconds a call).
def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (>= 1)."""
    return 1 << (n - 1).bit_length()


def cdiv(n: int, d: int) -> int:
    """``n / d`` rounded up."""
    return -(-n // d)


def padded_head_dim(head_dim: int) -> int:
    """A head dim's tile: tl.dot needs K >= 16 and power-of-two tiles; padded lanes are masked
    to zero."""
    return max(16, next_power_of_2(head_dim))


@functools.lru_cache(maxsize=256)
def contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def remembered(fn):
    """``fn(p, ...)``, a function of a problem and hashable arguments, remembered for problems that
    are a cache key: asked at every call, the same few problems come back.  A problem that holds
    tensors (varlen offsets, ALiBi slopes, a dropout seed, FP8 descales: new at every call) is
    computed afresh.  Results are shared between calls: read them, never change them."""
    cached = functools.lru_cache(maxsize=1024)(fn)

    @functools.wraps(fn)
    def call(p, *args, **kwargs):
        return fn(p, *args, **kwargs) if p.holds_tensors else cached(p, *args, **kwargs)

    call.cache_clear = cached.cache_clear
    return call


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device) -> torch.Tensor:
    # One per device, made once: no allocation or fill on every launch.
    return torch.zeros(1, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Problem:
    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int          # longest query sequence (the padded length when not varlen)
    seqlen_k: int
    head_dim: int
    softmax_scale: float
    window_left: int       # -1: unbounded
    window_right: int      # -1: unbounded; 0 with causal
    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    deterministic: bool = False  # the backward must give bitwise-identical gradients run to run
    softcap: float = 0.0   # scores become softcap * tanh(scores / softcap); 0: off
    total_q: int = 0       # rows of the packed q and k (varlen)
    total_k: int = 0
    alibi_slopes: Optional[torch.Tensor] = None  # fp32 (heads,) or (batch, heads): ALiBi's bias
    dropout_p: float = 0.0  # probabilities dropped with this probability (kernels/dropout.py)
    # The dropout's seed, a one-element int64 tensor; no part of what a plan depends on.
    dropout_seed: Optional[torch.Tensor] = field(default=None, compare=False, hash=False)
    own_head_dim_v: Optional[int] = None  # V's (and the output's) head dim where it differs; None: head_dim
    fp8: bool = False  # q, k, v in float8 (e4m3 or e5m2), dequantized by fp8_descale; the output bf16
    fp8_per_block: bool = False  # descales per block of the kernel's tiles, not per (sequence, KV head)
    # float32 q's, k's and v's descales: (3, batch, heads_k) per (sequence, KV head), or
    # (3, batch, heads_q, blocks) per block (kernels/v2.py's FP8 modes).
    fp8_descale: Optional[torch.Tensor] = field(default=None, compare=False, hash=False)
    # Per block, for a backward: (q rows, k/v rows) each descale covers (the forward's tiles);
    # the backward's tiles divide them.  () where only a forward reads the descales.
    fp8_rows: tuple = ()

    @classmethod
    def of(cls, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
           softmax_scale, window_left, window_right, softcap=0.0, deterministic=False, alibi_slopes=None,
           dropout_p=0.0, dropout_seed=None, head_dim_v=None, fp8_descale=None, fp8_rows=()):
        varlen = cu_seqlens_q is not None
        return cls(
            batch=(cu_seqlens_q.shape[0] if cu_seqlens_q.dim() == 2 else cu_seqlens_q.numel() - 1) if varlen
            else q.shape[0],
            heads_q=q.shape[-2], heads_k=k.shape[-2],
            seqlen_q=max_seqlen_q if varlen else q.shape[1],
            seqlen_k=max_seqlen_k if varlen else k.shape[1],
            head_dim=q.shape[-1], softmax_scale=softmax_scale,
            window_left=window_left, window_right=window_right,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, deterministic=deterministic,
            softcap=softcap, total_q=q.shape[0] if varlen else 0, total_k=k.shape[0] if varlen else 0,
            alibi_slopes=alibi_slopes, dropout_p=dropout_p,
            dropout_seed=dropout_seed,
            own_head_dim_v=None if head_dim_v in (None, q.shape[-1]) else head_dim_v,
            fp8=fp8_descale is not None, fp8_per_block=fp8_descale is not None and fp8_descale.dim() == 4,
            fp8_descale=fp8_descale, fp8_rows=fp8_rows)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def seqused(self) -> bool:
        """Varlen with each sequence's used rows given: cu_seqlens are (batch, 2) tables of
        (start, end) per sequence, rows of q or k outside them are neither read nor written."""
        return self.varlen and self.cu_seqlens_q.dim() == 2

    def gradients(self, q, k, v):
        """dq, dk, dv to be written by a backward (``gradient_of`` each)."""
        return self.gradient_of(q), self.gradient_of(k), self.gradient_of(v)

    def gradient_of(self, x):
        """The gradient of x (q, k or v) to be written by a backward: zeros where rows go
        unwritten (seqused); float32 for float8 inputs (with respect to their dequantized values)."""
        alloc = torch.zeros_like if self.seqused else torch.empty_like
        return alloc(x, dtype=torch.float32 if self.fp8 else None)

    @property
    def holds_tensors(self) -> bool:
        """Whether the problem carries tensors (offsets, slopes, a dropout seed, FP8 descales):
        then it is no cache key."""
        return (self.cu_seqlens_q is not None or self.alibi_slopes is not None or self.dropout_seed is not None
                or self.fp8_descale is not None)

    @property
    def empty(self) -> bool:
        """No query row, or no key: nothing to compute (outputs 0, logsumexp +inf).  Packed
        sequences may declare longer ones than they hold: none when the packed q or k is empty."""
        return (self.batch == 0 or self.seqlen_q == 0 or self.seqlen_k == 0
                or (self.varlen and (self.total_q == 0 or self.total_k == 0)))

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def banded(self) -> bool:
        """Causal or windowed: each query row sees a band of keys, not all of them."""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_k

    @property
    def head_dim_pad(self) -> int:
        return padded_head_dim(self.head_dim)

    @property
    def fp8_mode(self) -> int:
        """v2's FP8 constexpr: 0 none, 1 descales per (sequence, KV head), 2 per block."""
        return (2 if self.fp8_per_block else 1) if self.fp8 else 0

    def fp8_descale_strides(self):
        """(part, batch, head) strides of the descales as the kernel reads them (zeros without)."""
        if not self.fp8:
            return 0, 0, 0
        d = self.fp8_descale
        return d.stride(0), d.stride(1), d.stride(2) if self.fp8_per_block else 1

    def out_dtype(self, q: torch.Tensor) -> torch.dtype:
        """The output's dtype: q's, or bf16 for FP8 inputs."""
        return torch.bfloat16 if self.fp8 else q.dtype

    @property
    def head_dim_v(self) -> int:
        """V's (and the output's) head dim: its own, or Q's and K's."""
        return self.own_head_dim_v or self.head_dim

    @property
    def head_dims(self) -> int:
        """Q's (and K's) head dim in the low 16 bits, V's (and O's) in the high ones: the Gluon
        kernels' ``head_dims`` argument, one argument whether V has a head dim of its own or not."""
        return self.head_dim | self.head_dim_v << 16

    @property
    def head_dim_v_pad(self) -> int:
        return padded_head_dim(self.head_dim_v)

    @property
    def widest_head_dim_pad(self) -> int:
        """The tile tables' key: the wider of the padded Q/K and V head dims."""
        return max(self.head_dim_pad, self.head_dim_v_pad)

    def query_blocks(self, rows: int) -> int:
        """Blocks of ``rows`` query rows per sequence (the last may be partial)."""
        return cdiv(self.seqlen_q, rows)

    def key_blocks(self, rows: int) -> int:
        """Blocks of ``rows`` key rows per sequence (the last may be partial)."""
        return cdiv(self.seqlen_k, rows)

    @property
    def scale_log2(self) -> float:
        # exp(x * scale) == exp2(x * scale * log2(e)): the scale is folded into one multiply.
        return self.softmax_scale * LOG2E.value

    def seq_strides(self, x: torch.Tensor):
        """(batch, seq, head) strides of q/k/v/o-like tensors; the batch stride is 0 for varlen."""
        return self.seq_strides_of(x.stride())

    def seq_strides_of(self, strides: tuple):
        """seq_strides of a tensor of these strides."""
        return (0, *strides[:2]) if self.varlen else tuple(strides[:3])

    def row_stat_strides(self, x: torch.Tensor):
        """(batch, head) strides of lse-like tensors: (b, h, sq) batched, (h, total_q) varlen."""
        return self.row_stat_strides_of(x.stride())

    def row_stat_strides_of(self, strides: tuple):
        """row_stat_strides of a tensor of these strides."""
        return (0, strides[0]) if self.varlen else tuple(strides[:2])

    def row_stat_shape(self, total_q: int):
        return (self.heads_q, total_q) if self.varlen else (self.batch, self.heads_q, self.seqlen_q)

    @property
    def totals(self):
        """(total_q, total_k, stride_q, stride_k): what the kernels clamp varlen offsets to, and
        the strides of the (start, end) entries in cu_seqlens (blocks.sequence_bounds)."""
        stride = 2 if self.seqused else 1
        return self.total_q, self.total_k, stride, stride

    def cu_pointers(self, device):
        """cu_seqlens for the kernels; a one-element placeholder when not varlen (never read)."""
        if self.varlen:
            return self.cu_seqlens_q, self.cu_seqlens_k
        dummy = _placeholder(device)
        return dummy, dummy

    def upcast(self, x: torch.Tensor) -> bool:
        """Run tiles in fp32 where the interpreter would mis-compute bf16 matmuls or float8
        casts (tiles.fp8_operand)."""
        return options.interpreting() and (x.dtype == torch.bfloat16 or self.fp8)
