"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed
process group (ring attention), forward and backward.

Each rank holds a shard of Q, K and V along the sequence.  K/V shards travel round the ring
(rank r sends to r + 1), each rank attending with its own queries to the shard it holds at each
step with flashtile's kernels and merging the partial outputs by their logsumexp, the online
softmax one level up.  The next shard's transfer is posted before the step's kernels run, so
the exchange overlaps the compute.  The backward goes round the ring again: each rank's dQ
stays home, while the dK/dV of a shard travel with it and reach their owner after one more hop.
The partial backward of each step is the kernels' own, given the final output and logsumexp.

Causal attention uses the zigzag layout (``zigzag_shard``): the sequence is cut into 2N chunks
and rank r holds chunks r and 2N - 1 - r, so that every rank does the same work at every step.
Each step is one kernel call per pair of contiguous runs that interact (``step_pairs``), cut
to the rows and keys inside the band, so causal masks and sliding windows reach the kernels as
their own bands and pairs outside the band cost nothing.  Attention sinks join the merged
output once (sinks.join), and the backward's kernels, given the joined output and logsumexp,
need nothing more; the sinks' gradient is this rank's rows' share.
The transport is torch.distributed's point-to-point operations (NCCL on GPUs, gloo on CPUs).
"""
import torch
import torch.distributed as dist

from flashtile import dispatch, ops, options, validation
from flashtile import sinks as attention_sinks


def zigzag_shard(x, rank: int, world: int, dim: int = 1):
    """Rank ``rank``'s shard of ``x`` (the whole sequence along ``dim``) in the zigzag layout:
    chunks rank and 2 * world - 1 - rank of 2 * world equal chunks."""
    if not 0 <= rank < world or x.shape[dim] % (2 * world):
        raise ValueError(f"zigzag_shard cuts the sequence into 2 * world = {2 * world} equal chunks: its length "
                         f"({x.shape[dim]}) must be a multiple of that and rank in [0, {world}), got rank {rank}")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards, dim: int = 1):
    """The whole sequence from every rank's zigzag shard (in rank order)."""
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


