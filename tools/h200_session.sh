#!/usr/bin/env bash
# One GPU session on the H200 (device tool), in two calls of under ten minutes each:
#   bash tools/h200_session.sh verify   # GPU tests and the whole conformance catalogue, side by side
#   bash tools/h200_session.sh bench    # the shared benchmark alone (timings), then the GPU property profile
#   PREV=report.json bash tools/h200_session.sh reverify   # after a float32-path change (below)
#   PROFILE=ci bash tools/h200_session.sh properties       # the Hypothesis suite on cpu and cuda
#   bash tools/h200_session.sh tests        # the GPU tests alone (every file with GPU parts)
#   bash tools/h200_session.sh wave2bench   # call-path overhead, the decode grid, the fastest policy
#   PREV=report.json bash tools/h200_session.sh wave2final   # GPU tests + the cases PREV did not run
#       (and triton's quick subset again) side by side, one merged report, then wave2bench
#   bash tools/h200_session.sh bwdsweep     # triton tile sweep + its GPU tests + ncu (AFTER: one more step)
#   PREV=benchmarks/results/conformance-h200.json bash tools/h200_session.sh leftover
#       # what the last session could not run: the transformers-on-triton model tests, then the
#       # catalogue cases PREV lacks (wave2final's merge), then the decode grid with the fast launch
#   bash tools/h200_session.sh callpath    # the call-path / decode call: transformers-on-triton and the
#       call-path GPU tests side by side, then alone on the GPU: the launcher check, the overhead table
#       and the decode tile sweep; everything but the summaries in $OUT/results.tgz
#   bash tools/h200_session.sh final3   # the session's last call: decode + triton GPU tests and the
#       catalogue's headdim and KV-cache cases side by side, then alone: the decode grid, the overhead
#       table and the fastest policy's quick grid
#   bash tools/h200_session.sh policy   # the fastest policy's quick grid and the overhead table
#   PREV=benchmarks/results/conformance-h200.json bash tools/h200_session.sh fwdsweep
#       # the TMA/prepared GPU tests and the catalogue cases PREV lacks side by side (one merged
#       # report), then alone: the triton forward sweep (--fwd-only) and the overhead table
#   bash tools/h200_session.sh s4fastest   # triton's D 129-256 and headdim catalogue cases (the D256
#       TMA row), the TMA tests and the compile warm-up side by side, then alone: the fastest
#       policy's full grid
#   bash tools/h200_session.sh s4variants  # the helpers' variant sweeps in one call: GPU tests of the
#       split backward / decode variants / cupy beside the compiles, then alone: the triton backward
#       sweep, the decode variants, the cupy forward check, the fastest policy's re-checked cells
#   bash tools/h200_session.sh s4final     # the rows picked from s4variants: triton's D 256 catalogue
#       cases, the KV-cache catalogue and the GPU tests side by side, then alone: the cupy forward
#       check (kernels after the prologue fold, the K/V double buffer), the fastest policy's
#       re-checked cells and the D 256 training cells
#   bash tools/h200_session.sh s5verify    # the checks the fourth session could not run: cupy's whole
#       catalogue (kernels after the prologue fold), the moved graph-capture test and the tuning GPU
#       tests beside the fastest grid's compiles, then alone: the fastest policy's full grid with the
#       second look
#   bash tools/h200_session.sh s5atomic    # triton's atomic dQ: its GPU tests and catalogue cases (16-bit
#       core, features, varlen), the decode GPU tests, cupy's six large cases side by side; then alone:
#       the atomic-dQ backward sweep and the fastest policy's re-checked cells with the host overhead
#   bash tools/h200_session.sh s5wgmma     # cupy's sm_90a wgmma forward: tools/cupy_wgmma_check.py (compile
#       and SASS report, layout probe, numerics against float64, its GPU tests, the warp-specialised
#       variant in a child process, timings beside mma.sync, FA2 and cuDNN)
#   bash tools/h200_session.sh s6apply     # the sweep's atomic-dQ defaults (D 128/256) and cupy's wgmma
#       forward under auto: triton's and cupy's catalogue shards, the atomic-dQ fault diagnosis
#       (tools/triton_atomic_diag.py), the atomic GPU tests alone and the other GPU tests, the
#       compile warm-up side by side; then alone: the fastest policy's full grid
#   bash tools/h200_session.sh s6bench     # the training grid (portattn bench) after the warm-up
#   bash tools/h200_session.sh s7verify    # what the sixth session could not run with its defaults (atomic dQ
#       at D 128/256, cupy's wgmma forward): the rest of triton's and cupy's catalogue, tests/test_cupy.py's
#       and the atomic-dQ GPU tests, the atomic diagnosis with --narrow (the padded accumulator), side by side
#   bash tools/h200_session.sh s7fastest   # the fastest policy's full grid with ~20 ms samples (alone, ~450 s)
#   bash tools/h200_session.sh s8final     # the Gluon GPU tests (default path too), the atomic diagnosis --narrow,
#       then alone the fastest policy on the D 128 forward cells and the two D 256 S16k fwd+bwd cells
#   bash tools/h200_session.sh s7gluon     # the Gluon forward (issue #14): its GPU tests, then
#       tools/triton_gluon_check.py (compile report, numerics in a child with a timeout, timings)
# Runs from the source tree (PYTHONPATH, no install). Everything lands under $OUT in few files
# (the device tool brings back at most 8); the last lines printed are the summaries.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/portattn-out}
LIMIT=${LIMIT:-430}          # seconds each parallel part may run
mkdir -p "$OUT"
what=${1:-verify}
# the test files with GPU parts (the rest of the suite is CPU-only and runs in CI)
GPU_TESTS=${GPU_TESTS:-$(ls tests/test_triton.py tests/test_cupy.py tests/test_sdpa.py tests/test_dispatch.py \
    tests/test_compile.py tests/test_cuda_graph.py tests/test_lse_grad.py tests/test_call_path.py \
    tests/test_kvcache*.py tests/test_transformers*.py tests/test_sdpa_kernels.py tests/test_tuning.py \
    tests/test_cu_seqlens_safety.py tests/test_distributed.py tests/test_compat_*.py tests/test_chunked.py 2>/dev/null)}
PY=python3
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv; $PY -m portattn.cli info; } \
    > "$OUT/env.txt" 2>&1
tail -12 "$OUT/env.txt"

