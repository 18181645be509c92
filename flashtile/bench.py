"""Speed and memory of flashtile against the attention kernels people already use.

Every provider gets the same (batch, seqlen, heads, headdim) tensors; PyTorch's SDPA backends
see them as (batch, heads, seqlen, headdim) views of that storage.  A packed case (``varlen``)
holds the batch's tokens as documents of random lengths, each attending within itself:
flashtile through its varlen call, FlexAttention through a document mask, SDPA's backends
through a nested (jagged) tensor, standard attention document by document.  Times are medians of
CUDA-event timings with warm-up and an L2 flush between repetitions
(``triton.testing.do_bench``), on random (never zero) inputs.  FLOPs follow the
FlashAttention papers: forward 4*b*h*sq*sk*d, half when causal; backward 2.5x forward.
"""
import datetime
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

import torch
import triton

from flashtile import api, dispatch, fp8, options
from flashtile.reference import standard_attention

MODES = ("fwd", "bwd", "fwdbwd")
# Input types: bf16 and fp16, and float8 (e4m3, e5m2) with descales per (sequence, KV head), as
# FlashAttention-3's interface takes them (forward only, bf16 output).
DTYPES = ("bf16", "fp16", "e4m3", "e5m2")
FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


@dataclass
class Case:
    b: int
    h: int
    h_k: int
    sq: int
    sk: int
    d: int
    causal: bool
    mode: str
    dtype: str = "bf16"
    softcap: float = 0.0
    alibi: bool = False   # ALiBi slopes 2^(-8 i / h), as BLOOM's
    sinks: bool = False   # one learnable logit per head (gpt-oss)
    varlen: bool = False  # b documents of random lengths (mean sq) packed along the tokens
    dropout: float = 0.0  # dropout_p of the timed calls
    dv: int = 0           # V's (and the output's) head dim where it differs from d (0: d)

    @property
    def head_dim_v(self) -> int:
        return self.dv or self.d

    def lengths(self) -> list:
        """The documents' lengths of a packed case: b draws from [1, 2 sq), the same every run."""
        generator = torch.Generator().manual_seed(1_000_003 * self.b + self.sq)
        return (1 + torch.randint(0, 2 * self.sq - 1, (self.b,), generator=generator)).tolist()

    @property
    def torch_dtype(self):
        """The type inputs are drawn in (float8 ones are drawn in bf16, then quantized)."""
        return {"fp16": torch.float16}.get(self.dtype, torch.bfloat16)

    @property
    def float8(self):
        """The float8 type of the inputs, or None."""
        return FLOAT8.get(self.dtype)

    def flops(self) -> float:
        pairs = sum(n * n for n in self.lengths()) if self.varlen else self.b * self.sq * self.sk
        # 2 * d for S = Q K^T, 2 * dv for P V (4 * d with one head dim)
        fwd = 2.0 * self.h * pairs * (self.d + self.head_dim_v) / (2 if self.causal else 1)
        return fwd * FLOP_FACTOR[self.mode]


