"""Hopper code checked without a GPU: kernels compiled for sm_90 and their TTGIR read."""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_for_sm90(tmp_path, only, head_dim, config_env):
    env = dict(os.environ, TRITON_INTERPRET="0", **config_env)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_sm90.py"), "--head-dims",
                          str(head_dim), "--only", only, "--dump", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0 or "FAILED" in res.stdout:
        pytest.fail(f"sm_90 compile failed:\n{res.stdout}\n{res.stderr[-2000:]}")
    return (tmp_path / f"{only}_d{head_dim}.ttgir").read_text()


def test_v3_warp_specialized_partitions_store_their_own_rows(tmp_path):
    # Each consumer warpgroup stores O and the logsumexp of the same rows: the second one at
    # m0 + 64, never m0 + 128 (Triton 3.6's double offset on pointer stores, see v3.py).
    # The shipped d128 config is the warp-specialized one.
    ttgir = compile_for_sm90(tmp_path, "v3.fwd", 128, {})
    assert "ttg.warp_specialize" in ttgir
    partitions = re.split(r"\n\s*partition\d+\(", ttgir)[1:]
    assert len(partitions) >= 2
    stores = []
    for part in partitions:
        o_rows = re.findall(r"async_tma_copy_local_to_global %o_desc\w*\[(%\w+),", part)
        lse_rows = re.findall(r"async_tma_copy_local_to_global %lse_desc\w*\[(%\w+)\]", part)
        if o_rows:
            assert lse_rows == o_rows
            stores.append(o_rows[0])
    assert len(stores) == 2


def test_every_kernel_compiles_for_sm90_with_varlen():
    # Varlen changes the index types (cu_seqlens loads) that TMA and loop bounds see, which the
    # interpreter does not check: compile every kernel's varlen form for Hopper.
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_sm90.py"), "--head-dims", "128",
                          "--varlen"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and "FAILED" not in res.stdout, res.stdout + res.stderr[-2000:]
    assert res.stdout.count("wgmma=True") == 7


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_v3_gluon_forward_compiles_for_sm90(tmp_path, monkeypatch, head_dim):
    # The Gluon kernel does not run under the interpreter: its Hopper structure is checked here,
    # its numbers on the GPU (scripts/gpu_check.sh gluon).
    ttgir = compile_for_sm90(tmp_path, "v3.fwd_gluon", head_dim, {})
    ptx = (tmp_path / f"v3.fwd_gluon_d{head_dim}.ptx").read_text()
    # One consumer warpgroup in the default region, the others and the TMA producer as workers,
    # registers moved from the producer to the consumers: two consumers of 240 registers, or at
    # d64 (compile_sm90 takes 4k queries) three of 160.
    consumers = 3 if head_dim == 64 else 2
    assert "ttg.warp_specialize" in ttgir and len(re.findall(r"partition\d+\(", ttgir)) == consumers
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{ {2: 240, 3: 160}[consumers]}", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    assert "cp.async.bulk.tensor.4d.shared::cluster.global" in ptx  # TMA loads
    # O += P V with P in registers (a brace list as the A operand); S = Q K^T with Q in registers
    # too where two consumers have room (d128), else from shared memory.
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, (\S)", ptx)
    assert any(n == str(head_dim) and a == "{" for n, a in wgmma), "PV product without P in registers"
    assert any(a == "%" for _, a in wgmma) == (head_dim != 128), "QK^T product's Q operand"
    # O staged in shared memory and stored by TMA at every head dim (d256's two consumers share
    # one buffer): never as two-byte stores from registers.
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
    assert "st.global.b16" not in ptx
    assert_consumer_loops(tmp_path / f"v3.fwd_gluon_d{head_dim}.cubin", head_dim, consumers, monkeypatch)


def assert_consumer_loops(cubin, head_dim, consumers, monkeypatch):
    """Each consumer's K/V loop, in SASS: per block the k-steps of S = Q K^T (head dim / 16) and
    of O += P V (block_n / 16), and no spill traffic."""
    from flashtile.kernels import configs
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass
    block_n = configs._by_head_dim(configs._V3_GLUON, head_dim).block_n
    loops = hot_loops(sass(cubin.read_bytes()))
    assert len(loops) == consumers
    for loop in loops:
        size, mma, spills, _ = loop_stats(loop)
        assert mma == head_dim // 16 + block_n // 16 and spills == 0, (size, mma, spills)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_v3_gluon_window_forward_compiles_for_sm90(tmp_path, monkeypatch, head_dim):
    # A sliding window's left edge is tested only where the window has one (LEFT_EDGE): the
    # kernel built with it keeps the causal one's K/V loops.
    compile_for_sm90(tmp_path, "v3.fwd_gluon_window", head_dim, {})
    assert_consumer_loops(tmp_path / f"v3.fwd_gluon_window_d{head_dim}.cubin", head_dim, 2, monkeypatch)


