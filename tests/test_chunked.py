"""The ``chunked`` backend (the CPU default) against the float64 reference (docs/semantics.md).

Every check runs at the default chunk budget and at tiny ones (``_ELEMENT_BUDGET`` patched), so
that query chunks, key chunks (the online-softmax merge), band-edge chunks and the single-chunk
path are all exercised on problems small enough for a CPU. Beyond closeness: the gradient
through lse, empty problems (batch 0 included), fully-masked rows, bit-identical repeats, a
bound on the largest tensor it allocates (memory linear in S), and non-finite K/V at hidden keys.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from portattn.backends import chunked

import portattn
from portattn.conformance import Checker, Problem, problem_strategy
from portattn.conformance.catalogue import select_cases
from portattn.conformance.problems import CPU_CAP
from portattn.spec import build_spec

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_lse_grad import CASES as LSE_CASES  # noqa: E402
from test_lse_grad import _make, check_lse_grads  # noqa: E402

#: None = the module default; 1 forces one key per chunk (16 query rows); 600 a few keys per chunk
BUDGETS = [None, 1, 600]


@contextlib.contextmanager
def budget(elements):
    old = chunked._ELEMENT_BUDGET
    chunked._ELEMENT_BUDGET = old if elements is None else elements
    try:
        yield
    finally:
        chunked._ELEMENT_BUDGET = old


def _verdict(problem, elements):
    with budget(elements):
        outcome = Checker(problem, "cpu").check("chunked")
    return outcome


@settings(max_examples=30)
@given(problem=problem_strategy(CPU_CAP), elements=st.sampled_from([*BUDGETS, 37]))
def test_matches_reference_on_drawn_problems(problem, elements):
    note(f"problem: {problem!r} budget={elements}")
    outcome = _verdict(problem, elements)
    assert outcome.verdict == "pass", outcome.summary()


EVERYTHING = [
    Problem(seqlens_q=(7, 0, 25, 1), seqlens_k=(19, 3, 25, 0), heads_q=4, heads_kv=2, head_dim=40, head_dim_v=24,
            causal=True, window=(9, 0), softcap=20.0, alibi="head", bias="float", bias_grad=True, strided=True,
            magnitude=2.0, dtype="float16", seed=3),
    Problem(batch=3, seqlen_q=33, seqlen_k=20, heads_q=6, heads_kv=2, head_dim=16, bias="bool", causal=True,
            alignment="top_left", dtype="bfloat16", seed=4),
    Problem(batch=2, seqlen_q=29, seqlen_k=41, heads_q=2, heads_kv=1, head_dim=24, window=(3, 5), alibi="batch",
            bias="float_keys", bias_grad=True, layout="bhsd", dtype="float32", seed=5),
    Problem(batch=2, seqlen_q=40, seqlen_k=9, heads_q=2, heads_kv=2, head_dim=8, causal=True, dtype="float64",
            bias="float_heads", bias_grad=True, seed=6),   # rows with no key, float64 (lse recomputed)
    Problem(batch=1, seqlen_q=40, seqlen_k=40, heads_q=2, heads_kv=2, head_dim=32, extreme=True, causal=True,
            dtype="float32", seed=7),
]


@pytest.mark.parametrize("elements", BUDGETS)
@pytest.mark.parametrize("index", range(len(EVERYTHING)))
def test_every_feature_at_every_chunking(index, elements):
    outcome = _verdict(EVERYTHING[index], elements)
    assert outcome.verdict == "pass", outcome.summary()
    assert "dq" in outcome.checks and not outcome.not_checked


@pytest.mark.parametrize("elements", [None, 5])
@pytest.mark.parametrize("name", sorted(LSE_CASES))
def test_lse_gradient(name, elements):
    q, k, v, kw = _make(name)
    with budget(elements):
        check_lse_grads("chunked", q, k, v, **kw)


def test_lse_sum_backward_is_not_dropped():
    """The issue's case through the default path: ``lse.sum().backward()`` moves q and k."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    assert portattn.explain(q, k, v).selected == "chunked"
    _, lse = portattn.attention(q, k, v, return_lse=True)
    lse.sum().backward()
    assert q.grad.abs().max() > 0.1 and k.grad.abs().max() > 0.1
    assert torch.equal(v.grad, torch.zeros_like(v.grad))


