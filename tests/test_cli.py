"""The portattn command line."""

import os
import re
import subprocess
import sys

import pytest
import torch

from portattn.cli import main


def test_info_lists_every_backend_with_status(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "sdpa", "triton", "cupy", "onnx"):
        assert f"  {name}" in out
    assert "torch " in out and "devices:" in out and "priority:" in out
    assert re.search(r"reference +available", out)


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


def test_explain_on_a_missing_device_is_a_message_not_a_traceback(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["explain", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA/ROCm device" in err and "Traceback" not in err


def test_explain_rejects_negative_sizes_in_argument_parsing(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", "--seqlen-q", "-1"])
    assert exc.value.code == 2
    assert "--seqlen-q: -1 is out of range: must be >= 0" in capsys.readouterr().err


def test_a_closed_pipe_ends_the_listing_quietly():
    r = subprocess.run(f"{sys.executable} -m portattn.cli conformance list | head -n 1", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.count("\n") == 1
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr


def test_check_says_when_cases_are_filtered_to_the_quick_subset(capsys):
    assert main(["check", "--cases", "core/fp16/*/full", "--backends", "reference", "--devices", "cpu",
                 "--no-progress"]) == 0
    assert "selects among the quick subset" in capsys.readouterr().err


def test_info_says_where_each_backend_can_run(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"reference +available\n +cpu: runs", out)
