"""A fresh process's first call at one grid point and the autotuner's own timing of every candidate.

    python benchmarks/lab/first_call_tuning.py [--headdim 64] [--seqlen 2048] [--causal] [--spin]

bf16 at the harness's shapes (batch·seqlen = 16384, heads·head_dim = 2048): one forward+backward, then
each kernel's ``configs_timings`` (µs, best first) and the tiles chosen. Run it in several processes to
see whether the choice is stable; the first process tunes and later ones read Triton's on-disk record
(identical numbers) unless its cache is cleared. ``--spin`` runs half a second of matrix products first,
to tell a cold GPU's effect on the first candidates from the kernels' own.
"""

from __future__ import annotations

import argparse
import time

import torch

from flashtile import flash_attn_func
from flashtile.kernels import backward, configs, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--spin", action="store_true")
    args = parser.parse_args()
    if args.spin:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        start = time.perf_counter()
        while time.perf_counter() - start < 0.5:
            a @ a
        torch.cuda.synchronize()
    shape = (16384 // args.seqlen, args.seqlen, 2048 // args.headdim, args.headdim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    out = flash_attn_func(q, k, v, causal=args.causal)
    torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    for name, kernel in (("fwd", forward._attn_fwd), ("dq", backward._attn_bwd_dq), ("dkdv", backward._attn_bwd_dkdv)):
        timings = sorted((t[0] * 1e3, f"{c.kwargs} w{c.num_warps} s{c.num_stages}")
                         for c, t in (getattr(kernel, "configs_timings", None) or {}).items())
        print(name, " | ".join(f"{us:.0f} {config}" for us, config in timings))
    print("tiles", configs.tiles_used())


if __name__ == "__main__":
    main()
