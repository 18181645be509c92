"""V copied with its keys contiguous: the layout a float8 P V product reads its second operand in.

A warpgroup MMA reads float8 operands along the reduction only, and P V reduces over the keys, so
V (..., seqlen, heads, head_dim) is copied to (..., heads, head_dim, keys).  One program per
(sequence × head, block of KEYS keys, block of DIMS dims) loads the tile along the head dim,
transposes it in registers (through shared memory) and stores it along the keys; a copy through
``Tensor.copy_`` of the transposed view writes a byte at a time and runs at a tenth of the
bandwidth.

With MMA_ORDER the keys of each 16 are stored in the order of the float8 register operand: key
8a + 2t + b at 4t + 2a + b (a, b < 2; t < 4).  A warpgroup MMA's float32 accumulator gives thread
t of a quad the keys 2t, 2t + 1, 8 + 2t and 9 + 2t of each 16 and its float8 register operand
takes keys 4t to 4t + 3, so with V's keys (and so P's: gluon/forward.py, _p_operand) in this
order, P's change of layout moves no value between threads (FlashAttention-3's).
"""
import torch
import triton
import triton.language as tl

from flashtile.kernels.launch import launch
from flashtile.kernels.problem import cdiv

KEYS = 128
DIMS = 64


@triton.jit
def _copy_kernel(V, OUT, seqlen, heads, head_dim, row, svb, svs, svh, sob, soh, sod,
                 KEYS: tl.constexpr, DIMS: tl.constexpr, MMA_ORDER: tl.constexpr):
    bh = tl.program_id(0)
    batch = (bh // heads).to(tl.int64)  # a batch's or a head's offset may pass 2**31 elements
    head = (bh % heads).to(tl.int64)
    keys = tl.program_id(1) * KEYS + tl.arange(0, KEYS)
    dims = tl.program_id(2) * DIMS + tl.arange(0, DIMS)
    x = tl.load(V + batch * svb + head * svh + keys[:, None].to(tl.int64) * svs + dims[None, :],
                mask=(keys[:, None] < seqlen) & (dims[None, :] < head_dim), other=0.0)
    if MMA_ORDER:  # (group, a, t, b) -> (group, t, a, b)
        x = tl.reshape(tl.permute(tl.reshape(x, (KEYS // 16, 2, 4, 2, DIMS)), (0, 2, 1, 3, 4)), (KEYS, DIMS))
    tl.store(OUT + batch * sob + head * soh + dims[:, None].to(tl.int64) * sod + keys[None, :], tl.trans(x),
             mask=(keys[None, :] < row) & (dims[:, None] < head_dim))


def copy(v, row: int, mma_order: bool):
    """v (batch, seqlen, heads, head_dim), or varlen (total, heads, head_dim), as (batch, heads,
    head_dim, row) (varlen: (heads, head_dim, row)) with keys past seqlen zero, in the float8
    operand's order within each 16 if ``mma_order``."""
    *lead, seqlen, heads, head_dim = v.shape
    if mma_order and row % 16:
        raise ValueError(f"row={row}: the float8 operand's key order permutes groups of 16 keys")
    if v.stride(-1) != 1:
        v = v.contiguous()
    out = v.new_empty(*lead, heads, head_dim, row)
    batch, svb = (lead[0], v.stride(0)) if lead else (1, 0)
    sob = out.stride(0) if lead else 0
    if out.numel():
        # Sequences x heads on the grid's first axis: the others stop at 65535.
        launch(_copy_kernel, (batch * heads, cdiv(row, KEYS), cdiv(head_dim, DIMS)), v, out,
               seqlen, heads, head_dim, row, svb, v.stride(-3), v.stride(-2), sob, out.stride(-3),
               out.stride(-2), KEYS=KEYS, DIMS=DIMS, MMA_ORDER=mma_order, num_warps=4)
    return out


def reference(v, row: int, mma_order: bool):
    """What ``copy`` gives, through PyTorch's copies (the tests' oracle)."""
    *lead, seqlen, heads, head_dim = v.shape
    src = torch.zeros(*lead, heads, head_dim, row, dtype=v.dtype, device=v.device)
    src[..., :seqlen] = v.movedim(-3, -1)
    if mma_order:
        src = src.unflatten(-1, (row // 16, 2, 4, 2)).transpose(-3, -2).flatten(-4)
    return src
