#!/usr/bin/env bash
# The whole GPU suite and the benchmarks, from the repository root on the device machine:
#   PYTHONPATH=. bash tools/gpu_suite.sh [tests|scale|checks|all|kernels|bench|batch|long|tables|fuzz|soak|sanitize|profile]
#   (default: all)
# tests:   the test suite, CPU and GPU, in TEST_SHARDS (3) parallel pytest processes
# suite:   tests and scale at once, within one device call (2 + 3 processes by default: with
#          3 + 6 and with 3 + 4 one scale process was killed for host memory on a 128 GiB
#          machine; `tests` then `scale` as two calls is the safe order)
# scale:   its scale tier (-m scale: public geometries at ctx 4096 in every precision, the
#          stream tests at gemma/gpt-oss, the whole geometry sweep, the dspark draft step), in
#          SCALE_SHARDS (5) parallel pytest processes; SCALE_SLICE=i/n runs the i-th of n slices
#          (three calls: SCALE_SLICE=1/3, 2/3, 3/3 with SCALE_SHARDS=4)
# checks:  load_check of every preset (bf16 and q8_0, ctx 4096), the soaks (one sequence;
#          batched rounds over a churning pool, spot-checked against the reference), bench_round
# kernels: bench_linear (decode linear vs its floor), bench_attention, bench_kernels,
#          bench_stream (the linears' weight tile order read alone, row-major against tiled)
# bench:   bench_round at ctx 4096 (qwen3-8b with --propose, gemma4-31b) and bench_kernels
# batch:   bench_round --batch 1 .. 64 --profile (qwen3-8b bf16, ctx 4096; exact and bf16
#          activations) and bench_kernels --batched (gemm_bf16act's tiles): batched rounds
# long:    bench_round at ctx 131072 (qwen3-8b, gemma4-31b)
# tables:  every table of docs/performance.md's figures: both presets, every
#          precision at ctx 4096 (with propose) and 131072, batch 1 / 16 / 64 (exact and bf16
#          activations; q8_0 / q4_0 too, and on the decode linear), the peer beside each, and
#          every precision tiled beside row-major; TABLES_PRESETS and TABLES_ONLY pick some
# fuzz:    the GPU API fuzz (FUZZ_EXAMPLES a target, 250): light enough to run beside `tests`
# soak:    tools/soak.py --churn (SOAK_ROUNDS, 100000) alone, for its memory and time figures
# sanitize: compute-sanitizer's memcheck, racecheck, initcheck and synccheck over
#          tools/sanitize_round.py (every kind of call once, checked against the reference) on
#          tiny, tiny-swa, tiny-dspark and tiny-dflash2 in every precision, and qwen3-8b-b16 (memcheck
#          in every precision, a job each; initcheck and synccheck in bf16, a job per part;
#          racecheck the same over one layer of its geometry),
#          SANITIZE_PARALLEL (10) jobs at once; SANITIZE_ONLY=REGEX only the jobs it names
# profile: Nsight Compute's per-kernel time and DRAM bytes of one call (tools/profile_round.py)
#          for each kernel's distance to its bytes, and the stall reasons of the attention partial, the q4_0
#          decode linear and the quantized ingest tile
# Run the parts as separate device calls so each fits the 10-minute limit. Logs go to $OUT
# (or ./gpu_logs); the summary lines print last.
set -uo pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
CKPT=${PYDFLASH_CKPT_CACHE:-/tmp/pydflash_ckpt}
export PYDFLASH_CKPT_CACHE=$CKPT
PART=${1:-all}
status=0
run() {  # run NAME CMD...: tee the output to $OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "== $*" | tee "$OUT/$name.log"
  "$@" >> "$OUT/$name.log" 2>&1 || { status=1; echo "FAILED: $name" | tee -a "$OUT/failed.log"; }
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/device.log"
python3 -c "import cupy, numpy; from cupy_backends.cuda.libs import nvrtc; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'nvrtc', nvrtc.getVersion())" >> "$OUT/device.log"

PRESETS=${PRESETS:-"qwen3-8b-b16 gemma4-31b gpt-oss-20b-b8 qwen3-4b-b16 qwen3.6-27b dspark-qwen3-8b-b7 dspark-qwen3-4b-b7 muse-glimmer-30b ornith-1.5-35b-a3b kimi-k2.5 kimi-k3.1-dspark qwen3.8-27b-dflash2 muse-glimmer-30b-dflash2 tiny tiny-swa tiny-dspark tiny-dflash2"}
for p in $PRESETS; do   # each preset written once (in parallel), shared by the tests and load_check
  [ -f "$CKPT/$p/config.json" ] || python3 tools/make_checkpoint.py "$CKPT/$p" --preset "$p" --seed 1 > "$OUT/make_checkpoint_$p.log" 2>&1 &
done
wait
# every kernel family compiled once, in parallel, into the kernel cache the test processes
# then read (pydflash-precompile; a warm cache reads them in about a second)
ARCH=sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
run precompile python3 -m pydflash.precompile --arch "$ARCH"

if [ "$PART" = tests ] || [ "$PART" = all ] || [ "$PART" = suite ]; then
  # in TEST_SHARDS processes (test files dealt round-robin; tests.log the summary)
  SHARDS=${TEST_SHARDS:-$([ "$PART" = suite ] && echo 2 || echo 3)}
  find tests dev/tests -name "test_*.py" | sort | grep -v test_kernels_compile.py > "$OUT/test_files.txt"
  for i in $(seq 1 "$SHARDS"); do
    awk -v i="$i" -v n="$SHARDS" 'NR % n == i % n' "$OUT/test_files.txt" > "$OUT/test_files_$i.txt"
    (xargs -a "$OUT/test_files_$i.txt" python3 -m pytest -q -rs -p no:cacheprovider \
      > "$OUT/tests_$i.log" 2>&1 || echo "FAILED: tests shard $i" >> "$OUT/failed.log") &
  done
  if [ "$PART" != suite ]; then wait; [ -f "$OUT/failed.log" ] && status=1; fi  # suite: scale beside
fi
if [ "$PART" = scale ] || [ "$PART" = all ] || [ "$PART" = suite ]; then
  # in SHARDS processes on the one GPU (one process takes over 10 minutes, a device call's
  # limit): the scale tests dealt round-robin, each shard's log scale_N.log, scale.log the sum
  SHARDS=${SCALE_SHARDS:-$([ "$PART" = suite ] && echo 3 || echo 5)}
  # SCALE_SLICE=i/n: the i-th of n slices of the ids only (the whole tier, 141 tests, takes
  # about three device calls: one call ran 66 in 540 s with 6 processes, two of them killed
  # for host memory at the 27B f32 presets)
  python3 -m pytest -q --collect-only -m scale -p no:cacheprovider tests 2>/dev/null | grep '::' > "$OUT/scale_all_ids.txt"
  IFS=/ read -r SLICE_I SLICE_N <<< "${SCALE_SLICE:-1/1}"
  awk -v i="$SLICE_I" -v n="$SLICE_N" 'NR % n == i % n' "$OUT/scale_all_ids.txt" > "$OUT/scale_ids.txt"
  # NumPy's BLAS (the reference's GEMMs) gets the cores divided among the processes running
  # at once (SCALE_BLAS_THREADS overrides): OpenBLAS starts a thread a core in every process,
  # and oversubscribed its GEMMs slow down (measured: 2 processes x 2 threads on 2 cores 29%
  # slower than x 1 thread)
  BESIDE=0; [ "$PART" = suite ] && BESIDE=${TEST_SHARDS:-2}  # suite: the test shards too
  BLAS=${SCALE_BLAS_THREADS:-$(( $(nproc) / (SHARDS + BESIDE) ))}
  [ "$BLAS" -ge 1 ] || BLAS=1
  for i in $(seq 1 "$SHARDS"); do
    awk -v i="$i" -v n="$SHARDS" 'NR % n == i % n' "$OUT/scale_ids.txt" > "$OUT/scale_ids_$i.txt"
    (OPENBLAS_NUM_THREADS=$BLAS OMP_NUM_THREADS=$BLAS MKL_NUM_THREADS=$BLAS \
      xargs -a "$OUT/scale_ids_$i.txt" -d '\n' python3 -m pytest -v -rA -m scale -p no:cacheprovider \
      --durations=0 > "$OUT/scale_$i.log" 2>&1 || echo "FAILED: scale shard $i" >> "$OUT/failed.log") &
  done
  wait
  for i in $(seq 1 "$SHARDS"); do echo "shard $i: $(tail -n 1 "$OUT/scale_$i.log")"; done > "$OUT/scale.log"
  grep -h -E "^(FAILED|ERROR|SCALE)" "$OUT"/scale_[0-9]*.log >> "$OUT/scale.log"
  # every test's time (--durations=0), the slowest 30 phases of all shards here
  echo "== slowest (BLAS threads $BLAS a process)" >> "$OUT/scale.log"
  grep -h -E "^[0-9.]+s (setup|call|teardown) " "$OUT"/scale_[0-9]*.log | sort -rn | head -30 >> "$OUT/scale.log"
  cat "$OUT/scale.log"
  [ -f "$OUT/failed.log" ] && status=1
fi
if [ "$PART" = checks ] || [ "$PART" = all ]; then
  for p in $PRESETS; do
    run "load_check_$p" python3 tools/load_check.py "$CKPT/$p" --precision bf16 q8_0 --ctx 4096
  done
  run soak python3 tools/soak.py --preset tiny --rounds 100000 --window 20000
  run soak_churn python3 tools/soak.py --churn --preset tiny --rounds 100000
  run bench_qwen python3 tools/bench_round.py --ckpt "$CKPT/qwen3-8b-b16" --precision bf16 q8_0 q4_0 mixed --ctx 4096 --propose
  run bench_gemma python3 tools/bench_round.py --ckpt "$CKPT/gemma4-31b" --precision bf16 q8_0 q4_0 mixed --ctx 4096
fi
if [ "$PART" = kernels ]; then
  run bench_linear python3 tools/bench_linear.py --variants --tiled
  run bench_attention python3 tools/bench_attention.py
  run bench_kernels python3 tools/bench_kernels.py --precision bf16 q8_0 q4_0
  run bench_stream python3 dev/bench_stream.py
fi
if [ "$PART" = bench ]; then   # bench_round at ctx 4096 (the peer beside) and every kernel alone
  run bench_qwen python3 tools/bench_round.py --ckpt "$CKPT/qwen3-8b-b16" --precision bf16 q8_0 q4_0 mixed --ctx 4096 --propose --host-profile --peer
  run bench_gemma python3 tools/bench_round.py --ckpt "$CKPT/gemma4-31b" --precision bf16 q8_0 q4_0 mixed --ctx 4096 --peer
  run bench_kernels python3 tools/bench_kernels.py --precision bf16 q8_0 q4_0
fi
if [ "$PART" = batch ]; then   # batched rounds, qwen3-8b bf16 at ctx 4096
  run bench_batch python3 tools/bench_round.py --ckpt "$CKPT/qwen3-8b-b16" --precision bf16 --ctx 4096 --batch 1 2 4 8 16 32 64 --rounds 50 --profile
  run bench_batched_linears python3 tools/bench_kernels.py --batched 64 128 256 512 1024
fi
if [ "$PART" = long ]; then   # ctx 131072 (bf16 K/V; gemma's sliding layers in rings)
  run bench_qwen_long python3 tools/bench_round.py --ckpt "$CKPT/qwen3-8b-b16" --precision bf16 q8_0 q4_0 mixed --ctx 131072 --rounds 30
  run bench_gemma_long python3 tools/bench_round.py --ckpt "$CKPT/gemma4-31b" --precision bf16 q8_0 q4_0 mixed --ctx 131072 --rounds 30
fi
if [ "$PART" = fuzz ]; then   # the GPU API fuzz (tiny checkpoints; light: beside `tests` in one call)
  export PYDFLASH_GPU_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-250}
  run fuzz python3 -m pytest -q -m fuzz -s -p no:cacheprovider tests/fuzz/test_gpu_fuzz_gpu.py
  grep -h "GPUFUZZ total" "$OUT/fuzz.log"
