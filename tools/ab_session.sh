#!/usr/bin/env bash
# Time a branch against the checked-out tree in ONE device call, on the same machine: the device
# tool sends only the working tree, and a kernel's gain is only trusted against a baseline timed
# on the same card in the same call (it may lend an H100 or an H200).
#
#   bash tools/ab_session.sh --prepare BRANCH   # here: BRANCH's files into .exp/b (git-ignored
#                                               # through .git/info/exclude); name .exp in `carry`
#   bash tools/ab_session.sh STEP[:ARG] ...     # there: the tools/h200_session.sh steps in .exp/b,
#                                               # then in the checked-out tree (a), then in .exp/b
#                                               # again while AB_DEADLINE_S (480) allows;
#                                               # DRY_RUN=1 prints the steps' commands
#
# The environment reaches every run (e.g. CUPYBWD_ARGS=--no-tests, NCU_BACKEND=cupy); each run
# gets AB_RUN_S seconds (200) as its DEADLINE_S. Everything lands in $OUT/ab.tgz (one folder per
# run: b, a, b2) and the last lines printed are each run's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
EXP=.exp/b

if [[ ${1:-} == --prepare ]]; then
  branch=${2:?"--prepare BRANCH: the branch to time against the checked-out tree"}
  git rev-parse --verify -q "$branch^{commit}" > /dev/null || { echo "no commit '$branch'" >&2; exit 2; }
  mkdir -p "$(git rev-parse --git-path info)"
  grep -qx '/.exp/' "$(git rev-parse --git-path info/exclude)" 2> /dev/null \
    || echo '/.exp/' >> "$(git rev-parse --git-path info/exclude)"
  rm -rf "$EXP" && mkdir -p "$EXP"
  git archive "$branch" | tar -x -C "$EXP"
  # what the runs do not read: the docs and the results (but the catalogue's per-case seconds)
  rm -rf "$EXP/docs" "$EXP/benchmarks/results"
  mkdir -p "$EXP/benchmarks/results"
  cp benchmarks/results/conformance-h[0-9]*.json "$EXP/benchmarks/results/" 2> /dev/null
  echo "$branch ($(git rev-parse --short "$branch")) in $EXP: $(du -sh "$EXP" | cut -f1); call with carry [\".exp\"]"
  exit 0
fi

(($#)) || { echo "usage: $0 --prepare BRANCH | STEP[:ARG] ..." >&2; exit 2; }
[[ -d $EXP ]] || { echo "$EXP is missing: run '$0 --prepare BRANCH' here and carry .exp" >&2; exit 2; }
OUT=${OUT:-/tmp/portattn-out}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/portattn-ab.XXXXXX")
RUN_S=${AB_RUN_S:-200}
T0=$SECONDS
runs=()
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2> /dev/null

one() {   # one: NAME TREE — the steps in TREE, results in $WORK/NAME
  local name=$1 tree=$2
  mkdir -p "$WORK/$name"
  (cd "$tree" && OUT="$WORK/$name" DEADLINE_S=$RUN_S bash tools/h200_session.sh "${@:3}" > "$WORK/$name/log" 2>&1)
  echo "== $name ($tree): rc $?, done at $((SECONDS - T0)) s"
  runs+=("$name")
}

one b "$EXP" "$@"
one a . "$@"
# a second run of the branch, so that drift over the call shows: only while a whole run still fits
if (( SECONDS - T0 + RUN_S <= ${AB_DEADLINE_S:-480} )); then one b2 "$EXP" "$@"; fi
tar czf "$OUT/ab.tgz" -C "$WORK" .
for name in "${runs[@]}"; do
  echo "==================== $name"
  cut -c1-180 "$WORK/$name/summary.txt" 2> /dev/null
done
