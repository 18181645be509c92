"""Tensors as the Hopper copy engine (TMA) reads them, on the host side.

TMA reads from a 16-byte aligned base with strides in 16-byte multiples; ``ready`` makes an
aligned copy of the rare tensor that is not.  The Gluon kernels see (batch, seqlen, heads,
head_dim) tensors through 4-D descriptors whose block is ``rows`` rows of one head
(``descriptor``); the plain-Triton kernel builds its descriptors on the device.
"""
import functools

import torch
from triton.experimental.gluon import language as gl

from flashtile.kernels.launch import Descriptor, descriptor_spec

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
              torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


def aligned(x) -> bool:
    """TMA reads from a 16-byte aligned base with strides in 16-byte multiples (the last is 1)."""
    return x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])


def ready(x):
    """``x``, or an aligned copy of the rare tensor that is not (a fresh allocation: ``contiguous``
    would hand back a contiguous tensor whose base is misaligned)."""
    return x if aligned(x) else x.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def block_layout(rows, head_dim_pad, dtype):
    # Cached: computing it costs tens of microseconds of Python, a tenth of a short forward.
    block = [1, rows, 1, head_dim_pad]
    return block, gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[dtype])


@functools.lru_cache(maxsize=None)
def _block_spec(rows, head_dim_pad, dtype):
    block, layout = block_layout(rows, head_dim_pad, dtype)
    return block, layout, descriptor_spec(dtype, block, layout)


def descriptor(x, rows, head_dim_pad):
    """(batch, seqlen, heads, head_dim) as TMA sees it; one block is ``rows`` rows of one head."""
    return Descriptor(x, *_block_spec(rows, head_dim_pad, x.dtype))


@functools.lru_cache(maxsize=None)
def _keys_block_spec(head_dim_pad, keys, dtype):
    block = [1, 1, head_dim_pad, keys]
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[dtype])
    return block, layout, descriptor_spec(dtype, block, layout)


def keys_contiguous(v):
    """V (..., seqlen, heads, head_dim) copied to (..., heads, head_dim, seqlen), its keys
    contiguous, each row's start 16-byte aligned (as TMA reads it): the layout a float8 P V
    product reads its second operand in (along the keys; read row by row, the tile would be
    transposed a byte at a time in shared memory).  Batched or varlen."""
    *lead, seqlen, heads, head_dim = v.shape
    row = -(-seqlen * v.element_size() // 16) * 16 // v.element_size()
    vt = v.new_empty(*lead, heads, head_dim, row)[..., :seqlen]
    vt.copy_(v.movedim(-3, -1))
    return vt


# A float8 V copy puts key 8a + 2t + b of each group of 16 at 4t + 2a + b (a, b < 2; t < 4): a
# warpgroup MMA's float32 accumulator gives thread t of a quad the keys 2t, 2t + 1, 8 + 2t and
# 9 + 2t of each 16, and its float8 register operand takes keys 4t to 4t + 3.  With V's keys
# (and so P's: gluon/forward.py, _p_operand) in this order, P's change of layout moves no value
# between threads (FlashAttention-3's).


def keys_contiguous_descriptor(v, keys, head_dim_pad):
    """A batched V laid out as keys_contiguous lays it out, but in the float8 key order above
    within each 16, as TMA reads it ``keys`` keys of one head at a time (the Gluon forward).  The
    keys are padded with zeros to a multiple of 16 (the order mixes the last group's)."""
    batch, seqlen, heads, head_dim = v.shape
    groups, tail = divmod(seqlen, 16)
    src = v.permute(0, 2, 3, 1)  # (batch, heads, head_dim, seqlen)
    vt = v.new_empty(batch, heads, head_dim, groups + (tail > 0), 4, 2, 2)  # (..., group, t, a, b)
    dst = vt.permute(0, 1, 2, 3, 5, 4, 6)  # the same memory as (..., group, a, t, b)
    if groups:
        dst[..., :groups, :, :, :].copy_(src[..., :groups * 16].unflatten(-1, (groups, 2, 4, 2)))
    if tail:
        last = v.new_zeros(batch, heads, head_dim, 16)
        last[..., :tail] = src[..., groups * 16:]
        dst[..., groups, :, :, :].copy_(last.unflatten(-1, (2, 4, 2)))
    return Descriptor(vt.flatten(3), *_keys_block_spec(head_dim_pad, keys, v.dtype))
