"""flash_attn_with_kvcache: new query tokens against a KV cache, for inference.

The new keys and values (rotary applied to them and to the queries first) are written into the
cache in place at each sequence's ``cache_seqlens``; the queries then attend to each sequence's
valid keys, ``[cache_leftpad, cache_seqlens + seqlen_new)`` of its cache row, causal aligned to
the end.  The attention is the split-KV kernel of kernels/decode.py, its split count from
``dispatch.decode_plan``.  Forward only, as in flash_attn.
"""
import types

import torch

from flashtile import dispatch, options, rotary, validation
from flashtile.kernels import decode


def _same_kind(name, x, q):
    validation.check_tensor(name, x)
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(x.shape)}")
    if x.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if x.shape[-1] != q.shape[-1]:
        raise ValueError(f"{name} must have q's head dim {q.shape[-1]}, got shape {tuple(x.shape)}")


def _int32_table(name, x, shape, device):
    """An int32 table of ``shape`` on ``device``, contiguous; None stays None."""
    if x is None:
        return None
    validation.check_tensor(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")
    return x.contiguous()


def _check_values(seqlens, seqlen_new, capacity, leftpad, batch_idx, batch_cache, block_table, pages):
    """The tables' values, where reading them costs no device-to-host copy: ``seqlens`` given as
    an int, and tables of CPU tensors.  Tables on a GPU are not read (as in flash_attn: a copy
    would stall every decoding step); the kernel clamps each sequence's end to the capacity and
    every page or cache row it reads to the cache, so a wrong entry cannot read outside it."""
    def out_of_capacity(got):
        return ValueError(f"cache_seqlens (+ {seqlen_new} new keys) must lie in [0, {capacity}] (the cache's "
                          f"capacity{' through block_table' if block_table is not None else ''}), got {got}")
    if isinstance(seqlens, int) and not 0 <= seqlens <= capacity - seqlen_new:
        raise out_of_capacity(seqlens)
    tables = {name: t for name, t in (("seqlens", seqlens), ("leftpad", leftpad), ("batch_idx", batch_idx),
                                      ("block_table", block_table)) if isinstance(t, torch.Tensor) and not t.is_cuda}
    if not tables:
        return
    if "seqlens" in tables and ((seqlens < 0) | (seqlens + seqlen_new > capacity)).any():
        raise out_of_capacity(seqlens.tolist())
    if "leftpad" in tables and ((tables["leftpad"] < 0) | (tables["leftpad"] > seqlens)).any():
        raise ValueError(f"cache_leftpad must lie in [0, cache_seqlens], got {tables['leftpad'].tolist()}")
    if "batch_idx" in tables and ((tables["batch_idx"] < 0) | (tables["batch_idx"] >= batch_cache)).any():
        raise ValueError(f"cache_batch_idx must index the cache's {batch_cache} rows, got "
                         f"{tables['batch_idx'].tolist()}")
    if "block_table" in tables and ((tables["block_table"] < 0) | (tables["block_table"] >= pages)).any():
        raise ValueError(f"block_table entries must index the cache's {pages} pages")


def _positions(seqlens, count, batch, device):
    """(batch, count) positions seqlens + [0, count) of each sequence; ``seqlens`` an int or a
    (batch,) tensor."""
    steps = torch.arange(count, device=device)
    if isinstance(seqlens, int):
        return (steps + seqlens).expand(batch, count)
    return seqlens.long()[:, None] + steps


def _append(k_cache, v_cache, k, v, positions, batch_idx, block_table):
    """k, v (batch, seqlen_new, heads_k, head_dim) written into the caches in place at
    ``positions`` (batch, seqlen_new) of each sequence's cache row (or pages)."""
    batch, seqlen_new = k.shape[:2]
    if block_table is not None:
        page_size = k_cache.shape[1]
        index = (block_table.long().gather(1, positions // page_size), positions % page_size)
    else:
        rows = torch.arange(batch, device=k.device) if batch_idx is None else batch_idx.long()
        index = (rows[:, None].expand(batch, seqlen_new), positions)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            kernel_options=None):
    """Attention of q (batch, seqlen_q, nheads, headdim) over a KV cache, flash_attn's semantics.

    k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with ``block_table``
    (batch, max_blocks) int32 pages of shape (num_pages, page_size, nheads_k, headdim), any page
    size.  k, v (batch, seqlen_new, nheads_k, headdim): appended into the caches in place at
    ``cache_seqlens`` (int or (batch,) int32; None: the whole cache).  rotary_cos/sin
    (seqlen_ro, rotary_dim / 2): applied to k at positions cache_seqlens + i, and to q at the
    same positions when causal or windowed, else at cache_seqlens.  cache_batch_idx (batch,)
    int32: the cache row of each sequence; cache_leftpad (batch,) int32: where each sequence's
    keys start.  causal / window_size are aligned to the end of each sequence's keys.
    num_splits: 0 picks the split-KV count, n > 0 uses n.  Returns out, or (out, softmax_lse)
    with lse (batch, nheads, seqlen_q), natural log.  ``kernel_options``: developer switches
    (options.KernelOptions: tiles.decode, tiles.decode_paged).
    """
    _same_kind("q", q, q)
    if q.dtype not in validation.SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; flashtile supports torch.float16 and torch.bfloat16")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q is on {q.device}; flashtile runs on CUDA GPUs (or CPU tensors)")
    _same_kind("k_cache", k_cache, q)
    _same_kind("v_cache", v_cache, q)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch, seqlen_q, heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    if head_dim > validation.MAX_HEAD_DIM:
        raise ValueError(f"head dim must be at most {validation.MAX_HEAD_DIM}, got {head_dim}")
    if heads_k == 0 or heads % heads_k:
        raise ValueError(f"nheads of q ({heads}) must be a multiple of nheads of the cache ({heads_k})")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along headdim (it is written in place)")
    if q.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("flash_attn_with_kvcache is forward only (as flash_attn's): call it under "
                                  "torch.no_grad() or with tensors that do not require grad")
    if block_table is not None:
        validation.check_tensor("block_table", block_table)
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(f"block_table must be (batch={batch}, max_blocks), got {tuple(block_table.shape)}")
        block_table = _int32_table("block_table", block_table, block_table.shape, q.device)
    paged = block_table is not None
    if paged and (cache_batch_idx is not None or cache_leftpad is not None):
        raise NotImplementedError("block_table with cache_batch_idx or cache_leftpad is not supported "
                                  "(as in flash_attn)")
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if not paged and cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"the cache has {k_cache.shape[0]} rows for a batch of {batch}: pass cache_batch_idx")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    seqlen_new = 0
    if k is not None:
        _same_kind("k", k, q)
        _same_kind("v", v, q)
        if k.shape != v.shape or tuple(k.shape[::2]) != (batch, heads_k) or k.shape[3] != head_dim:
            raise ValueError(f"k and v must be (batch={batch}, seqlen_new, nheads_k={heads_k}, headdim="
                             f"{head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = k.shape[1]
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin apply to new keys: pass k and v with them")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            validation.check_tensor(name, x)
            if x.dim() != 2 or x.shape != rotary_cos.shape or 2 * x.shape[1] > head_dim or x.device != q.device:
                raise ValueError(f"{name} must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim, on q's "
                                 f"device, got shape {tuple(x.shape)} on {x.device}")
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = _int32_table("cache_seqlens", cache_seqlens, (batch,), q.device)
    else:
        seqlens = capacity - seqlen_new if cache_seqlens is None else \
            validation.integer("cache_seqlens", cache_seqlens, minimum=0)
    batch_idx = _int32_table("cache_batch_idx", cache_batch_idx, (batch,), q.device)
    leftpad = _int32_table("cache_leftpad", cache_leftpad, (batch,), q.device)
    num_splits = validation.integer("num_splits", num_splits, minimum=0)
    softcap = validation.real("softcap", softcap, 0.0)
    alibi_slopes = validation.alibi_slopes(alibi_slopes, batch, heads, q.device)
    scale = validation.softmax_scale(softmax_scale, head_dim)
    window = validation.band(bool(causal), window_size, seqlen_q, capacity)
    _check_values(seqlens, seqlen_new, capacity, leftpad, batch_idx, k_cache.shape[0], block_table, k_cache.shape[0])

    new_positions = _positions(seqlens, seqlen_new, batch, q.device) if k is not None else None
    if rotary_cos is not None:
        k = rotary.apply(k, rotary_cos, rotary_sin, new_positions, rotary_interleaved)
        if causal or validation.window(window_size) != (-1, -1):
            q_positions = new_positions if seqlen_q == seqlen_new else _positions(seqlens, seqlen_q, batch, q.device)
        else:
            q_positions = _positions(seqlens, 1, batch, q.device).expand(batch, seqlen_q)
        q = rotary.apply(q, rotary_cos, rotary_sin, q_positions, rotary_interleaved)
    if k is not None:
        _append(k_cache, v_cache, k, v, new_positions, batch_idx, block_table)
    q = validation.last_dim_contiguous(q)
    plan = dispatch.decode_plan(q, heads_k, capacity, num_splits, block_table is not None,
                                options.resolve(kernel_options))
    features = types.SimpleNamespace(softcap=softcap, alibi_slopes=alibi_slopes)
    ends, new_keys = (seqlens, seqlen_new) if isinstance(seqlens, torch.Tensor) else (None, seqlens + seqlen_new)
    out, lse = decode.forward(plan, q, k_cache, v_cache, ends, new_keys, leftpad, batch_idx, block_table, scale,
                              window, features)
    return (out, lse) if return_softmax_lse else out
