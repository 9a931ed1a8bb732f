"""``portattn.onnx.export``: one fused node per attention call, run by onnxruntime, both targets.

The decoder-only transformer (2 layers, GQA 4:1, causal, key padding mask) is exported with a
dynamic batch and sequence length and run at two shapes; its onnxruntime output is held to the
§3 rule against the same model in float64 (reference attention), with the model in float32 using
naive attention math as yardstick. A transformers Llama built with
``attn_implementation="portattn"`` exports with one fused node per layer, its padding mask kept as
a (B, 1, 1, S) key mask with bottom-right causal, and runs in onnxruntime within the rule.
"""

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from portattn.onnx_ops import DOMAIN, OP_NAME

import portattn
import portattn.onnx
from portattn.numerics import compare, compare_lse
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec

ATTENTION_NODES = {(DOMAIN, OP_NAME), ("", "Attention")}


def _attention(q, k, v, mode, **kw):
    """``portattn.attention``, or the naive in-dtype math (the §3 yardstick) when mode == "naive"."""
    if mode == "naive":
        return naive_forward(build_spec(q, k, v, **kw))[0]
    return portattn.attention(q, k, v, backend=mode, **kw)


class DecoderLayer(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x, pad_bias, mode):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        a = _attention(q, k, v, mode, causal=True, attn_bias=pad_bias)
        x = x + self.o(a.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(torch.nn.Module):
    """2 layers, 8 query heads over 2 key/value heads (GQA 4:1), causal, key padding mask."""

    def __init__(self, vocab=50, dim=64, heads=8, kv_heads=2, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(DecoderLayer(dim, heads, kv_heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)
        self.mode = None   # None: portattn dispatch; "reference"; "naive"

    def forward(self, tokens, keep):
        x = self.embed(tokens)
        pad_bias = keep[:, None, None, :]          # (B, 1, 1, S), True = keep
        for layer in self.layers:
            x = layer(x, pad_bias, self.mode)
        return self.head(x)


def _inputs(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (batch, seq), generator=g)
    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep[0, seq - 3:] = False                      # right padding: every query still sees a key
    return tokens, keep


def _top_level_matmuls_are_projections(model):
    """Every MatMul/Gemm outside the attention nodes multiplies by a weight (an initializer)."""
    weights = {t.name for t in model.graph.initializer}
    weights |= {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm", "Einsum") and not any(i in weights for i in node.input):
            return False
    return True


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    return TinyDecoder().eval()


@pytest.mark.parametrize("target", ["portattn", "standard"])
def test_decoder_export(decoder, target, tmp_path):
    path = tmp_path / f"decoder_{target}.onnx"
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=4096)
    tokens, keep = _inputs(2, 9, 0)
    model = portattn.onnx.export(decoder, (tokens, keep), path, target=target,
                                 dynamic_shapes={"tokens": {0: batch, 1: seq}, "keep": {0: batch, 1: seq}})
    nodes = [(n.domain, n.op_type) for n in model.graph.node]
    assert sum(n in ATTENTION_NODES for n in nodes) == 2, nodes
    assert ("" , "Softmax") not in nodes
    assert _top_level_matmuls_are_projections(model)
    onnx.checker.check_model(onnx.load(path), full_check=True)

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, s, seed in ((2, 9, 1), (3, 16, 2)):
        tokens, keep = _inputs(b, s, seed)
        out = torch.from_numpy(session.run(None, {"tokens": tokens.numpy(), "keep": keep.numpy()})[0])
        with torch.no_grad():
            decoder.mode = "reference"
            ref = decoder.double()(tokens, keep)
            decoder.float()
            decoder.mode = "naive"
            naive = decoder(tokens, keep)
            decoder.mode = None
        result = compare("logits", out, ref, naive)
        assert result.passed, f"{target} B={b} S={s}: {result}"


class CrossAttention(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v, bias):
        return portattn.attention(q, k, v, attn_bias=bias, **self.kw)


@pytest.mark.parametrize("target,kw", [
    ("standard", dict(causal=True)),                                   # bottom-right, Sq != Sk: explicit mask
    ("standard", dict(window=(3, 1), causal_alignment="top_left")),
    ("standard", dict(causal=True, softcap=2.0)),
    ("portattn", dict(causal=True, window=(4, None), softcap=2.0)),
])
def test_unequal_lengths_and_features(target, kw, tmp_path):
    g = torch.Generator().manual_seed(3)

    def make(b, sq, sk):
        return (torch.randn(b, sq, 4, 16, generator=g), torch.randn(b, sk, 2, 16, generator=g),
                torch.randn(b, sk, 2, 16, generator=g), torch.randn(b, 1, 1, sk, generator=g))

    module = CrossAttention(**kw)
    b, sq, sk = torch.export.Dim("b"), torch.export.Dim("sq"), torch.export.Dim("sk")
    dyn = {"q": {0: b, 1: sq}, "k": {0: b, 1: sk}, "v": {0: b, 1: sk}, "bias": {0: b, 3: sk}}
    path = tmp_path / "cross.onnx"
    portattn.onnx.export(module, make(2, 5, 11), path, target=target, dynamic_shapes=dyn)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in ((2, 5, 11), (1, 12, 7)):
        q, k, v, bias = make(*shape)
        out = torch.from_numpy(session.run(None, dict(q=q.numpy(), k=k.numpy(), v=v.numpy(), bias=bias.numpy()))[0])
        spec = build_spec(q, k, v, attn_bias=bias, **kw)
        result = compare("out", out, reference_forward(spec)[0], naive_forward(spec)[0])
        assert result.passed, f"{target} {kw} {shape}: {result}"
        if kw.get("causal") and shape[1] > shape[2]:      # bottom-right: the first Sq - Sk rows see no key
            assert torch.equal(out[:, :shape[1] - shape[2]], torch.zeros_like(out[:, :shape[1] - shape[2]]))


def test_portattn_target_every_feature(tmp_path):
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 6, 4, 8, generator=g), torch.randn(2, 9, 1, 8, generator=g), torch.randn(2, 9, 1, 4, generator=g)
    slopes, bias = torch.rand(4, generator=g), torch.randn(2, 4, 6, 9, generator=g, dtype=torch.float64)  # cast in-graph

    class Everything(torch.nn.Module):
        def forward(self, q, k, v, slopes, bias):
            out, lse = portattn.attention(q, k, v, window=(5, 2), softcap=4.0, alibi_slopes=slopes, attn_bias=bias,
                                          causal_alignment="top_left", return_lse=True)
            return out, lse

    path = tmp_path / "every.onnx"
    model = portattn.onnx.export(Everything(), (q, k, v, slopes, bias), path)
    assert [(n.domain, n.op_type) for n in model.graph.node].count((DOMAIN, OP_NAME)) == 1
    out, lse = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, dict(q=q.numpy(), k=k.numpy(), v=v.numpy(), slopes=slopes.numpy(), bias=bias.numpy()))
    spec = build_spec(q, k, v, window=(5, 2), softcap=4.0, alibi_slopes=slopes, attn_bias=bias, causal_alignment="top_left")
    ref, ref_lse = reference_forward(spec)
    assert compare("out", torch.from_numpy(out), ref, naive_forward(spec)[0]).passed
    assert compare_lse(torch.from_numpy(lse), ref_lse).passed


@pytest.mark.parametrize("target,kw,feature", [
    ("standard", dict(alibi_slopes=torch.rand(4)), "alibi"),
    ("standard", dict(return_lse=True), "return_lse"),
])
def test_unsupported_features_are_named(target, kw, feature, tmp_path):
    q = torch.randn(1, 5, 4, 8)

    class M(torch.nn.Module):
        def forward(self, q):
            out = portattn.attention(q, q, q, **kw)
            return out[0] if isinstance(out, tuple) else out

    with pytest.raises(portattn.onnx.UnsupportedFeatureError, match=feature):
        portattn.onnx.export(M(), (q,), tmp_path / "x.onnx", target=target)


def test_varlen_is_refused(tmp_path):
    q = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)

    class M(torch.nn.Module):
        def forward(self, q, cu):
            return portattn.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)

    with pytest.raises(ValueError, match="varlen"):
        portattn.onnx.export(M(), (q, cu), tmp_path / "v.onnx")


