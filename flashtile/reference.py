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
from dataclasses import replace

import torch

from .options import SPARSE_BLOCK, AttentionOptions, as_bounds

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


def key_bounds(start_m: int, end_m: int, seqlen_q: int, seqlen_k: int, opts: AttentionOptions) -> tuple[int, int]:
    """[lo, hi): the keys any query row in [start_m, end_m) may see (window and causal bounds)."""
    shift = seqlen_k - seqlen_q
    lo = 0 if opts.left_limit is None else max(0, start_m + shift - opts.left_limit)
    hi = seqlen_k if opts.right_limit is None else min(seqlen_k, max(0, end_m - 1 + shift + opts.right_limit + 1))
    return min(lo, hi), hi


def query_bounds(start_n: int, end_n: int, seqlen_q: int, seqlen_k: int, opts: AttentionOptions) -> tuple[int, int]:
    """[lo, hi): the query rows that may see any key in [start_n, end_n)."""
    shift = seqlen_k - seqlen_q
    lo = 0 if opts.right_limit is None else max(0, start_n - shift - opts.right_limit)
    hi = seqlen_q if opts.left_limit is None else min(seqlen_q, max(0, end_n - 1 - shift + opts.left_limit + 1))
    return min(lo, hi), hi


def _keep(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int, opts: AttentionOptions):
    """(block_m, block_n) bool: query ``rows[i]`` may see key ``cols[j]``, or None when all may."""
    diagonal = rows[:, None] + (seqlen_k - seqlen_q)  # the key aligned with each query
    keep = None
    if opts.right_limit is not None:
        keep = cols[None, :] <= diagonal + opts.right_limit
    if opts.left_limit is not None:
        left = cols[None, :] >= diagonal - opts.left_limit
        keep = left if keep is None else keep & left
    return keep


def _slopes(opts: AttentionOptions, batch: int, nheads_k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """ALiBi slopes as (batch or 1, nheads_k, group, 1, 1) to broadcast over score tiles."""
    if opts.alibi_slopes is None:
        return None
    slopes = opts.alibi_slopes.to(dtype)
    slopes = slopes.view(1, -1) if slopes.dim() == 1 else slopes
    return slopes.view(slopes.shape[0], nheads_k, -1, 1, 1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x >> n) & ((1 << (64 - n)) - 1)  # logical shift of int64 bits


def dropout_keep(row_base: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, seqlen_k: int, seed: int,
                 dropout_p: float) -> torch.Tensor:
    """Bool, the broadcast shape of the three int64 index tensors: which entries survive dropout, entry (query
    ``rows``, key ``cols``) of the head whose first query is counter row ``row_base``. Counter-based: the same
    seed and indices always give the same answer, so the backward regenerates the forward's mask; the kernels'
    generator (``kernels.common.dropout_keep``) bit for bit.

    The four entries (i, j), (i, j + 8), (i + 8, j), (i + 8, j + 8) with bit 3 of i and j clear share one 64-bit
    hash, SplitMix64's output function of the counter ``(row_base + i) * seqlen_k + j`` plus the seed; entry
    (i, j) reads its 16 bits s = 2 (bit 3 of i) + (bit 3 of j) of it and is kept where they reach
    ``ceil(p * 2**16)``, p rounded to float32 as the kernels take it."""
    group = (row_base + (rows & ~8)) * seqlen_k + (cols & ~8)
    z = (group + seed) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    slot = ((rows >> 3) & 1) * 2 + ((cols >> 3) & 1)
    bits = (z >> (16 * slot)) & 0xFFFF  # (bits above those of the 16 are masked off: the shift's sign is moot)
    return bits >= math.ceil(torch.tensor(dropout_p, dtype=torch.float32).item() * 2.0**16)


def dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int,
                 device) -> torch.Tensor:
    """(batch, nheads, seqlen_q, seqlen_k) bool: the entries a dense call keeps for this seed, as
    ``kernels.dropout_mask`` draws them on a GPU."""
    heads = torch.arange(batch * nheads, device=device).view(batch, nheads, 1, 1)
    rows = torch.arange(seqlen_q, device=device)[:, None]
    return dropout_keep(heads * seqlen_q, rows, torch.arange(seqlen_k, device=device), seqlen_k, seed, dropout_p)


