"""Attention dropout: which probabilities are kept, from a counter-based RNG (Philox).

One Philox-4x32-7 call (seven rounds, as FlashAttention-2 draws its dropout: Philox-4x32-7
passes BigCrush, and the rounds are most of dropout's cost in the kernels) gives 128 bits, eight
16-bit numbers, for eight keys of one query row: call 4g + q of a row covers keys
32g + 8w + 2q + h, taking half h of word w (w < 4, h < 2). That is the keys one thread of a Hopper warpgroup
MMA's accumulator holds (2q + h in each group of eight, four groups apart), so the Gluon kernels
draw their own numbers with no exchange between threads. The call for row r of query head h in
sequence b has the counter (call, r, b * heads_q + h, 0) and the seed as its key: every score
has its own number, whatever the tiles or the sequences' lengths. A score is kept when its
number is at least round(dropout_p * 2**16) (dropout_p rounded to a multiple of 2**-16) and then
scaled by 1 / (1 - dropout_p). Nothing is stored: the backward draws the same numbers from the
same seed. The seed is a one-element int64 tensor on the device, drawn from torch's generator
(``new_seed``): ``torch.manual_seed`` reproduces a run, a CUDA graph replays the draw, and no
value crosses to the host.
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashtile import options
from flashtile.kernels.launch import launch
from flashtile.kernels.problem import cdiv

KEYS_PER_CALL = tl.constexpr(8)
PHILOX_ROUNDS = tl.constexpr(7)
# Keys whose numbers a group of four calls draws: tiles of keys are multiples of it.
KEYS_PER_GROUP = tl.constexpr(32)


@triton.jit
def stream_of(SEED, batch, head, heads_q, dropout_p, DROPOUT: tl.constexpr):
    """What kept_scale reads for one (sequence, query head): (seed, its stream, dropout_p);
    without dropout nothing reads them."""
    stream = batch * heads_q + head
    seed = (stream * 0).to(tl.int64)
    if DROPOUT:
        seed = tl.load(SEED)
    return seed, stream, dropout_p


def seed_argument(p, placeholder):
    """The dropout's seed tensor, or a placeholder pointer without dropout (never read)."""
    return p.dropout_seed if p.dropout else placeholder


@triton.jit
def _numbers(seed, calls, rows, stream):
    """The 16-bit numbers of the keys of ``calls`` (..., groups, 4): call 4g + q of each row, as
    (..., 32 * groups) keys in order (the module doc's layout of a call's numbers)."""
    zero = calls * 0
    w0, w1, w2, w3 = tl.philox(seed, calls.to(tl.uint32), (zero + rows).to(tl.uint32),
                               (zero + stream).to(tl.uint32), zero.to(tl.uint32), PHILOX_ROUNDS)
    words = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # (..., q, x, y): word x + 2y
    numbers = tl.join(words & 0xFFFF, words >> 16)  # (..., q, x, y, h)
    numbers = tl.permute(numbers, (0, 1, 4, 3, 2, 5))  # (rows, g, y, x, q, h): key 32g + 8(x + 2y) + 2q + h
    return tl.reshape(numbers, (numbers.shape[0], numbers.shape[1] * KEYS_PER_GROUP))


@triton.jit
def threshold(dropout_p):
    """Numbers below it are dropped."""
    return tl.cast(dropout_p * 65536.0 + 0.5, tl.uint32)


