"""Which kernel runs, with which tiles: dispatch.py's plans, the options that steer them, and the
host-side choices the Gluon kernels make from a plan (schedules, shared memory, TMA layouts)."""
from dataclasses import replace

import pytest
import torch

from flashtile import dispatch, gpu, options
from flashtile.dispatch import HOPPER, Plan, Target
from flashtile.kernels import configs, tma
from flashtile.kernels.configs import Config, GluonBackward, GluonSchedule
from flashtile.kernels.gluon import backward as gluon_bwd
from flashtile.kernels.gluon import backward_fp8 as gluon_bwd_fp8
from flashtile.kernels.gluon import forward as gluon_fwd
from flashtile.kernels.gluon import scheduler
from flashtile.kernels.problem import Problem
from flashtile.options import KernelOptions

NO_GLUON = Target(gluon=False, interpreter=False)
INTERPRETER = Target(gluon=False, interpreter=True)
NONE = KernelOptions()


def problem(seqlen=1024, window_right=-1, head_dim=128, **kw):
    return Problem(2, 8, 8, seqlen, seqlen, head_dim, 0.1, -1, window_right, None, None, **kw)


def forward(p, target=HOPPER, opts=NONE, version="v3"):
    return dispatch.forward_plan(p, version, target, opts)


def backward(p, target=HOPPER, opts=NONE, version="v3"):
    return dispatch.backward_plan(p, version, target, opts)


def test_options_round_trip_and_refuse_what_they_do_not_know():
    opts = KernelOptions(forward="triton", backward="gluon-reduce", ablate={"overlap", "pingpong"},
                         tiles={"v2_fwd": (128, 64, 4, 3), "v3_gluon": (64, 2, 2)}, v1_splits=3)
    assert KernelOptions.parse(str(opts)) == opts
    assert str(opts) == ("forward=triton;backward=gluon-reduce;v1_splits=3;ablate=overlap,pingpong;"
                         "tiles.v2_fwd=128,64,4,3;tiles.v3_gluon=64,2,2")
    assert KernelOptions.parse("") == NONE and str(NONE) == ""
    for text, match in (("forward=v9", "forward='v9'"), ("ablate=warp_magic", "unknown techniques"),
                        ("tiles.v9=1", "unknown table"), ("tiles.v3_gluon=1,2", "expected 3"),
                        ("v1_splits=0", "v1_splits=0"), ("colour=blue", "unknown key"), ("forward", "key=value"),
                        # Sizes, stages and warps of 0 or below (a negative block launched a wrong grid
                        # without a word), words where integers go, a key given twice.
                        ("tiles.v2_fwd=-64,64,4,1", r"integers, >= 1 .* got \(-64"),
                        ("tiles.decode=64,0,4", ">= 1"), ("tiles.v3_gluon=128,3,2,-1", ">= 1"), ("tiles.v2_fwd=128,64,4,abc", "takes comma"),
                        ("v1_splits=1,2", "takes 1 integer"), ("forward=triton;forward=v2", "given twice")):
        with pytest.raises(ValueError, match=match):
            KernelOptions.parse(text)
    assert KernelOptions.parse("tiles.v3_gluon=128,3,2,0").tile("v3_gluon") == (128, 3, 2, 0)  # (no share)
    # Whitespace around keys, values and list items is not part of them.
    assert KernelOptions.parse(" forward = triton ; ablate=pingpong, overlap ") == \
        KernelOptions(forward="triton", ablate={"pingpong", "overlap"})
    for given, match in ((dict(v1_splits=1.5), "v1_splits=1.5"), (dict(v1_splits=True), "v1_splits=True"),
                         (dict(tiles={"v2_fwd": (128, 64, 4, 1.5)}), ">= 1")):
        with pytest.raises(ValueError, match=match):
            KernelOptions(**given)
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        options.resolve({"colour": "blue"})


def test_v3_forward_routing():
    # The Gluon kernel for what it takes (short causal bands too); what it does not take runs
    # v2's forward on short bands and the plain-Triton kernel otherwise; the interpreter runs
    # plain Triton; options force a kernel.
    assert forward(problem()) == Plan("v3-gluon", GluonSchedule(128, 2))
    assert forward(problem(configs.SHORT_KEYS, 0)).kernel == "v3-gluon"
    assert forward(problem(configs.SHORT_KEYS, 0), NO_GLUON).kernel == "v2"
    assert forward(problem(2 * configs.SHORT_KEYS, 0), NO_GLUON).kernel == "v3-triton"
    assert forward(problem(configs.SHORT_KEYS, -1), NO_GLUON).kernel == "v3-triton"
    assert forward(problem(), INTERPRETER) == Plan("v3-triton", configs.INTERPRETER, unmasked=True)
    assert forward(problem(), opts=KernelOptions(forward="v2")).kernel == "v2"
    assert forward(problem(), opts=KernelOptions(forward="triton")).kernel == "v3-triton"
    # versions v1, v2 and "tiled" and empty problems
    assert forward(problem(), version="v2").kernel == "v2"
    assert forward(problem(), version="v1") == Plan("v1", Config(128, 128, 8, 1))
    assert forward(problem(), version="tiled").kernel == "tiled"
    assert forward(replace(problem(), seqlen_k=0)).kernel == "tiled"
    assert forward(replace(problem(), batch=0)).kernel == "tiled"


