"""Merge the conformance shards of one session call into one report (``tools/h200_session.sh``'s
``catalogue`` step), optionally on top of a previous report.

    python tools/merge_shards.py SHARD_DIR --out conformance-h200.json [--prev PREV.json]

SHARD_DIR holds, per shard, ``NAME.sel`` (the backend, then the ``--cases`` patterns, one a line;
none: the whole catalogue) and the ``NAME.json`` report its ``portattn conformance run`` wrote. A
shard that wrote no report (stopped before its first case finished, or crashed) has its cases
listed as not run. A (case, backend, device) two shards both ran keeps its first result (plain
patterns match anywhere in an id), where ``portattn conformance merge`` refuses the shards. With
``--prev``, PREV's results come after the shards' for every (case, backend, device) the shards
did not run again: the cases PREV lacked are filled in. A PREV of an older catalogue version is
carried forward (:func:`carry_forward`) when every case it has is in the current catalogue with
the same problem (inputs, seed), so a version that only adds cases needs only those run; the
merged report's ``carried_from`` says so. ``not_run`` keeps a case only while some
backend that was to run it has no result for it. Exit 0 when nothing failed and everything ran,
1 otherwise, 2 when there was nothing to merge.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from portattn.conformance.catalogue import CATALOGUE_VERSION, select_cases
from portattn.conformance.runner import load_report, merge_reports, print_summary, summarize, write_report


def _key(result: dict) -> tuple:
    return result["case"], result["backend"], result["device"]


def carry_forward(report: dict) -> tuple[dict, list[str]]:
    """``report`` relabelled as the current catalogue version, when it is of an older one whose
    every case the current catalogue has with the identical problem (``Problem.to_dict``: shape,
    dtype, features, seed — the same inputs bit for bit); its results are kept as they are and
    ``carried_from`` records the version and date they were made under. ValueError names the
    cases that changed or went (such a report cannot stand for the current catalogue)."""
    old = report.get("catalogue_version")
    if old == CATALOGUE_VERSION:
        return report, []
    now = {c.id: c.problem.to_dict() for c in select_cases()}
    changed = sorted(cid for cid, c in report["cases"].items() if now.get(cid) != c["problem"])
    if changed:
        raise ValueError(f"the previous report (catalogue v{old}) cannot be carried into v{CATALOGUE_VERSION}: "
                         f"{len(changed)} of its cases are gone or changed ({', '.join(changed[:5])}"
                         f"{' ...' if len(changed) > 5 else ''})")
    carried = {**report, "catalogue_version": CATALOGUE_VERSION,
               "carried_from": {"catalogue_version": old, "created": report.get("created"),
                                "cases": len(report["cases"])}}
    return carried, [f"carried the previous report's {len(report['cases'])} case(s) from catalogue v{old} into "
                     f"v{CATALOGUE_VERSION} (every one unchanged); {len(now) - len(report['cases'])} case(s) are new"]


def merge(shard_dir: str, prev: str | None = None) -> tuple[dict | None, list[str]]:
    """The merged report (None when there is nothing to merge) and the lines to print about the shards."""
    reports, lost, notes = [], set(), []
    for sel in sorted(glob.glob(os.path.join(shard_dir, "*.sel"))):
        with open(sel) as f:
            backend, *patterns = f.read().split()
        path = sel[:-len(".sel")] + ".json"
        if os.path.exists(path):
            reports.append(load_report(path))
        else:
            ids = [c.id for c in select_cases(patterns=patterns or None)]
            lost |= {(case, backend) for case in ids}
            notes.append(f"{os.path.basename(sel)[:-4]}: no report, its {len(ids)} {backend} case(s) did not run")
    seen: set[tuple] = set()
    for report in reports:
        keep = []
        for result in report["results"]:
            if _key(result) not in seen:
                seen.add(_key(result))
                keep.append(result)
        if len(keep) < len(report["results"]):
            notes.append(f"dropped {len(report['results']) - len(keep)} result(s) another shard had already")
        report["results"] = keep
    if prev:
        old, carried = carry_forward(load_report(prev))
        notes += carried
        carried_from = old.get("carried_from")
        old["results"] = [r for r in old["results"] if _key(r) not in seen]
        reports.append(old)   # last: a fresh shard's environment and command head the merged report
    if not reports:
        return None, notes + ["no report to merge"]
    merged = merge_reports(reports)
    if prev and carried_from:
        merged["carried_from"] = carried_from
    have = {(r["case"], r["backend"]) for r in merged["results"]}
    still = {case for r in reports for case in r.get("not_run", []) for backend in r.get("backends", {})
             if (case, backend) not in have}
    still |= {case for case, backend in lost if (case, backend) not in have}
    if still:
        merged["interrupted"], merged["not_run"] = True, sorted(still)
    else:
        merged.pop("interrupted", None)
        merged.pop("not_run", None)
    merged["summary"] = summarize(merged)
    return merged, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shard_dir")
    ap.add_argument("--out", required=True, metavar="REPORT.json")
    ap.add_argument("--prev", default=None, metavar="PREV.json", help="a previous report the shards complete")
    args = ap.parse_args(argv)
    try:
        merged, notes = merge(args.shard_dir, args.prev)
    except ValueError as exc:   # reports of different catalogue versions
        print(f"merge_shards: {exc}", file=sys.stderr)
        return 2
    for line in notes:
        print(line)
    if merged is None:
        return 2
    write_report(merged, args.out)
    print_summary(merged)
    not_run = merged.get("not_run", [])
    summary = merged["summary"]
    print(f"merged {len(merged['merged_from'])} report(s){' (PREV among them)' if args.prev else ''} into "
          f"{os.path.basename(args.out)}: {summary['passed']} pass, {summary['failed']} fail, {summary['known']} known, "
          f"{len(merged['cases'])} cases, {len(not_run)} not run"
          + (f" ({', '.join(not_run[:6])}{' ...' if len(not_run) > 6 else ''})" if not_run else ""))
    return 1 if not_run or merged["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
