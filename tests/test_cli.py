"""The flashtile command: usage errors, info, demo, and the report writers."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE, ON_GPU

from flashtile import bench, cli


@pytest.mark.parametrize("argv", [["bench", "--modes", "foo"], ["bench", "--head-dims", "100"],
                                  ["bench", "--seqlens", "0"], ["bench", "--providers", "nope"], ["frobnicate"],
                                  ["bench", "--repeats", "0"], ["bench", "--hidden", "64"], ["io", "--tokens", "x"],
                                  ["bench", "--cuda-graphs"],  # graphs time forwards only
                                  ["bench", "--dropout", "1"], ["bench", "--dropout", "x"],
                                  ["bench", "--out", __file__], ["decode", "--out", __file__],  # a file, not a folder
                                  ["bench", "--name", "sub/x"], ["decode", "--name", ""],
                                  ["bench", "--softcap", "-1"], ["bench", "--softcap", "inf"], ["io", "--copy-tbps", "-2"],
                                  ["io", "--matmul-tflops", "nan"], ["decode", "--head-dim", "257"]])
def test_bad_arguments_exit_2_with_allowed_values(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err


def test_bad_mode_lists_allowed_values(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--modes", "foo"])
    assert "fwd, bwd, fwdbwd" in capsys.readouterr().err


def _run_cli(*args, interpret="0"):
    env = dict(os.environ, TRITON_INTERPRET=interpret)
    return subprocess.run([sys.executable, "-m", "flashtile", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_info_names_every_version():
    res = _run_cli("info")
    assert res.returncode == 0, res.stderr
    for version in ("v1", "v2", "v3"):
        assert f"  {version}: " in res.stdout


def test_demo_prints_error_and_memory():
    res = _run_cli("demo")
    assert res.returncode == 0, res.stderr
    assert "max |error| vs float64: flashtile" in res.stdout
    assert "extra memory" in res.stdout
    line = next(x for x in res.stdout.splitlines() if x.startswith("max |error|"))
    flash_err = float(line.split("flashtile ")[1].split()[0])
    standard_err = float(line.split("standard attention ")[1].split()[0])
    assert flash_err <= 2 * standard_err + 1e-5


def test_report_files_and_schema(tmp_path):
    env = bench.environment()
    records = [dict(provider=p, **vars(c), ms=1.0, tflops=c.flops() / 1e9, peak_mem_bytes=1 << 20, **env)
               for c in bench.paper_grid((64,), (512, 1024), (False,), ("fwd",))
               for p in ("flashtile-v2", "sdpa-flash")]
    table = bench.save(records, tmp_path, "t", baseline="sdpa-flash")
    saved = json.loads((tmp_path / "t.json").read_text())
    assert set(saved[0]) == {"provider", "dtype", "softcap", "alibi", "sinks", "varlen", "dropout", "dv", "b", "h", "h_k",
                             "sq", "sk",
                             "d", "causal", "mode", "ms", "tflops", "peak_mem_bytes", "gpu", "torch", "triton", "commit",
                             "date"}
    assert "| 1024 |" in table and "flashtile-v2/sdpa-flash" in table
    assert (tmp_path / "t_tflops.png").stat().st_size > 0 and (tmp_path / "t_memory.png").stat().st_size > 0


def test_bench_tiny_grid_under_the_interpreter(tmp_path):
    # The whole pipeline (providers, timing, JSON, Markdown, plots) on a grid the interpreter runs
    # fast; on a GPU machine the same grid runs on the GPU.
    res = _run_cli("bench", "--head-dims", "32", "--seqlens", "80", "--tokens", "80", "--hidden", "64",
                   "--modes", "fwd,bwd", "--providers", "flashtile-v1,flashtile-v2,standard",
                   "--baseline", "standard", "--out", str(tmp_path), "--name", "tiny",
                   interpret="0" if ON_GPU else "1")
    assert res.returncode == 0, res.stderr
    records = json.loads((tmp_path / "tiny.json").read_text())
    assert len(records) == 2 * 2 * 3  # causal x mode x provider
    for r in records:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["b"] == 1 and r["h"] == 2 and r["sq"] == 80
    assert "### d32 causal bwd" in res.stdout and "flashtile-v2/standard" in res.stdout
    assert (tmp_path / "tiny.md").read_text() in res.stdout
    assert (tmp_path / "tiny_tflops.png").stat().st_size > 0


def test_bench_dropout_cells(tmp_path, monkeypatch):
    # --dropout P times flashtile's calls with dropout_p=P (SDPA's too); standard attention takes a
    # mask rather than a rate, so it is refused rather than timed without dropout.
    case = bench.Case(1, 2, 2, 64, 64, 32, False, "fwd", dtype="fp16", dropout=0.25)
    assert bench.score_features(case, DEVICE) == {"dropout_p": 0.25}
    q, k, v, fn = bench.make_inputs("standard", case, DEVICE)
    with pytest.raises(NotImplementedError, match="standard takes no dropout_p"):
        fn(q, k, v, False)
    res = _run_cli("bench", "--dropout", "0.25", "--head-dims", "32", "--seqlens", "64", "--tokens", "64",
                   "--hidden", "64", "--modes", "fwd", "--causal", "false", "--providers", "flashtile-v2,standard",
                   "--baseline", "flashtile-v2", "--out", str(tmp_path), "--name", "drop", "--no-plots",
                   interpret="0" if ON_GPU else "1")
    records = json.loads((tmp_path / "drop.json").read_text())
    assert [(r["provider"], r["dropout"]) for r in records] == [("flashtile-v2", 0.25)], res.stderr
    assert "standard takes no dropout_p" in res.stdout + res.stderr
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from features_table import feature_of
    assert feature_of(records[0]) == "dropout 0.25" and feature_of(dict(records[0], dropout=0.0)) == "none"


def test_bench_own_value_head_dim(tmp_path):
    # --head-dim-v: V (and the output) with a head dim of its own, FLOPs 2 * (d + dv) per pair
    # (4 * d with one head dim); float8 cells take one head dim.
    case = bench.Case(1, 2, 2, 64, 64, 32, False, "fwd", dtype="fp16", dv=16)
    assert case.flops() == 2 * 2 * 64 * 64 * (32 + 16) and bench.Case(1, 2, 2, 64, 64, 32, False, "fwd").flops() == \
        4 * 2 * 64 * 64 * 32
    q, k, v, fn = bench.make_inputs("standard", case, DEVICE)
    assert v.shape[-1] == 16 and fn(q, k, v, False).shape[-1] == 16
    with pytest.raises(NotImplementedError, match="one head dim"):
        bench.make_step("flashtile-v3", bench.Case(1, 2, 2, 64, 64, 32, False, "fwd", dtype="e4m3", dv=16), DEVICE)
    res = _run_cli("bench", "--head-dims", "32", "--head-dim-v", "16", "--seqlens", "64", "--tokens", "64",
                   "--hidden", "64", "--modes", "fwd,bwd", "--causal", "true", "--providers", "flashtile-v2,standard",
                   "--baseline", "standard", "--out", str(tmp_path), "--name", "own_v", "--no-plots",
                   interpret="0" if ON_GPU else "1")
    assert res.returncode == 0, res.stderr
    records = json.loads((tmp_path / "own_v.json").read_text())
    assert len(records) == 4 and all(r["dv"] == 16 and r["d"] == 32 for r in records)
    assert "### d32/16 causal bwd" in res.stdout and "2*b*h*sq*sk*(d + dv)" in res.stdout


def _packed_inputs(case):
    """The packed inputs make_inputs draws for ``case``, and the documents' offsets."""
    q, k, v, _ = bench.make_inputs("standard", case, DEVICE)
    offsets = torch.tensor([0] + case.lengths(), device=DEVICE).cumsum(0).to(torch.int32)
    return q, k, v, offsets


