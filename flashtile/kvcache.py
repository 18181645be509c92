"""flash_attn_with_kvcache: new query tokens against a KV cache, for inference.

The new keys and values (rotary applied to them and to the queries first) are written into the
cache in place at each sequence's ``cache_seqlens``; the queries then attend to each sequence's
valid keys, ``[cache_leftpad, cache_seqlens + seqlen_new)`` of its cache row, causal aligned to
the end.  ``dispatch.resolve_version`` decides what attends, as for flash_attn_func: the split-KV
kernel of kernels/decode.py (its split count from ``dispatch.decode_plan``) wherever Triton runs,
and the PyTorch path (dispatch's "tiled" plan, tiled.py) on CPU tensors outside the interpreter,
each sequence's keys gathered into one varlen problem.  Forward only, as in flash_attn.

A decoding loop makes the same kind of call at every step, and at small batches its host path
is what a step costs: a call on the kernels is checked and planned once per kind (shapes,
strides, dtypes, devices, scalars: ``_kind``), its launches prepared
(``_Step``, ``_STEPS``); later calls of the kind check only what can change between calls (an
int's value, tables in host memory) and launch (``_Step.repeat``).
"""
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from flashtile import dispatch, kept_calls, options, rotary, validation
from flashtile.kernels import decode
from flashtile.kernels.problem import Problem


def _same_kind(name, x, q, rank=4):
    validation.check_tensor(name, x)
    if x.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D, got shape {tuple(x.shape)}")
    if x.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if x.shape[-1] != q.shape[-1]:
        raise ValueError(f"{name} must have q's head dim {q.shape[-1]}, got shape {tuple(x.shape)}")


def _any(condition) -> bool:
    """Whether a comparison of ints or of tensors holds anywhere."""
    return condition if isinstance(condition, bool) else bool(condition.any())


def _check_values(seqlens, seqlen_new, capacity, leftpad, batch_idx, batch_cache, block_table, pages, page_size,
                  rotary_rows=None, rotary_span=0, rotary_starts=None):
    """The tables' values, where reading them costs no device-to-host copy: ints, and tables of
    CPU tensors.  Tables on a GPU are not read (as in flash_attn: a copy would stall every
    decoding step); the kernel clamps each sequence's end to the capacity and every page or
    cache row it reads to the cache, so a wrong entry cannot read outside it (the append's
    positions, rows and pages and the rotary positions are clamped the same way).
    ``seqlen_new``: the new keys' count, or each sequence's ((batch,) tensor: packed new keys).
    ``rotary_rows``: the rotary tables' rows, which the queries' positions base + [0,
    rotary_span) must index (``rotary_span`` an int or each sequence's); the base is
    ``rotary_starts`` where given (FA3's rotary_seqlens, the new keys' base too), else seqlens."""
    new_keys = f"{seqlen_new} new keys" if isinstance(seqlen_new, int) else "each sequence's new keys"

    def out_of_capacity(got):
        return ValueError(f"cache_seqlens (+ {new_keys}) must lie in [0, {capacity}] (the cache's "
                          f"capacity{' through block_table' if block_table is not None else ''}), got {got}")

    def listed(x):
        return x if isinstance(x, int) else x.tolist()

    # What the host holds: ints and tables in host memory, tables widened to int64 so that no sum
    # wraps (None: a table on the device).
    starts, new, span, base = (None if isinstance(x, torch.Tensor) and x.is_cuda else
                               x.long() if isinstance(x, torch.Tensor) else x
                               for x in (seqlens, seqlen_new, rotary_span,
                                         seqlens if rotary_starts is None else rotary_starts))
    ends = None if starts is None or new is None else starts + new
    if starts is not None and (_any(starts < 0) or _any(starts > capacity) or ends is not None
                               and _any(ends > capacity)):
        raise out_of_capacity(listed(starts))
    if rotary_starts is not None and base is not None and _any(base < 0):
        raise ValueError(f"rotary_seqlens must be >= 0, got {base.tolist()}")
    if rotary_rows is not None and base is not None and span is not None:
        reach = span  # (past the base: the queries', and from rotary_starts the new keys' too)
        if rotary_starts is not None:
            reach = None if new is None else torch.maximum(torch.as_tensor(span), torch.as_tensor(new))
        if reach is not None and _any(base + reach > rotary_rows):
            top = base + reach if isinstance(base + reach, int) else int((base + reach).max())
            which, frm = ("the new keys and the queries", "rotary_seqlens") if rotary_starts is not None else \
                ("the queries", "cache_seqlens")
            raise ValueError(f"rotary_cos/rotary_sin have {rotary_rows} rows, but {which} are rotated at positions "
                             f"{frm} + i as in flash_attn, up to {top - 1}: pass longer tables")
    tables = {name: t for name, t in (("leftpad", leftpad), ("batch_idx", batch_idx), ("block_table", block_table))
              if isinstance(t, torch.Tensor) and not t.is_cuda}
    if "leftpad" in tables and ends is not None and _any((tables["leftpad"] < 0) | (tables["leftpad"] > ends)):
        raise ValueError(f"cache_leftpad must lie in [0, cache_seqlens + {new_keys}], got {tables['leftpad'].tolist()}")
    if "batch_idx" in tables and ((tables["batch_idx"] < 0) | (tables["batch_idx"] >= batch_cache)).any():
        raise ValueError(f"cache_batch_idx must index the cache's {batch_cache} rows, got "
                         f"{tables['batch_idx'].tolist()}")
    if "block_table" in tables and ends is not None:
        # Only the pages a sequence's keys reach are read: later columns may hold anything (-1).
        table = tables["block_table"]
        used = torch.arange(table.shape[1]) * page_size < torch.as_tensor(ends).reshape(-1, 1)
        if (((table < 0) | (table >= pages)) & used).any():
            raise ValueError(f"block_table entries must index the cache's {pages} pages (in the columns each "
                             f"sequence's keys reach)")


