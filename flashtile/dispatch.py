"""The one place that decides what runs: a version, a problem and options in, a frozen plan out.

``forward_plan`` and ``backward_plan`` return a ``Plan``: which kernel (a name below) and its
tiles; ``run_forward`` and ``run_backward`` execute one.  Kernel modules compute what a plan
tells them and choose nothing.

Forward kernels:
  "tiled"        the PyTorch implementation (CPU tensors outside the interpreter; empty problems)
  "v1"           FlashAttention-1 (kernels/v1.py)
  "v2"           FlashAttention-2 (kernels/v2.py)
  "v3-gluon"     FlashAttention-3's warp-specialized forward in Gluon (kernels/gluon/forward.py)
  "v3-triton"    the Hopper forward in plain Triton (kernels/v3.py): what the Gluon kernel does
                 not take (broadcast layouts, the interpreter) and, unless kernel options force
                 the Gluon one, varlen
With a V head dim of its own (no wider than Q's) v3 runs the Gluon forward (not in float8)
and the two Gluon backward passes (batched, without dropout), else v2's kernels.
With dropout (kernels/dropout.py) the Gluon forward where it runs (else v2's) and the two
Gluon backward passes up to d128 (else, or with backward=v2, v2's backward).  FP8 inputs run
the Gluon forward where it takes the problem, else v2's; their backward (fp8_attn_func's FP8 backward)
the two Gluon passes on float8 MMAs where they take the problem, else (or with backward=v2)
v2's kernels in their FP8 mode.
Backward kernels:
  "tiled", "v1", "v2"   as above
  "v3-gluon"     two warp-specialized Gluon passes, dQ then dK/dV, bitwise reproducible
                 (kernels/gluon/backward.py); packed sequences only when kernel options force it
  "v3-gluon-reduce"  one K/V-stationary Gluon pass adding dQ by TMA reduce-add (FlashAttention-3's)
  "v3-gluon-fp8" FP8 inputs: the two passes on float8 MMAs (kernels/gluon/backward_fp8.py)

``decode_plan`` does the same for queries against a KV cache (the split-KV kernel of
kernels/decode.py, flash_attn_with_kvcache).
"""
import functools
import importlib
from dataclasses import dataclass, replace

import torch

from flashtile import gpu, options as _options
from flashtile.kernels import configs, score
from flashtile.kernels.configs import Config
from flashtile.kernels.problem import cdiv, next_power_of_2, remembered

VERSIONS = ("v1", "v2", "v3")
# Every accepted value of ``version``: "tiled" is the PyTorch implementation, runnable anywhere.
VERSION_CHOICES = ("auto", *VERSIONS, "tiled")


def why_not(version: str, device: torch.device) -> str | None:
    """None if ``version`` can run on ``device``; otherwise the reason it cannot."""
    if version == "tiled":
        return None
    if device.type == "cpu":
        if _options.interpreting():
            return None
        return ("Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 set before importing "
                "flashtile to run them on CPU tensors; version='auto' uses the PyTorch tiled path on CPU")
    if device.type != "cuda":
        return f"device type {device.type!r} is not supported"
    major, minor = gpu.capability(device.index)
    if version == "v3" and major != 9:
        return f"v3 uses Hopper TMA and warp specialization (compute capability 9.0); this GPU is {major}.{minor}"
    if major < 8:
        return f"flashtile needs compute capability >= 8.0; this GPU is {major}.{minor}"
    return None


def resolve_version(version: str, device: torch.device) -> str:
    """Map 'auto' to the best version for the device and refuse versions that cannot run."""
    if version == "auto":
        if device.type == "cpu" and not _options.interpreting():
            return "tiled"
        if device.type == "cuda" and why_not("v3", device) is None:
            return "v3"
        return "v2"
    reason = why_not(version, device)
    if reason is not None:
        raise RuntimeError(f"version={version!r} cannot run on {device}: {reason}")
    return version


@dataclass(frozen=True)
class Plan:
    kernel: str
    config: object = None  # the kernel's tiles: Config, GluonSchedule, GluonBackward or a pair
    splits: int | None = None  # v1: programs per (batch, head) (None: enough to fill the GPU)
    unmasked: bool = False     # v3-triton: one loop without masks (no band, whole K tiles)


@dataclass(frozen=True)
class Target:
    """What a plan depends on besides the problem: where the kernels run."""
    gluon: bool        # the Gluon kernels take these tensors
    interpreter: bool  # Triton kernels run on the CPU interpreter (its small tiles)


