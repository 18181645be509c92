"""Bad input is refused with a clear error before any kernel launches."""
import pytest
import torch
from attention_check import make_qkv
from conftest import DEVICE

import flashtile
from flashtile import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func)
from flashtile.validation import check_sequence_span


@pytest.fixture
def qkv():
    return make_qkv(1, 16, 16, 2, 2, 32, torch.float16, DEVICE)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any error must come from validation: reaching the op fails the test."""
    def launched(*a, **kw):
        raise AssertionError("a kernel was launched on bad input")
    monkeypatch.setattr(flashtile.ops, "attention", launched)


def test_wrong_type(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attn_func(q.numpy() if DEVICE == "cpu" else q.tolist(), k, v)


def test_unsupported_dtype(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="float16 and torch.bfloat16"):
        flash_attn_func(q.float(), k.float(), v.float())


def test_mixed_dtypes(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attn_func(q, k.bfloat16(), v)


def test_mixed_devices(qkv):
    q, k, v = qkv
    other = torch.device("meta")
    with pytest.raises(ValueError, match="one device"):
        flash_attn_func(q, k.to(other), v)


def test_wrong_rank(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, seqlen, nheads, headdim\)"):
        flash_attn_func(q[0], k, v)


def test_head_dim_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="same head dim"):
        flash_attn_func(q[..., :16], k, v)


@pytest.mark.parametrize("head_dim", [4, 20, 264])
def test_head_dim_out_of_range(head_dim):
    q, k, v = make_qkv(1, 8, 8, 1, 1, head_dim, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="multiple of 8"):
        flash_attn_func(q, k, v)


def test_heads_not_divisible():
    q, k, v = make_qkv(1, 8, 8, 3, 2, 32, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="multiple of nheads of k/v"):
        flash_attn_func(q, k, v)


def test_k_v_shape_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attn_func(q, k, v[:, :8])


def test_batch_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="same batch size"):
        flash_attn_func(q, torch.cat([k, k]), torch.cat([v, v]))


def test_empty_sequence(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="empty"):
        flash_attn_func(q[:, :0], k, v)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p"),
    (dict(softcap=30.0), NotImplementedError, "softcap"),
    (dict(alibi_slopes=torch.ones(2)), NotImplementedError, "alibi_slopes"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=5), ValueError, "window_size"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(version="v9"), ValueError, "version must be one of"),
])
def test_bad_options(qkv, kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*qkv, **kwargs)


def test_packed_shapes(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seqlen, 3, nheads, headdim\)"):
        flash_attn_qkvpacked_func(torch.stack([q, k], dim=2))
    with pytest.raises(ValueError, match=r"kv must be \(batch, seqlen_k, 2, nheads_k, headdim\)"):
        flash_attn_kvpacked_func(q, k)


def _varlen(lengths=(5, 7)):
    total = sum(lengths)
    q = torch.randn(total, 2, 32, dtype=torch.float16, device=DEVICE)
    cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)
    return q, q.clone(), q.clone(), cu


@pytest.mark.parametrize("mutate, error, match", [
    (lambda cu: cu.long(), TypeError, "must be torch.int32"),
    (lambda cu: cu[None], ValueError, "must be 1-D"),
    (lambda cu: cu.flip(0), ValueError, "start at 0 and be non-decreasing"),
    (lambda cu: cu - cu, ValueError, "tokens"),
])
def test_bad_cu_seqlens(mutate, error, match):
    q, k, v, cu = _varlen()
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(q, k, v, mutate(cu), cu, 7, 7)


def test_varlen_max_seqlen_too_small():
    q, k, v, cu = _varlen()
    with pytest.raises(ValueError, match="longest sequence"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 7)


def test_varlen_batch_mismatch():
    q, k, v, cu = _varlen()
    cu_k = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="same length"):
        flash_attn_varlen_func(q, k, v, cu, cu_k, 7, 4)


def test_varlen_wrong_rank(qkv):
    q, k, v = qkv
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="3-D"):
        flash_attn_varlen_func(q, k, v, cu, cu, 16, 16)


def test_sequence_beyond_32_bit_row_offsets():
    # Shapes only (meta tensors): 2**20 rows x 16 heads x 128 = 2**31 elements in one sequence.
    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    q = meta(1, 2**20, 16, 128)
    with pytest.raises(ValueError, match="32-bit row offsets"):
        check_sequence_span(q, q, q, 2**20, 2**20, varlen=False)
    check_sequence_span(q[:, :-1], q[:, :-1], q[:, :-1], 2**20 - 1, 2**20 - 1, varlen=False)
    # A view whose rows are spread further apart than a contiguous tensor's counts its own stride;
    # one packed tighter than contiguous counts the contiguous layout its outputs may take.
    wide = meta(1, 2**19, 3, 16, 128)[:, :, 0]
    with pytest.raises(ValueError, match="q: one sequence spans"):
        check_sequence_span(wide, q[:, :1], q[:, :1], 2**19, 1, varlen=False)
    heads_outer = meta(1, 16, 2**20, 128).transpose(1, 2)
    with pytest.raises(ValueError, match="k: one sequence spans"):
        check_sequence_span(q[:, :1], heads_outer, heads_outer, 1, 2**20, varlen=False)
    packed = meta(2**20, 16, 128)
    with pytest.raises(ValueError, match="32-bit"):
        check_sequence_span(packed, packed, packed, 2**20, 2**20, varlen=True)
