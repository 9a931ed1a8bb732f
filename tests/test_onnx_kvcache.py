"""``portattn.FlashAttentionKVCache``: the KV-cache ONNX op alone, and a decoder exported with it.

* The op in onnxruntime (one-node models, IOBinding from torch memory) against the oracle of
  :mod:`portattn.conformance.kvcache` (per sequence: the cached keys concatenated with the new
  ones by hand, float64 reference) under the §3 rule, and the present caches exactly equal to the
  caches after the expected append. Cache slots no sequence may read are NaN.
* ``portattn.onnx.export`` of a 2-layer GQA decoder that calls
  :func:`portattn.kvcache.attention_with_kvcache` on static caches: exported once (dynamic batch,
  tokens, cache length), then prefill of right-padded prompts of different lengths and greedy
  steps in onnxruntime feeding the present caches back as past (in place through IOBinding, and
  by plain ``session.run``): the greedy tokens equal torch's eager generation, the logits pass
  §3 against the float64 model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from portattn.onnx_ops import DOMAIN, OP_NAME
from portattn.onnx_ops.model import function_protos, kv_attribute_values, kv_one_node_model
from portattn.onnx_ops.schema import KV_OP_NAME, PAGED_KV_OP_NAME

import portattn
import portattn.onnx
from portattn.conformance.kvcache import KVProblem, kv_catalogue, kv_problem_strategy, make_inputs, oracle
from portattn.kvcache import attention_with_kvcache
from portattn.numerics import compare, compare_lse

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.int32: 6, torch.int64: 7}
_NAMES = {torch.float32: "float", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_SESSIONS: dict = {}


def _session(dtype, attributes: dict, seqlens_dtype="int32", paged=False):
    key = (dtype, tuple(sorted(attributes.items())), seqlens_dtype, paged)
    if key not in _SESSIONS:
        model = kv_one_node_model(dtype=_NAMES[dtype], attributes=attributes, seqlens_dtype=seqlens_dtype,
                                  paged=paged)
        _SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return _SESSIONS[key]


def _bind(binding, inputs: dict, outputs: dict) -> None:
    for name, t in inputs.items():
        binding.bind_input(name, "cpu", 0, _TYPES[t.dtype], list(t.shape), t.data_ptr())
    for name, t in outputs.items():
        binding.bind_output(name, "cpu", 0, _TYPES[t.dtype], list(t.shape), t.data_ptr())


def run_op(p: KVProblem, inp: dict, *, block_size=16, in_place=False, seqlens=None):
    """Run the op on the tensors ``inp`` of problem ``p``: (out, lse, k_present, v_present).
    ``in_place``: the present caches are bound to the input caches' memory (then returned)."""
    q, kc, vc = inp["q"], inp["k_cache"], inp["v_cache"]
    k_new = inp["k"] if inp["k"] is not None else kc[:, :0].contiguous()
    v_new = inp["v"] if inp["v"] is not None else vc[:, :0].contiguous()
    lens = inp["cache_seqlens"] if seqlens is None else seqlens
    slopes = inp["alibi_slopes"]
    slopes = torch.zeros(1, 1) if slopes is None else slopes.expand(p.batch, p.heads_q).contiguous()
    window = p.window or (None, None)
    attrs = kv_attribute_values(scale=p.head_dim ** -0.5, causal=p.causal, alignment=p.alignment,
                                window_left=window[0], window_right=window[1], softcap=p.softcap,
                                block_size=block_size)
    table = inp["block_table"]
    session = _session(q.dtype, attrs, "int64" if lens.dtype == torch.int64 else "int32", paged=table is not None)
    out = torch.empty(p.batch, p.seqlen_q, p.heads_q, p.dv, dtype=q.dtype)
    lse = torch.empty(p.batch, p.heads_q, p.seqlen_q)
    kp, vp = (kc, vc) if in_place else (torch.empty_like(kc), torch.empty_like(vc))
    binding = session.io_binding()
    paging = {} if table is None else {"block_table": table}
    _bind(binding, dict(Q=q, K_cache=kc, V_cache=vc, K_new=k_new, V_new=v_new, cache_seqlens=lens, **paging,
                        alibi_slopes=slopes),
          dict(Y=out, K_present=kp, V_present=vp, LSE=lse))
    session.run_with_iobinding(binding)
    return out, lse, kp, vp


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN included."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def check_op(p: KVProblem, *, block_size=16, in_place=False):
    inp = make_inputs(p)
    before = {name: t.clone() for name, t in inp.items() if t is not None}
    ref, ref_lse, naive, k_after, v_after = oracle(p, inp)
    out, lse, kp, vp = run_op(p, inp, block_size=block_size, in_place=in_place)
    assert out.dtype == inp["q"].dtype and not torch.isnan(out).any()
    result = compare("out", out, ref, naive)
    assert result.passed, f"{p}: {result}"
    lse_result = compare_lse(lse, ref_lse)
    assert lse_result.passed, f"{p}: {lse_result}"
    assert _same(kp, k_after) and _same(vp, v_after), "present caches differ from the expected append"
    if not in_place:   # ONNX is functional: the past caches are untouched
        assert all(_same(inp[name], t) for name, t in before.items())
    return out, lse


