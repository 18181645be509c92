"""FP8 attention for bf16/fp16 users: quantize, attend in float8, differentiate.

``fp8_attn_func`` quantizes Q, K and V to a float8 type with one scale per block of the FP8
kernel's tiles (BLOCK_M rows of a query head, BLOCK_N rows of a KV head, the plan's own) or per
(sequence, KV head), optionally after incoherent processing: Q and K are
multiplied by the same random orthogonal matrix M = D H / sqrt(d) along the head dim (D a fixed
random ±1 diagonal, H the Sylvester Hadamard matrix), which leaves Q Kᵀ unchanged but spreads
an outlier's magnitude over the whole head dim before it sets the scale (per block, one kernel
rotates and quantizes: kernels/quantize.py).  The forward runs the
FP8 kernel (both matmuls in float8).  The gradient goes straight through the quantization, taken
at the forward's own operands (the float8 Q, K, V, Q and K rotated): by default the bf16/fp16
kernels run on their dequantized copies with the FP8 forward's output and logsumexp (every
backward matmul in the input precision); with ``fp8_backward`` the backward kernels take the
float8 operands themselves, dO quantized per block and dS per row, and all five matmuls run in
float8.  Either way the scores are recomputed as the forward formed them, and the gradients of
the rotated Q and K are rotated back.
"""
import functools

import torch
import torch.nn.functional as F

from flashtile import api, dispatch, ops, options, validation
from flashtile import sinks as attention_sinks
from flashtile.kernels.configs import WARPGROUP_ROWS
from flashtile.kernels.quantize import blocks as fused_quantize_blocks
from flashtile.kernels.problem import Problem, cdiv

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@functools.lru_cache(maxsize=None)
def _rotation_cpu(head_dim: int) -> torch.Tensor:
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < head_dim:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(head_dim)) * 2 - 1
    return signs[:, None].float() * hadamard / head_dim ** 0.5


# Kept per device (and type): a copy from host memory at every call would wait for the work
# queued on the GPU before it, exposing the call's Python time.  Read only.
@functools.lru_cache(maxsize=None)
def rotation(head_dim: int, device) -> torch.Tensor:
    """The orthogonal (head_dim, head_dim) float32 matrix D H / sqrt(head_dim) of incoherent
    processing (head_dim a power of two)."""
    return _rotation_cpu(head_dim).to(device)


@functools.lru_cache(maxsize=None)
def rotation_signs(head_dim: int, dtype, device) -> torch.Tensor:
    """D H, the ±1 matrix of ``rotation`` before its 1 / sqrt(head_dim), in ``dtype``."""
    return (_rotation_cpu(head_dim) * head_dim ** 0.5).round().to(device=device, dtype=dtype)


def _scaled(x, dims, dtype):
    """x over the amax of its finite values along ``dims`` mapped to ``dtype``'s largest value,
    in float32, and that descale (at least float32's smallest normal, also for all zeros).  A
    value that is not finite sets no scale and comes out NaN: non-finite in its own place only.
    (The amax is taken in x's own type, exactly; one float32 copy is made, scaled in place.)"""
    finite = x.isfinite()
    amax = torch.where(finite, x.abs(), 0).amax(dim=dims, keepdim=True).float()
    descale = (amax / FP8_MAX[dtype]).clamp(min=torch.finfo(torch.float32).tiny)
    scaled = x.to(torch.float32, copy=True)
    return scaled.div_(descale).masked_fill_(~finite, float("nan")), descale


