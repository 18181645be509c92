"""Tile sizes, warps and pipeline depth per version and head dim.

Chosen by hand from sweeps on the H200 (scripts/gpu_check.sh can rerun one) rather than by
``triton.autotune``: multi-config autotuning does not run under the CPU interpreter, and a
fixed table keeps every launch reproducible.  ``FLASHTILE_CONFIG_<NAME>=bm,bn,warps,stages``
overrides one entry, for sweeps.
"""
import functools
import os
from dataclasses import dataclass, replace

from flashtile import runtime


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False


# Under the interpreter tiles are numpy arrays: mid-size tiles keep CPU tests fast while
# still giving several blocks (and all three masking segments) at test sequence lengths.
_INTERPRETER = Config(32, 32, 4, 1)


def pick(name: str, default: Config) -> Config:
    """``default`` on the GPU, the interpreter's tile under it, or the FLASHTILE_CONFIG_<name> override."""
    override = os.environ.get(f"FLASHTILE_CONFIG_{name}")
    if override:
        return Config(*(int(x) for x in override.split(",")))
    if runtime.interpreting():
        return _INTERPRETER
    return default


def _by_head_dim(table, head_dim_pad):
    for limit, cfg in table:
        if head_dim_pad <= limit:
            return cfg
    return table[-1][1]


# H200 sweep (scripts/sweep_configs.py, b4 h16/32 s4096 bf16), 2026-12-01.
_V2_FWD = [(64, Config(128, 64, 4, 3)), (128, Config(128, 128, 8, 3)), (256, Config(128, 64, 8, 2))]
_V2_BWD_KV = [(64, Config(32, 128, 4, 3)), (128, Config(64, 128, 8, 2)), (256, Config(64, 64, 8, 2))]
# d128 dQ pass: 128x64 tiles with 8 warps, +4% over 128x32x4 at 1k and 2k (b16/b8 h16 sweep).
_V2_BWD_Q = [(64, Config(128, 32, 4, 3)), (128, Config(128, 64, 8, 3)), (256, Config(128, 32, 8, 2))]
# Causal/window bands: narrower K tiles waste less work on the diagonal (b16 s1024-2048 sweep).
_V2_FWD_BAND = [(64, Config(128, 64, 4, 3)), (128, Config(128, 64, 8, 3)), (256, Config(128, 64, 8, 2))]
# A band over at most SHORT_KEYS keys is read more than computed on (d128 causal 1k moves its
# bytes at ~90% of the copy ceiling): small tiles fit three programs per SM and keep more loads
# in flight; 64x32x4 is +4% at 1k, -1.5% at 2k.
SHORT_KEYS = 1024
_V2_FWD_BAND_SHORT = [(64, Config(128, 64, 4, 3)), (128, Config(64, 32, 4, 3)), (256, Config(128, 64, 8, 2))]
_V2_BWD_KV_BAND = [(64, Config(32, 128, 4, 3)), (128, Config(32, 64, 4, 3)), (256, Config(64, 64, 8, 2))]


def _v2_fwd_table(banded: bool, seqlen_k: int):
    if not banded:
        return _V2_FWD
    return _V2_FWD_BAND_SHORT if seqlen_k <= SHORT_KEYS else _V2_FWD_BAND


def v2_fwd_config(p, dtype) -> Config:
    return pick("V2_FWD", _by_head_dim(_v2_fwd_table(p.banded, p.seqlen_k), p.head_dim_pad))


def v2_bwd_config(p, dtype):
    """(dK/dV kernel config, dQ kernel config)."""
    return (pick("V2_BWD_KV", _by_head_dim(_V2_BWD_KV_BAND if p.banded else _V2_BWD_KV, p.head_dim_pad)),
            pick("V2_BWD_Q", _by_head_dim(_V2_BWD_Q, p.head_dim_pad)))


# v3 unmasked path (no band, no varlen, seqlen_k a multiple of the K tile).  d128 runs
# warp-specialized (Triton 3.6 needs num_warps=4 for it): +9% over the best plain config at
# 4k-16k (H200 sweep); d64 and d256 are faster without it.  _V3_FWD_UNMASKED is the fallback
# where warp specialization cannot run (the interpreter; seqlen_q % 4 != 0, see v3.py).
_V3_FWD_WS = [(64, Config(128, 128, 4, 3)), (128, Config(128, 128, 4, 2, True)), (256, Config(128, 64, 8, 2))]
_V3_FWD_UNMASKED = [(64, Config(128, 128, 4, 3)), (128, Config(128, 128, 8, 3)),
                    (256, Config(128, 64, 8, 2))]
