"""Compile every kernel for sm_90 on any machine (no GPU needed) and report what Hopper got.

For each kernel: whether the PTX uses wgmma and TMA, whether TTGIR is warp-specialized,
shared memory, and compile errors.  ``--dump DIR`` writes the TTGIR/PTX (and the cubin) for reading;
``--loops`` adds each hot loop's SASS (sass_loops.py: instructions, HGMMAs, spill traffic).

    python scripts/compile_sm90.py --loops --dump /tmp/sm90
"""
import argparse
import pathlib
from dataclasses import replace
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from flashtile import dispatch, gpu, sinks
from flashtile.kernels import configs, decode, dropout, packed_tiles, quantize, score, tma, v1, v2, v3
from flashtile.kernels.gluon import backward as gluon_bwd
from flashtile.kernels.gluon import backward_fp8 as gluon_bwd_fp8
from flashtile.kernels.gluon import forward as gluon_fwd
from flashtile.kernels.problem import Problem, contiguous_strides, padded_head_dim
from flashtile.options import KernelOptions
from sass_loops import describe

FP32_POINTERS = {"DESCALE", "DO_DESCALE", "DO_BOUND", "DO_FACTORS", "LSE", "DELTA", "M", "L", "OACC", "DQACC", "DLSE", "SINKS", "JOINED", "SHARE", "PART_O",
                 "PART_LSE"}
INT_POINTERS = {"CU", "CU_Q", "CU_K", "CU_NEW", "ROTARY_STARTS", "ENDS", "LEFTPAD", "BATCH_IDX", "BLOCK_TABLE", "TILES", "COUNT"}
INT64_POINTERS = {"SEED"}
INT8_POINTERS = {"KEPT"}
FLOAT_SCALARS = {"scale_log2", "softmax_scale", "dropout_p", "fp8_max", "rotation_scale"}
FP8_POINTERS = {"OUT"}  # the quantizing kernel's output
TUPLES = {"totals": ("i32", "i32", "i32", "i32"), "score_args": ("fp32",), "counter": ("*i64", "i64")}
ALIBI_TUPLES = dict(TUPLES, score_args=("fp32", "*fp32", "i32"))  # softcap, slopes, their batch stride


