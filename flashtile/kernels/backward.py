"""Backward kernels: recompute each probability tile from Q, K and the saved lse.

Three launches, none with atomics, so gradients are bitwise reproducible:

1. ``_attn_bwd_preprocess``: ``delta = rowsum(dout * out)`` and lse in log2 units per query row (float32).
2. ``_attn_bwd_dkdv``: one program per (K/V block, sequence, kv head) keeps its K, V tile and the dK,
   dV accumulators on chip and streams the query tiles of every query head in its GQA group, so the
   group reduction happens in registers.
3. ``_attn_bwd_dq``: one program per (Q block, sequence, head) streams K/V tiles, mirroring the forward.

A large call runs 3 on a side stream beside 2. A small one runs on one stream, 3 first, which then makes
its own rows' delta and lse₂ (``ROW_STATS``) for 2 to read: two launches, not three.

With ``P = exp2(S_log2 - lse * log2(e))``: ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``
(times ``1 - tanh^2`` through a softcap), ``dK = scale * dS^T Q``, ``dQ = scale * dS K``. The same
compile-time switches as the forward select the variant.

On sm90 at d = 128 from 2,048 tokens (causal or not) and d = 64 from 1,024 (2,048 causal), plain attention,
``attention_backward`` hands the call to the Gluon one pass instead (``gluon_backward``,
``configs.gluon_backward_choice``): dK, dV and dQ's shares in one kernel, the shares added as integers, so the bits
repeat there too.
"""

import os

import torch
import triton
import triton.language as tl

from . import configs
from .common import (
    await_prior_grids,
    base_offset,
    dropout_keep,
    in_range,
    key_range,
    load_rows,
    load_tile,
    query_range,
    rng_head_index,
    row_delta_and_lse2,
    row_descriptors,
    schedule,
    score_constants,
    scores_log2,
    sequence_bounds,
    store_row_stats,
    store_tile,
    visible_keys,
    visible_queries,
)
from .forward import dropout_args, placeholder, sparse_args, variant_args, varlen_bounds