def test_v3_triton_forward_plan():
    # One unmasked (warp-specialized at d128) loop without a band and with whole K tiles; the
    # band's tiles otherwise; warp specialization only where Triton 3.6 can apply it.
    plan = dispatch.v3_triton_forward(problem(4096), HOPPER, NONE)
    assert plan == Plan("v3-triton", Config(128, 128, 4, 2, True), unmasked=True)
    assert dispatch.v3_triton_forward(problem(4096 + 4), HOPPER, NONE) == \
        Plan("v3-triton", Config(128, 64, 8, 3), unmasked=False)
    assert dispatch.v3_triton_forward(replace(problem(4096), seqlen_q=4095), HOPPER, NONE) == \
        Plan("v3-triton", Config(128, 128, 8, 3), unmasked=True)
    assert dispatch.v3_triton_forward(problem(4096, 0), HOPPER, NONE).unmasked is False


def test_gluon_schedule_from_the_tables_the_ablation_and_tile_overrides():
    assert dispatch.gluon_schedule(problem(head_dim=256), NONE) == GluonSchedule(64, 2)
    assert dispatch.gluon_schedule(problem(4096), KernelOptions(ablate={"pingpong", "persistent"})) == \
        GluonSchedule(128, 2, pingpong=False, persistent=False)
    assert dispatch.gluon_schedule(problem(4096), KernelOptions(tiles={"v3_gluon": (64, 4, 2)})) == \
        GluonSchedule(64, 4)
    with pytest.raises(ValueError, match="3 up to head dim 64"):
        dispatch.gluon_schedule(problem(4096), KernelOptions(tiles={"v3_gluon": (64, 4, 3)}))
    # A fourth integer: 1/N of the exponentials on the FMA pipe.
    assert dispatch.gluon_schedule(problem(4096), KernelOptions(tiles={"v3_gluon": (128, 3, 2, 4)})) == \
        GluonSchedule(128, 3, exp2_on_fma=4)
    with pytest.raises(ValueError, match="1/2, 1/4 or 1/8"):
        dispatch.gluon_schedule(problem(4096), KernelOptions(tiles={"v3_gluon": (128, 3, 2, 3)}))
    # The table's: float8 d128 without a band only.
    assert dispatch.gluon_schedule(problem(4096, fp8=True), NONE).exp2_on_fma == 4
    assert dispatch.gluon_schedule(problem(4096, fp8=True, window_right=0), NONE).exp2_on_fma == 0
    assert dispatch.gluon_schedule(problem(4096, fp8=True, head_dim=256), NONE).exp2_on_fma == 0
    assert dispatch.gluon_schedule(problem(4096), NONE).exp2_on_fma == 0
    # d64 takes three consumers from THREE_CONSUMERS_FROM query rows (a band: from more).
    d64 = problem(4096, head_dim=64)
    assert dispatch.gluon_schedule(d64, NONE).consumers == 3
    assert dispatch.gluon_schedule(replace(d64, seqlen_q=1024), NONE).consumers == 2
    assert dispatch.gluon_schedule(replace(d64, window_right=0), NONE).consumers == 2
    assert dispatch.gluon_schedule(replace(d64, window_right=0, seqlen_q=8192), NONE).consumers == 3
    # With dropout two, whatever the rows, and the row reductions as trees (only there).
    assert dispatch.gluon_schedule(replace(d64, dropout_p=0.1), NONE).row_trees
    assert not dispatch.gluon_schedule(d64, NONE).row_trees
    assert dispatch.gluon_schedule(replace(d64, dropout_p=0.1), NONE).consumers == 2
    assert dispatch.gluon_schedule(replace(d64, window_right=0, seqlen_q=8192, dropout_p=0.1), NONE).consumers == 2