def test_bench_packed_documents(tmp_path):
    # --varlen: the tokens as documents of random lengths (mean seqlen), the same every run, their
    # FLOPs summed document by document; flashtile's varlen call and standard attention document
    # by document agree on the same inputs; records and tables say the cells are packed.
    case = bench.Case(3, 2, 2, 40, 40, 32, True, "fwd", dtype="fp16", varlen=True)
    lengths = case.lengths()
    assert lengths == bench.Case(3, 2, 2, 40, 40, 32, False, "bwd", varlen=True).lengths()
    assert len(lengths) == 3 and all(1 <= n < 80 for n in lengths) and len(set(lengths)) > 1
    assert case.flops() == 4 * 2 * sum(n * n for n in lengths) * 32 / 2
    q, k, v, offsets = _packed_inputs(case)
    assert q.shape == (sum(lengths), 2, 32)
    ref = bench.PACKED_PROVIDERS["standard"](q, k, v, offsets, lengths, True)
    out = bench.PACKED_PROVIDERS["flashtile-v2"](q, k, v, offsets, lengths, True)
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=0)
    res = _run_cli("bench", "--varlen", "--head-dims", "32", "--seqlens", "40", "--tokens", "120", "--hidden", "64",
                   "--modes", "fwd,bwd", "--causal", "true", "--providers", "flashtile-v2,flashtile-v3,standard",
                   "--baseline", "standard", "--out", str(tmp_path), "--name", "packed", "--no-plots",
                   interpret="0" if ON_GPU else "1")
    assert res.returncode == 0, res.stderr
    records = json.loads((tmp_path / "packed.json").read_text())
    assert len(records) == 2 * 3 and all(r["varlen"] and r["b"] == 3 and r["tflops"] > 0 for r in records)
    assert "### d32 causal bwd packed" in res.stdout and "documents of random lengths" in res.stdout


