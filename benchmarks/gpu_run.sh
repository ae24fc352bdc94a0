#!/usr/bin/env bash
# Everything the GPU machine runs, in one go: GPU tests, then the benchmark. Logs go under $OUT.
#   bash benchmarks/gpu_run.sh [tests] [quick] [bench] [grid] [memory]   (default: tests bench)
# tests  every kernel test on the GPU (tests/kernels; TESTS_K narrows it), then the slow CPU sweeps   quick  a subset
# verify the attention kernels' tests (dense, replay, direct launch, reliability, grid, Gluon) in three runs, 420 s on an H200, more on an H100
# bench  bf16, d=64/128, causal and not, s=4096: flashtile vs SDPA flash and cuDNN, forward/backward
# grid   the whole speed grid, flashtile bench --full (GRID_ARGS narrows it, e.g. "--dtypes bfloat16 --peers flashtile,sdpa_flash";
#        "--rounds 3" times each point's peers three times in rotated order, medians),
#        after parallel untimed runs have filled the compile caches; spread over all GPUs (GRID_GPUS=1: one)
# tune   every tile candidate of each kernel timed at s=4096, d=64/128 (benchmarks/lab/tune.py; TUNE_ARGS="--points 256:false,256:true")
# profile  kernel time against host time per call, s=512..4096 (benchmarks/lab/profile_call.py; PROFILE_ARGS="--split --finer")
# memory the peak-memory sweep to 1M tokens
# decode one new token vs KV caches (contiguous, paged 16/256) against SDPA enable_gqa
# overhead  wall time per eager call (short-sequence training calls, decoding steps) against SDPA: bench --overhead
# fused-append  the decoding tests with FLASHTILE_FUSED_APPEND=1, then its A/B against two launches (lab/env_ab.py --mode decode)
# descriptor-memo  raw launches reusing filled TMA descriptors against refilling (lab/descriptor_memo.py), the host profile
# plans  the launch-plan GPU tests (replayed calls, CUDA graphs, decoding steps, direct launches), then overhead's run
# first-call  first vs second forward+backward at 16k/262k/1M tokens, flashtile and SDPA, empty caches (benchmarks/first_call.py)
# first-call-compiles  each kernel's compile in a first call at 16k tokens (benchmarks/first_call.py --compiles under
#        FLASHTILE_COMPILE_THREADS=8), then the first call under cProfile, flashtile and SDPA (--profile 1)
# hf     Hugging Face transformers: generate and a training step, flashtile against sdpa (benchmarks/hf_bench.py; HF_ARGS)
# hf-static  the compiled static-cache generation's GPU tests, then its generate with FLASHTILE_HF_STEP_IN_GRAPH=1, paged and 0
#        (HF_IN_GRAPH="1": one of them)
# variants-bench  sliding window vs full causal (32k), block-sparse and varlen vs dense (VARIANT_PARTS=varlen: one part)
# dropout-tiles  tiles with dropout not timed yet: the d = 128 forward's list, d = 64's dK/dV and dQ lists (bwd_at_tiles.py)
# dropout-spread  the 8 x 2,048 dropout backward in six processes, the dQ pass on the side stream or not (bwd_at_tiles.py --one-stream)
# packed  the packed-gradient GPU tests, then bench --overhead with FLASHTILE_PACKED_GRADS=0 and 1
# sanitize  compute-sanitizer memcheck + racecheck over every kernel (benchmarks/lab/sanitize.sh)
# train  the compiled GPT trained 200 steps with flashtile and with SDPA (benchmarks/train_compare.py)
# train-modes  tokens/s of 60 steps in ABBA rounds: s=2048 and s=8192, s=2048 with CUDA graphs; an s=8192 step profiled
# cp     (2+ GPUs) NCCL tests and the context-parallel scaling benchmark
# ncu    Nsight Compute reports (full set) of one GQA decode call and one causal backward (benchmarks/lab/ncu_targets.py;
#        NCU_TARGETS="bwd_d64c2048 bwd_d256n2048" picks others)
# variants  flashtile alone under several kernel settings (VARIANTS='A=1 B=2;A=0')
# fp8    the FP8 kernels' GPU tests, then FP8 against bf16: forward and backward TFLOP/s, FP8-cache decoding (benchmarks/lab/fp8_bench.py;
#        FP8_ARGS replaces its default arguments, --backward)
# q-regs FP8 consumers with Q in registers as well as P (FLASHTILE_FP8_Q_REGISTERS=1: two consumers, three at d = 64)
#        against 0 (gluon_bench.py --fp8, d = 128 and 64, three consumers and two), then the FP8 Gluon tests under 1
# dv-at  where FA3's order issues dV's product and reads delta (FLASHTILE_BWD_DV_AT, FLASHTILE_BWD_DELTA_AHEAD): A/B
# tail-split  the one pass without a causal mask splitting its last, partial wave of key blocks into pieces (the
#        default) against whole blocks (FLASHTILE_BWD_TAIL_SPLIT=0): the FA3 order's GPU tests (and the split's own)
#        under the split, then the two backwards in alternating processes with cuDNN's (benchmarks/lab/env_ab.py)
# exp2-poly  the FP8 forward with 1 or 2 of each 8 exponentials by a polynomial (FLASHTILE_FP8_EXP2_POLY) against
#        none: alternating processes, the FP8 tests under each, then the bf16 cells against cuDNN (POLY_CELLS=0: not)
# rescale-skip  the sm90 forward skipping O's rescale where a warp's rows kept their max (FLASHTILE_FWD_RESCALE_SKIP=0,
#        exact, 1) and with lane partial row sums (FLASHTILE_FWD_LANE_SUM=1), FP8 also with P stored as words of 4 keys
#        (FLASHTILE_FP8_P_WORDS=1), 16-bit with P rounded by pairs (FLASHTILE_FWD_P_PAIRS=1): forwards in alternating
#        processes with cuDNN's, digests compared, then GPU tests with all on
# p-regs the FP8 forward's P V taking P from registers (K loaded with its keys permuted): gluon_bench.py --fp8 with
#        three consumers and two under FLASHTILE_FP8_P_REGISTERS=wait, its GPU tests, then the same under 0 and carry
# fp8-accept  issue 27's table first (fp8_bench.py --headdims 128 --seqlens 4096,8192,16384 --backward: the FP8 forward,
#        backward and FP8-cache decoding against bf16 in one process), then the FP8 kernels' GPU tests (about 140 s on
#        a fresh H100, the tests' compile included)
# dropout  the dropout GPU tests, then one call with dropout and a compiled GPT with attention dropout against SDPA
#        (benchmarks/lab/compile_dropout.py) for each tree in DROPOUT_TREES (default: this one) and setting in
#        DROPOUT_SETTINGS (default: the backward's Triton two passes, then the Gluon one pass; DROPOUT_TRAIN=0: no GPT)
# d64-three  the d = 64 three-consumer forward (the dispatch's from 4,096 tokens, dense calls) where not measured
#        yet: its GPU tests (the packed kernel with three consumers too), then dispatch_choice.py dense at 1,024-4,096
#        tokens and packed at means of 1,024-8,192, two rounds (its limits add up to 520 s)
# peers  issue 26's 24 cells (bf16, d = 64 and 128, 4k-16k tokens, causal and not, forward and backward) with cuDNN,
#        SDPA flash, Flex and FA4 in one run (FA4: carry .fa4, made here by benchmarks/lab/fa4_carry.sh prepare)
# accept the open issues' acceptance tables in one call: bench --overhead (25), the 24 cells against cuDNN with default
#        tiles (26), fp8_bench.py's d = 128 table (27); no tests (run on an H200, the issues' GPU)
# fwd-2048  the d = 128 forward at 2,048 tokens, batch 4 (bench --overhead's rows): the dispatch's tile against cuDNN,
#        q, k, v separate and as views of one projection, two rounds (dispatch_choice.py --tokens 8192 [--views]), then
#        Nsight Compute on flashtile's and cuDNN's forward there (ncu_targets.py fwd_d128n2048b4_cudnn)
# dispatch  which forward kernel where: dispatch_choice.py, dense (DISPATCH_ARGS replaces its arguments) and packed;
#        the backward's: DISPATCH_ARGS="--backward --headdims 128 --causal true --seqlens 2048,4096 --rounds 2"
# gluon  the Gluon sm90 forward: its GPU tests, then its variants' TFLOP/s against flashtile and SDPA (benchmarks/lab/gluon_bench.py)
# gluon-proto  the Gluon varlen forward and the prototypes outside the dispatch (FP8 forward, backward): their GPU tests, then FP8 and backward TFLOP/s
# keys-m the keys-as-M one pass ("fa3": FA3's order, the dispatch's at d = 64 and 128; "fa3-early-dv" and True, the plain order: lab
#        variants): a smoke test, its GPU tests, TFLOP/s against the pipelined loop
# mask-edges  the keys-as-M pass masking only its edge pairs (the default) against masking every pair
#        (FLASHTILE_BWD_MASK_EDGES_ONLY=0): the FA3 order's GPU tests under each, then the two backwards in alternating
#        processes, gradients' digests compared (benchmarks/lab/env_ab.py; odd lengths included, where edge pairs are masked)
# dq-wait  FA3's order freeing its dQ buffer at dSᵀ's barrier (the default) against a barrier of its own
#        (FLASHTILE_BWD_DQ_WAIT_AT_DS=0): the FA3 order's GPU tests under the latter, then the two backwards in
#        alternating processes, gradients' digests compared (benchmarks/lab/env_ab.py)
# named-release  FA3's order at d = 128 handing its ring stages back by named barriers (the default) against an mbarrier
#        (FLASHTILE_BWD_NAMED_RELEASE=0): the FA3 order's GPU tests under the latter, then the two backwards in
#        alternating processes, gradients' digests compared (benchmarks/lab/env_ab.py)
# dq-send-late  FA3's order at d = 128 sending each dQ share after the next step's dSᵀ barrier (the default) against
#        a barrier of its own (FLASHTILE_BWD_DQ_SEND_LATE=0): the FA3 order's GPU tests under the latter, then the two
#        backwards in alternating processes, gradients' digests compared (benchmarks/lab/env_ab.py)
# fp8-wall  FP8 forwards' launch plans and quantize kernels: their GPU tests (and the FP8 suites), quantize's
#        kernels against its PyTorch ops (fp8_bench.py --quantize), then `flashtile bench --overhead --fp8`
# tree   the forward's row max in a tree everywhere (FLASHTILE_FWD_TREE_MAX=1): the Gluon forward's GPU tests under it,
#        then FP8 and bf16 A/B against the chain (lab/env_ab.py)
# fwd-named  the ping-pong forward (FA3's order) taking turns and releasing stages by named barriers (the default)
#        against mbarriers (FLASHTILE_FWD_NAMED_SYNC=0): the Gluon forward's GPU tests, then the two forwards in
#        alternating processes with cuDNN's, outputs' digests compared (env_ab.py --mode fwd), then compute-sanitizer
#        on the sm90 kernels (sanitize.sh's one_pass part, variant 5: the forward's dense, varlen and FP8 calls too)
# three  the forward with three consumer warpgroups (pingpong3-fa3, 192-row tiles): the Gluon FP8 forward's GPU tests
#        (all variants), then gluon_bench.py --fp8 at d = 128 with two and three consumers beside the Triton FP8
#        forward and the bf16 forward, then the bf16 forward at d = 64 with one, two and three consumers
# sampled-bound  the one pass's fixed-point units from sampled K and V maxima, checked in the kernel: its GPU tests, then A/B
#        against the units from every key (FLASHTILE_BWD_SAMPLED_BOUND; lab/env_ab.py, cuDNN beside) and the backward
#        kernel by kernel (lab/bwd_passes.py)
# sampled-verify  the sampled bound's GPU tests, the fallback's cost (every check failing) kernel by kernel, and the 24
#        cells against cuDNN in five rounds (about 4 minutes)
# flagged  the flagged dQ pass per KV head: the sampled bound's GPU tests, then its cost kernel by kernel with every
#        head flagged and with one, at each tile of FLAGGED_TILES_ARGS (lab/bwd_passes.py --flagged-tiles)
# one-pass-check  the default one pass in FA3's order as it stands: compute-sanitizer (memcheck, racecheck) on its
#        variants 5 and 7 (SANITIZE_VARIANTS), its GPU tests (FA3 order, dispatch, d = 64), then the long-length tests (65,536 and 131,072
#        tokens, float64 oracle) with 4 workers; logs under $OUT (about 250 s)
# one-pass  the one-pass Gluon backward (the pipelined warp-specialized loop, fixed point and float32): its GPU tests,
#        then its TFLOP/s against flashtile's, cuDNN's and the Gluon two passes (benchmarks/lab/one_pass_bench.py; ONE_PASS_ARGS)
# WARM_ONLY=1 fills the compile caches of the named phases and stops; WARM=0 measures without filling
# FLASHTILE_COMMIT=<hash> names the commit in the logs' headers: a copied tree's git metadata may name an older one
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
phases=${*:-tests bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
status=0
# Charts only where matplotlib is installed (flashtile bench --plot stops at once without it).
has_matplotlib=$(python3 -c "import matplotlib" 2>/dev/null && echo 1)
ngpus=${TEST_GPUS:-$(nvidia-smi --list-gpus | wc -l)}  # GPUs the tests phase spreads its workers over
# Before measuring, untimed runs of the measuring phases fill the compile caches in parallel
# (FLASHTILE_AUTOTUNE=compile compiles every tile candidate without choosing; FLASHTILE_BENCH_WARM=1
# runs each measured call once): the measuring runs then spend their time on the GPU, not in compilers.
# First-call times reported by the measuring runs are therefore warm-cache times; tune also times one
# cold first call (empty cache) at the default grid point. WARM=0 skips this.
# The peers phase's points (issue 26's 24 cells)
PEERS_ARGS=${PEERS_ARGS:---dtypes bfloat16 --headdims 64,128 --causal false,true --seqlens 4096,8192,16384 --modes fwd,bwd}
warm() { FLASHTILE_AUTOTUNE=compile FLASHTILE_BENCH_WARM=1 timeout ${WARM_TIMEOUT:-300} "$@"; }
# sanitize_summary: each sanitizer log's summary lines and its hazard reports counted by kind, into
# $OUT/sanitize_summary.txt (the whole logs can be too large to come back)
sanitize_summary() {
  for log in "$OUT"/sanitize_*.log; do
    [ -f "$log" ] || continue
    echo "== $log"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitized run done" "$log"
    grep -oE "(Race reported|Error|Warning|Hazard)[^(]*" "$log" | sort | uniq -c | sort -rn | head -20
  done | tee "$OUT/sanitize_summary.txt"
}
# overhead_rows NAME LIMIT: bench --overhead's wall time per eager call into $OUT/NAME.{log,json} (phases overhead, plans, accept)
overhead_rows() {
  timeout ${PHASE_TIMEOUT:-$2} python3 -m flashtile bench --overhead --json "$OUT/$1.json" 2>&1 | tee "$OUT/$1.log" \
    || status=1
}
# fp8_table NAME LIMIT: issue 27's table (FP8 forward, backward and FP8-cache decoding against bf16, d = 128, one
# process) into $OUT/NAME.log (phases fp8-accept, accept)
fp8_table() {
  FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-$2} python3 benchmarks/lab/fp8_bench.py --headdims 128 \
    --seqlens 4096,8192,16384 --backward 2>&1 | tee "$OUT/$1.log" || status=1
}
# switch_ab NAME VAR "VALUES" "A=VAR=x;B=VAR=y" POINTS [MODE TESTS K]: a kernel switch read at import, A/B'd. GPU tests
# under each of VALUES first (by default the FA3 order's backward tests, the long-length cases left out: beside 13
# other workers one ran out of memory; else the file TESTS, narrowed by K where K is not empty), then, if they pass,
# benchmarks/lab/env_ab.py's alternating processes (MODE bwd or fwd, default bwd) with the outputs' digests compared
# (POINTS may be overridden by the POINTS variable; TESTS_TIMEOUT=150 keeps a two-value phase within one 600 s call).
# The FA3 order's backward tests, the long-length cases left out (switch_ab's default, one-pass-check's)
FA3_TESTS_K="(fa3 or dispatch or where_it_is_faster or d64) and not long_lengths"
switch_ab() {
  local name=$1 var=$2 values=$3 variants=$4 points=$5 mode=${6:-bwd}
  local tests=${7:-tests/kernels/test_gluon_backward.py}
  local k=${8-$FA3_TESTS_K}
  rm -f "$OUT/${name}_tests_"*.log
  if (for value in $values; do env "$var=$value" FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest \
        "$tests" -q -p no:cacheprovider -W ignore -rfE -n 14 ${k:+-k "$k"} > "$OUT/${name}_tests_$value.log" 2>&1 \
        || exit 1; done); then
    tail -n 1 "$OUT/${name}_tests_"*.log
    timeout ${PHASE_TIMEOUT:-300} python3 benchmarks/lab/env_ab.py --mode "$mode" --cudnn --rounds ${ROUNDS:-2} \
      --variants "$variants" --points "${POINTS:-$points}" 2>&1 | tee "$OUT/${name}_ab.log" || status=1
  else
    status=1; tail -n 30 "$OUT/${name}_tests_"*.log
  fi
}
# FA4 for the peers phase, from the archive the call carries (.fa4; benchmarks/lab/fa4_carry.sh), before the warm-up
case " $phases " in *" peers "*)
  if [ -f .fa4/site.tar.xz ]; then
    bash benchmarks/lab/fa4_carry.sh unpack && export PYTHONPATH=$(bash benchmarks/lab/fa4_carry.sh path)
    # FA4's compiled kernels on disk, so that the measuring process loads what the warm-up compiled
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    python3 -c "import flash_attn.cute" 2>&1 | tail -n 2 | tee "$OUT/fa4_import.txt"
  else
    echo "no .fa4/site.tar.xz: FA4 is left out (carry .fa4)" | tee "$OUT/fa4_import.txt"
  fi ;;
