"""Backward kernels: recompute each probability tile from Q, K and the saved lse.

Three launches, none with atomics, so gradients are bitwise reproducible:

1. ``_attn_bwd_preprocess``: ``delta = rowsum(dout * out)`` per query row (float32).
2. ``_attn_bwd_dkdv``: one program per (K/V block, batch, kv head) keeps its K, V tile and the dK, dV
   accumulators on chip and streams the query tiles of every query head in its GQA group, so the group
   reduction happens in registers.
3. ``_attn_bwd_dq``: one program per (Q block, batch, head) streams K/V tiles, mirroring the forward.

With ``P = exp2(S * scale * log2(e) - lse * log2(e))``: ``dV = P^T dO``, ``dP = dO V^T``,
``dS = P * (dP - delta)``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``.
"""

import torch
import triton
import triton.language as tl

from . import configs
from .common import LOG2E, causal_keep, key_range, load_tile, query_range, store_tile


@triton.jit
def _attn_bwd_preprocess(
    Out, DO, Delta,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    nheads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // nheads
    head = pid_bh % nheads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    o_ptrs += rows.to(tl.int64)[:, None] * stride_om + offs_d[None, :]
    do_ptrs = DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
    do_ptrs += rows.to(tl.int64)[:, None] * stride_dom + offs_d[None, :]
    o = load_tile(o_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    do = load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * seqlen_q + rows, tl.sum(o * do, 1), mask=rows < seqlen_q)


@triton.jit
def _load_row_stats(Lse_head, Delta_head, rows, seqlen_q):
    """lse in log2 units and delta of the given rows.

    Rows past seqlen_q and rows that saw no key (lse = -inf) get lse = +inf, which makes every
    recomputed probability of the row exactly 0.
    """
    lse2 = tl.load(Lse_head + rows, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    delta = tl.load(Delta_head + rows, mask=rows < seqlen_q, other=0.0)
    return lse2, delta


@triton.jit
def _bwd_dkdv_q_loop(
    dk, dv, k, v,
    Q_head, DO_head, Lse_head, Delta_head, stride_qm, stride_dom,
    start_m_lo, start_m_hi, offs_n, offs_d,
    seqlen_q, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    MASKED: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Accumulate into (dk, dv) of one key block the contributions of query rows [lo, hi)."""
    offs_m = tl.arange(0, BLOCK_M)
    q_ptrs = Q_head + tl.cast(start_m_lo, tl.int64) * stride_qm + offs_m[:, None] * stride_qm + offs_d[None, :]
    do_ptrs = DO_head + tl.cast(start_m_lo, tl.int64) * stride_dom + offs_m[:, None] * stride_dom + offs_d[None, :]
    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(Q_head, shape=[seqlen_q, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        do_desc = tl.make_tensor_descriptor(DO_head, shape=[seqlen_q, HEAD_DIM], strides=[stride_dom, 1],
                                            block_shape=[BLOCK_M, BLOCK_D])
    for start_m in range(start_m_lo, start_m_hi, BLOCK_M):
        rows = start_m + offs_m
        if USE_TMA:
            q = q_desc.load([start_m, 0])
            do = do_desc.load([start_m, 0])
        else:
            q = load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
            do = load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
        lse2, delta = _load_row_stats(Lse_head, Delta_head, rows, seqlen_q)
        # Transposed tiles (BLOCK_N, BLOCK_M) so that dK and dV come out as (BLOCK_N, BLOCK_D).
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASKED:
            # causal_keep transposed: key offs_n[i] is seen by query rows[j].
            p_t = tl.where(offs_n[:, None] <= rows[None, :] + causal_offset, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.autotune(
    configs=configs.bwd_kv_configs(),
    key=["SEQ_BUCKET_Q", "SEQ_BUCKET_K", "HEAD_DIM", "CAUSAL", "USE_TMA"],
    prune_configs_by={"early_config_prune": configs.bwd_kv_prune},
    do_bench=configs.autotune_bench,
    cache_results=True,
)
@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    nheads, nheads_k, seqlen_q, seqlen_k, gqa_group, softmax_scale,
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # autotune keys only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    batch = pid_bhk // nheads_k
    kv_head = pid_bhk % nheads_k
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k_ptrs = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + start_n.to(tl.int64) * stride_kn
    k_ptrs += tl.arange(0, BLOCK_N)[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + start_n.to(tl.int64) * stride_vn
    v_ptrs += tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_d[None, :]
    # Keys past seqlen_k read as 0: their rows of dK/dV are garbage-free and never stored.
    k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, True, EVEN_D)
    v = load_tile(v_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, True, EVEN_D)

    qk_scale = softmax_scale * LOG2E
    causal_offset = seqlen_k - seqlen_q
    masked_start, interior_start, rows_end = query_range(start_n, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # The query heads sharing this kv head, reduced here in registers rather than by atomics.
    for g in range(0, gqa_group):
        head = kv_head * gqa_group + g
        bh = batch.to(tl.int64) * nheads + head
        Q_head = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
        DO_head = DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
        Lse_head = Lse + bh * seqlen_q
        Delta_head = Delta + bh * seqlen_q
        if CAUSAL:
            dk, dv = _bwd_dkdv_q_loop(
                dk, dv, k, v, Q_head, DO_head, Lse_head, Delta_head, stride_qm, stride_dom,
                masked_start, interior_start, offs_n, offs_d, seqlen_q, causal_offset, qk_scale,
                HEAD_DIM, BLOCK_M, BLOCK_D, EVEN_D, True, USE_TMA,
            )
        dk, dv = _bwd_dkdv_q_loop(
            dk, dv, k, v, Q_head, DO_head, Lse_head, Delta_head, stride_qm, stride_dom,
            interior_start, rows_end, offs_n, offs_d, seqlen_q, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_M, BLOCK_D, EVEN_D, False, USE_TMA,
        )

    dk_ptrs = DK + batch.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh
    dk_ptrs += start_n.to(tl.int64) * stride_dkn + tl.arange(0, BLOCK_N)[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + batch.to(tl.int64) * stride_dvb + kv_head.to(tl.int64) * stride_dvh
    dv_ptrs += start_n.to(tl.int64) * stride_dvn + tl.arange(0, BLOCK_N)[:, None] * stride_dvn + offs_d[None, :]
    store_tile(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_D)


@triton.jit
def _bwd_dq_kv_loop(
    dq, q, do, lse2, delta,
    K_head, V_head, k_desc, v_desc, stride_kn, stride_vn,
    start_n_lo, start_n_hi, offs_m, offs_d,
    seqlen_k, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Accumulate into dq of one query block the contributions of keys [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = K_head + tl.cast(start_n_lo, tl.int64) * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V_head + tl.cast(start_n_lo, tl.int64) * stride_vn + offs_n[:, None] * stride_vn + offs_d[None, :]
    for start_n in range(start_n_lo, start_n_hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
        else:
            k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
            v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASKED:
            # Keys past seqlen_k were read as 0 and would otherwise get probability exp2(-lse2) > 0.
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & causal_keep(offs_m, cols, causal_offset)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.autotune(
    configs=configs.bwd_q_configs(),
    key=["SEQ_BUCKET_Q", "SEQ_BUCKET_K", "HEAD_DIM", "CAUSAL", "USE_TMA"],
    prune_configs_by={"early_config_prune": configs.bwd_q_prune},
    do_bench=configs.autotune_bench,
    cache_results=True,
)
@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    nheads, seqlen_q, seqlen_k, gqa_group, softmax_scale,
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # autotune keys only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid_bh = tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    else:
        pid_m = tl.program_id(0)
    batch = pid_bh // nheads
    head = pid_bh % nheads
    kv_head = head // gqa_group
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + start_m.to(tl.int64) * stride_qm
    q_ptrs += tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    do_ptrs = DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh + start_m.to(tl.int64) * stride_dom
    do_ptrs += tl.arange(0, BLOCK_M)[:, None] * stride_dom + offs_d[None, :]
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
    do = load_tile(do_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
    bh = pid_bh.to(tl.int64)
    lse2, delta = _load_row_stats(Lse + bh * seqlen_q, Delta + bh * seqlen_q, offs_m, seqlen_q)

    K_head = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    V_head = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(K_head, shape=[seqlen_k, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V_head, shape=[seqlen_k, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc = K_head
        v_desc = V_head
    qk_scale = softmax_scale * LOG2E
    causal_offset = seqlen_k - seqlen_q
    interior_end, keys_end = key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _bwd_dq_kv_loop(
        dq, q, do, lse2, delta, K_head, V_head, k_desc, v_desc, stride_kn, stride_vn,
        0, interior_end, offs_m, offs_d, seqlen_k, causal_offset, qk_scale,
        HEAD_DIM, BLOCK_N, EVEN_D, False, CAUSAL, USE_TMA,
    )
    dq = _bwd_dq_kv_loop(
        dq, q, do, lse2, delta, K_head, V_head, k_desc, v_desc, stride_kn, stride_vn,
        interior_end, keys_end, offs_m, offs_d, seqlen_k, causal_offset, qk_scale,
        HEAD_DIM, BLOCK_N, EVEN_D, True, CAUSAL, USE_TMA,
    )
    dq_ptrs = DQ + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh + start_m.to(tl.int64) * stride_dqm
    dq_ptrs += tl.arange(0, BLOCK_M)[:, None] * stride_dqm + offs_d[None, :]
    store_tile(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_D)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the three backward kernels.

    Args:
        dout: (batch, seqlen_q, nheads, headdim), dtype of q, last dim contiguous, any other strides.
        q, k, v, out, lse: the forward's inputs and outputs (lse float32 (batch, nheads, seqlen_q)).

    Returns:
        dq (shape of q), dk, dv (shape of k, v), contiguous, dtype of q.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    block_d = configs.head_block(headdim)
    gqa_group = nheads // nheads_k
    buckets = (configs.seqlen_bucket(seqlen_q), configs.seqlen_bucket(seqlen_k))

    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    block_m = configs.PREPROCESS_BLOCK_M
    _attn_bwd_preprocess[(triton.cdiv(seqlen_q, block_m), batch * nheads)](
        out, dout, delta,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        nheads, seqlen_q,
        HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_M=block_m,
    )

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    common_strides = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
    )
    _attn_bwd_dkdv[lambda meta: (triton.cdiv(seqlen_k, meta["BLOCK_N"]), batch * nheads_k)](
        q, k, v, dout, lse, delta, dk, dv,
        *common_strides,
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        nheads, nheads_k, seqlen_q, seqlen_k, gqa_group, softmax_scale,
        *buckets,
        HEAD_DIM=headdim, BLOCK_D=block_d, CAUSAL=causal, USE_TMA=configs.use_tma(q, dout),
    )
    _attn_bwd_dq[lambda meta: (triton.cdiv(seqlen_q, meta["BLOCK_M"]), batch * nheads)](
        q, k, v, dout, lse, delta, dq,
        *common_strides,
        dq.stride(0), dq.stride(1), dq.stride(2),
        nheads, seqlen_q, seqlen_k, gqa_group, softmax_scale,
        *buckets,
        HEAD_DIM=headdim, BLOCK_D=block_d, CAUSAL=causal, USE_TMA=configs.use_tma(k, v),
    )
    return dq, dk, dv
