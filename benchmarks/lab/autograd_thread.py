"""What autograd's device thread costs a Python backward: flashtile and SDPA against a backward that does nothing.

    python benchmarks/lab/autograd_thread.py [--calls 30] [--loops 7]

Rows of ``flashtile bench --overhead`` (q, k, v views of one projection that requires grad, ``out.backward(dout)``),
forward+backward with autograd's device thread on (as a model runs) and off
(``torch.autograd.set_multithreading_enabled(False)``: the backward runs on the calling thread), for:

* ``sdpa``: SDPA's default backend (C++ autograd nodes);
* ``flashtile``: ``flash_attn_func``;
* ``null``: a Python ``autograd.Function`` saving q, k, v and out, whose forward returns an empty tensor and whose
  backward returns three (no kernel): the fixed cost of a Python node;
* then the first row again, each implementation with the calling thread and autograd's device thread pinned to
  one core (each pins itself: the device thread inside a backward), whether the device thread's cost is that of
  another core's caches.

Enqueue µs per call (the loop's host time) and wall µs per call (synchronised once per loop), median of the loops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flashtile import flash_attn_func

ROWS = ((1, 256, 32, 128, True), (8, 1024, 16, 64, True), (32, 512, 12, 64, False))


class _Null(torch.autograd.Function):
    pin_to: int | None = None

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        if _Null.pin_to is not None:
            os.sched_setaffinity(0, {_Null.pin_to})  # this thread only (Linux)
            _Null.pin_to = None
        q, k, v, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sdpa(q, k, v, causal):
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal)
    return out.transpose(1, 2)


def _time(fn, calls: int, loops: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    enqueue, wall = [], []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        enqueue.append((enqueued - start) / calls * 1e6)
        wall.append((done - start) / calls * 1e6)
    return statistics.median(enqueue), statistics.median(wall)


def _steps(batch: int, seqlen: int, nheads: int, headdim: int, causal: bool) -> dict:
    """{name: a forward+backward through autograd} over views of one projection, for each implementation."""
    projection = torch.randn(batch, seqlen, 3 * nheads * headdim, dtype=torch.bfloat16, device="cuda",
                             requires_grad=True)
    dout = torch.randn(batch, seqlen, nheads, headdim, dtype=torch.bfloat16, device="cuda")
    attends = {"sdpa": lambda q, k, v: _sdpa(q, k, v, causal),
               "flashtile": lambda q, k, v: flash_attn_func(q, k, v, causal=causal),
               "null": lambda q, k, v: _Null.apply(q, k, v)}

    def step(attend):
        q, k, v = projection.view(batch, seqlen, 3, nheads, headdim).unbind(2)
        attend(q, k, v).backward(dout)

    return {name: (lambda attend=attend: step(attend)) for name, attend in attends.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--loops", type=int, default=7)
    args = parser.parse_args()
    for batch, seqlen, nheads, headdim, causal in ROWS:
        row = f"b={batch} s={seqlen} h={nheads} d={headdim} {'causal' if causal else 'non-causal'}"
        for name, fn in _steps(batch, seqlen, nheads, headdim, causal).items():
            cells = []
            for threads in (True, False):
                with torch.autograd.set_multithreading_enabled(threads):
                    enqueue, wall = _time(fn, args.calls, args.loops)
                cells.append(f"thread {'on' if threads else 'off'}: enqueue {enqueue:6.1f} wall {wall:6.1f}")
            print(f"{row} {name:10s} " + " | ".join(cells), flush=True)
    # Both threads on one core: the calling thread pins itself, the device thread in its next backward.
    core = sorted(os.sched_getaffinity(0))[-1]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    _Null.pin_to = core
    steps = _steps(*ROWS[0])
    for name in ("null", "flashtile", "sdpa"):
        enqueue, wall = _time(steps[name], args.calls, args.loops)
        print(f"{ROWS[0][:4]} both threads on core {core}: {name:10s} thread on: enqueue {enqueue:6.1f} "
              f"wall {wall:6.1f}", flush=True)
    os.sched_setaffinity(0, before)


if __name__ == "__main__":
    main()
