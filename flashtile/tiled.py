"""FlashAttention in plain PyTorch: the same tiled algorithm as the kernels, for CPU tensors.

The executable specification of the online softmax: queries and keys are processed in
blocks, a running max and row sum rescale the partial output as each K/V block arrives, only
the logsumexp is kept, and the backward recomputes probabilities from it.  No
(seqlen_q x seqlen_k) matrix is ever formed; memory is O(block x seqlen).  Math runs in
float32 (CPU half-precision matmuls are slow and no more faithful).

A masked key contributes nothing whatever its value: a block whose values are not all finite
multiplies them only where the band lets a query see them (a matrix product would turn a
probability of 0 times an infinite value into NaN).  Dropout keeps what the kernels keep: the
same Philox numbers, drawn in PyTorch (dropout.kept_scale_block).
"""
import torch

from flashtile.kernels import dropout, score
from flashtile.reference import band_mask

BLOCK = 128


def _sequences(p):
    """(q slice, k slice) per sequence: varlen offsets, or whole rows of a padded batch."""
    if p.seqused:  # (start, end) per sequence
        return [(slice(*q), slice(*k)) for q, k in zip(p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist())]
    if p.varlen:
        cq, ck = p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()
        return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(p.batch)]
    return [(b, b) for b in range(p.batch)]


