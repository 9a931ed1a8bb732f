#!/usr/bin/env bash
# One GPU session on the H200 (device tool): GPU tests, the conformance report, the benchmark.
# Everything lands under $OUT; the last lines printed are the summaries.
#   bash benchmarks/h200_session.sh [tests|conformance|bench|all]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/portattn-out}
mkdir -p "$OUT"
what=${1:-all}
PY=python3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
$PY -m portattn.cli info > "$OUT/info.txt" 2>&1; tail -25 "$OUT/info.txt"

if [[ $what == all || $what == tests ]]; then
  t0=$(date +%s)
  $PY -m pytest -q -p no:cacheprovider -n 6 tests/test_triton.py tests/test_cupy.py tests/test_sdpa.py \
      tests/test_dispatch.py tests/test_compile.py -rfEs 2>&1 | tail -60 > "$OUT/pytest_gpu.txt"
  echo "== GPU tests ($(( $(date +%s) - t0 ))s):"; tail -8 "$OUT/pytest_gpu.txt"
fi
if [[ $what == properties ]]; then
  PORTATTN_HYPOTHESIS_PROFILE=${PROFILE:-ci} $PY -m pytest -q -p no:cacheprovider -n 6 tests/test_properties.py \
      -rfE 2>&1 | tail -40 > "$OUT/pytest_properties.txt"; tail -8 "$OUT/pytest_properties.txt"
fi
if [[ $what == all || $what == conformance ]]; then
  t0=$(date +%s)
  $PY -m portattn.cli conformance run --devices cuda --no-progress --out "$OUT/conformance-h200.json" \
      > "$OUT/conformance.txt" 2>&1
  echo "== conformance rc=$? ($(( $(date +%s) - t0 ))s):"; tail -30 "$OUT/conformance.txt"
fi
if [[ $what == all || $what == bench ]]; then
  t0=$(date +%s)
  $PY benchmarks/bench_attention.py --backends triton,cupy --out "$OUT" > "$OUT/bench.txt" 2>&1
  echo "== bench rc=$? ($(( $(date +%s) - t0 ))s):"; tail -25 "$OUT/bench.txt"
fi