def _contiguous(p: KVProblem) -> KVProblem:
    """The same problem with a contiguous cache of the same capacity (the op has no block table)."""
    return p if p.page_size is None else replace(p, page_size=None, capacity=p.cap)


CASES = {case_id: _contiguous(p) for case_id, p in kv_catalogue()}
PAGED = {case_id: p for case_id, p in kv_catalogue() if p.page_size is not None}


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_op_matches_oracle(case_id):
    """Every KV conformance case (cache lengths 0, 1 and full, Sq 1..16, GQA/MQA, new keys 0..16,
    NaN in unused slots, windows, softcap, ALiBi, Dv != D, three dtypes), paged ones contiguous."""
    check_op(CASES[case_id], block_size=16)


@pytest.mark.parametrize("case_id", sorted(PAGED))
def test_paged_op_matches_oracle(case_id):
    """``FlashAttentionPagedKVCache`` on the paged cases (pages of 16, 32 and 256, shuffled in a
    pool with spare pages, NaN in every slot no sequence owns)."""
    check_op(PAGED[case_id], block_size=16)


@pytest.mark.parametrize("block_size", [1, 7, 256])
def test_block_sizes_and_in_place_binding(block_size):
    """Blocks of one key, a size that divides nothing, one block for everything; the present
    caches bound to the past caches' memory give the same results (in-place decoding)."""
    p = KVProblem(lengths=(0, 1, 37, 61), seqlen_q=3, seqlen_new=3, heads_q=6, heads_kv=2, head_dim=16,
                  dtype="float32", capacity=64, seed=11)
    check_op(p, block_size=block_size)
    check_op(p, block_size=block_size, in_place=True)
    paged = replace(p, page_size=16, pages_per_seq=4, spare_pages=3)
    check_op(paged, block_size=block_size)
    check_op(paged, block_size=block_size, in_place=True)


def test_int64_lengths_and_nothing_appended():
    p = KVProblem(lengths=(9, 0), seqlen_q=2, seqlen_new=0, head_dim=16, dtype="float32", capacity=12, seed=3)
    inp = make_inputs(p)
    ref, ref_lse, naive, _, _ = oracle(p, inp)
    out, lse, kp, _ = run_op(p, inp, seqlens=inp["cache_seqlens"].long())
    assert compare("out", out, ref, naive).passed and compare_lse(lse, ref_lse).passed
    assert _same(kp, inp["k_cache"])
    # sequence 1 has no key at all: zeros and -inf, never NaN
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def test_lengths_out_of_range_are_clamped_not_read_out_of_bounds():
    """A caller error handled without reading or writing outside the cache: lengths < 0 count as
    0, and new keys that do not fit are dropped (the length is clamped to the capacity)."""
    p = KVProblem(lengths=(0, 6), seqlen_q=2, seqlen_new=2, head_dim=16, dtype="float32", capacity=8, seed=5,
                  causal=False)
    inp = make_inputs(p)
    inp["k_cache"][1] = torch.randn(8, p.heads_kv, 16)      # sequence 1: a full cache
    inp["v_cache"][1] = torch.randn(8, p.heads_kv, 16)
    bad = torch.tensor([-3, 8], dtype=torch.int32)
    out, lse, kp, vp = run_op(p, inp, seqlens=bad)
    assert torch.equal(kp[0, :2], inp["k"][0]) and torch.isnan(kp[0, 2:]).all()
    assert torch.equal(kp[1], inp["k_cache"][1]) and torch.equal(vp[1], inp["v_cache"][1])   # nothing fits
    good = dict(inp, cache_seqlens=torch.tensor([0, 6], dtype=torch.int32))
    good["k"], good["v"] = inp["k"].clone(), inp["v"].clone()
    good["k"][1], good["v"][1] = inp["k_cache"][1, 6:], inp["v_cache"][1, 6:]   # the same keys, "appended"
    ref, ref_lse, naive, _, _ = oracle(p, good)
    assert compare("out", out, ref, naive).passed and compare_lse(lse, ref_lse).passed