def signature(fn, dtype, constexprs, descriptors=None, tuples=TUPLES, pointers=None):
    """Triton signature strings; ``descriptors`` maps tensor-descriptor arguments to (block, layout)
    or (block, layout, element type); ``tuples`` the types inside tuple arguments; ``pointers``
    pointer types by name where they differ from the rules below."""
    sig = {}
    for param in fn.params:
        name = param.name
        if pointers and name in pointers:
            sig[name] = pointers[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name in tuples:
            sig[name] = tuples[name]
        elif descriptors and name in descriptors:
            block, layout, *element = descriptors[name]  # (block, layout[, element type if not dtype])
            sig[name] = f"tensordesc<{element[0] if element else dtype}[{', '.join(map(str, block))}],{layout}>"
        elif name.isupper():
            sig[name] = ("*fp32" if name in FP32_POINTERS else "*i32" if name in INT_POINTERS else
                         "*i64" if name in INT64_POINTERS else "*i8" if name in INT8_POINTERS else
                         "*fp8e4nv" if name in FP8_POINTERS else
                         "*bf16" if name == "O" and dtype.startswith("fp8") else f"*{dtype}")
        else:
            sig[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return sig


def aligned(fn, sig):
    """Triton's launch-time hints for pointers and strides (``s`` + lower case) as a GPU launch
    of contiguous tensors gives them: divisible by 16, which lets loads vectorize."""
    return {(i,): [["tt.divisibility", 16]] for i, param in enumerate(fn.params)
            if str(sig.get(param.name, "")).startswith("*") or (sig.get(param.name) == "i32" and param.name[0] == "s"
                                                           and param.name[1:].isalpha() and param.name.islower())}


def compile_one(fn, dtype, constexprs, options, descriptors=None, tuples=TUPLES, hints=False, pointers=None):
    source = GluonASTSource if fn.is_gluon() else ASTSource
    # Tuple elements specialized to constants: keyed (argument index, element index) for triton.
    elements = {key: value for key, value in constexprs.items() if isinstance(key, tuple)}
    constexprs = {key: value for key, value in constexprs.items() if not isinstance(key, tuple)}
    tuples = dict(tuples)
    for (name, i), value in elements.items():
        types = list(tuples[name])
        types[i] = "constexpr"
        tuples[name] = tuple(types)
        constexprs[(fn.arg_names.index(name), i)] = value
    sig = signature(fn, dtype, constexprs, descriptors, tuples, pointers)
    src = source(fn, sig, constexprs, aligned(fn, sig) if hints else None)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def problem(head_dim, causal=False, window_left=-1, softcap=0.0, seqlen=4096, alibi=False):
    return Problem(1, 16, 16, seqlen, seqlen, head_dim, 0.1, window_left, 0 if causal else -1, None, None,
                   softcap=softcap, alibi_slopes=torch.zeros(16) if alibi else None)


FP8_DTYPES = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
SHARED_MEMORY_LIMIT = 232448  # bytes a block may take on sm_90


def gluon_case(head_dim, opts, causal=False, window_left=-1, softcap=0.0, alibi=False, fp8=None, fp8_mode=1,
               varlen=False, dropout=False, head_dim_v=None):
    """v3's Gluon forward with the constants, launch options and descriptor blocks of its launch as
    gluon/forward.py builds it (_ForwardLaunch, on a GPU of 132 SMs); ``window_left`` >= 0: a
    sliding window's left edge, tested in the kernel only then; ``fp8`` (a triton float8 type
    name): float8 inputs with descales per head (``fp8_mode`` 1) or block (2); ``varlen``: packed
    sequences (cu_seqlens); ``dropout``: with dropout; ``head_dim_v``: V's own."""
    p = problem(head_dim, causal, window_left, softcap, alibi=alibi)
    if head_dim_v not in (None, head_dim):
        p = replace(p, own_head_dim_v=head_dim_v)
    if dropout:
        p = replace(p, dropout_p=0.1)
    if varlen:
        offsets = torch.zeros(2, dtype=torch.int32)
        p = replace(p, cu_seqlens_q=offsets, cu_seqlens_k=offsets, total_q=p.seqlen_q, total_k=p.seqlen_k)
    if fp8:
        p = replace(p, fp8=True, fp8_per_block=fp8_mode == 2)
    dtype = FP8_DTYPES[fp8] if fp8 else torch.bfloat16
    cfg = dispatch.gluon_schedule(p, opts)
    q_shape = (p.total_q, p.heads_q, p.head_dim) if varlen else (p.batch, p.seqlen_q, p.heads_q, p.head_dim)
    k_shape = (*q_shape[:-2], p.heads_k, p.head_dim)
    v_shape = (*k_shape[:-1], p.head_dim_v)
    with mock.patch.object(gpu, "sm_count", lambda index: 132):
        strides = (contiguous_strides(shape) for shape in (q_shape, k_shape, v_shape))
        launch = gluon_fwd._ForwardLaunch(p, cfg, dtype, q_shape, *strides, 0)
    consts = dict(launch.launch.constants)
    options = {name: consts.pop(name) for name in ("num_warps", "maxnreg") if name in consts}
    return {**consts, **walk_constants(p)}, options, descriptor_blocks(launch.specs)


def descriptor_blocks(specs):
    """compile_one's descriptor blocks, (block, layout, element type), of a launch's descriptor
    specs (launch.descriptor_spec: the string starts with the torch dtype)."""
    blocks = {}
    for name, (block, layout, spec) in specs.items():
        dtype = getattr(torch, spec.split("[", 1)[0].removeprefix("torch."))
        blocks[name] = (block, layout, str(tma._GL_DTYPES[dtype]))
    return blocks


def walk_constants(p):
    """What triton specializes into constants at launch (arguments equal to 1, tuple elements
    too, keyed (name, index)): without a band head_group 1 (one head's tiles adjacent); the
    cu_seqlens strides in ``totals`` (Problem.totals)."""
    consts = {} if p.banded else dict(head_group=1)
    consts.update({("totals", i): 1 for i, x in enumerate(p.totals) if x == 1})
    return consts


def gluon_bwd_case(head_dim, opts, dq_pass, dq_reduce=False, persistent=True, causal=False, softcap=0.0,
                   alibi=False, varlen=False, dropout=False, head_dim_v=None):
    """One of v3's Gluon backward kernels with the constants, launch options and descriptor blocks
    of its launch as gluon/backward.py builds it (_PassLaunch, on a GPU of 132 SMs);
    ``dq_reduce``: the dK/dV kernel adding dQ by TMA (the single pass); ``persistent``: 4k tokens,
    more tiles than SMs, so persistent where the pass can be (two stationary slots, tiles strided
    over or, ``causal`` or ``varlen``, taken from the tile counter), else 1k tokens, as few tiles
    as SMs (a CTA per tile); ``varlen``: on packed sequences (the two passes); ``dropout``: with
    dropout (the two passes); ``head_dim_v``: V's own head dim (the two passes)."""
    b = gluon_bwd
    p = problem(head_dim, causal, softcap=softcap, alibi=alibi, seqlen=4096 if persistent else 1024)
    if head_dim_v not in (None, head_dim):
        p = replace(p, own_head_dim_v=head_dim_v)
    if dropout:
        p = replace(p, dropout_p=0.1)
    if varlen:
        offsets = torch.zeros(2, dtype=torch.int32)
        p = replace(p, cu_seqlens_q=offsets, cu_seqlens_k=offsets, total_q=p.seqlen_q, total_k=p.seqlen_k)
    cfg = dispatch.gluon_backward_config(p, opts, dq_reduce)
    with mock.patch.object(gpu, "sm_count", lambda index: 132):
        kernel = b._dq_kernel if dq_pass else b._dkdv_kernel
        launch = b._PassLaunch(kernel, p, cfg, torch.bfloat16, 0, not dq_pass, dq_reduce, False)
    consts = dict(launch.launch.constants)
    options = {name: consts.pop(name) for name in ("num_warps", "maxnreg")}
    return {**consts, **walk_constants(p)}, options, descriptor_blocks(launch.specs)


def gluon_bwd_fp8_case(head_dim, opts, fp8, keys, causal=False, softcap=0.0, alibi=False, grads=None):
    """A float8 pass (gluon/backward_fp8.py; ``keys``: a dK/dV pass, forming ``grads``, else the
    dQ pass) as its launch builds it (PassLaunch, 132 SMs, 4k tokens): descales per block of the
    Gluon forward's float8 tiles."""
    p = problem(head_dim, causal, softcap=softcap, alibi=alibi)
    rows = (configs.WARPGROUP_ROWS, configs.by_head_dim(configs.V3_GLUON_FP8, p.head_dim_pad).block_n)
    p = replace(p, fp8=True, fp8_per_block=True, fp8_rows=rows)
    cfg = dispatch.gluon_backward_config(p, opts, False)
    with mock.patch.object(gpu, "sm_count", lambda index: 132):
        launch = gluon_bwd_fp8.PassLaunch(p, cfg, FP8_DTYPES[fp8], 0, keys)
    consts = dict(launch.constants, **(dict(GRADS=grads) if keys else {}))
    options = {name: consts.pop(name) for name in ("num_warps", "maxnreg")}
    return {**consts, **walk_constants(p)}, options, descriptor_blocks(launch.specs)


def gluon_bwd_fp8_cases(head_dim, opts, fp8, **features):
    """(name, kernel, constants, options, descriptors) of the float8 passes, plain and causal:
    the dQ pass, and the dK/dV pass (at d256 a dV pass and a dK pass: backward_fp8.key_passes)."""
    pad = problem(head_dim, False).head_dim_pad
    passes = [("dq", gluon_bwd_fp8._dq_kernel, False, None)]
    names = {gluon_bwd_fp8.GRAD_DK.value | gluon_bwd_fp8.GRAD_DV.value: "dkdv", gluon_bwd_fp8.GRAD_DK.value: "dk",
             gluon_bwd_fp8.GRAD_DV.value: "dv"}
    passes += [(names[grads], gluon_bwd_fp8._dkdv_kernel, True, grads) for grads in gluon_bwd_fp8.key_passes(pad)]
    for name, kernel, keys, grads in passes:
        for causal, suffix in ((False, ""), (True, "_causal")):
            yield (f"v3.bwd_{name}_gluon_fp8{suffix}", kernel,
                   *gluon_bwd_fp8_case(head_dim, opts, fp8, keys, causal=causal, grads=grads, **features))


def _options(cfg):
    return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def cases(head_dim=128, varlen=False, opts=KernelOptions(), softcap=0.0, alibi=False, with_dropout=False, fp8=None,
          fp8_mode=1, head_dim_v=None):
    """(name, kernel, constexprs, compile options, descriptor blocks) of every kernel as launched
    (``with_dropout``: the v1 and v2 kernels as dropout launches them; ``fp8``: the kernels that take
    float8 inputs, v2's forward and backward and the Gluon forward, as they launch for them;
    ``head_dim_v``: V's own head dim, the Gluon forward and the two backward passes alone)."""
    if head_dim_v not in (None, head_dim):
        # The backward passes as the dispatcher runs them: batched, without dropout, V no wider
        # than Q (dispatch._gluon_backward_takes).
        passes = not varlen and not with_dropout and padded_head_dim(head_dim_v) <= padded_head_dim(head_dim)
        features = dict(softcap=softcap, alibi=alibi)
        for causal in (False, True):
            name = '_causal' if causal else ''
            yield (f"v3.fwd_gluon{name}", gluon_fwd._fwd_kernel,
                   *gluon_case(head_dim, opts, causal=causal, head_dim_v=head_dim_v, varlen=varlen,
                               dropout=with_dropout, **features))
            if passes:
                yield (f"v3.bwd_dq_gluon{name}", gluon_bwd._dq_kernel,
                       *gluon_bwd_case(head_dim, opts, True, causal=causal, head_dim_v=head_dim_v, **features))
                yield (f"v3.bwd_dkdv_gluon{name}", gluon_bwd._dkdv_kernel,
                       *gluon_bwd_case(head_dim, opts, False, causal=causal, head_dim_v=head_dim_v, **features))
        return
    p = problem(head_dim, softcap=softcap, alibi=alibi)
    base = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=p.head_dim_pad, IS_VARLEN=varlen, UPCAST=False,
                SCORE=score.mod_of(p))
    yield "dropout.kept", dropout._kept_kernel, dict(BLOCK=dropout.KEYS_PER_GROUP), {}, None
    yield "quantize.blocks", quantize._blocks_kernel, dict(ROWS=128, HEAD_DIM=head_dim, HEAD_DIM_PAD=p.head_dim_pad,
                                                           ROTATE=True, UPCAST=False), dict(num_warps=8), None
    block_s, block_d = sinks.tiles(head_dim)
    rows = dict(BLOCK_D=block_d, BLOCK_S=block_s)
    yield "sinks.join", sinks._join_kernel, rows, {}, None
    yield "sinks.gradient", sinks._share_kernel, dict(rows, HAS_DLSE=True), {}, None
    # Decoding against a paged cache, GQA packed (one split writes the output itself), and the
    # combine of several splits.
    q = torch.empty(8, 1, 32, head_dim, dtype=torch.bfloat16)
    plan = dispatch.decode_plan(q, 8, 4096, 1, paged=True)
    split = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), BLOCK_M=plan.block_m,
                 BLOCK_N=plan.block_n, PAGED=True, HAS_ENDS=True, HAS_LEFTPAD=False, HAS_BATCH_IDX=False,
                 UPCAST=False, SCORE=score.mod_of(p), PDL=True, PAGE_SIZE=16)
    warps = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
    yield "decode.split", decode._split_kernel, dict(split, VARLEN_Q=False, SAME_STRIDES=True), warps, None
    # Queries of varying counts, packed (FlashAttention-3's cu_seqlens_q), a V cache of its own strides
    yield "decode.split_packed", decode._split_kernel, dict(split, VARLEN_Q=True, SAME_STRIDES=False), warps, None
    # The append and the queries' rotation, batched and packed (FlashAttention-3's
    # cu_seqlens_k_new and cu_seqlens_q, rotary from rotary_seqlens).
    for packed in (False, True):
        name = "_packed" if packed else ""
        yield f"decode.append{name}", decode._append_kernel, dict(
            HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), ROWS=16, PAGED=True, HAS_ENDS=True,
            HAS_BATCH_IDX=False, ROTARY=True, INTERLEAVED=False, PAGE_SIZE=16, PACKED=packed,
            HAS_ROTARY_STARTS=packed), dict(num_warps=4), None
        yield f"decode.rotate{name}", decode._rotate_kernel, dict(
            HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), ROWS=16, HAS_ENDS=True, ADVANCE=True,
            INTERLEAVED=True, PACKED=packed), dict(num_warps=4), None
    combine = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), SPLITS_PAD=16, PDL=True)
    for packed in (False, True):
        yield (f"decode.combine{'_packed' if packed else ''}", decode._combine_kernel, dict(combine, VARLEN_Q=packed),
               dict(num_warps=decode.COMBINE_WARPS, launch_pdl=True), None)
    f = dispatch.forward_plan(p, "v2", dispatch.HOPPER, opts).config
    v2_base = dict(base, DROPOUT=with_dropout, HEAD_DIM_V=head_dim, HEAD_DIM_V_PAD=p.head_dim_pad)
    # V's head-dim stride is 1 as launched (specialized): its keys' stride is, for float8.
    yield "v2.fwd", v2._fwd_kernel, dict(v2_base, BLOCK_M=f.block_m, BLOCK_N=f.block_n, NUM_STAGES=f.num_stages,
                                         FP8=False, svd=1), \
        _options(f), None
    # The FP8 backward (fp8_attn_func's): float8 operands with descales per block of the Gluon
    # forward's tiles (a consumer's 64 rows, BLOCK_N keys).
    rows = (configs.WARPGROUP_ROWS, configs.by_head_dim(configs.V3_GLUON_FP8, p.head_dim_pad).block_n)
    pb = replace(p, fp8=True, fp8_per_block=True, fp8_rows=rows) if fp8 else p
    kv, qc = dispatch.backward_plan(pb, "v2", dispatch.HOPPER, opts).config
    fp8_rows = dict(FP8=True, Q_ROWS=rows[0], KV_ROWS=rows[1]) if fp8 else dict(FP8=False, Q_ROWS=1, KV_ROWS=1)
    yield "v2.bwd_dkdv", v2._bwd_dkdv_kernel, dict(v2_base, BLOCK_M=kv.block_m, BLOCK_N=kv.block_n,
                                                   NUM_STAGES=kv.num_stages, DO_ROWS=kv.block_m, **fp8_rows), \
        _options(kv), None
    yield "v2.bwd_dq", v2._bwd_dq_kernel, dict(v2_base, BLOCK_M=qc.block_m, BLOCK_N=qc.block_n,
                                               NUM_STAGES=qc.num_stages, HAS_DLSE=False, DO_ROWS=kv.block_m,
                                               **fp8_rows), _options(qc), None
    c1 = dispatch.forward_plan(p, "v1", dispatch.HOPPER, opts).config
    yield "v1.fwd", v1._fwd_kernel, dict(v2_base, BLOCK_M=c1.block_m, BLOCK_N=c1.block_n), _options(c1), None
    c1 = dispatch.backward_plan(p, "v1", dispatch.HOPPER, opts).config
    yield "v1.bwd", v1._bwd_kernel, dict(v2_base, BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, HAS_DLSE=False), \
        _options(c1), None
    for banded in ((True,) if varlen else (False, True)):  # varlen always takes the banded loop
        p3 = problem(head_dim, causal=banded, softcap=softcap, alibi=alibi)
        plan = dispatch.v3_triton_forward(p3 if not varlen else problem(head_dim, True, softcap=softcap, alibi=alibi),
                                         dispatch.HOPPER, opts)
        c3 = plan.config
        yield f"v3.fwd{'_band' if banded else ''}", v3._fwd_kernel, dict(
            base, BLOCK_M=c3.block_m, BLOCK_N=c3.block_n, NUM_STAGES=c3.num_stages, UNMASKED=plan.unmasked,
            WARP_SPECIALIZE=plan.unmasked and c3.warp_specialize), _options(c3), None
    features = dict(softcap=softcap, alibi=alibi)
    fwd_features = dict(features, dropout=with_dropout)  # (the backward's two passes too, up to d128)
    fp8_features = dict(fwd_features, fp8=fp8, fp8_mode=fp8_mode)
    if varlen:  # the Gluon forward and the two-pass backward take packed sequences (not float8), walking
        # their tile lists
        yield "packed_tiles.list", packed_tiles._list_kernel, dict(TILE_M=128, SEQUENCES=1024, LAST_FIRST=True), {}, \
            None
        yield ("v3.fwd_gluon", gluon_fwd._fwd_kernel, *gluon_case(head_dim, opts, varlen=True, **fwd_features))
        yield ("v3.fwd_gluon_causal", gluon_fwd._fwd_kernel,
               *gluon_case(head_dim, opts, causal=True, varlen=True, **fwd_features))
        yield ("v3.fwd_gluon_window", gluon_fwd._fwd_kernel,
               *gluon_case(head_dim, opts, causal=True, window_left=512, varlen=True, **fwd_features))
        if not configs.split_head_dim(p.head_dim_pad):  # the two passes up to d128
            yield ("v3.bwd_dq_gluon", gluon_bwd._dq_kernel,
                   *gluon_bwd_case(head_dim, opts, True, varlen=True, **fwd_features))
            yield ("v3.bwd_dkdv_gluon", gluon_bwd._dkdv_kernel,
                   *gluon_bwd_case(head_dim, opts, False, varlen=True, **fwd_features))
            yield ("v3.bwd_dq_gluon_causal", gluon_bwd._dq_kernel,
                   *gluon_bwd_case(head_dim, opts, True, causal=True, varlen=True, **features))
            yield ("v3.bwd_dkdv_gluon_causal", gluon_bwd._dkdv_kernel,
                   *gluon_bwd_case(head_dim, opts, False, causal=True, varlen=True, **features))
    else:
        yield ("v3.fwd_gluon", gluon_fwd._fwd_kernel, *gluon_case(head_dim, opts, **fp8_features))
        yield ("v3.fwd_gluon_causal", gluon_fwd._fwd_kernel, *gluon_case(head_dim, opts, causal=True, **fp8_features))
        yield ("v3.fwd_gluon_window", gluon_fwd._fwd_kernel,
               *gluon_case(head_dim, opts, causal=True, window_left=512, **fp8_features))
        passes = fwd_features if not configs.split_head_dim(p.head_dim_pad) else features  # (dropout up to d128)
        yield ("v3.bwd_dq_gluon", gluon_bwd._dq_kernel, *gluon_bwd_case(head_dim, opts, True, **passes))
        yield ("v3.bwd_dkdv_gluon", gluon_bwd._dkdv_kernel,
               *gluon_bwd_case(head_dim, opts, False, **passes))
        if not configs.split_head_dim(p.head_dim_pad):  # up to d128
            # The two passes over a band's tiles (persistent, from the tile counter), and with a
            # CTA per tile (as few tiles as SMs).
            yield ("v3.bwd_dq_gluon_causal", gluon_bwd._dq_kernel,
                   *gluon_bwd_case(head_dim, opts, True, causal=True, **passes))
            yield ("v3.bwd_dkdv_gluon_causal", gluon_bwd._dkdv_kernel,
                   *gluon_bwd_case(head_dim, opts, False, causal=True, **passes))
            yield ("v3.bwd_dq_gluon_tile", gluon_bwd._dq_kernel,
                   *gluon_bwd_case(head_dim, opts, True, False, False, **features))
            yield ("v3.bwd_dkdv_gluon_tile", gluon_bwd._dkdv_kernel,
                   *gluon_bwd_case(head_dim, opts, False, False, False, **features))
            # The single pass (it does not split the head dim), after D and its zeroed dQ.
            yield ("v3.bwd_reduce_gluon", gluon_bwd._dkdv_kernel,
                   *gluon_bwd_case(head_dim, opts, False, True, **features))
        if fp8:
            yield from gluon_bwd_fp8_cases(head_dim, opts, fp8, softcap=softcap, alibi=alibi)
        if not configs.split_head_dim(p.head_dim_pad):
            yield ("v3.bwd_delta", gluon_bwd._delta_kernel, dict(HEAD_DIM=p.head_dim, HEAD_DIM_PAD=p.head_dim_pad,
                   BLOCK_M=64, HAS_DLSE=False, ZERO_DQ=True), dict(num_warps=4), None)