class _Ring:
    """Sends to the next rank and receives from the previous, overlapped with whatever runs
    between ``post`` and ``wait``."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group else (self.rank - 1) % self.world
        self._pending = ([], [])

    def post(self, *tensors):
        """Start sending ``tensors`` on and receiving their successors; returns the receive buffers
        (contiguous: the transports take no other layout)."""
        sent = [t.contiguous() for t in tensors]  # (kept until the sends complete)
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in sent]
        ops_ = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops_ += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        self._pending = (dist.batch_isend_irecv(ops_), sent)
        return received

    def wait(self):
        for request in self._pending[0]:
            request.wait()
        self._pending = ([], [])


def _merge(out, lse, part_out, part_lse):
    """Two partial attentions over disjoint keys merged by their logsumexp: out (b, s, h, d)
    float32, lse (b, h, s) float32; a partial that saw no key (lse -inf) weighs nothing."""
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    old_w = torch.exp(lse - safe).transpose(1, 2)[..., None]
    part_w = torch.exp(part_lse - safe).transpose(1, 2)[..., None]
    return out * old_w + part_out.float() * part_w, new


def shard_segments(rank: int, world: int, seqlen: int, zigzag: bool):
    """(global start, local start, length) of each contiguous run of rank ``rank``'s shard of
    ``seqlen`` local rows: one run in rank order, or the two chunks of the zigzag layout."""
    if not zigzag:
        return ((rank * seqlen, 0, seqlen),)
    half = seqlen // 2
    return ((rank * half, 0, half), ((2 * world - 1 - rank) * half, half, half))


def step_pairs(rank, source, world, seqlen, zigzag, left, right):
    """The kernel calls of one ring step: rank ``rank``'s queries against the shard of rank
    ``source``, as (local query rows, held key rows, kernel left, kernel right), for the key
    band ``i - left <= j <= i + right`` in global positions (-1: an unbounded side).

    Each pair of runs is cut to the queries that see a key and the keys that some query sees.
    The last such query sees the last such key, so the band passes through the corner the
    kernels align the band to (the end of both ranges): its sides relative to that corner are
    never negative, and the kernels' own band arithmetic does the rest.  Pairs that see nothing
    are dropped."""
    pairs = []
    for qg, ql, qn in shard_segments(rank, world, seqlen, zigzag):
        for kg, kl, kn in shard_segments(source, world, seqlen, zigzag):
            i0 = qg if right < 0 else max(qg, kg - right)
            i1 = qg + qn - 1 if left < 0 else min(qg + qn - 1, kg + kn - 1 + left)
            if i0 > i1:
                continue
            j0 = kg if left < 0 else max(kg, i0 - left)
            j1 = kg + kn - 1 if right < 0 else min(kg + kn - 1, i1 + right)
            if j0 > j1:
                continue
            corner = j1 - i1  # the last query's offset to the last key
            k_left, k_right = validation.band(False, (-1 if left < 0 else left + corner,
                                                      -1 if right < 0 else right - corner),
                                              i1 - i0 + 1, j1 - j0 + 1)
            pairs.append((slice(ql + i0 - qg, ql + i1 - qg + 1), slice(kl + j0 - kg, kl + j1 - kg + 1),
                          k_left, k_right))
    return pairs


def _kernel_args(scale, left, right, softcap, version, seqlen_q, seqlen_k):
    return seqlen_q, seqlen_k, scale, left, right, softcap, 0.0, version


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, left, right, zigzag, softcap, version, group):
        ring = _Ring(group)
        text = options.text(options.resolve(None))
        seqlen = q.shape[1]
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], seqlen), float("-inf"), dtype=torch.float32, device=q.device)
        held = (k, v)
        for step in range(ring.world):
            if step < ring.world - 1:
                incoming = ring.post(*held)
            source = (ring.rank - step) % ring.world
            for rows, keys, k_left, k_right in step_pairs(ring.rank, source, ring.world, seqlen, zigzag, left, right):
                qs, ks, vs = q[:, rows], held[0][:, keys], held[1][:, keys]
                part_out, part_lse, _ = ops._forward(
                    qs, ks, vs, None, None, None, None, None, None,
                    *_kernel_args(scale, k_left, k_right, softcap, version, qs.shape[1], ks.shape[1]), False, text)
                part_lse = torch.where(torch.isinf(part_lse), float("-inf"), part_lse)  # no key: weight 0
                out[:, rows], lse[..., rows] = _merge(out[:, rows], lse[..., rows], part_out, part_lse)
            if step < ring.world - 1:
                ring.wait()
                held = tuple(incoming)
        out = out.to(q.dtype)
        lse = torch.where(torch.isinf(lse), float("inf"), lse)  # flashtile's convention: +inf, output 0
        if sinks is not None:
            out, lse, _ = attention_sinks.join(False, out, lse, lse.new_empty(0), sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (scale, left, right, zigzag, softcap, version, group, text)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None:
            raise NotImplementedError("ring attention's logsumexp is not differentiable")
        q, k, v, out, lse, sinks = ctx.saved_tensors
        scale, left, right, zigzag, softcap, version, group, text = ctx.args
        ring = _Ring(group)
        seqlen = q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        held = (k, v)
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(ring.world):
            if step < ring.world - 1:
                incoming = ring.post(*held)
            source = (ring.rank - step) % ring.world
            for rows, keys, k_left, k_right in step_pairs(ring.rank, source, ring.world, seqlen, zigzag, left, right):
                qs, ks, vs = q[:, rows], held[0][:, keys], held[1][:, keys]
                grads = ops._backward_kernels(
                    dout[:, rows].contiguous(), None, qs, ks, vs, out[:, rows], lse[..., rows].contiguous(),
                    lse.new_empty(0), None, None, None, None,
                    *_kernel_args(scale, k_left, k_right, softcap, version, qs.shape[1], ks.shape[1]), False, text)
                dq[:, rows] += grads[0].float()
                dk[:, keys] += grads[1].float()
                dv[:, keys] += grads[2].float()
            if step < ring.world - 1:
                ring.wait()
                held = tuple(incoming)
            # The shard's dK/dV go on with it; after the last step they reach their owner (a
            # ring of one rank holds its own).
            if ring.world > 1:
                dk, dv = ring.post(dk, dv)
                ring.wait()
        dsinks = None
        if ctx.needs_input_grad[3]:  # this rank's rows' share
            dsinks = attention_sinks.gradient(False, sinks, out, lse, dout, None)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None, None, None


def ring_flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, group=None,
                         version="auto", return_softmax_lse=False, sinks=None):
    """Attention over the whole sequence of which each rank of ``group`` (None: the default
    group) holds a shard: q (batch, seqlen_local, nheads, headdim), k and v (batch,
    seqlen_local, nheads_k, headdim), every rank's seqlen_local equal; shards in rank order, or
    with ``causal`` in the zigzag layout (``zigzag_shard``) and seqlen_local even.
    ``window_size`` (left, right) bounds the keys each query sees in global positions, as in
    flash_attn_func.  ``sinks`` (nheads,): gpt-oss's attention sinks, as in flash_attn_func.
    Returns this rank's rows of the output (and with ``return_softmax_lse`` their logsumexp,
    (batch, nheads, seqlen_local)), differentiable with respect to q, k, v and the sinks (whose
    gradient is this rank's rows' share: the whole sequence's is its sum over the group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_flash_attn_func needs an initialized torch.distributed process group")
    validation.check_qkv(q, k, v, False)
    softcap = validation.real("softcap", softcap, 0.0)
    sinks = validation.sinks(sinks, q.shape[2], q.device)
    scale = validation.softmax_scale(softmax_scale, q.shape[-1])
    version = dispatch.resolve_version(version, q.device)
    if version == "v1":
        raise NotImplementedError("ring attention runs the v2, v3 or PyTorch kernels per step, not version='v1'")
    # The shards' lengths, gathered before they are checked: every rank sees every rank's and
    # raises alike (a check on this rank's alone would leave the others waiting in the ring).
    world = dist.get_world_size(group)
    lengths = [torch.zeros(2, dtype=torch.int64, device=q.device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([q.shape[1], k.shape[1]], device=q.device), group=group)
    lengths = [tuple(int(n) for n in x) for x in lengths]
    if any(n_q != n_k for n_q, n_k in lengths):
        raise ValueError(f"q and k must hold the same shard of the sequence on every rank, got (q, k) rows "
                         f"{lengths}")
    if len(set(lengths)) != 1:
        raise ValueError(f"every rank must hold a shard of the same length, got {[n for n, _ in lengths]}")
    if causal and q.shape[1] % 2:
        raise ValueError(f"causal ring attention takes zigzag shards of an even length, got {q.shape[1]} rows")
    total = world * q.shape[1]
    left, right = validation.band(bool(causal), window_size, total, total)
    with ops.on_device_of(q):
        out, lse = _RingAttention.apply(q, k, v, sinks, scale, left, right, bool(causal), softcap, version, group)
    return (out, lse) if return_softmax_lse else out