# The GPU as the tile tables and the IO model see it: Gluon kernels, no interpreter.
HOPPER = Target(gluon=True, interpreter=False)


def broadcast(x) -> bool:
    """A stride 0 (a broadcast batch or head), which the Gluon kernels' 4-D descriptors do not take."""
    return 0 in x.stride()[:-1]


def gluon_takes(p) -> bool:
    """Whether the Gluon kernels take problem ``p``: Q's and V's head dims among those they are
    built for (packed sequences: forward_plan and backward_plan say which)."""
    return all(pad in configs.GLUON_HEAD_DIMS and dim % 8 == 0
               for pad, dim in ((p.head_dim_pad, p.head_dim), (p.head_dim_v_pad, p.head_dim_v)))


def target_of(p, *tensors) -> Target:
    """The Gluon kernels take the problems of ``gluon_takes`` on a GPU, in layouts a 4-D TMA
    descriptor describes (aligned copies are made where needed: tma.ready)."""
    interpreter = _options.interpreting()
    gluon = tensors[0].is_cuda and not interpreter and gluon_takes(p) and not any(map(broadcast, tensors))
    return Target(gluon, interpreter)


def _tiles(opts, target, table, default):
    """``default``, the interpreter's tile under it, or the options' override of ``table``."""
    override = opts.tile(table)
    if override is not None:
        return Config(*override[:4], *(bool(x) for x in override[4:]))
    return configs.INTERPRETER if target.interpreter else default


def _v1_plan(p, target, opts, mode) -> Plan:
    from flashtile.kernels import v1  # its tiles follow the paper's rule
    fwd, bwd = v1.block_sizes(p.widest_head_dim_pad)
    cfg = Config(*(fwd if mode == "fwd" else bwd), 4 if p.widest_head_dim_pad <= 64 else 8, 1)
    cfg = _tiles(opts, target, f"v1_{mode}", cfg)
    return Plan("v1", _dropout_keys(p, cfg.block_n, f"v1_{mode}", cfg), splits=opts.v1_splits)


@remembered
def forward_plan(p, version: str, target: Target, opts) -> Plan:
    """The forward kernel and tiles of problem ``p`` under ``version`` (already resolved)."""
    if p.empty or version == "tiled":
        return Plan("tiled")
    if version == "v1":
        return _v1_plan(p, target, opts, "fwd")
    if version == "v2":
        return _v2_forward(p, target, opts)
    kernel = opts.forward or "gluon"
    # Packed sequences take the Gluon forward (its walk runs down a device-side tile list)
    # only when the options ask for it (experimental), not in float8 (V's keys-contiguous copy
    # is batched), and while the walk's tile numbers fit in 32 bits (at most batch x heads x
    # the longest sequence's blocks).
    gluon = kernel == "gluon" and target.gluon and (not p.varlen or (opts.forward == "gluon" and not p.fp8 and (
        p.batch * p.heads_q * p.query_blocks(configs.WARPGROUP_ROWS) < 2**31)))
    # It takes a V head dim of its own, not in float8, and V wider than Q only when the options
    # ask for it (the pairs run on the GPU have V no wider than Q, as the backward takes them).
    if p.own_head_dim_v and (p.fp8 or (p.head_dim_v_pad > p.head_dim_pad and opts.forward != "gluon")):
        gluon = False
    if gluon:
        return Plan("v3-gluon", gluon_schedule(p, opts))
    # The plain-Triton Hopper forward has no float8, dropout or V head dim of its own.
    if p.own_head_dim_v or p.fp8 or p.dropout:
        return _v2_forward(p, target, opts)
    if kernel == "v2" or (kernel == "gluon" and p.banded and p.seqlen_k <= configs.SHORT_KEYS):
        # Short bands the Gluon kernel does not take run faster in v2 than in plain Triton.
        return _v2_forward(p, target, opts)
    return v3_triton_forward(p, target, opts)


def _v2_forward(p, target, opts) -> Plan:
    table = configs.v2_fwd_table(p.banded, p.seqlen_k, p.dropout, p.fp8)
    cfg = _tiles(opts, target, "v2_fwd", configs.by_head_dim(table, p.widest_head_dim_pad))
    return Plan("v2", _dropout_keys(p, cfg.block_n, "v2_fwd", cfg))


