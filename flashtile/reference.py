"""The FlashAttention algorithm in plain PyTorch: the CPU backend and the readable specification.

Every Triton kernel in ``flashtile.kernels`` computes exactly what the functions here compute, tile by
tile, in the same order of operations:

* forward: Q blocks of ``block_m`` rows in the outer loop, K/V blocks of ``block_n`` keys streamed in
  the inner loop, an online softmax with a running row maximum ``m`` and running row sum ``l`` kept in
  float32 (float64 for float64 inputs) in the base-2 domain (``exp2(x * log2(e))``), the accumulator
  rescaled whenever the maximum moves and normalised once at the end. Only ``out`` and the row
  logsumexp ``lse`` are returned.
* backward: ``delta = rowsum(dout * out)``, then every probability tile is rebuilt from Q, K and the
  saved ``lse`` (recomputation) and turned into dQ, dK and dV. No ``seqlen_q x seqlen_k`` tensor is ever
  built: peak memory is ``O(seqlen * block)``.

Layout is flash-attn's BSHD: ``q: (batch, seqlen_q, nheads, headdim)``, ``k, v: (batch, seqlen_k,
nheads_k, headdim)`` with ``nheads % nheads_k == 0`` (GQA/MQA). ``causal`` masks are aligned to the
bottom-right corner: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``; a query row that
sees no key gets ``out = 0`` and ``lse = -inf``.

``attention_ref`` at the end is the naive materialising oracle for tests; nothing else uses it.
"""

from __future__ import annotations

import math

