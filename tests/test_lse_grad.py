"""The gradient through the returned lse (issue 11): ``loss = Σ out·g + Σ lse·h``.

∂lse_i/∂s_ij = P_ij, so the score gradient gains ``h_i · P_ij`` (a backend's ``delta`` becomes
``delta − dlse``). Every backend with a backward that runs on a CPU (reference, sdpa, triton
under the interpreter) is checked against torch autograd through the float64
:func:`portattn.reference.reference_forward`, with autograd through the in-dtype
:func:`portattn.reference.naive_forward` as the yardstick of the equivalence rule
(``portattn.numerics``, factor 3 for gradients). Before the fix the lse gradient was dropped:
``lse.sum().backward()`` left q/k gradients at exactly 0.
"""

from __future__ import annotations

import pytest
import torch

import portattn
from portattn.numerics import GRAD_FACTOR, compare
from portattn.reference import naive_forward, reference_forward
from portattn.registry import get_backend
from portattn.spec import build_spec

# every backend with a backward that runs on a CPU (chunked: the default CPU path; sdpa_math: torch
# SDPA's math kernel pinned)
BACKENDS = ["reference", "sdpa", "sdpa_math", "chunked", "triton"]


def _skip_unless_runs_on_cpu(backend):
    """These tests use CPU tensors: triton runs them only under its interpreter (a GPU machine
    runs its GPU tests instead)."""
    q = torch.zeros(1, 4, 1, 8, requires_grad=True)
    reasons = portattn.explain(q, q, q, backend=backend).reasons[backend]
    if reasons:
        pytest.skip(f"{backend} on CPU tensors: {'; '.join(reasons)}")


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# name -> (B, Sq, Sk, Hq, Hkv, D, dtype, kwargs); "varlen" gives per-sequence (lens_q, lens_k)
CASES = {
    "plain_fp32": (2, 17, 23, 2, 2, 16, torch.float32, {}),
    "causal_br_empty_rows_gqa2": (1, 40, 33, 4, 2, 16, torch.float16, {"causal": True}),   # 7 rows see nothing
    "causal_top_left_bf16": (1, 33, 40, 2, 1, 24, torch.bfloat16, {"causal": True, "causal_alignment": "top_left"}),
    "window_fp32": (1, 40, 40, 2, 2, 16, torch.float32, {"window": (5, 3)}),
    "softcap_causal": (1, 20, 20, 2, 2, 16, torch.float32, {"softcap": 2.0, "causal": True}),
    "alibi_fp16": (2, 17, 25, 2, 2, 16, torch.float16, {"alibi": True}),
    "bias_grad_neg_inf_rows": (2, 17, 20, 2, 2, 16, torch.float32, {"bias": True}),
    "bool_mask_empty_rows": (2, 24, 20, 2, 1, 16, torch.bfloat16, {"mask": True}),
    "varlen_gqa_empty_seq": (3, None, None, 4, 2, 16, torch.float32,
                             {"varlen": ([5, 0, 17, 9], [9, 3, 0, 12]), "causal": True}),
}


def _make(name, seed=0):
    b, sq, sk, hq, hkv, d, dtype, kw = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    kw = dict(kw)
    lens = kw.pop("varlen", None)
    if lens is not None:
        lq, lk = lens
        q = _randn(sum(lq), hq, d, dtype=dtype, gen=gen)
        k = _randn(sum(lk), hkv, d, dtype=dtype, gen=gen)
        v = _randn(sum(lk), hkv, d, dtype=dtype, gen=gen)
        kw.update(cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk))
    else:
        q = _randn(b, sq, hq, d, dtype=dtype, gen=gen)
        k = _randn(b, sk, hkv, d, dtype=dtype, gen=gen)
        v = _randn(b, sk, hkv, d, dtype=dtype, gen=gen)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(b, hq, generator=gen) * 0.5
    if kw.pop("bias", False):
        bias = _randn(b, hq, sq, sk, dtype=dtype, gen=gen)
        bias[0, :, 3] = float("-inf")          # row 3 sees no key through the bias alone
        kw["attn_bias"] = bias
    if kw.pop("mask", False):
        keep = torch.rand(b, 1, sq, sk, generator=gen) > 0.3
        keep[:, :, ::5] = False                # every 5th row sees no key
        kw["attn_bias"] = keep
    return q, k, v, kw


