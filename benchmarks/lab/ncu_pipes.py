"""Per kernel of an Nsight Compute report: duration, issue activity, and each pipe's share of its peak.

    ncu --import report.ncu-rep --page raw --csv > raw.csv && python benchmarks/lab/ncu_pipes.py raw.csv

Reads the raw page's CSV (the ComputeWorkloadAnalysis and InstructionStats sections' metrics) and prints, per
profiled kernel, the columns that say what bounds it: ``gpu__time_duration``, the issue slots used, the tensor,
FMA, ALU, XU (MUFU: exp2, conversions) and LSU pipes' utilisation, and the top warp stall reasons.
"""

from __future__ import annotations

import csv
import sys


def main() -> None:
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.reader(f))
    header, units, data = rows[0], rows[1], rows[2:]
    wanted = [i for i, name in enumerate(header) if (
        name.startswith("gpu__time_duration.sum") or name.startswith("smsp__issue_active.avg.pct")
        or (name.startswith("sm__inst_executed_pipe_") and name.endswith("pct_of_peak_sustained_active"))
        or (name.startswith("sm__pipe_") and "pct_of_peak_sustained_active" in name)
        or name.startswith("sm__warps_active.avg.pct") or name.startswith("launch__registers_per_thread")
        or name.startswith("launch__grid_size"))]
    stalls = [i for i, name in enumerate(header) if name.startswith("smsp__average_warp_latency_issue_stalled_")
              or name.startswith("smsp__pcsamp_warps_issue_stalled_") and not name.endswith("_not_issued")]
    name_col = header.index("Kernel Name")
    for row in data:
        print(f"== {row[name_col][:90]}")
        for i in wanted:
            value = row[i]
            try:
                if float(value.replace(",", "")) == 0:
                    continue
            except ValueError:
                pass
            print(f"   {header[i]:70s} {value} {units[i]}")
        ranked = []
        for i in stalls:
            try:
                ranked.append((float(row[i].replace(",", "")), header[i]))
            except ValueError:
                pass
        for value, name in sorted(ranked, reverse=True)[:6]:
            print(f"   stall {name:64s} {value:g}")


if __name__ == "__main__":
    main()
