"""Backend selection: priority lists per vendor, pinning, the "fastest" policy, explanations.

Order of precedence for the backend used by one call:

1. ``attention(..., backend="name")``;
2. the innermost ``with portattn.use_backend("name", ...)``;
3. the ``PORTATTN_BACKEND`` environment variable;
4. the policy (:func:`set_policy`, else ``PORTATTN_POLICY``): ``"priority"`` (the default) takes
   the first backend of the device vendor's priority list that has no reasons; ``"fastest"``
   takes the fastest of those with no reasons, timed once per shape class and remembered
   (:mod:`portattn.tuning`).

``"fastest"`` may also be named wherever a backend name goes (``backend="fastest"``,
``use_backend("fastest")``, ``PORTATTN_BACKEND=fastest``). A pinned backend that cannot run
raises :class:`~portattn.errors.BackendNotAvailableError` (a ``ValueError``) with its reasons —
never a silent fallback. ``use_backend`` with several names restricts the choice to those, in
that order.

The call path (:func:`select`) formats no reason strings: per capability key (device, dtype,
head dims, features, grad, determinism) it caches the candidates whose declared capabilities
fit, and then asks only those, in order, for their size- and state-dependent reasons
(``Backend.extra_reasons``). Reasons are formatted for :func:`explain_spec` and for errors. Any
change of the registry, of a pin, of the policy or of the ``PORTATTN_*`` variables is part of
the cache key, so the next call sees it.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

from . import config, registry, tuning
from .errors import BackendNotAvailableError
from .registry import Backend, get_backend, list_backends, preferred_backends
from .spec import AttentionSpec

#: Built-in priority per vendor. Third-party backends come after the kernels, before
#: ``reference``, unless registered with ``prefer=True``; PORTATTN_PRIORITY_<VENDOR> overrides.
PRIORITY = {
    # torch SDPA's kernels one by one after "sdpa" (which lets torch choose): first-fit never
    # reaches them, the "fastest" policy times them like any other candidate
    "nvidia": ["triton", "cupy", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "onnx", "reference"],
    "amd": ["triton", "sdpa", "sdpa_flash", "sdpa_efficient", "reference"],
    # Triton on CPU means its interpreter (a test tool): pin it to use it, it is never automatic.
    "cpu": ["chunked", "sdpa", "onnx", "reference"],
}
_DEFAULT_PRIORITY = ["sdpa", "reference"]
PRIORITY_ALL = frozenset(n for names in PRIORITY.values() for n in names)
#: built-in backends never chosen automatically: pin them (sdpa_math is what sdpa does on a CPU
#: and for float32 on a GPU anyway; the fastest policy does not time it)
PIN_ONLY = frozenset({"sdpa_math"})

#: Policies: how the candidates with no reasons are ranked when nothing pins a backend.
PRIORITY_POLICY = "priority"
FASTEST = "fastest"
POLICIES = (PRIORITY_POLICY, FASTEST)

_pinned: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("portattn_backend", default=())
_policy: str | None = None   # set_policy(); None = PORTATTN_POLICY or "priority"


# ----- names, pins and the policy ------------------------------------------------------------

def _check_names(names, source: str) -> tuple[str, ...]:
    names = tuple(names)
    if names == (FASTEST,):
        return names
    known = list_backends()
    for n in names:
        if not isinstance(n, str) or n not in known:
            hint = f" ({FASTEST!r} is a policy: name it alone)" if n == FASTEST else ""
            raise ValueError(f"unknown backend {n!r} in {source}{hint}; known backends: {', '.join(known)}; "
                             f"policies: {', '.join(POLICIES)}")
    return names


@contextlib.contextmanager
def use_backend(*names: str):
    """Pin a backend (or restrict the choice to several, in order) inside a ``with`` block.

    Nestable (the innermost wins) and local to the thread / asyncio task (a ContextVar)::

        with portattn.use_backend("triton"):
            out = portattn.attention(q, k, v)          # triton or a ValueError with its reasons
        with portattn.use_backend("fastest"):
            out = portattn.attention(q, k, v)          # the fastest verified backend for this shape
    """
    if not names:
        raise ValueError("use_backend() needs at least one backend name; known: " + ", ".join(list_backends()))
    token = _pinned.set(_check_names(names, "use_backend()"))
    try:
        yield
    finally:
        _pinned.reset(token)


def set_policy(policy: str | None) -> None:
    """Make ``"fastest"`` (or ``"priority"``) the default for calls that pin nothing; ``None``
    returns to ``PORTATTN_POLICY`` (default ``"priority"``). Process-wide."""
    global _policy
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)} (or None for the default)")
    _policy = policy


def get_policy() -> str:
    """The policy in force for calls that pin nothing."""
    if _policy is not None:
        return _policy
    env = config.policy()
    if env not in POLICIES:
        raise ValueError(f"PORTATTN_POLICY={env!r} is not a policy; use one of {', '.join(POLICIES)}")
    return env


_parsed_names: dict[str, tuple[str, ...]] = {}


def _split(value: str, source: str) -> tuple[str, ...]:
    key = (value, source, registry.generation())
    names = _parsed_names.get(key)
    if names is None:
        names = _check_names([n.strip() for n in value.split(",") if n.strip()], source)
        if len(_parsed_names) > 256:
            _parsed_names.clear()
        _parsed_names[key] = names
    return names


def _requested(backend: str | None) -> tuple[tuple[str, ...], str]:
    """The pinned names and where they came from ('' when nothing is pinned); ``("fastest",)``
    when the fastest policy applies."""
    if backend:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a backend name (str), got {type(backend).__name__}")
        return _split(backend, "backend="), "backend="
    ctx = _pinned.get()
    if ctx:
        return ctx, "use_backend()"
    env = config.backend()
    if env:
        return _split(env, "PORTATTN_BACKEND"), "PORTATTN_BACKEND"
    if get_policy() == FASTEST:
        return (FASTEST,), "the policy"
    return (), ""


def priority_for(vendor: str) -> list[str]:
    """The ordered candidate list for a device vendor (overrides and registrations applied)."""
    override = config.priority_override(vendor)
    if override is not None:
        return list(_check_names(override, f"PORTATTN_PRIORITY_{vendor.upper()}"))
    base = list(PRIORITY.get(vendor, _DEFAULT_PRIORITY))
    known = list_backends()
    extra = [n for n in known if n not in base and n not in PRIORITY_ALL and n not in PIN_ONLY]
    preferred = [n for n in preferred_backends() if n in known]
    ordered = preferred + [n for n in base if n not in preferred and n != "reference"]
    ordered += [n for n in extra if n not in ordered]
    if "reference" in known and "reference" not in ordered:
        ordered.append("reference")
    return [n for n in ordered if n in known]


def _candidates(spec: AttentionSpec, names: tuple[str, ...]) -> list[str]:
    return list(names) if names and names != (FASTEST,) else priority_for(spec.vendor)


# ----- the call path -------------------------------------------------------------------------

#: capability key (+ pins, policy, registry generation, priority override) -> backends whose
#: declared capabilities fit, in order
_fits: dict[tuple, tuple[Backend, ...]] = {}
_FITS_LIMIT = 4096


def _fitting(spec: AttentionSpec, names: tuple[str, ...]) -> tuple[Backend, ...]:
    key = (spec.capability_key, names, registry.generation(), config.priority_raw(spec.vendor))
    fits = _fits.get(key)
    if fits is None:
        fits = tuple(b for b in map(get_backend, _candidates(spec, names)) if not b.static_reasons(spec))
        if len(_fits) >= _FITS_LIMIT:
            _fits.clear()
        _fits[key] = fits
    return fits


def _runs(backend: Backend, spec: AttentionSpec) -> bool:
    if type(backend).not_supported_reasons is not Backend.not_supported_reasons:
        return not backend.not_supported_reasons(spec)   # a backend with its own rules: ask it all
    return not backend.extra_reasons(spec)


def select(spec: AttentionSpec, backend: str | None = None) -> Backend:
    """The backend that will compute ``spec``; raises BackendNotAvailableError listing reasons."""
    return select_stable(spec, backend)[0]


def select_stable(spec: AttentionSpec, backend: str | None = None) -> tuple[Backend, bool]:
    """``(backend, stable)``: :func:`select`'s choice, and whether it may be remembered for every
    call with the same signature (:mod:`portattn.callcache`): True under a pin or the priority
    policy when every backend asked (the ones passed over and the one chosen) declares
    ``stable_reasons``; under the fastest policy when the class's remembered winner was chosen
    and declares them (the signature holds :func:`portattn.tuning.generation`, which changes
    with any remembered winner), never for a choice that timed the candidates. A provisional
    winner (a second look pending: :func:`portattn.tuning.recheck_due`) gives ``stable`` as a
    float instead: the ``time.time()`` until which the choice may be remembered (the second
    look's moment, when the next call chooses again and takes it)."""
    names, _ = _requested(backend)
    fits = _fitting(spec, names)
    if names == (FASTEST,):
        winner, until = tuning.held_winner(spec)   # a class timed before: its winner, no timing, no sync
        if winner is not None:
            for b in fits:
                if b.name == winner:
                    if _runs(b, spec):
                        return b, (b.stable_reasons if until is None else b.stable_reasons and until)
                    break
        runnable = [b.name for b in fits if _runs(b, spec)]
        if runnable:
            return get_backend(tuning.choose(spec, runnable)), False
    else:
        stable = True
        for b in fits:
            stable = stable and b.stable_reasons
            if _runs(b, spec):
                return b, stable
    _raise_no_backend(spec, backend)


def _raise_no_backend(spec: AttentionSpec, backend: str | None):
    exp = explain_spec(spec, backend)
    detail = "\n".join(f"  - {n}: {'; '.join(exp.reasons[n]) or 'supported'}" for n in exp.candidates)
    if exp.pinned_by and len(exp.candidates) == 1:
        msg = (f"backend {exp.candidates[0]!r} (pinned by {exp.pinned_by}) cannot run this problem "
               f"({exp.spec_summary}):\n{detail}\nunpin it to let portattn choose, or change the inputs")
    elif exp.pinned_by and exp.policy != FASTEST:
        msg = f"none of the backends pinned by {exp.pinned_by} can run this problem ({exp.spec_summary}):\n{detail}"
    else:
        msg = f"no backend can run this problem ({exp.spec_summary}):\n{detail}"
    raise BackendNotAvailableError(msg, exp.reasons)


# ----- explanations --------------------------------------------------------------------------

@dataclass
class Explanation:
    """Why each backend was or was not chosen for one problem."""

    spec_summary: str
    candidates: list[str]
    reasons: dict[str, list[str]] = field(default_factory=dict)
    selected: str | None = None
    pinned_by: str = ""
    not_candidates: list[str] = field(default_factory=list)
    policy: str = PRIORITY_POLICY
    #: fastest policy: backend -> seconds per call measured for this shape class (None: not timed yet)
    timings: dict[str, float] | None = None

    def __str__(self) -> str:
        lines = [f"problem: {self.spec_summary}"]
        if self.policy == FASTEST:
            lines.append(f"policy: fastest ({'timed' if self.timings else 'not timed yet: the first call times'} "
                         f"the supported backends for this shape class)")
        elif self.pinned_by:
            lines.append(f"pinned by {self.pinned_by}: {', '.join(self.candidates)}")
        for name in self.candidates:
            rs = self.reasons.get(name, [])
            mark = "->" if name == self.selected else ("ok" if not rs else "  ")
            status = "selected" if name == self.selected else ("supported" if not rs else "; ".join(rs))
            if self.timings and name in self.timings:
                t = self.timings[name]
                status += f"  [{t * 1e6:.1f} us/call]" if t == t and t != float("inf") else "  [failed the check]"
            lines.append(f" {mark} {name:<14} {status}")
        for name in self.not_candidates:
            lines.append(f"    {name:<14} not in this device's priority list (pin it with backend={name!r})")
        lines.append(f"selected: {self.selected}" if self.selected else "selected: none (see reasons above)")
        return "\n".join(lines)


def explain_spec(spec: AttentionSpec, backend: str | None = None) -> Explanation:
    """Reasons for every candidate backend, in priority order, and the one selected."""
    names, source = _requested(backend)
    fastest = names == (FASTEST,)
    candidates = _candidates(spec, names)
    pinned = bool(names) and not fastest
    exp = Explanation(spec.summary(), candidates, pinned_by=source if pinned else "",
                      not_candidates=[] if pinned else [n for n in list_backends() if n not in candidates],
                      policy=FASTEST if fastest else PRIORITY_POLICY)
    for name in candidates:
        exp.reasons[name] = get_backend(name).not_supported_reasons(spec)
    runnable = [n for n in candidates if not exp.reasons[n]]
    if fastest and runnable:
        from . import tuning
        exp.timings = tuning.timings_for(spec)
        exp.selected = tuning.cached_choice(spec, runnable) or runnable[0]
    elif runnable:
        exp.selected = runnable[0]
    return exp


def _reset_caches() -> None:
    """Forget cached choices (tests; the registry generation already covers registrations)."""
    _fits.clear()
    _parsed_names.clear()
