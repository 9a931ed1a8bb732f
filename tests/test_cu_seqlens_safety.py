"""Bad ``cu_seqlens`` / ``max_seqlen`` where nothing validates them (issue 11).

Under ``torch.compile`` (and CUDA-graph capture) the contents of ``cu_seqlens`` cannot be read
on the host, so :func:`portattn.spec.build_spec` skips that check and the kernels must be safe
by construction. Before the fix ``cu_seqlens=[0, 5, 40]`` for 32 packed tokens aborted the
process on triton (``free(): invalid size``) and gave a silent result on the reference.

The triton kernels run here under the interpreter (CPU tensors) on a spec built the way the
compiled path builds it (``build_spec`` while compiling: no content check), with q/k/v/dO as
views into NaN-filled buffers and out/lse/dq/dk/dv as views into sentinel-filled ones:
no crash, no guard read (everything finite), no guard written, and the valid sequences' rows
match the reference computed on those sequences alone. What a bad ``cu_seqlens`` gives is
documented in docs/semantics.md: every bound is clamped (start and end into [0, total],
end >= start, length <= max_seqlen); rows no clamped sequence covers output 0 with
lse = -inf and get gradient 0; the rest of an invalid sequence is unspecified but finite.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import portattn.spec
from portattn.numerics import GRAD_FACTOR, compare, compare_lse
from portattn.reference import ReferenceBackend, naive_forward, reference_forward
from portattn.spec import build_spec

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

GUARD = 8              # guard rows on each side of every buffer
SENTINEL = 1234.5      # what the output guards hold (exact in fp16/bf16/fp32)
TOTAL_Q = TOTAL_K = 32
HQ, HKV, D = 2, 1, 16

# name -> (cu_seqlens, max_seqlen): q and k share them (packed self-attention)
BAD = {
    "end_beyond_total": ([0, 5, 40], 35),           # the case
    "decreasing_tail": ([0, 10, 32, 20], 32),
    "decreasing_overlap": ([0, 20, 10, 32], 22),      # sequences 0 and 2 overlap after clamping
    "negative": ([0, -5, 12, 32], 20),
    "all_beyond_total": ([0, 12, 50, 60], 40),
    "max_seqlen_too_small": ([0, 10, 32], 16),       # sequence 1 has 22 rows
    "start_not_zero": ([3, 9, 30], 21),
}


def _spans(cu, max_len, total):
    """The clamped (start, length) of every sequence, as the kernels compute them."""
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        start = min(max(a, 0), total)
        end = min(max(b, start), total)
        out.append((start, min(end - start, max_len)))
    return out


def _valid(cu, max_len, total):
    """Indices of sequences that are valid as given and overlap no other clamped sequence."""
    spans = _spans(cu, max_len, total)
    good = []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if not (0 <= a <= b <= total and b - a <= max_len):
            continue
        s, n = spans[i]
        if all(j == i or n == 0 or m == 0 or s + n <= t or t + m <= s for j, (t, m) in enumerate(spans)):
            good.append(i)
    return good


def _guarded(shape, fill, dtype, device, gen=None):
    """``(buffer, view)``: a view of ``shape`` (rows first) inside a buffer with GUARD rows on each
    side and 8 extra columns, all holding ``fill``; with ``gen`` the view holds random values."""
    buf = torch.full((shape[0] + 2 * GUARD, *shape[1:-1], shape[-1] + 8), fill, dtype=dtype, device=device)
    view = buf[GUARD:GUARD + shape[0], ..., :shape[-1]]
    if gen is not None:
        view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
    return buf, view


def _guarded_lse(heads, total, device):
    buf = torch.full((heads, total + 2 * GUARD), SENTINEL, dtype=torch.float32, device=device)
    return buf, buf[:, GUARD:GUARD + total]


def _outside(buf, view):
    """Bool mask of the elements of ``buf`` that are not part of ``view``."""
    mask = torch.ones_like(buf, dtype=torch.bool)
    inner = mask.as_strided(view.shape, view.stride(), view.storage_offset() - buf.storage_offset())
    inner.fill_(False)
    return mask


def _unvalidated_spec(monkeypatch, q, k, v, cu, max_len, **kw):
    """The spec the compiled path builds: build_spec while compiling checks no contents."""
    monkeypatch.setattr(portattn.spec, "_is_compiling", lambda: True)
    t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    spec = build_spec(q, k, v, cu_seqlens_q=t, cu_seqlens_k=t.clone(), max_seqlen_q=max_len,
                      max_seqlen_k=max_len, **kw)
    monkeypatch.undo()
    return spec


def _guarded_bias(batch, max_len, gen, device):
    """A (B, Hq, max_len, max_len) bias view inside a NaN buffer guarded on every side: a read
    past max_seqlen (a length not clamped to it) would show as NaN."""
    buf = torch.full((batch + 2, HQ, max_len + 2 * GUARD, max_len + 2 * GUARD), float("nan"), device=device)
    view = buf[1:1 + batch, :, GUARD:GUARD + max_len, GUARD:GUARD + max_len]
    view.copy_(torch.randn(view.shape, generator=gen).to(device))
    return view


FEATURES = ["causal", "window_softcap", "bias_alibi"]


def run_bad_case(monkeypatch, backend, name, features, *, dtype=torch.float32, device="cpu", guard_outputs=False):
    """Forward and backward (with dlse) of ``backend`` on the bad ``cu_seqlens`` case ``name``,
    q/k/v/dO inside NaN guards, the spec built as the compiled path builds it; out/lse/dq/dk/dv
    inside sentinel guards too with ``guard_outputs`` (triton's ops accept output buffers).
    Asserts: nothing non-finite, no guard written, uncovered rows 0 / -inf, valid sequences
    equal to the reference. Used by the GPU tests of test_triton.py / test_cupy.py too."""
    from portattn.registry import get_backend

    cu, max_len = BAD[name]
    gen = torch.Generator().manual_seed(0)
    kw = {"causal": {"causal": True}, "window_softcap": {"window": (3, 2), "softcap": 2.0},
          "bias_alibi": {"alibi_slopes": torch.rand(HQ, generator=gen).to(device),
                         "attn_bias": _guarded_bias(len(cu) - 1, max_len, gen, device)}}[features]
    q, k, v, dout = (_guarded((total, heads, D), float("nan"), dtype, device, gen)[1]
                     for total, heads in ((TOTAL_Q, HQ), (TOTAL_K, HKV), (TOTAL_K, HKV), (TOTAL_Q, HQ)))
    spec = _unvalidated_spec(monkeypatch, q, k, v, cu, max_len, **kw)
    dlse = torch.randn(spec.lse_shape, generator=gen).to(device)
    if guard_outputs:
        from portattn.backends.triton import ops
        outs = {key: _guarded((total, heads, D), SENTINEL, dtype, device)
                for key, total, heads in (("out", TOTAL_Q, HQ), ("dq", TOTAL_Q, HQ), ("dk", TOTAL_K, HKV),
                                          ("dv", TOTAL_K, HKV))}
        outs["lse"] = _guarded_lse(HQ, TOTAL_Q, device)
        out, lse = ops.forward(spec, out=outs["out"][1], lse=outs["lse"][1])
        dq, dk, dv, _ = ops.backward(spec, out, lse, dout, dlse, grads=(outs["dq"][1], outs["dk"][1], outs["dv"][1]))
        for key, (buf, view) in outs.items():
            outside = buf[_outside(buf, view)]
            assert torch.equal(outside, torch.full_like(outside, SENTINEL)), f"{key}: a guard element was written"
    else:
        impl = get_backend(backend)
        out, lse = impl.forward(spec)
        dq, dk, dv, _ = impl.backward(spec, out, lse, dout, dlse)
    if device != "cpu":
        torch.cuda.synchronize()   # an illegal address fails here
    for key, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{key}: non-finite values (a NaN guard was read?)"
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any()

    # rows no clamped sequence covers: output 0, lse -inf, gradient 0
    covered_q = torch.zeros(TOTAL_Q, dtype=torch.bool, device=device)
    for s, n in _spans(cu, max_len, TOTAL_Q):
        covered_q[s:s + n] = True
    assert torch.equal(out[~covered_q], torch.zeros_like(out[~covered_q]))
    assert torch.isneginf(lse[:, ~covered_q]).all()
    assert torch.equal(dq[~covered_q], torch.zeros_like(dq[~covered_q]))

    # valid sequences: their rows as the reference computes them on that sequence alone
    valid = _valid(cu, max_len, TOTAL_Q)
    if name != "decreasing_overlap":
        assert valid, "each case keeps at least one valid sequence"
    for b in valid:
        s, n = cu[b], cu[b + 1] - cu[b]
        if n == 0:
            continue
        seq_kw = dict(kw)
        if "attn_bias" in kw:
            seq_kw["attn_bias"] = kw["attn_bias"][b:b + 1, :, :n, :n]
        _check_sequence(q[s:s + n], k[s:s + n], v[s:s + n], dout[s:s + n], dlse[:, s:s + n],
                        out[s:s + n], lse[:, s:s + n], dq[s:s + n], dk[s:s + n], dv[s:s + n], seq_kw,
                        f"{backend} {name}[{b}]")


@cpu_only
@needs_triton
@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("name", sorted(BAD))
def test_triton_bad_cu_seqlens_stay_in_bounds(monkeypatch, name, features):
    run_bad_case(monkeypatch, "triton", name, features, guard_outputs=True)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("name", sorted(BAD))
def test_chunked_bad_cu_seqlens_stay_in_bounds(monkeypatch, name, features):
    """The default CPU path (host-side offsets, clamped the same way) meets the same contract."""
    from portattn.registry import list_backends
    if "chunked" not in list_backends():
        pytest.skip("no chunked backend")
    run_bad_case(monkeypatch, "chunked", name, features)


def _check_sequence(q, k, v, dout, dlse, out, lse, dq, dk, dv, kw, label):
    """One sequence against the float64 reference (dense, batch 1) under the equivalence rule."""
    leaves = [t.detach().unsqueeze(0).to(torch.float64).requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = reference_forward(build_spec(*leaves, **kw))
    nleaves = [t.detach().unsqueeze(0).requires_grad_(True) for t in (q, k, v)]
    naive_out, _ = naive_forward(build_spec(*nleaves, **kw))
    results = [compare("out", out.unsqueeze(0), ref_out, naive_out), compare_lse(lse.unsqueeze(0), ref_lse)]
    g = dout.unsqueeze(0)
    h = dlse.unsqueeze(0)
    ref_g = torch.autograd.grad((ref_out * g.double()).sum() + (ref_lse.double() * h.double()).sum(), leaves)
    naive_lse = naive_forward(build_spec(*nleaves, **kw))[1]
    naive_g = torch.autograd.grad((naive_out * g).sum() + (naive_lse * h).sum(), nleaves)
    scale = ((g.abs().max() * v.abs().max() + h.abs().max()) * k.abs().max()).item()
    for name, a, r, nv in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, naive_g):
        results.append(compare(name, a.unsqueeze(0), r, nv, factor=GRAD_FACTOR, zero_ref_scale=scale))
    assert all(r.passed for r in results), label + "\n" + "\n".join(map(str, results))


@pytest.mark.parametrize("name", sorted(BAD))
def test_reference_rejects_bad_cu_seqlens(monkeypatch, name):
    """The reference reads cu_seqlens on the host anyway: a clear ValueError, not a silent result."""
    cu, max_len = BAD[name]
    q = torch.randn(TOTAL_Q, HQ, D)
    k = torch.randn(TOTAL_K, HKV, D)
    spec = _unvalidated_spec(monkeypatch, q, k, k, cu, max_len)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ReferenceBackend().forward(spec)


def test_reference_accepts_valid_cu_seqlens(monkeypatch):
    q = torch.randn(TOTAL_Q, HQ, D)
    spec = _unvalidated_spec(monkeypatch, q, q, q, [0, 10, 10, 32], 22)
    out, lse = ReferenceBackend().forward(spec)
    assert torch.isfinite(out).all() and out.shape == q.shape


_COMPILED = textwrap.dedent("""
    import sys, torch, portattn
    backend = sys.argv[1]
    q = torch.randn(32, 2, 16)
    cu = torch.tensor([0, 5, 40], dtype=torch.int32)
    f = torch.compile(lambda q: portattn.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=35,
                                                   max_seqlen_k=35, causal=True, backend=backend),
                      fullgraph=True, backend="aot_eager")
    try:
        out = f(q)
    except ValueError as exc:
        print("ValueError:", exc)
    else:
        print("finite" if bool(torch.isfinite(out).all()) else "NOT FINITE")
""")


@cpu_only
@needs_triton
@pytest.mark.parametrize("backend,expect", [("triton", "finite"), ("reference", "ValueError: cu_seqlens_q")])
def test_compiled_public_api_with_bad_cu_seqlens(backend, expect):
    """The issue's exact case through torch.compile(fullgraph=True), in a subprocess: a heap
    corruption would abort the test process itself."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", _COMPILED, backend], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert expect in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