fi
if [ "$PART" = soak ]; then   # the churn soak, alone on the device (its memory and time figures)
  run soak_churn python3 tools/soak.py --churn --preset tiny --rounds "${SOAK_ROUNDS:-100000}"
fi
if [ "$PART" = tables ]; then   # every table of docs/performance.md, the peer beside each
  # TABLES_PRESETS (both) and TABLES_ONLY (an extended regex over 4096, 131072, batch,
  # batch_quant, batch_quant_decode, row_major, tiled_optin) split the part over device calls
  # when it does not fit one
  want() { echo "$1" | grep -q -x -E "${TABLES_ONLY:-.*}"; }
  for ck in ${TABLES_PRESETS:-qwen3-8b-b16 gemma4-31b}; do
    want 4096 && run "tables_${ck}_4096" python3 tools/bench_round.py --ckpt "$CKPT/$ck" --precision bf16 q8_0 q4_0 mixed --ctx 4096 --rounds 200 --propose --peer
    want 131072 && run "tables_${ck}_131072" python3 tools/bench_round.py --ckpt "$CKPT/$ck" --precision bf16 q8_0 q4_0 --ctx 131072 --rounds 30 --peer
    want batch && run "tables_${ck}_batch" python3 tools/bench_round.py --ckpt "$CKPT/$ck" --precision bf16 --ctx 4096 --batch 1 16 64 --activations f32 bf16 --rounds 30 --peer
    want batch_quant && run "tables_${ck}_batch_quant" python3 tools/bench_round.py --ckpt "$CKPT/$ck" --precision q8_0 q4_0 --ctx 4096 --batch 1 16 64 --activations bf16 f32 --rounds 30
    # the same with the quant linears of bf16-activation batches on the decode linear
    want batch_quant_decode && run "tables_${ck}_batch_quant_decode" python3 tools/bench_round.py --ckpt "$CKPT/$ck" --precision q8_0 q4_0 --ctx 4096 --batch 1 16 64 --activations bf16 --rounds 30 --no-batched-quant-gemm
    # each precision's tiled weights against the same drafter all row-major, one run
    want row_major && run "tables_${ck}_row_major" python3 tools/bench_round.py --ckpt "$CKPT/$ck" --precision bf16 q8_0 q4_0 --ctx 4096 --rounds 200 --row-major
    # the opt-in tiled layouts (bf16's batched GEMM over tiled weights, qkv tiled): single
    # rounds beside row-major, and bf16 batches, to decide whether they become the default
    want tiled_optin && run "tables_${ck}_tiled_optin" python3 tools/bench_round.py --ckpt "$CKPT/$ck" --precision bf16 q8_0 q4_0 --ctx 4096 --rounds 200 --row-major --tiled-bf16-gemm --tiled-row-views
    want tiled_optin && run "tables_${ck}_tiled_optin_batch" python3 tools/bench_round.py --ckpt "$CKPT/$ck" --precision bf16 --ctx 4096 --batch 1 4 16 64 --activations bf16 --rounds 30 --tiled-bf16-gemm
  done
