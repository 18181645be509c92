"""Tensors as the Hopper copy engine (TMA) reads them, on the host side.

TMA reads from a 16-byte aligned base with strides in 16-byte multiples; ``ready`` makes an
aligned copy of the rare tensor that is not.  The Gluon kernels see (batch, seqlen, heads,
head_dim) tensors through 4-D descriptors whose block is ``rows`` rows of one head
(``descriptor``); the plain-Triton kernel builds its descriptors on the device.
"""
import functools
import math

import torch
from triton.experimental.gluon import language as gl

from flashtile.kernels.keys_contiguous import copy as keys_contiguous_copy
from flashtile.kernels.launch import Descriptor, descriptor_spec
from flashtile.kernels.problem import cdiv

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
              torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


def aligned(x) -> bool:
    """TMA reads from a 16-byte aligned base with strides in 16-byte multiples (the last is 1)."""
    # Every stride a multiple of 16 bytes exactly when their greatest common divisor is.
    return x.data_ptr() % 16 == 0 and math.gcd(*x.stride()[:-1]) * x.element_size() % 16 == 0


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
def block_spec(rows, head_dim_pad, dtype):
    """Descriptor's (block_shape, layout, spec) for ``rows`` rows of one head (``descriptor``)."""
    block, layout = block_layout(rows, head_dim_pad, dtype)
    return block, layout, descriptor_spec(dtype, block, layout)


def descriptor(x, rows, head_dim_pad):
    """(batch, seqlen, heads, head_dim) as TMA sees it; one block is ``rows`` rows of one head."""
    return Descriptor(x, *block_spec(rows, head_dim_pad, x.dtype))


@functools.lru_cache(maxsize=None)
def keys_block_spec(head_dim_pad, keys, dtype):
    """Descriptor's (block_shape, layout, spec) for ``keys`` keys of one head of a keys_contiguous
    operand (``keys_contiguous_operand``)."""
    block = [1, 1, head_dim_pad, keys]
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[dtype])
    return block, layout, descriptor_spec(dtype, block, layout)


def keys_contiguous(v):
    """V (..., seqlen, heads, head_dim) copied to (..., heads, head_dim, seqlen), its keys
    contiguous, each row's start 16-byte aligned (as TMA reads it): the layout a float8 P V
    product reads its second operand in (kernels/keys_contiguous.py).  Batched or varlen."""
    seqlen = v.shape[-3]
    row = cdiv(seqlen * v.element_size(), 16) * 16 // v.element_size()
    return keys_contiguous_copy(v, row, mma_order=False)[..., :seqlen]


def keys_contiguous_operand(v):
    """A batched V laid out as keys_contiguous lays it out, but with the keys of each 16 in the
    float8 register operand's order (kernels/keys_contiguous.py), which TMA reads a block of keys
    of one head at a time (the Gluon forward: keys_block_spec).  The keys are padded with zeros to
    a multiple of 16 (the order mixes the last group's)."""
    return keys_contiguous_copy(v, cdiv(v.shape[1], 16) * 16, mma_order=True)
