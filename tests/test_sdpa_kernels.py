"""torch SDPA's kernels as pinned backends (backends/sdpa_kernels.py).

On CPU: the declared capabilities and reasons, the stand-ins handed to torch's own checks, and
the exactness of the rewrites each backend makes before calling SDPA (decode causal dropped,
cuDNN's bottom-right causal as a window, the efficient kernel's GQA expansion) — run through
SDPA's math kernel, which is what SDPA does on CPU under any pin. On a GPU: every kernel, where
it declares no reason, matches the float64 reference under the equivalence rule.
"""

import pytest
import torch
from portattn.backends import sdpa_kernels as sk

import portattn
from portattn.numerics import GRAD_FACTOR, compare, compare_lse
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec
from portattn.testing import check_backend

PINNED = ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math"]
GPU_KERNELS = ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient"]


def _qkv(b=2, sq=8, skv=8, hq=4, hkv=2, d=16, dv=None, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(device, dtype)
    k = torch.randn(b, skv, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(b, skv, hkv, dv or d, generator=g).to(device, dtype)
    return q, k, v


def test_registered_and_pinnable():
    for name in PINNED:
        backend = portattn.get_backend(name)
        assert backend.available, backend.availability()
        assert isinstance(backend, sk._PinnedSdpaBackend)
    q, k, v = _qkv()
    exp = portattn.explain(q, k, v, backend="sdpa_cudnn")
    assert exp.selected is None and "device cpu (cpu) is not supported (supported: nvidia)" in exp.reasons["sdpa_cudnn"]
    with pytest.raises(portattn.BackendNotAvailableError, match="sdpa_flash"):
        portattn.attention(q, k, v, backend="sdpa_flash")


def test_declared_limits_are_reasons():
    q, k, v = _qkv(dtype=torch.float32)
    bias = torch.randn(2, 4, 8, 8)
    flash = portattn.explain(q, k, v, attn_bias=bias, backend="sdpa_flash").reasons["sdpa_flash"]
    assert "dtype float32 is not supported (supported: bfloat16, float16)" in flash
    assert "does not support bias" in flash
    q5, k5, v5 = _qkv(dv=24)
    assert "does not support head_dim_v" in "; ".join(portattn.explain(q5, k5, v5, backend="sdpa_flash").reasons["sdpa_flash"])
    assert not any("head_dim_v" in r for r in portattn.explain(q5, k5, v5, backend="sdpa_cudnn").reasons["sdpa_cudnn"])
    soft = portattn.explain(q, k, v, softcap=3.0, backend="sdpa_efficient").reasons["sdpa_efficient"]
    assert "does not support softcap" in soft
    # the kernels' own limits (checked before torch is asked)
    cudnn, eff, flash_b = sk.SdpaCudnnBackend(), sk.SdpaEfficientBackend(), sk.SdpaFlashBackend()
    one_key = build_spec(*_qkv(skv=1))
    assert any("seqlen_k=1" in r for r in cudnn._kernel_reasons(one_key))
    odd = build_spec(*_qkv(d=12))
    assert any("multiples of 8 (got head_dim=12, head_dim_v=12)" in r for r in cudnn._kernel_reasons(odd))
    assert any("multiples of 8" in r for r in eff._kernel_reasons(odd))
    tall = build_spec(*_qkv(sq=16, skv=4), causal=True)
    assert any("seqlen_q=16 > seqlen_k=4" in r for r in flash_b._kernel_reasons(tall))
    assert any("seqlen_q=16 > seqlen_k=4" in r for r in cudnn._kernel_reasons(tall))
    assert eff._kernel_reasons(tall) == []              # the efficient kernel takes the mask
    grad = build_spec(*(t.requires_grad_() for t in _qkv(d=160)))
    assert any("backward supports D, Dv <= 128" in r for r in cudnn._kernel_reasons(grad))
    packed = torch.randn(12, 4, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    varlen = build_spec(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert "does not support varlen" in "; ".join(portattn.get_backend("sdpa_math").not_supported_reasons(varlen))


def test_deterministic_backward_reasons(monkeypatch):
    monkeypatch.setenv("PORTATTN_DETERMINISTIC", "1")
    q, k, v = _qkv()
    spec = build_spec(q.requires_grad_(), k, v)
    assert "has no deterministic mode" in "; ".join(portattn.get_backend("sdpa_cudnn").not_supported_reasons(spec))
    # flash/efficient on a GPU spec: only torch.use_deterministic_algorithms engages their deterministic backward
    monkeypatch.setattr(type(spec), "vendor", property(lambda self: "nvidia"))
    assert any("use_deterministic_algorithms(True)" in r for r in sk._deterministic_grad_reasons(spec, "x"))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)
    assert sk._deterministic_grad_reasons(spec, "x") == []


def test_sdpa_view_stand_ins_share_storage():
    buf = torch.randn(2, 8, 4, 19)
    view = buf[..., :16]                      # padded rows: SDPA's fused kernels get a copy
    stand_in = sk._sdpa_view(view, needs_grad=True)
    assert stand_in.shape == (2, 4, 8, 16) and stand_in.requires_grad
    assert stand_in.transpose(1, 2).is_contiguous() and stand_in.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    expanded = torch.randn(1, 8, 1, 16).expand(2, 8, 4, 16)      # stride 0 is fine for the kernels: as is
    assert sk._sdpa_view(expanded, needs_grad=False).stride() == (0, 0, 16, 1)
    padded_expanded = torch.randn(1, 8, 1, 19)[..., :16].expand(2, 8, 4, 16)
    assert sk._sdpa_view(padded_expanded, needs_grad=False) is None   # its storage is smaller than a copy
    friendly = torch.randn(2, 8, 4, 16)
    assert sk._sdpa_view(friendly, needs_grad=False).data_ptr() == friendly.data_ptr()


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, causal_alignment="top_left"),
                                dict(window=(2, 1)), dict(attn_bias="float"), dict(attn_bias="bool"),
                                dict(alibi=True)])