def _takes_gradients(*tensors):
    """Whether grad mode is on and any of ``tensors`` requires gradients: a cache call is forward
    only (the PyTorch path would chain the cache into the graph, the kernels drop gradients)."""
    return torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in tensors)


def _block_table(block_table, batch, device):
    """``block_table`` checked as a (batch, max_blocks) int32 table on ``device``, contiguous."""
    validation.check_tensor("block_table", block_table)
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be (batch={batch}, max_blocks), got {tuple(block_table.shape)}")
    return validation.int32_table("block_table", block_table, block_table.shape, device)


def _positions(seqlens, count, batch, device, limit):
    """(batch, count) positions seqlens + [0, count) of each sequence; ``seqlens`` an int (its
    value checked) or a (batch,) tensor, whose positions are clamped to [0, limit): a wrong
    entry in a table not read on the host indexes the wrong row, never past the end."""
    steps = torch.arange(count, device=device)
    if isinstance(seqlens, int):
        return (steps + seqlens).expand(batch, count)
    return (seqlens.long()[:, None] + steps).clamp_(0, limit - 1)


def _cache_slots(k_cache, positions, batch_idx, block_table, sequences=None):
    """Where ``positions`` of the sequences lie in the cache: (cache row or page, row in it), rows
    and pages clamped to the cache, as the kernel reads them.  ``positions`` (batch, n), row b
    sequence b's; or, with ``sequences`` of the same shape, each position's sequence beside it
    (packed keys)."""
    last = k_cache.shape[0] - 1
    if sequences is None:
        sequences = torch.arange(positions.shape[0], device=positions.device)[:, None]
    if block_table is not None:
        page_size = k_cache.shape[1]
        return block_table.long()[sequences, positions // page_size].clamp_(0, last), positions % page_size
    rows = sequences if batch_idx is None else batch_idx.long().clamp(0, last)[sequences]
    return rows.expand_as(positions), positions


def _append(k_cache, v_cache, k, v, positions, batch_idx, block_table, sequences=None):
    """k, v (batch, seqlen_new, heads_k, head_dim) written into the caches in place at
    ``positions`` (batch, seqlen_new, inside the capacity) of each sequence's cache row (or
    pages), or with ``sequences`` beside the positions, of those sequences' (packed keys): the
    PyTorch path's append, and the reference of the kernels' (decode.Append)."""
    index = _cache_slots(k_cache, positions, batch_idx, block_table, sequences)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def _packed_positions(offsets, total, starts=None):
    """Each packed key's (sequence, position in it), sequences packed one after another at
    ``offsets`` (batch + 1, int64), ``total`` keys in all as the host knows it (no count to wait
    for); positions count from ``starts`` (batch,) where given, else from 0."""
    device = offsets.device
    sequence = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=device), offsets[1:] - offsets[:-1],
                                       output_size=total)
    position = torch.arange(total, device=device) - offsets[sequence]
    if starts is not None:
        position += starts[sequence]
    return sequence, position


def _gathered(k_cache, v_cache, ends, leftpad, batch_idx, block_table, capacity):
    """Each sequence's keys and values, [start, end) of its cache row or pages, packed one sequence
    after another as (total, heads_k, head_dim), and their int32 offsets (batch + 1,).  ``ends``
    (batch,): where each sequence ends.  Clamped as the kernel clamps: the end to [0, capacity],
    the start to [0, end], rows and pages to the cache.  The keys' count is read on the host."""
    ends = ends.long().clamp(0, capacity)
    starts = torch.zeros_like(ends) if leftpad is None else torch.minimum(leftpad.long().clamp(min=0), ends)
    offsets = torch.zeros(ends.shape[0] + 1, dtype=torch.long, device=ends.device)
    offsets[1:] = (ends - starts).cumsum(0)
    sequence, position = _packed_positions(offsets, int(offsets[-1]), starts)
    outer, inner = _cache_slots(k_cache, position, batch_idx, block_table, sequence)
    return k_cache[outer, inner], v_cache[outer, inner], offsets.int()


def _capacity(k_cache, block_table):
    """Keys a sequence's cache holds: its row, or its table's pages."""
    return k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)


