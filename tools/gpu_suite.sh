#!/usr/bin/env bash
# The whole GPU suite and the benchmarks in one call, for the device tool:
#   PYTHONPATH=. bash tools/gpu_suite.sh [quick]
# Logs go to $OUT (or ./gpu_logs). "quick" runs the tests and one benchmark only.
set -uo pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/device.txt"

python3 -m pytest -q -x tests/test_engine_gpu.py tests/test_draft_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
tail -n 3 "$OUT/gpu_tests.log"

python3 tools/load_check.py --preset qwen3-8b-b16 --precision bf16 --ctx 4096 2>&1 | tee "$OUT/load_check.log" || status=1
if [ "${1:-}" = quick ]; then
  python3 tools/bench_round.py --preset qwen3-8b-b16 --precision bf16 --ctx 4096 2>&1 | tee "$OUT/bench.log" || status=1
else
  python3 -m pytest -q tests 2>&1 | tail -n 3 | tee "$OUT/all_tests.log" || status=1
  for preset in qwen3-8b-b16 gemma4-31b; do
    python3 tools/bench_round.py --preset $preset --precision bf16 q8_0 --ctx 4096 2>&1 | tee -a "$OUT/bench.log" || status=1
  done
fi
exit $status
