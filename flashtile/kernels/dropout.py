"""Attention dropout: which probabilities are kept, from a counter-based RNG (Philox).

One Philox-4x32-7 call (seven rounds, as FlashAttention-2 draws its dropout: Philox-4x32-7
passes BigCrush, and the rounds are most of dropout's cost in the kernels) gives 128 bits,
sixteen 8-bit numbers (FlashAttention-2's width too), for eight keys of two query rows eight
apart.  Rows come in pairs 16R + i and 16R + 8 + i (i < 8), pair 8R + i; call 4g + q of a pair
covers keys 32g + 8w + 2q + h (w < 4, h < 2), taking byte 2a + h of word w for row 16R + 8a + i.
Those are the scores one thread of a Hopper warpgroup MMA's accumulator holds (rows i and i + 8
of its warp's sixteen, columns 2q and 2q + 1 of each eight), so the Gluon kernels draw their own
numbers with no exchange between threads; a word's four numbers are two of the thread's
bf16x2 registers of P, masked four at a time (``dropped_mma``).  The call for pair P of query
head h in sequence b has the counter (call, P, b * heads_q + h, 0) and the seed as its key: every
score has its own number, whatever the tiles or the sequences' lengths (tiles of rows start at
multiples of 16, tiles of keys at multiples of 32).  dropout_p runs as a multiple of 1/256
(``rate``, applied once, in the API): a score is kept when its number is at least
dropout_p * 256, and then scaled by 1 / (1 - dropout_p), so the expectation is exact.  Nothing is
stored: the backward draws the same numbers from the same seed.  The seed is a one-element int64
tensor on the device, drawn from torch's generator (``new_seed``): ``torch.manual_seed``
reproduces a run, a CUDA graph replays the draw, and no value crosses to the host.
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
LEVELS = tl.constexpr(256)  # an 8-bit number's values: dropout_p runs as a multiple of 1 / LEVELS

# One Philox round with each 32 x 32-bit product one wide multiply (tl.philox's form takes two
# instructions a product, its high and low halves apart): $0..$3 the counters out, $4..$7 in,
# $8, $9 the round's key.
_PHILOX_ROUND = tl.constexpr("""{
.reg .b64 a, b;
.reg .b32 ah, al, bh, bl;
mul.wide.u32 a, $4, 0xD2511F53;
mul.wide.u32 b, $6, 0xCD9E8D57;
mov.b64 {al, ah}, a;
mov.b64 {bl, bh}, b;
xor.b32 bh, bh, $5;
xor.b32 $0, bh, $8;
mov.b32 $1, bl;
xor.b32 ah, ah, $7;
xor.b32 $2, ah, $9;
mov.b32 $3, al;
}""")
_WIDE_PRODUCTS = tl.constexpr(not options.interpreting())  # (the interpreter runs no PTX)


def rate(dropout_p: float) -> float:
    """The dropout rate the kernels run for ``dropout_p`` (in [0, 1)): the nearest multiple of
    1/256; one that rounds to 1 is refused."""
    levels = round(dropout_p * LEVELS.value)
    if levels >= LEVELS.value:
        raise ValueError(f"dropout_p={dropout_p}: dropout runs at multiples of 1/{LEVELS.value} (8-bit numbers, "
                         f"as FlashAttention-2's), and this one rounds to 1; take dropout_p below "
                         f"{(LEVELS.value - 0.5) / LEVELS.value}")
    return levels / LEVELS.value


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
def _philox(seed, c0, c1, c2, c3):
    """tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS) on uint32 counters (of one shape), each
    product in one instruction on a GPU."""
    if _WIDE_PRODUCTS:
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        for _ in tl.static_range(PHILOX_ROUNDS):
            c0, c1, c2, c3 = tl.inline_asm_elementwise(_PHILOX_ROUND, "=r,=r,=r,=r,r,r,r,r,r,r",
                                                       [c0, c1, c2, c3, k0 + c1 * 0, k1 + c1 * 0],
                                                       dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                       is_pure=True, pack=1)
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return c0, c1, c2, c3
    else:
        return tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS)


@triton.jit
def _words(seed, calls, pairs, stream):
    """Philox's four words of ``calls`` for row pairs ``pairs`` (broadcast together), as one
    tensor with (x, y) appended: word x + 2y."""
    zero = calls * 0 + pairs * 0
    w0, w1, w2, w3 = _philox(seed, (zero + calls).to(tl.uint32), (zero + pairs).to(tl.uint32),
                             (zero + stream).to(tl.uint32), zero.to(tl.uint32))
    return tl.join(tl.join(w0, w1), tl.join(w2, w3))


@triton.jit
def _pair_of(rows):
    """The row pair (module doc) of each row."""
    return (rows // 16) * 8 + rows % 8


@triton.jit
def _score_tile(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Per-score values of a draw as (R, i, g, q, x, y, a, h) -- calls (R, i, g, q), word x + 2y,
    byte 2a + h -- in tile order: (ROWS, COLS), row 16R + 8a + i, key 32g + 8(x + 2y) + 2q + h."""
    return tl.reshape(tl.permute(x, (0, 6, 1, 2, 5, 4, 3, 7)), (ROWS, COLS))


