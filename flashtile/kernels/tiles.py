"""Tile loads, stores and the online-softmax step, shared by every kernel version."""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def load_tile(ptrs, rows, n_rows, cols_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
              CHECK_ROWS: tl.constexpr, UPCAST: tl.constexpr):
    """Load a (rows x HEAD_DIM_PAD) tile, zero outside the sequence and the head dim.

    Masks are emitted only where needed (CHECK_ROWS, padded head dims) so that full tiles get
    unpredicated loads.  UPCAST converts to fp32: the CPU interpreter computes bf16 ``tl.dot``
    wrongly, fp32 exactly, so kernels run there on upcast tiles.
    """
    if CHECK_ROWS:
        if HEAD_DIM == HEAD_DIM_PAD:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == HEAD_DIM_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols_d[None, :] < HEAD_DIM, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def store_tile(ptrs, x, rows, n_rows, cols_d, HEAD_DIM: tl.constexpr):
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols_d[None, :] < HEAD_DIM))


@triton.jit
def as_operand(x, dtype, UPCAST: tl.constexpr):
    """Round x to the input dtype for the next matmul (kept in fp32 under the interpreter)."""
    x = x.to(dtype)
    if UPCAST:
        x = x.to(tl.float32)
    return x


# FP8: probabilities (at most 1) are multiplied by this before their cast to float8, so that small
# ones keep the type's normal range (FlashAttention-3's 2**8); the output divides it back out.
FP8_P_SCALE = tl.constexpr(256.0)
# The FP8 forwards' modes: descales per (sequence, KV head), or per block of their tiles.
FP8_PER_HEAD = tl.constexpr(1)
FP8_PER_BLOCK = tl.constexpr(2)


@triton.jit
def fp8_operand(x, dtype, UPCAST: tl.constexpr):
    """x (non-negative, within the type's range) rounded to the float8 ``dtype`` for the next
    matmul.  Under the interpreter (UPCAST) it is rounded to the type's grid in fp32 arithmetic
    (to nearest, ties to even, as the GPU's cast) and kept in fp32: the interpreter's cast to
    float8 drops a rounding carry into the exponent (125 becomes 64 in e4m3)."""
    if UPCAST:
        mantissa_bits = 3 if dtype == tl.float8e4nv else 2
        min_exponent = -6 if dtype == tl.float8e4nv else -14  # below it, the subnormals' fixed step
        exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, min_exponent)
        step = ((exponent - mantissa_bits + 127) << 23).to(tl.float32, bitcast=True)  # a power of two
        steps = x / step  # exact
        nearest = tl.floor(steps + 0.5)
        tie_to_odd = (nearest - steps == 0.5) & (nearest % 2 == 1)
        return tl.where(tie_to_odd, nearest - 1, nearest) * step
    return x.to(dtype)


@triton.jit
def fp8_signed_operand(x, dtype, UPCAST: tl.constexpr):
    """fp8_operand for values of either sign."""
    if UPCAST:
        magnitude = fp8_operand(tl.abs(x), dtype, True)
        return tl.where(x < 0, -magnitude, magnitude)
    return x.to(dtype)


TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: an all-zero block's amax


@triton.jit
def fp8_row_scaled(x, dtype, UPCAST: tl.constexpr):
    """A 2-D tile as the float8 ``dtype`` first operand of one matmul, with one descale per row
    ((rows, 1)): x is about operand * descale, each row's amax mapped to the type's largest
    value.  Rows are the product's output rows, so the descale multiplies the product's rows
    (the FP8 backward's dS, whose range varies from row to row; a row reduction stays within
    a few threads, where a tile's would cross warps)."""
    top = 448.0 if dtype == tl.float8e4nv else 57344.0
    # At least float32's smallest normal: an all-zero row (masked, or a padded token's dO) divides
    # by a number no denormal flush turns into 0.
    descale = tl.maximum(tl.max(tl.abs(x), 1) / top, TINY)[:, None]
    return fp8_signed_operand(x / descale, dtype, UPCAST), descale


@triton.jit
def values_product(p, v, dtype, UPCAST: tl.constexpr, MASKED: tl.constexpr):
    """p @ v for one K/V block, with the masking rule: a key of weight exactly 0 (masked, or
    past the sequence) contributes nothing, whatever its value.  A matrix product would make 0
    times an infinite value NaN; so a MASKED block multiplies its finite values only, and where
    the block holds a value that is not finite (rare) each row gets +inf, -inf or NaN in the
    columns where a key it weighs holds one (inf + -inf giving NaN, as IEEE sums do), key by key
    on the CUDA cores.  Blocks without masks see every key: the plain product."""
    p_op = as_operand(p, dtype, UPCAST)
    if MASKED:
        finite = (v - v) == 0  # inf - inf and NaN - NaN are NaN
        pv = tl.dot(p_op, tl.where(finite, v, tl.zeros_like(v)))
        if tl.sum((~finite).to(tl.int32)) > 0:
            pv += _non_finite_terms(p, v)
    else:
        pv = tl.dot(p_op, v)
    return pv


@triton.jit
def finite_or_zero(x):
    """``x`` with its values that are not finite replaced by 0: the keys of a block the band
    crosses as the backward's dQ = dS K takes them.  A pair outside the band has dS exactly 0,
    which times an infinite key would be NaN; a key that is not finite and that a row sees has
    made that row's dS NaN already, so nothing is hidden."""
    return tl.where((x - x) == 0, x, tl.zeros_like(x))


