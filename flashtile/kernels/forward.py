"""Forward kernel: online-softmax attention over streamed K/V tiles, writing out and lse.

One program owns BLOCK_M query rows of one (sequence, head). K/V tiles of BLOCK_N keys stream through in
three stages: masked tiles left of the interior (sliding window), the interior tiles that every row of
the block sees in full (no mask at all), and masked tiles right of it (the causal diagonal, the window's
right edge, the ragged end of the keys). Tiles that no row sees are never visited, so a sliding window
costs O(window), not O(seqlen). Statistics are float32 in base 2: ``softmax_scale * log2(e)`` is folded
into one multiply so each score costs a single ``exp2``.

Variants are compile-time switches of this one kernel: LIMIT_LEFT/LIMIT_RIGHT (window, causal), SOFTCAP,
HAS_ALIBI, IS_VARLEN (packed sequences with cu_seqlens), USE_TMA (Hopper copy engine for K/V), HAS_SINK,
PAGE_SIZE (paged KV cache), SPLIT_KV (flash-decoding), SPARSE_BLOCK, DROPOUT, and PACK_GQA: the query
heads that share a KV head become rows of one block (row r is query token r // group of head
kv_head * group + r % group), so one program reads each K/V tile once for the whole group. Decoding
(a few query tokens against a long cache) is bound by those reads; packing divides them by the group.
"""

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..layout import keys_fastest_memory
from ..options import SPARSE_BLOCK, CacheLengths, as_bounds, sparse_lists
from . import configs
from .common import (
    LN2,
    LOG2E,
    await_prior_grids,
    base_offset,
    bshd_tile,
    dropout_keep,
    in_tile_range,
    key_range,
    load_rows,
    load_tile,
    rng_head_index,
    row_descriptors,
    schedule,
    score_constants,
    scores_unscaled,
    sequence_bounds,
    store_tile,
    visible_keys,
)
from .kvcache import _cache_row