@pytest.mark.parametrize("name", GPU_KERNELS)
def test_torch_check_params_are_built_and_refusals_are_reasons(name, kw, monkeypatch):
    q, k, v = _qkv(sq=4, skv=9)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(4)
    if kw.get("attn_bias") == "float":
        kw["attn_bias"] = torch.randn(2, 4, 4, 9)
    elif kw.get("attn_bias") == "bool":
        kw["attn_bias"] = torch.rand(2, 1, 1, 9) > 0.5
    spec = build_spec(q, k, v, **kw)
    backend = portattn.get_backend(name)
    params = backend._params(spec)
    assert params is not None
    # on this CPU build torch's checks refuse everything: that refusal becomes an actionable reason
    reasons = backend._torch_reasons(spec)
    assert len(reasons) == 1 and f"torch.backends.cuda.{backend.torch_check}(params, debug=True)" in reasons[0]
    assert "backend='sdpa'" in reasons[0]
    monkeypatch.setattr(torch.backends.cuda, backend.torch_check, lambda params, debug=False: True)
    assert backend._torch_reasons(spec) != []              # memoised per geometry
    sk._verdicts.clear()
    assert backend._torch_reasons(spec) == []

    def broken(params, debug=False):
        raise RuntimeError("boom")
    monkeypatch.setattr(torch.backends.cuda, backend.torch_check, broken)
    sk._verdicts.clear()
    assert "failed: RuntimeError: boom" in backend._torch_reasons(spec)[0]
    sk._verdicts.clear()


def test_decode_causal_is_dropped_and_cudnn_lower_right_becomes_a_window():
    q, k, v = _qkv(sq=1, skv=9)
    spec = build_spec(q, k, v, causal=True)
    call = portattn.get_backend("sdpa_cudnn")._call_spec(spec)
    assert not call.causal and call.window_right is None and call.features() == {"gqa"}
    spec8 = build_spec(*_qkv(sq=3, skv=9), causal=True)
    cudnn = portattn.get_backend("sdpa_cudnn")._call_spec(spec8)
    assert not cudnn.causal and cudnn.window_right == 0 and "window" in cudnn.features()
    assert portattn.get_backend("sdpa_flash")._call_spec(spec8) is spec8
    top_left = build_spec(*_qkv(sq=1, skv=9), causal=True, causal_alignment="top_left")
    assert portattn.get_backend("sdpa_flash")._call_spec(top_left) is top_left   # not trivial: one key


