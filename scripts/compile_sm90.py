"""Compile every kernel for sm_90 on any machine (no GPU needed) and report what Hopper got.

For each kernel: whether the PTX uses wgmma and TMA, whether TTGIR is warp-specialized,
shared memory, and compile errors.  ``--dump DIR`` writes the TTGIR/PTX (and the cubin) for reading;
``--loops`` adds each hot loop's SASS (sass_loops.py: instructions, HGMMAs, spill traffic).
"""
import argparse
import pathlib
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from flashtile.kernels import configs, v1, v2, v3, v3_gluon, v3_gluon_bwd
from flashtile.kernels.problem import Problem
from sass_loops import describe

FP32_POINTERS = {"LSE", "DELTA", "M", "L", "OACC", "DQACC", "DLSE"}
INT_POINTERS = {"CU_Q", "CU_K", "COUNTER"}
FLOAT_SCALARS = {"scale_log2", "softmax_scale"}


def signature(fn, dtype, constexprs, descriptors=None):
    """Triton signature strings; ``descriptors`` maps tensor-descriptor arguments to (block, layout)
    or (block, layout, element type)."""
    sig = {}
    for param in fn.params:
        name = param.name
        if name in constexprs:
            sig[name] = "constexpr"
        elif descriptors and name in descriptors:
            block, layout, *element = descriptors[name]  # (block, layout[, element type if not dtype])
            sig[name] = f"tensordesc<{element[0] if element else dtype}[{', '.join(map(str, block))}],{layout}>"
        elif name.isupper():
            sig[name] = "*fp32" if name in FP32_POINTERS else "*i32" if name in INT_POINTERS else f"*{dtype}"
        else:
            sig[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return sig


def compile_one(fn, dtype, constexprs, options, descriptors=None):
    source = GluonASTSource if fn.is_gluon() else ASTSource
    src = source(fn, signature(fn, dtype, constexprs, descriptors), constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def gluon_case(head_dim, causal=False, window_left=-1):
    """v3's Gluon forward with the constants and launch options v3_gluon.forward would use
    (FLASHTILE_V3_ABLATE and FLASHTILE_CONFIG_V3_GLUON apply); ``window_left`` >= 0: a sliding
    window's left edge, tested in the kernel only then."""
    p = Problem(1, 16, 16, 4096, 4096, head_dim, 0.1, window_left, 0 if causal else -1, None, None)
    cfg = configs.v3_gluon_schedule(p)
    consts = v3_gluon.kernel_constants(p, cfg, 2)
    q_block = v3_gluon.block_layout(consts["ROWS"], p.head_dim_pad, torch.bfloat16)
    kv_block = v3_gluon.block_layout(cfg.block_n, p.head_dim_pad, torch.bfloat16)
    descriptors = {"q_desc": q_block, "o_desc": q_block, "k_desc": kv_block, "v_desc": kv_block}
    return consts, v3_gluon.launch_options(cfg.consumers), descriptors


def gluon_bwd_case(head_dim_pad, dq_pass, dq_reduce=False, persistent=True, causal=False):
    """One of v3's Gluon backward kernels with the constants and launch options
    v3_gluon_bwd.backward would use (FLASHTILE_CONFIG_V3_GLUON_BWD applies); ``dq_reduce``: the
    dK/dV kernel adding dQ by TMA (v3_gluon_bwd.backward_reduce); ``persistent``: as launched
    persistent where the pass can be (two stationary slots, tiles strided over or, ``causal``,
    taken from the tile counter: v3_gluon_bwd.pass_schedule), else a CTA per tile."""
    b = v3_gluon_bwd
    p = Problem(1, 16, 16, 4096, 4096, head_dim_pad, 0.1, -1, 0 if causal else -1, None, None)
    cfg = configs.v3_gluon_bwd_config(p, single_pass=dq_reduce)
    rows = configs.gluon_bwd_stationary_rows(head_dim_pad)
    block_m, block_n = (rows, cfg.dq_block_n) if dq_pass else (cfg.kv_block_m, rows)
    q_block = v3_gluon.block_layout(block_m, head_dim_pad, torch.bfloat16)
    kv_block = v3_gluon.block_layout(block_n, head_dim_pad, torch.bfloat16)
    descriptors = {"q_desc": q_block, "do_desc": q_block, "dq_desc": q_block, "k_desc": kv_block,
                   "v_desc": kv_block, "dk_desc": kv_block, "dv_desc": kv_block}
    schedule = b.Schedule(1, 1, False, False)
    if persistent:  # as launched on a GPU of 132 SMs, 1024 tiles
        with mock.patch.object(b, "sm_count", lambda index: 132):
            schedule = b.pass_schedule(p, 1024, torch.device("cuda", 0), dq_reduce)
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM_PAD=head_dim_pad, STAGES=cfg.num_stages,
                  SPLIT_D=configs.split_head_dim(head_dim_pad), **schedule.constants())
    out_block = v3_gluon.block_layout(b.partition_rows(head_dim_pad, dq_reduce), head_dim_pad, torch.bfloat16)
    if dq_pass:
        consts["HAS_DLSE"] = False
        descriptors["dq_desc"] = out_block
    else:
        consts["DQ_REDUCE"] = dq_reduce
        consts["SHARED_SCORES"] = b.shared_scores(cfg, head_dim_pad, dq_reduce)
        descriptors.update(dk_desc=out_block, dv_desc=out_block)
        descriptors["dq_desc"] = (*v3_gluon.block_layout(block_m, head_dim_pad, torch.float32), "fp32") \
            if dq_reduce else out_block
    return consts, dict(b.launch_options(head_dim_pad, dq_reduce)), descriptors


def _options(cfg):
    return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def cases(head_dim=128, varlen=False):
    """(name, kernel, constexprs, compile options, descriptor blocks) of every kernel as launched."""
    p = Problem(1, 16, 16, 4096, 4096, head_dim, 0.1, -1, -1, None, None)
    base = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=p.head_dim_pad, IS_VARLEN=varlen, UPCAST=False)
    f = configs.v2_fwd_config(p, None)
    yield "v2.fwd", v2._fwd_kernel, dict(base, BLOCK_M=f.block_m, BLOCK_N=f.block_n, NUM_STAGES=f.num_stages), \
        _options(f), None
    kv, qc = configs.v2_bwd_config(p, None)
    yield "v2.bwd_dkdv", v2._bwd_dkdv_kernel, dict(base, BLOCK_M=kv.block_m, BLOCK_N=kv.block_n,
                                                   NUM_STAGES=kv.num_stages), _options(kv), None
    yield "v2.bwd_dq", v2._bwd_dq_kernel, dict(base, BLOCK_M=qc.block_m, BLOCK_N=qc.block_n, NUM_STAGES=qc.num_stages,
                                               HAS_DLSE=False), _options(qc), None
    c1 = v1._config(p, "FWD")
    yield "v1.fwd", v1._fwd_kernel, dict(base, BLOCK_M=c1.block_m, BLOCK_N=c1.block_n), _options(c1), None
    c1 = v1._config(p, "BWD")
    yield "v1.bwd", v1._bwd_kernel, dict(base, BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, HAS_DLSE=False), \
        _options(c1), None
    for unmasked in ((False,) if varlen else (True, False)):  # varlen always takes the banded loop
        c3 = configs.v3_fwd_config(p, unmasked)
        yield f"v3.fwd{'' if unmasked else '_band'}", v3._fwd_kernel, dict(
            base, BLOCK_M=c3.block_m, BLOCK_N=c3.block_n, NUM_STAGES=c3.num_stages, UNMASKED=unmasked,
            WARP_SPECIALIZE=unmasked and c3.warp_specialize), _options(c3), None
    c3 = configs.v3_bwd_reduce_config(p)
    yield "v3.bwd", v3._bwd_kernel, dict(base, BLOCK_M=c3.block_m, BLOCK_N=c3.block_n, NUM_STAGES=c3.num_stages,
                                         TMA_REDUCE=True), _options(c3), None
    if not varlen:  # the Gluon kernels take batched problems only
        yield ("v3.fwd_gluon", v3_gluon._fwd_kernel, *gluon_case(head_dim))
        yield ("v3.fwd_gluon_causal", v3_gluon._fwd_kernel, *gluon_case(head_dim, causal=True))
        yield ("v3.fwd_gluon_window", v3_gluon._fwd_kernel, *gluon_case(head_dim, causal=True, window_left=512))
        yield ("v3.bwd_dq_gluon", v3_gluon_bwd._dq_kernel, *gluon_bwd_case(p.head_dim_pad, True))
        yield ("v3.bwd_dkdv_gluon", v3_gluon_bwd._dkdv_kernel, *gluon_bwd_case(p.head_dim_pad, False))
        if not configs.split_head_dim(p.head_dim_pad):  # up to d128
            # The two passes over a band's tiles (persistent, from the tile counter), and with a
            # CTA per tile (as few tiles as SMs).
            yield ("v3.bwd_dq_gluon_causal", v3_gluon_bwd._dq_kernel,
                   *gluon_bwd_case(p.head_dim_pad, True, causal=True))
            yield ("v3.bwd_dkdv_gluon_causal", v3_gluon_bwd._dkdv_kernel,
                   *gluon_bwd_case(p.head_dim_pad, False, causal=True))
            yield ("v3.bwd_dq_gluon_tile", v3_gluon_bwd._dq_kernel, *gluon_bwd_case(p.head_dim_pad, True, False, False))
            yield ("v3.bwd_dkdv_gluon_tile", v3_gluon_bwd._dkdv_kernel,
                   *gluon_bwd_case(p.head_dim_pad, False, False, False))
            # The single pass (it does not split the head dim).
            yield ("v3.bwd_reduce_gluon", v3_gluon_bwd._dkdv_kernel, *gluon_bwd_case(p.head_dim_pad, False, True))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--dump", type=pathlib.Path)
    ap.add_argument("--only", help="compile only the kernels with this name (e.g. v3.fwd)")
    ap.add_argument("--varlen", action="store_true", help="the variable-length (cu_seqlens) variants")
    ap.add_argument("--loops", action="store_true", help="each hot loop's SASS instruction mix")
    args = ap.parse_args()
    for d in (int(x) for x in args.head_dims.split(",")):
        for name, fn, constexprs, options, descriptors in cases(d, args.varlen):
            if args.only and name != args.only:
                continue
            try:
                k = compile_one(fn, "bf16", constexprs, options, descriptors)
            except Exception as e:  # report and go on: one broken kernel should not hide the rest
                print(f"d{d:<4} {name:18} FAILED: {str(e).splitlines()[0][:200]}")
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