@pytest.mark.parametrize("kernel", ["v3.bwd_dq_gluon", "v3.bwd_dkdv_gluon", "v3.bwd_reduce_gluon",
                                    "v3.bwd_dq_gluon_causal", "v3.bwd_dkdv_gluon_causal",
                                    "v3.bwd_dq_gluon_tile", "v3.bwd_dkdv_gluon_tile"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_v3_gluon_backward_kernels_compile_for_sm90(tmp_path, kernel, head_dim):
    # v3's Gluon backward: a TMA producer warp and two consumer warpgroups, in the two passes a
    # partition each (no barrier spans both), in the single pass one partition (both
    # warpgroups' dS^T meet for the dQ product); S and dP from shared memory, the gradient
    # products with P / dS in registers, except in d64's single pass (128-row Q blocks: P^T and
    # dS^T through shared memory, every product from there).  The two passes as launched
    # persistent (two stationary slots; a band's tiles, "_causal", taken from the atomic tile
    # counter) and with a CTA per tile ("_tile": one slot).
    ttgir = compile_for_sm90(tmp_path, kernel, head_dim, {})
    ptx = (tmp_path / f"{kernel}_d{head_dim}.ptx").read_text()
    single_pass = kernel == "v3.bwd_reduce_gluon"
    assert "ttg.warp_specialize" in ttgir
    assert len(re.findall(r"partition\d+\(", ttgir)) == (1 if single_pass else 2)
    assert bool(re.search(r"bar\.sync\s+\d+, 256;", ptx)) == single_pass
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx)
    assert "cp.async.bulk.tensor.4d.shared::cluster.global" in ptx  # TMA loads
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx      # TMA stores of the gradients
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, (\S)", ptx)
    shared_scores = single_pass and head_dim == 64
    assert any(n == str(head_dim) and a == "{" for n, a in wgmma) != shared_scores, "register A operands"
    assert any(n in ("64", "128") and a == "%" for n, a in wgmma), "S / dP not from shared memory"
    reduces = re.findall(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx)
    assert len(reduces) == single_pass, "dQ by TMA reduce-add in the single pass only"
    # The K/V-stationary pass gets each Q block's lse and D through the ring (cp.async counted on
    # the slot's mbarrier); the dQ pass reads its rows' once.
    assert ("cp.async.mbarrier.arrive" in ptx) == (not kernel.startswith("v3.bwd_dq_gluon"))
    assert ("atom.global" in ptx) == kernel.endswith("_causal")


@pytest.mark.parametrize("kernel", ["v3.bwd_dq_gluon", "v3.bwd_dkdv_gluon"])
def test_v3_gluon_backward_splits_the_head_dim_at_d256(tmp_path, kernel):
    # At d256 the two passes split the work between the consumer warpgroups (32-column halves
    # of S / dP, 128-column halves of the gradients), every product from shared memory.
    ttgir = compile_for_sm90(tmp_path, kernel, 256, {})
    ptx = (tmp_path / f"{kernel}_d256.ptx").read_text()
    assert "ttg.warp_specialize" in ttgir
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx)
    assert "cp.async.bulk.tensor.4d.shared::cluster.global" in ptx  # TMA loads
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx      # TMA stores of the gradients
    wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, (\S)", ptx))
    assert wgmma == {("32", "%"), ("128", "%")}
    assert "cp.async.mbarrier.arrive" not in ptx  # lse and D loaded a block ahead into registers here


