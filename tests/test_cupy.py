"""GPU tests of the cupy backend: forward, lse and gradients against the float64 reference
under the equivalence rule of docs/semantics.md (portattn.numerics), across features, dtypes and odd sizes.

Skipped without a CUDA device or without cupy (run on the H200 by the lead).
"""

import dataclasses
import math

import pytest
import torch
from test_cu_seqlens_safety import BAD, FEATURES, run_bad_case
from test_lse_grad import check_lse_grads

import portattn
from portattn.numerics import compare, compare_lse
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec

cuda_ok = torch.cuda.is_available() and not getattr(torch.version, "hip", None)
try:
    import cupy  # noqa: F401
    have_cupy = True
except Exception:
    have_cupy = False

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (cuda_ok and have_cupy), reason="needs an NVIDIA GPU and cupy")]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# name -> (B, Sq, Sk, Hq, Hkv, D, Dv, kwargs); "bias"/"mask"/"alibi"/"varlen" are built below.
CASES = {
    "basic": (2, 128, 128, 4, 4, 64, 64, {}),
    "odd_sizes": (2, 77, 133, 3, 3, 40, 40, {}),
    "causal_br": (2, 65, 190, 4, 4, 128, 128, {"causal": True}),
    "causal_br_sq_gt_sk": (1, 190, 65, 2, 2, 64, 64, {"causal": True}),
    "causal_tl": (1, 190, 65, 2, 2, 96, 96, {"causal": True, "causal_alignment": "top_left"}),
    # whole CTAs (rows 0..279) see no key: their loop is empty (regression: staging race)
    "causal_br_empty_ctas": (2, 300, 20, 4, 1, 128, 128, {"causal": True}),
    "window": (2, 300, 300, 2, 2, 96, 96, {"window": (32, 16)}),
    "window_tl": (1, 150, 260, 2, 2, 64, 64, {"window": (20, 5), "causal_alignment": "top_left"}),
    "gqa_causal": (2, 200, 200, 8, 2, 128, 128, {"causal": True}),
    "mqa_d224": (1, 96, 96, 4, 1, 224, 224, {}),
    "softcap_d256": (1, 130, 100, 2, 2, 256, 256, {"softcap": 5.0}),
    "alibi_d160": (2, 100, 140, 4, 4, 160, 160, {"alibi": True, "causal": True}),
    "bias_dv": (2, 70, 90, 2, 2, 32, 64, {"bias": True}),
    "bool_mask": (3, 60, 80, 2, 2, 64, 64, {"mask": True}),
    "varlen_causal": (3, None, None, 4, 2, 64, 64, {"varlen": [1, 130, 64], "causal": True}),
    "varlen_window": (3, None, None, 2, 2, 128, 128, {"varlen": [77, 5, 200], "window": (40, 0)}),
    "seqlen1": (2, 1, 257, 4, 4, 128, 128, {}),
    "seqlen1_causal": (2, 1, 1, 2, 2, 64, 64, {"causal": True}),
    "dv_ne_d": (1, 64, 100, 2, 2, 64, 128, {}),
    "tiny_d8": (1, 50, 50, 2, 2, 8, 8, {}),
    "odd_d": (1, 33, 47, 2, 2, 72, 72, {"causal": True}),
    "bhsd": (2, 80, 80, 4, 4, 64, 64, {"layout": "bhsd"}),
    # tensor-core backward (fp16/bf16, padded head dim <= 128): every feature at 32/64/96/128,
    # several query tiles per dK/dV CTA and GQA groups walked across heads (double buffering)
    "softcap_d128_gqa": (2, 130, 150, 4, 2, 128, 128, {"softcap": 5.0, "causal": True}),
    "alibi_d64_window": (2, 100, 140, 4, 2, 64, 64, {"alibi": True, "window": (30, 10)}),
    "bias_d128_causal": (1, 90, 70, 2, 1, 128, 128, {"bias": True, "causal": True}),
    "mask_d32": (3, 50, 70, 2, 1, 32, 32, {"mask": True}),
    "varlen_softcap_d32": (3, None, None, 4, 1, 32, 32, {"varlen": [90, 3, 40], "softcap": 2.0, "causal": True}),
    "varlen_d96_tl": (2, None, None, 2, 2, 96, 96, {"varlen": [70, 33], "causal": True, "causal_alignment": "top_left"}),
    "gqa_long_d128": (1, 300, 300, 8, 2, 128, 128, {"causal": True}),
    "gqa_long_d64_window": (2, 257, 190, 6, 3, 64, 64, {"window": (50, 20)}),
    "dv_ne_d_small": (1, 40, 60, 2, 2, 20, 36, {}),   # unaligned: padded copies, sliced gradients
    # tensor-core backward above padded head dim 128 (issue 16): two warps per 16 keys split the
    # head dim of dK/dV (several query tiles per CTA, GQA walks, a partial last key CTA), and
    # Dv != D where one warp of each pair stores no dK or no dV column
    "d256_causal_gqa": (1, 200, 230, 4, 2, 256, 256, {"causal": True}),
    "d192_dv64": (2, 90, 150, 2, 2, 192, 64, {}),
    "d64_dv256_window": (1, 120, 140, 2, 1, 64, 256, {"window": (40, 10)}),
    "d160_mask": (3, 60, 80, 2, 2, 160, 160, {"mask": True}),
    "varlen_d224_causal": (3, None, None, 4, 2, 224, 224, {"varlen": [70, 1, 150], "causal": True}),
    "d180_softcap": (1, 50, 70, 2, 2, 180, 180, {"softcap": 4.0}),   # unaligned: padded copies
    "d256_bias_dv128_tl": (1, 70, 90, 2, 2, 256, 128, {"bias": True, "causal": True,
                                                        "causal_alignment": "top_left"}),
}
#: cases whose 16-bit backward runs the head-dim-split tensor-core kernels (padded HD > 128)
HD_GT_128_CASES = ["mqa_d224", "softcap_d256", "alibi_d160", "d256_causal_gqa", "d192_dv64", "d64_dv256_window",
                   "d160_mask", "varlen_d224_causal", "d180_softcap", "d256_bias_dv128_tl"]