@pytest.mark.skipif(not ON_GPU, reason="SDPA's nested tensors and FlexAttention run on the GPU")
def test_bench_packed_peers_agree_with_standard_attention():
    # The packed peers compute what flashtile's varlen call does: SDPA's backends on a nested
    # (jagged) tensor, FlexAttention with a document mask.
    case = bench.Case(4, 4, 4, 300, 300, 64, True, "fwd", dtype="fp16", varlen=True)
    q, k, v, offsets = _packed_inputs(case)
    lengths = tuple(case.lengths())
    ref = bench.PACKED_PROVIDERS["standard"](q, k, v, offsets, lengths, True)
    for provider in ("flashtile-v3", "sdpa-flash", "sdpa-efficient", "flex"):
        out = bench.PACKED_PROVIDERS[provider](q, k, v, offsets, lengths, True)
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=0, msg=provider)


def test_bench_float8_cells_beside_bf16_ones(tmp_path):
    # --dtype bf16,e4m3: float8 cells on the providers with an FP8 path, in the same JSON schema
    # (dtype "e4m3"), divided by the same provider's bf16 cell in the table (the backward:
    # fp8_attn_func's FP8 backward, as flashtile-v3); providers without float8 inputs are reported
    # as not measured, not silently skipped.
    res = _run_cli("bench", "--head-dims", "32", "--seqlens", "80", "--tokens", "80", "--hidden", "64",
                   "--modes", "fwd,bwd", "--causal", "true", "--dtype", "bf16,e4m3",
                   "--providers", "flashtile-v3,standard", "--baseline", "standard", "--out", str(tmp_path),
                   "--name", "fp8", "--no-plots", interpret="0" if ON_GPU else "1")
    assert res.returncode == 0, res.stderr
    records = json.loads((tmp_path / "fp8.json").read_text())
    float8 = [r for r in records if r["dtype"] == "e4m3"]
    assert [(r["provider"], r["mode"]) for r in float8] == [("flashtile-v3", "fwd"), ("flashtile-v3", "bwd")]
    assert all(r["tflops"] > 0 and set(r) == set(records[0]) for r in float8)
    assert len(records) - len(float8) == 2 * 2  # bf16: mode x provider
    assert "### d32 causal fwd e4m3" in res.stdout and "### d32 causal bwd e4m3" in res.stdout
    assert "flashtile-v3/bf16" in res.stdout and "fp8_backward=True" in res.stdout
    assert "standard takes no float8 inputs" in res.stdout and "measured as flashtile-v3" in res.stdout


def test_bench_without_gpu_or_interpreter_is_a_usage_error():
    if ON_GPU:
        pytest.skip("a GPU is present")
    res = _run_cli("bench")
    assert res.returncode == 2 and "TRITON_INTERPRET=1" in res.stderr


def test_bench_cuda_graphs_need_a_gpu():
    if ON_GPU:
        pytest.skip("a GPU is present")
    res = _run_cli("bench", "--cuda-graphs", "--modes", "fwd", interpret="1")
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr


def test_bench_cuda_graph_timing_on_gpu():
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    case = bench.Case(2, 4, 4, 1000, 1000, 128, True, "fwd")
    for provider in ("flashtile-v2", "flashtile-v3", "sdpa-cudnn"):
        if provider in bench.available_providers()[0]:
            ms, _ = bench.measure(provider, case, cuda_graph=True)
            assert ms > 0


def test_io_model_table_and_regimes(tmp_path, capsys):
    assert cli.main(["io", "--head-dims", "64", "--seqlens", "1024"]) == 0
    table = capsys.readouterr().out
    assert all(f"| 64 | False | 1024 | {name} |" in table for name in ("standard", "v1", "v2", "v3"))
    rec = dict(provider="flashtile-v1", b=16, h=32, h_k=32, sq=1024, sk=1024, d=64, causal=False, mode="fwd", ms=1.0)
    (tmp_path / "b.json").write_text(json.dumps([rec]))
    assert cli.main(["io", "--measured", str(tmp_path / "b.json"), "--copy-tbps", "4", "--matmul-tflops", "700",
                     "--out", str(tmp_path / "io.json")]) == 0
    out = capsys.readouterr().out
    assert "| flashtile-v1 | 64 | False | 1024 | fwd |" in out and "memory" in out
    assert json.loads((tmp_path / "io.json").read_text())["rows"][0]["bound"] == "memory"


def test_io_model_rows_written_without_measurements(tmp_path):
    assert cli.main(["io", "--head-dims", "64", "--seqlens", "1024", "--out", str(tmp_path / "model.json")]) == 0
    rows = json.loads((tmp_path / "model.json").read_text())["rows"]
    assert {r["algorithm"] for r in rows} == {"standard", "v1", "v2", "v3"}
    assert all(r["d"] == 64 and r["seqlen"] == 1024 and r["fwd_bytes"] > 0 for r in rows)


