"""portattn.compat.sdpa against torch's scaled_dot_product_attention itself.

The reference is torch's SDPA on float64 copies of the inputs; the yardstick of the equivalence
rule (docs/semantics.md) is the plain math in the input dtype (scores and P·V in the dtype,
softmax in float32). Problems come from Hypothesis: GQA (``enable_gqa``), 3-D and 4-D inputs,
top-left ``is_causal``, bool and float masks of broadcast shapes, ``scale``, Ev != E. Masks are
drawn so that every query row keeps a key (torch gives NaN for an empty row; portattn 0, tested
separately). Then the router: routed inside, torch's own function outside, restored on error,
fallbacks counted, other threads untouched.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import portattn  # noqa: E402
from portattn.compat import sdpa as compat  # noqa: E402
from portattn.numerics import compare  # noqa: E402

TORCH_SDPA = F.scaled_dot_product_attention
EXAMPLES = settings(max_examples=max(10, settings.default.max_examples))


def _naive(q, k, v, mask, is_causal, scale, enable_gqa):
    """The rule's yardstick in q's dtype: torch SDPA's formula with scores/P·V in the dtype."""
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    if enable_gqa and q.dim() >= 4 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q * scale) @ k.transpose(-1, -2)
    s = s.float()
    if is_causal:
        s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return torch.softmax(s, dim=-1).to(q.dtype) @ v


@st.composite
def _problem(draw):
    dims = draw(st.sampled_from([3, 4, 4]))
    batch, lq, lk = draw(st.integers(1, 3)), draw(st.integers(1, 10)), draw(st.integers(1, 10))
    hk = draw(st.sampled_from([1, 2])) if dims == 4 else 1
    group = draw(st.sampled_from([1, 2])) if dims == 4 else 1
    e, ev = draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([4, 8]))
    kind = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    mask_shape = None
    if kind in ("bool", "float"):
        full = (batch, hk * group, lq, lk)[4 - dims:]
        mask_shape = tuple(n if draw(st.booleans()) else 1 for n in full)
        mask_shape = mask_shape[draw(st.integers(0, 1)):]        # sometimes fewer dims (broadcast)
    return dict(dims=dims, batch=batch, lq=lq, lk=lk, hk=hk, group=group, e=e, ev=ev, kind=kind,
                mask_shape=mask_shape, scale=draw(st.sampled_from([None, 0.2, 1.3])),
                dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float64])),
                seed=draw(st.integers(0, 2**16)))


def _make(p):
    g = torch.Generator().manual_seed(p["seed"])
    lead = (p["batch"],) if p["dims"] == 3 else (p["batch"], p["hk"] * p["group"])
    lead_k = (p["batch"],) if p["dims"] == 3 else (p["batch"], p["hk"])
    q = torch.randn(*lead, p["lq"], p["e"], generator=g).to(p["dtype"])
    k = torch.randn(*lead_k, p["lk"], p["e"], generator=g).to(p["dtype"])
    v = torch.randn(*lead_k, p["lk"], p["ev"], generator=g).to(p["dtype"])
    mask = None
    if p["kind"] == "bool":
        mask = torch.rand(p["mask_shape"], generator=g) > 0.4
        mask[..., 0] = True                                     # every row keeps a key (torch: NaN otherwise)
    elif p["kind"] == "float":
        mask = torch.randn(p["mask_shape"], generator=g).to(p["dtype"])
    return q, k, v, mask


@EXAMPLES
@given(p=_problem())
def test_matches_torch_sdpa(p):
    q, k, v, mask = _make(p)
    gqa = p["group"] > 1
    kw = dict(attn_mask=mask, is_causal=p["kind"] == "causal", scale=p["scale"], enable_gqa=gqa)
    out = compat.scaled_dot_product_attention(q, k, v, **kw)
    ref_mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    ref = TORCH_SDPA(q.double(), k.double(), v.double(), **dict(kw, attn_mask=ref_mask))
    naive = _naive(q, k, v, mask, kw["is_causal"], p["scale"], gqa)
    assert out.shape == ref.shape and out.dtype == q.dtype
    result = compare("out", out, ref, naive)
    assert result.passed, f"{p}: {result}"


def test_gradients_match_torch_sdpa():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 1, 6, 6, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(compat.scaled_dot_product_attention(q, k, v, attn_mask=bias), (q, k, v, bias), dout)
    expected = torch.autograd.grad(TORCH_SDPA(q, k, v, attn_mask=bias), (q, k, v, bias), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), grads, expected):
        torch.testing.assert_close(a, b, msg=name)


def test_fully_masked_row_is_zero():
    q = k = v = torch.randn(1, 2, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    out = compat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kw,match", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(is_causal=True, attn_mask=torch.ones(4, 4, dtype=torch.bool)), "is_causal"),
])
def test_strict_function_names_what_it_cannot_do(kw, match):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=match):
        compat.scaled_dot_product_attention(q, q, q, **kw)


def test_heads_differ_without_enable_gqa():
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="enable_gqa"):
        compat.scaled_dot_product_attention(q, k, k)


# ----- the router -----------------------------------------------------------------------------

def test_route_sdpa_routes_inside_and_restores_outside():
    q = torch.randn(1, 2, 5, 8)
    with compat.route_sdpa(backend="reference") as stats:
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)       # portattn has no dropout: torch runs it
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert stats.routed == 1 and stats.fell_back == 1 and "dropout_p" in stats.reasons[0]
    expected = portattn.attention(q, q, q, layout="bhsd", causal=True, causal_alignment="top_left",
                                  backend="reference")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_route_sdpa_restores_on_error_and_nests():
    with pytest.raises(RuntimeError, match="boom"):
        with compat.route_sdpa():
            with compat.route_sdpa() as inner:
                F.scaled_dot_product_attention(*(torch.randn(1, 1, 3, 4),) * 3)
            assert F.scaled_dot_product_attention is not TORCH_SDPA      # the outer block is still open
            raise RuntimeError("boom")
    assert inner.routed == 1
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_route_sdpa_leaves_other_threads_to_torch():
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        inside.wait(10)
        q = torch.randn(1, 1, 3, 4)
        seen["out"] = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with compat.route_sdpa() as stats:
        inside.set()
        assert done.wait(10)
    worker.join()
    assert stats.routed == 0 and stats.fell_back == 0       # the other thread's call was torch's
    assert seen["out"].shape == (1, 1, 3, 4)


def test_route_sdpa_does_not_recurse_through_the_sdpa_backend():
    q = torch.randn(1, 2, 4, 8)
    with compat.route_sdpa(backend="sdpa") as stats:
        out = F.scaled_dot_product_attention(q, q, q)
    assert stats.routed == 1
    torch.testing.assert_close(out, TORCH_SDPA(q, q, q))


def test_compiles_fullgraph_without_recompiles():
    from torch._dynamo.utils import counters

    def block(q, k, v, mask):
        return compat.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True) + \
            compat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
        mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
        mask[..., 0] = True
        torch.testing.assert_close(compiled(q, k, v, mask), block(q, k, v, mask))
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
