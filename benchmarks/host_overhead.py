"""Host (Python) time of one flash_attn_func call with the Triton launches stubbed out.

    python benchmarks/host_overhead.py [--calls 500]

Runs on any machine, GPU or not: Triton's JIT launch of the four kernels is replaced by a no-op and the
backend is forced to "triton", so what is timed is argument checking, autograd, allocation, the
launchers' own work and the autotuner's dispatch — everything on the host but the JIT launch itself.
On a GPU the real launches add their own cost.
Small tensors keep the CPU allocator out of the picture.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

import flashtile.interface as interface  # noqa: E402
from flashtile import flash_attn_func  # noqa: E402
from flashtile.kernels import backward, forward  # noqa: E402


def _no_launch(*args, grid, warmup, **kwargs):
    """Stands in for ``JITFunction.run``: evaluates the grid (with the config's block sizes) and returns."""
    if callable(grid):
        grid(kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    # The autotuned kernels keep Triton's Autotuner (its first call "tunes" with zero timings) and
    # flashtile's launch path; only the JIT launch itself is stubbed.
    for kernel in (forward._attn_fwd, backward._attn_bwd_dkdv, backward._attn_bwd_dq):
        kernel.cache_results = False
        kernel._bench = lambda *args, **kwargs: [0.0, 0.0, 0.0]
        kernel.fn.run = _no_launch
    backward._attn_bwd_preprocess.run = _no_launch
    interface.select_backend = lambda device: "triton"
    q, k, v = (torch.randn(2, 64, 4, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def forward_only():
        return flash_attn_func(q, k, v, causal=True)

    def forward_backward():
        return torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout)

    for name, fn in (("forward", forward_only), ("forward+backward", forward_backward)):
        for _ in range(50):
            fn()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best = min(best, (time.perf_counter() - start) / args.calls)
        print(f"{name:17s} {best * 1e6:7.1f} us per call (host only, launches stubbed)")


if __name__ == "__main__":
    main()