import torch

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 128


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split_heads(x: torch.Tensor, nheads_k: int) -> torch.Tensor:
    """(batch, rows, nheads, d) -> (batch, nheads_k, group, rows, d) as a view (no copy)."""
    batch, rows, nheads, headdim = x.shape
    return x.view(batch, rows, nheads_k, nheads // nheads_k, headdim).permute(0, 2, 3, 1, 4)


def _kv_heads(x: torch.Tensor) -> torch.Tensor:
    """(batch, rows, nheads_k, d) -> (batch, nheads_k, 1, rows, d), broadcasting over the group."""
    return x.permute(0, 2, 1, 3).unsqueeze(2)


def key_range(start_m: int, block_m: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """One past the last key any query row of the block ``[start_m, start_m + block_m)`` may see."""
    if not causal:
        return seqlen_k
    return min(seqlen_k, max(0, start_m + block_m + seqlen_k - seqlen_q))


def query_start(start_n: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """The first query row that sees key ``start_n`` (every row when not causal)."""
    if not causal:
        return 0
    return min(seqlen_q, max(0, start_n - (seqlen_k - seqlen_q)))


def _causal_keep(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """(block_m, block_n) bool: query ``rows[i]`` may see key ``cols[j]`` (bottom-right aligned)."""
    return cols[None, :] <= rows[:, None] + (seqlen_k - seqlen_q)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled online-softmax attention forward.

    Args:
        q: (batch, seqlen_q, nheads, headdim), any float dtype.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device as q.
        softmax_scale: multiplier of ``q @ k^T`` before the softmax.
        causal: bottom-right aligned causal mask.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q.
        lse: (batch, nheads, seqlen_q) natural-log logsumexp of the scaled scores, float32 (float64
            for float64 inputs, so that the backward keeps float64 accuracy); ``-inf`` for rows that
            see no key.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    acc_dtype = _accumulator_dtype(q.dtype)
    # Folding log2(e) into the scale lets the loop use exp2, as the kernels do.
    qk_scale = softmax_scale * LOG2E

    out = torch.empty_like(q)
    lse = torch.empty(batch, nheads_k, group, seqlen_q, dtype=acc_dtype, device=q.device)
    k_heads, v_heads = _kv_heads(k), _kv_heads(v)
    for start_m in range(0, seqlen_q, block_m):
        end_m = min(start_m + block_m, seqlen_q)
        rows = torch.arange(start_m, end_m, device=q.device)
        q_block = _split_heads(q[:, start_m:end_m], nheads_k).to(acc_dtype)  # (B, Hk, G, bm, D)
        m_i = torch.full(q_block.shape[:-1], -math.inf, dtype=acc_dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_block)
        for start_n in range(0, key_range(start_m, end_m - start_m, seqlen_q, seqlen_k, causal), block_n):
            end_n = min(start_n + block_n, seqlen_k)
            k_block = k_heads[:, :, :, start_n:end_n].to(acc_dtype)  # (B, Hk, 1, bn, D)
            v_block = v_heads[:, :, :, start_n:end_n].to(acc_dtype)
            scores = (q_block @ k_block.transpose(-1, -2)) * qk_scale  # (B, Hk, G, bm, bn), log2 units
            if causal:
                cols = torch.arange(start_n, end_n, device=q.device)
                scores = scores.masked_fill(~_causal_keep(rows, cols, seqlen_q, seqlen_k), -math.inf)
            m_new = torch.maximum(m_i, scores.amax(dim=-1))
            # A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp2(scores - m_safe[..., None])
            alpha = torch.exp2(m_i - m_safe)
            l_i = l_i * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v_block
            m_i = m_new
        seen = l_i > 0
        acc = acc / torch.where(seen, l_i, torch.ones_like(l_i))[..., None]
        lse[..., start_m:end_m] = torch.where(seen, (m_i + torch.log2(l_i)) * LN2, -math.inf)
        # (B, Hk, G, bm, D) -> (B, bm, H, D)
        out[:, start_m:end_m] = acc.permute(0, 3, 1, 2, 4).reshape(batch, end_m - start_m, nheads, headdim)
    return out, lse.reshape(batch, nheads, seqlen_q)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recomputation backward of :func:`attention_forward`.

    K/V blocks in the outer loop (their dK/dV accumulate in registers in the kernel), Q blocks in the
    inner loop; dQ accumulates in a float32 buffer of the size of q. Serial, hence deterministic.

    Args:
        dout: (batch, seqlen_q, nheads, headdim) gradient of out, any strides.
        q, k, v, out: as in and from :func:`attention_forward`.
        lse: (batch, nheads, seqlen_q) float32 from :func:`attention_forward`.

    Returns:
        dq (shape and dtype of q), dk, dv (shape and dtype of k, v; summed over the query heads that
        share a kv head).
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    acc_dtype = _accumulator_dtype(q.dtype)
    qk_scale = softmax_scale * LOG2E

    # delta_i = sum_d dout_id * out_id = sum_j P_ij dP_ij: the softmax-backward row term.
    delta = _split_heads((dout.to(acc_dtype) * out.to(acc_dtype)), nheads_k).sum(-1)  # (B, Hk, G, Sq)
    # Rows that saw no key have lse = -inf; +inf makes their recomputed probabilities exactly 0.
    lse2 = lse.to(acc_dtype).view(batch, nheads_k, group, seqlen_q) * LOG2E
    lse2 = torch.where(torch.isneginf(lse2), torch.full_like(lse2, math.inf), lse2)

    q_heads = _split_heads(q, nheads_k)
    dout_heads = _split_heads(dout, nheads_k)
    dq_acc = torch.zeros(batch, nheads_k, group, seqlen_q, headdim, dtype=acc_dtype, device=q.device)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    for start_n in range(0, seqlen_k, block_n):
        end_n = min(start_n + block_n, seqlen_k)
        cols = torch.arange(start_n, end_n, device=q.device)
        k_block = _kv_heads(k[:, start_n:end_n]).to(acc_dtype)  # (B, Hk, 1, bn, D)
        v_block = _kv_heads(v[:, start_n:end_n]).to(acc_dtype)
        dk_acc = torch.zeros(batch, nheads_k, group, end_n - start_n, headdim, dtype=acc_dtype, device=q.device)
        dv_acc = torch.zeros_like(dk_acc)
        first_row = query_start(start_n, seqlen_q, seqlen_k, causal)
        for start_m in range(first_row // block_m * block_m, seqlen_q, block_m):
            end_m = min(start_m + block_m, seqlen_q)
            rows = torch.arange(start_m, end_m, device=q.device)
            q_block = q_heads[:, :, :, start_m:end_m].to(acc_dtype)  # (B, Hk, G, bm, D)
            do_block = dout_heads[:, :, :, start_m:end_m].to(acc_dtype)
            scores = (q_block @ k_block.transpose(-1, -2)) * qk_scale  # (B, Hk, G, bm, bn)
            p = torch.exp2(scores - lse2[..., start_m:end_m, None])
            if causal:
                p = p.masked_fill(~_causal_keep(rows, cols, seqlen_q, seqlen_k), 0.0)
            dv_acc += p.transpose(-1, -2) @ do_block
            dp = do_block @ v_block.transpose(-1, -2)
            ds = p * (dp - delta[..., start_m:end_m, None])
            dk_acc += ds.transpose(-1, -2) @ q_block
            dq_acc[..., start_m:end_m, :] += ds @ k_block
        # Sum over the query heads that share this kv head, then back to (B, bn, Hk, D).
        dk[:, start_n:end_n] = (dk_acc.sum(2) * softmax_scale).permute(0, 2, 1, 3)
        dv[:, start_n:end_n] = dv_acc.sum(2).permute(0, 2, 1, 3)
    dq = (dq_acc * softmax_scale).permute(0, 3, 1, 2, 4).reshape(batch, seqlen_q, nheads, headdim)
    return dq.to(q.dtype), dk, dv


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive attention that materialises the full score matrix. A test oracle only.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
        compute_dtype: dtype of the arithmetic (float64 for the oracle); None keeps the input dtype
            (``out_torch`` of the accuracy rule).

    Returns:
        out (dtype of the computation, shape of q) and lse (batch, nheads, seqlen_q) in that dtype,
        ``-inf`` where a row sees no key.
    """
    if compute_dtype is not None:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    seqlen_q, nheads, headdim = q.shape[1], q.shape[2], q.shape[3]
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = headdim**-0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(nheads // nheads_k, dim=2)
    v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)
        cols = torch.arange(seqlen_k, device=q.device)
        scores = scores.masked_fill(~_causal_keep(rows, cols, seqlen_q, seqlen_k), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    attn = torch.softmax(scores, dim=-1)
    attn = torch.nan_to_num(attn, nan=0.0)  # rows with no key: softmax of all -inf
    out = torch.einsum("bhts,bshd->bthd", attn, v)
    return out, lse
