"""tools/plan_shards.py: which cases a re-run takes, and how they are spread over shards."""

from __future__ import annotations

import json

import pytest
from _scripts import load_script

from portattn.conformance.catalogue import build_catalogue

plan_shards = load_script("plan_shards", "tools")


def _report():
    cases = build_catalogue()
    f16 = [c.id for c in cases if c.problem.dtype == "float16"]
    return {"results": [{"case": c, "backend": "triton", "seconds": 10.0 * (i % 4 + 1)} for i, c in enumerate(f16[:20])]
                       + [{"case": f16[0], "backend": "cupy", "seconds": 999.0}],
            "not_run": f16[20:23]}


def test_dtype_cases_and_not_run_cases_each_once():
    report = _report()
    groups = plan_shards.plan(report, "triton", "float32", 5, 40.0)
    flat = [c for g in groups for c in g]
    want = {c.id for c in build_catalogue() if c.problem.dtype == "float32"} | set(report["not_run"])
    assert len(flat) == len(set(flat)) and set(flat) == want
    assert len(groups) == 5


def test_shards_are_balanced_by_the_reports_seconds():
    report = _report()
    groups = plan_shards.plan(report, "triton", "float16", 4, 40.0)
    seconds = {r["case"]: r["seconds"] for r in report["results"] if r["backend"] == "triton"}
    loads = [sum(seconds.get(c, 40.0) for c in g) for g in groups]
    biggest = max(seconds.values())
    assert max(loads) - min(loads) <= max(biggest, 40.0), loads   # greedy longest-first bound


def test_without_dtype_only_the_not_run_cases_and_empty_shards_dropped():
    report = _report()
    groups = plan_shards.plan(report, "triton", None, 8, 40.0)
    assert sorted(c for g in groups for c in g) == sorted(report["not_run"]) and len(groups) == 3


def test_cli_prints_one_line_per_shard(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report()))
    assert plan_shards.main([str(path), "--shards", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["s0", "s1"]
    with pytest.raises(SystemExit):
        plan_shards.main([str(path), "--shards", "0"])


def test_missing_all_cases_and_seconds_from():
    report = _report()
    ids = {c.id for c in build_catalogue()}
    ran = {r["case"] for r in report["results"] if r["backend"] == "triton"}
    missing = plan_shards.plan(report, "triton", None, 4, 40.0, missing=True)
    assert sorted(c for g in missing for c in g) == sorted(ids - ran)
    every = plan_shards.plan({"results": []}, "triton", None, 3, 40.0, every=True, patterns=["core/fp16/*"])
    assert sorted(c for g in every for c in g) == sorted(i for i in ids if i.startswith("core/fp16/"))
    slow = sorted(ids)[0]   # the seconds of another report place its case alone on a shard
    groups = plan_shards.plan({"results": []}, "cupy", None, 2, 1.0, every=True,
                              seconds_from={"results": [{"case": slow, "backend": "cupy", "seconds": 1e6}]})
    assert [slow] in groups


def test_exact_globs_select_their_case_only(tmp_path, capsys):
    ids = [c.id for c in build_catalogue()]
    plain = [i for i in ids if any(o != i and i in o for o in ids)]   # ids a plain pattern would over-select
    assert plain
    from portattn.conformance.catalogue import select_cases
    assert all([c.id for c in select_cases(patterns=[plan_shards.exact(i)])] == [i] for i in plain[:20])
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": []}))
    assert plan_shards.main([str(path), "--all", "--exact", "--shards", "2", "--cases", "headdim/*"]) == 0
    out = capsys.readouterr().out.split()
    assert all(w.endswith("]") for w in out if "/" in w)
