"""The public functions: bad input refused by name before any launch, numbers taken as what they
are, the differentiation modes flashtile supports and refuses, torch.compile, packed layouts,
which device a call runs on."""
import contextlib
import types

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from attention_check import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU

import flashtile
from flashtile import (dispatch, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, ops, options)
from flashtile.validation import check_sequence_span


@pytest.fixture
def qkv():
    return make_qkv(1, 16, 16, 2, 2, 32, torch.float16, DEVICE)


@pytest.fixture
def no_launch(monkeypatch):
    """Any error must come before a kernel runs: reaching one fails the test."""
    def launched(*a, **kw):
        raise AssertionError("a kernel was launched on bad input")
    monkeypatch.setattr(dispatch, "run_forward", launched)
    monkeypatch.setattr(dispatch, "run_backward", launched)


def refused(error, match, fn, *args, **kwargs):
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


@pytest.mark.usefixtures("no_launch")
class TestRefusedBeforeLaunch:
    def test_tensors(self, qkv):
        q, k, v = qkv
        refused(TypeError, "q must be a torch.Tensor", flash_attn_func, q.cpu().numpy(), k, v)
        refused(TypeError, "float16 and torch.bfloat16", flash_attn_func, q.float(), k.float(), v.float())
        refused(TypeError, "share one dtype", flash_attn_func, q, k.bfloat16(), v)
        refused(ValueError, "one device", flash_attn_func, q, k.to("meta"), v)
        refused(ValueError, r"q must be 4-D \(batch, seqlen, nheads, headdim\)", flash_attn_func, q[0], k, v)
        refused(ValueError, "same head dim", flash_attn_func, q[..., :16], k, v)
        refused(ValueError, "same shape", flash_attn_func, q, k, v[:, :8])
        refused(ValueError, "same batch size", flash_attn_func, q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
        refused(ValueError, "no heads or an empty head dim", flash_attn_func, q[..., :0], k[..., :0], v[..., :0])

    @pytest.mark.parametrize("head_dim", [264, 512])
    def test_head_dim_out_of_range(self, head_dim):
        refused(ValueError, "head dim must be at most 256", flash_attn_func,
                *make_qkv(1, 8, 8, 1, 1, head_dim, torch.float16, DEVICE))

    def test_heads_not_divisible(self):
        q, _, _ = make_qkv(1, 8, 8, 3, 3, 32, torch.float16, DEVICE)
        _, k, v = make_qkv(1, 8, 8, 2, 2, 32, torch.float16, DEVICE)
        refused(ValueError, "multiple of nheads of k/v", flash_attn_func, q, k, v)

    @pytest.mark.parametrize("kwargs, error, match", [
        (dict(dropout_p=-0.1), ValueError, "dropout_p"),
        (dict(alibi_slopes=[0.5, 0.25]), TypeError, "alibi_slopes must be a torch.Tensor"),
        (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError, "alibi_slopes must be float32"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(2,\) or \(1, 2\)"),
        (dict(alibi_slopes=torch.ones(2, device="meta")), ValueError, "alibi_slopes must be on"),
        (dict(sinks=[0.5, 0.25]), TypeError, "sinks must be a torch.Tensor"),
        (dict(sinks=torch.ones(2, dtype=torch.int32)), TypeError, "sinks must be a floating-point tensor"),
        (dict(sinks=torch.ones(1, 2)), ValueError, r"sinks must have shape \(2,\)"),
        (dict(sinks=torch.ones(2, device="meta")), ValueError, "sinks must be on"),
        # Invalid values are named as such, not as features missing.
        (dict(dropout_p=None), TypeError, "dropout_p must be a real number"),
        (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0.0, 1.0\)"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0.0, 1.0\)"),
        (dict(dropout_p=float("nan")), ValueError, "dropout_p must be finite"),
        (dict(softcap=-1.0), ValueError, "softcap must be >= 0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
        (dict(softcap="30"), TypeError, "softcap must be a real number"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be in"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale must be in"),
        (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
        (dict(softmax_scale=3e38), ValueError, "softmax_scale must be in"),
        (dict(softmax_scale=10**400), ValueError, "softmax_scale must be finite"),
        (dict(softmax_scale=True), TypeError, "softmax_scale must be a real number"),
        (dict(softmax_scale=torch.ones(2)), ValueError, "softmax_scale must be a number"),
        (dict(window_size=(-2, 0)), ValueError, r"window_size\[0\] must be >= -1"),
        (dict(window_size=5), ValueError, "window_size must be a pair"),
        (dict(window_size=(1, 2, 3)), ValueError, "window_size must be a pair"),
        (dict(window_size=(True, False)), TypeError, r"window_size\[0\] must be an integer"),
        (dict(window_size=(1.5, 0)), TypeError, r"window_size\[0\] must be an integer"),
        (dict(window_size=torch.tensor([1.0, 2.0])), ValueError, "window_size must hold two integers"),
        (dict(version="v9"), ValueError, "version must be one of"),
        (dict(kernel_options="forward=cuda"), ValueError, "forward='cuda'"),
        (dict(kernel_options="ablate=everything"), ValueError, "unknown techniques"),
        (dict(kernel_options="tiles.v2_fwd=1,2"), ValueError, "expected 4 integers"),
    ])
    def test_options(self, qkv, kwargs, error, match):
        refused(error, match, flash_attn_func, *qkv, **kwargs)

    def test_packed_shapes(self, qkv):
        q, k, v = qkv
        refused(ValueError, r"qkv must be \(batch, seqlen, 3, nheads, headdim\)", flash_attn_qkvpacked_func,
                torch.stack([q, k], dim=2))
        refused(ValueError, r"kv must be \(batch, seqlen_k, 2, nheads_k, headdim\)", flash_attn_kvpacked_func, q, k)

    @pytest.mark.parametrize("mutate, error, match", [
        (lambda cu: cu.long(), TypeError, "must be torch.int32"),
        (lambda cu: cu[None], ValueError, "must be 1-D"),
        (lambda cu: cu.flip(0), ValueError, "start at 0 and be non-decreasing"),
        (lambda cu: cu * 2, ValueError, "tokens"),  # past the tensor's rows (fewer: spare rows, taken)
        (lambda cu: [0, 5, 12], TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ])
    def test_bad_cu_seqlens(self, mutate, error, match):
        q, k, v, cu = _varlen()
        refused(error, match, flash_attn_varlen_func, q, k, v, mutate(cu), cu, 7, 7)

    def test_bad_max_seqlen(self):
        q, k, v, cu = _varlen()
        refused(ValueError, "longest sequence", flash_attn_varlen_func, q, k, v, cu, cu, 5, 7)
        refused(TypeError, "max_seqlen_q must be an integer", flash_attn_varlen_func, q, k, v, cu, cu, 7.0, 7)
        refused(ValueError, "max_seqlen_k must be >= 0", flash_attn_varlen_func, q, k, v, cu, cu, 7, -1)
        cu_k = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=DEVICE)
        refused(ValueError, "same length", flash_attn_varlen_func, q, k, v, cu, cu_k, 7, 4)
        refused(ValueError, "3-D", flash_attn_varlen_func, q[None], k[None], v[None], cu, cu, 7, 7)
        refused(ValueError, "cu_seqlens_q and cu_seqlens_k are required", flash_attn_varlen_func, q, k, v,
                None, cu, 7, 7)


def test_sequence_beyond_32_bit_row_offsets():
    # Shapes only (meta tensors): 2**20 rows x 16 heads x 128 = 2**31 elements in one sequence.
    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    q = meta(1, 2**20, 16, 128)
    refused(ValueError, "32-bit row offsets", check_sequence_span, q, q, q, 2**20, 2**20, varlen=False)
    check_sequence_span(q[:, :-1], q[:, :-1], q[:, :-1], 2**20 - 1, 2**20 - 1, varlen=False)
    # A view whose rows are spread further apart than a contiguous tensor's counts its own stride;
    # one packed tighter than contiguous counts the contiguous layout its outputs may take.
    wide = meta(1, 2**19, 3, 16, 128)[:, :, 0]
    refused(ValueError, "q: one sequence spans", check_sequence_span, wide, q[:, :1], q[:, :1], 2**19, 1,
            varlen=False)
    heads_outer = meta(1, 16, 2**20, 128).transpose(1, 2)
    refused(ValueError, "k: one sequence spans", check_sequence_span, q[:, :1], heads_outer, heads_outer, 1, 2**20,
            varlen=False)
    packed = meta(2**20, 16, 128)
    refused(ValueError, "32-bit", check_sequence_span, packed, packed, packed, 2**20, 2**20, varlen=True)


def _varlen(lengths=(5, 7)):
    total = sum(lengths)
    q = torch.randn(total, 2, 32, dtype=torch.float16, device=DEVICE)
    cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)
    return q, q.clone(), q.clone(), cu


def test_offsets_read_once_until_changed(monkeypatch):
    # A model passes one offsets tensor to every layer: its values are read on the host once,
    # and again after an in-place change.
    q, k, v, cu = _varlen()
    flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    reads = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda x, *a, **kw: reads.append(x) or real_cpu(x, *a, **kw))
    flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    assert not any(x is cu for x in reads)
    refused(ValueError, "longest sequence", flash_attn_varlen_func, q, k, v, cu, cu, 5, 7)
    cu[1] = cu[2] + 1  # no longer non-decreasing
    refused(ValueError, "non-decreasing", flash_attn_varlen_func, q, k, v, cu, cu, 7, 7)


def test_offsets_written_behind_pytorchs_back_are_read_again():
    # A buffer rewritten where PyTorch counts no version (a kernel, .data): a call whose token
    # counts disagree with what was read reads the offsets again rather than refusing them.
    q, k, v, cu = _varlen()  # lengths 5, 7
    flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    cu.data.copy_(torch.tensor([0, 4, 9], dtype=torch.int32))
    q9, k9, v9 = (x[:9] for x in (q, k, v))
    torch.testing.assert_close(flash_attn_varlen_func(q9, k9, v9, cu, cu, 5, 5),
                               flash_attn_varlen_func(q9, k9, v9, cu.clone(), cu.clone(), 5, 5))


def test_offsets_of_inference_mode_are_read_at_each_call():
    # Inference tensors count no versions: nothing is kept, every call reads them.
    with torch.inference_mode():
        q, k, v, cu = _varlen()
        first = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
        torch.testing.assert_close(flash_attn_varlen_func(q, k, v, cu, cu, 7, 7), first)
        refused(ValueError, "longest sequence", flash_attn_varlen_func, q, k, v, cu, cu, 5, 7)


def test_numbers_are_taken_as_what_they_are(qkv):
    # numpy scalars and 0-d tensors where a number goes, as flash_attn's own tests pass them.
    q, k, v = qkv
    base = flash_attn_func(q, k, v, softmax_scale=0.125, window_size=(4, 0), version="v2")
    for scale, window in ((np.float32(0.125), (np.int64(4), 0)), (torch.tensor(0.125), torch.tensor([4, 0])),
                          (np.float64(0.125), np.array([4, 0])), (0.125, [4, 0])):
        assert torch.equal(flash_attn_func(q, k, v, softmax_scale=scale, window_size=window, version="v2"), base)
    qv, kv, vv, cu = _varlen()
    ours = flash_attn_varlen_func(qv, kv, vv, cu, cu, np.int64(7), torch.tensor(7), version="v2")
    assert torch.equal(ours, flash_attn_varlen_func(qv, kv, vv, cu, cu, 7, 7, version="v2"))


def test_double_backward_is_refused_not_silently_wrong(qkv):
    # A gradient penalty: the loss reaches q by another path too, so a missing second-order
    # term would go unnoticed.  Differentiating flashtile's gradients raises.
    q, k, v = qkv
    for entry in ("eager", "custom_op"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if entry == "eager":
            out = flash_attn_func(*leaves, version="v2")
        else:
            out = ops.attention_forward(*leaves, None, None, None, None, None, None, 16, 16, 32 ** -0.5, -1, -1, 0.0, 0.0,
                                            "v2", False, "")[0]
        g, = torch.autograd.grad(out.float().sum(), leaves[0], create_graph=True)
        with pytest.raises(RuntimeError, match="differentiable once"):
            (g.float().square().sum() + leaves[0].float().sum()).backward()
    # First derivatives under create_graph are still right when nothing differentiates them again.
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    g_graph = torch.autograd.grad(flash_attn_func(*leaves, version="v2").float().sum(), leaves, create_graph=True)
    g_plain = torch.autograd.grad(flash_attn_func(*leaves, version="v2").float().sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(g_graph, g_plain))


def test_forward_mode_and_function_transforms_are_refused(qkv):
    q, k, v = qkv
    with forward_ad.dual_level():
        refused(NotImplementedError, "forward-mode AD", flash_attn_func, forward_ad.make_dual(q, torch.ones_like(q)),
                k, v)
        # Dual tensors without a tangent on q, k, v: nothing to drop.
        flash_attn_func(q, k, v, version="v2")
    refused(NotImplementedError, "torch.func transforms", torch.func.grad(lambda x: flash_attn_func(x, k, v).sum()),
            q.float().half())
    refused(NotImplementedError, "torch.func transforms", torch.vmap(lambda x: flash_attn_func(x, k, v)), q[None])
    refused(NotImplementedError, "torch.func transforms",
            lambda: torch.func.jvp(lambda x: flash_attn_func(x, k, v), (q,), (torch.ones_like(q),)))


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 40, 40, 2, 2, 32, torch.float16, DEVICE))
    slopes = torch.tensor([0.25, 0.0625], device=DEVICE)
    sinks = torch.tensor([0.5, -1.0], device=DEVICE, requires_grad=True)

    def layer(q, k, v, sinks):
        return (flash_attn_func(q, k, v, causal=True, softcap=20.0, alibi_slopes=slopes, sinks=sinks) * 2).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, sinks)
    grads = torch.autograd.grad(loss, (q, k, v, sinks))
    eager = torch.autograd.grad(layer(q, k, v, sinks), (q, k, v, sinks))
    torch.testing.assert_close(loss, layer(q, k, v, sinks))
    for a, b in zip(grads, eager):
        torch.testing.assert_close(a, b)


