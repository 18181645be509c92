"""The attention forward and backward as autograd-aware ops: ``attention`` is the entry point.

Registered as torch.library custom ops, they let ``torch.compile(fullgraph=True)`` trace through
flashtile without graph breaks: the compiler sees opaque ops with fake (shape-only)
implementations.  Outside compilation the same two functions run under a plain
``torch.autograd.Function``, whose per-call cost is a fraction of the custom op's autograd
wrapper.  Both differentiate once: a second derivative (``create_graph=True`` through the
backward) is refused rather than silently missing attention's second-order term.
"""
import contextlib
import functools
from typing import Optional

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor
from torch._C import _functions as autograd_functions

from flashtile import dispatch, options, sinks as attention_sinks, validation
from flashtile.kernels.problem import Problem


def on_device_of(x: Tensor):
    """A context making ``x``'s GPU the current device: Triton launches on the current device and
    its stream, so a call on another GPU's tensors would otherwise launch where they are not
    (flash_attn's CUDAGuard).  Nothing to do, and nothing entered, in the common case."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=64)
def _options(text: str) -> options.KernelOptions:
    return options.KernelOptions.parse(text)


def _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q, max_seqlen_k,
             softmax_scale, window_left, window_right, softcap, dropout_p, deterministic=False, fp8_descale=None):
    if (cu_seqlens_q is not None or alibi_slopes is not None or dropout_seed is not None or fp8_descale is not None
            or torch.compiler.is_compiling()):  # (traced shapes may be symbolic)
        return Problem.of(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                          window_right, softcap, deterministic, alibi_slopes, dropout_p, dropout_seed, v.shape[-1],
                          fp8_descale)
    return _batched_problem(q.shape, k.shape, v.shape[-1], softmax_scale, window_left, window_right, softcap,
                            dropout_p, deterministic)


@functools.lru_cache(maxsize=1024)
def _batched_problem(q_shape, k_shape, head_dim_v, softmax_scale, window_left, window_right, softcap, dropout_p,
                     deterministic):
    """A batched problem that holds no tensor, by the shapes and scalars it is made of: a model asks
    for the same few in every layer and step, and the plans that follow are remembered per problem
    (dispatch.forward_plan).  (Problem.of reads only the shapes of batched q and k.)"""
    q, k = torch.empty(q_shape, device="meta"), torch.empty(k_shape, device="meta")
    return Problem.of(q, k, None, None, q_shape[1], k_shape[1], softmax_scale, window_left, window_right, softcap,
                      deterministic, None, dropout_p, None, head_dim_v)


def _saved_shape(p, version: str, lse_shape):
    # FlashAttention-1 keeps the paper's running max m and row sum l for its backward.
    return (2, *lse_shape) if version == "v1" and not p.empty else (0,)


def _forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
             alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], dropout_seed: Optional[Tensor],
             fp8_descale: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
             window_left: int, window_right: int, softcap: float, dropout_p: float, version: str,
             deterministic: bool, kernel_options: str) -> tuple[Tensor, Tensor, Tensor]:
    p = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q, max_seqlen_k,
                 softmax_scale, window_left, window_right, softcap, dropout_p, fp8_descale=fp8_descale)
    if p.varlen and p.seqused:  # (tables made from offsets api.py checked are not read again)
        validation.check_row_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    elif p.varlen:
        validation.check_offset_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    plan = dispatch.forward_plan(p, version, dispatch.target_of(p, q, k, v), _options(kernel_options))
    with on_device_of(q):
        out, lse, saved = dispatch.run_forward(plan, p, q, k, v)
        if sinks is not None:
            out, lse, saved = attention_sinks.join(p.varlen, out, lse, saved, sinks)
        if p.seqused:  # (the rows no kernel writes, as the op's outputs: what backwards read too)
            out, lse = _unused_rows_cleared(out, lse, cu_seqlens_q)
    return out, lse, saved


def _unused_rows_cleared(out, lse, bounds_q):
    """out 0 and lse +inf on the rows of q outside every sequence's (start, end) bounds (the
    sequences' row ranges are disjoint: +1 at each start, -1 at each end, summed)."""
    edges = torch.zeros(out.shape[0] + 1, dtype=torch.int32, device=out.device)
    edges.index_add_(0, bounds_q[:, 0].long(), torch.ones_like(bounds_q[:, 0]))
    edges.index_add_(0, bounds_q[:, 1].long(), -torch.ones_like(bounds_q[:, 1]))
    used = edges.cumsum(0)[:-1] > 0
    return torch.where(used[:, None, None], out, 0.0), torch.where(used, lse, float("inf"))


attention_forward = torch.library.custom_op("flashtile::attention_forward", _forward, mutates_args=())


@attention_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, dropout_seed, fp8_descale, max_seqlen_q,
      max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, version, deterministic,
      kernel_options):
    p = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q, max_seqlen_k,
                 softmax_scale, window_left, window_right, softcap, dropout_p, fp8_descale=fp8_descale)
    lse_shape = p.row_stat_shape(q.shape[0])
    return (q.new_empty(*q.shape[:-1], v.shape[-1], dtype=p.out_dtype(q)), q.new_empty(lse_shape, dtype=torch.float32),
            q.new_empty(_saved_shape(p, version, lse_shape), dtype=torch.float32))