def test_v3_backward_routing():
    # The single pass from GLUON_REDUCE_MIN_KEYS keys at d64 and d128, the two passes below that,
    # at d256 (head dim split) and whenever deterministic; v2's where Gluon does not run.
    p = problem(1024, 0)
    p64, p256 = replace(p, head_dim=64), replace(p, head_dim=256)
    assert [backward(x).kernel for x in (p64, p, p256, replace(p, head_dim=192))] == ["v3-gluon"] * 4
    long = replace(p, seqlen_k=configs.GLUON_REDUCE_MIN_KEYS[128])
    assert backward(long).kernel == "v3-gluon-reduce"
    assert backward(replace(long, deterministic=True)).kernel == "v3-gluon"
    # A softcap or ALiBi keeps the single pass; both together spill there.
    alibi = replace(long, alibi_slopes=torch.ones(4))
    assert [backward(x).kernel for x in (alibi, replace(long, softcap=30.0))] == ["v3-gluon-reduce"] * 2
    assert backward(replace(alibi, softcap=30.0)).kernel == "v3-gluon"
    long64 = replace(p64, seqlen_k=configs.GLUON_REDUCE_MIN_KEYS[64])
    assert backward(long64) == Plan("v3-gluon-reduce", GluonBackward(128, 128, 2))
    assert backward(replace(long64, seqlen_k=long64.seqlen_k - 1)) == Plan("v3-gluon", GluonBackward(64, 128, 3))
    assert backward(replace(long64, head_dim=256)).kernel == "v3-gluon"  # no single pass at d256
    assert backward(p, NO_GLUON).kernel == "v2"
    assert backward(p, INTERPRETER) == Plan("v2", (configs.INTERPRETER, configs.INTERPRETER))
    assert backward(p, opts=KernelOptions(backward="v2")).kernel == "v2"
    assert backward(p64, opts=KernelOptions(backward="gluon-reduce")).kernel == "v3-gluon-reduce"
    assert backward(replace(p64, deterministic=True), opts=KernelOptions(backward="gluon-reduce")).kernel == "v3-gluon"
    assert backward(p256, opts=KernelOptions(backward="gluon-reduce")).kernel == "v3-gluon"
    assert backward(long, opts=KernelOptions(backward="gluon")).kernel == "v3-gluon"
    assert backward(p, opts=KernelOptions(ablate={"persistent"})).config.persistent is False


def test_a_tile_override_never_changes_the_algorithm():
    # Tiles of the table a plan reads are replaced; which kernel runs is not.
    for p in (problem(1024), problem(4096), problem(4096, 0, head_dim=64)):
        for table, values in (("v3_gluon_bwd", (128, 64, 3)), ("v3_gluon_bwd_reduce", (64, 64, 3)),
                              ("v2_bwd_kv", (32, 64, 4, 2)), ("v3_gluon", (64, 2, 2)), ("v3_fwd", (64, 64, 4, 2))):
            opts = KernelOptions(tiles={table: values})
            assert backward(p, opts=opts).kernel == backward(p).kernel
            assert forward(p, opts=opts).kernel == forward(p).kernel
    long = problem(4096)
    assert backward(long, opts=KernelOptions(tiles={"v3_gluon_bwd_reduce": (64, 64, 3)})).config == \
        GluonBackward(64, 64, 3)
    assert backward(long, opts=KernelOptions(tiles={"v3_gluon_bwd": (64, 64, 3)})).config == \
        backward(long).config  # (the two passes' table: not read for the single pass)


def test_gluon_takes_only_what_its_descriptors_describe():
    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    p = Problem.of(q, q, None, None, None, None, 0.1, -1, -1)
    on_gpu = type("T", (), {"is_cuda": True, "stride": q.stride})()
    assert dispatch.target_of(p, on_gpu, on_gpu, on_gpu).gluon in (True, False)  # interpreter-dependent
    assert not dispatch.target_of(p, q, q, q).gluon  # CPU tensors
    # The Gluon kernels take every score modification, and packed sequences (forward_plan says when).
    assert dispatch.gluon_takes(p) and dispatch.gluon_takes(replace(p, softcap=30.0))
    assert dispatch.gluon_takes(replace(p, alibi_slopes=torch.ones(4), softcap=30.0))
    assert dispatch.gluon_takes(replace(p, cu_seqlens_q=torch.zeros(3, dtype=torch.int32)))
    assert not dispatch.gluon_takes(replace(p, head_dim=20))
    assert dispatch.broadcast(q[:1].expand(2, 64, 4, 64))
    assert not dispatch.broadcast(q.transpose(1, 2).contiguous().transpose(1, 2))
    # tma.ready copies what TMA cannot read, including a contiguous tensor on a misaligned base.
    shifted = torch.randn(2 * 64 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64, 4, 64)
    assert shifted.is_contiguous() and not tma.aligned(shifted)
    for x in (shifted, torch.randn(2, 64, 4, 68, dtype=torch.bfloat16)[..., :64]):
        ready = tma.ready(x)
        assert tma.aligned(ready) and torch.equal(ready, x)
    assert tma.ready(q) is q


