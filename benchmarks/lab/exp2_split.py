"""The Gluon forward with a quarter of its exponentials on the FMA units (``exp2_poly=4``) against all on MUFU.

    python benchmarks/lab/exp2_split.py [--seqlens 4096,16384]

FA4 computes part of the softmax's exp2 with a polynomial on the FMA units, because the MUFU unit that runs
``ex2`` does 16 a cycle per multiprocessor against the tensor cores' pace. This times the Gluon forward
(``pingpong-fa3``, its default tiles) in bf16 at d = 64 and 128 and in FP8 at d = 128 (also the 128 x 256 tile),
causal and not, with ``exp2_poly`` 0 and 4, beside cuDNN's bf16 forward (batch * seqlen = 16,384, heads * d =
2,048), forward TFLOP/s, and the largest difference of the two outputs.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from flashtile import fp8
from flashtile.kernels.gluon_forward import DEFAULT_TILES, gluon_attention_forward, gluon_attention_forward_fp8


def _tflops(ms: float, batch: int, heads: int, s: int, d: int, causal: bool) -> float:
    return 4 * batch * heads * s * s * d / (2 if causal else 1) / (ms * 1e-3) / 1e12


def point(kind: str, d: int, causal: bool, s: int) -> None:
    """One (kind, d, causal, s) point: each tile's line."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads = 16384 // s, 2048 // d
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    (q8, qd), (k8, kd) = fp8.quantize(q), fp8.quantize(k)
    v8, vd = fp8.quantize(v, keys_fastest=True)
    for tiles in [DEFAULT_TILES[d]] + ([(128, 256, 2, 8)] if kind == "fp8" else []):
        def run(poly, tiles=tiles):
            if kind == "fp8":
                return gluon_attention_forward_fp8(q8, k8, v8, qd, kd, vd, causal, tiles=tiles, exp2_poly=poly)[0]
            return gluon_attention_forward(q, k, v, causal, tiles=tiles, variant="pingpong-fa3", exp2_poly=poly)[0]

        base, split = run(0).float(), run(4).float()
        diff = ((split - base).abs().max() / base.abs().max()).item()
        t0, t4 = do_bench(lambda: run(0)), do_bench(lambda: run(4))
        f0, f4, fc = (_tflops(t, batch, heads, s, d, causal) for t in (t0, t4, cudnn))
        tile = "x".join(map(str, tiles))
        print(f"{kind:>5} {d:>4} {'yes' if causal else 'no':>6} {s:>6} {tile:>12} | {f0:7.1f} {f4:7.1f} "
              f"{f4 / f0:10.3f} {fc:7.1f} | {diff:.1e}  nan: {bool(split.isnan().any())}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="4096,16384")
    args = parser.parse_args()
    print(f"{'kind':>5} {'d':>4} {'causal':>6} {'s':>6} {'tile':>12} | {'mufu':>7} {'split':>7} {'split/mufu':>10} "
          f"{'cudnn':>7} | max|diff| / max|out|")
    for kind, d in (("bf16", 64), ("bf16", 128), ("fp8", 128)):
        for causal in (False, True):
            for s in (int(x) for x in args.seqlens.split(",")):
                point(kind, d, causal, s)


if __name__ == "__main__":
    main()