FP8_P_LOG2 = tl.constexpr(8.0)  # FP8 P is exp2(s - m + 8): see _fwd_tile


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, qk, start_n, v_desc, v_ptrs, offs_m, offs_n, key_lo, key_hi,
    seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2,
    HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, LIMIT_LEFT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, USE_TMA: tl.constexpr,
    seed, rng_row_base, rng_col_base, rng_stride, dropout_p, DROPOUT: tl.constexpr,
    batch, kv_head, HOST_TMA: tl.constexpr, stride_vd, DOT_TYPE: tl.constexpr, V_T: tl.constexpr = False,
):
    """Fold one key tile, whose raw scores ``qk = q k^T`` are given, into (acc, l_i, m_i): scale and
    modify the scores, mask them (MASKED), update the running max and sum, and add ``P V``.

    DOT_TYPE float8 (FP8 == 2): V was copied keys-fastest, (batch, heads, head_dim, keys) in memory. V_T: ``v_ptrs``
    is a (BLOCK_D, BLOCK_N) tile of pointers, V keys-fastest (an FP8 cache laid out so, FP8 == 3)."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    BLOCK_D: tl.constexpr = acc.shape[1]
    cols = start_n + offs_n
    rel = cols[None, :] - (offs_m[:, None] + shift)  # key offset from each row's diagonal (ALiBi)
    scores, mult = scores_unscaled(qk, rel, qk_scale, softcap_scale, softcap_log2, slope_log2, SOFTCAP, HAS_ALIBI)
    if MASKED:
        scores = tl.where(in_tile_range(offs_n, key_lo - start_n, key_hi - start_n, LIMIT_LEFT, True), scores,
                          float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1) * mult)  # log2 units
    if MASKED:
        # A row that has seen no key keeps m = -inf; subtract 0 instead to avoid inf - inf = NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    if DOT_TYPE == tl.float8e4nv:
        # FP8 P: exp2(s - m + 8), in (0, 256], as FA3 rounds it: float8_e4m3fn flushes values under 2^-9 to
        # zero and keeps 3 bits from 2^-6 up, so P in (0, 1] would lose every weight 6+ nats below a
        # dominant key (a sink token). l sums the same scaled P; the 2^8 cancels in out = acc / l and
        # leaves lse (FP8_P_LOG2).
        p = tl.math.exp2(scores * mult - (m_sub[:, None] - FP8_P_LOG2))
    else:
        p = tl.math.exp2(scores * mult - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if USE_TMA and DOT_TYPE == tl.float8e4nv:
        v = tl.trans(v_desc.load([batch, kv_head, 0, start_n]).reshape(BLOCK_D, BLOCK_N))
    elif USE_TMA:
        v = load_rows(v_desc, start_n, batch, kv_head, HOST_TMA, BLOCK_N, BLOCK_D)
    elif V_T:
        # Loaded as (head_dim, keys), the keys contiguous, and transposed in registers: a (keys, head_dim) load
        # of the same memory was not pipelined and read a byte at a time (triton 3.6).
        dims = tl.arange(0, BLOCK_D)
        if MASKED:
            keep = cols[None, :] < seqlen_k
            if not EVEN_D:
                keep = keep & (dims[:, None] < HEAD_DIM)
            v = tl.trans(tl.load(v_ptrs, mask=keep, other=0.0))
        elif EVEN_D:
            v = tl.trans(tl.load(v_ptrs))
        else:
            v = tl.trans(tl.load(v_ptrs, mask=dims[:, None] < HEAD_DIM, other=0.0))
    else:
        v = load_tile(v_ptrs, cols, seqlen_k, tl.arange(0, BLOCK_D), HEAD_DIM, MASKED, EVEN_D)
    if DROPOUT:
        # The normaliser l keeps every probability; only the weights applied to V are dropped.
        keep = dropout_keep(seed, rng_row_base, rng_col_base + start_n, rng_stride, dropout_p, offs_m.shape[0],
                            BLOCK_N)
        p = tl.where(keep, p, 0.0)  # (the survivors' 1 / (1 - p) is applied to the output row, once)
    if v.dtype != DOT_TYPE:  # an FP8 cache read in q's precision (FP8 == 1), through fp16 as k is
        v = v.to(tl.float16).to(DOT_TYPE)
    acc = tl.dot(p.to(DOT_TYPE), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _fwd_scores(q, k_desc, k_ptrs, start_n, offs_n, offs_d, seqlen_k, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
                MASKED: tl.constexpr, USE_TMA: tl.constexpr, batch, kv_head, HOST_TMA: tl.constexpr):
    """Raw scores ``q k^T`` of the key tile at start_n (k_ptrs: that tile's pointers when not USE_TMA)."""
    if USE_TMA:
        # The copy engine zero-fills rows past seqlen_k and columns past HEAD_DIM.
        k = load_rows(k_desc, start_n, batch, kv_head, HOST_TMA, offs_n.shape[0], offs_d.shape[0])
    else:
        k = load_tile(k_ptrs, start_n + offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
    if k.dtype != q.dtype:
        # An FP8 cache under bf16/fp16 queries (FP8 == 1), read in the queries' precision, through fp16: both
        # steps are exact, and sm89 has no direct float8 to bf16 conversion (ptxas fails on it).
        k = k.to(tl.float16).to(q.dtype)
    return tl.dot(q, tl.trans(k))


@triton.jit
def _write_new_keys(K_head, V_head, KNew_seq, VNew_seq, batch, Seqlens, seqlen_new, capacity, num_rows, stride_kn,
                    stride_vn, stride_knn, stride_vnn, offs_n, offs_d, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr):
    """A fused append's writes: rows [0, seqlen_new) of one (sequence, KV head) of KNew and VNew into that head's
    flattened cache rows (``K_head``, ``V_head``: the cache at the head's offset), at the rows and under the
    validity that ``kvcache._cache_row`` gives the append kernel's writes."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    for start in range(0, seqlen_new, BLOCK_N):
        rows = start + offs_n
        row, keep = _cache_row(tl.zeros_like(rows) + batch, rows, rows < seqlen_new, Seqlens, Seqlens, Seqlens, 0,
                               capacity, capacity, num_rows, 0, False)
        if EVEN_D:
            mask = keep[:, None]
        else:
            mask = keep[:, None] & (offs_d[None, :] < HEAD_DIM)
        new_k = tl.load(KNew_seq + rows.to(tl.int64)[:, None] * stride_knn + offs_d[None, :], mask=mask)
        tl.store(K_head + row[:, None] * stride_kn + offs_d[None, :], new_k, mask=mask)
        new_v = tl.load(VNew_seq + rows.to(tl.int64)[:, None] * stride_vnn + offs_d[None, :], mask=mask)
        tl.store(V_head + row[:, None] * stride_vn + offs_d[None, :], new_v, mask=mask)


@triton.jit
def _fwd_kv_loop(
    acc, l_i, m_i, q,
    K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn, Pages, k_start,
    start_n_lo, start_n_hi, offs_m, offs_n, offs_d,
    seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    USE_TMA: tl.constexpr, PAGE_SIZE: tl.constexpr,
    seed=0, rng_row_base=0, rng_col_base=0, rng_stride=0, dropout_p=0.0, DROPOUT: tl.constexpr = False,
    batch=0, kv_head=0, HOST_TMA: tl.constexpr = False, stride_vd=1, DOT_TYPE: tl.constexpr = None,
    V_T: tl.constexpr = False, NEW_KEYS: tl.constexpr = False, keys_end=0, KNew_at=0, VNew_at=0, stride_knn=0,
    stride_vnn=0, pool_pages=1,
):
    """Fold keys [start_n_lo, start_n_hi) into the running (acc, l_i, m_i) of one query block.

    MASKED=False is the interior stage: every row sees every key of each tile and keys are in bounds.
    With PAGE_SIZE > 0 the keys live in a paged pool of ``pool_pages`` pages: key j of the sequence is row
    ``Pages[(k_start + j) // PAGE_SIZE] * PAGE_SIZE + (k_start + j) % PAGE_SIZE`` of K_seq and V_seq, the page
    clamped into the pool (values the host did not read this call stay inside the tensors). V_T: V is
    keys-fastest (stride_vn 1), its tiles loaded as (head_dim, keys). NEW_KEYS (a fused append's tiles from the
    first that holds a new key; masked, by pointers, 16-bit V with unit stride_vd): the cache holds keys
    [0, keys_end), keys [keys_end, seqlen_k) are read from the new keys' rows, key j at row j - keys_end of
    ``KNew_at`` and ``VNew_at`` (addressed from key 0, so before their first row: a bare address, never read;
    addressing each row from the first instead took 11 more registers a thread at d = 64 on sm90), in the same
    tiles as from the cache: one row pointer each, so a tile is one load (a load of each source and a select held
    both tiles in registers).
    """
    k_ptrs = K_seq + tl.cast(start_n_lo, tl.int64) * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :]
    # An FP8 V may be keys-fastest (the FP8 forward's copy, or an FP8 cache laid out so,
    # ``flashtile.fp8.zeros_cache``): d * stride_vd can then pass 2**31.
    V_FP8: tl.constexpr = V_seq.dtype.element_ty == tl.float8e4nv
    if V_T:
        v_ptrs = (V_seq + offs_d.to(tl.int64)[:, None] * stride_vd
                  + (tl.cast(start_n_lo, tl.int64) + offs_n[None, :]) * stride_vn)
    else:
        v_ptrs = V_seq + tl.cast(start_n_lo, tl.int64) * stride_vn + offs_n[:, None] * stride_vn
        if V_FP8:
            v_ptrs += offs_d.to(tl.int64)[None, :] * stride_vd
        else:
            v_ptrs += offs_d[None, :] * stride_vd  # stride_vd: 1, specialized away
    key_lo, key_hi = visible_keys(offs_m, shift, seqlen_k, window_left, window_right, LIMIT_LEFT, LIMIT_RIGHT)
    # (NEW_KEYS: two stages, not the kernel's three: 80/145/212 registers a thread at d = 64/128/256 on sm90 against
    # 87/147/212, so that at d = 64 registers allow the six programs a multiprocessor that shared memory does.)
    for start_n in tl.range(start_n_lo, start_n_hi, BLOCK_N, num_stages=2 if NEW_KEYS else None):
        cols = start_n + offs_n
        if NEW_KEYS:
            # Each row from the cache or, from keys_end on, from the new keys' tensors.
            fresh = cols >= keys_end
            k_rows = tl.where(fresh, KNew_at + cols.to(tl.int64) * stride_knn, K_seq + cols.to(tl.int64) * stride_kn)
            v_rows = tl.where(fresh, VNew_at + cols.to(tl.int64) * stride_vnn, V_seq + cols.to(tl.int64) * stride_vn)
            k_ptrs = k_rows[:, None] + offs_d[None, :]
            v_ptrs = v_rows[:, None] + offs_d[None, :]
        if PAGE_SIZE > 0:
            position = k_start + cols
            page = tl.load(Pages + position // PAGE_SIZE, mask=cols < seqlen_k, other=0)
            page = tl.minimum(tl.maximum(page, 0), pool_pages - 1).to(tl.int64)
            rows = page * PAGE_SIZE + position % PAGE_SIZE
            k_ptrs = K_seq + rows[:, None] * stride_kn + offs_d[None, :]
            if V_T:  # paged: never FP8 == 2, but maybe an FP8 cache keys-fastest
                v_ptrs = V_seq + offs_d.to(tl.int64)[:, None] * stride_vd + rows[None, :] * stride_vn
            elif V_FP8:
                v_ptrs = V_seq + rows[:, None] * stride_vn + offs_d.to(tl.int64)[None, :] * stride_vd
            else:
                v_ptrs = V_seq + rows[:, None] * stride_vn + offs_d[None, :] * stride_vd
        qk = _fwd_scores(q, k_desc, k_ptrs, start_n, offs_n, offs_d, seqlen_k, HEAD_DIM, EVEN_D, MASKED,
                         USE_TMA, batch, kv_head, HOST_TMA)
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, qk, start_n, v_desc, v_ptrs, offs_m, offs_n, key_lo, key_hi,
            seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2,
            HEAD_DIM, EVEN_D, MASKED, LIMIT_LEFT, SOFTCAP, HAS_ALIBI, USE_TMA,
            seed, rng_row_base, rng_col_base, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA,
            stride_vd, DOT_TYPE, V_T,
        )
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.autotune(
    configs=configs.fwd_configs(),
    key=["SEQ_BUCKET_Q", "SEQ_BUCKET_K", "HEAD_DIM", "LIMIT_LEFT", "LIMIT_RIGHT", "SOFTCAP", "HAS_ALIBI",
         "IS_VARLEN", "USE_TMA", "HAS_SINK", "PAGE_SIZE", "SPLIT_KV", "SPARSE_BLOCK", "DROPOUT", "PACK_GQA",
         "HOST_TMA", "FP8", "APPEND"],
    prune_configs_by={"early_config_prune": configs.fwd_prune},
    do_bench=configs.autotune_bench,
)
# The packed row counts only clamp the bounds, and the dropout seed is random: neither worth a compiled variant per
# value class (a seed divisible by 16 compiled another variant of each dropout kernel, at a random step).
@triton.jit(do_not_specialize=["total_q", "total_k", "seed"])
def _attn_fwd(
    Q, K, V, Out, Lse, BoundsQ, BoundsK, Alibi, Sink, BlockTable, SparseCount, SparseIndex, KHost, VHost,
    QDescale, KDescale, VDescale, KNew, VNew,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h, stride_alibi_b, stride_block_table, stride_out_split, stride_lse_split,
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh, seqlen_new,
    nheads, seqlen_q, seqlen_k, gqa_group, total_q, total_k, softmax_scale, window_left, window_right, softcap,
    sparse_rows, sparse_cols, seed, dropout_p, rng_rows_per_head, rng_stride,
    num_head_programs, heads_per_section,
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # autotune keys only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, HAS_SINK: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr, SPARSE_BLOCK: tl.constexpr, DROPOUT: tl.constexpr, PACK_GQA: tl.constexpr,
    HOST_TMA: tl.constexpr, FP8: tl.constexpr, APPEND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    await_prior_grids(PDL)  # (programmatic dependent launch: configs.pdl_options)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    # FP8 1: K and V are float8_e4m3fn (a quantized KV cache) read in q's precision, bf16/fp16, or in fp16
    # (exact for float8 values) when q is float8 too; 3: the same with V keys-fastest (stride_vn 1); 2: q, k, v
    # float8_e4m3fn, both products on FP8 tensor cores, P rounded to float8 before P V.
    Q_FP8: tl.constexpr = Q.dtype.element_ty == tl.float8e4nv
    FP8_CACHE: tl.constexpr = FP8 == 1 or FP8 == 3
    if FP8_CACHE:
        DOT_TYPE: tl.constexpr = tl.float16 if Q_FP8 else Q.dtype.element_ty
    else:
        DOT_TYPE: tl.constexpr = V.dtype.element_ty
    # Causal rows near the bottom see the most keys: those start first so the tail is short.
    pid_m, pid_bh = schedule(num_head_programs, heads_per_section, LIMIT_RIGHT)
    if PACK_GQA:
        # One program per (sequence, KV head); `head` is the group's first query head.
        batch = pid_bh // (nheads // gqa_group)
        kv_head = pid_bh % (nheads // gqa_group)
        head = kv_head * gqa_group
    else:
        batch = pid_bh // nheads
        head = pid_bh % nheads
        kv_head = head // gqa_group
    start_m = pid_m * BLOCK_M
    capacity = seqlen_k  # (APPEND: the cache's length, its row stride)
    # (PAGE_SIZE > 0: seqlen_k is the pool's page count, a paged sequence's keys start at its logical position 0)
    pool_pages = seqlen_k
    q_start, seqlen_q = sequence_bounds(BoundsQ, batch, seqlen_q, total_q, IS_VARLEN)
    # (IS_VARLEN 4: each sequence's cache entry in the block table's slot, unused without pages)
    k_start, seqlen_k = sequence_bounds(BoundsK, batch, 0 if PAGE_SIZE > 0 else seqlen_k, total_k, IS_VARLEN, True,
                                        BlockTable)
    # APPEND (flash_attn_with_kvcache's new keys, fused): the contiguous cache holds the sequence's first cached_k
    # keys (BoundsK: cache_seqlens), its seqlen_new next ones are read from KNew and VNew, which this launch also
    # writes into the cache after them. No program reads those rows of the cache in this launch, so the writes
    # need no ordering against the reads (with checked cache_seqlens: unchecked values past the cache, which the
    # append kernel's path would also turn into garbage, can put one sequence's reads on another's new rows).
    cached_k = seqlen_k
    if APPEND:
        seqlen_k = cached_k + seqlen_new
    num_rows = seqlen_q * gqa_group if PACK_GQA else seqlen_q
    if start_m >= num_rows:
        return  # packed sequences shorter than the longest one

    offs_r = start_m + tl.arange(0, BLOCK_M)  # the block's rows
    if PACK_GQA:
        offs_m = offs_r // gqa_group  # each row's query token
        head_of_row = offs_r % gqa_group  # and its head within the group
        row_lo = start_m // gqa_group
        row_hi = (start_m + BLOCK_M - 1) // gqa_group + 1
    else:
        offs_m = offs_r
        row_lo = start_m
        row_hi = start_m + BLOCK_M
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # 64-bit base offsets: batch * stride and row * stride can pass 2**31 elements.
    Q_seq = Q + base_offset(batch, stride_qb, head, stride_qh, q_start, stride_qm)
    if PAGE_SIZE > 0:
        # Paged pool: rows are found through this sequence's block table, tile by tile.
        K_seq = K + kv_head.to(tl.int64) * stride_kh
        V_seq = V + kv_head.to(tl.int64) * stride_vh
        Pages = BlockTable + batch.to(tl.int64) * stride_block_table
    else:
        K_seq = K + base_offset(batch, stride_kb, kv_head, stride_kh, k_start, stride_kn)
        V_seq = V + base_offset(batch, stride_vb, kv_head, stride_vh, k_start, stride_vn)
        Pages = BlockTable
    if APPEND:
        KNew_seq = KNew + batch.to(tl.int64) * stride_knb + kv_head.to(tl.int64) * stride_knh
        VNew_seq = VNew + batch.to(tl.int64) * stride_vnb + kv_head.to(tl.int64) * stride_vnh
        # One program of each (sequence, KV head) writes its new keys: the first query block's first split (its
        # group's first head where heads are not packed).
        writes = (pid_m == 0) & (tl.program_id(1) == 0)
        if not PACK_GQA:
            writes = writes & (head % gqa_group == 0)
        if writes:
            _write_new_keys(K + kv_head.to(tl.int64) * stride_kh, V + kv_head.to(tl.int64) * stride_vh, KNew_seq,
                            VNew_seq, batch, BoundsK, seqlen_new, capacity, total_k, stride_kn, stride_vn, stride_knn,
                            stride_vnn, offs_n, offs_d, HEAD_DIM, EVEN_D)
    if PACK_GQA:
        q_ptrs = Q_seq + offs_m.to(tl.int64)[:, None] * stride_qm + head_of_row[:, None] * stride_qh + offs_d[None, :]
    else:
        q_ptrs = Q_seq + start_m.to(tl.int64) * stride_qm + tl.arange(0, BLOCK_M)[:, None] * stride_qm
        q_ptrs += offs_d[None, :]
    q = load_tile(q_ptrs, offs_r, num_rows, offs_d, HEAD_DIM, True, EVEN_D)
    if FP8_CACHE and Q_FP8:
        q = q.to(DOT_TYPE)
    tl.static_assert(not HOST_TMA or PAGE_SIZE == 0, "host-made descriptors index dense keys")
    tl.static_assert(FP8 != 2 or HOST_TMA or not USE_TMA, "keys-fastest V: host-made descriptors only")
    k_desc, v_desc = row_descriptors(K_seq, V_seq, cached_k, stride_kn, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA,
                                     KHost, VHost, HOST_TMA, IS_VARLEN)

    if FP8:
        # Per (sequence, kv head) factors: x = x_fp8 * descale. The raw scores carry q's and k's, folded
        # into the softmax scale (so softcap and the lse see true scores); v's scales the output.
        descale_index = batch.to(tl.int64) * (nheads // gqa_group) + kv_head
        softmax_scale = softmax_scale * tl.load(KDescale + descale_index)
        if Q_FP8:
            softmax_scale = softmax_scale * tl.load(QDescale + descale_index)
        v_scale = tl.load(VDescale + descale_index)
    else:
        v_scale = 1.0
    qk_scale, softcap_scale, softcap_log2, slope_log2 = score_constants(
        softmax_scale, softcap, Alibi, batch * stride_alibi_b + head, HAS_ALIBI)
    if PACK_GQA and HAS_ALIBI:
        slope_log2 = (tl.load(Alibi + batch * stride_alibi_b + head + head_of_row) * LOG2E)[:, None]  # per row
    shift = seqlen_k - seqlen_q
    lo, interior_lo, interior_hi, hi = key_range(row_lo, row_hi, seqlen_q, seqlen_k, window_left, window_right,
                                                 BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
    split = 0
    if SPLIT_KV:
        # Split-KV: this program takes one BLOCK_N-aligned chunk of the keys; every stage is clipped to
        # it. Partial (out, lse) go to scratch and a combine kernel merges them by lse.
        split = tl.program_id(1)
        chunk = tl.cdiv(tl.cdiv(seqlen_k, tl.num_programs(1)), BLOCK_N) * BLOCK_N
        split_lo = split * chunk
        split_hi = tl.minimum(split_lo + chunk, seqlen_k)
        lo = tl.minimum(tl.maximum(lo, split_lo), split_hi)
        interior_lo = tl.minimum(tl.maximum(interior_lo, split_lo), split_hi)
        interior_hi = tl.minimum(tl.maximum(interior_hi, split_lo), split_hi)
        hi = tl.minimum(tl.maximum(hi, split_lo), split_hi)
        Out += split.to(tl.int64) * stride_out_split
        Lse += split.to(tl.int64) * stride_lse_split

    if HAS_SINK:
        # The sink is one more score per row, with no value: it starts the running max and sum (of the
        # first split only, so that merging splits counts it once).
        first = split == 0
        if PACK_GQA:
            sink_log2 = tl.load(Sink + head + head_of_row) * LOG2E
        else:
            sink_log2 = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sink + head) * LOG2E
        m_i = tl.where(first, sink_log2, float("-inf"))
        l_i = tl.where(first, tl.full([BLOCK_M], 1.0, dtype=tl.float32), 0.0)
        if FP8 == 2:
            l_i = l_i * (2.0 ** FP8_P_LOG2)  # l in P's scale (``_fwd_tile``)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Dropout counters: row (sequence, head, query token) times rng_stride plus the key token; here the row of
    # the block's first query.
    rng_row_base = rng_head_index(batch, head, nheads, IS_VARLEN).to(tl.int64) * rng_rows_per_head + q_start + start_m
    if SPARSE_BLOCK > 0:
        # Block-sparse: only the key tiles this row block's mask turns on, each with the usual masks.
        row_block = pid_bh.to(tl.int64) * sparse_rows + start_m // SPARSE_BLOCK
        for i in range(0, tl.load(SparseCount + row_block)):
            col_start = tl.load(SparseIndex + row_block * sparse_cols + i) * SPARSE_BLOCK
            acc, l_i, m_i = _fwd_kv_loop(
                acc, l_i, m_i, q, K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn, Pages, k_start,
                tl.maximum(col_start, lo), tl.minimum(col_start + SPARSE_BLOCK, hi), offs_m, offs_n, offs_d,
                seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
                HEAD_DIM, BLOCK_N, EVEN_D, True, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA, PAGE_SIZE,
                seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA,
                stride_vd, DOT_TYPE, FP8 == 3, pool_pages=pool_pages,
            )
    else:
        if APPEND:
            # The stages below take the tiles before the first that holds a new key (fresh_start) as they are; that
            # tile and the ones after it, masked, read the new keys from KNew and VNew (key j at row j - cached_k):
            # the same tiles in the same order as the cache would give them after an append.
            fresh_start = cached_k // BLOCK_N * BLOCK_N
            first_end = tl.minimum(interior_lo, fresh_start)
            interior_end = tl.maximum(tl.minimum(interior_hi, fresh_start), interior_lo)
            tail_end = tl.minimum(hi, fresh_start)
        else:
            first_end = interior_lo
            interior_end = interior_hi
            tail_end = hi
        if LIMIT_LEFT:
            acc, l_i, m_i = _fwd_kv_loop(
                acc, l_i, m_i, q, K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn, Pages, k_start,
                lo, first_end, offs_m, offs_n, offs_d,
                seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
                HEAD_DIM, BLOCK_N, EVEN_D, True, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA, PAGE_SIZE,
                seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA,
                stride_vd, DOT_TYPE, FP8 == 3, pool_pages=pool_pages,
            )
        if FP8_CACHE:
            # An FP8 cache's V may be positions-fastest (``flashtile.fp8.zeros_cache``): its tiles load as vectors
            # only from starts known to be aligned. Interior tiles start at multiples of BLOCK_N (key_range; the
            # split clipping above can move interior_lo off them only to where the interior is empty).
            interior_lo = tl.multiple_of(interior_lo, BLOCK_N)
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn, Pages, k_start,
            interior_lo, interior_end, offs_m, offs_n, offs_d,
            seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
            HEAD_DIM, BLOCK_N, EVEN_D, False, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA, PAGE_SIZE,
            seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA,
            stride_vd, DOT_TYPE, FP8 == 3, pool_pages=pool_pages,
        )
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn, Pages, k_start,
            interior_end, tail_end, offs_m, offs_n, offs_d,
            seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
            HEAD_DIM, BLOCK_N, EVEN_D, True, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA, PAGE_SIZE,
            seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA,
            stride_vd, DOT_TYPE, FP8 == 3, pool_pages=pool_pages,
        )
        if APPEND:
            acc, l_i, m_i = _fwd_kv_loop(
                acc, l_i, m_i, q, K_seq, V_seq, K_seq, V_seq, stride_kn, stride_vn, Pages, k_start,
                tl.maximum(lo, fresh_start), hi, offs_m, offs_n, offs_d,
                seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
                HEAD_DIM, BLOCK_N, EVEN_D, True, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, False, 0,
                seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, False,
                stride_vd, DOT_TYPE, False, True, cached_k, KNew_seq - cached_k.to(tl.int64) * stride_knn,
                VNew_seq - cached_k.to(tl.int64) * stride_vnn, stride_knn, stride_vnn,
            )

    # Rows that saw no key (l = 0) output 0 and lse = -inf. One reciprocal per row and a multiply per
    # element: a division per element is an IEEE-rounded division sequence, ~100 of the epilogue's ~350
    # instructions per warp in the d=64 (64, 64) tile (ptxas for sm_90a), for an error below bf16/fp16's.
    seen = l_i != 0.0  # (a NaN sum, from a NaN score, keeps the row's lse NaN: "> 0" would say it saw no key)
    if DROPOUT:
        v_scale = v_scale / (1.0 - dropout_p)  # the surviving weights' scale (``_fwd_tile``)
    out = acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None]
    if FP8 == 2:
        l_i_log2 = tl.math.log2(l_i) - FP8_P_LOG2  # l was summed in P's scale (``_fwd_tile``)
    else:
        l_i_log2 = tl.math.log2(l_i)
    lse = tl.where(seen, (m_i + l_i_log2) * LN2, float("-inf"))
    O_seq = Out + base_offset(batch, stride_ob, head, stride_oh, q_start, stride_om)
    lse_ptrs = Lse + batch.to(tl.int64) * stride_lse_b + head.to(tl.int64) * stride_lse_h + q_start + offs_m
    if PACK_GQA:
        o_ptrs = O_seq + offs_m.to(tl.int64)[:, None] * stride_om + head_of_row[:, None] * stride_oh + offs_d[None, :]
        lse_ptrs += head_of_row.to(tl.int64) * stride_lse_h
    else:
        o_ptrs = O_seq + start_m.to(tl.int64) * stride_om + tl.arange(0, BLOCK_M)[:, None] * stride_om
        o_ptrs += offs_d[None, :]
    store_tile(o_ptrs, out.to(Out.dtype.element_ty), offs_r, num_rows, offs_d, HEAD_DIM, EVEN_D)
    tl.store(lse_ptrs, lse, mask=offs_r < num_rows)


_PLACEHOLDERS: list[torch.Tensor] = []  # every cached placeholder (kept by launch plans: placeholder_ids)


def placeholder_ids() -> set[int]:
    """ids of the cached placeholder tensors, which a recorded launch plan may keep as arguments."""
    return {id(t) for t in _PLACEHOLDERS}


@functools.cache
def _cached_placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    made = _make_placeholder(dtype, device)
    _PLACEHOLDERS.append(made)
    return made


def _make_placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Outside a CUDA graph's private pool: while torch.compile's CUDA graphs warm up, a kept tensor allocated
    # there is an untracked allocation, which cudagraph trees reject. (Imported here: the interface layer
    # imports the kernels lazily too.)
    from ..interface import made_outside_graph_pool

    return made_outside_graph_pool(lambda: torch.empty(1, dtype=dtype, device=device), device)


def placeholder(dtype: torch.dtype, device) -> torch.Tensor:
    """A one-element tensor for a pointer argument that the compiled variant never reads (no ALiBi, no
    varlen bounds, no block mask): one per (dtype, device) instead of an allocation per launch. Made
    afresh while a CUDA graph is captured, so no cached tensor lives in a graph's private pool."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(1, dtype=dtype, device=device)
    return _cached_placeholder(dtype, device)


def variant_args(opts, batch: int, device) -> tuple[list, dict]:
    """Runtime scalars and compile-time switches of an AttentionOptions, shared by every launcher."""
    left, right = opts.left_limit, opts.right_limit
    alibi = opts.alibi_slopes
    if alibi is not None:
        alibi = alibi.float().contiguous()
        stride_alibi_b = alibi.stride(0) if alibi.dim() == 2 else 0
    else:
        alibi, stride_alibi_b = placeholder(torch.float32, device), 0
    scalars = [opts.softmax_scale, left or 0, right or 0, opts.softcap if opts.softcap > 0 else 1.0]
    switches = dict(LIMIT_LEFT=left is not None, LIMIT_RIGHT=right is not None, SOFTCAP=opts.softcap > 0,
                    HAS_ALIBI=opts.alibi_slopes is not None,
                    SPARSE_BLOCK=SPARSE_BLOCK if opts.block_mask is not None else 0, DROPOUT=opts.dropout_p > 0)
    return [alibi, stride_alibi_b, scalars], switches


def varlen_bounds(cu_q: torch.Tensor, cu_k) -> tuple[int, torch.Tensor, torch.Tensor, int]:
    """(IS_VARLEN, bounds of q, bounds of k, batch) for the kernels: 1 when both are contiguous cumulative
    cu_seqlens (batch + 1,), passed as they are (no tensor op per call; the kernels read them with stride
    1); 3 for keys given as ``CacheLengths`` (a KV cache read in place: its lengths read as they are, the
    queries' (batch, 2) bounds), 4 for those with a batch index (``CacheLengths.rows``, which the launcher
    passes in the block table's slot); else 2, both as (batch, 2) [start, length] bounds (the KV cache's; a
    paged varlen call mixes the two forms; a strided view of cu_seqlens is copied into them)."""
    if isinstance(cu_k, CacheLengths):
        return 3 if cu_k.rows is None else 4, as_bounds(cu_q), cu_k.lengths, cu_k.lengths.shape[0]
    if cu_q.dim() == 1 and cu_k.dim() == 1 and cu_q.stride(0) == 1 and cu_k.stride(0) == 1:
        return 1, cu_q, cu_k, cu_q.shape[0] - 1
    return 2, as_bounds(cu_q), as_bounds(cu_k), cu_q.shape[0] - (1 if cu_q.dim() == 1 else 0)


def dropout_args(opts, q, k, varlen) -> list:
    """(seed, p, rows per head, stride) of the dropout counters: dense (b * H + h) * sq + i rows of sk
    columns; packed h * total_q + token rows of total_k columns."""
    if varlen is None:
        return [opts.dropout_seed, opts.dropout_p, q.shape[1], k.shape[1]]
    return [opts.dropout_seed, opts.dropout_p, q.shape[0], k.shape[0]]


def sparse_args(opts, transpose: bool, device) -> list:
    """(counts, indices, rows, cols) of the block mask's on-tiles, or placeholders when dense."""
    if opts.block_mask is None:
        empty = placeholder(torch.int32, device)
        return [empty, empty, 0, 0]
    counts, indices = sparse_lists(opts.block_mask, transpose)
    rows, cols = opts.block_mask.shape[-2:]
    return [counts, indices, *((cols, rows) if transpose else (rows, cols))]


configs.keep_choices_on_disk(_attn_fwd)
configs.compile_candidates_together(_attn_fwd)
configs.fit_host_descriptors(_attn_fwd, ("KHost", "VHost"), "BLOCK_N")


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts, varlen=None, paged=None,
                      num_splits: int = 1, before_launch=None, fp8=None, append=None):
    """Launch the forward kernel. Inputs are checked by the caller (``flashtile.interface``).

    Args:
        q: (batch, seqlen_q, nheads, headdim) fp16/bf16, last dim contiguous, any other strides; or
            packed (total_q, nheads, headdim) with ``varlen``.
        k, v: (batch, seqlen_k, nheads_k, headdim) (or packed (total_k, nheads_k, headdim)).
        opts: ``flashtile.options.AttentionOptions``.
        varlen: None, or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for packed inputs
            (cu_seqlens, or (batch, 2) int32 [start, length] bounds).
        paged: None, or (block_table (batch, max_pages) int32, page_size) with varlen: k, v are then the
            flattened page pool (num_pages * page_size, nheads_k, headdim) and key starts are logical.
        num_splits: > 1 splits the keys across that many programs per query block (split-KV
            decoding); their partial results are merged by ``_combine_splits``. Dense inputs given 1
            take ``configs.split_count``'s choice when their queries are few (see below).
        before_launch: None, or a callable run just before the launch (checks that may raise; see
            ``flashtile.interface._start_cu_seqlens_check``).
        fp8: None, or FP8 inputs' (q_descale, k_descale, v_descale, out_dtype, cache), descales float32
            (batch, nheads_k) (``flashtile.fp8``). ``cache`` False: q, k, v all float8_e4m3fn, products
            on FP8 tensor cores. True: k, v an FP8 KV cache read in 16-bit precision, under float8 q
            (with q_descale) or bfloat16/float16 q (q_descale None; out then has q's dtype).
        append: None, or a decoding step's new keys and values (k_new, v_new), each (batch, seqlen_new,
            nheads_k, headdim) in the cache's dtype, last dim contiguous, appended in this launch: k and v the
            16-bit cache as its rows (``inference.cache_rows``, pitch seqlen_cache), varlen's keys
            ``CacheLengths`` of the lengths before the append (the kernel reads the new keys from k_new and
            v_new and writes them into the cache after those lengths, at positions inside the cache).

    Returns:
        out: shape of q, contiguous, dtype of q (fp8's out_dtype for FP8 q).
        lse: float32, natural log, -inf for rows that see no key; (batch, nheads, seqlen_q), or
            (nheads, total_q) for packed inputs.
    """
    configs.target_of(q.device)  # a GPU the kernels do not run on: its error before any launch
    if append is not None and (not isinstance(varlen[1], CacheLengths) or varlen[1].rows is not None
                               or paged is not None or fp8 is not None):
        raise ValueError("append: a contiguous 16-bit cache read in place (CacheLengths keys without a batch index, "
                         "no pages, no FP8)")
    if varlen is None and paged is None and num_splits == 1 and fp8 is not None and append is None:
        gluon = configs.gluon_fp8_forward_choice(q, k, v, opts, fp8)
        if gluon is not None:  # sm90, FP8 q, k, v: the warp-specialized Gluon FP8 kernel
            from .gluon_forward import gluon_attention_forward_fp8

            if before_launch is not None:
                before_launch()
            variant, tiles = gluon
            q_descale, k_descale, v_descale, out_dtype, _ = fp8
            return gluon_attention_forward_fp8(q, k, v, q_descale, k_descale, v_descale, opts.right_limit == 0,
                                               opts.softmax_scale, out_dtype, tiles=tiles, variant=variant)
    if paged is None and num_splits == 1 and fp8 is None and append is None:
        gluon = configs.gluon_forward_choice(q, k, v, opts, varlen)
        if gluon is not None:  # sm90: the warp-specialized Gluon kernel (no tuning: its tile is fixed)
            from .gluon_forward import gluon_attention_forward, gluon_attention_forward_varlen

            if before_launch is not None:
                before_launch()
            variant, tiles = gluon
            causal = opts.right_limit == 0
            if varlen is None:
                return gluon_attention_forward(q, k, v, causal, opts.softmax_scale, tiles=tiles, variant=variant)
            cu_q, cu_k, max_seqlen_q, _ = varlen
            return gluon_attention_forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, causal, opts.softmax_scale,
                                                  tiles=tiles, variant=variant)
    variant = configs.proxy_tuning_needed("fwd", q, k, opts, q.shape[1], k.shape[1]) if varlen is None else None
    if variant is not None:
        cap = configs.TUNE_SEQLEN_CAP  # tiles tuned on the first tokens, found by the long call's capped key
        attention_forward(q[:, :cap], k[:, :cap], v[:, :cap], opts, fp8=fp8)
        configs.proxy_tuned(variant)
    if varlen is None:
        batch, seqlen_q, nheads, headdim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        cu_q = cu_k = placeholder(torch.int32, q.device)
        lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
        q4, k4, v4 = q, k, v
        varlen_mode = 0
        key_seqlen_arg = seqlen_k
    else:
        cu_q, cu_k, seqlen_q, seqlen_k = varlen
        # The kernel's seqlen_k argument: for keys given as CacheLengths, their row stride; paged, the pool's pages
        # (which the kernel clamps page numbers into).
        key_seqlen_arg = cu_k.row_stride if isinstance(cu_k, CacheLengths) else seqlen_k
        if paged is not None:
            key_seqlen_arg = k.shape[0] // paged[1]
        entries = cu_k.rows if isinstance(cu_k, CacheLengths) else None  # (IS_VARLEN 4: in the block table's slot)
        varlen_mode, cu_q, cu_k, batch = varlen_bounds(cu_q, cu_k)
        (_, nheads, headdim), nheads_k = q.shape, k.shape[1]
        lse = torch.empty((nheads, q.shape[0]), dtype=torch.float32, device=q.device)
        q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # batch stride 0 below
    fp8_mode, descales, out_dtype = _fp8_args(q, fp8)
    if fp8_mode == 1 and v.stride(-3) == 1 and v.stride(-1) != 1:
        fp8_mode = 3  # an FP8 cache with V positions-fastest (``flashtile.fp8.zeros_cache``), read by pointers
    if fp8_mode == 2:
        v4, v_keys_minor = keys_fastest(v4)
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    final_out, final_lse = out, lse
    if (varlen is None and num_splits == 1 and fp8 is None and opts.dropout_p == 0 and opts.block_mask is None
            and seqlen_q * (nheads // nheads_k) <= configs.FEW_ROWS):
        # A few queries over many keys (a decoding step through flash_attn_func, as Hugging Face's dynamic
        # cache makes it): split the keys too, as flash-attn does, or most multiprocessors idle. Longer
        # queries keep one program per block (measured for decoding only). The splits cut all seqlen_k
        # keys, so a window that sees fewer keys would leave all but one or two splits empty: unsplit.
        right = opts.right_limit
        if opts.left_limit is None or opts.left_limit + seqlen_q + (seqlen_k if right is None else right) >= seqlen_k:
            num_splits = configs.split_count(q.device, batch, nheads, nheads_k, seqlen_q, seqlen_k, False)
    if num_splits > 1:
        # fp32 partial results, one slice per split, in the layouts of out and lse.
        split_out = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
        split_lse = torch.empty((num_splits, *lse.shape), dtype=torch.float32, device=q.device)
        out, lse = split_out[0], split_lse[0]
    o4 = out if varlen is None else out.unsqueeze(0)
    (alibi, stride_alibi_b, scalars), switches = variant_args(opts, batch, q.device)
    batch_stride = (lambda t: t.stride(0)) if varlen is None else (lambda t: 0)
    lse_strides = (lse.stride(0), lse.stride(1)) if varlen is None else (0, lse.stride(0))

    pack = configs.pack_gqa(nheads, nheads_k, seqlen_q, opts.dropout_p > 0 or opts.block_mask is not None)
    rows, programs = (seqlen_q * (nheads // nheads_k), batch * nheads_k) if pack else (seqlen_q, batch * nheads)

    def grid(meta):
        return (configs.flat_programs(configs.cdiv(rows, meta["BLOCK_M"]), programs), num_splits)

    # Bytes of K and V that one program's head streams; unpacked GQA heads of one group share them.
    kv_bytes = 2 * seqlen_k * headdim * k.element_size() // (1 if pack else nheads // nheads_k)
    section = configs.heads_per_section(programs, kv_bytes, opts)

    sink = opts.sink.float().contiguous() if opts.sink is not None else alibi  # any pointer when unused
    block_table, page_size = paged if paged is not None else (cu_q if varlen_mode != 4 else entries, 0)
    # Rows the bounds may address: packed q; packed or flattened-cache k (paged: logical positions).
    total_q = q.shape[0] if varlen is not None else 0
    total_k = 0 if varlen is None else (block_table.shape[1] * page_size if paged is not None else k.shape[0])
    sparse_counts, sparse_indices, sparse_rows, sparse_cols = sparse_args(opts, False, q.device)
    block_d = configs.head_block(headdim)
    # Keys-fastest V (FP8 == 2) has a descriptor of its own, made below: dense inputs only.
    use_tma = paged is None and (fp8_mode != 2 or varlen is None) and fp8_mode != 3 and configs.use_tma(
        *((k, v) if fp8_mode != 2 else (k,)), rows=seqlen_k)
    # Dense (batch, seqlen, heads, head_dim) keys: the K/V descriptors are made here, once per launch,
    # instead of two per program in the kernel (0.6-0.9 us less per program on an H200,
    # benchmarks/lab/tma_setup_cost.py).
    if fp8_mode == 2:
        host = configs.host_descriptors((k,), block_d, use_tma, packed=varlen is not None)
        if host is not None:  # (batch, heads, head_dim, keys) boxes of the copy (fit_host_descriptors sizes them)
            host = (*host, TensorDescriptor(v_keys_minor, [batch, nheads_k, headdim, seqlen_k],
                                            list(v_keys_minor.stride()), [1, 1, block_d, 16]))
        else:
            use_tma = False  # the keys-fastest V has no descriptor made in the kernel
    else:
        host = configs.host_descriptors((k, v), block_d, use_tma, packed=varlen is not None)
    host_tma = host is not None
    k_host, v_host = host if host_tma else (None, None)
    if before_launch is not None:
        before_launch()
    if append is not None:
        k_new, v_new = append
        new_args = [k_new, v_new, *k_new.stride()[:3], *v_new.stride()[:3], k_new.shape[1]]
    else:
        new_args = [k, v, 0, 0, 0, 0, 0, 0, 0]  # (unread)
    configs.launch(
        _attn_fwd, grid,
        q, k, v4, out, lse, cu_q, cu_k, alibi, sink, block_table, sparse_counts, sparse_indices, k_host, v_host,
        *descales, *new_args[:2],
        batch_stride(q4), q4.stride(1), q4.stride(2),
        batch_stride(k4), k4.stride(1), k4.stride(2),
        batch_stride(v4), v4.stride(1), v4.stride(2), v4.stride(3),
        batch_stride(o4), o4.stride(1), o4.stride(2),
        *lse_strides, stride_alibi_b, block_table.stride(0) if paged is not None else 0,
        split_out.stride(0) if num_splits > 1 else 0, split_lse.stride(0) if num_splits > 1 else 0, *new_args[2:],
        nheads, seqlen_q, key_seqlen_arg, nheads // nheads_k, total_q, total_k, *scalars, sparse_rows, sparse_cols,
        *dropout_args(opts, q, k, varlen),
        programs, section,
        configs.seqlen_bucket(rows), configs.seqlen_bucket(seqlen_k),
        HEAD_DIM=headdim, BLOCK_D=block_d, IS_VARLEN=varlen_mode, PACK_GQA=pack,
        USE_TMA=use_tma, HOST_TMA=host_tma,
        HAS_SINK=opts.sink is not None, PAGE_SIZE=page_size,
        SPLIT_KV=num_splits > 1, FP8=fp8_mode, APPEND=append is not None, **switches, **configs.pdl_options(q.device),
    )
    if num_splits > 1:
        _combine_splits(split_out, split_lse, final_out, final_lse)
    return final_out, final_lse


def _fp8_args(q: torch.Tensor, fp8) -> tuple[int, list, torch.dtype]:
    """(FP8 mode of the kernel, its three descale pointers, out's dtype) of ``attention_forward``'s fp8."""
    if fp8 is None:
        return 0, [placeholder(torch.float32, q.device)] * 3, q.dtype
    q_descale, k_descale, v_descale, out_dtype, cache = fp8
    descales = [d.contiguous() if d is not None else placeholder(torch.float32, q.device)
                for d in (q_descale, k_descale, v_descale)]
    return (1 if cache else 2), descales, out_dtype if q.dtype == torch.float8_e4m3fn else q.dtype


def keys_fastest(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v (batch, seqlen_k, nheads_k, headdim) laid out keys-fastest, (batch, nheads_k, headdim, seqlen_k)
    in memory, as a (batch, seqlen_k, nheads_k, headdim) view, and that memory as a (batch, nheads_k,
    headdim, keys) tensor: FP8 tensor-core products (wgmma) read both operands along their reduction dim,
    which for P V is the keys. A v already keys-fastest with strides of 16-byte multiples (what
    ``flashtile.fp8.quantize(v, keys_fastest=True)`` returns) is used as it is; any other is copied, with
    rows padded to 16 bytes (the alignment the copy engine wants of strides)."""
    batch, seqlen_k, nheads_k, headdim = v.shape
    given = v.permute(0, 2, 3, 1)
    # (A zero stride, an expanded v, is no layout a descriptor takes: copied too.)
    if v.stride(1) == 1 and given.data_ptr() % 16 == 0 and all(s > 0 and s % 16 == 0 for s in given.stride()[:3]):
        return v, given
    buffer = keys_fastest_memory(batch, seqlen_k, nheads_k, headdim, v.dtype, v.device)
    transpose_keys(v, buffer)
    return buffer.permute(0, 3, 1, 2)[:, :seqlen_k], buffer


def transpose_keys(v: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, h, d, :seqlen] = v[b, :, h, d]: v (batch, seqlen, nheads, headdim), any strides; out (batch,
    nheads, headdim, >= seqlen) with unit stride last. A kernel transposes tiles of keys on chip:
    ``Tensor.copy_`` of the permuted view moves 1-byte elements at about a third of the copy rate on an
    H200 (44 us for 32 MiB); off the GPU (the interpreter aside) torch copies."""
    batch, seqlen, nheads, headdim = v.shape
    if _torch_transposes(v.device):
        out[..., :seqlen].copy_(v.permute(0, 2, 3, 1))
        return
    block_keys = 128
    tiles = configs.cdiv(seqlen, block_keys)
    # One flat grid axis (a second one stops at 65535 (batch, head) pairs), on v's device (Triton
    # launches on the current one).
    with torch.cuda.device(v.device) if v.is_cuda else contextlib.nullcontext():
        configs.launch_plain(
            _transpose_keys_kernel, (configs.flat_programs(tiles, batch * nheads),),
            v, out, seqlen, nheads, tiles, v.stride(0), v.stride(1), v.stride(2), v.stride(3),
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=headdim, BLOCK_D=configs.next_power_of_2(headdim), BLOCK_KEYS=block_keys,
        )


def _torch_transposes(device: torch.device) -> bool:
    """Whether ``transpose_keys`` copies by torch: off the GPU, the interpreter aside (tests on the stand-in
    driver, whose launches do nothing, set it to launch the kernel there too)."""
    return device.type != "cuda" and not configs.interpreting()


@triton.jit
def _transpose_keys_kernel(
    V, Out, seqlen, nheads, tiles, stride_vb, stride_vn, stride_vh, stride_vd, stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KEYS: tl.constexpr,
):
    """Out[b, h, :, keys] = V[b, keys, h, :] for one tile of BLOCK_KEYS keys of one (sequence, head)."""
    batch, head, keys, dims, _, tile = bshd_tile(V, tl.program_id(0), tiles, seqlen, nheads, stride_vb, stride_vn,
                                                 stride_vh, stride_vd, HEAD_DIM, BLOCK_D, BLOCK_KEYS)
    dst = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(dst + dims.to(tl.int64)[:, None] * stride_od + keys[None, :], tl.trans(tile),
             mask=(dims[:, None] < HEAD_DIM) & (keys[None, :] < seqlen))


@triton.jit
def _combine_kernel(
    OutPartial, LsePartial, Out, Lse,
    rows, nheads, num_splits, stride_split_o, stride_split_l, stride_row_o, stride_head_o, stride_row_l,
    stride_head_l, rows_per_batch, stride_batch_l,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the split partials of one (row, head): weights exp(lse_s - lse), lse = logsumexp_s(lse_s).
    Rows are (batch, query) pairs, ``rows_per_batch`` queries each: lse's batch stride is its own (dense
    lse is (batch, heads, queries))."""
    pid = tl.program_id(0)
    row = pid // nheads
    head = pid % nheads
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    stats = ((row // rows_per_batch).to(tl.int64) * stride_batch_l + (row % rows_per_batch).to(tl.int64) * stride_row_l
             + head.to(tl.int64) * stride_head_l)
    lse_s = tl.load(LsePartial + splits.to(tl.int64) * stride_split_l + stats, mask=splits < num_splits,
                    other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # 0 for splits that saw no key
    total = tl.sum(w, 0)
    vals = row.to(tl.int64) * stride_row_o + head.to(tl.int64) * stride_head_o
    part = tl.load(OutPartial + splits.to(tl.int64)[:, None] * stride_split_o + vals + offs_d[None, :],
                   mask=(splits[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total != 0, total, 1.0)  # (NaN: as the forward's "seen")
    tl.store(Out + vals + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(Lse + stats, tl.where(total != 0, m_safe + tl.log(total), float("-inf")))


def _combine_splits(out_partial, lse_partial, out, lse):
    """Merge split partials in place: packed, out_partial (splits, total, nheads, d) fp32, lse_partial
    (splits, nheads, total) -> out (total, nheads, d), lse (nheads, total); dense, out_partial (splits, batch,
    seqlen_q, nheads, d), lse_partial (splits, batch, nheads, seqlen_q) -> out (batch, seqlen_q, nheads, d)
    contiguous, lse (batch, nheads, seqlen_q)."""
    if lse.dim() == 3:
        rows_per_batch, stride_batch_l, stride_head_l, stride_row_l = lse.shape[2], *lse.stride()
        out_partial, out = out_partial.flatten(1, 2), out.flatten(0, 1)
    else:
        (stride_head_l, stride_row_l), stride_batch_l = lse.stride(), 0
        rows_per_batch = max(1, lse.shape[1])
    num_splits, total, nheads, headdim = out_partial.shape
    configs.launch_plain(
        _combine_kernel, (total * nheads,),
        out_partial, lse_partial, out, lse, total, nheads, num_splits, out_partial.stride(0), lse_partial.stride(0),
        out.stride(0), out.stride(1), stride_row_l, stride_head_l, rows_per_batch, stride_batch_l,
        HEAD_DIM=headdim, BLOCK_D=configs.next_power_of_2(headdim), BLOCK_S=max(2, configs.next_power_of_2(num_splits)),
    )
