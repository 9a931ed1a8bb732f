#!/usr/bin/env bash
# One call of the H200 device tool (one shell command, at most 600 s, at most 8 files back from
# $OUT): the steps named on the command line, in that order, then everything packed into
# $OUT/results.tgz, $OUT/summary.txt and $OUT/env.txt (and $OUT/conformance-<GPU_TAG>.json: h200, h100...).
#
#   bash tools/h200_session.sh STEP[:ARG] ...           # one step after the other
#   bash tools/h200_session.sh par:STEP par:STEP STEP   # consecutive par: steps run side by side
#   DRY_RUN=1 bash tools/h200_session.sh STEP ...       # print each step's commands, run nothing
#
# Steps (* = may run side by side with par:; the others time things and run alone). Each has its
# own limit in seconds, NAME_LIMIT (default in brackets), cut to what is left of DEADLINE_S (560):
# no step starts after it (it is reported as skipped), so the packing ends inside the 600 s.
#   catalogue[:b,..]  * the whole conformance catalogue on cuda, merged into conformance-h200.json:
#                       triton (TRITON_SHARDS=9) and cupy (CUPY_SHARDS=3) in shards balanced by
#                       TIMES' per-case seconds (tools/plan_shards.py), reference, sdpa and onnx one
#                       process each; :b,.. or CATALOGUE_BACKENDS picks backends. PREV=report.json:
#                       only the cases PREV lacks, merged with PREV (tools/merge_shards.py; RERUN=1:
#                       every selected case again, the new results replacing PREV's);
#                       CASES='pat ..': only the cases matching these patterns; CONF_DEVICES=cpu
#                       runs it here [CONF_LIMIT 480]
#   tests[:g,..]      * pytest -v, one process per group [TESTS_LIMIT 400]: gpu (GPU_TESTS, the
#                       default), atomic, gluon, cupy, decode, callpath, transformers, or tests/ paths
#   warm[:d,..]       * tools/warm_caches.py per head dim (64,128,256) x WARM_DTYPES (bf16) [150]
#   atomicdiag        * tools/triton_atomic_diag.py $ATOMICDIAG_ARGS (--quick --narrow --jobs 3) [240]
#   kvcache           * the KV-cache conformance (python -m portattn.conformance.kvcache) [200]
#   properties        * the Hypothesis suite, PROFILE=ci (25 examples a test) | gpu (300) | nightly [300]
#   fastest[:cells]     benchmarks/bench_fastest.py --full; :quick; :inference or :training (one half of
#                       the grid, --part; bench_fastest.py --merge joins the two reports); or the cells
#                       given (comma-separated, here or in CELLS, e.g. 'D128 S1k fwd,D256 S16k fwd+bwd') [480]
#   bench               portattn bench, the training grid ($BENCH_ARGS); warm first [330]; the device copy's
#                       git metadata can be stale: give PORTATTN_BENCH_COMMIT=<this tree's commit>
#   decode              benchmarks/bench_decode.py ($DECODE_ARGS) [240]
#   overhead            benchmarks/overhead.py, then tools/gpu_launcher_check.py [150]
#   gluon               tools/triton_gluon_check.py: the Gluon forward's compile, numerics, timings [440]
#   gluonbwd            tools/triton_gluon_bwd_check.py: the opt-in Gluon backward's compile, gradients,
#                       timings; $GLUONBWD_ARGS (e.g. --quick) [260]
#   cupywgmma           tools/cupy_wgmma_check.py: cupy's sm_90a wgmma forward [300]
#   cupybwd             tools/cupy_wgmma_bwd_check.py, its backward, the other walk and tiles and the
#                       fused atomic dQ; $CUPYBWD_ARGS (e.g. --no-tests --timings-limit 200) [280]
#   cupyfwd             tools/cupy_fwd_check.py: cupy's mma.sync forward [140]
#   sweep[:v]           tools/triton_sweep.py: train (default; compiles per head dim first), fwd
#                       (--fwd-only), bwd (--bwd-variants); decode (tools/decode_sweep.py),
#                       decodevariants (tools/decode_variants.py) [250]
#   ncu[:D,..]          Nsight Compute (--clock-control none) on tools/ncu_attention.py --d D (128), one
#                       report per head dim; NCU_BACKEND (triton; cudnn, flash: torch SDPA's), NCU_S, NCU_CAUSAL=1,
#                       NCU_FWD_ONLY=1, NCU_SET=full, NCU_SOURCE=1 (+ per-SASS stall samples, a .csv) [90]
#
# The next session's plan, one device call a line (priority order; ~30 minutes in all; a fresh
# machine compiles from a cold cache, so give test groups whole calls; export PYTHONPATH=$PWD for
# tools run outside this script). The device tool lends an H100 or an H200 (either, call by call;
# every call of 2026-12-05's three sessions got an H100, and on the third most starts failed):
# time a change against main in the same call (tools/ab_session.sh); the report files carry the
# card's name (GPU_TAG), so an H100's results sit beside the H200's in benchmarks/results/.
# Branches are not kept between sessions: time an experiment in the session that builds it, or
# land it behind a switch.
#   triton, the short causal cells first (D 128 S 512 causal 0.61 x cuDNN): Nsight Compute kernel for kernel
#                                        # (ncu-h100-d128-s512-causal-source.txt, an H100, 2026-12-06) found the same
#                                        # launch, registers, shared memory and L2 hit rate as cuDNN's, but 9400 SASS
#                                        # instructions to its 1448 and 22 % of stall samples on instruction fetch (cuDNN
#                                        # 1.3 %): each consumer partition has its own copy of every stage (first tile,
#                                        # masked and unmasked band steps, last P V, epilogue) and a short item runs them
#                                        # all. Built, not yet timed: PORTATTN_TRITON_GLUON_ONE_STEP=1, the band after the
#                                        # first tile through one step with the mask behind a runtime branch (D 128 causal
#                                        # persistent SASS 9480 -> 6288 instructions). First call of the next session:
#   mkdir -p $OUT/sw; PYTHONPATH=. timeout 420 python3 tools/gluon_switch_check.py --env PORTATTN_TRITON_GLUON_ONE_STEP \
#     --settings 0,1 --out $OUT/sw --time-limit 300; PYTHONPATH=. python3 -m pytest -q -x tests/test_triton_gluon.py \
#     -k gpu_persistent_matches_reference   # + NCU_SOURCE=1 ... PORTATTN_TRITON_GLUON_ONE_STEP=1 ncu:128 to see no_inst fall
#                                        # then, if it pays: the first tile through the same step too, and ONE_STEP the
#                                        # default (catalogue + tests:gluon again). A deeper K/V ring did not help
#                                        # (ring-depth-h100.txt).
#   WARM_DTYPES="bf16 fp16" PORTATTN_BENCH_COMMIT=<hash> bash tools/h200_session.sh par:warm bench
#                                        # the grid on whichever card comes (warm 111 s + bench 129 s on an
#                                        # H100); on an H200 this refreshes bench-h200.* (4ce2745: before the
#                                        # D 64 consumer rows, the grouped causal walk, its pairs, the two Q
#                                        # buffers and D 256 persistent); bench-h100.* is from 2026-12-06, 37914f7
#   RERUN=1 CASES='large/hopper/*' bash tools/h200_session.sh par:catalogue:triton,reference,sdpa,cupy par:tests:gluon
#                                        # on an H200: the catalogue's 16 hopper cases (v8) and the Gluon tests
#                                        # (passed on an H100 with the current defaults, 2026-12-06; tests:gluon
#                                        # takes ~370 s on a cold machine); cupy / sdpa have not run v8's two new cases
#   triton, short causal sequences (#14's 0.8 x cuDNN at 512-1k): D 128 causal 512 runs 0.61 x. Nsight Compute
#                                        # (ncu_attention.py --d 128 --s 512 --causal --fwd-only, an H100, 2026-12-06):
#                                        # the persistent kernel at 49 % of DRAM bandwidth and 29 % of SM throughput,
#                                        # 0.40 eligible warps a scheduler, a third of stalls at CTA barriers (the
#                                        # epilogue's shared-memory store before the TMA store); cuDNN runs the cell at
#                                        # ~80 % of DRAM bandwidth. The SASS (triton 3.6, D 128 causal persistent)
#                                        # has a warpgroup BAR.SYNC before every one-thread mbarrier arrive (the
#                                        # ring's k/v_empty, the ping-pong turns) and around every wgmma wait: ~5 a
#                                        # key tile, so warps waiting on data show as barrier stalls. Leads: the first tile's S and the epilogue
#                                        # overlapped with the next item (FA3's epilogue under the next item's
#                                        # Q K^T), per-warpgroup skipping of a wholly masked diagonal key tile
#   D 64 causal 2k / 4k (0.82 / 0.87 x cuDNN, two consumers): the same leads; D 256 causal 512 (0.77)
#   PYTHONPATH=. python3 tools/bwd_group_check.py --out $OUT   # the Gluon backward's grouped causal walk on an
#                                        # H200 and at D 64 (an H100 timed 0.99-1.05 x, bwd-group-h100.txt;
#                                        # its GPU test, grouped vs one head bit for bit, passed on an H100)
#   cupy, #16's D 64 backward (0.85-0.94 x FA2): neither the producers' loads (0.98-1.00 x) nor own-keys dQ
#                                        # (0.85-0.96 x) paid; next is ping-pong between the consumer warpgroups
#                                        # (docs/cupy.md, What limits the backward)
# and e.g. after a partial catalogue:
#   PREV=benchmarks/results/conformance-h200.json bash tools/h200_session.sh catalogue:triton,cupy
#
# Runs from the source tree (PYTHONPATH, no install); locally too (OUT defaults to /tmp). Each
# step writes into its own folder of one work dir and prints a short summary as it ends (also
# appended to $OUT/summary.txt); the last lines printed are the summary of the whole call.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/portattn-out}
PY=${PY:-python3}
DEADLINE_S=${DEADLINE_S:-560}
DRY_RUN=${DRY_RUN:-}
# the card's short name in the report files (conformance-TAG.json, ...): the device tool lends an
# H100 or an H200, call by call; GPU_TAG overrides it, and h200 stands in where no GPU answers
GPU_TAG=${GPU_TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
                     | grep -oiE '[abhl][0-9]{2,3}[a-z]?' | head -1 | tr '[:upper:]' '[:lower:]')}
