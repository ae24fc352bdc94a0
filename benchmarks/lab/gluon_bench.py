"""On an H200: forward TFLOP/s of the Gluon sm90 prototype's variants against flashtile's Triton forward and
PyTorch SDPA (cuDNN where it is the default backend), at a few shapes.

    python benchmarks/lab/gluon_bench.py [--headdims 64,128] [--seqlens 1024,4096,16384] [--tiles 128x128x2x8]
                                         [--variants single,ws,ws-overlap,ws2,pingpong] [--schedules grid,lpt]
    python benchmarks/lab/gluon_bench.py --backward [--headdims 64,128] [--seqlens 4096,16384]
    python benchmarks/lab/gluon_bench.py --fp8 [--headdims 128] [--seqlens 4096,16384] [--tiles 128x128x2x8]
                                         [--fp8-configs pingpong-fa3:128x128x2x8,pingpong3-fa3:192x128x2x12]
    python benchmarks/lab/gluon_bench.py --varlen [--headdims 64,128] [--seqlens 256,512,1024,2048,4096]

Batch × seqlen = 16k tokens, 16 heads, bf16, seqlen_q = seqlen_k. The variants are
``gluon_forward.VARIANTS`` (single partition; warp-specialized; + intra-warpgroup overlap; two consumer
warpgroups; + ping-pong), each on each schedule of ``--schedules`` (a column ``variant/lpt`` for the
"lpt" grid: (batch, head) groups that fit L2, longest causal rows first across heads). Each Gluon variant's
output is compared with flashtile's (max abs difference printed after the timings, in the order of the
columns), so a wrong kernel does not pass for a fast one.

``--backward``: the Gluon backward prototype (``gluon_backward.gluon_attention_backward``, from flashtile's
out and lse; plain, with the pipelined passes, and those with dQ on a side stream) against flashtile's
backward (``torch.autograd.grad`` through flash_attn_func) and SDPA's (its default backend), backward
TFLOP/s, and the Gluon gradients' max difference from flashtile's.

``--fp8``: the Gluon FP8 forward (``gluon_attention_forward_fp8``, pingpong-fa3, v keys-fastest as
``flashtile.fp8.quantize(v, keys_fastest=True)`` makes it) against flashtile's FP8 forward (the Triton kernel,
same inputs), flashtile's bf16 forward and SDPA's default on the dequantized inputs, forward TFLOP/s, and the
Gluon output's max difference from flashtile's FP8 output.

``--varlen``: packed sequences of mixed lengths (16k tokens; ``--seqlens`` are the mean lengths, each
sequence 0.25-1.75x of it): the Gluon varlen forward (the variant and tile ``configs.gluon_tier`` gives)
against flashtile's Triton varlen forward (``flash_attn_varlen_func`` with ``FLASHTILE_GLUON=0``), forward
TFLOP/s (by the sequences' own lengths) and the max difference of the two outputs. What
``configs.GLUON_VARLEN_MIN_MEAN`` was set from.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_func
from flashtile.bench import attention_flops
from flashtile.kernels.gluon_forward import SCHEDULES, VARIANTS, gluon_attention_forward


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure(d: int, causal: bool, s: int, runs) -> tuple[dict, list[str]]:
    """Milliseconds per call of each implementation at one point, and each Gluon variant's max difference
    from flashtile's output."""
    batch, heads = max(1, 16384 // s), 16
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = flash_attn_func(q, k, v, causal=causal)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    row = {"flashtile": _ms(lambda: flash_attn_func(q, k, v, causal=causal)),
           "sdpa": _ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))}
    errors = []
    for name, (variant, tile), schedule in runs:
        kwargs = dict(tiles=tile, variant=variant, schedule=schedule)
        try:
            out, _ = gluon_attention_forward(q, k, v, causal, **kwargs)
        except ValueError:  # a (variant, tile) the kernel does not take: 0 TFLOP/s
            errors.append("-")
            row[name] = float("inf")
            continue
        errors.append(f"{(out.float() - ref.float()).abs().max().item():.2e}")
        row[name] = _ms(lambda kwargs=kwargs: gluon_attention_forward(q, k, v, causal, **kwargs))
    return {name: attention_flops(batch, heads, s, s, d, causal) / ms / 1e9 for name, ms in row.items()}, errors


def backward_point(d: int, causal: bool, s: int) -> tuple:
    """(batch, heads, q, k, v, dout, out, lse, (qt, kt, vt)) of one backward benchmark point: bf16, batch · s =
    16k tokens, 16 heads, q, k, v leaves that require grad, out and lse from flashtile's forward, and BHSD leaves
    of the same values for SDPA."""
    batch, heads = max(1, 16384 // s), 16
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    return batch, heads, q, k, v, dout, out, lse, tuple(t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))


