"""Where a long call's first forward+backwards spend their time (cProfile of the calls named, by default the second
and third), one fresh process; run it with an empty TRITON_CACHE_DIR to see a new user's first call.

    python benchmarks/lab/second_call_profile.py [--seqlen 16384] [--nheads 16] [--headdim 128] [--calls 4]
                                                 [--profile 2,3] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from flashtile import flash_attn_func


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--profile", default="2,3", help="the calls profiled, counted from 1")
    parser.add_argument("--top", type=int, default=30, help="rows of each profile, by cumulative time")
    args = parser.parse_args()
    profiled = {int(x) - 1 for x in args.profile.split(",") if x}
    q, k, v = (torch.randn(1, args.seqlen, args.nheads, args.headdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    for call in range(args.calls):
        profiler = cProfile.Profile() if call in profiled else None
        torch.cuda.synchronize()
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        out = flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        middle = time.perf_counter()
        out.backward(dout)
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        print(f"call {call + 1}: forward {middle - start:.3f} s, backward {time.perf_counter() - middle:.3f} s",
              flush=True)
        if profiler:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
            print(text.getvalue(), flush=True)
        q.grad = k.grad = v.grad = None


if __name__ == "__main__":
    main()
