"""Tile tables: block sizes, warps and pipeline depth per kernel and head dim.

Chosen by hand from sweeps on the H200 (docs/tuning.md; ``scripts/gpu_check.sh sweep`` reruns
one) rather than by ``triton.autotune``: multi-config autotuning does not run under the CPU
interpreter, and a fixed table keeps every launch reproducible.  Nothing here decides which
kernel runs (dispatch.py does) or reads the environment (options.py does); a tile override
(``KernelOptions.tiles``) replaces one table's entry and nothing else.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False


# Under the interpreter tiles are numpy arrays: mid-size tiles keep CPU tests fast while
# still giving several blocks (and all three masking segments) at test sequence lengths.
INTERPRETER = Config(32, 32, 4, 1)


def by_head_dim(table, head_dim_pad):
    """The entry of ``table`` ((largest padded head dim, entry), ...) for ``head_dim_pad``."""
    for limit, entry in table:
        if head_dim_pad <= limit:
            return entry
    return table[-1][1]


# v2 (b4 h16/32 s4096 sweep).
V2_FWD = [(64, Config(128, 64, 4, 3)), (128, Config(128, 128, 8, 3)), (256, Config(128, 64, 8, 2))]
V2_BWD_KV = [(64, Config(32, 128, 4, 3)), (128, Config(64, 128, 8, 2)), (256, Config(64, 64, 8, 2))]
V2_BWD_Q = [(64, Config(128, 32, 4, 3)), (128, Config(128, 64, 8, 3)), (256, Config(128, 32, 8, 2))]
# Causal/window bands: narrower K tiles waste less work on the diagonal.
V2_FWD_BAND = [(64, Config(128, 64, 4, 3)), (128, Config(128, 64, 8, 3)), (256, Config(128, 64, 8, 2))]
# A band over at most SHORT_KEYS keys is read more than computed on: small tiles fit three
# programs per SM and keep more loads in flight.
SHORT_KEYS = 1024
V2_FWD_BAND_SHORT = [(64, Config(128, 64, 4, 3)), (128, Config(64, 32, 4, 3)), (256, Config(128, 64, 8, 2))]
V2_BWD_KV_BAND = [(64, Config(32, 128, 4, 3)), (128, Config(32, 64, 4, 3)), (256, Config(64, 64, 8, 2))]


# With dropout the keep mask changes layout through shared memory: one stage fewer at d128.
V2_FWD_DROPOUT = [(64, Config(128, 64, 4, 3)), (128, Config(128, 128, 8, 2)), (256, Config(128, 64, 8, 2))]


# Float8 tiles hold half the bytes: wider K tiles at d256, and for bands 64 query rows at d128
# (d128 16k causal 632 TFLOP/s against 531 with 128 rows; d256 16k: 250 / 401 against 199 / 352).
V2_FWD_FP8 = [(64, Config(128, 64, 4, 3)), (128, Config(128, 128, 8, 3)), (256, Config(128, 128, 8, 2))]
V2_FWD_FP8_BAND = [(64, Config(128, 64, 4, 3)), (128, Config(64, 128, 4, 3)), (256, Config(128, 128, 8, 2))]


def v2_fwd_table(banded: bool, seqlen_k: int, dropout: bool = False, fp8: bool = False):
    if fp8:
        return V2_FWD_FP8_BAND if banded else V2_FWD_FP8
    if not banded:
        return V2_FWD_DROPOUT if dropout else V2_FWD
    return V2_FWD_BAND_SHORT if seqlen_k <= SHORT_KEYS else V2_FWD_BAND


def v2_bwd_kv_table(banded: bool):
    return V2_BWD_KV_BAND if banded else V2_BWD_KV


# v3's plain-Triton forward.  With no band and seqlen_k a multiple of the K tile one unmasked
# loop runs, warp-specialized at d128 (Triton 3.6 needs num_warps=4 for it); V3_FWD_UNMASKED is
# the same without warp specialization (where it cannot run: the interpreter, seqlen_q % 4 != 0).
V3_FWD_WS = [(64, Config(128, 128, 4, 3)), (128, Config(128, 128, 4, 2, True)), (256, Config(128, 64, 8, 2))]
V3_FWD_UNMASKED = [(64, Config(128, 128, 4, 3)), (128, Config(128, 128, 8, 3)), (256, Config(128, 64, 8, 2))]
V3_FWD_BAND = [(64, Config(128, 64, 4, 3)), (128, Config(128, 64, 8, 3)), (256, Config(128, 64, 8, 2))]


def v3_fwd_table(unmasked: bool, warp_specialize: bool):
    if not unmasked:
        return V3_FWD_BAND
    return V3_FWD_WS if warp_specialize else V3_FWD_UNMASKED


WARPGROUP_ROWS = 64  # the rows of an accumulator one warpgroup's MMA covers
GLUON_HEAD_DIMS = (64, 128, 256)  # padded head dims the Gluon kernels (forward and backward) take


@dataclass(frozen=True)
class GluonSchedule:
    """v3's Gluon forward: K/V tile, ring depth, consumer warpgroups and its FA3 techniques."""
    block_n: int
    num_stages: int
    pingpong: bool = True
    overlap: bool = True
    persistent: bool = True
    next_q: bool = True       # a second Q buffer: the next tile's Q and K/V load under this tile's tail
    q_registers: bool = True  # Q as the register operand of S = Q K^T (where registers hold it)
    consumers: int = 2        # consumer warpgroups, 64 query rows each
    exp2_on_fma: int = 0      # 1/N of the softmax's exponentials on the FMA pipe (2, 4, 8; 0 none)
    row_trees: bool = False   # the softmax's row maxima and sums as register trees (gluon_schedule)

    @property
    def tile_m(self) -> int:
        return WARPGROUP_ROWS * self.consumers


