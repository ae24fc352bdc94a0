"""Jit helpers shared by the forward and backward kernels (and the FP8 copies: V's transposition, quantization):
tile loads, masks, score modifiers, ranges.

Positions: query row i and key column j of one sequence are compared through
``rel = j - (i + seqlen_k - seqlen_q)``, the key's offset from the query's bottom-right-aligned
diagonal. A key is visible iff ``-window_left <= rel <= window_right`` for the bounds that exist
(``LIMIT_LEFT``/``LIMIT_RIGHT``; causal is ``window_right = 0``).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))
LN2 = tl.constexpr(0.6931471805599453)  # ln(x) = log2(x) * ln(2)


@triton.jit
def await_prior_grids(PDL: tl.constexpr):
    """Under programmatic dependent launch (``configs.pdl_options``): wait until the previous kernel on the stream
    completed and its writes are visible, then let the next such kernel launch. First in a kernel that takes
    ``PDL``, before any access to global memory; nothing without it."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def bshd_tile(X, pid, tiles, seqlen, nheads, stride_b, stride_s, stride_h, stride_d,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ZEROS: tl.constexpr = False):
    """(batch, head, tokens, dims, mask, the tile) of program ``pid`` of a flat grid over a (batch, seqlen, nheads,
    headdim) tensor X of any strides: BLOCK_S tokens of one (batch, head), ``tiles`` programs to a head, consecutive
    programs on consecutive tiles of one head; masked elements read as 0 with ZEROS (a float8 tile takes no
    fill value), else undefined. Offsets in int64 (a keys-fastest tensor's stride_d is a whole sequence)."""
    pid_bh = pid // tiles
    batch = pid_bh // nheads
    head = pid_bh % nheads
    tokens = (pid % tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    mask = (tokens[:, None] < seqlen) & (dims[None, :] < HEAD_DIM)
    rows = X + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    ptrs = rows + tokens.to(tl.int64)[:, None] * stride_s + dims.to(tl.int64)[None, :] * stride_d
    if ZEROS:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = tl.load(ptrs, mask=mask)
    return batch, head, tokens, dims, mask, tile


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
def row_delta_and_lse2(o_ptrs, do_ptrs, Lse, Delta, Lse2, stats, rows, nrows, offs_d, HEAD_DIM: tl.constexpr,
                       EVEN_D: tl.constexpr):
    """The backward's row statistics of a (len(rows), BLOCK_D) tile of O and dO: delta = rowsum(dO * O) into
    Delta, and lse in log2 units into Lse2, a row that saw no key (lse = -inf) as +inf, so that every probability
    recomputed from it is exactly 0; ``stats``: the rows' offsets in Lse, Delta and Lse2. Rows >= nrows are
    neither stored nor read. Returns (dO as float32, delta) for a caller that needs more of the rows."""
    o = load_tile(o_ptrs, rows, nrows, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    do = load_tile(do_ptrs, rows, nrows, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    delta, _ = store_row_stats(o, do, Lse, Delta, Lse2, stats, rows, nrows)
    return do, delta


@triton.jit
def store_row_stats(o, do, Lse, Delta, Lse2, stats, rows, nrows):
    """``row_delta_and_lse2`` from tiles already loaded: o and do float32 (len(rows), BLOCK_D), zero past nrows.
    Returns (delta, lse₂) of the rows, 0 past nrows."""
    delta = tl.sum(o * do, 1)
    tl.store(Delta + stats, delta, mask=rows < nrows)
    lse2 = tl.load(Lse + stats, mask=rows < nrows, other=0.0) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    tl.store(Lse2 + stats, lse2, mask=rows < nrows)
    return delta, lse2


@triton.jit
def store_tile(ptrs, tile, rows, nrows, offs_d, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr):
    """Store a (len(rows), BLOCK_D) tile, skipping rows >= nrows and padded head-dim columns."""
    if EVEN_D:
        tl.store(ptrs, tile, mask=rows[:, None] < nrows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < nrows) & (offs_d[None, :] < HEAD_DIM))


# tanh(x) = x + x^3 * P(x^2) on |x| < TANH_POLY_BOUND: a least-squares fit of the relative error on Chebyshev
# nodes (within 1e-7 of tanh, fp32 rounding included). Past the bound, (1 - t) / (1 + t) with t = exp(-2|x|)
# >= 0.33 loses no digits to cancellation.
TANH_POLY_BOUND = tl.constexpr(0.55)
TANH_C1 = tl.constexpr(-0.33333317)
TANH_C2 = tl.constexpr(0.13332564)
TANH_C3 = tl.constexpr(-0.0538503)
TANH_C4 = tl.constexpr(0.02106414)
TANH_C5 = tl.constexpr(-0.00626437)


@triton.jit
def tanh(x):
    """tanh in float32, within a few ulp for every x (libdevice calls do not run in the interpreter).

    The plain ``1 - 2 / (exp(2x) + 1)`` cancels for small |x|: tanh(1e-6) came out 6% off, and a large
    softcap (scores / softcap tiny) multiplies that error back up (softcap 1e6: 5e-2 in out). Small |x|
    take an odd polynomial (exact to x for tiny x); the rest exp(-2|x|), which never overflows, with the
    sign put back: +-1 exactly for |x| past ~9.
    """
    a = tl.abs(x)
    t = tl.math.exp2(a * (-2.0 * LOG2E))
    large = (1.0 - t) / (1.0 + t)
    x2 = x * x
    poly = TANH_C1 + x2 * (TANH_C2 + x2 * (TANH_C3 + x2 * (TANH_C4 + x2 * TANH_C5)))
    small = x + x * (x2 * poly)
    return tl.where(a < TANH_POLY_BOUND, small, tl.where(x < 0.0, -large, large))


@triton.jit
def scores_log2(qk, rel, qk_scale, softcap_scale, softcap_log2, slope_log2,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Final scores of a tile in log2 units, and tanh of the capped scores (for the backward).

    score = softcap * tanh(qk * scale / softcap)   (or qk * scale)   - slope * |rel|   (ALiBi)
    ``softcap_scale = scale / softcap``, ``softcap_log2 = softcap * log2(e)``, ``slope_log2 = slope * log2(e)``.
    """
    if SOFTCAP:
        capped = tanh(qk * softcap_scale)
        scores = capped * softcap_log2
    else:
        capped = qk
        scores = qk * qk_scale
    if HAS_ALIBI:
        scores -= slope_log2 * tl.abs(rel).to(tl.float32)
    return scores, capped


@triton.jit
def scores_unscaled(qk, rel, qk_scale, softcap_scale, softcap_log2, slope_log2,
                    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """A tile's scores as (s, mult) with ``scores_log2 = s * mult`` and mult > 0, for the forward.

    The forward takes its row maximum over s and scales only that (max(s) * mult == max(s * mult) for
    mult > 0, rounding included), then forms ``exp2(s * mult - m)`` as one FMA per element: one
    multiply per element fewer than scaling the tile first. ALiBi's per-element bias leaves mult = 1.
    """
    if HAS_ALIBI:
        scores, _ = scores_log2(qk, rel, qk_scale, softcap_scale, softcap_log2, slope_log2, SOFTCAP, HAS_ALIBI)
        return scores, 1.0
    elif SOFTCAP:
        return tanh(qk * softcap_scale), softcap_log2
    else:
        return qk, qk_scale


@triton.jit
def row_descriptors(A_rows, B_rows, num_rows, stride_a, stride_b, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                    BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, A_host, B_host, HOST_TMA: tl.constexpr,
                    IS_VARLEN: tl.constexpr):
    """TMA descriptors of two (num_rows, HEAD_DIM) views of one sequence's rows — K and V, or Q and dO in
    the dK/dV pass — in BLOCK_ROWS-row tiles; or the plain pointers without TMA; or, with HOST_TMA, the
    descriptors the launcher made over the whole dense tensors (A_host, B_host; see ``load_rows``).

    The copy engine zero-fills rows past num_rows and columns past HEAD_DIM; the launcher checked the
    16-byte alignment it needs. Making one here writes it to global memory behind a fence: once per
    (program, head), not per loop, and 0.6-0.9 us of each program on an H200 (tma_setup_cost.py)."""
    if HOST_TMA:
        tl.static_assert(IS_VARLEN == 0, "host-made descriptors index dense rows from row 0")
        a_desc = A_host
        b_desc = B_host
    elif USE_TMA:
        a_desc = tl.make_tensor_descriptor(A_rows, shape=[num_rows, HEAD_DIM], strides=[stride_a, 1],
                                           block_shape=[BLOCK_ROWS, BLOCK_D])
        b_desc = tl.make_tensor_descriptor(B_rows, shape=[num_rows, HEAD_DIM], strides=[stride_b, 1],
                                           block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        a_desc = A_rows
        b_desc = B_rows
    return a_desc, b_desc


@triton.jit
def load_rows(desc, start, batch, head, HOST_TMA: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [start, start + BLOCK_ROWS) of one (sequence, head) through a TMA descriptor: one made in the
    kernel over that head's rows (``row_descriptors``), or with HOST_TMA one made on the host over the
    whole (batch, seqlen, heads, head_dim) tensor, in (1, BLOCK_ROWS, 1, BLOCK_D) boxes."""
    if HOST_TMA:
        return desc.load([batch, start, head, 0]).reshape(BLOCK_ROWS, BLOCK_D)
    else:
        return desc.load([start, 0])


@triton.jit
def score_constants(softmax_scale, softcap, Alibi, alibi_offset, HAS_ALIBI: tl.constexpr):
    """The multipliers of ``scores_log2``: scale*log2(e), scale/softcap, softcap*log2(e), slope*log2(e)."""
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + alibi_offset) * LOG2E
    else:
        slope_log2 = 0.0
    return softmax_scale * LOG2E, softmax_scale / softcap, softcap * LOG2E, slope_log2


@triton.jit
def visible_keys(rows, shift, seqlen_k, window_left, window_right, LIMIT_LEFT: tl.constexpr,
                 LIMIT_RIGHT: tl.constexpr):
    """Per query row, the keys it sees: [key_lo, key_hi), within [0, seqlen_k) and the window.

    Masking a tile then costs one compare per element against its row's bound (two with a left
    limit), where comparing each element's ``rel`` with the window and each key with seqlen_k took
    an add, two compares and the packing of two boolean tiles (about 7 instructions per element in
    the d=64 forward's diagonal tiles, ptxas for sm_90a). The windows are clamped to the longest offset
    a key can have (|rel| < max(seqlen_q, seqlen_k)), so the bounds stay in int32. key_lo is clamped at 0
    (no key lies left of it): the forward compares against ``key_lo - start_n - lane``, which could otherwise
    pass -2^31 with a left window past seqlen_k and more than 2^29 keys."""
    widest = seqlen_k + tl.abs(shift)
    key_hi = tl.zeros_like(rows) + seqlen_k
    if LIMIT_RIGHT:
        key_hi = tl.minimum(key_hi, rows + shift + tl.minimum(window_right, widest) + 1)
    key_lo = tl.zeros_like(rows)
    if LIMIT_LEFT:
        key_lo = tl.maximum(rows + shift - tl.minimum(window_left, widest), 0)
    return key_lo, key_hi


@triton.jit
def in_range(idx, lo, hi, CHECK_LO: tl.constexpr, CHECK_HI: tl.constexpr):
    """Bool (len(lo), len(idx)) tile: ``lo[i] <= idx[j] < hi[i]``, each side tested only where asked."""
    keep = tl.full((lo.shape[0], idx.shape[0]), 1, tl.int1)
    if CHECK_HI:
        keep = keep & (idx[None, :] < hi[:, None])
    if CHECK_LO:
        keep = keep & (idx[None, :] >= lo[:, None])
    return keep


@triton.jit
def in_tile_range(offs, lo, hi, CHECK_LO: tl.constexpr, CHECK_HI: tl.constexpr):
    """``in_range`` for ``offs`` a tile's own ``tl.arange`` (the caller moves the bounds by the tile's start).

    In the tensor-core accumulator layouts a thread's columns are 8·g + 2·(lane % 4) + e, so each element is
    compared as (8·g + e) against its row's bound less 2·(lane % 4): a constant against one value per row,
    where ``offs[j]`` itself kept the thread's column indices in registers across the key loop. The identity
    holds for any layout; only the saving depends on it."""
    lane = offs & 6
    own = offs - lane
    keep = tl.full((lo.shape[0], offs.shape[0]), 1, tl.int1)
    if CHECK_HI:
        keep = keep & (own[None, :] < hi[:, None] - lane[None, :])
    if CHECK_LO:
        keep = keep & (own[None, :] >= lo[:, None] - lane[None, :])
    return keep


@triton.jit
def visible_queries(keys, shift, seqlen_q, window_left, window_right, LIMIT_LEFT: tl.constexpr,
                    LIMIT_RIGHT: tl.constexpr):
    """Per key, the query rows that see it under the window: [query_lo, query_hi) (the transpose of
    ``visible_keys`` without the seqlen_k bound, for the key-stationary dK/dV pass; rows past seqlen_q
    add nothing there: their Q and dO rows load as zeros, and under ALiBi their lse is +inf)."""
    widest = seqlen_q + tl.abs(shift)
    query_lo = tl.zeros_like(keys)
    if LIMIT_RIGHT:
        query_lo = keys - shift - tl.minimum(window_right, widest)
    query_hi = tl.zeros_like(keys) + seqlen_q
    if LIMIT_LEFT:
        query_hi = keys - shift + tl.minimum(window_left, widest) + 1
    return query_lo, query_hi


@triton.jit
def key_range(row_lo, row_hi, seqlen_q, seqlen_k, window_left, window_right,
              BLOCK_N: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr):
    """Key ranges of the query rows [row_lo, row_hi) (one block of queries), in BLOCK_N tiles.

    Returns (lo, interior_lo, interior_hi, hi): [lo, interior_lo) and [interior_hi, hi) need masks,
    [interior_lo, interior_hi) are in-bounds tiles seen in full by every row (no mask at all); keys
    outside [lo, hi) are seen by no row and never visited.
    """
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_k
    interior_lo = 0
    interior_hi = seqlen_k // BLOCK_N * BLOCK_N
    if LIMIT_RIGHT:
        hi = tl.minimum(tl.maximum(row_hi + shift + window_right, 0), seqlen_k)
        interior_hi = tl.minimum(tl.maximum(row_lo + shift + window_right + 1, 0) // BLOCK_N * BLOCK_N, interior_hi)
    if LIMIT_LEFT:
        lo = tl.maximum(row_lo + shift - window_left, 0) // BLOCK_N * BLOCK_N
        interior_lo = tl.cdiv(tl.maximum(row_hi - 1 + shift - window_left, 0), BLOCK_N) * BLOCK_N
    interior_lo = tl.maximum(interior_lo, lo)
    empty = interior_lo >= interior_hi
    interior_lo = tl.where(empty, lo, interior_lo)
    interior_hi = tl.where(empty, lo, interior_hi)
    return lo, interior_lo, interior_hi, hi


@triton.jit
def query_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr):
    """Query ranges of the key block [start_n, start_n + BLOCK_N), in BLOCK_M tiles.

    Returns (lo, interior_lo, interior_hi, hi) as in :func:`key_range`. Rows past seqlen_q in the last
    tile read Q and dO as zeros (and, under ALiBi, lse = +inf), so they add nothing and need no mask.
    """
    shift = seqlen_k - seqlen_q
    rows_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    lo = 0
    hi = rows_end
    interior_lo = 0
    interior_hi = rows_end
    if LIMIT_RIGHT:
        lo = tl.minimum(tl.maximum(start_n - shift - window_right, 0), seqlen_q) // BLOCK_M * BLOCK_M
        interior_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift - window_right, 0), BLOCK_M) * BLOCK_M
    if LIMIT_LEFT:
        hi = tl.minimum(tl.maximum(start_n + BLOCK_N + window_left - shift, 0), seqlen_q)
        interior_hi = tl.minimum(tl.maximum(start_n - shift + window_left + 1, 0) // BLOCK_M * BLOCK_M, rows_end)
    interior_lo = tl.maximum(interior_lo, lo)
    empty = interior_lo >= interior_hi
    interior_lo = tl.where(empty, lo, interior_lo)
    interior_hi = tl.where(empty, lo, interior_hi)
    return lo, interior_lo, interior_hi, hi


@triton.jit
def sequence_bounds(Bounds, batch, seqlen, total, IS_VARLEN: tl.constexpr, IS_KEYS: tl.constexpr = False, Rows=0):
    """(start token, length) of sequence ``batch`` (kept within the ``total`` rows there are): IS_VARLEN 1
    reads int32 cumulative cu_seqlens (batch + 1,), 2 reads (batch, 2) int32 [start, length] bounds
    (cached or paged sequences); 0 (dense) gives the dense length. 3 (a KV cache read in place,
    ``flashtile.options.CacheLengths``) reads the keys' (IS_KEYS) bounds as int32 lengths (batch,),
    sequence b starting at row b * seqlen (seqlen: the cache's row stride, 0 for pages), and the
    queries' as in 2; 4 the same with sequence b's cache entry read from int32 ``Rows`` (cache_batch_idx),
    starting at row Rows[b] * seqlen."""
    if IS_VARLEN == 1:
        start = tl.load(Bounds + batch)
        length = tl.load(Bounds + batch + 1) - start
    if IS_VARLEN == 2 or (IS_VARLEN >= 3 and not IS_KEYS):
        start = tl.load(Bounds + 2 * batch)
        length = tl.load(Bounds + 2 * batch + 1)
    if IS_VARLEN == 3 and IS_KEYS:
        # int32, as the (batch, 2) bounds are: flash_attn_with_kvcache refuses a contiguous cache of 2**31
        # rows or more.
        start = batch * seqlen
        length = tl.load(Bounds + batch)
    if IS_VARLEN == 4 and IS_KEYS:
        # The entry clamped before the product, which keeps the divisibility of seqlen (see below).
        entry = tl.minimum(tl.maximum(tl.load(Rows + batch), 0), total // tl.maximum(seqlen, 1))
        start = entry * seqlen
        length = tl.load(Bounds + batch)
    if IS_VARLEN:
        # The host checks cu_seqlens values once per tensor, not on every call (interface.py): values
        # changed behind autograd's back must still not send a load or store outside the tensors.
        if IS_VARLEN < 3 or not IS_KEYS:
            # (A cache's start b * seqlen is no value read: within the rows by the cache's shape, and left
            # unclamped it keeps its divisibility, which vector loads of a keys-fastest V need.)
            start = tl.minimum(tl.maximum(start, 0), total)
        length = tl.minimum(tl.maximum(length, 0), total - start)
    else:
        start = 0
        length = seqlen
    return start, length


@triton.jit
def base_offset(batch, stride_b, head, stride_h, token, stride_t):
    """64-bit element offset of (batch, token, head): batch * stride and token * stride pass 2**31."""
    return batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + tl.cast(token, tl.int64) * stride_t


@triton.jit
def _splitmix64(z):
    """SplitMix64's output function of z (uint64): a bijection whose every output bit depends on every input bit."""
    z = z * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def dropout_keep(seed, row_start, col_start, rng_stride, dropout_p, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 KEYS_FIRST: tl.constexpr = False):
    """Bool (BLOCK_Q, BLOCK_K) tile, (BLOCK_K, BLOCK_Q) if KEYS_FIRST: which entries of the tile whose first query
    is counter row ``row_start`` and first key counter column ``col_start`` survive dropout. The tile's first
    query and key must sit at multiples of 16 in their sequence (every tile start is a multiple of its block).

    Counter-based, so the backward regenerates the forward's mask (``reference.dropout_keep``, bit for bit):
    entries (q, k), (q, k + 8), (q + 8, k), (q + 8, k + 8) with q, k at bit 3 clear share one 64-bit hash of the
    first one's counter ``row * rng_stride + col`` plus the seed (SplitMix64's output function), 16 bits each:
    bits [16 s, 16 s + 16) with s = 2 (q bit 3) + (k bit 3), kept where they reach ``ceil(dropout_p * 2**16)``.
    In Hopper's wgmma accumulator layout (its warps split only the rows) the thread holding one of the four holds
    all four, in either operand order, so Triton builds the tile from the hashes without moving data: one hash per
    four entries, where one hash an entry took three times the instructions (sm_90, 128 x 64). Where an sm_80 mma
    layout splits the columns between warps (8 columns at a time), column c + 8 sits in another warp and the mask
    goes through shared memory."""
    q_groups = tl.arange(0, BLOCK_Q // 16)[:, None] * 16 + tl.arange(0, 8)[None, :]  # (BLOCK_Q / 16, 8)
    k_groups = tl.arange(0, BLOCK_K // 16)[:, None] * 16 + tl.arange(0, 8)[None, :]
    return dropout_keep_groups(seed, row_start + q_groups, col_start + k_groups, rng_stride, dropout_p, BLOCK_Q,
                               BLOCK_K, KEYS_FIRST)


@triton.jit
def dropout_keep_groups(seed, q_groups, k_groups, rng_stride, dropout_p, BLOCK_Q: tl.constexpr,
                        BLOCK_K: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """``dropout_keep`` from the counter rows and columns of the tile's groups, (BLOCK_Q / 16, 8) and
    (BLOCK_K / 16, 8) int tensors, row_start + 16 i + j and col_start + 16 i + j (the Gluon backward passes its
    own, laid out for it: Gluon's ``arange`` takes a layout)."""
    tl.static_assert(BLOCK_Q % 16 == 0 and BLOCK_K % 16 == 0, "dropout tiles: multiples of 16 queries and keys")
    row_counters = q_groups.to(tl.int64) * rng_stride
    col_counters = k_groups.to(tl.int64) + seed
    if KEYS_FIRST:
        z = row_counters[None, None, :, :] + col_counters[:, :, None, None]
    else:
        z = row_counters[:, :, None, None] + col_counters[None, None, :, :]
    z = _splitmix64(z.to(tl.uint64))
    low = z.to(tl.uint32)
    high = (z >> 32).to(tl.uint32)
    threshold = tl.math.ceil(dropout_p * 65536.0).to(tl.uint32)
    keep_00 = (low & 0xFFFF) >= threshold  # (q, k)
    keep_01 = (low >> 16) >= threshold  # (q, k + 8)
    keep_10 = (high & 0xFFFF) >= threshold  # (q + 8, k)
    keep_11 = (high >> 16) >= threshold  # (q + 8, k + 8)
    # tl.join adds a last axis: (groups..., k bit, q bit), then each bit goes beside its 8 groups:
    # (q/16, 8, k/16, 8, k bit, q bit) -> (q/16, q bit, 8, k/16, k bit, 8), keys first the other way round.
    keep = tl.join(tl.join(keep_00, keep_01), tl.join(keep_10, keep_11))
    if KEYS_FIRST:  # (one return: Triton wants the same type from every return statement)
        keep = tl.reshape(tl.permute(keep, (0, 4, 1, 2, 5, 3)), (BLOCK_K, BLOCK_Q))
    else:
        keep = tl.reshape(tl.permute(keep, (0, 5, 1, 2, 4, 3)), (BLOCK_Q, BLOCK_K))
    return keep


@triton.jit
def rng_head_index(batch, head, nheads, IS_VARLEN: tl.constexpr):
    """The head's block of dropout counters: (batch, head) dense, the head alone when packed."""
    if IS_VARLEN:
        return head
    return batch * nheads + head


@triton.jit
def schedule(num_heads, heads_per_section, LONGEST_LAST_BLOCK: tl.constexpr):
    """(block, head index) of this program in a flat 1-D grid of ``num_blocks * num_heads`` programs.

    The grid is flat because a grid's second axis holds at most 65,535 programs, fewer than
    batch * heads of a large packed batch. Programs start in id order. The heads are cut into
    sections of ``heads_per_section``; within a section, block by block, all of its heads take that
    block before the next one. With one head per section (the launchers' choice without a causal
    limit) consecutive programs are the blocks of one head, which then re-read the same K/V from L2.
    Under a causal limit the blocks differ in work: the longest ones (the last query block with
    ``LONGEST_LAST_BLOCK``, else the first key block) go first, across a section of heads whose
    K/V still fit in L2 together, so the programs still running at the end are short ones.
    """
    num_blocks = tl.num_programs(0) // num_heads
    pid = tl.program_id(0)
    section_first = pid // (heads_per_section * num_blocks) * heads_per_section
    heads_here = tl.minimum(heads_per_section, num_heads - section_first)
    within = pid - section_first * num_blocks
    block = within // heads_here
    head_index = section_first + within % heads_here
    if LONGEST_LAST_BLOCK:
        block = num_blocks - 1 - block
    return block, head_index