def _direct(spec_args, spec_kwargs, grad=True):
    backend = portattn.get_backend("chunked")
    spec = build_spec(*spec_args, return_lse=True, **spec_kwargs)
    out, lse = backend.forward(spec)
    grads = backend.backward(spec, out, lse, torch.ones_like(out), torch.ones_like(lse)) if grad else None
    return out, lse, grads


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)], ids=["batch0", "sq0", "sk0"])
def test_empty_problems(shape):
    b, sq, sk = shape
    q, k, v = torch.randn(b, sq, 4, 8), torch.randn(b, sk, 2, 8), torch.randn(b, sk, 2, 6)
    out, lse, (dq, dk, dv, dbias) = _direct((q, k, v), {"causal": True})
    assert out.shape == (b, sq, 4, 6) and lse.shape == (b, 4, sq) and dbias is None
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and torch.equal(g, torch.zeros_like(t))
    # through the public API too (empty problems are computed by the core, whatever is chosen)
    o = portattn.attention(q, k, v, causal=True, backend="chunked")
    assert o.shape == (b, sq, 4, 6) and not o.any()


def test_varlen_with_only_empty_sequences_and_no_keys():
    q, k = torch.randn(5, 2, 8), torch.randn(0, 2, 8)
    cu_q = torch.tensor([0, 0, 5, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 0, 0], dtype=torch.int32)
    out, lse, (dq, dk, dv, _) = _direct((q, k, k), {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k})
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == (0, 2, 8)


@pytest.mark.parametrize("elements", [None, 3])
def test_fully_masked_rows_are_zero_with_finite_zero_gradients(elements):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, s, 2, 16, generator=gen, requires_grad=True) for s in (12, 5, 5))
    keep = torch.rand(2, 2, 12, 5, generator=gen) > 0.4
    keep[:, :, 3] = False                                   # row 3 sees nothing (bool mask)
    with budget(elements):
        out, lse = portattn.attention(q, k, v, causal=True, attn_bias=keep, return_lse=True, backend="chunked")
        (out.sum() + torch.where(torch.isneginf(lse), 1e30, lse).sum()).backward()
    empty = torch.isneginf(lse)                             # also rows 0..6: bottom-right causal, Sq > Sk
    assert empty[:, :, :7].all() and empty[:, :, 3].all()
    rows = empty.permute(0, 2, 1)
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[rows], torch.zeros_like(q.grad[rows]))


def test_deterministic_bits():
    p = EVERYTHING[0]
    runs = []
    for _ in range(2):
        c = Checker(p, "cpu")
        with budget(600):
            runs.append(c.run_backend("chunked", grads=True, bias_grad=True))
    a, b = runs
    for x, y in [(a.out, b.out), (a.lse, b.lse)] + [(a.grads[n], b.grads[n]) for n in a.grads]:
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))


class _LargestAllocation(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in (result if isinstance(result, (tuple, list)) else [result]):
            if isinstance(t, torch.Tensor) and t._base is None and func is not torch.ops.aten.view.default:
                self.largest = max(self.largest, t.numel())
        return result


@pytest.mark.parametrize("causal", [False, True])
def test_memory_is_linear_in_the_sequence_length(causal):
    """No tensor larger than the chunk budget or the inputs: the S×S scores never exist."""
    b, s, h, d = 1, 256, 2, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=gen) for _ in range(3))
    spec = build_spec(q, k, v, causal=causal, return_lse=True)
    backend = portattn.get_backend("chunked")
    with budget(2048):
        with _LargestAllocation() as mode:
            out, lse = backend.forward(spec)
            backend.backward(spec, out, lse, torch.ones_like(out), None)
    linear = b * s * h * d
    assert mode.largest <= max(linear, 2048 * 2), (mode.largest, linear, h * s * s)
    assert h * s * s > 8 * max(linear, 2048 * 2)   # the test would see a quadratic buffer


def test_capabilities_and_reasons():
    backend = portattn.get_backend("chunked")
    assert backend.features == portattn.registry.ALL_FEATURES and backend.has_backward and backend.deterministic
    assert torch.float64 in backend.dtypes and "cpu" in backend.vendors
    q = torch.randn(1, 4, 2, 8)
    assert backend.not_supported_reasons(build_spec(q, q, q, softcap=3.0)) == []


# ----- non-finite values at hidden keys (docs/semantics.md, "Non-finite values") ------------------

