"""A control for compute-sanitizer's racecheck: does it follow an mbarrier handoff between warp partitions?

    compute-sanitizer --tool racecheck python benchmarks/lab/racecheck_control.py [--no-sync]

A Gluon kernel whose 1-warp worker partition stores 64 floats to shared memory, passes a warp barrier and
arrives on an mbarrier (count 1); the default partition (4 warps) waits on that mbarrier's phase 0, then reads
the floats and writes them out. By the PTX memory model the arrival releases the stores and the wait acquires
them: no race. The backward's one pass in FA3's order hands the row statistics over the same way (its producer
warp, ``gluon_backward._dkdv_producer``). ``--no-sync`` drops the consumer's wait: a real race, which racecheck
should report. ``--ring``: the same handoff through a ring of two stages over many iterations, as the backward
runs it: the worker waits for a stage's release (an "empty" mbarrier, parity by lap) before it stores the next
values, the consumer releases each stage after a CTA-wide barrier, so both directions (read after write and
write after read) are ordered by mbarriers whose phases repeat. Needs an sm90 GPU; checks the values it read.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

ROWS = 64


@gluon.jit
def _worker(buf, bar, ROWS: gl.constexpr):
    values = gl.arange(0, ROWS, layout=gl.BlockedLayout([ROWS // 32], [32], [1], [0])).to(gl.float32) + 1.0
    buf.store(values)
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _default(buf, bar, out, ROWS: gl.constexpr, SYNC: gl.constexpr):
    if SYNC:
        mbarrier.wait(bar, 0)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    values = buf.load(layout)
    gl.store(out + gl.arange(0, ROWS, layout=layout), values)


@gluon.jit
def _ring_worker(buf, full, empty, ROWS: gl.constexpr, ITERS: gl.constexpr):
    for it in range(0, ITERS):
        stage = it % 2
        mbarrier.wait(empty.index(stage), ((it // 2) & 1) ^ 1, pred=it >= 2)
        values = gl.arange(0, ROWS, layout=gl.BlockedLayout([ROWS // 32], [32], [1], [0])).to(gl.float32) + it
        buf.index(stage).store(values)
        gl.thread_barrier()
        mbarrier.arrive(full.index(stage))


@gluon.jit
def _ring_default(buf, full, empty, out, ROWS: gl.constexpr, ITERS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])  # the kernel's 8 warps
    total = gl.zeros([ROWS], gl.float32, layout)
    for it in range(0, ITERS):
        stage = it % 2
        mbarrier.wait(full.index(stage), (it // 2) & 1)
        total += buf.index(stage).load(layout)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(stage))
    gl.store(out + gl.arange(0, ROWS, layout=layout), total)


@gluon.jit
def _ring(out, ROWS: gl.constexpr, ITERS: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [2, ROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([(_ring_default, (buf, full, empty, out, ROWS, ITERS)),
                        (_ring_worker, (buf, full, empty, ROWS, ITERS))], [1], [24])
    for s in gl.static_range(2):
        mbarrier.invalidate(full.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def _handoff(out, ROWS: gl.constexpr, SYNC: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    gl.warp_specialize([(_default, (buf, bar.index(0), out, ROWS, SYNC)), (_worker, (buf, bar.index(0), ROWS))],
                       [1], [24])
    mbarrier.invalidate(bar.index(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sync", action="store_true", help="drop the consumer's wait (a real race)")
    parser.add_argument("--ring", action="store_true", help="a ring of two stages, 16 iterations, 8 consumer warps")
    args = parser.parse_args()
    out = torch.zeros(ROWS, device="cuda")
    if args.ring:
        iters = 16
        _ring[(1,)](out, ROWS, iters, num_warps=8)
        torch.cuda.synchronize()
        expected = torch.arange(ROWS, device="cuda", dtype=torch.float32) * iters + sum(range(iters))
        print("ring handoff", "values as stored" if torch.equal(out, expected) else "values differ")
        return
    _handoff[(1,)](out, ROWS, not args.no_sync, num_warps=4)
    torch.cuda.synchronize()
    expected = torch.arange(1, ROWS + 1, device="cuda", dtype=torch.float32)
    print("handoff", "without the wait" if args.no_sync else "through the mbarrier",
          "values as stored" if torch.equal(out, expected) else "values differ")


if __name__ == "__main__":
    main()
