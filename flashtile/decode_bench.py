"""The decode benchmark: one new query token per sequence against a KV cache.

Decoding is bound by reading the cache, so each cell reports the bandwidth achieved on it,
bytes of K and V read ÷ time, beside the GPU's measured copy bandwidth (bytes read + written ÷
time of a device-to-device copy).  Providers: flashtile's ``flash_attn_with_kvcache`` on a
contiguous cache and on pages of ``page_size`` rows, and PyTorch SDPA's backends on the same
tensors in its layout (GQA through ``enable_gqa``, no copy of K/V).  Each cell is timed twice:
called eagerly, where the CPU's time to enqueue a call (recorded too) bounds short cells, and
replayed from a CUDA graph, as serving engines run their decoding steps.
"""
import functools
import json
import os
import statistics
import time

import torch
import triton

from flashtile import bench, kvcache
from flashtile.kernels.problem import cdiv

PROVIDERS = ("flashtile", "flashtile-paged", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient")
CUDA_ONLY = ("sdpa-cudnn", "sdpa-efficient")  # SDPA's backends with no CPU kernel


def _inputs(batch, cache, heads, heads_k, head_dim, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, 1, heads, head_dim, dtype=torch.bfloat16, device=device, generator=g)
    k = torch.randn(batch, cache, heads_k, head_dim, dtype=torch.bfloat16, device=device, generator=g)
    v = torch.randn(batch, cache, heads_k, head_dim, dtype=torch.bfloat16, device=device, generator=g)
    return q, k, v


def make_call(provider, batch, cache, heads=32, heads_k=8, head_dim=128, page_size=16, device=None,
              kernel_options=None, num_splits=0):
    """A no-argument call of ``provider`` on one decode cell (inputs made here); ``kernel_options``
    (options.KernelOptions: tiles.decode, tiles.decode_paged) and ``num_splits`` (0: the
    dispatcher's count) for the flashtile providers, whose call carries its ``splits``
    (kvcache.split_plan's count; None where the PyTorch path attends)."""
    device = device or bench.default_device()
    q, k, v = _inputs(batch, cache, heads, heads_k, head_dim, device)
    lengths = torch.full((batch,), cache, dtype=torch.int32, device=device)
    if provider in ("flashtile", "flashtile-paged"):
        block_table = None
        if provider == "flashtile-paged":
            blocks = cdiv(cache, page_size)
            pad = blocks * page_size - cache
            pages = [torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).view(batch * blocks, page_size, heads_k, head_dim)
                     for x in (k, v)]
            # Pages in a shuffled order, as an allocator hands them out.
            order = torch.randperm(batch * blocks, device=device).int()
            table = torch.empty_like(order)
            table[order.long()] = torch.arange(batch * blocks, dtype=torch.int32, device=device)
            k, v = (x[order.long()] for x in pages)
            block_table = table.view(batch, blocks)
        call = functools.partial(kvcache.flash_attn_with_kvcache, q, k, v, cache_seqlens=lengths,
                                 block_table=block_table, num_splits=num_splits, kernel_options=kernel_options)
        plan = kvcache.split_plan(q, k, block_table, num_splits, kernel_options)
        call.splits = plan and plan.splits
        return call
    if provider.startswith("sdpa-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[provider]
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return call
    raise ValueError(f"unknown provider {provider!r}; choose from {PROVIDERS}")


def host_us(call, calls=100):
    """Microseconds of host time per call of ``call`` (bench.enqueue_time)."""
    return 1e3 * bench.enqueue_time(call, calls)[0]


def measure(provider, batch, cache, **shape):
    """(median ms called eagerly, median ms replayed from a CUDA graph (None without a GPU), host
    us per eager call, the split count (make_call's: None for SDPA's)) of one cell."""
    call = make_call(provider, batch, cache, **shape)
    splits = getattr(call, "splits", None)
    call()
    if not torch.cuda.is_available():
        times = []
        for _ in range(3):
            t = time.perf_counter()
            call()
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times), None, host_us(call, 3), splits
    ms = triton.testing.do_bench(call, warmup=50, rep=100, return_mode="median")
    graph_ms = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median")
    return ms, graph_ms, host_us(call), splits


