"""torch's ``scaled_dot_product_attention``, computed by :func:`portattn.attention`.

Two ways in:

* :func:`scaled_dot_product_attention` — torch's signature and semantics, strict: what portattn
  cannot express raises ``ValueError`` naming the argument;
* :func:`route_sdpa` — a context manager: calls of ``torch.nn.functional.scaled_dot_product_attention``
  made inside it (in this thread / asyncio task) go to portattn; calls portattn cannot express
  fall back to torch's own function, silently (the yielded :class:`RouteStats` counts both).

Semantics (torch's): ``query (N, ..., L, E)``, ``key (N, ..., S, E)``, ``value (N, ..., S, Ev)``
-> ``(N, ..., L, Ev)`` (SDPA's head-major layout; ``...`` is usually the heads). ``is_causal``
is aligned **top-left** (query ``i`` sees keys ``j <= i``); ``attn_mask`` is bool (True = take
part) or float (added to the scores), broadcastable to ``(N, ..., L, S)``; ``scale`` defaults to
``1/sqrt(E)``; ``enable_gqa=True`` lets key/value have fewer heads than query (query head ``h``
reads kv head ``h // (Hq // Hkv)``, torch's ``repeat_interleave`` order).

One deliberate difference: a query row whose mask hides every key gives **0** (portattn's
contract, docs/semantics.md), where torch's math kernel gives NaN.

Not expressible (strict function: ``ValueError``; :func:`route_sdpa`: torch's function runs):
``dropout_p > 0``; ``is_causal=True`` together with ``attn_mask`` (torch rejects it too); inputs
of fewer than 3 dimensions, batch dimensions that differ between q/k/v, or head counts that are
not a multiple when ``enable_gqa=True``; dtypes/devices/problems no portattn backend runs;
any torch-only keyword a future torch may add.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
import threading

import torch

from ..api import attention
from ..errors import BackendNotAvailableError, describe

__all__ = ["scaled_dot_product_attention", "route_sdpa", "RouteStats"]

_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention


class _Unsupported(ValueError):
    """An SDPA call portattn cannot express (the router falls back to torch on it)."""


def _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Validate and reshape to 4-D ``(B, H, S, D)``; returns the kwargs of :func:`portattn.attention`
    and the output shape's leading dims. Raises :class:`_Unsupported` for what portattn cannot do."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {dropout_p!r}")
    if dropout_p != 0:
        raise _Unsupported(f"dropout_p={dropout_p} is not supported: portattn has no attention dropout; "
                           f"pass dropout_p=0.0 (e.g. evaluate with model.eval())")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if is_causal and attn_mask is not None:
        raise _Unsupported("is_causal=True cannot be combined with attn_mask (torch rejects it as well); "
                           "fold the causal pattern into the mask or drop one of them")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
            raise _Unsupported(f"scale={scale!r}: portattn needs a finite scale > 0 (None = 1/sqrt(E))")
        scale = float(scale)
    dims = query.dim()
    if dims < 3 or key.dim() != dims or value.dim() != dims:
        raise _Unsupported(f"query, key and value must have the same number (>= 3) of dimensions (N, ..., L, E); "
                           f"got query={describe(query)}, key={describe(key)}, value={describe(value)}")
    lead = tuple(query.shape[:-3]) if dims > 3 else ()
    if tuple(key.shape[:-3]) != lead or tuple(value.shape[:-3]) != lead:
        raise _Unsupported(f"query, key and value must share their batch dimensions; got query={describe(query)}, "
                           f"key={describe(key)}, value={describe(value)}")
    if dims == 3:       # (N, L, E): one head
        q, k, v = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    else:
        q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))
    hq, hk = q.shape[1], k.shape[1]
    if hk != v.shape[1]:
        raise _Unsupported(f"key and value must have the same number of heads; got key={describe(key)}, "
                           f"value={describe(value)}")
    if hq != hk and not enable_gqa:
        raise _Unsupported(f"query has {hq} heads but key/value {hk}: pass enable_gqa=True for grouped-query "
                           f"attention (or repeat key/value heads)")
    if hq != hk and (hk == 0 or hq % hk):
        raise _Unsupported(f"enable_gqa=True needs the query heads ({hq}) to be a multiple of the key/value heads ({hk})")
    bias = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise _Unsupported(f"attn_mask must be bool (True = take part) or float (added); got {describe(attn_mask)}")
        target = (*query.shape[:-1], key.shape[-2])
        try:
            full = torch.broadcast_shapes(attn_mask.shape, target)
        except RuntimeError:
            full = None
        if full != torch.Size(target):
            raise _Unsupported(f"attn_mask with shape {tuple(attn_mask.shape)} is not broadcastable to "
                               f"(N, ..., L, S)={target}")
        bias = attn_mask
        if dims == 3:
            bias = bias.unsqueeze(-3) if bias.dim() == 3 else bias
        elif dims > 4:
            bias = bias.expand(target).reshape(-1, *target[-3:])    # rare: flattened batch dims
    kwargs = dict(q=q, k=k, v=v, layout="bhsd", causal=is_causal, causal_alignment="top_left", scale=scale,
                  attn_bias=bias)
    return kwargs, (query.shape[:-1], value.shape[-1])


def _restore(out: torch.Tensor, shape) -> torch.Tensor:
    lead, ev = shape
    return out.reshape(*lead, ev) if out.dim() != len(lead) + 1 or tuple(out.shape[:-1]) != tuple(lead) else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by :func:`portattn.attention`.

    ``query (N, ..., L, E)``, ``key (N, ..., S, E)``, ``value (N, ..., S, Ev)`` -> ``(N, ..., L, Ev)``;
    top-left ``is_causal``, bool or float ``attn_mask``, ``scale``, ``enable_gqa`` as in torch.
    Raises ``ValueError`` for what portattn cannot express (``dropout_p > 0``, ``is_causal`` with
    ``attn_mask``; module docstring). Differentiable in query, key, value and a float mask.
    """
    try:
        kwargs, shape = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    except _Unsupported as exc:
        raise ValueError(str(exc)) from None
    return _restore(attention(**kwargs), shape)


