"""The markdown table RESULTS.md keeps for a whole-grid run, and its target cells checked.

    python benchmarks/grid_table.py out/grid.json

One row per (dtype, head dim, causal, seqlen): TFLOP/s forward / backward / forward+backward of each
implementation, then flashtile's ratios to SDPA's flash backend. A target cell (bf16, seqlen >= 2048:
1.35x SDPA flash at d=64 and 128, 1.1x at d=256, forward and backward) that misses is in bold, and the
misses are listed after the table.
"""

from __future__ import annotations

import argparse
import json
import sys

IMPLS = ("flashtile", "sdpa_flash", "sdpa_cudnn", "flex", "naive")
MODES = ("fwd", "bwd", "fwd_bwd")
SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def target(dtype: str, headdim: int, seqlen: int) -> float | None:
    """The target ratio to SDPA flash for this cell, or None where it sets none."""
    if dtype != "bfloat16" or seqlen < 2048:
        return None
    return 1.1 if headdim > 128 else 1.35


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("grid_json")
    args = parser.parse_args()
    with open(args.grid_json) as fh:
        data = json.load(fh)
    tflops: dict[tuple, float] = {}
    for row in data["rows"]:
        key = (row["dtype"], row["headdim"], row["causal"], row["seqlen"], row["impl"], row["mode"])
        tflops[key] = row["tflops"]
    points = sorted({key[:4] for key in tflops}, key=lambda p: (p[0] != "bfloat16", p[1], p[2], p[3]))

    def cell(point, impl) -> str:
        values = [tflops.get((*point, impl, mode)) for mode in MODES]
        if all(v is None or v != v for v in values):  # absent or NaN (did not fit)
            return "–"
        return " / ".join("–" if v is None or v != v else f"{v:.0f}" for v in values)

    print(f"| dtype | d | causal | s | {' | '.join(IMPLS)} | ×flash fwd / bwd / f+b |")
    print("|---|---|---|---|" + "---|" * len(IMPLS) + "---|")
    misses, held, counted = [], 0, 0
    for point in points:
        dtype, headdim, causal, seqlen = point
        ratios = []
        for mode in MODES:
            ours, flash = tflops.get((*point, "flashtile", mode)), tflops.get((*point, "sdpa_flash", mode))
            ratio = ours / flash if ours and flash else float("nan")
            text = f"{ratio:.2f}"
            goal = target(dtype, headdim, seqlen)
            if goal is not None and mode != "fwd_bwd":
                counted += 1
                if ratio >= goal:
                    held += 1
                else:  # below the target, or not measured (a missing row or NaN)
                    text = f"**{text}**"
                    measured = f"{ours:.0f} against {flash:.0f} TFLOP/s" if ours and flash else "not measured"
                    misses.append(f"{SHORT[dtype]} d={headdim} {'causal' if causal else 'non-causal'} s={seqlen} "
                                  f"{mode}: {ratio:.3f}x ({measured})")
            ratios.append(text)
        print(f"| {SHORT.get(dtype, dtype)} | {headdim} | {'yes' if causal else 'no'} | {seqlen} | "
              + " | ".join(cell(point, impl) for impl in IMPLS) + f" | {' / '.join(ratios)} |")
    print(f"\n{held} of {counted} target cells hold.")
    for miss in misses:
        print(f"- {miss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