@pytest.mark.parametrize("batch,s_max,new,sq", [(0, 8, 1, 1), (2, 0, 0, 1), (2, 0, 2, 1), (2, 8, 2, 0)])
def test_empty_problems(batch, s_max, new, sq):
    """No sequence, no cache slot (new keys cannot be written) or no query: well-formed outputs,
    zeros with lse -inf where rows exist, the append still done (``session.run``: IOBinding
    refuses empty buffers)."""
    g = torch.Generator().manual_seed(batch * 100 + s_max * 10 + new + sq)
    t = lambda *shape: torch.randn(*shape, generator=g).numpy()
    feeds = dict(Q=t(batch, sq, 4, 16), K_cache=t(batch, s_max, 2, 16), V_cache=t(batch, s_max, 2, 16),
                 K_new=t(batch, new, 2, 16), V_new=t(batch, new, 2, 16),
                 cache_seqlens=torch.tensor([3] * batch, dtype=torch.int32).clamp(max=s_max).numpy(),
                 alibi_slopes=torch.zeros(1, 1).numpy())
    session = _session(torch.float32, kv_attribute_values(scale=0.25, causal=True, block_size=4))
    y, kp, vp, lse = (torch.from_numpy(a) for a in session.run(None, feeds))
    assert y.shape == (batch, sq, 4, 16) and kp.shape == (batch, s_max, 2, 16) and lse.shape == (batch, 4, sq)
    if s_max == 0:   # no key at all
        assert torch.equal(y, torch.zeros_like(y)) and torch.isneginf(lse).all()
    if sq == 0 and batch:   # no query, but the new keys are appended at slot 3
        assert torch.equal(kp[:, 3:3 + new], torch.from_numpy(feeds["K_new"]))


def test_property_op_matches_oracle():
    hyp = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    @hyp.settings(max_examples=20, deadline=None)
    @hyp.given(kv_problem_strategy(max_len=48), st.sampled_from([3, 16, 256]), st.booleans())
    def run(problem, block_size, contiguous):
        check_op(_contiguous(problem) if contiguous else problem, block_size=block_size)

    run()


def test_schema_and_functions():
    from portattn.onnx_ops import register_schema

    register_schema()
    for name in (OP_NAME, KV_OP_NAME, PAGED_KV_OP_NAME):
        assert onnx.defs.has(name, 1, DOMAIN), name
    protos = {f.name: f for f in function_protos(23, [OP_NAME, KV_OP_NAME, PAGED_KV_OP_NAME])}

    def calls(nodes):
        return [n.op_type for n in nodes if n.domain == DOMAIN]

    def loop_calls(name):
        loops = [n for n in protos[name].node if n.op_type == "Loop"]
        assert len(loops) == 1, name
        return calls(loops[0].attribute[0].g.node)

    # one key loop with one block step inside, called by the dense op and by the KV-cache attention
    assert loop_calls("FlashAttentionLoop") == ["FlashAttentionBlock"]
    assert "MatMul" not in [n.op_type for n in protos["FlashAttentionLoop"].node]
    assert calls(protos["KVCacheAttend"].node) == ["FlashAttentionLoop"]
    assert calls(protos[OP_NAME].node).count("FlashAttentionLoop") == 1
    for name in (OP_NAME, "KVCacheAttend"):
        assert not {"Loop", "MatMul"} & {n.op_type for n in protos[name].node}, name
    for name in (KV_OP_NAME, PAGED_KV_OP_NAME):   # both KV ops: the same append and attention
        assert calls(protos[name].node) == ["KVCacheSlots", "KVCacheWrite", "KVCacheWrite", "KVCacheBand",
                                            "KVCacheAttend"], name
    assert [n.op_type for n in protos["KVCacheWrite"].node].count("ScatterND") == 1


# ----- an exported decoder generating in onnxruntime ----------------------------------------------

