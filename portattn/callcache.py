"""The call-signature cache: one validation and one backend choice per *signature*, not per call.

A model calls :func:`portattn.attention` with the same shapes, strides, dtypes and arguments
layer after layer and step after step. Everything :func:`portattn.spec.build_spec` checks on a
dense call, and everything the backend choice depends on, is a function of

* each tensor's exact type, shape, strides, dtype, device and ``requires_grad`` (q, k, v and a
  bias), and ``torch.is_grad_enabled()``;
* the scalar arguments with their types (``scale=1`` and ``scale=True`` differ: one is refused);
* the selection state: ``backend=``, the innermost :func:`portattn.use_backend`, the policy,
  every ``PORTATTN_*`` variable the call path reads, the registry's generation, the fastest
  policy's generation (:func:`portattn.tuning.generation`), torch's deterministic-algorithms
  flags and its TF32 matmul flag.

:func:`key` builds that tuple (~3 us on a slow host, against ~12 us for the validation and
~7 us for the choice); a signature seen before reuses its validated spec as a *template*
(:func:`portattn.spec.copy_with_tensors` puts the new tensors in) and, when the choice is stable
(:func:`portattn.dispatch.select_stable`: every backend asked declares ``stable_reasons``; under
the fastest policy, a remembered winner that declares them), the chosen backend. The results are those of the full
path by construction: the same spec fields, the same backend, the same calls after that. A
provisional winner of the fastest policy (a second look pending) is kept until the moment of its
second look (one ``time.time()`` per call): the first call after it chooses again, which takes
the look.

Not cached (the full path runs): varlen (``cu_seqlens`` contents are validated on the host),
``alibi_slopes`` (converted per call), ``max_seqlen_*``, tensor subclasses, unhashable or
unusual argument types, torch.compile tracing (the custom op path) — and any call whose
validation raises (errors are never remembered).
"""

from __future__ import annotations

import threading
import time

import torch

from . import config, dispatch, registry, tuning
from .spec import copy_with_tensors

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_det = torch.are_deterministic_algorithms_enabled
_det_warn = torch.is_deterministic_algorithms_warn_only_enabled
_pinned = dispatch._pinned
_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", None) or (lambda: torch.backends.cuda.matmul.allow_tf32)

#: signature -> (template spec, bias shape, backend or None when it must be chosen per call,
#: the time.time() until which the backend holds, or None: always)
_plans: dict[tuple, tuple] = {}
LIMIT = 2048
_lock = threading.Lock()


def _tensor(t) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def key(q, k, v, bias, causal, alignment, window, scale, softcap, layout, return_lse, backend):
    """The call's signature, or None when the call is not cacheable (see the module docstring).
    Raises TypeError for unhashable arguments (the caller then takes the full path)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    if bias is not None and type(bias) is not _Tensor:
        return None
    if window is not None:
        if type(window) is not tuple or len(window) != 2:
            return None
        window = (window, type(window[0]), type(window[1]))
    return (
        _tensor(q), _tensor(k), _tensor(v), None if bias is None else _tensor(bias), _grad_enabled(),
        causal, type(causal), alignment, window, scale, type(scale), softcap, type(softcap), layout,
        return_lse, type(return_lse), backend, type(backend),
        _pinned.get(), dispatch._policy, config.state(), registry._generation, tuning._generation,
        _det(), _det_warn(), _tf32(),
    )


def spec_for(sig, q, k, v, bias):
    """``(spec, backend or None)`` for a call whose signature was seen before, else None.
    ``q, k, v, bias`` are the caller's tensors (``bias`` as given, broadcastable)."""
    plan = _plans.get(sig)
    if plan is None:
        return None
    template, bias_shape, backend, until = plan
    if until is not None and time.time() >= until:
        backend = None   # a provisional choice's second look is due: the full choice takes it
    if template.layout == "bhsd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if bias is not None:
        bias = bias.expand(bias_shape)
    return copy_with_tensors(template, q, k, v, bias), backend


def remember(sig, spec, backend, until: float | None = None) -> None:
    """Keep ``spec`` (validated) as the template of ``sig``, without its tensors (a template must
    not keep a call's activations alive), and ``backend`` (None: chosen per call; ``until``: a
    ``time.time()`` from which it is chosen per call again)."""
    bias_shape = None if spec.attn_bias is None else spec.attn_bias.shape
    template = copy_with_tensors(spec, None, None, None, None)
    with _lock:
        if len(_plans) >= LIMIT:
            _plans.clear()
        _plans[sig] = (template, bias_shape, backend, until)


def clear() -> None:
    """Forget every signature (tests; any state change is already part of the key)."""
    _plans.clear()
