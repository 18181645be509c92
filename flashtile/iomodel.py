"""HBM traffic and FLOPs of each algorithm, after Theorem 2 of the FlashAttention-1 paper.

Standard attention moves Theta(N d + N^2) elements (it writes and re-reads the N x N scores
and probabilities); FlashAttention-1 re-reads Q and re-writes O (fp32), l and m once per K/V
block: Theta(N^2 d^2 / M) with Bc ~ M / 4d; FlashAttention-2/3 re-read K and V once per Q
block and write O once.  Counts are per call (all batches and heads), for the forward and
the backward, with the block sizes the kernels use and only the blocks that intersect the
causal band.
"""
from dataclasses import dataclass, replace

from flashtile.kernels.problem import cdiv

ELEM = 2   # bf16 / fp16 bytes
F32 = 4


@dataclass(frozen=True)
class Shape:
    b: int
    h: int
    sq: int
    sk: int
    d: int
    causal: bool = False
    h_k: int | None = None

    @property
    def heads_k(self):
        return self.h_k or self.h


def visited_pairs(sq, sk, block_q, block_k, causal):
    """Number of (Q block, K block) pairs a kernel visits: all, or those touching the causal band."""
    n_q, n_k = cdiv(sq, block_q), cdiv(sk, block_k)
    if not causal:
        return n_q * n_k
    off = sk - sq
    total = 0
    for i in range(n_q):
        last_col = min(sk, (i + 1) * block_q - 1 + off + 1)  # exclusive end of visible keys
        total += max(0, cdiv(last_col, block_k))
    return total


def matmul_flops(s: Shape, matmuls: int, block_q=None, block_k=None):
    """2*sq*sk*d per matmul and head, counted over the visited blocks (or exactly half the
    score matrix, for causal, when no block sizes are given)."""
    if block_q is None:
        frac = 0.5 if s.causal else 1.0
    else:
        frac = visited_pairs(s.sq, s.sk, block_q, block_k, s.causal) * block_q * block_k / (s.sq * s.sk)
    return matmuls * 2.0 * s.sq * s.sk * s.d * s.b * s.h * frac


def standard(s: Shape):
    """Forward: read Q, K; write S; read S, write P; read P, V; write O.  Backward: read dO, V, P;
    write dP; read dP, P, write dS; read dS, K, Q; write dQ, dK, dV (and dV needs P, dO)."""
    bh, nd_q, nd_k, nn = s.b * s.h, s.sq * s.d, s.sk * s.d, s.sq * s.sk
    fwd = bh * ELEM * (2 * nd_q + 2 * nd_k + 4 * nn)
    bwd = bh * ELEM * (nd_q + nd_k + nn          # dP = dO V^T
                       + 3 * nn                    # dS = P * (dP - rowsum)
                       + nn + nd_q + nd_q          # dV = P^T dO
                       + 2 * nn + 2 * nd_k         # dQ = dS K, dK = dS^T Q
                       + nd_q + 2 * nd_k + nd_q)   # read Q, write dQ, dK, dV
    # It computes the whole score matrix even when causal (the mask only hides entries).
    full = replace(s, causal=False)
    return dict(fwd_bytes=fwd, bwd_bytes=bwd, extra_memory_bytes=bh * nn * 2 * ELEM,  # scores, probabilities
                fwd_flops=matmul_flops(full, 2), bwd_flops=matmul_flops(full, 4))