def split_plan(q, k_cache, block_table=None, num_splits=0, kernel_options=None, version="auto", shape=None):
    """dispatch.DecodePlan of a flash_attn_with_kvcache call of q over ``k_cache`` (and
    ``block_table``), whose ``splits`` its kernels run with; None where the PyTorch path attends
    (``version``, resolved as the call resolves it).  ``shape``: q's (batch, seqlen_q, heads,
    head_dim) where q is packed."""
    if dispatch.resolve_version(version, q.device) == "tiled":
        return None
    return dispatch.decode_plan(q, k_cache.shape[2], _capacity(k_cache, block_table), num_splits,
                                block_table is not None, options.resolve(kernel_options), shape=shape)


def _paged_varlen_arguments(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """flash_attn_varlen_func's paged arguments checked, as (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, block_table): the offsets' values read on the host once
    (validation.check_offset_values; not under CUDA-graph capture, where the kernels clamp
    them)."""
    _same_kind("k", k_cache, q)  # (named as flash_attn_varlen_func names them)
    validation.check_tensor("v", v_cache)
    if v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3] or v_cache.dtype != q.dtype \
            or v_cache.device != q.device:
        raise ValueError(f"with block_table, v must be (num_blocks, page_size, nheads_k, headdim_v) pages as "
                         f"k's {tuple(k_cache.shape[:3])}, of q's dtype and device, got "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} on {v_cache.device}")
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = validation.varlen_arguments(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
    block_table = _block_table(block_table, cu_seqlens_k.numel() - 1, q.device)
    pages, page_size = k_cache.shape[:2]
    capacity = _capacity(k_cache, block_table)
    # (the keys' count is what the offsets say: any end is taken here, the longest checked below)
    validation.check_offset_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], 2**31 - 1,
                                   spare_rows=True)
    read = validation.read_offsets(cu_seqlens_k)  # (None under capture: not read)
    if read is not None and read[1] > capacity:
        raise ValueError(f"block_table holds {capacity} keys a sequence ({block_table.shape[1]} pages of "
                         f"{page_size}), fewer than the longest sequence's {read[1]}")
    # (each sequence's key count from offsets in host memory: a table there is checked where read)
    _check_values(cu_seqlens_k.diff() if not cu_seqlens_k.is_cuda else 0, 0, capacity, None, None, 0, block_table,
                  pages, page_size)
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table