def test_v3_gluon_ablation_switches_remove_their_technique(tmp_path):
    def compiled(ablate, kernel="v3.fwd_gluon"):
        ttgir = compile_for_sm90(tmp_path / (ablate or "shipped"), kernel, 128, {"FLASHTILE_V3_ABLATE": ablate})
        return ttgir, (tmp_path / (ablate or "shipped") / f"{kernel}_d128.ptx").read_text()

    def waits(ttgir):
        return ttgir.count("ttng.wait_barrier")

    shipped, shipped_ptx = compiled("")
    no_pingpong, _ = compiled("pingpong")
    no_overlap, _ = compiled("overlap")
    _, no_persistent_ptx = compiled("persistent")
    no_next_q, _ = compiled("next_q")
    _, no_q_registers_ptx = compiled("q_registers")
    _, causal_ptx = compiled("", "v3.fwd_gluon_causal")
    _, causal_no_persistent_ptx = compiled("persistent", "v3.fwd_gluon_causal")
    # Ping-pong: each consumer waits for its turn before the first block's GEMM and in the loop.
    assert waits(shipped) == waits(no_pingpong) + 4
    # Intra-warpgroup overlap: waiting for S while the PV product stays in flight (1 pending).
    assert "pendings = 1" in shipped and "pendings = 1" not in no_overlap
    # Persistent CTAs take causal tiles (uneven lengths) from an atomic counter and stride over
    # equal ones; one CTA per tile needs no counter.
    assert "atom.global" in causal_ptx and "atom.global" not in causal_no_persistent_ptx
    assert causal_ptx.count(".exch.") == 2  # the last CTA sets the counter pair back to zero
    assert "atom.global" not in shipped_ptx
    assert shipped_ptx.count("%nctaid.x") > no_persistent_ptx.count("%nctaid.x")
    # The next tile's Q: two tiles' Q halves (4 x 64 rows) in shared memory instead of one's.
    assert "memdesc<4x1x64x1x128xbf16" in shipped and "memdesc<4x1x64x1x128xbf16" not in no_next_q
    # Q in registers: no wgmma reads its A operand from shared memory; switched off, S = Q K^T does.
    smem_a = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, %"
    assert not re.search(smem_a, shipped_ptx) and re.search(smem_a, no_q_registers_ptx)


def test_v3_forward_routing(monkeypatch):
    # Which v3 forward a problem gets on the GPU: the Gluon kernel for batched problems (short
    # causal/window bands too), the plain-Triton one under the interpreter; switches work.
    from dataclasses import replace

    from flashtile.kernels import configs
    from flashtile.kernels.problem import Problem

    def problem(seqlen, window_right):
        return Problem(2, 8, 8, seqlen, seqlen, 128, 0.1, -1, window_right, None, None)

    monkeypatch.setattr(configs.runtime, "interpreting", lambda: False)
    for name in ("FLASHTILE_V3_FWD", "FLASHTILE_V3_ABLATE", "FLASHTILE_CONFIG_V3_GLUON"):
        monkeypatch.delenv(name, raising=False)
    assert configs.v3_forward_kernel(problem(1024, -1)) == "gluon"
    assert configs.v3_gluon_schedule(problem(1024, -1)) == configs.GluonSchedule(128, 2, True, True, True, True)
    assert configs.v3_forward_kernel(problem(configs.SHORT_KEYS, 0)) == "gluon"  # short bands too
    monkeypatch.setenv("FLASHTILE_V3_FWD", "v2")
    assert configs.v3_forward_kernel(problem(configs.SHORT_KEYS, 0)) == "v2"
    monkeypatch.setenv("FLASHTILE_V3_ABLATE", "pingpong,persistent")
    assert configs.v3_gluon_schedule(problem(4096, -1)) == configs.GluonSchedule(128, 2, False, True, False, True)
    monkeypatch.setenv("FLASHTILE_V3_ABLATE", "pingpong,nonsense")
    with pytest.raises(ValueError, match="nonsense"):
        configs.v3_gluon_schedule(problem(4096, -1))
    monkeypatch.setenv("FLASHTILE_CONFIG_V3_GLUON", "64,4")
    monkeypatch.delenv("FLASHTILE_V3_ABLATE")
    assert configs.v3_gluon_schedule(problem(4096, -1)) == configs.GluonSchedule(64, 4)
    monkeypatch.setenv("FLASHTILE_CONFIG_V3_GLUON", "64,4,3")  # three consumers: up to d64 only
    with pytest.raises(ValueError, match="3 up to head dim 64"):
        configs.v3_gluon_schedule(problem(4096, -1))
    d64 = replace(problem(4096, -1), head_dim=64)
    assert configs.v3_gluon_schedule(d64) == configs.GluonSchedule(64, 4, consumers=3)
    monkeypatch.delenv("FLASHTILE_CONFIG_V3_GLUON")
    # d64 takes three consumers from THREE_CONSUMERS_FROM query rows (a band: from more).
    assert configs.v3_gluon_schedule(d64).consumers == 3
    assert configs.v3_gluon_schedule(replace(d64, seqlen_q=1024)).consumers == 2
    assert configs.v3_gluon_schedule(replace(d64, window_right=0)).consumers == 2
    assert configs.v3_gluon_schedule(replace(d64, window_right=0, seqlen_q=8192)).consumers == 3
    monkeypatch.setenv("FLASHTILE_V3_FWD", "triton")
    assert configs.v3_forward_kernel(problem(4096, -1)) == "triton"
    monkeypatch.setenv("FLASHTILE_V3_FWD", "v3")
    with pytest.raises(ValueError, match="FLASHTILE_V3_FWD"):
        configs.v3_forward_kernel(problem(4096, -1))
    monkeypatch.setattr(configs.runtime, "interpreting", lambda: True)
    monkeypatch.delenv("FLASHTILE_V3_FWD")
    assert configs.v3_forward_kernel(problem(4096, -1)) == "triton"
    assert configs.v3_forward_kernel(problem(configs.SHORT_KEYS, 0)) == "triton"


