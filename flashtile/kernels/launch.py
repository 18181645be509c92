"""Launching a compiled kernel again without triton's per-call argument binding.

``kernel[grid](...)`` (JITFunction.run) spends tens of microseconds of Python before the driver
sees a launch: it specializes every argument (a tensor descriptor's type string is built from
its layout's repr, ~5 us each), hashes the result to find the compiled kernel and checks the
kernel's globals; a Gluon TensorDescriptor checks itself on construction (~7 us each).  Where the
kernels are short (causal 1k) that host path, not the GPU, is what a call costs: v3's two-pass
backward launches two kernels with twelve descriptors.

``launch`` keeps each compiled kernel under a key made of everything triton specializes on (the
constexprs and launch options; each descriptor's dtype, block and layout; each tensor's dtype
and 16-byte alignment; whether each integer is 1, a multiple of 16, 32-bit), compiles and
launches through JITFunction.run the first time it meets a key, and afterwards hands the
arguments to the compiled kernel's C launch function (``_DirectLaunch``: tensor maps kept per
address), or to triton's launcher as ``CompiledKernel.__getitem__`` does where a profiler's hook
is installed or the kernel needs scratch memory.  The key may tell apart arguments triton would
not (a second compile of the same kernel, served by triton's own cache), never the reverse.
``Descriptor`` carries what that launcher reads of a tensor descriptor; the first launch of a
key converts it to the checked TensorDescriptor.
Every kernel of every version launches through here; under the interpreter each launch goes
through ``kernel[grid]``.  ``Prepared`` goes further for a launch repeated on the same shapes:
all but its leading arguments are fixed once, so only those are classified at each call.
"""
import torch
from triton import knobs
from triton.knobs import HookChain
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.backends.nvidia import driver as nvidia_driver
from triton.runtime.driver import driver

from flashtile import options


class Descriptor:
    """A TMA descriptor's arguments: ``base`` as laid out, read and written ``block_shape`` at a
    time in the shared-memory ``layout``.  Unchecked (tma_aligned states the rules).  ``spec``
    is what triton specializes on (descriptor_spec: pass it where it is cached)."""
    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "padding", "spec")

    def __init__(self, base, block_shape, layout, spec=None):
        self.base = base
        self.shape = list(base.shape)
        self.strides = list(base.stride())
        self.block_shape = block_shape
        self.layout = layout
        self.padding = "zero"
        self.spec = spec or descriptor_spec(base.dtype, block_shape, layout)

    def checked(self) -> TensorDescriptor:
        return TensorDescriptor(self.base, self.shape, self.strides, list(self.block_shape), self.layout)


def descriptor_spec(dtype, block_shape, layout) -> str:
    # A string, as triton's own type string for it: hashed once, where a layout rehashes its fields.
    return f"{dtype}{list(block_shape)}{layout!r}"


# Arguments other than integers and tensors, by exact type.
_OTHER_CLASS = {
    Descriptor: lambda x: x.spec,
    bool: lambda x: (bool, x),
    float: lambda x: float,
    type(None): lambda x: None,
}


# Integers' classes, remembered: most launch arguments are strides and shapes seen before.
# Bounded, so that values that keep changing cannot grow it without limit.
_INT_CLASSES: dict = {}
_MAX_INT_CLASSES = 4096


def _int_class(x: int) -> tuple:
    # triton: 1 becomes a constant, multiples of 16 are marked divisible, the range picks
    # i32, i64 or u64.
    found = (x == 1, x % 16 == 0, 0 if -2**31 <= x < 2**31 else 1 if -2**63 <= x < 2**63 else 2)
    if len(_INT_CLASSES) < _MAX_INT_CLASSES:
        _INT_CLASSES[x] = found
    return found


def specialization_key(args) -> tuple:
    """What triton's specialization of the runtime ``args`` depends on, as a hashable tuple.
    Integers and tensors, most of every launch's arguments, are classified inline: a function
    call an argument would be most of the cost."""
    key = []
    append = key.append
    int_classes = _INT_CLASSES
    for x in args:
        kind = type(x)
        if kind is int:
            found = int_classes.get(x)
            append(_int_class(x) if found is None else found)
        elif kind is torch.Tensor or isinstance(x, torch.Tensor):  # a subclass too (Parameter, ...)
            append((x.dtype, x.data_ptr() % 16 == 0))
        elif kind is tuple:
            append(specialization_key(x))
        else:
            classify = _OTHER_CLASS.get(kind)
            if classify is None:
                raise TypeError(f"no launch key for a {kind.__name__} argument")
            append(classify(x))
    return tuple(key)