def _chain(e) -> str:
    """An exception's message with its causes', innermost last (Triton nests a kernel's errors)."""
    parts = []
    while e is not None:
        parts.append(str(e).splitlines()[-1] if str(e) else type(e).__name__)
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--head-dim-v", type=int, help="V's own head dim (the Gluon forward and backward passes alone)")
    ap.add_argument("--dump", type=pathlib.Path)
    ap.add_argument("--verbose", action="store_true", help="a failed compilation's whole message")
    ap.add_argument("--only", help="compile only the kernels of these names, comma-separated (e.g. v3.fwd)")
    ap.add_argument("--varlen", action="store_true", help="the variable-length (cu_seqlens) variants")
    ap.add_argument("--loops", action="store_true", help="each hot loop's SASS instruction mix")
    ap.add_argument("--options", default="", help="kernel options, as FLASHTILE_KERNEL_OPTIONS takes them")
    ap.add_argument("--softcap", type=float, default=0.0, help="compile the kernels with this softcap")
    ap.add_argument("--alibi", action="store_true", help="compile the kernels that take ALiBi with it")
    ap.add_argument("--dropout", action="store_true", help="compile the kernels that take dropout with it")
    ap.add_argument("--fp8", choices=("fp8e4nv", "fp8e5"),
                    help="compile the kernels that take float8 inputs (v2's, the Gluon forward) for them")
    ap.add_argument("--aligned", action="store_true",
                    help="pointers and strides divisible by 16, as a launch on contiguous tensors hints")
    ap.add_argument("--fp8-mode", type=int, choices=(1, 2), default=1,
                    help="descales per (sequence, KV head) (1) or per block (2)")
    args = ap.parse_args()
    opts = KernelOptions.parse(args.options)
    tuples = ALIBI_TUPLES if args.alibi else TUPLES
    for d in (int(x) for x in args.head_dims.split(",")):
        for name, fn, constexprs, options, descriptors in cases(d, args.varlen, opts, args.softcap, args.alibi,
                                                                  args.dropout, args.fp8, args.fp8_mode,
                                                                  args.head_dim_v):
            if args.only and name not in args.only.split(","):
                continue
            try:
                fp8 = args.fp8 and (name.startswith("v2.") or name.startswith("v3.fwd_gluon") or name.endswith(
                    ("_fp8", "_fp8_causal")))
                if fp8 and name == "v2.fwd":  # V keys-contiguous (tma.keys_contiguous)
                    constexprs = {**{k: v for k, v in constexprs.items() if k != "svd"}, "FP8": args.fp8_mode, "svs": 1}
                # The FP8 backward's gradients: v2's float32 (its dQ pass reads the bf16 dO for D),
                # the float8 Gluon passes' in dO's type.
                pointers = (dict(DQ="*fp32", DK="*fp32", DV="*fp32", **({"DO": "*bf16"} if name == "v2.bwd_dq" else {}))
                            if fp8 and name.startswith("v2.bwd") else
                            dict(DQ="*bf16", DK="*bf16", DV="*bf16") if fp8 and "_fp8" in name else None)
                k = compile_one(fn, args.fp8 if fp8 else "bf16", constexprs, options, descriptors, tuples, args.aligned,
                                pointers)
            except Exception as e:  # report and go on: one broken kernel should not hide the rest
                print(f"d{d:<4} {name:18} FAILED: {_chain(e) if args.verbose else str(e).splitlines()[0][:200]}")
                continue
            if k.metadata.shared > SHARED_MEMORY_LIMIT:
                print(f"d{d:<4} {name:18} FAILED: {k.metadata.shared} bytes of shared memory, more than sm_90's "
                      f"{SHARED_MEMORY_LIMIT}")
                continue
            ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
            print(f"d{d:<4} {name:18} wgmma={'wgmma.mma_async' in ptx!s:5} tma={'cp.async.bulk.tensor' in ptx!s:5} "
                  f"ws={'ttg.warp_specialize' in ttgir!s:5} smem={k.metadata.shared:>6} warps={k.metadata.num_warps}")
            if args.loops:
                for line in describe(k.asm["cubin"]):
                    print("      " + line)
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{name}_d{d}.ttgir").write_text(ttgir)
                (args.dump / f"{name}_d{d}.ptx").write_text(ptx)
                (args.dump / f"{name}_d{d}.cubin").write_bytes(k.asm["cubin"])


if __name__ == "__main__":
    main()