VOCAB, DIM, HEADS, KV_HEADS, MAX_POS = 64, 32, 4, 2, 64


class KVLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.q = torch.nn.Linear(DIM, DIM)
        self.kv = torch.nn.Linear(DIM, 2 * KV_HEADS * self.head_dim)
        self.o = torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))

    def forward(self, x, lens, k_cache, v_cache, backend):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, HEADS, self.head_dim)
        k, v = self.kv(h).view(b, t, 2, KV_HEADS, self.head_dim).unbind(2)
        a = portattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                           backend=backend)
        x = x + self.o(a.reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


class KVDecoder(torch.nn.Module):
    """2 layers, GQA 4:2, learned positions, static caches (B, S_max, Hkv, D) updated in place;
    returns the logits and the (updated) caches."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(MAX_POS, DIM)
        self.layers = torch.nn.ModuleList(KVLayer() for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.backend = None

    def forward(self, tokens, lens, k0, v0, k1, v1):
        pos = lens.long().unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos.clamp(max=MAX_POS - 1))
        x = self.layers[0](x, lens, k0, v0, self.backend)
        x = self.layers[1](x, lens, k1, v1, self.backend)
        return self.head(x), k0, v0, k1, v1


def _caches(batch, s_max, dtype=torch.float32):
    return [torch.full((batch, s_max, KV_HEADS, DIM // HEADS), float("nan"), dtype=dtype) for _ in range(4)]


def _prompts(batch, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (batch,), generator=g)
    lengths[0] = 6
    tokens = torch.randint(0, VOCAB, (batch, int(lengths.max())), generator=g)
    return tokens, lengths.to(torch.int32)


def generate(step, tokens, prompt_lens, caches, steps):
    """Greedy decoding with ``step(tokens, lens, caches) -> logits`` (which updates ``caches``):
    prefill of the right-padded prompts at length 0, then one token per step at each sequence's
    own length. Returns the generated tokens (B, steps) and every step's logits of those rows."""
    batch = tokens.shape[0]
    logits = step(tokens, torch.zeros(batch, dtype=torch.int32), caches)
    last = logits[torch.arange(batch), prompt_lens.long() - 1]          # (B, V) each prompt's last row
    lens, out, seen = prompt_lens.clone(), [], [last]
    for _ in range(steps):
        nxt = last.argmax(-1)
        out.append(nxt)
        last = step(nxt.unsqueeze(1), lens, caches)[:, 0]
        lens = lens + 1
        seen.append(last)
    return torch.stack(out, 1), seen


def _torch_step(model):
    def step(tokens, lens, caches):
        with torch.no_grad():
            return model(tokens, lens, *caches)[0]
    return step


def _ort_step_in_place(session, dtype=torch.float32):
    """IOBinding: inputs and outputs bound to torch memory, present caches to the past buffers."""
    def step(tokens, lens, caches):
        logits = torch.empty(tokens.shape[0], tokens.shape[1], VOCAB, dtype=dtype)
        binding = session.io_binding()
        past = dict(zip(("k0", "v0", "k1", "v1"), caches))
        _bind(binding, dict(tokens=tokens.contiguous(), lens=lens.contiguous(), **past),
              dict(logits=logits, **{"present_" + n: t for n, t in past.items()}))
        session.run_with_iobinding(binding)
        return logits
    return step


def _ort_step_run(session):
    """Plain ``session.run``: the present caches come back as arrays and are fed as the next past."""
    def step(tokens, lens, caches):
        feeds = dict(tokens=tokens.numpy(), lens=lens.numpy(),
                     **{n: c.numpy() for n, c in zip(("k0", "v0", "k1", "v1"), caches)})
        logits, *present = session.run(None, feeds)
        for c, p in zip(caches, present):
            c.copy_(torch.from_numpy(p))
        return torch.from_numpy(logits)
    return step


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = KVDecoder().eval()
    path = tmp_path_factory.mktemp("kv") / "decoder.onnx"
    batch, seq, cache = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=MAX_POS), \
        torch.export.Dim("cache", max=4096)
    cache_dims = {0: batch, 1: cache}
    tokens, lens = _prompts(2, 0)
    proto = portattn.onnx.export(
        model, (tokens, torch.zeros(2, dtype=torch.int32), *_caches(2, 24)), path, block_size=8,
        dynamic_shapes={"tokens": {0: batch, 1: seq}, "lens": {0: batch},
                        "k0": cache_dims, "v0": cache_dims, "k1": cache_dims, "v1": cache_dims},
        output_names=["logits", "present_k0", "present_v0", "present_k1", "present_v1"])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return model, proto, session