fi
if [ "$PART" = sanitize ]; then   # 0 errors expected from each tool
  # one job a line: log name, tool, checkpoint, ctx, then sanitize_round's own arguments;
  # SANITIZE_PARALLEL (10) at once on the one GPU. qwen3-8b-b16's runs are split by precision
  # (memcheck) and by part (the other tools: racecheck over a public geometry is the slowest)
  : > "$OUT/sanitize_jobs.txt"
  for tool in memcheck racecheck initcheck synccheck; do
    for p in tiny tiny-swa tiny-dspark tiny-dflash2; do
      echo "${tool}_$p $tool $p 40 --precision f32 bf16 q8_0 q4_0 mixed" >> "$OUT/sanitize_jobs.txt"
    done
  done
  # the batched part with the quant linears on gemm_quant's tile (quant_bf16act)
  for tool in memcheck racecheck initcheck; do
    for p in tiny tiny-dflash2; do
      # 32 sequences: more than 64 rows at tiny-dflash2's block of 4 (where quant_bf16act starts)
      echo "${tool}_${p}_quant_gemm $tool $p 160 --precision q8_0 q4_0 mixed --parts batch --batch-activations bf16 --batch-seqs 32" >> "$OUT/sanitize_jobs.txt"
    done
  done
  for prec in f32 bf16 q8_0 q4_0 mixed; do
    echo "memcheck_qwen3-8b-b16_$prec memcheck qwen3-8b-b16 300 --precision $prec" >> "$OUT/sanitize_jobs.txt"
  done
  # racecheck instruments every shared-memory access: over the public geometry's 5 layers one
  # forward_round took most of a device call, so it runs on qwen3-8b-b16-L1, the same geometry
  # with one layer (the same kernels and launch shapes a layer; propose's lm_head as is)
  [ -f "$CKPT/qwen3-8b-b16-L1/config.json" ] || python3 tools/make_checkpoint.py "$CKPT/qwen3-8b-b16-L1" \
    --preset qwen3-8b-b16 --seed 1 --override n_layer=1 > "$OUT/make_checkpoint_qwen3-8b-b16-L1.log" 2>&1
  for part in round propose commit; do
    echo "racecheck_qwen3-8b-b16-L1_$part racecheck qwen3-8b-b16-L1 64 --precision bf16 --parts $part" >> "$OUT/sanitize_jobs.txt"
  done
  # the batched part's two modes apart (its exact rounds alone outlast a 10-minute call among
  # the other jobs), over 24 ctx rows: the batched round's linears are launched the same
  # whatever the ctx length, and its attention's ctx chunks are covered by the round part
  for act in f32 bf16; do
    echo "racecheck_qwen3-8b-b16-L1_batch_$act racecheck qwen3-8b-b16-L1 24 --precision bf16 --parts batch --batch-activations $act" >> "$OUT/sanitize_jobs.txt"
  done
  for tool in initcheck synccheck; do
    for part in round propose commit batch; do
      echo "${tool}_qwen3-8b-b16_$part $tool qwen3-8b-b16 64 --precision bf16 --parts $part" >> "$OUT/sanitize_jobs.txt"
    done
  done
  sanitize_job() {
    read -r name tool p ctx args <<< "$1"
    # shellcheck disable=SC2086  # args: sanitize_round's arguments, split on purpose
    compute-sanitizer --tool "$tool" --error-exitcode 1 python3 tools/sanitize_round.py \
      --ckpt "$CKPT/$p" --ctx "$ctx" $args > "$OUT/sanitize_$name.log" 2>&1 \
      || echo "FAILED: sanitize_$name" >> "$OUT/failed.log"
  }
  export -f sanitize_job; export OUT CKPT
  # SANITIZE_ONLY (an extended regex over the job names) runs some of them again
  awk -v re="${SANITIZE_ONLY:-.}" '$1 ~ re' "$OUT/sanitize_jobs.txt" > "$OUT/sanitize_jobs_run.txt"
  if [ -n "${SANITIZE_ONLY:-}" ] && [ ! -s "$OUT/sanitize_jobs_run.txt" ]; then
    echo "FAILED: SANITIZE_ONLY=$SANITIZE_ONLY names no job" | tee -a "$OUT/failed.log"
  fi
  # beside them, memcheck over the GPU tests of the kernels one by one (their own geometries)
  echo memcheck_engine_tests | grep -q -E "${SANITIZE_ONLY:-.}" && (compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/device/test_engine_gpu.py > "$OUT/sanitize_memcheck_engine_tests.log" 2>&1 \
    || echo "FAILED: sanitize_memcheck_engine_tests" >> "$OUT/failed.log") &
  xargs -a "$OUT/sanitize_jobs_run.txt" -d '\n' -P "${SANITIZE_PARALLEL:-10}" -I{} bash -c 'sanitize_job "{}"'
  wait
  [ -f "$OUT/failed.log" ] && status=1
  grep -H -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_round:| passed" "$OUT"/sanitize_*.log