def dropout_keep_tile(opts, batch, nheads, seqlen_q, seqlen_k, rows, cols, nheads_k) -> torch.Tensor:
    """(B, Hk, G, bm, bn) bool: which probabilities of this tile survive dropout. Head (b, h) starts at counter
    row (b * nheads + h) * seqlen_q, as in the kernels."""
    heads = torch.arange(batch * nheads, device=rows.device, dtype=torch.int64).view(batch, nheads_k, -1, 1, 1)
    return dropout_keep(heads * seqlen_q, rows[:, None], cols[None, :], seqlen_k, opts.dropout_seed,
                        opts.dropout_p)


def _scores(q_block, k_block, rows, cols, seqlen_q, seqlen_k, opts, slopes):
    """Scores of one tile in log2 units, masked to -inf, and tanh of the soft-capped scores (or None).

    score = softcap * tanh(q k^T * scale / softcap) (if softcap) - slope * |i + sk - sq - j| (if ALiBi)
    """
    scores = (q_block @ k_block.transpose(-1, -2)) * opts.softmax_scale  # (B, Hk, G, bm, bn)
    tanh = None
    if opts.softcap > 0:
        tanh = torch.tanh(scores / opts.softcap)
        scores = opts.softcap * tanh
    if slopes is not None:
        distance = (rows[:, None] + (seqlen_k - seqlen_q) - cols[None, :]).abs().to(scores.dtype)
        scores = scores - slopes * distance
    keep = _keep(rows, cols, seqlen_q, seqlen_k, opts)
    scores = scores * LOG2E
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    if opts.block_mask is not None:
        # Block-sparse: (B, H, row blocks, col blocks) -> this tile's (B, Hk, G, bm, bn) element mask.
        tile = opts.block_mask[:, :, rows // SPARSE_BLOCK][:, :, :, cols // SPARSE_BLOCK]
        scores = scores.masked_fill(~tile.view(scores.shape), -math.inf)
    return scores, tanh


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    opts: AttentionOptions,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled online-softmax attention forward.

    Args:
        q: (batch, seqlen_q, nheads, headdim), any float dtype.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device as q.
        opts: scale, causal/window mask, softcap, ALiBi (``flashtile.options.AttentionOptions``).

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q.
        lse: (batch, nheads, seqlen_q) natural-log logsumexp of the final scores, float32 (float64
            for float64 inputs, so that the backward keeps float64 accuracy); ``-inf`` for rows that
            see no key.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    acc_dtype = _accumulator_dtype(q.dtype)
    slopes = _slopes(opts, batch, nheads_k, acc_dtype)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, nheads_k, group, seqlen_q, dtype=acc_dtype, device=q.device)
    k_heads, v_heads = _kv_heads(k), _kv_heads(v)
    for start_m in range(0, seqlen_q, block_m):
        end_m = min(start_m + block_m, seqlen_q)
        rows = torch.arange(start_m, end_m, device=q.device)
        q_block = _split_heads(q[:, start_m:end_m], nheads_k).to(acc_dtype)  # (B, Hk, G, bm, D)
        m_i = torch.full(q_block.shape[:-1], -math.inf, dtype=acc_dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        if opts.sink is not None:
            # The sink is one more score per row, with no value: it starts the running max and sum.
            m_i = (opts.sink.to(acc_dtype) * LOG2E).view(1, nheads_k, group, 1).expand_as(m_i).clone()
            l_i = torch.ones_like(m_i)
        acc = torch.zeros_like(q_block)
        keys_lo, keys_hi = key_bounds(start_m, end_m, seqlen_q, seqlen_k, opts)
        # Tiles outside [keys_lo, keys_hi) are seen by no row of the block: skipped, never computed.
        for start_n in range(keys_lo // block_n * block_n, keys_hi, block_n):
            end_n = min(start_n + block_n, seqlen_k)
            cols = torch.arange(start_n, end_n, device=q.device)
            k_block = k_heads[:, :, :, start_n:end_n].to(acc_dtype)  # (B, Hk, 1, bn, D)
            v_block = v_heads[:, :, :, start_n:end_n].to(acc_dtype)
            scores, _ = _scores(q_block, k_block, rows, cols, seqlen_q, seqlen_k, opts, slopes)
            m_new = torch.maximum(m_i, scores.amax(dim=-1))
            # A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp2(scores - m_safe[..., None])
            alpha = torch.exp2(m_i - m_safe)
            l_i = l_i * alpha + p.sum(dim=-1)  # the normaliser keeps every probability
            if opts.dropout_p > 0:
                keep = dropout_keep_tile(opts, batch, nheads, seqlen_q, seqlen_k, rows, cols, nheads_k)
                p = torch.where(keep, p / (1 - opts.dropout_p), torch.zeros_like(p))
            acc = acc * alpha[..., None] + p @ v_block
            m_i = m_new
        seen = l_i != 0  # (not "> 0": a NaN sum, from a NaN score, keeps its row's lse NaN, not -inf)
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
    opts: AttentionOptions,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recomputation backward of :func:`attention_forward`.

    K/V blocks in the outer loop (their dK/dV accumulate in registers in the kernel), Q blocks in the
    inner loop; dQ accumulates in a float32 buffer of the size of q. Serial, hence deterministic.

    Args:
        dout: (batch, seqlen_q, nheads, headdim) gradient of out, any strides.
        q, k, v, out: as in and from :func:`attention_forward`.
        lse: (batch, nheads, seqlen_q) from :func:`attention_forward`.

    Returns:
        dq (shape and dtype of q), dk, dv (shape and dtype of k, v; summed over the query heads that
        share a kv head).
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    acc_dtype = _accumulator_dtype(q.dtype)
    slopes = _slopes(opts, batch, nheads_k, acc_dtype)

    # delta_i = sum_d dout_id * out_id = sum_j P_ij dP_ij: the softmax-backward row term.
    delta = _split_heads((dout.to(acc_dtype) * out.to(acc_dtype)), nheads_k).sum(-1)  # (B, Hk, G, Sq)
    # Rows that saw no key have lse = -inf; +inf makes their recomputed probabilities exactly 0.
    lse2 = lse.to(acc_dtype).view(batch, nheads_k, group, seqlen_q) * LOG2E
    lse2 = torch.where(torch.isneginf(lse2), torch.full_like(lse2, math.inf), lse2)

    q_heads = _split_heads(q, nheads_k)
    dout_heads = _split_heads(dout, nheads_k)
    dq_acc = torch.zeros(batch, nheads_k, group, seqlen_q, headdim, dtype=acc_dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for start_n in range(0, seqlen_k, block_n):
        end_n = min(start_n + block_n, seqlen_k)
        cols = torch.arange(start_n, end_n, device=q.device)
        k_block = _kv_heads(k[:, start_n:end_n]).to(acc_dtype)  # (B, Hk, 1, bn, D)
        v_block = _kv_heads(v[:, start_n:end_n]).to(acc_dtype)
        dk_acc = torch.zeros(batch, nheads_k, group, end_n - start_n, headdim, dtype=acc_dtype, device=q.device)
        dv_acc = torch.zeros_like(dk_acc)
        rows_lo, rows_hi = query_bounds(start_n, end_n, seqlen_q, seqlen_k, opts)
        for start_m in range(rows_lo // block_m * block_m, rows_hi, block_m):
            end_m = min(start_m + block_m, seqlen_q)
            rows = torch.arange(start_m, end_m, device=q.device)
            q_block = q_heads[:, :, :, start_m:end_m].to(acc_dtype)  # (B, Hk, G, bm, D)
            do_block = dout_heads[:, :, :, start_m:end_m].to(acc_dtype)
            scores, tanh = _scores(q_block, k_block, rows, cols, seqlen_q, seqlen_k, opts, slopes)
            p = torch.exp2(scores - lse2[..., start_m:end_m, None])  # masked scores give exactly 0
            dp = do_block @ v_block.transpose(-1, -2)
            if opts.dropout_p > 0:
                # The forward's mask again: dV sees the dropped weights, dP the same mask and scale.
                keep = dropout_keep_tile(opts, batch, nheads, seqlen_q, seqlen_k, rows, cols, nheads_k)
                zero = torch.zeros_like(p)
                dv_acc += torch.where(keep, p / (1 - opts.dropout_p), zero).transpose(-1, -2) @ do_block
                dp = torch.where(keep, dp / (1 - opts.dropout_p), zero)
            else:
                dv_acc += p.transpose(-1, -2) @ do_block
            ds = p * (dp - delta[..., start_m:end_m, None])  # gradient w.r.t. the final score
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)  # through softcap * tanh(x / softcap)
            dk_acc += ds.transpose(-1, -2) @ q_block
            dq_acc[..., start_m:end_m, :] += ds @ k_block
        # Sum over the query heads that share this kv head, then back to (B, bn, Hk, D).
        dk[:, start_n:end_n] = (dk_acc.sum(2) * opts.softmax_scale).permute(0, 2, 1, 3)
        dv[:, start_n:end_n] = dv_acc.sum(2).permute(0, 2, 1, 3)
    dq = (dq_acc * opts.softmax_scale).permute(0, 3, 1, 2, 4).reshape(batch, seqlen_q, nheads, headdim)
    return dq.to(q.dtype), dk, dv


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(batch index, q slice, k slice) per packed sequence (cu_seqlens or (batch, 2) bounds)."""
    bounds_q, bounds_k = as_bounds(cu_seqlens_q).tolist(), as_bounds(cu_seqlens_k).tolist()
    for b, ((sq, lq), (sk, lk)) in enumerate(zip(bounds_q, bounds_k)):
        yield b, slice(sq, sq + lq), slice(sk, sk + lk)


def _sequence_options(opts: AttentionOptions, b: int) -> AttentionOptions:
    if opts.alibi_slopes is not None and opts.alibi_slopes.dim() == 2:
        opts = replace(opts, alibi_slopes=opts.alibi_slopes[b])
    if opts.dropout_p > 0:
        opts = replace(opts, dropout_seed=opts.dropout_seed + b * (1 << 40))  # distinct counters per sequence
    return opts


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts):
    """Packed sequences: q (total_q, nheads, d), k/v (total_k, nheads_k, d) -> out, lse (nheads, total_q).

    Each sequence is attention of its own; the loop is over sequences on this path (the kernels launch
    once for all of them).
    """
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=_accumulator_dtype(q.dtype), device=q.device)
    for b, sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        o, l_ = attention_forward(q[None, sq], k[None, sk], v[None, sk], _sequence_options(opts, b))
        out[sq], lse[:, sq] = o[0], l_[0]
    return out, lse


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts):
    """Backward of :func:`varlen_attention_forward`; dk/dv of keys no query sees are 0."""
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    for b, sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        grads = attention_backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], out[None, sq],
                                   lse[None, :, sq], _sequence_options(opts, b))
        dq[sq], dk[sk], dv[sk] = (g[0] for g in grads)
    return dq, dk, dv


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    compute_dtype: torch.dtype | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    return_probs: bool = False,
):
    """Naive attention that materialises the full score matrix. A test oracle only.

    Written straight from the flash-attn semantics, sharing no helper with the tiled path.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
        compute_dtype: dtype of the arithmetic (float64 for the oracle); None keeps the input dtype
            (``out_torch`` of the accuracy rule).
        window_size, softcap, alibi_slopes, sink: as in ``flash_attn_func``.
        dropout_mask: (batch, nheads, seqlen_q, seqlen_k) bool of kept probabilities (with dropout_p).
        return_probs: also return the (undropped) probabilities (batch, nheads, seqlen_q, seqlen_k).

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
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # Key position relative to the query's bottom-right-aligned diagonal.
    i = torch.arange(seqlen_q, device=q.device)[:, None]
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    relative = j - (i + seqlen_k - seqlen_q)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        scores = scores - slopes * relative.abs().to(scores.dtype)
    left, right = window_size
    if causal:
        right = 0
    mask = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if right >= 0:
        mask |= relative > right
    if left >= 0:
        mask |= relative < -left
    scores = scores.masked_fill(mask, -math.inf)
    if sink is not None:
        # One extra column per row holding the sink logit; it has no value and is dropped after softmax.
        column = sink.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    attn = torch.softmax(scores, dim=-1)
    attn = torch.nan_to_num(attn, nan=0.0)  # rows with no key: softmax of all -inf
    if sink is not None:
        attn = attn[..., :-1]
    weights = attn
    if dropout_mask is not None:
        weights = torch.where(dropout_mask, attn / (1 - dropout_p), torch.zeros_like(attn))
    out = torch.einsum("bhts,bshd->bthd", weights, v)
    return (out, lse, attn) if return_probs else (out, lse)