def _direct(backend, spec, grad):
    """Run ``backend`` directly (reasons bypassed: on CPU SDPA runs its math kernel under any
    pin) and compare out, lse and gradients with the float64 reference."""
    out, lse = backend.forward(spec)
    rq, rk, rv = (t.detach().double().requires_grad_(grad) for t in (spec.q, spec.k, spec.v))
    kw = dict(causal=spec.causal, causal_alignment=spec.alignment, scale=spec.scale)
    ref_out, ref_lse = reference_forward(build_spec(rq, rk, rv, **kw))
    nq, nk, nv = (t.detach().requires_grad_(grad) for t in (spec.q, spec.k, spec.v))
    naive_out, _ = naive_forward(build_spec(nq, nk, nv, **kw))
    results = [compare("out", out, ref_out, naive_out), compare_lse(lse, ref_lse)]
    if grad:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        got = backend.backward(spec, out, lse, dout)[:3]
        ref = torch.autograd.grad(ref_out, (rq, rk, rv), dout.double())
        naive = torch.autograd.grad(naive_out, (nq, nk, nv), dout)
        results += [compare(n, a, r, m, factor=GRAD_FACTOR) for n, a, r, m in zip(("dq", "dk", "dv"), got, ref, naive)]
    return results


@pytest.mark.parametrize("shape", [(1, 9), (3, 9), (9, 9), (9, 3)])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("name", PINNED)
def test_rewrites_are_exact(name, alignment, shape):
    sq, skv = shape
    q, k, v = _qkv(sq=sq, skv=skv, hq=4, hkv=1, seed=sq * 10 + skv)
    q.requires_grad_(True)
    spec = build_spec(q, k, v, causal=True, causal_alignment=alignment, return_lse=True)
    results = _direct(portattn.get_backend(name), spec, grad=True)
    assert all(r.passed for r in results), "\n".join(map(str, results))


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "bias", "bool_mask", "alibi", "gqa_dv"])
def test_sdpa_math_matches_reference(feature):
    g = torch.Generator().manual_seed(7)
    q, k, v = _qkv(sq=7, skv=11, hq=4, hkv=2 if feature == "gqa_dv" else 4, dv=24 if feature == "gqa_dv" else None)
    kw = {"causal": dict(causal=True), "window": dict(window=(3, 1)),
          "bias": dict(attn_bias=torch.randn(2, 4, 7, 11, generator=g)),
          "bool_mask": dict(attn_bias=torch.rand(2, 1, 1, 11, generator=g) > 0.3),
          "alibi": dict(alibi_slopes=torch.rand(4, generator=g), causal=True)}.get(feature, {})
    for dtype in (torch.float32, torch.bfloat16):
        results = check_backend("sdpa_math", q.to(dtype), k.to(dtype), v.to(dtype), grad=True, **kw)
        assert all(r.passed for r in results), "\n".join(map(str, results))


# ----- on a GPU ----------------------------------------------------------------------------

GPU_PROBLEMS = {
    "square": dict(b=2, sq=128, skv=128, hq=8, hkv=8, d=64),
    "causal": dict(b=2, sq=128, skv=128, hq=8, hkv=8, d=128, causal=True),
    "causal_tl": dict(b=1, sq=64, skv=200, hq=4, hkv=4, d=64, causal=True, causal_alignment="top_left"),
    "lower_right_gqa": dict(b=2, sq=8, skv=300, hq=8, hkv=2, d=128, causal=True),
    "decode_gqa": dict(b=2, sq=1, skv=1000, hq=32, hkv=4, d=128, causal=True),
    "dv": dict(b=1, sq=100, skv=120, hq=4, hkv=4, d=128, dv=64),
    "d256": dict(b=1, sq=128, skv=128, hq=4, hkv=4, d=256, causal=True),
    "bias": dict(b=1, sq=64, skv=96, hq=4, hkv=4, d=64, bias=True),
    "window": dict(b=1, sq=96, skv=96, hq=4, hkv=4, d=64, window=(16, 0)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("problem", list(GPU_PROBLEMS))
@pytest.mark.parametrize("name", GPU_KERNELS)
def test_gpu_kernel_matches_reference_where_it_declares_no_reason(name, problem, dtype):
    kw = dict(GPU_PROBLEMS[problem])
    dims = {key: kw.pop(key) for key in ("b", "sq", "skv", "hq", "hkv", "d", "dv") if key in kw}
    q, k, v = _qkv(dtype=dtype, device="cuda", **dims)
    if kw.pop("bias", False):
        kw["attn_bias"] = torch.randn(dims["b"], dims["hq"], dims["sq"], dims["skv"], device="cuda")
    for grad in (False, True):
        spec = build_spec(q.detach().requires_grad_(grad), k, v, **kw)
        reasons = portattn.get_backend(name).not_supported_reasons(spec)
        if reasons:
            continue
        results = check_backend(name, q, k, v, grad=grad, **kw)
        assert all(r.passed for r in results), f"{name} {problem} grad={grad}:\n" + "\n".join(map(str, results))
