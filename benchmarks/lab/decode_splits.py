"""GPU time (CUDA-graph replays) of the wall-time rows' decoding steps at fixed split-KV counts: one new token
appended to a cache and attended to it all (``flash_attn_with_kvcache``, 32 query heads over 8 KV heads,
d = 128, bf16), each ``num_splits`` in turn and the default heuristic (``configs.split_count``), against SDPA's
cuDNN backend writing the token and attending the same cache. Bandwidth: K and V bytes read once / time.

    PYTHONPATH=. python benchmarks/lab/decode_splits.py [--points 8:4096,1:32768,64:2048] [--splits 1,2,3,4,...]
"""

from __future__ import annotations

import argparse
import os

os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"  # every split count through the ordinary path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from dense_decode import gpu_us  # noqa: E402  (CUDA-graph GPU time, µs)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashtile import flash_attn_with_kvcache  # noqa: E402
from flashtile.kernels import configs  # noqa: E402

NHEADS, NHEADS_K, HEADDIM = 32, 8, 128


def point(batch: int, length: int, splits: list[int]) -> None:
    dtype, device = torch.bfloat16, "cuda"
    k_cache = torch.randn(batch, length, NHEADS_K, HEADDIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, 1, NHEADS, HEADDIM, dtype=dtype, device=device)
    k_new = torch.randn(batch, 1, NHEADS_K, HEADDIM, dtype=dtype, device=device)
    v_new = torch.randn_like(k_new)
    seqlens = torch.full((batch,), length - 1, dtype=torch.int32, device=device)
    gbytes = 2 * k_cache.numel() * k_cache.element_size() / 1e9

    def ours(num_splits):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                       num_splits=num_splits)

    def cudnn():
        k_cache[:, length - 1:length] = k_new
        v_cache[:, length - 1:length] = v_new
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                                  enable_gqa=True).transpose(1, 2)

    reference = cudnn().float()
    default = configs.split_count(q.device, batch, NHEADS, NHEADS_K, 1, length, False)
    base = gpu_us(cudnn)
    print(f"b={batch} cache={length}: cuDNN {base:.1f} µs ({gbytes / base * 1e3:.2f} TB/s); heuristic splits {default}")
    for num_splits in [0, *splits]:
        us = gpu_us(lambda num_splits=num_splits: ours(num_splits))
        diff = (ours(num_splits).float() - reference).abs().max().item()
        label = f"default ({default})" if num_splits == 0 else str(num_splits)
        print(f"  splits {label:>12}: {us:7.1f} µs  {gbytes / us * 1e3:.2f} TB/s  {us / base:.3f}x cuDNN  "
              f"max diff {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", default="8:4096,1:32768,64:2048", help="batch:cache pairs")
    parser.add_argument("--splits", default="1,2,3,4,6,8,12,16,24,32,48,64")
    args = parser.parse_args()
    splits = [int(s) for s in args.splits.split(",") if s]
    for item in args.points.split(","):
        batch, length = (int(x) for x in item.split(":"))
        point(batch, length, splits)


if __name__ == "__main__":
    main()
