#!/usr/bin/env bash
# The whole test suite (CPU + GPU) and the benchmarks in one call, for the device machine:
#   PYTHONPATH=. bash tools/gpu_suite.sh
# Logs go to $OUT (or ./gpu_logs); the summary lines print last.
set -uo pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
status=0
run() {  # run NAME CMD...: tee the output to $OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "== $*" | tee "$OUT/$name.log"
  "$@" 2>&1 | tee -a "$OUT/$name.log" || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.log"
python3 -c "import cupy, numpy; from cupy_backends.cuda.libs import nvrtc; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'nvrtc', nvrtc.getVersion())" | tee -a "$OUT/device.log"

run tests python3 -m pytest -q -rs tests
run load_check_bf16 python3 tools/load_check.py --preset qwen3-8b-b16 --precision bf16 --ctx 4096
run load_check_q8 python3 tools/load_check.py --preset qwen3-8b-b16 --precision q8_0 --ctx 4096
run bench_qwen python3 tools/bench_round.py --preset qwen3-8b-b16 --precision bf16 q8_0 q4_0 mixed --ctx 4096
run bench_gemma python3 tools/bench_round.py --preset gemma4-31b --precision bf16 q8_0 --ctx 4096
run bench_kernels python3 tools/bench_kernels.py --precision bf16 q8_0

echo "== summary"
tail -n 1 "$OUT/tests.log"
grep -h -E "gpu vs ref|loaded|forward_round|ingest|draft_tokens" "$OUT"/load_check_*.log "$OUT"/bench_*.log
exit $status
