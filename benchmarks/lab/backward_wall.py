"""Wall time of eager forward+backward calls under two ways of running the backward, in alternating processes:
the small backward in two launches (the dQ pass makes the row statistics, ``ROW_STATS``) against three (the
preprocess kernel first), or the Gluon one pass against the Triton two passes at every length (sm90).

    python benchmarks/lab/backward_wall.py [--variants two-launches,three-launches | one-pass,two-passes]
                                           [--rounds 2] [--device cuda] [--shapes 1:256:32:128,...]

The rows are ``flashtile bench --overhead``'s training rows (q, k, v views of one projection's output, ``.backward()``
through autograd, loops of 30 calls synchronised once, median of 11 loops), forward+backward only, with SDPA's cuDNN
backend timed in the same processes as a yardstick of the machine's drift (the last columns divide it out: each
variant's time over cuDNN's in the same process, median over rounds). The variant is fixed per process
(``backward._stats_in_dq_pass``, ``configs.GLUON_BACKWARD_MIN_SEQLEN``) because a launch plan replays the launches
it recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

VARIANTS = ("two-launches", "three-launches", "one-pass", "two-passes")


def child(variant: str, device: str, shapes: list[tuple[int, ...]]) -> None:
    from flashtile import bench_overhead
    from flashtile.kernels import backward, configs

    if variant == "three-launches":
        backward._stats_in_dq_pass = lambda large, fp8: False
    elif variant in ("one-pass", "two-passes"):  # from any length, or from none
        for key in configs.GLUON_BACKWARD_MIN_SEQLEN:
            configs.GLUON_BACKWARD_MIN_SEQLEN[key] = 1 if variant == "one-pass" else 1 << 62
    import torch

    for shape in shapes:
        for causal in (False, True):
            calls = bench_overhead._training_calls(shape, causal, torch.bfloat16, torch.device(device))
            timed = {name: calls[name]["fwd_bwd"] for name in ("flashtile", "sdpa_cudnn")}
            us, _ = bench_overhead._time_round_robin(timed, 30, 11, torch.device(device))
            us = {name: value if isinstance(value, float) else float("nan") for name, value in us.items()}
            print(json.dumps({"shape": shape, "causal": causal, "us": us}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="two-launches,three-launches",
                        help="two-launches,three-launches or one-pass,two-passes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default=None, help="b:s:h:d,... (default: the overhead rows' four shapes)")
    parser.add_argument("--child", choices=VARIANTS)
    args = parser.parse_args()
    pair = tuple(args.variants.split(","))
    if set(pair) not in ({"two-launches", "three-launches"}, {"one-pass", "two-passes"}) or len(pair) != 2:
        parser.error(f"--variants takes two-launches,three-launches or one-pass,two-passes (either order), got "
                     f"{args.variants!r}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.child:
        from flashtile.bench_overhead import OVERHEAD_SHAPES
        shapes = ([tuple(map(int, item.split(":"))) for item in args.shapes.split(",")] if args.shapes
                  else list(OVERHEAD_SHAPES))
        child(args.child, args.device, shapes)
        return
    results: dict[tuple, dict[str, list[float]]] = {}
    for round_index in range(args.rounds):
        for variant in pair if round_index % 2 == 0 else reversed(pair):
            command = [sys.executable, __file__, "--child", variant, "--device", args.device]
            lines = subprocess.run(command + (["--shapes", args.shapes] if args.shapes else []),
                                   check=True, capture_output=True, text=True).stdout.splitlines()
            for line in lines:
                print(variant, line, file=sys.stderr, flush=True)  # a run stopped by a time limit keeps its rows
                row = json.loads(line)
                cell = results.setdefault((tuple(row["shape"]), row["causal"]), {})
                cell.setdefault(variant, []).append(row["us"]["flashtile"])
                cell.setdefault(f"sdpa_cudnn ({variant})", []).append(row["us"]["sdpa_cudnn"])
                # flashtile over cuDNN in the same process: what is left once the machine's drift between
                # processes (cuDNN's own time moved by up to half at host-bound shapes) is divided out
                cell.setdefault(f"over cuDNN ({variant})", []).append(row["us"]["flashtile"] / row["us"]["sdpa_cudnn"])
    first, second = pair
    print(f"| b, s, h, d | causal | {first} µs | {second} µs | {first} / {second} | cuDNN µs (in each) | "
          f"each over cuDNN in its processes | {first} / {second} by those |")
    print("|---|---|---|---|---|---|---|---|")
    for (shape, causal), cell in results.items():
        a, b = (statistics.median(cell[variant]) for variant in pair)
        cudnn = " / ".join(f"{statistics.median(cell[f'sdpa_cudnn ({variant})']):.0f}" for variant in pair)
        over = [statistics.median(cell[f"over cuDNN ({variant})"]) for variant in pair]
        print(f"| {', '.join(map(str, shape))} | {'yes' if causal else 'no'} | {a:.0f} | {b:.0f} | "
              f"{a / b:.3f} | {cudnn} | {over[0]:.3f} / {over[1]:.3f} | {over[0] / over[1]:.3f} |")


if __name__ == "__main__":
    main()