def test_export_is_one_node_per_layer(exported):
    _, proto, session = exported
    nodes = [(n.domain, n.op_type) for n in proto.graph.node]
    assert nodes.count((DOMAIN, KV_OP_NAME)) == 2, nodes
    assert (DOMAIN, OP_NAME) not in nodes and ("", "Softmax") not in nodes
    assert not any(op in ("ScatterND", "ScatterElements", "Loop") for _, op in nodes)   # all inside the op
    assert [o.name for o in session.get_outputs()] == ["logits", "present_k0", "present_v0", "present_k1",
                                                       "present_v1"]
    cache_shape = session.get_inputs()[2].shape
    assert isinstance(cache_shape[0], str) and isinstance(cache_shape[1], str), cache_shape   # batch, S_max dynamic


@pytest.mark.parametrize("batch,s_max,seed", [(2, 24, 1), (3, 16, 2)])
def test_greedy_generation_matches_torch(exported, batch, s_max, seed):
    model, _, session = exported
    tokens, prompt_lens = _prompts(batch, seed)
    steps = s_max - int(prompt_lens.max()) - 1
    want, want_logits = generate(_torch_step(model), tokens, prompt_lens, _caches(batch, s_max), steps)
    # the float64 model, fed the same tokens (teacher-forced by the eager ones): §3 yardstick
    model.double()
    model.backend = "reference"
    try:
        forced = iter(want.T)
        ref_caches = _caches(batch, s_max, torch.float64)

        def ref_step(t, lens, caches):
            if t.shape[1] == 1:
                t = next(forced).unsqueeze(1)
            return _torch_step(model)(t, lens, caches)
        _, ref_logits = generate(ref_step, tokens, prompt_lens, ref_caches, steps)
    finally:
        model.float()
        model.backend = None
    for runner in (_ort_step_in_place(session), _ort_step_run(session)):
        got, got_logits = generate(runner, tokens, prompt_lens, _caches(batch, s_max), steps)
        assert torch.equal(got, want), f"onnxruntime tokens {got.tolist()} != torch {want.tolist()}"
        for i, (g, r, e) in enumerate(zip(got_logits, ref_logits, want_logits)):
            result = compare(f"logits step {i}", g, r, e)
            assert result.passed, result


def test_eager_call_is_unchanged_in_place():
    """Outside export the hook does nothing: the caches are written in place, as before."""
    p = KVProblem(lengths=(3, 0), seqlen_q=1, seqlen_new=1, head_dim=16, dtype="float32", capacity=8, seed=7)
    inp = make_inputs(p)
    _, _, _, k_after, v_after = oracle(p, inp)
    attention_with_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                           cache_seqlens=inp["cache_seqlens"], causal=True)
    assert _same(inp["k_cache"], k_after) and _same(inp["v_cache"], v_after)


@pytest.mark.parametrize("page_size", [None, 4])
def test_functional_torch_op_matches_in_place_call(page_size):
    from portattn.onnx_ops import kvcache_op  # noqa: F401  (registers the op)

    p = KVProblem(lengths=(5, 1), seqlen_q=2, seqlen_new=2, head_dim=16, dtype="float32", capacity=12, seed=9,
                  window=(3, 0), page_size=page_size, pages_per_seq=3)
    inp = make_inputs(p)
    kc, vc = inp["k_cache"].clone(), inp["v_cache"].clone()
    out, k2, v2, lse = torch.ops.portattn.attention_with_kvcache(
        inp["q"], kc, vc, inp["k"], inp["v"], inp["cache_seqlens"], inp["block_table"], None, 0.25, True,
        "bottom_right", 3, 0, 0.0, "")
    assert _same(kc, inp["k_cache"]) and _same(vc, inp["v_cache"])     # inputs untouched
    want, want_lse = attention_with_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                                            cache_seqlens=inp["cache_seqlens"], block_table=inp["block_table"],
                                            causal=True, window=(3, 0), scale=0.25, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert _same(k2, inp["k_cache"]) and _same(v2, inp["v_cache"])