def v1(s: Shape, block_q: int, block_k: int, bwd_block_q: int | None = None, bwd_block_k: int | None = None,
       splits: int = 1):
    """Algorithm 1: per K/V block (Tc of them), every visited Q block reads Q_i, O_i (fp32),
    l_i, m_i and writes O_i, l_i, m_i.  Backward: per K/V block, Q, O, dO, m, l and the fp32
    dQ accumulator are read, dQ written; with ``splits`` programs per (batch, head) each keeps
    its own fp32 dQ, and the partial dQs are summed at the end."""
    bwd_block_q, bwd_block_k = bwd_block_q or block_q, bwd_block_k or block_k
    bh = s.b * s.h
    pairs = visited_pairs(s.sq, s.sk, block_q, block_k, s.causal)
    per_q_block_fwd = block_q * (s.d * ELEM + 2 * s.d * F32 + 4 * F32)
    fwd = bh * (pairs * per_q_block_fwd + 2 * s.sk * s.d * ELEM + s.sq * s.d * (F32 + ELEM))
    bpairs = visited_pairs(s.sq, s.sk, bwd_block_q, bwd_block_k, s.causal)
    per_q_block_bwd = bwd_block_q * (3 * s.d * ELEM + 2 * s.d * F32 + 3 * F32)
    bwd = bh * (bpairs * per_q_block_bwd + 4 * s.sk * s.d * ELEM + s.sq * s.d * (splits * F32 + ELEM))
    return dict(fwd_bytes=fwd, bwd_bytes=bwd,
                extra_memory_bytes=bh * s.sq * (s.d * F32 * (1 + splits) + 3 * F32),
                fwd_flops=matmul_flops(s, 2, block_q, block_k),
                bwd_flops=matmul_flops(s, 5, bwd_block_q, bwd_block_k))


def v2(s: Shape, block_q: int, block_k: int, bwd_block_q: int | None = None, bwd_block_k: int | None = None):
    """Forward: each Q block reads its K/V blocks; Q read and O written once; lse saved.
    Backward: D = rowsum(dO * O); each K block reads Q, dO, lse, D of its Q blocks; a separate
    Q-parallel pass reads K, V again for dQ (7 matmuls instead of 5, no fp32 atomics)."""
    bwd_block_q, bwd_block_k = bwd_block_q or block_q, bwd_block_k or block_k
    bh = s.b * s.h
    pairs = visited_pairs(s.sq, s.sk, block_q, block_k, s.causal)
    fwd = bh * (pairs * 2 * block_k * s.d * ELEM + 2 * s.sq * s.d * ELEM + s.sq * F32)
    bpairs = visited_pairs(s.sq, s.sk, bwd_block_q, bwd_block_k, s.causal)
    bwd = bh * (2 * s.sq * s.d * ELEM + s.sq * F32                               # D
                + bpairs * bwd_block_q * (2 * s.d * ELEM + 2 * F32) + 4 * s.sk * s.d * ELEM  # dK, dV
                + bpairs * 2 * bwd_block_k * s.d * ELEM + s.sq * (3 * s.d * ELEM + 2 * F32))  # dQ
    return dict(fwd_bytes=fwd, bwd_bytes=bwd, extra_memory_bytes=bh * s.sq * 2 * F32,
                fwd_flops=matmul_flops(s, 2, block_q, block_k),
                bwd_flops=matmul_flops(s, 7, bwd_block_q, bwd_block_k))


def v3_single_pass_backward(s: Shape, block_q: int, block_k: int, bwd_block_q: int, bwd_block_k: int):
    """v2's forward; FlashAttention-3's backward: D = rowsum(dO * O) first, then each K/V block
    reads Q, dO, lse, D of its Q blocks and adds its share of dQ in fp32 (bytes to L2 per
    block pair), 5 matmuls; the fp32 dQ is zeroed before and converted after."""
    model = v2(s, block_q, block_k, bwd_block_q, bwd_block_k)
    bh = s.b * s.h
    bpairs = visited_pairs(s.sq, s.sk, bwd_block_q, bwd_block_k, s.causal)
    model["bwd_bytes"] = bh * (2 * s.sq * s.d * ELEM + s.sq * F32                     # D
                               + bpairs * bwd_block_q * (2 * s.d * ELEM + 2 * F32 + s.d * F32)
                               + 4 * s.sk * s.d * ELEM                                 # K, V in; dK, dV out
                               + s.sq * s.d * (2 * F32 + ELEM))                        # dQ zeroed, converted
    model["bwd_flops"] = matmul_flops(s, 5, bwd_block_q, bwd_block_k)
    return model


# v3 keeps v2's tiling (with its own tile sizes): TMA and warp specialization change when bytes
# move, not how many; its single-pass backward (head dims 64 and 128, long keys) trades the
# second pass's matmuls for fp32 dQ traffic.