def _dropout_keys(p, keys, table, plan_config):
    """``plan_config``, once its blocks of ``keys`` keys suit dropout's draws (kernels/dropout.py:
    multiples of 32); an override of tiles ``table`` that does not is refused here, not at
    compile time."""
    if p.dropout and keys % 32:
        raise ValueError(f"kernel option tiles.{table}: dropout takes keys in blocks of 32, not {keys}")
    return plan_config


def v3_triton_forward(p, target, opts) -> Plan:
    """The plain-Triton Hopper forward's plan (v3's where the Gluon kernel does not run)."""
    def tiles(unmasked, ws):
        table = configs.v3_fwd_table(unmasked, ws)
        return _tiles(opts, target, "v3_fwd", configs.by_head_dim(table, p.head_dim_pad))

    # One unmasked loop: no band, batched, whole K tiles.
    cfg = tiles(not p.banded and not p.varlen, True)
    unmasked = not p.banded and not p.varlen and p.seqlen_k % cfg.block_n == 0
    # Triton 3.6's warp specialization: not under the interpreter, and the logsumexp's 1-D TMA
    # store needs 16-byte aligned rows (seqlen_q % 4 == 0).
    ws = unmasked and not target.interpreter and p.seqlen_q % 4 == 0
    if cfg.warp_specialize and not ws:
        cfg = tiles(unmasked, False)
    return Plan("v3-triton", replace(cfg, warp_specialize=cfg.warp_specialize and ws), unmasked=unmasked)


def gluon_schedule(p, opts) -> configs.GluonSchedule:
    """The Gluon forward's schedule: the table's tiles (or the override: block_n, stages,
    consumers and a share of the exponentials on the FMA pipe; the table's share not on a band),
    row reductions as trees with dropout, with the ablated techniques off."""
    override = opts.tile("v3_gluon")
    if override is not None:
        block_n, stages, consumers, exp2_on_fma = (*override, 0)[:4]
        if consumers not in (2, 3) or (consumers == 3 and p.widest_head_dim_pad > 64):
            raise ValueError(f"kernel option tiles.v3_gluon={override}: 2 consumers, or 3 up to head dim 64")
        if exp2_on_fma not in (0, 2, 4, 8):
            raise ValueError(f"kernel option tiles.v3_gluon={override}: the exponentials' share on the FMA pipe "
                             f"is 1/2, 1/4 or 1/8 (2, 4, 8) or none (0)")
        cfg = _dropout_keys(p, block_n, "v3_gluon", configs.GluonSchedule(block_n, stages, consumers=consumers,
                                                                          exp2_on_fma=exp2_on_fma))
    else:
        table = configs.V3_GLUON_FP8 if p.fp8 else configs.V3_GLUON
        cfg = configs.by_head_dim(table, configs.gluon_table_lanes(p))
        cfg = replace(cfg, consumers=configs.gluon_consumers(p.widest_head_dim_pad, p.banded, p.seqlen_q, p.fp8,
                                                            p.dropout),
                      exp2_on_fma=0 if p.banded else cfg.exp2_on_fma)
    # Row reductions as trees shorten the consumer's critical path, which pays where the dropout's
    # draws lengthen it (H100, d128 8k: forward with dropout 1.05-1.06x); without dropout the same
    # instructions in another order were level in bf16 and 0.95x in float8 d128.
    return replace(cfg, row_trees=p.dropout, **{t: False for t in opts.ablate})