def test_unknown_target():
    with pytest.raises(ValueError, match="target"):
        portattn.onnx.export(torch.nn.Identity(), (torch.randn(1),), None, target="tensorrt")


# ----- a transformers model built with attn_implementation="portattn" ------------------------------

class _CausalLM(torch.nn.Module):
    """input_ids + 2-D padding mask -> logits. Positions come from the mask (left padding), and as a
    (B, S) tensor: onnxscript's rotary-embedding fusion mis-sizes a (1, S) position input for B > 1."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                          use_cache=False).logits


def _hf_inputs(batch, seq, seed, pad):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :pad] = 0                                  # left padding
    return ids, mask


def _producer(model, name):
    return next((n for n in model.graph.node if name in n.output), None)


def test_transformers_llama_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    import copy

    from portattn.integrations.transformers import register

    register()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    built = {impl: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
             for impl in ("portattn", "eager")}
    built["eager"].load_state_dict(built["portattn"].state_dict())
    lm, eager = _CausalLM(built["portattn"]).eval(), _CausalLM(built["eager"]).eval()
    reference = copy.deepcopy(lm).double()

    path = tmp_path / "llama.onnx"
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=64)
    model = portattn.onnx.export(lm, _hf_inputs(2, 10, 0, pad=3), path,
                                 dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})
    nodes = [(n.domain, n.op_type) for n in model.graph.node]
    fused = [n for n in model.graph.node if (n.domain, n.op_type) == (DOMAIN, OP_NAME)]
    assert len(fused) == cfg.num_hidden_layers, nodes
    assert ("", "Softmax") not in nodes
    assert _top_level_matmuls_are_projections(model)
    for node in fused:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["causal"] == 1 and attrs["alignment"] == 0 and attrs["window_left"] == -1   # bottom-right
        # the mask input is the padding mask itself, unsqueezed to (B, 1, 1, S): no (S, S) mask is built
        unsqueeze = _producer(model, node.input[4])
        assert unsqueeze is not None and unsqueeze.op_type == "Unsqueeze", unsqueeze
        axes = _producer(model, unsqueeze.input[1])
        axes = (onnx.numpy_helper.to_array(axes.attribute[0].t) if axes is not None else
                next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == unsqueeze.input[1]))
        assert axes.tolist() == [1, 2]
        cast = _producer(model, unsqueeze.input[0])
        assert cast.op_type == "Cast" and cast.input[0] == "attention_mask"

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, s, seed, pad in ((2, 10, 1, 3), (3, 7, 2, 2)):
        ids, mask = _hf_inputs(b, s, seed, pad)
        out = torch.from_numpy(session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0])
        keep = mask.bool()                  # padded query rows see no key: compared nowhere
        with torch.no_grad(), portattn.use_backend("reference"):
            ref = reference(ids, mask)
        with torch.no_grad():
            naive = eager(ids, mask)
        result = compare("logits", out[keep], ref[keep], naive[keep])
        assert result.passed, f"B={b} S={s}: {result}"