def paper_grid(head_dims=(64, 128, 256), seqlens=(512, 1024, 2048, 4096, 8192, 16384),
               causals=(False, True), modes=("fwd", "bwd"), dtype="bf16", tokens=16384, hidden=2048, softcap=0.0,
               alibi=False, sinks=False, varlen=False, dropout=0.0, head_dim_v=0):
    """The FlashAttention papers' sweep: batch x seqlen = 16k tokens, hidden 2048; ``dtype`` one
    of DTYPES or several (each cell in each); ``varlen``: the tokens packed as documents of mean
    length seqlen (Case.lengths); ``head_dim_v``: V's own head dim (0: each cell's d)."""
    dtypes = [dtype] if isinstance(dtype, str) else list(dtype)
    return [Case(max(1, tokens // s), hidden // d, hidden // d, s, s, d, c, m, t, softcap, alibi, sinks, varlen,
                 dropout, head_dim_v if head_dim_v != d else 0)
            for t in dtypes for d in head_dims for c in causals for m in modes for s in seqlens]


# ---- providers: each maps (q, k, v, causal, score features) in (b, s, h, d) to the output ----
# Score features are keywords of flash_attn_func (softcap, alibi_slopes, sinks, dropout_p), passed only
# when set; SDPA's providers take dropout_p too.

def _flashtile(version):
    def run(q, k, v, causal, kernel_options=None, **features):
        return api.flash_attn_func(q, k, v, causal=causal, version=version, kernel_options=kernel_options,
                                   **features)
    return run


def plain_only(provider, features):
    """Refuse score features (softcap, ALiBi, sinks, dropout) that ``provider`` does not take."""
    if features:
        raise NotImplementedError(f"{provider} takes no {', '.join(sorted(features))}")


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal, kernel_options=None, dropout_p=0.0, **features):
        plain_only(backend_name, features)
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, is_causal=causal,
                enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    return run


def _standard(q, k, v, causal, kernel_options=None, **features):
    plain_only("standard", {f: x for f, x in features.items() if f == "dropout_p"})  # (it takes a mask)
    return standard_attention(q, k, v, causal=causal, **features)


_FLEX_CACHE = {}


def _flex_compiled():
    """torch.compile(flex_attention), made once."""
    from torch.nn.attention.flex_attention import flex_attention
    if "fn" not in _FLEX_CACHE:
        # A grid compiles once per shape and grad mode: allow that many recompiles, and fail
        # rather than fall back silently to the unfused eager path when the limit is reached.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 512)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        # mode "bwd" runs backward repeatedly on one graph (retain_graph), which donated buffers forbid.
        torch._functorch.config.donated_buffer = False
        _FLEX_CACHE["fn"] = torch.compile(flex_attention)
    return _FLEX_CACHE["fn"]


def _flex(q, k, v, causal, kernel_options=None, **features):
    from torch.nn.attention.flex_attention import create_block_mask
    plain_only("flex", features)
    flex = _flex_compiled()
    mask = None
    if causal:
        key = (q.shape[1], k.shape[1])
        if key not in _FLEX_CACHE:
            off = k.shape[1] - q.shape[1]
            _FLEX_CACHE[key] = create_block_mask(lambda b, h, i, j: j <= i + off, None, None,
                                                 q.shape[1], k.shape[1], device=q.device)
        mask = _FLEX_CACHE[key]
    out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
               enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


PROVIDERS = {
    "flashtile-v1": _flashtile("v1"), "flashtile-v2": _flashtile("v2"), "flashtile-v3": _flashtile("v3"),
    "standard": _standard, "sdpa-flash": _sdpa("FLASH_ATTENTION"), "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"), "flex": _flex,
}


# ---- packed providers: (q, k, v) (total, h, d), offsets (documents + 1,) int32 on q's device, and the
# same lengths as a tuple (read on the host without a device-to-host copy in the timed calls) ----

def _flashtile_packed(version):
    def run(q, k, v, offsets, lengths, causal, kernel_options=None, **features):
        longest = max(lengths)
        return api.flash_attn_varlen_func(q, k, v, offsets, offsets, longest, longest, causal=causal, version=version,
                                          kernel_options=kernel_options, **features)
    return run


def _sdpa_packed(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, offsets, lengths, causal, kernel_options=None, dropout_p=0.0, **features):
        plain_only(backend_name, features)
        nested = [torch.nested.nested_tensor_from_jagged(x, offsets.long(), max_seqlen=max(lengths)).transpose(1, 2)
                  for x in (q, k, v)]
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(*nested, dropout_p=dropout_p, is_causal=causal)
        return out.transpose(1, 2).values()
    return run


def _standard_packed(q, k, v, offsets, lengths, causal, kernel_options=None, **features):
    return torch.cat([standard_attention(*(x[None] for x in one), causal=causal, **features)[0]
                      for one in zip(*(x.split(lengths) for x in (q, k, v)))])


