"""Backend selection, pinning, PORTATTN_BACKEND, reasons, and third-party backends."""

import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import portattn
from portattn import dispatch, registry
from portattn.reference import reference_forward


class ToyBackend(portattn.Backend):
    """A third-party backend: float32, causal only, no backward; counts its calls."""

    name = "toy"
    dtypes = frozenset({torch.float32})
    head_dims = (8, 64)
    vendors = frozenset({"cpu"})
    features = frozenset({"causal", "top_left"})
    has_backward = False

    def __init__(self):
        self.calls = 0

    def forward(self, spec):
        self.calls += 1
        out, lse = reference_forward(spec)
        return out.to(spec.dtype), lse


@pytest.fixture
def toy():
    backend = portattn.register_backend(ToyBackend, prefer=True)
    yield backend
    portattn.unregister_backend("toy")


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("PORTATTN_BACKEND", "PORTATTN_PRIORITY_CPU", "PORTATTN_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def qkv(d=16, dtype=torch.float32, grad=False):
    q = torch.randn(1, 6, 2, d, dtype=dtype, requires_grad=grad)
    return q, torch.randn(1, 6, 2, d, dtype=dtype), torch.randn(1, 6, 2, d, dtype=dtype)


def test_builtins_are_registered_through_entry_points():
    names = portattn.list_backends()
    for name in registry._SOURCE_TREE_ENTRY_POINTS:
        assert name in names
    # pyproject's entry points and the source-tree table name the same targets
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"][registry.ENTRY_POINT_GROUP]
    assert declared == registry._SOURCE_TREE_ENTRY_POINTS
    assert declared["sdpa"] == "portattn.backends.sdpa:SdpaBackend"


def test_cpu_default_is_chunked_and_falls_back_with_reasons(clean_env, monkeypatch):
    q, k, v = qkv()
    assert dispatch.priority_for("cpu")[:2] == ["chunked", "sdpa"]
    assert portattn.explain(q, k, v).selected == "chunked"
    exp = portattn.explain(q, k, v, softcap=5.0)   # chunked has every feature; sdpa says why it cannot
    assert exp.selected == "chunked"
    assert "does not support softcap" in "; ".join(exp.reasons["sdpa"])
    # when chunked cannot run, the next candidate is taken and chunked's reason is shown
    chunked = registry.get_backend("chunked")
    monkeypatch.setattr(chunked, "extra_reasons", lambda spec: ["made unavailable by the test"])
    exp = portattn.explain(q, k, v)
    assert exp.selected == "sdpa" and exp.reasons["chunked"] == ["made unavailable by the test"]
    assert "chunked" in str(exp) and "made unavailable by the test" in str(exp)
    exp = portattn.explain(q, k, v, softcap=5.0)
    assert exp.selected not in ("sdpa", "chunked")
    assert "does not support softcap" in "; ".join(exp.reasons["sdpa"])


def test_prefer_registered_backend_and_capability_reasons(toy, clean_env):
    q, k, v = qkv()
    out = portattn.attention(q, k, v, causal=True)
    assert toy.calls == 1
    torch.testing.assert_close(out, portattn.attention(q, k, v, causal=True, backend="reference"))
    # outside its capabilities, toy explains itself and dispatch moves on
    exp = portattn.explain(q.double(), k.double(), v.double())
    assert exp.selected != "toy"
    assert exp.reasons["toy"] == ["dtype float64 is not supported (supported: float32)"]
    exp = portattn.explain(*qkv(d=128))
    assert "head_dim=128 is out of range (supported: 8..64)" in exp.reasons["toy"]
    exp = portattn.explain(q, k, v, window=(2, 2))
    assert "does not support window" in exp.reasons["toy"]


def test_backend_without_backward_is_skipped_when_grad_needed(toy, clean_env):
    q, k, v = qkv(grad=True)
    exp = portattn.explain(q, k, v, causal=True)
    assert exp.selected != "toy"
    assert any("has no backward" in r for r in exp.reasons["toy"])
    out = portattn.attention(q, k, v, causal=True)
    out.sum().backward()
    assert toy.calls == 0 and q.grad is not None


def test_pinned_backend_that_cannot_run_raises_with_reasons(toy, clean_env):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"(?s)backend 'toy' \(pinned by backend=\) cannot run this problem.*"
                                         r"dtype float16 is not supported"):
        portattn.attention(q.half(), k.half(), v.half(), backend="toy")
    with pytest.raises(portattn.BackendNotAvailableError) as info:
        portattn.attention(q, k, v, softcap=2.0, backend="sdpa")
    assert "does not support softcap" in info.value.reasons["sdpa"][0]


def test_unknown_backend_lists_known_ones(clean_env):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"unknown backend 'nope' in backend=; known backends: .*reference.*sdpa"):
        portattn.attention(q, k, v, backend="nope")
    with pytest.raises(ValueError, match=r"unknown backend 'nope' in use_backend\(\)"):
        with portattn.use_backend("nope"):
            pass


