"""The one-call GPU check tools' shared cell loop (tools/triton_gluon_check.py's ``run_cells``) and
the reports of ``tools/q_buffers_check.py``, ``tools/ring_depth_check.py`` and ``tools/head_group_check.py``, on made-up cells and
rows: a GPU call must not lose a run's results to a failing cell, a time limit or a report bug."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
# triton_gluon_check sets PORTATTN_TRITON_FORWARD=portable when imported (its timing column); the
# rest of the session must keep the caller's value
_FORWARD = os.environ.get("PORTATTN_TRITON_FORWARD")
import gluon_switch_check as sw  # noqa: E402
import head_group_check  # noqa: E402
import ncu_stalls  # noqa: E402
import q_buffers_check  # noqa: E402
import ring_depth_check  # noqa: E402
import triton_gluon_check as chk  # noqa: E402

if _FORWARD is None:
    os.environ.pop("PORTATTN_TRITON_FORWARD", None)
else:
    os.environ["PORTATTN_TRITON_FORWARD"] = _FORWARD


def _report(res):
    lines = [f"rows {[r['d'] for r in res['rows']]}"]
    bad = [c for r in res["rows"] for c in r["checks"] if not c["passed"]]
    return "\n".join(lines + ["verdict: " + ("PASS" if res["rows"] and not bad else "FAIL")])


def _cell(d, s):
    if d == 2:
        raise RuntimeError("compile failed")
    return {"d": d, "s": s, "checks": [{"passed": True}], "tflops": {"x": 100.0 * d}}


def test_importing_the_tools_leaves_the_forward_switch_alone():
    assert os.environ.get("PORTATTN_TRITON_FORWARD") == _FORWARD


def test_run_cells_keeps_the_other_cells_when_one_raises(tmp_path, capsys):
    rc = chk.run_cells([(1, 512), (2, 512), (3, 512)], ("d", "s"), _cell, _report, str(tmp_path), "t", 1e9)
    assert rc == 1
    text = (tmp_path / "t.txt").read_text()
    assert "rows [1, 3]" in text and "verdict: FAIL" in text and "d=2 s=512: RuntimeError: compile failed" in text
    res = json.loads((tmp_path / "t.json").read_text())
    assert [r["d"] for r in res["rows"]] == [1, 2, 3] and res["rows"][1]["checks"][0]["passed"] is False
    assert "d=3 s=512:" in capsys.readouterr().out


def test_run_cells_passes_and_skips_past_the_time_limit(tmp_path):
    assert chk.run_cells([(1, 512), (3, 1024)], ("d", "s"), _cell, _report, str(tmp_path), "t", 1e9) == 0
    assert "verdict: PASS" in (tmp_path / "t.txt").read_text()
    assert chk.run_cells([(1, 512)], ("d", "s"), _cell, _report, str(tmp_path), "u", -1.0) == 1
    text = (tmp_path / "u.txt").read_text()
    assert "skipped (time limit): [[1, 512]]" in text and "verdict: FAIL" in text


def _env():
    return {"gpu": "made up", "torch": "x", "triton": "y", "date": "today"}


def test_q_buffers_report_states_gains_and_failures():
    t = {"p@q1": 400.0, "p@q2": 440.0, "p_train@q1": 380.0, "p_train@q2": 380.0, "cudnn": 500.0}
    rows = [{"d": 128, "s": 512, "causal": False, "tflops": t, "checks": [{"impl": "p", "passed": True}]},
            {"d": 64, "s": 8192, "causal": True, "tflops": t,
             "checks": [{"impl": "p_train", "passed": False, "bit_identical": False}]}]
    text = q_buffers_check.report({"env": _env(), "seconds": 1.0, "rows": rows})
    assert " 1.100 " in text and " 0.88" in text and "yes" in text
    assert "checks: 1 passed, 1 failed" in text and "FAILED D64 S8192 causal=True" in text
    assert text.endswith("verdict: FAIL")
    assert q_buffers_check.report({"env": _env(), "seconds": 1.0, "rows": rows[:1]}).endswith("verdict: PASS")


@pytest.mark.parametrize("cells, want", [("128x512c,64x2048", [(128, 512, True), (64, 2048, False)])])
def test_q_buffers_cells_argument(monkeypatch, cells, want):
    seen = {}
    monkeypatch.setattr(chk, "run_cells", lambda c, keys, *a: seen.setdefault("cells", (c, keys)) and 0)
    assert q_buffers_check.main(["--cells", cells]) == 0
    assert seen["cells"] == (want, ("d", "s", "causal"))


def test_head_group_report_with_no_rows_fails():
    assert head_group_check.report({"env": _env(), "seconds": 0.0, "rows": []}).endswith("verdict: FAIL")


def test_ring_depth_report_states_plans_gains_and_failures():
    t = {"p@s2": 200.0, "p@s3": 250.0, "p_train@s2": 180.0, "p_train@s3": 171.0, "cudnn": 320.0}
    rows = [{"d": 128, "s": 512, "causal": True, "consumers": 2, "depths": [2, 3], "tflops": t,
             "plans": {"2": [2, False], "3": [1, True]}, "checks": [{"impl": "p", "passed": True}]},
            {"d": 128, "s": 1024, "causal": False, "consumers": 2, "depths": [2, 3], "tflops": t,
             "plans": {"2": [2, False], "3": [1, True]},
             "checks": [{"impl": "p_train", "passed": False, "bit_identical": False}]}]
    text = ring_depth_check.report({"env": _env(), "seconds": 1.0, "rows": rows})
    assert "s2  200.0 /  180.0 (q2)" in text and "s3  250.0 /  171.0 (q1 O-in-Q)" in text
    assert "gain 1.250 / 0.950" in text and "best/cudnn 0.78" in text and "causal" in text
    assert "checks: 1 passed, 1 failed" in text and "FAILED D128 S1024 causal=False" in text
    assert text.endswith("verdict: FAIL")
    assert ring_depth_check.report({"env": _env(), "seconds": 1.0, "rows": rows[:1]}).endswith("verdict: PASS")


def test_ring_depths_fit_and_start_with_the_default():
    """Every depth the tool times fits shared memory with the consumers ``auto`` runs, and the
    first is tile_config's (the reference the others must match bit for bit)."""
    from portattn.backends.triton import gluon_fwd
    for d, depths in ring_depth_check.DEPTHS.items():
        for consumers in ((2, 3) if d in gluon_fwd.THREE_CONSUMER_HEAD_DIMS else (2,)):
            block_n, default = gluon_fwd.tile_config(d, consumers)
            assert depths[0] == default, (d, consumers)
            for n in depths:
                gluon_fwd.smem_plan(d, consumers, block_n, n)   # raises where it does not fit