def _checked(args) -> list:
    return [a.checked() if isinstance(a, Descriptor) else a for a in args]


# Per kernel: {key: (compiled kernel, constexpr values in signature order)}.
_COMPILED = {}


def launch(kernel, grid, *args, **constants):
    """``kernel[grid](*args, **constants)``; ``args`` are the runtime arguments in signature
    order (Descriptor for a tensor descriptor), ``constants`` the constexprs (which follow them
    in the signature) and launch options."""
    if options.interpreting():
        return kernel[grid](*_checked(args), **constants)
    device = driver.active.get_current_device()
    (binary, constexprs), launched = _compiled(kernel, grid, device, args, constants)
    if not launched:
        _run(binary, (*grid, 1, 1), device, (*args, *constexprs))


def _compiled(kernel, grid, device, args, constants):
    """((compiled kernel, constexpr values in signature order), whether it was launched): the
    first call of a key compiles and launches it through ``kernel[grid]``."""
    key = (device, specialization_key(args), *constants.items())
    compiled = _COMPILED.setdefault(kernel, {})
    entry = compiled.get(key)
    if entry is not None:
        return entry, False
    constexprs = tuple(constants[name] for name in kernel.arg_names[len(args):])
    entry = compiled[key] = (kernel[grid](*_checked(args), **constants), constexprs)
    return entry, True


