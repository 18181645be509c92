"""torch.compile, packed layouts, version selection and which device a call runs on."""
import contextlib
import os

import pytest
import torch
from attention_check import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU

from flashtile import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, ops,
                       runtime)


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 40, 40, 2, 2, 32, torch.float16, DEVICE))

    def layer(q, k, v):
        return (flash_attn_func(q, k, v, causal=True) * 2).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager = torch.autograd.grad(layer(q, k, v), (q, k, v))
    torch.testing.assert_close(loss, layer(q, k, v))
    for a, b in zip(grads, eager):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_eager_function_and_custom_op_agree(version):
    # Eager calls skip the custom op's autograd wrapper (ops.py); both paths must give the same
    # outputs and gradients, including a loss that reaches the logsumexp only.
    q, k, v = make_qkv(1, 40, 48, 2, 1, 32, torch.float16, DEVICE)
    args = (None, None, 40, 48, 32 ** -0.5, -1, 0, version, False)
    results = []
    for entry in (ops.attention, ops.attention_forward):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse, _ = entry(*leaves, *args)
        grads = torch.autograd.grad(out.float().sum() + lse.sum(), leaves)
        lse_only = torch.autograd.grad(entry(*leaves, *args)[1].sum(), leaves)
        results.append((out, lse, *grads, *lse_only))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_calls_without_gradients_build_no_autograd_node():
    # Under no_grad, or with inputs that need no gradient, ops.attention skips the autograd
    # Function (ops.py): the outputs must match the ones with gradients, bit for bit, and
    # carry no autograd node.
    q, k, v = make_qkv(1, 40, 48, 2, 1, 32, torch.float16, DEVICE)
    args = (None, None, 40, 48, 32 ** -0.5, -1, 0, "v2", False)
    with_grad = ops.attention(*(x.clone().requires_grad_() for x in (q, k, v)), *args)
    assert with_grad[0].grad_fn is not None
    with torch.no_grad():
        no_grad = ops.attention(*(x.clone().requires_grad_() for x in (q, k, v)), *args)
    plain = ops.attention(q, k, v, *args)
    for out in (no_grad, plain):
        assert out[0].grad_fn is None and not out[0].requires_grad
        for a, b in zip(out, with_grad):
            torch.testing.assert_close(a, b.detach(), atol=0, rtol=0)


def test_packed_layouts_match_separate_tensors():
    qkv = torch.randn(1, 33, 3, 2, 32, dtype=torch.float16, device=DEVICE)
    q, k, v = qkv.unbind(2)
    separate = flash_attn_func(q, k, v, causal=True, version="v2")
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=True, version="v2"), separate, atol=0, rtol=0)
    torch.testing.assert_close(flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True, version="v2"),
                               separate, atol=0, rtol=0)


def test_auto_picks_a_version_that_runs_here():
    expected = ("v3" if torch.cuda.get_device_capability()[0] == 9 else "v2") if ON_GPU else "v2"
    assert runtime.resolve_version("auto", torch.device(DEVICE)) == expected


@pytest.mark.skipif(ON_GPU, reason="CPU-only behaviour")
def test_cpu_without_interpreter_uses_tiled_path_and_refuses_kernels(monkeypatch):
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    assert runtime.resolve_version("auto", torch.device("cpu")) == "tiled"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        runtime.resolve_version("v2", torch.device("cpu"))


def test_calls_run_on_the_device_of_their_tensors(monkeypatch):
    # Triton launches on the current device: a call on another GPU's tensors makes theirs current.
    import types
    assert isinstance(ops.on_device_of(torch.empty(1)), contextlib.nullcontext)
    on_gpu1 = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = ops.on_device_of(on_gpu1)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert isinstance(ops.on_device_of(on_gpu1), contextlib.nullcontext)


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_a_second_gpu_while_the_first_is_current(version):
    q, k, v = make_qkv(2, 300, 300, 4, 2, 128, torch.bfloat16, "cuda:1")
    with torch.cuda.device(0):
        check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, causal=True, version=version),
                                q, k, v, causal=True)