def paged_varlen_keys(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """flash_attn_varlen_func's paged keys and values: k_cache, v_cache (num_blocks, page_size,
    nheads_k, headdim), block_table (batch, max_blocks) int32, sequence b's keys the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages in the table's order.  Gathered into
    the packed (total_k, nheads_k, headdim) k and v the varlen call takes: a copy, whose
    gradients flow back to the pages (paged_varlen_attention reads the pages in place where
    no gradient is taken).  Entries are clamped to the cache as the decode kernel clamps them
    (checked on the host where the table is in host memory)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError("block_table in flash_attn_varlen_func gathers the pages on the host's count of "
                                  "keys for calls with gradients, dropout, sinks, a V head dim of its own, strided "
                                  "pages or version='tiled': not under CUDA-graph capture (other calls, and "
                                  "flash_attn_with_kvcache, read pages in place)")
    _, cu_seqlens_k, _, _, block_table = _paged_varlen_arguments(q, k_cache, v_cache, block_table, cu_seqlens_q,
                                                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # (the keys' count from the offsets already read: nothing waits on the device here)
    total = validation.read_offsets(cu_seqlens_k)[0]
    sequence, position = _packed_positions(cu_seqlens_k.long(), total)
    page, row = _cache_slots(k_cache, position, None, block_table, sequence)
    return k_cache[page, row], v_cache[page, row]


def reads_pages_in_place(q, k_cache, v_cache, dropout_p, sinks, alibi_slopes) -> bool:
    """Whether a paged flash_attn_varlen_func call may go to paged_varlen_attention: no
    gradient, dropout or sinks; fp16 or bf16 q; V of q's head dim; pages of unit stride along
    the head dim (as flash_attn_with_kvcache takes them)."""
    return (type(dropout_p) in (int, float) and dropout_p == 0 and sinks is None
            and all(isinstance(x, torch.Tensor) for x in (q, k_cache, v_cache))
            and q.dtype in validation.SUPPORTED_DTYPES and v_cache.shape[-1:] == q.shape[-1:]
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and not _takes_gradients(q, k_cache, v_cache, alibi_slopes))


def paged_varlen_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size, softcap, alibi_slopes, version, kernel_options):
    """(out, lse) of flash_attn_varlen_func over pages (paged_varlen_keys' layout) read in place
    by the split-KV kernels, as flash_attn_with_kvcache reads them with packed queries: no copy
    of the keys, no read on the host under CUDA-graph capture.  For calls without gradients,
    dropout or sinks, V of q's head dim (rows after the last sequence's queries 0, as the varlen
    call gives them); None where the dispatcher leaves the call to the varlen kernels
    (dispatch.paged_varlen_in_place: many queries a sequence)."""
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, _, block_table = _paged_varlen_arguments(
        q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if not dispatch.paged_varlen_in_place(max_seqlen_q, q.shape[1], k_cache.shape[2], capturing) or (
            capturing and version == "tiled"):  # (the PyTorch path reads offsets on the host: not capturable)
        return None
    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cu_seqlens_k.diff(), block_table=block_table,
                                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                   softcap=softcap, alibi_slopes=alibi_slopes, return_softmax_lse=True,
                                   cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, version=version,
                                   kernel_options=kernel_options)


def _tiled_forward(q, k_cache, v_cache, ends, leftpad, batch_idx, block_table, capacity, scale, window, softcap,
                   alibi_slopes, opts, packed=None):
    """(out, lse) of the PyTorch path: the sequences' keys gathered (``_gathered``) into one varlen
    problem, its queries (batch x seqlen_q rows, or ``packed``: (their offsets, the longest)) one
    sequence each, run by the dispatcher's "tiled" plan (tiled.py).  Masks count from each
    sequence's first key and align to its last, as in the kernel; no split (``num_splits`` has
    nothing to split there)."""
    k, v, offsets_k = _gathered(k_cache, v_cache, ends, leftpad, batch_idx, block_table, capacity)
    if packed is not None:
        offsets_q, seqlen_q = packed
    else:
        batch, seqlen_q, heads, head_dim = q.shape
        offsets_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
        q = q.reshape(batch * seqlen_q, heads, head_dim)
    p = Problem.of(q, k, offsets_q, offsets_k, seqlen_q, capacity, scale, *window, softcap=softcap,
                   alibi_slopes=alibi_slopes)
    plan = dispatch.forward_plan(p, "tiled", dispatch.target_of(p, q, k, v), opts)
    out, lse, _ = dispatch.run_forward(plan, p, q, k, v)
    if packed is not None:
        return out, lse
    return out.view(batch, seqlen_q, heads, head_dim), lse.view(heads, batch, seqlen_q).transpose(0, 1).contiguous()


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            cu_seqlens_q=None, max_seqlen_q=None, cu_seqlens_k_new=None, rotary_seqlens=None,
                            version="auto", kernel_options=None):
    """Attention of q (batch, seqlen_q, nheads, headdim) over a KV cache, flash_attn's semantics.

    k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with ``block_table``
    (batch, max_blocks) int32 pages of shape (num_pages, page_size, nheads_k, headdim), any page
    size.  k, v (batch, seqlen_new, nheads_k, headdim): appended into the caches in place at
    ``cache_seqlens`` (int or (batch,) int32; None: the whole cache).  rotary_cos/sin
    (seqlen_ro >= the cache's capacity, rotary_dim / 2): applied to k at positions
    cache_seqlens + i, and to q at positions cache_seqlens + i when causal or windowed (a window
    side narrower than the capacity), else all at cache_seqlens, as flash_attn does.
    cache_batch_idx (batch,) int32: the cache row of each sequence (contiguous caches);
    cache_leftpad (batch,) int32: where each sequence's keys start (paged too, which flash_attn
    refuses), at most its end.  causal / window_size are aligned to the end of each
    sequence's keys.  num_splits: 0 picks the split-KV count, n > 0 uses n (the PyTorch path
    does not split).  Returns out, or (out, softmax_lse) with lse (batch, nheads, seqlen_q),
    natural log.  ``version`` as in flash_attn_func: "auto" runs the split-KV kernel where
    Triton runs and the PyTorch path on CPU tensors outside the interpreter; "tiled" the PyTorch
    path anywhere; "v1", "v2" and "v3" the split-KV kernel (one for every version), where the
    version can run.  ``kernel_options``: developer switches (options.KernelOptions:
    tiles.decode, tiles.decode_paged).

    FlashAttention-3's varying counts: ``cu_seqlens_q`` (batch + 1,) int32 and ``max_seqlen_q``,
    queries packed as q (total_q, nheads, headdim), each sequence's aligned to the end of its
    keys, the output packed alike, lse (nheads, total_q); ``cu_seqlens_k_new`` (batch + 1,)
    int32, new keys and values packed as k, v (total_k_new, nheads_k, headdim), sequence b's
    appended at cache_seqlens[b], which then ends that many keys later.  Rotary positions count
    from ``rotary_seqlens`` ((batch,) int32) where given, else from cache_seqlens; each
    sequence's own queries and new keys from 0.
    """
    if torch.compiler.is_compiling():  # (traced: one op, which checks and runs the call at run time)
        _same_kind("q", q, q, 3 if cu_seqlens_q is not None or max_seqlen_q is not None else 4)  # (the op's shapes)
        left, right = validation.window(window_size)
        out, lse = kvcache_attention(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
            cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
            -1 if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor) else cache_seqlens,
            cache_batch_idx, cache_leftpad, block_table, validation.softmax_scale(softmax_scale, q.shape[-1]),
            bool(causal), left, right, validation.real("softcap", softcap, 0.0), bool(rotary_interleaved),
            alibi_slopes, validation.integer("num_splits", num_splits, minimum=0), cu_seqlens_q,
            None if max_seqlen_q is None else validation.integer("max_seqlen_q", max_seqlen_q, minimum=0),
            cu_seqlens_k_new, rotary_seqlens, version, options.text(options.resolve(kernel_options)))
        return (out, lse) if return_softmax_lse else out
    kind = _kind(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                 num_splits, version, kernel_options, cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new, rotary_seqlens)
    step = _STEPS.get(kind)
    if step is not None:
        out, lse = step.repeat(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_leftpad,
                               cache_batch_idx, block_table, alibi_slopes, cu_seqlens_q, cu_seqlens_k_new,
                               rotary_seqlens)
        return (out, lse) if return_softmax_lse else out
    packed = cu_seqlens_q is not None or max_seqlen_q is not None
    _same_kind("q", q, q, 3 if packed else 4)
    if q.dtype not in validation.SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; flashtile supports torch.float16 and torch.bfloat16")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q is on {q.device}; flashtile runs on CUDA GPUs (or CPU tensors)")
    _same_kind("k_cache", k_cache, q)
    if isinstance(v_cache, torch.Tensor) and v_cache.dim() == k_cache.dim() and v_cache.shape[-1] != q.shape[-1]:
        raise NotImplementedError(f"flash_attn_with_kvcache takes V of q's head dim ({q.shape[-1]}); a V head dim "
                                  f"of its own ({v_cache.shape[-1]}) runs in flash_attn_func and the varlen call only")
    _same_kind("v_cache", v_cache, q)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    counts_q = None  # each sequence's count of packed queries, where the host holds the offsets
    if packed:
        if cu_seqlens_q is None or max_seqlen_q is None:
            raise ValueError("cu_seqlens_q and max_seqlen_q must be given together")
        cu_seqlens_q = validation.offsets("cu_seqlens_q", cu_seqlens_q, q.device)
        batch, seqlen_q = cu_seqlens_q.numel() - 1, validation.integer("max_seqlen_q", max_seqlen_q, minimum=0)
        _, heads, head_dim = q.shape
        counts_q = _host_counts("cu_seqlens_q", cu_seqlens_q, q.shape[0], seqlen_q)
    else:
        batch, seqlen_q, heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    if not 0 < head_dim <= validation.MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {validation.MAX_HEAD_DIM}], got {head_dim}")
    if heads_k == 0 or heads % heads_k:
        raise ValueError(f"nheads of q ({heads}) must be a multiple of nheads of the cache ({heads_k})")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along headdim (it is written in place)")
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 alibi_slopes=alibi_slopes)
    if _takes_gradients(*given.values()):
        names = ", ".join(name for name, x in given.items() if getattr(x, "requires_grad", False))
        raise NotImplementedError(f"flash_attn_with_kvcache is forward only (as flash_attn's): call it under "
                                  f"torch.no_grad() or with tensors that do not require grad (requiring grad: "
                                  f"{names})")
    if block_table is not None:
        block_table = _block_table(block_table, batch, q.device)
    paged = block_table is not None
    if paged and cache_batch_idx is not None:
        raise NotImplementedError("block_table with cache_batch_idx is not supported (the table picks each "
                                  "sequence's pages)")
    capacity = _capacity(k_cache, block_table)
    if not paged and cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"the cache has {k_cache.shape[0]} rows for a batch of {batch}: pass cache_batch_idx")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    packed_new = cu_seqlens_k_new is not None
    if packed_new and k is None:
        raise ValueError("cu_seqlens_k_new packs new keys: pass k and v (total_k_new, nheads_k, headdim) with it")
    seqlen_new = 0  # the new keys' count; packed: each sequence's where the host holds the offsets, else None
    if k is not None:
        _same_kind("k", k, q, 3 if packed_new else 4)
        _same_kind("v", v, q, 3 if packed_new else 4)
        if packed_new:
            if k.shape != v.shape or tuple(k.shape[1:]) != (heads_k, head_dim):
                raise ValueError(f"with cu_seqlens_k_new, k and v must be (total_k_new, nheads_k={heads_k}, headdim="
                                 f"{head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
            cu_seqlens_k_new = validation.offsets("cu_seqlens_k_new", cu_seqlens_k_new, q.device, batch)
            seqlen_new = _host_counts("cu_seqlens_k_new", cu_seqlens_k_new, k.shape[0])
        else:
            if k.shape != v.shape or tuple(k.shape[::2]) != (batch, heads_k) or k.shape[3] != head_dim:
                raise ValueError(f"k and v must be (batch={batch}, seqlen_new, nheads_k={heads_k}, headdim="
                                 f"{head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
            seqlen_new = k.shape[1]
            if seqlen_new > capacity:
                raise ValueError(f"k has {seqlen_new} new keys but the cache holds {capacity} per sequence")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin apply to new keys: pass k and v with them")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            validation.check_tensor(name, x)
            if not x.is_floating_point():
                raise TypeError(f"{name} must be a real floating-point table, got {x.dtype}")
            if x.dim() != 2 or x.shape != rotary_cos.shape or 2 * x.shape[1] > head_dim or x.device != q.device:
                raise ValueError(f"{name} must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim, on q's "
                                 f"device, got shape {tuple(x.shape)} on {x.device}")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos/rotary_sin must have at least as many rows as the cache's capacity "
                             f"({capacity}{' through block_table' if paged else ''}), as in flash_attn, got "
                             f"{rotary_cos.shape[0]}")
    elif rotary_seqlens is not None:
        raise ValueError("rotary_seqlens sets where rotary positions start: pass rotary_cos and rotary_sin with it")
    rotary_starts = validation.int32_table("rotary_seqlens", rotary_seqlens, (batch,), q.device)
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = validation.int32_table("cache_seqlens", cache_seqlens, (batch,), q.device)
    elif cache_seqlens is None and packed_new:
        raise ValueError("cu_seqlens_k_new appends at cache_seqlens: pass it")
    else:
        seqlens = capacity - seqlen_new if cache_seqlens is None else \
            validation.integer("cache_seqlens", cache_seqlens, minimum=0)
    batch_idx = validation.int32_table("cache_batch_idx", cache_batch_idx, (batch,), q.device)
    leftpad = validation.int32_table("cache_leftpad", cache_leftpad, (batch,), q.device)
    num_splits = validation.integer("num_splits", num_splits, minimum=0)
    if version not in dispatch.VERSION_CHOICES:
        raise ValueError(f"version must be one of {dispatch.VERSION_CHOICES}, got {version!r}")
    softcap = validation.real("softcap", softcap, 0.0)
    alibi_slopes = validation.alibi_slopes(alibi_slopes, batch, heads, q.device)
    scale = validation.softmax_scale(softmax_scale, head_dim)
    window = validation.band(bool(causal), window_size, seqlen_q, capacity)
    # flash_attn rotates the queries at cache_seqlens + i when causal or local, a window side
    # narrower than the capacity (wider ones it drops), else all at cache_seqlens.
    queries_advance = bool(causal) or any(0 <= side < capacity for side in validation.window(window_size))
    rotary_span = _rotary_span(seqlen_q, counts_q, packed, queries_advance)
    _check_values(seqlens, seqlen_new, capacity, leftpad, batch_idx, k_cache.shape[0], block_table, k_cache.shape[0],
                  k_cache.shape[1], None if rotary_cos is None else rotary_cos.shape[0], rotary_span, rotary_starts)
    opts = options.resolve(kernel_options)
    version = dispatch.resolve_version(version, q.device)  # before the cache is written
    # The queries' rotary positions clamped to the capacity where they are the new keys' (the
    # same rows, from the same base), else to the tables.
    rotary_limit = None if rotary_cos is None else capacity if (
        queries_advance and not packed and not packed_new and rotary_starts is None and seqlen_q == seqlen_new) \
        else rotary_cos.shape[0]

    if version == "tiled":  # PyTorch operations
        out, lse = _tiled_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, leftpad, batch_idx,
                               block_table, batch, capacity, scale, window, softcap, alibi_slopes, opts,
                               rotary_interleaved, queries_advance, rotary_limit, rotary_starts,
                               cu_seqlens_q if packed else None, seqlen_q, cu_seqlens_k_new)
        return (out, lse) if return_softmax_lse else out

    # Kernels: the queries rotated in one launch, the new keys rotated and appended in another,
    # then the split-KV attention (and its combine).
    tables = isinstance(seqlens, torch.Tensor)
    rotate = append = None
    if rotary_cos is not None:
        rotate = decode.Rotate(validation.last_dim_contiguous(q), rotary_cos.contiguous(),
                               tables or rotary_starts is not None, queries_advance, rotary_limit,
                               rotary_interleaved, batch if packed else None)
    if k is not None:
        append = decode.Append(k_cache, v_cache, validation.last_dim_contiguous(k), validation.last_dim_contiguous(v),
                               tables, batch_idx is not None, block_table,
                               None if rotary_cos is None else rotary_cos.contiguous(),
                               rotary_interleaved, batch if packed_new else None, rotary_starts is not None)
    # The queries attended: rotated into a new contiguous tensor, or as given.
    attended = validation.last_dim_contiguous(q) if rotate is None else torch.empty(q.shape, dtype=q.dtype,
                                                                                   device="meta")
    plan = split_plan(q, k_cache, block_table, num_splits, opts, version, shape=(batch, seqlen_q, heads, head_dim))
    attend = decode.Attend(plan, attended, k_cache, v_cache, tables or packed_new, leftpad is not None,
                           batch_idx is not None, block_table, scale, window, softcap, alibi_slopes is not None,
                           (batch, seqlen_q) if packed else None)
    step = _Step(rotate, append, attend, capacity, None if packed_new else seqlen_new,
                 None if rotary_cos is None else rotary_cos.shape[0],
                 None if packed else rotary_span)
    _STEPS.keep(kind, step)
    out, lse = step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, leftpad, batch_idx, block_table,
                    alibi_slopes, cu_seqlens_q, cu_seqlens_k_new, rotary_starts)
    return (out, lse) if return_softmax_lse else out


def _host_counts(name, cu, total, longest=None):
    """Each sequence's count by offsets ``cu`` (named ``name``) of ``total`` packed rows, rows
    past the last sequence allowed (``longest`` the longest allowed, else any), the offsets'
    values checked, where the host holds them; None for offsets on a GPU (not read: the kernels
    clamp them to the rows)."""
    if cu.is_cuda:
        return None
    limit = total if longest is None else longest
    validation.check_offset_values(cu, cu, limit, limit, total, total, spare_rows=True, names=(name, name))
    return cu.diff()


def _rotary_span(seqlen_q, counts_q, packed, advance):
    """How far past their base the queries' rotary positions reach: seqlen_q (``advance``) or 1,
    and none without queries; packed, each sequence's (None where its count is not read)."""
    if not packed:
        return seqlen_q if advance else min(seqlen_q, 1)
    if counts_q is None:
        return None
    return counts_q if advance else counts_q.clamp(max=1)


