"""The call path: one validation and one backend choice per call, caches that never go stale,
the eager paths equal to the custom op, empty problems, and the small argument fixes."""

import numpy as np
import pytest
import torch

import portattn
from portattn import api, dispatch, registry
from portattn import spec as spec_mod
from portattn.reference import reference_forward


class Counting(portattn.Backend):
    """float32/float64 CPU backend computing the reference; counts forward/backward calls."""

    name = "counting"
    dtypes = frozenset({torch.float32, torch.float64})
    vendors = frozenset({"cpu"})
    features = frozenset({"causal"})
    has_backward = True

    def __init__(self):
        self.calls = []

    def forward(self, spec):
        self.calls.append("forward")
        with torch.no_grad():
            out, lse = reference_forward(spec)
        return out.to(spec.dtype), lse

    def backward(self, spec, out, lse, dout, dlse=None):
        self.calls.append("backward")
        return portattn.get_backend("reference").backward(spec, out, lse, dout)


@pytest.fixture
def counting(monkeypatch):
    for var in ("PORTATTN_BACKEND", "PORTATTN_POLICY", "PORTATTN_PRIORITY_CPU"):
        monkeypatch.delenv(var, raising=False)
    b = portattn.register_backend(Counting())
    yield b
    portattn.unregister_backend("counting")


def qkv(*shape, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    shape = shape or (1, 6, 2, 8)
    return [torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(3)]


def spy(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_one_validation_and_one_choice_per_call_forward_and_backward(counting, monkeypatch):
    built = spy(monkeypatch, api, "build_spec")
    chosen = spy(monkeypatch, dispatch, "select_stable")
    q, k, v = qkv(grad=True)
    out = portattn.attention(q, k, v, causal=True, backend="counting")
    out.sum().backward()
    assert built == ["build_spec"] and chosen == ["select_stable"]
    assert counting.calls == ["forward", "backward"]     # the backward runs on the forward's backend
    ref = reference_forward(spec_mod.build_spec(q.detach().double(), k.detach().double(), v.detach().double(),
                                                causal=True))[0]
    torch.testing.assert_close(out.detach().double(), ref, atol=1e-5, rtol=1e-5)


def test_explanations_are_not_formatted_on_the_call_path(counting, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("explain_spec on the call path")

    q, k, v = qkv()
    portattn.attention(q, k, v)          # warm the caches
    monkeypatch.setattr(dispatch, "explain_spec", boom)
    portattn.attention(q, k, v)
    portattn.attention(q, k, v, backend="counting")


def test_every_change_of_a_pin_is_seen_by_the_next_call(counting, monkeypatch):
    q, k, v = qkv()
    spec = spec_mod.build_spec(q, k, v)
    assert dispatch.select(spec).name != "counting"
    with portattn.use_backend("counting"):
        assert dispatch.select(spec).name == "counting"
    assert dispatch.select(spec).name != "counting"
    monkeypatch.setenv("PORTATTN_BACKEND", "counting")
    assert dispatch.select(spec).name == "counting"
    monkeypatch.delenv("PORTATTN_BACKEND")
    monkeypatch.setenv("PORTATTN_PRIORITY_CPU", "counting,reference")
    assert dispatch.select(spec).name == "counting"
    monkeypatch.setenv("PORTATTN_PRIORITY_CPU", "reference")
    assert dispatch.select(spec).name == "reference"


def test_a_registration_is_seen_by_the_next_call(counting):
    q, k, v = qkv()
    spec = spec_mod.build_spec(q, k, v)
    first = dispatch.select(spec).name
    assert first != "counting"
    portattn.register_backend(Counting(), name="counting2", prefer=True)
    try:
        assert dispatch.select(spec).name == "counting2"
    finally:
        portattn.unregister_backend("counting2")
    assert dispatch.select(spec).name == first


def test_problem_dependent_reasons_are_asked_on_every_call(counting, monkeypatch):
    """The cache keeps declared-capability fits only: a size-dependent reason still applies."""
    q, k, v = qkv()
    monkeypatch.setattr(Counting, "extra_reasons", lambda self, spec: ["too long"] if spec.seqlen_q > 4 else [])
    with portattn.use_backend("counting"):
        portattn.attention(q[:, :4], k, v)
        with pytest.raises(portattn.BackendNotAvailableError, match="too long"):
            portattn.attention(q, k, v)


def test_eager_paths_equal_the_custom_op():
    q, k, v = qkv(1, 9, 4, 16)
    k, v = k[:, :, :2], v[:, :, :2]
    bias = torch.randn(1, 1, 9, 9)
    for backend in ("sdpa", "reference"):
        eager, lse = portattn.attention(q, k, v, causal=True, attn_bias=bias, return_lse=True, backend=backend)
        spec = spec_mod.build_spec(q, k, v, causal=True, attn_bias=bias, return_lse=True)
        op_out, op_lse = api._attention_op(spec.q, spec.k, spec.v, None, bias, None, None, 0, 0, spec.scale, True,
                                           "bottom_right", -1, 0, 0.0, backend, True, False)
        assert torch.equal(eager, op_out) and torch.equal(lse, op_lse)


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (1, 0, 2, 8), (2, 5, 2, 8, "no keys")])
def test_empty_problems_give_zeros_and_zero_gradients(shape):
    if shape[-1] == "no keys":
        q = torch.randn(2, 5, 2, 8, requires_grad=True)
        k = torch.randn(2, 0, 2, 8, requires_grad=True)
        v = torch.randn(2, 0, 2, 8, requires_grad=True)
    else:
        q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    for backend in (None, "reference", "sdpa"):
        out, lse = portattn.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        assert out.shape == (*q.shape[:-1], v.shape[-1]) and not out.any()
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and bool(torch.isneginf(lse).all())
        out.sum().backward()
        for t in (q, k, v):
            assert t.grad is not None and not t.grad.any()
            t.grad = None
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        portattn.attention(q, k, v, backend="nope")


def test_unknown_keywords_get_a_hint():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"'is_causal' \(use causal=True"):
        portattn.attention(q, k, v, is_causal=True)
    with pytest.raises(TypeError, match=r"'softmax_scale' \(use scale="):
        portattn.attention(q, k, v, softmax_scale=0.1)


