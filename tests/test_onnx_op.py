"""The portattn ONNX op (``portattn.FlashAttention``) through the ``onnx`` backend (onnxruntime CPU).

Every numeric check is the §3 rule (:func:`portattn.numerics.compare`) against the float64
reference, with the naive in-dtype math as yardstick.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from hypothesis import given
from hypothesis import strategies as st
from portattn.backends.onnx import OnnxBackend

from portattn.numerics import compare, compare_lse
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec


def _backend(block_size=256):
    be = OnnxBackend()
    be.block_size = block_size
    return be


def _check(spec, backend):
    assert backend.not_supported_reasons(spec) == []
    out, lse = backend.forward(spec)
    ref, ref_lse = reference_forward(spec)
    naive, _ = naive_forward(spec)
    assert out.dtype == spec.dtype and out.shape == spec.out_shape
    result = compare("out", out, ref, naive)
    assert result.passed, f"{spec.summary()}: {result}"
    lse_result = compare_lse(lse, ref_lse)
    assert lse_result.passed, f"{spec.summary()}: {lse_result}"
    return out, lse


@st.composite
def problems(draw):
    """Small attention problems covering every feature of the op."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    b = draw(st.integers(1, 2))
    sq = draw(st.integers(1, 19))
    sk = draw(st.integers(1, 41))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([8, 16, 32]))
    dv = draw(st.sampled_from([d, 8]))
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, dv, generator=g).to(dtype)
    kw = {}
    kw["causal"] = draw(st.booleans())
    kw["causal_alignment"] = draw(st.sampled_from(["bottom_right", "top_left"]))
    if draw(st.booleans()):
        left = draw(st.one_of(st.none(), st.integers(0, 12)))
        right = None if kw["causal"] else draw(st.one_of(st.none(), st.integers(0, 12)))
        kw["window"] = (left, right)
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 8.0))
    if draw(st.booleans()):
        kw["alibi_slopes"] = torch.rand(*draw(st.sampled_from([(hq,), (b, hq)])), generator=g)
    bias_kind = draw(st.sampled_from([None, "float", "bool"]))
    if bias_kind is not None:
        shape = draw(st.sampled_from([(b, hq, sq, sk), (b, 1, 1, sk), (1, hq, sq, 1), (sq, sk)]))
        if bias_kind == "float":
            kw["attn_bias"] = torch.randn(*shape, generator=g).to(draw(st.sampled_from([torch.float32, dtype])))
        else:
            kw["attn_bias"] = torch.rand(*shape, generator=g) > 0.3
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.05, 1.0))
    block = draw(st.sampled_from([4, 16, 256]))
    return build_spec(q, k, v, **kw), block


@given(problems())
def test_op_matches_reference(problem):
    spec, block = problem
    _check(spec, _backend(block))


def test_fully_masked_rows_are_zero_with_neg_inf_lse():
    # bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key; a bool mask empties one more row
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 9, 2, 8, generator=g), torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 4, 2, 8, generator=g)
    mask = torch.ones(1, 1, 9, 4, dtype=torch.bool)
    mask[..., 7, :] = False
    spec = build_spec(q, k, v, causal=True, attn_bias=mask)
    out, lse = _check(spec, _backend(2))
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5])) and torch.equal(out[:, 7], torch.zeros_like(out[:, 7]))
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isneginf(lse[:, :, 7]).all()
    assert torch.isfinite(lse[:, :, 5]).all() and not torch.isnan(out).any()


def test_no_keys():
    q, k, v = torch.randn(2, 3, 2, 8), torch.randn(2, 0, 1, 8), torch.randn(2, 0, 1, 8)
    out, lse = _backend().forward(build_spec(q, k, v))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_sessions_are_cached_per_configuration_with_dynamic_shapes():
    be = _backend(8)
    g = torch.Generator().manual_seed(1)
    for b, sq, sk in ((1, 5, 9), (3, 17, 40), (2, 1, 3)):
        q, k, v = (torch.randn(b, s, 2, 16, generator=g) for s in (sq, sk, sk))
        _check(build_spec(q, k, v, causal=True), be)
    assert len(be._sessions) == 1
    q = torch.randn(1, 4, 2, 16, generator=g)
    _check(build_spec(q, q, q, causal=False), be)
    assert len(be._sessions) == 2


def test_through_portattn_attention():
    import portattn

    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 11, 4, 16, generator=g), torch.randn(2, 13, 2, 16, generator=g), torch.randn(2, 13, 2, 16, generator=g)
    out, lse = portattn.attention(q, k, v, causal=True, softcap=3.0, return_lse=True, backend="onnx")
    spec = build_spec(q, k, v, causal=True, softcap=3.0)
    ref, ref_lse = reference_forward(spec)
    assert compare("out", out, ref, naive_forward(spec)[0]).passed
    assert compare_lse(lse, ref_lse).passed