def _flex_packed(q, k, v, offsets, lengths, causal, kernel_options=None, **features):
    from torch.nn.attention.flex_attention import create_block_mask
    plain_only("flex", features)
    flex = _flex_compiled()
    key = ("documents", tuple(lengths), causal)
    if key not in _FLEX_CACHE:
        total = q.shape[0]
        document = torch.searchsorted(offsets[1:].long(), torch.arange(total, device=q.device), right=True)

        def same_document(b, h, i, j):
            inside = document[i] == document[j]
            return inside & (j <= i) if causal else inside
        _FLEX_CACHE[key] = create_block_mask(same_document, None, None, total, total, device=q.device)
    out = flex(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), block_mask=_FLEX_CACHE[key],
               enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[0]


PACKED_PROVIDERS = {
    "flashtile-v1": _flashtile_packed("v1"), "flashtile-v2": _flashtile_packed("v2"),
    "flashtile-v3": _flashtile_packed("v3"), "standard": _standard_packed,
    "sdpa-flash": _sdpa_packed("FLASH_ATTENTION"), "sdpa-cudnn": _sdpa_packed("CUDNN_ATTENTION"),
    "sdpa-efficient": _sdpa_packed("EFFICIENT_ATTENTION"), "flex": _flex_packed,
}

DEFAULT_PROVIDERS = tuple(p for p in PROVIDERS if p != "flex")


def available_providers(device=None):
    """Providers that can run on this machine, with the reason for each that cannot."""
    device = device or default_device()
    ok, why = [], {}
    for name in PROVIDERS:
        if name.startswith("flashtile-"):
            reason = dispatch.why_not(name.split("-")[1], device)
        elif device.type != "cuda" and name != "standard":
            reason = "needs a CUDA GPU"
        else:
            reason = None
        if reason is None:
            ok.append(name)
        else:
            why[name] = reason
    return ok, why


# ---- measurement ----

def environment():
    try:
        commit = options.commit_override() or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = ""
    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, triton=triton.__version__, commit=commit or "unknown",
                date=datetime.date.today().isoformat())


def default_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cpu_median_ms(step, reps=3):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(provider: str, case: Case, device=None, cuda_graph=False, kernel_options=None):
    """(median ms, peak extra bytes) of one provider on one case.

    On a CPU (the Triton interpreter) the times only exercise the pipeline, and there is no
    allocator peak to read: peak_mem_bytes is None.  ``cuda_graph`` times replays of a CUDA
    graph of the calls (forwards only): the GPU's time without the Python launch path, L2 warm.
    ``kernel_options``: developer switches for the flashtile providers (options.KernelOptions).
    """
    return _measure(provider, case, device, cuda_graph, kernel_options)