def _tiled_call(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, block_table, batch, capacity,
                scale, window, softcap, alibi_slopes, opts, interleaved, advance, rotary_limit, rotary_starts,
                cu_seqlens_q, seqlen_q, cu_new):
    """(out, lse) of the PyTorch path: rotary on q and the new keys, the new keys appended, then
    _tiled_forward.  Packed offsets are read on the host here (checked as they are read)."""
    device = q.device
    # (the offsets read and checked before anything is written)
    if cu_new is not None:
        _host_counts("cu_seqlens_k_new", cu_new.cpu(), k.shape[0])
    if cu_seqlens_q is not None:
        _host_counts("cu_seqlens_q", cu_seqlens_q.cpu(), q.shape[0], seqlen_q)
    starts = torch.full((batch,), seqlens, device=device) if isinstance(seqlens, int) else seqlens.long()
    base = starts if rotary_starts is None else rotary_starts.long()
    ends = starts
    if k is not None:
        if cu_new is None:  # (batch, seqlen_new) positions, from each sequence's start
            seqlen_new = k.shape[1]
            positions = _positions(seqlens, seqlen_new, batch, device, capacity)
            rotary_positions = positions if rotary_starts is None else \
                _positions(rotary_starts, seqlen_new, batch, device, cos.shape[0])
            sequences, ends = None, starts + seqlen_new
        else:  # one row of packed keys: (1, total) positions, each with its sequence
            total = int(cu_new[-1])
            k, v = k[None, :total], v[None, :total]
            sequences, steps = _packed_positions(cu_new.long(), total)
            sequences = sequences[None]
            positions = (starts[sequences] + steps).clamp_(0, capacity - 1)
            rotary_positions = positions if rotary_starts is None else \
                (base[sequences] + steps).clamp_(0, cos.shape[0] - 1)
            ends = starts + cu_new.diff()
        if cos is not None:
            k = rotary.apply(k, cos, sin, rotary_positions, interleaved)
        _append(k_cache, v_cache, k, v, positions, batch_idx, block_table, sequences)
    if cos is not None:
        if cu_seqlens_q is None:
            q_positions = _positions(base, seqlen_q if advance else 1, batch, device, rotary_limit)
            q = rotary.apply(q, cos, sin, q_positions.expand(batch, seqlen_q), interleaved)
        else:  # packed queries: each sequence's from 0
            total = int(cu_seqlens_q[-1])
            sequences, steps = _packed_positions(cu_seqlens_q.long(), total)
            q_positions = (base[sequences] + steps * advance).clamp_(0, rotary_limit - 1)
            q = torch.cat([rotary.apply(q[None, :total], cos, sin, q_positions[None], interleaved)[0], q[total:]])
    out, lse = _tiled_forward(q, k_cache, v_cache, ends, leftpad, batch_idx, block_table, capacity, scale, window,
                              softcap, alibi_slopes, opts, None if cu_seqlens_q is None else (cu_seqlens_q, seqlen_q))
    if cu_seqlens_q is not None:  # rows after the last sequence's queries: 0 and +inf, as the kernels give them
        last = int(cu_seqlens_q[-1])
        out[last:], lse[:, last:] = 0, float("inf")
    return out, lse


