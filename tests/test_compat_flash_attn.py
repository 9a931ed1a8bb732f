"""portattn.compat.flash_attn against flash-attn 2's documented semantics.

flash-attn itself needs a CUDA build, so the oracle is flash-attn's semantics written out here
independently of portattn (``_flash_oracle``: the masks and biases of flash-attn's docstrings,
bottom-right causal, ``window_size`` with negative = unbounded, causal forcing right = 0), in
float64 as the reference and in the input dtype (scores and P·V in the dtype, softmax in
float32) as the equivalence rule's yardstick (docs/semantics.md). Problems are drawn by
Hypothesis: dense, qkv-/kv-packed and the three varlen variants, GQA, windows, softcap, ALiBi,
scales, float32/bfloat16/float64; lse shapes as flash-attn's.
"""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from portattn.compat import flash_attn as fa  # noqa: E402
from portattn.numerics import GRAD_FACTOR, compare, compare_lse  # noqa: E402

EXAMPLES = settings(max_examples=max(10, settings.default.max_examples))


def _flash_oracle(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi=None,
                  naive=False):
    """One sequence, flash-attn's semantics. q (Sq, H, D), k/v (Sk, Hk, D/Dv); alibi (H,) or None.

    ``naive=False``: the float64 reference; ``naive=True``: the yardstick in q's dtype (q scaled
    first, scores and P·V in that dtype, softmax in float32). Returns out (Sq, H, Dv) and lse (H, Sq)."""
    dtype = q.dtype if naive else torch.float64
    sq, h, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    kd = kd.repeat_interleave(h // hk, dim=1)      # head i reads kv head i // (H / Hk)
    vd = vd.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", qd * scale if naive else qd, kd)
    if not naive:
        s = s * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    if alibi is not None:
        s = s - alibi.to(s.dtype).view(h, 1, 1) * (i + sk - sq - j).abs().to(s.dtype)
    left, right = window_size
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i + sk - sq - left
    if right >= 0:
        keep &= j <= i + sk - sq + right
    s = s.masked_fill(~keep, float("-inf"))
    work = s.float() if naive else s
    m = work.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(work - m)
    l = p.sum(-1, keepdim=True)
    lse = (m + torch.log(l)).squeeze(-1).double()
    p = p / torch.where(l == 0, torch.ones_like(l), l)
    out = torch.einsum("hqk,khd->qhd", p.to(dtype), vd)
    return out, lse


def _oracle_batch(q, k, v, cu_q=None, cu_k=None, *, alibi=None, **kw):
    """Dense (B, S, H, D) or packed (total, H, D) + cu_seqlens; returns ref out/lse and naive out."""
    dense = cu_q is None
    if dense:
        cu_q = [b * q.shape[1] for b in range(q.shape[0] + 1)]
        cu_k = [b * k.shape[1] for b in range(k.shape[0] + 1)]
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    outs, lses, naives = [], [], []
    for b in range(len(cu_q) - 1):
        sl_q, sl_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = None if alibi is None else (alibi[b] if alibi.dim() == 2 else alibi)
        o, lse = _flash_oracle(q[sl_q], k[sl_k], v[sl_k], alibi=slopes, **kw)
        n, _ = _flash_oracle(q[sl_q], k[sl_k], v[sl_k], alibi=slopes, naive=True, **kw)
        outs.append(o)
        lses.append(lse)
        naives.append(n)
    out, naive, lse = torch.cat(outs), torch.cat(naives), torch.cat(lses, dim=1)
    if dense:
        bsz = len(cu_q) - 1
        out, naive = out.unflatten(0, (bsz, -1)), naive.unflatten(0, (bsz, -1))
        lse = lse.unflatten(1, (bsz, -1)).transpose(0, 1)       # (B, H, Sq)
    return out, lse, naive


@st.composite
def _options(draw):
    causal = draw(st.booleans())
    left = draw(st.sampled_from([-1, -1, 0, 1, 3]))
    right = draw(st.sampled_from([-1, -1, 0, 2]))
    return dict(
        softmax_scale=draw(st.sampled_from([None, None, 0.3, 1.7])),
        causal=causal,
        window_size=(left, right),
        softcap=draw(st.sampled_from([0.0, 0.0, 1.5])),
    )


def _rand(g, *shape, dtype):
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def _check(out, lse, ref, ref_lse, naive, label):
    result = compare("out", out, ref, naive)
    assert result.passed, f"{label}: {result}"
    lse_result = compare_lse(lse, ref_lse)
    assert lse_result.passed, f"{label}: {lse_result}"


@EXAMPLES
@given(
    variant=st.sampled_from(["func", "qkvpacked", "kvpacked"]),
    batch=st.integers(1, 3), sq=st.integers(1, 12), sk=st.integers(1, 12), hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]), d=st.sampled_from([4, 8, 16]),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float64]),
    use_alibi=st.booleans(), options=_options(), seed=st.integers(0, 2**16),
)
def test_dense_variants_match_flash_attn_semantics(variant, batch, sq, sk, hk, group, d, dtype, use_alibi, options,
                                                   seed):
    g = torch.Generator().manual_seed(seed)
    if variant == "qkvpacked":
        sk, group = sq, 1
    h = hk * group
    q, k, v = _rand(g, batch, sq, h, d, dtype=dtype), _rand(g, batch, sk, hk, d, dtype=dtype), \
        _rand(g, batch, sk, hk, d, dtype=dtype)
    alibi = torch.rand(batch, h, generator=g) if use_alibi else None
    if variant == "func":
        got = fa.flash_attn_func(q, k, v, 0.0, alibi_slopes=alibi, return_attn_probs=True, **options)
    elif variant == "qkvpacked":
        got = fa.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), alibi_slopes=alibi,
                                           return_attn_probs=True, **options)
    else:
        got = fa.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), alibi_slopes=alibi,
                                          return_attn_probs=True, **options)
    out, lse, probs = got
    assert probs is None
    assert lse.shape == (batch, h, sq) and lse.dtype == torch.float32
    assert out.shape == (batch, sq, h, d) and out.dtype == dtype
    ref, ref_lse, naive = _oracle_batch(q, k, v, alibi=alibi, **options)
    _check(out, lse, ref, ref_lse, naive, f"{variant} {options}")


