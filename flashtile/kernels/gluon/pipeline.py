"""The Gluon kernels' shared-memory pipeline: ring slots and their mbarrier phases, releasing a
buffer to the producer, and the TMA reduce-add Gluon 3.6 does not expose."""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add a shared-memory block into global memory by TMA (cp.reduce.async.bulk.tensor): Gluon
    3.6 builds the operation but its hopper.tma module exposes no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def buffer_of(count, BUFFERS: gl.constexpr):
    """Buffer and mbarrier phase of the ``count``-th use of a BUFFERS-deep set of buffers (the
    ring, the stationary slots), counted from 0 since the launch."""
    return count % BUFFERS, (count // BUFFERS) & 1


@gluon.jit
def release(stationary_empty, slot):
    """The partition's results have left the stationary slot (its TMA stores waited for by the
    thread that issued them): the producer may load the next tile into it."""
    gl.thread_barrier()
    mbarrier.arrive(stationary_empty.index(slot))
