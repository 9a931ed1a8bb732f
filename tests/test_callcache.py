"""The call-signature cache (portattn/callcache.py): a repeated signature skips the validation
and (for stable choices) the selection, with results identical to the full path; every change
of what the validation or the choice depends on is a new signature."""

import gc
import weakref

import pytest
import torch
from test_call_path import spy  # records the calls of a module function

import portattn
from portattn import api, callcache, dispatch
from portattn.reference import reference_forward
from portattn.spec import build_spec


class Stable(portattn.Backend):
    """float32/float64 CPU reference math, declared stable; counts its calls."""

    name = "stable_counting"
    dtypes = frozenset({torch.float32, torch.float64})
    vendors = frozenset({"cpu"})
    features = frozenset({"causal", "bias", "bias_grad", "bool_mask", "gqa", "window", "top_left"})
    has_backward = True
    stable_reasons = True

    def __init__(self):
        self.calls = 0

    def forward(self, spec):
        self.calls += 1
        with torch.no_grad():
            out, lse = reference_forward(spec)
        return out.to(spec.dtype), lse

    def backward(self, spec, out, lse, dout, dlse=None):
        return portattn.get_backend("reference").backward(spec, out, lse, dout, dlse)


class Unstable(Stable):
    name = "unstable_counting"
    stable_reasons = False