def _inputs(case, dtype, seed=0):
    b, sq, sk, hq, hkv, d, dv, kw = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    kw = dict(kw)
    extra = {}
    if "varlen" in kw:
        lens = kw.pop("varlen")
        lens_k = [n + 7 * (i % 2) for i, n in enumerate(lens)]
        cu_q = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + list(_cumsum(lens_k)), dtype=torch.int32, device=dev)
        shapes = [(sum(lens), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, dv)]
        extra.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        sq, sk = max(lens), max(lens_k)
    elif kw.get("layout") == "bhsd":
        shapes = [(b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv)]
    else:
        shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv)]
    q, k, v = (torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(dtype) for s in shapes)
    if kw.pop("alibi", False):
        extra["alibi_slopes"] = torch.rand(b, hq, generator=g, device=dev) * 0.5
    if kw.pop("bias", False):
        extra["attn_bias"] = torch.randn(b, 1, sq, sk, generator=g, device=dev).to(dtype)
    if kw.pop("mask", False):
        mask = torch.rand(b, 1, sq, sk, generator=g, device=dev) > 0.3
        mask[0, :, :, :] = False          # batch 0: every row fully masked
        mask[1, :, 5, :] = False          # one fully-masked row
        extra["attn_bias"] = mask
    kw.update(extra)
    return q, k, v, kw


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _grads(fn, q, k, v, kw, dout, dtype):
    """Gradients of fn(spec)'s output wrt q, k, v computed by autograd in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    spec = build_spec(*leaves, **kw)
    out, _ = fn(spec)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


def _to_layout(t, kw):
    return t.transpose(1, 2) if kw.get("layout") == "bhsd" else t


def _grad_scale(spec, dout, k, v) -> float:
    """numerics.compare's zero_ref_scale for gradients (as portattn.testing and the conformance
    checker pass it): the tensor-core backward sums dP = dO.v and delta = dO.O in different
    orders, so a numerically-zero reference (e.g. dq when every row sees one key) meets float32
    rounding noise of this magnitude."""
    if dout.numel() == 0:
        return 1.0
    return (dout.abs().max() * v.abs().max() * k.abs().max()).item() * spec.scale


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward(case, dtype):
    from portattn.backends.cupy import CupyBackend

    be = CupyBackend()
    q, k, v, kw = _inputs(case, dtype)
    spec = build_spec(q, k, v, **kw)
    assert be.supports(spec), be.not_supported_reasons(spec)
    out, lse = be.forward(spec)
    torch.cuda.synchronize()
    results = forward_results(spec, q, k, v, kw, out, lse)

    # gradients (the kernels' own out/lse feed the backward, as autograd would)
    g = torch.Generator(device="cuda").manual_seed(1)
    dout = torch.randn(spec.out_shape, generator=g, device="cuda").to(dtype)
    # the default backward (on Hopper at padded HD 64/128 it may fuse dQ with atomics: determinism
    # is not requested), then the deterministic mode twice: the same bits, and the same dk / dv
    dq, dk, dv, _ = be.backward(spec, out, lse, dout)
    det = dataclasses.replace(spec, deterministic=True)
    dq_d, dk_d, dv_d, _ = be.backward(det, out, lse, dout)
    dq2, dk2, dv2, _ = be.backward(det, out, lse, dout)
    assert torch.equal(dq_d, dq2) and torch.equal(dk_d, dk2) and torch.equal(dv_d, dv2), "backward not deterministic"
    assert torch.equal(dk, dk_d) and torch.equal(dv, dv_d), "dk / dv differ between the default and deterministic modes"
    ref_g = _grads(reference_forward, q, k, v, kw, dout, torch.float64)
    naive_g = _grads(naive_forward, q, k, v, kw, dout, dtype)
    for name, mine, r, n in zip(("dq", "dk", "dv", "dq (deterministic)"), (dq, dk, dv, dq_d), ref_g + ref_g[:1],
                                naive_g + naive_g[:1]):
        # reference grads are in the caller's layout; bring them to the canonical one
        r = _to_layout(r, kw)
        n = _to_layout(n, kw)
        results.append(compare(name, mine, r, n, factor=3, zero_ref_scale=_grad_scale(spec, dout, k, v)))
    bad = [str(r) for r in results if not r.passed]
    assert not bad, f"{case} {dtype}: " + "; ".join(bad)


def forward_results(spec, q, k, v, kw, out, lse) -> list:
    """out and lse against the float64 reference (docs/semantics.md's rule, against the naive
    math in the input dtype); asserts that rows with no visible key are exactly 0 with lse -inf."""
    ref_out, ref_lse = reference_forward(build_spec(q.double(), k.double(), v.double(), **kw))
    naive_out, _ = naive_forward(spec)
    empty = torch.isneginf(ref_lse)
    if bool(empty.any()):
        rows = empty.transpose(0, 1) if spec.is_varlen else empty.transpose(1, 2)
        assert bool((out[rows] == 0).all()), "fully-masked rows must output exactly 0"
        assert bool(torch.isneginf(lse[empty]).all()), "fully-masked rows must have lse -inf"
    return [compare("out", out, ref_out, naive_out), compare_lse(lse, ref_lse)]


MMA_VS_FMA_CASES = ["basic", "odd_sizes", "causal_br", "causal_tl", "window", "gqa_causal", "bias_dv", "bool_mask",
                     "varlen_causal", "seqlen1", "softcap_d128_gqa", "alibi_d64_window", "varlen_softcap_d32",
                     "gqa_long_d128", "dv_ne_d_small", "tiny_d8", *HD_GT_128_CASES]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", MMA_VS_FMA_CASES)
def test_mma_backward_matches_fma_backward(case, dtype):
    """The tensor-core backward against the FMA backward (runtime.backward(force_fma=True)) on
    the same inputs and the same forward out/lse: both within the §3 bound of the reference,
    and within that bound of each other."""
    from portattn.backends.cupy import CupyBackend, configs, runtime

    q, k, v, kw = _inputs(case, dtype, seed=7)
    spec = build_spec(q, k, v, **kw)
    cfg = configs.backward_config(runtime._DTYPE_NAMES[dtype], spec.head_dim, spec.head_dim_v)
    assert cfg.family == "bwd_mma", f"{case}: {cfg} (is {configs.BACKWARD_ENV} set?)"
    out, lse = CupyBackend().forward(spec)
    g = torch.Generator(device="cuda").manual_seed(2)
    dout = torch.randn(spec.out_shape, generator=g, device="cuda").to(dtype)
    mma = runtime.backward(spec, out, lse, dout)[:3]
    fma = runtime.backward(spec, out, lse, dout, force_fma=True)[:3]
    ref_g = _grads(reference_forward, q, k, v, kw, dout, torch.float64)
    naive_g = _grads(naive_forward, q, k, v, kw, dout, dtype)
    bad = []
    for name, a, b, r, n in zip(("dq", "dk", "dv"), mma, fma, ref_g, naive_g):
        r, n = _to_layout(r, kw), _to_layout(n, kw)
        zs = _grad_scale(spec, dout, k, v)
        rm = compare(name + "[mma]", a, r, n, factor=3, zero_ref_scale=zs)
        rf = compare(name + "[fma]", b, r, n, factor=3, zero_ref_scale=zs)
        bad += [str(x) for x in (rm, rf) if not x.passed]
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        if not diff <= 2 * rm.tolerance:
            bad.append(f"{name}: max|mma - fma| = {diff:.3g} > {2 * rm.tolerance:.3g}")
    assert not bad, f"{case} {dtype}: " + "; ".join(bad)


@pytest.mark.parametrize("d,dv", [(128, 128), (256, 256), (256, 160)])
def test_large_backward_bf16(d, dv):
    """Many key and query tiles per CTA (the benchmark's shape, smaller): tensor-core backward
    (at D 256 the head-dim-split dK/dV kernel)."""
    from portattn.backends.cupy import CupyBackend, runtime

    g = torch.Generator(device="cuda").manual_seed(4)
    q, k = (torch.randn(2, 1024, 8 if d <= 128 else 4, d, generator=g, device="cuda").to(torch.bfloat16)
            for _ in range(2))
    v = torch.randn(*k.shape[:-1], dv, generator=g, device="cuda").to(torch.bfloat16)
    for causal in (False, True):
        spec = build_spec(q, k, v, causal=causal)
        out, lse = CupyBackend().forward(spec)
        dout = torch.randn(spec.out_shape, generator=g, device="cuda").to(torch.bfloat16)
        grads = runtime.backward(spec, out, lse, dout)[:3]
        assert_large_backward_close(q, k, v, causal, dout, grads)


def assert_large_backward_close(q, k, v, causal, dout, grads):
    """dq, dk, dv of a bf16 large-shape backward (``grads``) against the float64 reference under
    the equivalence rule, factor 3 (test_large_backward_bf16, test_cupy_wgmma_bwd.py's)."""
    kw = {"causal": causal}
    ref_g = _grads(reference_forward, q, k, v, kw, dout, torch.float64)
    naive_g = _grads(naive_forward, q, k, v, kw, dout, torch.bfloat16)
    results = [compare(n, a, r, nv, factor=3) for n, a, r, nv in zip(("dq", "dk", "dv"), grads, ref_g, naive_g)]
    bad = [str(r) for r in results if not r.passed]
    assert not bad, f"causal={causal}: " + "; ".join(bad)


def test_large_tiles_bf16():
    """Several K tiles per CTA and many CTAs (the benchmark's shape, smaller)."""
    from portattn.backends.cupy import CupyBackend

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 1024, 8, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        spec = build_spec(q, k, v, causal=causal)
        out, lse = CupyBackend().forward(spec)
        ref_out, ref_lse = reference_forward(build_spec(q.double(), k.double(), v.double(), causal=causal))
        naive_out, _ = naive_forward(spec)
        r = compare("out", out, ref_out, naive_out)
        assert r.passed, str(r)
        assert compare_lse(lse, ref_lse).passed


def test_current_stream_and_no_sync():
    """Launches go to torch's current stream: results are right when read on that stream."""
    from portattn.backends.cupy import CupyBackend

    s = torch.cuda.Stream()
    q = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.float16)
    with torch.cuda.stream(s):
        spec = build_spec(q, q, q, causal=True)
        out, _ = CupyBackend().forward(spec)
        out2 = out * 1.0
    s.synchronize()
    ref, _ = reference_forward(build_spec(q.double(), q.double(), q.double(), causal=True))
    assert (out2.double() - ref).abs().max().item() < 5e-3
    assert math.isfinite(out2.float().sum().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_through_public_api_with_autograd(dtype):
    """portattn.attention(..., backend="cupy"): forward, lse and autograd gradients."""
    import portattn

    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 150, 4, 64, generator=g, device="cuda").to(dtype) for _ in range(3))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = portattn.attention(*leaves, causal=True, return_lse=True, backend="cupy")
    dout = torch.randn(out.shape, generator=g, device="cuda").to(dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    spec = build_spec(q, k, v, causal=True)
    ref_out, ref_lse = reference_forward(build_spec(q.double(), k.double(), v.double(), causal=True))
    naive_out, _ = naive_forward(spec)
    results = [compare("out", out, ref_out, naive_out), compare_lse(lse, ref_lse)]
    ref_g = _grads(reference_forward, q, k, v, {"causal": True}, dout, torch.float64)
    naive_g = _grads(naive_forward, q, k, v, {"causal": True}, dout, dtype)
    for name, mine, r, n in zip(("dq", "dk", "dv"), grads, ref_g, naive_g):
        results.append(compare(name, mine, r, n, factor=3))
    bad = [str(r) for r in results if not r.passed]
    assert not bad, "; ".join(bad)


# the gradient through the returned lse (issue 11): every kernel that forms delta is covered:
# the preprocess (fp16/bf16, tensor-core kernels at D <= 128 and the head-dim split above) and
# the stats (float32)
LSE_GRAD_CASES = ["basic", "causal_br_sq_gt_sk", "causal_br_empty_ctas", "gqa_causal", "softcap_d256",
                  "alibi_d160", "bias_d128_causal", "mask_d32", "varlen_causal", "varlen_window"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", LSE_GRAD_CASES)
def test_lse_gradient(case, dtype):
    q, k, v, kw = _inputs(case, dtype, seed=11)
    check_lse_grads("cupy", q, k, v, bias_grad=False, **kw)   # cupy has no dBias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lse_gradient_deterministic(dtype):
    """With a gradient reaching lse too and determinism requested, 5 backward runs are
    bit-identical (without the request, Hopper's fused dQ adds with atomics)."""
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v, dout = (torch.randn(2, 1024, 8, 128, generator=g, device="cuda").to(dtype) for _ in range(4))
    dlse = torch.randn(2, 8, 1024, generator=g, device="cuda")
    first = None
    for _ in range(5):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        with portattn.config.deterministic_scope():
            out, lse = portattn.attention(*leaves, causal=True, return_lse=True, backend="cupy")
        grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
        assert grads[0].abs().max() > 0
        if first is None:
            first = grads
        else:
            for a, b in zip(first, grads):
                assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_cu_seqlens_stay_in_bounds(monkeypatch, name, features, dtype):
    """Bad cu_seqlens/max_seqlen as torch.compile passes them (unchecked): the kernels clamp every
    sequence (seq_span in attn_common.cuh); NaN-guarded inputs (see test_cu_seqlens_safety.py)."""
    run_bad_case(monkeypatch, "cupy", name, features, dtype=dtype, device="cuda")


@pytest.mark.parametrize("mode", ["fma", "mma128"])
def test_backward_env_switch_runs_the_fma_kernels(monkeypatch, mode):
    """PORTATTN_CUPY_BACKWARD=fma (every head dim) / mma128 (above padded head dim 128) makes the
    backend's backward the FMA kernels, bit for bit (the switch back from the tensor cores
    without a code change, docs/cupy.md)."""
    from portattn.backends.cupy import CupyBackend, configs, runtime

    q, k, v, kw = _inputs("d256_causal_gqa", torch.bfloat16, seed=21)
    spec = build_spec(q, k, v, **kw)
    out, lse = CupyBackend().forward(spec)
    dout = torch.randn(spec.out_shape, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv(configs.BACKWARD_ENV, mode)
    switched = CupyBackend().backward(spec, out, lse, dout)[:3]
    monkeypatch.delenv(configs.BACKWARD_ENV)
    fma = runtime.backward(spec, out, lse, dout, force_fma=True)[:3]
    for a, b in zip(switched, fma):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d", [256, 200])
@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_cu_seqlens_stay_in_bounds_hd_gt_128(monkeypatch, name, features, d):
    """The bad-cu_seqlens cases at head dims 256 and 200 (bf16: the head-dim-split tensor-core
    backward; run_bad_case builds q, k, v at one width, its module's ``D``)."""
    import test_cu_seqlens_safety

    monkeypatch.setattr(test_cu_seqlens_safety, "D", d)
    run_bad_case(monkeypatch, "cupy", name, features, dtype=torch.bfloat16, device="cuda")


KV_STAGES_CASES = ["basic", "causal_br", "causal_br_empty_ctas", "varlen_causal", "softcap_d256", "d256_causal_gqa",
                   "dv_ne_d", "bias_d128_causal"]


@pytest.mark.parametrize("case", KV_STAGES_CASES)
def test_forward_kv_stages_2_is_bit_identical(monkeypatch, case):
    """PORTATTN_CUPY_FWD_KV_STAGES=2 (double-buffered K+V tiles) changes only when tiles are
    copied, not the arithmetic: out and lse equal the default kernel's bit for bit, and the
    reference's under the equivalence rule; the switch really launches the 2-stage kernel."""
    from portattn.backends.cupy import CupyBackend, configs, runtime

    q, k, v, kw = _inputs(case, torch.bfloat16, seed=17)
    spec = build_spec(q, k, v, **kw)
    monkeypatch.setenv(configs.FORWARD_ENV, "mma")   # the mma.sync forward's two pipelines (auto: wgmma at HD 64/128/256)
    monkeypatch.delenv(configs.FORWARD_KV_STAGES_ENV, raising=False)
    out1, lse1 = CupyBackend().forward(spec)
    monkeypatch.setenv(configs.FORWARD_KV_STAGES_ENV, "2")
    assert runtime.plan_forward(spec).launches[0].cfg.kv_stages == 2
    out2, lse2 = CupyBackend().forward(spec)
    out3, _ = CupyBackend().forward(spec)
    torch.cuda.synchronize()
    assert torch.equal(out1, out2) and torch.equal(out2, out3)
    assert torch.equal(lse1, lse2)
    ref_out, ref_lse = reference_forward(build_spec(q.double(), k.double(), v.double(), **kw))
    naive_out, _ = naive_forward(spec)
    for r in (compare("out", out2, ref_out, naive_out), compare_lse(lse2, ref_lse)):
        assert r.passed, str(r)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("dv", [8, 40, 64, 128, 200, 256])
def test_preprocess_vector_and_element_reads_agree(dtype, dv):
    """attn_bwd_preprocess's delta (one sequential fmaf sum per row) is bit-identical for the same
    values aligned (a fresh tensor) and misaligned (the same rows one element into a buffer), and
    within float32 rounding of float64 (with dlse subtracted): the guard for a kernel that reads
    aligned rows in wider loads."""
    from portattn.backends.cupy import configs, runtime

    g = torch.Generator(device="cuda").manual_seed(dv)
    B, S, H = 2, 77, 3
    q = torch.randn(B, S, H, dv, generator=g, device="cuda").to(dtype)
    spec = build_spec(q, q, q)
    o = torch.randn(B, S, H, dv, generator=g, device="cuda").to(dtype)
    do = torch.randn(B, S, H, dv, generator=g, device="cuda").to(dtype)
    dlse = torch.randn(spec.lse_shape, generator=g, device="cuda")
    # the preprocess takes the head dim at run time: one module per dtype serves every dv
    cfg = configs.backward_config(runtime._DTYPE_NAMES[dtype], 64, 64, mode="fma")

    def delta_of(o, do):
        delta = torch.full(spec.lse_shape, float("nan"), device="cuda")
        lse_strides = runtime.common_args(spec, q, q, q)[0][-2:]
        do_args = [runtime._ptr(do), *runtime._strides3(do, False)]
        plan = runtime.Plan(launches=[runtime._preprocess_launch(spec, cfg, o, do_args, delta, lse_strides, dlse)],
                            keep_alive=(o, do, delta, dlse))
        runtime.execute(plan, spec.device)
        return delta

    def misaligned(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    aligned = delta_of(o, do)
    shifted = delta_of(misaligned(o), misaligned(do))
    torch.cuda.synchronize()
    assert torch.equal(aligned, shifted), (aligned - shifted).abs().max()
    ref = (o.double() * do.double()).sum(-1).permute(0, 2, 1) - dlse.double()
    assert torch.allclose(aligned.double(), ref, rtol=1e-5, atol=1e-5 * math.sqrt(dv))
