"""Backward (or forward) TFLOP/s, or decoding steps' wall time, under several environment settings, in alternating
processes, with a digest of the gradients (or the output).

    python benchmarks/lab/env_ab.py --variants "A=FT_X=0;B=FT_X=1" [--rounds 2] [--points 128:16384:1,...]
                                    [--mode fwd | --mode decode]

For a kernel change behind a switch read at import: each variant runs in its own process (the switch is fixed
when the kernel is compiled), the variants take turns round by round, and a first untimed round fills every
variant's compile cache in parallel. A point is ``d:seqlen:causal`` at batch x seqlen = 16k tokens and heads x d =
2048 (the speed grid's shape); the call is ``flash_attn_func``'s backward through autograd, as a model runs it
(the dispatch picks the kernels), or with ``--mode fwd`` its forward
(``--mode fwd8``: the forward on FP8 q, k, v). Each process prints one JSON line per point:
milliseconds (median of ``triton.testing.do_bench``), TFLOP/s by the flash-attn formula, and a SHA-256 of dq, dk and
dv's bytes (forward: of out's), so a change meant to keep the bits shows whether it did. ``--cudnn`` adds SDPA's
cuDNN call of the same mode, timed in the first variant's processes.

``--mode decode``: a point is ``batch:cache`` (default: ``flashtile bench --overhead``'s decoding rows, one new
token appended per sequence, d = 128, 32 query heads over 8 KV heads, bf16), timed as that mode times them (loops
of eager calls synchronised once, the median, beside SDPA's cuDNN step where ``--cudnn``), in µs per step, with
the kernels' GPU time of one step (``torch.profiler``) and a digest of the output and both caches after one step
from fixed inputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys

POINTS = "128:2048:0,128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:16384:1"
DECODE_POINTS = "8:4096,1:32768,64:2048"  # (batch:cache) flashtile bench --overhead's decoding rows


def child(points: str, cudnn: bool, warm_only: bool, mode: str = "bwd") -> None:
    for item in points.split(","):
        row = point(item, cudnn, warm_only, mode)
        if row:
            print(json.dumps(row), flush=True)


def decode_point(item: str, cudnn: bool, warm_only: bool) -> dict | None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flashtile import flash_attn_with_kvcache
    from flashtile.bench_overhead import DECODE_HEADS, _decode_calls, _time_round_robin

    batch, length = map(int, item.split(":"))
    device, dtype = torch.device("cuda"), torch.bfloat16
    nheads, nheads_k, headdim = DECODE_HEADS
    generator = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.randn(batch, length, nheads_k, headdim, dtype=dtype, device=device, generator=generator)
    v_cache = torch.randn(k_cache.shape, dtype=dtype, device=device, generator=generator)
    q = torch.randn(batch, 1, nheads, headdim, dtype=dtype, device=device, generator=generator)
    new = torch.randn(batch, 1, 2 * nheads_k, headdim, dtype=dtype, device=device, generator=generator)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, new[:, :, :nheads_k], new[:, :, nheads_k:],
                                  cache_seqlens=torch.full((batch,), length - 1, dtype=torch.int32, device=device))
    digest = hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()
                                     for t in (out, k_cache, v_cache))).hexdigest()[:16]
    calls = _decode_calls(batch, length, dtype, device)
    timed = {"flashtile": calls["flashtile"], **({"sdpa_cudnn": calls["sdpa_cudnn"]} if cudnn else {})}
    if warm_only:
        for fn in timed.values():
            fn()
        torch.cuda.synchronize()
        return None
    us, _ = _time_round_robin(timed, 30, 11, device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            calls["flashtile"]()
        torch.cuda.synchronize()
    row = {"point": item, "value": us["flashtile"], "unit": "µs", "digest": digest,
           "kernel_us": sum(e.device_time_total for e in prof.key_averages()) / 10}
    if cudnn:
        row["cudnn_value"] = us["sdpa_cudnn"]
    return row


def fp8_point(item: str, batch: int, heads: int, s: int, d: int, causal: bool, cudnn: bool,
              warm_only: bool) -> dict | None:
    """``--mode fwd8``: ``flash_attn_func``'s forward on FP8 q, k, v (``flashtile.fp8.quantize`` per (batch, head), v
    keys-fastest so that the call is the kernel's), bf16 out; ``--cudnn``: SDPA's cuDNN forward on the bf16 inputs."""
    import torch
    import triton

    from flashtile import flash_attn_func, fp8
    from flashtile.bench import _implementation, _mode_callable, attention_flops

    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    (q8, qd), (k8, kd) = fp8.quantize(q), fp8.quantize(k)
    v8, vd = fp8.quantize(v, keys_fastest=True)

    def call():
        return flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

    out = call()
    torch.cuda.synchronize()
    if warm_only:
        return None
    digest = hashlib.sha256(out.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
    flops = attention_flops(batch, heads, s, s, d, causal, "fwd")
    ms = triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")
    row = {"point": item, "ms": ms, "value": flops / ms * 1e-9, "unit": "TFLOP/s", "digest": digest}
    if cudnn:
        cudnn_call = _mode_callable(_implementation("sdpa_cudnn", s, s, causal), "fwd", q, k, v, None, causal)
        cudnn_ms = triton.testing.do_bench(cudnn_call, warmup=50, rep=300, return_mode="median")
        row["cudnn_value"] = flops / cudnn_ms * 1e-9
    return row


def point(item: str, cudnn: bool, warm_only: bool, mode: str = "bwd") -> dict | None:
    if mode == "decode":
        return decode_point(item, cudnn, warm_only)
    import torch
    import triton

    from flashtile.bench import _implementation, _mode_callable, attention_flops

    d, s, c = item.split(":")
    d, s, causal = int(d), int(s), c == "1"
    batch, heads = max(1, 16384 // s), 2048 // d
    torch.manual_seed(0)
    if mode == "fwd8":
        return fp8_point(item, batch, heads, s, d, causal, cudnn, warm_only)
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    # The harness's callables (``flashtile bench --modes bwd``: one forward, then its backward again; fwd: the call).
    call = _mode_callable(_implementation("flashtile", s, s, causal), mode, q, k, v, dout, causal)
    outputs = call()
    if mode == "fwd":
        outputs = (outputs,)
    torch.cuda.synchronize()
    if warm_only:
        return None
    digest = hashlib.sha256(b"".join(g.contiguous().view(torch.uint8).cpu().numpy().tobytes()
                                     for g in outputs)).hexdigest()[:16]
    flops = attention_flops(batch, heads, s, s, d, causal, mode)
    ms = triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")
    row = {"point": item, "ms": ms, "value": flops / ms * 1e-9, "unit": "TFLOP/s", "digest": digest}
    if cudnn:
        cudnn_call = _mode_callable(_implementation("sdpa_cudnn", s, s, causal), mode, q, k, v, dout, causal)
        cudnn_ms = triton.testing.do_bench(cudnn_call, warmup=50, rep=300, return_mode="median")
        row["cudnn_value"] = flops / cudnn_ms * 1e-9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="", help="NAME=VAR=VALUE[ VAR=VALUE...];NAME=...")
    parser.add_argument("--points", default=None, help=f"default {POINTS}; --mode decode: {DECODE_POINTS}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cudnn", action="store_true")
    parser.add_argument("--mode", choices=("bwd", "fwd", "fwd8", "decode"), default="bwd")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.points is None:
        args.points = DECODE_POINTS if args.mode == "decode" else POINTS
    if args.child:
        child(args.points, args.cudnn, args.warm_only, args.mode)
        return
    variants = {}
    for item in filter(None, args.variants.split(";")):
        name, _, settings = item.partition("=")
        pairs = settings.split()
        if not name or any("=" not in pair for pair in pairs):
            parser.error(f"--variants: {item!r} is not NAME=VAR=VALUE[ VAR=VALUE...]")
        variants[name] = dict(pair.split("=", 1) for pair in pairs)
    if not variants:
        parser.error("--variants: give at least one")
    command = [sys.executable, __file__, "--child", "--points", args.points, "--mode", args.mode]
    warm = {name: subprocess.Popen(command + ["--warm-only"], env={**os.environ, **env}, stdout=subprocess.DEVNULL)
            for name, env in variants.items()}
    for name, process in warm.items():
        if process.wait():
            print(f"{name}: the warm-up run failed (exit {process.returncode})", flush=True)
    results: dict = {}
    for round_ in range(args.rounds):
        for i, (name, env) in enumerate(variants.items()):
            extra = ["--cudnn"] if args.cudnn and i == 0 else []
            done = subprocess.run(command + extra, env={**os.environ, **env}, capture_output=True, text=True)
            if done.returncode:  # the points it printed before failing still count
                print(f"{name} round {round_}: failed\n{done.stderr[-3000:]}", flush=True)
            for line in done.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    results.setdefault(row["point"], {}).setdefault(name, []).append(row)
                    print(name, round_, line, flush=True)
    names = list(variants)
    unit = next((r["unit"] for by_name in results.values() for rows in by_name.values() for r in rows), "")
    header = ["point (batch:cache)" if args.mode == "decode" else "point (d:s:causal)", *(f"{n} {unit}" for n in names),
              *(f"{n}/{names[0]}" for n in names[1:]), f"cuDNN {unit}", "same bits"]
    print("\n| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for point, by_name in results.items():
        med = {n: statistics.median(r["value"] for r in by_name[n]) if by_name.get(n) else float("nan")
               for n in names}
        cells = [" / ".join(f"{r['value']:.1f}" for r in by_name.get(n, [])) for n in names]
        ratios = [f"{med[n] / med[names[0]]:.3f}" for n in names[1:]]
        cudnn = [r["cudnn_value"] for rows in by_name.values() for r in rows if "cudnn_value" in r]
        digests = {r["digest"] for rows in by_name.values() for r in rows}
        same = "yes" if len(digests) == 1 else f"no ({len(digests)} digests)"
        row = [point, *cells, *ratios, f"{statistics.median(cudnn):.1f}" if cudnn else "-", same]
        print("| " + " | ".join(row) + " |")

if __name__ == "__main__":
    main()
