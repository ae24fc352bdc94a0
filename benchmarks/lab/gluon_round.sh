#!/usr/bin/env bash
# One round of the Gluon forward's variants on the GPU machine: TFLOP/s against flashtile and SDPA, at two
# tiles per head dim, then the GPU tests of the variants named in TESTS_K. Logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
B=benchmarks/lab/gluon_bench.py
S=${SEQLENS:-1024,4096,16384}
for tiles in 128x128x2x8 128x128x3x8; do
  timeout 150 python3 $B --headdims 128 --seqlens $S --schedules grid --tiles $tiles \
    --variants ${VARIANTS128:-pingpong-ffma,pingpong-early,pingpong-fa3} > "$OUT/b128_$tiles.log" 2>&1
  timeout 120 python3 $B --headdims 64 --seqlens $S --schedules grid --tiles $tiles \
    --variants ${VARIANTS64:-single-ffma,pingpong-early,pingpong-fa3} > "$OUT/b64_$tiles.log" 2>&1
done
if [ -n "${TESTS_K:-}" ]; then
  timeout ${TESTS_TIMEOUT:-100} python3 -m pytest tests/kernels/test_gluon_forward.py -q -p no:cacheprovider -W ignore \
    -k "$TESTS_K" -n 8 > "$OUT/gl_tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/gl_tests.log"
  tail -3 "$OUT/gl_tests.log"
fi
for f in "$OUT"/b*.log; do echo "== $f"; cat "$f"; done