GPU_TAG=${GPU_TAG:-h200}
# per-case seconds for the shard plan: this card's report, else the H200's
TIMES=${TIMES:-$( [[ -f benchmarks/results/conformance-$GPU_TAG.json ]] && echo "benchmarks/results/conformance-$GPU_TAG.json" \
                  || echo benchmarks/results/conformance-h200.json)}
T0=$(date +%s)

STEPS="catalogue tests warm atomicdiag kvcache properties fastest bench decode overhead gluon gluonbwd cupywgmma cupybwd cupyfwd sweep ncu"
SIDE_BY_SIDE=" catalogue tests warm atomicdiag kvcache properties "

# the test files with GPU parts (the rest of the suite is CPU-only and runs in CI)
GPU_TESTS=${GPU_TESTS:-tests/test_triton.py tests/test_triton_*.py tests/test_cupy.py tests/test_cupy_wgmma*.py
tests/test_sdpa.py tests/test_sdpa_kernels.py tests/test_dispatch.py tests/test_compile.py tests/test_cuda_graph.py
tests/test_lse_grad.py tests/test_call_path.py tests/test_callcache.py tests/test_host_overhead.py tests/test_timing.py
tests/test_kvcache*.py tests/test_decode_variants_gpu.py tests/test_onnx_kvcache.py tests/test_transformers*.py
tests/test_tuning.py tests/test_cu_seqlens_safety.py tests/test_distributed.py tests/test_compat_*.py
tests/test_chunked.py}
declare -A TEST_GROUP=(
  [gpu]=$GPU_TESTS
  [atomic]="tests/test_triton_atomic_dq.py"
  [gluon]="tests/test_triton_gluon.py tests/test_triton_gluon_bwd.py"
  [cupy]="tests/test_cupy.py tests/test_cupy_wgmma*.py"
  [decode]="tests/test_kvcache_gpu.py tests/test_decode_variants_gpu.py tests/test_onnx_kvcache.py"
  [callpath]="tests/test_call_path.py tests/test_callcache.py tests/test_triton_launcher.py tests/test_cuda_graph.py
    tests/test_lse_grad.py tests/test_sdpa.py tests/test_host_overhead.py
    tests/test_triton.py::test_gpu_prepared_launch_is_bit_identical_to_the_full_path"
  [transformers]="tests/test_transformers.py -k cuda"
)
# pytest-xdist workers per group (TESTS_WORKERS overrides); atomic alone: a fault poisons a worker's context
declare -A TEST_WORKERS=([gpu]=6 [atomic]=0 [gluon]=2 [cupy]=2 [decode]=2 [callpath]=4 [transformers]=4)
SWEEPS=" train fwd bwd decode decodevariants "


