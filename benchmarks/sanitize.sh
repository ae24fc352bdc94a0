#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck) over a small run of every kernel: forward, backward (preprocess,
# dK/dV, dQ), varlen, the variant switches. Needs the GPU machine. Logs under $OUT (default ./out).
#   bash benchmarks/sanitize.sh
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FLASHTILE_AUTOTUNE=0 PYTORCH_NO_CUDA_MEMORY_CACHING=1
cat > "$OUT/sanitize_run.py" <<'PY'
import torch
from flashtile import flash_attn_func, flash_attn_varlen_func
torch.manual_seed(0)
for causal, window, softcap in ((False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (16, 0), 5.0)):
    for d in (64, 59):
        q, k, v = (torch.randn(2, 97, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
        out.backward(torch.randn_like(out))
cu = torch.tensor([0, 30, 31, 100], dtype=torch.int32, device="cuda")
q = torch.randn(100, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
out = flash_attn_varlen_func(q, q, q, cu, cu, 69, 69, causal=True)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("sanitized run done")
PY
status=0
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 python3 "$OUT/sanitize_run.py" > "$OUT/sanitize_$tool.log" 2>&1 || status=1
  tail -3 "$OUT/sanitize_$tool.log"
done
exit $status
