"""Eager loops of ``flashtile bench --overhead``'s training rows on a GPU timeline: each kernel's start and end
under ``torch.profiler``, so that a row's wall time splits into kernel time and the gaps between kernels.

    python benchmarks/lab/eager_gaps.py [--rows 4:2048:16:128,1:256:32:128] [--calls 30] [--impls flashtile,sdpa_cudnn]

Per row, mode (forward; forward + backward) and implementation: µs per call of wall time (the loop, synchronised
once), of kernel time (summed durations), of gaps (an idle GPU between one kernel's end and the next one's
start, summed) and of overlap (a kernel that starts before the previous one ended: programmatic dependent
launch, or streams), kernels per call, and the three longest kernels' names and mean µs. Setting
``FLASHTILE_PDL=1`` in the environment gives flashtile's kernels programmatic dependent launch where they
support it; ``--impls flashtile,flashtile_pdl,...`` times both in one process (the setting is a launch plan's key).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flashtile import bench_overhead


def _context(name: str):
    if name == "flashtile_pdl":
        from flashtile.bench import env_setting

        return env_setting("FLASHTILE_PDL", "1")
    if name == "flashtile":
        from flashtile.bench import env_setting

        return env_setting("FLASHTILE_PDL", os.environ.get("FLASHTILE_PDL", "0"))
    return bench_overhead._backend_context(name)


def _timeline(fn, calls: int) -> tuple[float, list]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start),
                     key=lambda k: k[0])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6, kernels


def _describe(kernels: list, calls: int) -> str:
    busy = sum(end - begin for begin, end, _ in kernels)
    gaps = overlap = 0.0
    latest_end = kernels[0][1] if kernels else 0.0  # the GPU is busy until the latest end so far, not the last one's
    for begin, end, _ in kernels[1:]:
        if begin >= latest_end:
            gaps += begin - latest_end
        else:
            overlap += min(end, latest_end) - begin
        latest_end = max(latest_end, end)
    by_name: dict[str, list[float]] = {}
    for begin, end, name in kernels:
        by_name.setdefault(name, []).append(end - begin)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:3]
    names = "; ".join(f"{name[:48]} {statistics.mean(d):.1f}" for name, d in top)
    return (f"kernels {busy / calls:7.1f}  gaps {gaps / calls:6.1f}  overlap {overlap / calls:6.1f}  "
            f"n {len(kernels) / calls:4.1f}  [{names}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4:2048:16:128,1:256:32:128", help="batch:seqlen:heads:headdim,...")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--impls", default="flashtile,sdpa_cudnn")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (µs per call)", flush=True)
    for item in args.rows.split(","):
        shape = tuple(map(int, item.split(":")))
        for causal in (False, True):
            calls = bench_overhead._training_calls(shape, causal, torch.bfloat16, torch.device("cuda"))
            for mode in ("fwd", "fwd_bwd"):
                for round_ in range(args.rounds):
                    for name in args.impls.split(","):
                        fn = calls["flashtile" if name.startswith("flashtile") else name][mode]
                        with _context(name):
                            for _ in range(3):
                                fn()
                            wall, kernels = _timeline(fn, args.calls)
                        print(f"b={shape[0]} s={shape[1]} h={shape[2]} d={shape[3]} causal={int(causal)} {mode:7} "
                              f"r{round_} {name:13} wall {wall:7.1f}  {_describe(kernels, args.calls)}", flush=True)


if __name__ == "__main__":
    main()
