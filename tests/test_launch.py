"""The launch path that skips triton's per-call binding once a kernel is compiled (kernels/launch.py)."""
import itertools
import types

import pytest
import torch
from attention_check import make_qkv
from conftest import DEVICE, ON_GPU, clear_kept_launches
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile import flash_attn_func, gpu, options
from flashtile.kernels import launch
from flashtile.kernels.tma import block_layout


def _descriptor(dtype=torch.bfloat16, rows=64, offset=0):
    base = torch.empty(2 * 64 * 2 * 64 + offset, dtype=dtype)[offset:].view(2, 64, 2, 64)
    return launch.Descriptor(base, *block_layout(rows, 64, dtype))


def _triton_specialization(x):
    if isinstance(x, launch.Descriptor):
        x = x.checked()
    return native_specialize_impl(BaseBackend, x, False, True, True)


def _specialization(x):
    """What triton specializes a (possibly tuple) argument on: each element's, for a tuple."""
    if isinstance(x, tuple):
        return tuple(map(_specialization, x))
    return _triton_specialization(x)


def test_specialization_key_separates_what_triton_specializes():
    storage = torch.empty(64, dtype=torch.float32)
    args = [0, 1, 2, 16, 17, 48, -16, -1, 2**31 - 16, 2**31, -2**31, -2**31 - 16, 2**40, 2**63, 2**63 + 16, True, False, 0.5, 1.0,
            None, storage, storage[1:], storage[4:], storage.to(torch.float16), storage.to(torch.float16)[8:],
            _descriptor(), _descriptor(rows=128), _descriptor(torch.float16), torch.nn.Parameter(storage),
            (1, 16), (17, 16), (0.5,), (storage, 2**40)]
    for a, b in itertools.combinations(args, 2):
        if _specialization(a) != _specialization(b):
            assert launch.specialization_key([a]) != launch.specialization_key([b]), (a, b)
    with pytest.raises(TypeError, match="no launch key"):
        launch.specialization_key(["a string"])


def test_descriptor_checks_itself_when_converted():
    assert isinstance(_descriptor().checked(), TensorDescriptor)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        _descriptor(offset=1).checked()


class _FakeKernel:
    """Stands for a JIT function: ``kernel[grid](...)`` records a compile and returns a binary."""
    arg_names = ["desc", "x", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.compiles = []

    def __getitem__(self, grid):
        def compile_and_launch(*args, **constants):
            self.compiles.append((grid, args, constants))
            return _FakeBinary()
        return compile_and_launch


class _FakeBinary:
    """Stands for a compiled kernel: records what each launch hands its launcher, in ``launches``
    (a list of its own, or one shared by several binaries, each launch then under ``label``)."""
    function, packed_metadata = "function", "packed metadata"

    def __init__(self, label=None, launches=None):
        self.label, self.launches = label, [] if launches is None else launches

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.launches.append(args if self.label is None else (self.label, args))


@pytest.fixture
def fake_gpu(monkeypatch):
    """Launches leave the interpreter's path for the compiled one, on device 0 and stream 7."""
    monkeypatch.setattr(options, "interpreting", lambda: False)
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 7)
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=active))


def test_launch_compiles_once_per_class_of_arguments(fake_gpu):
    kernel, x, desc = _FakeKernel(), torch.empty(8), _descriptor()
    launch.launch(kernel, (3,), desc, x, 32, 0.5, BLOCK=64, FLAG=True, num_warps=4)
    (grid, args, constants), = kernel.compiles
    assert grid == (3,) and isinstance(args[0], TensorDescriptor) and args[1:] == (x, 32, 0.5)
    assert constants == dict(BLOCK=64, FLAG=True, num_warps=4)

    # Same classes (another multiple of 16): the compiled binary runs, constexprs appended in order.
    launch.launch(kernel, (5, 2), desc, x, 64, 0.25, BLOCK=64, FLAG=True, num_warps=4)
    assert len(kernel.compiles) == 1
    binary = launch._COMPILED[kernel][next(iter(launch._COMPILED[kernel]))][0]
    (launched,) = binary.launches
    assert launched[:7] == (5, 2, 1, 7, "function", "packed metadata", None)
    assert launched[9:] == (desc, x, 64, 0.25, 64, True)

    # An integer no longer a multiple of 16, another constexpr, another option: each compiles again.
    launch.launch(kernel, (5,), desc, x, 65, 0.25, BLOCK=64, FLAG=True, num_warps=4)
    launch.launch(kernel, (5,), desc, x, 64, 0.25, BLOCK=128, FLAG=True, num_warps=4)
    launch.launch(kernel, (5,), desc, x, 64, 0.25, BLOCK=64, FLAG=True, num_warps=8)
    assert len(kernel.compiles) == 4