def _run(binary, grid, device, full):
    """Hand ``full`` (the runtime arguments, then the constexprs) to a compiled kernel's launcher."""
    stream = driver.active.get_current_stream(device)
    # The hooks a profiler installs are read at each launch, as triton does.
    hooks = knobs.runtime
    direct = _DIRECT.get(binary, _UNSEEN)
    if direct is _UNSEEN:
        direct = _DIRECT[binary] = _DirectLaunch.of(binary)
    if direct is not None and not (_hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook)):
        return direct(grid, stream, binary, full)
    binary.run(grid[0], grid[1], grid[2], stream, binary.function, binary.packed_metadata,
               binary.launch_metadata(grid, stream, *full), hooks.launch_enter_hook,
               hooks.launch_exit_hook, *full)


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: a function, or a chain (triton's default) holding one."""
    return hook is not None and (type(hook) is not HookChain or bool(hook.calls))


_UNSEEN = object()
# Per compiled kernel: its _DirectLaunch, or None where triton's own launcher is used.
_DIRECT = {}


class _DirectLaunch:
    """A compiled kernel's C launch function called with its tensor descriptors already encoded.
    Triton's launcher wraps that function in a Python loop over every argument that encodes each
    tensor descriptor anew (``make_tensordesc_arg``: cuTensorMapEncodeTiled), and its C code asks
    the driver for each tensor's address (cuPointerGetAttribute).  Here a descriptor's encoding is
    kept per (address, shape, strides): the same tensor map, which the launch copies; a model's
    activations come back at the same addresses from PyTorch's caching allocator step after
    step.  CUDA tensors pass as their addresses (any other object as it is, for the C code's own
    checks).  Used where triton's launcher has the shape this relies on (``of``: no scratch
    memory, which the kernels that build tensor descriptors on the device take) and no profiler
    hook is installed; else triton's launcher runs."""
    __slots__ = ("c_launch", "options", "pieces", "pointers", "meta", "encoded")

    # Tensor maps kept per kernel, at most; the oldest half goes when full.
    MAX_ENCODED = 512

    def __init__(self, c_launch, run, descriptor_positions, descriptor_meta, pointer_positions, count):
        self.c_launch = c_launch
        self.options = (run.launch_cooperative_grid, run.launch_pdl)
        # (start, stop) runs of plain arguments, each followed by the descriptor at ``stop`` (< count)
        edges = [-1, *sorted(descriptor_positions), count]
        self.pieces = tuple((a + 1, b) for a, b in zip(edges, edges[1:]))
        self.meta = dict(zip(sorted(descriptor_positions), descriptor_meta))
        self.pointers = tuple(pointer_positions)
        self.encoded = {}

    @classmethod
    def of(cls, binary):
        """The direct launch of ``binary``, or None where its launcher is not triton 3.6's CUDA
        launcher with encoded tensor descriptors and no scratch memory."""
        run = getattr(binary, "run", None)
        launch = getattr(run, "launch", None)
        if run is None or launch is None or getattr(run, "global_scratch_size", 1) or getattr(
                run, "profile_scratch_size", 1):
            return None
        signature = getattr(getattr(binary, "src", None), "signature", None)
        if signature is None:
            return None
        signature = list(signature.values())
        pointers = [i for i, ty in enumerate(signature) if isinstance(ty, str) and ty.startswith("*")]
        code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
        if code is None:  # no tensor descriptor: triton's launcher is the C function itself
            return cls(launch, run, (), (), pointers, len(signature))
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure or ())))
        c_launch, positions, meta = (cells.get(x) for x in ("launcher", "tensordesc_indices", "tensordesc_meta"))
        if c_launch is None or positions is None or not meta or None in meta or len(meta) != len(positions):
            return None
        return cls(c_launch, run, positions, meta, pointers, len(signature))

    def _encoding(self, position, d):
        key = (position, d.base.data_ptr(), *d.shape, *d.strides)
        found = self.encoded.get(key)
        if found is None:
            if len(self.encoded) >= self.MAX_ENCODED:
                for old in list(self.encoded)[:self.MAX_ENCODED // 2]:
                    self.encoded.pop(old, None)
            found = self.encoded[key] = nvidia_driver.make_tensordesc_arg(d, self.meta[position])
        return found

    def __call__(self, grid, stream, binary, full):
        if self.pointers:
            full = list(full)
            for i in self.pointers:
                x = full[i]
                if type(x) is torch.Tensor and x.is_cuda:
                    full[i] = x.data_ptr()
        args = [grid[0], grid[1], grid[2], stream, binary.function, *self.options, None, None,
                binary.packed_metadata, None, None, None]
        count = len(full)
        for start, stop in self.pieces:
            args.extend(full[start:stop])
            if stop < count:
                args.extend(self._encoding(stop, full[stop]))
        self.c_launch(*args)


class Prepared:
    """``launch(kernel, grid, *leading, *fixed, **constants)`` with everything but the leading
    arguments (the tensors, and integers that change from call to call) fixed once:
    ``prepared(*leading)`` launches it.  The fixed arguments' share of the launch key is taken
    once, so a launch classifies only the leading ones before the driver call: for launches
    repeated on the same shapes (decoding steps, kvcache.py).  ``fixed`` holds no tensor (a
    tensor's address must be read at each launch).  ``vouched``: the caller vouches that every
    call's leading arguments specialize as the first call's (the same dtypes, shapes, strides and
    options; tensors it has made aligned), so none is looked over after the first call, which
    finds the kernel under its full key (the Gluon kernels' launches kept per kind of call)."""
    __slots__ = ("kernel", "grid", "fixed", "constants", "vouched", "_grid", "_tail", "_binaries")

    def __init__(self, kernel, grid, fixed, constants, vouched=False):
        if any(isinstance(x, (torch.Tensor, Descriptor)) for x in _flat(fixed)):
            raise TypeError("a prepared launch's fixed arguments hold no tensor: pass it among the leading ones")
        self.kernel, self.grid, self.fixed, self.constants = kernel, tuple(grid), tuple(fixed), constants
        self.vouched = vouched
        self._grid = (*grid, 1, 1)
        self._tail = None  # fixed + the constexprs in signature order, once compiled
        # (device, the leading arguments' specialization_key; vouched: the device alone) -> compiled kernel
        self._binaries = {}

    def __call__(self, *leading):
        if options.interpreting():
            return launch(self.kernel, self.grid, *leading, *self.fixed, **self.constants)
        device = driver.active.get_current_device()
        key = device if self.vouched else (device, specialization_key(leading))
        binary = self._binaries.get(key)
        if binary is None:
            (binary, constexprs), launched = _compiled(self.kernel, self.grid, device, (*leading, *self.fixed),
                                                       self.constants)
            self._tail = (*self.fixed, *constexprs)  # (before the binary: another thread may take it at once)
            self._binaries[key] = binary
            if launched:
                return
        _run(binary, self._grid, device, (*leading, *self._tail))


def _flat(args):
    for x in args:
        if type(x) is tuple:
            yield from _flat(x)
        else:
            yield x
