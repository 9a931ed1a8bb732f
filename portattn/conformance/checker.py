"""The checking function shared by the property tests and the conformance tool.

For one :class:`~portattn.conformance.problems.Problem` on one device, :class:`Checker` computes
once the float64 reference (output, lse and, when the problem asks for them, gradients by
autograd through :func:`portattn.reference.reference_forward` on float64 leaves) and the naive
in-dtype yardstick (:func:`portattn.reference.naive_forward`), then runs any backend and judges
it with the equivalence rule of docs/semantics.md (:func:`portattn.numerics.compare`, factor 2 for the output,
3 for gradients; :func:`portattn.numerics.compare_lse` for lse), plus the exact rule for
fully-masked rows (output exactly 0, lse -inf).

Backends are called through the public API, ``portattn.attention(..., backend=name)``, and its
autograd, so the checks cover argument handling, layouts and the custom op as users see them.
``direct=True`` calls ``Backend.forward``/``backward`` on a spec instead (for debugging a
backend in isolation).
"""

from __future__ import annotations

import hashlib
import math
import time
import traceback
from dataclasses import dataclass, field

import torch

from .. import numerics
from ..reference import naive_forward, reference_forward
from ..registry import get_backend
from ..spec import build_spec
from .problems import Inputs, Problem, make_inputs

GRAD_NAMES = ("dq", "dk", "dv", "dbias")


@dataclass
class Raw:
    """A backend's results in the canonical layout (out, lse, and grads by name)."""

    out: torch.Tensor
    lse: torch.Tensor
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Outcome:
    """The verdict for one problem × backend × device.

    ``verdict`` is ``pass``, ``fail``, ``known`` (a failure listed in :mod:`.known`) or ``skip``; ``reasons`` holds the backend's reasons for a
    skip, or the failure messages. ``checks`` maps ``out``/``lse``/``dq``... to the numbers of
    the comparison; ``not_checked`` says what could not be compared and why (e.g. a backend
    without backward is still checked forward-only).
    """

    backend: str
    device: str
    verdict: str
    reasons: list[str] = field(default_factory=list)
    checks: dict[str, dict] = field(default_factory=dict)
    not_checked: list[str] = field(default_factory=list)
    checksum: str | None = None
    seconds: float = 0.0

    @property
    def score(self) -> float | None:
        """``max|out - ref| / max|naive - ref|`` of the output (None when it did not run)."""
        c = self.checks.get("out")
        if c is None:
            return None
        if c["max_err"] == 0:
            return 0.0
        return c["max_err"] / c["naive_err"] if c["naive_err"] > 0 else math.inf

    def summary(self) -> str:
        head = f"{self.backend}@{self.device}: {self.verdict}"
        if self.verdict == "skip":
            return head + " (" + "; ".join(self.reasons) + ")"
        parts = [head]
        for name, c in self.checks.items():
            if "max_err" not in c:
                parts.append(f"{name}: {'ok' if c['passed'] else 'FAIL'}")
                continue
            parts.append(f"{name}: err={c['max_err']:.3g} naive={c['naive_err']:.3g} tol={c['tolerance']:.3g}"
                         + ("" if c["passed"] else " FAIL"))
        if self.reasons:
            parts.append("| " + "; ".join(self.reasons))
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "device": self.device, "verdict": self.verdict,
                "reasons": list(self.reasons), "score": _json_float(self.score),
                "checks": {n: {k: _json_float(v) if isinstance(v, float) else v for k, v in c.items()}
                           for n, c in self.checks.items()},
                "not_checked": list(self.not_checked), "checksum": self.checksum,
                "seconds": round(self.seconds, 4)}


def _json_float(x):
    """Floats for the JSON report: 5 significant digits, "inf"/"nan" as strings."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)   # JSON has no literal for them
        return float(f"{x:.5g}")
    return x


def checksum(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes (canonical, contiguous, little-endian CPU copy)."""
    data = t.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


def _api_available() -> bool:
    import portattn
    return hasattr(portattn, "attention")


