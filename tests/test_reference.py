"""The float64 reference against an independent, literal float64 formula (docs/semantics.md).

``literal`` below is written from the contract text, row by row, sharing no code with
portattn.reference, so a slip in either shows up as a mismatch.
"""

import math

import pytest
import torch

import portattn
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec


def literal(q, k, v, *, causal=False, alignment="bottom_right", window=None, scale=None, softcap=None,
            alibi=None, bias=None):
    """One sequence, bshd without batch: q (Sq, Hq, D), k (Sk, Hkv, D), v (Sk, Hkv, Dv).

    alibi (Hq,), bias (Hq, Sq, Sk) float or bool. Returns out (Sq, Hq, Dv), lse (Hq, Sq)."""
    q, k, v = q.double(), k.double(), v.double()
    sq, hq, d = q.shape
    sk, hkv, dv = v.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    left, right = (None, None) if window is None else window
    left = None if left == -1 else left
    right = None if right == -1 else right
    if causal:
        right = 0
    out = torch.zeros(sq, hq, dv, dtype=torch.float64)
    lse = torch.full((hq, sq), -math.inf, dtype=torch.float64)
    for h in range(hq):
        hk = h // (hq // hkv)
        for i in range(sq):
            row = i + sk - sq if alignment == "bottom_right" else i
            scores, values = [], []
            for j in range(sk):
                if left is not None and j < row - left:
                    continue
                if right is not None and j > row + right:
                    continue
                if bias is not None and bias.dtype == torch.bool and not bool(bias[h, i, j]):
                    continue
                s = scale * float(q[i, h] @ k[j, hk])
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                if alibi is not None:
                    s -= float(alibi[h]) * abs(i + sk - sq - j)
                if bias is not None and bias.dtype != torch.bool:
                    s += float(bias[h, i, j])
                scores.append(s)
                values.append(v[j, hk])
            if not scores:
                continue
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            total = sum(w)
            out[i, h] = sum(wi * vi for wi, vi in zip(w, values)) / total
            lse[h, i] = m + math.log(total)
    return out, lse


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, alignment="top_left"),
    dict(window=(2, 1)),
    dict(window=(1, -1)),
    dict(window=(0, 0)),
    dict(causal=True, window=(3, None)),
    dict(window=(2, 1), alignment="top_left"),
    dict(softcap=2.5),
    dict(alibi=True),
    dict(bias="float"),
    dict(bias="bool"),
    dict(scale=0.7, softcap=5.0, alibi=True, bias="float", causal=True),
]


def _inputs(g, sq, sk, hq, hkv, d, dv, case):
    q = torch.randn(sq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sk, hkv, dv, generator=g, dtype=torch.float64)
    alibi = torch.rand(hq, generator=g) if case.get("alibi") else None   # slopes are float32 (as in flash-attn)
    bias = None
    if case.get("bias") == "float":
        bias = torch.randn(hq, sq, sk, generator=g, dtype=torch.float64)
    elif case.get("bias") == "bool":
        bias = torch.rand(hq, sq, sk, generator=g) > 0.4
    return q, k, v, alibi, bias


