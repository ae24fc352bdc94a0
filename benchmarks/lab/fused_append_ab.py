"""Decoding steps with the append fused into the attention kernel (``FLASHTILE_FUSED_APPEND=1``) against the append
kernel and the attention (``0``), in alternating processes.

    python benchmarks/lab/fused_append_ab.py [--rounds 3] [--calls 30] [--repeats 11]

The switch is read at import, so each variant runs in processes of its own, the two taking turns round by round.
Each process times the decoding rows of ``flashtile bench --overhead`` (one new token appended per sequence,
d = 128, 32 query heads over 8 KV heads, bf16; loops of eager calls synchronised once, the median of the loops)
beside SDPA's cuDNN backend writing the token with a slice assignment, the kernels' GPU time of one flashtile step
under ``torch.profiler`` (summed, µs), and a SHA-256 of the output and both caches after one step from fixed inputs
(the variants should give the same bits). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys

VARIANTS = {"two_launches": "0", "fused": "1"}


def child(calls: int, repeats: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flashtile import flash_attn_with_kvcache
    from flashtile.bench_overhead import DECODE_HEADS, DECODE_STEPS, _decode_calls, _time_round_robin

    device, dtype = torch.device("cuda"), torch.bfloat16
    nheads, nheads_k, headdim = DECODE_HEADS
    for batch, length in DECODE_STEPS:
        impls = _decode_calls(batch, length, dtype, device)
        timings, spread = _time_round_robin({"flashtile": impls["flashtile"], "sdpa_cudnn": impls["sdpa_cudnn"]},
                                            calls, repeats, device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                impls["flashtile"]()
            torch.cuda.synchronize()
        kernel_us = sum(e.device_time_total for e in prof.key_averages()) / 10
        generator = torch.Generator(device=device).manual_seed(0)
        k_cache = torch.randn(batch, length, nheads_k, headdim, dtype=dtype, device=device, generator=generator)
        v_cache = torch.randn(k_cache.shape, dtype=dtype, device=device, generator=generator)
        q = torch.randn(batch, 1, nheads, headdim, dtype=dtype, device=device, generator=generator)
        new = torch.randn(batch, 1, 2 * nheads_k, headdim, dtype=dtype, device=device, generator=generator)
        seqlens = torch.full((batch,), length - 1, dtype=torch.int32, device=device)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, new[:, :, :nheads_k], new[:, :, nheads_k:],
                                      cache_seqlens=seqlens)
        digest = hashlib.sha256()
        for t in (out, k_cache, v_cache):
            digest.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        print(json.dumps({"row": f"decode b={batch} cache={length}", "us": timings, "spread": spread,
                          "kernel_us": kernel_us, "digest": digest.hexdigest()[:16]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.calls, args.repeats)
        return
    results: dict = {}
    for round_index in range(args.rounds):
        order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            env = {**os.environ, "FLASHTILE_FUSED_APPEND": VARIANTS[name]}
            run = subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls), "--repeats",
                                  str(args.repeats)], env=env, capture_output=True, text=True)
            if run.returncode:
                print(f"{name} round {round_index}: exit {run.returncode}\n{run.stderr[-2000:]}", flush=True)
                continue
            for line in run.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    results.setdefault(row["row"], {}).setdefault(name, []).append(row)
                    print(f"round {round_index} {name:13s} {row['row']:26s} flashtile {row['us']['flashtile']:.1f} "
                          f"cudnn {row['us']['sdpa_cudnn']:.1f} kernels {row['kernel_us']:.1f} µs "
                          f"digest {row['digest']}", flush=True)
    print("\n| row | " + " | ".join(f"{n} µs (kernels)" for n in VARIANTS) + " | cuDNN µs | fused / two launches |")
    print("|---|" + "---|" * (len(VARIANTS) + 2))
    for row, by_name in results.items():
        med = {n: statistics.median(r["us"]["flashtile"] for r in rows) for n, rows in by_name.items()}
        kern = {n: statistics.median(r["kernel_us"] for r in rows) for n, rows in by_name.items()}
        cudnn = statistics.median(r["us"]["sdpa_cudnn"] for rows in by_name.values() for r in rows)
        digests = {r["digest"] for rows in by_name.values() for r in rows}
        ratio = med["fused"] / med["two_launches"] if len(med) == 2 else float("nan")
        print(f"| {row} | " + " | ".join(f"{med[n]:.1f} ({kern[n]:.1f})" if n in med else "n/a" for n in VARIANTS)
              + f" | {cudnn:.1f} | {ratio:.3f} |" + ("" if len(digests) == 1 else f" digests differ: {digests}"))


if __name__ == "__main__":
    main()
