"""Import a script of benchmarks/ (not a package) as a module, for the tests of its GPU-free parts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    """The module ``benchmarks/<name>.py``, executed once per call."""
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
