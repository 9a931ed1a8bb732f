"""Subcommands ``portattn check`` and ``portattn conformance {run,diff,list}``.

``portattn.cli`` calls :func:`register` with its subparsers; ``python -m portattn.conformance``
runs the same commands stand-alone. Each subcommand's ``func(args)`` returns the exit code:
0 when everything that ran passed, 1 on any failure (``diff``: a case passes in one report and
fails in the other), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys


def _interpret_default() -> None:
    """Without a GPU, let the Triton backend run through Triton's interpreter.

    TRITON_INTERPRET must be set before triton is first imported; a caller's explicit value wins.
    """
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _split(values):
    if not values:
        return None
    out = []
    for v in values:
        out.extend(x.strip() for x in v.split(",") if x.strip())
    return out or None


def _run(args, *, quick: bool) -> int:
    if not args.no_interpret:
        _interpret_default()
    from .runner import print_summary, run_catalogue, write_report
    patterns = _split(args.cases)
    if quick and patterns:
        from .catalogue import select_cases
        n_quick, n_all = len(select_cases(quick=True, patterns=patterns)), len(select_cases(quick=False, patterns=patterns))
        if n_quick < n_all:
            print(f"note: --cases selects among the quick subset: {n_quick} of the {n_all} matching cases run "
                  f"(add --full for all of them)", file=sys.stderr)
    _sigterm_interrupts()
    report = run_catalogue(quick=quick, patterns=_split(args.cases), backends=_split(args.backends),
                           devices=_split(args.devices), progress=not args.no_progress, direct=args.direct)
    if not report["results"]:
        print("no case matched the selection (see `portattn conformance list`)", file=sys.stderr)
        return 2
    if args.out:
        write_report(report, args.out)
    print_summary(report)
    if args.out:
        print(f"report written to {args.out}")
    if report.get("interrupted"):
        print(f"interrupted: {len(report['not_run'])} case(s) did not run", file=sys.stderr)
        return 1
    return 1 if report["summary"]["failed"] else 0


def _sigterm_interrupts() -> None:
    """SIGTERM (e.g. from ``timeout``) stops a run like Ctrl-C: the cases done so far are still
    summarised and written."""
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        def _raise(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, _raise)


def cmd_check(args) -> int:
    """The quick catalogue over every available backend and device (``--full`` for all of it)."""
    return _run(args, quick=not args.full)


def cmd_run(args) -> int:
    return _run(args, quick=args.quick)


def cmd_diff(args) -> int:
    from .diff import diff_reports, print_diff, write_diff
    from .runner import load_report
    d = diff_reports(load_report(args.a), load_report(args.b), factor=args.factor, min_score=args.min_score)
    print_diff(d)
    if args.json:
        write_diff(d, args.json)
        print(f"diff written to {args.json}")
    return 1 if d["pass_fail"] else 0


def cmd_merge(args) -> int:
    from .runner import load_report, merge_reports, print_summary, write_report
    try:
        merged = merge_reports([load_report(path) for path in args.reports])
    except ValueError as exc:
        print(f"portattn conformance merge: {exc}", file=sys.stderr)
        return 2
    write_report(merged, args.out)
    print_summary(merged)
    print(f"report written to {args.out}")
    if merged.get("interrupted"):
        print(f"{len(merged['not_run'])} case(s) did not run in interrupted shards: "
              f"{', '.join(merged['not_run'][:10])}{' ...' if len(merged['not_run']) > 10 else ''}")
        return 1
    return 1 if merged["summary"]["failed"] else 0


def cmd_list(args) -> int:
    from .catalogue import CATALOGUE_VERSION, select_cases
    cases = select_cases(quick=args.quick, patterns=_split(args.cases))
    for c in cases:
        flags = ("Q" if c.quick else "-") + ("L" if c.tier == "large" else "-")
        print(f"{flags} {c.id:<48} {c.problem.describe()}")
    print(f"{len(cases)} case(s), catalogue v{CATALOGUE_VERSION} (Q = quick subset, L = GPU-only size)")
    return 0


def _selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", nargs="+", metavar="NAME", help="backends to run (default: every registered one)")
    p.add_argument("--devices", nargs="+", metavar="DEV", help="devices, e.g. cpu cuda (default: every available)")
    p.add_argument("--cases", nargs="+", metavar="PATTERN", help="only cases whose id contains PATTERN (or matches "
                                                                 "a glob like 'varlen/*')")
    p.add_argument("--out", metavar="REPORT.json", help="write the JSON report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar / lines")
    p.add_argument("--no-interpret", action="store_true",
                   help="do not set TRITON_INTERPRET=1 when there is no GPU (the triton backend is then skipped)")
    p.add_argument("--direct", action="store_true",
                   help="call Backend.forward/backward directly instead of portattn.attention (debugging)")


def register(subparsers) -> None:
    """Add ``check`` and ``conformance`` to the ``portattn`` command's subparsers."""
    p = subparsers.add_parser("check", help="quick conformance check of every available backend on every device",
                              description="Run the quick subset of the conformance catalogue through every "
                                          "available backend on every available device; exit 1 on any failure.")
    _selection_args(p)
    p.add_argument("--full", action="store_true", help="the whole catalogue (same as `conformance run`)")
    p.set_defaults(func=cmd_check)

    conf = subparsers.add_parser("conformance", help="run the conformance catalogue, or diff two reports",
                                 description="The cross-backend, cross-vendor conformance suite (docs/conformance.md).")
    csub = conf.add_subparsers(dest="conformance_command", required=True)
    p = csub.add_parser("run", help="run the catalogue and write a report")
    _selection_args(p)
    p.add_argument("--quick", action="store_true", help="only the quick subset (what `portattn check` runs)")
    p.set_defaults(func=cmd_run)

    p = csub.add_parser("diff", help="compare two reports (e.g. an NVIDIA and an AMD machine)")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--json", metavar="OUT.json", help="also write the diff as JSON")
    p.add_argument("--factor", type=float, default=2.0, help="report scores that moved by more than this factor")
    p.add_argument("--min-score", type=float, default=0.25,
                   help="ignore score moves when both scores are below this (rounding noise)")
    p.set_defaults(func=cmd_diff)

    p = csub.add_parser("merge", help="merge reports of shards run side by side into one")
    p.add_argument("reports", nargs="+", metavar="SHARD.json")
    p.add_argument("--out", required=True, metavar="REPORT.json")
    p.set_defaults(func=cmd_merge)
    p = csub.add_parser("list", help="list the catalogue's cases")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cases", nargs="+", metavar="PATTERN")
    p.set_defaults(func=cmd_list)
    from .kvcache import register as register_kvcache  # KV-cache cases: portattn/conformance/kvcache.py
    register_kvcache(csub)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portattn.conformance")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
