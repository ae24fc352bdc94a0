"""Markdown table of alternating A/B rounds (benchmarks/lab/ab_rounds.sh): flashtile's TFLOP/s per round on
each side, SDPA flash's median over all rounds, and the ratios of medians.

    python benchmarks/lab/ab_compare.py out/          # reads out/ab_a*.json and out/ab_b*.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    args = parser.parse_args()
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for side in ("a", "b"):
        for path in sorted(glob.glob(os.path.join(args.folder, f"ab_{side}*.json"))):
            for row in json.load(open(path))["rows"]:
                key = (row["dtype"], row["headdim"], row["causal"], row["seqlen"], row["mode"])
                if row.get("tflops"):
                    rows[key][(side, row["impl"])].append(row["tflops"])
    median = statistics.median
    print("| dtype | d | causal | s | mode | A (rounds) | B (rounds) | SDPA flash | B/A | A/flash | B/flash |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(rows, key=lambda k: (k[0], k[1], k[2], k[3], k[4] != "fwd")):
        got = rows[key]
        a, b = got[("a", "flashtile")], got[("b", "flashtile")]
        flash = got[("a", "sdpa_flash")] + got[("b", "sdpa_flash")]
        if not (a and b and flash):
            continue
        dtype, headdim, causal, seqlen, mode = key
        rounds = [" / ".join(str(round(x)) for x in side) for side in (a, b)]
        print(f"| {dtype} | {headdim} | {'yes' if causal else 'no'} | {seqlen} | {mode} | {rounds[0]} | {rounds[1]} | "
              f"{round(median(flash))} | {median(b) / median(a):.3f} | {median(a) / median(flash):.3f} | "
              f"{median(b) / median(flash):.3f} |")


if __name__ == "__main__":
    main()
