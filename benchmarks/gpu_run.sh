#!/usr/bin/env bash
# Everything the GPU machine runs, in one go: GPU tests, then the benchmark. Logs go under $OUT.
#   bash benchmarks/gpu_run.sh [tests] [quick] [bench] [grid] [memory]   (default: tests bench)
# tests  the whole suite on the GPU (pytest -n 8)      quick  a subset of the GPU tests
# bench  bf16, d=64/128, causal and not, s=4096: flashtile vs SDPA flash and cuDNN, forward/backward
# grid   the harness's full default grid               memory the peak-memory sweep to 1M tokens
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
phases=${*:-tests bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
status=0
for phase in $phases; do
  start=$(date +%s)
  case $phase in
    tests) python3 -m pytest tests -n 8 -q -p no:cacheprovider -W ignore 2>&1 | tail -40 | tee "$OUT/tests.log" || status=1 ;;
    quick) python3 -m pytest tests/kernels -n 8 -q -p no:cacheprovider -W ignore -k "${QUICK_K:-d64 or d128 or d59 or gqa or determin}" -x 2>&1 | tail -40 | tee "$OUT/quick.log" || status=1 ;;
    bench) python3 -m flashtile bench --dtypes bfloat16 --headdims 64,128 --causal false,true --seqlens 4096 \
             --modes fwd,bwd --peers flashtile,sdpa_flash,sdpa_cudnn --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1 ;;
    grid) python3 -m flashtile bench --json "$OUT/grid.json" --plot "$OUT/grid" 2>&1 | tee "$OUT/grid.log" || status=1 ;;
    memory) python3 -m flashtile bench --memory --peers flashtile,naive --json "$OUT/memory.json" --plot "$OUT/memory" 2>&1 | tee "$OUT/memory.log" || status=1 ;;
    *) echo "unknown phase $phase"; status=1 ;;
  esac
  echo "phase $phase took $(( $(date +%s) - start )) s" | tee -a "$OUT/phases.txt"
done
exit $status