def _poisoned(value, where):
    """q, k, v and kwargs with ``value`` written into K (``where="k"``) or V at keys that no query
    row sees (bool key padding, causal top-left beyond Sq, varlen padding) and clean copies."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, s, 4, 16, generator=gen) for s in (9, 21, 21))
    keep = torch.ones(2, 1, 1, 21, dtype=torch.bool)
    keep[0, ..., 4] = keep[1, ..., 15:] = False
    poisoned = {"k": k.clone(), "v": v.clone()}
    t = poisoned[where]
    t[0, 4], t[1, 15:] = value, value            # hidden by the key padding mask
    t[:, 9:12] = value                           # hidden by causal top-left (Sq 9 < Sk 21) and the window
    return (q, k, v), (q, poisoned["k"], poisoned["v"]), dict(attn_bias=keep, causal=True,
                                                              causal_alignment="top_left")


@pytest.mark.parametrize("elements", [None, 50])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_at_hidden_keys_changes_no_bit(value, where, elements):
    """A key no row sees: its K and V never reach out, lse or any gradient, whatever they hold."""
    clean, dirty, kw = _poisoned(value, where)
    results = []
    with budget(elements):
        for args in (clean, dirty):
            leaves = [t.clone().requires_grad_(True) for t in args]
            out, lse = portattn.attention(*leaves, return_lse=True, backend="chunked", **kw)
            (out.sum() + lse.sum()).backward()
            results.append([out, lse] + [t.grad for t in leaves])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name
        assert not torch.isnan(b).any(), name


def test_nan_in_k_hidden_from_some_rows_reaches_only_the_rows_that_see_it():
    """Causal: key j is seen by rows i' >= j only. NaN there: those rows are NaN (as in the
    reference), every other row is bit-identical to the clean run."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=gen) for _ in range(3))
    k2 = k.clone()
    k2[0, 25] = float("nan")
    for elements in (None, 40):
        with budget(elements):
            a, la = portattn.attention(q, k, v, causal=True, return_lse=True, backend="chunked")
            b, lb = portattn.attention(q, k2, v, causal=True, return_lse=True, backend="chunked")
        assert torch.equal(a[:, :25], b[:, :25]) and torch.equal(la[..., :25], lb[..., :25])
        assert torch.isnan(b[:, 25:]).all() and torch.isnan(lb[..., 25:]).all()
        ref = portattn.attention(q, k2, v, causal=True, backend="reference")
        assert torch.equal(torch.isnan(ref), torch.isnan(b))


def test_math_of_the_budget():
    """Tiles respect the budget (when at least one row and one key fit), and cover the band."""
    spec = build_spec(torch.randn(1, 100, 4, 8), torch.randn(1, 300, 2, 8), torch.randn(1, 300, 2, 8),
                      window=(10, 3))
    with budget(4 * 16 * 20):
        rows, keys = chunked._tiles(spec, 1, 100, 300)
        assert 4 * rows * keys <= chunked._ELEMENT_BUDGET
        covered = set()
        for i0 in range(0, 100, rows):
            i1 = min(100, i0 + rows)
            lo, hi = chunked._key_range(spec, 100, 300, i0, i1)
            for j0, j1 in chunked._key_chunks(spec, 100, 300, i0, i1, lo, hi, keys):
                assert j1 - j0 <= keys
                covered |= {(i, j) for i in range(i0, i1) for j in range(j0, j1)}
    off = 200
    needed = {(i, j) for i in range(100) for j in range(300) if i + off - 10 <= j <= i + off + 3}
    assert needed <= covered
    assert len(covered) < 100 * 300 / 4   # the band, not the whole rectangle


# ----- the conformance catalogue's non-finite cases on the CPU backends ---------------------------

_NONFINITE = select_cases(patterns=["nonfinite/*"])
_TRITON_SAMPLE = {"nonfinite/hidden/v-nan/key-padding", "nonfinite/partial/k-inf/window"}


@pytest.mark.parametrize("case", _NONFINITE, ids=[c.id for c in _NONFINITE])
def test_nonfinite_catalogue_cases(case):
    """chunked passes every case; the other CPU backends pass or fail only as their known
    limitation says (docs/semantics.md's table); triton (interpreter) on a sample."""
    checker = Checker(case.problem, "cpu")
    names = ["chunked", "reference", "sdpa", "onnx"] + (["triton"] if case.id in _TRITON_SAMPLE else [])
    seen = {}
    for name in names:
        if not portattn.get_backend(name).available:
            continue
        outcome = checker.check(name)
        seen[name] = outcome.verdict
        allowed = ("pass",) if name == "chunked" else ("pass", "known", "skip")
        assert outcome.verdict in allowed, outcome.summary()
        if outcome.verdict == "skip":   # what cannot express varlen, or triton without its interpreter
            interpreter_off = name == "triton" and "interpreter" in outcome.summary()
            assert interpreter_off or (name in ("sdpa", "onnx") and case.problem.is_varlen), outcome.summary()
    if case.problem.poison_at == "partial":
        assert "poisoned_rows" in checker.check("chunked").checks
    if "sdpa" in seen and not case.problem.is_varlen:
        # the additive-mask behaviour the table describes; under SDPA's own causal (is_causal) the
        # CPU forward runs torch's fused kernel, which skips hidden keys: such a case passes unless
        # its gradients (the math kernel) meet the non-finite value
        own_causal = case.problem.causal and not case.problem.window and case.problem.bias is None and (
            case.problem.seqlen_q == case.problem.seqlen_k or case.problem.alignment == "top_left")
        assert seen["sdpa"] in (("pass", "known") if own_causal else ("known",)), seen


