"""Split the conformance cases one backend must (re-)run into balanced shards.

    python tools/plan_shards.py REPORT.json --backend triton --dtype float32 --shards 11

prints one line per shard, ``name case-id case-id ...``, for ``h200_session.sh reverify``: the
cases of ``--dtype`` (those a float32-path change touches) plus every case the report lists as
not run, spread over the shards by the seconds each took in REPORT (longest first onto the
least-loaded shard; a case the report lacks counts as ``--default-seconds``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys

from portattn.conformance.catalogue import build_catalogue


def plan(report: dict, backend: str, dtype: str | None, shards: int, default_seconds: float) -> list[list[str]]:
    """Case ids in ``shards`` groups of roughly equal previous run time (empty groups dropped)."""
    seconds = {r["case"]: float(r.get("seconds") or default_seconds)
               for r in report.get("results", []) if r["backend"] == backend}
    wanted = set(report.get("not_run", []))
    if dtype is not None:
        wanted |= {c.id for c in build_catalogue() if c.problem.dtype == dtype}
    heap = [(0.0, i, []) for i in range(shards)]
    for case in sorted(wanted, key=lambda c: (-seconds.get(c, default_seconds), c)):
        load, i, ids = heapq.heappop(heap)
        ids.append(case)
        heapq.heappush(heap, (load + seconds.get(case, default_seconds), i, ids))
    return [ids for _, _, ids in sorted(heap, key=lambda t: t[1]) if ids]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a conformance report (JSON) with per-case seconds")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--dtype", default=None, help="also re-run every catalogue case of this dtype")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--default-seconds", type=float, default=40.0)
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be >= 1, got {args.shards}")
    with open(args.report) as f:
        report = json.load(f)
    groups = plan(report, args.backend, args.dtype, args.shards, args.default_seconds)
    ids = {c.id for c in build_catalogue()}
    for k, group in enumerate(groups):
        for case in group:   # the runner matches a plain pattern anywhere in an id
            extra = [o for o in ids if case in o and o != case]
            if extra:
                print(f"plan_shards: {case!r} would also select {extra}", file=sys.stderr)
        print(f"s{k} " + " ".join(group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