_V3_FWD_BAND = [(64, Config(128, 64, 4, 3)), (128, Config(128, 64, 8, 3)), (256, Config(128, 64, 8, 2))]


@dataclass(frozen=True)
class GluonSchedule:
    """v3's Gluon forward (kernels/v3_gluon.py): K/V tile, ring depth, and its FA3 techniques."""
    block_n: int
    num_stages: int
    pingpong: bool = True
    overlap: bool = True
    persistent: bool = True
    next_q: bool = True  # a second Q buffer: the next tile's Q and K/V load under this tile's tail
    q_registers: bool = True  # Q as the register operand of S = Q K^T (where registers hold it)
    consumers: int = 2   # consumer warpgroups, 64 query rows each

    @property
    def tile_m(self) -> int:
        return WARPGROUP_ROWS * self.consumers


# Two consumer warpgroups of 64 rows each; shared memory holds Q (2 x 64 rows), the K/V ring and,
# where it fits, O for the TMA store.  H200 sweep (scripts/sweep_configs.py --only v3-gluon, 1k and
# 16k, 58d2bdc): d64 128x3 (+3% over 128x2 at 16k), d128 128x2 (a third slot left no room to stage
# O, which then waited in Q's buffer: -40% at 1k), d256 64x2 (+39% over one slot at 16k).
WARPGROUP_ROWS = 64  # the rows of an accumulator one warpgroup's MMA covers
GLUON_TILE_M = 2 * WARPGROUP_ROWS  # the Gluon backward's stationary rows: two consumer warpgroups
GLUON_HEAD_DIMS = (64, 128, 256)  # padded head dims the Gluon kernels (forward and backward) take
_V3_GLUON = [(64, GluonSchedule(128, 3)), (128, GluonSchedule(128, 2)), (256, GluonSchedule(64, 2))]
GLUON_TECHNIQUES = ("pingpong", "overlap", "persistent", "next_q", "q_registers")
# d64 with three consumer warpgroups (192-row tiles, 160 registers each, as FlashAttention-3's
# d64 forward), its speed over two's in the same run (H200, bf16): non-causal 0.95x at 1k (1024
# rows make six tiles of 192: 12.5% of them padding), 1.07x at 2k, 1.09x 4k, 1.13x 8k, 1.15x 16k;
# causal 0.73x at 1k, 0.92x 2k, 0.96x 4k, 1.04x 8k, 1.07x 16k
# (benchmarks/results/2026-12-02_H200_c46b5ae/experiments/three_consumers_run*.md).  d128 has no
# registers for it (ptxas: 1.1 KB of spills).  By query rows, for problems without and with a band:
THREE_CONSUMERS_FROM = {False: 2048, True: 8192}
# The Gluon backward's stationary rows per CTA (K/V rows in dK/dV, query rows in dQ): one 64-row
# slice per consumer warpgroup, or above d128 (SPLIT_D) 64 rows the two warpgroups share,
# splitting the head dim instead (one warpgroup's registers do not hold d256 accumulators).
SPLIT_D_ROWS = WARPGROUP_ROWS


def split_head_dim(head_dim_pad: int) -> bool:
    """Whether the Gluon backward splits the head dim between its consumer warpgroups."""
    return head_dim_pad > 128


def gluon_bwd_stationary_rows(head_dim_pad: int) -> int:
    return SPLIT_D_ROWS if split_head_dim(head_dim_pad) else GLUON_TILE_M


def v3_forward_kernel(p) -> str:
    """Which forward v3 runs on the GPU: "gluon" (kernels/v3_gluon.py, where its supports() also
    holds, else v3_fallback_forward) or "triton" (v3's plain-Triton kernel) under the
    interpreter.  FLASHTILE_V3_FWD=gluon|triton|v2 forces one (v2: v2's forward).

    With its next tile's Q loaded under the current one (GluonSchedule.next_q) the Gluon kernel
    leads v2's on short causal bands too: 1.22x at d64, 1.58x at d128, 1.40x at d256 causal 1k
    (H200, benchmarks/results/2026-12-01_H200_94a4a11/experiments/fwd_next_q_wip.md)."""
    choice = os.environ.get("FLASHTILE_V3_FWD") or None
    if choice not in (None, "gluon", "triton", "v2"):
        raise ValueError(f"FLASHTILE_V3_FWD={choice!r}: expected 'gluon', 'triton' or 'v2'")
    if runtime.interpreting():
        return "triton"
    if choice:
        return choice
    return "gluon"


