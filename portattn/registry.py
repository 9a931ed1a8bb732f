"""The backend registry: the :class:`Backend` base class and registration.

A backend is a class with declared capabilities (class attributes) and a
:meth:`Backend.not_supported_reasons` method. Built-in backends are found through the
entry-point group ``portattn.backends`` exactly like third-party ones; an entry point is only
imported when the registry is first used, and a backend whose optional dependency is missing
reports that as a reason instead of failing the import of portattn.

Writing a backend (see docs/backends.md)::

    class MyBackend(portattn.Backend):
        name = "mine"
        dtypes = frozenset({torch.float16, torch.bfloat16})
        head_dims = (16, 128)
        vendors = frozenset({"nvidia"})
        features = frozenset({"causal", "gqa"})
        has_backward = False

        def forward(self, spec):      # -> (out, lse) in the canonical layout
            ...

    portattn.register_backend(MyBackend)
"""

from __future__ import annotations

import importlib.metadata
import threading
from typing import ClassVar

import torch

from . import config
from .features import ALL_FEATURES, check_feature_names

__all__ = ["ALL_FEATURES", "Backend", "get_backend", "list_backends", "register_backend", "unregister_backend"]

ENTRY_POINT_GROUP = "portattn.backends"

#: Built-in backends, used when portattn runs from a source tree without installed metadata
#: (``PYTHONPATH=.``) or with metadata that lacks some: same names and targets as pyproject's
#: entry points (tests/test_dispatch.py checks that the two lists agree).
_SOURCE_TREE_ENTRY_POINTS = {
    "reference": "portattn.reference:ReferenceBackend",
    "sdpa": "portattn.backends.sdpa:SdpaBackend",
    "chunked": "portattn.backends.chunked:ChunkedBackend",
    "sdpa_cudnn": "portattn.backends.sdpa_kernels:SdpaCudnnBackend",
    "sdpa_flash": "portattn.backends.sdpa_kernels:SdpaFlashBackend",
    "sdpa_efficient": "portattn.backends.sdpa_kernels:SdpaEfficientBackend",
    "sdpa_math": "portattn.backends.sdpa_kernels:SdpaMathBackend",
    "triton": "portattn.backends.triton:TritonBackend",
    "cupy": "portattn.backends.cupy:CupyBackend",
    "onnx": "portattn.backends.onnx:OnnxBackend",
}


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