def _kvcache_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                       rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                       cache_seqlens_int: int, cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                       block_table: Optional[Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
                       window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[Tensor],
                       num_splits: int, cu_seqlens_q: Optional[Tensor], max_seqlen_q: Optional[int],
                       cu_seqlens_k_new: Optional[Tensor], rotary_seqlens: Optional[Tensor], version: str,
                       kernel_options: str) -> tuple[Tensor, Tensor]:
    """flash_attn_with_kvcache as torch.compile traces it (its checks run here, at run time):
    ``cache_seqlens`` a table, or ``cache_seqlens_int`` its int (-1: None)."""
    seqlens = cache_seqlens if cache_seqlens is not None else None if cache_seqlens_int < 0 else cache_seqlens_int
    return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale, causal, (window_left, window_right),
                                   softcap, rotary_interleaved, alibi_slopes, num_splits, True,
                                   cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                   cu_seqlens_k_new=cu_seqlens_k_new, rotary_seqlens=rotary_seqlens, version=version,
                                   kernel_options=kernel_options)


# The call as one custom op for torch.compile: the caches written in place, out and lse new.
kvcache_attention = torch.library.custom_op("flashtile::kvcache_attention", _kvcache_attention,
                                            mutates_args=("k_cache", "v_cache"))


@kvcache_attention.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int, cache_batch_idx,
      cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
      alibi_slopes, num_splits, cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new, rotary_seqlens, version,
      kernel_options):
    # lse (nheads, total_q) for packed queries, else (batch, nheads, seqlen_q)
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(lse_shape, dtype=torch.float32)


