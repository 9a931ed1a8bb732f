"""The equivalence rule of docs/semantics.md, used by every test and by the conformance suite.

For inputs in dtype ``T`` with float64 reference ``ref`` and naive in-dtype result ``naive``::

    max|out - ref| <= factor * max|naive - ref| + 2 * max|(ref + 0.3 - 0.3) - ref|   (in T)

with ``factor = 2`` for outputs and ``3`` for gradients; ``lse`` is compared at 2e-4 absolute;
NaN or inf where ``ref`` is finite always fails. The score is ``max|out - ref| / max|naive - ref|``.

One degenerate case needs a floor the rule does not give: a reference tensor that is
*numerically zero* (e.g. ``dq`` when every query row sees exactly one key, so ``P = 1`` and
``dS = P∘(dP − Δ) = 0``; the float64 reference leaves at most float64 rounding, ~1e-17). The
naive math then reproduces (nearly) zero, the rounding floor is ~0, and the bound collapses,
while any tiled backend that computes ``dP`` and ``Δ = rowsum(dO∘O)`` in different summation
orders leaves float32 rounding noise. Only when ``max|ref| <= eps(float32) · zero_ref_scale``
(below what float32 accumulation can resolve) the floor is ``ZERO_REF_ULPS · eps(float32) · zero_ref_scale`` (``zero_ref_scale``: the
magnitude of the quantities cancelled, default 1; the test harnesses pass
``max|dO| · max|V| · max|K| · scale`` for gradients). A wrong kernel is still caught: its error
is of the order of the data, not of float32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
LSE_ATOL = 2e-4
ZERO_REF_ULPS = 32


@dataclass(frozen=True)
class Comparison:
    """Result of comparing one tensor with the reference."""

    name: str
    passed: bool
    max_err: float      # max|out - ref|
    naive_err: float    # max|naive - ref|
    tolerance: float    # the bound max_err had to meet
    message: str = ""

    @property
    def score(self) -> float:
        """``max|out - ref| / max|naive - ref|`` (0 when both are 0, inf when only naive is exact)."""
        if self.max_err == 0:
            return 0.0
        return self.max_err / self.naive_err if self.naive_err > 0 else math.inf

    def __str__(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (f"{self.name}: {verdict} max|err|={self.max_err:.3g} naive={self.naive_err:.3g} "
                f"tol={self.tolerance:.3g} score={self.score:.3g}{' ' + self.message if self.message else ''}")


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """``max|(ref + 0.3 - 0.3) - ref|`` evaluated in ``dtype`` (FA3's rounding floor)."""
    if ref.numel() == 0:
        return 0.0
    r = ref.detach().to(dtype)
    return ((r + 0.3 - 0.3) - r).abs().max().double().item()


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, naive: torch.Tensor, *,
            factor: float = OUT_FACTOR, zero_ref_scale: float = 1.0) -> Comparison:
    """Apply the §3 rule to ``out`` against ``ref`` (float64) with yardstick ``naive``."""
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(name, False, math.inf, math.nan, math.nan,
                          f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    ref = ref.detach().double()
    finite_ref = torch.isfinite(ref)
    bad = (~torch.isfinite(out.detach())) & finite_ref
    if bool(bad.any()):
        n = int(bad.sum())
        return Comparison(name, False, math.inf, _max_abs_diff(naive, ref), math.nan,
                          f"{n} NaN/inf value(s) where the reference is finite")
    max_err = _max_abs_diff(out, ref)
    naive_err = _max_abs_diff(naive, ref)
    floor = 2.0 * rounding_floor(ref, out.dtype)
    message = ""
    eps32 = torch.finfo(torch.float32).eps
    scale = max(1.0, float(zero_ref_scale))
    if ref.numel() and ref.abs().max().item() <= eps32 * scale:   # numerically zero: see the module docstring
        floor = ZERO_REF_ULPS * eps32 * scale
        message = "(reference numerically 0: float32 rounding floor)"
    tol = factor * naive_err + floor
    return Comparison(name, max_err <= tol, max_err, naive_err, tol, message if max_err > 0 else "")


def compare_lse(out_lse: torch.Tensor, ref_lse: torch.Tensor, *, atol: float = LSE_ATOL) -> Comparison:
    """lse must be -inf exactly where the reference is, and within ``atol`` elsewhere."""
    if tuple(out_lse.shape) != tuple(ref_lse.shape):
        return Comparison("lse", False, math.inf, 0.0, atol,
                          f"shape {tuple(out_lse.shape)} != reference {tuple(ref_lse.shape)}")
    o = out_lse.detach().double()
    r = ref_lse.detach().double()
    ref_empty = torch.isneginf(r)
    if bool(torch.isnan(o).any()):
        return Comparison("lse", False, math.inf, 0.0, atol, "NaN in lse")
    if not torch.equal(torch.isneginf(o), ref_empty):
        n = int((torch.isneginf(o) != ref_empty).sum())
        return Comparison("lse", False, math.inf, 0.0, atol, f"{n} row(s) disagree on -inf (fully-masked rows)")
    finite = ~ref_empty
    err = (o[finite] - r[finite]).abs().max().item() if bool(finite.any()) else 0.0
    return Comparison("lse", err <= atol, err, 0.0, atol)
