"""Why FP8-cache decoding reads at 3.1-3.7 TB/s: the layout of V, tested on a minimal split-KV decoding kernel.

    python benchmarks/lab/fp8_v_layout.py [--points 8:32768,1:131072,32:32768,64:4096]

A decoding step's P V takes V as the product's B operand with the keys as its reduction dimension. A 16-bit V
in the usual (keys, head_dim) rows reaches the tensor cores through ``ldmatrix.trans``; an FP8 V does not (the
transposing load has no 8-bit form), so Triton reads its elements from shared memory one byte at a time (the
issue-bound FP8 step in RESULTS, "FP8"). With V keys-fastest, (head_dim, keys) rows, the keys are contiguous
and the operand loads are vector loads. This script times one query token per sequence over a cache (GQA
32/8 heads, d = 128, keys split over programs, the splits' partial results not merged) with K and V in bf16,
FP8 rows, and FP8 with V keys-fastest, the same kernel otherwise, best of a few tiles each, as CUDA-graph
replays; and flashtile's own steps (``flash_attn_with_kvcache``, bf16 and FP8 caches) beside them.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

import flashtile
from flashtile import fp8


@triton.jit
def _decode_split(Q, K, V, Out, Lse, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd,
                  chunk, qk_scale, NHEADS_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, V_KEYS_FASTEST: tl.constexpr,
                  DOT_TYPE: tl.constexpr):
    """Program (batch * NHEADS_K + kv_head, split): the GROUP query heads of a KV head (rows of a BLOCK_M tile)
    over keys [split * chunk, (split + 1) * chunk); out (fp32) and lse of the split."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    batch = bh // NHEADS_K
    kv_head = bh % NHEADS_K
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, BLOCK_N)
    q = tl.load(Q + (bh * GROUP + rows[:, None]) * HEAD_DIM + dims[None, :], mask=rows[:, None] < GROUP, other=0.0)
    q = q.to(DOT_TYPE)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo = split * chunk
    for start in range(lo, lo + chunk, BLOCK_N):
        k = tl.load(k_base + (start + keys.to(tl.int64))[:, None] * stride_ks + dims[None, :])
        if k.dtype != DOT_TYPE:  # FP8 through fp16 (exact)
            k = k.to(tl.float16).to(DOT_TYPE)
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_KEYS_FASTEST:
            v = tl.trans(tl.load(v_base + dims.to(tl.int64)[:, None] * stride_vd + (start + keys)[None, :]))
        else:
            v = tl.load(v_base + (start + keys.to(tl.int64))[:, None] * stride_vs + dims[None, :])
        if v.dtype != DOT_TYPE:
            v = v.to(tl.float16).to(DOT_TYPE)
        acc = tl.dot(p.to(DOT_TYPE), v, acc * alpha[:, None])
        m_i = m_new
    out_rows = (split * tl.num_programs(0) + bh) * GROUP + rows
    tl.store(Out + out_rows[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None], mask=rows[:, None] < GROUP)
    tl.store(Lse + out_rows, m_i + tl.math.log2(l_i), mask=rows < GROUP)


def run_split(q, k, v, splits, block_n, stages, warps, keys_fastest):
    """Partial (out, lse2) per split: q (batch, nheads, d), k (batch, keys, nheads_k, d), v likewise, or as
    (batch, nheads_k, d, keys) in memory when keys_fastest."""
    batch, nheads, d = q.shape
    seqlen, nheads_k = k.shape[1], k.shape[2]
    chunk = seqlen // splits
    out = torch.empty(splits, batch * nheads, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, batch * nheads, dtype=torch.float32, device=q.device)
    dot_type = tl.bfloat16 if k.dtype == torch.bfloat16 else tl.float16
    if keys_fastest:  # v: (batch, nheads_k, d, keys)
        strides = (v.stride(0), 1, v.stride(1), v.stride(2))
    else:
        strides = (v.stride(0), v.stride(1), v.stride(2), 1)
    _decode_split[(batch * nheads_k, splits)](
        q, k, v, out, lse, k.stride(0), k.stride(1), k.stride(2), *strides, chunk, d ** -0.5 * 1.4426950408889634,
        NHEADS_K=nheads_k, GROUP=nheads // nheads_k, BLOCK_M=16, BLOCK_N=block_n, HEAD_DIM=d,
        V_KEYS_FASTEST=keys_fastest, DOT_TYPE=dot_type, num_stages=stages, num_warps=warps)
    return out, lse