def test_v3_forward_falls_back_where_the_gluon_kernel_does_not_run(monkeypatch):
    # What the Gluon forward does not take (here: CPU tensors; on the GPU varlen, d <= 32)
    # runs v2's forward on short causal/window bands and v3's plain-Triton kernel otherwise.
    from flashtile.kernels import configs, v3
    from flashtile.kernels.problem import Problem

    def problem(seqlen, window_right):
        return Problem(1, 2, 2, seqlen, seqlen, 64, 0.125, -1, window_right, None, None)

    assert configs.v3_fallback_forward(problem(configs.SHORT_KEYS, 0)) == "v2"
    assert configs.v3_fallback_forward(problem(2 * configs.SHORT_KEYS, 0)) == "triton"
    assert configs.v3_fallback_forward(problem(configs.SHORT_KEYS, -1)) == "triton"
    ran = []
    monkeypatch.setattr(v3, "v3_forward_kernel", lambda p: "gluon")
    monkeypatch.setattr(v3.v2, "forward", lambda p, q, k, v: ran.append("v2"))
    q = torch.randn(1, 40, 2, 64, dtype=torch.float16)
    v3.forward(problem(40, 0), q, q, q)
    assert ran == ["v2"]
    if os.environ.get("TRITON_INTERPRET") == "1":  # the plain kernel runs under the interpreter
        out, lse, _ = v3.forward(problem(40, -1), q, q, q)
        assert ran == ["v2"] and out.shape == q.shape and torch.isfinite(out).all()


def test_v3_backward_routing(monkeypatch):
    # Gluon by default at d128 (one pass with TMA reduce-add on long keys, two passes otherwise),
    # at d256 (two passes) and at d64 on long keys (one pass), v2's otherwise; each on request; a
    # reduce-add kernel never when deterministic; the interpreter keeps v2's.
    from dataclasses import replace

    from flashtile.kernels import configs
    from flashtile.kernels.problem import Problem

    p = Problem(2, 8, 8, 1024, 1024, 128, 0.1, -1, 0, None, None)
    p64, p256 = replace(p, head_dim=64), replace(p, head_dim=256)
    monkeypatch.setattr(configs.runtime, "interpreting", lambda: False)
    for name in ("FLASHTILE_V3_DQ", "FLASHTILE_CONFIG_V3_BWD", "FLASHTILE_V3_BWD", "FLASHTILE_CONFIG_V3_GLUON_BWD"):
        monkeypatch.delenv(name, raising=False)
    assert [configs.v3_backward(x) for x in (p64, p, p256)] == ["gluon", "gluon", "gluon"]
    assert configs.v3_backward(replace(p, head_dim=192)) == "gluon"  # padded to 256
    long = replace(p, seqlen_k=configs.GLUON_REDUCE_MIN_KEYS[128])
    assert configs.v3_backward(long) == "gluon-reduce"
    assert configs.v3_backward(replace(long, deterministic=True)) == "gluon"
    long64 = replace(p64, seqlen_k=configs.GLUON_REDUCE_MIN_KEYS[64])
    assert configs.v3_backward(long64) == "gluon-reduce"
    assert configs.v3_backward(replace(long64, seqlen_k=long64.seqlen_k - 1)) == "gluon"
    assert configs.v3_backward(replace(long64, deterministic=True)) == "gluon"
    assert configs.v3_backward(replace(long64, head_dim=256)) == "gluon"  # no single pass at d256
    monkeypatch.setenv("FLASHTILE_V3_BWD", "v2")
    assert configs.v3_backward(p) == "v2"
    monkeypatch.setenv("FLASHTILE_V3_BWD", "gluon")
    assert configs.v3_backward(p64) == "gluon"
    monkeypatch.setenv("FLASHTILE_V3_BWD", "gluon-reduce")
    assert configs.v3_backward(p64) == "gluon-reduce"
    assert configs.v3_backward(replace(p64, deterministic=True)) == "gluon"
    assert configs.v3_backward(p256) == "gluon"  # the single pass stops at d128
    # d64's single pass streams 128-row Q blocks, its two passes 64-row ones
    assert configs.v3_gluon_bwd_config(p64, single_pass=True).kv_block_m == 128
    assert configs.v3_gluon_bwd_config(p64).kv_block_m == 64
    monkeypatch.setenv("FLASHTILE_V3_BWD", "")
    monkeypatch.setenv("FLASHTILE_CONFIG_V3_GLUON_BWD", "128,64,3")
    assert configs.v3_backward(p64) == "gluon"
    assert configs.v3_gluon_bwd_config(p64) == configs.GluonBackward(128, 64, 3)
    assert configs.v3_gluon_bwd_config(p64, single_pass=True) == configs.GluonBackward(128, 64, 3)
    monkeypatch.setenv("FLASHTILE_V3_DQ", "reduce")
    assert configs.v3_backward(p) == "reduce"
    assert configs.v3_backward(replace(p, deterministic=True)) == "gluon"
    monkeypatch.setenv("FLASHTILE_V3_BWD", "v1")
    monkeypatch.delenv("FLASHTILE_V3_DQ")
    with pytest.raises(ValueError, match="FLASHTILE_V3_BWD"):
        configs.v3_backward(p)
    monkeypatch.delenv("FLASHTILE_V3_BWD")
    monkeypatch.setattr(configs.runtime, "interpreting", lambda: True)
    assert configs.v3_backward(p) == "v2"