def test_ncu_stalls_summarises_a_source_page_export(tmp_path):
    """tools/ncu_stalls.py on a made-up export of ``ncu --page source --csv --print-source sass``: the
    kernel, its SASS size, the samples by reason and the top instructions, most samples first."""
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_no_inst",
            "stall_barrier (Not Issued)"]
    rows = [["0x10", "NOP", "30", "30", "0", "30"], ["0x20", "HGMMA.64x128x16.F32.BF16 R24", "10", "0", "10", "0"],
            ["0x30", "BRA 0x10", "", "", "", ""]]
    path = tmp_path / "k_sass.csv"
    path.write_text("\n".join(",".join(f'"{x}"' for x in r)
                              for r in [["Kernel Name", "attn_fwd_gluon", ""], head, *rows]) + "\n")
    text = ncu_stalls.summarise(str(path), top=2)
    assert text.startswith("attn_fwd_gluon: 3 SASS instructions (0 KiB of code), 40 stall samples"), text
    assert "barrier 75.0 %, no_inst 25.0 %" in text
    lines = text.splitlines()
    assert "NOP" in lines[3] and "barrier 30" in lines[3] and "HGMMA" in lines[4] and "no_inst 10" in lines[4]
    assert len(lines) == 5


def test_switch_check_report_and_arguments(monkeypatch):
    """tools/gluon_switch_check.py: --env and --settings reach the cells, the report names the switch
    and states each setting's TFLOP/s and the gain of the last over the first."""
    t = {"p@=0": 200.0, "p@=1": 220.0, "p_train@=0": 180.0, "p_train@=1": 171.0, "cudnn": 320.0}
    rows = [{"d": 128, "s": 512, "causal": True, "tflops": t, "checks": [{"impl": "p", "passed": True}]}]
    text = sw.report({"env": _env(), "seconds": 1.0, "rows": rows, "switch": "X_SWITCH", "settings": ["0", "1"]})
    assert "X_SWITCH = each of ['0', '1']" in text and "0:  200.0 /  180.0" in text and "1:  220.0 /  171.0" in text
    assert "gain 1.100 / 0.950" in text and "last/cudnn 0.69" in text and text.endswith("verdict: PASS")
    seen = {}
    monkeypatch.setattr(chk, "run_cells", lambda cells, keys, run_cell, *a: seen.update(cells=cells) or 0)
    assert sw.main(["--env", "X_SWITCH", "--settings", "1,2,3", "--cells", "128x512c"]) == 0
    assert seen["cells"] == [(128, 512, True)]