@remembered
def backward_plan(p, version: str, target: Target, opts) -> Plan:
    """The backward kernels and tiles of problem ``p`` under ``version`` (already resolved)."""
    if p.empty or version == "tiled":
        return Plan("tiled")
    if version == "v1":
        return _v1_plan(p, target, opts, "bwd")
    gluon = _gluon_backward_takes(p, target, opts)
    if p.fp8 and version != "v2" and gluon and opts.backward != "v2":
        cfg = gluon_backward_config(p, opts, False)
        if _fp8_gluon_backward_takes(p, cfg):
            return Plan("v3-gluon-fp8", cfg)
    # Float8 inputs the float8 passes do not take run v2's kernels in their FP8 mode.
    v2 = version == "v2" or p.fp8 or not gluon
    kernel = "v2" if v2 else _v3_backward_kernel(p, opts)
    if kernel == "v2":
        kv = configs.by_head_dim(configs.v2_bwd_kv_table(p.banded), p.widest_head_dim_pad)
        dq = configs.by_head_dim(configs.V2_BWD_Q, p.widest_head_dim_pad)
        kv, dq = _tiles(opts, target, "v2_bwd_kv", kv), _tiles(opts, target, "v2_bwd_q", dq)
        if p.fp8:
            # One descale per block a matmul reduces over: the dK/dV pass's query blocks within
            # Q's descale blocks, the dQ pass's key blocks within K's and V's (powers of two).
            q_rows, kv_rows = p.fp8_rows
            kv, dq = replace(kv, block_m=min(kv.block_m, q_rows)), replace(dq, block_n=min(dq.block_n, kv_rows))
            if min(kv.block_m, dq.block_n) < 32:  # Hopper's float8 MMA reduces over 32 at least
                raise ValueError(f"the FP8 backward's matmuls reduce over 32 rows or more: dK/dV pass {kv.block_m} "
                                 f"queries, dQ pass {dq.block_n} keys (kernel options tiles.v2_bwd_kv, "
                                 f"tiles.v2_bwd_q; the forward's descale blocks {p.fp8_rows})")
        _dropout_keys(p, kv.block_n, "v2_bwd_kv", kv)
        return Plan("v2", (kv, _dropout_keys(p, dq.block_n, "v2_bwd_q", dq)))
    return Plan(kernel, gluon_backward_config(p, opts, kernel == "v3-gluon-reduce"))


def gluon_backward_config(p, opts, reduce: bool) -> configs.GluonBackward:
    """The Gluon backward's tiles for ``p``: the single pass's (``reduce``) or the two passes'
    (on float8 inputs the float8 passes' own, where they take the problem with them)."""
    table = "v3_gluon_bwd_reduce" if reduce else "v3_gluon_bwd"
    override = opts.tile(table)
    if override is not None:
        cfg = configs.GluonBackward(*override)
    elif p.fp8 and not reduce:
        cfg = configs.by_head_dim(configs.V3_GLUON_BWD_FP8, p.head_dim_pad)
        if not _fp8_gluon_backward_takes(p, cfg):  # (e.g. K's descale blocks shorter than its key blocks)
            cfg = configs.by_head_dim(configs.V3_GLUON_BWD, p.head_dim_pad)
    else:
        cfg = configs.by_head_dim(configs.V3_GLUON_BWD_REDUCE if reduce else configs.V3_GLUON_BWD, p.head_dim_pad)
    cfg = _dropout_keys(p, cfg.dq_block_n, table, cfg)
    return replace(cfg, persistent="persistent" not in opts.ablate)


def _fp8_gluon_backward_takes(p, cfg) -> bool:
    """Whether the float8 Gluon passes take FP8 problem ``p`` with tiles ``cfg``: descales per
    block, each block a pass streams (the dK/dV pass's Q and dO blocks, quantized dO's blocks
    too; the dQ pass's K/V blocks) inside one descale block, a consumer warpgroup's 64 stationary
    rows inside one of Q's and dO's; batched, one head dim and key block a multiple of 32 (a
    float8 MMA reduces over 32); no dropout."""
    q_rows, kv_rows = p.fp8_rows
    return (p.fp8_per_block and q_rows % cfg.kv_block_m == 0 and cfg.kv_block_m % configs.WARPGROUP_ROWS == 0
            and kv_rows % cfg.dq_block_n == 0 and cfg.dq_block_n % 32 == 0 and not p.varlen
            and not p.own_head_dim_v and not p.dropout and p.head_dim_pad % 32 == 0)


def _gluon_backward_takes(p, target, opts) -> bool:
    """Whether the Gluon backward runs problem ``p`` (else v2's): batched problems, and packed
    sequences (its two passes down device-side tile lists) only when the options ask for it
    (experimental), up to d128, while the walks' tile numbers fit in 32 bits, and without
    seqused tables (its MMAs read the rows after a sequence, which there may hold anything:
    masked to 0, a value that is not finite would still make 0 x inf).  Dropout in the two
    passes up to d128 (d256's split head dim has no draw); and a V head dim of its own in the
    two passes, batched, without dropout, no wider than Q's padded head dim (the tiles are Q's
    head dim's)."""
    if not target.gluon:
        return False
    if p.own_head_dim_v and (p.varlen or p.dropout or p.head_dim_v_pad > p.head_dim_pad):
        return False
    if p.dropout and configs.split_head_dim(p.head_dim_pad):
        return False
    if not p.varlen:
        return True
    rows = configs.gluon_bwd_stationary_rows(p.head_dim_pad)
    return (opts.backward == "gluon" and not configs.split_head_dim(p.head_dim_pad) and not p.seqused
            and p.batch * p.heads_q * max(p.query_blocks(rows), p.key_blocks(rows)) < 2**31)


