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
from flashtile.kernels.problem import cdiv


def _pieces(cu_seqlens_q, cu_seqlens_k, before, chunks, chunk):
    """(offsets of the pieces' queries, of their keys) as int32 tensors on the offsets' device,
    read by no host: each sequence cut into ``before`` pieces of at most ``chunk`` queries placed
    before its first key (no key), then one piece per chunk of its keys with the queries that
    sit in that chunk, ``chunks`` of them (pieces past a sequence's end are empty).  The pieces
    of a sequence tile its rows and its keys in order, so the offsets are running sums from where
    the first sequence starts."""
    seqlen_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()[:, None]
    seqlen_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()[:, None]
    offset = seqlen_k - seqlen_q  # the key position of query 0
    device = seqlen_q.device
    first_before = torch.arange(before, device=device) * chunk
    rows_before = ((-offset).clamp(min=0) - first_before).clamp(0, chunk)
    first = torch.minimum(torch.arange(chunks, device=device) * chunk, seqlen_k)
    last = torch.minimum(first + chunk, seqlen_k)
    rows = (last - offset).clamp(min=0) - (first - offset).clamp(min=0)
    lengths_q = torch.cat([rows_before, rows], 1).flatten()
    lengths_k = torch.cat([torch.zeros_like(rows_before), last - first], 1).flatten()
    return tuple(torch.cat([cu[:1], cu[:1] + torch.cumsum(lengths, 0)]).to(torch.int32)
                 for cu, lengths in ((cu_seqlens_q, lengths_q), (cu_seqlens_k, lengths_k)))


def attend(run, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, chunk, descales):
    """(out, lse) of attention in chunks of ``chunk`` keys.  ``run(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, descales)`` is the attention of whole pieces,
    returning (out, lse); q, k, v batched (batch, seqlen, heads, headdim) or packed with their
    int32 offsets and longest sequences; ``descales``: FP8's three (batch, nheads_k) descales or
    Nones, each piece taking its sequence's.  The offsets' values are not read on the host: the
    pieces are as many per sequence as the longest sequences need."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        # Queries before the first key need pieces of their own unless every sequence has as
        # many keys as queries (one offsets tensor for both).
        before = 0 if cu_seqlens_q is cu_seqlens_k else cdiv(max_seqlen_q, chunk)
    else:
        batch, seqlen_q, heads, _ = q.shape
        seqlen_k = max_seqlen_k = k.shape[1]
        max_seqlen_q = seqlen_q
        if seqlen_q <= seqlen_k <= chunk:  # one chunk holds every key
            return run(q, k, v, None, None, None, None, descales)
        if seqlen_q == seqlen_k and seqlen_k % chunk == 0:  # a batch of whole chunks
            n = seqlen_k // chunk
            pieces = (x.reshape(batch * n, chunk, *x.shape[2:]) for x in (q, k, v))
            per_piece = tuple(None if d is None else d.repeat_interleave(n, 0) for d in descales)
            out, lse = run(*pieces, None, None, None, None, per_piece)
            return (out.reshape(batch, seqlen_q, heads, -1),
                    lse.reshape(batch, n, heads, chunk).transpose(1, 2).reshape(batch, heads, seqlen_q))
        before = cdiv(max(seqlen_q - seqlen_k, 0), chunk)
        cu_seqlens_q, cu_seqlens_k = (torch.arange(batch + 1, dtype=torch.int32, device=q.device) * n
                                      for n in (seqlen_q, seqlen_k))
        q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    per_sequence = before + cdiv(max_seqlen_k, chunk)
    cu_q, cu_k = _pieces(cu_seqlens_q, cu_seqlens_k, before, per_sequence - before, chunk)
    # The pieces tile checked offsets: no need to read them back on the host (validation's
    # remembered offsets; nothing is kept while torch.compile traces or in inference mode).
    # (each ending where the call's offsets end: before the tensor's rows in a padded buffer,
    # whose rows after the last sequence the attention then leaves at 0; while torch.compile
    # traces nothing was read, and the attention op refuses such rows)
    known = varlen and not torch.compiler.is_compiling()
    ends = [(validation.read_offsets(cu) or (x.shape[0],))[0] if known else x.shape[0]
            for cu, x in ((cu_seqlens_q, q), (cu_seqlens_k, k))]
    validation.trust_offsets(cu_q, ends[0], min(chunk, max_seqlen_q))
    validation.trust_offsets(cu_k, ends[1], min(chunk, max_seqlen_k))
    per_piece = tuple(None if d is None else d.repeat_interleave(per_sequence, 0) for d in descales)
    out, lse = run(q, k, v, cu_q, cu_k, min(chunk, max_seqlen_q), min(chunk, max_seqlen_k), per_piece)
    if varlen:
        return out, lse
    return out.reshape(batch, -1, *out.shape[1:]), lse.reshape(lse.shape[0], batch, -1).transpose(0, 1)


def cache_starts(q, k_cache, k, cache_seqlens, cache_leftpad, block_table, chunk, cu_seqlens_k_new=None):
    """A decoding step's chunks over a KV cache, as flash_attn_with_kvcache's ``cache_leftpad``:
    each sequence's one query sits at its last key and sees from the start of that key's chunk,
    positions (and so chunks) counted from the sequence's own leftpad, as FA3 counts them.  One
    query token per sequence: several could span two chunks, which only the sequence lengths on
    the device would tell.  New keys k (batch, seqlen_new, ...), or packed by
    ``cu_seqlens_k_new``."""
    validation.check_tensor("q", q)
    if q.dim() != 4 or q.shape[1] != 1:
        raise NotImplementedError(f"attention_chunk over a KV cache takes one query token per sequence "
                                  f"(decoding), got q of shape {tuple(q.shape)}")
    batch = q.shape[0]
    cache_leftpad = validation.int32_table("cache_leftpad", cache_leftpad, (batch,), q.device)
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    new = 0 if k is None else k.shape[1]
    if k is not None and cu_seqlens_k_new is not None:
        new = validation.offsets("cu_seqlens_k_new", cu_seqlens_k_new, q.device, batch).diff()
    ends = (capacity - new if cache_seqlens is None else cache_seqlens) + new
    ends = ends.long() if isinstance(ends, torch.Tensor) else torch.full((batch,), int(ends), device=q.device)
    pad = torch.zeros_like(ends) if cache_leftpad is None else cache_leftpad.long()
    return (pad + (ends - 1 - pad).clamp(min=0) // chunk * chunk).to(torch.int32)


def check(chunk) -> int:
    """``attention_chunk`` as an int >= 0 (0: no chunks)."""
    return validation.integer("attention_chunk", chunk, minimum=0)