def test_prepared_launch_keys_on_its_leading_arguments(fake_gpu):
    kernel, x = _FakeKernel(), torch.empty(8)
    kernel.arg_names = ["x", "n", "stride", "scale", "BLOCK"]
    prepared = launch.Prepared(kernel, (4,), (16, 0.5), dict(BLOCK=64))
    prepared(x, 32)  # compiles (and launches) through the kernel
    (grid, args, constants), = kernel.compiles
    assert grid == (4,) and args == (x, 32, 16, 0.5) and constants == dict(BLOCK=64)
    prepared(x, 48)  # the same classes: the compiled binary, the fixed arguments and constexprs after
    binary = next(iter(launch._COMPILED[kernel].values()))[0]
    assert binary.launches[-1][:7] == (4, 1, 1, 7, "function", "packed metadata", None)
    assert binary.launches[-1][9:] == (x, 48, 16, 0.5, 64)
    launch.launch(kernel, (4,), x, 64, 16, 0.5, BLOCK=64)  # one compiled kernel for both paths
    assert len(kernel.compiles) == 1 and len(binary.launches) == 2
    prepared(x, 33)  # not a multiple of 16
    prepared(x[1:], 32)  # not 16-byte aligned
    prepared(x.half(), 32)  # another dtype
    assert len(kernel.compiles) == 4
    for fixed in ((x,), (1, (2, x))):
        with pytest.raises(TypeError, match="no tensor"):
            launch.Prepared(kernel, (1,), fixed, {})


def test_vouched_launch_finds_its_kernel_once(fake_gpu):
    kernel, x, desc = _FakeKernel(), torch.empty(8), _descriptor()
    launch.launch(kernel, (3,), desc, x, 32, 0.5, BLOCK=64, FLAG=True)  # compiled by an earlier launch
    fixed = launch.Prepared(kernel, (3,), (), dict(BLOCK=64, FLAG=True), vouched=True)
    fixed(desc, x, 48, 0.25)  # found under its full key: no compile
    assert len(kernel.compiles) == 1
    binary = next(iter(launch._COMPILED[kernel].values()))[0]
    assert binary.launches[-1][:7] == (3, 1, 1, 7, "function", "packed metadata", None)
    assert binary.launches[-1][9:] == (desc, x, 48, 0.25, 64, True)
    y = x[1:]
    fixed(desc, y, 64, 0.25)  # after that nothing is looked over: the caller vouches for the classes
    assert len(kernel.compiles) == 1 and binary.launches[-1][9:] == (desc, y, 64, 0.25, 64, True)
    other = launch.Prepared(kernel, (3,), (), dict(BLOCK=128, FLAG=True), vouched=True)
    other(desc, x, 48, 0.25)  # another kind compiles (and launches) through the kernel
    assert len(kernel.compiles) == 2 and len(binary.launches) == 2 and len(launch._COMPILED[kernel]) == 2


