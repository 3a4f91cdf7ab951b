#!/usr/bin/env bash
# The whole test suite (CPU + GPU, then the scale tier), load_check of every preset and the
# benchmarks, in one call on the device machine, from the repository root:
#   PYTHONPATH=. bash tools/gpu_suite.sh [--quick]
# --quick: tests and load_check only (no scale tier, no benchmarks).
# Logs go to $OUT (or ./gpu_logs); the summary lines print last.
set -uo pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
CKPT=${PYDFLASH_CKPT_CACHE:-/tmp/pydflash_ckpt}
export PYDFLASH_CKPT_CACHE=$CKPT
QUICK=${1:-}
status=0
run() {  # run NAME CMD...: tee the output to $OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "== $*" | tee "$OUT/$name.log"
  "$@" 2>&1 | tee -a "$OUT/$name.log" || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.log"
python3 -c "import cupy, numpy; from cupy_backends.cuda.libs import nvrtc; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'nvrtc', nvrtc.getVersion())" | tee -a "$OUT/device.log"

PRESETS="qwen3-8b-b16 gemma4-31b gpt-oss-20b-b8 qwen3-4b-b16 dspark-qwen3-8b-b7 tiny tiny-swa tiny-dspark"
for p in $PRESETS; do   # each preset written once, shared by the tests and load_check
  [ -f "$CKPT/$p/config.json" ] || python3 tools/make_checkpoint.py "$CKPT/$p" --preset "$p" --seed 1 >> "$OUT/make_checkpoint.log" 2>&1
done

run tests python3 -m pytest -q -rs tests
[ "$QUICK" = --quick ] || run scale python3 -m pytest -q -rs -m scale -v tests
for p in $PRESETS; do
  run "load_check_$p" python3 tools/load_check.py "$CKPT/$p" --precision bf16 q8_0 --ctx 4096
done
if [ "$QUICK" != --quick ]; then
  run bench_qwen python3 tools/bench_round.py --ckpt "$CKPT/qwen3-8b-b16" --precision bf16 q8_0 q4_0 mixed --ctx 4096
  run bench_gemma python3 tools/bench_round.py --ckpt "$CKPT/gemma4-31b" --precision bf16 q8_0 q4_0 mixed --ctx 4096
  run bench_kernels python3 tools/bench_kernels.py --precision bf16 q8_0
fi

echo "== summary"
tail -n 1 "$OUT/tests.log"
[ -f "$OUT/scale.log" ] && tail -n 1 "$OUT/scale.log"
grep -h -E "^SCALE|PASSED|FAILED" "$OUT/scale.log" 2>/dev/null | grep -E "FAILED" | head -20
grep -h -E "gpu vs ref|gpu timing|loaded|INVALID" "$OUT"/load_check_*.log
grep -h -E "forward_round|ingest|draft_tokens|ordering" "$OUT"/bench_*.log 2>/dev/null
exit $status
