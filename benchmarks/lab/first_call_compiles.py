"""Where a first call's seconds go: each kernel's compile, stamped on one clock, beside the first forward and backward.

    python benchmarks/lab/first_call_compiles.py [--seqlen 16384] [--headdim 128] [--nheads 16] [--causal 1]

One sequence, bf16, in a new process per run with a new, empty Triton cache directory (as ``benchmarks/first_call.py``).
Triton's compilation listener (``triton.knobs.compilation.listener``) prints a line per compile: seconds since the
process started when it ended, the kernel, the thread it ran on (``FLASHTILE_COMPILE_THREADS`` > 1 compiles the
one-pass backward's kernels on worker threads, ``configs.compile_together``), and the compiler's own stage times
(µs). What lies between the compiles (imports, allocation, autotuning's timing, module loads, the kernels' run) is the
rest of the first call. Run it under ``FLASHTILE_COMPILE_THREADS=1`` and ``=8`` to see whether the compiles overlap.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

START = time.perf_counter()


def _stamp() -> str:
    return f"[{time.perf_counter() - START:7.2f} s]"


def _listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
    name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
    stages = ", ".join(f"{stage} {us / 1e6:.2f}" for stage, us in times.lowering_stages)
    print(f"{_stamp()} compiled {name} on {threading.current_thread().name}: {times.total / 1e6:.2f} s "
          f"(ir {times.ir_initialization / 1e6:.2f}, {stages}){' cache hit' if cache_hit else ''}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--causal", type=int, default=1)
    args = parser.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="first_call_compiles_")
    from triton import knobs

    knobs.compilation.listener = _listener
    import torch

    from flashtile import flash_attn_func

    shape = (1, args.seqlen, args.nheads, args.headdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    print(f"{_stamp()} inputs ready (threads: {os.environ.get('FLASHTILE_COMPILE_THREADS', 'default')})", flush=True)
    begin = time.perf_counter()
    out = flash_attn_func(q, k, v, causal=bool(args.causal))
    torch.cuda.synchronize()
    middle = time.perf_counter()
    print(f"{_stamp()} first forward {middle - begin:.2f} s", flush=True)
    out.backward(dout)
    torch.cuda.synchronize()
    print(f"{_stamp()} first backward {time.perf_counter() - middle:.2f} s", flush=True)


if __name__ == "__main__":
    main()