def _leaves(ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in ts]


def _loss_grads(fn, inputs, g, h):
    out, lse = fn(*inputs)
    loss = (out.double() * g.double()).sum() + (lse.double() * h.double()).sum()
    return torch.autograd.grad(loss, inputs)


def check_lse_grads(backend, q, k, v, *, seed=1, bias_grad=True, **kw):
    """Assert that the backend's gradients of ``Σ out·g + Σ lse·h`` (random g, h) in q, k, v
    (and a float ``attn_bias`` unless ``bias_grad=False``) pass the equivalence rule against
    float64 autograd through ``reference_forward``; skip when the backend cannot run the
    problem. Any device (the GPU tests of test_triton.py / test_cupy.py use it too). Returns
    the backend's gradients."""
    bias = kw.get("attn_bias")
    bias_grad = bias_grad and bias is not None and bias.is_floating_point()
    with torch.enable_grad():   # the spec the API will build: gradients needed
        leaves = _leaves([q, k, v] + ([bias] if bias_grad else []))
        spec = build_spec(*leaves[:3], return_lse=True, **dict(kw, attn_bias=leaves[3] if bias_grad else bias))
    reasons = get_backend(backend).not_supported_reasons(spec)
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(spec.out_shape, generator=gen).to(device=q.device, dtype=q.dtype)
    h = torch.randn(spec.lse_shape, generator=gen).to(q.device)

    def run(dtype, forward):
        def fn(q_, k_, v_, b_=bias):
            return forward(build_spec(q_, k_, v_, **dict(kw, attn_bias=b_)))
        inputs = _leaves([q, k, v] + ([bias] if bias_grad else []), dtype)
        return _loss_grads(fn, inputs, g, h)

    def api(q_, k_, v_, b_=bias):
        return portattn.attention(q_, k_, v_, return_lse=True, backend=backend, **dict(kw, attn_bias=b_))

    got = _loss_grads(api, _leaves([q, k, v] + ([bias] if bias_grad else [])), g, h)
    ref = run(torch.float64, reference_forward)
    naive = run(None, naive_forward)
    magnitude = ((g.abs().max() * v.abs().max() + h.abs().max()) * k.abs().max()).item() * spec.scale
    results = [compare(name, a, r, n, factor=GRAD_FACTOR, zero_ref_scale=magnitude)
               for name, a, r, n in zip(("dq", "dk", "dv", "dbias"), got, ref, naive)]
    assert all(r.passed for r in results), "\n".join(map(str, results))
    for t in got:
        assert torch.isfinite(t).all()
    return got


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_and_lse_gradients_match_reference(backend, name):
    q, k, v, kw = _make(name)
    check_lse_grads(backend, q, k, v, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_get_no_lse_gradient(backend):
    """Rows with lse = -inf: a (large) dlse there changes nothing and never gives NaN."""
    _skip_unless_runs_on_cpu(backend)
    q, k, v, kw = _make("causal_br_empty_rows_gqa2")
    q, k, v = (t.float() for t in (q, k, v))
    leaves = _leaves([q, k, v])
    out, lse = portattn.attention(*leaves, return_lse=True, backend=backend, **kw)
    empty = torch.isneginf(lse)
    assert empty.any() and not empty.all()
    h = torch.where(empty, 1e30, 0.0)
    grads = torch.autograd.grad([lse], leaves, [h])
    for t in grads:
        assert torch.isfinite(t).all()
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_regression_lse_sum_backward(backend):
    """The issue's exact case: ``lse.sum().backward()`` gave q/k gradients of exactly 0."""
    _skip_unless_runs_on_cpu(backend)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 16, generator=gen) for _ in range(3))
    lq, lk, lv = _leaves([q, k, v])
    out, lse = portattn.attention(lq, lk, lv, return_lse=True, backend=backend)
    lse.sum().backward()
    rq, rk, rv = _leaves([q, k, v], torch.float64)
    _, ref_lse = reference_forward(build_spec(rq, rk, rv))
    ref_lse.double().sum().backward()
    assert lq.grad.abs().max() > 0.1 and lk.grad.abs().max() > 0.1
    torch.testing.assert_close(lq.grad.double(), rq.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lk.grad.double(), rk.grad, atol=1e-5, rtol=1e-4)
    assert torch.equal(lv.grad, torch.zeros_like(lv.grad))   # lse does not depend on v


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_lse_gradient_matches_eager(backend):
    _skip_unless_runs_on_cpu(backend)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=gen) for _ in range(3))

    def f(q_, k_, v_):
        out, lse = portattn.attention(q_, k_, v_, causal=True, return_lse=True, backend=backend)
        return out.sum() + (lse * lse).sum()   # z-loss-like use of lse

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager = torch.autograd.grad(f(*(e := _leaves([q, k, v]))), e)
    comp = torch.autograd.grad(compiled(*(c := _leaves([q, k, v]))), c)
    for a, b in zip(eager, comp):
        torch.testing.assert_close(a, b)
    assert eager[0].abs().max() > 0