# ----- routing torch.nn.functional.scaled_dot_product_attention ---------------------------------

@dataclasses.dataclass
class RouteStats:
    """What happened to the SDPA calls inside one :func:`route_sdpa` block."""

    backend: str | None = None
    routed: int = 0                                           # computed by portattn
    fell_back: int = 0                                        # computed by torch
    reasons: list[str] = dataclasses.field(default_factory=list)   # why, one per fallback (first 32)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def _count(self, reason: str | None) -> None:
        with self._lock:
            if reason is None:
                self.routed += 1
            else:
                self.fell_back += 1
                if len(self.reasons) < 32:
                    self.reasons.append(reason)


_route: contextvars.ContextVar[RouteStats | None] = contextvars.ContextVar("portattn_route_sdpa", default=None)
_install_lock = threading.Lock()
_install_count = 0


def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False,
                 **torch_only):
    """Installed as ``torch.nn.functional.scaled_dot_product_attention`` while some thread is inside
    :func:`route_sdpa`; outside such a block (in this thread) it is torch's function."""
    stats = _route.get()
    torch_args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **torch_only)
    if enable_gqa:
        torch_args["enable_gqa"] = True
    if stats is None:
        return _TORCH_SDPA(query, key, value, **torch_args)
    if torch_only:
        stats._count(f"torch-only keyword(s) {sorted(torch_only)}")
        return _TORCH_SDPA(query, key, value, **torch_args)
    token = _route.set(None)        # portattn's own sdpa backend calls torch's function: no recursion
    try:
        try:
            kwargs, shape = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            out = attention(**kwargs, backend=stats.backend)
        except (_Unsupported, BackendNotAvailableError) as exc:
            stats._count(str(exc).splitlines()[0])
            return _TORCH_SDPA(query, key, value, **torch_args)
    finally:
        _route.reset(token)
    stats._count(None)
    return _restore(out, shape)


@contextlib.contextmanager
def route_sdpa(backend: str | None = None):
    """Send ``torch.nn.functional.scaled_dot_product_attention`` calls made inside the block to portattn.

    >>> with route_sdpa() as stats:
    ...     logits = model(tokens)          # a model (e.g. transformers, attn_implementation="sdpa")
    >>> stats.routed, stats.fell_back

    ``backend`` pins a portattn backend for the routed calls (else portattn's dispatch chooses).
    Calls portattn cannot express (``dropout_p > 0``, ``is_causal`` with a mask, …; module
    docstring) run torch's own function, counted in ``stats.fell_back`` with a reason.

    Thread safety: the replacement is installed on ``torch.nn.functional`` while at least one
    block is open in any thread (a lock-protected count) and torch's function is put back when the
    last one exits, also on error. Whether a call is routed is decided by a ContextVar, so only
    calls made in the thread / asyncio task that opened the block are routed; other threads keep
    torch's behaviour. Code that bound the function before the block
    (``from torch.nn.functional import scaled_dot_product_attention``) is not affected, and neither
    are calls inside ``torch.compile``d graphs traced before the block.
    """
    global _install_count
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str) or None, got {type(backend).__name__}")
    stats = RouteStats(backend=backend)
    with _install_lock:
        if _install_count == 0:
            torch.nn.functional.scaled_dot_product_attention = _routed_sdpa
        _install_count += 1
    token = _route.set(stats)
    try:
        yield stats
    finally:
        _route.reset(token)
        with _install_lock:
            _install_count -= 1
            # put torch's function back, unless someone replaced ours in the meantime (leave theirs)
            if _install_count == 0 and torch.nn.functional.scaled_dot_product_attention is _routed_sdpa:
                torch.nn.functional.scaled_dot_product_attention = _TORCH_SDPA