def run(batches, caches, providers, heads=32, heads_k=8, head_dim=128, page_size=16, on_error=print,
        kernel_options=None, num_splits=0):
    """Records of every (batch, cache, provider); a provider that fails a cell is reported.
    ``kernel_options`` (options.KernelOptions) and ``num_splits`` (0: the dispatcher's count) go
    to the flashtile providers and into the records, with the split count each cell ran."""
    env = bench.environment()
    copy_tbps = bench.ceilings()["copy_tbps"] if torch.cuda.is_available() else None
    records = []
    for batch in batches:
        for cache in caches:
            kv_bytes = 2 * batch * cache * heads_k * head_dim * 2
            for provider in providers:
                try:
                    ms, graph_ms, host, splits = measure(provider, batch, cache, heads=heads, heads_k=heads_k,
                                                         head_dim=head_dim, page_size=page_size,
                                                         kernel_options=kernel_options, num_splits=num_splits)
                except Exception as e:  # one provider failing must not stop the grid
                    on_error(f"{provider} batch {batch} cache {cache}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                finally:
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                records.append(dict(provider=provider, batch=batch, cache=cache, heads=heads, heads_k=heads_k,
                                    head_dim=head_dim, page_size=page_size, dtype="bf16", ms=ms,
                                    tbps=kv_bytes / ms / 1e9, graph_ms=graph_ms,
                                    graph_tbps=graph_ms and kv_bytes / graph_ms / 1e9, host_us=host,
                                    copy_tbps=copy_tbps, kernel_options=str(kernel_options or ""),
                                    splits=splits, **env))
    return records


def _ratio(by, batch, cache, providers, key):
    """flashtile's ``key`` over the best SDPA backend's in one cell, as text."""
    sdpa = [by[(batch, cache, p)][key] for p in providers
            if p.startswith("sdpa-") and (batch, cache, p) in by and by[(batch, cache, p)][key]]
    ours = by.get((batch, cache, "flashtile"))
    return f"{ours[key] / max(sdpa):.2f}" if ours and ours[key] and sdpa else "—"


def markdown_table(records):
    """TB/s per provider for each (batch, cache) cell, eager and from a CUDA graph, flashtile
    over the best SDPA backend in each, and the split count of each flashtile provider."""
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in records)]
    cells = sorted({(r["batch"], r["cache"]) for r in records})
    by = {(r["batch"], r["cache"], r["provider"]): r for r in records}
    copy = next((r["copy_tbps"] for r in records if r["copy_tbps"]), None)
    lines = [f"Decode: 1 query token, {records[0]['heads']}/{records[0]['heads_k']} heads, d{records[0]['head_dim']}, "
             f"bf16; K/V bytes read / time in TB/s, CUDA-graph replay (eager call)"
             + (f"; device copy {copy:.2f} TB/s" if copy else "") + f"; paged: pages of {records[0]['page_size']}.",
             "", "| batch | cache | " + " | ".join(providers) + " | flashtile / best SDPA, graph (eager) | "
             "flashtile host us | flashtile splits |", "|---" * (len(providers) + 5) + "|"]

    def cell(record):
        eager = f"{record['tbps']:.2f}"
        return f"{record['graph_tbps']:.2f} ({eager})" if record.get("graph_tbps") else eager
    for batch, cache in cells:
        row = [cell(by[(batch, cache, p)]) if (batch, cache, p) in by else "—" for p in providers]
        ratio = f"{_ratio(by, batch, cache, providers, 'graph_tbps')} ({_ratio(by, batch, cache, providers, 'tbps')})"
        ours = by.get((batch, cache, "flashtile"))
        host = f"{ours['host_us']:.0f}" if ours else "—"
        splits = [str(by[(batch, cache, p)]["splits"]) for p in providers
                  if by.get((batch, cache, p), {}).get("splits") is not None]
        lines.append(f"| {batch} | {cache} | " + " | ".join(row) + f" | {ratio} | {host} | "
                     f"{' / '.join(splits) or '—'} |")
    return "\n".join(lines) + "\n"


def save(records, out_dir, name):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(records, f, indent=1)
    table = markdown_table(records)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    return table
