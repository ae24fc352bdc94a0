"""Does a wall-time row of ``flashtile bench --overhead`` wait for the GPU inside the call?

    python benchmarks/lab/sync_check.py

For each row's flashtile call (training shapes: forward, forward + backward; decoding steps), after warm-up
calls: the call under ``torch.cuda.set_sync_debug_mode("error")`` (a synchronizing CUDA call raises; the
traceback names it), then the host time to enqueue 30 calls against the wall time of the same 30 calls
synchronised once. A call that waits for the GPU inside it has enqueue time close to wall time at rows whose
kernels take longer than the host's work.
"""

from __future__ import annotations

import time
import traceback

import torch

from flashtile.bench_overhead import DECODE_STEPS, OVERHEAD_SHAPES, _decode_calls, _training_calls


def check(name: str, fn) -> None:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        verdict = "no synchronizing call"
    except RuntimeError as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "flashtile" in f.filename]
        where = "; ".join(f"{f.filename.split('flashtile/')[-1]}:{f.lineno} {f.name}" for f in frames[-3:])
        verdict = f"SYNC: {str(exc).splitlines()[0][:80]} at {where or 'outside flashtile'}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(30):
        fn()
    enqueued = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    print(f"{name:48s} enqueue {enqueued / 30 * 1e6:7.1f} us/call, wall {wall / 30 * 1e6:7.1f} us/call | {verdict}",
          flush=True)


def main() -> None:
    device = torch.device("cuda")
    for shape in OVERHEAD_SHAPES:
        for causal in (False, True):
            calls = _training_calls(shape, causal, torch.bfloat16, device)
            for mode in ("fwd", "fwd_bwd"):
                for impl in ("flashtile", "sdpa"):
                    check(f"{impl} b={shape[0]} s={shape[1]} d={shape[3]} {'causal' if causal else 'full'} {mode}",
                          calls[impl][mode])
    for batch, length in DECODE_STEPS:
        calls = _decode_calls(batch, length, torch.bfloat16, device)
        for impl in ("flashtile", "sdpa"):
            check(f"{impl} decode b={batch} cache={length}", calls[impl])


if __name__ == "__main__":
    main()
