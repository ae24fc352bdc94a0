#!/usr/bin/env bash
# Alternating A/B rounds of `flashtile bench`, one process per round, for a change too small to tell from
# one run: the settings take turns, so clock drift and neighbours hit both alike.
#   AB_A="FLASHTILE_BWD_OVERLAP=0" AB_B="FLASHTILE_BWD_OVERLAP=1" ROUNDS=3 bash benchmarks/lab/ab_rounds.sh \
#       --dtypes bfloat16 --headdims 64,128 --causal false,true --seqlens 2048,8192 --modes fwd,bwd
# AB_A / AB_B: space-separated env assignments; PYTHONPATH=<folder> among them runs another tree (e.g. a
# `git archive <rev> flashtile | tar -x -C <folder>` copy). Caches are filled first, in parallel, for both
# (WARM=0 skips it). Rows go to $OUT/ab_<a|b><round>.json; benchmarks/lab/ab_compare.py makes the table.
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
source "$(dirname "$0")/tuning_choices.sh"
# PYTHONSAFEPATH: `python3 -m` would otherwise put the current folder (this tree) ahead of PYTHONPATH, and a
# side's PYTHONPATH=<folder> would silently run this tree too (it did in the tree-against-tree rounds of
# 2026-11-30 before this line).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONSAFEPATH=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Which package each side imports, so a log shows that the two sides ran what was meant.
for side in A B; do
  setting=AB_$side
  echo "side $side imports $(env ${!setting:-} python3 -c 'import flashtile; print(flashtile.__file__)' 2>&1 | tail -1)"
done
if [ "${WARM:-1}" = 1 ]; then
  for side in A B; do
    setting=AB_$side
    for i in 0 1 2 3; do
      env ${!setting:-} FLASHTILE_AUTOTUNE=compile FLASHTILE_BENCH_WARM=1 timeout ${WARM_TIMEOUT:-200} \
        python3 -m flashtile bench "$@" --peers flashtile --shard $i/4 > "/tmp/ab_warm_$side$i.log" 2>&1 &
    done
  done
  wait
  echo "caches filled in $SECONDS s"
fi
for round in $(seq 1 "${ROUNDS:-3}"); do
  for side in a b; do
    forget_choices  # every round tunes anew, not with an earlier round's stored choices
    setting=AB_${side^^}
    env ${!setting:-} timeout ${ROUND_TIMEOUT:-150} python3 -m flashtile bench "$@" --peers flashtile,sdpa_flash \
      --json "$OUT/ab_$side$round.json" > "/tmp/ab_$side$round.log" 2>&1 || echo "round $side$round failed: $(tail -1 /tmp/ab_$side$round.log)"
    echo "round $side$round done at $SECONDS s"
  done
done
