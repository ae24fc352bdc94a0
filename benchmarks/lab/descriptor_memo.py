"""Host time a raw launch saves by reusing the TMA descriptors it filled at the same addresses before.

    python benchmarks/lab/descriptor_memo.py [--calls 30] [--repeats 11]

The wall-time training rows of ``flashtile bench --overhead`` that are bound by the host, timed as that mode
times them (its decoding steps fill no host descriptors: theirs are made in the kernel), with three
implementations taking turns loop by loop: ``flashtile`` (a replayed launch passes the descriptor it filled over
the same address before), ``flashtile_refill`` (the same calls, every descriptor encoded anew, as before the
reuse), and SDPA's cuDNN backend. Also prints, per row, how many descriptors a call's launches pass and how many
it encoded.
"""

from __future__ import annotations

import argparse

import torch

from flashtile import bench_overhead as bo
from flashtile.kernels import replay

ROWS = (((1, 256, 32, 128), True), ((1, 256, 32, 128), False), ((32, 512, 12, 64), True),
        ((8, 1024, 16, 64), True), ((4, 2048, 16, 128), True))

_memo_call = replay._RawLaunch.__call__


def _refill_call(self, tensors, stream, arena=None):
    for by_address in self.filled:
        by_address.clear()
    return _memo_call(self, tensors, stream, arena)


def _counting():
    counts = [0]
    fill = replay._fill_tma_descriptor

    def counted(*args):
        counts[0] += 1
        return fill(*args)

    return counts, counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16

    def variants(fn):
        def refill():
            replay._RawLaunch.__call__ = _refill_call
            try:
                return fn()
            finally:
                replay._RawLaunch.__call__ = _memo_call
        return {"flashtile": fn, "flashtile_refill": refill}

    cases = []
    for shape, causal in ROWS:
        calls = bo._training_calls(shape, causal, dtype, device)
        for mode in ("fwd", "fwd_bwd"):
            cases.append((f"b={shape[0]} s={shape[1]} h={shape[2]} d={shape[3]} {'causal' if causal else 'non-causal'} "
                          f"{mode}", {**variants(calls["flashtile"][mode]), "sdpa_cudnn": calls["sdpa_cudnn"][mode]}))
    for name, impls in cases:
        for _ in range(4):
            impls["flashtile"]()
        torch.cuda.synchronize()
        fill, real_call = replay._fill_tma_descriptor, replay._RawLaunch.__call__
        counts, counted = _counting()
        descriptors = [0]

        def seen(self, tensors, stream, arena=None, descriptors=descriptors, real_call=real_call):
            descriptors[0] += len(self.descriptors)
            return real_call(self, tensors, stream, arena)

        replay._fill_tma_descriptor, replay._RawLaunch.__call__ = counted, seen
        try:
            impls["flashtile"]()
        finally:
            replay._fill_tma_descriptor, replay._RawLaunch.__call__ = fill, real_call
        torch.cuda.synchronize()
        timings, spread = bo._time_round_robin(impls, args.calls, args.repeats, device)
        parts = "  ".join(f"{k} {v:.1f} ({spread[k][0]:.0f}-{spread[k][1]:.0f})" for k, v in timings.items())
        ratio = timings["flashtile"] / timings["flashtile_refill"]
        print(f"{name:45s} descriptors {descriptors[0]} filled {counts[0]}  µs: {parts}  reuse/refill {ratio:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
