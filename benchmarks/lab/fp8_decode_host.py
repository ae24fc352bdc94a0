"""Host time of one decoding step over an FP8 KV cache against a 16-bit one, on any machine, GPU or not.

    PYTHONSAFEPATH=1 PYTHONPATH=<repo>:benchmarks/lab python benchmarks/lab/fp8_decode_host.py [--calls 500]

As host_overhead.py does it: CPU tensors, the Triton backend forced, Triton's launch path whole under the
stand-in sm_90 driver (raw launches: the driver call recorded, not made). One new token per sequence is
appended to a (2, 128, 2, 64) cache and attended by 8 query heads, over:
- a float16 cache;
- an FP8 cache, the new tokens already float8 in the cache's scale (the step replays a launch plan);
- an FP8 cache, float16 new tokens (quantized by PyTorch ops in the call: the ordinary path every step);
- the same, the tokens quantized first by ``flashtile.fp8.quantize_with`` (PyTorch ops too, then a replayed step).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ["FLASHTILE_AUTOTUNE"] = "0"

import torch  # noqa: E402
from stand_in_hopper import Launcher, install  # noqa: E402

import flashtile.inference as inference  # noqa: E402
import flashtile.interface as interface  # noqa: E402
from flashtile import flash_attn_with_kvcache, fp8  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    install(raw=True)
    interface.select_backend = inference.select_backend = lambda device: "triton"
    batch, length, nheads_k, nheads, d = 2, 128, 2, 8, 64
    k_cache, v_cache = (torch.randn(batch, length, nheads_k, d, dtype=torch.float16) for _ in range(2))
    q = torch.randn(batch, 1, nheads, d, dtype=torch.float16)
    k_new, v_new = (torch.randn(batch, 1, nheads_k, d, dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([100, 120], dtype=torch.int32)
    (k8, kd), (v8, vd) = fp8.quantize(k_cache), fp8.quantize(v_cache)
    q8, qd = fp8.quantize(q, nheads_k)
    k_new8, v_new8 = fp8._quantize_with(k_new.float(), kd), fp8._quantize_with(v_new.float(), vd)
    scales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    cases = {
        "float16 cache": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens),
        "FP8 cache, FP8 new tokens": lambda: flash_attn_with_kvcache(q8, k8, v8, k_new8, v_new8,
                                                                     cache_seqlens=seqlens, **scales),
        "FP8 cache, fp16 new tokens": lambda: flash_attn_with_kvcache(q8, k8, v8, k_new, v_new,
                                                                      cache_seqlens=seqlens, **scales),
        "FP8 cache, quantize_with + step": lambda: flash_attn_with_kvcache(
            q8, k8, v8, fp8.quantize_with(k_new, kd), fp8.quantize_with(v_new, vd), cache_seqlens=seqlens, **scales),
    }
    for name, step in cases.items():
        for _ in range(20):
            step()
        before = Launcher.launches
        step()
        launches = Launcher.launches - before
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.calls):
                step()
            best = min(best, (time.perf_counter() - start) / args.calls)
        print(f"{name:32s} {best * 1e6:7.1f} us per step (host only), {launches} launches")


if __name__ == "__main__":
    main()
