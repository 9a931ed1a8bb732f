"""The conformance tool: catalogue, report, diff, CLI — and proof that a wrong backend is caught.

A planted backend that silently drops the softcap (otherwise exact: it delegates to the float64
reference) must be caught by the property suite's checking function (found by Hypothesis'
search) and by ``portattn conformance run`` (exit code 1, its softcap cases marked failed, its
other cases passed).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json

import pytest
import torch

import portattn
from portattn.conformance import CPU_CAP, Checker, Problem, problem_strategy
from portattn.conformance import cli as conf_cli
from portattn.conformance.catalogue import CATALOGUE_VERSION, build_catalogue, select_cases
from portattn.conformance.diff import diff_reports
from portattn.conformance.runner import load_report
from portattn.reference import ReferenceBackend
from portattn.registry import ALL_FEATURES, Backend


class DropsSoftcap(Backend):
    """Wrong on purpose: exact attention, except that the softcap is ignored."""

    name = "wrong_softcap"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (1, 1024)
    vendors = frozenset({"cpu", "nvidia", "amd"})
    features = ALL_FEATURES
    has_backward = True

    def _drop(self, spec):
        return dataclasses.replace(spec, softcap=None)

    def forward(self, spec):
        return ReferenceBackend().forward(self._drop(spec))

    def backward(self, spec, out, lse, dout):
        return ReferenceBackend().backward(self._drop(spec), out, lse, dout)


@pytest.fixture
def planted():
    portattn.register_backend(DropsSoftcap, replace=True)
    try:
        yield DropsSoftcap.name
    finally:
        portattn.unregister_backend(DropsSoftcap.name)


# ----- the planted bug is caught ---------------------------------------------------------------

def test_checker_catches_the_planted_backend(planted):
    """Hypothesis' search over whole problems finds a failing problem, and it has a softcap;
    the same backend passes a problem without softcap (the check is not failing everything)."""
    from hypothesis import find, settings

    found = find(problem_strategy(CPU_CAP, grad=False),
                 lambda p: Checker(p).check(planted).verdict == "fail",
                 settings=settings(max_examples=60, derandomize=True, database=None, deadline=None))
    assert found.softcap is not None, found
    outcome = Checker(found).check(planted)
    failed = {name for name, c in outcome.checks.items() if not c["passed"]}
    assert failed and failed <= {"out", "lse"}, outcome.summary()   # the minimal case may only move lse
    assert Checker(dataclasses.replace(found, softcap=None)).check(planted).verdict == "pass"


def test_conformance_run_catches_the_planted_backend(planted, tmp_path):
    out = tmp_path / "report.json"
    rc = conf_cli.main(["conformance", "run", "--quick", "--backends", planted, "reference", "--devices", "cpu",
                        "--no-progress", "--out", str(out)])
    assert rc == 1
    report = load_report(str(out))
    mine = [r for r in report["results"] if r["backend"] == planted]
    softcap_cases = {cid for cid, c in report["cases"].items() if c["problem"]["softcap"] is not None}
    assert softcap_cases, "the quick catalogue must contain softcap cases"
    for r in mine:
        expected = "fail" if r["case"] in softcap_cases else "pass"
        assert r["verdict"] == expected, r
    assert all(r["verdict"] == "pass" for r in report["results"] if r["backend"] == "reference")
    assert report["summary"]["by_backend"][f"{planted}@cpu"]["fail"] == len(softcap_cases)


# ----- catalogue -------------------------------------------------------------------------------

def test_catalogue_is_fixed_and_covers_the_semantics():
    cases = build_catalogue()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)) and 250 <= len(cases) <= 500
    assert [c.problem for c in build_catalogue()] == [c.problem for c in cases]   # deterministic, seeds included
    assert len({c.problem.seed for c in cases}) == len(cases)
    quick = select_cases(quick=True)
    assert 15 <= len(quick) <= 40
    covered = frozenset().union(*(c.problem.features for c in quick))
    assert covered == ALL_FEATURES, f"quick subset misses {sorted(ALL_FEATURES - covered)}"
    for c in cases:
        if c.tier == "small":
            assert max(c.problem.max_q, c.problem.max_k) <= 129 and max(c.problem.head_dim, c.problem.dv) <= 128, c.id
    assert {c.problem.dtype for c in quick} == {"float16", "bfloat16", "float32"}
    assert any(c.problem.is_varlen and 0 in c.problem.seqlens_q for c in quick)
    varlen = select_cases(patterns=["varlen/*"])
    assert varlen and all(c.id.startswith("varlen/") for c in varlen)


# ----- reports ---------------------------------------------------------------------------------

def _run(tmp_path, name, *extra):
    path = tmp_path / name
    rc = conf_cli.main(["conformance", "run", "--no-progress", "--devices", "cpu", "--out", str(path), *extra])
    return rc, load_report(str(path))


def test_report_records_versions_scores_and_checksums(tmp_path):
    rc, report = _run(tmp_path, "a.json", "--backends", "reference", "sdpa", "--cases", "masked/", "combo/llm-decode")
    assert rc == 0
    assert report["catalogue_version"] == CATALOGUE_VERSION
    assert report["environment"]["versions"]["torch"] == torch.__version__.split("+")[0] or \
        report["environment"]["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert set(report["backends"]) == {"reference", "sdpa"}
    ran = [r for r in report["results"] if r["verdict"] != "skip"]
    assert ran and all(len(r["checksum"]) == 64 and isinstance(r["score"], (int, float)) for r in ran)
    skipped = [r for r in report["results"] if r["verdict"] == "skip"]
    assert all(r["reasons"] for r in skipped)
    # the checksum is of the output bits: recompute one from the same problem
    entry = next(r for r in ran if r["backend"] == "reference" and r["case"] == "combo/llm-decode")
    problem = Problem.from_dict(report["cases"]["combo/llm-decode"]["problem"])
    got = Checker(problem).run_backend("reference", grads=False, bias_grad=False)
    assert hashlib.sha256(got.out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() == entry["checksum"]
    assert json.loads((tmp_path / "a.json").read_text())["summary"]["failed"] == 0


def test_diff_finds_verdicts_scores_and_bits(tmp_path, capsys):
    rc, a = _run(tmp_path, "a.json", "--backends", "reference", "sdpa", "--cases", "alibi/head/full")
    assert rc == 0
    same = diff_reports(a, a)
    assert not same["verdicts"] and not same["scores"] and not same["bits"]["different"]
    assert same["bits"]["identical"] == same["bits"]["compared"] > 0

    b = copy.deepcopy(a)
    ran = [r for r in b["results"] if r["verdict"] == "pass"]
    ran[0]["verdict"], ran[0]["reasons"] = "fail", ["out: FAIL (planted)"]
    ran[1]["score"] = (ran[1]["score"] or 0.1) * 10 + 1.0
    ran[2]["checksum"] = "0" * 64
    # a backend that ran on another device in B is still compared (cross-device pair)
    ran[3]["device"] = "cuda"
    (tmp_path / "b.json").write_text(json.dumps(b))
    d = diff_reports(a, b)
    assert d["pass_fail"] == 1 and d["verdicts"][0]["case"] == ran[0]["case"]
    assert any(s["case"] == ran[1]["case"] and s["backend"] == ran[1]["backend"] for s in d["scores"])
    assert any(x["case"] == ran[2]["case"] for x in d["bits"]["different"])
    assert any(x["device"] == "cpu~cuda" for x in
               [{"device": dev} for dev in _paired_devices(a, b, ran[3]["case"], ran[3]["backend"])])

    rc = conf_cli.main(["conformance", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                        "--json", str(tmp_path / "d.json")])
    assert rc == 1
    assert json.loads((tmp_path / "d.json").read_text())["pass_fail"] == 1
    assert "pass in one report and fail in the other" in capsys.readouterr().out


def test_merge_joins_shards_and_refuses_overlap(tmp_path, capsys):
    """Shards run side by side (one per group of cases) merge into the report a single run makes."""
    rc, a = _run(tmp_path, "a.json", "--backends", "reference", "sdpa", "--cases", "alibi/head/full")
    rc2, b = _run(tmp_path, "b.json", "--backends", "reference", "--cases", "masked/bool-rows")
    assert rc == rc2 == 0
    out = tmp_path / "m.json"
    assert conf_cli.main(["conformance", "merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                          "--out", str(out)]) == 0
    m = load_report(str(out))
    assert set(m["cases"]) == set(a["cases"]) | set(b["cases"])
    assert len(m["results"]) == len(a["results"]) + len(b["results"])
    assert set(m["backends"]) == {"reference", "sdpa"}
    assert m["summary"]["passed"] == a["summary"]["passed"] + b["summary"]["passed"]
    assert [s["cases"] for s in m["merged_from"]] == [len(a["cases"]), len(b["cases"])]
    # the same case through the same backend twice is an overlap, not a merge
    assert conf_cli.main(["conformance", "merge", str(tmp_path / "a.json"), str(tmp_path / "a.json"),
                          "--out", str(tmp_path / "x.json")]) == 2
    assert "shards overlap" in capsys.readouterr().err


def test_a_run_stopped_by_sigterm_keeps_its_finished_cases(tmp_path):
    """`timeout` on a GPU machine sends SIGTERM: the report still holds every finished case."""
    import os
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "partial.json"
    env = {**os.environ, "PORTATTN_BACKEND": ""}
    # signal once the run is inside its case loop (its first progress line), whatever the load
    proc = subprocess.Popen([sys.executable, "-m", "portattn.cli", "conformance", "run", "--backends", "reference",
                             "onnx", "--devices", "cpu", "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    while first and not first.startswith("["):
        first = proc.stderr.readline()
    assert first.startswith("[1/"), f"no progress line before the end: {first!r}"
    time.sleep(0.5)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    report = load_report(str(out))
    assert report["interrupted"] is True and report["not_run"], "the run should have been cut short"
    assert report["cases"] and set(r["case"] for r in report["results"]) == set(report["cases"])
    assert not set(report["not_run"]) & set(report["cases"])
    assert "did not run" in err


def _paired_devices(a, b, case, backend):
    from portattn.conformance.diff import _pairs
    return [dev for c, be, dev, ea, eb in _pairs(a, b) if c == case and be == backend and ea and eb]


def test_check_is_wired_into_the_portattn_command():
    from portattn import cli
    assert cli.main(["check", "--backends", "reference", "--cases", "masked/bool-rows", "--no-progress"]) == 0
    assert cli.main(["conformance", "list", "--quick"]) == 0


def test_catalogue_holds_every_hopper_default_kernel_to_the_reference():
    """Each kernel the triton backend's ``auto`` takes on Hopper runs in some GPU-size catalogue case:
    every row of the Gluon forward's tables (inference; training where a gradient is checked; the
    persistent variant's, ``AUTO_PERSISTENT``, and its two-consumer rows, ``AUTO_TWO_CONSUMERS``) and
    the Gluon backward with and without GQA at each head dim of its tables. A new auto row without
    a case fails here (add a ``large/hopper/`` case and bump CATALOGUE_VERSION)."""
    from portattn.backends.triton import gluon_bwd, gluon_fwd

    from portattn.spec import build_spec

    covered_fwd, covered_bwd, covered_pers, covered_two = set(), set(), set(), set()
    for case in build_catalogue():
        p = case.problem
        if p.is_varlen or p.dtype not in ("float16", "bfloat16") or p.alibi or p.bias or p.softcap or p.window:
            continue
        q = torch.empty(p.batch, p.seqlen_q, p.heads_q, p.head_dim, dtype=p.torch_dtype, device="meta")
        k = torch.empty(p.batch, p.seqlen_k, p.heads_kv, p.head_dim, dtype=p.torch_dtype, device="meta")
        v = torch.empty(p.batch, p.seqlen_k, p.heads_kv, p.dv, dtype=p.torch_dtype, device="meta")
        spec = build_spec(q, k, v, causal=p.causal)
        if gluon_fwd.auto_takes(spec, training=p.grad):
            covered_fwd.add((p.head_dim, p.causal, p.grad))
        if gluon_fwd.auto_persistent(spec, training=p.grad):
            covered_pers.add((p.head_dim, p.causal, p.grad))
            if gluon_fwd.row_holds(gluon_fwd.AUTO_TWO_CONSUMERS, (p.head_dim, p.causal), p.seqlen_q):
                covered_two.add((p.head_dim, p.causal, p.grad))
        if p.grad and gluon_bwd.auto_takes(spec):
            covered_bwd.add((p.head_dim, p.heads_q != p.heads_kv))
    want_fwd = {(d, c, False) for d, c in gluon_fwd.AUTO_MIN_SEQLEN_Q if (d, c) not in gluon_fwd.AUTO_TRAINING_MIN_SEQLEN_Q}
    want_fwd |= {(d, c, True) for d, c in gluon_fwd.AUTO_TRAINING_MIN_SEQLEN_Q}
    want_bwd = {(d, False) for d in gluon_bwd.AUTO_MIN_SEQLEN} | {(d, True) for d in gluon_bwd.AUTO_GQA_MIN_SEQLEN}
    assert want_fwd <= covered_fwd, sorted(want_fwd - covered_fwd)
    assert want_bwd <= covered_bwd, sorted(want_bwd - covered_bwd)
    # the persistent variant's rows, (head dim, causal, training)
    assert set(gluon_fwd.AUTO_PERSISTENT) <= covered_pers, sorted(set(gluon_fwd.AUTO_PERSISTENT) - covered_pers)
    # and the two-consumer rows of AUTO_TWO_CONSUMERS where a persistent row (inference or training) overlaps them
    pers, two = gluon_fwd.AUTO_PERSISTENT, gluon_fwd.AUTO_TWO_CONSUMERS
    want_two = {(d, c, g) for d, c in two for g in (False, True)
                if (d, c, g) in pers and pers[d, c, g][0] < two[d, c][1] and two[d, c][0] < pers[d, c, g][1]}
    assert want_two <= covered_two, sorted(want_two - covered_two)
