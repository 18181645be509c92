"""Test setup: on a machine without CUDA the Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before triton is imported, hence here and not in a fixture.
The same tests run unchanged on a GPU, with larger shapes and bf16 as well as fp16.
"""
import os
import subprocess
import sys
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import flashtile  # noqa: E402,F401

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_outside_the_interpreter(*args, timeout=120):
    """``python *args`` in a fresh process with TRITON_INTERPRET=0 (CPU tensors take the PyTorch
    path there; kernels compile for a GPU target), on this checkout's flashtile whatever else is
    installed: the completed process, its output captured."""
    path = os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def clear_kept_launches():
    """Forget the Gluon launches kept per kind of call: the next call of each kind builds its own."""
    from flashtile.kernels.gluon import backward, forward
    forward._forward_launch.cache_clear()
    backward._backward_launches.cache_clear()


@pytest.fixture
def fresh_launches():
    """The Gluon launches kept per kind of call built anew inside the test and dropped after it:
    for tests that patch what they are built from (the SM count, the L2 budget)."""
    clear_kept_launches()
    yield
    clear_kept_launches()


@pytest.fixture(autouse=True)
def cached_memory_released():
    """On a GPU each test hands its cached blocks back: the suite's workers share one card, and a
    worker holding what its largest test allocated left the others out of memory on 80 GB."""
    yield
    if ON_GPU:
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def fresh_kept_calls():
    """Each test's calls checked and their problems made afresh (api.py and ops.py keep them per
    kind of call): a test may patch what they are made from."""
    from flashtile import api, ops
    api._KEPT_CALLS.clear()
    ops._batched_problem.cache_clear()
    yield


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """Every float tensor flashtile allocates starts as NaN, so an unwritten element fails."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        if t.is_floating_point():
            with torch.no_grad():  # (a leaf that requires grad, as torch.compile's passes make)
                t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(empty_like(*a, **kw)))
    yield


@pytest.fixture(autouse=True)
def fresh_seed(request):
    # A different seed per test (from its name), same across runs: fresh inputs, reproducible failures.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
