"""The portattn command line."""

import os
import re
import subprocess
import sys

from portattn.cli import main


def test_info_lists_every_backend_with_status(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "sdpa", "triton", "cupy", "onnx"):
        assert f"  {name}" in out
    assert "torch " in out and "devices:" in out and "priority:" in out
    assert "reference  available" in out


def test_explain_selects_and_reports_reasons(capsys):
    assert main(["explain", "--seqlen-q", "64", "--heads", "4", "--head-dim", "32", "--dtype", "fp32",
                 "--device", "cpu", "--softcap", "30"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sdpa +does not support softcap", out)
    assert "selected: " in out


def test_explain_pinned_backend_that_cannot_run_exits_nonzero(capsys):
    code = main(["explain", "--seqlen-q", "8", "--device", "cpu", "--backend", "sdpa", "--varlen"])
    assert code == 1
    assert "does not support varlen" in capsys.readouterr().out


def test_explain_unknown_backend_is_a_clear_error(capsys):
    assert main(["explain", "--device", "cpu", "--seqlen-q", "8", "--backend", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err


def test_console_script_runs():
    exe = os.path.join(os.path.dirname(sys.executable), "portattn")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "portattn.cli"]
    proc = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "portattn" in proc.stdout