# Decoding steps checked and planned once per kind of call (``_kind``): _Step.
_STEPS = kept_calls.KeptCalls()


def _kind(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
          block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
          version, kernel_options, cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new, rotary_seqlens):
    """The kind of a call, for ``_STEPS``: everything its checks, plan and launches depend on (the
    tensors' kept_calls.tensors_kind; the scalars, each of one type, a stricter and quicker test
    than kept_calls.kind's; the options).  None for any other call, or where a tensor takes
    gradients: the full path refuses those every time.  ``cache_seqlens`` counts as an int, whatever its value
    (checked at each call)."""
    if type(q) is not torch.Tensor or _takes_gradients(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                                       alibi_slopes):
        return None
    if not (type(causal) is bool and type(softcap) is float and type(num_splits) is int and type(version) is str
            and type(rotary_interleaved) is bool and (softmax_scale is None or type(softmax_scale) is float)
            and type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and (max_seqlen_q is None or type(max_seqlen_q) is int)):
        return None
    if kernel_options is None:
        kernel_options = options.ENVIRONMENT
    elif not isinstance(kernel_options, (str, options.KernelOptions)):
        return None
    seqlens_int = type(cache_seqlens) is int
    key = kept_calls.tensors_kind((q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                   None if seqlens_int else cache_seqlens, cache_batch_idx, cache_leftpad,
                                   block_table, alibi_slopes, cu_seqlens_q, cu_seqlens_k_new, rotary_seqlens))
    if key is None:
        return None
    return (*key, seqlens_int, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, version,
            kernel_options, max_seqlen_q)


