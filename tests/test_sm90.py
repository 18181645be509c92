"""Hopper code checked without a GPU: kernels compiled for sm_90 and their TTGIR read."""
import os
import re

import pytest
from conftest import ROOT, run_outside_the_interpreter

from flashtile.kernels import configs


def compile_for_sm90(tmp_path, only, head_dim, kernel_options="", softcap=0.0, alibi=False, dropout=False, fp8=None,
                     fp8_mode=1, head_dim_v=None):
    res = run_outside_the_interpreter(
        os.path.join(ROOT, "scripts", "compile_sm90.py"), "--head-dims", str(head_dim), "--only", only, "--dump",
        str(tmp_path), "--options", kernel_options, "--softcap", str(softcap), *(["--alibi"] if alibi else []),
        *(["--dropout"] if dropout else []), *(["--fp8", fp8, "--fp8-mode", str(fp8_mode)] if fp8 else []),
        *(["--head-dim-v", str(head_dim_v)] if head_dim_v else []), timeout=600)
    if res.returncode != 0 or "FAILED" in res.stdout:
        pytest.fail(f"sm_90 compile failed:\n{res.stdout}\n{res.stderr[-2000:]}")
    return (tmp_path / f"{only}_d{head_dim}.ttgir").read_text()


def test_v3_warp_specialized_partitions_store_their_own_rows(tmp_path):
    # Each consumer warpgroup stores O and the logsumexp of the same rows: the second one at
    # m0 + 64, never m0 + 128 (Triton 3.6's double offset on pointer stores, see v3.py).
    # The shipped d128 config is the warp-specialized one.
    ttgir = compile_for_sm90(tmp_path, "v3.fwd", 128)
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
    res = run_outside_the_interpreter(os.path.join(ROOT, "scripts", "compile_sm90.py"), "--head-dims", "128",
                                      "--varlen", timeout=600)
    assert res.returncode == 0 and "FAILED" not in res.stdout, res.stdout + res.stderr[-2000:]
    # v1 (two), v2 (three), v3, the quantizing kernel, the Gluon forward (plain, causal, window)
    # and the Gluon backward's two passes (plain, causal)
    assert res.stdout.count("wgmma=True") == 14


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_v3_gluon_forward_compiles_for_sm90(tmp_path, monkeypatch, head_dim):
    # The Gluon kernel does not run under the interpreter: its Hopper structure is checked here,
    # its numbers on the GPU (scripts/gpu_check.sh gluon).
    ttgir = compile_for_sm90(tmp_path, "v3.fwd_gluon", head_dim)
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
    # one buffer); only the rare rows recomputed by the masking rule leave by pointer.
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
    assert_consumer_loops(tmp_path / f"v3.fwd_gluon_d{head_dim}.cubin", head_dim, consumers, monkeypatch)


@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (128, 64), (192, 192)])
def test_v3_gluon_forward_takes_its_own_value_head_dim(tmp_path, monkeypatch, head_dim, head_dim_v):
    # MLA prefill's 192 / 128 and 128 / 64: S = Q K^T over Q's head dim, O += P V and O's TMA
    # store over V's, tiles chosen by the wider one.  Head dim 192 loads Q and K as three slices
    # of 64 lanes (shared-memory blocks are powers of two): S's product reduces over 192 lanes,
    # 12 MMA steps of 16, not d256's 16 (qk_lanes), and with V of 128 lanes the K/V ring holds
    # d128's 128-key blocks.
    ttgir = compile_for_sm90(tmp_path, "v3.fwd_gluon", head_dim, head_dim_v=head_dim_v)
    ptx = (tmp_path / f"v3.fwd_gluon_d{head_dim}.ptx").read_text()
    assert "ttg.warp_specialize" in ttgir
    pad, pad_v = (max(16, 1 << (d - 1).bit_length()) for d in (head_dim, head_dim_v))
    lanes = 192 if head_dim == 192 else pad
    block_n = configs.by_head_dim(configs.V3_GLUON, max(lanes, pad_v)).block_n
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, (\S)", ptx)
    assert {n for n, _ in wgmma} == {str(block_n), str(pad_v)}
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx  # O's TMA store
    assert_consumer_loops(tmp_path / f"v3.fwd_gluon_d{head_dim}.cubin", lanes, 2, monkeypatch, block_n)


