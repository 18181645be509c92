"""The flashtile command: usage errors, info, demo, and the report writers."""
import cProfile
import json
import os
import pstats
import subprocess
import sys

import pytest
from conftest import ON_GPU

from flashtile import bench, cli


@pytest.mark.parametrize("argv", [["bench", "--modes", "foo"], ["bench", "--head-dims", "100"],
                                  ["bench", "--seqlens", "0"], ["bench", "--providers", "nope"], ["frobnicate"],
                                  ["bench", "--repeats", "0"], ["bench", "--hidden", "64"], ["io", "--tokens", "x"],
                                  ["bench", "--cuda-graphs"]])  # graphs time forwards only
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
    assert set(saved[0]) == {"provider", "dtype", "b", "h", "h_k", "sq", "sk", "d", "causal", "mode", "ms",
                             "tflops", "peak_mem_bytes", "gpu", "torch", "triton", "commit", "date"}
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


def test_io_unreadable_measurements_exit_2(tmp_path):
    assert cli.main(["io", "--measured", str(tmp_path / "missing.json")]) == 2


def test_bench_repeats_keep_every_pass_and_report_failures(monkeypatch):
    def broken(q, k, v, causal):
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


def test_bench_measure_sets_kernel_switches_for_one_measurement(monkeypatch):
    # The ablation, sweep and backward-variant scripts force kernels through ``env``: it must
    # reach the kernels (an unknown backward is refused) and be gone after the call.
    monkeypatch.delenv("FLASHTILE_V3_BWD", raising=False)
    case = bench.Case(1, 2, 2, 40, 40, 32, False, "bwd")
    with pytest.raises(ValueError, match="FLASHTILE_V3_BWD"):
        bench.measure("flashtile-v3", case, device="cuda" if ON_GPU else "cpu", env={"FLASHTILE_V3_BWD": "v7"})
    assert "FLASHTILE_V3_BWD" not in os.environ


def test_compare_rotates_the_order_of_the_variants(monkeypatch):
    # Each variant's setup is in place for its own measurements only, the order of the variants
    # rotates by one from round to round (over as many rounds as variants, each runs once in
    # every place), and each keeps its best time per case.
    import contextlib

    entered, times = [], iter([3.0, 2.0, 1.0, 5.0, 4.0, 6.0, 2.5, 0.5, 7.0, 1.5, 0.2, 9.0,
                               8.0, 3.5, 4.5, 0.1, 6.5, 5.5])

    def fake_measure(provider, case):
        assert entered[-1][1] == provider  # measured under its own variant's setup
        return next(times), None

    def setup(name, provider):
        @contextlib.contextmanager
        def put_in_place():
            entered.append((name, provider))
            yield
        return put_in_place

    monkeypatch.setattr(bench, "measure", fake_measure)
    variants = {"old": ("flashtile-v2", setup("old", "flashtile-v2")),
                "new": ("flashtile-v3", setup("new", "flashtile-v3")),
                "again": ("flashtile-v3", setup("again", "flashtile-v3"))}
    cases = [bench.Case(1, 2, 2, 40, 40, 32, True, "fwd"), bench.Case(1, 2, 2, 70, 70, 32, False, "bwd")]
    best = bench.compare(variants, cases, rounds=3)
    order = [name for name, _ in entered]
    assert order == ["old", "new", "again"] * 2 + ["new", "again", "old"] * 2 + ["again", "old", "new"] * 2
    for place in range(3):  # every variant once in every place, for each case
        assert sorted(order[place::3][::2]) == sorted(order[place::3][1::2]) == ["again", "new", "old"]
    assert best == [{"old": 3.0, "new": 2.0, "again": 0.5}, {"old": 5.0, "new": 1.5, "again": 0.1}]


def test_host_cost_times_the_calls_enqueued_and_finished(monkeypatch):
    # Host time (calls enqueued) never exceeds wall time (calls finished); switches in ``env``
    # reach the kernels for those calls only.
    case = bench.Case(1, 2, 2, 40, 40, 32, True, "fwd")
    host, wall = bench.host_cost("flashtile-v2", case, calls=3)
    assert 0 < host <= wall
    # A profiler sees the timed calls (not the warm-up ones): each reaches v2's forward once.
    profiler = cProfile.Profile()
    bench.host_cost("flashtile-v2", case, calls=3, profiler=profiler)
    calls = {fn[2]: count for fn, (count, *_) in pstats.Stats(profiler).stats.items() if fn[0].endswith("v2.py")}
    assert calls.get("forward") == 3
    monkeypatch.delenv("FLASHTILE_V3_FWD", raising=False)
    with pytest.raises(ValueError, match="FLASHTILE_V3_FWD"):
        bench.host_cost("flashtile-v3", case, calls=1, env={"FLASHTILE_V3_FWD": "v7"})
    assert "FLASHTILE_V3_FWD" not in os.environ


