"""Import a script of benchmarks/ or tools/ (not packages) as a module, for the tests of its GPU-free parts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str, folder: str = "benchmarks"):
    """The module ``<folder>/<name>.py`` (benchmarks/ or tools/), executed once per call."""
    spec = importlib.util.spec_from_file_location(name, _ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
