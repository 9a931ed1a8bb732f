"""tools/host_overhead.py (the CPU measurement of the triton backend's host path) keeps working:
every mode (stub, binder, fast) runs portattn.attention / ops.forward / ops.backward with the launches stubbed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_host_overhead_tool_runs_every_mode():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "host_overhead.py"), "--calls", "20", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"\[(stub|binder|fast)\s*\] (.+?)\s+([0-9.]+) us/call", proc.stdout)
    assert {(mode, name.strip()) for mode, name, _ in rows} == {
        (mode, name) for mode in ("stub", "binder", "fast")
        for name in ("attention(triton) fwd", "build_spec only", "ops.forward(spec)", "ops.backward(spec)")}, proc.stdout
    assert all(float(t) > 0 for _, _, t in rows)


def test_prepared_forward_launch_passes_what_the_full_path_passes():
    """tools/host_overhead.py --mode check: the second call of each argument kind (causal, GQA +
    window + softcap, bool and float bias, bhsd with Dv != D, a padded row stride, the training
    forward with its residual) launches through backends/triton/ops.py's prepared launch, with
    the grid, kernel and every argument the full path gives for the same tensors."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "host_overhead.py"), "--mode", "check"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("  ok   ") == 7 and "0 mismatch(es)" in proc.stdout, proc.stdout