def test_ab_module_measures_each_revision_in_place_of_the_tree(monkeypatch, tmp_path, capsys):
    # scripts/ab_module.py: the file at the revision stands where the package refers to the
    # module for the "rev" variant's measurements only; tree and tree_again use the tree's file;
    # --check compares one set of gradients of the two bit for bit (v3's backward is v2's under
    # the interpreter, so v2's file is swapped).
    import importlib.util

    from flashtile.kernels import v3
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("ab_module", os.path.join(root, "scripts", "ab_module.py"))
    ab_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_module)
    tree_file = v3.v2.__file__
    seen = []

    def fake_measure(provider, case):
        seen.append(os.path.basename(v3.v2.__file__))
        return float(len(seen)), None

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.chdir(root)
    out = tmp_path / "ab.json"
    ab_module.main(["flashtile/kernels/v2.py", "--rev", "HEAD", "--at", "flashtile.kernels.v3", "--cells",
                    "16 40 causal bwd", "--tokens", "40", "--hidden", "32", "--baseline", "", "--rounds", "2",
                    "--check", "--out", str(out)])
    assert seen == ["v2.py", "v2_at_HEAD.py", "v2.py", "v2_at_HEAD.py", "v2.py", "v2.py"]
    assert v3.v2.__file__ == tree_file
    assert "bitwise equal: True" in capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert rows == [dict(d=16, causal=True, seqlen=40, mode="bwd", tree=1.0, rev=2.0, tree_again=3.0)]
    with pytest.raises(SystemExit):
        ab_module.main(["flashtile/kernels/v2.py", "--at", "flashtile.kernels.v1", "--cells", "16 40 causal bwd"])


def test_ab_env_measures_each_variant_under_its_settings(monkeypatch, tmp_path, capsys):
    # scripts/ab_env.py: each variant's environment is set for its own measurements only, the
    # order rotated each round; --check compares each variant's gradients with the first's.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "scripts"))
    import ab_env
    monkeypatch.delenv("FLASHTILE_V3_BWD", raising=False)
    seen = []

    def fake_measure(provider, case):
        seen.append(os.environ.get("FLASHTILE_V3_BWD"))
        return float(len(seen)), None

    monkeypatch.setattr(bench, "measure", fake_measure)
    out = tmp_path / "ab.json"
    ab_env.main(["--cells", "16 40 causal bwd", "--tokens", "40", "--hidden", "32", "--baseline", "",
                 "--rounds", "2", "--variant", "plain:", "--variant", "forced:FLASHTILE_V3_BWD=v2", "--check",
                 "--out", str(out)])
    assert seen == [None, "v2", "v2", None]
    assert "FLASHTILE_V3_BWD" not in os.environ
    assert "plain and forced bitwise equal: True" in capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert rows == [dict(d=16, causal=True, seqlen=40, mode="bwd", plain=1.0, forced=2.0)]
    with pytest.raises(ValueError):
        ab_env.parse_variant("no-colon")


def test_bars_table_counts_cells_at_or_above_the_baseline(monkeypatch, tmp_path, capsys):
    # scripts/bars_table.py: one table from a run split by head dim, v3 over the baseline and
    # over v2 per mode, the count of cells v3 holds, an earlier run's ratios beside them.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "scripts"))
    import bars_table

    def records(d, tflops):
        return [dict(provider=p, d=d, causal=False, sq=1024, mode=m, tflops=t)
                for (p, m), t in tflops.items()]

    run = [tmp_path / "d64.json", tmp_path / "d128.json"]
    run[0].write_text(json.dumps(records(64, {("flashtile-v3", "fwd"): 400, ("sdpa-cudnn", "fwd"): 500,
                                              ("flashtile-v2", "fwd"): 200, ("flashtile-v3", "bwd"): 300,
                                              ("sdpa-cudnn", "bwd"): 300})))
    run[1].write_text(json.dumps(records(128, {("flashtile-v3", "fwd"): 600, ("sdpa-cudnn", "fwd"): 500})))
    before = tmp_path / "before.json"
    before.write_text(json.dumps(records(64, {("flashtile-v3", "fwd"): 250, ("sdpa-cudnn", "fwd"): 500})))
    bars_table.main([*map(str, run), "--previous", str(before)])
    out = capsys.readouterr().out
    assert "fwd: v3 >= sdpa-cudnn in 1 of 2 cells, bwd: v3 >= sdpa-cudnn in 1 of 1 cells" in out
    assert "| 64 | no | 1024 | 400 | 500 | 0.800 | 2.00 | 300 | 300 | 1.000 |  | 0.500 / - |" in out
    assert "| 128 | no | 1024 | 600 | 500 | 1.200 |  |  |  |  |  | - / - |" in out


def test_ncu_stalls_splits_the_samples_by_region(monkeypatch, tmp_path, capsys):
    # scripts/ncu_stalls.py: Nsight Compute's SASS page (a preamble, then one row per
    # instruction) split into hot loops (run at least half as often as the most run
    # instruction), idle warps (NOPs sampled only at a barrier) and the rest.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "scripts"))
    import ncu_stalls

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_barrier", "stall_wait", "stall_long_sb", "stall_barrier (Not Issued)"]
    rows = [["0x10", "MUFU.EX2 R1, R1", "60", "1,000", "0", "60", "0", "0"],
            ["0x20", "@!P0 BRA 0x10", "20", "900", "5", "15", "0", "0"],
            ["0x30", "NOP", "15", "10", "15", "0", "0", "15"],
            ["0x40", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2", "5", "100", "0", "0", "5", "0"]]
    path = tmp_path / "sass.csv"
    path.write_text('"Kernel Name","_fwd_kernel"\n' + "\n".join(",".join(f'"{x}"' for x in r)
                                                             for r in [header] + rows) + "\n")
    ncu_stalls.main([str(path)])
    out = capsys.readouterr().out
    assert "| hot loops | 80.0% | wait 93.8%, barrier 6.2% |" in out
    assert "| idle at a barrier | 15.0% | barrier 100.0% |" in out
    assert "| rest | 5.0% | long_sb 100.0% |" in out
    assert "Hot loops' samples by opcode: MUFU 75.0%, BRA 25.0%" in out