def test_checker_does_not_pass_a_backend_that_hides_a_visible_nan():
    """A partial case: a backend that returns the clean result where the reference is NaN fails
    the poisoned_rows check (an expected NaN is never turned into a silent pass)."""
    case = next(c for c in _NONFINITE if c.id == "nonfinite/partial/k-nan/causal")
    checker = Checker(case.problem, "cpu")
    clean = checker.reference
    got = type(clean)(clean.out.to(case.problem.torch_dtype), clean.lse.clone())
    failures = checker.judge(got, checks := {})
    assert checks["poisoned_rows"]["passed"] is False and any("poisoned_rows" in f for f in failures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU (run on the H200)")
@pytest.mark.parametrize("elements", [None, 37])
@pytest.mark.parametrize("index", range(len(EVERYTHING)))
def test_on_the_gpu(index, elements):
    """The same torch ops on a GPU: every feature at two chunkings, and the hidden-key guarantee."""
    outcome = _verdict_on(EVERYTHING[index], elements, "cuda")
    assert outcome.verdict == "pass", outcome.summary()
    case = next(c for c in _NONFINITE if c.id == "nonfinite/hidden/v-nan/varlen-key-padding")
    outcome = _verdict_on(case.problem, elements, "cuda")
    assert outcome.verdict == "pass", outcome.summary()


def _verdict_on(problem, elements, device):
    with budget(elements):
        return Checker(problem, device).check("chunked")


FOUND = [   # delta = dO·O carried O's rounding: dbias 7.7x (bf16), dq 408x (fp16 x5, one-hot softmax)
    (1, Problem(batch=1, seqlen_q=2, seqlen_k=2, heads_q=2, heads_kv=2, head_dim=64, dtype="bfloat16", scale=0.5,
                bias="float_heads", bias_grad=True, layout="bhsd", strided=True, seed=2446861)),
    (None, Problem(heads_q=3, heads_kv=1, head_dim=16, dtype="float16", seqlens_q=(2, 2), seqlens_k=(2, 2),
                   alibi="batch", magnitude=5.0, strided=True, seed=0)),
]


@pytest.mark.parametrize("elements,problem", FOUND)
def test_problems_found_by_the_property_search(elements, problem):
    outcome = _verdict(problem, elements)
    assert outcome.verdict == "pass", outcome.summary()


@pytest.mark.parametrize("case_id", ["core/fp32/sq2-sk3/d40/causal-tl", "core/fp32/sq3-sk2/d24/causal-br",
                                     "core/fp32/sq3-sk2/d24/causal-tl"])
def test_float32_gradients_of_rows_with_one_or_two_keys(case_id):
    """float32: δ = Σ_j P dP, not dO·O (O's rounding alone gave dq/dk 3-7x the naive error here)."""
    case = next(c for c in select_cases(patterns=[case_id]))
    outcome = Checker(case.problem, "cpu").check("chunked")
    assert outcome.verdict == "pass", outcome.summary()


def test_bad_cu_seqlens_are_clamped_never_read_out_of_bounds():
    """Offsets past the packed length (possible under torch.compile, where they are not checked)
    are clamped to the tensors: no out-of-bounds read, finite results."""
    q, k, v = (torch.randn(32, 2, 8) for _ in range(3))
    good = torch.tensor([0, 5, 32], dtype=torch.int32)
    spec = build_spec(q, k, v, cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=35, max_seqlen_k=35,
                      causal=True, return_lse=True)
    spec.cu_seqlens_q = spec.cu_seqlens_k = torch.tensor([0, 5, 40], dtype=torch.int32)
    backend = portattn.get_backend("chunked")
    out, lse = backend.forward(spec)
    dq, dk, dv, _ = backend.backward(spec, out, lse, torch.ones_like(out))
    for t in (out, lse[torch.isfinite(lse)], dq, dk, dv):
        assert torch.isfinite(t).all()
    ref, _ = backend.forward(build_spec(q, k, v, cu_seqlens_q=good, cu_seqlens_k=good, causal=True))
    assert torch.equal(out, ref)   # the clamped sequence is the packed tensor's end


def test_varlen_where_no_row_has_a_key():
    """The checker's own oracle has no gradient here (found by the property search): grads are 0."""
    p = Problem(batch=2, heads_q=1, heads_kv=1, head_dim=16, dtype="float16", seqlens_q=(1, 0), seqlens_k=(0, 1),
                extreme=True)
    outcome = Checker(p, "cpu").check("chunked")
    assert outcome.verdict == "pass" and "dq" in outcome.checks, outcome.summary()