class _Step(NamedTuple):
    """The kernels of one kind of call (decode.Rotate and decode.Append, None where the call has
    no rotary or no new keys; decode.Attend) and what its checks at each call read:
    ``seqlen_new`` None for packed new keys, ``rotary_span`` None where it is each packed
    sequence's."""
    rotate: object
    append: object
    attend: object
    capacity: int
    seqlen_new: int | None
    rotary_rows: int | None
    rotary_span: int | None

    def __call__(self, q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, block_table, alibi_slopes,
                 cu_seqlens_q, cu_new, rotary_starts):
        """(out, lse), the tables checked (``seqlens`` an int or a contiguous int32 table)."""
        if cos is not None:
            # Contiguous: the kernels read both tables with one row stride.
            cos, sin = cos.contiguous(), sin.contiguous()
        if self.rotate is not None:
            q = self.rotate(validation.last_dim_contiguous(q), cos, sin,
                            seqlens if rotary_starts is None else rotary_starts, cu_seqlens_q)
        if self.append is not None:
            self.append(k_cache, v_cache, validation.last_dim_contiguous(k), validation.last_dim_contiguous(v),
                        seqlens, batch_idx, block_table, cos, sin, cu_new, rotary_starts)
        if cu_new is not None:  # each sequence's end, on the device
            ends, new_keys = cu_new.diff() + seqlens, 0
        elif isinstance(seqlens, torch.Tensor):
            ends, new_keys = seqlens, self.seqlen_new
        else:
            ends, new_keys = None, seqlens + self.seqlen_new
        return self.attend(validation.last_dim_contiguous(q), k_cache, v_cache, ends, new_keys, leftpad, batch_idx,
                           block_table, alibi_slopes, cu_seqlens_q)

    def repeat(self, q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, leftpad, batch_idx, block_table, alibi_slopes,
               cu_seqlens_q, cu_new, rotary_starts):
        """A call of this kind after the first: what the full path does at every call (value
        checks of ints and of tables in host memory, the tables made contiguous), then the step."""
        tables = (leftpad, batch_idx, block_table, alibi_slopes, cu_seqlens_q, cu_new, rotary_starts)
        leftpad, batch_idx, block_table, alibi_slopes, cu_seqlens_q, cu_new, rotary_starts = (
            None if x is None else x.contiguous() for x in tables)
        seqlen_new = self.seqlen_new
        if cu_new is not None and not q.is_cuda:
            seqlen_new = _host_counts("cu_seqlens_k_new", cu_new, k.shape[0])
        rotary_span = self.rotary_span
        if cu_seqlens_q is not None and not q.is_cuda:
            longest = self.attend.packed[1]
            rotary_span = _rotary_span(longest, _host_counts("cu_seqlens_q", cu_seqlens_q, q.shape[0], longest), True,
                                       self.rotate is not None and self.rotate.advance)
        seqlens = self.capacity - self.seqlen_new if cache_seqlens is None else cache_seqlens
        if type(seqlens) is int:
            fits = 0 <= seqlens <= self.capacity - (self.seqlen_new or 0) and self.seqlen_new is not None and (
                self.rotary_rows is None or rotary_starts is None and self.rotary_span is not None
                and seqlens + self.rotary_span <= self.rotary_rows)
        else:
            seqlens, fits = seqlens.contiguous(), True
        if not fits or not q.is_cuda:
            _check_values(seqlens, seqlen_new, self.capacity, leftpad, batch_idx, k_cache.shape[0], block_table,
                          k_cache.shape[0], k_cache.shape[1], self.rotary_rows, rotary_span, rotary_starts)
        return self(q, k_cache, v_cache, k, v, cos, sin, seqlens, leftpad, batch_idx, block_table, alibi_slopes,
                    cu_seqlens_q, cu_new, rotary_starts)
