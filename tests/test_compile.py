"""torch.compile(fullgraph=True) traces portattn.attention as one custom-op node."""

import pytest
import torch

import portattn


def block(q, k, v, bias):
    h = portattn.attention(q, k, v, causal=True, attn_bias=bias)
    return torch.nn.functional.gelu(h).sum(dim=-1)


def test_compile_fullgraph_forward_backward_matches_eager():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 16, generator=g)
    k = torch.randn(2, 8, 2, 16, generator=g)
    v = torch.randn(2, 8, 2, 16, generator=g)
    bias = torch.randn(2, 1, 1, 8, generator=g)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager_q = q.clone().requires_grad_()
    comp_q = q.clone().requires_grad_()
    eager = block(eager_q, k, v, bias)
    out = compiled(comp_q, k, v, bias)
    torch.testing.assert_close(out, eager)
    eager.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(comp_q.grad, eager_q.grad)


def test_compiled_graph_holds_the_custom_op():
    seen = []

    def capture(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    q = torch.randn(1, 4, 2, 8)
    compiled = torch.compile(lambda q: portattn.attention(q, q, q, causal=True), fullgraph=True, backend=capture)
    compiled(q)
    assert any("portattn.attention" in t for t in seen), seen


def test_compiled_call_respects_use_backend_at_run_time():
    torch._dynamo.reset()
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    compiled = torch.compile(lambda q: portattn.attention(q, q, q, softcap=2.0), fullgraph=True, backend="eager")
    with portattn.use_backend("sdpa"):
        with pytest.raises(ValueError, match="does not support softcap"):
            compiled(q)
    torch.testing.assert_close(compiled(q), portattn.attention(q, q, q, softcap=2.0, backend="reference"))


def test_compiled_call_does_not_recompile_on_the_second_call(monkeypatch):
    """The call path's memoised environment reads must not change what dynamo guards on."""
    from torch._dynamo.utils import counters
    for var in ("PORTATTN_DETERMINISTIC", "PORTATTN_ALLOW_TF32", "PORTATTN_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q: portattn.attention(q, q, q, causal=True), fullgraph=True, backend="eager")
    for seed in range(3):
        compiled(torch.randn(1, 4, 2, 8, generator=torch.Generator().manual_seed(seed)))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
