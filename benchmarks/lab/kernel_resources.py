"""Registers, spills and shared memory of every tile candidate, compiled for sm_90 without a GPU.

    python benchmarks/lab/kernel_resources.py [--headdims 64,128] [--causal false,true] [--seqlen 4096]

Runs one forward+backward per point under the stand-in sm_90 driver (``stand_in_hopper.py``) with
``FLASHTILE_AUTOTUNE=compile``, so every candidate of the forward, dK/dV and dQ kernels is compiled as
on an H200 (TMA paths included); then reads each compiled kernel's PTX through the bundled ptxas with
``-v``: registers, spills, and whether ptxas serialized the kernel's wgmma instructions (with its reason).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["FLASHTILE_AUTOTUNE"] = "compile"

import torch  # noqa: E402
from stand_in_hopper import install  # noqa: E402

install()

import flashtile.interface as interface  # noqa: E402
from flashtile import flash_attn_func  # noqa: E402
from flashtile.kernels import backward, configs, forward  # noqa: E402
from flashtile.kernels.compile_check import ptxas_log  # noqa: E402

interface.select_backend = lambda device: "triton"
configs.use_tma = lambda *tensors, rows: rows >= configs.TMA_MIN_ROWS  # as on an H200 with aligned tensors


def ptxas_report(ptx: str) -> str:
    log = ptxas_log(ptx)
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    # ptxas serializes every wgmma of a kernel it cannot pipeline, and says why: the first thing to look
    # for when a Hopper kernel underperforms (the causal dK/dV pass was serialized so before it ran one masked loop).
    serialized = re.search(r"wgmma.mma_async instructions are serialized due to (.*?) in the function", log)
    return (f"{used.group(1) if used else '?'} registers, "
            f"{spills.group(1) + ' B spill stores' if spills else 'spills ?'}"
            + (f", WGMMA SERIALIZED ({serialized.group(1)})" if serialized else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--causal", default="false,true")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--decode", action="store_true",
                        help="also one new token against a GQA cache (32 query heads, 8 kv heads, 33 splits)")
    args = parser.parse_args()
    if args.decode:
        import flashtile.inference as inference
        from flashtile import flash_attn_with_kvcache

        inference.select_backend = lambda device: "triton"
        for headdim in (int(d) for d in args.headdims.split(",")):
            q = torch.randn(1, 1, 32, headdim, dtype=torch.bfloat16)
            cache = torch.randn(1, args.seqlen, 8, headdim, dtype=torch.bfloat16)
            flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.full((1,), args.seqlen, dtype=torch.int32),
                                    num_splits=33)
    for headdim in (int(d) for d in args.headdims.split(",")):
        for causal in (c == "true" for c in args.causal.split(",")):
            # Small batch and heads: the compiled variants depend on the switches, not on the sizes
            # (beyond the length's divisibility, the same as at the grid's default point).
            q, k, v = (torch.randn(1, args.seqlen, 1, headdim, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            out = flash_attn_func(q, k, v, causal=causal)
            out.backward(torch.randn_like(out))
    shown = None
    for name, names, compiled in compiled_kernels():
        if name != shown:
            print(f"{name}:")
            shown = name
        switches = " ".join(f"{n}={names[n]}" for n in ("HEAD_DIM", "LIMIT_RIGHT", "PACK_GQA", "USE_TMA", "HOST_TMA",
                                                       "KV_GRADS", "BLOCK_M", "BLOCK_N")
                            if names.get(n) is not None)
        meta = compiled.metadata
        print(f"  {switches} warps={meta.num_warps} stages={meta.num_stages} shared={meta.shared} B "
              f"scratch={meta.global_scratch_size} B: "
              f"{ptxas_report(compiled.asm['ptx'])}", flush=True)
    return 0


def compiled_kernels():
    """(kernel kind, its constexpr values by name, the compiled kernel) of every forward, dK/dV and dQ
    variant this process compiled, in that order."""
    for name, kernel in (("forward", forward._attn_fwd), ("dK/dV", backward._attn_bwd_dkdv),
                         ("dQ", backward._attn_bwd_dq)):
        for cache in kernel.fn.device_caches.values():
            for compiled in cache[0].values():
                const = compiled.src.constants
                yield name, {n: const.get((i,)) for i, n in enumerate(kernel.fn.arg_names)}, compiled


if __name__ == "__main__":
    sys.exit(main())
