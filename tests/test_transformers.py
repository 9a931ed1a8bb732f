"""transformers models with ``attn_implementation="portattn"`` against ``"eager"``.

Tiny configs with random weights (no download): Llama, Qwen2 (GQA), Mistral (sliding window
shorter than the prompt), Gemma 2 (softcap, alternating sliding/full layers, query_pre_attn_scalar)
and GPT-2, on a batch whose first row is left-padded. Under the equivalence rule
(docs/semantics.md), with eager attention in float64 as the reference and eager in the test dtype
as the yardstick: logits at the non-padded positions, one training step's gradients (factor 3),
and greedy ``generate()`` with a DynamicCache and a StaticCache (same tokens; a divergence is
accepted only where the reference itself has a tie within the rule). Plus: which portattn
arguments the layers use (key-padding mask + bottom-right causal + window, not a dense mask),
the mask function read as the attention function reads it equals transformers' own mask (caches
with offsets, static caches, padding), packed sequences and a BERT encoder (dense-mask paths),
``torch.compile(fullgraph=True)`` without graph breaks or recompiles, ``route_sdpa`` on an
``attn_implementation="sdpa"`` model, and that ``import portattn`` does not import transformers.

On a GPU (skipped here) the same model checks run on cuda with the triton backend in bfloat16
and float32: ``pytest tests/test_transformers.py -k cuda``.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import portattn  # noqa: E402
import portattn.integrations.transformers as hf  # noqa: E402
from portattn.numerics import GRAD_FACTOR, compare  # noqa: E402

hf.register()

VOCAB, SEQ, PAD = 128, 10, 3
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False)


def _config(name: str):
    if name == "llama":
        return transformers.LlamaConfig(**COMMON, num_key_value_heads=4)
    if name == "qwen2":
        return transformers.Qwen2Config(**COMMON, num_key_value_heads=2)
    if name == "mistral":
        return transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=4)
    if name == "gemma2":
        return transformers.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                                         query_pre_attn_scalar=12)
    if name == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                       attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    raise ValueError(name)


MODELS = ["llama", "qwen2", "mistral", "gemma2", "gpt2"]
CUDA_CASES = [pytest.param(d, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))
              for d in (torch.float32, torch.bfloat16)]


def _build(name, implementation, dtype, device, state=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(_config(name)), attn_implementation=implementation)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


class Trio:
    """The model with portattn attention, eager in the same dtype (yardstick), eager float64 (reference)."""

    def __init__(self, name, dtype=torch.float32, device="cpu"):
        self.name, self.dtype, self.device = name, dtype, device
        self.portattn = _build(name, "portattn", dtype, device)
        state = self.portattn.state_dict()
        self.naive = _build(name, "eager", dtype, device, state)
        self.ref = _build(name, "eager", torch.float64, device, state)


def _batch(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :PAD] = 0                        # left padding on the first row
    return ids.to(device), mask.to(device)


@pytest.fixture(scope="module", params=MODELS)
def trio(request):
    return Trio(request.param)


@contextlib.contextmanager
def _finite_eager_mask(model):
    """For the float64 eager reference: transformers' eager mask is ``finfo(float64).min``, which the
    layers' float32 softmax turns into -inf, so left-padded (fully masked) rows become NaN and the NaN
    reaches every later position through V. The float32 minimum masks identically (exp underflows to
    0) and stays finite."""
    from transformers import masking_utils as mu

    mapping = mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    original = mapping["eager"]
    if model.dtype == torch.float64:
        mapping["eager"] = lambda *args, **kw: original(*args, **{**kw, "dtype": torch.float32})
    try:
        yield
    finally:
        mapping["eager"] = original


def _logits(model, ids, mask):
    with torch.no_grad(), _finite_eager_mask(model):
        return model(input_ids=ids, attention_mask=mask).logits


def check_logits(t: Trio):
    ids, mask = _batch(t.device)
    keep = mask.bool()
    out, naive, ref = (_logits(m, ids, mask)[keep] for m in (t.portattn, t.naive, t.ref))
    result = compare("logits", out, ref, naive)
    assert result.passed, f"{t.name} {t.dtype}: {result}"


def check_training_step(t: Trio):
    ids, mask = _batch(t.device, seed=1)
    # the loss predicts token i + 1 from position i: position PAD - 1 of the padded row is a padded
    # query (no visible key: 0 in portattn, a uniform average in eager), so its target is ignored too
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :PAD + 1] = -100
    grads = {}
    for label, model in (("portattn", t.portattn), ("naive", t.naive), ("ref", t.ref)):
        model.train()
        model.zero_grad(set_to_none=True)
        with _finite_eager_mask(model):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads[label] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        model.eval()
    assert grads["portattn"].keys() == grads["ref"].keys() and grads["ref"]
    failed = []
    for n, g in grads["portattn"].items():
        result = compare(n, g, grads["ref"][n], grads["naive"][n], factor=GRAD_FACTOR)
        if not result.passed:
            failed.append(str(result))
    assert not failed, f"{t.name} {t.dtype}: " + "\n".join(failed)


def _greedy(model, ids, mask, cache):
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **kw)


def check_generate(t: Trio, cache: str):
    ids, mask = _batch(t.device, seed=2)
    got, expected = _greedy(t.portattn, ids, mask, cache), _greedy(t.naive, ids, mask, cache)
    assert got.shape == expected.shape
    for row in range(got.shape[0]):
        diff = (got[row] != expected[row]).nonzero()
        if not len(diff):
            continue
        # the first divergence must be a tie under the rule: the reference cannot tell the tokens apart
        step = int(diff[0])
        prefix = got[row:row + 1, :step]
        prefix_mask = torch.cat([mask[row:row + 1], mask.new_ones(1, step - SEQ)], dim=1)
        last = [_logits(m, prefix, prefix_mask)[0, -1] for m in (t.portattn, t.naive, t.ref)]
        tolerance = compare("logits", last[0], last[2], last[1]).tolerance
        a, b = int(got[row, step]), int(expected[row, step])
        gap = abs(float(last[2][a] - last[2][b]))
        assert gap <= 2 * tolerance, (f"{t.name} {cache}: row {row} step {step}: portattn picked {a}, eager {b}; "
                                      f"reference logit gap {gap:.3g} > tie tolerance {2 * tolerance:.3g}")


# ----- CPU ----------------------------------------------------------------------------------------

def test_logits_match_eager(trio):
    check_logits(trio)


def test_training_step_gradients_match_eager(trio):
    check_training_step(trio)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_matches_eager(trio, cache):
    check_generate(trio, cache)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_pinned_backends_give_the_same_logits(backend):
    t = Trio("qwen2")
    ids, mask = _batch()
    keep = mask.bool()
    with portattn.use_backend(backend):
        out = _logits(t.portattn, ids, mask)[keep]
    result = compare("logits", out, _logits(t.ref, ids, mask)[keep], _logits(t.naive, ids, mask)[keep])
    assert result.passed, f"{backend}: {result}"


def _recorded_calls(model, **inputs):
    calls = []
    original = hf.attention

    def spy(q, k, v, **kw):
        bias = kw.get("attn_bias")
        calls.append(dict(causal=kw["causal"], window=kw["window"], softcap=kw["softcap"], scale=kw["scale"],
                          bias=None if bias is None else (bias.dtype, tuple(bias.shape)),
                          heads=(q.shape[1], k.shape[1])))
        return original(q, k, v, **kw)

    hf.attention = spy
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hf.attention = original
    return calls


def test_layers_get_portattn_arguments_not_a_dense_mask():
    """Padding travels as a (B, 1, 1, S) key mask; causal, windows, softcap, scale and GQA as arguments."""
    t = Trio("gemma2")
    ids, mask = _batch()
    calls = _recorded_calls(t.portattn, input_ids=ids, attention_mask=mask)
    cfg = t.portattn.config
    assert len(calls) == cfg.num_hidden_layers
    windows = [c["window"] for c in calls]
    expected_windows = [(cfg.sliding_window - 1, None) if kind == "sliding_attention" else None
                        for kind in cfg.layer_types]
    assert windows == expected_windows and None in windows and len(set(windows)) == 2
    for c in calls:
        assert c["causal"] is True and c["bias"] == (torch.bool, (2, 1, 1, SEQ))
        assert c["softcap"] == 2.0 and c["scale"] == pytest.approx(12 ** -0.5) and c["heads"] == (4, 2)
    # no padding: no mask at all
    assert all(c["bias"] is None for c in _recorded_calls(t.portattn, input_ids=ids, attention_mask=torch.ones_like(mask)))


def _implied_mask(returned, q_length, kv_length, window):
    """The (B, 1, Sq, Sk) mask attention_forward computes from what the mask function returned
    (causal layer, transformers' sliding window ``window`` or None)."""
    if returned is not None and not (returned.shape[-2] == 1 and q_length > 1):
        return returned.expand(2, 1, q_length, kv_length)              # dense: used as it is
    i = torch.arange(q_length).view(-1, 1) + kv_length - q_length      # bottom-right aligned rows
    j = torch.arange(kv_length).view(1, -1)
    keep = j <= i
    if window:
        keep &= j >= i - (window - 1)
    keep = keep.view(1, 1, q_length, kv_length)
    return (keep if returned is None else keep & returned).expand(2, 1, q_length, kv_length)


@pytest.mark.parametrize("case", [
    dict(q=6, kv=6),                                  # prefill, no cache
    dict(q=1, kv=9, q_offset=8),                      # decoding, DynamicCache
    dict(q=3, kv=9, q_offset=6),                      # chunked prefill into a DynamicCache
    dict(q=1, kv=4, q_offset=8, kv_offset=5, window=4),       # sliding-window cache: kept keys only
    dict(q=3, kv=6, q_offset=6, kv_offset=3, window=4),
    dict(q=6, kv=6, window=3),
    dict(q=4, kv=10),                                 # StaticCache prefill: keys past the queries
    dict(q=1, kv=10, q_offset=4, tensor_offset=True),         # StaticCache decoding
    dict(q=6, kv=6, mask_len=4),                      # keys beyond the 2-D mask count as padding
])
@pytest.mark.parametrize("padded", [False, True])
def test_mask_function_means_what_transformers_means(case, padded):
    """Whatever the portattn mask function returns, read the way attention_forward reads it, is
    transformers' own dense mask (masking_utils.sdpa_mask) for the same arguments."""
    from transformers import masking_utils as mu

    q_length, kv_length, window = case["q"], case["kv"], case.get("window")
    q_offset, kv_offset = case.get("q_offset", 0), case.get("kv_offset", 0)
    length = case.get("mask_len", kv_offset + kv_length)
    mask2d = torch.ones(2, length, dtype=torch.bool)
    if padded:
        mask2d[0, :2] = False
    fn = mu.sliding_window_causal_mask_function(window) if window else mu.causal_mask_function
    args = dict(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                mask_function=fn, attention_mask=mask2d, local_size=window)
    expected = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    if case.get("tensor_offset"):
        args["q_offset"] = torch.tensor(q_offset)
    returned = hf.attention_mask(**args)
    assert torch.equal(_implied_mask(returned, q_length, kv_length, window),
                       expected.expand(2, 1, q_length, kv_length)), returned
    aligned = q_offset + q_length == kv_offset + kv_length and not case.get("tensor_offset")
    padding_seen = not torch.nn.functional.pad(mask2d, (0, 16))[:, kv_offset:kv_offset + kv_length].all()
    if aligned and not padding_seen:
        assert returned is None                    # the structured case builds nothing
    if aligned and padding_seen and q_length > 1:
        assert returned.shape == (2, 1, 1, kv_length)     # a key mask, not (Sq, Sk)


def test_static_cache_decoding_uses_the_dense_mask():
    """A StaticCache holds keys past the current position: bottom-right alignment does not hold, so
    the dense mask is passed (and causal is off)."""
    t = Trio("llama")
    ids, mask = _batch()
    cache = transformers.StaticCache(config=t.portattn.config, max_cache_len=SEQ + 4)
    calls = _recorded_calls(t.portattn, input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert all(c["causal"] is False and c["bias"] == (torch.bool, (2, 1, SEQ, SEQ + 4)) for c in calls)


def test_switching_back_to_eager_is_one_line():
    t = Trio("qwen2")
    ids, mask = _batch()
    switched = copy.deepcopy(t.portattn)
    switched.set_attn_implementation("eager")
    torch.testing.assert_close(_logits(switched, ids, mask), _logits(t.naive, ids, mask), rtol=0, atol=0)


def test_route_sdpa_sends_an_sdpa_model_to_portattn():
    from portattn.compat.sdpa import route_sdpa

    t = Trio("llama")
    sdpa_model = _build("llama", "sdpa", torch.float32, "cpu", t.portattn.state_dict())
    ids, mask = _batch()
    with route_sdpa() as stats:
        out = _logits(sdpa_model, ids, mask)
    assert stats.routed == t.portattn.config.num_hidden_layers and stats.fell_back == 0, stats
    keep = mask.bool()
    result = compare("logits", out[keep], _logits(t.ref, ids, mask)[keep], _logits(t.naive, ids, mask)[keep])
    assert result.passed, result


def test_packed_sequences_use_the_dense_mask():
    """Two sequences packed in one row (position_ids restart, no attention mask): transformers'
    packed-sequence mask is block-diagonal causal, which portattn receives as a dense mask."""
    t = Trio("llama")
    ids = _batch()[0][:1]
    positions = torch.cat([torch.arange(4), torch.arange(SEQ - 4)]).view(1, -1)
    with torch.no_grad():
        # no cache: transformers looks for packed sequences only then
        out, naive = (m(input_ids=ids, position_ids=positions, use_cache=False).logits for m in (t.portattn, t.naive))
        with _finite_eager_mask(t.ref):
            ref = t.ref(input_ids=ids, position_ids=positions, use_cache=False).logits
        # the same positions with a 2-D mask: no packed-sequence detection, one causal sequence
        unpacked = t.ref(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids),
                         use_cache=False).logits
    result = compare("logits", out, ref, naive)
    assert result.passed, result
    assert not torch.allclose(ref[:, 4:].float(), unpacked[:, 4:].float(), atol=1e-3)   # the packing matters
    calls = _recorded_calls(t.portattn, input_ids=ids, position_ids=positions, use_cache=False)
    assert all(c["causal"] is False and c["bias"] == (torch.bool, (1, 1, SEQ, SEQ)) for c in calls)


def test_bidirectional_encoder_with_padding():
    """BERT: non-causal layers, right padding (the dense bidirectional mask)."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    models = {}
    for label, impl, dtype in (("portattn", "portattn", torch.float32), ("naive", "eager", torch.float32),
                               ("ref", "eager", torch.float64)):
        model = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation=impl)
        if models:
            model.load_state_dict(models["portattn"].state_dict())
        models[label] = model.to(dtype).eval()
    ids, mask = _batch()
    mask = mask.flip(-1)                          # right padding
    with torch.no_grad():
        out, naive, ref = (m(input_ids=ids, attention_mask=mask).last_hidden_state for m in models.values())
    keep = mask.bool()
    result = compare("hidden", out[keep], ref[keep], naive[keep])
    assert result.passed, result


def test_dropout_is_refused_by_name():
    cfg = _config("llama")
    cfg.attention_dropout = 0.1
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="portattn").train()
    ids, mask = _batch()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("name", ["llama", "gemma2"])      # key-mask path; softcap + dense sliding masks
def test_compile_fullgraph_no_graph_break_no_recompile(name):
    from torch._dynamo.utils import counters

    t = Trio(name)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(t.portattn, fullgraph=True, backend="aot_eager")
    for seed in range(3):       # same shapes, new values: one graph
        ids, mask = _batch(seed=seed)
        with torch.no_grad():
            out = compiled(input_ids=ids, attention_mask=mask).logits
        keep = mask.bool()
        result = compare("logits", out[keep], _logits(t.ref, ids, mask)[keep], _logits(t.naive, ids, mask)[keep])
        assert result.passed, f"compiled, seed {seed}: {result}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_import_portattn_does_not_import_transformers():
    code = "import sys, portattn, portattn.compat.flash_attn, portattn.compat.sdpa, portattn.integrations; " \
           "print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----- GPU: the same checks with the triton backend on cuda -----------------------------------------

@pytest.mark.parametrize("dtype", CUDA_CASES)
@pytest.mark.parametrize("name", MODELS)
def test_cuda_triton_models_match_eager(name, dtype):
    t = Trio(name, dtype=dtype, device="cuda")
    with portattn.use_backend("triton"):
        check_logits(t)
        check_training_step(t)
        check_generate(t, "dynamic")
        check_generate(t, "static")