def _backward_kernels(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                      lse: Tensor, saved: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                      alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor], max_seqlen_q: int,
                      max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                      dropout_p: float, version: str, deterministic: bool,
                      kernel_options: str) -> tuple[Tensor, Tensor, Tensor]:
    p = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, max_seqlen_q, max_seqlen_k,
                 softmax_scale, window_left, window_right, softcap, dropout_p, deterministic)
    plan = dispatch.backward_plan(p, version, dispatch.target_of(p, q, k, v, dout), _options(kernel_options))
    with on_device_of(q):
        return dispatch.run_backward(plan, p, dout, dlse, q, k, v, out, lse, saved)


attention_backward = torch.library.custom_op("flashtile::attention_backward", _backward_kernels, mutates_args=())


@attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, saved, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, alibi, sinks, seed, _fp8_descale, *ctx.args = inputs  # FP8: forward only
    out, lse, saved = output
    ctx.save_for_backward(q, k, v, out, lse, saved, cu_q, cu_k, alibi, seed, sinks)
    ctx.set_materialize_grads(False)


def differentiable_once(grads, graphed):
    """The gradients ``grads`` (tensors or None) of a backward; where ``graphed`` (a backward
    under ``create_graph=True`` whose inputs need gradients) through a node that raises if they
    are differentiated again (as ``once_differentiable``'s, but also when only q, k, v need
    gradients: a gradient penalty's second-order term would otherwise be missing without a word)."""
    if not (graphed and torch.is_grad_enabled()):
        return grads
    given = [g for g in grads if g is not None]
    refuse = autograd_functions.DelayedError(
        b"flashtile's attention is differentiable once: a second derivative (create_graph=True through "
        b"its backward, e.g. a gradient penalty) is not supported", len(given))
    refused = iter(refuse(*(g.detach().requires_grad_() for g in given)))
    return tuple(None if g is None else next(refused) for g in grads)


def check_differentiation_mode(q, k, v):
    """flashtile's autograd is reverse mode, once: refuse what would otherwise drop derivatives."""
    if torch.compiler.is_compiling():
        return
    tensors = (q, k, v)
    if torch._C._functorch.maybe_current_level() is not None and any(
            map(torch._C._functorch.is_functorch_wrapped_tensor, tensors)):
        raise NotImplementedError("flashtile does not support torch.func transforms (grad, vmap, jvp, jacrev, ...): "
                                  "differentiate with torch.autograd (loss.backward() or torch.autograd.grad)")
    if forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(x).tangent is not None for x in tensors):
        raise NotImplementedError("flashtile does not support forward-mode AD (torch.autograd.forward_ad dual "
                                  "tensors): it has no jvp; use reverse mode (torch.autograd)")


def _gradients(ctx, dout, dlse, backward_op):
    """(dq, dk, dv, None...) for the op's inputs, differentiable once (``differentiable_once``)."""
    saved = ctx.saved_tensors  # unpacked once: each read unpacks every saved tensor
    with torch.no_grad():
        grads = _first_derivatives(ctx, saved, dout, dlse, backward_op)
    q, k, v = saved[:3]
    sinks = saved[-1]
    grads = differentiable_once(grads, any(x is not None and x.requires_grad for x in (q, k, v, sinks, dout, dlse)))
    dq, dk, dv, *dsinks = grads
    return (dq, dk, dv, None, None, None, dsinks[0] if dsinks else None, None, None, *(None for _ in ctx.args))


def _first_derivatives(ctx, saved_tensors, dout, dlse, backward_op):
    """dq, dk, dv, and d sinks where the sinks need a gradient."""
    q, k, v, out, lse, saved, cu_q, cu_k, alibi, seed, sinks = saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    # Unit stride along head_dim, and rows the kernels' 32-bit offsets reach (q passed that
    # check with a contiguous layout, so a contiguous dout does too).
    if dout.stride(-1) != 1 or dout.stride(-3) * dout.shape[-3] >= validation.MAX_SEQUENCE_SPAN:
        dout = dout.contiguous()
    # A loss that uses the logsumexp contributes through dlse (folded into D by the kernels);
    # None, the usual case, costs nothing.
    if dlse is not None:
        dlse = dlse.contiguous()
    grads = backward_op(dout, dlse, q, k, v, out, lse, saved, cu_q, cu_k, alibi, seed, *ctx.args)
    if sinks is None or not ctx.needs_input_grad[6]:
        return grads
    return (*grads, attention_sinks.gradient(cu_q is not None, sinks, out, lse, dout, dlse))


torch.library.register_autograd("flashtile::attention_forward",
                                lambda ctx, dout, dlse, dsaved: _gradients(ctx, dout, dlse, attention_backward),
                                setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom op's forward and backward, without its autograd wrapper (see the module doc)."""

    @staticmethod
    def forward(ctx, *inputs):  # ctx in forward: a separate setup_context costs a signature bind per call
        output = _forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse, dsaved):
        return _gradients(ctx, dout, dlse, _backward_kernels)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, dropout_seed, fp8_descale, max_seqlen_q,
              max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, version, deterministic,
              kernel_options):
    """(out, lse, saved) with autograd: the custom op under torch.compile, else the Function."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, dropout_seed, fp8_descale, max_seqlen_q,
            max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, version, deterministic,
            kernel_options)
    if torch.compiler.is_compiling():
        return attention_forward(*args)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (sinks is not None and sinks.requires_grad))):
        return _forward(*args)  # nothing to differentiate: no autograd node to build
    return _EagerAttention.apply(*args)