def test_torch_compile_fullgraph_varlen():
    # The offsets' values are read where the op runs, not where the graph is traced: no break.
    q, k, v, cu = _varlen()
    for x in (q, k, v):
        x.requires_grad_()

    def layer(q, k, v, cu):
        return flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True).float().sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, cu), layer(q, k, v, cu))
    torch.testing.assert_close(torch.autograd.grad(compiled(q, k, v, cu), (q, k, v)),
                               torch.autograd.grad(layer(q, k, v, cu), (q, k, v)))
    with pytest.raises(ValueError, match="non-decreasing"):
        compiled(q, k, v, cu.flip(0).contiguous())


def test_torch_compile_takes_float_options_that_change_between_calls():
    # A float that changes between calls becomes symbolic when the graph is compiled again: its
    # checks trace (comparisons), so softcap, softmax_scale and dropout_p keep the full graph.
    q, k, v = make_qkv(1, 40, 40, 2, 2, 32, torch.float16, DEVICE)
    for name in ("softcap", "softmax_scale", "dropout_p"):
        torch._dynamo.reset()  # (each name's graphs: one static, then one symbolic)
        compiled = torch.compile(lambda q, k, v, x: flash_attn_func(q, k, v, causal=True, **{name: x}),
                                 fullgraph=True, backend="aot_eager")
        for value in (0.1, 0.2, 0.3):
            out = compiled(q, k, v, value)
            if name != "dropout_p":  # (dropout: another draw)
                torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True, **{name: value}))


