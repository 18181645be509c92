"""Test setup: on a machine without CUDA the Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before triton is imported, hence here and not in a fixture.
The same tests run unchanged on a GPU, with larger shapes and bf16 as well as fp16.
"""
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import flashtile  # noqa: E402,F401

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


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
