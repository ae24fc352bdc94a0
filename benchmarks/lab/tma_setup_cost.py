"""What a program pays to start loading K/V tiles: device-made TMA descriptors, host-made ones, or plain loads.

    python benchmarks/lab/tma_setup_cost.py [--tiles 1,4,16] [--headdim 64]

A probe kernel shaped like the forward's prologue and loop (one program per (query block, sequence·head),
BSHD bf16 tensors, Q by plain loads, then TILES key tiles each of QK^T and PV matmuls) in three ways of
reading K and V:

- ``device``: ``tl.make_tensor_descriptor`` per program over the (sequence, head) rows, as the kernels do
  (the descriptor is written to global memory behind a fence);
- ``host``: one 4-D ``TensorDescriptor`` (batch, seqlen, heads, head_dim) made on the host per launch,
  blocks of (1, BLOCK_N, 1, head_dim) reshaped to (BLOCK_N, head_dim);
- ``pointer``: unmasked ``tl.load`` of the tile.

Time per program from launches of 8192 programs (CUDA events, median); the difference between
TILES=1 and larger TILES separates the per-program set-up from the per-tile cost. Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

MODES = {"device": 0, "host": 1, "pointer": 2}


@triton.jit
def _probe(Q, K, V, Out, k_host, v_host, stride_b, stride_s, stride_h, seqlen, nheads,
           MODE: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // nheads
    head = pid_bh % nheads
    base = batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * stride_s + offs_d[None, :])
    if MODE == 0:
        k_dev = tl.make_tensor_descriptor(K + base, shape=[seqlen, HEAD_DIM], strides=[stride_s, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_dev = tl.make_tensor_descriptor(V + base, shape=[seqlen, HEAD_DIM], strides=[stride_s, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for j in range(TILES):
        start_n = j * BLOCK_N
        if MODE == 0:
            k = k_dev.load([start_n, 0])
            v = v_dev.load([start_n, 0])
        elif MODE == 1:
            k = k_host.load([batch, start_n, head, 0]).reshape(BLOCK_N, HEAD_DIM)
            v = v_host.load([batch, start_n, head, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k = tl.load(K + base + (start_n + offs_n)[:, None] * stride_s + offs_d[None, :])
            v = tl.load(V + base + (start_n + offs_n)[:, None] * stride_s + offs_d[None, :])
        scores = tl.dot(q, tl.trans(k))
        acc = tl.dot(scores.to(v.dtype), v, acc)
    tl.store(Out + base + offs_m[:, None] * stride_s + offs_d[None, :], acc.to(Out.dtype.element_ty))


def run(mode: str, tiles: int, headdim: int, block_m: int = 128, block_n: int = 128,
        programs: int = 8192) -> tuple[float, int]:
    """(median µs per launch, programs per launch)."""
    seqlen = max(tiles * block_n, block_m)
    nheads = 16
    batch = max(1, programs // (nheads * (seqlen // block_m)))
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    grid = (seqlen // block_m, batch * nheads)

    def launch():
        if mode == "host":
            k_host = TensorDescriptor.from_tensor(k, [1, block_n, 1, headdim])
            v_host = TensorDescriptor.from_tensor(v, [1, block_n, 1, headdim])
        else:
            k_host = v_host = None
        _probe[grid](q, k, v, out, k_host, v_host, k.stride(0), k.stride(1), k.stride(2), seqlen, nheads,
                     MODE=MODES[mode], TILES=tiles, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=headdim,
                     num_warps=4, num_stages=3)

    launch()
    torch.cuda.synchronize()
    return triton.testing.do_bench(launch, warmup=25, rep=100, return_mode="median") * 1000, grid[0] * grid[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", default="1,4,16")
    parser.add_argument("--headdim", type=int, default=64)
    args = parser.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, head_dim {args.headdim}, "
          "128x128 tiles, 4 warps")
    for tiles in (int(t) for t in args.tiles.split(",")):
        cells = []
        for mode in MODES:
            us, programs = run(mode, tiles, args.headdim)
            cells.append(f"{mode} {us:8.1f} µs ({us / programs * 132 * 1000:6.0f} ns per program-slot)")
        print(f"tiles={tiles:<3d} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