def test_torch_compile_checks_seqused_offsets_where_the_op_runs():
    # With seqused tables the offsets are read where the op runs (the traced call reads nothing
    # on the host): offsets that break the max_seqlen given or run past the rows are refused,
    # as in eager calls, never a silent wrong answer.
    from flashtile import flash_attn_interface as fa3
    q, k, v = (torch.randn(40, 2, 16, dtype=torch.float16, device=DEVICE) for _ in range(3))
    used = torch.tensor([10, 25], dtype=torch.int32, device=DEVICE)
    call = lambda q, k, v, cu, m: fa3.flash_attn_varlen_func(q, k, v, cu, cu, m, m, seqused_k=used)  # noqa: E731
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(compiled(q, k, v, cu, 25), call(q, k, v, cu, 25))
    for offsets, longest in (([0, 15, 40], 15), ([0, 20, 48], 28), ([0, 30, 20], 30)):
        for fn in (call, compiled):  # (max_seqlen too small, past the rows, decreasing)
            with pytest.raises(ValueError, match="cu_seqlens_q"):
                fn(q, k, v, torch.tensor(offsets, dtype=torch.int32, device=DEVICE), longest)


def test_eager_seqused_tables_are_not_read_again(monkeypatch):
    # Eager calls check the offsets, then make the seqused tables from them: the op takes those
    # as checked, with no read of its own (a wait on the device), in inference mode too.
    from flashtile import flash_attn_interface as fa3
    reads, cpu = [], torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda x, *a, **kw: reads.append(x.dim()) or cpu(x, *a, **kw))
    q, k, v = (torch.randn(40, 2, 16, dtype=torch.float16, device=DEVICE) for _ in range(3))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=DEVICE)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            fa3.flash_attn_varlen_func(q, k, v, cu, cu, 25, 25, seqused_k=torch.tensor([10, 25], dtype=torch.int32,
                                                                                        device=DEVICE))
    assert 2 not in reads  # (the (batch, 2) tables)


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_eager_function_and_custom_op_agree(version):
    # Eager calls skip the custom op's autograd wrapper (ops.py); both paths must give the same
    # outputs and gradients, including a loss that reaches the logsumexp only.
    q, k, v = make_qkv(1, 40, 48, 2, 1, 32, torch.float16, DEVICE)
    args = (None, None, None, None, None, None, 40, 48, 32 ** -0.5, -1, 0, 0.0, 0.0, version, False, "")
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
    # Function: the outputs must match the ones with gradients, bit for bit, with no node.
    q, k, v = make_qkv(1, 40, 48, 2, 1, 32, torch.float16, DEVICE)
    args = (None, None, None, None, None, None, 40, 48, 32 ** -0.5, -1, 0, 0.0, 0.0, "v2", False, "")
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