def v3_fallback_forward(p) -> str:
    """What runs a problem the Gluon forward does not take (varlen, head dims up to 32, stride-0
    layouts): v2's forward on causal/window bands over at most SHORT_KEYS keys, where it measured
    1.03-1.25x v3's plain-Triton kernel (H200, d64-d256 causal 1k, c167ac1 and 69899f7), that
    plain kernel otherwise."""
    return "v2" if p.banded and p.seqlen_k <= SHORT_KEYS else "triton"


def gluon_consumers(head_dim_pad: int, banded: bool, seqlen_q: int) -> int:
    """The Gluon forward's consumer warpgroups: three at d64 from THREE_CONSUMERS_FROM rows."""
    return 3 if head_dim_pad == 64 and seqlen_q >= THREE_CONSUMERS_FROM[banded] else 2


def v3_gluon_schedule(p) -> GluonSchedule:
    """The Gluon forward's schedule: FLASHTILE_CONFIG_V3_GLUON=block_n,stages[,consumers]
    overrides the tiles (two consumers unless given); FLASHTILE_V3_ABLATE=pingpong,overlap,
    persistent,next_q,q_registers switches techniques off (persistent: the backward's persistent
    CTAs too, gluon_backward_persistent)."""
    return _gluon_schedule(p.head_dim_pad, gluon_consumers(p.head_dim_pad, p.banded, p.seqlen_q),
                           os.environ.get("FLASHTILE_CONFIG_V3_GLUON"), os.environ.get("FLASHTILE_V3_ABLATE", ""))


@functools.lru_cache(maxsize=None)  # parsed once per setting: this runs at every forward
def _gluon_schedule(head_dim_pad, consumers, override, ablate) -> GluonSchedule:
    cfg = _by_head_dim(_V3_GLUON, head_dim_pad)
    if override:
        block_n, stages, *more = (int(x) for x in override.split(","))
        consumers = more[0] if more else 2
        if consumers not in (2, 3) or (consumers == 3 and head_dim_pad > 64):
            raise ValueError(f"FLASHTILE_CONFIG_V3_GLUON={override!r}: 2 consumers, or 3 up to head dim 64")
        cfg = GluonSchedule(block_n, stages)
    off = _ablated(ablate)
    return GluonSchedule(cfg.block_n, cfg.num_stages, *(t not in off for t in GLUON_TECHNIQUES),
                         consumers=consumers)


def gluon_backward_persistent() -> bool:
    """Whether the Gluon backward's passes may run persistent CTAs (v3_gluon_bwd.pass_schedule):
    FLASHTILE_V3_ABLATE=persistent switches the backward's persistent scheduler off too."""
    return "persistent" not in _ablated(os.environ.get("FLASHTILE_V3_ABLATE", ""))


@functools.lru_cache(maxsize=None)
def _ablated(ablate) -> frozenset:
    off = frozenset(t for t in ablate.split(",") if t)
    unknown = off - set(GLUON_TECHNIQUES)
    if unknown:
        raise ValueError(f"FLASHTILE_V3_ABLATE: unknown techniques {sorted(unknown)}; known: {GLUON_TECHNIQUES}")
    return off


def v3_fwd_config(p, unmasked: bool, warp_specialize: bool = True) -> Config:
    table = (_V3_FWD_WS if warp_specialize else _V3_FWD_UNMASKED) if unmasked else _V3_FWD_BAND
    return pick("V3_FWD", _by_head_dim(table, p.head_dim_pad))


# v3's K/V-stationary backward with dQ added in fp32 by TMA reduce-add; tiles from an H200 sweep
# (b4 s4096; the fp32 dQ staging tile leaves d256 one stage).  It measured slower than v2's
# separate dQ pass at every head dim (d64 214 vs 301, d128 309 vs 326, d256 161 vs >= 175 TFLOP/s),
# so it runs only when asked for: FLASHTILE_V3_DQ=reduce, or a FLASHTILE_CONFIG_V3_BWD override.
_V3_BWD_REDUCE = [(64, Config(128, 128, 8, 2)), (128, Config(64, 128, 8, 3)), (256, Config(64, 64, 8, 1))]


def v3_bwd_reduce_config(p) -> Config:
    return pick("V3_BWD", _by_head_dim(_V3_BWD_REDUCE, p.head_dim_pad))


@dataclass(frozen=True)
class GluonBackward:
    """v3's Gluon backward (kernels/v3_gluon_bwd.py): the streamed block of each pass (the
    stationary side: gluon_bwd_stationary_rows) and the ring depth."""
    kv_block_m: int  # dK/dV pass: Q/dO rows per streamed block
    dq_block_n: int  # dQ pass: K/V rows per streamed block
    num_stages: int


