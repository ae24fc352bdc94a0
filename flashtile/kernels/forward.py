"""Forward kernel: online-softmax attention over streamed K/V tiles, writing out and lse.

One program owns BLOCK_M query rows of one (batch, head). K/V tiles of BLOCK_N keys stream through in
two stages: the interior tiles that every row of the block sees in full run with no mask at all; the
boundary tiles (the causal diagonal and the ragged end of the keys) run with masks. Tiles that no row
sees are never visited. Statistics are float32 in base 2: ``softmax_scale * log2(e)`` is folded into one
multiply so each score costs a single ``exp2``.
"""

import torch
import triton
import triton.language as tl

from . import configs
from .common import LN2, LOG2E, causal_keep, key_range, load_tile, store_tile


@triton.jit
def _fwd_kv_loop(
    acc, l_i, m_i, q,
    K_block, V_block, k_desc, v_desc, stride_kn, stride_vn,
    start_n_lo, start_n_hi, offs_m, offs_n, offs_d,
    seqlen_k, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Fold keys [start_n_lo, start_n_hi) into the running (acc, l_i, m_i) of one query block.

    MASKED=False is the interior stage: every row sees every key of each tile and keys are in bounds.
    """
    k_ptrs = K_block + tl.cast(start_n_lo, tl.int64) * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V_block + tl.cast(start_n_lo, tl.int64) * stride_vn + offs_n[:, None] * stride_vn + offs_d[None, :]
    for start_n in range(start_n_lo, start_n_hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            # The copy engine zero-fills rows past seqlen_k and columns past HEAD_DIM.
            k = k_desc.load([start_n, 0])
        else:
            k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & causal_keep(offs_m, cols, causal_offset)
            scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        if MASKED:
            # A row that has seen no key keeps m = -inf; subtract 0 instead to avoid inf - inf = NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.math.exp2(scores - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        else:
            v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.autotune(
    configs=configs.fwd_configs(),
    key=["SEQ_BUCKET_Q", "SEQ_BUCKET_K", "HEAD_DIM", "CAUSAL", "USE_TMA"],
    prune_configs_by={"early_config_prune": configs.fwd_prune},
    do_bench=configs.autotune_bench,
    cache_results=True,
)
@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    nheads, seqlen_q, seqlen_k, gqa_group, softmax_scale,
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # autotune keys only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid_bh = tl.program_id(1)
    if CAUSAL:
        # Causal rows near the bottom see the most keys: start those first so the tail is short.
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    batch = pid_bh // nheads
    head = pid_bh % nheads
    kv_head = head // gqa_group
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # 64-bit base offsets: batch * stride and row * stride can pass 2**31 elements.
    q_block = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh + start_m.to(tl.int64) * stride_qm
    K_block = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    V_block = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    q_ptrs = q_block + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, True, EVEN_D)
    if USE_TMA:
        # Per-(batch, kv head) 2-D views; the launcher checked the 16-byte alignment TMA needs.
        k_desc = tl.make_tensor_descriptor(K_block, shape=[seqlen_k, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V_block, shape=[seqlen_k, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc = K_block
        v_desc = V_block

    qk_scale = softmax_scale * LOG2E
    causal_offset = seqlen_k - seqlen_q
    interior_end, keys_end = key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _fwd_kv_loop(
        acc, l_i, m_i, q, K_block, V_block, k_desc, v_desc, stride_kn, stride_vn,
        0, interior_end, offs_m, offs_n, offs_d, seqlen_k, causal_offset, qk_scale,
        HEAD_DIM, BLOCK_N, EVEN_D, False, CAUSAL, USE_TMA,
    )
    acc, l_i, m_i = _fwd_kv_loop(
        acc, l_i, m_i, q, K_block, V_block, k_desc, v_desc, stride_kn, stride_vn,
        interior_end, keys_end, offs_m, offs_n, offs_d, seqlen_k, causal_offset, qk_scale,
        HEAD_DIM, BLOCK_N, EVEN_D, True, CAUSAL, USE_TMA,
    )

    # Rows that saw no key (l = 0) output 0 and lse = -inf.
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_i)) * LN2, float("-inf"))
    o_block = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + start_m.to(tl.int64) * stride_om
    o_ptrs = o_block + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
    store_tile(o_ptrs, out.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_D)
    tl.store(Lse + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Inputs are checked by the caller (``flashtile.interface``).

    Args:
        q: (batch, seqlen_q, nheads, headdim) fp16/bf16, last dim contiguous, any other strides.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device.

    Returns:
        out: (batch, seqlen_q, nheads, headdim) contiguous, dtype of q.
        lse: (batch, nheads, seqlen_q) float32, natural log; -inf for rows that see no key.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)

    def grid(meta):
        return (triton.cdiv(seqlen_q, meta["BLOCK_M"]), batch * nheads)

    _attn_fwd[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        nheads, seqlen_q, seqlen_k, nheads // nheads_k, softmax_scale,
        configs.seqlen_bucket(seqlen_q), configs.seqlen_bucket(seqlen_k),
        HEAD_DIM=headdim, BLOCK_D=configs.head_block(headdim), CAUSAL=causal,
        USE_TMA=configs.use_tma(k, v),
    )
    return out, lse