def test_kernel_options_come_from_the_call_or_the_environment(monkeypatch):
    # A call's kernel_options win; without any, the environment's (read once at import).
    seen = []
    forward_plan = dispatch.forward_plan
    monkeypatch.setattr(dispatch, "forward_plan", lambda p, version, target, opts: seen.append(opts) or
                        forward_plan(p, version, target, opts))
    q, k, v = make_qkv(1, 16, 16, 2, 2, 32, torch.float16, DEVICE)
    monkeypatch.setattr(options, "ENVIRONMENT", options.KernelOptions(v1_splits=2))
    flash_attn_func(q, k, v, version="v1")
    flash_attn_func(q, k, v, version="v1", kernel_options="v1_splits=1")
    flash_attn_func(q, k, v, version="v1", kernel_options={"v1_splits": 3})
    assert [o.v1_splits for o in seen] == [2, 1, 3]


@pytest.mark.skipif(ON_GPU, reason="CPU-only behaviour")
def test_cpu_without_interpreter_uses_tiled_path_and_refuses_kernels(monkeypatch):
    monkeypatch.setattr(options, "interpreting", lambda: False)
    assert dispatch.resolve_version("auto", torch.device("cpu")) == "tiled"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.resolve_version("v2", torch.device("cpu"))


def test_auto_picks_a_version_that_runs_here():
    expected = ("v3" if torch.cuda.get_device_capability()[0] == 9 else "v2") if ON_GPU else "v2"
    assert dispatch.resolve_version("auto", torch.device(DEVICE)) == expected