# Two consumer warpgroups of 64 rows; shared memory holds Q, the K/V ring and, where it fits, O
# for its TMA store: d64 three slots of 128 keys, d128 two (a third leaves no room to stage O),
# 192 lanes of Q and K (qk_slices) with V of at most 128 two of 128, d256 two of 64.  Keyed by
# gluon_table_lanes.
V3_GLUON = [(64, GluonSchedule(128, 3)), (128, GluonSchedule(128, 2)), (192, GluonSchedule(128, 2)),
            (256, GluonSchedule(64, 2))]
# Float8 Q/K/V take half the shared memory: a deeper ring at the same tiles.  At d128 a score
# costs as many MUFU cycles as float8 tensor-core cycles: a quarter of the exponentials go to the
# FMA pipe, where no band masks (dispatch.gluon_schedule; causal, d256 and bf16 d64 lost with it).
V3_GLUON_FP8 = [(64, GluonSchedule(128, 4)), (128, GluonSchedule(128, 3, exp2_on_fma=4)), (256, GluonSchedule(64, 3))]
# Float8 P V products summed into O in float32 (the Gluon forward's FRESH_PV) up to this head
# dim: at d256 a second 64 x 256 accumulator takes the registers O already fills.
FRESH_PV_MAX_HEAD_DIM = 128


def fresh_pv(p) -> bool:
    """Whether problem ``p``'s Gluon forward sums each block's float8 P V product into O in
    float32 (float8 MMAs accumulate in fewer bits): float8 up to FRESH_PV_MAX_HEAD_DIM."""
    return bool(p.fp8) and p.head_dim_v_pad <= FRESH_PV_MAX_HEAD_DIM


# Three consumer warpgroups (192-row tiles, 160 registers each, as FlashAttention-3's d64
# forward) pay at d64 once there are enough query rows to fill them: from this many rows,
# without and with a band; float8 inputs (half the MMA time, the same softmax) already at 4k
# rows with a band.  d128 has no registers for them (ptxas spills).
THREE_CONSUMERS_FROM = {False: 2048, True: 8192}
THREE_CONSUMERS_FROM_FP8 = {False: 2048, True: 4096}


def gluon_consumers(head_dim_pad: int, banded: bool, seqlen_q: int, fp8: bool = False, dropout: bool = False) -> int:
    """Two, or three at d64 from THREE_CONSUMERS_FROM(_FP8) rows; two with dropout, whose draws
    leave three consumers' 160 registers short (spills on a band, register moves without):
    two measured 1.01-1.07x three at d64 8k-16k with dropout (H100)."""
    start = (THREE_CONSUMERS_FROM_FP8 if fp8 else THREE_CONSUMERS_FROM)[banded]
    return 3 if head_dim_pad == 64 and seqlen_q >= start and not dropout else 2