def score_features(case, device):
    """The flash_attn_func keywords of ``case``'s score features, only those that are set."""
    features = {}
    if case.softcap:
        features["softcap"] = case.softcap
    if case.alibi:
        features["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, case.h + 1, device=device) / case.h)
    if case.sinks:
        features["sinks"] = torch.randn(case.h, device=device)
    if case.dropout:
        features["dropout_p"] = case.dropout
    return features


def make_inputs(provider, case, device, kernel_options=None, features=None):
    """(q, k, v, fn): fresh inputs of ``case`` and ``fn(q, k, v, causal)``, the provider's call
    on them (packed cases: (total, heads, head dim) tensors, the documents' offsets bound in)."""
    features = score_features(case, device) if features is None else features
    if case.varlen:
        lengths = case.lengths()
        offsets = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        q = torch.randn(sum(lengths), case.h, case.d, dtype=case.torch_dtype, device=device)
        k = torch.randn(sum(lengths), case.h_k, case.d, dtype=case.torch_dtype, device=device)
        v = torch.randn(sum(lengths), case.h_k, case.head_dim_v, dtype=case.torch_dtype, device=device)
        packed_fn = PACKED_PROVIDERS[provider]

        def fn(q, k, v, causal):
            return packed_fn(q, k, v, offsets, lengths, causal, kernel_options=kernel_options, **features)
        return q, k, v, fn
    provider_fn = PROVIDERS[provider]

    def fn(q, k, v, causal):
        return provider_fn(q, k, v, causal, kernel_options=kernel_options, **features)
    q = torch.randn(case.b, case.sq, case.h, case.d, dtype=case.torch_dtype, device=device)
    k = torch.randn(case.b, case.sk, case.h_k, case.d, dtype=case.torch_dtype, device=device)
    return q, k, torch.randn(case.b, case.sk, case.h_k, case.head_dim_v, dtype=case.torch_dtype, device=device), fn


def make_step(provider, case, device, kernel_options=None):
    """One call of ``provider`` on fresh inputs of ``case``: the forward without gradients, the
    backward alone (autograd.grad of one forward's output), or both."""
    features = score_features(case, device)
    if case.float8 is not None:
        if case.dv:
            raise NotImplementedError(f"{case.dtype} inputs: one head dim for Q, K and V")
        return _float8_step(provider, case, device, kernel_options, features)
    q, k, v, fn = make_inputs(provider, case, device, kernel_options, features)
    grad = case.mode != "fwd"
    for x in (q, k, v):
        x.requires_grad_(grad)
    if "sinks" in features:  # learnable: their gradient is part of the backward
        features["sinks"].requires_grad_(grad)
    inputs = (q, k, v, *(x for x in features.values() if isinstance(x, torch.Tensor) and x.requires_grad))
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=device)  # the output's shape
    if case.mode == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v, case.causal)
    elif case.mode == "bwd":
        out = fn(q, k, v, case.causal)

        def step():
            torch.autograd.grad(out, inputs, dout, retain_graph=True)
    else:
        def step():
            torch.autograd.grad(fn(q, k, v, case.causal), inputs, dout)
    return step


def _float8_step(provider, case, device, kernel_options, features):
    """One forward of ``provider`` on float8 inputs quantized from random bf16 ones, descales per
    (sequence, KV head): flashtile's versions with an FP8 path take them as FlashAttention-3's
    interface does; the other providers take no float8 inputs.  Backward modes: flashtile-v3's
    FP8 backward (_float8_backward_step)."""
    if case.mode != "fwd":
        return _float8_backward_step(provider, case, device, kernel_options, features)
    if case.varlen:
        raise NotImplementedError(f"{case.dtype} inputs: batched cases only")
    if case.dropout:
        raise NotImplementedError(f"{case.dtype} inputs take no dropout")
    if not provider.startswith("flashtile-"):
        raise NotImplementedError(f"{provider} takes no float8 inputs")
    version = provider.split("-")[1]
    q = torch.randn(case.b, case.sq, case.h, case.d, dtype=case.torch_dtype, device=device)
    k, v = (torch.randn(case.b, case.sk, case.h_k, case.d, dtype=case.torch_dtype, device=device) for _ in range(2))
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x, case.h_k, case.float8) for x in (q, k, v))

    def step():
        with torch.no_grad():
            api._attention(q8, k8, v8, None, None, None, None, 0.0, None, case.causal, (-1, -1),
                           features.get("softcap", 0.0), features.get("alibi_slopes"), False, False,
                           features.get("sinks"), version, kernel_options, fp8_descales=(qd, kd, vd))
    return step


