"""On an H200: forward TFLOP/s of the Gluon sm90 prototype's variants against flashtile's Triton forward and
PyTorch SDPA (cuDNN where it is the default backend), at a few shapes.

    python benchmarks/lab/gluon_bench.py [--headdims 64,128] [--seqlens 1024,4096,16384] [--tiles 128x128x2x8]
                                         [--variants single,ws,ws-overlap,ws2,pingpong] [--schedules grid,lpt]

Batch × seqlen = 16k tokens, 16 heads, bf16, seqlen_q = seqlen_k. The variants are
``gluon_forward.VARIANTS`` (single partition; warp-specialized; + intra-warpgroup overlap; two consumer
warpgroups; + ping-pong), each on each schedule of ``--schedules`` (a column ``variant/lpt`` for the
"lpt" grid: (batch, head) groups that fit L2, longest causal rows first across heads). Each Gluon variant's
output is compared with flashtile's (max abs difference printed after the timings, in the order of the
columns), so a wrong kernel does not pass for a fast one.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from flashtile import flash_attn_func
from flashtile.bench import attention_flops
from flashtile.kernels.gluon_forward import SCHEDULES, VARIANTS, gluon_attention_forward


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure(d: int, causal: bool, s: int, tiles, runs) -> tuple[dict, list[str]]:
    """Milliseconds per call of each implementation at one point, and each Gluon variant's max difference
    from flashtile's output."""
    batch, heads = max(1, 16384 // s), 16
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = flash_attn_func(q, k, v, causal=causal)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    row = {"flashtile": _ms(lambda: flash_attn_func(q, k, v, causal=causal)),
           "sdpa": _ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))}
    errors = []
    for name, variant, schedule in runs:
        kwargs = dict(tiles=tiles, variant=variant, schedule=schedule)
        out, _ = gluon_attention_forward(q, k, v, causal, **kwargs)
        errors.append(f"{(out.float() - ref.float()).abs().max().item():.2e}")
        row[name] = _ms(lambda kwargs=kwargs: gluon_attention_forward(q, k, v, causal, **kwargs))
    return {name: attention_flops(batch, heads, s, s, d, causal) / ms / 1e9 for name, ms in row.items()}, errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--tiles", default="", help="BLOCK_MxBLOCK_NxSTAGESxnum_warps for the Gluon kernel")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="keys of gluon_forward.VARIANTS")
    parser.add_argument("--schedules", default="grid,lpt", help="of gluon_forward.SCHEDULES: grid, lpt")
    args = parser.parse_args(argv)
    tiles = tuple(int(x) for x in args.tiles.split("x")) if args.tiles else None
    variants, schedules = args.variants.split(","), args.schedules.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [s for s in schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"unknown {unknown}: variants are {', '.join(VARIANTS)}; schedules {', '.join(SCHEDULES)}")
    runs = [(variant if schedule == "grid" else f"{variant}/{schedule}", variant, schedule)
            for schedule in schedules for variant in variants]
    columns = ["flashtile", "sdpa"] + [name for name, _, _ in runs]
    width = max(10, *map(len, columns))
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | " + " ".join(f"{c:>{width}}" for c in columns)
          + "  (TFLOP/s)  max|gluon - flashtile|")
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in args.seqlens.split(",")):
                tf, errors = measure(d, causal, s, tiles, runs)
                print(f"{d:>4} {'yes' if causal else 'no':>6} {s:>6} | "
                      + " ".join(f"{tf[c]:>{width}.1f}" for c in columns) + f"  {' / '.join(errors)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
