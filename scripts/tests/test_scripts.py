"""The maintained scripts' own logic, on made-up inputs (no GPU)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_bars_table_counts_cells_at_or_above_the_baseline(monkeypatch, tmp_path, capsys):
    # scripts/bars_table.py: one table from a run split by head dim, v3 over the baseline and
    # over v2 per mode, the count of cells v3 holds, an earlier run's ratios beside them.
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


def test_features_table_joins_the_runs_against_no_feature(tmp_path, capsys):
    # scripts/features_table.py: the features' runs joined into one record file, a row per
    # feature with each cell's ratio to the run without one; a cell a run lacks stays empty.
    import features_table

    def run(name, tflops, **feature):
        path = tmp_path / f"features_{name}.json"
        path.write_text(json.dumps([dict(provider="flashtile-v3", b=2, h=16, d=128, sq=8192, dtype="bf16",
                                         causal=c, mode=m, tflops=t, **feature) for (m, c), t in tflops.items()]))
        return str(path)

    runs = [run("none", {("fwd", False): 600, ("bwd", False): 500, ("fwd", True): 400}),
            run("softcap", {("fwd", False): 540, ("bwd", False): 450}, softcap=30.0),
            run("alibi", {("fwd", False): 300}, alibi=True, softcap=0.0)]
    features_table.main([*runs, "--out", str(tmp_path / "features.json")])
    out = capsys.readouterr().out
    assert "| feature | fwd non-causal | fwd causal | bwd non-causal |" in out
    assert "| none | 600 | 400 | 500 |" in out
    assert "| alibi | 300 (0.50x) |  |  |" in out
    assert "| softcap 30 | 540 (0.90x) |  | 450 (0.90x) |" in out
    assert len(json.loads((tmp_path / "features.json").read_text())) == 6
    assert (tmp_path / "features.md").read_text() == out


def test_ncu_stalls_splits_the_samples_by_region(monkeypatch, tmp_path, capsys):
    # scripts/ncu_stalls.py: Nsight Compute's SASS page (a preamble, then one row per
    # instruction) split into hot loops (run at least half as often as the most run
    # instruction), idle warps (NOPs sampled only at a barrier) and the rest.
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


def test_fp8_accuracy_protocol_end_to_end(tmp_path):
    # scripts/fp8_accuracy.py on a tiny problem (the interpreter on CPU): every variant's RMSE
    # in the JSON, float8 coarser than bf16 everywhere, the table with both float8 types, and
    # gradients for bf16 v3 and for fp8_attn_func's two backwards.
    import subprocess

    import torch
    gpu = torch.cuda.is_available()
    env = dict(os.environ, TRITON_INTERPRET="0" if gpu else "1", PYTHONPATH=ROOT)
    out = tmp_path / "acc.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fp8_accuracy.py"), "--seqlen", "64",
                          "--heads", "2", "--head-dim", "32", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    variants = {f"{t}_{s}{i}" for t in ("e4m3", "e5m2") for s in ("tensor", "head", "block")
                for i in ("", "_incoherent")}
    for causal in ("non-causal", "causal"):
        errors = result[causal]
        assert set(errors) == variants | {"bf16_v3", "bf16_pytorch"}
        assert all(errors["bf16_v3"] < errors[v] < 0.2 for v in variants), errors
    assert [len(g) for g in result["gradients"].values()] == [3, 3, 3]
    assert "| e4m3 |" in res.stdout and "| e5m2 |" in res.stdout and "gradients dQ, dK, dV" in res.stdout


def test_train_llama_fp8_attention_matches_sdpa(monkeypatch):
    # scripts/train_llama.py's attn_implementation "fp8" (fp8_attn_func through transformers'
    # attention interface) on a tiny random Llama: logits and a gradient near "sdpa"'s, within
    # what float8 attention inputs allow; padding masks refused by name.
    import pytest
    import torch
    pytest.importorskip("transformers")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the FP8 kernels need a GPU or the interpreter")
    import train_llama
    from transformers import LlamaConfig, LlamaForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device)
    tokens = torch.randint(0, 64, (2, 48), device=device)
    logits, grads = {}, {}
    for name in ("sdpa", train_llama.FP8):
        model.set_attn_implementation(name)
        model.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):  # as train_llama.train_step (float32 q, k)
            out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        logits[name] = out.logits.float()
        grads[name] = model.model.layers[0].self_attn.q_proj.weight.grad.float()
    scale = logits["sdpa"].abs().mean()
    assert (logits[train_llama.FP8] - logits["sdpa"]).abs().mean() < 0.05 * scale
    cosine = torch.nn.functional.cosine_similarity(grads["sdpa"].flatten(), grads[train_llama.FP8].flatten(), dim=0)
    assert cosine > 0.95, cosine
    with pytest.raises(NotImplementedError, match="attn_implementation='fp8' takes unpadded"):
        model(input_ids=tokens, attention_mask=torch.ones_like(tokens).index_fill_(1, torch.tensor([0], device=device), 0))


def test_train_llama_parting_finds_the_first_difference_and_its_margins():
    # scripts/train_llama.py's generation check on a tiny random Llama (CPU): identical greedy
    # tokens part nowhere; tokens changed from index 3 part there, with the reference's top-2
    # margin and the float32 model's logit difference between the two tokens on the prefix.
    import pytest
    import torch
    pytest.importorskip("transformers")
    import train_llama
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 64, (1, 8))
    reference = train_llama.generate(model, prompt, "sdpa", 6)
    assert train_llama.parting(model, prompt, reference, reference) == (None, None, None)
    other = (reference[0][:3] + [(t + 1) % 64 for t in reference[0][3:]], reference[1])
    first, margin, margin32 = train_llama.parting(model, prompt, reference, other)
    top = reference[1][3].topk(2).values
    assert first == 3 and margin == pytest.approx(float(top[0] - top[1]))
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, torch.tensor([reference[0][:3]])], 1)).logits[0, -1]
    assert margin32 == pytest.approx(float(logits[reference[0][3]] - logits[other[0][3]]), abs=1e-5)


def test_host_time_table_takes_each_trees_median():
    # scripts/host_time.py --table: runs of two trees joined, the median per tree and call, the
    # number of runs beside it; a call one tree lacks stays empty.
    import host_time
    runs = [dict(tree="a", host_us={"flashtile forward": x, "sdpa forward": 20.0}) for x in (100.0, 140.0, 120.0)]
    runs.append(dict(tree="b", host_us={"flashtile forward": 80.0}))
    out = host_time.table(runs)
    assert "| call | a | b |" in out
    assert "| flashtile forward | 120.0 (3) | 80.0 (1) |" in out
    assert "| sdpa forward | 20.0 (3) |  |" in out