def measure_backward(d: int, causal: bool, s: int) -> tuple[dict, str]:
    """Backward TFLOP/s of flashtile, SDPA and the Gluon prototype at one point, and max|gluon - flashtile|
    over dq, dk, dv."""
    from flashtile.kernels.gluon_backward import gluon_attention_backward

    batch, heads, q, k, v, dout, out, lse, (qt, kt, vt) = backward_point(d, causal, s)
    sdpa_dout = dout.transpose(1, 2)
    want = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    got = gluon_attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, causal)
    error = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    row = {"flashtile": _ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))}
    for name, backend in (("sdpa", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):  # the backward's kernel is the one its forward was made with
            sdpa_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        row[name] = _ms(lambda sdpa_out=sdpa_out: torch.autograd.grad(sdpa_out, (qt, kt, vt), sdpa_dout,
                                                                      retain_graph=True))
    row["gluon"] = _ms(lambda: gluon_attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                                        lse, causal))
    piped = gluon_attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, causal,
                                     pipelined=True)
    error_piped = max((a.float() - b.float()).abs().max().item() for a, b in zip(piped, want))
    row["pipelined"] = _ms(lambda: gluon_attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                                            lse, causal, pipelined=True))
    row["overlapped"] = _ms(lambda: gluon_attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                                             lse, causal, pipelined=True, overlap=True))
    return ({name: attention_flops(batch, heads, s, s, d, causal, "bwd") / ms / 1e9 for name, ms in row.items()},
            f"{error:.2e} {error_piped:.2e}")


def main_backward(args) -> int:
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | {'flashtile':>10} {'sdpa':>10} {'cudnn':>10} {'gluon':>10}"
          f" {'pipelined':>10} {'overlapped':>10}  (backward TFLOP/s; overlapped: pipelined, dQ on a side stream)"
          "  max|gluon - flashtile|, max|pipelined - flashtile|")
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in args.seqlens.split(",")):
                tf, error = measure_backward(d, causal, s)
                print(f"{d:>4} {'yes' if causal else 'no':>6} {s:>6} | {tf['flashtile']:>10.1f} {tf['sdpa']:>10.1f} "
                      f"{tf['cudnn']:>10.1f} {tf['gluon']:>10.1f} {tf['pipelined']:>10.1f} {tf['overlapped']:>10.1f}"
                      f"  {error}", flush=True)
    return 0


def measure_fp8(d: int, causal: bool, s: int, configs: list[tuple[str, tuple | None]]) -> tuple[dict, list[str]]:
    """Forward TFLOP/s of the Gluon FP8 kernel at each (variant, tiles) of ``configs``, flashtile's FP8 and bf16
    forwards and SDPA at one point, and each Gluon config's max|gluon - flashtile FP8|."""
    from flashtile import fp8
    from flashtile.kernels.gluon_forward import gluon_attention_forward_fp8

    batch, heads = max(1, 16384 // s), 16
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    (q8, qd), (k8, kd) = fp8.quantize(q), fp8.quantize(k)
    v8, vd = fp8.quantize(v, keys_fastest=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def flashtile_fp8():
        return flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

    reference = flashtile_fp8().float()
    row, errors = {}, []
    for variant, tiles in configs:
        def gluon(variant=variant, tiles=tiles):
            return gluon_attention_forward_fp8(q8, k8, v8, qd, kd, vd, causal, tiles=tiles, variant=variant)[0]

        errors.append(f"{(gluon().float() - reference).abs().max().item():.2e}")
        row[(variant, tiles)] = _ms(gluon)
    row.update(fp8=_ms(flashtile_fp8), bf16=_ms(lambda: flash_attn_func(q, k, v, causal=causal)),
               sdpa=_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)))
    return {name: attention_flops(batch, heads, s, s, d, causal) / ms / 1e9 for name, ms in row.items()}, errors


def main_fp8(args) -> int:
    tiles = tuple(int(x) for x in args.tiles.split("x")) if args.tiles else None
    configs = [("pingpong-fa3", tiles)]
    if args.fp8_configs:  # variant:tile pairs
        configs = [(c.split(":")[0], tuple(int(x) for x in c.split(":")[1].split("x")))
                   for c in args.fp8_configs.split(",")]
    names = [f"{variant}:{'x'.join(map(str, tiles)) if tiles else 'default'}" for variant, tiles in configs]
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | " + " ".join(f"{n:>26}" for n in names)
          + f" {'fp8':>8} {'bf16':>8} {'sdpa':>8}  (forward TFLOP/s)  max|gluon - fp8| per config")
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in args.seqlens.split(",")):
                tf, errors = measure_fp8(d, causal, s, configs)
                print(f"{d:>4} {'yes' if causal else 'no':>6} {s:>6} | "
                      + " ".join(f"{tf[c]:>26.1f}" for c in configs)
                      + f" {tf['fp8']:>8.1f} {tf['bf16']:>8.1f} {tf['sdpa']:>8.1f}  {' '.join(errors)}", flush=True)
    return 0


def packed_lengths(mean: int, d: int, causal: bool, tokens: int = 16384) -> list[int]:
    """Sequence lengths of 0.25-1.75x ``mean`` that sum to ``tokens``, the same for the same point."""
    gen = torch.Generator().manual_seed(mean + d + causal)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(max(16, int(mean * (0.25 + 1.5 * torch.rand(1, generator=gen).item()))))
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


