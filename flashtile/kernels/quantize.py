"""Quantizing to float8 per block of rows, with incoherent processing fused in.

One program per (block of ROWS rows, sequence × head): it loads the block of one head, multiplies
it by the rotation of incoherent processing when ROTATE (the ±1 matrix D H in the input's type, so
the tensor cores form exact products summed in float32, then 1 / sqrt(head_dim): a product on
the block in registers, in place of a rotated copy of the tensor in memory), takes the block's
amax, and writes the block divided by amax / max(float8) in the float8 type with that descale.
A value that is not finite sets no scale and is written as float8's NaN: it stays non-finite in
its own place, not in every value of its block.
The PyTorch passes it replaces (``fp8.quantize_blocks`` after a matmul) stay the reference the
tests check it against.
"""
import torch
import triton
import triton.language as tl

from flashtile import options
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import cdiv, padded_head_dim
from flashtile.kernels.tiles import TINY, fp8_signed_operand


FP8_NAN_BITS = tl.constexpr(0x7F)  # a NaN of both float8 types (e4m3fn: its only one)


@triton.jit
def _blocks_kernel(X, ROT, OUT, DESCALE, seqlen, heads, sxb, sxs, sxh, sob, sos, soh, sdb, sdh, rotation_scale,
                   fp8_max,
                   ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROTATE: tl.constexpr,
                   UPCAST: tl.constexpr):
    block = tl.program_id(0)
    bh = tl.program_id(1)
    batch = bh // heads
    head = bh % heads
    rows = block * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HEAD_DIM_PAD)
    inside = (rows[:, None] < seqlen) & (cols[None, :] < HEAD_DIM)
    x = tl.load(X + batch * sxb + head * sxh + rows[:, None].to(tl.int64) * sxs + cols[None, :], mask=inside,
                other=0.0)
    if ROTATE:
        signs = tl.load(ROT + cols[:, None] * HEAD_DIM_PAD + cols[None, :])
        if UPCAST:  # the interpreter's bf16 products are not exact
            x = tl.dot(x.to(tl.float32), signs.to(tl.float32), input_precision="ieee") * rotation_scale
        else:
            x = tl.dot(x, signs) * rotation_scale
    else:
        x = x.to(tl.float32)
    finite = tl.abs(x) < float("inf")  # (not NaN either)
    x = tl.where(finite, x, 0.0)
    descale = tl.maximum(tl.max(tl.abs(x)) / fp8_max, TINY)  # a normal number, also for an all-zero block
    y = x / descale
    # (the interpreter's cast to float8 drops rounding carries: fp8_signed_operand rounds on the grid first)
    y = fp8_signed_operand(y, OUT.dtype.element_ty, UPCAST).to(OUT.dtype.element_ty)
    bits = tl.where(finite, y.to(tl.uint8, bitcast=True), tl.full([ROWS, HEAD_DIM_PAD], FP8_NAN_BITS, tl.uint8))
    tl.store(OUT.to(tl.pointer_type(tl.uint8)) + batch * sob + head * soh + rows[:, None].to(tl.int64) * sos
             + cols[None, :], bits, mask=inside)
    tl.store(DESCALE + batch * sdb + head * sdh + block, descale)


def blocks(x, rows: int, dtype, fp8_max: float, signs=None):
    """x (batch, seqlen, heads, d) in float8 ``dtype`` with one descale per ``rows`` rows of each
    head, (batch, heads, blocks) float32, after multiplying each row by ``signs`` / sqrt(d) if
    given (``signs`` a (d, d) matrix of ±1 in x's type, d a power of two): what
    ``fp8.quantize_blocks(x @ (signs / sqrt(d)), rows, dtype)`` gives, in one pass."""
    batch, seqlen, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_blocks = cdiv(seqlen, rows)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    descale = torch.empty(batch, heads, n_blocks, dtype=torch.float32, device=x.device)
    head_dim_pad = padded_head_dim(head_dim)
    if signs is not None and (signs.shape != (head_dim, head_dim) or head_dim != head_dim_pad
                              or signs.dtype != x.dtype):
        raise ValueError(f"signs must be ({head_dim}, {head_dim}) in {x.dtype} with a power-of-two head dim, got "
                         f"{tuple(signs.shape)} in {signs.dtype}")
    if out.numel():
        launch(_blocks_kernel, (n_blocks, batch * heads), x, x if signs is None else signs, out,
               descale, seqlen, heads, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
               out.stride(2), descale.stride(0), descale.stride(1), head_dim ** -0.5, fp8_max, ROWS=rows,
               HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, ROTATE=signs is not None, UPCAST=options.interpreting(),
               num_warps=4 if rows * head_dim_pad <= 8192 else 8)
    return out, descale