# ----- helpers --------------------------------------------------------------------------------

now() { echo $(( $(date +%s) - T0 )); }

# limit SECONDS: a step's own limit, cut to what is left before DEADLINE_S (at least 5 s)
limit() {
  local left=$(( DEADLINE_S - $(now) ))
  (( left < 5 )) && left=5
  echo $(( $1 < left ? $1 : left ))
}

# inner LIMIT MARGIN: a tool's own --time-limit inside LIMIT (it writes its files in the margin)
inner() { echo $(( $1 > 2 * $2 ? $1 - $2 : $1 / 2 )); }

# split VAR TEXT: TEXT's words (split at commas, blanks, newlines; no glob expanded) into array VAR
split() { local -n _into=$1; IFS=$', \t\n' read -rd '' -a _into <<< "$2"; return 0; }

# test_args WORD...: pytest's arguments, a file glob (*) expanded (one matching nothing dropped)
test_args() {
  local w
  for w in "$@"; do if [[ $w == *\** ]]; then compgen -G "$w"; else echo "$w"; fi; done
}

# quote WORD...: the words as one would type them (single quotes around spaces and globs)
quote() {
  local a s=""
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then s+=" $a"; else s+=" '$a'"; fi
  done
  echo "${s# }"
}

# x LOG LIMIT CMD...: CMD with its output in LOG, stopped with SIGINT at LIMIT s (pytest, the
# catalogue and the benchmarks then still report what they did), killed 15 s later; under
# DRY_RUN printed instead. Returns CMD's status (124: stopped at the limit).
x() {
  local log=$1 lim=$2; shift 2
  if [[ -n $DRY_RUN ]]; then echo "+ timeout $lim $(quote "$@") > $log"; return 0; fi
  timeout -s INT -k 15 "$lim" "$@" > "$log" 2>&1
}

# bg CMD...: CMD in the background, for a `wait` (under DRY_RUN in the foreground, in order)
bg() { if [[ -n $DRY_RUN ]]; then "$@"; else "$@" & fi; }