@triton.jit
def _non_finite_terms(p, v):
    """+inf, -inf or NaN where a row of ``p`` weighs (> 0) a key whose value in that column is
    +inf, -inf or NaN (both infinities: NaN), else 0."""
    keys = tl.arange(0, v.shape[0])
    pos = tl.zeros([p.shape[0], v.shape[1]], tl.int32)
    neg = tl.zeros([p.shape[0], v.shape[1]], tl.int32)
    nan = tl.zeros([p.shape[0], v.shape[1]], tl.int32)
    for j in range(v.shape[0]):
        weighs = tl.sum(tl.where(keys[None, :] == j, p, 0.0), 1) > 0
        vj = tl.sum(tl.where(keys[:, None] == j, v.to(tl.float32), 0.0), 0)
        pos |= (weighs[:, None] & (vj == float("inf"))[None, :]).to(tl.int32)
        neg |= (weighs[:, None] & (vj == float("-inf"))[None, :]).to(tl.int32)
        nan |= (weighs[:, None] & (vj != vj)[None, :]).to(tl.int32)
    return tl.where(pos != 0, float("inf"), 0.0) + tl.where(neg != 0, float("-inf"), 0.0) + \
        tl.where(nan != 0, float("nan"), 0.0)


@triton.jit
def row_delta(o, do, DLSE, stat, rows, n_rows, HAS_DLSE: tl.constexpr):
    """D = rowsum(dO * O) - dlse in fp32, for the backward's dS = P * (dP - D).

    d lse_i / d s_ij = P_ij, so a gradient reaching the logsumexp (dlse, read at ``stat``)
    folds into D: dS = P * (dP - D) + P * dlse = P * (dP - (D - dlse))."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + stat, mask=rows < n_rows, other=0.0)
    return delta


@triton.jit
def online_softmax_step(s, m_i, scale_log2):
    """One step of the online softmax on raw scores ``s`` (masked entries -inf).

    Works in the log2 domain: the row max is taken on the raw scores and scaled once per row
    (the scale is positive, so the max commutes with it), and each score's exponent is one
    fused multiply-add, s * scale_log2 - max.  Returns the unnormalised probabilities, the
    factor that rescales what was accumulated so far, and the new running max.  A row whose
    scores are all -inf so far keeps max -inf; its reference point is taken as 0 so that no
    ``-inf - (-inf)`` NaN appears.
    """
    return scaled_softmax_step(s, m_i, scale_log2, 0.0, None)


# 2**f on [-1/2, 1/2] as 1 + f (C1 + f (C2 + f C3)): exact at 0, largest relative error 1.02e-4
# in float32 (the coefficients fitted for it).
EXP2_C1 = tl.constexpr(0.6932829022407532)
EXP2_C2 = tl.constexpr(0.2422109693288803)
EXP2_C3 = tl.constexpr(0.05500893294811249)
# x + 1.5 * 2**23 holds round(x) in its low mantissa bits, for |x| < 2**22.
ROUNDING = tl.constexpr(12582912.0)


@triton.jit
def exp2_fma(x):
    """2**x for x <= 127 on the FMA pipe (FlashAttention-4's exponential), for a share of a
    tile's exponentials where the MUFU's 16 a clock per SM bound the softmax: x rounded to an
    integer n by adding 1.5 * 2**23, 2**(x - n) by a polynomial, n added into its exponent bits.
    Relative error 1.02e-4 at most from 2**-126 up; x of -127 or less (-inf) gives exactly +0.0."""
    x = tl.maximum(x, -127.0)
    j = x + ROUNDING
    f = x - (j - ROUNDING)
    p = 1.0 + f * (EXP2_C1 + f * (EXP2_C2 + f * EXP2_C3))
    bits = p.to(tl.uint32, bitcast=True) + (j.to(tl.uint32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def softmax_exponents(s, m_i, scale_log2, log2_factor, row_log2, row_max=None):
    """scaled_softmax_step before its exponentials: their arguments (log2 units), the running
    max's reference point (the rescale factor is 2**(m_i - it)) and the new running max, for a
    kernel that takes the exponentials its own way.  ``row_max``: the rows' maxima of ``s``
    where the caller takes them its own way (None: tl.max here)."""
    if row_max is None:
        row_max = tl.max(s, 1)
    if row_log2 is None:
        m_new = tl.maximum(m_i, row_max * scale_log2)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        x = s * scale_log2 - (m_ref - log2_factor)[:, None]
    else:
        m_new = tl.maximum(m_i, row_max * scale_log2 + row_log2)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        x = s * scale_log2 - (m_ref - row_log2 - log2_factor)[:, None]
    return x, m_ref, m_new


@triton.jit
def scaled_softmax_step(s, m_i, scale_log2, log2_factor, row_log2, row_max=None):
    """online_softmax_step with the probabilities multiplied by 2**log2_factor, inside their
    exponent (no extra instruction per score); the running max and the rescale factor as there.
    ``row_log2``: None, or a term per row (log2 units) that the logits add to s * scale_log2: the
    row part of a bias split into a column part (already in ``s``) and a row part, which costs
    instructions per row, not per score (score.one_side_logits).  ``row_max``: as
    softmax_exponents takes it."""
    x, m_ref, m_new = softmax_exponents(s, m_i, scale_log2, log2_factor, row_log2, row_max)
    return tl.math.exp2(x), tl.math.exp2(m_i - m_ref), m_new


@triton.jit
def finalize_rows(acc, m_i, l_i):
    """Divide once by the row sum; rows that saw no key give 0 and logsumexp +inf (natural log).

    +inf (as in flash_attn) makes the backward's exp(s - lse) exactly 0 for such rows.
    """
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    return out, lse