# The packed row counts only clamp the bounds: not worth a compiled variant per value class.
@triton.jit(do_not_specialize=["total_q"])
def _attn_bwd_preprocess(
    Out, DO, Lse, Delta, Lse2, BoundsQ,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_lse_b, stride_lse_h,
    nheads, seqlen_q, total_q, num_head_programs,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid_m, pid_bh = schedule(num_head_programs, 1, False)
    batch = pid_bh // nheads
    head = pid_bh % nheads
    q_start, seqlen_q = sequence_bounds(BoundsQ, batch, seqlen_q, total_q, IS_VARLEN)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tokens = (q_start + rows).to(tl.int64)
    o_ptrs = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    o_ptrs += tokens[:, None] * stride_om + offs_d[None, :]
    do_ptrs = DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
    do_ptrs += tokens[:, None] * stride_dom + offs_d[None, :]
    stats = batch.to(tl.int64) * stride_lse_b + head.to(tl.int64) * stride_lse_h + q_start + rows
    # lse in log2 units once per row here rather than per tile in the dK/dV loop.
    row_delta_and_lse2(o_ptrs, do_ptrs, Lse, Delta, Lse2, stats, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_D)


@triton.jit
def _load_row_stats(Lse2_head, Delta_head, rows, seqlen_q, HAS_ALIBI: tl.constexpr):
    """lse in log2 units (from the preprocess kernel) and delta of the given rows.

    Rows past seqlen_q read delta = 0, and lse = 0 or, with ALiBi, +inf. Their Q and dO rows load as
    zeros, so without ALiBi each of their scores is 0, its probability finite, and every product it
    enters (P^T dO, dS = P (dP - delta) with dP = 0, dS^T Q, dS K) is 0. ALiBi adds -slope * |rel| to
    the score, which a negative slope makes large and positive: against an lse of 0 exp2 overflowed to
    inf, then inf * 0 = NaN in dV and dK; against +inf each probability is exactly 0. Only ALiBi pays
    for it: a fill other than 0 costs a select per loaded value, and it measured 5% of the whole d=64
    causal backward on an H200 (337 against 320 TFLOP/s at 4096 tokens, 364 against 347 at 16384).
    """
    if HAS_ALIBI:
        lse2 = tl.load(Lse2_head + rows, mask=rows < seqlen_q, other=float("inf"))
    else:
        lse2 = tl.load(Lse2_head + rows, mask=rows < seqlen_q, other=0.0)
    delta = tl.load(Delta_head + rows, mask=rows < seqlen_q, other=0.0)
    return lse2, delta


@triton.jit
def _fp8_scales(Scales, batch, nheads, head, softmax_scale, FP8: tl.constexpr):
    """(the scores' scale, dP's scale) of one query head: under FP8 ``softmax_scale`` times q's and k's
    descales, and v's times dO's, read from Scales (batch, nheads, 2) float32; otherwise (softmax_scale, 1)."""
    if FP8:
        scales = Scales + (batch.to(tl.int64) * nheads + head) * 2
        return softmax_scale * tl.load(scales), tl.load(scales + 1)
    else:
        return softmax_scale, 1.0


@triton.jit
def _bwd_dkdv_q_loop(
    dk, dv, k, v,
    Q_head, DO_head, q_desc, do_desc, Lse2_head, Delta_head, stride_qm, stride_dom,
    start_m_lo, start_m_hi, offs_n, offs_d,
    seqlen_q, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    MASKED: tl.constexpr, LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, USE_TMA: tl.constexpr,
    seed=0, rng_row_base=0, rng_col_base=0, rng_stride=0, dropout_p=0.0, DROPOUT: tl.constexpr = False,
    interior_lo=0, interior_hi=0, MASK_EDGES_ONLY: tl.constexpr = False, KV_GRADS: tl.constexpr = 3,
    batch=0, head=0, HOST_TMA: tl.constexpr = False, EARLY_DP: tl.constexpr = False,
    Q8_head=None, DO8_head=None, dp_scale=1.0, FP8: tl.constexpr = False,
):
    """Accumulate into (dk, dv) of one key block the contributions of query rows [lo, hi).

    FP8: k, v are float8_e4m3fn tiles, and the scores and dP come from FP8 products with the float8 copies
    of Q and dO (Q8_head, DO8_head; Q's strides), dP times ``dp_scale``; dV and dK stay 16-bit products.

    q_desc, do_desc: TMA descriptors of the head's Q and dO rows (made once per head by the caller:
    a descriptor is written to global memory and fenced, not worth repeating per range), or unused.
    MASK_EDGES_ONLY: a MASKED loop masks only the tiles outside [interior_lo, interior_hi) (a branch
    per tile, in the one loop) instead of every tile. KV_GRADS: 3 both, 1 dV only, 2 dK only. EARLY_DP: dP is
    issued before the exponentials of P, so the matrix units compute it while they run (the caller picks
    it by head dim, as measured)."""
    WANT_DV: tl.constexpr = KV_GRADS != 2
    WANT_DK: tl.constexpr = KV_GRADS != 1
    offs_m = tl.arange(0, BLOCK_M)
    q_ptrs = Q_head + tl.cast(start_m_lo, tl.int64) * stride_qm + offs_m[:, None] * stride_qm + offs_d[None, :]
    do_ptrs = DO_head + tl.cast(start_m_lo, tl.int64) * stride_dom + offs_m[:, None] * stride_dom + offs_d[None, :]
    if FP8:
        q8_ptrs = Q8_head + tl.cast(start_m_lo, tl.int64) * stride_qm + offs_m[:, None] * stride_qm + offs_d[None, :]
        do8_ptrs = DO8_head + tl.cast(start_m_lo, tl.int64) * stride_dom + offs_m[:, None] * stride_dom
        do8_ptrs += offs_d[None, :]
    query_lo, query_hi = visible_queries(offs_n, shift, seqlen_q, window_left, window_right, LIMIT_LEFT,
                                         LIMIT_RIGHT)
    for start_m in range(start_m_lo, start_m_hi, BLOCK_M):
        rows = start_m + offs_m
        if USE_TMA:
            q = load_rows(q_desc, start_m, batch, head, HOST_TMA, BLOCK_M, BLOCK_D)
            do = load_rows(do_desc, start_m, batch, head, HOST_TMA, BLOCK_M, BLOCK_D)
        else:
            q = load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
            do = load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
        lse2, delta = _load_row_stats(Lse2_head, Delta_head, rows, seqlen_q, HAS_ALIBI)
        if FP8:
            q_s = load_tile(q8_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
            do_dp = load_tile(do8_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
        else:
            q_s = q
            do_dp = do
        # Transposed tiles (BLOCK_N, BLOCK_M) so that dK and dV come out as (BLOCK_N, BLOCK_D).
        rel_t = offs_n[:, None] - (rows[None, :] + shift)
        scores_t, capped_t = scores_log2(tl.dot(k, tl.trans(q_s)), rel_t, qk_scale, softcap_scale, softcap_log2,
                                         slope_log2, SOFTCAP, HAS_ALIBI)
        if EARLY_DP and WANT_DK:
            dp_t = tl.dot(v, tl.trans(do_dp))
            if FP8:
                dp_t = dp_t * dp_scale
        p_t = tl.math.exp2(scores_t - lse2[None, :])
        if MASKED:
            if MASK_EDGES_ONLY:
                if (start_m < interior_lo) | (start_m >= interior_hi):
                    p_t = tl.where(in_range(rows, query_lo, query_hi, LIMIT_RIGHT, LIMIT_LEFT), p_t, 0.0)
            else:
                p_t = tl.where(in_range(rows, query_lo, query_hi, LIMIT_RIGHT, LIMIT_LEFT), p_t, 0.0)
        # (The order of these steps with both gradients is the one measured; the switches only drop steps,
        # but EARLY_DP, which moves dP before the exponentials above.)
        if WANT_DK and not EARLY_DP:
            dp_t = tl.dot(v, tl.trans(do_dp))
            if FP8:
                dp_t = dp_t * dp_scale
        if DROPOUT:
            # The forward's mask, regenerated: dV sees the dropped weights, dP the same mask and scale.
            keep_t = dropout_keep(seed, rng_row_base + start_m, rng_col_base, rng_stride, dropout_p, BLOCK_M,
                                  offs_n.shape[0], KEYS_FIRST=True)
            if WANT_DV:  # (the survivors' 1 / (1 - p) is applied to dV once, at the end)
                dv = tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv)
            if WANT_DK:
                dp_t = tl.where(keep_t, dp_t * (1.0 / (1.0 - dropout_p)), 0.0)
        elif WANT_DV:
            dv = tl.dot(p_t.to(do.dtype), do, dv)
        if WANT_DK:
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * (1.0 - capped_t * capped_t)
            dk = tl.dot(ds_t.to(q.dtype), q, dk)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        if FP8:
            q8_ptrs += BLOCK_M * stride_qm
            do8_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.autotune(
    configs=configs.bwd_kv_configs(),
    key=["SEQ_BUCKET_Q", "SEQ_BUCKET_K", "HEAD_DIM", "LIMIT_LEFT", "LIMIT_RIGHT", "SOFTCAP", "HAS_ALIBI",
         "IS_VARLEN", "USE_TMA", "SPARSE_BLOCK", "DROPOUT", "MASK_EDGES_ONLY", "KV_GRADS", "HOST_TMA",
         "EARLY_DP", "FP8"],
    prune_configs_by={"early_config_prune": configs.bwd_kv_prune},
    do_bench=configs.autotune_bench,
)
# The packed row counts only clamp the bounds, and the dropout seed is random (forward.py's _attn_fwd).
@triton.jit(do_not_specialize=["total_q", "total_k", "seed"])
def _attn_bwd_dkdv(
    Q, K, V, DO, Lse2, Delta, DK, DV, BoundsQ, BoundsK, Alibi, SparseCount, SparseIndex, QHost, DOHost,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, nheads_k, seqlen_q, seqlen_k, gqa_group, total_q, total_k, softmax_scale, window_left, window_right,
    softcap,
    sparse_rows, sparse_cols, seed, dropout_p, rng_rows_per_head, rng_stride,
    num_head_programs, heads_per_section,
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # autotune keys only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, SPARSE_BLOCK: tl.constexpr, DROPOUT: tl.constexpr,
    MASK_EDGES_ONLY: tl.constexpr, KV_GRADS: tl.constexpr, HOST_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    FP8: tl.constexpr = False,  # passed by FP8 launches only: a keyword per launch costs host time
):
    # FP8: K and V are their float8_e4m3fn copies; the pointers a block mask and ALiBi would use (FP8 takes
    # neither, and a launch costs host time per argument) carry the float8 copies of Q and dO (SparseCount,
    # SparseIndex; Q's and dO's strides) and FP8 scales (Alibi): float32 (batch, nheads, 2), per query head
    # the scores' descale (q's times k's) and dP's (v's times dO's). QK^T and dO V^T are FP8 products,
    # P^T dO and dS^T Q 16-bit ones.
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    # Under a causal limit the first key blocks see the most queries: they start first.
    pid_n, pid_bhk = schedule(num_head_programs, heads_per_section, False)
    batch = pid_bhk // nheads_k
    kv_head = pid_bhk % nheads_k
    start_n = pid_n * BLOCK_N
    q_start, seqlen_q = sequence_bounds(BoundsQ, batch, seqlen_q, total_q, IS_VARLEN)
    k_start, seqlen_k = sequence_bounds(BoundsK, batch, seqlen_k, total_k, IS_VARLEN, True)
    if start_n >= seqlen_k:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_tokens = tl.cast(k_start, tl.int64) + start_n

    k_ptrs = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + k_tokens * stride_kn
    k_ptrs += tl.arange(0, BLOCK_N)[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + k_tokens * stride_vn
    v_ptrs += tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_d[None, :]
    # Keys past seqlen_k read as 0: their rows of dK/dV are never stored.
    k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, True, EVEN_D)
    v = load_tile(v_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, True, EVEN_D)

    shift = seqlen_k - seqlen_q
    lo, interior_lo, interior_hi, hi = query_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                   BLOCK_M, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # The query heads sharing this kv head, reduced here in registers rather than by atomics.
    for g in range(0, gqa_group):
        head = kv_head * gqa_group + g
        Q_head = Q + base_offset(batch, stride_qb, head, stride_qh, q_start, stride_qm)
        DO_head = DO + base_offset(batch, stride_dob, head, stride_doh, q_start, stride_dom)
        stats = batch.to(tl.int64) * stride_lse_b + head.to(tl.int64) * stride_lse_h + q_start
        Lse2_head = Lse2 + stats
        Delta_head = Delta + stats
        q_desc, do_desc = row_descriptors(Q_head, DO_head, seqlen_q, stride_qm, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D,
                                         USE_TMA, QHost, DOHost, HOST_TMA, IS_VARLEN)
        if FP8:
            tl.static_assert(SPARSE_BLOCK == 0 and not HAS_ALIBI, "FP8: no block mask, no ALiBi")
            Q8_head = SparseCount + base_offset(batch, stride_qb, head, stride_qh, q_start, stride_qm)
            DO8_head = SparseIndex + base_offset(batch, stride_dob, head, stride_doh, q_start, stride_dom)
        else:
            Q8_head = Q
            DO8_head = DO
        score_scale, dp_scale = _fp8_scales(Alibi, batch, nheads, head, softmax_scale, FP8)
        qk_scale, softcap_scale, softcap_log2, slope_log2 = score_constants(
            score_scale, softcap, Alibi, batch * stride_alibi_b + head, HAS_ALIBI)
        rng_row_base = rng_head_index(batch, head, nheads, IS_VARLEN).to(tl.int64) * rng_rows_per_head + q_start
        if SPARSE_BLOCK > 0:
            # Block-sparse: only the query tiles whose mask turns this key block on.
            col_block = (batch.to(tl.int64) * nheads + head) * sparse_rows + start_n // SPARSE_BLOCK
            for i in range(0, tl.load(SparseCount + col_block)):
                row_start = tl.load(SparseIndex + col_block * sparse_cols + i) * SPARSE_BLOCK
                dk, dv = _bwd_dkdv_q_loop(
                    dk, dv, k, v, Q_head, DO_head, q_desc, do_desc, Lse2_head, Delta_head, stride_qm, stride_dom,
                    tl.maximum(row_start, lo), tl.minimum(row_start + SPARSE_BLOCK, hi), offs_n, offs_d,
                    seqlen_q, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
                    HEAD_DIM, BLOCK_M, BLOCK_D, EVEN_D, True, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA,
                    seed, rng_row_base, k_start + start_n, rng_stride, dropout_p, DROPOUT, interior_lo, interior_hi,
                    MASK_EDGES_ONLY, KV_GRADS, batch, head, HOST_TMA, EARLY_DP, Q8_head, DO8_head, dp_scale, FP8,
                )
        else:
            # Under a causal or window limit, one masked loop over every visited query tile: split into
            # masked / interior / masked loops, the dK and dV accumulators crossing from loop to loop
            # made ptxas serialize every wgmma of the kernel (its "non wgmma instructions defining
            # accumulator registers" warning), which costs far more than masking the interior tiles.
            if LIMIT_RIGHT or LIMIT_LEFT:
                rows_lo, rows_hi = lo, hi
            else:
                rows_lo, rows_hi = interior_lo, interior_hi
            dk, dv = _bwd_dkdv_q_loop(
                dk, dv, k, v, Q_head, DO_head, q_desc, do_desc, Lse2_head, Delta_head, stride_qm, stride_dom,
                rows_lo, rows_hi, offs_n, offs_d,
                seqlen_q, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
                HEAD_DIM, BLOCK_M, BLOCK_D, EVEN_D, LIMIT_RIGHT or LIMIT_LEFT, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP,
                HAS_ALIBI, USE_TMA, seed, rng_row_base, k_start + start_n, rng_stride, dropout_p, DROPOUT, interior_lo,
                interior_hi, MASK_EDGES_ONLY, KV_GRADS, batch, head, HOST_TMA, EARLY_DP, Q8_head, DO8_head, dp_scale,
                FP8,
            )

    dk_ptrs = DK + batch.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh
    dk_ptrs += k_tokens * stride_dkn + tl.arange(0, BLOCK_N)[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + batch.to(tl.int64) * stride_dvb + kv_head.to(tl.int64) * stride_dvh
    dv_ptrs += k_tokens * stride_dvn + tl.arange(0, BLOCK_N)[:, None] * stride_dvn + offs_d[None, :]
    if KV_GRADS != 1:
        store_tile(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM,
                   EVEN_D)
    if KV_GRADS != 2:
        if DROPOUT:
            dv = dv * (1.0 / (1.0 - dropout_p))  # the survivors' scale (``_bwd_dkdv_q_loop``)
        store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_D)


@triton.jit
def _bwd_dq_kv_loop(
    dq, q, do, lse2, delta,
    K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn,
    start_n_lo, start_n_hi, offs_m, offs_d,
    seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    USE_TMA: tl.constexpr,
    seed=0, rng_row_base=0, rng_col_base=0, rng_stride=0, dropout_p=0.0, DROPOUT: tl.constexpr = False,
    batch=0, kv_head=0, HOST_TMA: tl.constexpr = False, EARLY_DP: tl.constexpr = False,
    K8_seq=None, dp_scale=1.0, FP8: tl.constexpr = False,
):
    """Accumulate into dq of one query block the contributions of keys [lo, hi) (EARLY_DP as in
    ``_bwd_dkdv_q_loop``). FP8: q, do and v are float8_e4m3fn, the scores read K's float8 copy (K8_seq,
    K's strides), dP is scaled by ``dp_scale``; dS K stays a 16-bit product."""
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = K_seq + tl.cast(start_n_lo, tl.int64) * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V_seq + tl.cast(start_n_lo, tl.int64) * stride_vn + offs_n[:, None] * stride_vn + offs_d[None, :]
    if FP8:
        k8_ptrs = K8_seq + tl.cast(start_n_lo, tl.int64) * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :]
    key_lo, key_hi = visible_keys(offs_m, shift, seqlen_k, window_left, window_right, LIMIT_LEFT, LIMIT_RIGHT)
    for start_n in range(start_n_lo, start_n_hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k = load_rows(k_desc, start_n, batch, kv_head, HOST_TMA, BLOCK_N, BLOCK_D)
            v = load_rows(v_desc, start_n, batch, kv_head, HOST_TMA, BLOCK_N, BLOCK_D)
        else:
            k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
            v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        if FP8:
            k_s = load_tile(k8_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        else:
            k_s = k
        rel = cols[None, :] - (offs_m[:, None] + shift)
        scores, capped = scores_log2(tl.dot(q, tl.trans(k_s)), rel, qk_scale, softcap_scale, softcap_log2, slope_log2,
                                     SOFTCAP, HAS_ALIBI)
        if EARLY_DP:
            dp = tl.dot(do, tl.trans(v))
            if FP8:
                dp = dp * dp_scale
        p = tl.math.exp2(scores - lse2[:, None])
        if MASKED:
            # Keys past seqlen_k were read as 0 and would otherwise get probability exp2(-lse2) > 0.
            p = tl.where(in_range(cols, key_lo, key_hi, LIMIT_LEFT, True), p, 0.0)
        if not EARLY_DP:
            dp = tl.dot(do, tl.trans(v))
            if FP8:
                dp = dp * dp_scale
        if DROPOUT:
            keep = dropout_keep(seed, rng_row_base, rng_col_base + start_n, rng_stride, dropout_p, offs_m.shape[0],
                                BLOCK_N)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - capped * capped)
        dq = tl.dot(ds.to(k.dtype), k, dq)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
        if FP8:
            k8_ptrs += BLOCK_N * stride_kn
    return dq


@triton.jit
def _dq_tile(
    Q, K, V, DO, Lse2, Delta, DQ, BoundsQ, BoundsK, Alibi, SparseCount, SparseIndex, KHost, VHost,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, seqlen_q, seqlen_k, gqa_group, total_q, total_k, softmax_scale, window_left, window_right, softcap,
    sparse_rows, sparse_cols, seed, dropout_p, rng_rows_per_head, rng_stride,
    Out, Lse, stride_ob, stride_om, stride_oh,
    pid_m, pid_bh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, SPARSE_BLOCK: tl.constexpr, DROPOUT: tl.constexpr,
    HOST_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, ROW_STATS: tl.constexpr,
):
    """dQ of one query tile: query block ``pid_m`` of (batch x head) ``pid_bh``, every key block it sees summed in
    order into float32 and stored in DQ's dtype (the arguments as ``_attn_bwd_dq``'s). Shared by the dQ pass and
    the one pass's flagged fallback (``_dq_where_flagged``)."""
    # FP8: Q, V and DO are float8_e4m3fn copies; SparseCount carries K's (K's strides) and SparseIndex the FP8
    # scales of ``_attn_bwd_dkdv`` (FP8 takes no block mask). QK^T and dO V^T are FP8 products, dS K a 16-bit
    # one (K itself).
    # ROW_STATS: this pass runs first and makes its rows' delta and lse₂ from O, dO and lse itself, storing them
    # for the dK/dV pass after it (``common.store_row_stats``), instead of reading the preprocess kernel's.
    tl.static_assert(not (ROW_STATS and FP8), "ROW_STATS: dO in 16 bits")
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    batch = pid_bh // nheads
    head = pid_bh % nheads
    kv_head = head // gqa_group
    start_m = pid_m * BLOCK_M
    q_start, seqlen_q = sequence_bounds(BoundsQ, batch, seqlen_q, total_q, IS_VARLEN)
    k_start, seqlen_k = sequence_bounds(BoundsK, batch, seqlen_k, total_k, IS_VARLEN, True)
    if start_m >= seqlen_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_tokens = tl.cast(q_start, tl.int64) + start_m

    q_ptrs = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + q_tokens * stride_qm
    q_ptrs += tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    do_ptrs = DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh + q_tokens * stride_dom
    do_ptrs += tl.arange(0, BLOCK_M)[:, None] * stride_dom + offs_d[None, :]
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
    do = load_tile(do_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
    stats = batch.to(tl.int64) * stride_lse_b + head.to(tl.int64) * stride_lse_h + q_start
    if ROW_STATS:
        o_ptrs = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + q_tokens * stride_om
        o_ptrs += tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
        o = load_tile(o_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
        delta, lse2 = store_row_stats(o, do.to(tl.float32), Lse, Delta, Lse2, stats + offs_m, offs_m, seqlen_q)
    else:
        lse2, delta = _load_row_stats(Lse2 + stats, Delta + stats, offs_m, seqlen_q, HAS_ALIBI)

    K_seq = K + base_offset(batch, stride_kb, kv_head, stride_kh, k_start, stride_kn)
    V_seq = V + base_offset(batch, stride_vb, kv_head, stride_vh, k_start, stride_vn)
    k_desc, v_desc = row_descriptors(K_seq, V_seq, seqlen_k, stride_kn, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA,
                                     KHost, VHost, HOST_TMA, IS_VARLEN)
    if FP8:
        tl.static_assert(SPARSE_BLOCK == 0, "FP8: no block mask")
        K8_seq = SparseCount + base_offset(batch, stride_kb, kv_head, stride_kh, k_start, stride_kn)
    else:
        K8_seq = K
    score_scale, dp_scale = _fp8_scales(SparseIndex, batch, nheads, head, softmax_scale, FP8)
    qk_scale, softcap_scale, softcap_log2, slope_log2 = score_constants(
        score_scale, softcap, Alibi, batch * stride_alibi_b + head, HAS_ALIBI)
    shift = seqlen_k - seqlen_q
    lo, interior_lo, interior_hi, hi = key_range(start_m, start_m + BLOCK_M, seqlen_q, seqlen_k, window_left,
                                                 window_right, BLOCK_N, LIMIT_LEFT, LIMIT_RIGHT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # (The row of the block's first query: dropout_keep's tiles start there.)
    rng_row_base = rng_head_index(batch, head, nheads, IS_VARLEN).to(tl.int64) * rng_rows_per_head + q_start + start_m
    if SPARSE_BLOCK > 0:
        row_block = pid_bh.to(tl.int64) * sparse_rows + start_m // SPARSE_BLOCK
        for i in range(0, tl.load(SparseCount + row_block)):
            col_start = tl.load(SparseIndex + row_block * sparse_cols + i) * SPARSE_BLOCK
            dq = _bwd_dq_kv_loop(
                dq, q, do, lse2, delta, K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn,
                tl.maximum(col_start, lo), tl.minimum(col_start + SPARSE_BLOCK, hi), offs_m, offs_d,
                seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
                HEAD_DIM, BLOCK_N, EVEN_D, True, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA,
                seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA, EARLY_DP,
                K8_seq, dp_scale, FP8,
            )
    else:
        if LIMIT_LEFT:
            dq = _bwd_dq_kv_loop(
                dq, q, do, lse2, delta, K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn,
                lo, interior_lo, offs_m, offs_d,
                seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
                HEAD_DIM, BLOCK_N, EVEN_D, True, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA,
                seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA, EARLY_DP,
                K8_seq, dp_scale, FP8,
            )
        dq = _bwd_dq_kv_loop(
            dq, q, do, lse2, delta, K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn,
            interior_lo, interior_hi, offs_m, offs_d,
            seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
            HEAD_DIM, BLOCK_N, EVEN_D, False, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA,
            seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA, EARLY_DP,
            K8_seq, dp_scale, FP8,
        )
        dq = _bwd_dq_kv_loop(
            dq, q, do, lse2, delta, K_seq, V_seq, k_desc, v_desc, stride_kn, stride_vn,
            interior_hi, hi, offs_m, offs_d,
            seqlen_k, shift, qk_scale, softcap_scale, softcap_log2, slope_log2, window_left, window_right,
            HEAD_DIM, BLOCK_N, EVEN_D, True, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, USE_TMA,
            seed, rng_row_base, k_start, rng_stride, dropout_p, DROPOUT, batch, kv_head, HOST_TMA, EARLY_DP,
            K8_seq, dp_scale, FP8,
        )
    dq_ptrs = DQ + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh + q_tokens * stride_dqm
    dq_ptrs += tl.arange(0, BLOCK_M)[:, None] * stride_dqm + offs_d[None, :]
    store_tile(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_D)


@triton.autotune(
    configs=configs.bwd_q_configs(),
    key=["SEQ_BUCKET_Q", "SEQ_BUCKET_K", "HEAD_DIM", "LIMIT_LEFT", "LIMIT_RIGHT", "SOFTCAP", "HAS_ALIBI",
         "IS_VARLEN", "USE_TMA", "SPARSE_BLOCK", "DROPOUT", "HOST_TMA", "EARLY_DP", "FP8", "ROW_STATS"],
    prune_configs_by={"early_config_prune": configs.bwd_q_prune},
    do_bench=configs.autotune_bench,
)
# The packed row counts only clamp the bounds, and the dropout seed is random (forward.py's _attn_fwd).
@triton.jit(do_not_specialize=["total_q", "total_k", "seed"])
def _attn_bwd_dq(
    Q, K, V, DO, Lse2, Delta, DQ, BoundsQ, BoundsK, Alibi, SparseCount, SparseIndex, KHost, VHost,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, seqlen_q, seqlen_k, gqa_group, total_q, total_k, softmax_scale, window_left, window_right, softcap,
    sparse_rows, sparse_cols, seed, dropout_p, rng_rows_per_head, rng_stride,
    num_head_programs, heads_per_section,
    Out, Lse, stride_ob, stride_om, stride_oh,  # ROW_STATS: what the rows' statistics are made from
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # autotune keys only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    LIMIT_LEFT: tl.constexpr, LIMIT_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, SPARSE_BLOCK: tl.constexpr, DROPOUT: tl.constexpr,
    HOST_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr = False,  # passed by FP8 launches only
    ROW_STATS: tl.constexpr = False,
):
    pid_m, pid_bh = schedule(num_head_programs, heads_per_section, LIMIT_RIGHT)  # longest rows first
    _dq_tile(
        Q, K, V, DO, Lse2, Delta, DQ, BoundsQ, BoundsK, Alibi, SparseCount, SparseIndex, KHost, VHost,
        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh, stride_lse_b, stride_lse_h,
        stride_alibi_b, nheads, seqlen_q, seqlen_k, gqa_group, total_q, total_k, softmax_scale, window_left,
        window_right, softcap, sparse_rows, sparse_cols, seed, dropout_p, rng_rows_per_head, rng_stride,
        Out, Lse, stride_ob, stride_om, stride_oh, pid_m, pid_bh,
        HEAD_DIM, BLOCK_D, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, HAS_ALIBI, IS_VARLEN, USE_TMA, SPARSE_BLOCK, DROPOUT,
        HOST_TMA, EARLY_DP, BLOCK_M, BLOCK_N, FP8, ROW_STATS,
    )


@triton.jit(do_not_specialize=["seed"])
def _dq_where_flagged(
    Q, K, V, DO, Lse2, Delta, DQ, Flag,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    nheads, gqa_group, seqlen_q, seqlen_k, softmax_scale, seed, dropout_p, num_tiles, num_flags,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAG_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    """dQ of dense attention (causal bottom-right or not, dropout) for the heads whose KV head's flag is set, else
    nothing: the Gluon one pass's fallback (``gluon_backward``'s estimated bounds). Flag: (batch * nheads_k,) int32.
    A persistent grid: program i takes the (query block, batch x head) tiles i, i + programs, ..., of flagged heads,
    each by ``_dq_tile`` (key blocks summed in order in float32, no atomics: the same bits every run). Lse2, Delta:
    contiguous (batch, nheads, seqlen_q) float32, as the one pass's. With no flag set each program reads the flags
    once and returns."""
    await_prior_grids(PDL)
    flagged = 0
    for first in range(0, num_flags, FLAG_BLOCK):
        index = first + tl.arange(0, FLAG_BLOCK)
        flagged = tl.maximum(flagged, tl.max(tl.load(Flag + index, mask=index < num_flags, other=0), 0))
    if flagged == 0:
        return
    n_m = tl.cdiv(seqlen_q, BLOCK_M)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        pid_m = tile % n_m
        pid_bh = tile // n_m
        # (batch * nheads + head) // group = batch * nheads_k + KV head: the flag's index
        if tl.load(Flag + pid_bh // gqa_group) != 0:
            # Dense rows (no packing, window, softcap, ALiBi, block mask or FP8): the unused pointers are Q and
            # Flag; the statistics' strides those of contiguous (batch, nheads, seqlen_q); dropout's counters as
            # the dense forward's (``forward.dropout_args``).
            _dq_tile(
                Q, K, V, DO, Lse2, Delta, DQ, Flag, Flag, Q, Flag, Flag, None, None,
                stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh, nheads * seqlen_q, seqlen_q,
                0, nheads, seqlen_q, seqlen_k, gqa_group, 0, 0, softmax_scale, 0, 0, 1.0, 0, 0, seed, dropout_p,
                seqlen_q, seqlen_k, None, None, 0, 0, 0, pid_m, pid_bh,
                HEAD_DIM, BLOCK_D, False, CAUSAL, False, False, 0, False, 0, DROPOUT, False, False, BLOCK_M, BLOCK_N,
                False, False,
            )


# The fallback's tile, (BLOCK_M, BLOCK_N, num_warps, num_stages): with every head flagged on an H200 (4,096 tokens,
# 2026-12-07, benchmarks/RESULTS.md "The flagged dQ pass") 128 x 64 with 8 warps and 3 stages ran 1.21-1.46x the 64 x 64
# tile of 4 warps at d = 64 and 128, and 1.18-1.45x the same tile with 2 stages.
FLAGGED_TILES = {64: (128, 64, 8, 3), 128: (128, 64, 8, 3)}


def dq_where_flagged(flag: torch.Tensor, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     lse2: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, causal: bool, softmax_scale: float,
                     dropout_p: float = 0.0, dropout_seed: int = 0, tiles: tuple[int, int, int, int] | None = None,
                     ) -> None:
    """Overwrite dq (q's shape, last dim contiguous) with dense attention's dQ for the query heads whose KV head's
    ``flag`` is nonzero, by ``_dq_where_flagged``; launched without a look at the flags (no host sync), one program
    per multiprocessor. flag: contiguous (batch * nheads_k,) int32 on q's device. q, dout: (batch, seqlen_q, nheads,
    d); k, v: (batch, seqlen_k, nheads_k, d), last dims contiguous; lse2, delta: contiguous (batch, nheads, seqlen_q)
    float32 (lse in log2 units, +inf for a row that saw no key). Dropout as the dense forward drew it with
    ``dropout_seed``. ``tiles``: (BLOCK_M, BLOCK_N, num_warps, num_stages), default ``FLAGGED_TILES``."""
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if flag.numel() != batch * nheads_k:
        raise ValueError(f"flag: expected {batch * nheads_k} int32 (batch * nheads_k), got {flag.numel()}")
    block_m, block_n, warps, stages = tiles or FLAGGED_TILES.get(d, (64, 64, 4, 2))
    num_tiles = triton.cdiv(seqlen_q, block_m) * batch * nheads
    programs = max(1, min(num_tiles, configs.multiprocessors(q.device.index) if q.is_cuda else 4))
    configs.launch_plain(
        _dq_where_flagged, (programs,), q, k, v, dout, lse2, delta, dq, flag, *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], nheads, nheads // nheads_k, seqlen_q, seqlen_k,
        softmax_scale, dropout_seed, dropout_p, num_tiles, flag.numel(), HEAD_DIM=d, BLOCK_D=configs.head_block(d),
        CAUSAL=bool(causal), DROPOUT=dropout_p > 0, BLOCK_M=block_m, BLOCK_N=block_n,
        FLAG_BLOCK=min(1024, triton.next_power_of_2(flag.numel())), num_warps=warps, num_stages=stages,
        **configs.pdl_options(q.device))


# batch * nheads * seqlen_q * seqlen_k * headdim below which the dQ pass shares the dK/dV pass's stream:
# 2**33 is a backward of ~86 GFLOP, ~0.25 ms of kernels on an H200 at the short lengths where it applies.
SIDE_STREAM_MIN_WORK = 2**33

configs.keep_choices_on_disk(_attn_bwd_dkdv, _attn_bwd_dq)
configs.compile_candidates_together(_attn_bwd_dkdv)
configs.compile_candidates_together(_attn_bwd_dq)
configs.fit_host_descriptors(_attn_bwd_dkdv, ("QHost", "DOHost"), "BLOCK_M")
configs.fit_host_descriptors(_attn_bwd_dq, ("KHost", "VHost"), "BLOCK_N")


def _stats_in_dq_pass(large: bool, fp8) -> bool:
    """Whether the dQ pass makes the rows' delta and lse₂ (``ROW_STATS``) instead of the preprocess kernel: a call
    too small to fork its dQ pass (``SIDE_STREAM_MIN_WORK``), from a 16-bit dO."""
    return not large and fp8 is None


def preprocess(out, dout, lse, cu_q, o_strides: tuple, do_strides: tuple, lse_strides: tuple, batch: int, nheads: int,
               seqlen_q: int, total_q: int = 0, varlen_mode: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, lse in log2 units) of the backward's rows, shaped like ``lse``: ``_attn_bwd_preprocess``.
    ``o_strides``/``do_strides``: (batch, token, head) strides of out and dout (batch 0 for packed rows), their
    last dim contiguous; ``lse_strides``: (batch, head) strides of lse."""
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    block_m = configs.PREPROCESS_BLOCK_M
    headdim = out.shape[-1]
    configs.launch_plain(
        _attn_bwd_preprocess, (configs.flat_programs(configs.cdiv(seqlen_q, block_m), batch * nheads),),
        out, dout, lse, delta, lse2, cu_q, *o_strides, *do_strides, *lse_strides, nheads, seqlen_q, total_q,
        batch * nheads,
        HEAD_DIM=headdim, BLOCK_D=configs.head_block(headdim), BLOCK_M=block_m, IS_VARLEN=varlen_mode,
    )
    return delta, lse2


def attention_backward(dout, q, k, v, out, lse, opts, varlen=None, fp8=None, grads=None):
    """Launch the backward kernels (two or three: the module's docstring).

    Args:
        dout: shape and dtype of q, last dim contiguous, any other strides.
        q, k, v, out, lse: the forward's inputs and outputs (see ``forward.attention_forward``).
        opts: ``flashtile.options.AttentionOptions``; varlen as in the forward.
        fp8: None, or (q8, k8, v8, dout8, scales) for FP8 products of QK^T and dO V^T (dense inputs, no
            dropout, block mask or ALiBi): float8_e4m3fn copies of q, k, v, dout, each with the strides of its
            16-bit twin (which must then be contiguous), and float32 (batch, nheads, 2) scales: per query
            head the product of q's and k's descales, and of v's and dout's.
        grads: None, or (dq, dk, dv) to write the gradients into (dense inputs): tensors of q's, k's and v's
            shapes and q's dtype, last dim contiguous, any other strides (the three slices of one packed
            gradient, say), returned as given.

    Returns:
        dq (shape of q), dk, dv (shape of k, v), contiguous (or ``grads``), dtype of q. For packed inputs, keys
        that no query sees get zero gradients.
    """
    configs.target_of(q.device)  # a GPU the kernels do not run on: its error before any launch
    if fp8 is None and configs.gluon_backward_choice(q, k, v, dout, opts, varlen):
        # sm90, d = 128 or 64, long sequences (configs.GLUON_BACKWARD_MIN_SEQLEN): one Gluon pass whose dQ
        # shares are added as integers (reproducible bits), warp-specialized; at d = 128 the keys as M in FA3's
        # order (configs.GLUON_BACKWARD_KEYS_AS_M), elsewhere the next pair's scores under each pair's products.
        from .gluon_backward import gluon_attention_backward

        causal = opts.right_limit == 0
        keys_as_m = (q.shape[3], causal) in configs.GLUON_BACKWARD_KEYS_AS_M
        dropout = dict(dropout_p=opts.dropout_p, dropout_seed=int(opts.dropout_seed)) if opts.dropout_p > 0 else {}
        return gluon_attention_backward(dout, q, k, v, out, lse, causal, opts.softmax_scale, one_pass="fixed",
                                        warp_specialize=True, pipelined=not keys_as_m,
                                        keys_as_m="fa3" if keys_as_m else False, grads=grads, **dropout)
    kind = "bwd" if fp8 is None else "bwd_fp8"
    variant = configs.proxy_tuning_needed(kind, q, k, opts, q.shape[1], k.shape[1]) if varlen is None else None
    if variant is not None:
        # Tiles tuned on the first tokens, found by the long call's capped key (configs.seqlen_bucket). Its
        # results are thrown away (the full lse does not belong to the shortened keys).
        rows_q, rows_k = min(q.shape[1], configs.TUNE_SEQLEN_CAP), min(k.shape[1], configs.TUNE_SEQLEN_CAP)
        short = None if fp8 is None else (fp8[0][:, :rows_q], fp8[1][:, :rows_k], fp8[2][:, :rows_k],
                                          fp8[3][:, :rows_q], fp8[4])
        attention_backward(dout[:, :rows_q], q[:, :rows_q], k[:, :rows_k], v[:, :rows_k], out[:, :rows_q],
                           lse[:, :, :rows_q].contiguous(), opts, fp8=short)
        configs.proxy_tuned(variant)
    if varlen is None:
        batch, seqlen_q, nheads, headdim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        cu_q = cu_k = placeholder(torch.int32, q.device)
        views = (q, k, v, dout, out)
        lse_strides = (lse.stride(0), lse.stride(1))
        varlen_mode = 0
    else:
        cu_q, cu_k, seqlen_q, seqlen_k = varlen
        varlen_mode, cu_q, cu_k, batch = varlen_bounds(cu_q, cu_k)
        if varlen_mode == 4:  # (a KV cache read through a batch index: forward only, flash_attn_with_kvcache)
            raise ValueError("the backward takes no keys read through a cache batch index")
        (_, nheads, headdim), nheads_k = q.shape, k.shape[1]
        views = tuple(t.unsqueeze(0) for t in (q, k, v, dout, out))
        lse_strides = (0, lse.stride(0))

    def strides(t4):
        return (t4.stride(0) if varlen is None else 0, t4.stride(1), t4.stride(2))

    q4, k4, v4, do4, o4 = views
    block_d = configs.head_block(headdim)
    gqa_group = nheads // nheads_k
    buckets = (configs.seqlen_bucket(seqlen_q), configs.seqlen_bucket(seqlen_k))
    (alibi, stride_alibi_b, scalars), switches = variant_args(opts, batch, q.device)
    total_q, total_k = (q.shape[0], k.shape[0]) if varlen_mode else (0, 0)  # rows the bounds may address

    if fp8 is not None:
        q8, k8, v8, do8, fp8_scales = fp8
        for name, x, twin in (("q", q8, q), ("k", k8, k), ("v", v8, v), ("dout", do8, dout)):
            if x.stride() != twin.stride() or x.shape != twin.shape:
                raise ValueError(f"the FP8 backward wants {name}'s float8 copy with its strides")
        if varlen is not None or opts.dropout_p > 0 or opts.block_mask is not None or opts.alibi_slopes is not None:
            raise ValueError("the FP8 backward takes dense inputs without dropout, a block mask or ALiBi")
    fp8_switch = {} if fp8 is None else {"FP8": True}
    # A large backward runs its dQ pass on a side stream beside the dK/dV pass, so that each fills the other's
    # last partial wave of blocks: 0.99-1.05x the one-stream time on an H200 (2026-11-30). A small one runs on one
    # stream: its kernels take less time than the host spends issuing them, so the overlap has nothing to gain,
    # and the fork and join cost two events and a stream switch (~30 us of host time per call on the H200
    # machine, benchmarks/lab/profile_call.py --split --finer).
    large = batch * nheads * seqlen_q * seqlen_k * headdim > SIDE_STREAM_MIN_WORK
    main_stream = side = None
    if q.is_cuda and large:
        main_stream, side = torch.cuda.current_stream(q.device), configs.side_stream(q.device)
        if side.cuda_stream == main_stream.cuda_stream:
            side = None  # PyTorch's pool gave back the current stream: one stream, dQ after dK/dV
    # A small call's dQ pass goes first and makes the rows' delta and lse₂ itself (ROW_STATS), as its programs own
    # the query rows: one launch fewer than the preprocess kernel before both passes. Chosen by the shape alone, so
    # that a call's bits do not depend on the stream it runs on (delta's sum is laid out differently in the two
    # kernels). FP8: the dQ pass reads a float8 dO, so the preprocess makes them from the 16-bit one.
    row_stats = _stats_in_dq_pass(large, fp8)
    if row_stats:
        delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    else:
        delta, lse2 = preprocess(out, dout, lse, cu_q, strides(o4), strides(do4), lse_strides, batch, nheads,
                                 seqlen_q, total_q, varlen_mode)

    if grads is not None:
        if varlen is not None:
            raise ValueError("grads: dense inputs only")
        dq, dk, dv = grads
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # Every key row is stored: valid cu_seqlens_k cover [0, total_k), and keys no query sees get zeros.
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dq4, dk4, dv4 = (t if varlen is None else t.unsqueeze(0) for t in (dq, dk, dv))
    common_strides = (*strides(q4), *strides(k4), *strides(v4), *strides(do4))
    # Block-sparse: the mask's on-tiles per key block (dK/dV pass) and per query block (dQ pass).
    kv_sparse, q_sparse = sparse_args(opts, True, q.device), sparse_args(opts, False, q.device)
    # Bytes streamed per program's head: Q and dO of its group (dK/dV pass), K and V (dQ pass; unpacked
    # GQA heads of one group share them).
    elem = q.element_size()
    kv_section = configs.heads_per_section(batch * nheads_k, 2 * gqa_group * seqlen_q * headdim * elem, opts)
    q_section = configs.heads_per_section(batch * nheads, 2 * seqlen_k * headdim * elem // gqa_group, opts)
    def kv_grid(meta):
        return (configs.flat_programs(configs.cdiv(seqlen_k, meta["BLOCK_N"]), batch * nheads_k),)

    def q_grid(meta):
        return (configs.flat_programs(configs.cdiv(seqlen_q, meta["BLOCK_M"]), batch * nheads),)

    # Dense inputs are read through descriptors made here once, as in the forward, rather than per
    # program: 1.015-1.039x the backward at non-causal s=2048/4096 on an H200, level when causal (2026-11-30;
    # docs/tuning.md). Packed sequences keep the per-(sequence, head) descriptors made in the kernel.
    # FP8: the dQ pass streams K and the float8 V (the descriptors' tensors); the float8 copies of Q, dO and K
    # that the passes read beside them come by pointers.
    q_tma, kv_tma = configs.use_tma(q, dout, rows=seqlen_q), configs.use_tma(k, v8 if fp8 else v, rows=seqlen_k)
    # dP issued before P's exponentials: on an H200 the backward at d=128 causal 1.019-1.028x, level
    # non-causal; d=64 causal 0.971-0.975x and d=256 0.99x (2026-11-30, docs/tuning.md), so only for
    # 64 < d <= 128. FLASHTILE_BWD_OVERLAP=0/1 forces it off/on (for A/B runs).
    early_dp = os.environ.get("FLASHTILE_BWD_OVERLAP", "1" if 64 < block_d <= 128 else "0") == "1"
    q_host = configs.host_descriptors((q, dout), block_d, q_tma, packed=varlen is not None)
    kv_host = configs.host_descriptors((k, v8 if fp8 else v), block_d, kv_tma, packed=varlen is not None)

    def launch_dq(row_stats: bool = False):
        configs.launch(
            _attn_bwd_dq, q_grid,
            q8 if fp8 else q, k, v8 if fp8 else v, do8 if fp8 else dout, lse2, delta, dq, cu_q, cu_k, alibi,
            *((k8, fp8_scales) if fp8 else q_sparse[:2]), *(kv_host or (None, None)),
            *common_strides, *strides(dq4), *lse_strides, stride_alibi_b,
            nheads, seqlen_q, seqlen_k, gqa_group, total_q, total_k, *scalars, *q_sparse[2:],
            *dropout_args(opts, q, k, varlen),
            batch * nheads, q_section, *((out, lse, *strides(o4)) if row_stats else (None, None, 0, 0, 0)),
            *buckets,
            HEAD_DIM=headdim, BLOCK_D=block_d, IS_VARLEN=varlen_mode, **switches,
            USE_TMA=kv_tma, HOST_TMA=kv_host is not None, EARLY_DP=early_dp, **fp8_switch,
            **({"ROW_STATS": True} if row_stats else {}),  # absent otherwise: the dQ pass's tuning keys as before
        )

    # Forked: the dQ pass goes first, onto the side stream, which starts after everything queued so far (delta,
    # the gradient buffers), and runs beside dK/dV (same inputs, different outputs). This stream waits for it
    # before returning, so callers (and CUDA-graph captures) see one stream. If the dK/dV launch raises (out of
    # memory while tuning, a compile error), the join still happens: the buffers the dQ pass uses must not
    # return to the allocator while it may still run.
    if side is not None:
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            launch_dq()
    elif row_stats:
        launch_dq(row_stats=True)
    try:
        # KV_GRADS 3: dK and dV in one launch. 1 then 2: dV alone, then dK alone, for d > 128: one
        # accumulator per launch leaves room for 128-key tiles; it recomputes the scores twice (8 matmuls
        # per tile pair instead of 7) and still runs d=256 backward 2-13% faster on an H200 than one launch.
        for kv_grads in ((1, 2) if block_d > 128 else (3,)):
            configs.launch(
                _attn_bwd_dkdv, kv_grid,
                q, k8 if fp8 else k, v8 if fp8 else v, dout, lse2, delta, dk, dv, cu_q, cu_k,
                fp8_scales if fp8 else alibi, *((q8, do8) if fp8 else kv_sparse[:2]), *(q_host or (None, None)),
                *common_strides, *strides(dk4), *strides(dv4), *lse_strides, stride_alibi_b,
                nheads, nheads_k, seqlen_q, seqlen_k, gqa_group, total_q, total_k, *scalars, *kv_sparse[2:],
                *dropout_args(opts, q, k, varlen),
                batch * nheads_k, kv_section,
                *buckets,
                HEAD_DIM=headdim, BLOCK_D=block_d, IS_VARLEN=varlen_mode, **switches,
                USE_TMA=q_tma, HOST_TMA=q_host is not None,
                # Masking only the edge tiles, by a branch per tile: 9% (d=64) and 3% (d=128) faster causal
                # dK/dV on an H200. Not for d > 128: there ptxas serializes the pass's wgmma around the branch.
                MASK_EDGES_ONLY=block_d <= 128, KV_GRADS=kv_grads, EARLY_DP=early_dp, **fp8_switch,
            )
    finally:
        if side is not None:
            main_stream.wait_stream(side)
    if side is None and not row_stats:
        launch_dq()
    return dq, dk, dv