@triton.jit
def kept_scale(seed, stream, rows, col0, dropout_p, BLOCK_COLS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """1 / (1 - dropout_p) where score (row, col) of ``stream`` (sequence * heads_q + query head)
    is kept, else 0: a (len(rows), BLOCK_COLS) tile for the keys col0 .. col0 + BLOCK_COLS - 1
    (col0 and BLOCK_COLS multiples of 32), or its transpose."""
    tl.static_assert(BLOCK_COLS % 32 == 0, "dropout takes tiles of keys in multiples of 32")
    calls = col0 // KEYS_PER_CALL + tl.arange(0, BLOCK_COLS // KEYS_PER_CALL)
    calls = tl.reshape(rows[:, None] * 0 + calls[None, :], (rows.shape[0], BLOCK_COLS // KEYS_PER_GROUP, 4))
    numbers = _numbers(seed, calls, rows[:, None, None], stream)
    scale = tl.where(numbers >= threshold(dropout_p), 1.0 / (1.0 - dropout_p), 0.0)
    if TRANSPOSED:
        scale = tl.trans(scale)
    return scale


@triton.jit
def key_scale(drop, rows, key):
    """kept_scale of one key ``key`` for ``rows`` (any layout): (seed, stream, dropout_p) = ``drop``."""
    seed, stream, dropout_p = drop
    zero = (rows * 0).to(tl.uint32)
    key = zero + key  # (a tensor whatever ``key`` is; 32 keys a group of calls, 8 a call)
    call = (key // 32) * 4 + (key % 8) // 2
    w0, w1, w2, w3 = tl.philox(seed, call, rows.to(tl.uint32), zero + stream.to(tl.uint32), zero, PHILOX_ROUNDS)
    w = (key // 8) % 4
    word = tl.where(w == 0, w0, tl.where(w == 1, w1, tl.where(w == 2, w2, w3)))
    number = (word >> (16 * (key % 2))) & 0xFFFF
    return tl.where(number >= threshold(dropout_p), 1.0 / (1.0 - dropout_p), 0.0)


@gluon.jit
def kept_mma(seed, stream, rows, col0, dropout_p, BLOCK_COLS: gl.constexpr, layout: gl.constexpr):
    """Which scores kept_scale keeps, for a Gluon kernel: the (len(rows), BLOCK_COLS) tile in
    ``layout``, a Hopper MMA accumulator's (``rows`` in its row slice).  Each thread draws the
    numbers of its own keys: the call indices are formed in the accumulator's layout and reduced
    over the axes each thread holds alone, so the tile comes back in ``layout`` without an
    exchange."""
    gl.static_assert(BLOCK_COLS % 32 == 0, "dropout takes tiles of keys in multiples of 32")
    ROWS: gl.constexpr = rows.shape[0]
    GROUPS: gl.constexpr = BLOCK_COLS // KEYS_PER_GROUP
    cols = gl.arange(0, BLOCK_COLS, layout=gl.SliceLayout(0, layout))
    # key 32g + 8(x + 2y) + 2q + h as (rows, g, y, x, q, h); its call col0 / 8 + 4g + q
    calls = (col0 // KEYS_PER_CALL + (cols // KEYS_PER_GROUP) * 4 + (cols % KEYS_PER_CALL) // 2)[None, :]
    calls = gl.reshape(rows[:, None] * 0 + calls, [ROWS, GROUPS, 2, 2, 4, 2])
    calls = gl.max(gl.max(gl.max(calls, 5), 3), 2)  # (rows, g, q): constant along y, x, h
    row_ids = gl.reshape(rows[:, None] + cols[None, :] * 0, [ROWS, GROUPS, 2, 2, 4, 2])
    row_ids = gl.max(gl.max(gl.max(row_ids, 5), 3), 2)
    return gl.convert_layout(_numbers(seed, calls, row_ids, stream), layout) >= threshold(dropout_p)


@triton.jit
def numbers_by_key(seed, groups, lanes, queries, stream):
    """The numbers of keys 16a + 8b + c (b < 2, c < 8) for ``queries``, as a (16 A, Q) tile in key
    order: a, c and the queries as (A, 8, Q) tensors.  One call serves both b (key bit 3): the
    keys one thread holds in an MMA accumulator with keys as its rows (c, c + 8 of each 16), so a
    Gluon kernel's transposed tile (kept_mma_t) draws each call once, in the thread that needs it."""
    zero = groups * 0
    calls = (groups // 2) * 4 + lanes // 2  # 4 (key // 32) + (key % 8) // 2
    w0, w1, w2, w3 = tl.philox(seed, calls.to(tl.uint32), queries.to(tl.uint32), (zero + stream).to(tl.uint32),
                               zero.to(tl.uint32), PHILOX_ROUNDS)
    upper = groups % 2 == 1  # key bit 4: words 2 and 3
    shift = 16 * (lanes % 2)  # key bit 0: the high half
    first = (tl.where(upper, w2, w0) >> shift) & 0xFFFF  # key bit 3 clear: word 2 (key bit 4)
    second = (tl.where(upper, w3, w1) >> shift) & 0xFFFF  # key bit 3 set: the word after it
    numbers = tl.permute(tl.join(first, second), (0, 3, 1, 2))  # (a, b, c, queries)
    return tl.reshape(numbers, (numbers.shape[0] * 16, numbers.shape[3]))


@gluon.jit
def kept_mma_t(seed, stream, keys, queries, dropout_p, layout: gl.constexpr):
    """kept_mma of a transposed tile, keys as rows: (len(keys), len(queries)) in ``layout``, a
    Hopper MMA accumulator's (``keys`` from a multiple of 16 in its row slice, ``queries`` in its
    column slice).  A thread holds keys c and c + 8 of each 16 there; one call serves both."""
    KEYS: gl.constexpr = keys.shape[0]
    QUERIES: gl.constexpr = queries.shape[0]
    gl.static_assert(KEYS % 16 == 0, "dropout takes tiles of keys in multiples of 16 here")
    shape: gl.constexpr = [KEYS // 16, 2, 8, QUERIES]  # key 16a + 8b + c
    key_ids = gl.max(gl.reshape(keys[:, None] + queries[None, :] * 0, shape), 1)  # 16a + 8 + c
    query_ids = gl.max(gl.reshape(keys[:, None] * 0 + queries[None, :], shape), 1)
    numbers = numbers_by_key(seed, key_ids // 16, key_ids % 8, query_ids, stream)
    return gl.convert_layout(numbers, layout) >= threshold(dropout_p)


@triton.jit
def _kept_kernel(SEED, KEPT, heads_q, seqlen_q, seqlen_k, dropout_p, BLOCK: tl.constexpr):
    """KEPT (batch, heads_q, seqlen_q, seqlen_k) int8: 1 where kept (rows of one (b, h) per program row)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    seed = tl.load(SEED)
    first = bh.to(tl.int64) * seqlen_q * seqlen_k
    for c0 in range(0, seqlen_k, BLOCK):
        scale = kept_scale(seed, bh, rows, c0, dropout_p, BLOCK, False)
        inside = (rows[:, None] < seqlen_q) & (c0 + cols[None, :] < seqlen_k)
        tl.store(KEPT + first + rows[:, None].to(tl.int64) * seqlen_k + c0 + cols[None, :], (scale > 0).to(tl.int8),
                 mask=inside)


def new_seed(device) -> torch.Tensor:
    """A fresh seed from torch's generator for ``device``, as a one-element int64 tensor there."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def kept(seed, batch, heads_q, seqlen_q, seqlen_k, dropout_p) -> torch.Tensor:
    """Bool (batch, heads_q, seqlen_q, seqlen_k): the probabilities the kernels keep under ``seed``
    (a seed in host memory outside the interpreter: drawn by ``kept_block``, in PyTorch)."""
    if seed.device.type == "cpu" and not options.interpreting():
        streams = torch.arange(batch * heads_q).view(batch, heads_q)
        return kept_block(int(seed), streams, torch.arange(seqlen_q), torch.arange(seqlen_k), dropout_p)
    out = torch.empty(batch, heads_q, seqlen_q, seqlen_k, dtype=torch.int8, device=seed.device)
    block = KEYS_PER_GROUP
    if out.numel():
        launch(_kept_kernel, (cdiv(seqlen_q, block), batch * heads_q), seed, out, heads_q, seqlen_q, seqlen_k,
               dropout_p, BLOCK=block)
    return out.bool()


# Philox-4x32's constants (triton.language.random's, whose tl.philox the kernels call).
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_WORD = 0xFFFFFFFF


def _product(a, b: int):
    """(high, low) 32-bit words of a * b, ``a`` an int64 tensor of 32-bit values, ``b`` a 32-bit
    constant, in 16-bit pieces (int64 holds no 64-bit unsigned product)."""
    a_lo, a_hi, b_lo, b_hi = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    middle = (lo_lo >> 16) + (hi_lo & 0xFFFF) + (lo_hi & 0xFFFF)
    return hi_hi + (hi_lo >> 16) + (lo_hi >> 16) + (middle >> 16), ((middle & 0xFFFF) << 16) | (lo_lo & 0xFFFF)


def philox(seed: int, c0, c1, c2, c3, rounds: int = PHILOX_ROUNDS.value):
    """tl.philox(seed, c0, c1, c2, c3, rounds) in PyTorch: the four 32-bit words (int64 tensors)
    of the counters ``c0``..``c3`` (int64 tensors of 32-bit values, broadcast together)."""
    k0, k1 = seed & _WORD, (seed >> 32) & _WORD
    for _ in range(rounds):
        high_b, low_b = _product(c2, _ROUND_B)
        high_a, low_a = _product(c0, _ROUND_A)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _KEY_A) & _WORD, (k1 + _KEY_B) & _WORD
    return c0, c1, c2, c3


def kept_block(seed: int, streams, rows, cols, dropout_p: float) -> torch.Tensor:
    """Bool (*streams.shape, len(rows), len(cols)): which scores the kernels keep, drawn in
    PyTorch (the PyTorch path's dropout, on CPU tensors): the module doc's numbers of keys
    ``cols`` (int64, consecutive) for query rows ``rows`` of each stream (sequence * heads_q +
    query head), each Philox call drawn once."""
    if not rows.numel() or not cols.numel():
        return torch.zeros(*streams.shape, rows.numel(), cols.numel(), dtype=torch.bool)
    first = int(cols[0]) // KEYS_PER_GROUP.value
    groups = int(cols[-1]) // KEYS_PER_GROUP.value - first + 1
    calls = first * 4 + torch.arange(groups * 4, dtype=torch.int64, device=cols.device)
    zero = torch.zeros((), dtype=torch.int64)
    words = torch.stack(philox(seed, calls, rows[:, None], streams[..., None, None], zero))
    # key 32g + 8w + 2q + h: call 4g + q (counted from the first group), word w, half h
    call = (cols // 32 - first) * 4 + (cols % 8) // 2
    picked = words[(cols // 8) % 4, ..., call].movedim(0, -1)  # (*streams, rows, cols)
    numbers = (picked >> (16 * (cols % 2))) & 0xFFFF
    threshold = int(torch.tensor(dropout_p, dtype=torch.float32) * 65536.0 + 0.5)
    return numbers >= threshold


def kept_scale_block(seed: int, streams, rows, cols, dropout_p: float) -> torch.Tensor:
    """kept_scale in PyTorch: float32 1 / (1 - dropout_p) where ``kept_block`` keeps, else 0."""
    scale = 1.0 / (1.0 - torch.tensor(dropout_p, dtype=torch.float32))
    return kept_block(seed, streams, rows, cols, dropout_p) * scale