def quantize(x, heads_k: int, dtype):
    """x (batch, seqlen, heads, d) in float8 ``dtype`` and its descale (batch, heads_k) float32:
    the amax of each (sequence, KV head group) mapped to the type's largest value."""
    batch, seqlen, heads, d = x.shape
    scaled, descale = _scaled(x.reshape(batch, seqlen, heads_k, heads // heads_k, d), (1, 3, 4), dtype)
    return scaled.view_as(x).to(dtype), descale.view(batch, heads_k)


def quantize_blocks(x, rows: int, dtype):
    """x (batch, seqlen, heads, d) in float8 ``dtype`` and its descale (batch, heads, blocks)
    float32: one scale per ``rows`` rows of each head (the last block may be short).  In PyTorch
    operations: the reference of the fused kernel ``fp8_attn_func`` runs (kernels/quantize.py)."""
    batch, seqlen, heads, d = x.shape
    blocks = cdiv(seqlen, rows)
    padded = F.pad(x, (0, 0, 0, 0, 0, blocks * rows - seqlen)).view(batch, blocks, rows, heads, d)
    scaled, descale = _scaled(padded, (2, 4), dtype)
    quantized = scaled.view(batch, blocks * rows, heads, d)[:, :seqlen]
    return quantized.to(dtype), descale.view(batch, blocks, heads).transpose(1, 2)


def _kernel_tiles(q, k, v, scale, left, right, softcap, alibi_slopes, version, kernel_options):
    """(rows, keys) of the blocks the FP8 forward the dispatcher picks for these tensors scales
    by: v2's (BLOCK_M, BLOCK_N), or the Gluon kernel's (a consumer's rows, BLOCK_N)."""
    marker = torch.empty(3, 1, 1, 1)  # descales per block: the FP8 problem the kernel will see
    p = Problem.of(q, k, None, None, q.shape[1], k.shape[1], scale, left, right, softcap, alibi_slopes=alibi_slopes,
                   fp8_descale=marker)
    plan = dispatch.forward_plan(p, version, dispatch.target_of(p, q, k, v), ops._options(kernel_options))
    if plan.kernel == "v3-gluon":
        return WARPGROUP_ROWS, plan.config.block_n
    return plan.config.block_m, plan.config.block_n


# The rows of a block that spans any sequence: per-(sequence, KV head) descales as one block each
# (a power of two, which every tile divides; one value, so the backward kernels compile once).
WHOLE_SEQUENCE_ROWS = 1 << 30


def _head_descales_as_blocks(descale, heads_q):
    """Per-(sequence, KV head) descales (3, batch, heads_k) as per-block ones (3, batch, heads_q,
    1) whose one block spans every row, and those rows."""
    blocks = descale.new_zeros(3, descale.shape[1], heads_q, 1)
    blocks[0, ..., 0] = descale[0].repeat_interleave(heads_q // descale.shape[2], dim=1)  # Q: per query head
    blocks[1:, :, :descale.shape[2], 0] = descale[1:]  # K, V: per KV head, as in _quantized
    return blocks, (WHOLE_SEQUENCE_ROWS, WHOLE_SEQUENCE_ROWS)


def _quantized(q, k, v, dtype, per_block, tiles, incoherent):
    """q, k, v in float8 and the descales the FP8 kernel reads for them (q and k rotated first
    with ``incoherent``: per block, inside the quantizing kernel)."""
    if not per_block:
        if incoherent:
            m = rotation(q.shape[-1], q.device)
            q, k = q.float() @ m, k.float() @ m
        (q8, qd), (k8, kd), (v8, vd) = (quantize(x, k.shape[2], dtype) for x in (q, k, v))
        return q8, k8, v8, torch.stack([qd, kd, vd])
    top = FP8_MAX[dtype]
    signs = rotation_signs(q.shape[-1], q.dtype, q.device) if incoherent else None
    (q8, qd), (k8, kd), (v8, vd) = (fused_quantize_blocks(x, rows, dtype, top, rot) for x, rows, rot
                                    in ((q, tiles[0], signs), (k, tiles[1], signs), (v, tiles[1], None)))
    descale = torch.zeros(3, q.shape[0], q.shape[2], max(qd.shape[-1], kd.shape[-1]), device=q.device)
    descale[0, :, :, :qd.shape[-1]] = qd
    descale[1, :, :k.shape[2], :kd.shape[-1]] = kd
    descale[2, :, :k.shape[2], :vd.shape[-1]] = vd
    return q8, k8, v8, descale


def dequantize(x8, descale, rows: int, dtype):
    """x8 (batch, seqlen, heads, d) in float8 times its descales (batch, heads or more, blocks),
    one per ``rows`` rows of a head, in ``dtype``."""
    block = torch.arange(x8.shape[1], device=x8.device) // rows
    per_row = descale[:, :x8.shape[2]].transpose(1, 2)[:, block]  # (batch, seqlen, heads)
    return (x8.float() * per_row[..., None]).to(dtype)


class _FP8Attention(torch.autograd.Function):
    """The FP8 forward; its backward differentiates at the forward's own operands (the float8
    values, Q and K rotated), straight through the quantization, in float8 (``fp8_backward``)
    or in the input type on their dequantized copies.  Either way P is recomputed from the
    scores the forward formed (up to the copies' rounding to the input type), which its
    logsumexp normalizes."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, left, right, softcap, alibi_slopes, dtype, incoherent, per_block,
                fp8_backward, kernel_options):
        version = dispatch.resolve_version("auto", q.device)
        tiles = (_kernel_tiles(q, k, v, scale, left, right, softcap, alibi_slopes, version, kernel_options)
                 if per_block else None)
        q8, k8, v8, descale = _quantized(q, k, v, dtype, per_block, tiles, incoherent)
        out, lse, _ = ops._forward(q8, k8, v8, None, None, alibi_slopes, sinks, None, descale,
                                   q.shape[1], k.shape[1], scale, left, right, softcap, 0.0, version, False,
                                   kernel_options)
        out = out.to(q.dtype)
        if not per_block:
            descale, tiles = _head_descales_as_blocks(descale, q.shape[2])
        ctx.save_for_backward(q8, k8, v8, descale, out, lse, alibi_slopes, sinks)
        ctx.state = (tuple(tiles), incoherent, q.dtype, fp8_backward)
        ctx.args = (q.shape[1], k.shape[1], scale, left, right, softcap, 0.0, kernel_options)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        with torch.no_grad():
            grads = _FP8Attention._first_derivatives(ctx, dout, dlse)
        # (a backward under create_graph=True runs with grad mode on: differentiable_once checks it)
        return (*ops.differentiable_once(grads, True), *(None for _ in range(10)))

    @staticmethod
    def _first_derivatives(ctx, dout, dlse):
        """dq, dk, dv and the sinks' gradient (None where they need none)."""
        q8, k8, v8, descale, out, lse, alibi_slopes, sinks = ctx.saved_tensors
        rows, incoherent, dtype, fp8_backward = ctx.state
        seqlen_q, seqlen_k, scale, left, right, softcap, dropout_p, kernel_options = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dout, dlse = dout.contiguous(), None if dlse is None else dlse.contiguous()
        version = dispatch.resolve_version("auto", out.device)
        if fp8_backward:
            p = Problem.of(q8, k8, None, None, seqlen_q, seqlen_k, scale, left, right, softcap,
                           alibi_slopes=alibi_slopes, fp8_descale=descale, fp8_rows=rows)
            plan = dispatch.backward_plan(p, version, dispatch.target_of(p, q8, k8, v8, dout),
                                          ops._options(kernel_options))
            dq, dk, dv = dispatch.run_backward(plan, p, dout, dlse, q8, k8, v8, out, lse, lse.new_empty(0))
        else:
            q, k, v = (dequantize(x8, d, n, dtype) for x8, d, n in zip((q8, k8, v8), descale, (*rows, rows[1])))
            dq, dk, dv = ops._backward_kernels(dout, dlse, q, k, v, out, lse, lse.new_empty(0), None, None,
                                               alibi_slopes, None, seqlen_q, seqlen_k, scale, left, right, softcap,
                                               dropout_p, version, False, kernel_options)
        if incoherent:  # Q M and K M were quantized: dQ = d(Q M) M^T, likewise dK
            m = rotation(q8.shape[-1], q8.device)
            dq, dk = dq.float() @ m.T, dk.float() @ m.T
        # The sinks' gradient from the output and logsumexp (which includes them), as in bf16.
        dsinks = attention_sinks.gradient(False, sinks, out, lse, dout, dlse) if ctx.needs_input_grad[3] else None
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), dsinks


def fp8_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  dtype=torch.float8_e4m3fn, incoherent=True, scaling="block", return_softmax_lse=False,
                  fp8_backward=False, *, alibi_slopes=None, sinks=None, kernel_options=None):
    """Attention of bf16/fp16 q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k,
    nheads_k, headdim) computed in float8 ``dtype`` (e4m3 or e5m2), with incoherent processing
    of Q and K unless ``incoherent=False`` (head dims a power of two, 16 to 256), and scales per
    block of the kernel's tiles (``scaling="block"``) or per (sequence, KV head) ("head").
    Returns out in q's dtype (and the logsumexp), differentiable with respect to q, k and v:
    the backward's matmuls in q's dtype, or with ``fp8_backward=True`` in ``dtype`` as well.
    ``alibi_slopes``, ``sinks``: as flash_attn_func's (the sinks' gradient too), on the scores
    the float8 product forms.
    ``kernel_options``: developer switches (options.KernelOptions)."""
    validation.check_qkv(q, k, v, False)
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    head_dim = q.shape[-1]
    if head_dim != v.shape[-1] or head_dim % 16 or (incoherent and head_dim & (head_dim - 1)):
        raise ValueError(f"fp8_attn_func takes one head dim, a multiple of 16 (a power of two with incoherent "
                         f"processing), got {head_dim} and {v.shape[-1]}")
    version = dispatch.resolve_version("auto", q.device)
    validation.fp8_takes(version, head_dim, q.device)
    softcap = validation.real("softcap", softcap, 0.0)
    alibi_slopes = validation.alibi_slopes(alibi_slopes, q.shape[0], q.shape[-2], q.device)
    sinks = validation.sinks(sinks, q.shape[-2], q.device)
    scale = validation.softmax_scale(softmax_scale, head_dim)
    left, right = validation.band(bool(causal), window_size, q.shape[1], k.shape[1])
    if scaling not in ("block", "head"):
        raise ValueError(f"scaling must be 'block' or 'head', got {scaling!r}")
    ops.check_differentiation_mode(q, k, v)
    if not (q.numel() and k.numel()):  # nothing to quantize: the same empty result as in q's type
        res = api.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  return_attn_probs=return_softmax_lse, sinks=sinks, kernel_options=kernel_options)
        return res[:2] if return_softmax_lse else res
    text = options.text(options.resolve(kernel_options))
    with ops.on_device_of(q):
        out, lse = _FP8Attention.apply(q, k, v, sinks, scale, left, right, softcap, alibi_slopes, dtype,
                                       bool(incoherent), scaling == "block", bool(fp8_backward), text)
    return (out, lse) if return_softmax_lse else out