def measure_varlen(d: int, causal: bool, mean: int, tokens: int = 16384) -> tuple[dict, str]:
    """Forward TFLOP/s of the Triton and the Gluon varlen forwards over one packing of mixed lengths."""
    import os

    from flashtile import flash_attn_varlen_func
    from flashtile.kernels import configs
    from flashtile.kernels.gluon_forward import gluon_attention_forward_varlen

    heads = 16
    lengths = packed_lengths(mean, d, causal, tokens)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    q, k, v = (torch.randn(tokens, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    variant, tiles = configs.gluon_tier(d, causal)

    def triton_varlen():  # under FLASHTILE_GLUON=0, set around the calls (not inside the timed one)
        return flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)

    def gluon():
        return gluon_attention_forward_varlen(q, k, v, cu, cu, max(lengths), causal, tiles=tiles, variant=variant)[0]

    os.environ["FLASHTILE_GLUON"] = "0"
    try:
        triton_out, triton_ms = triton_varlen(), _ms(triton_varlen)
    finally:
        del os.environ["FLASHTILE_GLUON"]
    error = (gluon().float() - triton_out.float()).abs().max().item()
    flops = sum(attention_flops(1, heads, n, n, d, causal) for n in lengths)
    row = {"triton": triton_ms, "gluon": _ms(gluon)}
    return {name: flops / ms / 1e9 for name, ms in row.items()}, f"{len(lengths)} seqs, max diff {error:.2e}"


def main_varlen(args) -> int:
    from flashtile.kernels import configs

    print(f"{'d':>4} {'causal':>6} {'mean':>6} | {'triton':>10} {'gluon':>10} {'ratio':>6}  (forward TFLOP/s)")
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (False, True):
            if configs.gluon_tier(d, causal) is None:
                continue
            for mean in (int(x) for x in args.seqlens.split(",")):
                tf, note = measure_varlen(d, causal, mean)
                print(f"{d:>4} {'yes' if causal else 'no':>6} {mean:>6} | {tf['triton']:>10.1f} {tf['gluon']:>10.1f} "
                      f"{tf['gluon'] / tf['triton']:>6.2f}  {note}", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--tiles", default="", help="BLOCK_MxBLOCK_NxSTAGESxnum_warps for the Gluon kernel; several "
                        "(comma-separated, forward only): a column per variant and tile")
    parser.add_argument("--causal", default="false,true", help="causal settings to run: false, true or both")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="keys of gluon_forward.VARIANTS")
    parser.add_argument("--schedules", default="grid,lpt", help="of gluon_forward.SCHEDULES: grid, lpt")
    parser.add_argument("--backward", action="store_true", help="the Gluon backward prototype instead")
    parser.add_argument("--fp8", action="store_true", help="the Gluon FP8 forward instead")
    parser.add_argument("--fp8-configs", default=None,
                        help="with --fp8: variant:BLOCK_MxBLOCK_NxSTAGESxnum_warps pairs, comma-separated (columns)")
    parser.add_argument("--varlen", action="store_true", help="the Gluon varlen forward against the Triton one")
    args = parser.parse_args(argv)
    if args.varlen:
        return main_varlen(args)
    if args.backward:
        return main_backward(args)
    if args.fp8:
        return main_fp8(args)
    tile_list = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")] if args.tiles else [None]
    variants, schedules = args.variants.split(","), args.schedules.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [s for s in schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"unknown {unknown}: variants are {', '.join(VARIANTS)}; schedules {', '.join(SCHEDULES)}")
    def column(variant: str, schedule: str, tile) -> str:
        name = variant if schedule == "grid" else f"{variant}/{schedule}"
        return f"{name}@{'x'.join(map(str, tile))}" if len(tile_list) > 1 else name

    # (column, (variant, tile), schedule); with several tiles a column per (variant, tile) that the kernel takes
    # (two or three consumers need 4 warps each)
    runs = [(column(variant, schedule, tile), (variant, tile), schedule)
            for schedule in schedules for variant in variants for tile in tile_list
            if len(tile_list) == 1 or VARIANTS[variant][2] == 1 or tile[3] == 4 * VARIANTS[variant][2]]
    columns = ["flashtile", "sdpa"] + [name for name, _, _ in runs]
    width = max(10, *map(len, columns))
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | " + " ".join(f"{c:>{width}}" for c in columns)
          + "  (TFLOP/s)  max|gluon - flashtile|")
    causal_settings = [c.strip().lower() in ("true", "yes", "1") for c in args.causal.split(",")]
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in causal_settings:
            for s in (int(x) for x in args.seqlens.split(",")):
                tf, errors = measure(d, causal, s, runs)
                print(f"{d:>4} {'yes' if causal else 'no':>6} {s:>6} | "
                      + " ".join(f"{tf[c]:>{width}.1f}" for c in columns) + f"  {' / '.join(errors)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
