"""Tile-config sweep on the GPU: every kernel's time under a wide candidate list, and the whole
forward/backward under several L2-section sizes of the causal schedule, next to SDPA's flash and cuDNN
backends on the same inputs.

    FLASHTILE_AUTOTUNE=compile python benchmarks/lab/tune.py --slice 0/4 &  ...  # fill the compile cache
    python benchmarks/lab/tune.py --json out/tune.json                         # then time, in one process

The candidate lists below are wider than flashtile.kernels.configs' (which keep the measured winners);
they replace the kernels' lists in this process only. Autotuning times each candidate (Triton's ``configs_timings``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from flashtile.kernels import configs

WIDE = {
    "fwd": {
        "small_d": [(128, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3),
                    (128, 64, 4, 4), (128, 128, 8, 2), (64, 128, 4, 3), (128, 128, 4, 2), (128, 64, 4, 2),
                    (64, 64, 4, 2), (64, 64, 4, 4)],
        "mid_d": [(128, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 4, 2),
                  (128, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2), (64, 64, 4, 4),
                  (128, 64, 8, 2, 128), (128, 128, 8, 2, 128)],
    },
    "bwd_kv": {  # (BLOCK_N, BLOCK_M, warps, stages)
        "small_d": [(128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4),
                    (128, 32, 4, 5), (64, 32, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 4),
                    (128, 32, 8, 3), (64, 128, 4, 3), (64, 32, 4, 3, 128), (64, 32, 4, 4, 128), (64, 32, 4, 2),
                    (64, 64, 4, 2, 168), (64, 64, 4, 3, 168)],
        "mid_d": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 2), (128, 32, 4, 4),
                  (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2),
                  (64, 128, 8, 2), (128, 32, 8, 2)],
    },
    "bwd_q": {  # (BLOCK_M, BLOCK_N, warps, stages)
        "small_d": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4),
                    (128, 32, 8, 3), (64, 32, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 8, 2),
                    (64, 64, 4, 2, 128), (64, 64, 4, 3, 128), (64, 64, 4, 2)],
        "mid_d": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 3),
                  (128, 32, 8, 3), (128, 32, 4, 4), (64, 32, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2),
                  (64, 64, 4, 2, 168), (128, 64, 8, 2, 168)],
    },
}
_TABLES = {"fwd": configs._FWD_CANDIDATES, "bwd_kv": configs._BWD_KV_CANDIDATES, "bwd_q": configs._BWD_Q_CANDIDATES}


def widen(index: int, count: int) -> None:
    for name, classes in WIDE.items():
        for dim_class, entries in classes.items():
            _TABLES[name][dim_class] = entries[index::count]


def measure(entry: dict, q, k, v, dout, sections: list[str]) -> None:
    """flashtile's forward and backward TFLOP/s under each L2-section size, then SDPA flash and cuDNN."""
    import torch
    import triton.testing

    from flashtile import flash_attn_func
    from flashtile.bench import _implementation

    batch, seqlen, nheads, headdim = q.shape
    causal = entry["causal"]
    fwd_flops = 4.0 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
    label = f"d={headdim} causal={causal}"

    def tflops(fwd, bwd):
        fwd_ms = triton.testing.do_bench(fwd, warmup=25, rep=100)
        bwd_ms = triton.testing.do_bench(bwd, warmup=25, rep=100)
        return round(fwd_flops / (fwd_ms * 1e-3) / 1e12, 1), round(2.5 * fwd_flops / (bwd_ms * 1e-3) / 1e12, 1)

    for section in sections:
        os.environ["FLASHTILE_L2_SECTION_MB"] = section
        out = flash_attn_func(q, k, v, causal=causal)
        entry[f"section_{section}"] = tflops(
            lambda: flash_attn_func(q, k, v, causal=causal),
            lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        print(f"{label} L2 section {section} MB: fwd/bwd {entry[f'section_{section}']} TFLOP/s", flush=True)
    os.environ.pop("FLASHTILE_L2_SECTION_MB")
    for name in ("sdpa_flash", "sdpa_cudnn"):  # the harness's peers, BSHD in and out
        impl = _implementation(name, seqlen, seqlen, causal)
        out = impl(q, k, v, causal)
        entry[name] = tflops(lambda impl=impl: impl(q, k, v, causal),
                             lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        print(f"{label} {name}: fwd/bwd {entry[name]} TFLOP/s", flush=True)


def kernel_resources(kernel) -> list[str]:
    """Registers, spills and shared memory of every compiled variant of an autotuned kernel: a variant
    that spills, or needs so many registers that fewer blocks fit on a multiprocessor, shows here."""
    import re

    lines = []
    for caches in kernel.fn.device_caches.values():
        for key, compiled in caches[0].items():
            constexprs = re.findall(r"\('constexpr', ([^)]*)\)", key)
            warps = re.search(r"num_warps'?[=:] ?(\d+)", key)
            stages = re.search(r"num_stages'?[=:] ?(\d+)", key)
            meta = compiled.metadata
            lines.append(f"    constexprs {','.join(constexprs)[-60:]:60s} warps {warps and warps.group(1)} "
                         f"stages {stages and stages.group(1)}: {getattr(compiled, 'n_regs', '?')} registers, "
                         f"{getattr(compiled, 'n_spills', '?')} spills, {getattr(meta, 'shared', '?')} B shared")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slice", default="0/1", help="I/N: only every N-th candidate from the I-th")
    parser.add_argument("--points", default="64:false,64:true,128:false,128:true", help="headdim:causal list")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--sections", default="0,8,24,64", help="FLASHTILE_L2_SECTION_MB values to time")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    index, count = (int(x) for x in args.slice.split("/"))
    widen(index, count)

    import torch

    from flashtile import flash_attn_func
    from flashtile.kernels import backward, forward

    compile_only = configs.compile_only()
    kernels = {"fwd": forward._attn_fwd, "bwd_kv": backward._attn_bwd_dkdv, "bwd_q": backward._attn_bwd_dq}
    names = {"fwd": configs._FWD_NAMES, "bwd_kv": configs._BWD_KV_NAMES, "bwd_q": configs._BWD_Q_NAMES}
    for name, kernel in kernels.items():  # the kernels were decorated with the narrower lists
        kernel.configs = configs._all_configs(name, names[name])  # every target's lists, sm90's widened
    results = []
    for point in args.points.split(","):
        headdim, causal = int(point.split(":")[0]), point.split(":")[1] == "true"
        seqlen = args.seqlen
        batch, nheads = 16384 // seqlen, 2048 // headdim
        gen = torch.Generator(device="cuda").manual_seed(headdim)
        shape = (batch, seqlen, nheads, headdim)
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        start = time.perf_counter()
        out = flash_attn_func(q, k, v, causal=causal)
        out.backward(dout)
        torch.cuda.synchronize()
        first_call = time.perf_counter() - start
        entry = {"headdim": headdim, "causal": causal, "seqlen": seqlen, "batch": batch, "nheads": nheads,
                 "first_call_s": round(first_call, 2), "kernels": {}}
        if compile_only:
            print(f"compiled d={headdim} causal={causal} in {first_call:.1f} s", flush=True)
            continue
        for name, kernel in kernels.items():
            timings = getattr(kernel, "configs_timings", None) or {}
            ranked = sorted(((t[0] if isinstance(t, (list, tuple)) else t, str(c)) for c, t in timings.items()))
            entry["kernels"][name] = ranked
            print(f"d={headdim} causal={causal} {name}:", flush=True)
            for ms, cfg in ranked:
                print(f"    {ms * 1e3:8.1f} us  {cfg}", flush=True)
        measure(entry, q, k, v, dout, args.sections.split(","))
        if point == args.points.split(",")[-1]:
            for name, kernel in kernels.items():
                print(f"{name} compiled variants (all points so far):", flush=True)
                try:
                    lines = kernel_resources(kernel)
                except Exception as exc:  # Triton internals: report, never fail the sweep
                    lines = [f"    n/a: {type(exc).__name__}: {exc}"]
                print("\n".join(lines), flush=True)
        results.append(entry)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