@st.composite
def _varlen_problem(draw):
    batch = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    lens_k = draw(st.lists(st.integers(1, 9), min_size=batch, max_size=batch))
    return lens_q, lens_k


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@EXAMPLES
@given(
    variant=st.sampled_from(["varlen", "varlen_qkvpacked", "varlen_kvpacked"]), lengths=_varlen_problem(),
    hk=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]), d=st.sampled_from([8, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), use_alibi=st.booleans(), options=_options(),
    seed=st.integers(0, 2**16),
)
def test_varlen_variants_match_flash_attn_semantics(variant, lengths, hk, group, d, dtype, use_alibi, options, seed):
    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = lengths
    if variant == "varlen_qkvpacked":
        lens_k, group = [max(n, 1) for n in lens_q], 1
        lens_q = lens_k
    h = hk * group
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q = _rand(g, cu_q[-1], h, d, dtype=dtype)
    k, v = _rand(g, cu_k[-1], hk, d, dtype=dtype), _rand(g, cu_k[-1], hk, d, dtype=dtype)
    alibi = torch.rand(h, generator=g) if use_alibi else None
    tq, tk = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    mq, mk = max(lens_q), max(lens_k)
    if variant == "varlen":
        got = fa.flash_attn_varlen_func(q, k, v, tq, tk, mq, mk, alibi_slopes=alibi, return_attn_probs=True,
                                        **options)
    elif variant == "varlen_qkvpacked":
        got = fa.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], dim=1), tq, mq, alibi_slopes=alibi,
                                                  return_attn_probs=True, **options)
    else:
        got = fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], dim=1), tq, tk, mq, mk, alibi_slopes=alibi,
                                                 return_attn_probs=True, **options)
    out, lse, probs = got
    assert probs is None
    assert lse.shape == (h, cu_q[-1]) and lse.dtype == torch.float32
    ref, ref_lse, naive = _oracle_batch(q, k, v, cu_q, cu_k, alibi=alibi, **options)
    _check(out, lse, ref, ref_lse, naive, f"{variant} {lengths} {options}")