def _v3_backward_kernel(p, opts) -> str:
    """v3's backward where the Gluon kernels run: by default the single pass from
    GLUON_REDUCE_MIN_KEYS keys (d64, d128), the two Gluon passes below that, at d256 (the head
    dim split between the warpgroups), whenever gradients must be bitwise reproducible, with a
    V head dim of its own (the single pass's D kernel and dQ staging take one head dim), and with
    a score modification the single pass has no registers for (ScoreMod.single_pass)."""
    if opts.backward == "v2":
        return "v2"
    if p.dropout:  # only the two passes draw it
        return "v3-gluon"
    mod = score.mod_of(p)
    single_pass_possible = (not p.deterministic and not configs.split_head_dim(p.head_dim_pad)
                            and not p.own_head_dim_v and (mod is None or mod.single_pass))
    if opts.backward == "gluon-reduce":
        return "v3-gluon-reduce" if single_pass_possible else "v3-gluon"
    if opts.backward == "gluon":
        return "v3-gluon"
    if single_pass_possible and configs.gluon_reduce_by_default(p.head_dim_pad, p.seqlen_k):
        return "v3-gluon-reduce"
    return "v3-gluon"


_FORWARD_MODULES = {"tiled": "flashtile.tiled", "v1": "flashtile.kernels.v1", "v2": "flashtile.kernels.v2",
                    "v3-triton": "flashtile.kernels.v3", "v3-gluon": "flashtile.kernels.gluon.forward"}
_BACKWARD_MODULES = {"tiled": "flashtile.tiled", "v1": "flashtile.kernels.v1", "v2": "flashtile.kernels.v2",
                     "v3-gluon": "flashtile.kernels.gluon.backward",
                     "v3-gluon-reduce": "flashtile.kernels.gluon.backward",
                     "v3-gluon-fp8": "flashtile.kernels.gluon.backward_fp8"}


@functools.lru_cache(maxsize=None)  # asked at every call: import_module costs a few us
def _module(name: str):
    return importlib.import_module(name)


def run_forward(plan: Plan, p, q, k, v):
    """(out, lse, saved) of the plan's forward kernel; ``saved``: what its backward needs beyond lse."""
    return _module(_FORWARD_MODULES[plan.kernel]).forward(plan, p, q, k, v)


def run_backward(plan: Plan, p, dout, dlse, q, k, v, out, lse, saved):
    """(dq, dk, dv) of the plan's backward kernels; ``dlse`` may be None."""
    return _module(_BACKWARD_MODULES[plan.kernel]).backward(plan, p, dout, dlse, q, k, v, out, lse, saved)


@dataclass(frozen=True)
class DecodePlan:
    """The split-KV kernel's tiles for queries against a KV cache (kernels/decode.py)."""
    block_m: int     # rows: query tokens x the query heads of one KV head
    block_n: int     # keys per step
    splits: int      # programs per row block sharing its keys; 1: no combine
    num_warps: int
    num_stages: int
    upcast: bool     # fp32 tiles under the interpreter (its bf16 matmuls are wrong)
    pdl: bool = False  # the combine launched as the split kernel's programmatic dependent (Hopper)
    maxnreg: int | None = None  # registers a thread at most (None: the compiler's choice)


# Keys a split should have at least: fewer make the combine's reads weigh.
DECODE_MIN_SPLIT_KEYS = 256
DECODE_MAX_SPLITS = 64
# Programs per SM the split count aims at: one for a contiguous cache on a device that reads
# under DECODE_TWO_PER_SM_GBPS of DRAM bandwidth per SM (the H100 SXM's 25 GB/s), where one per
# SM read faster than two; two for a paged cache, which read slower with one there, and on
# devices of more bandwidth per SM (the H200's 37), where two read faster.  Two per SM still go
# to one where they would cut each row block's keys into more than DECODE_MANY_SPLITS splits of
# fewer than DECODE_SHORT_SPLIT_KEYS keys (a contiguous cache) or DECODE_SHORT_PAGED_SPLIT_KEYS
# (pages, which read faster with two down to shorter splits), which read faster with one.  The
# measurements are in docs/README.md's decode section.
DECODE_TWO_PER_SM_GBPS = 30.0
DECODE_MANY_SPLITS = 16
DECODE_SHORT_SPLIT_KEYS = 1024
DECODE_SHORT_PAGED_SPLIT_KEYS = 256