# Conformance shards run side by side (triton's JIT compiles dominate, ~5 s a case, and use the CPU
# cores); a shard stopped by `timeout` still writes the cases it finished ("interrupted").
shards=/tmp/portattn-shards
run_shard() {  # name, then conformance-run arguments
  local name=$1; shift
  timeout "$LIMIT" $PY -m portattn.cli conformance run --devices cuda --no-progress \
      --out "$shards/$name.json" "$@" > "$shards/$name.log" 2>&1
  echo "shard $name rc=$? ($(( $(date +%s) - t0 ))s)" >> "$shards/rc.txt"
}
merge_shards() {  # the merged report's file name under $OUT
  { cat "$shards/rc.txt"; for f in "$shards"/*.log; do echo "=== $f"; tail -40 "$f"; done; } > "$OUT/conformance_shards.txt"
  $PY -m portattn.cli conformance merge "$shards"/*.json --out "$OUT/$1" > "$OUT/conformance.txt" 2>&1
  echo "== conformance merge rc=$? ($(( $(date +%s) - t0 ))s):"; cat "$shards/rc.txt"; tail -40 "$OUT/conformance.txt"
}

run_properties() {  # seconds; SIGINT at the limit so that pytest still prints its failures
  PORTATTN_HYPOTHESIS_PROFILE=${PROFILE:-ci} timeout -s INT -k 30 "$1" $PY -m pytest -q -p no:cacheprovider \
      -n "${WORKERS:-8}" tests/test_properties.py -rfE --tb=short > "$OUT/pytest_properties_gpu.txt" 2>&1
  echo "== properties (${PROFILE:-ci} profile) rc=$? :"; grep -v "Warning\|warner" "$OUT/pytest_properties_gpu.txt" | tail -60
}

if [[ $what == verify ]]; then
  t0=$(date +%s)
  rm -rf "$shards"; mkdir -p "$shards"
  # GPU tests: triton/cupy/sdpa at real sizes, dispatch, torch.compile (4 workers)
  # shellcheck disable=SC2086  # GPU_TESTS: one word per test file
  # -v: one line per test, so a run stopped at its limit still says which tests failed
  timeout -s INT -k 20 "$LIMIT" $PY -m pytest -v --tb=short -p no:cacheprovider -n "${WORKERS:-4}" $GPU_TESTS -rfEs \
      > "$OUT/pytest_gpu.txt" 2>&1 &
  # the catalogue: the fast backends over every case in one process, triton in nine shards
  run_shard others --backends reference sdpa cupy onnx &
  # (globs: a plain pattern matches anywhere in the id, so 'varlen/' would also take large/varlen/...)
  run_shard t-c16 --backends triton --cases 'core/fp16/*' &
  run_shard t-cb16 --backends triton --cases 'core/bf16/*' &
  run_shard t-c32 --backends triton --cases 'core/fp32/*' &
  run_shard t-large --backends triton --cases 'large/*' &
  run_shard t-values --backends triton --cases 'values/*' 'softcap/*' &
  run_shard t-headdim --backends triton --cases 'headdim/*' &
  run_shard t-varlen --backends triton --cases 'varlen/*' 'gqa/*' 'layout/*' 'masked/*' &
  run_shard t-bias --backends triton --cases 'bias/*' 'alibi/*' &
  run_shard t-window --backends triton --cases 'window/*' 'combo/*' &
  wait
  echo "== GPU tests:"; grep -E "(FAILED|ERROR) tests" "$OUT/pytest_gpu.txt" | sort -u | head -40; tail -3 "$OUT/pytest_gpu.txt"
  merge_shards conformance-h200.json
fi

if [[ $what == reverify ]]; then
  # after a float32-path kernel change: the GPU tests of the two kernel backends, cupy over the
  # whole catalogue, and triton over every float32 case plus those PREV did not run, in shards
  # balanced by PREV's per-case seconds (tools/plan_shards.py)
  t0=$(date +%s)
  rm -rf "$shards"; mkdir -p "$shards"
  PREV=${PREV:?set PREV to the previous conformance report}
  timeout "$LIMIT" $PY -m pytest -q -p no:cacheprovider -n 3 tests/test_triton.py tests/test_cupy.py -rfEs \
      > "$OUT/pytest_gpu.txt" 2>&1 &
  run_shard others --backends reference cupy &
  while read -r name ids; do
    # shellcheck disable=SC2086  # ids: one word per case id
    run_shard "t-$name" --backends triton --cases $ids &
  done < <($PY tools/plan_shards.py "$PREV" --backend triton --dtype float32 --shards "${SHARDS:-11}")
  wait
  echo "== GPU tests:"; tail -25 "$OUT/pytest_gpu.txt"
  merge_shards conformance-h200-reverify.json
fi

if [[ $what == final ]]; then
  # the triton cases the first call's shards did not finish (its JIT compiles dominate: 8 shards,
  # nothing else running), then the quick benchmark alone on the GPU
  t0=$(date +%s)
  rm -rf "$shards"; mkdir -p "$shards"
  LIMIT=${CONF_LIMIT:-270}
  run_shard c16 --backends triton --cases 'core/fp16/*' & run_shard cb16 --backends triton --cases 'core/bf16/*' &
  run_shard c32 --backends triton --cases 'core/fp32/*' & run_shard val --backends triton --cases 'values/*' &
  run_shard hd --backends triton --cases 'headdim/*' & run_shard bias --backends triton --cases 'bias/*' 'alibi/*' &
  run_shard win --backends triton --cases 'window/*' 'combo/*' & run_shard cap --backends triton --cases 'softcap/*' &
  wait
  merge_shards conformance-h200-triton-rest.json
  t1=$(date +%s)
  timeout "${BENCH_LIMIT:-200}" $PY benchmarks/bench_attention.py --quick --backends triton,cupy --out "$OUT" \
      > "$OUT/bench.txt" 2>&1
  echo "== bench rc=$? ($(( $(date +%s) - t1 ))s):"; tail -22 "$OUT/bench.txt"
fi

if [[ $what == bench ]]; then
  t0=$(date +%s)
  timeout "${BENCH_LIMIT:-400}" $PY benchmarks/bench_attention.py --backends triton,cupy --out "$OUT" > "$OUT/bench.txt" 2>&1
  echo "== bench rc=$? ($(( $(date +%s) - t0 ))s):"; tail -30 "$OUT/bench.txt"
  left=$(( ${TOTAL:-540} - ($(date +%s) - t0) ))
  if (( left > 60 )); then
    PROFILE=gpu run_properties $(( left - 15 ))
  fi
fi

if [[ $what == tests ]]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -s INT -k 20 "${TEST_LIMIT:-400}" $PY -m pytest -v --tb=short -p no:cacheprovider -n "${WORKERS:-8}" $GPU_TESTS -rfEs \
      > "$OUT/pytest_gpu.txt" 2>&1
  echo "== GPU tests rc=$? ($(( $(date +%s) - t0 ))s):"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head -40
  tail -3 "$OUT/pytest_gpu.txt"
fi

if [[ $what == callpath ]]; then
  t0=$(date +%s)
  R=$OUT/r; mkdir -p "$R"; cp "$OUT/env.txt" "$R/"
  # 1. tests, side by side (compile-bound): the transformers models on triton (bf16, float32), and
  #    the GPU parts of the call path, the launcher, CUDA graphs, lse gradients and decoding
  timeout -s INT -k 20 "${TEST_LIMIT:-280}" $PY -m pytest -v --tb=short -p no:cacheprovider -n 5 \
      tests/test_transformers.py -k cuda_triton -rfEs > "$R/pytest_transformers_triton.txt" 2>&1 &
  timeout -s INT -k 20 "${TEST_LIMIT:-280}" $PY -m pytest -v --tb=short -p no:cacheprovider -n 6 \
      tests/test_call_path.py tests/test_callcache.py tests/test_triton_launcher.py tests/test_cuda_graph.py \
      tests/test_lse_grad.py tests/test_kvcache_gpu.py tests/test_sdpa.py tests/test_host_overhead.py \
      "tests/test_triton.py::test_gpu_prepared_launch_is_bit_identical_to_the_full_path" -rfEs \
      > "$R/pytest_gpu.txt" 2>&1 &
  wait
  echo "== tests done ($(( $(date +%s) - t0 ))s)"
  for f in pytest_transformers_triton pytest_gpu; do
    echo "-- $f:"; grep -E "(FAILED|ERROR) tests" "$R/$f.txt" | sort -u | head -20; tail -2 "$R/$f.txt"; done
  # 2. timings, alone on the GPU
  $PY tools/gpu_launcher_check.py --out "$R" > "$R/launcher_check.log" 2>&1
  echo "== launcher check rc=$? ($(( $(date +%s) - t0 ))s)"; tail -22 "$R/launcher_check.log"
  $PY benchmarks/overhead.py --out "$R" > "$R/overhead.log" 2>&1
  echo "== overhead rc=$? ($(( $(date +%s) - t0 ))s)"; tail -28 "$R/overhead.log"
  timeout -s INT -k 10 "${SWEEP_LIMIT:-175}" $PY tools/decode_sweep.py --out "$R" --time-limit "${SWEEP_TIME:-150}" \
      > "$R/decode_sweep.log" 2>&1
  echo "== decode sweep rc=$? ($(( $(date +%s) - t0 ))s)"; tail -45 "$R/decode_sweep.log"
  tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
fi

if [[ $what == policy ]]; then
  t0=$(date +%s)
  R=$OUT/r; mkdir -p "$R"; cp "$OUT/env.txt" "$R/"
  timeout -s INT -k 10 "${FASTEST_LIMIT:-175}" $PY benchmarks/bench_fastest.py --quick --out "$R" --time-limit 145 \
      > "$R/fastest.log" 2>&1
  echo "== fastest quick rc=$? ($(( $(date +%s) - t0 ))s)"; tail -14 "$R/fastest.log"
  $PY benchmarks/overhead.py --out "$R" > "$R/overhead.log" 2>&1
  echo "== overhead rc=$? ($(( $(date +%s) - t0 ))s)"; grep -E "target|us/call" "$R/overhead.log"
  tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
fi

if [[ $what == final3 ]]; then
  t0=$(date +%s)
  R=$OUT/r; mkdir -p "$R"; cp "$OUT/env.txt" "$R/"
  rm -rf "$shards"; mkdir -p "$shards"
  timeout -s INT -k 20 "${TEST_LIMIT:-130}" $PY -m pytest -v --tb=short -p no:cacheprovider -n 6 \
      tests/test_kvcache_gpu.py tests/test_kvcache.py tests/test_triton.py -k "gpu or cuda or paged or decode_shaped" -rfEs \
      > "$R/pytest_gpu.txt" 2>&1 &
  LIMIT=${CONF_LIMIT:-130}
  run_shard t-headdim --backends triton --cases 'headdim/*' 'large/headdim/*' &
  timeout "$LIMIT" $PY -m portattn.conformance.kvcache --backends triton,sdpa,reference --devices cuda \
      --json "$R/conformance-kvcache-h200.json" > "$R/conformance_kvcache.txt" 2>&1 &
  wait
  echo "== GPU tests ($(( $(date +%s) - t0 ))s):"; grep -E "(FAILED|ERROR) tests" "$R/pytest_gpu.txt" | sort -u | head
  tail -2 "$R/pytest_gpu.txt"
  cp "$shards"/*.json "$R/" 2>/dev/null
  { cat "$shards/rc.txt"; for f in "$shards"/*.log; do echo "=== $f"; tail -12 "$f"; done; } > "$R/conformance_shards.txt"
  echo "== conformance ($(( $(date +%s) - t0 ))s):"; cat "$shards/rc.txt"; grep -h "passed," "$shards"/*.log
  tail -4 "$R/conformance_kvcache.txt"
  timeout -s INT -k 10 "${DECODE_LIMIT:-190}" $PY benchmarks/bench_decode.py --no-eager --out "$R" > "$R/bench_decode.log" 2>&1
  echo "== decode grid rc=$? ($(( $(date +%s) - t0 ))s)"; tail -40 "$R/bench_decode.log"
  $PY benchmarks/overhead.py --out "$R" > "$R/overhead.log" 2>&1
  echo "== overhead rc=$? ($(( $(date +%s) - t0 ))s)"; grep -E "target" "$R/overhead.log"
  timeout -s INT -k 10 "${FASTEST_LIMIT:-155}" $PY benchmarks/bench_fastest.py --quick --out "$R" --time-limit 130 \
      > "$R/fastest.log" 2>&1
  echo "== fastest quick rc=$? ($(( $(date +%s) - t0 ))s)"; tail -30 "$R/fastest.log"
  tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
fi

if [[ $what == fwdsweep ]]; then
  t0=$(date +%s)
  PREV=${PREV:?set PREV to the previous conformance report}
  R=$OUT/r; mkdir -p "$R"; cp "$OUT/env.txt" "$R/"
  rm -rf "$shards"; mkdir -p "$shards"
  timeout -s INT -k 20 "${TEST_LIMIT:-200}" $PY -m pytest -v --tb=short -p no:cacheprovider -n 3 tests/test_triton.py \
      -k "gpu_tma or gpu_prepared" -rfEs > "$R/pytest_gpu_tma.txt" 2>&1 &
  mapfile -t missing < <($PY - "$PREV" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
ran = {(r["case"], r["backend"]) for r in report["results"]}
from portattn.conformance.catalogue import build_catalogue
cat = build_catalogue()
ids = [c.id for c in cat if (c.id, "triton") not in ran]
for part in range(4):
    print(" ".join(ids[part::4]))
print(" ".join(c.id for c in cat if (c.id, "cupy") not in ran))
PYEOF
)
  LIMIT=${CONF_LIMIT:-190}
  for i in 0 1 2 3; do
    # shellcheck disable=SC2086  # one word per case id
    [[ -n ${missing[$i]:-} ]] && run_shard "rest$i" --backends triton --cases ${missing[$i]} &
  done
  # shellcheck disable=SC2086
  [[ -n ${missing[4]:-} ]] && run_shard others --backends reference sdpa cupy --cases ${missing[4]} &
  wait
  echo "== TMA/prepared GPU tests ($(( $(date +%s) - t0 ))s):"; grep -E "(FAILED|ERROR) tests" "$R/pytest_gpu_tma.txt" | sort -u
  tail -2 "$R/pytest_gpu_tma.txt"
  # PREV without the (case, backend@device) pairs the shards ran again (a case it had stopped in)
  $PY - "$PREV" "$shards" <<'PYEOF'
import glob, json, sys
prev, shards = sys.argv[1], sys.argv[2]
again = {(r["case"], r["backend"], r["device"]) for f in glob.glob(f"{shards}/*.json")
         for r in json.load(open(f))["results"]}
report = json.load(open(prev))
report["results"] = [r for r in report["results"] if (r["case"], r["backend"], r["device"]) not in again]
json.dump(report, open(f"{shards}/prev.json", "w"))
PYEOF
  { cat "$shards/rc.txt"; for f in "$shards"/*.log; do echo "=== $f"; tail -30 "$f"; done; } > "$R/conformance_shards.txt"
  $PY -m portattn.cli conformance merge "$shards"/*.json --out "$R/conformance-h200.json" > "$R/conformance.txt" 2>&1
  echo "== conformance merge rc=$? ($(( $(date +%s) - t0 ))s):"; cat "$shards/rc.txt"; tail -6 "$R/conformance.txt"
  timeout -s INT -k 10 "${SWEEP_LIMIT:-250}" $PY tools/triton_sweep.py --fwd-only --out "$R" --time-limit "${SWEEP_TIME:-200}" \
      > "$R/fwd_sweep.log" 2>&1
  echo "== forward sweep rc=$? ($(( $(date +%s) - t0 ))s)"; tail -45 "$R/triton_fwd_sweep.txt"
  $PY benchmarks/overhead.py --out "$R" > "$R/overhead.log" 2>&1
  echo "== overhead rc=$? ($(( $(date +%s) - t0 ))s)"; grep -E "target|per call|x torch" "$R/overhead.log" | tail -24
  tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
fi

if [[ $what == leftover ]]; then
  t0=$(date +%s)
  timeout -s INT -k 20 "${TEST_LIMIT:-200}" $PY -m pytest -v --tb=short -p no:cacheprovider -n 4 \
      tests/test_transformers.py -k cuda_triton -rfEs > "$OUT/pytest_transformers_triton.txt" 2>&1
  echo "== transformers on triton rc=$? ($(( $(date +%s) - t0 ))s):"; tail -3 "$OUT/pytest_transformers_triton.txt"
  GPU_TESTS="tests/test_onnx_kvcache.py tests/test_kvcache_gpu.py" TEST_LIMIT=${REST_TEST_LIMIT:-200} \
      DECODE_ARGS=${DECODE_ARGS:---no-sweep} what=wave2final
fi

if [[ $what == wave2final ]]; then
  t0=$(date +%s)
  PREV=${PREV:?set PREV to the previous conformance report}
  rm -rf "$shards"; mkdir -p "$shards" /tmp/portattn-quick
  # shellcheck disable=SC2086
  timeout -s INT -k 20 "${TEST_LIMIT:-240}" $PY -m pytest -v --tb=short -p no:cacheprovider -n "${WORKERS:-6}" \
      $GPU_TESTS -rfEs > "$OUT/pytest_gpu.txt" 2>&1 &
  mapfile -t missing < <($PY - "$PREV" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
ran = {(r["case"], r["backend"]) for r in report["results"]}
from portattn.conformance.catalogue import build_catalogue
ids = [c.id for c in build_catalogue() if (c.id, "triton") not in ran]
for part in range(4):
    print(" ".join(ids[part::4]))
PYEOF
)
  LIMIT=${CONF_LIMIT:-240}
  for i in 0 1 2 3; do
    # shellcheck disable=SC2086  # one word per case id
    [[ -n ${missing[$i]:-} ]] && run_shard "rest$i" --backends triton --cases ${missing[$i]} &
  done
  timeout "$LIMIT" $PY -m portattn.cli conformance run --devices cuda --no-progress --quick --backends triton \
      --out /tmp/portattn-quick/quick-triton.json > /tmp/portattn-quick/quick-triton.log 2>&1 &
  wait
  echo "== GPU tests ($(( $(date +%s) - t0 ))s):"; grep -E "(FAILED|ERROR) tests" "$OUT/pytest_gpu.txt" | sort -u | head -40
  tail -2 "$OUT/pytest_gpu.txt"
  echo "== triton quick subset again:"; tail -4 /tmp/portattn-quick/quick-triton.log
  $PY - "$PREV" "$shards" "$OUT/conformance-h200.json" > "$OUT/conformance.txt" 2>&1 <<'PYEOF'
import glob, json, sys
from portattn.conformance.runner import merge_reports, print_summary, write_report
prev, shard_dir, out = sys.argv[1:]
reports = [json.load(open(prev))] + [json.load(open(f)) for f in sorted(glob.glob(shard_dir + "/*.json"))]
seen = set()   # --cases patterns match by substring: a case can land in two shards; keep its first result
for r in reports:
    keep = []
    for res in r["results"]:
        key = (res["case"], res["backend"], res["device"])
        if key not in seen:
            seen.add(key)
            keep.append(res)
    r["results"] = keep
merged = merge_reports(reports)
done = {(r["case"], r["backend"]) for r in merged["results"]}
still = [c for c in merged.get("not_run", []) if (c, "triton") not in done]
if still:
    merged["interrupted"], merged["not_run"] = True, still
else:
    merged.pop("interrupted", None); merged.pop("not_run", None)
write_report(merged, out)
print_summary(merged)
print("not run:", still)
PYEOF
  echo "== conformance merge rc=$?:"; tail -12 "$OUT/conformance.txt"
  cat "$shards"/*.log > /tmp/portattn-quick/shards.log 2>/dev/null
  W=/tmp/portattn-wave2; rm -rf "$W"; mkdir -p "$W"; cp -r /tmp/portattn-quick "$W/"
  what=wave2bench KEEP_W=1
fi

if [[ $what == wave2bench ]]; then
  # each part bounded; what a part printed last is its summary. The benchmarks write many
  # files (JSON, PNG, tables): they go to $W and come back as one archive (the device tool
  # returns at most 8 files).
  W=/tmp/portattn-wave2
  [[ -n ${KEEP_W:-} ]] || { rm -rf "$W"; mkdir -p "$W"; }
  t0=$(date +%s)
  timeout -s INT -k 10 "${OVERHEAD_LIMIT:-90}" $PY benchmarks/overhead.py --out "$W" > "$OUT/overhead.txt" 2>&1
  echo "== overhead rc=$? ($(( $(date +%s) - t0 ))s):"; tail -30 "$OUT/overhead.txt"
  t1=$(date +%s)
  timeout -s INT -k 10 "${DECODE_LIMIT:-240}" $PY benchmarks/bench_decode.py --out "$W" ${DECODE_ARGS:-} \
      > "$OUT/decode.txt" 2>&1
  echo "== decode rc=$? ($(( $(date +%s) - t1 ))s):"; tail -45 "$OUT/decode.txt"
  t2=$(date +%s)
  timeout -s INT -k 10 "${FASTEST_LIMIT:-200}" $PY benchmarks/bench_fastest.py --out "$W" ${FASTEST_ARGS:-} \
      > "$OUT/fastest.txt" 2>&1
  echo "== fastest rc=$? ($(( $(date +%s) - t2 ))s):"; tail -45 "$OUT/fastest.txt"
  tar czf "$OUT/wave2bench.tgz" -C "$W" . && ls -la "$W"
fi

if [[ $what == bwdsweep ]]; then
  # issue #14: the new backward's GPU tests and the quick catalogue beside the sweep's compiles
  # (they fill triton's cache, one process per head dim), then the timed sweep alone on the GPU,
  # then Nsight Compute on one forward+backward at D 128
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -s INT -k 20 "${TEST_LIMIT:-200}" $PY -m pytest -q --tb=short -p no:cacheprovider -n 4 \
      ${SWEEP_TESTS:-tests/test_triton.py tests/test_lse_grad.py tests/test_cuda_graph.py tests/test_cu_seqlens_safety.py} \
      -rfEs > "$OUT/pytest_gpu.txt" 2>&1 &
  timeout "${CONF_LIMIT:-200}" $PY -m portattn.cli conformance run --devices cuda --no-progress --quick \
      --backends triton --out "$OUT/conformance-quick-triton.json" > /tmp/conf-quick.log 2>&1 &
  for d in 64 128 256; do
    timeout 200 $PY tools/triton_sweep.py --compile-only --dims $d > /tmp/sweep-compile-$d.log 2>&1 &
  done
  wait
  echo "== GPU tests ($(( $(date +%s) - t0 ))s):"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head -30
  tail -2 "$OUT/pytest_gpu.txt"
  echo "== quick catalogue:"; tail -6 /tmp/conf-quick.log
  cat /tmp/sweep-compile-*.log > "$OUT/sweep_compile.txt"; grep FAILED "$OUT/sweep_compile.txt" | head -20
  t1=$(date +%s)
  timeout -s INT "${SWEEP_LIMIT:-200}" $PY tools/triton_sweep.py --out "$OUT" --time-limit $(( ${SWEEP_LIMIT:-200} - 20 )) \
      > "$OUT/sweep.txt" 2>&1
  echo "== sweep rc=$? ($(( $(date +%s) - t1 ))s):"; grep -v "^D.*FAILED" "$OUT/sweep.txt" | tail -22
  ncu_d=${NCU_D:-128}
  timeout 90 ncu --clock-control none --kernel-name regex:attn_ --launch-skip 4 --launch-count 4 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      $PY tools/ncu_attention.py --d "$ncu_d" --s 4096 > "$OUT/ncu_d$ncu_d.txt" 2>&1
  echo "== ncu D$ncu_d rc=$? ($(( $(date +%s) - t0 ))s total)"
  grep -E "attn_|Duration|Compute \(SM\) Thr|Memory Thr|Registers Per|Achieved Occ|Theoretical Occ" "$OUT/ncu_d$ncu_d.txt" | head -40
  if [[ -n ${AFTER:-} ]]; then   # one more step of this call (e.g. the fastest-policy benchmark)
    t2=$(date +%s); bash -c "$AFTER" > "$OUT/after.txt" 2>&1
    echo "== after rc=$? ($(( $(date +%s) - t2 ))s):"; tail -30 "$OUT/after.txt"
  fi
fi

if [[ $what == properties ]]; then
  # the property suite alone (PROFILE=ci: 25 derandomised examples a test; gpu: 300)
  run_properties "${LIMIT}"
fi

if [[ $what == s4fastest ]]; then
  # issue #14: the catalogue cases over D 128 (the D256 forward's TMA row) and the headdim cases
  # not run yet, the TMA tests, and the fastest grid's compiles (tools/warm_caches.py, one
  # process per head dim) side by side; then issue #15: the fastest policy's full grid, alone
  t0=$(date +%s); rm -rf "$shards"; mkdir -p "$shards"
  LIMIT=${CONF_LIMIT:-130}
  run_shard t-d256 --backends triton --cases 'large/headdim/*' 'large/fp16/*/d256' 'large/bf16/*/d256' &
  run_shard t-hd1 --backends triton --cases 'headdim/d40/*' 'headdim/d48/*' 'headdim/d57/*' 'headdim/d64/*' 'headdim/d72/*' &
  run_shard t-hd2 --backends triton --cases 'headdim/d80/*' 'headdim/d96/*' 'headdim/d100/*' 'headdim/d128/*' &
  run_shard t-hd3 --backends triton --cases 'headdim/*-dv*' 'headdim/d1/*' 'headdim/d3/*' 'headdim/d8/*' &
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -q --tb=short -p no:cacheprovider tests/test_triton.py -k "tma or prepared" \
      -rfEs > "$OUT/pytest_tma.txt" 2>&1 &
  for d in 64 128 256; do timeout "$LIMIT" $PY tools/warm_caches.py --d $d --dtype bf16 > /tmp/warm-$d.log 2>&1 & done
  wait
  merge_shards conformance-s4.json
  echo "== TMA tests:"; tail -3 "$OUT/pytest_tma.txt"; tail -2 /tmp/warm-*.log
  W=/tmp/portattn-fastest; rm -rf "$W"; mkdir -p "$W"
  t1=$(date +%s)
  timeout -s INT -k 10 "${FASTEST_LIMIT:-440}" $PY benchmarks/bench_fastest.py --full --out "$W" \
      --time-limit "${FASTEST_TIME:-420}" > "$OUT/fastest.txt" 2>&1
  echo "== fastest --full rc=$? ($(( $(date +%s) - t1 ))s):"; tail -70 "$OUT/fastest.txt"
  tar czf "$OUT/fastest.tgz" -C "$W" . && ls -la "$W"
fi

if [[ $what == s4variants ]]; then
  # issues #13, #14, #15, #16: every part bounded; results land in $W and come back as one archive
  W=/tmp/portattn-s4; rm -rf "$W"; mkdir -p "$W"
  t0=$(date +%s)
  timeout -s INT -k 10 "${TEST_LIMIT:-70}" $PY -m pytest -q --tb=short -p no:cacheprovider -n 3 \
      tests/test_decode_variants_gpu.py tests/test_triton_bwd_split.py tests/test_timing.py \
      ${CUPY_TESTS:-} -rfEs > "$W/pytest_gpu.txt" 2>&1 &
  [[ -n ${CUPY_PRE:-} ]] && { bash -c "$CUPY_PRE" > "$W/cupy_pre.txt" 2>&1 & }
  wait
  echo "== GPU tests ($(( $(date +%s) - t0 ))s):"; grep -E "^(FAILED|ERROR)" "$W/pytest_gpu.txt" | head -20; tail -1 "$W/pytest_gpu.txt"
  t1=$(date +%s)
  timeout -s INT -k 10 "${BWD_LIMIT:-165}" $PY tools/triton_sweep.py --bwd-variants --out "$W" \
      --time-limit $(( ${BWD_LIMIT:-165} - 10 )) > "$W/bwd_sweep_log.txt" 2>&1
  echo "== bwd sweep rc=$? ($(( $(date +%s) - t1 ))s):"; tail -40 "$W/triton_bwd_sweep.txt" 2>/dev/null || tail -20 "$W/bwd_sweep_log.txt"
  t2=$(date +%s)
  timeout -k 5 -s INT "${DEC_LIMIT:-130}" $PY tools/decode_variants.py --out "$W" --time-limit $(( ${DEC_LIMIT:-130} - 4 )) \
      > "$W/decode_variants_log.txt" 2>&1
  echo "== decode variants rc=$? ($(( $(date +%s) - t2 ))s):"; tail -40 "$W/decode-variants.txt" 2>/dev/null || tail -20 "$W/decode_variants_log.txt"
  if [[ -n ${CUPY_CMD:-} ]]; then
    t3=$(date +%s); bash -c "$CUPY_CMD" > "$W/cupy_log.txt" 2>&1
    echo "== cupy rc=$? ($(( $(date +%s) - t3 ))s):"; tail -30 "$W/cupy_log.txt"
  fi
  t4=$(date +%s)
  timeout -s INT -k 10 "${FASTEST_LIMIT:-70}" $PY benchmarks/bench_fastest.py --out "$W" --tag h200-recheck \
      --time-limit $(( ${FASTEST_LIMIT:-70} - 8 )) --cells 'D128 S1k causal fwd' 'D64 S4k causal fwd+bwd' \
      'decode Sq1 B1 Sk8k fwd' 'decode Sq8 B8 Sk8k fwd' 'D128 S1k fwd+bwd' 'D256 S1k causal fwd+bwd' 'D128 S4k fwd' \
      > "$W/fastest_recheck_log.txt" 2>&1
  echo "== fastest re-check rc=$? ($(( $(date +%s) - t4 ))s):"; tail -16 "$W/fastest_recheck_log.txt"
  tar czf "$OUT/s4variants.tgz" -C "$W" . ; ls "$W"; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s4final ]]; then
  W=/tmp/portattn-s4f; rm -rf "$W" "$shards"; mkdir -p "$W" "$shards"
  t0=$(date +%s)
  LIMIT=${CONF_LIMIT:-110}
  run_shard t-d256 --backends triton --cases 'large/headdim/*' 'large/fp16/*/d256' 'large/bf16/*/d256' &
  timeout "$LIMIT" $PY -m portattn.conformance.kvcache --devices cuda --backends triton \
      --json "$W/conformance-kvcache.json" > "$W/conformance-kvcache.txt" 2>&1 &
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -q --tb=short -p no:cacheprovider -n 3 \
      tests/test_decode_variants_gpu.py tests/test_triton_bwd_split.py tests/test_kvcache_gpu.py "tests/test_triton.py::test_gpu_tma_forward_matches_the_reference" \
      -rfEs > "$W/pytest_gpu.txt" 2>&1 &
  wait
  merge_shards conformance-d256.json; cp "$OUT/conformance-d256.json" "$W/" 2>/dev/null
  echo "== KV-cache conformance:"; tail -4 "$W/conformance-kvcache.txt"
  echo "== GPU tests ($(( $(date +%s) - t0 ))s):"; grep -E "^(FAILED|ERROR)" "$W/pytest_gpu.txt" | head -20; tail -1 "$W/pytest_gpu.txt"
  t1=$(date +%s)
  timeout -k 5 140 $PY tools/cupy_fwd_check.py --out "$W" --time-limit 130 > "$W/cupy_log.txt" 2>&1
  echo "== cupy check rc=$? ($(( $(date +%s) - t1 ))s):"; tail -40 "$W/cupy_fwd_check.txt" 2>/dev/null || tail -30 "$W/cupy_log.txt"
  t2=$(date +%s)
  timeout -s INT -k 10 "${FASTEST_LIMIT:-95}" $PY benchmarks/bench_fastest.py --out "$W" --tag h200-recheck \
      --time-limit $(( ${FASTEST_LIMIT:-95} - 10 )) --cells 'D128 S1k causal fwd' 'D64 S4k causal fwd+bwd' \
      'D128 S1k fwd+bwd' 'decode Sq8 B8 Sk8k fwd' > "$W/fastest_recheck_log.txt" 2>&1
  echo "== fastest re-check rc=$? ($(( $(date +%s) - t2 ))s):"; tail -14 "$W/fastest_recheck_log.txt"
  t3=$(date +%s)
  timeout -s INT -k 10 "${BENCH_LIMIT:-90}" $PY -m portattn.cli bench --backends triton --head-dims 256 --dtypes bf16 \
      --out "$W" --tag h200-d256 --time-limit $(( ${BENCH_LIMIT:-90} - 15 )) --no-progress-bar > "$W/bench_d256_log.txt" 2>&1
  echo "== bench D256 rc=$? ($(( $(date +%s) - t3 ))s):"; tail -22 "$W/bench_d256_log.txt"
  tar czf "$OUT/s4final.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s5verify ]]; then
  t0=$(date +%s); rm -rf "$shards"; mkdir -p "$shards"
  LIMIT=${CONF_LIMIT:-170}
  run_shard c-core --backends cupy reference --cases 'core/*' &
  run_shard c-large --backends cupy --cases 'large/*' &
  run_shard c-var --backends cupy --cases 'varlen/*' 'headdim/*' &
  run_shard c-rest --backends cupy --cases 'bias/*' 'window/*' 'nonfinite/*' 'values/*' 'softcap/*' 'gqa/*' \
      'layout/*' 'alibi/*' 'masked/*' 'combo/*' &
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -v --tb=short -p no:cacheprovider -n 2 tests/test_decode_variants_gpu.py \
      tests/test_kvcache_gpu.py tests/test_tuning.py -rfEs > "$OUT/pytest_gpu.txt" 2>&1 &
  for d in 64 128 256; do timeout "$LIMIT" $PY tools/warm_caches.py --d $d --dtype bf16 > /tmp/warm-$d.log 2>&1 & done
  wait
  merge_shards conformance-cupy-h200.json
  echo "== GPU tests:"; grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest_gpu.txt" | tail -8; tail -2 /tmp/warm-*.log
  W=/tmp/portattn-fastest; rm -rf "$W"; mkdir -p "$W"
  t1=$(date +%s)
  timeout -s INT -k 10 "${FASTEST_LIMIT:-380}" $PY benchmarks/bench_fastest.py --full --out "$W" \
      --time-limit "${FASTEST_TIME:-345}" > "$OUT/fastest.txt" 2>&1
  echo "== fastest --full rc=$? ($(( $(date +%s) - t1 ))s):"; tail -62 "$OUT/fastest.txt"
  tar czf "$OUT/fastest.tgz" -C "$W" . && ls -la "$W"; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s5atomic ]]; then
  t0=$(date +%s); rm -rf "$shards"; mkdir -p "$shards"
  LIMIT=${CONF_LIMIT:-170}
  run_shard t-fp16 --backends triton --cases 'core/fp16/*' &
  run_shard t-bf16 --backends triton --cases 'core/bf16/*' &
  run_shard t-feat --backends triton --cases 'gqa/*' 'window/*' 'softcap/*' 'alibi/*' &
  run_shard t-var --backends triton --cases 'varlen/*' 'masked/*' 'combo/*' &
  run_shard c-large --backends cupy --cases 'large/headdim/d192' 'large/headdim/d256' 'large/varlen/mixed' \
      'large/varlen/window-softcap' 'large/bias/float+grad' 'large/alibi/causal' &
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -v --tb=short -p no:cacheprovider -n 3 tests/test_triton_atomic_dq.py \
      tests/test_triton.py::test_gpu_prepared_launch_is_bit_identical_to_the_full_path tests/test_decode_variants_gpu.py \
      tests/test_kvcache_gpu.py -rfEs > "$OUT/pytest_gpu.txt" 2>&1 &
  wait
  merge_shards conformance-s5atomic.json
  echo "== GPU tests:"; grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest_gpu.txt" | tail -8
  W=/tmp/portattn-s5; rm -rf "$W"; mkdir -p "$W"
  t1=$(date +%s)
  timeout -s INT -k 10 200 $PY tools/triton_sweep.py --bwd-variants --out "$W" --time-limit 185 > "$W/bwd_sweep_log.txt" 2>&1
  echo "== bwd sweep rc=$? ($(( $(date +%s) - t1 ))s):"; tail -45 "$W/triton_bwd_sweep.txt"
  t1=$(date +%s)
  timeout -s INT -k 10 100 $PY benchmarks/bench_fastest.py --out "$W" --time-limit 85 --tag h200-cells --cells \
      'decode Sq1 B1 Sk8k fwd' 'decode Sq1 B8 Sk8k fwd' 'D128 S1k causal fwd' 'D256 S1k causal fwd+bwd' > "$W/fastest_cells.txt" 2>&1
  echo "== fastest cells rc=$? ($(( $(date +%s) - t1 ))s):"; tail -16 "$W/fastest_cells.txt"
  tar czf "$OUT/s5atomic.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s5wgmma ]]; then
  t0=$(date +%s)
  W=/tmp/portattn-wgmma; rm -rf "$W"; mkdir -p "$W"
  timeout -s INT -k 10 170 $PY tools/cupy_wgmma_check.py --out "$W" --time-limit 150 > "$W/wgmma_log.txt" 2>&1
  echo "== wgmma check rc=$? ($(( $(date +%s) - t0 ))s):"; tail -60 "$W/wgmma_check.txt" 2>/dev/null || tail -60 "$W/wgmma_log.txt"
  tar czf "$OUT/s5wgmma.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s6apply ]]; then
  t0=$(date +%s); rm -rf "$shards"; mkdir -p "$shards"
  LIMIT=${CONF_LIMIT:-175}
  W=/tmp/portattn-s6; rm -rf "$W"; mkdir -p "$W"
  run_shard t-fp16 --backends triton --cases 'core/fp16/*' &
  run_shard t-bf16 --backends triton --cases 'core/bf16/*' 'headdim/*' &
  run_shard t-feat --backends triton --cases 'gqa/*' 'window/*' 'softcap/*' 'alibi/*' &
  run_shard t-var --backends triton --cases 'varlen/*' 'masked/*' 'combo/*' &
  run_shard c-core --backends cupy --cases 'core/*' &
  run_shard c-hd --backends cupy --cases 'headdim/*' 'gqa/*' 'window/*' 'varlen/*' 'large/headdim/*' &
  timeout -s INT -k 10 "$LIMIT" $PY tools/triton_atomic_diag.py --quick --jobs 4 --out "$W" > "$W/atomic_diag.txt" 2>&1 &
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -v --tb=short -p no:cacheprovider tests/test_triton_atomic_dq.py -rfEs \
      > "$W/pytest_atomic.txt" 2>&1 &
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -v --tb=short -p no:cacheprovider -n 2 tests/test_cupy_wgmma.py \
      tests/test_decode_variants_gpu.py tests/test_kvcache_gpu.py tests/test_compat_flash_attn.py \
      "tests/test_triton.py::test_gpu_prepared_launch_is_bit_identical_to_the_full_path" \
      "tests/test_triton.py::test_gpu_deterministic_20_runs" -rfEs > "$OUT/pytest_gpu.txt" 2>&1 &
  for d in 64 128 256; do timeout "$LIMIT" $PY tools/warm_caches.py --d $d --dtype bf16 > /tmp/warm-$d.log 2>&1 & done
  wait
  merge_shards conformance-s6apply.json
  echo "== atomic diag:"; tail -8 "$W/atomic_diag.txt"
  echo "== atomic GPU tests:"; grep -E "(FAILED|ERROR) tests|passed|failed" "$W/pytest_atomic.txt" | tail -12
  echo "== GPU tests:"; grep -E "(FAILED|ERROR) tests|passed|failed" "$OUT/pytest_gpu.txt" | tail -12
  t1=$(date +%s)
  timeout -s INT -k 10 "${FASTEST_LIMIT:-370}" $PY benchmarks/bench_fastest.py --full --out "$W" \
      --time-limit "${FASTEST_TIME:-335}" > "$W/fastest.txt" 2>&1
  echo "== fastest --full rc=$? ($(( $(date +%s) - t1 ))s):"; tail -40 "$W/fastest.txt"
  tar czf "$OUT/s6apply.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s6bench ]]; then
  t0=$(date +%s)
  W=/tmp/portattn-s6b; rm -rf "$W"; mkdir -p "$W"
  for d in 64 128 256; do for t in bf16 fp16; do
    timeout 120 $PY tools/warm_caches.py --d $d --dtype $t > /tmp/warm-$d-$t.log 2>&1 & done; done; wait
  echo "== warm-up ($(( $(date +%s) - t0 ))s)"; tail -q -n1 /tmp/warm-*.log
  t1=$(date +%s)
  timeout -s INT -k 10 "${BENCH_LIMIT:-330}" $PY -m portattn.cli bench --out "$W" --time-limit $(( ${BENCH_LIMIT:-330} - 20 )) \
      --no-progress-bar > "$W/bench_log.txt" 2>&1
  echo "== bench rc=$? ($(( $(date +%s) - t1 ))s):"; tail -50 "$W/bench_log.txt"
  tar czf "$OUT/s6bench.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s7verify ]]; then
  t0=$(date +%s); rm -rf "$shards"; mkdir -p "$shards"
  LIMIT=${CONF_LIMIT:-400}
  W=/tmp/portattn-s7; rm -rf "$W"; mkdir -p "$W"
  run_shard t-c32 --backends triton --cases 'core/fp32/*' &
  run_shard t-large --backends triton --cases 'large/*' &
  run_shard t-bias --backends triton --cases 'bias/*' 'values/*' 'layout/*' 'nonfinite/*' &
  run_shard t-feat --backends triton --cases 'gqa/*' 'window/*' 'softcap/*' 'alibi/*' 'masked/*' 'combo/*' &
  run_shard t-var --backends triton --cases 'varlen/*' 'headdim/*' &
  run_shard c-rest --backends cupy --cases 'bias/*' 'values/*' 'layout/*' 'nonfinite/*' 'softcap/*' 'alibi/*' \
      'masked/*' 'combo/*' 'large/*' &
  run_shard c-feat --backends cupy --cases 'gqa/*' 'window/*' 'varlen/*' &
  timeout -s INT -k 10 "$LIMIT" $PY tools/triton_atomic_diag.py --narrow --jobs 3 --out "$W" > "$W/atomic_diag.txt" 2>&1 &
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -v --tb=short -p no:cacheprovider tests/test_triton_atomic_dq.py -rfEs \
      > "$W/pytest_atomic.txt" 2>&1 &
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -v --tb=short -p no:cacheprovider -n 2 tests/test_cupy.py tests/test_cupy_wgmma.py \
      -rfEs > "$OUT/pytest_gpu.txt" 2>&1 &
  wait
  merge_shards conformance-s7verify.json
  echo "== atomic diag:"; tail -8 "$W/atomic_diag.txt"
  echo "== atomic GPU tests:"; grep -E "(FAILED|ERROR) tests|passed|failed" "$W/pytest_atomic.txt" | tail -12
  echo "== cupy GPU tests:"; grep -E "(FAILED|ERROR) tests|passed|failed" "$OUT/pytest_gpu.txt" | tail -12
  tar czf "$OUT/s7verify.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s7fastest ]]; then
  t0=$(date +%s)
  W=/tmp/portattn-s7f; rm -rf "$W"; mkdir -p "$W"
  for d in 64 128 256; do timeout "${WARM_LIMIT:-90}" $PY tools/warm_caches.py --d $d --dtype bf16 > /tmp/warm-$d.log 2>&1 & done; wait
  echo "== warm-up ($(( $(date +%s) - t0 ))s)"
  t1=$(date +%s)
  timeout -s INT -k 10 "${FASTEST_LIMIT:-480}" $PY benchmarks/bench_fastest.py --full --out "$W" \
      --time-limit "${FASTEST_TIME:-440}" > "$W/fastest.txt" 2>&1
  echo "== fastest --full rc=$? ($(( $(date +%s) - t1 ))s):"; tail -40 "$W/fastest.txt"
  tar czf "$OUT/s7fastest.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s7gluon ]]; then
  t0=$(date +%s)
  W=/tmp/portattn-s7g; rm -rf "$W"; mkdir -p "$W"
  timeout -s INT -k 10 "${GLUON_TEST_LIMIT:-240}" $PY -m pytest -v --tb=short -p no:cacheprovider tests/test_triton_gluon.py -rfEs \
      > "$W/pytest_gluon.txt" 2>&1
  echo "== gluon GPU tests rc=$? ($(( $(date +%s) - t0 ))s):"; grep -E "(FAILED|ERROR) tests|passed|failed" "$W/pytest_gluon.txt" | tail -12
  timeout -s INT -k 10 "${GLUON_LIMIT:-440}" $PY tools/triton_gluon_check.py --out "$W" --time-limit $(( ${GLUON_LIMIT:-440} - 40 )) \
      > "$W/gluon_log.txt" 2>&1
  echo "== gluon check rc=$? ($(( $(date +%s) - t0 ))s):"; tail -40 "$W/gluon_check.txt" 2>/dev/null || tail -40 "$W/gluon_log.txt"
  tar czf "$OUT/s7gluon.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi

if [[ $what == s8final ]]; then
  # after the Gluon default (D 128) and the no-prune second look: the Gluon GPU tests (the default
  # path included), the atomic diagnosis with --narrow and the compile warm-up side by side; then
  # alone: the fastest policy on the cells those changes touch and the two the full grid skipped
  t0=$(date +%s)
  W=/tmp/portattn-s8; rm -rf "$W"; mkdir -p "$W"
  LIMIT=${CONF_LIMIT:-150}
  timeout -s INT -k 10 "$LIMIT" $PY -m pytest -v --tb=short -p no:cacheprovider tests/test_triton_gluon.py -rfEs \
      > "$W/pytest_gluon.txt" 2>&1 &
  timeout -s INT -k 10 "$LIMIT" $PY tools/triton_atomic_diag.py --quick --narrow --jobs 3 --out "$W" \
      > "$W/atomic_diag.txt" 2>&1 &
  for d in 128 256; do timeout "$LIMIT" $PY tools/warm_caches.py --d $d --dtype bf16 > /tmp/warm-$d.log 2>&1 & done
  wait
  echo "== gluon GPU tests ($(( $(date +%s) - t0 ))s):"; grep -E "(FAILED|ERROR) tests|passed|failed" "$W/pytest_gluon.txt" | tail -8
  echo "== atomic diag:"; tail -6 "$W/atomic_diag.txt"
  t1=$(date +%s)
  timeout -s INT -k 10 "${FASTEST_LIMIT:-230}" $PY benchmarks/bench_fastest.py --out "$W" --tag h200-cells \
      --time-limit $(( ${FASTEST_LIMIT:-230} - 15 )) --cells 'D128 S1k fwd' 'D128 S1k causal fwd' 'D128 S4k fwd' \
      'D128 S4k causal fwd' 'D128 S16k fwd' 'D128 S16k causal fwd' 'D256 S16k fwd+bwd' 'D256 S16k causal fwd+bwd' \
      > "$W/fastest_cells.txt" 2>&1
  echo "== fastest cells rc=$? ($(( $(date +%s) - t1 ))s):"; tail -22 "$W/fastest_cells.txt"
  tar czf "$OUT/s8final.tgz" -C "$W" . ; echo "total $(( $(date +%s) - t0 ))s"
fi
