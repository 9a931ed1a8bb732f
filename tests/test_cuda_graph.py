"""``portattn.attention`` inside a CUDA graph: captured once, replayed on new inputs, equal to eager.

Capture fails on any host synchronisation (``.item()``, ``.tolist()``, a device-to-host copy),
so a passing capture also shows that the call path has none; varlen replays change the
sequence lengths inside a fixed ``max_seqlen`` without re-capturing (nothing reads
``cu_seqlens`` on the host).
"""

import pytest
import torch

import portattn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BACKENDS = ["triton", "cupy"]


def _runs(backend, q, k, v, **kw):
    try:
        reasons = portattn.explain(q, k, v, backend=backend, **kw).reasons[backend]
    except ValueError as exc:
        return [str(exc)]
    return reasons


def _capture(fn):
    """Warm up on a side stream (compiles, allocator), then capture ``fn`` into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,causal", [(4, True), (1, False)])
def test_dense_capture_replays_like_eager(backend, dtype, kv_heads, causal):
    dev = torch.device("cuda")
    q = torch.randn(2, 200, 4, 64, device=dev, dtype=dtype)
    k = torch.randn(2, 333, kv_heads, 64, device=dev, dtype=dtype)
    v = torch.randn(2, 333, kv_heads, 64, device=dev, dtype=dtype)
    reasons = _runs(backend, q, k, v, causal=causal)
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")
    graph, out = _capture(lambda: portattn.attention(q, k, v, causal=causal, backend=backend, return_lse=True))
    for seed in range(3):
        g = torch.Generator(device=dev).manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device=dev, dtype=dtype, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = portattn.attention(q, k, v, causal=causal, backend=backend, return_lse=True)
        assert torch.equal(out[0], ref_out) and torch.equal(out[1], ref_lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_capture_with_max_seqlen_replays_new_lengths(backend):
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    total, max_len = 96, 64
    q = torch.randn(total, 4, 64, device=dev, dtype=dtype)
    k = torch.randn(total, 2, 64, device=dev, dtype=dtype)
    v = torch.randn(total, 2, 64, device=dev, dtype=dtype)
    cu = torch.tensor([0, 32, 96], dtype=torch.int32, device=dev)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True)
    reasons = _runs(backend, q, k, v, **kw)
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")
    graph, out = _capture(lambda: portattn.attention(q, k, v, backend=backend, **kw))
    for lengths in ([0, 32, 96], [0, 50, 96], [0, 40, 96]):      # every length <= max_len
        cu.copy_(torch.tensor(lengths, dtype=torch.int32, device=dev))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, portattn.attention(q, k, v, backend=backend, **kw))


def test_capture_without_max_seqlen_is_a_clear_error():
    dev = torch.device("cuda")
    q = torch.randn(16, 2, 64, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=dev)
    portattn.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="triton")   # warm up
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="max_seqlen_q must be given under torch.compile and CUDA-graph capture"):
        with torch.cuda.graph(graph):
            portattn.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="triton")
