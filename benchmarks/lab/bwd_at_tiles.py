"""On a GPU: the whole backward's TFLOP/s at fixed tiles, for comparing trees without the tuner's choices.

    PYTHONSAFEPATH=1 PYTHONPATH=<tree> python benchmarks/lab/bwd_at_tiles.py [--tag NAME] [--headdim 64]
        [--causal] [--dkdv 64x32x4x3] [--dq 128x64x4x3] [--points 4:4096,1:16384]

Each kernel's autotuner keeps one candidate, the tile given (BLOCK_N x BLOCK_M x warps x stages for dK/dV,
BLOCK_M x BLOCK_N x warps x stages for dQ), so two trees (``git archive <rev> flashtile | tar -x -C <dir>``)
run the same tiles and differ only in their code. bf16, 32 heads (heads x d = 2048 at d = 64), the
backward of ``flash_attn_func`` through autograd, median of ``triton.testing.do_bench``. Run each tree in
its own process, alternating, at least twice: how the 5% that 2b111dc cost was found (`git show
8ad0713^:benchmarks/RESULTS.md`, "Speed grid").

``--sweep "DKDV/DQ;DKDV/DQ;..."`` times several tile pairs in one process instead, round by round in rotated order
(``--rounds``), launch plans and direct launches off so that each pin takes effect: which pair is fastest for the
whole backward, its two streams included, where the tuner times each kernel alone. ``--heads`` sets the heads
(default 32; the speed grid's shape is heads x d = 2048). ``--dropout P``: calls with ``dropout_p=P`` (the kernels'
dropout variant; sm90's dK/dV pass has its own list with dropout). ``--one-stream``: the dQ pass after the dK/dV pass on
the caller's stream, never forked onto the side stream (``backward.SIDE_STREAM_MIN_WORK``), for telling the two-stream
schedule's share of a point's spread from the kernels'.

``--fwd-sweep "128x64x4x2;64x64x4x3"`` times the Triton forward (``_attn_fwd``: BLOCK_M x BLOCK_N x warps x stages)
pinned to each tile instead, round by round in rotated order (``FLASHTILE_GLUON=0``: calls without dropout take it
too): the forward that calls with dropout, and GPUs and variants the Gluon forward does not serve, run; TFLOP/s.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton

from flashtile import flash_attn_func
from flashtile.bench import attention_flops
from flashtile.kernels import backward, configs, forward


def _pin(tuner, names: tuple[str, str], tile: str) -> None:
    a, b, warps, stages = (int(x) for x in tile.split("x"))
    keep = [c for c in tuner.configs if c.kwargs.get(names[0]) == a and c.kwargs.get(names[1]) == b
            and c.num_warps == warps and c.num_stages == stages]
    if not keep:
        raise SystemExit(f"{tile} is not among {tuner.fn.__name__}'s candidates")
    tuner.configs = keep[:1]
    tuner.early_config_prune = None  # the one config left: no prune to look for the target's list in it
    tuner.cache.clear()
    configs._CHOSEN.clear()  # the launcher's own memory of each key's choice and its direct launches
    configs._DIRECT.clear()


def _backward_call(out, inputs, dout):
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="tree")
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dkdv", default="64x32x4x3")
    parser.add_argument("--dq", default="128x64x4x3")
    parser.add_argument("--points", default="4:4096,1:16384", help="batch:seqlen, comma-separated")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--sweep", default="", help="DKDV/DQ tile pairs, ';'-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p of the calls")
    parser.add_argument("--fwd-sweep", default="", help="forward tiles, ';'-separated (the forward instead)")
    parser.add_argument("--one-stream", action="store_true", help="no side stream for the dQ pass")
    args = parser.parse_args()
    if args.one_stream:
        backward.SIDE_STREAM_MIN_WORK = float("inf")
        args.tag += " one-stream"
    if args.fwd_sweep:
        _forward_sweep(args)
        return
    if not args.sweep:
        _pin(backward._attn_bwd_dkdv, ("BLOCK_N", "BLOCK_M"), args.dkdv)
        _pin(backward._attn_bwd_dq, ("BLOCK_M", "BLOCK_N"), args.dq)
        for point in args.points.split(","):
            print(f"{args.tag} {_point_line(args, point, _time_point(args, point))}", flush=True)
        return
    _sweep(args, [tuple(pair.split("/")) for pair in args.sweep.split(";")],
           [(backward._attn_bwd_dkdv, ("BLOCK_N", "BLOCK_M")), (backward._attn_bwd_dq, ("BLOCK_M", "BLOCK_N"))],
           ("dK/dV tile", "dQ tile"), _time_point, "bwd")


def _forward_sweep(args) -> None:
    # Calls without dropout would take the Gluon forward on an sm90 GPU, whatever the pinned tile: the Triton one here.
    os.environ["FLASHTILE_GLUON"] = "0"
    _sweep(args, [(tile,) for tile in args.fwd_sweep.split(";")], [(forward._attn_fwd, ("BLOCK_M", "BLOCK_N"))],
           ("forward tile",), _time_forward, "fwd")


def _sweep(args, entries, kernels, headers, time_point, mode: str) -> None:
    """Each entry (one tile per kernel of ``kernels``, (autotuner, names) pairs) pinned in turn, round by round in
    rotated order, timed at every point by ``time_point``; then the table of every round's TFLOP/s."""
    points = args.points.split(",")
    every = [list(kernel.configs) for kernel, _ in kernels]
    results: dict = {}
    for round_ in range(args.rounds):
        for i in range(len(entries)):
            entry = entries[(i + round_) % len(entries)]
            for (kernel, names), configs_all, tile in zip(kernels, every, entry):
                kernel.configs = list(configs_all)
                _pin(kernel, names, tile)
            label = " ".join(f"{header.split()[0]}={tile}" for header, tile in zip(headers, entry))
            for point in points:
                tflops = time_point(args, point)
                results.setdefault((entry, point), []).append(tflops)
                print(f"round {round_} {label} {_point_line(args, point, tflops, mode)}", flush=True)
    print("\n| " + " | ".join(headers) + " | " + " | ".join(points) + " |")
    print("|" + "---|" * (len(headers) + len(points)))
    for entry in entries:
        cells = [" / ".join(f"{x:.1f}" for x in results[(entry, point)]) for point in points]
        print("| " + " | ".join(entry) + " | " + " | ".join(cells) + " |")