class _CudaLauncher:
    """Stands for triton 3.6's CUDA launcher: ``launch`` its C function as triton wraps it."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, launch_function):
        self.launch, self.calls = launch_function, 0

    def __call__(self, *args):
        self.calls += 1


def test_direct_launch_passes_the_c_launcher_what_tritons_wrapper_passes(monkeypatch, fake_gpu):
    # triton's CUDA launcher wraps its C function in a loop that encodes each tensor descriptor
    # (make_tensordesc_arg); the direct launch hands the C function the same arguments, the
    # descriptors' encodings kept per address, shape and strides (CUDA tensors as their
    # addresses; these CPU ones as they are, for the C code to refuse).
    from triton.backends.nvidia import driver as nvidia_driver
    encodings = []

    def encode(arg, meta):
        encodings.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), meta), *arg.shape, *arg.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", encode)
    received = []

    def address(x):  # a pointer argument's tensor as the C code reads it
        if isinstance(x, tuple):
            return tuple(map(address, x))
        return x.data_ptr() if isinstance(x, torch.Tensor) else x

    def c_launch(*args):
        received.append(address(args))

    signature = {"a_desc": "tensordesc<bf16[64, 64]>", "x": "*fp32", "n": "i32", "b_desc": "tensordesc<bf16[64, 64]>",
                 "pair": "[*fp32,i32]", "scale": "fp32", "BLOCK": "constexpr"}
    meta = [dict(block=1), dict(block=2)]
    binary = _FakeBinary()
    binary.run = _CudaLauncher(nvidia_driver.wrap_handle_tensordesc(c_launch, signature, meta))
    binary.src = types.SimpleNamespace(signature=signature)
    x, y = torch.empty(8), torch.empty(8)
    a, b = _descriptor(), _descriptor(rows=128)
    full = (a, x, 32, b, (y, 3), 0.5, 64)
    binary.run.launch(2, 1, 1, 7, "function", False, True, None, None, "packed metadata", None, None, None, *full)
    launch._run(binary, (2, 1, 1), 0, full)
    layout = (2, 64, 2, 64, 8192, 128, 64, 1)
    assert received[0][13:] == (("map", a.base.data_ptr(), meta[0]), *layout, x.data_ptr(), 32,
                                ("map", b.base.data_ptr(), meta[1]), *layout, (y.data_ptr(), 3), 0.5, 64)
    assert received[1] == received[0] and encodings == [a.base.data_ptr(), b.base.data_ptr()] * 2
    launch._run(binary, (2, 1, 1), 0, full)  # the same tensors: their encodings kept
    c = launch.Descriptor(torch.empty_like(a.base), a.block_shape, a.layout)
    launch._run(binary, (2, 1, 1), 0, (c, *full[1:]))  # another address: encoded anew
    assert received[2] == received[0] and encodings[4:] == [c.base.data_ptr()]
    assert received[3][13] == ("map", c.base.data_ptr(), meta[0]) and received[3][14:] == received[0][14:]
    assert binary.run.calls == 0
    # A profiler's hook installed (in triton's chain, or in its place): triton's launcher runs.
    chain = launch.knobs.runtime.launch_exit_hook
    assert not launch._hooked(chain) and not launch._hooked(None)
    monkeypatch.setattr(chain, "calls", [lambda metadata: None])
    launch._run(binary, (2, 1, 1), 0, full)
    monkeypatch.setattr(launch.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launch._run(binary, (2, 1, 1), 0, full)
    assert binary.run.calls == 2 and len(received) == 4


def _described(x, inputs):
    """What a launch argument is, comparable across calls: an input by name, another tensor by
    its layout, a descriptor by its tensor and block."""
    if isinstance(x, torch.Tensor):
        return next((name for name, t in inputs.items() if t is x),
                    ("tensor", tuple(x.shape), x.stride(), x.dtype, x.data_ptr() % 16))
    if isinstance(x, launch.Descriptor):
        return ("descriptor", _described(x.base, inputs), tuple(x.block_shape), x.spec)
    if isinstance(x, tuple):
        return tuple(_described(y, inputs) for y in x)
    return (type(x).__name__, x)


@pytest.mark.parametrize("head_dim, causal, window, heads_k, options_text", [
    (64, True, (-1, -1), 2, None), (128, False, (-1, -1), 4, None), (256, True, (-1, -1), 2, None),
    (128, False, (48, 16), 2, "backward=gluon-reduce"), (64, True, (-1, -1), 4, "backward=gluon-reduce")])
def test_kept_gluon_launches_pass_what_a_fresh_build_passes(monkeypatch, fake_gpu, fresh_launches, head_dim, causal,
                                                            window, heads_k, options_text):
    # The Gluon forward and backward keep their launches per kind of call: a call through the
    # kept ones passes every kernel what launches built afresh for it pass (the host side on CPU
    # tensors as on a 132-SM Hopper GPU, the kernels not run).
    from flashtile import dispatch
    from flashtile.kernels.gluon import backward as gluon_backward
    from flashtile.kernels.gluon import forward as gluon_forward
    launches = []
    monkeypatch.setattr(launch, "_compiled", lambda kernel, grid, device, args, constants: (
        (_FakeBinary((kernel.__name__, sorted(constants.items())), launches), ()), False))
    counter = torch.zeros(1, dtype=torch.int64)
    monkeypatch.setattr(gpu, "sm_count", lambda index: 132)
    for module in (gluon_forward, gluon_backward):
        monkeypatch.setattr(module, "tile_counter", lambda device: (counter, 1 << 32))
        monkeypatch.setattr(module, "no_counter", lambda device: (counter, 1 << 32))
    monkeypatch.setattr(dispatch, "target_of", lambda p, *tensors: dispatch.HOPPER)
    monkeypatch.setattr(dispatch, "resolve_version", lambda version, device: "v3")
    contiguous = [x.requires_grad_() for x in make_qkv(2, 200, 333, 4, heads_k, head_dim, torch.bfloat16, "cpu")]
    # The same problem in (batch, heads, seqlen, headdim) storage: another kind of call.
    heads_major = [x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in contiguous]
    dout = torch.randn(2, 4, 200, head_dim, dtype=torch.bfloat16).transpose(1, 2)

    def step(q, k, v):
        launches.clear()
        out = flash_attn_func(q, k, v, causal=causal, window_size=window, kernel_options=options_text)
        torch.autograd.grad(out, (q, k, v), dout)
        inputs = dict(q=q, k=k, v=v, dout=dout)
        # (the launcher's arguments: the grid, stream, function, metadata and hooks, then the kernel's)
        return [(name, args[:3], constants, _described(args[9:], inputs)) for (name, constants), args in launches]

    step(*contiguous)
    kept = step(*heads_major)  # built for its own kind, not the first call's launches
    assert kept == step(*heads_major)
    clear_kept_launches()
    fresh = step(*heads_major)
    assert [name for name, *_ in kept] == (["_fwd_kernel", "_dq_kernel", "_dkdv_kernel"] if options_text is None
                                           else ["_fwd_kernel", "_delta_kernel", "_dkdv_kernel"])
    assert kept == fresh


def test_launch_under_the_interpreter_goes_through_the_kernel(monkeypatch):
    monkeypatch.setattr(options, "interpreting", lambda: True)
    kernel = _FakeKernel()
    launch.launch(kernel, (1,), _descriptor(), 1, BLOCK=64, FLAG=False)
    launch.launch(kernel, (1,), _descriptor(), 1, BLOCK=64, FLAG=False)
    assert len(kernel.compiles) == 2 and kernel not in launch._COMPILED


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernels run on the GPU only")
@pytest.mark.parametrize("causal", [False, True])
def test_cached_launches_match_the_compiling_launch(monkeypatch, fresh_launches, causal):
    # The first call of each kernel goes through JITFunction.run, the second through the
    # compiled binary with unchecked descriptors: bitwise the same (both backwards here are
    # the two deterministic passes).
    monkeypatch.setattr(launch, "_COMPILED", {})  # (fresh_launches: the kept launches look their kernels up again)
    q, k, v = (x.requires_grad_() for x in make_qkv(2, 300, 300, 4, 2, 128, torch.bfloat16, DEVICE))
    dout = torch.randn_like(q)
    results = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, causal=causal, deterministic=True, version="v3")
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    assert len(launch._COMPILED) == 3  # the forward, the dQ pass, the dK/dV pass
    for first, second in zip(*results):
        assert torch.equal(first, second)


HOOK_SOURCE = """
from triton.runtime.jit import JITFunction


