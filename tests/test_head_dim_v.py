"""V with a head dim of its own (MLA prefill's 192 / 128, and 128 / 64): outputs and gradients
against the float64 reference, in v1's kernels, v2's, v3's (the Gluon forward and two backward
passes on the GPU, v2's under the interpreter) and the PyTorch path."""
import pytest
import torch
from attention_check import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU

from flashtile import flash_attn_func, flash_attn_varlen_func, standard_attention
from attention_check import OUT_RULE, assert_within_rule

DTYPE = torch.bfloat16 if ON_GPU else torch.float16
PAIRS = [(192, 128), (128, 64), (192, 64)] if ON_GPU else [(48, 32), (32, 16), (24, 40)]


def qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v):
    q, k, _ = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, DTYPE, DEVICE)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim_v, dtype=DTYPE, device=DEVICE)
    return q, k, v


@pytest.mark.parametrize("head_dim, head_dim_v", PAIRS)
@pytest.mark.parametrize("version", ["v1", "v2", "v3", "tiled"])
@pytest.mark.parametrize("causal", [True, False])
def test_own_value_head_dim(version, causal, head_dim, head_dim_v):
    if version in ("v1", "tiled") and not ON_GPU and (head_dim_v != PAIRS[0][1] or not causal):
        pytest.skip("v1 and the PyTorch path: once is enough")
    torch.manual_seed(head_dim + head_dim_v)
    # GQA, lengths off the block sizes; on the GPU past one tile of the Gluon forward (128 rows)
    seqlen_q, seqlen_k = (37, 53) if not ON_GPU else (301, 517)
    q, k, v = qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, head_dim_v)
    out, lse, oracle_lse = check_against_reference(lambda a, b, c: flash_attn_func(
        a, b, c, causal=causal, version=version, return_attn_probs=True)[:2],
        q, k, v, causal=causal)
    assert out.shape == (2, seqlen_q, 4, head_dim_v)
    torch.testing.assert_close(lse, oracle_lse.float(), atol=1e-3, rtol=1e-3)


def test_own_value_head_dim_varlen_with_softcap():
    torch.manual_seed(0)
    head_dim, head_dim_v = PAIRS[0]
    lengths = [13, 30]
    q = torch.randn(sum(lengths), 2, head_dim, dtype=DTYPE, device=DEVICE)
    k = torch.randn(sum(lengths), 2, head_dim, dtype=DTYPE, device=DEVICE)
    v = torch.randn(sum(lengths), 2, head_dim_v, dtype=DTYPE, device=DEVICE)
    cu = torch.tensor([0, 13, 43], dtype=torch.int32, device=DEVICE)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, softcap=4.0, window_size=(8, 0))
    assert out.shape == (43, 2, head_dim_v)
    for s0, s1 in ((0, 13), (13, 43)):
        kw = dict(softcap=4.0, window_size=(8, 0))
        oracle = standard_attention(q[None, s0:s1], k[None, s0:s1], v[None, s0:s1], upcast=True, **kw)
        pt = standard_attention(q[None, s0:s1], k[None, s0:s1], v[None, s0:s1], **kw)
        assert_within_rule("out", out[None, s0:s1], pt, oracle, OUT_RULE)


def test_own_value_head_dim_refusals():
    q, k, v = qkv(1, 8, 8, 2, 2, 32, 16)
    with pytest.raises(ValueError, match="same shape but for the head dim"):
        flash_attn_func(q, k, v[:, :4])
    with pytest.raises(ValueError, match="v's head dim must be at most 256"):
        flash_attn_func(q, k, torch.randn(1, 8, 2, 264, dtype=DTYPE, device=DEVICE))
