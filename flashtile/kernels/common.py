"""Jit helpers shared by the forward and backward kernels: tile loads and the causal mask."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))
LN2 = tl.constexpr(0.6931471805599453)  # ln(x) = log2(x) * ln(2)


@triton.jit
def load_tile(ptrs, rows, nrows, offs_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (len(rows), BLOCK_D) tile; rows >= nrows and columns >= HEAD_DIM read as 0.

    The masks are compile-time switches so that interior tiles of power-of-two head dims load with no
    predicate at all.
    """
    if CHECK_ROWS:
        if EVEN_D:
            tile = tl.load(ptrs, mask=rows[:, None] < nrows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < nrows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def store_tile(ptrs, tile, rows, nrows, offs_d, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr):
    """Store a (len(rows), BLOCK_D) tile, skipping rows >= nrows and padded head-dim columns."""
    if EVEN_D:
        tl.store(ptrs, tile, mask=rows[:, None] < nrows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < nrows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def causal_keep(rows, cols, causal_offset):
    """(len(rows), len(cols)) bool: query row i may see key j iff j <= i + seqlen_k - seqlen_q."""
    return cols[None, :] <= rows[:, None] + causal_offset


@triton.jit
def key_range(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key ranges of the query block [start_m, start_m + BLOCK_M).

    Returns (interior_end, keys_end): tiles in [0, interior_end) are in bounds and seen in full by every
    row (the mask-free stage); [interior_end, keys_end) needs masks; keys >= keys_end are seen by no row.
    """
    full_tiles_end = seqlen_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        causal_offset = seqlen_k - seqlen_q
        # Keys <= start_m + causal_offset are seen by every row of the block.
        interior_end = tl.minimum(tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N * BLOCK_N, full_tiles_end)
        keys_end = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_offset, 0), seqlen_k)
    else:
        interior_end = full_tiles_end
        keys_end = seqlen_k
    return interior_end, keys_end


@triton.jit
def query_range(start_n, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query ranges of the key block [start_n, start_n + BLOCK_N), in whole BLOCK_M tiles.

    Returns (masked_start, interior_start, rows_end): tiles in [masked_start, interior_start) straddle
    the causal diagonal and need the mask; rows in [interior_start, rows_end) see every key of the
    block. Rows past seqlen_q in the last tile are read as zeros with lse = +inf, so they add nothing.
    """
    rows_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        causal_offset = seqlen_k - seqlen_q
        first_row = tl.minimum(tl.maximum(start_n - causal_offset, 0), seqlen_q)
        masked_start = first_row // BLOCK_M * BLOCK_M
        full_row = tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0)
        interior_start = tl.minimum(tl.cdiv(full_row, BLOCK_M) * BLOCK_M, rows_end)
    else:
        masked_start = 0
        interior_start = 0
    return masked_start, interior_start, rows_end
