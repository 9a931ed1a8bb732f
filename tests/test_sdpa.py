"""The sdpa backend against the float64 reference under docs/semantics.md, on CPU and, where one is
visible, on the GPU (the fused CUDA kernels and the view copies run only there)."""

import pytest
import torch

import portattn
from portattn.spec import build_spec
from portattn.testing import check_backend

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

FEATURES = {
    "plain": {},
    "causal_br": dict(causal=True),
    "causal_tl": dict(causal=True, causal_alignment="top_left"),
    "window": dict(window=(3, 1)),
    "window_tl": dict(window=(2, 0), causal_alignment="top_left"),
    "alibi": "alibi",
    "bias": "bias",
    "bool_mask": "mask",
    "scale": dict(scale=0.3),
}


def _kwargs(feature, b, sq, sk, hq, g, device="cpu"):
    spec = FEATURES[feature]
    if spec == "alibi":
        return dict(alibi_slopes=torch.rand(b, hq, generator=g).to(device), causal=True)
    if spec == "bias":
        return dict(attn_bias=torch.randn(b, hq, sq, sk, generator=g).to(device))
    if spec == "mask":
        return dict(attn_bias=(torch.rand(b, 1, 1, sk, generator=g) > 0.3).to(device))
    return dict(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sq,sk", [(1, 17), (17, 1), (13, 29), (33, 16)])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_matches_reference(device, feature, sq, sk, dtype):
    g = torch.Generator().manual_seed(sq * 31 + sk)
    b, hq, hkv, d = 2, 4, 2, 16
    q = torch.randn(b, sq, hq, d, generator=g).to(device, dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(device, dtype)
    results = check_backend("sdpa", q, k, v, grad=True, **_kwargs(feature, b, sq, sk, hq, g, device))
    assert all(r.passed for r in results), "\n".join(map(str, results))


def test_sdpa_bias_gradient_and_bhsd_layout():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k = torch.randn(2, 4, 11, 16, generator=g)
    bias = torch.randn(1, 4, 9, 11, generator=g)
    results = check_backend("sdpa", q, k, k, grad=True, attn_bias=bias, layout="bhsd", causal=True)
    assert [r.name for r in results] == ["out", "lse", "dq", "dk", "dv", "dbias"]
    assert all(r.passed for r in results), "\n".join(map(str, results))


def test_sdpa_fully_masked_rows_are_zero_and_grads_finite():
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    k = torch.randn(1, 3, 2, 16, requires_grad=True)
    mask = torch.ones(1, 1, 8, 3, dtype=torch.bool)
    mask[..., 5, :] = False
    out, lse = portattn.attention(q, k, k, causal=True, attn_bias=mask, return_lse=True, backend="sdpa")
    assert (out[0, :5] == 0).all() and torch.isneginf(lse[0, :, :5]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert (q.grad[0, :5] == 0).all()


def test_sdpa_reasons():
    sdpa = portattn.get_backend("sdpa")
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    spec = build_spec(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, softcap=3.0)
    assert sdpa.not_supported_reasons(spec) == ["does not support softcap, varlen"]


def test_views_the_fused_gpu_kernels_cannot_read_are_detected():
    from portattn.backends.sdpa import _fused_kernel_friendly
    buf = torch.randn(2, 40, 5, 51, dtype=torch.float16)        # padded head dim: row stride 51
    assert not _fused_kernel_friendly(buf[..., :48])
    assert not _fused_kernel_friendly(torch.randn(2, 40, 4, 48).transpose(-1, -2))
    assert _fused_kernel_friendly(torch.randn(2, 40, 4, 48, dtype=torch.float16))
    assert _fused_kernel_friendly(torch.randn(2, 4, 40, 48, dtype=torch.float16).transpose(1, 2))
    # size-1 dims with strides that are not 16-byte multiples (a view into a padded buffer, as the
    # property suite made one): torch calls it contiguous, the memory-efficient kernel refuses it
    odd = torch.randn(1, 1, 1, 38, dtype=torch.float16).as_strided((1, 1, 1, 16), (38, 38, 19, 1))
    assert odd.is_contiguous() and not _fused_kernel_friendly(odd)
    assert _fused_kernel_friendly(torch.randn(1, 1, 1, 16, dtype=torch.float16))


def test_dense_copy_gives_the_strides_of_its_sizes():
    """The copy of an unfriendly view is a new tensor whose strides follow its sizes, even where
    torch counts the view contiguous (size-1 dims with odd strides): then the fused kernels can
    read it (backends/sdpa.py _dense_copy)."""
    from portattn.backends.sdpa import _dense_copy, _fused_kernel_friendly
    odd = torch.randn(1, 1, 1, 38, dtype=torch.float16).as_strided((1, 1, 1, 16), (38, 38, 19, 1))
    copy = _dense_copy(odd)
    assert copy.stride() == (16, 16, 16, 1) and torch.equal(copy, odd) and _fused_kernel_friendly(copy)
    bhsd = torch.randn(2, 3, 5, 16, dtype=torch.float16).transpose(1, 2)[:, :, :, :8]   # (B, S, H, D) view
    c2 = _dense_copy(bhsd)
    assert torch.equal(c2, bhsd) and c2.transpose(1, 2).is_contiguous() and c2.data_ptr() != bhsd.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_on_padded_strided_views_matches_reference(device):
    """Forward and gradients through views with a padded head dim (row stride 51): on CUDA they
    are copied for the fused kernels, outside torch.func.vjp in the backward."""
    g = torch.Generator().manual_seed(11)
    buf = torch.full((24, 2, 5, 51), float("nan")).to(device, torch.bfloat16)
    view = buf.permute(1, 0, 2, 3)[:, :, :4, :48]
    view.copy_(torch.randn(view.shape, generator=g).to(device, torch.bfloat16))
    kbuf = torch.full((40, 2, 3, 51), float("nan")).to(device, torch.bfloat16)
    kview = kbuf.permute(1, 0, 2, 3)[:, :, :2, :48]
    kview.copy_(torch.randn(kview.shape, generator=g).to(device, torch.bfloat16))
    results = check_backend("sdpa", view, kview, kview, grad=True, causal=True)
    assert all(r.passed for r in results), "\n".join(map(str, results))


def test_view_copies_happen_outside_vjp(monkeypatch):
    """The alignment check reads data_ptr(), which the tensors torch.func.vjp wraps do not have
    (on the H200 every sdpa backward through the conformance run raised, 2026-11-29): the copy
    path runs on the real tensors, here forced on for CPU tensors."""
    from portattn.backends import sdpa as sdpa_mod
    monkeypatch.setattr(sdpa_mod, "_copies_unfriendly_views", lambda spec: True)
    g = torch.Generator().manual_seed(5)
    buf = torch.randn(2, 9, 3, 19, generator=g)
    q = buf[:, :, :2, :16]                      # row stride 19 floats: copied for the fused kernels
    k = torch.randn(2, 11, 2, 16, generator=g)
    assert not sdpa_mod._fused_kernel_friendly(q)
    results = check_backend("sdpa", q, k, k, grad=True, causal=True)
    assert all(r.passed for r in results), "\n".join(map(str, results))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("magnitude", [0.3, 3.0, 8.0])
def test_cpu_forward_uses_the_fused_kernel(dtype, magnitude, monkeypatch):
    """On CPU the forward lets torch pick its fused kernel (~40 us cheaper per small call than
    the math kernel) and still meets the rule at peaked softmaxes; the gradient recomputation
    keeps the math kernel, whose backward is the one that meets it (backends/sdpa.py)."""
    from portattn.backends import sdpa as sdpa_mod
    entered = []
    real_enter = sdpa_mod._MathOnly.__enter__
    monkeypatch.setattr(sdpa_mod._MathOnly, "__enter__", lambda self: (entered.append(1), real_enter(self))[1])
    g = torch.Generator().manual_seed(int(magnitude * 10))
    for sq, sk, kw in ((9, 33, dict(causal=True)), (40, 40, {}), (5, 70, dict(window=(20, 0)))):
        q, k, v = (torch.randn(2, s, 4, 32, generator=g).mul(m).to(dtype)
                   for s, m in ((sq, magnitude), (sk, magnitude), (sk, 1.0)))
        with torch.no_grad():
            results = check_backend("sdpa", q, k, v, **kw)
        assert all(r.passed for r in results), "\n".join(map(str, results))
    assert not entered                       # no forward above forced the math kernel
    q, k, v = (torch.randn(1, 7, 2, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    portattn.attention(q, k, v, backend="sdpa").sum().backward()
    assert entered                           # the backward's recomputation did


def test_padded_views_compute_on_their_dense_layout():
    """A padded (B, S, H, D) view and a padded (B, H, S, D) view give the bits of the dense tensor
    of their own order (torch's fused CPU kernel rounds differently on padded views: one float32
    ulp on an AMD EPYC); dense tensors of either order are passed through uncopied."""
    from portattn.backends import sdpa as sdpa_mod
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 2, 16, generator=g) * 30            # (B, S, H, D), large logits
    bshd = torch.full((2, 1, 3, 19), float("nan"))
    view = bshd.permute(1, 0, 2, 3)[:, :, :2, :16]
    view.copy_(x)
    bhsd = torch.full((1, 3, 2, 19), float("nan"))
    tview = bhsd[:, :2, :, :16].transpose(1, 2)
    tview.copy_(x)
    for v, dense in ((view, x.contiguous()), (tview, x.transpose(1, 2).contiguous().transpose(1, 2))):
        copy = sdpa_mod._dense_copy(v)
        assert copy.stride() == dense.stride() and torch.equal(copy, dense)
        assert not sdpa_mod._dense(v) and sdpa_mod._dense(dense)
        a = portattn.attention(v, v, v, backend="sdpa")
        b = portattn.attention(dense, dense, dense, backend="sdpa")
        assert torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