# H200 (69899f7 and 09f4e71, b16 h16, 1k-16k): at d128 the Gluon two passes are 1.15-1.26x v2's
# backward.  The single pass with TMA reduce-add, dS and the dQ staging double-buffered, against
# the two passes at d128: 1.13x at 4k, 1.17x at 8k, 1.19x at 16k, 0.91x at 1k and 0.96x at 2k
# non-causal (its fp32 dQ round trip and extra launches weigh on short rows)
# (benchmarks/results/2026-12-01_H200_8cddb94/experiments).  With each block's lse and D in the
# ring beside it (the dK/dV pass read them from global memory as the block started, stalling on
# their latency) the single pass gained 8-20% at d64 and 3-12% at d128, the two passes 4-9% at
# d64 and 0-10% at d128 (benchmarks/results/2026-12-01_H200_6312519/experiments/bwd_stats_ring_1a56c88.md):
# at d64 the single pass now leads v2's backward 1.03-1.24x from 512 keys and the two passes
# lead it 1.00-1.07x (0.95x at causal 512).  With each consumer warpgroup a partition of its
# own the two passes gained 0-25% (mostly 5-11%; d64, d128, 1k-16k) and match the single pass
# at d64 up to 4k (0.94-1.03x), which still leads at 16k (1.03-1.09x); at d128 the single pass
# leads from 4k (1.04-1.14x) and the two passes below (1.11-1.35x)
# (benchmarks/results/2026-12-01_H200_e802256/experiments/bwd_split_partitions.md).  With one
# head's blocks adjacent in the grid (both kernels 1.00-1.34x faster at 1k-4k) the boundaries
# held: at d128 4k the single pass 0.93x cuDNN, the two passes 0.86x; at d64 a tie at 4k, the
# single pass ahead at 16k (benchmarks/results/2026-12-01_H200_86cee91/INDEX.md).  So by
# default: the single pass from GLUON_REDUCE_MIN_KEYS keys on (never when ``deterministic``),
# below that (and when ``deterministic``) the two Gluon passes.  Tiles: the 4k sweep (e943ac5)
# put every candidate within 2% of 64,64,2 except 128-row Q blocks at d64 (they spill: -22%);
# d128 has no shared memory for a third ring slot next to the two dS and dQ staging buffers.
# Later (H200, benchmarks/results/2026-12-02_H200_a031d76/INDEX.md, same-run): at d64 the dQ
# pass's 128-row K/V blocks made the two passes 1.036-1.039x faster (1k, 4k, causal 4k; 4 ring
# slots instead of 3: 0.995-1.012x), and at d128 the single pass led the two passes from 2k on
# (1.021x at 2k, 1.048x at 4k non-causal, 1.05-1.07x causal 4k-8k).  With the two passes'
# causal tiles on persistent CTAs (a031d76) the single pass still led at d128 2k (1.015x
# non-causal, 1.025x causal) and at d64 4k (1.023x non-causal; causal a tie, 0.993x), so d64
# takes it from 4k too (benchmarks/results/2026-12-02_H200_a031d76/INDEX.md).
# At d256 the two passes split the head dim between the warpgroups: 1.61-1.78x v2's backward and
# 0.995-1.14x cuDNN at 1k-16k (benchmarks/results/2026-12-01_H200_86cee91/bars_e0b3aaa.md).
# The single pass at d64 with FlashAttention-3's 128-row Q blocks (S^T / dP^T over all 128 key
# rows, each warpgroup half the Q block; P^T and dS^T through shared memory, two ring slots: 199
# KB; no spills, unlike the 128-row blocks of the 4k sweep above), same run: 1.08x the single
# pass with 64-row blocks at every length (1k-16k, causal 2k and 8k), and 1.057 / 1.088 / 1.078x
# the two passes at 2k / 4k / 16k, 1.008 / 1.080x causal 2k / 8k, a tie at 1k (0.996)
# (benchmarks/results/2026-12-02_H200_308ee87/experiments/d64_bwd.md): d64's single pass takes
# them, and runs from 2k keys.
_V3_GLUON_BWD = [(64, GluonBackward(64, 128, 3)), (128, GluonBackward(64, 64, 2)),
                 (256, GluonBackward(64, 64, 2))]  # d256: 64-row blocks both ways (shared memory)
_V3_GLUON_BWD_SINGLE_PASS = [(64, GluonBackward(128, 128, 2)), (128, GluonBackward(64, 64, 2))]
GLUON_REDUCE_MIN_KEYS = {64: 2048, 128: 2048}  # by padded head dim