def _time_forward(args, point: str) -> float:
    """The forward's TFLOP/s at one batch:seqlen point (grad off: no autograd bookkeeping)."""
    heads, d = args.heads, args.headdim
    batch, seqlen = (int(x) for x in point.split(":"))
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = triton.testing.do_bench(lambda: flash_attn_func(q, k, v, dropout_p=args.dropout, causal=args.causal),
                                 warmup=100, rep=500, return_mode="median")
    return attention_flops(batch, heads, seqlen, seqlen, d, args.causal, "fwd") / ms / 1e9


def _time_point(args, point: str) -> float:
    """The whole backward's TFLOP/s at one batch:seqlen point."""
    heads, d = args.heads, args.headdim
    batch, seqlen = (int(x) for x in point.split(":"))
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flash_attn_func(q, k, v, dropout_p=args.dropout, causal=args.causal)
    backward_call = _backward_call(out, (q, k, v), torch.randn_like(out))
    ms = triton.testing.do_bench(backward_call, warmup=100, rep=500, return_mode="median")
    return attention_flops(batch, heads, seqlen, seqlen, d, args.causal, "bwd") / ms / 1e9


def _point_line(args, point: str, tflops: float, mode: str = "bwd") -> str:
    dropout = f" dropout={args.dropout}" if args.dropout else ""
    return f"d={args.headdim} causal={args.causal}{dropout} s={point.split(':')[1]} {mode} {tflops:.1f} TFLOP/s"


if __name__ == "__main__":
    # Each pin must reach the launch: no launch plan or direct launch replaying an earlier pair's kernels.
    os.environ.setdefault("FLASHTILE_LAUNCH_PLANS", "0")
    os.environ.setdefault("FLASHTILE_DIRECT_LAUNCH", "0")
    main()