def _cap(x):
    return {body}


cap = JITFunction(_cap)  # (compiled, as kernels on a GPU take it, even under the interpreter)
"""


def test_compiled_kernels_keyed_by_the_score_hooks_code(tmp_path, monkeypatch):
    """A kernel compiled with a score hook must not be served from triton's cache for a hook of
    the same name whose code has changed (a new version, or an edit): triton keys a constexpr by
    its ``cache_key`` where it has one, else by its string, which names the hook's functions but
    not their code (triton.compiler.ASTSource.hash)."""
    import importlib
    import sys

    from flashtile.kernels import score

    def triton_key(constexpr):
        return constexpr.cache_key if hasattr(constexpr, "cache_key") else str(constexpr)

    module = tmp_path / "edited_hook.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = []
    for body in ("x * 0.5", "x * 0.25"):
        module.write_text(HOOK_SOURCE.format(body=body))
        sys.modules.pop("edited_hook", None)
        importlib.invalidate_caches()
        hook = score.ScoreMod("cap", importlib.import_module("edited_hook").cap)
        keys.append((triton_key(hook), str(hook)))
    sys.modules.pop("edited_hook", None)
    assert keys[0][0] != keys[1][0] and keys[0][1] != keys[1][1]
    assert triton_key(score.SOFTCAP) != triton_key(score.SOFTCAP_ALIBI)