def test_reference_lse_gradient_is_logsumexp_of_the_scores():
    """The oracle itself, against an independent one: torch.logsumexp of explicit float64
    scores (bottom-right causal, ALiBi, Sq > Sk so that the first rows see no key)."""
    gen = torch.Generator().manual_seed(4)
    b, sq, sk, h, d = 2, 9, 6, 3, 8
    q, k, v = (torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) for s in (sq, sk, sk))
    slopes = torch.rand(b, h, generator=gen)
    w = torch.randn(b, h, sq, generator=gen, dtype=torch.float64)
    lq, lk = _leaves([q, k])
    _, lse = reference_forward(build_spec(lq, lk, v, causal=True, alibi_slopes=slopes))
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    eq, ek = _leaves([q, k])
    s = torch.einsum("bihd,bjhd->bhij", eq, ek) / d ** 0.5
    s = s - slopes.double().view(b, h, 1, 1) * (i + sk - sq - j).abs()
    s = s.masked_fill(j > i + sk - sq, float("-inf"))
    visible = (j <= i + sk - sq).any(dim=-1)                 # rows 0..2 see nothing
    expect = torch.logsumexp(s[:, :, visible], dim=-1)
    torch.testing.assert_close(lse[:, :, visible].double(), expect, atol=1e-6, rtol=0)
    assert torch.isneginf(lse[:, :, ~visible]).all()
    got = torch.autograd.grad((lse[:, :, visible].double() * w[:, :, visible]).sum(), [lq, lk])
    want = torch.autograd.grad((expect * w[:, :, visible]).sum(), [eq, ek])
    for a, e in zip(got, want):
        assert e.abs().max() > 0.1
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype,first", [(torch.bfloat16, "preprocess"), (torch.float32, "stats")])
def test_cupy_plan_hands_dlse_to_the_kernel_that_forms_delta(dtype, first):
    """No GPU needed: the backward plan passes dlse's pointer (last argument) to the preprocess
    (fp16/bf16) or stats (float32) launch, and a null pointer without it."""
    pytest.importorskip("numpy")
    from portattn.backends.cupy import runtime
    q, k, v = (torch.randn(2, 37, 2, 64, dtype=dtype) for _ in range(3))
    spec = build_spec(q, k, v, causal=True)
    out, lse = torch.randn(spec.out_shape, dtype=dtype), torch.randn(spec.lse_shape)
    dlse = torch.randn(spec.lse_shape)
    for given in (None, dlse):
        plan = runtime.plan_backward(spec, out, lse, torch.randn_like(out), dlse=given)
        (launch,) = [item for item in plan.launches if item.role == first]
        assert int(launch.args[-1]) == (0 if given is None else given.data_ptr())