def _api_kwargs(case, alibi, bias):
    kw = {key: val for key, val in case.items() if key in ("causal", "window", "scale", "softcap")}
    if "alignment" in case:
        kw["causal_alignment"] = case["alignment"]
    if alibi is not None:
        kw["alibi_slopes"] = alibi
    if bias is not None:
        kw["attn_bias"] = bias.unsqueeze(0)
    return kw


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("sq,sk", [(5, 7), (7, 5), (1, 6), (4, 4)])
def test_reference_matches_literal_formula(case, sq, sk):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    hq, hkv, d, dv = 4, 2, 8, 6
    q, k, v, alibi, bias = _inputs(g, sq, sk, hq, hkv, d, dv, case)
    lit_out, lit_lse = literal(q, k, v, causal=case.get("causal", False), alignment=case.get("alignment", "bottom_right"),
                               window=case.get("window"), scale=case.get("scale"), softcap=case.get("softcap"),
                               alibi=alibi, bias=bias)
    spec = build_spec(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                      causal_alignment=case.get("alignment", "bottom_right"), **{
                          kk: vv for kk, vv in _api_kwargs(case, alibi, bias).items() if kk != "causal_alignment"},
                      )
    out, lse = reference_forward(spec)
    torch.testing.assert_close(out[0], lit_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[0].double(), lit_lse, rtol=1e-6, atol=1e-6)
    # fully-masked rows: output exactly 0 and lse -inf, never NaN
    empty = torch.isneginf(lit_lse)
    assert torch.equal(torch.isneginf(lse[0]), empty)
    assert not torch.isnan(out).any()
    assert (out[0].permute(1, 0, 2)[empty] == 0).all()


def test_fully_masked_rows_are_zero_with_neg_inf_lse():
    # Sq > Sk with bottom-right causal: the first Sq - Sk rows see no key.
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 3, 2, 8, dtype=torch.float64)
    out, lse = portattn.attention(q, k, k, causal=True, return_lse=True, backend="reference")
    assert (out[0, :3] == 0).all() and torch.isneginf(lse[0, :, :3]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, :, 3:]).all()


def test_varlen_equals_per_sequence_dense():
    g = torch.Generator().manual_seed(7)
    lens_q, lens_k = [3, 0, 1, 5], [4, 2, 0, 5]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, 8, generator=g, dtype=torch.float64)
    out, lse = portattn.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True,
                                  backend="reference")
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        lit_out, lit_lse = literal(q[qs], k[ks], v[ks], causal=True)
        torch.testing.assert_close(out[qs], lit_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, qs].double(), lit_lse, rtol=1e-6, atol=1e-6)


def test_layout_bhsd_matches_bshd():
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64)
    k = torch.randn(2, 7, 2, 8, dtype=torch.float64)
    a = portattn.attention(q, k, k, causal=True, backend="reference")
    b = portattn.attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), causal=True, layout="bhsd",
                           backend="reference")
    assert b.shape == (2, 4, 5, 8)
    torch.testing.assert_close(a, b.transpose(1, 2), rtol=0, atol=0)


def test_output_dtype_follows_q():
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        q = torch.randn(1, 3, 2, 8, dtype=dt)
        out, lse = portattn.attention(q, q, q, backend="reference", return_lse=True)
        assert out.dtype == dt and lse.dtype == torch.float32


@pytest.mark.parametrize("case", [dict(causal=True), dict(softcap=3.0, alibi=True), dict(bias="float", window=(2, 0))],
                         ids=["causal", "softcap+alibi", "bias+window"])
def test_reference_gradcheck(case):
    g = torch.Generator().manual_seed(3)
    q, k, v, alibi, bias = _inputs(g, 4, 5, 2, 1, 4, 3, case)
    kw = _api_kwargs(case, alibi, bias)
    leaves = [t.unsqueeze(0).requires_grad_() for t in (q, k, v)]
    if bias is not None:
        kw["attn_bias"] = kw["attn_bias"].clone().requires_grad_()
        leaves.append(kw.pop("attn_bias"))

        def fn(q, k, v, b):
            return portattn.attention(q, k, v, attn_bias=b, backend="reference", **kw)
    else:
        def fn(q, k, v):
            return portattn.attention(q, k, v, backend="reference", **kw)
    assert torch.autograd.gradcheck(fn, tuple(leaves))


def test_naive_is_close_but_in_dtype():
    q = torch.randn(1, 9, 2, 16, dtype=torch.bfloat16)
    spec = build_spec(q, q, q)
    ref, _ = reference_forward(spec)
    naive, _ = naive_forward(spec)
    assert naive.dtype == torch.bfloat16 and ref.dtype == torch.float64
    err = (naive.double() - ref).abs().max().item()
    assert 0 < err < 0.05
