#!/usr/bin/env bash
# Shows that the stream tests catch the stream defects: runs tests/device/test_streams_gpu.py and
# tests/device/test_torch_gpu.py with the ordering removed (tools/no_ordering.py puts back the
# pre-contract behaviour: work queued on the engine stream with no wait either way, foreign
# arrays read with no handshake with their producer's stream). Expect failures here, and a
# pass without -p.
#   PYTHONPATH=. bash tools/prove_stream_tests.sh
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
python3 -m pytest -q -p tools.no_ordering tests/device/test_streams_gpu.py tests/device/test_torch_gpu.py \
  -k "not callers_stream and not torch_stream and not refused" "$@"
rc=$?
if [ $rc -eq 0 ]; then echo "UNEXPECTED: the stream tests passed without the ordering"; exit 1; fi
echo "as expected: the stream tests fail without the ordering (pytest rc $rc)"