class _Features(torch.nn.Module):
    def __init__(self, p: KVProblem):
        super().__init__()
        self.kw = dict(p.kwargs(), return_lse=True)
        self.append, self.paged = p.seqlen_new > 0, p.page_size is not None

    def forward(self, q, k_cache, v_cache, k, v, lens, slopes, table):
        if not self.append:   # nothing new: the translation passes empty K_new/V_new
            k = v = None
        out, lse = portattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, alibi_slopes=slopes,
                                                   block_table=table if self.paged else None, **self.kw)
        return out, lse, k_cache, v_cache


@pytest.mark.parametrize("p", [
    KVProblem(lengths=(0, 1, 11), seqlen_q=3, seqlen_new=3, heads_q=6, heads_kv=3, head_dim=16, head_dim_v=8,
              capacity=14, window=(4, 0), softcap=3.0, alibi=True, dtype="float32", seed=21),
    KVProblem(lengths=(7, 2), seqlen_q=2, seqlen_new=1, head_dim=16, capacity=9, causal=False, alignment="top_left",
              window=(2, 1), alibi=True, dtype="float16", seed=22),
    KVProblem(lengths=(5, 0), seqlen_q=2, seqlen_new=0, head_dim=16, capacity=8, dtype="float32", seed=23),
    KVProblem(lengths=(20, 3, 0), seqlen_q=2, seqlen_new=2, head_dim=16, page_size=8, pages_per_seq=3,
              dtype="float32", seed=24),
    KVProblem(lengths=(9, 1), seqlen_q=1, seqlen_new=0, head_dim=16, page_size=4, pages_per_seq=3, spare_pages=3,
              alibi=True, dtype="float32", seed=25),
], ids=["window-softcap-alibi-dv8", "top-left-band-fp16", "no-append", "paged", "paged-no-append-alibi"])
def test_exported_call_with_features_and_lse(p, tmp_path):
    """The translation passes every attribute and input through: out, lse and present caches of
    one exported call against the oracle (paged calls become FlashAttentionPagedKVCache)."""
    inp = make_inputs(p)
    k, v = (inp["k"], inp["v"]) if p.seqlen_new else (inp["q"][:, :1, :p.heads_kv], inp["q"][:, :1, :p.heads_kv])
    slopes = inp["alibi_slopes"] if p.alibi else torch.zeros(p.heads_q)
    table = inp["block_table"] if p.page_size else torch.zeros(p.batch, 1, dtype=torch.int32)
    args = (inp["q"], inp["k_cache"].clone(), inp["v_cache"].clone(), k, v, inp["cache_seqlens"], slopes, table)
    path = tmp_path / "call.onnx"
    proto = portattn.onnx.export(_Features(p).eval(), args, path, block_size=4)
    op_name = KV_OP_NAME if p.page_size is None else PAGED_KV_OP_NAME
    assert [(n.domain, n.op_type) for n in proto.graph.node].count((DOMAIN, op_name)) == 1
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    named = dict(zip(("q", "k_cache", "v_cache", "k", "v", "lens", "slopes", "table"), args))
    feeds = {i.name: named[i.name].numpy() for i in session.get_inputs()}   # unused inputs may be dropped
    out, lse, kp, vp = (torch.from_numpy(a) for a in session.run(None, feeds))
    ref, ref_lse, naive, k_after, v_after = oracle(p, inp)
    assert compare("out", out, ref, naive).passed and compare_lse(lse, ref_lse).passed
    assert _same(kp, k_after) and _same(vp, v_after)


class _OneCall(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k_cache, v_cache, lens):
        return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, **self.kw)


def _one_call_args():
    return torch.randn(2, 1, 4, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8), torch.tensor([3, 9], dtype=torch.int32)


def test_standard_target_is_refused_by_name():
    with pytest.raises(portattn.onnx.UnsupportedFeatureError, match="attention_with_kvcache"):
        portattn.onnx.export(_OneCall(causal=True).eval(), _one_call_args(), None, target="standard")


def test_caches_updated_but_not_returned_warn(tmp_path):
    class NoReturn(_OneCall):
        def forward(self, q, k_cache, v_cache, lens):
            k = v = q[:, :, :2]
            return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)

    with pytest.warns(UserWarning, match="'k_cache', 'v_cache'.*return the updated caches"):
        portattn.onnx.export(NoReturn().eval(), _one_call_args(), None)
