"""The Gluon kernels' shared-memory pipeline: ring slots and their mbarrier phases, releasing a
buffer to the producer, the scores' product over a head dim's lanes (whole or in slices), and
the TMA reduce-add Gluon 3.6 does not expose."""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma


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
def lanes_product(a, b, zero, LANES: gl.constexpr):
    """a b^T reduced over the first LANES lanes of both (rows x lanes tiles; ``b`` in shared
    memory, ``a`` in registers only when LANES is all of its lanes), issued and left in flight.
    Fewer lanes than the tiles hold (configs.qk_lanes: 192 of d256's 256) go as two products over
    slices of 2/3 and 1/3 of them, each a commit group: a wait that leaves later groups in flight
    covers both."""
    if LANES == a.shape[1]:
        return warpgroup_mma(a, b.permute((1, 0)), zero, use_acc=False, is_async=True)
    else:
        FIRST: gl.constexpr = LANES // 3 * 2
        acc = warpgroup_mma(a.slice(0, FIRST, dim=1), b.slice(0, FIRST, dim=1).permute((1, 0)), zero,
                            use_acc=False, is_async=True)
        rest_a, rest_b = a.slice(FIRST, LANES - FIRST, dim=1), b.slice(FIRST, LANES - FIRST, dim=1)
        return warpgroup_mma(rest_a, rest_b.permute((1, 0)), acc, is_async=True)


@gluon.jit
def slices_product(a_bufs, a_first, b_bufs, b_first, zero, SLICES: gl.constexpr):
    """a b^T reduced over lanes held as SLICES slices loaded separately (configs.qk_slices; 1: the
    whole tile): buffers a_first.. of ``a_bufs`` and b_first.. of ``b_bufs``, each (1, rows, 1,
    slice lanes), issued and left in flight, each slice a commit group (as lanes_product's)."""
    acc = zero
    for i in gl.static_range(SLICES):
        a = a_bufs.index(a_first + i)
        b = b_bufs.index(b_first + i)
        acc = warpgroup_mma(a.reshape([a.shape[1], a.shape[3]]), b.reshape([b.shape[1], b.shape[3]]).permute((1, 0)),
                            acc, use_acc=i > 0, is_async=True)
    return acc


@gluon.jit
def release(stationary_empty, slot):
    """The partition's results have left the stationary slot (its TMA stores waited for by the
    thread that issued them): the producer may load the next tile into it."""
    gl.thread_barrier()
    mbarrier.arrive(stationary_empty.index(slot))