def test_v3_gluon_backward_pass_schedule(monkeypatch):
    # The two passes up to d128 run a CTA per SM with two stationary slots when there are more
    # tiles than SMs: tiles of equal length strided over, a band's (causal, window) taken from
    # the tile counter; d256, the single pass and as few tiles as SMs keep a CTA per tile and
    # one slot.
    from dataclasses import replace

    from flashtile.kernels import v3_gluon_bwd
    from flashtile.kernels.problem import Problem

    Schedule = v3_gluon_bwd.Schedule
    monkeypatch.setattr(v3_gluon_bwd, "sm_count", lambda device_index: 132)
    monkeypatch.delenv("FLASHTILE_V3_ABLATE", raising=False)
    plain = Problem(2, 8, 8, 1024, 1024, 128, 0.1, -1, -1, None, None)
    gpu = torch.device("cuda", 0)
    assert v3_gluon_bwd.pass_schedule(plain, 512, gpu) == Schedule(132, 2, True, False)
    assert v3_gluon_bwd.pass_schedule(replace(plain, head_dim=64), 512, gpu) == Schedule(132, 2, True, False)
    assert v3_gluon_bwd.pass_schedule(plain, 132, gpu) == Schedule(132, 1, False, False)
    assert v3_gluon_bwd.pass_schedule(replace(plain, window_right=0), 512, gpu) == Schedule(132, 2, True, True)
    assert v3_gluon_bwd.pass_schedule(replace(plain, window_left=64), 512, gpu) == Schedule(132, 2, True, True)
    assert v3_gluon_bwd.pass_schedule(plain, 512, gpu, dq_reduce=True) == Schedule(512, 1, False, False)
    assert v3_gluon_bwd.pass_schedule(replace(plain, head_dim=256), 512, gpu) == Schedule(512, 1, False, False)
    assert Schedule(132, 2, True, True).constants() == dict(SLOTS=2, PERSISTENT=True, DYNAMIC=True)
    monkeypatch.setenv("FLASHTILE_V3_ABLATE", "persistent")  # the ablation's switch
    assert v3_gluon_bwd.pass_schedule(plain, 512, gpu) == Schedule(512, 1, False, False)
    assert v3_gluon_bwd.pass_schedule(replace(plain, window_right=0), 512, gpu) == Schedule(512, 1, False, False)