def _masked_rows(lse: torch.Tensor, varlen: bool) -> torch.Tensor:
    """Bool mask over the output's (rows, heads) positions whose reference lse is -inf."""
    empty = torch.isneginf(lse)
    return empty.transpose(0, 1) if varlen else empty.permute(0, 2, 1)


class Checker:
    """Reference, yardstick and verdicts for one problem on one device."""

    def __init__(self, problem: Problem, device="cpu", *, direct: bool = False):
        self.problem = problem
        self.device = str(torch.device(device))
        self.direct = direct
        self._ref: Raw | None = None
        self._naive: Raw | None = None
        self._grad_scale: float | None = None
        self._poisoned_rows: torch.Tensor | None = None

    # ----- reference and yardstick ---------------------------------------------------------
    def _spec_for(self, inp: Inputs, q, k, v, bias):
        kw = dict(inp.kwargs)
        kw["layout"] = "bshd"
        if bias is not None:
            kw["attn_bias"] = bias
        return build_spec(q, k, v, **kw)

    def _math(self, fn, dtype) -> Raw:
        """Run ``fn`` (reference_forward or naive_forward) on leaf copies in ``dtype``."""
        p = self.problem
        inp = make_inputs(p, self.device, clean=True)   # a poisoned problem's oracle: the clean inputs
        self._poisoned_rows = inp.poisoned_rows
        q, k, v = (inp.canonical(t).detach().to(dtype) for t in (inp.q, inp.k, inp.v))
        bias = inp.bias
        if bias is not None and bias.is_floating_point():
            bias = bias.detach().to(dtype)
        if p.grad:
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            if p.bias_grad and bias is not None:
                bias.requires_grad_(True)
        with torch.enable_grad() if p.grad else torch.no_grad():
            out, lse = fn(self._spec_for(inp, q, k, v, bias))
            grads = {}
            if p.grad:
                dout = inp.canonical(inp.dout).to(out.dtype)
                leaves = [q, k, v] + ([bias] if p.bias_grad and bias is not None else [])
                # every query row without a key (e.g. varlen q (1, 0), k (0, 1)): nothing depends on the leaves
                got = (torch.autograd.grad(out, leaves, dout, allow_unused=True) if out.requires_grad
                       else [None] * len(leaves))
                for name, g, leaf in zip(GRAD_NAMES, got, leaves):
                    grads[name] = torch.zeros_like(leaf) if g is None else g
        if self._grad_scale is None:
            # magnitude of the quantities a gradient cancels (numerics.compare's zero_ref_scale)
            dout, kk, vv = inp.canonical(inp.dout), inp.canonical(inp.k), inp.canonical(inp.v)
            peaks = [t.detach().abs().max().item() if t.numel() else 0.0 for t in (dout, kk, vv)]
            scale = p.scale if p.scale is not None else 1.0 / math.sqrt(p.head_dim)
            self._grad_scale = peaks[0] * peaks[1] * peaks[2] * scale
        return Raw(out.detach(), lse.detach(), {n: g.detach() for n, g in grads.items()})

    @property
    def reference(self) -> Raw:
        if self._ref is None:
            self._ref = self._math(reference_forward, torch.float64)
        return self._ref

    @property
    def naive(self) -> Raw:
        if self._naive is None:
            self._naive = self._math(naive_forward, self.problem.torch_dtype)
        return self._naive

    # ----- running a backend ---------------------------------------------------------------
    def plan(self, backend_name: str) -> tuple[list[str], bool, bool, list[str]]:
        """``(skip reasons, grads?, bias grad?, not_checked)`` for this backend on this problem.

        A backend without backward (or without ``bias_grad``) is still checked forward-only
        (or without dbias), and that is recorded in ``not_checked``.
        """
        p = self.problem
        try:
            backend = get_backend(backend_name)
        except ValueError as exc:
            return [str(exc)], False, False, []
        not_checked = []
        grads = p.grad and backend.has_backward
        if p.grad and not backend.has_backward:
            not_checked.append("gradients: backend has no backward")
        if grads and p.poison and p.poison_at == "partial":
            grads = False
            not_checked.append("gradients: a non-finite key that some rows see makes every gradient of its "
                               "(batch, head) non-finite (docs/semantics.md)")
        bias_grad = grads and p.bias_grad and "bias_grad" in backend.features
        if grads and p.bias_grad and not bias_grad:
            not_checked.append("dbias: backend does not declare bias_grad")
        inp = make_inputs(p, self.device, requires_grad=grads, bias_requires_grad=bias_grad)
        with torch.enable_grad() if grads else torch.no_grad():
            spec = build_spec(inp.q, inp.k, inp.v, **inp.kwargs)
        return backend.not_supported_reasons(spec), grads, bias_grad, not_checked

    def run_backend(self, backend_name: str, *, grads: bool, bias_grad: bool, perturb_except: int | None = None,
                    problem: Problem | None = None) -> Raw:
        """Run one backend; return its canonical results (raises what the backend raises)."""
        p = problem or self.problem
        inp = make_inputs(p, self.device, requires_grad=grads, bias_requires_grad=bias_grad,
                          perturb_except=perturb_except)
        if self.direct or not _api_available():
            return self._run_direct(backend_name, inp, grads, bias_grad)
        import portattn
        with torch.enable_grad() if grads else torch.no_grad():
            out, lse = portattn.attention(inp.q, inp.k, inp.v, return_lse=True, backend=backend_name, **inp.kwargs)
            result = Raw(inp.canonical(out).detach(), lse.detach())
            if grads:
                leaves = [inp.q, inp.k, inp.v] + ([inp.bias] if bias_grad else [])
                got = (torch.autograd.grad(out, leaves, inp.dout, allow_unused=True) if out.requires_grad
                       else [None] * len(leaves))
                for name, g, leaf in zip(GRAD_NAMES, got, leaves):
                    g = torch.zeros_like(leaf) if g is None else g
                    result.grads[name] = (inp.canonical(g) if name != "dbias" else g).detach()
        return result

    def _run_direct(self, backend_name: str, inp: Inputs, grads: bool, bias_grad: bool) -> Raw:
        backend = get_backend(backend_name)
        with torch.enable_grad() if grads else torch.no_grad():
            spec = build_spec(inp.q, inp.k, inp.v, return_lse=True, **inp.kwargs)
        with torch.no_grad():
            out, lse = backend.forward(spec)
        result = Raw(out.detach(), lse.detach())
        if grads:
            dq, dk, dv, dbias = backend.backward(spec, out, lse, inp.canonical(inp.dout))
            result.grads.update(dq=dq, dk=dk, dv=dv)
            if bias_grad:
                result.grads["dbias"] = (dbias.sum_to_size(inp.bias.shape) if dbias is not None
                                         else torch.full_like(inp.bias, float("nan")))
        return result

    # ----- judging -------------------------------------------------------------------------
    def check(self, backend_name: str) -> Outcome:
        """Run and judge one backend (never raises for a backend's error: that is a failure)."""
        start = time.perf_counter()
        outcome = Outcome(backend=backend_name, device=self.device, verdict="skip")
        try:
            reasons, grads, bias_grad, not_checked = self.plan(backend_name)
        except Exception as exc:   # a support check that crashes is a bug in the backend
            outcome.verdict = "fail"
            outcome.reasons = [f"not_supported_reasons raised {type(exc).__name__}: {exc}"]
            return outcome
        if reasons:
            outcome.reasons = reasons
            outcome.seconds = time.perf_counter() - start
            return outcome
        outcome.not_checked = not_checked
        try:
            got = self.run_backend(backend_name, grads=grads, bias_grad=bias_grad)
        except Exception as exc:
            outcome.verdict = "fail"
            tb = traceback.extract_tb(exc.__traceback__)
            where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
            outcome.reasons = [f"raised {type(exc).__name__}: {str(exc)[:500]}{where}"]
            outcome.seconds = time.perf_counter() - start
            return outcome
        outcome.checksum = checksum(got.out)
        failures = self.judge(got, outcome.checks)
        outcome.verdict = "fail" if failures else "pass"
        outcome.reasons = failures
        if failures:
            from .known import known_limitation
            failed = [name for name, c in outcome.checks.items() if not c.get("passed", True)]
            why = known_limitation(self.problem, backend_name, failed)
            if why is not None:
                outcome.verdict = "known"
                outcome.reasons = [f"known limitation: {why}"] + failures
        outcome.seconds = time.perf_counter() - start
        return outcome

    def judge(self, got: Raw, checks: dict | None = None) -> list[str]:
        """Compare ``got`` with the reference under §3; return failure messages (empty = pass)."""
        checks = {} if checks is None else checks
        ref, naive = self.reference, self.naive
        failures = []
        got_out, got_lse = got.out, got.lse
        rows = self._poisoned_rows
        if rows is not None and bool(rows.any()) and tuple(got.out.shape) == tuple(ref.out.shape) \
                and tuple(got.lse.shape) == tuple(ref.lse.shape):
            # Rows that see a poisoned key must be non-finite (the reference on the poisoned inputs
            # is NaN there); they are checked for that, explicitly, and left out of the comparison.
            lse_rows = rows.transpose(0, 1) if self.problem.is_varlen else rows.permute(0, 2, 1)
            finite_out = int(torch.isfinite(got.out.detach()[rows]).all(dim=-1).sum())
            finite_lse = int(torch.isfinite(got.lse.detach()[lse_rows]).sum())
            ok = finite_out == 0 and finite_lse == 0
            checks["poisoned_rows"] = {"passed": ok, "rows": int(rows.sum()), "finite_out_rows": finite_out,
                                       "finite_lse": finite_lse}
            if not ok:
                failures.append(f"poisoned_rows: {finite_out} output row(s) and {finite_lse} lse value(s) finite "
                                f"among {int(rows.sum())} row(s) that see a non-finite key (expected NaN/inf, "
                                f"as the reference gives)")
            got_out = torch.where(rows.unsqueeze(-1), ref.out.to(got.out.dtype), got.out.detach())
            got_lse = torch.where(lse_rows, ref.lse, got.lse.detach())
        results = [numerics.compare("out", got_out, ref.out, naive.out, factor=numerics.OUT_FACTOR),
                   numerics.compare_lse(got_lse, ref.lse)]
        for name in GRAD_NAMES:
            if name in got.grads:
                results.append(numerics.compare(name, got.grads[name], ref.grads[name], naive.grads[name],
                                                factor=numerics.GRAD_FACTOR, zero_ref_scale=self._grad_scale))
        for c in results:
            checks[c.name] = {"passed": c.passed, "max_err": c.max_err, "naive_err": c.naive_err,
                              "tolerance": c.tolerance}
            if not c.passed:
                failures.append(str(c))
        # fully-masked rows: output exactly 0 (not merely close), lse -inf (compare_lse checks it)
        if tuple(got.out.shape) == tuple(ref.out.shape) and tuple(ref.lse.shape) == tuple(got.lse.shape):
            rows = _masked_rows(ref.lse, self.problem.is_varlen)
            if bool(rows.any()):
                nonzero = int((got.out.detach()[rows] != 0).sum())
                checks["masked_rows"] = {"passed": nonzero == 0, "rows": int(rows.sum()), "nonzero": nonzero}
                if nonzero:
                    failures.append(f"masked_rows: {nonzero} value(s) != 0 in {int(rows.sum())} fully-masked "
                                    f"row(s) (must be exactly 0)")
        return failures


def check_problem(problem: Problem, backends=None, device="cpu", *, direct: bool = False) -> list[Outcome]:
    """Judge every named (default: every registered) backend on ``problem``; skipped backends
    carry their reasons. ``reference`` itself is included: it must pass its own rule."""
    from ..registry import list_backends
    if isinstance(backends, str):
        backends = [backends]
    names = list(backends) if backends is not None else list_backends()
    checker = Checker(problem, device, direct=direct)
    return [checker.check(name) for name in names]