def merged(out, lse):
    """The splits' partial results merged: (batch * nheads, d)."""
    weights = torch.softmax(lse * 0.6931471805599453, dim=0)
    return (weights.unsqueeze(-1) * out).sum(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="8:32768,1:131072,32:32768,64:4096")
    args = parser.parse_args()
    nheads, nheads_k, d = 32, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = list(itertools.product((64, 128), (2, 3, 4), (4,)))
    print(f"{'batch':>5} {'cache':>7} | {'layout':>22} {'best tile':>16} {'us':>8} {'TB/s':>6} {'vs bf16':>7} | err")
    for point in args.points.split(","):
        batch, cache = (int(x) for x in point.split(":"))
        splits = max(1, min(cache // 512, (2 * sms) // (batch * nheads_k) or 1))
        while cache % (splits * 128):
            splits -= 1
        q = torch.randn(batch, nheads, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, cache, nheads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        (k8, kd), (v8, vd) = fp8.quantize(k), fp8.quantize(v)
        kq, vq = fp8.dequantize(k8, kd), fp8.dequantize(v8, vd)  # the FP8 values, descales folded in below
        # The kernel takes raw FP8 values: scale q by k's descale and the outputs by v's (per batch, kv head).
        group = nheads // nheads_k
        q_scaled = (q.float() * kd.repeat_interleave(group, 1).unsqueeze(-1)).to(torch.bfloat16)
        v8_t = v8.permute(0, 2, 3, 1).contiguous()  # (batch, nheads_k, d, keys)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2).float(), kq.transpose(1, 2).float(), vq.transpose(1, 2).float(), enable_gqa=True
        ).squeeze(2).reshape(batch * nheads, d)
        kv_bytes = batch * cache * nheads_k * d * 2 * 2  # K and V in bf16
        bf16_us = None
        variants = (("bf16", kq, vq, False, q, None), ("fp8 rows", k8, v8, False, q_scaled, vd),
                    ("fp8 keys-fastest", k8, v8_t, True, q_scaled, vd))
        for name, kk, vv, kf, qq, vscale in variants:
            best = None
            for block_n, stages, warps in tiles:
                fn = partial(run_split, qq, kk, vv, splits, block_n, stages, warps, kf)
                try:
                    o, lse = fn()
                    torch.cuda.synchronize()
                    t = do_bench_cudagraph(fn) * 1e3
                except Exception as exc:  # a tile that does not fit
                    print(f"  {name} {block_n}x{stages}x{warps}: {type(exc).__name__}")
                    continue
                if best is None or t < best[0]:
                    out = merged(o, lse)
                    if vscale is not None:
                        out = out * vscale.repeat_interleave(group, 1).reshape(-1, 1)
                    best = (t, f"{block_n}x{stages}st{warps}w", (out - ref).abs().max().item())
            t, tile, err = best
            nbytes = kv_bytes // (1 if name == "bf16" else 2)
            bf16_us = t if name == "bf16" else bf16_us
            print(f"{batch:>5} {cache:>7} | {name:>22} {tile:>16} {t:8.1f} {nbytes / t / 1e6:6.2f} "
                  f"{bf16_us / t:7.2f} | {err:.1e}  (splits {splits})", flush=True)
        seqlens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
        q4, q8 = q.unsqueeze(1), fp8.quantize(q.unsqueeze(1), nheads_k)
        t_b = do_bench_cudagraph(partial(flashtile.flash_attn_with_kvcache, q4, kq, vq, cache_seqlens=seqlens)) * 1e3
        t_8 = do_bench_cudagraph(partial(flashtile.flash_attn_with_kvcache, q8[0], k8, v8, cache_seqlens=seqlens,
                                         q_descale=q8[1], k_descale=kd, v_descale=vd)) * 1e3
        print(f"{batch:>5} {cache:>7} | {'flashtile bf16 / fp8':>22} {'':>16} {t_b:8.1f} {t_8:8.1f} {t_b / t_8:7.2f}",
              flush=True)


if __name__ == "__main__":
    main()