def test_env_var_pins_and_is_validated(toy, clean_env):
    q, k, v = qkv()
    clean_env.setenv("PORTATTN_BACKEND", "reference")
    assert portattn.explain(q, k, v, causal=True).selected == "reference"
    portattn.attention(q, k, v, causal=True)
    assert toy.calls == 0
    clean_env.setenv("PORTATTN_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"unknown backend 'bogus' in PORTATTN_BACKEND; known backends:"):
        portattn.attention(q, k, v)


def test_precedence_argument_over_context_over_env(toy, clean_env):
    q, k, v = qkv()
    clean_env.setenv("PORTATTN_BACKEND", "sdpa")
    with portattn.use_backend("reference"):
        assert portattn.explain(q, k, v, causal=True).selected == "reference"
        assert portattn.explain(q, k, v, causal=True, backend="toy").selected == "toy"
        with portattn.use_backend("toy"):   # nested: innermost wins
            assert portattn.explain(q, k, v, causal=True).selected == "toy"
        assert portattn.explain(q, k, v, causal=True).selected == "reference"
    assert portattn.explain(q, k, v, causal=True).selected == "sdpa"   # PORTATTN_BACKEND, not the default


def test_use_backend_with_several_names_is_an_ordered_restriction(toy, clean_env):
    q, k, v = qkv()
    with portattn.use_backend("toy", "reference"):
        assert portattn.explain(q, k, v, causal=True).selected == "toy"
        assert portattn.explain(q, k, v, softcap=1.0).selected == "reference"
    with portattn.use_backend("toy", "sdpa"):
        with pytest.raises(ValueError, match=r"none of the backends pinned by use_backend\(\) can run"):
            portattn.attention(q, k, v, softcap=1.0)


def test_use_backend_is_thread_local(toy, clean_env):
    q, k, v = qkv()
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name, pin):
        with portattn.use_backend(pin):
            barrier.wait()
            seen[name] = portattn.explain(q, k, v, causal=True).selected

    threads = [threading.Thread(target=worker, args=("a", "toy")), threading.Thread(target=worker, args=("b", "reference"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "toy", "b": "reference"}


def test_nothing_fits_lists_every_backend(clean_env):
    q, k, v = qkv()
    clean_env.setenv("PORTATTN_PRIORITY_CPU", "sdpa")
    with pytest.raises(ValueError, match=r"no backend can run this problem .*\n  - sdpa: does not support softcap"):
        portattn.attention(q, k, v, softcap=3.0)


def test_priority_override_is_validated(clean_env):
    clean_env.setenv("PORTATTN_PRIORITY_CPU", "sdpa, nope")
    with pytest.raises(ValueError, match=r"unknown backend 'nope' in PORTATTN_PRIORITY_CPU"):
        dispatch.priority_for("cpu")


def test_register_rejects_duplicates_and_non_backends(toy):
    with pytest.raises(ValueError, match=r"a backend named 'toy' is already registered; pass replace=True"):
        portattn.register_backend(ToyBackend)
    portattn.register_backend(ToyBackend, replace=True)
    with pytest.raises(TypeError, match=r"expects a portattn.Backend subclass or instance"):
        portattn.register_backend(object)
    with pytest.raises(ValueError, match=r"no backend named 'ghost' is registered"):
        portattn.unregister_backend("ghost")


def test_missing_optional_dependency_is_a_reason_not_an_import_error():
    class NeedsMissing(portattn.Backend):
        name = "needs_missing"

        def unavailable_reasons(self):
            try:
                import portattn_no_such_module  # noqa: F401
            except ImportError as exc:
                return [f"package missing: {exc}"]
            return []

    portattn.register_backend(NeedsMissing)
    try:
        q, k, v = qkv()
        reasons = portattn.explain(q, k, v, backend="needs_missing").reasons["needs_missing"]
        assert reasons and "package missing" in reasons[0]
    finally:
        portattn.unregister_backend("needs_missing")


def test_third_party_backend_through_an_entry_point(tmp_path, monkeypatch):
    pkg = tmp_path / "portattn_plugin_demo.py"
    pkg.write_text(textwrap.dedent("""
        import torch, portattn
        from portattn.reference import reference_forward

        class DemoBackend(portattn.Backend):
            name = "demo"
            dtypes = frozenset({torch.float32})
            vendors = frozenset({"cpu"})
            features = frozenset({"causal"})
            def forward(self, spec):
                out, lse = reference_forward(spec)
                return out.float(), lse
    """))
    dist = tmp_path / "portattn_plugin_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: portattn-plugin-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[portattn.backends]\ndemo = portattn_plugin_demo:DemoBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._reset_for_tests()
    try:
        assert "demo" in portattn.list_backends()
        assert "portattn_plugin_demo" not in sys.modules   # discovered, not imported yet
        q, k, v = qkv()
        out = portattn.attention(q, k, v, causal=True, backend="demo")
        torch.testing.assert_close(out, portattn.attention(q, k, v, causal=True, backend="reference"))
        monkeypatch.setenv("PORTATTN_DISABLE_ENTRY_POINTS", "1")
        registry._reset_for_tests()
        assert "demo" not in portattn.list_backends() and "sdpa" in portattn.list_backends()
    finally:
        monkeypatch.delenv("PORTATTN_DISABLE_ENTRY_POINTS", raising=False)
        registry._reset_for_tests()


def test_broken_entry_point_is_reported_not_raised(tmp_path, monkeypatch):
    dist = tmp_path / "portattn_broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: portattn-broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[portattn.backends]\nbroken = no_such_module_xyz:Backend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._reset_for_tests()
    try:
        backend = portattn.get_backend("broken")
        assert not backend.available
        assert "failed to load: ModuleNotFoundError" in backend.availability()[0]
        q, k, v = qkv()
        assert portattn.explain(q, k, v).selected == "chunked"
    finally:
        registry._reset_for_tests()


def test_empty_problem_goes_to_reference(clean_env):
    q = torch.randn(1, 0, 2, 8)
    k = torch.randn(1, 4, 2, 8)
    out, lse = portattn.attention(q, k, k, return_lse=True)
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    q = torch.randn(1, 3, 2, 8)
    out, lse = portattn.attention(q, k[:, :0], k[:, :0], return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