esac
if [ "${WARM:-1}" = 1 ]; then
  rm -f /tmp/warm_*.log
  case "${COLD:-1} $phases " in "1 "*" tune "*)  # COLD=0 skips it
    # The first call at the default grid point (d=128, s=4096, causal) with an empty compile cache, alone
    # on the machine: what a user pays once per shape bucket.
    cold=$(mktemp -d)
    TRITON_CACHE_DIR=$cold timeout 300 python3 -m flashtile bench --dtypes bfloat16 --headdims 128 --causal true \
      --seqlens 4096 --modes fwd,bwd --peers flashtile > "$OUT/cold_first_call.log" 2>&1
    rm -rf "$cold" ;;
  esac
  # Grid warm-up processes: one per two cores, 4 to 32 (8 on the 16-core machine, 32 on the 64-core one).
  shards=${WARM_SHARDS:-$(( $(nproc) / 2 < 4 ? 4 : ($(nproc) / 2 > 32 ? 32 : $(nproc) / 2) ))}
  warm_start=$(date +%s)
  for phase in $phases; do
    case $phase in
      grid) for i in $(seq 0 $((shards - 1))); do
              warm python3 -m flashtile bench --full ${GRID_ARGS:-} --peers flashtile,flex --shard $i/$shards \
                > /tmp/warm_grid$i.log 2>&1 &
            done ;;
      tune) for i in 0 1 2 3 4 5; do warm python3 benchmarks/lab/tune.py ${TUNE_ARGS:-} --slice $i/6 > /tmp/warm_tune$i.log 2>&1 & done ;;
      decode) warm python3 -m flashtile bench --decode ${DECODE_SPLITS:+--decode-splits $DECODE_SPLITS} > /tmp/warm_decode.log 2>&1 & ;;
      variants) IFS=';' read -ra settings <<< "${VARIANTS:-FLASHTILE_TMA=0;FLASHTILE_TMA=auto;FLASHTILE_AUTOTUNE=1}"
                for setting in "${settings[@]}"; do
                  env $setting FLASHTILE_AUTOTUNE=compile FLASHTILE_BENCH_WARM=1 timeout ${WARM_TIMEOUT:-300} \
                    python3 -m flashtile bench --dtypes bfloat16 --headdims ${HEADDIMS:-64,128} --causal false,true \
                    --seqlens ${SEQLENS:-4096} --modes fwd,bwd --peers flashtile > "/tmp/warm_variants_${setting//[^A-Za-z0-9]/_}.log" 2>&1 &
                done ;;
      variants-bench) warm python3 -m flashtile bench --variants ${VARIANT_PARTS:+--variant-parts $VARIANT_PARTS} > /tmp/warm_variants.log 2>&1 & ;;
      peers) for i in $(seq 0 $((shards - 1))); do
               warm python3 -m flashtile bench $PEERS_ARGS --peers ${WARM_PEERS:-flashtile,flex,fa4} --shard $i/$shards \
                 > /tmp/warm_peers$i.log 2>&1 &
             done ;;
    esac
  done
  wait
  echo "compile caches warmed in $(( $(date +%s) - warm_start )) s" | tee "$OUT/phases.txt"
  if grep -h -i -E "error|Traceback" /tmp/warm_*.log 2>/dev/null | head -5 | grep -q .; then
    grep -h -i -E "error|Traceback" /tmp/warm_*.log | head -5; status=1
  fi
