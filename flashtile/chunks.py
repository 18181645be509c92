"""FlashAttention-3's ``attention_chunk`` (Llama 4's chunked local attention): each query sees
only the keys of its own chunk of ``chunk`` positions, positions counted along the keys with the
queries aligned to the end of their sequence's keys (as the causal mask aligns them), within the
causal mask or window if one is given.

Attention inside a chunk is ordinary attention, so a call is cut into one piece per (sequence,
chunk) and the pieces run as packed sequences.  A piece's queries end where its keys end (the
last query of a chunk sits at its last key), so the causal mask and the window keep their
alignment and need no change.  Self-attention whose length is a multiple of the chunk is a batch
of chunks: a view, run by the batched kernels.  Queries placed before the first key (more
queries than keys) see none: output 0, as any row without a key.  Differentiable, forward and
backward, as the attention it is made of.
"""
import torch

from flashtile import validation


def _pieces(q_start, k_start, seqlen_q, seqlen_k, chunk):
    """(query rows, key rows) of one sequence's pieces, as (start, length) pairs in the packed
    tensors: queries before the first key with no key, then chunk by chunk (a chunk may have no
    query; empty pieces are left out)."""
    offset = seqlen_k - seqlen_q  # the key position of query 0
    pieces = []
    if offset < 0:
        pieces.append(((q_start, min(-offset, seqlen_q)), (k_start, 0)))
    for first in range(0, seqlen_k, chunk):
        last = min(first + chunk, seqlen_k)
        rows = (max(first - offset, 0), max(last - offset, 0))
        pieces.append(((q_start + rows[0], rows[1] - rows[0]), (k_start + first, last - first)))
    return [p for p in pieces if p[0][1] or p[1][1]]


def attend(run, q, k, v, cu_seqlens_q, cu_seqlens_k, chunk, descales):
    """(out, lse) of attention in chunks of ``chunk`` keys.  ``run(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, descales)`` is the attention of whole pieces,
    returning (out, lse); q, k, v batched (batch, seqlen, heads, headdim) or packed with their
    int32 offsets; ``descales``: FP8's three (batch, nheads_k) descales or Nones, each piece
    taking its sequence's."""
    varlen = cu_seqlens_q is not None
    if not varlen:
        batch, seqlen_q, heads, _ = q.shape
        seqlen_k = k.shape[1]
        if seqlen_q <= seqlen_k <= chunk:  # one chunk holds every key
            return run(q, k, v, None, None, None, None, descales)
        if seqlen_q == seqlen_k and seqlen_k % chunk == 0:  # a batch of whole chunks
            n = seqlen_k // chunk
            pieces = (x.reshape(batch * n, chunk, *x.shape[2:]) for x in (q, k, v))
            per_piece = tuple(None if d is None else d.repeat_interleave(n, 0) for d in descales)
            out, lse = run(*pieces, None, None, None, None, per_piece)
            return (out.reshape(batch, seqlen_q, heads, -1),
                    lse.reshape(batch, n, heads, chunk).transpose(1, 2).reshape(batch, heads, seqlen_q))
        bounds_q = [(b * seqlen_q, seqlen_q) for b in range(batch)]
        bounds_k = [(b * seqlen_k, seqlen_k) for b in range(batch)]
        q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    else:
        offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        bounds_q = [(s, e - s) for s, e in zip(offsets_q, offsets_q[1:])]
        bounds_k = [(s, e - s) for s, e in zip(offsets_k, offsets_k[1:])]
    pieces, owners = [], []
    for sequence, ((q_start, seqlen_q), (k_start, seqlen_k)) in enumerate(zip(bounds_q, bounds_k)):
        found = _pieces(q_start, k_start, seqlen_q, seqlen_k, chunk)
        pieces += found
        owners += [sequence] * len(found)
    # (the offsets start where the first sequence does, as the given ones)
    offsets = [[bounds_q[0][0] if bounds_q else 0], [bounds_k[0][0] if bounds_k else 0]]
    for rows in pieces:
        for side, (_, length) in zip(offsets, rows):
            side.append(side[-1] + length)
    device = q.device
    cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device=device) for o in offsets)
    owner = torch.tensor(owners, dtype=torch.long, device=device)
    per_piece = tuple(None if d is None else d[owner] for d in descales)
    longest_q = max((r[0][1] for r in pieces), default=0)
    longest_k = max((r[1][1] for r in pieces), default=0)
    out, lse = run(q, k, v, cu_q, cu_k, longest_q, longest_k, per_piece)
    if varlen:
        return out, lse
    return out.reshape(batch, -1, *out.shape[1:]), lse.reshape(lse.shape[0], batch, -1).transpose(0, 1)


def cache_starts(q, k_cache, k, cache_seqlens, cache_leftpad, block_table, chunk):
    """A decoding step's chunks over a KV cache, as flash_attn_with_kvcache's ``cache_leftpad``:
    each sequence's one query sits at its last key and sees from the start of that key's chunk
    (or from its own leftpad, if later).  One query token per sequence: several could span two
    chunks, which only the sequence lengths on the device would tell."""
    validation.check_tensor("q", q)
    if q.dim() != 4 or q.shape[1] != 1:
        raise NotImplementedError(f"attention_chunk over a KV cache takes one query token per sequence "
                                  f"(decoding), got q of shape {tuple(q.shape)}")
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    new = 0 if k is None else k.shape[1]
    ends = (capacity - new if cache_seqlens is None else cache_seqlens) + new
    if isinstance(ends, torch.Tensor):
        starts = ((ends.long() - 1).clamp(min=0) // chunk * chunk).to(torch.int32)
    else:
        starts = torch.full((q.shape[0],), max(int(ends) - 1, 0) // chunk * chunk, dtype=torch.int32,
                            device=q.device)
    return starts if cache_leftpad is None else torch.maximum(cache_leftpad, starts)


def check(chunk) -> int:
    """``attention_chunk`` as an int >= 0 (0: no chunks)."""
    return validation.integer("attention_chunk", chunk, minimum=0)