def gpu_tiles(version: str, s: "Shape"):
    """((fwd block_m, block_n), (bwd dK/dV block_m, block_n)) and whether the backward is v3's
    single pass, as dispatch plans them on a Hopper GPU for shape ``s`` (batched)."""
    from flashtile import dispatch
    from flashtile.kernels import configs
    from flashtile.kernels.problem import Problem
    from flashtile.options import KernelOptions
    p = Problem(s.b, s.h, s.heads_k, s.sq, s.sk, s.d, 1.0, -1, 0 if s.causal else -1, None, None)
    fwd_plan = dispatch.forward_plan(p, version, dispatch.HOPPER, KernelOptions())
    bwd_plan = dispatch.backward_plan(p, version, dispatch.HOPPER, KernelOptions())
    cfg = fwd_plan.config
    fwd = (cfg.tile_m, cfg.block_n) if fwd_plan.kernel == "v3-gluon" else (cfg.block_m, cfg.block_n)
    if bwd_plan.kernel == "v2":
        bwd = (bwd_plan.config[0].block_m, bwd_plan.config[0].block_n)
    else:  # the Gluon dK/dV pass: streamed Q blocks against the stationary K/V rows
        bwd = (bwd_plan.config.kv_block_m, configs.gluon_bwd_stationary_rows(p.head_dim_pad))
    return fwd, bwd, bwd_plan.kernel == "v3-gluon-reduce"


def summary(s: Shape):
    """Model for each algorithm at the block sizes the kernels use on the GPU."""
    from flashtile.kernels import v1 as v1_kernels
    from flashtile.kernels.problem import padded_head_dim
    pad = padded_head_dim(s.d)
    fwd, bwd = v1_kernels.block_sizes(pad)
    model = {"standard": standard(s), "v1": v1(s, *fwd, *bwd)}
    for version in ("v2", "v3"):
        fwd, bwd, single_pass = gpu_tiles(version, s)
        model[version] = (v3_single_pass_backward if single_pass else v2)(s, *fwd, *bwd)
    return model


# ---- the model set against measured times ----

# Ceilings of an H200 (bf16 matmul 8192^3; device-to-device copy, read + write counted), the
# defaults when no GPU is at hand; on a GPU `flashtile io` measures them (bench.ceilings).
H200_MATMUL_TFLOPS = 775.0
H200_COPY_TBPS = 4.26

PROVIDER_MODEL = {"standard": "standard", "flashtile-v1": "v1", "flashtile-v2": "v2", "flashtile-v3": "v3"}


def regime(hbm_bytes: float, flops: float, ms: float, copy_tbps: float, matmul_tflops: float):
    """Where one measured run sits against the two ceilings.

    ``bound`` is the ceiling the model says limits the algorithm (the larger of bytes / bandwidth
    and FLOPs / matmul peak); ``roofline_pct`` how much of that bound the run achieved.  A run far
    below both ceilings is limited by something the model leaves out (latency, occupancy,
    softmax instructions, too few programs for the SMs).
    """
    seconds = ms / 1e3
    t_mem, t_math = hbm_bytes / (copy_tbps * 1e12), flops / (matmul_tflops * 1e12)
    return dict(tbps=hbm_bytes / seconds / 1e12, copy_pct=100 * t_mem / seconds,
                tflops=flops / seconds / 1e12, matmul_pct=100 * t_math / seconds,
                intensity=flops / hbm_bytes, bound="memory" if t_mem > t_math else "compute",
                roofline_pct=100 * max(t_mem, t_math) / seconds)


def regime_rows(records, copy_tbps=H200_COPY_TBPS, matmul_tflops=H200_MATMUL_TFLOPS):
    """One row per bench record of a modelled provider in mode fwd or bwd: the record's keys
    plus the model's bytes and FLOPs and :func:`regime` of its measured time."""
    rows = []
    for r in records:
        version = PROVIDER_MODEL.get(r["provider"])
        if version is None or r["mode"] not in ("fwd", "bwd"):
            continue
        model = summary(Shape(r["b"], r["h"], r["sq"], r["sk"], r["d"], r["causal"], r["h_k"]))[version]
        hbm_bytes, flops = model[f"{r['mode']}_bytes"], model[f"{r['mode']}_flops"]
        rows.append(dict(r, model_bytes=hbm_bytes, model_flops=flops,
                         **regime(hbm_bytes, flops, r["ms"], copy_tbps, matmul_tflops)))
    return rows