fi
if [ "$PART" = profile ]; then   # where each op's time goes (ncu: one kernel at a time)
  METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size
  NCU="ncu --clock-control none --profile-from-start off"
  # PROFILE_SPECS: "preset precision ctx op" entries separated by ";" (default: all of them);
  # PROFILE_STALLS=0 skips the stall sections
  SPECS=${PROFILE_SPECS:-"qwen3-8b-b16 bf16 4096 round;qwen3-8b-b16 q8_0 4096 round;qwen3-8b-b16 q4_0 4096 round;gemma4-31b bf16 4096 round;qwen3-8b-b16 bf16 131072 round;gemma4-31b bf16 131072 round;qwen3-8b-b16 bf16 4096 propose;qwen3-8b-b16 q8_0 4096 ingest;qwen3-8b-b16 bf16 4096 batch16"}
  IFS=';' read -r -a SPEC_LIST <<< "$SPECS"
  for spec in "${SPEC_LIST[@]}"; do
    read -r ck prec ctx op <<< "$spec"
    name="prof_${ck}_${prec}_${ctx}_${op}"
    $NCU --csv --page raw --print-units base --metrics "$METRICS" python3 tools/profile_round.py run \
      --ckpt "$CKPT/$ck" --precision "$prec" --ctx "$ctx" --op "$op" > "$OUT/$name.csv" 2> "$OUT/$name.err" \
      || { status=1; echo "FAILED: $name" | tee -a "$OUT/failed.log"; }
    { echo "== $spec"; python3 tools/profile_round.py summarize "$OUT/$name.csv"; } | tee "$OUT/$name.txt"
  done
  # SourceCounters adds the PC sampling the WarpStateStats rules need for their stall reasons
  [ "${PROFILE_STALLS:-1}" = 0 ] && SKIP_STALLS=1 || SKIP_STALLS=0
  SECTIONS="--section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats"
  [ $SKIP_STALLS = 1 ] || run ncu_attention $NCU $SECTIONS -k regex:attn_partial -c 1 python3 tools/profile_round.py run --ckpt "$CKPT/qwen3-8b-b16" --ctx 4096 --op round
  [ $SKIP_STALLS = 1 ] || run ncu_linear_q4 $NCU $SECTIONS -k regex:linear -c 2 python3 tools/profile_round.py run --ckpt "$CKPT/qwen3-8b-b16" --precision q4_0 --ctx 4096 --op round
  [ $SKIP_STALLS = 1 ] || run ncu_gemm_quant $NCU $SECTIONS -k regex:gemm_quant -c 1 python3 tools/profile_round.py run --ckpt "$CKPT/qwen3-8b-b16" --precision q8_0 --ctx 4096 --op ingest