def test_defaults_and_positional_order_are_flash_attn_s():
    """Positional arguments land where flash-attn 2 puts them (dropout_p, softmax_scale, causal, ...)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 2, 8, generator=g) for _ in range(3))
    by_position = fa.flash_attn_func(q, k, v, 0.0, 0.5, True, (2, -1), 0.0, None, False, True)
    by_name = fa.flash_attn_func(q, k, v, softmax_scale=0.5, causal=True, window_size=(2, -1), return_attn_probs=True)
    torch.testing.assert_close(by_position[0], by_name[0], rtol=0, atol=0)
    plain = fa.flash_attn_func(q, k, v)
    assert isinstance(plain, torch.Tensor) and plain.shape == (2, 5, 2, 8)
    # causal with a positive right window: flash-attn forces right = 0, so does the compat layer
    torch.testing.assert_close(fa.flash_attn_func(q, k, v, causal=True, window_size=(-1, 3)),
                               fa.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    torch.testing.assert_close(fa.flash_attn_func(q, k, v, deterministic=True), plain)   # may pick another backend


def test_rows_without_keys_are_zero_with_lse_minus_inf():
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)   # bottom-right: rows 0..2 empty
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()


def test_packed_gradients_reach_the_packed_tensor():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 6, 3, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 6, 2, 8, generator=g, dtype=torch.float64)
    fa.flash_attn_qkvpacked_func(qkv, causal=True).backward(dout)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    fa.flash_attn_func(q, k, v, causal=True).backward(dout)
    expected = torch.stack([q.grad, k.grad, v.grad], dim=2)
    result = compare("dqkv", qkv.grad, expected, expected, factor=GRAD_FACTOR)
    assert result.passed, result


@pytest.mark.parametrize("call,match", [
    (lambda q: fa.flash_attn_func(q, q, q, dropout_p=0.1), "dropout_p"),
    (lambda q: fa.flash_attn_func(q, q, q, 0.5), "dropout_p"),
    (lambda q: fa.flash_attn_qkvpacked_func(q), "qkv"),
    (lambda q: fa.flash_attn_kvpacked_func(q, q), "kv"),
    (lambda q: fa.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                                         torch.tensor([0, 4], dtype=torch.int32), 4, 4,
                                         block_table=torch.zeros(1, 1, dtype=torch.int32)), "block_table"),
])
def test_unsupported_arguments_are_named(call, match):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=match):
        call(q)


@pytest.mark.parametrize("kw,match", [
    (dict(window_size=3), "window_size"),
    (dict(window_size=(1.5, -1)), r"window_size\[0\]"),
    (dict(softcap="big"), "softcap"),
    (dict(causal=1), "causal"),
])
def test_bad_argument_types_are_named(kw, match):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match=match):
        fa.flash_attn_func(q, q, q, **kw)


def test_compiles_fullgraph_without_recompiles():
    from torch._dynamo.utils import counters

    def block(q, k, v, cu, alibi):
        dense = fa.flash_attn_func(q, k, v, causal=True, window_size=(3, -1), softcap=2.0, alibi_slopes=alibi)
        packed = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 6, 6,
                                           causal=True)
        return dense + packed.unflatten(0, (2, 6))

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, 6, 2, 8, generator=g) for _ in range(3))
        alibi = torch.rand(2, generator=g)
        torch.testing.assert_close(compiled(q, k, v, cu, alibi), block(q, k, v, cu, alibi))
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_kvcache_function_is_served_from_the_compat_module():
    from portattn import kvcache

    assert fa.flash_attn_with_kvcache is kvcache.flash_attn_with_kvcache
    assert "flash_attn_with_kvcache" in fa.__all__
