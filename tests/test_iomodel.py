"""The IO model's counts against small cases computed by hand."""
from flashtile import iomodel
from flashtile.iomodel import Shape


def test_visited_pairs():
    assert iomodel.visited_pairs(256, 256, 64, 64, causal=False) == 16
    assert iomodel.visited_pairs(256, 256, 64, 64, causal=True) == 1 + 2 + 3 + 4
    # bottom-right alignment: 64 queries against 256 keys see every key block
    assert iomodel.visited_pairs(64, 256, 64, 64, causal=True) == 4


def test_standard_forward_bytes():
    # read Q, K (2 + 2 elements), write S (4), read S + write P (8), read P (4) and V (2), write O (2)
    assert iomodel.standard(Shape(1, 1, 2, 2, 1))["fwd_bytes"] == 2 * (2 + 2 + 4 + 8 + 4 + 2 + 2)


def test_v2_forward_bytes_and_flops():
    m = iomodel.v2(Shape(1, 1, 128, 128, 64), 64, 64)
    # 4 block pairs each read a 64x64 K and V tile; Q read and O written once; fp32 lse
    assert m["fwd_bytes"] == 4 * 2 * 64 * 64 * 2 + 2 * 128 * 64 * 2 + 128 * 4
    assert m["fwd_flops"] == 2 * 2 * 128 * 128 * 64


def test_v1_moves_more_than_v2_as_seqlen_grows():
    """Theorem 2: FA1's traffic grows like N^2 d^2 / M; v2 re-reads K/V instead of O, l, m."""
    small, large = Shape(1, 1, 1024, 1024, 128), Shape(1, 1, 8192, 8192, 128)
    ratio = lambda s: iomodel.v1(s, 128, 128)["fwd_bytes"] / iomodel.v2(s, 128, 128)["fwd_bytes"]  # noqa: E731
    assert ratio(large) > 1.0 and ratio(large) >= ratio(small) * 0.99


def test_flashattention_moves_fewer_bytes_than_standard():
    s = Shape(2, 8, 4096, 4096, 64, causal=True)
    model = iomodel.summary(s)
    assert model["v2"]["fwd_bytes"] < model["standard"]["fwd_bytes"] / 4
    assert model["v2"]["extra_memory_bytes"] < model["standard"]["extra_memory_bytes"] / 1000
