"""Which K/V blocks a Q tile visits (and the reverse): every masking rule in one place.

A query at position ``r`` (0-based inside its sequence) may attend to the key at ``c`` when
``dlo <= c - r <= dhi`` and ``c < n_cols``.  Causal and sliding-window attention are both
such a diagonal band, aligned bottom-right as in ``flash_attn``: with ``off = seqlen_k - seqlen_q``,
``dlo = off - window_left`` and ``dhi = off + window_right`` (causal means ``window_right = 0``;
a negative window means unbounded).

The backward kernels that iterate over Q for a fixed K tile use the same band with rows and
columns swapped: ``-dhi <= r - c <= -dlo``.
"""
import triton
import triton.language as tl


@triton.jit
def diagonal_band(seqlen_q, seqlen_k, window_left, window_right):
    """(dlo, dhi) of the band for one sequence; unbounded sides become a band edge no index reaches."""
    off = seqlen_k - seqlen_q
    unbounded = seqlen_q + seqlen_k
    left = tl.where(window_left < 0, unbounded, window_left)
    right = tl.where(window_right < 0, unbounded, window_right)
    return off - left, off + right


@triton.jit
def visited_blocks(r0, ROWS, COLS, n_cols, dlo, dhi):
    """For the row tile [r0, r0 + ROWS): the column blocks to visit, split into three segments.

    Returns (lo, full_lo, full_hi, hi): blocks in [lo, full_lo) and [full_hi, hi) need the
    element mask; blocks in [full_lo, full_hi) are entirely inside the band and the sequence, so
    the mask is skipped there.  Blocks outside [lo, hi) are never loaded.  Every bound is a
    multiple of COLS except ``hi`` (exclusive end of the loop).  Values are clamped before any
    division so that integer division never sees a negative operand.
    """
    lo = tl.maximum(r0 + dlo, 0) // COLS * COLS
    hi = tl.maximum(tl.minimum(r0 + ROWS + dhi, n_cols), 0)
    full_lo = (tl.maximum(r0 + ROWS - 1 + dlo, 0) + COLS - 1) // COLS * COLS
    full_hi = tl.maximum(tl.minimum(r0 + dhi + 1, n_cols), 0) // COLS * COLS
    empty = full_hi <= full_lo
    full_lo = tl.where(empty, tl.maximum(hi, lo), full_lo)
    full_hi = tl.where(empty, tl.maximum(hi, lo), full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def band_blocks(r0, ROWS, COLS, seqlen_q, seqlen_k, window_left, window_right, KEY_ROWS: tl.constexpr):
    """For the rows [r0, r0 + ROWS) of one sequence: the band (dlo, dhi) and the column blocks
    to visit, (lo, full_lo, full_hi, count) as in visited_blocks with ``count`` blocks from lo.

    Rows are queries and columns keys; KEY_ROWS swaps them (the K/V-stationary backward), so
    the band is read with rows and columns swapped.  For loops that count their blocks (the
    Gluon kernels) rather than step through [lo, hi)."""
    dlo, dhi = diagonal_band(seqlen_q, seqlen_k, window_left, window_right)
    if KEY_ROWS:
        lo, full_lo, full_hi, hi = visited_blocks(r0, ROWS, COLS, seqlen_q, -dhi, -dlo)
    else:
        lo, full_lo, full_hi, hi = visited_blocks(r0, ROWS, COLS, seqlen_k, dlo, dhi)
    count = (tl.maximum(hi - lo, 0) + COLS - 1) // COLS
    return dlo, dhi, lo, full_lo, full_hi, count


@triton.jit
def program_tile(seqlen, ROWS: tl.constexpr):
    """(batch x head, row block, row blocks per head) of this program in a 1-D grid of
    batch x heads x cdiv(seqlen, ROWS) programs, one head's row blocks adjacent: the programs
    resident together stream the same head's blocks through L2 (with the head varying fastest,
    each resident program read its own head from HBM at short sequences)."""
    return split_tile(tl.program_id(0), seqlen, ROWS)


@triton.jit
def split_tile(t, seqlen, ROWS: tl.constexpr):
    """program_tile's (batch x head, row block, row blocks per head) of tile ``t`` of that walk,
    for kernels whose programs each take several tiles."""
    blocks = tl.cdiv(seqlen, ROWS)
    return t // blocks, t % blocks, blocks


@triton.jit
def grouped_tile(t, batch_heads, head_group, blocks):
    """(batch x head, step) of tile ``t`` of a walk over batch_heads x blocks tiles in groups of
    ``head_group`` (batch, head) pairs: a group's tiles one step at a time, its heads adjacent
    within a step (the last group may be smaller).  A band's tiles taken in this order come
    longest first across the group, which keeps a greedy walk (the CTAs taking tiles as they
    free up) balanced; one head's tiles in a row would leave its short ones, and the next
    head's long ones, to the end of the walk.  ``head_group`` 1 is split_tile's order."""
    if head_group == 1:  # (a launch passing 1 makes it a constant: this branch alone is compiled)
        bh = t // blocks
        step = t % blocks
    else:
        group_tiles = head_group * blocks
        first = t // group_tiles * head_group
        heads_here = tl.minimum(head_group, batch_heads - first)
        r = t % group_tiles
        bh = first + r % heads_here
        step = r // heads_here
    return bh, step


@triton.jit
def band_mask(rows, cols, n_cols, dlo, dhi):
    """Element mask of a (rows x cols) tile: inside the band and inside the key sequence."""
    diff = cols[None, :] - rows[:, None]
    return (diff >= dlo) & (diff <= dhi) & (cols[None, :] < n_cols)


@triton.jit
def band_rows_mask(rows, cols, n_cols, dlo, dhi, LEFT_EDGE: tl.constexpr = True):
    """band_mask as two bounds per row (first and past-last key) rather than three tests on a
    difference: the per-row bounds are computed once per row, each element compared twice.
    LEFT_EDGE=False leaves out the first bound, for a band with no left edge (window_left < 0:
    dlo lies left of every key).  Each branch writes its comparisons out whole: the right bound
    shared ahead of the branch reorders the kernels' SASS (registers, not instruction counts)."""
    if LEFT_EDGE:
        return (cols[None, :] >= (rows + dlo)[:, None]) & (cols[None, :] < tl.minimum(rows + dhi + 1, n_cols)[:, None])
    return cols[None, :] < tl.minimum(rows + dhi + 1, n_cols)[:, None]


@triton.jit
def band_edge_masks(s, rows, offs, n0, COLS, n_cols, r_first, r_last, dlo, dhi, fill, LEFT_EDGE: tl.constexpr):
    """``s`` with ``fill`` outside band_mask, for the block of COLS columns from ``n0`` (``offs``:
    0..COLS-1) and rows ``rows`` (r_first to r_last); a block inside the band and the sequence
    for every row (left of no row's left edge, the last row's being the rightmost; inside the
    first row's right edge) comes back untouched.  Each element is compared with two bounds per
    row (band_rows_mask), not band_mask's three tests on a difference: about half the
    instructions on a causal diagonal block of the Gluon forward (SASS, d64).  LEFT_EDGE=False
    says the band has no left edge, so only the right edge and the sequence's end are tested
    (d64's masked block: 172 SASS instructions rather than 303)."""
    # Crossing the first row's right edge (or the sequence's end), or the last row's left edge.
    if LEFT_EDGE:
        crosses = (n0 < r_last + dlo) | (n0 + COLS > tl.minimum(r_first + dhi + 1, n_cols))
    else:
        crosses = n0 + COLS > tl.minimum(r_first + dhi + 1, n_cols)
    if crosses:
        # The columns are built inside the branch: built outside, their registers live through
        # the whole loop (spills).
        s = tl.where(band_rows_mask(rows, n0 + offs, n_cols, dlo, dhi, LEFT_EDGE), s, fill)
    return s


@triton.jit
def sequence_bounds(batch, cu_seqlens, seqlen, total, stride, IS_VARLEN: tl.constexpr):
    """Start row and length of sequence ``batch``: from its (start, end) in cu_seqlens (varlen)
    or the padded length.  ``stride`` 1: cu_seqlens is the offsets (batch + 1,), sequence b
    from entry b to entry b + 1; 2: one (start, end) pair per sequence (seqused).

    Varlen offsets are clamped to the ``total`` rows of the packed tensor, so a malformed table
    (one the host did not read: CUDA-graph capture) can never send a load outside it."""
    if IS_VARLEN:
        # The start is int64, like the batched branch's: start x row stride passes 2**31 once
        # a packed batch holds that many elements.  The length stays int32 (loop bounds, TMA).
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens + batch * stride), 0), total)
        end = tl.minimum(tl.maximum(tl.load(cu_seqlens + batch * stride + 1), start), total)
        return start.to(tl.int64), end - start
    else:
        return batch * 0, seqlen  # a zero of batch's type, so both branches agree


@triton.jit
def program_sequence(bh, heads, CU_Q, CU_K, seqlen_q, seqlen_k, totals, window_left, window_right,
                     IS_VARLEN: tl.constexpr):
    """Which (batch, head) a program works on, where its sequences start, their lengths, and the band.

    ``bh`` enumerates batch x heads (heads of q, or of k/v for K/V-parallel kernels);
    ``totals``: the rows of the packed q and k and the strides of their (start, end) entries
    in CU_Q and CU_K (varlen: Problem.totals).  Returns (batch, head, q_start,
    seqlen_q, k_start, seqlen_k, dlo, dhi); batch and head are int64 so that offsets into large
    tensors do not overflow.
    """
    batch = (bh // heads).to(tl.int64)
    head = (bh % heads).to(tl.int64)
    q_start, seqlen_q = sequence_bounds(batch, CU_Q, seqlen_q, totals[0], totals[2], IS_VARLEN)
    k_start, seqlen_k = sequence_bounds(batch, CU_K, seqlen_k, totals[1], totals[3], IS_VARLEN)
    dlo, dhi = diagonal_band(seqlen_q, seqlen_k, window_left, window_right)
    return batch, head, q_start, seqlen_q, k_start, seqlen_k, dlo, dhi