def test_reasons_name_what_is_missing():
    be = OnnxBackend()
    q = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert any("varlen" in r for r in be.not_supported_reasons(build_spec(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)))
    x = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    assert any("float64" in r for r in be.not_supported_reasons(build_spec(x, x, x)))
    y = torch.randn(1, 4, 2, 8, requires_grad=True)
    assert any("backward" in r for r in be.not_supported_reasons(build_spec(y, y, y)))


def test_function_body_is_a_loop_and_model_checks():
    import onnx
    from portattn.onnx_ops import DOMAIN, OP_NAME, register_schema
    from portattn.onnx_ops.model import attribute_values, function_proto, one_node_model

    register_schema()
    assert register_schema() is False            # idempotent
    assert onnx.defs.has(OP_NAME, 1, DOMAIN)
    body = function_proto(23)
    assert [n.op_type for n in body.node if n.domain == DOMAIN].count("FlashAttentionLoop") == 1
    assert not {"Loop", "MatMul"} & {n.op_type for n in body.node}
    loop = function_proto(23, "FlashAttentionLoop")   # the key loop, shared with the KV-cache ops
    assert [n.op_type for n in loop.node].count("Loop") == 1
    assert "MatMul" not in [n.op_type for n in loop.node]   # every MatMul is inside the loop over key blocks
    model = one_node_model(dtype="float16", bias_dtype="float", attributes=attribute_values(scale=0.5, causal=True))
    onnx.checker.check_model(model, full_check=True)
    assert [(n.domain, n.op_type) for n in model.graph.node] == [(DOMAIN, OP_NAME)]


def test_backend_imports_without_onnx():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('onnx', 'onnxruntime', 'onnxscript', 'onnx_ir'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import portattn
        from portattn.backends.onnx import OnnxBackend
        reasons = OnnxBackend().availability()
        assert reasons and 'pip install portattn[onnx]' in reasons[0], reasons
        assert 'onnx' not in sys.modules and 'onnxruntime' not in sys.modules
        print('ok')
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_export_bytes_do_not_depend_on_the_hash_seed():
    """The same model in the same bytes from every process: onnxscript orders Loop-carried values
    and If outputs by set iteration (PYTHONHASHSEED); model._canonical puts them in name order.
    Seeds 1, 2 and 3 gave three different FlashAttention bodies before it."""
    code = textwrap.dedent("""
        import hashlib
        from portattn.onnx_ops.model import (attribute_values, kv_attribute_values, kv_one_node_model,
                                             one_node_model)
        ms = [one_node_model(dtype="float", bias_dtype="float", attributes=attribute_values(scale=0.5, causal=True)),
              kv_one_node_model(dtype="float16", attributes=kv_attribute_values(scale=0.3), paged=True)]
        print(" ".join(hashlib.sha256(m.SerializeToString()).hexdigest() for m in ms))
    """)
    digests = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        digests.add(result.stdout.strip())
    assert len(digests) == 1, digests


@pytest.mark.parametrize("opset", [18, 23])
def test_packed_heads_and_opsets(opset):
    """3-D (B, S, H·D) inputs with q_num_heads/kv_num_heads, in models of opset 18 and 23."""
    import numpy as np
    import onnxruntime as ort
    from portattn.onnx_ops.model import attribute_values, one_node_model

    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 7, 2, 8, generator=g), torch.randn(2, 7, 2, 6, generator=g)
    spec = build_spec(q, k, v, causal=True)
    attributes = {**attribute_values(scale=spec.scale, causal=True, block_size=3), "q_num_heads": 4, "kv_num_heads": 2}
    model = one_node_model(dtype="float", bias_dtype="float", attributes=attributes, opset=opset, packed_heads=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, lse = session.run(None, dict(Q=q.reshape(2, 5, 32).numpy(), K=k.reshape(2, 7, 16).numpy(),
                                    V=v.reshape(2, 7, 12).numpy(), bias=np.zeros((1, 1, 1, 1), np.float32),
                                    mask=np.ones((1, 1, 1, 1), np.bool_), alibi_slopes=np.zeros((1, 1), np.float32)))
    ref, ref_lse = reference_forward(spec)
    assert compare("out", torch.from_numpy(y), ref, naive_forward(spec)[0]).passed
    assert compare_lse(torch.from_numpy(lse), ref_lse).passed
