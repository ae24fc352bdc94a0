"""Context-parallel scaling on the GPUs of one host (NCCL, NVLink multicast off).

    NCCL_NVLS_ENABLE=0 python3 benchmarks/cp_bench.py [--tokens-per-gpu 65536] [--long 2097152]

For each method (zigzag ring, Ulysses): causal forward+backward of one sequence of
``tokens_per_gpu * world`` tokens, 16 heads, d=128, bf16, per-GPU TFLOP/s (flash-attn formula, total
FLOPs / world / time) against single-GPU flashtile at ``tokens_per_gpu`` tokens. Then one long sequence
across all GPUs: time and peak memory per GPU. Prints a table and writes JSON to --json.

Rank 0 prints each row as soon as it is measured (a run cut by a time limit still reports what it got).
With ``FLASHTILE_AUTOTUNE=0`` every run, the single-GPU baseline included, uses the default tiles: a
cold cache then compiles one variant per kernel instead of timing every candidate on every shape.
"""

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile import flash_attn_func
from flashtile.bench import attention_flops
from flashtile.distributed import ring_flash_attn_func, ulysses_attn_func

NHEADS, HEADDIM = 16, 128


def _timed(fn, repeats, warmup=True, together=True):
    """Median seconds of ``fn``; ``together``: every rank starts timing after a barrier (False: one rank
    alone, the others waiting in their next collective)."""
    if warmup:
        fn()  # compile and autotune
    torch.cuda.synchronize()
    if together:
        dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


_START = time.perf_counter()


def _report(rank, row):
    if rank == 0:
        print(f"[{time.perf_counter() - _START:6.0f} s] {row}", flush=True)


def _worker(rank, world, init_file, args, result_file):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = []
    device = torch.device("cuda", rank)

    def run(method, total_tokens, repeats, warmup=True):
        local = total_tokens // world
        q, k, v, dout = (torch.randn(1, local, NHEADS, HEADDIM, device=device, dtype=torch.bfloat16)
                         for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        fn = {"ring": lambda: ring_flash_attn_func(q, k, v, causal=True),
              "ulysses": lambda: ulysses_attn_func(q, k, v, causal=True)}[method]
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds = _timed(lambda: torch.autograd.grad(fn(), (q, k, v), dout), repeats, warmup)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        flops = attention_flops(1, NHEADS, total_tokens, total_tokens, HEADDIM, True, "fwd_bwd") / world
        return seconds, flops / seconds / 1e12, peak

    if rank == 0:
        # Single GPU at the same tokens per GPU, no communication.
        q, k, v, dout = (torch.randn(1, args.tokens_per_gpu, NHEADS, HEADDIM, device=device, dtype=torch.bfloat16)
                         for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        seconds = _timed(lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout),
                         args.repeats, together=False)
        flops = attention_flops(1, NHEADS, args.tokens_per_gpu, args.tokens_per_gpu, HEADDIM, True, "fwd_bwd")
        del q, k, v, dout  # not held through the long run below
        rows.append({"run": "single", "method": "single", "world": 1, "tokens": args.tokens_per_gpu,
                     "seconds": seconds, "tflops_per_gpu": flops / seconds / 1e12, "peak_extra_gib": None})
        _report(rank, rows[-1])
    for method in args.methods.split(","):
        seconds, tflops, peak = run(method, args.tokens_per_gpu * world, args.repeats)
        rows.append({"run": "scaling", "method": method, "world": world, "tokens": args.tokens_per_gpu * world,
                     "seconds": seconds, "tflops_per_gpu": tflops, "peak_extra_gib": peak})
        _report(rank, rows[-1])
    if args.long:
        # One call of minutes: autotuning would time every candidate on it, and a warm-up call would
        # double it. Default tiles, compiled first on a short sequence (tile choice does not depend on
        # the length then), and a single timed call.
        previous = os.environ.get("FLASHTILE_AUTOTUNE")
        os.environ["FLASHTILE_AUTOTUNE"] = "0"
        try:
            run("ring", 8192 * world, 1)
            seconds, tflops, peak = run("ring", args.long, 1, warmup=False)
        finally:
            # Back to the caller's setting.
            if previous is None:
                del os.environ["FLASHTILE_AUTOTUNE"]
            else:
                os.environ["FLASHTILE_AUTOTUNE"] = previous
        rows.append({"run": "long", "method": "ring", "world": world, "tokens": args.long, "seconds": seconds,
                     "tflops_per_gpu": tflops, "peak_extra_gib": peak})
        _report(rank, rows[-1])
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(result_file, "w") as fh:
            json.dump(gathered, fh)
    dist.barrier()  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-gpu", type=int, default=65536)
    parser.add_argument("--long", type=int, default=2097152, help="one long sequence across all GPUs (0: skip)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--methods", default="ring,ulysses", help="comma-separated subset of ring,ulysses")
    parser.add_argument("--json", default="cp_bench.json")
    args = parser.parse_args()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), args, result_file), nprocs=world)
        per_rank = json.load(open(result_file))
    single = next(r for r in per_rank[0] if r["method"] == "single")["tflops_per_gpu"]
    setting = os.environ.get("FLASHTILE_AUTOTUNE", "1")
    print(f"FLASHTILE_AUTOTUNE={setting}" + (" (default tiles everywhere)" if setting == "0" else ""))
    print(f"{world} x {torch.cuda.get_device_name()}; single GPU at {args.tokens_per_gpu} tokens: {single:.0f} TFLOP/s")
    print("| method | GPUs | tokens | s (rank 0) | TFLOP/s per GPU | of single | peak extra GiB per GPU (max) |")
    print("|---|---|---|---|---|---|---|")
    for row in per_rank[0]:
        if row["method"] == "single":
            continue
        peak = max(r["peak_extra_gib"] for rows in per_rank for r in rows
                   if (r["run"], r["method"]) == (row["run"], row["method"]))
        print(f"| {row['method']} | {row['world']} | {row['tokens']} | {row['seconds']:.3f} | "
              f"{row['tflops_per_gpu']:.0f} | {row['tflops_per_gpu'] / single:.0%} | {peak:.2f} |")
    with open(args.json, "w") as fh:
        json.dump(per_rank, fh, indent=1)


if __name__ == "__main__":
    main()