# status_to FILE CMD...: CMD, then its status into FILE
status_to() { local f=$1; shift; "$@"; echo $? > "$f"; }

# why RC: what a status of 124 means
why() { [[ $1 == 124 ]] && echo " (stopped at its limit)"; return 0; }

# all_zero FILE...: whether every status file says 0
all_zero() { local f; for f in "$@"; do [[ $(cat "$f" 2>/dev/null) == 0 ]] || return 1; done; }

# show FILE [N]: its last N lines (a tool's report or log)
show() { [[ -s $1 ]] && tail -n "${2:-20}" "$1"; return 0; }

# headline TEXT: the step's line in the summary of the whole call (none when TEXT is empty)
headline() { [[ -n ${*// /} ]] && echo "=> $*"; return 0; }

# pytest_summary LOG: the failed and erroring tests, then pytest's count line
pytest_summary() {
  [[ -f $1 ]] || return 0
  grep -oE "(FAILED|ERROR) tests/[^ ]+" "$1" | sort -u | head -25
  grep -E "([0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran).* in [0-9.]+s" "$1" | tail -1 | tr -s '=' | sed 's/^= //; s/ =$//'
}

# tool DIR LIMIT MARGIN REPORT SCRIPT ARG...: a check/sweep script run with --out DIR and
# --time-limit LIMIT-MARGIN; then the tail of its REPORT (or of its log) and its VERDICT line
tool() {
  local dir=$1 lim=$2 margin=$3 report=$4 script=$5 rc; shift 5
  x "$dir/$(basename "$script" .py).log" "$lim" "$PY" "$script" "$@" --out "$dir" --time-limit "$(inner "$lim" "$margin")"
  rc=$?
  if [[ -s $dir/$report ]]; then show "$dir/$report" 40; else show "$dir/$(basename "$script" .py).log" 30; fi
  headline "$(grep -h "^VERDICT" "$dir/$report" 2>/dev/null | tail -1)"
  return "$rc"
}

# ----- steps: step_NAME DIR ARG; what it prints is its summary, its status the step's ----------

# shard DIR LIMIT NAME BACKEND [CASE-PATTERN...]: one `conformance run` process into DIR/NAME.json
# (a shard stopped at LIMIT still writes the cases it finished), what it was to run in NAME.sel
shard() {
  local dir=$1 lim=$2 name=$3 b=$4 cases=() t
  shift 4
  (( $# )) && cases=(--cases "$@")
  printf '%s\n' "$b" "$@" > "$dir/$name.sel"
  t=$(date +%s)
  x "$dir/$name.log" "$lim" "$PY" -m portattn.cli conformance run --devices "${CONF_DEVICES:-cuda}" --no-progress \
      --backends "$b" "${cases[@]}" --out "$dir/$name.json"
  echo "shard $name: rc=$? $(( $(date +%s) - t ))s" >> "$dir/rc.txt"
}

step_catalogue() {
  local dir=$1 backends=${2:-${CATALOGUE_BACKENDS:-triton,cupy,reference,sdpa,onnx}}
  local shards=$1/shards times=$TIMES lim b n line rc pats=() plan merge bs
  lim=$(limit "${CONF_LIMIT:-480}")
  mkdir -p "$shards"
  [[ -f $times ]] || { echo '{"results": []}' > "$shards/no-times.json"; times=$shards/no-times.json; }
  split pats "${CASES:-}"
  split bs "$backends"
  for b in "${bs[@]}"; do   # the plans (side by side: each imports torch), then the shards
    case $b in triton) n=${TRITON_SHARDS:-9} ;; cupy) n=${CUPY_SHARDS:-3} ;; *) n=1 ;; esac
    if [[ -z ${PREV:-} && ${#pats[@]} == 0 && $n == 1 ]]; then
      echo "whole $b" > "$shards/plan-$b.txt"   # the whole catalogue, one process
      continue
    fi
    plan=("$times" --all)
    [[ -n ${PREV:-} && -z ${RERUN:-} ]] && plan=("$PREV" --missing)   # RERUN=1: run them again
    (( ${#pats[@]} )) && plan+=(--cases "${pats[@]}")
    plan+=(--backend "$b" --shards "$n" --exact --seconds-from "$times")
    [[ -n $DRY_RUN ]] && echo "+ $PY tools/plan_shards.py $(quote "${plan[@]}")   # (runs under DRY_RUN too)"
    "$PY" tools/plan_shards.py "${plan[@]}" > "$shards/plan-$b.txt" 2> "$shards/plan-$b.err" &
  done
  wait
  for b in "${bs[@]}"; do
    [[ -s $shards/plan-$b.err ]] && { echo "plan for $b:"; tail -4 "$shards/plan-$b.err"; }
    while read -ra line; do   # "s0 case-glob case-glob ...", or "whole"
      if [[ ${line[0]} == whole ]]; then
        bg shard "$shards" "$lim" "$b" "$b"
      else
        bg shard "$shards" "$lim" "$b-${line[0]}" "$b" "${line[@]:1}"
      fi
    done < "$shards/plan-$b.txt"
  done
  wait
  merge=(tools/merge_shards.py "$shards" --out "$dir/conformance-$GPU_TAG.json" ${PREV:+--prev "$PREV"})
  if [[ -n $DRY_RUN ]]; then echo "+ $PY $(quote "${merge[@]}") && cp $dir/conformance-$GPU_TAG.json $OUT/"; return 0; fi
  sort -V "$shards/rc.txt" 2>/dev/null
  "$PY" "${merge[@]}" > "$dir/conformance.txt" 2>&1
  rc=$?
  [[ -f $dir/conformance-$GPU_TAG.json ]] && cp "$dir/conformance-$GPU_TAG.json" "$OUT/"
  grep -v "^KNOWN" "$dir/conformance.txt" | tail -30
  headline "$(tail -1 "$dir/conformance.txt")"
  return "$rc"
}

step_tests() {
  local dir=$1 lim g f heads="" groups words args
  lim=$(limit "${TESTS_LIMIT:-400}")
  split groups "${2:-gpu}"
  for g in "${groups[@]}"; do   # one pytest per group, side by side
    split words "${TEST_GROUP[$g]:-$g}"   # files, globs, node ids, -k EXPR
    mapfile -t args < <(test_args "${words[@]}")
    bg status_to "$dir/pytest_${g//[^A-Za-z0-9_]/_}.rc" x "$dir/pytest_${g//[^A-Za-z0-9_]/_}.txt" "$lim" \
        "$PY" -m pytest -v --tb=short -p no:cacheprovider -rfEs -n "${TESTS_WORKERS:-${TEST_WORKERS[$g]:-2}}" "${args[@]}"
  done
  wait
  for g in "${groups[@]}"; do
    f=$dir/pytest_${g//[^A-Za-z0-9_]/_}
    [[ -n $DRY_RUN ]] && continue
    echo "-- $g: rc=$(cat "$f.rc")$(why "$(cat "$f.rc")")"
    pytest_summary "$f.txt"
    heads+="$g: $(pytest_summary "$f.txt" | tail -1); "
  done
  headline "$heads"
  all_zero "$dir"/pytest_*.rc
}

step_warm() {
  local dir=$1 lim d t dims dtypes logs f ok=0
  lim=$(limit "${WARM_LIMIT:-150}")
  split dims "${2:-64,128,256}"
  split dtypes "${WARM_DTYPES:-bf16}"
  for d in "${dims[@]}"; do
    for t in "${dtypes[@]}"; do
      bg status_to "$dir/warm-d$d-$t.rc" x "$dir/warm-d$d-$t.log" "$lim" "$PY" tools/warm_caches.py --d "$d" --dtype "$t"
    done
  done
  wait
  mapfile -t logs < <(compgen -G "$dir/warm-*.log")
  (( ${#logs[@]} )) || return 0
  grep -hv "^warm " "${logs[@]}" | tail -10   # cells a backend could not run, errors
  for f in "${logs[@]}"; do grep -q "^warm " "$f" && ok=$(( ok + 1 )); done
  headline "$ok of ${#logs[@]} warmed$(grep -h "^warm " "${logs[@]}" | cut -c5- | tr '\n' ';')"
  all_zero "$dir"/warm-*.rc
}

step_atomicdiag() {
  local dir=$1 lim args rc
  lim=$(limit "${ATOMICDIAG_LIMIT:-240}")
  read -ra args <<< "${ATOMICDIAG_ARGS:---quick --narrow --jobs 3}"
  x "$dir/atomic_diag.txt" "$lim" "$PY" tools/triton_atomic_diag.py "${args[@]}" --out "$dir"
  rc=$?
  show "$dir/atomic_diag.txt" 8
  headline "$(grep -h " ok; not ok" "$dir/atomic_diag.txt" 2>/dev/null | cut -c1-200)"
  return "$rc"
}

step_kvcache() {
  local dir=$1 lim rc
  lim=$(limit "${KVCACHE_LIMIT:-200}")
  x "$dir/conformance_kvcache.txt" "$lim" "$PY" -m portattn.conformance.kvcache --devices cuda \
      --backends "${KVCACHE_BACKENDS:-triton,sdpa,reference}" --json "$dir/conformance-kvcache-$GPU_TAG.json"
  rc=$?
  show "$dir/conformance_kvcache.txt" 8
  return "$rc"
}

step_properties() {
  local dir=$1 lim rc
  lim=$(limit "${PROPERTIES_LIMIT:-300}")
  x "$dir/pytest_properties.txt" "$lim" env PORTATTN_HYPOTHESIS_PROFILE="${PROFILE:-ci}" "$PY" -m pytest -v \
      --tb=short -p no:cacheprovider -rfE -n "${PROPERTIES_WORKERS:-8}" tests/test_properties.py
  rc=$?
  pytest_summary "$dir/pytest_properties.txt"
  return "$rc"
}

step_fastest() {
  local dir=$1 lim which=${2:-${CELLS:-}} what=(--full) tag=$GPU_TAG cells extra rc
  lim=$(limit "${FASTEST_LIMIT:-480}")
  if [[ $which == quick ]]; then
    what=(--quick)
  elif [[ $which == inference || $which == training ]]; then
    what=(--full --part "$which") tag=$GPU_TAG-$which
  elif [[ -n $which ]]; then
    IFS=, read -ra cells <<< "$which"
    what=(--cells "${cells[@]}") tag=$GPU_TAG-cells
  fi
  read -ra extra <<< "${FASTEST_ARGS:-}"
  x "$dir/fastest.txt" "$lim" "$PY" benchmarks/bench_fastest.py "${what[@]}" --out "$dir" --tag "$tag" \
      --time-limit "$(inner "$lim" 40)" "${extra[@]}"
  rc=$?
  show "$dir/fastest.txt" 40
  headline "$(grep -hE "^wall|^skipped \(over" "$dir/fastest.txt" 2>/dev/null | tr '\n' ' ' | cut -c1-200)"
  return "$rc"
}

step_bench() {
  local dir=$1 lim args rc
  lim=$(limit "${BENCH_LIMIT:-330}")
  read -ra args <<< "${BENCH_ARGS:-}"
  x "$dir/bench.txt" "$lim" "$PY" -m portattn.cli bench --out "$dir" --time-limit "$(inner "$lim" 20)" \
      --no-progress-bar "${args[@]}"
  rc=$?
  show "$dir/bench.txt" 40
  headline "$(grep -h " cells in " "$dir/bench.txt" 2>/dev/null | tail -1)"
  return "$rc"
}

step_decode() {
  local dir=$1 lim args rc
  lim=$(limit "${DECODE_LIMIT:-240}")
  read -ra args <<< "${DECODE_ARGS:-}"
  x "$dir/bench_decode.txt" "$lim" "$PY" benchmarks/bench_decode.py --out "$dir" "${args[@]}"
  rc=$?
  show "$dir/bench_decode.txt" 40
  return "$rc"
}

step_overhead() {
  local dir=$1 rc
  x "$dir/overhead.txt" "$(limit "${OVERHEAD_LIMIT:-150}")" "$PY" benchmarks/overhead.py --out "$dir"
  rc=$?
  grep -hE "target|per call|x torch" "$dir/overhead.txt" 2>/dev/null | tail -20
  x "$dir/launcher_check.txt" "$(limit "${OVERHEAD_LIMIT:-150}")" "$PY" tools/gpu_launcher_check.py --out "$dir" || rc=$?
  show "$dir/launcher_check.txt" 22
  return "$rc"
}

step_gluon() { tool "$1" "$(limit "${GLUON_LIMIT:-440}")" 40 gluon_check.txt tools/triton_gluon_check.py; }
step_gluonbwd() {
  local args=()
  split args "${GLUONBWD_ARGS:-}"
  tool "$1" "$(limit "${GLUONBWD_LIMIT:-260}")" 20 gluon_bwd_check.txt tools/triton_gluon_bwd_check.py "${args[@]}"
}
step_cupywgmma() { tool "$1" "$(limit "${CUPYWGMMA_LIMIT:-300}")" 20 wgmma_check.txt tools/cupy_wgmma_check.py; }
step_cupyfwd() { tool "$1" "$(limit "${CUPYFWD_LIMIT:-140}")" 10 cupy_fwd_check.txt tools/cupy_fwd_check.py; }

step_cupybwd() {
  if [[ ! -f tools/cupy_wgmma_bwd_check.py ]]; then
    headline "skipped: tools/cupy_wgmma_bwd_check.py is not in this tree (it comes with cupy's wgmma backward)"
    return 0
  fi
  local args=()
  split args "${CUPYBWD_ARGS:-}"
  tool "$1" "$(limit "${CUPYBWD_LIMIT:-280}")" 15 wgmma_bwd_check.txt tools/cupy_wgmma_bwd_check.py "${args[@]}"
}

step_sweep() {
  local dir=$1 lim d rc
  lim=$(limit "${SWEEP_LIMIT:-250}")
  case ${2:-train} in
    fwd) tool "$dir" "$lim" 20 triton_fwd_sweep.txt tools/triton_sweep.py --fwd-only ;;
    bwd) tool "$dir" "$lim" 15 triton_bwd_sweep.txt tools/triton_sweep.py --bwd-variants ;;
    decode) tool "$dir" "$lim" 20 decode-sweep.txt tools/decode_sweep.py ;;
    decodevariants) tool "$dir" "$lim" 10 decode-variants.txt tools/decode_variants.py ;;
    train)   # the compiles first, one process per head dim (CPU-bound), then the timed sweep alone
      for d in 64 128 256; do
        bg x "$dir/compile-d$d.log" "$(( lim / 3 ))" "$PY" tools/triton_sweep.py --compile-only --dims "$d"
      done
      wait
      grep -h FAILED "$dir"/compile-d*.log 2>/dev/null | head -10
      lim=$(limit "${SWEEP_LIMIT:-250}")
      x "$dir/sweep.txt" "$lim" "$PY" tools/triton_sweep.py --out "$dir" --time-limit "$(inner "$lim" 20)"
      rc=$?
      grep -hv "^D.*FAILED" "$dir/sweep.txt" 2>/dev/null | tail -22
      return "$rc" ;;
  esac
}

step_ncu() {
  # NCU_BACKEND (triton; a comma list runs each), NCU_S (4096), NCU_CAUSAL=1, NCU_SET (the sections below; "full": --set full)
  # NCU_FWD_ONLY=1 (the forward alone); NCU_SOURCE=1: --set full with SASS stall sampling, saved as
  # a report and exported as ncu_..._sass.csv (samples by stall reason, per instruction); cudnn/flash
  # backends (torch SDPA's kernels) are matched by their own kernel-name regex
  local dir=$1 dims=${2:-${NCU_D:-128}} rc=0 be=${NCU_BACKEND:-triton} sections d f kern=regex:attn_ rep
  if ! command -v ncu > /dev/null && [[ -z $DRY_RUN ]]; then headline "skipped: no ncu on PATH"; return 0; fi
  if [[ ${NCU_SET:-} == full || -n ${NCU_SOURCE:-} ]]; then sections=(--set full)
  else sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
                 --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis); fi
  for be in ${be//,/ }; do
  kern=regex:attn_
  [[ $be == cudnn || $be == flash ]] && kern="regex:cudnn|sdpa|flash|fmha"
  for d in ${dims//,/ }; do
    f="$dir/ncu_${be}_d$d${NCU_CAUSAL:+_causal}.txt"
    rep=()
    [[ -n ${NCU_SOURCE:-} ]] && rep=(--import-source no -f -o "${f%.txt}")
    x "$f" "$(limit "${NCU_LIMIT:-90}")" ncu --clock-control none --profile-from-start off \
        --kernel-name "$kern" "${sections[@]}" "${rep[@]}" "$PY" tools/ncu_attention.py --backend "$be" --d "$d" \
        --s "${NCU_S:-4096}" ${NCU_CAUSAL:+--causal} ${NCU_FWD_ONLY:+--fwd-only} || rc=$?
    if [[ -n ${NCU_SOURCE:-} ]]; then
      x "${f%.txt}_details.txt" 60 ncu -i "${f%.txt}.ncu-rep" --print-details all || rc=$?
      x "${f%.txt}_sass.csv" 120 ncu -i "${f%.txt}.ncu-rep" --page source --csv --print-source sass || rc=$?
      f="${f%.txt}_details.txt"
    fi
    grep -hE "attn_|Duration|Compute \(SM\) Thr|Memory Thr|Registers Per|Achieved Occ|Issue Slots Busy|No Eligible" \
        "$f" 2>/dev/null | head -40
  done
  done
  return "$rc"
}

# ----- the command line -----------------------------------------------------------------------

usage() {
  echo "usage: [DRY_RUN=1] [NAME_LIMIT=s ...] bash tools/h200_session.sh [par:]STEP[:ARG] ..."
  echo "steps: $STEPS (par: only for $SIDE_BY_SIDE; see the header)"
}

# check SPEC: whether SPEC names a step (and an argument it takes); why not on stdout
check() {
  local spec=${1#par:} name arg g groups
  name=${spec%%:*}
  arg=""; [[ $spec == *:* ]] && arg=${spec#*:}
  if [[ " $STEPS " != *" $name "* ]]; then echo "unknown step '$name'"; return 1; fi
  if [[ $1 == par:* && $SIDE_BY_SIDE != *" $name "* ]]; then
    echo "'$name' times things: it runs alone, not with par:"; return 1
  fi
  case $name in
    catalogue) [[ $arg =~ ^[a-z_,]*$ ]] || { echo "catalogue takes backend names, e.g. catalogue:triton,cupy"; return 1; } ;;
    tests)
      split groups "$arg"
      for g in "${groups[@]}"; do
        [[ -n ${TEST_GROUP[$g]:-} || $g == tests/* ]] \
          || { echo "unknown test group '$g' (groups: ${!TEST_GROUP[*]}, or tests/ paths)"; return 1; }
      done ;;
    warm|ncu) [[ $arg =~ ^[0-9,]*$ ]] || { echo "$name takes head dims, e.g. $name:128"; return 1; } ;;
    sweep) [[ -z $arg || $SWEEPS == *" $arg "* ]] || { echo "unknown sweep '$arg' (sweeps:$SWEEPS)"; return 1; } ;;
    fastest) ;;
    *) [[ -z $arg ]] || { echo "$name takes no argument"; return 1; } ;;
  esac
}

(( $# )) || { usage >&2; exit 2; }
for spec in "$@"; do
  why=$(check "$spec") || { echo "h200_session.sh: $spec: $why" >&2; usage >&2; exit 2; }
done

mkdir -p "$OUT"
W=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/portattn-session.XXXXXX")}   # every step's files; packed at the end
STATE=$W/steps
mkdir -p "$STATE"
specs=("$@")
FINAL=()
: > "$OUT/summary.txt"

# the environment: GPU, driver, clocks, versions and every backend's availability, the PORTATTN_* set
if [[ -n $DRY_RUN ]]; then
  echo "+ nvidia-smi ...; $PY -m portattn.cli info  (DRY_RUN: $*; GPU_TAG=$GPU_TAG)" > "$OUT/env.txt"
else
  { nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    timeout 90 "$PY" -m portattn.cli info
    env | grep "^PORTATTN_" || echo "no PORTATTN_* variables set"
    echo "GPU_TAG=$GPU_TAG (the report files' card name)"
  } > "$OUT/env.txt" 2>&1
  tail -12 "$OUT/env.txt"
fi

tag() { printf '%02d-%s' $(( $1 + 1 )) "$(spec_name "${specs[$1]}")"; }
spec_name() { local s=${1#par:}; echo "${s%%:*}"; }

# run_step K: step K's function in its folder; its summary to STATE/TAG.out, "status seconds" to .rc
run_step() {
  local k=$1 spec=${specs[$1]#par:} t arg=""
  [[ $spec == *:* ]] && arg=${spec#*:}
  t=$(date +%s)
  "step_$(spec_name "$spec")" "$W/$(tag "$k")" "$arg" > "$STATE/$(tag "$k").out" 2>&1
  echo "$? $(( $(date +%s) - t ))" > "$STATE/$(tag "$k").rc"
}

# report K: step K's summary (printed and appended to summary.txt) and its line for the end
report() {
  local k=$1 t rc secs head
  t=$(tag "$k")
  read -r rc secs < "$STATE/$t.rc"
  { echo "== [$(( k + 1 ))] ${specs[k]}: rc=$rc$(why "$rc"), ${secs}s (at $(now)s)"; cat "$STATE/$t.out"; } | tee -a "$OUT/summary.txt"
  head=$(grep "^=> " "$STATE/$t.out" | tail -1 | cut -c4-)
  [[ -n $head ]] || head=$(grep -v "^ *$" "$STATE/$t.out" | tail -1)
  FINAL[k]=$(printf '[%d] %-26s rc=%-3s %4ss  %s' $(( k + 1 )) "${specs[k]}" "$rc" "$secs" "${head:0:160}")
}

# run_group K...: steps K... side by side (one: alone); each reported as it ends
run_group() {
  local k pending=() left
  for k in "$@"; do
    if (( $(now) >= DEADLINE_S )); then
      FINAL[k]=$(printf '[%d] %-26s skipped: %ss, past DEADLINE_S=%s' $(( k + 1 )) "${specs[k]}" "$(now)" "$DEADLINE_S")
      echo "== [$(( k + 1 ))] ${specs[k]}: ${FINAL[k]#*skipped: }: skipped" | tee -a "$OUT/summary.txt"
      continue
    fi
    mkdir -p "$W/$(tag "$k")"
    bg run_step "$k"
    pending+=("$k")
  done
  while (( ${#pending[@]} )); do
    if [[ -z $DRY_RUN ]]; then
      wait -n
      [[ $? == 127 ]] && for k in "${pending[@]}"; do [[ -f $STATE/$(tag "$k").rc ]] || echo "? ?" > "$STATE/$(tag "$k").rc"; done
    fi
    left=()
    for k in "${pending[@]}"; do
      if [[ -f $STATE/$(tag "$k").rc ]]; then report "$k"; else left+=("$k"); fi
    done
    pending=("${left[@]}")
  done
}

# finish: the summary of the whole call (last in the output), everything packed into $OUT
finish() {
  local files
  {
    echo "==================== h200_session.sh $(quote "${specs[@]}"): $(now)s, DEADLINE_S=$DEADLINE_S${DRY_RUN:+, DRY_RUN}"
    printf '%s\n' "${FINAL[@]}"
  } > "$STATE/final.txt"
  cat "$STATE/final.txt" >> "$OUT/summary.txt"
  cp "$OUT/env.txt" "$OUT/summary.txt" "$W/"
  tar czf "$OUT/results.tgz" -C "$W" .
  if (( $(stat -c %s "$OUT/results.tgz") > 15 * 1024 * 1024 )); then   # the device tool takes 16 MiB a file
    echo "results.tgz over 15 MiB: packed without $(find "$W" -type f -size +1023k -printf '%P ')" >> "$STATE/final.txt"
    find "$W" -type f -size -1024k -printf '%P\n' | tar czf "$OUT/results.tgz" -C "$W" -T -
  fi
  files=$(find "$OUT" -type f -printf '%P ')
  echo "$OUT: $files(work dir $W)" >> "$STATE/final.txt"
  (( $(find "$OUT" -type f | wc -l) <= 8 )) || echo "WARNING: more than 8 files under $OUT: the device tool brings back 8" >> "$STATE/final.txt"
  cat "$STATE/final.txt"
}
trap 'echo "== signalled at $(now)s: packing what is there"; finish; exit 143' TERM

i=0
while (( i < ${#specs[@]} )); do   # consecutive par: steps form one group
  group=("$i")
  if [[ ${specs[i]} == par:* ]]; then
    while (( i + 1 < ${#specs[@]} )) && [[ ${specs[i + 1]} == par:* ]]; do i=$(( i + 1 )); group+=("$i"); done
  fi
  i=$(( i + 1 ))
  run_group "${group[@]}"
done
finish
