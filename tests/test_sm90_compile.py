"""Hopper code checked without a GPU: kernels compiled for sm_90 and their TTGIR read."""
import os
import re
import subprocess
import sys

import pytest

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
