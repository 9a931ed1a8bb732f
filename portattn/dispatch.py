"""Backend selection: priority lists per vendor, pinning, and explanations.

Order of precedence for the backend used by one call:

1. ``attention(..., backend="name")``;
2. the innermost ``with portattn.use_backend("name", ...)``;
3. the ``PORTATTN_BACKEND`` environment variable;
4. the first backend of the device vendor's priority list that has no reasons.

A pinned backend that cannot run raises :class:`~portattn.errors.BackendNotAvailableError`
(a ``ValueError``) with its reasons — never a silent fallback. ``use_backend`` with several
names restricts the choice to those, in that order.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

from . import config
from .errors import BackendNotAvailableError
from .registry import get_backend, list_backends, preferred_backends
from .spec import AttentionSpec

#: Built-in priority per vendor. Third-party backends come after the kernels, before
#: ``reference``, unless registered with ``prefer=True``; PORTATTN_PRIORITY_<VENDOR> overrides.
PRIORITY = {
    "nvidia": ["triton", "cupy", "sdpa", "onnx", "reference"],
    "amd": ["triton", "sdpa", "reference"],
    # Triton on CPU means its interpreter (a test tool): pin it to use it, it is never automatic.
    "cpu": ["chunked", "sdpa", "onnx", "reference"],
}
_DEFAULT_PRIORITY = ["sdpa", "reference"]

_pinned: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("portattn_backend", default=())


def _check_names(names, source: str) -> tuple[str, ...]:
    known = list_backends()
    for n in names:
        if not isinstance(n, str) or n not in known:
            raise ValueError(f"unknown backend {n!r} in {source}; known backends: {', '.join(known)}")
    return tuple(names)


@contextlib.contextmanager
def use_backend(*names: str):
    """Pin a backend (or restrict the choice to several, in order) inside a ``with`` block.

    Nestable (the innermost wins) and local to the thread / asyncio task (a ContextVar)::

        with portattn.use_backend("triton"):
            out = portattn.attention(q, k, v)          # triton or a ValueError with its reasons
    """
    if not names:
        raise ValueError("use_backend() needs at least one backend name; known: " + ", ".join(list_backends()))
    token = _pinned.set(_check_names(names, "use_backend()"))
    try:
        yield
    finally:
        _pinned.reset(token)


def priority_for(vendor: str) -> list[str]:
    """The ordered candidate list for a device vendor (overrides and registrations applied)."""
    override = config.priority_override(vendor)
    if override is not None:
        return list(_check_names(override, f"PORTATTN_PRIORITY_{vendor.upper()}"))
    base = list(PRIORITY.get(vendor, _DEFAULT_PRIORITY))
    known = list_backends()
    extra = [n for n in known if n not in base and n not in PRIORITY_ALL]
    preferred = [n for n in preferred_backends() if n in known]
    ordered = preferred + [n for n in base if n not in preferred and n != "reference"]
    ordered += [n for n in extra if n not in ordered]
    if "reference" in known and "reference" not in ordered:
        ordered.append("reference")
    return [n for n in ordered if n in known]


PRIORITY_ALL = frozenset(n for names in PRIORITY.values() for n in names)


def _requested(backend: str | None) -> tuple[tuple[str, ...], str]:
    """The pinned names and where they came from ('' when nothing is pinned)."""
    if backend:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a backend name (str), got {type(backend).__name__}")
        return _check_names([n.strip() for n in backend.split(",")], "backend="), "backend="
    ctx = _pinned.get()
    if ctx:
        return ctx, "use_backend()"
    env = config.backend()
    if env:
        return _check_names([n.strip() for n in env.split(",") if n.strip()], "PORTATTN_BACKEND"), "PORTATTN_BACKEND"
    return (), ""


@dataclass
class Explanation:
    """Why each backend was or was not chosen for one problem."""

    spec_summary: str
    candidates: list[str]
    reasons: dict[str, list[str]] = field(default_factory=dict)
    selected: str | None = None
    pinned_by: str = ""
    not_candidates: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"problem: {self.spec_summary}"]
        if self.pinned_by:
            lines.append(f"pinned by {self.pinned_by}: {', '.join(self.candidates)}")
        for name in self.candidates:
            rs = self.reasons.get(name, [])
            mark = "->" if name == self.selected else ("ok" if not rs else "  ")
            status = "selected" if name == self.selected else ("supported" if not rs else "; ".join(rs))
            lines.append(f" {mark} {name:<10} {status}")
        for name in self.not_candidates:
            lines.append(f"    {name:<10} not in this device's priority list (pin it with backend={name!r})")
        lines.append(f"selected: {self.selected}" if self.selected else "selected: none (see reasons above)")
        return "\n".join(lines)


def explain_spec(spec: AttentionSpec, backend: str | None = None) -> Explanation:
    """Reasons for every candidate backend, in priority order, and the one selected."""
    names, source = _requested(backend)
    if spec.is_empty and not names:
        names, source = ("reference",), "empty problem (no query rows or no keys)"
    candidates = list(names) if names else priority_for(spec.vendor)
    exp = Explanation(spec.summary(), candidates, pinned_by=source,
                      not_candidates=[] if names else [n for n in list_backends() if n not in candidates])
    for name in candidates:
        reasons = get_backend(name).not_supported_reasons(spec)
        exp.reasons[name] = reasons
        if not reasons and exp.selected is None:
            exp.selected = name
    return exp


def select(spec: AttentionSpec, backend: str | None = None):
    """The backend that will compute ``spec``; raises BackendNotAvailableError listing reasons."""
    exp = explain_spec(spec, backend)
    if exp.selected is not None:
        return get_backend(exp.selected)
    detail = "\n".join(f"  - {n}: {'; '.join(exp.reasons[n]) or 'supported'}" for n in exp.candidates)
    if exp.pinned_by and len(exp.candidates) == 1:
        msg = (f"backend {exp.candidates[0]!r} (pinned by {exp.pinned_by}) cannot run this problem "
               f"({exp.spec_summary}):\n{detail}\nunpin it to let portattn choose, or change the inputs")
    elif exp.pinned_by:
        msg = f"none of the backends pinned by {exp.pinned_by} can run this problem ({exp.spec_summary}):\n{detail}"
    else:
        msg = f"no backend can run this problem ({exp.spec_summary}):\n{detail}"
    raise BackendNotAvailableError(msg, exp.reasons)