# Query rows a KV head (a sequence's queries x the query heads sharing the KV head) up to which a
# paged varlen call without gradients reads its pages in place with the split-KV kernels: one
# row block (decode_plan's largest), so each key is read once a KV head.  Past it, the row
# blocks would read the keys again on tiles without Hopper's warpgroup MMA, where the varlen
# kernels on a gathered copy of the keys (read and written once more) take their place.
PAGED_VARLEN_IN_PLACE_ROWS = 64


def paged_varlen_in_place(max_seqlen_q: int, heads: int, heads_k: int, capturing: bool) -> bool:
    """Whether a paged flash_attn_varlen_func call without gradients reads its pages in place
    (kvcache.paged_varlen_attention): up to PAGED_VARLEN_IN_PLACE_ROWS rows a KV head, or under
    CUDA-graph capture (where the gathered copy, sized by offsets read on the host, cannot be)."""
    return capturing or max_seqlen_q * (heads // max(heads_k, 1)) <= PAGED_VARLEN_IN_PLACE_ROWS


def decode_plan(q, heads_k: int, capacity: int, num_splits: int, paged: bool = False,
                opts=_options.ENVIRONMENT, shape=None) -> DecodePlan:
    """Tiles and split count for q (batch, seqlen_q, heads, head_dim) over a cache of ``capacity``
    keys per sequence (``paged``: in pages, through a block table). ``num_splits`` 0: as many
    programs as one per SM hold for a contiguous cache on a device of less bandwidth per SM than
    DECODE_TWO_PER_SM_GBPS, else as two per SM hold, where the row blocks alone are fewer (a
    count between one and two per SM, or past two, leaves a partial wave), one per SM where two
    would make many short splits (DECODE_MANY_SPLITS), each split at least DECODE_MIN_SPLIT_KEYS
    keys of the capacity (a static shape: no sequence length is read on the host); > 0: that
    many, at most DECODE_MAX_SPLITS (the combine holds every split's partial output of a row at
    once). ``opts``: its tiles.decode / decode_paged override (keys a step, stages, warps[,
    registers a thread]). ``shape``: (batch, seqlen_q, heads, head_dim) where q is packed (the
    longest sequence's queries). Asked at every decoding step: remembered per shape."""
    device = q.device.index if q.is_cuda else None
    tiles = opts.tile("decode_paged" if paged else "decode")
    return _decode_plan(*(shape or q.shape), q.dtype, device, heads_k, capacity, num_splits, paged,
                        _options.interpreting(), tiles)


@functools.lru_cache(maxsize=256)
def _decode_plan(batch, seqlen_q, heads, head_dim, dtype, device, heads_k, capacity, num_splits, paged,
                 interpreter, tiles=None) -> DecodePlan:
    on_gpu = not interpreter and device is not None
    rows = seqlen_q * (heads // heads_k)
    block_m = min(64, max(16, next_power_of_2(rows)))
    # Pages: the table's load takes a pipeline stage of its own, so a paged cache runs one more
    # stage and steps of twice the keys, to keep as many in flight as a contiguous one.
    block_n = 16 if interpreter else (64 if head_dim <= 128 else 32) * (2 if paged else 1)
    if num_splits > 0:
        splits = min(num_splits, DECODE_MAX_SPLITS)
    else:
        sms = gpu.sm_count(device) if on_gpu else 4
        programs = max(cdiv(rows, block_m) * batch * heads_k, 1)  # (no query at all: one split of nothing)
        two = 2 * sms // programs
        short = DECODE_SHORT_PAGED_SPLIT_KEYS if paged else DECODE_SHORT_SPLIT_KEYS
        per_sm = 1 if (on_gpu and not paged and gpu.dram_gbps(device) < DECODE_TWO_PER_SM_GBPS * sms) or (
            two > DECODE_MANY_SPLITS and capacity < two * short) else 2
        splits = max(1, min(per_sm * sms // programs, capacity // DECODE_MIN_SPLIT_KEYS, DECODE_MAX_SPLITS))
    upcast = interpreter and dtype == torch.bfloat16
    pdl = on_gpu and gpu.capability(device)[0] >= 9
    block_n, stages, warps, maxnreg = (*tiles, None)[:4] if tiles else (block_n, 4 if paged else 3, 4, None)
    return DecodePlan(block_m, block_n, splits, warps, stages, upcast, pdl, maxnreg)
