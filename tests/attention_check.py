"""The FlashAttention accuracy rule and input builders shared by the tests.

Outputs: max |ours - oracle| <= 2 * max |pytorch - oracle| + 1e-5, where the oracle is
standard attention in float64 and "pytorch" the same standard attention in the input dtype.
Gradients: 3x + 1e-4 (the factors of flash-attention's own test suite).
"""
import torch

from flashtile import standard_attention

OUT_RULE = (2.0, 1e-5)
GRAD_RULE = (3.0, 1e-4)


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, device):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype, device=device)
    return q, k, v


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def assert_within_rule(name, ours, pytorch, oracle, rule):
    factor, atol = rule
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    err, err_pt = max_err(ours, oracle), max_err(pytorch, oracle)
    assert err <= factor * err_pt + atol, f"{name}: error {err:.3e} > {factor} x {err_pt:.3e} + {atol}"


def run_and_grad(fn, q, k, v, dout):
    """out, lse (or None) and (dq, dk, dv) of fn on fresh leaf copies of q, k, v."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    res = fn(*leaves)
    out, lse = res if isinstance(res, tuple) else (res, None)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse, grads


def check_against_reference(flash, q, k, v, rules=(OUT_RULE, GRAD_RULE), **mask):
    """Run flash(q, k, v) and the two references (standard_attention with ``mask``: causal,
    window_size, softcap) on the same inputs; assert the rules (output, gradients) everywhere."""
    dout = q.new_empty(*q.shape[:-1], v.shape[-1]).normal_()
    out, lse, grads = run_and_grad(lambda a, b, c: flash(a, b, c), q, k, v, dout)
    oracle, oracle_lse, oracle_grads = run_and_grad(
        lambda a, b, c: standard_attention(a, b, c, upcast=True, return_lse=True, **mask), q, k, v, dout.double())
    pt, _, pt_grads = run_and_grad(lambda a, b, c: standard_attention(a, b, c, **mask), q, k, v, dout)
    out_rule, grad_rule = rules
    assert_within_rule("out", out, pt, oracle, out_rule)
    for name, g, g_pt, g_ref in zip(("dq", "dk", "dv"), grads, pt_grads, oracle_grads):
        assert_within_rule(name, g, g_pt, g_ref, grad_rule)
    return out, lse, oracle_lse
