"""Split the conformance cases one backend must (re-)run into balanced shards.

    python tools/plan_shards.py REPORT.json --backend triton --dtype float32 --shards 11
    python tools/plan_shards.py PREV.json --backend cupy --missing --exact --shards 3
    python tools/plan_shards.py TIMES.json --backend triton --all --exact --shards 9

prints one line per shard, ``name case-id case-id ...``, for ``tools/h200_session.sh``'s
``catalogue`` step. The cases: every case the report lists as not run, plus those of ``--dtype``
(the ones a float32-path change touches), plus with ``--missing`` every catalogue case the
report has no result for through ``--backend``, or with ``--all`` the whole catalogue (the
report then only gives the seconds); ``--cases`` keeps only the cases matching its patterns.
They are spread over the shards by the seconds each took in REPORT (or in ``--seconds-from``
for a case REPORT did not run; longest first onto the least-loaded shard; a case neither lists
counts as ``--default-seconds``). ``--exact`` prints each id as a glob that matches that id only
(``portattn conformance run --cases`` takes a plain pattern anywhere in an id, so ``x`` would
also select ``large/x``, and ``conformance merge`` refuses shards that ran a case twice).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys

from portattn.conformance.catalogue import build_catalogue, select_cases


def _seconds(report: dict | None, backend: str) -> dict[str, float]:
    return {r["case"]: float(r["seconds"]) for r in (report or {}).get("results", [])
            if r["backend"] == backend and r.get("seconds")}


def plan(report: dict, backend: str, dtype: str | None, shards: int, default_seconds: float, *,
         missing: bool = False, every: bool = False, patterns: list[str] | None = None,
         seconds_from: dict | None = None) -> list[list[str]]:
    """Case ids in ``shards`` groups of roughly equal previous run time (empty groups dropped)."""
    seconds = {**_seconds(seconds_from, backend), **_seconds(report, backend)}
    wanted = set(report.get("not_run", []))
    if dtype is not None:
        wanted |= {c.id for c in build_catalogue() if c.problem.dtype == dtype}
    if missing or every or patterns:
        universe = {c.id for c in select_cases(patterns=patterns)}
        if every:
            wanted |= universe
        if missing:
            wanted |= universe - {r["case"] for r in report.get("results", []) if r["backend"] == backend}
        wanted &= universe
    heap = [(0.0, i, []) for i in range(shards)]
    for case in sorted(wanted, key=lambda c: (-seconds.get(c, default_seconds), c)):
        load, i, ids = heapq.heappop(heap)
        ids.append(case)
        heapq.heappush(heap, (load + seconds.get(case, default_seconds), i, ids))
    return [ids for _, _, ids in sorted(heap, key=lambda t: t[1]) if ids]


def exact(case: str) -> str:
    """A glob ``portattn conformance run --cases`` matches against ``case`` only (fnmatch is anchored)."""
    return case[:-1] + "[" + case[-1] + "]" if case else case


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a conformance report (JSON) with per-case seconds")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--dtype", default=None, help="also re-run every catalogue case of this dtype")
    parser.add_argument("--missing", action="store_true",
                        help="also every catalogue case the report has no result for through --backend")
    parser.add_argument("--all", action="store_true", help="the whole catalogue (the report gives the seconds)")
    parser.add_argument("--cases", nargs="+", metavar="PATTERN", default=None,
                        help="only cases matching these patterns (as `portattn conformance run --cases`)")
    parser.add_argument("--seconds-from", metavar="REPORT.json", default=None,
                        help="per-case seconds for the cases the report did not run")
    parser.add_argument("--exact", action="store_true", help="print each id as a glob that matches it only")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--default-seconds", type=float, default=40.0)
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be >= 1, got {args.shards}")
    with open(args.report) as f:
        report = json.load(f)
    seconds_from = None
    if args.seconds_from:
        with open(args.seconds_from) as f:
            seconds_from = json.load(f)
    groups = plan(report, args.backend, args.dtype, args.shards, args.default_seconds, missing=args.missing,
                  every=args.all, patterns=args.cases, seconds_from=seconds_from)
    ids = {c.id for c in build_catalogue()}
    for k, group in enumerate(groups):
        if not args.exact:
            for case in group:   # the runner matches a plain pattern anywhere in an id
                extra = [o for o in ids if case in o and o != case]
                if extra:
                    print(f"plan_shards: {case!r} would also select {extra}", file=sys.stderr)
        print(f"s{k} " + " ".join(exact(c) if args.exact else c for c in group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