@pytest.fixture
def backends(monkeypatch):
    for var in ("PORTATTN_BACKEND", "PORTATTN_POLICY", "PORTATTN_PRIORITY_CPU", "PORTATTN_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)
    stable, unstable = portattn.register_backend(Stable()), portattn.register_backend(Unstable())
    callcache.clear()
    yield stable, unstable
    portattn.unregister_backend("stable_counting")
    portattn.unregister_backend("unstable_counting")
    callcache.clear()


def qkv(*shape, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = shape or (2, 6, 4, 8)
    return [torch.randn(*shape, generator=g).requires_grad_(grad) for _ in range(3)]


def test_a_repeated_signature_is_validated_and_chosen_once(backends, monkeypatch):
    built = spy(monkeypatch, api, "build_spec")
    chosen = spy(monkeypatch, dispatch, "select_stable")
    for seed in range(3):
        q, k, v = qkv(seed=seed)
        portattn.attention(q, k, v, causal=True, backend="stable_counting")
    assert built == ["build_spec"] and chosen == ["select_stable"]
    assert backends[0].calls == 3


def test_an_unstable_backend_is_asked_on_every_call(backends, monkeypatch):
    built = spy(monkeypatch, api, "build_spec")
    chosen = spy(monkeypatch, dispatch, "select_stable")
    for seed in range(3):
        portattn.attention(*qkv(seed=seed), backend="unstable_counting")
    assert built == ["build_spec"] and chosen == ["select_stable"] * 3


def test_cached_calls_equal_the_full_path(backends):
    """bhsd layout, GQA, a broadcast bias and gradients: the second call (cached) equals a fresh
    build of the same call, value for value and gradient for gradient."""
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 4, 5, 8, generator=g, requires_grad=True)
        k = torch.randn(2, 2, 7, 8, generator=g, requires_grad=True)
        v = torch.randn(2, 2, 7, 8, generator=g, requires_grad=True)
        bias = torch.randn(1, 1, 5, 7, generator=g, requires_grad=True)
        out, lse = portattn.attention(q, k, v, layout="bhsd", attn_bias=bias, window=(3, 1), return_lse=True,
                                      backend="stable_counting")
        (out.square().sum() + lse.sum()).backward()
        return [out, lse, q.grad, k.grad, v.grad, bias.grad]

    run(0)                        # fills the cache
    cached = run(1)
    callcache.clear()
    fresh = run(1)
    for a, b in zip(cached, fresh):
        assert torch.equal(a, b)


def test_a_refused_argument_is_refused_after_an_equal_accepted_one(backends):
    q, k, v = qkv()
    portattn.attention(q, k, v, scale=1, backend="stable_counting")
    with pytest.raises(TypeError, match="scale must be a real number"):
        portattn.attention(q, k, v, scale=True, backend="stable_counting")     # True == 1, another type
    portattn.attention(q, k, v, window=(2, 0), backend="stable_counting")
    with pytest.raises(TypeError, match="window"):
        portattn.attention(q, k, v, window=(2, False), backend="stable_counting")
    portattn.attention(q, k, v, causal=True, backend="stable_counting")
    with pytest.raises(TypeError, match="causal must be a bool"):
        portattn.attention(q, k, v, causal=1, backend="stable_counting")


def test_every_state_change_is_a_new_signature(backends, monkeypatch):
    q, k, v = qkv()
    assert portattn.explain(q, k, v).selected != "stable_counting"
    first = api._choose(build_spec(q, k, v), None).name
    seen = []
    real = dispatch.select_stable

    def record(spec, backend=None):
        chosen = real(spec, backend)
        seen.append(chosen[0].name)
        return chosen

    monkeypatch.setattr(dispatch, "select_stable", record)
    portattn.attention(q, k, v)
    with portattn.use_backend("stable_counting"):
        portattn.attention(q, k, v)
    monkeypatch.setenv("PORTATTN_BACKEND", "unstable_counting")
    portattn.attention(q, k, v)
    monkeypatch.delenv("PORTATTN_BACKEND")
    monkeypatch.setenv("PORTATTN_PRIORITY_CPU", "stable_counting,reference")
    portattn.attention(q, k, v)
    monkeypatch.delenv("PORTATTN_PRIORITY_CPU")
    portattn.attention(q, k, v)                           # back to the first signature: no new choice
    assert seen == [first, "stable_counting", "unstable_counting", "stable_counting"]
    portattn.register_backend(Stable(), name="stable2", prefer=True)
    try:
        portattn.attention(q, k, v)
        assert seen[-1] == "stable2"
    finally:
        portattn.unregister_backend("stable2")


def test_grad_mode_and_requires_grad_are_part_of_the_signature(backends):
    q, k, v = qkv()
    portattn.attention(q, k, v, backend="stable_counting")
    qg = q.clone().requires_grad_(True)
    out = portattn.attention(qg, k, v, backend="stable_counting")
    assert out.requires_grad
    with torch.no_grad():
        assert not portattn.attention(qg, k, v, backend="stable_counting").requires_grad
    assert portattn.attention(qg, k, v, backend="stable_counting").requires_grad


def test_determinism_flags_are_part_of_the_signature(backends, monkeypatch):
    q, k, v = qkv()
    seen = []
    real = api.callcache.remember

    def record(sig, spec, backend, until=None):
        seen.append(spec.deterministic)
        return real(sig, spec, backend, until)

    monkeypatch.setattr(api.callcache, "remember", record)
    portattn.attention(q, k, v, backend="stable_counting")
    monkeypatch.setenv("PORTATTN_DETERMINISTIC", "1")
    portattn.attention(q, k, v, backend="stable_counting")
    assert seen == [False, True]


def test_a_template_does_not_keep_the_tensors_alive(backends):
    q, k, v = qkv()
    bias = torch.zeros(2, 4, 6, 6)
    refs = [weakref.ref(t) for t in (q, k, v, bias)]
    portattn.attention(q, k, v, attn_bias=bias, backend="stable_counting")
    del q, k, v, bias
    gc.collect()
    assert all(r() is None for r in refs)


def test_subclasses_and_varlen_take_the_full_path(backends, monkeypatch):
    built = spy(monkeypatch, api, "build_spec")
    q, k, v = qkv()
    p = torch.nn.Parameter(q)
    for _ in range(2):
        portattn.attention(p, k, v, backend="stable_counting")
    assert built == ["build_spec"] * 2
