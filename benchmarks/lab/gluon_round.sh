#!/usr/bin/env bash
# One round of the Gluon forward's variants on the GPU machine: TFLOP/s against flashtile and SDPA, then
# the new variants' GPU tests. Logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
B=benchmarks/lab/gluon_bench.py
timeout 190 python3 $B --headdims 128 --seqlens 4096,16384 --schedules grid \
  --variants pingpong,pingpong-ffma,pingpong-lag,pingpong-fa3 > "$OUT/b128.log" 2>&1
timeout 110 python3 $B --headdims 128 --seqlens 4096,16384 --schedules grid --tiles 128x128x3x8 \
  --variants pingpong-ffma,pingpong-fa3 > "$OUT/b128s3.log" 2>&1
timeout 140 python3 $B --headdims 64 --seqlens 4096,16384 --schedules grid \
  --variants single,single-ffma,pingpong,pingpong-fa3 > "$OUT/b64.log" 2>&1
timeout ${TESTS_TIMEOUT:-100} python3 -m pytest tests/kernels/test_gluon_forward.py -q -p no:cacheprovider -W ignore \
  -k "ffma or lag or fa3" -n 8 > "$OUT/gl_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/gl_tests.log"
tail -3 "$OUT/gl_tests.log"; cat "$OUT/b128.log" "$OUT/b128s3.log" "$OUT/b64.log"
