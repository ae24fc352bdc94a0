"""GPU time (CUDA-graph replays) of a decoding step made through flash_attn_func: one query token over a
growing cache, as Hugging Face's dynamic cache calls it (keys a BHSD tensor seen as BSHD), split-KV on and
off, against SDPA's cuDNN and flash backends on the same tensors.

    PYTHONPATH=. python benchmarks/lab/dense_decode.py   # on the GPU
"""

from __future__ import annotations

import functools
import os

os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"  # split on and off share a plan key: take the ordinary path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from flashtile import flash_attn_func  # noqa: E402
from flashtile.kernels import configs  # noqa: E402

CASES = [(8, 4097, 32, 8, 64), (1, 32769, 32, 8, 128), (64, 2049, 32, 8, 128), (8, 16385, 16, 16, 128)]
HEADER = ("| batch | keys | heads q/kv | d | flashtile split µs | splits | flashtile unsplit µs | cuDNN µs "
          "| SDPA flash µs | max abs diff to cuDNN |")


def gpu_us(fn) -> float:
    """GPU time of fn in µs: CUDA-graph replays, so host time is not counted."""
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200) * 1e3


def ours(q, k, v):
    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)


def sdpa(q, k, v, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def main() -> None:
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    choose = configs.split_count
    for batch, keys, nheads, nheads_k, d in CASES:
        q = torch.randn(batch, nheads, 1, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, nheads_k, keys, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        splits = choose(q.device, batch, nheads, nheads_k, 1, keys, False)
        split_us = gpu_us(functools.partial(ours, q, k, v))
        configs.split_count = lambda *args: 1
        try:
            whole_us = gpu_us(functools.partial(ours, q, k, v))
        finally:
            configs.split_count = choose
        peers = [gpu_us(functools.partial(sdpa, q, k, v, backend))
                 for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)]
        err = (ours(q, k, v).float() - sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION).float()).abs().max().item()
        print(f"| {batch} | {keys} | {nheads}/{nheads_k} | {d} | {split_us:.1f} | {splits} | {whole_us:.1f} | "
              f"{peers[0]:.1f} | {peers[1]:.1f} | {err:.1e} |")


if __name__ == "__main__":
    main()