def test_numpy_scalars_are_accepted_for_scale_and_softcap():
    q, k, v = qkv()
    a = portattn.attention(q, k, v, scale=np.float32(0.1), softcap=np.float64(5.0), backend="reference")
    b = portattn.attention(q, k, v, scale=float(np.float32(0.1)), softcap=5.0, backend="reference")
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="scale must be a real number"):
        portattn.attention(q, k, v, scale=torch.tensor(0.1))


def test_cu_seqlens_as_a_list_is_a_clear_error():
    q = torch.randn(8, 2, 8)
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be a 1-D int32 torch.Tensor.*got list"):
        portattn.attention(q, q, q, cu_seqlens_q=[0, 3, 8], cu_seqlens_k=[0, 3, 8])


def test_differentiable_alibi_slopes_are_refused_not_detached():
    q, k, v = qkv(grad=True)
    slopes = torch.rand(2, requires_grad=True)
    with pytest.raises(ValueError, match="does not differentiate with respect to the ALiBi slopes"):
        portattn.attention(q, k, v, alibi_slopes=slopes)
    with torch.no_grad():
        portattn.attention(q, k, v, alibi_slopes=slopes)     # fine when no gradient is taken
    portattn.attention(q, k, v, alibi_slopes=slopes.detach())


def test_unknown_feature_names_are_rejected_at_registration():
    class Typo(portattn.Backend):
        name = "typo"
        features = frozenset({"casual"})

    with pytest.raises(ValueError, match=r"unknown feature name\(s\) \['casual'\]"):
        portattn.register_backend(Typo)
    assert "typo" not in portattn.list_backends()


def test_feature_vocabulary_is_one_list():
    from portattn import features
    assert registry.ALL_FEATURES is features.ALL_FEATURES
    q, k, v = qkv()
    spec = spec_mod.build_spec(q, k[:, :, :1], v[:, :, :1], causal=True, window=(3, 0), softcap=2.0,
                               alibi_slopes=torch.ones(2), attn_bias=torch.ones(6, 6, dtype=torch.bool))
    assert spec.features() <= features.ALL_FEATURES
    assert spec.features() == {"causal", "window", "softcap", "alibi", "bool_mask", "gqa"}


def test_policy_names_are_checked():
    with pytest.raises(ValueError, match="unknown policy 'quickest'"):
        portattn.set_policy("quickest")
    with pytest.raises(ValueError, match="'fastest' is a policy: name it alone"):
        with portattn.use_backend("sdpa", "fastest"):
            pass
    assert portattn.get_policy() == "priority"


def test_reference_backend_itself_runs_batch_zero():
    q = torch.randn(0, 4, 2, 8, requires_grad=True)
    spec = spec_mod.build_spec(q, q, q)
    ref = portattn.get_backend("reference")
    out, lse = ref.forward(spec)
    assert out.shape == (0, 4, 2, 8) and lse.shape == (0, 2, 4)
    dq, dk, dv, _ = ref.backward(spec, out, lse, torch.zeros_like(out))
    assert dq.shape == dk.shape == dv.shape == q.shape