def test_calls_run_on_the_device_of_their_tensors(monkeypatch):
    # Triton launches on the current device: a call on another GPU's tensors makes theirs current.
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


def test_package_exports():
    assert set(flashtile.__all__) >= {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
                                      "flash_attn_kvpacked_func", "standard_attention"}


def _outputs_and_gradients(q, k, v, dout, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn_func(*leaves, **kwargs)
    return (out, *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_kept_calls_match_calls_checked_afresh(monkeypatch, version):
    # A batched call's checks are kept per kind (kept_calls.kind), its problem by shape (ops._problem):
    # the calls that find them must give what a call checked afresh gives, bit for bit, kind by kind.
    from flashtile import api, kept_calls
    q, k, v = make_qkv(1, 24, 40, 2, 1, 32, torch.float16, DEVICE)
    dout = torch.randn_like(q)
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]  # (batch, heads, seqlen) storage
    kinds = [(q, k, v, {}), (q, k, v, dict(causal=True)), (q, k, v, dict(causal=1)),
             (q, k, v, dict(window_size=(6, 0))), (q, k, v, dict(softcap=5.0, softmax_scale=0.1)),
             (*strided, dict(causal=True)), (q[:, :17], k, v, dict(causal=True)),
             (q.bfloat16(), k.bfloat16(), v.bfloat16(), {}), (q, k, v, dict(deterministic=True))]
    for x, y, z, kwargs in kinds:
        first = _outputs_and_gradients(x, y, z, dout[:, :x.shape[1]].to(x.dtype), version=version, **kwargs)
        again = _outputs_and_gradients(x, y, z, dout[:, :x.shape[1]].to(x.dtype), version=version, **kwargs)
        with monkeypatch.context() as unkept:  # checked, and its problem made, as each call comes
            unkept.setattr(api, "_KEPT_CALLS", kept_calls.KeptCalls(limit=0))
            unkept.setattr(ops, "_batched_problem", ops._batched_problem.__wrapped__)
            fresh = _outputs_and_gradients(x, y, z, dout[:, :x.shape[1]].to(x.dtype), version=version, **kwargs)
        for a, b, c in zip(first, again, fresh):
            torch.testing.assert_close(a, c, atol=0, rtol=0)
            torch.testing.assert_close(b, c, atol=0, rtol=0)
    # One kept call per kind (True and 1 apart: validation may tell such values apart).
    assert len(api._KEPT_CALLS) == len(kinds)


def test_calls_not_kept(qkv):
    # Refused calls are refused every time; options given as tensors (whose values may change)
    # and calls with tensors besides q, k, v are checked at every call.
    from flashtile import api, kept_calls
    q, k, v = qkv
    for _ in range(2):
        refused(ValueError, "softcap", flash_attn_func, q, k, v, softcap=-1.0)
    cap = torch.tensor(5.0)  # (a CPU scalar: its value read at each call)
    first = flash_attn_func(q, k, v, softcap=cap)
    cap.fill_(2.0)
    torch.testing.assert_close(flash_attn_func(q, k, v, softcap=cap), flash_attn_func(q, k, v, softcap=2.0),
                               atol=0, rtol=0)
    assert not torch.equal(first, flash_attn_func(q, k, v, softcap=cap))
    flash_attn_func(q, k, v, alibi_slopes=torch.rand(2, device=q.device))
    flash_attn_func(q, k, v, sinks=torch.zeros(2, device=q.device))
    flash_attn_func(q, k, v, dropout_p=0.1)
    flash_attn_func(q, k, v, kernel_options={"tiles": {}})
    flash_attn_func(q[..., :30], k[..., :30], v[..., :30])  # padded to a multiple of 8
    assert list(api._KEPT_CALLS) == [kept_calls.kind((q, k, v), (0.0, None, False, (-1, -1), 2.0, False, "auto", None))]


def test_kept_calls_are_bounded_least_recent_first(monkeypatch, qkv):
    from flashtile import api
    monkeypatch.setattr(api._KEPT_CALLS, "limit", 2)
    q, k, v = qkv
    for n in (5, 6, 5, 7):  # (5 used again after 6: 6 is the least recently used)
        flash_attn_func(q[:, :n], k, v)
    assert [kind[0][1] for kind in api._KEPT_CALLS] == [5, 7]


def test_batched_problems_kept_by_shape_and_scalars(qkv):
    # ops._problem keeps a problem with no tensor by the shapes and scalars it is made of: each
    # variation gives the problem made afresh, and no two variations share one.
    from flashtile.kernels.problem import Problem
    q, k, v = qkv
    base = dict(softmax_scale=0.125, window_left=-1, window_right=0, softcap=0.0, dropout_p=0.0, deterministic=False)
    variations = [{}, dict(softmax_scale=0.25), dict(window_left=4), dict(window_right=-1), dict(softcap=5.0),
                  dict(dropout_p=0.1), dict(deterministic=True), dict(q=q[:, :9]), dict(k=k[:, :9], v=v[:, :9]),
                  dict(v=v[..., :16])]
    kept = []
    for change in variations:
        args = {**base, **change}
        x, y, z = (args.pop(name, t) for name, t in (("q", q), ("k", k), ("v", v)))
        scalars = [args[name] for name in ("softmax_scale", "window_left", "window_right", "softcap", "dropout_p")]
        problem = ops._problem(x, y, z, None, None, None, None, x.shape[1], y.shape[1], *scalars,
                               args["deterministic"])
        assert problem == Problem.of(x, y, None, None, x.shape[1], y.shape[1], *scalars[:4], args["deterministic"],
                                     None, scalars[4], None, z.shape[-1])
        assert ops._problem(x, y, z, None, None, None, None, x.shape[1], y.shape[1], *scalars,
                            args["deterministic"]) is problem
        kept.append(problem)
    assert len(set(kept)) == len(variations)