def _float8_backward_step(provider, case, device, kernel_options, features):
    """The backward (mode "bwd") or forward and backward ("fwdbwd") of fp8_attn_func with its
    FP8 backward, from bf16 inputs, descales per (sequence, KV head) and no rotation as the float8
    forward cells: every matmul in float8 (one set of kernels, measured as flashtile-v3)."""
    if provider != "flashtile-v3":
        raise NotImplementedError(f"{case.dtype} backward: fp8_attn_func(fp8_backward=True), measured as flashtile-v3")
    if case.varlen or set(features) - {"softcap", "alibi_slopes", "sinks"}:
        raise NotImplementedError(f"{case.dtype} backward: batched cases, softcap, ALiBi and sinks the score features")
    q = torch.randn(case.b, case.sq, case.h, case.d, dtype=case.torch_dtype, device=device, requires_grad=True)
    k, v = (torch.randn(case.b, case.sk, case.h_k, case.d, dtype=case.torch_dtype, device=device, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)

    def forward():
        return fp8.fp8_attn_func(q, k, v, causal=case.causal, softcap=features.get("softcap", 0.0),
                                 dtype=case.float8, incoherent=False, scaling="head", fp8_backward=True,
                                 alibi_slopes=features.get("alibi_slopes"), sinks=features.get("sinks"),
                                 kernel_options=kernel_options)
    if case.mode == "bwd":
        out = forward()

        def step():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    else:
        def step():
            torch.autograd.grad(forward(), (q, k, v), dout)
    return step


# Calls before the timed ones, in ms of GPU work: a cell timed right after its kernel compiled
# (the GPU idle for the seconds a Gluon compile takes) runs slow at first.
WARMUP_MS = 250


def _measure(provider, case, device, cuda_graph, kernel_options):
    if cuda_graph and case.mode != "fwd":
        raise ValueError("CUDA-graph timing covers forwards only")
    device = torch.device(device) if device else default_device()
    step = make_step(provider, case, device, kernel_options)
    step()  # compile / autotune outside the timing and the memory peak
    if device.type != "cuda":
        return _cpu_median_ms(step), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    if cuda_graph:
        ms = triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median")
    else:
        ms = triton.testing.do_bench(step, warmup=WARMUP_MS, rep=100, return_mode="median")
    return ms, peak


def host_cost(provider: str, case: Case, calls=300, device=None, kernel_options=None, profiler=None):
    """(host ms, wall ms) per call: ``calls`` calls enqueued back to back, timed when the last is
    enqueued (the CPU's time: Python and launch) and when the GPU has finished.  Host >= wall
    means the GPU waited on the CPU: an event-timed measurement of that case times the launch
    path, not the kernels.  ``profiler`` (a cProfile.Profile) runs over the timed calls only
    (its own overhead inflates the host time)."""
    device = torch.device(device) if device else default_device()
    step = make_step(provider, case, device, kernel_options)
    for _ in range(min(calls, 20)):  # compile, warm the allocator and the clocks
        step()
    return enqueue_time(step, calls, device, profiler)


def enqueue_time(step, calls, device=None, profiler=None):
    """(host ms, wall ms) per call of ``step`` over ``calls`` calls enqueued back to back from an
    idle device (host_cost's measure, on any no-argument call)."""
    device = torch.device(device) if device else default_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    enqueued = time.perf_counter()
    if profiler:
        profiler.disable()
    sync()
    done = time.perf_counter()
    return 1e3 * (enqueued - start) / calls, 1e3 * (done - start) / calls


def ceilings(n=8192, copy_bytes=2**30):
    """The two roofline ceilings of this GPU, measured: bf16 matmul n^3 in TFLOP/s and
    device-to-device copy in TB/s (bytes read + written)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms_mm = triton.testing.do_bench(lambda: a @ a, warmup=25, rep=200, return_mode="median")
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return dict(matmul_tflops=2 * n**3 / ms_mm / 1e9, copy_tbps=2 * copy_bytes / ms_copy / 1e9)


def run(cases, providers, repeats=1, progress=True, on_error=print, cuda_graph=False, kernel_options=None):
    """Measure every (case, provider); a failure or OOM is reported and the run goes on.

    With ``repeats`` > 1 the whole grid is measured that many times, one pass after the other,
    so that a drift of the GPU (clocks, temperature) touches every provider alike; a record
    keeps the median and every pass's time (``ms_runs``).  ``cuda_graph`` (see measure) marks
    each record with ``timing="cuda-graph"``.
    """
    env = environment()
    times, peaks, failed = {}, {}, set()
    cells = [(c, p) for c in cases for p in providers]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(cells) * repeats, desc="bench", unit="cell")
    for _ in range(repeats):
        for i, (case, provider) in enumerate(cells):
            try:
                if i not in failed:
                    ms, peak = measure(provider, case, cuda_graph=cuda_graph, kernel_options=kernel_options)
                    times.setdefault(i, []).append(ms)
                    peaks.setdefault(i, peak)
            except torch.OutOfMemoryError:
                failed.add(i)
                on_error(f"{provider} {case}: out of memory")
            except Exception as e:  # one provider failing must not stop the grid
                failed.add(i)
                on_error(f"{provider} {case}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if bar:
                    bar.update()
    if bar:
        bar.close()
    records = []
    for i, (case, provider) in enumerate(cells):
        if i in failed or i not in times:
            continue
        ms = statistics.median(times[i])
        record = dict(provider=provider, **asdict(case), ms=ms, tflops=case.flops() / ms / 1e9,
                      peak_mem_bytes=peaks[i], **env)
        if repeats > 1:
            record["ms_runs"] = times[i]
        if cuda_graph:
            record["timing"] = "cuda-graph"
        records.append(record)
    return records


def compare(variants, cases, rounds=2):
    """Same-run A/B of code variants: ``variants`` maps a name to (provider, kernel options).
    Each round measures every case's variants back to back, the order rotated by one each
    round, so that over as many rounds as variants each runs once in every place (first, after
    each other one): a variant always at an end of the order measures a few percent apart from
    the same code in the middle.  Returns one dict per case: its variants' best ms.  The same
    variant under two names gives the spread a null comparison has on the machine."""
    names = list(variants)
    best = [{} for _ in cases]
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for times, case in zip(best, cases):
            for name in order:
                provider, kernel_options = variants[name]
                ms, _ = measure(provider, case, kernel_options=kernel_options)
                times[name] = min(times.get(name, float("inf")), ms)
    return best


PACKED_STORAGE = "packed (total, heads, headdim) storage of documents of random lengths (seqlen: their mean)"


def markdown_table(records, baseline=None, failures=()):
    """One table per (head dim, causal, mode): TFLOP/s per provider and seqlen, plus ratios;
    then one line per cell that failed or ran out of memory."""
    failed = ["", "Not measured:", ""] + [f"- {f}" for f in failures] if failures else []
    if not records:
        return "\n".join(["(no results)"] + failed) + "\n"
    # (records joined from several runs name each run's value: "commit a, b")
    env = {k: ", ".join(dict.fromkeys(str(r[k]) for r in records))
           for k in ("gpu", "torch", "triton", "commit", "date")}
    dtypes = list(dict.fromkeys(r["dtype"] for r in records))
    float8_backward = any(r["dtype"] in FLOAT8 and r["mode"] != "fwd" for r in records)
    flops_formula = "2*b*h*sq*sk*(d + dv)" if any(r.get("dv") for r in records) else "4*b*h*sq*sk*d"
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
             f"{env['date']}; TFLOP/s (forward {flops_formula}, half when causal; backward 2.5x), "
             f"{', '.join(dtypes)}, "
             f"{PACKED_STORAGE if any(r.get('varlen') for r in records) else '(batch, seqlen, heads, headdim) storage'}"
             f"{'; float8 inputs with descales per (sequence, KV head), bf16 output' if set(dtypes) & set(FLOAT8) else ''}"
             f"{'; float8 backward: fp8_attn_func(fp8_backward=True) on bf16 inputs' if float8_backward else ''}"
             f"{'; CUDA-graph replays (no launch cost, L2 warm)' if records[0].get('timing') == 'cuda-graph' else ''}.",
             ""]
    groups = dict.fromkeys((r["dtype"], r["d"], r["causal"], r["mode"], r.get("varlen", False)) for r in records)
    for dtype, d, causal, mode, varlen in groups:
        rows = [r for r in records
                if (r["dtype"], r["d"], r["causal"], r["mode"], r.get("varlen", False)) == (dtype, d, causal, mode, varlen)]
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        seqlens = sorted({r["sq"] for r in rows})
        # float8 cells: each provider against its own bf16 cell of the run, where there is one
        bf16 = {(r["provider"], r["sq"]): r for r in records if dtype in FLOAT8 and r["dtype"] == "bf16"
                and (r["d"], r["causal"], r["mode"]) == (d, causal, mode)}
        versus = [(p, baseline) for p in providers if baseline in providers and p != baseline
                  and p.startswith("flashtile")]
        versus += [(p, "bf16") for p in providers if any(key[0] == p for key in bf16)]
        cols = providers + [f"{p}/{b}" for p, b in versus]
        own_v = f"/{rows[0]['dv']}" if rows[0].get("dv") else ""  # V's head dim of its own
        lines += [f"### d{d}{own_v} {'causal' if causal else 'non-causal'} {mode}"
                  f"{' ' + dtype if len(dtypes) > 1 else ''}"
                  f"{' packed' if varlen else ''}", "",
                  "| seqlen | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for s in seqlens:
            by = {r["provider"]: r for r in rows if r["sq"] == s}
            cells = [f"{by[p]['tflops']:.0f}" if p in by else "—" for p in providers]
            for p, b in versus:
                other = bf16.get((p, s)) if b == "bf16" else by.get(b)
                cells.append(f"{by[p]['tflops'] / other['tflops']:.2f}x" if p in by and other else "—")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines + failed)


def plot(records, path_prefix):
    """TFLOP/s vs seqlen per (head dim, mode) and peak memory vs seqlen; returns the PNG paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    head_dims = sorted({r["d"] for r in records})
    modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    if not head_dims or not modes:
        return paths
    fig, axes = plt.subplots(len(modes), len(head_dims), figsize=(4.5 * len(head_dims), 3.5 * len(modes)),
                             squeeze=False)
    for i, mode in enumerate(modes):
        for j, d in enumerate(head_dims):
            ax = axes[i][j]
            for (prov, dtype, causal) in dict.fromkeys((r["provider"], r["dtype"], r["causal"]) for r in records):
                pts = sorted((r["sq"], r["tflops"]) for r in records if (r["provider"], r["dtype"], r["causal"],
                                                                         r["mode"], r["d"]) == (prov, dtype, causal, mode, d))
                if pts:
                    ax.plot(*zip(*pts), marker="o", linestyle="--" if causal else "-",
                            label=f"{prov}{'' if dtype in ('bf16', 'fp16') else ' ' + dtype}{' causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, headdim {d}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    paths.append(f"{path_prefix}_tflops.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for prov in dict.fromkeys(r["provider"] for r in records):
        pts = sorted({r["sq"]: r["peak_mem_bytes"] for r in records if r["provider"] == prov
                      and r["mode"] == modes[-1] and r["d"] == head_dims[-1]
                      and r["peak_mem_bytes"] is not None}.items())
        if pts:
            ax.plot([p[0] for p in pts], [max(p[1], 1) / 2**20 for p in pts], marker="o", label=prov)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("seqlen")
    ax.set_ylabel(f"peak extra memory, MiB ({modes[-1]}, headdim {head_dims[-1]})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(f"{path_prefix}_memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def save(records, out_dir, name, baseline=None, plots=True, failures=()):
    """Write <name>.json, <name>.md (and PNG plots); returns the Markdown table."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(records, f, indent=1)
    table = markdown_table(records, baseline, failures)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    if plots and records:
        plot(records, os.path.join(out_dir, name))
    return table