def _grouped(x, heads_k):
    """(seqlen, heads, d) -> float32 (heads_k, group, seqlen, d) without copying K/V per group."""
    s, h, d = x.shape
    return x.float().permute(1, 0, 2).reshape(heads_k, h // heads_k, s, d)


def _ungrouped(x):
    """Inverse of _grouped: (heads_k, group, seqlen, d) -> (seqlen, heads, d)."""
    hk, g, s, d = x.shape
    return x.reshape(hk * g, s, d).permute(1, 0, 2)


def _visible(p, i0, i1, j0, j1, sq, sk, device):
    return band_mask(sq, sk, p.window_left, p.window_right, device=device,
                     rows=slice(i0, i1), cols=slice(j0, j1))


def _weighted_values(probs, values, visible):
    """probs @ values (heads_k, group, rows, keys) x (heads_k, keys, d), where masked keys add nothing."""
    if torch.isfinite(values).all():
        return torch.einsum("hgqk,hkd->hgqd", probs, values)
    terms = probs[..., None] * values[:, None, None]
    return torch.where(visible[..., None], terms, 0.0).sum(-2)


def _slopes(p, b):
    """Sequence b's ALiBi slopes as (heads_k, group), or None."""
    if p.alibi_slopes is None:
        return None
    slopes = p.alibi_slopes[b] if p.alibi_slopes.dim() == 2 else p.alibi_slopes
    return slopes.reshape(p.heads_k, p.group)


def _bias(slopes, i0, i1, j0, j1, sq, sk):
    return None if slopes is None else score.alibi_bias(slopes, sq, sk, slice(i0, i1), slice(j0, j1))


def _keep(p, b, i0, i1, j0, j1):
    """Sequence b's dropout factors for query rows [i0, i1) and keys [j0, j1), (heads_k, group,
    rows, keys): 1 / (1 - p) where kept, else 0; None without dropout."""
    if not p.dropout:
        return None
    streams = b * p.heads_q + torch.arange(p.heads_q).view(p.heads_k, p.group)
    return dropout.kept_scale_block(int(p.dropout_seed), streams, torch.arange(i0, i1), torch.arange(j0, j1),
                                    p.dropout_p)


def _scores(p, qblk, kblk, bias):
    s = torch.einsum("hgqd,hkd->hgqk", qblk, kblk) * p.softmax_scale
    return score.reference(s, p.softcap, bias)


def forward(plan, p, q, k, v):
    out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=p.out_dtype(q))
    lse = torch.empty(p.row_stat_shape(q.shape[0]), dtype=torch.float32, device=q.device)
    for b, (qs, ks) in enumerate(_sequences(p)):
        slopes = _slopes(p, b)
        qg, kg, vg = _grouped(q[qs], p.heads_k), k[ks].float().permute(1, 0, 2), v[ks].float().permute(1, 0, 2)
        sq, sk = qg.shape[2], kg.shape[1]
        o_seq = qg.new_zeros(*qg.shape[:-1], vg.shape[-1])
        lse_seq = torch.empty(qg.shape[:3], device=q.device)
        for i0 in range(0, sq, BLOCK):
            i1 = min(i0 + BLOCK, sq)
            m = torch.full(qg[:, :, i0:i1, 0].shape, float("-inf"), device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros_like(o_seq[:, :, i0:i1])
            for j0 in range(0, sk, BLOCK):
                j1 = min(j0 + BLOCK, sk)
                visible = _visible(p, i0, i1, j0, j1, sq, sk, q.device)
                bias = _bias(slopes, i0, i1, j0, j1, sq, sk)
                s = _scores(p, qg[:, :, i0:i1], kg[:, j0:j1], bias).masked_fill(~visible, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                probs = torch.exp(s - m_ref[..., None])
                alpha = torch.exp(m - m_ref)
                l = l * alpha + probs.sum(-1)  # every probability, dropped or not
                keep = _keep(p, b, i0, i1, j0, j1)
                if keep is not None:
                    probs = probs * keep.to(q.device)
                acc = acc * alpha[..., None] + _weighted_values(probs, vg[:, j0:j1], visible)
                m = m_new
            empty = l == 0
            o_seq[:, :, i0:i1] = acc / torch.where(empty, torch.ones_like(l), l)[..., None]
            lse_seq[:, :, i0:i1] = torch.where(empty, torch.full_like(l, float("inf")), m + torch.log(l))
        out[qs] = _ungrouped(o_seq).to(q.dtype)
        if p.varlen:
            lse[:, qs] = lse_seq.reshape(p.heads_q, sq)
        else:
            lse[qs] = lse_seq.reshape(p.heads_q, sq)
    return out, lse, lse.new_empty(0)


def backward(plan, p, dout, dlse, q, k, v, out, lse, saved):
    dq, dk, dv = p.gradients(q, k, v)
    for b, (qs, ks) in enumerate(_sequences(p)):
        slopes = _slopes(p, b)
        qg, dog, og = (_grouped(x[qs], p.heads_k) for x in (q, dout, out))
        kg, vg = k[ks].float().permute(1, 0, 2), v[ks].float().permute(1, 0, 2)
        # dQ's product: a masked pair (dS 0) adds nothing, even from an infinite key (a key a
        # row sees that is not finite has made that row's dS NaN already).
        kg_dq = torch.where(torch.isfinite(kg), kg, 0.0)
        sq, sk = qg.shape[2], kg.shape[1]
        seq_lse = (lse[:, qs] if p.varlen else lse[qs]).reshape(qg.shape[:3])
        # dS = P * (dP - D) with D = rowsum(dO * O) - dlse (see kernels/v2.py _bwd_dq_kernel).
        delta = (dog * og).sum(-1)
        if dlse is not None:
            delta = delta - (dlse[:, qs] if p.varlen else dlse[qs]).reshape(qg.shape[:3])
        dqg = torch.zeros_like(qg)
        dkg, dvg = torch.zeros_like(kg), torch.zeros_like(vg)
        for i0 in range(0, sq, BLOCK):
            i1 = min(i0 + BLOCK, sq)
            for j0 in range(0, sk, BLOCK):
                j1 = min(j0 + BLOCK, sk)
                visible = _visible(p, i0, i1, j0, j1, sq, sk, q.device)
                bias = _bias(slopes, i0, i1, j0, j1, sq, sk)
                y = _scores(p, qg[:, :, i0:i1], kg[:, j0:j1], bias)
                probs = torch.exp(y - seq_lse[:, :, i0:i1, None]).masked_fill(~visible, 0.0)
                dp = torch.einsum("hgqd,hkd->hgqk", dog[:, :, i0:i1], vg[:, j0:j1])
                keep = _keep(p, b, i0, i1, j0, j1)
                if keep is not None:  # dV sees the kept probabilities; dP reaches P through the same mask
                    keep = keep.to(q.device)
                    dp = dp * keep
                dvg[:, j0:j1] += torch.einsum("hgqk,hgqd->hkd", probs if keep is None else probs * keep,
                                              dog[:, :, i0:i1])
                ds = score.reference_grad(probs * (dp - delta[:, :, i0:i1, None]), y, p.softcap, bias)
                ds = ds.masked_fill(~visible, 0.0) * p.softmax_scale
                dqg[:, :, i0:i1] += torch.einsum("hgqk,hkd->hgqd", ds, kg_dq[:, j0:j1])
                dkg[:, j0:j1] += torch.einsum("hgqk,hgqd->hkd", ds, qg[:, :, i0:i1])
        dq[qs] = _ungrouped(dqg).to(q.dtype)
        dk[ks] = dkg.permute(1, 0, 2).to(k.dtype)
        dv[ks] = dvg.permute(1, 0, 2).to(v.dtype)
    return dq, dk, dv
