"""``conformance diff a.json b.json``: what changed between two conformance reports.

Entries are paired by (case, backend, device). When a backend ran a case on one device in
report A and on another in report B (an H200 report against a CPU-only one), those two are
paired as a *cross-device* pair, so the same backend is compared across machines either way.

Reported:

* ``verdict``: the verdicts differ (pass vs fail, or ran vs skipped; skip reasons included);
* ``score``: both ran and the score moved by more than ``factor`` (either way), ignoring scores
  below ``min_score`` on both sides (rounding noise: a score of 0.01 vs 0.05 means nothing);
* ``bits``: both produced an output but its sha256 differs (informational: different hardware
  and libraries round differently; on one machine type it flags nondeterminism or a change);
* cases present in only one report.

The exit status of the command is 1 when a case passes in one report and fails in the other.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

from .runner import _num, print_table

DEFAULT_FACTOR = 2.0
DEFAULT_MIN_SCORE = 0.25


def _index(report: dict) -> dict[tuple[str, str], dict[str, dict]]:
    idx: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in report["results"]:
        idx[(r["case"], r["backend"])][r["device"]] = r
    return idx


def _pairs(a: dict, b: dict):
    """Yield (case, backend, device label, entry_a | None, entry_b | None).

    Order of pairing per (case, backend): same device where both ran; then, if exactly one
    device ran on each side and they differ, that cross-device pair (``"cuda~cpu"``); then the
    remaining same-device pairs (one side skipped); leftovers are present in one report only.
    """
    ia, ib = _index(a), _index(b)
    for key in sorted(set(ia) | set(ib)):
        da, db = dict(ia.get(key, {})), dict(ib.get(key, {}))

        def ran(entries):
            return sorted(d for d, e in entries.items() if e["verdict"] != "skip")

        for dev in sorted(set(ran(da)) & set(ran(db))):
            yield key[0], key[1], dev, da.pop(dev), db.pop(dev)
        ran_a, ran_b = ran(da), ran(db)
        if len(ran_a) == 1 and len(ran_b) == 1 and ran_a[0] != ran_b[0]:
            yield key[0], key[1], f"{ran_a[0]}~{ran_b[0]}", da.pop(ran_a[0]), db.pop(ran_b[0])
        for dev in sorted(set(da) & set(db)):
            yield key[0], key[1], dev, da.pop(dev), db.pop(dev)
        for dev, e in sorted(da.items()):
            yield key[0], key[1], dev, e, None
        for dev, e in sorted(db.items()):
            yield key[0], key[1], dev, None, e


def diff_reports(a: dict, b: dict, *, factor: float = DEFAULT_FACTOR, min_score: float = DEFAULT_MIN_SCORE) -> dict:
    """The differences between reports ``a`` and ``b`` as a JSON-ready dict."""
    if factor <= 1:
        raise ValueError(f"factor={factor} must be > 1 (a score ratio)")
    verdicts, scores, bits, only_a, only_b = [], [], [], [], []
    same_bits = compared_bits = 0
    for case, backend, device, ea, eb in _pairs(a, b):
        if ea is None or eb is None:
            (only_b if ea is None else only_a).append({"case": case, "backend": backend, "device": device})
            continue
        row = {"case": case, "backend": backend, "device": device}
        if ea["verdict"] != eb["verdict"]:
            verdicts.append({**row, "a": ea["verdict"], "b": eb["verdict"],
                             "a_reasons": ea["reasons"], "b_reasons": eb["reasons"]})
        sa, sb = _num(ea.get("score")), _num(eb.get("score"))
        if sa is not None and sb is not None and max(sa, sb) >= min_score:
            lo, hi = min(sa, sb), max(sa, sb)
            ratio = math.inf if lo == 0 else hi / lo
            if ratio > factor:
                scores.append({**row, "a": sa, "b": sb, "ratio": ratio if math.isfinite(ratio) else "inf"})
        if ea.get("checksum") and eb.get("checksum"):
            compared_bits += 1
            if ea["checksum"] != eb["checksum"]:
                bits.append({**row, "a": ea["checksum"][:16], "b": eb["checksum"][:16]})
            else:
                same_bits += 1
    regressions = [v for v in verdicts if {v["a"], v["b"]} == {"pass", "fail"}]
    return {
        "a": _describe(a), "b": _describe(b),
        "catalogue_versions": [a.get("catalogue_version"), b.get("catalogue_version")],
        "factor": factor, "min_score": min_score,
        "verdicts": verdicts, "pass_fail": len(regressions), "scores": scores,
        "bits": {"compared": compared_bits, "identical": same_bits, "different": bits},
        "only_in_a": only_a, "only_in_b": only_b,
    }


def _describe(report: dict) -> dict:
    env = report.get("environment", {})
    gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "no GPU"
    return {"host": env.get("host"), "created": report.get("created"), "gpus": gpus,
            "devices": report.get("devices"), "torch": env.get("versions", {}).get("torch")}


def print_diff(d: dict, file=None, limit: int = 60) -> None:
    a, b = d["a"], d["b"]
    print(f"A: {a['host']} ({a['gpus']}, torch {a['torch']}, {a['created']})", file=file)
    print(f"B: {b['host']} ({b['gpus']}, torch {b['torch']}, {b['created']})", file=file)
    va, vb = d["catalogue_versions"]
    if va != vb:
        print(f"warning: catalogue versions differ ({va} vs {vb}); cases may not be comparable", file=file)
    ran_diff = [v for v in d["verdicts"] if "skip" not in (v["a"], v["b"])]
    skip_diff = [v for v in d["verdicts"] if "skip" in (v["a"], v["b"])]
    rows = [[v["case"], v["backend"], v["device"], v["a"], v["b"],
             "; ".join(v["a_reasons"] or v["b_reasons"])[:90]] for v in ran_diff[:limit]]
    print_table(f"verdicts that differ: {len(ran_diff)} pass/fail", ["case", "backend", "device", "A", "B", "why"],
                rows, file)
    by_backend: dict[str, int] = defaultdict(int)
    for v in skip_diff:
        by_backend[f"{v['backend']}@{v['device']} ({v['a']} -> {v['b']})"] += 1
    if by_backend:
        print_table(f"ran in one report, skipped in the other: {len(skip_diff)}", ["backend@device", "cases"],
                    [[k, n] for k, n in sorted(by_backend.items())], file)
    rows = [[s["case"], s["backend"], s["device"], f"{s['a']:.3g}", f"{s['b']:.3g}",
             s["ratio"] if isinstance(s["ratio"], str) else f"{s['ratio']:.2f}"]
            for s in sorted(d["scores"], key=lambda s: -_num(s["ratio"]))[:limit]]
    print_table(f"scores moved by more than x{d['factor']:g}: {len(d['scores'])}",
                ["case", "backend", "device", "score A", "score B", "ratio"], rows, file)
    bits = d["bits"]
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for x in bits["different"]:
        per[f"{x['backend']}@{x['device']}"][0] += 1
    print_table(f"outputs bit-identical in {bits['identical']} of {bits['compared']} comparable results",
                ["backend@device", "bit-different cases"], [[k, v[0]] for k, v in sorted(per.items())], file)
    if d["only_in_a"] or d["only_in_b"]:
        print(f"only in A: {len(d['only_in_a'])} results; only in B: {len(d['only_in_b'])} results", file=file)
    print(f"{d['pass_fail']} case(s) pass in one report and fail in the other", file=file)


def write_diff(d: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(d, f, indent=1)
        f.write("\n")