fi

echo "== summary ($PART)"
grep -h -E "^(FAILED|ERROR)" "$OUT"/tests_[0-9]*.log 2>/dev/null > "$OUT/tests.log"
for f in "$OUT"/tests_[0-9]*.log; do [ -f "$f" ] && echo "tests $(basename "$f"): $(tail -n 1 "$f")"; done
[ -s "$OUT/tests.log" ] && cat "$OUT/tests.log"
[ -f "$OUT/scale.log" ] && grep -h "^shard" "$OUT/scale.log" | sed 's/^/scale /'
[ -f "$OUT/scale.log" ] && grep -h -E "^SCALE" "$OUT/scale.log" | cut -c1-200 | head -20
[ -f "$OUT/failed.log" ] && cat "$OUT/failed.log"
grep -h -E "gpu vs ref|gpu timing|INVALID|Error" "$OUT"/load_check_*.log 2>/dev/null | cut -c1-220
grep -h -E "^soak" "$OUT/soak.log" "$OUT/soak_churn.log" 2>/dev/null
grep -h -E "forward_round|ingest|draft_tokens|propose|ordering|^bf16 +[0-9]+ " "$OUT"/bench_*.log 2>/dev/null
grep -h -E "forward_round|propose|^ *(f32|bf16) +[0-9]+ |^peer|B = " "$OUT"/tables_*.log 2>/dev/null | cut -c1-200
exit $status
