"""The equivalence suite: whole-problem generation, the §3 checking function, the fixed
conformance catalogue, reports and their diff (``portattn conformance``, ``portattn check``).

See docs/conformance.md.
"""
from .checker import Checker, Outcome, check_problem, checksum
from .problems import CPU_CAP, GPU_CAP, Problem, SizeCap, cap_for, make_inputs, problem_strategy

__all__ = ["Checker", "Outcome", "check_problem", "checksum", "CPU_CAP", "GPU_CAP", "Problem", "SizeCap",
           "cap_for", "make_inputs", "problem_strategy"]