@dataclass(frozen=True)
class GluonBackward:
    """v3's Gluon backward: the streamed block of each pass (the stationary side is
    gluon_bwd_stationary_rows) and the ring depth."""
    kv_block_m: int  # dK/dV pass: Q/dO rows per streamed block
    dq_block_n: int  # dQ pass: K/V rows per streamed block
    num_stages: int
    persistent: bool = True  # a CTA per SM walking the tiles, where the pass has room for it


# The two passes: at d64 the dQ pass streams 128-row K/V blocks; d128 has no shared memory for
# a third ring slot; d256 takes 64-row blocks both ways.
V3_GLUON_BWD = [(64, GluonBackward(64, 128, 3)), (128, GluonBackward(64, 64, 2)), (256, GluonBackward(64, 64, 2))]
# The float8 passes (fp8_attn_func's FP8 backward; half the shared memory per tile): the dQ pass
# streams 128-row K/V blocks at d128 too, where its S and dP fit in registers beside dQ.
V3_GLUON_BWD_FP8 = [(64, GluonBackward(64, 128, 3)), (128, GluonBackward(64, 128, 2)),
                    (256, GluonBackward(64, 64, 2))]
# The single pass: FlashAttention-3's 128-row Q blocks at d64 (P^T and dS^T through shared
# memory), 64-row blocks at d128.  It does not split the head dim (no d256).
V3_GLUON_BWD_REDUCE = [(64, GluonBackward(128, 128, 2)), (128, GluonBackward(64, 64, 2))]
# From how many keys the single pass runs by default (padded head dim -> keys): below that its
# fp32 dQ round trip and extra launch outweigh the second pass it saves.
GLUON_REDUCE_MIN_KEYS = {64: 2048, 128: 2048}
# The Gluon backward's stationary rows per CTA: one 64-row slice per consumer warpgroup, or
# above d128 (split_head_dim) 64 rows the two warpgroups share, each holding half the head dim.
GLUON_TILE_M = 2 * WARPGROUP_ROWS


def split_head_dim(head_dim_pad: int) -> bool:
    """Whether the Gluon backward splits the head dim between its consumer warpgroups."""
    return head_dim_pad > 128


def qk_lanes(p) -> int:
    """The lanes of Q and K that the Gluon kernels' S = Q K^T reduces over: the padded head dim,
    or 192 for head dims 129 to 192 in d256's tiles, as two products over 128 and 64 lanes (a
    quarter of the steps less; shared-memory blocks are powers of two, so the tiles keep 256
    lanes, zeros past the head dim).  Not float8 (its MMAs reduce 32 lanes a step)."""
    return 192 if p.head_dim_pad == 256 and p.head_dim <= 192 and not p.fp8 else p.head_dim_pad


# The Gluon forward loads Q and K of 192 lanes (qk_lanes) as three slices of QK_SLICE_LANES, so
# they take 192 lanes of shared memory, not d256's 256.
QK_SLICE_LANES = 64


def qk_slices(p) -> int:
    """Lane slices the Gluon forward loads Q and K as: 3 of QK_SLICE_LANES for 192 lanes, else 1
    (the whole padded head dim)."""
    return qk_lanes(p) // QK_SLICE_LANES if qk_lanes(p) == 192 else 1


def gluon_table_lanes(p) -> int:
    """The key of the Gluon forward's and two passes' tables: the wider of Q's and K's lanes
    (qk_lanes) and V's padded head dim."""
    return max(qk_lanes(p), p.head_dim_v_pad)


def gluon_bwd_stationary_rows(head_dim_pad: int) -> int:
    return WARPGROUP_ROWS if split_head_dim(head_dim_pad) else GLUON_TILE_M


def gluon_reduce_by_default(head_dim_pad: int, seqlen_k: int) -> bool:
    """Whether v3's backward runs the single pass (rather than the two) when nothing forces it."""
    min_keys = GLUON_REDUCE_MIN_KEYS.get(head_dim_pad)
    return min_keys is not None and seqlen_k >= min_keys
