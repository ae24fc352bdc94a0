"""The instruction mix of the forward kernel's loops, compiled for sm_90 without a GPU.

    python benchmarks/lab/sass_mix.py [--fp8] [--dropout 0.1] [--headdim 128] [--seqlen 4096] [--top 12] [--backward]

The process becomes a stand-in sm_90 driver (``stand_in_hopper.py``), calls the forward on small CPU tensors
(``--fp8``: FP8 q, k, v through ``attention_forward``, as ``flash_attn_func`` runs them on a GPU), causal and not,
with the default tiles (``FLASHTILE_AUTOTUNE=0``) and TMA as on an H200, and disassembles each compiled
``_attn_fwd`` with the ``nvdisasm`` bundled with Triton. For every loop (a backward branch) it prints the loop's
length in instructions and its most frequent opcodes: per K/V tile, each of the tile's warps issues that many.
Kernel switches read at import apply as set in the environment: compare two runs. ``--backward``: the Triton
backward's two passes (``_attn_bwd_dkdv``, ``_attn_bwd_dq``) instead, 16-bit only.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["FLASHTILE_AUTOTUNE"] = "0"

import torch  # noqa: E402
from stand_in_hopper import install  # noqa: E402

install()

from flashtile.kernels import backward, configs, forward  # noqa: E402
from flashtile.kernels.compile_check import disassemble, sass_loops  # noqa: E402
from flashtile.options import AttentionOptions  # noqa: E402

configs.use_tma = lambda *tensors, rows: rows >= configs.TMA_MIN_ROWS  # as on an H200 with aligned tensors

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p (the kernels' dropout variant)")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--backward", action="store_true", help="the backward passes' loops (not with --fp8)")
    args = parser.parse_args()
    d = args.headdim
    q, k, v = (torch.randn(1, args.seqlen, 2, d, dtype=torch.bfloat16) for _ in range(3))
    fp8 = None
    if args.fp8:
        from flashtile.fp8 import quantize

        (q, qd), (k, kd), (v, vd) = quantize(q.float()), quantize(k.float()), quantize(v.float())
        fp8 = (qd, kd, vd, torch.bfloat16, False)
    for causal in (False, True):
        opts = AttentionOptions(d ** -0.5, causal, -1, 0 if causal else -1, dropout_p=args.dropout, dropout_seed=1234)
        out, lse = forward.attention_forward(q, k, v, opts, fp8=fp8)
        if args.backward:
            backward.attention_backward(torch.randn_like(out), q, k, v, out, lse, opts)
    kernels = [backward._attn_bwd_dkdv, backward._attn_bwd_dq] if args.backward else [forward._attn_fwd]
    for kernel in kernels:
        _print_loops(kernel, args.top)
    return 0


def _print_loops(kernel, top: int) -> None:
    names = kernel.fn.arg_names
    for cache in kernel.fn.device_caches.values():
        for compiled in cache[0].values():
            const = {n: compiled.src.constants.get((i,)) for i, n in enumerate(names)}
            print(f"{kernel.fn.__name__} d={const['HEAD_DIM']} causal={const['LIMIT_RIGHT']} FP8={const['FP8']} "
                  f"tile {const['BLOCK_M']}x{const['BLOCK_N']} warps={compiled.metadata.num_warps}")
            # (loops of a few instructions are barrier waits' retries)
            for i, body in enumerate(b for b in sass_loops(disassemble(compiled.asm["cubin"])) if len(b) > 16):
                mix = collections.Counter(body).most_common(top)
                print(f"  loop {i}: {len(body)} instructions: " + " ".join(f"{op} {n}" for op, n in mix))


if __name__ == "__main__":
    sys.exit(main())