def test_v3_gluon_takes_only_layouts_tma_can_describe():
    from flashtile.kernels import v3_gluon

    def tma_addressable(x):  # what the 4-D host descriptors describe as it is
        return v3_gluon.tma_aligned(x) and not v3_gluon.broadcast(x)
    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    assert tma_addressable(q)
    assert tma_addressable(q.transpose(1, 2).contiguous().transpose(1, 2))  # (b, h, s, d) storage
    assert not tma_addressable(q[:1].expand(2, 64, 4, 64))  # broadcast batch: stride 0
    assert not tma_addressable(torch.randn(2, 64, 4, 68, dtype=torch.bfloat16)[..., :64])  # 136-byte heads
    # tma_ready copies what TMA cannot read, including a contiguous tensor on a misaligned base.
    shifted = torch.randn(2 * 64 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64, 4, 64)
    assert shifted.is_contiguous() and not v3_gluon.tma_aligned(shifted)
    for x in (shifted, torch.randn(2, 64, 4, 68, dtype=torch.bfloat16)[..., :64]):
        ready = v3_gluon.tma_ready(x)
        assert tma_addressable(ready) and torch.equal(ready, x)
    assert v3_gluon.tma_ready(q) is q


def test_v3_gluon_launch_constants():
    # Shared memory: each consumer stages O in a buffer of its own where Q, the K/V ring and those
    # fit (d64, d128), else the two share one (d256); a second Q buffer where that fits too;
    # without room for any staging O leaves from registers; persistent CTAs take
    # banded (uneven) tiles from the counter and stride over equal ones.
    from dataclasses import replace

    from flashtile.kernels import configs, v3_gluon
    from flashtile.kernels.problem import Problem

    def problem(batch, heads, seqlen, head_dim):
        return Problem(batch, heads, heads, seqlen, seqlen, head_dim, 0.1, -1, -1, None, None)

    for head_dim, own_buffers in ((64, True), (128, True), (256, False)):
        cfg = configs._by_head_dim(configs._V3_GLUON, head_dim)
        consts = v3_gluon.kernel_constants(problem(1, 16, 4096, head_dim), cfg, 2)
        assert consts["O_BUFFERS"] == (cfg.consumers if own_buffers else 1)
        assert consts["ROWS"] * 2 == configs.GLUON_TILE_M
        assert not consts["DYNAMIC"]
        assert consts["Q_SLOTS"] == (2 if own_buffers else 1)
        without = v3_gluon.kernel_constants(problem(1, 16, 4096, head_dim), replace(cfg, next_q=False), 2)
        assert without["Q_SLOTS"] == 1
        # Q in registers for S = Q K^T up to d128 with two consumers (d64's three would spill)
        assert consts["Q_IN_REGISTERS"] == (head_dim <= 128)
        assert not v3_gluon.kernel_constants(problem(1, 16, 4096, head_dim), replace(cfg, q_registers=False),
                                             2)["Q_IN_REGISTERS"]
        if head_dim == 64:
            assert not v3_gluon.kernel_constants(problem(1, 16, 4096, 64), replace(cfg, consumers=3),
                                                 2)["Q_IN_REGISTERS"]
    assert v3_gluon.o_staging_buffers(2**16, 2**17 + 2**15, 2) == 0  # no room left for 32 KB
    causal = Problem(1, 16, 16, 4096, 4096, 128, 0.1, -1, 0, None, None)
    cfg = configs._by_head_dim(configs._V3_GLUON, 128)
    assert v3_gluon.kernel_constants(causal, cfg, 2)["DYNAMIC"]
    assert not v3_gluon.kernel_constants(causal, replace(cfg, persistent=False), 2)["DYNAMIC"]
    # The band's left edge is tested only where a window has one.
    assert not v3_gluon.kernel_constants(causal, cfg, 2)["LEFT_EDGE"]
    assert v3_gluon.kernel_constants(replace(causal, window_left=0), cfg, 2)["LEFT_EDGE"]
    # Banded walks interleave the heads whose K/V fit in L2; equal tiles go one head at a time.
    assert v3_gluon.heads_sharing_l2(replace(causal, batch=16, seqlen_q=1024, seqlen_k=1024), 2) == 64  # 512 KiB
    assert v3_gluon.heads_sharing_l2(replace(causal, seqlen_q=16384, seqlen_k=16384), 2) == 4  # 8 MiB per head
    assert v3_gluon.heads_sharing_l2(replace(causal, heads_q=2, heads_k=2, seqlen_q=1024, seqlen_k=1024), 2) == 2
    assert v3_gluon.heads_sharing_l2(replace(causal, seqlen_q=2 ** 20, seqlen_k=2 ** 20, head_dim=256), 2) == 1
    assert v3_gluon.heads_sharing_l2(problem(16, 16, 1024, 128), 2) == 1