@triton.jit
def threshold(dropout_p):
    """Numbers below it are dropped (dropout_p a multiple of 1 / LEVELS)."""
    return tl.cast(dropout_p * LEVELS + 0.5, tl.uint32)


@triton.jit
def kept_scale(seed, stream, rows, col0, dropout_p, BLOCK_COLS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """1 / (1 - dropout_p) where score (row, col) of ``stream`` (sequence * heads_q + query head)
    is kept, else 0: a (len(rows), BLOCK_COLS) tile for the keys col0 .. col0 + BLOCK_COLS - 1
    (col0 and BLOCK_COLS multiples of 32; ``rows`` consecutive from a multiple of 16, a multiple
    of 16 of them), or its transpose."""
    tl.static_assert(BLOCK_COLS % 32 == 0, "dropout takes tiles of keys in multiples of 32")
    ROWS: tl.constexpr = rows.shape[0]
    tl.static_assert(ROWS % 16 == 0, "dropout takes tiles of rows in multiples of 16")
    pairs = tl.max(tl.reshape(_pair_of(rows), (ROWS // 16, 2, 8)), 1)  # (R, i)
    calls = tl.reshape(tl.arange(0, BLOCK_COLS // KEYS_PER_CALL) + col0 // KEYS_PER_CALL,
                       (BLOCK_COLS // KEYS_PER_GROUP, 4))  # (g, q)
    words = _words(seed, calls[None, None, :, :], pairs[:, :, None, None], stream)  # (R, i, g, q, x, y)
    # bytes 2a + h: (R, i, g, q, x, y, a, h)
    numbers = tl.join(tl.join(words & 0xFF, (words >> 16) & 0xFF), tl.join((words >> 8) & 0xFF, words >> 24))
    numbers = _score_tile(numbers, ROWS, BLOCK_COLS)
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
    w0, w1, w2, w3 = _philox(seed, call, zero + _pair_of(rows).to(tl.uint32), zero + stream.to(tl.uint32), zero)
    w = (key // 8) % 4
    word = tl.where(w == 0, w0, tl.where(w == 1, w1, tl.where(w == 2, w2, w3)))
    number = (word >> (8 * (2 * ((rows // 8) % 2) + key % 2))) & 0xFF
    return tl.where(number >= threshold(dropout_p), 1.0 / (1.0 - dropout_p), 0.0)


@triton.jit
def kept_bytes(numbers, dropout_p):
    """Four numbers a uint32 compared at once: each byte's top bit set where its number is kept
    (at least threshold: (n & 0x7F) + (0x80 - (t & 0x7F)) carries no byte into the next)."""
    t = threshold(dropout_p) * 0x01010101
    not_t = t ^ 0xFFFFFFFF  # (~t: the interpreter negates through a Python -1)
    low = (numbers & 0x7F7F7F7F) + (0x80808080 - (t & 0x7F7F7F7F))
    return (numbers & not_t) | ((numbers ^ not_t) & low)


@gluon.jit
def _sign_masks(flags, SELECTOR: gl.constexpr):
    """Masks from bytes' top bits by PRMT's sign replication, each nibble of ``SELECTOR`` 8 + k
    filling a byte with byte k's top bit: 0x9988 two 16-bit masks of bytes 0 and 1, 0xBBAA of
    bytes 2 and 3, 0x8888 .. 0xBBBB one 32-bit mask of byte 0 .. 3."""
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, " + SELECTOR + ";", "=r,r", [flags], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def kept_masks(seed, stream, rows, col0, dropout_p, BLOCK_COLS: gl.constexpr, layout: gl.constexpr):
    """Which scores kept_scale keeps, for a Gluon kernel: the (len(rows), BLOCK_COLS) tile in
    ``layout``, a Hopper MMA accumulator's (``rows`` in its row slice), as 16-bit masks (0xFFFF
    kept, 0 dropped).  Each thread draws the numbers of its own scores: the calls are formed in
    the accumulator's layout and reduced over the axes each thread holds alone, so the tile comes
    back in ``layout`` without an exchange.  A word's four bytes are compared at once
    (kept_bytes) and spread into masks by two byte permutations."""
    gl.static_assert(BLOCK_COLS % 32 == 0, "dropout takes tiles of keys in multiples of 32")
    ROWS: gl.constexpr = rows.shape[0]
    gl.static_assert(ROWS % 16 == 0, "dropout takes tiles of rows in multiples of 16")
    cols = gl.arange(0, BLOCK_COLS, layout=gl.SliceLayout(0, layout))
    shape: gl.constexpr = [ROWS // 16, 2, 8, BLOCK_COLS // KEYS_PER_GROUP, 2, 2, 4, 2]  # (R, a, i, g, y, x, q, h)
    calls = (col0 // KEYS_PER_CALL + (cols // KEYS_PER_GROUP) * 4 + (cols % KEYS_PER_CALL) // 2)[None, :]
    calls = gl.reshape(rows[:, None] * 0 + calls, shape)
    calls = gl.max(gl.max(gl.max(gl.max(calls, 7), 5), 4), 1)  # (R, i, g, q): constant along a, y, x, h
    pairs = gl.reshape(_pair_of(rows)[:, None] + cols[None, :] * 0, shape)
    pairs = gl.max(gl.max(gl.max(gl.max(pairs, 7), 5), 4), 1)
    flags = kept_bytes(_words(seed, calls, pairs, stream), dropout_p)  # (R, i, g, q, x, y)
    masks = gl.join(_sign_masks(flags, "0x9988"), _sign_masks(flags, "0xBBAA"))  # (..., a)
    masks = gl.join((masks & 0xFFFF).to(gl.uint16), (masks >> 16).to(gl.uint16))  # (..., a, h)
    return gl.convert_layout(_score_tile(masks, ROWS, BLOCK_COLS), layout)


@gluon.jit
def kept_mma(seed, stream, rows, col0, dropout_p, BLOCK_COLS: gl.constexpr, layout: gl.constexpr):
    """kept_masks as booleans: True where kept."""
    return kept_masks(seed, stream, rows, col0, dropout_p, BLOCK_COLS, layout) != 0


@gluon.jit
def dropped_mma(p, seed, stream, rows, col0, dropout_p, BLOCK_COLS: gl.constexpr, layout: gl.constexpr):
    """P (16-bit floats, in ``layout``) with the dropped probabilities zeroed: kept_masks ANDed
    into its bits, a bf16x2 register at a time."""
    masks = kept_masks(seed, stream, rows, col0, dropout_p, BLOCK_COLS, layout)
    return (p.to(gl.uint16, bitcast=True) & masks).to(p.dtype, bitcast=True)


@triton.jit
def words_by_key(seed, groups, quads, pairs, stream):
    """The numbers of keys 16A + 8b + 2c + h (b, h < 2, c < 4) for the query rows of pairs 8R + i
    (rows 16R + i and 16R + 8 + i), packed for a tile with keys as its rows: A, c and the pairs
    as (A, 4, R, 8) tensors, out (A, 4, R, 8, 2) with h appended, a uint32 whose byte 2a + b is
    the number of key 16A + 8b + 2c + h for row 16R + 8a + i.  One call serves all eight: words
    x + 2y of call 4 (key // 32) + c (y: key bit 4, x: key bit 3), byte 2a + h."""
    zero = groups * 0 + quads * 0 + pairs * 0
    calls = (groups // 2) * 4 + quads
    w0, w1, w2, w3 = _philox(seed, (zero + calls).to(tl.uint32), (zero + pairs).to(tl.uint32),
                             (zero + stream).to(tl.uint32), zero.to(tl.uint32))
    # Key bit 4 picks words 2 and 3 over 0 and 1, by masks rather than predicates (a tile of
    # predicates outlives the registers that hold them).
    upper = (zero - groups % 2).to(tl.uint32)  # all ones where key bit 4 is set
    first = w0 ^ ((w0 ^ w2) & upper)  # key bit 3 clear
    second = w1 ^ ((w1 ^ w3) & upper)  # key bit 3 set
    even = (first & 0x00FF00FF) | ((second & 0x00FF00FF) << 8)  # h = 0: bytes 0 and 2 of each
    odd = ((first >> 8) & 0x00FF00FF) | (second & 0xFF00FF00)  # h = 1: bytes 1 and 3
    return tl.join(even, odd)


@gluon.constexpr_function
def _key_bit0_in_registers(layout):
    """``layout`` (a linear layout of a keys x queries tile, a Hopper MMA accumulator's) with the
    lane that picks key bit 0 and the register that picks query bit 0 exchanged: a thread holds
    both keys 2c and 2c + 1, which one Philox call serves, and half the queries it held."""
    regs = [list(b) for b in layout.reg_bases]
    lanes = [list(b) for b in layout.lane_bases]
    r, l = regs.index([0, 1]), lanes.index([1, 0])
    regs[r], lanes[l] = [1, 0], [0, 1]
    return gl.DistributedLinearLayout(regs, lanes, [list(b) for b in layout.warp_bases],
                                      [list(b) for b in layout.block_bases], list(layout.shape))


@gluon.jit
def _quarters(x):
    """A keys x queries tile (keys 16A + 8b + c, queries 16R + 8a + i) as its four (A, 8, R, 8)
    views of one (b, a) each, (0, 0), (1, 0), (0, 1), (1, 1): what a thread of an MMA accumulator
    holds of each, one word of kept_words_t's."""
    KEYS: gl.constexpr = x.shape[0]
    QUERIES: gl.constexpr = x.shape[1]
    x = gl.permute(gl.reshape(x, [KEYS // 16, 2, 8, QUERIES // 16, 2, 8]), (0, 2, 3, 5, 1, 4))  # (A, c, R, i, b, a)
    a0, a1 = gl.split(x)
    b0a0, b1a0 = gl.split(a0)
    b0a1, b1a1 = gl.split(a1)
    return b0a0, b1a0, b0a1, b1a1


@gluon.jit
def kept_words_t(seed, stream, k0, m0, dropout_p, KEYS: gl.constexpr, QUERIES: gl.constexpr, layout: gl.constexpr):
    """Which scores of a transposed tile (keys k0 .. k0 + KEYS - 1 as rows, queries from m0; k0 and
    m0 multiples of 16; ``layout`` a Hopper MMA accumulator's) are kept, four to a word: an
    (A, 8, R, 8) tensor for keys 16A + 8b + c and queries 16R + 8a + i, byte 2a + b's top bit set
    where kept (kept_only_t applies it).  A thread of ``layout`` holds keys c and c + 8 of each 16,
    and one call serves keys 2c' and 2c' + 1 (words_by_key), which two threads hold: each draws
    the calls of half its query rows for both keys (a layout of its own), and kept_only_t's
    change of layout, one exchange of packed words within the warp, gives each its own."""
    gl.static_assert(KEYS % 16 == 0, "dropout takes tiles of keys in multiples of 16 here")
    gl.static_assert(QUERIES % 16 == 0, "dropout takes tiles of queries in multiples of 16")
    drawn: gl.constexpr = _key_bit0_in_registers(gl.to_linear_layout(layout, [KEYS, QUERIES]))
    keys = k0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, drawn))
    queries = m0 + gl.arange(0, QUERIES, layout=gl.SliceLayout(0, drawn))
    shape: gl.constexpr = [KEYS // 16, 2, 4, 2, QUERIES // 16, 2, 8]  # key 16A + 8b + 2c + h, query 16R + 8a + i
    key_ids = gl.max(gl.max(gl.max(gl.reshape(keys[:, None] + queries[None, :] * 0, shape), 5), 3), 1)
    query_ids = gl.max(gl.max(gl.max(gl.reshape(keys[:, None] * 0 + queries[None, :], shape), 5), 3), 1)
    words = words_by_key(seed, key_ids // 16, (key_ids % 8) // 2, _pair_of(query_ids), stream)  # (A, c, R, i, h)
    kept = kept_bytes(words, dropout_p)
    return gl.reshape(gl.permute(kept, (0, 1, 4, 2, 3)), [KEYS // 16, 8, QUERIES // 16, 8])  # (A, 2c + h, R, i)


@gluon.jit
def _kept_only(p, p_ds, kept, SELECTOR: gl.constexpr):
    """(``p`` where ``kept``'s byte (SELECTOR: _sign_masks' 0x8888 .. 0xBBBB) has its top bit
    set, else 0; |``p_ds``| with the sign bit set where it has not)."""
    mask = _sign_masks(kept, SELECTOR)
    p = p.to(gl.uint32, bitcast=True) & mask
    # One LOP3: p_ds's bits but the sign, the sign where the mask is clear.
    p_ds = gl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 0x7FFFFFFF, 0xB1;", "=r,r,r",
                                     [p_ds.to(gl.uint32, bitcast=True), mask], dtype=gl.uint32, is_pure=True, pack=1)
    return p.to(gl.float32, bitcast=True), p_ds.to(gl.float32, bitcast=True)


@gluon.jit
def kept_only_t(pT, pT_ds, kept):
    """P^T (float32; kept_words_t's keys and queries, in its layout) with the dropped
    probabilities 0, and P^T f' (``pT_ds``) as its magnitude with the sign bit set where dropped
    (FlashAttention-2's encoding, which carries the mask to dP^T without a register of its own),
    by kept_words_t's words ``kept``: three instructions a score."""
    layout: gl.constexpr = pT.type.layout
    p00, p10, p01, p11 = _quarters(pT)
    d00, d10, d01, d11 = _quarters(pT_ds)
    kept = gl.convert_layout(kept, p00.type.layout)
    p00, d00 = _kept_only(p00, d00, kept, "0x8888")
    p10, d10 = _kept_only(p10, d10, kept, "0x9999")
    p01, d01 = _kept_only(p01, d01, kept, "0xAAAA")
    p11, d11 = _kept_only(p11, d11, kept, "0xBBBB")
    return _whole(p00, p10, p01, p11, layout), _whole(d00, d10, d01, d11, layout)


@gluon.jit
def _whole(b0a0, b1a0, b0a1, b1a1, layout: gl.constexpr):
    """_quarters' inverse: the keys x queries tile, in ``layout``."""
    x = gl.join(gl.join(b0a0, b1a0), gl.join(b0a1, b1a1))  # (A, c, R, i, b, a)
    x = gl.reshape(gl.permute(x, (0, 4, 1, 2, 5, 3)), [x.shape[0] * 16, x.shape[2] * 16])
    return gl.convert_layout(x, layout)


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
    calls = first * 4 + torch.arange(groups * 4, dtype=torch.int64)
    pair = (rows // 16) * 8 + rows % 8
    first_pair = (int(rows[0]) // 16) * 8
    pairs = first_pair + torch.arange((int(rows[-1]) // 16) * 8 + 8 - first_pair, dtype=torch.int64)
    zero = torch.zeros((), dtype=torch.int64)
    words = torch.stack(philox(seed, calls, pairs[:, None], streams[..., None, None], zero))  # (4, *streams, P, C)
    # row 16R + 8a + i, key 32g + 8w + 2q + h: pair 8R + i, call 4g + q (counted from the first
    # group), word w, byte 2a + h
    call = (cols // 32 - first) * 4 + (cols % 8) // 2
    picked = words[((cols // 8) % 4)[None, :], ..., (pair - first_pair)[:, None], call[None, :]]
    picked = picked.movedim((0, 1), (-2, -1))  # (*streams, rows, cols)
    numbers = (picked >> (8 * (2 * ((rows[:, None] // 8) % 2) + cols[None, :] % 2))) & 0xFF
    return numbers >= round(dropout_p * LEVELS.value)


def kept_scale_block(seed: int, streams, rows, cols, dropout_p: float) -> torch.Tensor:
    """kept_scale in PyTorch: float32 1 / (1 - dropout_p) where ``kept_block`` keeps, else 0."""
    scale = 1.0 / (1.0 - torch.tensor(dropout_p, dtype=torch.float32))
    return kept_block(seed, streams, rows, cols, dropout_p) * scale