@pytest.mark.parametrize("head_dim, head_dim_v, mma", [(192, 128, (24, 28)), (192, 192, (32, 36)), (128, 64, (16, 20))])
def test_v3_gluon_backward_passes_take_their_own_value_head_dim(tmp_path, monkeypatch, head_dim, head_dim_v, mma):
    # The two Gluon backward passes with V's (and dO's, dV's) head dim of its own: no spills, and
    # the MMAs a warpgroup issues per streamed block, which at head dim 192 count the S product
    # over 192 lanes (d256's tiles: 12 steps of 16, not 16; 192 / 192: 36 and 40 with all 256).
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass
    for kernel, expected in zip(("v3.bwd_dq_gluon", "v3.bwd_dkdv_gluon"), mma):
        compile_for_sm90(tmp_path, kernel, head_dim, head_dim_v=head_dim_v)
        loops = hot_loops(sass((tmp_path / f"{kernel}_d{head_dim}.cubin").read_bytes()))
        assert loops and all(loop_stats(loop)[1:3] == (expected, 0) for loop in loops), \
            (kernel, [loop_stats(loop)[:3] for loop in loops])


def assert_consumer_loops(cubin, head_dim, consumers, monkeypatch, block_n=None):
    """Each consumer's K/V loop, in SASS: per block the k-steps of S = Q K^T (head dim / 16: the
    lanes it reduces over) and of O += P V (block_n / 16, by default the head dim's table's), and
    no spill traffic."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass
    block_n = block_n or configs.by_head_dim(configs.V3_GLUON, head_dim).block_n
    loops = hot_loops(sass(cubin.read_bytes()))
    assert len(loops) == consumers
    for loop in loops:
        size, mma, spills, _ = loop_stats(loop)
        assert mma == head_dim // 16 + block_n // 16 and spills == 0, (size, mma, spills)


def test_v3_gluon_forward_score_features_loops(tmp_path, monkeypatch):
    # d128: a softcap on bf16 is every row's max (BOUNDED): no running max (FMNMX) in the K/V
    # loop, a tanh and an exp2 per score on the special-function unit; ALiBi split off the
    # diagonal keeps the loop free of spills; with both, the running max is back.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass

    def loops(name, **feature):
        compile_for_sm90(tmp_path / name, "v3.fwd_gluon", 128, **feature)
        cubin = (tmp_path / name / "v3.fwd_gluon_d128.cubin").read_bytes()
        found = [loop_stats(loop) for loop in hot_loops(sass(cubin))]
        assert len(found) == 2 and all(spills == 0 and mma == 16 for _, mma, spills, _ in found), found
        return [ops for *_, ops in found]

    scores = 64 * 128 // 128  # a consumer's 64 x 128 block over its 128 threads
    for ops in loops("softcap", softcap=30.0):
        assert ops["FMNMX"] == 0 and 2 * scores <= ops["MUFU"] <= 2 * scores + 4, ops
    for ops in loops("alibi", alibi=True):
        assert ops["FMNMX"] > 0
    for ops in loops("both", softcap=30.0, alibi=True):
        assert ops["FMNMX"] > 0


def test_v3_gluon_single_pass_alibi_loop_reads_positions(tmp_path, monkeypatch):
    # d128's single-pass backward with ALiBi forms the bias's query part from a table of column
    # positions in shared memory (backward._write_positions): its loop keeps the 32 MMAs and at
    # most a few spill instructions (columns' indices built every block spill far more).
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass
    compile_for_sm90(tmp_path, "v3.bwd_reduce_gluon", 128, alibi=True)
    cubin = (tmp_path / "v3.bwd_reduce_gluon_d128.cubin").read_bytes()
    found = [loop_stats(loop)[:3] for loop in hot_loops(sass(cubin))]
    assert len(found) == 1 and found[0][1] == 32 and found[0][2] <= 16, found


@pytest.mark.parametrize("head_dim", [64, 128])
def test_v3_gluon_window_forward_compiles_for_sm90(tmp_path, monkeypatch, head_dim):
    # A sliding window's left edge is tested only where the window has one (LEFT_EDGE): the
    # kernel built with it keeps the causal one's K/V loops.
    compile_for_sm90(tmp_path, "v3.fwd_gluon_window", head_dim)
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
    ttgir = compile_for_sm90(tmp_path, kernel, head_dim)
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
    ttgir = compile_for_sm90(tmp_path, kernel, 256)
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
        ttgir = compile_for_sm90(tmp_path / (ablate or "shipped"), kernel, 128, f"ablate={ablate}" if ablate else "")
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
    # The counter is epoch-tagged: raised to the launch's epoch first, then taken from; nothing
    # sets it back at the end.
    assert re.search(r"atom\.global\.\S*max\.s64", causal_ptx) and re.search(r"atom\.global\.\S*add\.u64", causal_ptx)
    assert ".exch." not in causal_ptx
    assert "atom.global" not in shipped_ptx
    assert shipped_ptx.count("%nctaid.x") > no_persistent_ptx.count("%nctaid.x")
    # The next tile's Q: two tiles' Q halves (4 x 64 rows) in shared memory instead of one's.
    assert "memdesc<4x1x64x1x128xbf16" in shipped and "memdesc<4x1x64x1x128xbf16" not in no_next_q
    # Q in registers: no wgmma reads its A operand from shared memory; switched off, S = Q K^T does.
    smem_a = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, %"
    assert not re.search(smem_a, shipped_ptx) and re.search(smem_a, no_q_registers_ptx)


@pytest.mark.parametrize("kernel", ["v3.fwd_gluon", "v3.bwd_dq_gluon", "v3.bwd_dkdv_gluon", "v3.bwd_reduce_gluon"])
def test_softcap_goes_through_the_score_hook(tmp_path, kernel):
    # Softcap is one tanh.approx per score where S is formed (forward, and the backward's
    # recomputation of P), none without it; the backward's dS gets its derivative by FMA.
    compile_for_sm90(tmp_path / "plain", kernel, 128)
    compile_for_sm90(tmp_path / "softcap", kernel, 128, softcap=30.0)
    plain = (tmp_path / "plain" / f"{kernel}_d128.ptx").read_text()
    capped = (tmp_path / "softcap" / f"{kernel}_d128.ptx").read_text()
    assert "tanh.approx.f32" not in plain and "tanh.approx.f32" in capped


def test_plain_triton_kernels_take_the_score_hook(tmp_path):
    for kernel in ("v2.fwd", "v2.bwd_dq", "v2.bwd_dkdv", "v1.fwd", "v1.bwd", "v3.fwd_band"):
        compile_for_sm90(tmp_path / kernel, kernel, 64, softcap=30.0)
        assert "tanh.approx.f32" in (tmp_path / kernel / f"{kernel}_d64.ptx").read_text(), kernel


def test_alibi_compiles_into_every_kernel_that_takes_it(tmp_path):
    # ALiBi's slopes travel as a pointer inside the score hook's argument tuple; every kernel
    # compiles with it for sm_90 (the warp-specialized Triton and Gluon kernels included), its
    # distances |i + offset - j| as float abs, except where the bias is split on every block:
    # the Gluon dQ pass takes the diagonal's blocks as integer minima (score.crossing_part).
    for kernel in ("v2.fwd", "v2.bwd_dq", "v2.bwd_dkdv", "v1.fwd", "v1.bwd", "v3.fwd", "v3.fwd_band",
                   "v3.fwd_gluon", "v3.bwd_dq_gluon", "v3.bwd_dkdv_gluon"):
        compile_for_sm90(tmp_path / kernel, kernel, 128, softcap=30.0, alibi=True)
        ptx = (tmp_path / kernel / f"{kernel}_d128.ptx").read_text()
        if kernel == "v3.bwd_dq_gluon":
            assert "abs.f32" not in ptx and "min.s32" in ptx
        else:
            assert "abs.f32" in ptx, kernel


PHILOX = "0xD2511F53"  # a Philox round's multiplier (kernels/dropout.py's wide products)


def test_dropout_compiles_into_v2_kernels(tmp_path):
    # Philox (its rounds' multiplier) in v2's three kernels with dropout, and in the kernel that
    # writes the mask out; not in v2's forward without dropout.
    for kernel in ("v2.fwd", "v2.bwd_dq", "v2.bwd_dkdv", "dropout.kept"):
        compile_for_sm90(tmp_path / kernel, kernel, 128, dropout=True)
        assert PHILOX in (tmp_path / kernel / f"{kernel}_d128.ptx").read_text(), kernel
    compile_for_sm90(tmp_path / "plain", "v2.fwd", 128)
    assert PHILOX not in (tmp_path / "plain" / "v2.fwd_d128.ptx").read_text()


def test_gluon_forward_draws_dropout_numbers_in_its_own_threads(tmp_path, monkeypatch):
    # dropout.kept_mma forms each thread's Philox calls in the accumulator's layout: no value
    # crosses threads for the mask (the shuffles and shared-memory stores of the kernel without
    # dropout, no more), and the consumers' loops keep their MMAs and spill nothing.  With
    # dropout the rows' maxima and sums are trees over a thread's 32 keys of a row (depth 7: 5
    # in its registers, 2 across its lanes), without it Triton's chains (33).
    plain = compile_for_sm90(tmp_path / "plain", "v3.fwd_gluon", 128)
    ttgir = compile_for_sm90(tmp_path / "drop", "v3.fwd_gluon", 128, dropout=True)
    ptx, plain_ptx = ((tmp_path / x / "v3.fwd_gluon_d128.ptx").read_text() for x in ("drop", "plain"))
    assert PHILOX in ptx and PHILOX not in plain_ptx
    for op in ("shfl.sync", "st.shared"):
        assert ptx.count(op) == plain_ptx.count(op), op
    assert ttgir.count("ttg.local_alloc") == plain.count("ttg.local_alloc")
    assert_consumer_loops(tmp_path / "drop" / "v3.fwd_gluon_d128.cubin", 128, 2, monkeypatch)
    from sass_loops import hot_loops, longest_chain, sass
    for name, deepest in (("drop", range(1, 9)), ("plain", range(32, 64))):
        loops = hot_loops(sass((tmp_path / name / "v3.fwd_gluon_d128.cubin").read_bytes()))
        for op in ("FMNMX", "FADD"):
            assert all(longest_chain(loop, op) in deepest for loop in loops), (name, op)


def test_gluon_backward_passes_draw_dropout(tmp_path, monkeypatch):
    # The two passes with dropout (up to d128): Philox in both, no shared memory beyond the
    # kernels without it (the dK/dV pass hands its transposed tile's draws over by warp
    # shuffles: kept_words_t), and block loops without spill traffic (a tile of keep
    # predicates, or of keep words, held across the dP wait spilled at d128).
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass
    for kernel in ("v3.bwd_dq_gluon", "v3.bwd_dkdv_gluon"):
        plain = compile_for_sm90(tmp_path / kernel / "plain", kernel, 128)
        ttgir = compile_for_sm90(tmp_path / kernel / "drop", kernel, 128, dropout=True)
        ptx, plain_ptx = ((tmp_path / kernel / x / f"{kernel}_d128.ptx").read_text() for x in ("drop", "plain"))
        assert PHILOX in ptx and PHILOX not in plain_ptx, kernel
        assert ttgir.count("ttg.local_alloc") == plain.count("ttg.local_alloc"), kernel
        assert ptx.count("st.shared") == plain_ptx.count("st.shared"), kernel
        loops = [loop_stats(loop) for loop in hot_loops(sass((tmp_path / kernel / "drop" / f"{kernel}_d128.cubin")
                                                               .read_bytes()))]
        assert loops and all(spills == 0 for _, _, spills, _ in loops), (kernel, loops)


@pytest.mark.parametrize("fp8, mma, mode", [("fp8e4nv", "f32.e4m3.e4m3", 1), ("fp8e5", "f32.e5m2.e5m2", 1),
                                           ("fp8e4nv", "f32.e4m3.e4m3", 2)])
def test_fp8_forward_runs_both_matmuls_in_fp8(tmp_path, fp8, mma, mode):
    # Q K^T and P V as float8 warpgroup MMAs (P cast to V's type), the output stored as bf16,
    # with descales per (sequence, KV head) or per block.
    ptx = compile_for_sm90(tmp_path, "v2.fwd", 128, fp8=fp8, fp8_mode=mode) and \
        (tmp_path / "v2.fwd_d128.ptx").read_text()
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n128k32.{mma}") >= 2


@pytest.mark.parametrize("fp8", ["fp8e4nv", "fp8e5"])
def test_fp8_backward_runs_every_matmul_in_fp8(tmp_path, fp8):
    # fp8_attn_func(fp8_backward=True): the dQ pass's three products (S, dP, dQ) and the dK/dV
    # pass's four (S, dP, dV, dK) as float8 warpgroup MMAs, none in bf16.
    kind = "e4m3.e4m3" if fp8 == "fp8e4nv" else "e5m2.e5m2"
    for kernel, products in (("v2.bwd_dq", 3), ("v2.bwd_dkdv", 4)):
        compile_for_sm90(tmp_path, kernel, 128, fp8=fp8)
        ptx = (tmp_path / f"{kernel}_d128.ptx").read_text()
        shapes = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32)\.f32\.{kind}", ptx)
        assert len(shapes) >= products and "bf16" not in " ".join(re.findall(r"wgmma\.mma_async\S*", ptx)), kernel


@pytest.mark.parametrize("fp8, mode, head_dim", [("fp8e4nv", 1, 128), ("fp8e5", 2, 128), ("fp8e4nv", 2, 256)])
def test_gluon_fp8_forward_runs_float8_warpgroup_mmas(tmp_path, monkeypatch, fp8, mode, head_dim):
    # The Gluon forward on float8 inputs: both products float8 warpgroup MMAs (k32), V read
    # keys-contiguous by TMA, no spills in the consumers' loops; O leaves as bf16 by TMA.
    compile_for_sm90(tmp_path, "v3.fwd_gluon", head_dim, fp8=fp8, fp8_mode=mode)
    ptx = (tmp_path / f"v3.fwd_gluon_d{head_dim}.ptx").read_text()
    kind = "e4m3.e4m3" if fp8 == "fp8e4nv" else "e5m2.e5m2"
    shapes = set(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.{kind}", ptx))
    assert str(head_dim) in shapes, shapes  # O += P V, n = head dim
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass
    block_n = configs.by_head_dim(configs.V3_GLUON_FP8, head_dim).block_n
    loops = hot_loops(sass((tmp_path / f"v3.fwd_gluon_d{head_dim}.cubin").read_bytes()))
    assert loops
    for loop in loops:
        size, mma, spills, _ = loop_stats(loop)
        assert mma == head_dim // 32 + block_n // 32 and spills == 0, (size, mma, spills)


@pytest.mark.parametrize("share", [2, 4, 8])
def test_gluon_forward_takes_a_share_of_exponentials_on_the_fma_pipe(tmp_path, monkeypatch, share):
    # tiles.v3_gluon's fourth integer: 1/share of each block's exponentials computed on the FMA
    # pipe (tiles.exp2_fma), the rest on the MUFU, the parts taken along register bits (no
    # shuffle, no shared memory, no spills).
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass
    counts = {}
    for name, options in (("plain", "tiles.v3_gluon=128,3,2,0"), ("fma", f"tiles.v3_gluon=128,3,2,{share}")):
        compile_for_sm90(tmp_path / name, "v3.fwd_gluon", 128, kernel_options=options, fp8="fp8e4nv")
        counts[name] = [loop_stats(loop) for loop in
                        hot_loops(sass((tmp_path / name / "v3.fwd_gluon_d128.cubin").read_bytes()))]
    ptx, plain_ptx = ((tmp_path / x / "v3.fwd_gluon_d128.ptx").read_text() for x in ("fma", "plain"))
    for op in ("shfl.sync", "st.shared"):
        assert ptx.count(op) == plain_ptx.count(op), op
    assert counts["fma"] and len(counts["fma"]) == len(counts["plain"])
    for (_, mma, spills, ops), (_, plain_mma, _, plain_ops) in zip(counts["fma"], counts["plain"]):
        # 64 scores a thread a block: 64 / share exponentials move off the MUFU
        assert mma == plain_mma and spills == 0 and ops["MUFU"] == plain_ops["MUFU"] - 64 // share, \
            (ops["MUFU"], plain_ops["MUFU"])


# Per float8 pass: the producer's TMA copies, (tiles whose head dim is contiguous, of which a
# copy moves 128 bytes of a row: two at d256; keys-contiguous copies), and the loop's MMAs, k32
# each, as functions of the head dim and the streamed block.
FP8_PASSES = {
    "dq": ((4, 1), lambda d, block: 2 * d // 32 + block // 32),  # Q, dO, K, V; K's copy: S, dP, dQ
    "dkdv": ((4, 2), lambda d, block: 2 * d // 32 + 2 * block // 32),  # K, V, Q, dO; Q's, dO's: S^T, dP^T, dV, dK
    "dv": ((3, 1), lambda d, block: d // 32 + block // 32),  # K, V, Q; dO's copy: S^T, dV
    "dk": ((4, 1), lambda d, block: 2 * d // 32 + block // 32),  # K, V, Q, dO; Q's copy: S^T, dP^T, dK
}


@pytest.mark.parametrize("fp8, head_dim, kernel", [
    ("fp8e4nv", 128, "dq"), ("fp8e4nv", 128, "dkdv"), ("fp8e5", 64, "dq"), ("fp8e5", 64, "dkdv"),
    ("fp8e4nv", 256, "dq"), ("fp8e4nv", 256, "dv"), ("fp8e4nv", 256, "dk")])
def test_gluon_fp8_backward_passes_run_float8_warpgroup_mmas(tmp_path, monkeypatch, fp8, head_dim, kernel):
    # The float8 Gluon backward (gluon/backward_fp8.py): every product a float8 warpgroup MMA
    # (k32; none bf16), the dQ pass's S, dP (64 x its key block) and dQ (64 x head dim, dS in
    # registers), the dK/dV pass's S^T, dP^T (64 x 64), dV and dK (64 x head dim, P^T and dS^T in
    # registers), at d256 a dV pass (S^T, dV) and a dK pass (S^T, dP^T, dK); the tensors and the
    # keys-contiguous copies read by TMA; no spills in the loop.
    name = f"v3.bwd_{kernel}_gluon_fp8"
    compile_for_sm90(tmp_path, name, head_dim, fp8=fp8, fp8_mode=2)
    ptx = (tmp_path / f"{name}_d{head_dim}.ptx").read_text()
    kind = "e4m3.e4m3" if fp8 == "fp8e4nv" else "e5m2.e5m2"
    products = set(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.{kind}", ptx))
    block = configs.by_head_dim(configs.V3_GLUON_BWD_FP8, head_dim).dq_block_n if kernel == "dq" else 64
    assert products == {str(block), str(head_dim)}, products
    assert "bf16" not in " ".join(re.findall(r"wgmma\.mma_async\S*", ptx))
    (wide, keys), mmas = FP8_PASSES[kernel]
    assert ptx.count("cp.async.bulk.tensor.4d.shared::cluster.global") == wide * -(-head_dim // 128) + keys
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from sass_loops import hot_loops, loop_stats, sass
    loops = hot_loops(sass((tmp_path / f"{name}_d{head_dim}.cubin").read_bytes()))
    assert loops
    for loop in loops:
        size, mma, spills, _ = loop_stats(loop)
        assert mma == mmas(head_dim, block) and spills == 0, (size, mma, spills)


def test_sink_kernels_compile_for_sm90(tmp_path):
    # The interpreter runs what the compiler refuses (a plain global inside a kernel): the sinks'
    # join and gradient compile for sm_90 here.
    for kernel in ("sinks.join", "sinks.gradient"):
        compile_for_sm90(tmp_path / kernel, kernel, 128)
        assert "ex2.approx" in (tmp_path / kernel / f"{kernel}_d128.ptx").read_text(), kernel


def test_single_pass_delta_kernel_compiles_for_sm90(tmp_path):
    # The single pass's first kernel (plain Triton, numerics in test_kernels): D (a store per row
    # a thread holds), and the float32 dQ zeroed (a 64-row tile: more stores a thread).
    for head_dim in (64, 128):
        compile_for_sm90(tmp_path / str(head_dim), "v3.bwd_delta", head_dim)
        assert (tmp_path / str(head_dim) / f"v3.bwd_delta_d{head_dim}.ptx").read_text().count("st.global") > 8


def test_decode_kernels_compile_for_sm90(tmp_path):
    # The split-KV kernel over a paged cache (with ALiBi: each packed row reads its own query
    # head's slope) and the combine of its splits, its programmatic dependent: the split kernel
    # lets it launch, the combine waits for the split grid before reading.
    for kernel, control in (("decode.split", "griddepcontrol.launch_dependents"),
                            ("decode.combine", "griddepcontrol.wait")):
        compile_for_sm90(tmp_path / kernel, kernel, 128, softcap=30.0, alibi=True)
        assert control in (tmp_path / kernel / f"{kernel}_d128.ptx").read_text(), kernel
    # The append and rotation of packed rows (each finds its sequence by a search of the offsets)
    # compile and write their rows.
    for kernel in ("decode.append_packed", "decode.rotate_packed"):
        compile_for_sm90(tmp_path / kernel, kernel, 128)
        assert "st.global" in (tmp_path / kernel / f"{kernel}_d128.ptx").read_text(), kernel
