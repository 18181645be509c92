"""V with a head dim of its own (MLA prefill's 192 / 128, and 128 / 64): outputs and gradients
against the float64 reference, in v2's kernels (which v3 hands them to) and the PyTorch path."""
import pytest
import torch
from attention_check import check_against_reference, make_qkv
from conftest import DEVICE, ON_GPU

from flashtile import flash_attn_func, flash_attn_varlen_func, standard_attention
from attention_check import OUT_RULE, assert_within_rule

DTYPE = torch.bfloat16 if ON_GPU else torch.float16
PAIRS = [(192, 128), (128, 64)] if ON_GPU else [(48, 32), (32, 16), (24, 40)]


def qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v):
    q, k, _ = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, DTYPE, DEVICE)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim_v, dtype=DTYPE, device=DEVICE)
    return q, k, v


@pytest.mark.parametrize("head_dim, head_dim_v", PAIRS)
@pytest.mark.parametrize("version", ["v2", "v3", "tiled"])
def test_own_value_head_dim(version, head_dim, head_dim_v):
    if version == "tiled" and head_dim_v != PAIRS[0][1]:
        pytest.skip("the PyTorch path once is enough")
    torch.manual_seed(head_dim + head_dim_v)
    q, k, v = qkv(2, 37, 53, 4, 2, head_dim, head_dim_v)  # GQA, lengths off the block sizes
    out, lse, _ = check_against_reference(lambda a, b, c: flash_attn_func(a, b, c, causal=True, version=version,
                                                                           return_attn_probs=True)[:2],
                                          q, k, v, causal=True)
    assert out.shape == (2, 37, 4, head_dim_v)


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
    with pytest.raises(NotImplementedError, match="version='v1' takes one head dim"):
        flash_attn_func(q, k, v, version="v1")
    with pytest.raises(ValueError, match="same shape but for the head dim"):
        flash_attn_func(q, k, v[:, :4])
    with pytest.raises(ValueError, match="v's head dim must be at most 256"):
        flash_attn_func(q, k, torch.randn(1, 8, 2, 264, dtype=DTYPE, device=DEVICE))