def test_gluon_backward_pass_schedule(monkeypatch):
    # The two passes up to d128 run a CTA per SM with two stationary slots when there are more
    # tiles than SMs: tiles of equal length strided over, a band's taken from the tile counter;
    # d256, the single pass, the ablation and as few tiles as SMs keep a CTA per tile.
    Schedule = gluon_bwd.Schedule
    monkeypatch.setattr(gpu, "sm_count", lambda index: 132)
    plain = problem(1024)
    cfg = GluonBackward(64, 64, 2)
    cuda = torch.device("cuda", 0)
    assert gluon_bwd.pass_schedule(plain, cfg, 512, cuda) == Schedule(132, 2, True, False)
    assert gluon_bwd.pass_schedule(replace(plain, head_dim=64), cfg, 512, cuda) == Schedule(132, 2, True, False)
    assert gluon_bwd.pass_schedule(plain, cfg, 132, cuda) == Schedule(132, 1, False, False)
    assert gluon_bwd.pass_schedule(replace(plain, window_right=0), cfg, 512, cuda) == Schedule(132, 2, True, True)
    assert gluon_bwd.pass_schedule(replace(plain, window_left=64), cfg, 512, cuda) == Schedule(132, 2, True, True)
    assert gluon_bwd.pass_schedule(plain, cfg, 512, cuda, dq_reduce=True) == Schedule(512, 1, False, False)
    assert gluon_bwd.pass_schedule(replace(plain, head_dim=256), cfg, 512, cuda) == Schedule(512, 1, False, False)
    assert gluon_bwd.pass_schedule(plain, replace(cfg, persistent=False), 512, cuda) == Schedule(512, 1, False, False)
    assert Schedule(132, 2, True, True).constants() == dict(SLOTS=2, PERSISTENT=True, DYNAMIC=True)
    # A band's heads are walked together (as many as share L2) only with few tiles a SM.
    causal, budget = replace(plain, window_right=0), scheduler.L2_BUDGET
    assert gluon_bwd.walk_head_group(causal, 4 * 132, 8, budget // 8, cuda) == 8
    assert gluon_bwd.walk_head_group(causal, 4 * 132, 8, budget // 4, cuda) == 4
    assert gluon_bwd.walk_head_group(causal, 4 * 132 + 1, 8, budget // 8, cuda) == 1
    assert gluon_bwd.walk_head_group(plain, 256, 8, 1, cuda) == 1


def test_gluon_forward_launch_constants():
    # Shared memory: each consumer stages O in a buffer of its own where Q, the K/V ring and those
    # fit (d64, d128), else the two share one (d256); a second Q buffer where that fits too;
    # persistent CTAs take banded (uneven) tiles from the counter and stride over equal ones.
    for head_dim, own_buffers in ((64, True), (128, True), (256, False)):
        cfg = configs.by_head_dim(configs.V3_GLUON, head_dim)
        consts = gluon_fwd.kernel_constants(problem(4096, head_dim=head_dim), cfg, 2)
        assert consts["O_BUFFERS"] == (cfg.consumers if own_buffers else 1)
        assert not consts["DYNAMIC"] and consts["SCORE"] is None
        assert consts["Q_SLOTS"] == (2 if own_buffers else 1)
        assert gluon_fwd.kernel_constants(problem(4096, head_dim=head_dim), replace(cfg, next_q=False),
                                          2)["Q_SLOTS"] == 1
        # Q in registers for S = Q K^T up to d128 with two consumers (three would spill)
        assert consts["Q_IN_REGISTERS"] == (head_dim <= 128)
        assert not gluon_fwd.kernel_constants(problem(4096, head_dim=head_dim), replace(cfg, q_registers=False),
                                              2)["Q_IN_REGISTERS"]
    assert gluon_fwd.o_staging_buffers(2**16, 2**16, 2**17 + 2**15, 2) == 0  # no room left for 32 KB
    # Float8 Q and K/V ring, bf16 O: at d256 the three-slot ring, two Q buffers and both
    # consumers' O buffers fit.
    fp8_cfg = configs.by_head_dim(configs.V3_GLUON_FP8, 256)
    fp8_consts = gluon_fwd.kernel_constants(problem(4096, head_dim=256, fp8=True), fp8_cfg, 1, 2)
    assert fp8_consts["FP8"] == 1 and fp8_consts["O_BUFFERS"] == 2 and fp8_consts["Q_SLOTS"] == 2
    assert gluon_fwd.kernel_constants(problem(4096, head_dim=256, fp8=True, fp8_per_block=True), fp8_cfg, 1,
                                      2)["FP8"] == 2
    causal = problem(4096, 0)
    cfg = configs.by_head_dim(configs.V3_GLUON, 128)
    assert gluon_fwd.kernel_constants(causal, cfg, 2)["DYNAMIC"]
    assert not gluon_fwd.kernel_constants(causal, replace(cfg, persistent=False), 2)["DYNAMIC"]
    # Outputs checked for non-finite rows only where a band masks keys inside the tensors (past
    # their end TMA reads zeros), and not on float8 (no recomputation path).
    assert gluon_fwd.kernel_constants(causal, cfg, 2)["CHECK_FINITE"]
    assert gluon_fwd.kernel_constants(replace(problem(4096), window_left=64), cfg, 2)["CHECK_FINITE"]
    assert not gluon_fwd.kernel_constants(problem(4096), cfg, 2)["CHECK_FINITE"]
    assert not gluon_fwd.kernel_constants(replace(causal, fp8=True), configs.by_head_dim(configs.V3_GLUON_FP8, 128),
                                          1, 2)["CHECK_FINITE"]
    assert gluon_fwd.kernel_constants(replace(causal, softcap=30.0), cfg, 2)["SCORE"] is not None
    # A softcap is every row's max (BOUNDED) on bf16 alone, while its range stays in P's normal range.
    capped = replace(causal, softcap=30.0)
    assert gluon_fwd.kernel_constants(capped, cfg, 2, dtype=torch.bfloat16)["BOUNDED"]
    assert not any(gluon_fwd.kernel_constants(x, cfg, 2, dtype=dtype)["BOUNDED"] for x, dtype in (
        (capped, torch.float16), (replace(capped, softcap=40.0), torch.bfloat16), (causal, torch.bfloat16),
        (replace(capped, alibi_slopes=torch.ones(4)), torch.bfloat16), (capped, None)))
    # ALiBi is split off the diagonal with two consumers up to d128 (Q then from shared memory).
    alibi = gluon_fwd.kernel_constants(replace(causal, alibi_slopes=torch.ones(4)), cfg, 2)
    assert alibi["DISTANCE"] and not alibi["Q_IN_REGISTERS"]
    # The band's left edge is tested only where a window has one.
    assert not gluon_fwd.kernel_constants(causal, cfg, 2)["LEFT_EDGE"]
    assert gluon_fwd.kernel_constants(replace(causal, window_left=0), cfg, 2)["LEFT_EDGE"]
    # Banded walks interleave as many heads as have their streamed blocks fit in L2 (at least one,
    # at most all); equal tiles go one head at a time.
    budget = scheduler.L2_BUDGET
    assert scheduler.heads_sharing_l2(causal, 256, budget // 64) == 64
    assert scheduler.heads_sharing_l2(causal, 16, budget // 64) == 16
    assert scheduler.heads_sharing_l2(causal, 16, 2 * budget) == 1
    assert scheduler.heads_sharing_l2(problem(1024), 256, 1) == 1
    assert scheduler.heads_sharing_l2(causal, 4, budget // 3) == 2  # 2 + 2 rather than 3 + 1


def test_decode_plan_splits_from_static_shapes():
    # num_splits > 0 is obeyed; 0 splits the keys where the row blocks alone leave the GPU idle
    # (few sequences, a long cache), never below DECODE_MIN_SPLIT_KEYS keys of the capacity, and
    # not at all where the batch fills the GPU. Only shapes are read: no sequence length.
    one_token = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16)
    assert dispatch.decode_plan(one_token, 8, 4096, 5).splits == 5
    mqa = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16)  # one program without splits
    long_cache = dispatch.decode_plan(mqa, 1, 131072, 0)
    assert long_cache.splits > 1 and long_cache.block_m >= 16
    assert dispatch.decode_plan(mqa, 1, 2 * dispatch.DECODE_MIN_SPLIT_KEYS - 1, 0).splits == 1  # one split's worth
    many = torch.empty(4096, 1, 32, 128, dtype=torch.bfloat16)
    assert dispatch.decode_plan(many, 8, 131072, 0).splits == 1
    # A block's rows are the query heads of one KV head times the query tokens.
    assert dispatch.decode_plan(torch.empty(1, 16, 32, 128, dtype=torch.bfloat16), 8, 4096, 0).block_m == 64
    # On the GPU, a paged cache (its table's load a pipeline stage of its own) takes one more
    # stage and steps of twice the keys.
    contiguous, paged = (dispatch._decode_plan(8, 1, 32, 128, torch.bfloat16, None, 8, 4096, 1, p, False)
                         for p in (False, True))
    assert (paged.block_n, paged.num_stages) == (2 * contiguous.block_n, contiguous.num_stages + 1)
    # A tile override (keys a step, stages, warps) replaces the tiles of its layout only.
    opts = options.KernelOptions.parse("tiles.decode_paged=32,5,8")
    plan = dispatch.decode_plan(one_token, 8, 4096, 5, paged=True, opts=opts)
    assert (plan.block_n, plan.num_stages, plan.num_warps, plan.splits) == (32, 5, 8, 5)
    assert dispatch.decode_plan(one_token, 8, 4096, 5, opts=opts) == dispatch.decode_plan(one_token, 8, 4096, 5)
    capped = options.KernelOptions.parse("tiles.decode=64,3,4,168")
    assert dispatch.decode_plan(one_token, 8, 4096, 5, opts=capped).maxnreg == 168
    assert dispatch.decode_plan(one_token, 8, 4096, 5).maxnreg is None
    # An explicit count past what the combine holds is capped.
    assert dispatch.decode_plan(one_token, 8, 4096, 1000).splits == dispatch.DECODE_MAX_SPLITS


def test_decode_combine_is_a_programmatic_dependent_on_hopper_only(monkeypatch):
    # griddepcontrol exists from sm_90; the interpreter has no inline assembly.
    for capability, expected in (((9, 0), True), ((8, 0), False)):
        monkeypatch.setattr(gpu, "_CAPABILITIES", {5: capability})
        dispatch._decode_plan.cache_clear()  # plans are remembered per device, whose capability is fixed
        assert dispatch._decode_plan(8, 1, 32, 128, torch.bfloat16, 5, 8, 4096, 1, False, False).pdl is expected
        assert not dispatch._decode_plan(8, 1, 32, 128, torch.bfloat16, 5, 8, 4096, 1, False, True).pdl
    assert not dispatch._decode_plan(8, 1, 32, 128, torch.bfloat16, None, 8, 4096, 1, False, False).pdl


def test_packed_sequences_take_the_gluon_kernels_only_when_forced():
    # Packed sequences run the plain-Triton forward (v2's on short bands) unless the options
    # force the Gluon one, and v2's backward unless they force the Gluon one (its two passes, the
    # batched tiles, up to d128; never the single pass); float8 ones run v2's forward.
    offsets = torch.zeros(3, dtype=torch.int32)
    for seqlen, window_right, default in ((4096, -1, "v3-triton"), (4096, 0, "v3-triton"), (512, 0, "v2")):
        p = replace(problem(seqlen, window_right), cu_seqlens_q=offsets, cu_seqlens_k=offsets, total_q=2 * seqlen,
                    total_k=2 * seqlen)
        assert forward(p).kernel == default
        forced = forward(p, opts=KernelOptions(forward="gluon"))
        assert forced.kernel == "v3-gluon" and forced.config == forward(replace(p, cu_seqlens_q=None,
                                                                                cu_seqlens_k=None)).config
        assert forward(p, opts=KernelOptions(forward="gluon"), target=NO_GLUON).kernel != "v3-gluon"
        for opts in (NONE, KernelOptions(backward="gluon-reduce"), KernelOptions(backward="v2")):
            assert backward(p, opts=opts).kernel == "v2"
        gluon = KernelOptions(backward="gluon")
        packed = backward(p, opts=gluon)
        assert packed.kernel == "v3-gluon" and packed.config == backward(replace(
            p, cu_seqlens_q=None, cu_seqlens_k=None), opts=gluon).config
        assert backward(p, opts=gluon, target=NO_GLUON).kernel == "v2"
        assert backward(replace(p, head_dim=256), opts=gluon).kernel == "v2"  # (the head dim split: batched only)
        # seqused tables: the rows between sequences may hold anything, which the Gluon MMAs read
        table = torch.zeros(2, 2, dtype=torch.int32)
        assert backward(replace(p, cu_seqlens_q=table, cu_seqlens_k=table), opts=gluon).kernel == "v2"
        assert forward(replace(p, fp8=True), opts=KernelOptions(forward="gluon")).kernel == "v2"
    # Not where the walk's tile numbers would pass 32 bits: 2**17 sequences of up to 2**17 rows, 8 heads.
    many = replace(problem(2**17), batch=2**17, cu_seqlens_q=offsets, cu_seqlens_k=offsets, total_q=2**20,
                   total_k=2**20)
    assert forward(many, opts=KernelOptions(forward="gluon")).kernel == "v3-triton"
    # (the backward's walks have 128-row tiles: twice the sequences)
    assert backward(many, opts=KernelOptions(backward="gluon")).kernel == "v3-gluon"
    assert backward(replace(many, batch=2**18), opts=KernelOptions(backward="gluon")).kernel == "v2"


def test_dropout_own_value_head_dim_and_fp8_routes_on_hopper():
    # A V head dim of its own runs the Gluon forward and the two Gluon backward passes (v2's kernels
    # in float8, where the Gluon kernels do not run, or where the options ask for another kernel).
    # Dropout runs the Gluon forward (v2's where that does not
    # run: never the plain-Triton one, which draws no mask) and the two Gluon backward passes
    # up to d128 (v2's at d256).  FP8 inputs
    # run the Gluon forward, with its own tiles, at every head dim, band or not, else v2's
    # (never the plain-Triton Hopper forward, which has no float8 path).
    seed = torch.zeros(1, dtype=torch.int64)
    own_v = problem(own_head_dim_v=64)
    assert forward(own_v).kernel == "v3-gluon" and backward(own_v).kernel == "v3-gluon"
    assert forward(own_v, opts=KernelOptions(forward="triton")).kernel == "v2"
    assert backward(own_v, opts=KernelOptions(backward="v2")).kernel == "v2"
    forced = KernelOptions(forward="gluon")
    assert forward(own_v, opts=forced).kernel == "v3-gluon" and backward(own_v, opts=forced).kernel == "v3-gluon"
    # The two Gluon backward passes (never the single pass): batched, without dropout, V no wider
    # than Q (the tiles are Q's head dim's)
    both = KernelOptions(forward="gluon", backward="gluon")
    assert backward(own_v, opts=both).kernel == "v3-gluon"
    long = problem(8192)
    assert backward(long).kernel == "v3-gluon-reduce" and backward(replace(long, own_head_dim_v=64)).kernel == "v3-gluon"
    assert backward(own_v, opts=KernelOptions(backward="gluon-reduce")).kernel == "v3-gluon"
    assert backward(replace(own_v, dropout_p=0.1, dropout_seed=seed), opts=both).kernel == "v2"
    assert backward(replace(own_v, head_dim=64, own_head_dim_v=128), opts=both).kernel == "v2"
    # V wider than Q: the Gluon forward only when asked for
    wide_v = replace(own_v, head_dim=64, own_head_dim_v=128)
    assert forward(wide_v).kernel == "v2" and forward(wide_v, opts=forced).kernel == "v3-gluon"
    assert backward(problem(head_dim=192, own_head_dim_v=128), opts=both).config == \
        configs.by_head_dim(configs.V3_GLUON_BWD, 256)
    assert forward(replace(own_v, window_right=0), opts=forced).kernel == "v3-gluon"
    assert forward(own_v, target=dispatch.Target(gluon=False, interpreter=False), opts=forced).kernel == "v2"
    assert forward(replace(own_v, fp8=True), opts=forced).kernel == "v2"
    assert dispatch.gluon_takes(own_v) and not dispatch.gluon_takes(replace(own_v, own_head_dim_v=36))
    # 192 / 128: Q and K in three 64-lane slices, d128's K/V blocks; 192 / 192: d256's tiles.
    mla = problem(head_dim=192, own_head_dim_v=128)
    assert forward(mla, opts=forced).config == configs.by_head_dim(configs.V3_GLUON, 192)
    assert forward(replace(mla, own_head_dim_v=None), opts=forced).config == configs.by_head_dim(configs.V3_GLUON, 256)
    dropped = problem(dropout_p=0.1, dropout_seed=seed)
    for p in (dropped, replace(dropped, window_right=0), replace(dropped, seqlen_k=256, window_right=0)):
        assert forward(p).kernel == "v3-gluon" and backward(p).kernel == "v3-gluon"
    assert forward(dropped, opts=KernelOptions(forward="triton")).kernel == "v2"
    # The Gluon backward draws dropout in its two passes (never the single pass), up to d128.
    for opts in (KernelOptions(), KernelOptions(backward="gluon"), KernelOptions(backward="gluon-reduce")):
        assert [backward(replace(dropped, head_dim=d), opts=opts).kernel for d in (64, 128, 256)] == \
            ["v3-gluon", "v3-gluon", "v2"]
    assert backward(replace(dropped, seqlen_k=8192)).kernel == "v3-gluon"
    assert backward(dropped, opts=KernelOptions(backward="v2")).kernel == "v2"
    assert forward(dropped, target=dispatch.Target(gluon=False, interpreter=False)).kernel == "v2"
    # Dropout draws keys in groups of 32: smaller key blocks are refused before any launch.
    for text, plan in (("tiles.v3_gluon=16,2,2", forward), ("tiles.v2_fwd=64,16,4,1", forward),
                       ("tiles.v2_bwd_kv=32,16,4,1", backward), ("tiles.v2_bwd_q=64,16,4,1", backward),
                       ("backward=gluon;tiles.v3_gluon_bwd=64,16,2", backward)):
        kw = dict(version="v2") if text.startswith("tiles.v2") else {}
        with pytest.raises(ValueError, match=f"tiles.{text.split('tiles.')[1].split('=')[0]}: dropout takes keys"):
            plan(dropped, opts=KernelOptions.parse(text), **kw)
    fp8_plan = forward(problem(fp8=True))
    assert fp8_plan.kernel == "v3-gluon" and fp8_plan.config == configs.by_head_dim(configs.V3_GLUON_FP8, 128)
    assert forward(problem(fp8=True, own_head_dim_v=64)).kernel == "v2"
    assert forward(problem(fp8=True), opts=KernelOptions(forward="triton")).kernel == "v2"
    assert forward(problem(fp8=True), target=dispatch.Target(gluon=False, interpreter=False)).kernel == "v2"
    assert forward(problem(fp8=True), version="v2").kernel == "v2"
    for head_dim in (32, 64, 128, 256):
        for window_right in (-1, 0):
            assert forward(problem(window_right=window_right, fp8=True, head_dim=head_dim)).kernel == "v3-gluon"
    # Three consumers at d64 from 2k rows, 4k with a band (8k for bf16 bands).
    consumers = {(n, w, fp8): forward(problem(seqlen=n, window_right=w, fp8=fp8, head_dim=64)).config.consumers
                 for n in (1024, 2048, 4096, 8192) for w in (-1, 0) for fp8 in (False, True)}
    assert [n for n in (1024, 2048, 4096, 8192) if consumers[n, 0, True] == 3] == [4096, 8192]
    assert [n for n in (1024, 2048, 4096, 8192) if consumers[n, 0, False] == 3] == [8192]
    assert all(consumers[n, -1, fp8] == (3 if n >= 2048 else 2) for n in (1024, 2048, 4096, 8192)
               for fp8 in (False, True))
    assert forward(problem()).kernel == "v3-gluon" and backward(problem()).kernel.startswith("v3-gluon")
    # The FP8 backward (fp8_attn_func's) on v2's kernels, its tiles within the descales' blocks:
    # the dK/dV pass's query blocks divide Q's, the dQ pass's key blocks K's and V's.
    for head_dim in (64, 128, 256):
        for rows in ((64, 128), (64, 64), (32, 32), (128, 64)):
            plan = backward(problem(head_dim=head_dim, fp8=True, fp8_per_block=True, fp8_rows=rows),
                            opts=KernelOptions(backward="v2"))
            kv, dq = plan.config
            assert plan.kernel == "v2" and rows[0] % kv.block_m == 0 and rows[1] % dq.block_n == 0
            plain_kv, plain_dq = backward(problem(head_dim=head_dim), version="v2").config
            assert (kv.block_n, dq.block_m) == (plain_kv.block_n, plain_dq.block_m)
    # Hopper's float8 MMA reduces over 32 at least: smaller tiles are refused before any launch.
    with pytest.raises(ValueError, match="dK/dV pass 16 queries"):
        backward(problem(fp8=True, fp8_per_block=True, fp8_rows=(16, 64)))
    with pytest.raises(ValueError, match="dQ pass 16 keys"):
        backward(problem(fp8=True, fp8_per_block=True, fp8_rows=(64, 128)),
                 opts=KernelOptions.parse("backward=v2;tiles.v2_bwd_q=64,16,4,1"))
    # By default (also with backward=gluon): the two float8 Gluon passes, with their own tiles,
    # where each block a pass streams lies in one descale block; batched, one head dim (d256 too:
    # a dV pass and a dK pass); elsewhere, and with backward=v2, v2's.
    block_fp8 = problem(fp8=True, fp8_per_block=True, fp8_rows=(64, 128))
    for opts in (NONE, KernelOptions(backward="gluon")):
        for head_dim in (64, 128, 192, 256):
            plan = backward(problem(head_dim=head_dim, fp8=True, fp8_per_block=True, fp8_rows=(64, 128)), opts=opts)
            assert plan.kernel == "v3-gluon-fp8"
            assert plan.config == configs.by_head_dim(configs.V3_GLUON_BWD_FP8, head_dim)
    # The float8 dQ pass's key blocks within K's descale blocks: 128 at d128, 64 under 64-row ones.
    assert backward(problem(fp8=True, fp8_per_block=True, fp8_rows=(64, 128))).config.dq_block_n == 128
    plan = backward(problem(fp8=True, fp8_per_block=True, fp8_rows=(64, 64)))
    assert plan.kernel == "v3-gluon-fp8" and plan.config.dq_block_n == 64
    offsets = torch.tensor([0, 100, 1024], dtype=torch.int32)
    assert [gluon_bwd_fp8.key_passes(pad) for pad in (64, 128, 256)] == [(3,), (3,), (2, 1)]  # dV, then dK
    for other, kw in ((problem(head_dim=256, fp8=True, fp8_per_block=True, fp8_rows=(64, 32)), {}),
                      (problem(fp8=True, fp8_per_block=True, fp8_rows=(32, 128)), {}),
                      (replace(block_fp8, cu_seqlens_q=offsets, cu_seqlens_k=offsets, total_q=1024, total_k=1024),
                       {}),
                      (block_fp8, dict(version="v2")), (block_fp8, dict(target=Target(gluon=False, interpreter=False))),
                      (problem(head_dim=128, fp8=True, fp8_per_block=True, fp8_rows=(64, 32)), {}),
                      (block_fp8, dict(opts=KernelOptions(backward="v2"))),
                      (block_fp8, dict(opts=KernelOptions.parse("tiles.v3_gluon_bwd=64,16,2")))):
        assert backward(other, **kw).kernel == "v2"
    # The seed and the descales are no part of a plan's key.
    assert problem(dropout_p=0.1, dropout_seed=seed) == problem(dropout_p=0.1, dropout_seed=seed.clone())
    assert problem(dropout_p=0.1, dropout_seed=seed).holds_tensors


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("gbps", [3352.0, 4800.0])  # H100 SXM and H200: 25 and 36 GB/s per SM
def test_decode_splits_fill_the_sms_once_or_twice(monkeypatch, gbps, paged):
    # One program per SM (132 here) for a contiguous cache below DECODE_TWO_PER_SM_GBPS of
    # bandwidth per SM; otherwise two, except where that would cut each row block's keys into
    # more than DECODE_MANY_SPLITS splits shorter than DECODE_SHORT_SPLIT_KEYS (pages:
    # DECODE_SHORT_PAGED_SPLIT_KEYS): one per SM there.
    monkeypatch.setattr(gpu, "sm_count", lambda index: 132)
    monkeypatch.setattr(gpu, "dram_gbps", lambda index: gbps)
    monkeypatch.setattr(gpu, "_CAPABILITIES", {5: (9, 0)})
    dispatch._decode_plan.cache_clear()
    try:
        def splits(batch, cache):  # one query token, 32/8 heads: 8 row blocks a sequence
            return dispatch._decode_plan(batch, 1, 32, 128, torch.bfloat16, 5, 8, cache, 0, paged, False).splits
        per_sm = 1 if gbps == 3352.0 and not paged else 2  # (the H100 below the bar, the H200 above)
        # 33 splits of 16k or 32k keys: under 1024 keys each, not under 256 (pages)
        assert [splits(1, cache) for cache in (16384, 32768)] == [(2 if paged else 1) * 132 // 8] * 2
        assert splits(1, 8192) == 132 // 8  # 33 would be < 256 keys
        assert splits(1, 131072) == per_sm * 132 // 8  # long splits
        assert [splits(4, 4096), splits(8, 4096)] == [per_sm * 132 // 32, per_sm * 132 // 64]  # few splits
        assert splits(16, 131072) == per_sm * 132 // 128
        assert splits(1, 4096) == 4096 // dispatch.DECODE_MIN_SPLIT_KEYS
    finally:
        dispatch._decode_plan.cache_clear()