def test_bench_with_every_cell_failed_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run", lambda cases, providers, repeats, on_error, **kw: on_error("x") or [])
    monkeypatch.setattr(bench, "available_providers", lambda: (list(bench.PROVIDERS), {}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["bench", "--head-dims", "32", "--seqlens", "64", "--out", str(tmp_path)]) == 1
    assert "no provider ran a cell" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_io_unreadable_measurements_exit_2(tmp_path):
    assert cli.main(["io", "--measured", str(tmp_path / "missing.json")]) == 2


def test_bench_repeats_keep_every_pass_and_report_failures(monkeypatch):
    def broken(q, k, v, causal, **options):
        raise RuntimeError("no kernel for this shape\nsecond line")

    monkeypatch.setitem(bench.PROVIDERS, "broken", broken)
    errors = []
    cases = [bench.Case(1, 2, 2, 40, 40, 32, True, "fwd", "fp16")]
    records = bench.run(cases, ["standard", "broken"], repeats=3, progress=False, on_error=errors.append)
    assert [r["provider"] for r in records] == ["standard"]
    assert len(records[0]["ms_runs"]) == 3 and records[0]["ms"] == sorted(records[0]["ms_runs"])[1]
    assert len(errors) == 1 and "broken" in errors[0] and "no kernel for this shape" in errors[0]
    assert "second line" not in errors[0]
    table = bench.markdown_table(records, failures=errors)
    assert "| 40 |" in table and table.rstrip().endswith(f"- {errors[0]}")


def test_bench_measure_passes_kernel_options_to_flashtile(monkeypatch):
    # The ablation, sweep and A/B scripts force kernels through ``kernel_options``: it reaches the
    # flashtile providers (an unknown kernel is refused) and nothing else.
    case = bench.Case(1, 2, 2, 40, 40, 32, False, "bwd")
    device = "cuda" if ON_GPU else "cpu"
    with pytest.raises(ValueError, match="backward='v7'"):
        bench.measure("flashtile-v3", case, device=device, kernel_options="backward=v7")
    assert bench.measure("standard", case, device=device, kernel_options="backward=v7")[0] > 0


def test_compare_rotates_the_order_of_the_variants(monkeypatch):
    # Each variant is measured with its own provider and options, the order of the variants
    # rotating by one from round to round (over as many rounds as variants, each runs once in
    # every place), and each keeps its best time per case.
    measured, times = [], iter([3.0, 2.0, 1.0, 5.0, 4.0, 6.0, 2.5, 0.5, 7.0, 1.5, 0.2, 9.0,
                                8.0, 3.5, 4.5, 0.1, 6.5, 5.5])

    def fake_measure(provider, case, kernel_options=None):
        measured.append((provider, kernel_options))
        return next(times), None

    monkeypatch.setattr(bench, "measure", fake_measure)
    variants = {"old": ("flashtile-v2", None), "new": ("flashtile-v3", None), "again": ("flashtile-v3", "x")}
    cases = [bench.Case(1, 2, 2, 40, 40, 32, True, "fwd"), bench.Case(1, 2, 2, 70, 70, 32, False, "bwd")]
    best = bench.compare(variants, cases, rounds=3)
    order = [{v: k for k, v in variants.items()}[m] for m in measured]
    assert order == ["old", "new", "again"] * 2 + ["new", "again", "old"] * 2 + ["again", "old", "new"] * 2
    for place in range(3):  # every variant once in every place, for each case
        assert sorted(order[place::3][::2]) == sorted(order[place::3][1::2]) == ["again", "new", "old"]
    assert best == [{"old": 3.0, "new": 2.0, "again": 0.5}, {"old": 5.0, "new": 1.5, "again": 0.1}]


def test_decode_bench_tiny_grid(tmp_path, capsys):
    # The decode benchmark's pipeline on a grid the interpreter runs: its paged cache (pages in a
    # shuffled order) holds the same keys as the contiguous one, so both give the same bits.
    from flashtile import decode_bench
    shape = dict(heads=4, heads_k=2, head_dim=32, page_size=16)
    outs = [decode_bench.make_call(p, 2, 48, **shape)() for p in ("flashtile", "flashtile-paged")]
    assert torch.equal(outs[0], outs[1])
    tiles = "tiles.decode=32,2,4;tiles.decode_paged=32,3,4"  # a tile override, as a sweep passes it
    assert cli.main(["decode", "--batches", "1", "--caches", "40", "--heads", "4", "--heads-k", "2", "--head-dim", "32",
                 "--providers", "flashtile,flashtile-paged", "--kernel-options", tiles, "--out", str(tmp_path),
                 "--name", "d"]) == 0
    records = json.loads((tmp_path / "d.json").read_text())
    assert {r["provider"] for r in records} == {"flashtile", "flashtile-paged"}
    assert {r["kernel_options"] for r in records} == {tiles}
    # Each record keeps the split count its cell ran: the dispatcher's one for 40 keys (fewer than
    # a split's least, DECODE_MIN_SPLIT_KEYS), or the count --num-splits asks for, as a split
    # sweep passes it.
    assert [r["splits"] for r in records] == [1, 1]
    assert cli.main(["decode", "--batches", "1", "--caches", "40", "--heads", "4", "--heads-k", "2", "--head-dim", "32",
                 "--providers", "flashtile", "--num-splits", "3", "--out", str(tmp_path), "--name", "s"]) == 0
    split = json.loads((tmp_path / "s.json").read_text())
    assert [r["splits"] for r in split] == [3] and "| 1 | 40 |" in (tmp_path / "s.md").read_text()
    assert (tmp_path / "s.md").read_text().rstrip().endswith("| 3 |")
    with pytest.raises(SystemExit):
        cli.main(["decode", "--num-splits", "-1"])
    assert cli.main(["decode", "--kernel-options", "tiles.decode=32,2"]) == 2  # three integers
    assert all(r["tbps"] > 0 and r["host_us"] > 0 for r in records)
    if not ON_GPU:  # SDPA's backends with no CPU kernel are skipped by name, not run to fail
        assert cli.main(["decode", "--batches", "1", "--caches", "40", "--heads", "4", "--heads-k", "2",
                         "--head-dim", "32", "--providers", "flashtile,sdpa-cudnn", "--out", str(tmp_path),
                         "--name", "c"]) == 0
        assert "skipping sdpa-cudnn: needs a CUDA GPU" in capsys.readouterr().err
        assert {r["provider"] for r in json.loads((tmp_path / "c.json").read_text())} == {"flashtile"}
    assert "| 1 | 40 |" in (tmp_path / "d.md").read_text()
