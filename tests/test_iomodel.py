"""The IO model's counts against small cases computed by hand."""
from flashtile import iomodel
from flashtile.kernels import configs
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


def test_v1_split_backward_adds_partial_dq_traffic():
    # 128 x 128 at d64 with 64 x 64 tiles: 4 block pairs; each reads Q, O, dO (bf16), reads and
    # writes the fp32 dQ tile, reads m, l, D... (3 fp32 per row); K, V read, dK, dV written;
    # the 2 partial fp32 dQs read and dQ written once at the end.
    m = iomodel.v1(Shape(1, 1, 128, 128, 64), 64, 64, 64, 64, splits=2)
    per_pair = 64 * (3 * 64 * 2 + 2 * 64 * 4 + 3 * 4)
    assert m["bwd_bytes"] == 4 * per_pair + 4 * 128 * 64 * 2 + 128 * 64 * (2 * 4 + 2)


def test_regime_against_the_ceilings():
    # 4.26 GB at 4.26 TB/s is 1 ms, 387.5 GFLOP at 775 TFLOP/s 0.5 ms: memory-bound; a 2 ms run
    # reaches half of that bound.
    r = iomodel.regime(4.26e9, 387.5e9, 2.0, copy_tbps=4.26, matmul_tflops=775)
    assert r["bound"] == "memory"
    assert abs(r["roofline_pct"] - 50) < 1e-9 and abs(r["copy_pct"] - 50) < 1e-9
    assert abs(r["matmul_pct"] - 25) < 1e-9 and abs(r["tbps"] - 2.13) < 1e-9


def test_regime_rows_use_the_model_of_each_provider():
    rec = dict(b=4, h=16, h_k=16, sq=4096, sk=4096, d=128, causal=False, mode="bwd", ms=3.0)
    rows = iomodel.regime_rows([dict(rec, provider="flashtile-v2"), dict(rec, provider="sdpa-flash")])
    assert [r["provider"] for r in rows] == ["flashtile-v2"]
    model = iomodel.summary(Shape(4, 16, 4096, 4096, 128))["v2"]
    assert rows[0]["model_bytes"] == model["bwd_bytes"] and rows[0]["model_flops"] == model["bwd_flops"]


def test_v3_single_pass_backward_counts():
    # 128 x 128 at d64 with 64 x 64 tiles: 4 block pairs; D reads O and dO, writes one fp32 per
    # row; each pair reads a Q and a dO block, their lse and D, and adds a 64 x d fp32 dQ share;
    # K, V read and dK, dV written once; the fp32 dQ zeroed, read back and converted.  5 matmuls.
    m = iomodel.v3_single_pass_backward(Shape(1, 1, 128, 128, 64), 64, 64, 64, 64)
    assert m["bwd_bytes"] == (2 * 128 * 64 * 2 + 128 * 4 + 4 * 64 * (2 * 64 * 2 + 2 * 4 + 64 * 4)
                              + 4 * 128 * 64 * 2 + 128 * 64 * (2 * 4 + 2))
    assert m["bwd_flops"] == 5 * 2 * 128 * 128 * 64
    # v3 takes it at head dim 128 from GLUON_REDUCE_MIN_KEYS keys on, two passes (7 matmuls) below
    keys = configs.GLUON_REDUCE_MIN_KEYS[128]
    long, short = Shape(1, 16, keys, keys, 128), Shape(1, 16, keys // 2, keys // 2, 128)
    assert iomodel.summary(long)["v3"]["bwd_flops"] == 5 / 7 * iomodel.summary(long)["v2"]["bwd_flops"]
    assert iomodel.summary(short)["v3"]["bwd_flops"] == iomodel.summary(short)["v2"]["bwd_flops"]
