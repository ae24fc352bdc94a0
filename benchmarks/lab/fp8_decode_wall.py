"""Wall time of eager decoding steps over an FP8 cache against a bf16 cache, as a bf16 model makes them.

    python benchmarks/lab/fp8_decode_wall.py [--calls 30] [--repeats 11]

The decoding rows of ``flashtile bench --overhead`` (one new token appended per sequence, d = 128, 32 query
heads over 8 KV heads; loops of eager calls synchronised once, median of the loops, the implementations
taking turns), with the model's q, k, v in bf16 each step:

* ``bf16``: a bf16 cache;
* ``fp8_prequantized``: an FP8 cache (``fp8.zeros_cache``), q and the new tokens quantized once, outside the
  loop (the step alone: the replayed launches);
* ``fp8_quantize_with``: q quantized per step by ``fp8.quantize``, the new tokens by ``fp8.quantize_with``;
* ``fp8_16bit_tokens``: q quantized per step, the bf16 new tokens given to the call;
* ``fp8_bf16_q``: bf16 q and bf16 new tokens given to the call as they are (n/a where the call refuses them);
* ``sdpa``: SDPA (its default backend) over the bf16 cache, the new token written by a slice assignment.
"""

from __future__ import annotations

import argparse

import torch

from flashtile import flash_attn_with_kvcache, fp8
from flashtile.bench_overhead import DECODE_HEADS, DECODE_STEPS, _sdpa_call, _time_round_robin


def calls_for(batch: int, length: int, device: torch.device) -> dict:
    nheads, nheads_k, headdim = DECODE_HEADS
    k_cache = torch.randn(batch, length, nheads_k, headdim, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, 1, nheads, headdim, dtype=torch.bfloat16, device=device)
    k_new, v_new = (torch.randn(batch, 1, nheads_k, headdim, dtype=torch.bfloat16, device=device) for _ in range(2))
    seqlens = torch.full((batch,), length - 1, dtype=torch.int32, device=device)
    k_descale = k_cache.abs().amax(dim=(1, 3)).float() / fp8.FP8_MAX
    v_descale = v_cache.abs().amax(dim=(1, 3)).float() / fp8.FP8_MAX
    k8, v8 = fp8.zeros_cache(batch, length, nheads_k, headdim, device=device)
    k8.copy_(fp8.quantize_with(k_cache, k_descale))
    v8.copy_(fp8.quantize_with(v_cache, v_descale))
    q8_fixed, qd_fixed = fp8.quantize(q, nheads_k)
    k_new8, v_new8 = fp8.quantize_with(k_new, k_descale), fp8.quantize_with(v_new, v_descale)

    def bf16():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens)

    def fp8_prequantized():
        return flash_attn_with_kvcache(q8_fixed, k8, v8, k_new8, v_new8, cache_seqlens=seqlens, q_descale=qd_fixed,
                                       k_descale=k_descale, v_descale=v_descale)

    def fp8_quantize_with():
        q8, qd = fp8.quantize(q, nheads_k)
        return flash_attn_with_kvcache(q8, k8, v8, fp8.quantize_with(k_new, k_descale),
                                       fp8.quantize_with(v_new, v_descale), cache_seqlens=seqlens, q_descale=qd,
                                       k_descale=k_descale, v_descale=v_descale)

    def fp8_16bit_tokens():
        q8, qd = fp8.quantize(q, nheads_k)
        return flash_attn_with_kvcache(q8, k8, v8, k_new, v_new, cache_seqlens=seqlens, q_descale=qd,
                                       k_descale=k_descale, v_descale=v_descale)

    def fp8_bf16_q():
        return flash_attn_with_kvcache(q, k8, v8, k_new, v_new, cache_seqlens=seqlens, k_descale=k_descale,
                                       v_descale=v_descale)

    def sdpa():
        k_cache[:, length - 1:length] = k_new
        v_cache[:, length - 1:length] = v_new
        return _sdpa_call(q, k_cache, v_cache, False, enable_gqa=True)

    return {"bf16": bf16, "fp8_prequantized": fp8_prequantized, "fp8_quantize_with": fp8_quantize_with,
            "fp8_16bit_tokens": fp8_16bit_tokens, "fp8_bf16_q": fp8_bf16_q, "sdpa": sdpa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    device = torch.device("cuda")
    names = None
    for batch, length in DECODE_STEPS:
        timings, spread = _time_round_robin(calls_for(batch, length, device), args.calls, args.repeats, device)
        if names is None:
            names = list(timings)
            print("| step | " + " | ".join(f"{name} µs" for name in names) + " |")
            print("|---|" + "---|" * len(names))
        cells = [f"{v:.0f} ({spread[n][0]:.0f}-{spread[n][1]:.0f})" if isinstance(v := timings[n], float) else v
                 for n in names]
        print(f"| b={batch} cache={length} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