class Backend:
    """Base class of every backend.

    Subclasses declare their capabilities as class attributes and implement :meth:`forward`
    (and :meth:`backward` when ``has_backward``). They may add problem-specific reasons in
    :meth:`extra_reasons` and availability checks (imports, devices) in :meth:`unavailable_reasons`.

    Tensors passed in and out are in the canonical layout of :class:`portattn.spec.AttentionSpec`:
    ``out`` has ``spec.out_shape`` and q's dtype, ``lse`` is float32 of ``spec.lse_shape``
    (natural log, ``-inf`` for rows with no visible key, whose output is 0).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    dtypes: ClassVar[frozenset] = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims: ClassVar[tuple[int, int]] = (1, 256)
    vendors: ClassVar[frozenset] = frozenset({"nvidia", "amd", "cpu"})
    features: ClassVar[frozenset] = frozenset()
    deterministic: ClassVar[bool] = True       # can give bit-identical results across runs
    has_backward: ClassVar[bool] = False
    #: True when :meth:`extra_reasons` (and :meth:`not_supported_reasons`) depend only on the
    #: spec's host metadata (shapes, strides, dtypes, devices, arguments), on torch's TF32 matmul
    #: flag and on facts fixed for the life of the process (device properties, installed
    #: packages). The call path then remembers the choice per call signature
    #: (:mod:`portattn.callcache`). False, the default, asks the backend on every call.
    stable_reasons: ClassVar[bool] = False

    # ----- availability ------------------------------------------------------------------
    def unavailable_reasons(self) -> list[str]:
        """Reasons this backend cannot run at all on this machine (missing package, ...).

        Called once and cached by :meth:`availability`; return ``[]`` when available.
        """
        return []

    def availability(self) -> list[str]:
        cached = self.__dict__.get("_availability")
        if cached is None:
            try:
                cached = list(self.unavailable_reasons())
            except Exception as exc:  # a broken optional dependency is a reason, not a crash
                cached = [f"availability check failed: {type(exc).__name__}: {exc}"]
            self.__dict__["_availability"] = cached
        return cached

    @property
    def available(self) -> bool:
        return not self.availability()

    # ----- support -----------------------------------------------------------------------
    def extra_reasons(self, spec) -> list[str]:
        """Problem-specific reasons beyond the declared capabilities (override as needed)."""
        return []

    def static_reasons(self, spec) -> list[str]:
        """Reasons that follow from the declared capabilities and availability alone: they depend
        only on ``spec.capability_key`` (device, dtype, head dims, features, grad, determinism),
        so the dispatch core caches them per key. Sizes and run-time state go in
        :meth:`extra_reasons`."""
        reasons = list(self.availability())
        if reasons:
            return reasons
        if spec.vendor not in self.vendors:
            reasons.append(f"device {spec.device} ({spec.vendor}) is not supported "
                           f"(supported: {', '.join(sorted(self.vendors))})")
        if spec.dtype not in self.dtypes:
            reasons.append(f"dtype {_dtype_name(spec.dtype)} is not supported "
                           f"(supported: {', '.join(sorted(_dtype_name(d) for d in self.dtypes))})")
        lo, hi = self.head_dims
        for label, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
            if not lo <= d <= hi:
                reasons.append(f"{label}={d} is out of range (supported: {lo}..{hi})")
        missing = spec.features() - self.features
        if missing:
            reasons.append(f"does not support {', '.join(sorted(missing))}")
        if spec.needs_grad and not self.has_backward:
            reasons.append("has no backward, and a gradient is needed (inputs require grad)")
        if spec.deterministic and not self.deterministic:
            reasons.append("has no deterministic mode, and determinism was requested "
                           "(PORTATTN_DETERMINISTIC / torch.use_deterministic_algorithms)")
        return reasons

    def not_supported_reasons(self, spec) -> list[str]:
        """Every reason this backend cannot compute ``spec``; empty means it can:
        :meth:`static_reasons`, then (when there are none) :meth:`extra_reasons`."""
        return self.static_reasons(spec) or list(self.extra_reasons(spec))

    def supports(self, spec) -> bool:
        return not self.not_supported_reasons(spec)

    # ----- compute -----------------------------------------------------------------------
    def forward(self, spec) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out, lse)`` for ``spec`` (canonical layout, see the class docstring)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement forward")

    def forward_for_backward(self, spec) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """``(out, lse, residuals)`` for a call whose backward follows on this backend: a backend
        may keep extra tensors from its forward (the triton backend: O's rounding residual) that
        its :meth:`backward` then receives as ``residuals=`` (never passed when empty, so a
        backend without residuals need not accept the keyword). Default: :meth:`forward`, none."""
        out, lse = self.forward(spec)
        return out, lse, ()

    def backward(self, spec, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                 dlse: torch.Tensor | None = None):
        """Return ``(dq, dk, dv, dbias)`` in the canonical layout; ``dbias`` is None unless a
        float ``attn_bias`` requires grad, then it has ``spec.attn_bias``'s expanded shape.

        ``dout`` is the loss gradient w.r.t. ``out`` (``spec.out_shape``); ``dlse`` is None (no
        gradient reaches the lse) or float32 of ``spec.lse_shape``: the loss gradient w.r.t. the
        natural-log lse. Since ∂lse_i/∂s_ij = P_ij, it adds ``dlse_i · P_ij`` to the score
        gradient: ``dS_ij = P_ij · (dP_ij − delta_i + dlse_i)``, i.e. ``delta`` becomes
        ``delta − dlse``. Rows with no visible key (lse = -inf) get no gradient from ``dlse``
        (and never NaN). The API passes ``dlse`` only when it is given, by keyword."""
        raise NotImplementedError(f"backend {self.name!r} has no backward")

    def capabilities(self) -> dict:
        """The declared capabilities, for ``portattn info`` and docs."""
        return {
            "dtypes": sorted(_dtype_name(d) for d in self.dtypes),
            "head_dims": list(self.head_dims),
            "vendors": sorted(self.vendors),
            "features": sorted(self.features),
            "deterministic": self.deterministic,
            "has_backward": self.has_backward,
        }

    def __repr__(self) -> str:
        return f"<portattn backend {self.name!r}>"


class _BrokenBackend(Backend):
    """Stands in for an entry point that failed to import: always unavailable, with the error."""

    def __init__(self, name: str, error: str):
        self.name = name  # type: ignore[misc]
        self._error = error

    def unavailable_reasons(self) -> list[str]:
        return [self._error]


# ----- the registry -------------------------------------------------------------------------

_lock = threading.RLock()
_backends: dict[str, Backend] = {}
_entry_points: dict[str, importlib.metadata.EntryPoint] = {}
_discovered = False
_preferred: list[str] = []   # third-party backends registered with prefer=True
_generation = 0              # bumped on every change of the set of backends (dispatch caches key on it)


def generation() -> int:
    """A number that changes whenever a backend is registered, replaced or unregistered. Loading
    a discovered entry point does not change it: the instance it gives is what that name stands
    for from the start (caches keyed on the generation hold instances, which are loaded first)."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


def _check_declared(backend: Backend, owner: str) -> None:
    """Reject declared capabilities a typo would silently turn into 'unsupported'."""
    backend.features = check_feature_names(backend.features, owner)  # type: ignore[misc]


def _discover() -> None:
    """Find entry points once (without importing them)."""
    global _discovered
    if _discovered:
        return
    with _lock:
        if _discovered:
            return
        eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        own = [ep for ep in eps if ep.dist is not None and ep.dist.name == "portattn"]
        # A source tree (no metadata) or an install older than the tree (an editable install's
        # metadata is written once): the built-ins it lacks, same targets as pyproject declares.
        named = {ep.name for ep in own}
        own += [importlib.metadata.EntryPoint(n, v, ENTRY_POINT_GROUP)
                for n, v in _SOURCE_TREE_ENTRY_POINTS.items() if n not in named]
        others = [] if config.entry_points_disabled() else [ep for ep in eps if ep not in own]
        for ep in own + others:
            if ep.name not in _entry_points and ep.name not in _backends:
                _entry_points[ep.name] = ep
        _discovered = True


def _load(name: str) -> Backend | None:
    with _lock:
        if name in _backends:
            return _backends[name]
        ep = _entry_points.get(name)
        if ep is None:
            return None
        try:
            obj = ep.load()
            backend = obj() if isinstance(obj, type) else obj
            if not isinstance(backend, Backend):
                raise TypeError(f"{ep.value} is not a portattn.Backend")
            if not backend.name:
                backend.name = name
            _check_declared(backend, f"backend {name!r} ({ep.value})")
        except Exception as exc:
            backend = _BrokenBackend(name, f"entry point {ep.value!r} failed to load: {type(exc).__name__}: {exc}")
        _backends[name] = backend
        return backend


def register_backend(backend, *, name: str | None = None, replace: bool = False, prefer: bool = False) -> Backend:
    """Register a backend (a :class:`Backend` subclass or instance) and return the instance.

    ``prefer=True`` puts it ahead of the built-in priority lists for the vendors it declares;
    otherwise it is tried after the built-in kernels and before ``reference``.
    ``replace=True`` allows replacing a backend of the same name.
    """
    inst = backend() if isinstance(backend, type) else backend
    if not isinstance(inst, Backend):
        raise TypeError(f"register_backend expects a portattn.Backend subclass or instance, got {backend!r}")
    key = name or inst.name
    if not key:
        raise ValueError("a backend needs a name: set the class attribute `name` or pass name=...")
    _check_declared(inst, f"backend {key!r}")
    _discover()
    with _lock:
        if (key in _backends or key in _entry_points) and not replace:
            raise ValueError(f"a backend named {key!r} is already registered; pass replace=True to replace it")
        _entry_points.pop(key, None)
        inst.name = key
        _backends[key] = inst
        if key in _preferred:
            _preferred.remove(key)
        if prefer:
            _preferred.insert(0, key)
        _changed()
    return inst


def unregister_backend(name: str) -> None:
    """Remove a backend by name (built-ins too, until the process restarts)."""
    _discover()
    with _lock:
        if name not in _backends and name not in _entry_points:
            raise ValueError(f"no backend named {name!r} is registered; known: {', '.join(list_backends())}")
        _backends.pop(name, None)
        _entry_points.pop(name, None)
        if name in _preferred:
            _preferred.remove(name)
        _changed()


def list_backends() -> list[str]:
    """Names of every registered backend (entry points included, not yet imported)."""
    _discover()
    with _lock:
        return sorted(set(_backends) | set(_entry_points))


def get_backend(name: str) -> Backend:
    """The backend instance registered as ``name``; ``ValueError`` listing the known names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a name (str), got {type(name).__name__}")
    _discover()
    backend = _load(name)
    if backend is None:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(list_backends())}")
    return backend


def preferred_backends() -> list[str]:
    with _lock:
        return list(_preferred)


def _reset_for_tests() -> None:
    """Forget everything (tests only): the next use rediscovers entry points."""
    global _discovered
    with _lock:
        _backends.clear()
        _entry_points.clear()
        _preferred.clear()
        _discovered = False
        _changed()
