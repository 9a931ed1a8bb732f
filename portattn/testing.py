"""Check a backend against the float64 reference under docs/semantics.md — for tests and for
third-party backend authors::

    from portattn.testing import check_backend
    results = check_backend("mine", q, k, v, causal=True, grad=True)
    assert all(r.passed for r in results), "\\n".join(map(str, results))
"""

from __future__ import annotations

import torch

from .api import attention
from .numerics import GRAD_FACTOR, Comparison, compare, compare_lse
from .reference import naive_forward, reference_forward
from .spec import build_spec


def _leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


def check_backend(backend: str, q, k, v, *, grad: bool = False, dout: torch.Tensor | None = None,
                  **kwargs) -> list[Comparison]:
    """Run ``attention(q, k, v, backend=backend, **kwargs)`` and compare out, lse and (with
    ``grad=True``) dq/dk/dv (and d_bias for a float bias) against the float64 reference, with
    the in-dtype naive math as yardstick. Returns one :class:`Comparison` per tensor."""
    kwargs = dict(kwargs)
    bias = kwargs.get("attn_bias")
    bias_grad = grad and bias is not None and bias.is_floating_point()
    layout = kwargs.get("layout", "bshd")

    # the backend, through the public API
    lq, lk, lv = (_leaf(t) for t in (q, k, v)) if grad else (q, k, v)
    lb = _leaf(bias) if bias_grad else bias
    kw = dict(kwargs, return_lse=True, backend=backend)
    if bias is not None:
        kw["attn_bias"] = lb
    out, lse = attention(lq, lk, lv, **kw)

    spec_kwargs = {key: val for key, val in kwargs.items() if key != "backend"}
    # the reference (float64) and the naive yardstick (input dtype), on leaf copies
    rq, rk, rv = (_leaf(t, torch.float64) for t in (q, k, v))
    rb = _leaf(bias, torch.float64) if bias_grad else bias
    ref_out, ref_lse = reference_forward(build_spec(rq, rk, rv, **dict(spec_kwargs, attn_bias=rb)))
    nq, nk, nv = (_leaf(t) for t in (q, k, v))
    nb = _leaf(bias) if bias_grad else bias
    naive_out, _ = naive_forward(build_spec(nq, nk, nv, **dict(spec_kwargs, attn_bias=nb)))

    def canon(t):   # reference/naive work in the canonical layout; the API returns q's layout
        return t.transpose(1, 2) if layout == "bhsd" else t

    results = [compare("out", canon(out), ref_out, naive_out), compare_lse(lse, ref_lse)]
    if grad:
        if dout is None:
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
            dout = dout.to(out.dtype).to(out.device)
        backend_inputs = [lq, lk, lv] + ([lb] if bias_grad else [])
        ref_inputs = [rq, rk, rv] + ([rb] if bias_grad else [])
        naive_inputs = [nq, nk, nv] + ([nb] if bias_grad else [])
        g_out = torch.autograd.grad(out, backend_inputs, dout)
        g_ref = torch.autograd.grad(ref_out, ref_inputs, canon(dout).double())
        g_naive = torch.autograd.grad(naive_out, naive_inputs, canon(dout))
        spec = build_spec(q, k, v, **spec_kwargs)
        magnitude = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * spec.scale if dout.numel() else 1.0
        for name, a, r, n in zip(("dq", "dk", "dv", "dbias"), g_out, g_ref, g_naive):
            results.append(compare(name, a, r, n, factor=GRAD_FACTOR, zero_ref_scale=magnitude))
    return results


def assert_backend_matches_reference(backend: str, q, k, v, **kwargs) -> None:
    """:func:`check_backend`, raising ``AssertionError`` with every comparison on failure."""
    results = check_backend(backend, q, k, v, **kwargs)
    if not all(r.passed for r in results):
        raise AssertionError(f"backend {backend!r} differs from the reference:\n" + "\n".join(map(str, results)))