fi
# WARM_ONLY=1: stop after filling the caches. The caches live on the machine (~/.triton, inductor's
# cache), so a next call made while the machine is still held measures with them: the full grid's
# warm-up and measuring do not fit one 10-minute call together.
if [ "${WARM_ONLY:-0}" = 1 ]; then exit $status; fi
# A per-test limit where pytest-timeout is installed (it is on the GPU image), none elsewhere.
per_test_timeout=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout ${TEST_TIMEOUT:-240}")
# Each measuring phase forgets stored autotuning choices first, so it tunes anew.
source "$(dirname "$0")/lab/tuning_choices.sh"
for phase in $phases; do
  start=$(date +%s)
  case $phase in tests|quick|verify|sanitize) ;; *) forget_choices ;; esac
  case $phase in
    # The CPU-only suites (reference path, interface, harness) run in CI; here only tests/kernels.
    # Full logs go to $OUT as they are written, so a run stopped at the time limit still says where it was.
    # On a host of several GPUs the workers are spread over all of them (tests/conftest.py).
    tests) FLASHTILE_TEST_GPUS=$ngpus timeout ${TESTS_TIMEOUT:-480} python3 -m pytest tests/kernels -n ${PYTEST_WORKERS:-$((ngpus > 1 ? 8 * ngpus : 12))} -q -p no:cacheprovider \
             -W ignore ${TESTS_K:+-k "$TESTS_K"} $per_test_timeout -rfE --durations=15 \
             > "$OUT/tests.log" 2>&1 || status=1; tail -40 "$OUT/tests.log"
           # The slow cases of the sweeps outside tests/kernels (the PyTorch path's; CI runs the cases that
           # cover each axis, a GPU machine's cores the rest: tests/conftest.py).
           if [ -z "${TESTS_K:-}" ]; then
             timeout 300 python3 -m pytest tests -m slow --ignore=tests/kernels -n ${PYTEST_WORKERS:-12} -q \
               -p no:cacheprovider -W ignore -rfE >> "$OUT/tests.log" 2>&1 || status=1; tail -2 "$OUT/tests.log"
           fi
           # Tests that need several GPUs visible at once (the spread above shows each worker one).
           if [ "$(nvidia-smi --list-gpus | wc -l)" -ge 2 ] && [ -z "${TESTS_K:-}" ]; then
             timeout 300 python3 -m pytest tests/kernels/test_gpu_reliability.py -k another_device -q -p no:cacheprovider \
               -W ignore -rfE >> "$OUT/tests.log" 2>&1 || status=1; tail -2 "$OUT/tests.log"
           fi ;;
    verify)  # the attention kernels' GPU tests in three runs that fit one 600 s call (about 420 s on a fresh H200; on an H100
             # a call stopped at 480 s, 83% into its third run: call it with the 600 s limit)
      for files in "test_attention_kernels test_replay test_direct_launch test_gpu_reliability" test_gpu \
                   "test_gluon_backward test_gluon_forward"; do
        FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest $(printf 'tests/kernels/%s.py ' $files) \
          -n ${PYTEST_WORKERS:-14} -q -p no:cacheprovider -W ignore -rfE -k "not long_lengths" \
          > "$OUT/verify_${files%% *}.log" 2>&1 || status=1
        echo "$files: $(tail -1 "$OUT/verify_${files%% *}.log")"
      done ;;
    quick) timeout ${TESTS_TIMEOUT:-480} python3 -m pytest tests/kernels -n ${PYTEST_WORKERS:-12} -q -p no:cacheprovider \
             -W ignore -k "${QUICK_K:-d64 or d128 or d59 or gqa or determin}" -x > "$OUT/quick.log" 2>&1 || status=1; tail -30 "$OUT/quick.log" ;;
    dispatch)  # the forward's dispatch candidates through flash_attn_func / flash_attn_varlen_func, kernel time
      timeout ${PHASE_TIMEOUT:-330} python3 benchmarks/lab/dispatch_choice.py ${DISPATCH_ARGS:---headdims 64,128 --causal true \
        --choices triton,single-ffma@128x128x2x8,single-ffma@128x64x2x8,single-ffma@64x64x3x4,pingpong-fa3@128x128x2x8} \
        2>&1 | tee "$OUT/dispatch.log" || status=1
      timeout ${PHASE_TIMEOUT:-330} python3 benchmarks/lab/dispatch_choice.py --varlen --headdims 64,128 --causal false,true \
        --seqlens 512,1024,2048,4096 --choices triton,single-ffma@128x128x2x8,single-ffma@128x64x2x8,pingpong-fa3@128x128x2x8 \
        2>&1 | tee "$OUT/dispatch_varlen.log" || status=1 ;;
    gluon)  # a smoke test first (a hang costs 2 minutes, not 10), then the whole file, the benchmark only if they pass
      if timeout 120 python3 -m pytest tests/kernels/test_gluon_forward.py -x -q -p no:cacheprovider -W ignore -rfE \
           -k "d128 and sq1-sk1 or fp16_gqa" > "$OUT/gluon_smoke.log" 2>&1 \
         && timeout ${TESTS_TIMEOUT:-400} python3 -m pytest tests/kernels/test_gluon_forward.py -x -q -p no:cacheprovider \
           -W ignore -rfE > "$OUT/gluon_tests.log" 2>&1; then
        timeout ${PHASE_TIMEOUT:-300} python3 benchmarks/lab/gluon_bench.py 2>&1 | tee "$OUT/gluon_bench.log" || status=1
      else
        status=1; tail -30 "$OUT/gluon_smoke.log" "$OUT/gluon_tests.log" 2>/dev/null
      fi ;;
    gluon-proto)  # the Gluon varlen forward and the prototypes outside the dispatch (FP8 forward, backward): GPU tests, then TFLOP/s
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-150} python3 -m pytest tests/kernels/test_gluon_forward.py -q -p no:cacheprovider -W ignore -rfE \
        -n 8 -k "varlen or fp8" > "$OUT/gluon_proto_fwd_tests.log" 2>&1 || status=1
      tail -3 "$OUT/gluon_proto_fwd_tests.log"
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-150} python3 -m pytest tests/kernels/test_gluon_backward.py -q -p no:cacheprovider -W ignore -rfE \
        -n 8 > "$OUT/gluon_proto_bwd_tests.log" 2>&1 || status=1
      tail -3 "$OUT/gluon_proto_bwd_tests.log"
      timeout ${PHASE_TIMEOUT:-150} python3 benchmarks/lab/gluon_bench.py --fp8 --headdims 128 --seqlens ${SEQLENS:-4096,16384} \
        2>&1 | tee "$OUT/gluon_fp8_bench.log" || status=1
      timeout ${PHASE_TIMEOUT:-150} python3 benchmarks/lab/gluon_bench.py --backward --seqlens ${SEQLENS:-4096,16384} 2>&1 \
        | tee "$OUT/gluon_bwd_bench.log" || status=1 ;;
    one-pass)  # the one-pass Gluon backward: GPU tests, then TFLOP/s of every mode
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels/test_gluon_backward.py -q -p no:cacheprovider -W ignore -rfE \
        -n 8 -k "one_pass or fixed or schedule" > "$OUT/one_pass_tests.log" 2>&1 || status=1
      tail -3 "$OUT/one_pass_tests.log"
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-300} python3 benchmarks/lab/one_pass_bench.py \
        ${ONE_PASS_ARGS:---modes fixed-ws-pipe,atomic-ws-pipe} 2>&1 | tee "$OUT/one_pass_bench.log" || status=1 ;;
    keys-m)  # the keys-as-M one pass (FA3's order: the dispatch's at d = 64 and 128; its early-dV variant and the plain order:
      # lab variants): a smoke test first (a hang costs 150 s, not 10 minutes), then its GPU tests, then TFLOP/s
      # against the pipelined loop (d = 128 at four lengths; d = 64 at two, FA3's order at 64 and 128 query rows)
      if FLASHTILE_AUTOTUNE=0 timeout 150 python3 -m pytest tests/kernels/test_gluon_backward.py -x -q -p no:cacheprovider \
           -W ignore -rfE -k "keys and fa3 and d128 and sq1023" > "$OUT/keys_m_smoke.log" 2>&1; then
        FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels/test_gluon_backward.py -q -p no:cacheprovider \
          -W ignore -rfE -n 14 -k "keys" > "$OUT/keys_m_tests.log" 2>&1 || status=1
        tail -3 "$OUT/keys_m_tests.log"
        timeout ${PHASE_TIMEOUT:-240} python3 benchmarks/lab/one_pass_bench.py --headdims 128 --seqlens 2048,4096,8192,16384 \
          --modes fixed-ws-pipe,fixed-ws-km3,fixed-ws-km3dv --tiles 128:64x128x2x8 2>&1 | tee "$OUT/keys_m_bench.log" || status=1
        timeout ${PHASE_TIMEOUT:-240} python3 benchmarks/lab/one_pass_bench.py --headdims 64 --seqlens 4096,16384 \
          --modes fixed-ws-km3 --tiles 64:64x128x2x8,64:128x128x2x8 2>&1 | tee -a "$OUT/keys_m_bench.log" || status=1
      else
        status=1; tail -30 "$OUT/keys_m_smoke.log"
      fi ;;
    mask-edges) switch_ab mask_edges FLASHTILE_BWD_MASK_EDGES_ONLY "1 0" \
                  "every=FLASHTILE_BWD_MASK_EDGES_ONLY=0;edges=FLASHTILE_BWD_MASK_EDGES_ONLY=1" \
                  128:4096:0,128:4096:1,128:8192:1,128:16384:1,128:4000:1,64:4096:0,64:4096:1,64:16384:1,64:4000:1 ;;
    dq-wait) switch_ab dq_wait FLASHTILE_BWD_DQ_WAIT_AT_DS 0 \
               "own-barrier=FLASHTILE_BWD_DQ_WAIT_AT_DS=0 FLASHTILE_BWD_DQ_SEND_LATE=0;wait-at-ds=FLASHTILE_BWD_DQ_WAIT_AT_DS=1 FLASHTILE_BWD_DQ_SEND_LATE=0" \
               128:2048:0,128:4096:0,128:16384:0,128:4096:1,128:16384:1,64:4096:0,64:4096:1,64:4000:1 ;;
    named-release) switch_ab named_release FLASHTILE_BWD_NAMED_RELEASE 0 \
               "mbarrier=FLASHTILE_BWD_NAMED_RELEASE=0 FLASHTILE_BWD_DQ_SEND_LATE=0;named=FLASHTILE_BWD_NAMED_RELEASE=1 FLASHTILE_BWD_DQ_SEND_LATE=0" \
               128:2048:0,128:4096:0,128:16384:0,128:4096:1,128:16384:1,128:4000:1 ;;
    dq-send-late) switch_ab dq_send_late FLASHTILE_BWD_DQ_SEND_LATE 0 \
               "own-barrier=FLASHTILE_BWD_DQ_SEND_LATE=0;late=FLASHTILE_BWD_DQ_SEND_LATE=1" \
               128:2048:0,128:4096:0,128:16384:0,128:4096:1,128:16384:1,128:4000:1 ;;
    fwd-named)
      switch_ab fwd_named FLASHTILE_FWD_NAMED_SYNC 1 \
        "mbarrier=FLASHTILE_FWD_NAMED_SYNC=0;named=FLASHTILE_FWD_NAMED_SYNC=1" \
        128:4096:0,128:8192:0,128:16384:0,128:4096:1,128:16384:1,256:8192:0 fwd tests/kernels/test_gluon_forward.py ""
      (SANITIZE_PART=one_pass SANITIZE_VARIANTS=5 OUT="$OUT" timeout 200 bash benchmarks/lab/sanitize.sh) || status=1
      sanitize_summary ;;
    three)
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-150} python3 -m pytest tests/kernels/test_gluon_forward.py -q \
        -p no:cacheprovider -W ignore -rfE -n 8 -k fp8 > "$OUT/three_fp8_tests.log" 2>&1 || status=1
      tail -n 1 "$OUT/three_fp8_tests.log"
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-200} python3 benchmarks/lab/gluon_bench.py --fp8 --headdims 128 \
        --seqlens ${SEQLENS:-4096,8192,16384} \
        --fp8-configs pingpong-fa3:128x128x2x8,pingpong3-fa3:192x128x2x12,pingpong3-fa3:192x128x3x12 2>&1 \
        | tee "$OUT/three_fp8_bench.log" || status=1
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-200} python3 benchmarks/lab/gluon_bench.py --headdims 64 \
        --seqlens 4096,16384 --tiles 128x128x2x8,192x128x2x12 --variants single-ffma,pingpong-fa3,pingpong3-fa3 2>&1 \
        | tee "$OUT/three_d64_bench.log" || status=1 ;;
    fp8-wall)  # FP8 calls' launch plans and the quantize kernels: their GPU tests with the FP8 suites (one run, within
               # 240 s), the kernels against the PyTorch ops, then the FP8 inference forward's wall time per call
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-240} python3 -m pytest tests/kernels/test_replay.py \
        tests/kernels/test_fp8_quantize.py tests/kernels/test_fp8_kernels.py tests/test_fp8.py \
        tests/kernels/test_gluon_forward.py -q -p no:cacheprovider \
        -W ignore -rfE -n 14 -k "fp8 or quantize or FP8 or Fp8" > "$OUT/fp8_wall_tests.log" 2>&1 || status=1
      tail -n 1 "$OUT/fp8_wall_tests.log"
      timeout ${QUANTIZE_TIMEOUT:-90} python3 benchmarks/lab/fp8_bench.py --quantize --headdims 64,128,256 \
        --seqlens 2048,16384 2>&1 | tee "$OUT/fp8_quantize.log" || status=1
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-240} python3 -m flashtile bench --overhead --fp8 \
        --json "$OUT/fp8_wall.json" 2>&1 | tee "$OUT/fp8_wall.log" || status=1 ;;
    tree)  # the forward's row max in a tree (FLASHTILE_FWD_TREE_MAX): the Gluon forward's GPU tests under it, then its
           # A/B against Triton's chained reduction, FP8 and bf16 forwards in alternating processes (lab/env_ab.py)
      FLASHTILE_FWD_TREE_MAX=1 FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest \
        tests/kernels/test_gluon_forward.py -q -p no:cacheprovider -W ignore -rfE -n 8 > "$OUT/tree_tests.log" 2>&1 || status=1
      tail -n 1 "$OUT/tree_tests.log"
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-200} python3 benchmarks/lab/env_ab.py --mode fwd8 --cudnn \
        --rounds ${ROUNDS:-2} --points ${FP8_POINTS:-128:4096:0,128:16384:0,128:4096:1,128:16384:1,64:8192:0,256:8192:1} \
        --variants "chain=FLASHTILE_FWD_TREE_MAX=0;tree=FLASHTILE_FWD_TREE_MAX=1" 2>&1 | tee "$OUT/tree_fp8.log" || status=1
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-200} python3 benchmarks/lab/env_ab.py --mode fwd --cudnn \
        --rounds ${ROUNDS:-2} --points ${BF16_POINTS:-128:2048:0,128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:16384:1} \
        --variants "chain=FLASHTILE_FWD_TREE_MAX=0;tree=FLASHTILE_FWD_TREE_MAX=1" 2>&1 | tee "$OUT/tree_bf16.log" || status=1 ;;
    sampled-bound)  # the fixed-point units from sampled K and V maxima, checked by the one pass (FLASHTILE_BWD_SAMPLED_BOUND):
      # a smoke test (the check failing: dQ recomputed), the GPU tests, then A/B against the units from every key
      # (env_ab, with cuDNN) and the backward kernel by kernel
      if FLASHTILE_AUTOTUNE=0 timeout 150 python3 -m pytest tests/kernels/test_gluon_backward.py -x -q -p no:cacheprovider \
           -W ignore -rfE -k "sampled_bounds and d128 and full and unsampled" > "$OUT/sampled_smoke.log" 2>&1; then
        FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-240} python3 -m pytest tests/kernels/test_gluon_backward.py \
          tests/kernels/test_fixed_point.py -q -p no:cacheprovider -W ignore -rfE -n 14 \
          -k "(($FA3_TESTS_K) or sampled or flagged or reproducible or fixed_point) and not long_lengths" \
          > "$OUT/sampled_tests.log" 2>&1 || status=1
        tail -n 3 "$OUT/sampled_tests.log"
        timeout ${PHASE_TIMEOUT:-200} python3 benchmarks/lab/env_ab.py --mode bwd --cudnn --rounds ${ROUNDS:-2} \
          --variants "every-key=FLASHTILE_BWD_SAMPLED_BOUND=0;sampled=FLASHTILE_BWD_SAMPLED_BOUND=1" \
          --points "${POINTS:-128:4096:0,128:4096:1,128:8192:0,128:8192:1,128:16384:0,64:4096:0,64:4096:1,64:16384:1}" \
          2>&1 | tee "$OUT/sampled_ab.log" || status=1
        PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/lab timeout 120 python3 benchmarks/lab/bwd_passes.py --impls flashtile,cudnn --headdims 128 --seqlens 4096 2>&1 \
          | tee "$OUT/sampled_passes.log" || status=1
      else
        status=1; tail -n 40 "$OUT/sampled_smoke.log"
      fi ;;
    sampled-verify)  # the sampled bound's tests as they stand (not the long-length ones), the fallback's cost (bwd_passes.py
      # flashtile-recomputed: every check failing) and issue 26's cells against cuDNN in five rounds
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels/test_gluon_backward.py \
        tests/kernels/test_fixed_point.py -q -p no:cacheprovider -W ignore -rfE -n 10 \
        -k "sampled_bounds or flagged or recomputed or exact_bound or reproducible or sampled_setup or dropout_in_the_one_pass" \
        > "$OUT/sampled_verify_tests.log" 2>&1 || status=1
      tail -n 3 "$OUT/sampled_verify_tests.log"
      PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/lab FLASHTILE_AUTOTUNE=0 timeout 150 python3 benchmarks/lab/bwd_passes.py \
        --impls flashtile,flashtile-recomputed,cudnn --headdims 128,64 --causal false,true --seqlens 4096 2>&1 \
        | grep -v -i warn | tee "$OUT/sampled_verify_passes.log" || status=1
      FLASHTILE_AUTOTUNE=0 FLASHTILE_BENCH_MS=${CELLS_BENCH_MS:-10,50} timeout ${PHASE_TIMEOUT:-200} python3 -m flashtile \
        bench --dtypes bfloat16 --headdims 64,128 --causal false,true --seqlens 4096,8192,16384 --modes fwd,bwd \
        --peers flashtile,sdpa_cudnn --rounds ${CELLS_ROUNDS:-5} --json "$OUT/sampled_verify_cells.json" 2>&1 \
        | tail -n 17 | tee "$OUT/sampled_verify_cells.log" || status=1 ;;
    flagged)
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels/test_gluon_backward.py \
        tests/kernels/test_fixed_point.py -q -p no:cacheprovider -W ignore -rfE -n 10 \
        -k "sampled_bounds or flagged or recomputed or exact_bound or reproducible or sampled_setup or dropout_in_the_one_pass" \
        > "$OUT/flagged_tests.log" 2>&1 || status=1
      tail -n 3 "$OUT/flagged_tests.log"
      PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/lab FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-300} python3 \
        benchmarks/lab/bwd_passes.py --impls flashtile,flashtile-recomputed,flashtile-one-head,cudnn --headdims 128,64 \
        --causal ${FLAGGED_CAUSAL:-false,true} --seqlens 4096 \
        --flagged-tiles "${FLAGGED_TILES_ARGS:-64,64,4,3;128,64,8,3;128,64,8,2;64,64,4,2}" 2>&1 \
        | grep -v -i warn | tee "$OUT/flagged_passes.log" || status=1 ;;
    one-pass-check)
      (SANITIZE_PART=one_pass SANITIZE_VARIANTS=${SANITIZE_VARIANTS:-5,7} OUT="$OUT" timeout 200 bash benchmarks/lab/sanitize.sh) || status=1
      sanitize_summary
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels/test_gluon_backward.py -q \
        -p no:cacheprovider -W ignore -rfE -n 14 -k "$FA3_TESTS_K" \
        > "$OUT/one_pass_check_tests.log" 2>&1 || status=1
      tail -n 1 "$OUT/one_pass_check_tests.log"
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels/test_gluon_backward.py -q \
        -p no:cacheprovider -W ignore -rfE -n 4 -k long_lengths > "$OUT/one_pass_check_long.log" 2>&1 || status=1
      tail -n 1 "$OUT/one_pass_check_long.log" ;;
    bench) timeout ${PHASE_TIMEOUT:-300} python3 -m flashtile bench --dtypes bfloat16 --headdims 64,128 --causal false,true --seqlens 4096 \
             --modes fwd,bwd --peers flashtile,sdpa_flash,sdpa_cudnn --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1 ;;
    # Spread over the host's GPUs (one process each, every point's peers on one GPU): the whole default
    # grid took more than 540 s on one H200; rows are written as they come (grid.json.gpu<i>).
    grid) FLASHTILE_BENCH_MS=${GRID_BENCH_MS:-10,50} timeout ${PHASE_TIMEOUT:-540} python3 -m flashtile bench --full ${GRID_ARGS:-} --gpus ${GRID_GPUS:-$ngpus} --json "$OUT/grid.json" ${has_matplotlib:+--plot "$OUT/grid"} 2>&1 | tee "$OUT/grid.log" || status=1
          # RESULTS.md's table of the run, and which of its target cells hold.
          python3 benchmarks/grid_table.py "$OUT/grid.json" > "$OUT/grid_table.md" 2>&1 && tail -3 "$OUT/grid_table.md" ;;
    profile) timeout ${PHASE_TIMEOUT:-300} python3 benchmarks/lab/profile_call.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" || status=1 ;;
    tune) timeout ${PHASE_TIMEOUT:-300} python3 benchmarks/lab/tune.py ${TUNE_ARGS:-} --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" || status=1 ;;
    train) timeout ${PHASE_TIMEOUT:-600} python3 benchmarks/train_compare.py --noise-run --sdpa-backends "${SDPA_BACKENDS-flash,cudnn}" --json "$OUT/train.json" 2>&1 | tee "$OUT/train.log" || status=1 ;;
    train-modes)  # compiled training: s=2048 and s=8192 in ABBA rounds, s=2048 with CUDA graphs; then where an
                  # s=8192 step's time goes (kernels, GPU timeline, the attention ops' host time; Chrome traces)
      for run in "--seqlen 2048 --rounds 3" "--seqlen 8192 --batch 2 --rounds 3" "--seqlen 2048 --compile-mode reduce-overhead" \
                 "--seqlen 8192 --batch 2 --steps 40 --profile --trace-dir $OUT/trace"; do
        timeout ${PHASE_TIMEOUT:-300} python3 benchmarks/train_compare.py --steps ${TRAIN_STEPS:-60} $run 2>&1 \
          | grep -v "^step " | tee -a "$OUT/train_modes.log" || status=1
      done ;;
    fp8)  # tests first (fixed tiles: no tuning per shape); the benchmark only if they pass
      if FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-300} python3 -m pytest tests/kernels/test_fp8_kernels.py -n 8 -q \
           -p no:cacheprovider -W ignore -rfE > "$OUT/fp8_tests.log" 2>&1; then
        tail -3 "$OUT/fp8_tests.log"
        timeout ${PHASE_TIMEOUT:-300} python3 benchmarks/lab/fp8_bench.py ${FP8_ARGS:---backward} 2>&1 | tee "$OUT/fp8_bench.log" || status=1
      else
        status=1; tail -40 "$OUT/fp8_tests.log"
      fi ;;
    q-regs)  # FP8 consumers with Q in registers as well as P (FLASHTILE_FP8_Q_REGISTERS): gluon_bench.py --fp8 at d = 128
      # and 64 with three consumers and two, under 0 then 1, then the FP8 Gluon tests under 1
      for qregs in 0 1; do
        FLASHTILE_FP8_Q_REGISTERS=$qregs FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-150} python3 benchmarks/lab/gluon_bench.py \
          --fp8 --headdims 128,64 --seqlens ${QREGS_SEQLENS:-4096,16384} \
          --fp8-configs pingpong3-fa3:192x128x2x12,pingpong-fa3:128x128x2x8 2>&1 | tee "$OUT/q_regs_$qregs.log" || status=1
      done
      FLASHTILE_FP8_Q_REGISTERS=1 FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-120} python3 -m pytest \
        tests/kernels/test_gluon_forward.py -n 14 -q -p no:cacheprovider -W ignore -rfE -k "fp8" > "$OUT/q_regs_tests.log" \
        2>&1 || status=1
      tail -n 4 "$OUT/q_regs_tests.log" ;;
    dv-at)  # where FA3's order issues dV's product and reads delta (FLASHTILE_BWD_DV_AT, FLASHTILE_BWD_DELTA_AHEAD):
      # the same bits every way (env_ab.py compares the gradients' digests), so only the A/B
      timeout ${PHASE_TIMEOUT:-400} python3 benchmarks/lab/env_ab.py --mode bwd --cudnn --rounds ${ROUNDS:-2} \
        --variants "${DV_VARIANTS:-ds=FLASHTILE_BWD_DV_AT=ds;wait_ahead=FLASHTILE_BWD_DV_AT=wait FLASHTILE_BWD_DELTA_AHEAD=1;early_ahead=FLASHTILE_BWD_DV_AT=early FLASHTILE_BWD_DELTA_AHEAD=1;ds_ahead=FLASHTILE_BWD_DELTA_AHEAD=1}" \
        --points "${POINTS:-128:4096:0,128:16384:0,128:4096:1}" 2>&1 | tee "$OUT/dv_at_ab.log" || status=1 ;;
    tail-split) switch_ab tail_split FLASHTILE_BWD_TAIL_SPLIT 1 "whole=FLASHTILE_BWD_TAIL_SPLIT=0;split=FLASHTILE_BWD_TAIL_SPLIT=1" \
                  128:4096:0,128:8192:0,128:16384:0,64:4096:0,64:16384:0,128:4096:1 bwd tests/kernels/test_gluon_backward.py \
                  "${TAIL_TESTS_K:-(fa3 or dispatch or where_it_is_faster or d64 or tail) and not long_lengths}" ;;
    exp2-poly)  # FP8 forward with 1 or 2 of each 8 exponentials by a polynomial (FLASHTILE_FP8_EXP2_POLY): A/B in
      # alternating processes with cuDNN's, the FP8 rule's tests under each, then issue 26's 24 cells (bf16 against
      # cuDNN, forward and backward) unless POLY_CELLS=0
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-170} python3 benchmarks/lab/env_ab.py --mode fwd8 --cudnn --rounds 2 \
        --variants "mufu=FLASHTILE_FP8_EXP2_POLY=0;poly1=FLASHTILE_FP8_EXP2_POLY=1;poly2=FLASHTILE_FP8_EXP2_POLY=2" \
        --points ${POLY_POINTS:-128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:16384:0,64:16384:1} 2>&1 \
        | tee "$OUT/poly_fwd8.log" || status=1
      for poly in 1 2; do
        FLASHTILE_FP8_EXP2_POLY=$poly FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-100} python3 -m pytest \
          tests/kernels/test_gluon_forward.py -n 14 -q -p no:cacheprovider -W ignore -rfE -k "fp8" \
          > "$OUT/poly_tests_$poly.log" 2>&1 || status=1
        tail -n 3 "$OUT/poly_tests_$poly.log"
      done
      [ "${POLY_CELLS:-1}" = 1 ] && { FLASHTILE_AUTOTUNE=0 FLASHTILE_BENCH_MS=10,50 timeout ${CELLS_TIMEOUT:-220} python3 -m \
        flashtile bench --dtypes bfloat16 --headdims 64,128 --causal false,true --seqlens 4096,8192,16384 --modes fwd,bwd \
        --peers flashtile,sdpa_cudnn --rounds 2 --json "$OUT/poly_cells.json" 2>&1 | tee "$OUT/poly_cells.log" \
        || status=1; } ;;
    rescale-skip)  # the sm90 forward skipping O's rescale where a warp's rows kept their max (FLASHTILE_FWD_RESCALE_SKIP)
      # and keeping lane partial row sums (FLASHTILE_FWD_LANE_SUM): FP8 then bf16 forwards in alternating processes with
      # cuDNN's, outputs' digests compared ("exact" must give "off"'s bits), then the Gluon forward's and the FP8
      # kernels' GPU tests under both switches on
      skip_off="off=FLASHTILE_FWD_RESCALE_SKIP=0"
      skip_on="on=FLASHTILE_FWD_RESCALE_SKIP=1;all=FLASHTILE_FWD_RESCALE_SKIP=1 FLASHTILE_FWD_LANE_SUM=1 FLASHTILE_FWD_P_PAIRS=1"
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-180} python3 benchmarks/lab/env_ab.py --mode fwd8 --cudnn --rounds 2 \
        --variants "${SKIP_VARIANTS8:-$skip_off;exact=FLASHTILE_FWD_RESCALE_SKIP=exact;on=FLASHTILE_FWD_RESCALE_SKIP=1;all=FLASHTILE_FWD_RESCALE_SKIP=1 FLASHTILE_FWD_LANE_SUM=1 FLASHTILE_FP8_P_WORDS=1}" \
        --points ${SKIP_POINTS8:-128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:16384:1} 2>&1 | tee "$OUT/skip_fwd8.log" \
        || status=1
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-180} python3 benchmarks/lab/env_ab.py --mode fwd --cudnn --rounds 2 \
        --variants "${SKIP_VARIANTS:-$skip_off;$skip_on}" --points ${SKIP_POINTS:-128:4096:0,128:4096:1,128:8192:1,64:16384:0} 2>&1 \
        | tee "$OUT/skip_fwd.log" || status=1
      FLASHTILE_FWD_RESCALE_SKIP=1 FLASHTILE_FWD_LANE_SUM=1 FLASHTILE_FP8_P_WORDS=1 FLASHTILE_FWD_P_PAIRS=1 FLASHTILE_AUTOTUNE=0 \
        timeout ${TESTS_TIMEOUT:-200} \
        python3 -m pytest tests/kernels/test_gluon_forward.py tests/kernels/test_fp8_kernels.py -n 14 -q ${SKIP_TESTS_K:+-k "$SKIP_TESTS_K"} \
        -p no:cacheprovider -W ignore -rfE > "$OUT/skip_tests.log" 2>&1 || status=1
      tail -n 15 "$OUT/skip_tests.log" ;;
    p-regs)  # the FP8 forward's P from registers (K's keys permuted), within one call: TFLOP/s of three consumers and two
             # (2 and 3 stages) under FLASHTILE_FP8_P_REGISTERS=wait, its GPU tests under it (FA3's rule against
             # float64), then the same TFLOP/s under 0 (P through shared memory); P_REGS_CARRY=1: and carry
      p_regs_bench() {  # MODE HEADDIMS CONFIGS LIMIT
        FLASHTILE_FP8_P_REGISTERS=$1 FLASHTILE_AUTOTUNE=0 timeout $4 python3 benchmarks/lab/gluon_bench.py --fp8 \
          --headdims $2 --seqlens ${P_REGS_SEQLENS:-4096,16384} --fp8-configs $3 2>&1 | tee "$OUT/p_regs_bench_$1.log" \
          || status=1
      }
      configs3=pingpong3-fa3:192x128x2x12,pingpong-fa3:128x128x2x8,pingpong-fa3:128x128x3x8
      p_regs_bench wait 128,64 $configs3 170
      FLASHTILE_FP8_P_REGISTERS=wait FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-150} python3 -m pytest \
        tests/kernels/test_gluon_forward.py -n 14 -q -p no:cacheprovider -W ignore -rfE -k "fp8_rule" \
        > "$OUT/p_regs_tests.log" 2>&1 || status=1
      tail -n 15 "$OUT/p_regs_tests.log"
      p_regs_bench 0 128,64 $configs3 160
      [ "${P_REGS_CARRY:-0}" = 1 ] && p_regs_bench carry 128 pingpong-fa3:128x128x2x8,pingpong-fa3:128x128x3x8 100 ;;
    fp8-accept)  # the table before the tests: a test run cut short by its limit then costs no measurement
      fp8_table fp8_accept 300
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-240} python3 -m pytest tests/kernels/test_fp8_kernels.py -n 14 -q \
        -p no:cacheprovider -W ignore -rfE > "$OUT/fp8_tests.log" 2>&1 || status=1
      tail -3 "$OUT/fp8_tests.log" ;;
    d64-three)  # the d = 64 forward's three consumers where not measured yet: their GPU tests (packed sequences
      # among them), then dense calls at 1,024-4,096 tokens and packed ones at means of 1,024-8,192 against single-ffma
      FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-120} python3 -m pytest tests/kernels/test_gluon_forward.py -n 14 -q \
        -p no:cacheprovider -W ignore -rfE -k "pingpong3 or three_consumers" > "$OUT/d64_three_tests.log" 2>&1 || status=1
      tail -n 15 "$OUT/d64_three_tests.log"
      for round in 1 2; do
        echo "== round $round" | tee -a "$OUT/d64_three.log"
        FLASHTILE_AUTOTUNE=0 timeout 100 python3 benchmarks/lab/dispatch_choice.py --headdims 64 --causal false,true \
          --seqlens 1024,2048,4096 --choices single-ffma@128x128x2x8,pingpong3-fa3@192x128x2x12 2>&1 \
          | grep -v Warning | tee -a "$OUT/d64_three.log" || status=1
        FLASHTILE_AUTOTUNE=0 timeout 100 python3 benchmarks/lab/dispatch_choice.py --varlen --headdims 64 \
          --causal false,true --seqlens 1024,2048,4096,8192 --choices single-ffma@128x128x2x8,pingpong3-fa3@192x128x2x12 \
          2>&1 | grep -v Warning | tee -a "$OUT/d64_three.log" || status=1
      done ;;
    peers)  # issue 26's harness: the 24 cells with cuDNN, SDPA flash, Flex and FA4 in one run (FA4 from
      # fa4_carry.sh's archive, carried as .fa4 and unpacked before the warm-up)
      FLASHTILE_AUTOTUNE=0 FLASHTILE_BENCH_MS=${CELLS_BENCH_MS:-10,50} timeout ${PHASE_TIMEOUT:-420} python3 -m flashtile \
        bench $PEERS_ARGS --peers ${PEERS:-flashtile,sdpa_cudnn,sdpa_flash,flex,fa4} --rounds ${CELLS_ROUNDS:-1} \
        --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log" || status=1 ;;
    accept)  # the three open issues' acceptance tables in one call (about 6 minutes): issue 25's wall time per call
             # (bench --overhead), issue 26's 24 cells against cuDNN (default tiles, two rounds), issue 27's FP8 table
      overhead_rows accept_overhead 150
      FLASHTILE_AUTOTUNE=0 FLASHTILE_BENCH_MS=${CELLS_BENCH_MS:-10,50} timeout ${PHASE_TIMEOUT:-200} python3 -m flashtile \
        bench --dtypes bfloat16 --headdims 64,128 --causal false,true --seqlens 4096,8192,16384 --modes fwd,bwd \
        --peers flashtile,sdpa_cudnn --rounds ${CELLS_ROUNDS:-2} --json "$OUT/accept_cells.json" 2>&1 | tee "$OUT/accept_cells.log" || status=1
      fp8_table accept_fp8 200 ;;
    fwd-2048)
      for round in 1 2; do
        for views in "" --views; do
          echo "== round $round ${views:-separate q, k, v}" | tee -a "$OUT/fwd_2048.log"
          FLASHTILE_AUTOTUNE=0 timeout 90 python3 benchmarks/lab/dispatch_choice.py --headdims 128 --causal false,true \
            --seqlens 2048 --tokens 8192 $views --choices pingpong-fa3@128x128x2x8 2>&1 | tail -2 \
            | tee -a "$OUT/fwd_2048.log" || status=1
        done
      done
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-300} ncu --profile-from-start off --clock-control none \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats \
        --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis --csv --page details \
        python3 benchmarks/lab/ncu_targets.py fwd_d128n2048b4_cudnn > "$OUT/ncu_fwd_2048.csv" 2> "$OUT/ncu_fwd_2048.err" \
        || status=1 ;;
    dropout)
      # The dropout GPU tests, then one call's forward and forward+backward (tiles tuned) and the compiled GPT with
      # attention dropout against SDPA (benchmarks/lab/compile_dropout.py), for each tree in DROPOUT_TREES
      # (directories holding a flashtile package; default: this one) under each of DROPOUT_SETTINGS (';'-separated
      # environment settings; default: the Triton two passes and the Gluon one pass for the backward).
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/kernels/test_variant_kernels.py \
        tests/kernels/test_attention_kernels.py tests/kernels/test_gpu_reliability.py tests/test_compile.py \
        tests/kernels/test_gluon_backward.py tests/kernels/test_fixed_point.py \
        -k "(dropout or fixed_point or takes_the_one_pass) and not long_lengths" -n 8 -q -p no:cacheprovider -W ignore \
        > "$OUT/dropout_tests.log" 2>&1 || status=1; tail -3 "$OUT/dropout_tests.log"
      IFS=';' read -ra settings <<< "${DROPOUT_SETTINGS:-FLASHTILE_GLUON_DROPOUT=0;FLASHTILE_GLUON_DROPOUT=1}"
      for tree in ${DROPOUT_TREES:-$PWD}; do
        for setting in "${settings[@]}"; do
          echo "== $tree $setting" | tee -a "$OUT/dropout.log"
          env $setting PYTHONPATH=$tree:$PYTHONPATH timeout 150 python3 benchmarks/lab/compile_dropout.py --kernels \
            ${DROPOUT_IMPLS:+--impls $DROPOUT_IMPLS} 2>&1 | tee -a "$OUT/dropout.log" || status=1
          [ "${DROPOUT_TRAIN:-1}" = 1 ] && { env $setting PYTHONPATH=$tree:$PYTHONPATH FLASHTILE_AUTOTUNE=0 timeout 200 \
            python3 benchmarks/lab/compile_dropout.py --rounds 1 ${DROPOUT_IMPLS:+--impls $DROPOUT_IMPLS} 2>&1 \
            | tee -a "$OUT/dropout.log" || status=1; }
        done
      done ;;
    dropout-tiles)  # tiles with dropout not yet timed: the d = 128 forward's list, the d = 64 dK/dV and dQ lists (pinned
                    # in one process each, rounds rotated; benchmarks/lab/bwd_at_tiles.py --dropout 0.1); TILE_PARTS=fwd:
                    # the forward's alone
      FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-200} python3 benchmarks/lab/bwd_at_tiles.py --headdim 128 --causal \
        --heads 8 --dropout 0.1 --points 8:2048,2:8192 --rounds 2 \
        --fwd-sweep "128x64x4x2;64x64x4x3;128x64x8x3;128x128x8x2;128x128x4x2" 2>&1 | tee "$OUT/dropout_fwd_tiles.log" || status=1
      [ "${TILE_PARTS:-fwd d64}" = fwd ] || FLASHTILE_AUTOTUNE=0 timeout ${PHASE_TIMEOUT:-200} python3 benchmarks/lab/bwd_at_tiles.py --headdim 64 --causal \
        --heads 16 --dropout 0.1 --points 8:2048,2:8192 --rounds 2 --sweep \
        "128x32x4x3/64x64x4x3;64x32x4x3/64x64x4x3;128x64x4x3/64x64x4x3;64x64x4x3/64x64x4x3;128x64x8x3/64x64x4x3;128x32x4x3/128x64x8x3;128x32x4x3/128x32x4x3;128x32x4x3/128x64x4x3" \
        2>&1 | tee "$OUT/dropout_d64_tiles.log" || status=1 ;;
    dropout-spread)  # the d = 128 causal dropout backward at fixed tiles in six processes, the dQ pass forked onto the
                     # side stream (the default) and on one stream taking turns: is the two-stream schedule what moves
                     # the 8 x 2,048 point between processes? (bwd_at_tiles.py --one-stream; the GPU's clocks logged)
      for round in $(seq ${SPREAD_ROUNDS:-3}); do
        for streams in "" --one-stream; do
          nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader \
            | tee -a "$OUT/dropout_spread.log"
          FLASHTILE_AUTOTUNE=0 timeout 120 python3 benchmarks/lab/bwd_at_tiles.py --headdim 128 --causal --heads 8 \
            --dropout 0.1 --dkdv 64x32x4x3 --dq 128x64x8x3 --points 8:2048,2:8192,8:2048 --tag "round $round" $streams \
            2>&1 | tee -a "$OUT/dropout_spread.log" || status=1
        done
      done ;;
    packed)  # packed gradients (a fused projection's q, k, v slices): their GPU tests, then bench --overhead with
             # FLASHTILE_PACKED_GRADS=0 and 1 (the switch is read at import: one process each)
      if timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/test_packed_grads.py -n 6 -q -p no:cacheprovider -W ignore \
           -rfE > "$OUT/packed_tests.log" 2>&1; then
        tail -2 "$OUT/packed_tests.log"
        for packed in 0 1; do
          FLASHTILE_PACKED_GRADS=$packed overhead_rows "overhead_packed$packed" 170
        done
      else
        status=1; tail -30 "$OUT/packed_tests.log"
      fi ;;
    sanitize) timeout ${PHASE_TIMEOUT:-300} bash benchmarks/lab/sanitize.sh || status=1 ;;
    overhead) overhead_rows overhead 300 ;;
    fused-append)  # the decoding tests with the append fused into the attention kernel, then the A/B if they pass
      if FLASHTILE_FUSED_APPEND=1 FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-300} python3 -m pytest \
           tests/kernels/test_kvcache_kernels.py tests/kernels/test_replay.py tests/test_inference.py -k "kvcache or decod" \
           -n ${PYTEST_WORKERS:-12} -q -p no:cacheprovider -W ignore -rfE > "$OUT/fused_append_tests.log" 2>&1; then
        tail -2 "$OUT/fused_append_tests.log"
        timeout ${PHASE_TIMEOUT:-400} python3 benchmarks/lab/env_ab.py --mode decode --cudnn --rounds ${ROUNDS:-3} \
          --variants "two_launches=FLASHTILE_FUSED_APPEND=0;fused=FLASHTILE_FUSED_APPEND=1" 2>&1 \
          | tee "$OUT/fused_append_ab.log" || status=1
      else
        status=1; tail -40 "$OUT/fused_append_tests.log"
      fi ;;
    descriptor-memo)  # raw launches reusing their TMA descriptors against filling them anew, then the host profile
      timeout ${PHASE_TIMEOUT:-300} python3 benchmarks/lab/descriptor_memo.py 2>&1 | tee "$OUT/descriptor_memo.log" || status=1
      timeout 150 python3 benchmarks/lab/profile_call.py --cprofile-rows 300 > "$OUT/cprofile_rows.log" 2>&1 || status=1
      grep -E "^---|primitive|device thread" "$OUT/cprofile_rows.log" ;;
    plans)  # tests first (fixed tiles), the wall-time rows only if they pass
      if FLASHTILE_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-300} python3 -m pytest tests/kernels/test_replay.py \
           tests/kernels/test_gpu_reliability.py tests/kernels/test_kvcache_kernels.py tests/kernels/test_direct_launch.py \
           -n ${PYTEST_WORKERS:-12} -q -p no:cacheprovider -W ignore -rfE > "$OUT/plans_tests.log" 2>&1; then
        tail -2 "$OUT/plans_tests.log"
        overhead_rows overhead 300
      else
        status=1; tail -40 "$OUT/plans_tests.log"
      fi ;;
    hf) timeout ${PHASE_TIMEOUT:-400} python3 benchmarks/hf_bench.py ${HF_ARGS:---repeats 2} --json "$OUT/hf.json" 2>&1 | tee "$OUT/hf.log" || status=1 ;;
    hf-static)  # transformers' compiled static-cache generation: its GPU tests, then generate with the step in
                # one graph and not (FLASHTILE_HF_STEP_IN_GRAPH), sdpa in each run
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/integrations/test_transformers.py -k "cuda_graphs" \
        --tb=short > "$OUT/hf_static_tests.log" 2>&1 || status=1
      grep -E "passed|failed|Error" "$OUT/hf_static_tests.log" | tail -n 12
      for in_graph in ${HF_IN_GRAPH:-1 paged 0}; do
        FLASHTILE_HF_STEP_IN_GRAPH=$in_graph timeout ${PHASE_TIMEOUT:-200} python3 benchmarks/hf_bench.py --cache static \
          --skip train --repeats 1 --json "$OUT/hf_static_$in_graph.json" > "$OUT/hf_static_$in_graph.log" 2>&1 || status=1
        grep -E '"(impl|decode_tok_s|same_tokens_as_sdpa)"|Error' "$OUT/hf_static_$in_graph.log" | sed "s/^/in_graph=$in_graph /"
      done ;;
    first-call) timeout ${PHASE_TIMEOUT:-400} python3 benchmarks/first_call.py ${FIRST_CALL_ARGS:-} 2>&1 | tee "$OUT/first_call.md" || status=1 ;;
    first-call-compiles)
      FLASHTILE_COMPILE_THREADS=8 timeout ${PHASE_TIMEOUT:-90} python3 benchmarks/first_call.py --seqlens 16384 \
        --impls flashtile --compiles 2>&1 | tee -a "$OUT/first_call_compiles.log" || status=1
      timeout ${PHASE_TIMEOUT:-90} python3 benchmarks/first_call.py --seqlens 16384 --profile 1 --top 40 \
        2>&1 | tee -a "$OUT/first_call_compiles.log" || status=1 ;;
    decode) timeout ${PHASE_TIMEOUT:-300} python3 -m flashtile bench --decode ${DECODE_SPLITS:+--decode-splits $DECODE_SPLITS} --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" || status=1 ;;
    variants-bench) timeout ${PHASE_TIMEOUT:-300} python3 -m flashtile bench --variants ${VARIANT_PARTS:+--variant-parts $VARIANT_PARTS} --json "$OUT/variants.json" 2>&1 | tee "$OUT/variants-bench.log" || status=1 ;;
    memory) python3 -m flashtile bench --memory --peers flashtile,naive --json "$OUT/memory.json" ${has_matplotlib:+--plot "$OUT/memory"} 2>&1 | tee "$OUT/memory.log" || status=1 ;;
    ncu)  # Nsight Compute on one GQA decode call and one causal backward, flashtile and SDPA (Firecracker only)
      for target in ${NCU_TARGETS:-decode bwd_causal}; do
        timeout ${PHASE_TIMEOUT:-300} ncu --profile-from-start off --clock-control none --set full -o "$OUT/ncu_$target" \
          python3 benchmarks/lab/ncu_targets.py $target > "$OUT/ncu_$target.log" 2>&1 || status=1
        tail -3 "$OUT/ncu_$target.log"
        ncu --import "$OUT/ncu_$target.ncu-rep" --page details --csv > "$OUT/ncu_$target.csv" 2>/dev/null || true
      done ;;
    variants)  # flashtile alone under each kernel setting in VARIANTS (';'-separated env assignments)
      IFS=';' read -ra settings <<< "${VARIANTS:-FLASHTILE_TMA=0;FLASHTILE_TMA=auto;FLASHTILE_AUTOTUNE=1}"
      for setting in "${settings[@]}"; do
        echo "=== $setting" | tee -a "$OUT/variants.log"
        env $setting TRITON_PRINT_AUTOTUNING=1 python3 -m flashtile bench --dtypes bfloat16 --headdims ${HEADDIMS:-64,128} \
          --causal false,true --seqlens ${SEQLENS:-4096} --modes fwd,bwd --peers flashtile 2>&1 \
          | grep -E "^flashtile |best config|Error|error" | tee -a "$OUT/variants.log" || status=1
      done ;;
    cp)  # needs 2+ GPUs: NCCL correctness tests, then the context-parallel scaling benchmark
      # Only the NCCL test: the gloo ones (2, 4, 8 processes on the PyTorch path) run in CI, and took the
      # whole 75 s limit of the first two-GPU call here.
      # The scaling run uses default tiles everywhere (CP_AUTOTUNE=1 tunes): with a cold cache, tuning every
      # candidate on each shape of the ring's steps took more than a 10-minute call on two H200s.
      if [ "${CP_TESTS:-1}" = 1 ]; then
        timeout ${TESTS_TIMEOUT:-300} python3 -m pytest tests/distributed -k nccl -q -p no:cacheprovider -W ignore > "$OUT/cp_tests.log" 2>&1 || status=1
        tail -5 "$OUT/cp_tests.log"
      fi
      FLASHTILE_AUTOTUNE=${CP_AUTOTUNE:-0} python3 benchmarks/cp_bench.py ${CP_ARGS:-} --json "$OUT/cp_bench.json" 2>&1 | tee "$OUT/cp_bench.log" || status=1 ;;
    *) echo "unknown phase $phase"; status=1 ;;
  esac
  echo "phase $phase took $(( $(date +%s) - start )) s" | tee -a "$OUT/phases.txt"
done
exit $status
