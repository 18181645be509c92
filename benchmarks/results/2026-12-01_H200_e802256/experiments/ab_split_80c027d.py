"""Split-partition backward (this tree, 80c027d) vs 8cc1573's module (copied to
scratch/v3_gluon_bwd_main.py) and a mix (split dQ pass + 8cc1573's dK/dV pass), same process.
AB_BWD=main|h2 picks the module; unset: this tree.  Run as it ran for experiments/bwd_split_partitions.md."""
import importlib.util, os, sys, types
import torch, triton
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
from flashtile.kernels import v3, v3_gluon_bwd as split
from flashtile.kernels.configs import gluon_bwd_stationary_rows, split_head_dim, v3_gluon_bwd_config
from flashtile.kernels.v3_gluon import tma_descriptor
spec = importlib.util.spec_from_file_location("flashtile.kernels.v3_gluon_bwd_main", "scratch/v3_gluon_bwd_main.py")
main_mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(main_mod)


def h2_backward(p, dout, dlse, q, k, v, out, lse):
    cfg = v3_gluon_bwd_config(p)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    pad = p.head_dim_pad
    rows = gluon_bwd_stationary_rows(pad)
    split._dq_kernel[(p.batch * p.heads_q, triton.cdiv(p.seqlen_q, rows))](
        tma_descriptor(q, rows, pad), tma_descriptor(dout, rows, pad), tma_descriptor(k, cfg.dq_block_n, pad),
        tma_descriptor(v, cfg.dq_block_n, pad), tma_descriptor(dq, split.WARPGROUP_ROWS.value, pad),
        out, out.stride(0), out.stride(1), out.stride(2), p.head_dim, lse, delta if dlse is None else dlse, delta,
        lse.stride(0), lse.stride(1), p.heads_q, p.group, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
        p.softmax_scale, p.scale_log2, BLOCK_M=rows, BLOCK_N=cfg.dq_block_n, HEAD_DIM_PAD=pad,
        STAGES=cfg.num_stages, HAS_DLSE=dlse is not None, SPLIT_D=split_head_dim(pad), **split.launch_options(pad))
    main_mod._launch_dkdv(p, cfg, q, k, v, dout, lse, delta, dk, dv, None)
    return dq, dk, dv


h2 = types.SimpleNamespace(supports=main_mod.supports, backward=h2_backward, backward_reduce=main_mod.backward_reduce)


class Chooser:
    def __getattr__(self, name):
        which = os.environ.get("AB_BWD")
        mod = main_mod if which == "main" else h2 if which == "h2" else split
        return getattr(mod, name)


v3.v3_gluon_bwd = Chooser()
if os.environ.get("AB_CHECK"):  # numerics of the mix against the tree's two passes
    from flashtile import flash_attn_func
    for d in (64, 128):
        for causal in (False, True):
            q, k, v = (torch.randn(2, 1000, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grads = []
            for which in ("", "h2", "main"):
                os.environ["AB_BWD"] = which; os.environ["FLASHTILE_V3_BWD"] = "gluon"
                out = flash_attn_func(q, k, v, causal=causal, version="v3")
                grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
            print("check", d, causal, [max((a - b).abs().max().item() for a, b in zip(grads[0], g)) for g in grads[1:]])
    os.environ.pop("AB_BWD"); os.environ.pop("FLASHTILE_V3_BWD")
import backward_variants
V = backward_variants.VARIANTS
backward_variants.VARIANTS[:] = [
    ("split two", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon"}),
    ("split two 64,128,2", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon", "FLASHTILE_CONFIG_V3_GLUON_BWD": "64,128,2"}),
    ("split two 64,64,4", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon", "FLASHTILE_CONFIG_V3_GLUON_BWD": "64,64,4"}),
    ("h2 two", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon", "AB_BWD": "h2"}),
    ("main two", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon", "AB_BWD": "main"}),
    ("main one", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon-reduce", "AB_BWD": "main"}),
    ("main one 64,64,4", "flashtile-v3", {"FLASHTILE_V3_BWD": "gluon-reduce", "AB_BWD": "main", "FLASHTILE_CONFIG_V3_GLUON_BWD": "64,64,4"}),
    V[-1]]
backward_variants.main()