def v3_gluon_bwd_config(p, single_pass: bool = False) -> GluonBackward:
    """The tiles of the two passes, or of the single pass (its dq_block_n is not read);
    FLASHTILE_CONFIG_V3_GLUON_BWD=kv_block_m,dq_block_n,stages overrides both tables."""
    override = os.environ.get("FLASHTILE_CONFIG_V3_GLUON_BWD")
    if override:
        return GluonBackward(*(int(x) for x in override.split(",")))
    return _gluon_bwd_tiles(p.head_dim_pad, single_pass)


def _gluon_bwd_tiles(head_dim_pad: int, single_pass: bool) -> GluonBackward:
    return _by_head_dim(_V3_GLUON_BWD_SINGLE_PASS if single_pass else _V3_GLUON_BWD, head_dim_pad)


def v3_default_backward(head_dim_pad: int, seqlen_k: int, deterministic: bool = False) -> str:
    """v3's backward kernels on the GPU when nothing is forced (see v3_backward)."""
    single_from = GLUON_REDUCE_MIN_KEYS.get(head_dim_pad)
    if single_from is not None and seqlen_k >= single_from and not deterministic:
        return "gluon-reduce"
    return "gluon" if head_dim_pad in GLUON_HEAD_DIMS else "v2"


def v3_backward(p) -> str:
    """Which kernels v3's backward runs (FLASHTILE_V3_BWD=gluon|gluon-reduce|v2 forces one):

    - "gluon-reduce": kernels/v3_gluon_bwd.py's single K/V-stationary pass adding dQ by TMA
      reduce-add, by default from GLUON_REDUCE_MIN_KEYS keys on (d64, d128);
    - "gluon": its two passes (dQ, then dK/dV), by default at GLUON_HEAD_DIMS below
      that (at d256 the head dim split between the warpgroups), or with a
      FLASHTILE_CONFIG_V3_GLUON_BWD override;
    - "reduce": the plain-Triton single pass (FLASHTILE_V3_DQ=reduce or a FLASHTILE_CONFIG_V3_BWD
      override);
    - "v2": v2's two passes.
    The single passes sum dQ in an order that varies from run to run: never with
    ``deterministic``.  Under the interpreter (no Gluon) only "v2" and "reduce" run."""
    choice = os.environ.get("FLASHTILE_V3_BWD") or None
    if choice not in (None, "gluon", "gluon-reduce", "v2"):
        raise ValueError(f"FLASHTILE_V3_BWD={choice!r}: expected 'gluon', 'gluon-reduce' or 'v2'")
    if not p.deterministic and (os.environ.get("FLASHTILE_V3_DQ") == "reduce"
                                or os.environ.get("FLASHTILE_CONFIG_V3_BWD")):
        return "reduce"
    if runtime.interpreting() or choice == "v2":
        return "v2"
    if choice == "gluon-reduce":  # the single pass does not split the head dim
        return "gluon" if p.deterministic or split_head_dim(p.head_dim_pad) else "gluon-reduce"
    if choice == "gluon" or os.environ.get("FLASHTILE_CONFIG_V3_GLUON_BWD"):
        return "gluon"
    return v3_default_backward(p.head_dim_pad, p.seqlen_k, p.deterministic)


def gpu_tiles(version: str, head_dim_pad: int, banded: bool, seqlen_k: int):
    """((fwd block_m, block_n), (bwd dK/dV block_m, block_n)) used on the GPU (batched problems),
    for the IO model."""
    kernels = v3_default_backward(head_dim_pad, seqlen_k) if version == "v3" else "v2"
    if kernels != "v2":  # the Gluon dK/dV pass
        cfg = _gluon_bwd_tiles(head_dim_pad, kernels == "gluon-reduce")
        bwd = (cfg.kv_block_m, gluon_bwd_stationary_rows(head_dim_pad))
    else:
        b = _by_head_dim(_V2_BWD_KV_BAND if banded else _V2_BWD_KV, head_dim_pad)
        bwd = (b.block_m, b.block_n)
    if version == "v3":  # the Gluon forward
        schedule = replace(_by_head_dim(_V3_GLUON, head_dim_pad),  # (the model's shapes: as many queries)
                           consumers=gluon_consumers(head_dim_pad, banded, seqlen_k))
        fwd = (schedule.tile_m, schedule.block_n)
    else:
        f = _by_head_dim(_v2_fwd_table(banded, seqlen_k), head_dim_pad)
        fwd = (f.block_m, f.block_n)
    return fwd, bwd
