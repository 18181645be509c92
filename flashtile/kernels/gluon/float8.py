"""Float8 register operands of Hopper's warpgroup MMA, for the Gluon kernels.

A float8 MMA reads its first operand from registers four consecutive K elements to a thread
(32 bits) and its second from shared memory only along K.  A float32 accumulator (P, or dS in
the backward) becomes such an operand where the reduced dimension's elements of each 16 sit in
the order kernels/keys_contiguous.py writes the shared operand in (MMA_ORDER): a thread then
converts the values it already holds, with no exchange between threads (FlashAttention-3's).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def packed_operand(x, dtype: gl.constexpr, layout: gl.constexpr):
    """``x`` (rows x K, float32, within the float8 ``dtype``'s range) as a float8 register
    operand of ``layout`` (a DotOperandLayout of k_width 4), its K elements taken in the
    keys-contiguous copies' order, kept four elements to an int32 (rounded to nearest,
    saturating) until its MMA: ``register_operand`` unpacks it there."""
    ROWS: gl.constexpr = x.shape[0]
    KEYS: gl.constexpr = x.shape[1]
    x = x.reshape([ROWS, KEYS // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([ROWS, KEYS])
    x = gl.convert_layout(x, layout).reshape([ROWS, KEYS // 4, 2, 2])
    even, odd = gl.split(x)
    k0, k2 = gl.split(even)
    k1, k3 = gl.split(odd)
    if dtype == gl.float8e5:
        cvt: gl.constexpr = "cvt.rn.satfinite.e5m2x2.f32"
    else:
        cvt: gl.constexpr = "cvt.rn.satfinite.e4m3x2.f32"
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; " + cvt + " lo, $2, $1; " + cvt + " hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", [k0, k1, k2, k3], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def register_operand(packed, dtype: gl.constexpr, layout: gl.constexpr):
    """``packed_operand``'s int32 as the MMA's float8 register operand."""
    b0 = packed.to(gl.int8)
    b1 = (packed >> 8).to(gl.int8)
    b2 = (packed >> 16).to(gl.int8)
    b3 = (packed >> 24).to(gl.int8)
    x = gl.join(gl.join(b0, b2), gl.join(b1, b3))
    x = x.reshape([x.shape[0], x.shape[1] * 4]).to(dtype, bitcast=True)
    return gl.convert_layout(x, layout)
