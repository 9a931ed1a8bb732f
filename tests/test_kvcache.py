"""attention_with_kvcache / flash_attn_with_kvcache semantics on CPU tensors.

The oracle (portattn.conformance.kvcache.oracle) concatenates each sequence's cached keys with
the new ones by hand and runs the dense float64 reference, so it shares no code with the
gather/append path under test. Unused cache slots and pages are NaN; pages are shuffled. The
triton backend runs its kernels under Triton's interpreter (tiny sizes).
"""

from __future__ import annotations

import pytest
import torch

import portattn
from portattn import kvcache
from portattn.conformance.kvcache import KVProblem, check_kvcache, kv_catalogue, kv_problem_strategy, make_inputs
from portattn.errors import BackendNotAvailableError
from portattn.registry import Backend, register_backend, unregister_backend

CATALOGUE = dict(kv_catalogue())


def _ok(results):
    bad = [r for r in results if not r.passed]
    assert not bad, "\n".join(map(str, results))


# ----- semantics against the oracle ---------------------------------------------------------

@pytest.mark.parametrize("case_id", sorted(CATALOGUE))
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_catalogue_generic_backends(case_id, backend):
    problem = CATALOGUE[case_id]
    if backend == "sdpa" and problem.softcap is not None:
        pytest.skip("sdpa has no softcap (declined with a reason: test_pinned_backend_that_cannot_run)")
    _ok(check_kvcache(problem, backend))


TRITON_CASES = ["kvcache/contig/lengths-0-1-full/new1", "kvcache/page16/lengths-0-1-full/new3",
                "kvcache/page256/lengths-0-1-full/new0", "kvcache/page16/sq4-spec/gqa4", "kvcache/sq16/gqa8/causal",
                "kvcache/sq3/top-left", "kvcache/window/left8", "kvcache/softcap/5", "kvcache/alibi/causal",
                "kvcache/headdim/d40-dv24", "kvcache/batch4/mixed", "kvcache/sq8-gt-keys/causal",
                "kvcache/window/band-no-causal"]


@pytest.mark.parametrize("case_id", TRITON_CASES)
def test_catalogue_triton_interpreter(case_id):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test (CPU tensors); tests/test_kvcache_gpu.py covers the GPU")
    _ok(check_kvcache(CATALOGUE[case_id], "triton"))


def test_catalogue_covers_the_issue_cases():
    probs = list(CATALOGUE.values())
    assert {p.page_size for p in probs} >= {None, 16, 256}
    for p in probs:   # NaN sits in unused slots of every case; lengths 0, 1 and full appear
        assert p.cap > 0
    assert any(0 in p.lengths and 1 in p.lengths and p.cap - p.seqlen_new in p.lengths for p in probs)
    assert any(p.seqlen_new > 0 for p in probs) and any(p.seqlen_new == 0 for p in probs)


def test_nan_in_unused_slots_is_what_the_inputs_hold():
    inp = make_inputs(KVProblem(lengths=(3, 0), capacity=8, seqlen_new=1))
    assert torch.isnan(inp["k_cache"][0, 3:]).all() and not torch.isnan(inp["k_cache"][0, :3]).any()
    assert torch.isnan(inp["v_cache"][1]).all()


def test_property_generic_path_matches_oracle():
    hyp = pytest.importorskip("hypothesis")

    @hyp.settings(max_examples=20)
    @hyp.given(kv_problem_strategy(max_len=64))
    def run(problem):
        backend = "reference" if problem.softcap is not None else "sdpa"
        _ok(check_kvcache(problem, backend))

    run()


# ----- the in-place append -------------------------------------------------------------------

def test_append_writes_only_the_new_positions():
    p = KVProblem(lengths=(2, 5), seqlen_new=3, capacity=12, page_size=4, pages_per_seq=3)
    inp = make_inputs(p)
    before = inp["k_cache"].clone()
    kvcache.attention_with_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                                   cache_seqlens=inp["cache_seqlens"], block_table=inp["block_table"],
                                   backend="reference")
    table = inp["block_table"]
    for b, n in enumerate(p.lengths):
        for t in range(3):
            pos = n + t
            torch.testing.assert_close(inp["k_cache"][table[b, pos // 4], pos % 4], inp["k"][b, t], rtol=0, atol=0)
    changed = ~(torch.isnan(before) & torch.isnan(inp["k_cache"])) & (before != inp["k_cache"])
    assert int(changed.any(-1).any(-1).sum()) == 6          # exactly B x Sk_new rows changed


def test_append_beyond_capacity_is_dropped_without_out_of_bounds_writes():
    """A length past the capacity (unchecked on GPUs) writes only what fits and clamps L."""
    q = torch.randn(2, 1, 2, 16)
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    k, v = torch.ones(2, 3, 1, 16), torch.full((2, 3, 1, 16), 2.0)
    k[:, :, :, 0] = torch.arange(3.0).view(1, 3, 1)
    seqlens = torch.tensor([2, 9], dtype=torch.int32)
    kv = kvcache.KVCacheSpec(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens, k_new=k, v_new=v, scale=0.25)
    kvcache.append_kv(kv)
    assert kc[0, 2, 0, 0] == 0 and kc[0, 3, 0, 0] == 1 and (kc[0, :2] == 0).all()   # positions 2, 3 written
    assert (kc[1] == 0).all() and (vc[1] == 0).all()                                 # no room: nothing written
    assert kvcache.lengths(kv).tolist() == [4, 4]


# ----- validation ------------------------------------------------------------------------------

def _args():
    q = torch.randn(2, 1, 4, 16)
    return q, torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)


@pytest.mark.parametrize("mutate, kind, words", [
    (lambda a: a.update(q=a["q"][0]), ValueError, ["q must be 4-D", "unsqueeze(1)"]),
    (lambda a: a.update(k_cache=a["k_cache"].half()), TypeError, ["k_cache", "float16"]),
    (lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), ValueError, ["batch size 2", "block_table"]),
    (lambda a: a.update(k_cache=torch.randn(2, 8, 3, 16), v_cache=torch.randn(2, 8, 3, 16)), ValueError, ["multiple"]),
    (lambda a: a.update(v_cache=torch.randn(2, 7, 2, 16)), ValueError, ["k_cache and v_cache"]),
    (lambda a: a.update(k=torch.randn(2, 1, 2, 16)), ValueError, ["both k and v"]),
    (lambda a: a.update(k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16)), ValueError, ["give cache_seqlens"]),
    (lambda a: a.update(cache_seqlens=torch.zeros(2, dtype=torch.int64)), ValueError, ["int32", "cast"]),
    (lambda a: a.update(cache_seqlens=torch.tensor([1, 9], dtype=torch.int32)), ValueError, ["[0, 8]", "[1, 9]"]),
    (lambda a: a.update(cache_seqlens=9), ValueError, ["cache_seqlens=9"]),
    (lambda a: a.update(block_table=torch.zeros(2, 1, dtype=torch.int64)), ValueError, ["block_table", "int32"]),
    (lambda a: a.update(block_table=torch.tensor([[0], [5]], dtype=torch.int32), cache_seqlens=3), ValueError,
     ["page ids outside [0, 2)"]),
    (lambda a: a.update(window=(2,)), TypeError, ["window"]),
    (lambda a: a.update(causal=True, window=(2, 3)), ValueError, ["causal=True"]),
    (lambda a: a.update(alibi_slopes=torch.ones(3)), ValueError, ["alibi_slopes", "(4,)"]),
    (lambda a: a.update(scale=-1.0), ValueError, ["scale"]),
    (lambda a: a.update(causal_alignment="middle"), ValueError, ["causal_alignment"]),
])
def test_bad_arguments_are_named(mutate, kind, words):
    q, kc, vc = _args()
    a = dict(q=q, k_cache=kc, v_cache=vc)
    mutate(a)
    with pytest.raises(kind) as err:
        kvcache.attention_with_kvcache(**a)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_empty_problems_give_zeros_and_minus_inf():
    q = torch.randn(2, 3, 4, 16)
    kc = torch.full((2, 0, 2, 16), float("nan"))
    out, lse = kvcache.attention_with_kvcache(q, kc, kc.clone(), return_lse=True)
    assert out.shape == (2, 3, 4, 16) and (out == 0).all() and torch.isneginf(lse).all()
    q0 = torch.randn(2, 0, 4, 16)
    out, lse = kvcache.attention_with_kvcache(q0, torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16), return_lse=True)
    assert out.shape == (2, 0, 4, 16) and lse.shape == (2, 4, 0)


def test_fully_masked_rows_are_zero_not_nan():
    """Sq > L with bottom-right causal: the first rows see no key."""
    p = KVProblem(lengths=(0, 2), seqlen_q=6, seqlen_new=1, capacity=8, dtype="float32")
    inp = make_inputs(p)
    out, lse = kvcache.attention_with_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                                              cache_seqlens=inp["cache_seqlens"], causal=True, return_lse=True,
                                              backend="sdpa")
    assert (out[0, :5] == 0).all() and torch.isneginf(lse[0, :, :5]).all() and torch.isfinite(lse[0, :, 5]).all()
    assert not torch.isnan(out).any()


# ----- backend selection ---------------------------------------------------------------------

class _NoMask(Backend):
    name = "kv_nomask"
    features = frozenset({"causal", "gqa"})          # no bool_mask: the generic path cannot use it

    def forward(self, spec):
        raise AssertionError("must not run")


class _Native(Backend):
    name = "kv_native"
    calls: list = []

    def kvcache_reasons(self, kv):
        return [] if kv.seqlen_q == 1 else ["only Sq = 1"]

    def forward_kvcache(self, kv):
        self.calls.append(kv)
        return (torch.full(kv.out_shape, 3.0, dtype=kv.dtype),
                torch.zeros(kv.lse_shape, dtype=torch.float32))


@pytest.fixture
def extra_backends():
    register_backend(_NoMask)
    register_backend(_Native)
    yield
    unregister_backend("kv_nomask")
    unregister_backend("kv_native")


def test_pinned_backend_that_cannot_run(extra_backends):
    q, kc, vc = _args()
    with pytest.raises(BackendNotAvailableError) as err:
        kvcache.attention_with_kvcache(q, kc, vc, backend="kv_nomask")
    assert "pinned by backend=" in str(err.value) and "bool_mask" in str(err.value)
    assert err.value.reasons["kv_nomask"][0].startswith("generic KV-cache path")
    with pytest.raises(BackendNotAvailableError, match="softcap"):
        kvcache.attention_with_kvcache(q, kc, vc, softcap=2.0, backend="sdpa")


def test_native_protocol_and_every_pinning_route(extra_backends, monkeypatch):
    q, kc, vc = _args()
    assert (kvcache.attention_with_kvcache(q, kc, vc, backend="kv_native") == 3).all()
    assert isinstance(_Native.calls[-1], kvcache.KVCacheSpec)
    with portattn.use_backend("kv_native"):
        assert (kvcache.attention_with_kvcache(q, kc, vc) == 3).all()
        with pytest.raises(BackendNotAvailableError, match="only Sq = 1"):
            kvcache.attention_with_kvcache(torch.randn(2, 2, 4, 16), kc, vc)
    monkeypatch.setenv("PORTATTN_BACKEND", "kv_native")
    assert (kvcache.attention_with_kvcache(q, kc, vc) == 3).all()
    monkeypatch.setenv("PORTATTN_BACKEND", "kv_nomask,reference")
    exp = kvcache.explain_kvcache(q, kc, vc)
    assert exp.selected == "reference" and exp.pinned_by == "PORTATTN_BACKEND"
    monkeypatch.delenv("PORTATTN_BACKEND")
    exp = kvcache.explain_kvcache(q, kc, vc)
    assert exp.selected == portattn.dispatch.priority_for("cpu")[0]
    assert "kvcache B=2 Sq=1 cache 8" in str(exp)


# ----- flash-attn's signature ------------------------------------------------------------------

def test_flash_attn_with_kvcache_signature_and_results():
    import inspect
    params = list(inspect.signature(kvcache.flash_attn_with_kvcache).parameters)
    assert params == ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                      "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size",
                      "softcap", "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse"]
    p = KVProblem(lengths=(6, 2), seqlen_q=2, seqlen_new=2, capacity=16, dtype="float32", causal=True, window=(4, 0))
    inp = make_inputs(p)
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    want, want_lse = kvcache.attention_with_kvcache(ref["q"], ref["k_cache"], ref["v_cache"], ref["k"], ref["v"],
                                                    cache_seqlens=ref["cache_seqlens"], causal=True, window=(4, 0),
                                                    return_lse=True, backend="reference")
    got, lse = kvcache.flash_attn_with_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                                               cache_seqlens=inp["cache_seqlens"], causal=True, window_size=(4, -1),
                                               softcap=0.0, return_softmax_lse=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(inp["k_cache"], ref["k_cache"], equal_nan=True)


def test_flash_attn_cache_batch_idx_reads_and_writes_the_selected_rows():
    q = torch.randn(2, 1, 2, 16)
    kc, vc = torch.randn(3, 8, 1, 16), torch.randn(3, 8, 1, 16)
    k, v = torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    out = kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, cache_batch_idx=idx, causal=True)
    assert torch.equal(kc[2, 3], k[0, 0]) and torch.equal(kc[0, 5], k[1, 0]) and torch.equal(kc[1], kc2[1])
    want = kvcache.attention_with_kvcache(q, kc2[[2, 0]], vc2[[2, 0]], k, v, cache_seqlens=seqlens, causal=True)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("kw, word", [(dict(rotary_cos=torch.ones(1)), "rotary"),
                                      (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), "cache_leftpad"),
                                      (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), "int32")])
def test_flash_attn_unsupported_arguments(kw, word):
    q, kc, vc = _args()
    with pytest.raises(ValueError, match=word):
        kvcache.flash_attn_with_kvcache(q, kc, vc, **kw)


# ----- the triton split-KV kernels (interpreter) ---------------------------------------------

def _triton_cpu():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test (CPU tensors)")
    from portattn.backends.triton import decode
    return decode


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("paged", [False, True])
def test_triton_every_split_count_matches(splits, paged):
    """Forced split counts (flash-attn's num_splits) through both cache layouts: the combine of
    partials, empty splits (7 chunks of 16 keys over ≤ 61 keys) and a split boundary inside the
    causal band all agree with the oracle."""
    decode = _triton_cpu()
    layout = dict(page_size=16, pages_per_seq=4) if paged else dict(capacity=64)
    p = KVProblem(lengths=(40, 0, 61), seqlen_q=3, seqlen_new=3, heads_q=4, heads_kv=2, dtype="bfloat16", **layout)
    inp = make_inputs(p)
    kv = kvcache.build_kvcache_spec(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                                    cache_seqlens=inp["cache_seqlens"], block_table=inp["block_table"],
                                    causal=True, num_splits=splits)
    assert decode.plan_summary(kv)["num_splits"] == splits
    from portattn.conformance.kvcache import oracle
    from portattn.numerics import compare, compare_lse
    ref, ref_lse, naive, k_after, _ = oracle(p, inp)
    out, lse = kvcache.run_kvcache(kv, "triton")
    _ok([compare("out", out, ref, naive), compare_lse(lse, ref_lse)])
    assert torch.equal(torch.isnan(inp["k_cache"]), torch.isnan(k_after))


def test_triton_is_selected_natively_with_no_reasons():
    _triton_cpu()
    inp = make_inputs(CATALOGUE["kvcache/page16/sq4-spec/gqa4"])
    exp = kvcache.explain_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                                  cache_seqlens=inp["cache_seqlens"], block_table=inp["block_table"], backend="triton")
    assert exp.selected == "triton" and exp.reasons["triton"] == []
    strided = inp["k_cache"].transpose(-1, -2).contiguous().transpose(-1, -2)
    exp = kvcache.explain_kvcache(inp["q"], strided, inp["v_cache"], cache_seqlens=inp["cache_seqlens"],
                                  block_table=inp["block_table"], backend="triton")
    assert exp.selected is None and "not contiguous" in exp.reasons["triton"][0]


def test_split_heuristic():
    _triton_cpu()
    from portattn.backends.triton.decode import MAX_SPLITS, SPLIT_EFFICIENCY, num_splits_for
    assert num_splits_for(264, 4096, 132, 2) == 1              # the batch fills the GPU
    assert num_splits_for(4, 2, 132, 2) == 1                   # too few key tiles
    for units, blocks in ((4, 2048), (32, 2048), (4, 128), (8, 40), (1, 100000)):
        s = num_splits_for(units, blocks, 132, 2)
        assert 1 < s <= min(MAX_SPLITS, blocks // 2)
        def eff(n, units=units):   # wave efficiency over 132 SMs x 2 programs, the documented criterion
            waves = units * n / 264
            return waves / -(-waves // 1)
        allowed = range(1, min(MAX_SPLITS, blocks // 2) + 1)
        best = max(map(eff, allowed))
        assert eff(s) >= SPLIT_EFFICIENCY * best and all(eff(n) < SPLIT_EFFICIENCY * best
                                                         for n in range(1, s)), (units, blocks, s)
    assert num_splits_for(32, 2048, 132, 2) * 32 >= 0.8 * 264  # B 8 x Hkv 4 at 128k: fills the slots
    # batch 1, 4 KV heads, 128k keys: most of the 264 slots (132 for 64-row tiles)
    assert num_splits_for(4, 2048, 132, 2) * 4 >= SPLIT_EFFICIENCY * 264
    assert num_splits_for(4, 2048, 132, 1) * 4 >= SPLIT_EFFICIENCY * 132


def test_a_config_override_caps_the_tile_height():
    """tools/decode_sweep.py's block_m candidates: an override's block_m caps the packed rows
    (GQA 4 x Sq 8 = 32 rows -> two row blocks of 16) and the result still matches the oracle."""
    decode = _triton_cpu()
    from portattn.backends.triton.configs import KernelConfig

    from portattn.conformance.kvcache import oracle
    from portattn.numerics import compare, compare_lse
    p = KVProblem(lengths=(40, 61), seqlen_q=8, seqlen_new=0, heads_q=8, heads_kv=2, dtype="bfloat16", capacity=64)
    inp = make_inputs(p)
    kv = kvcache.build_kvcache_spec(inp["q"], inp["k_cache"], inp["v_cache"], cache_seqlens=inp["cache_seqlens"],
                                    causal=True, num_splits=2)
    cfg = KernelConfig(16, 32, 4, 1)
    plan = decode.plan_summary(kv, cfg)
    assert (plan["block_m"], plan["m_blocks"], plan["num_splits"]) == (16, 2, 2)
    assert decode.plan_summary(kv, KernelConfig(64, 32, 4, 1))["m_blocks"] == 1
    ref, ref_lse, naive, _, _ = oracle(p, inp)
    out, lse = decode.forward(kv, cfg)
    _ok([compare("out", out, ref, naive), compare_lse(lse, ref_lse)])
    with pytest.raises(ValueError, match="block_m must be 16, 32 or 64"):
        decode.plan_summary(kv, KernelConfig(48, 32, 4, 1))


def test_wide_decode_tiles_take_the_measured_row_where_one_exists():
    """64-row packed tiles (Sq 8 at GQA 8): hopper D128 2-byte takes _DECODE_WIDE_NVIDIA's row;
    other heads, float32 and sm_80 keep the rule (8 warps, BLOCK_N <= 64, one stage less)."""
    from portattn.backends.triton import configs
    hopper, ampere = configs.Target("nvidia", 90), configs.Target("nvidia", 80)
    m, n, w, s = configs._DECODE_WIDE_NVIDIA["hopper"][128]
    assert configs.decode_config(hopper, 128, 2, 64) == configs.KernelConfig(min(64, m), n, w, s)
    assert configs.decode_config(hopper, 128, 2, 32) == configs.KernelConfig(32, *configs._DECODE_NVIDIA["hopper"][128])
    for target, block_d in ((hopper, 64), (ampere, 128)):
        cfg = configs.decode_config(target, block_d, 2, 64)
        assert (cfg.block_m, cfg.num_warps) == (64, 8) and cfg.block_n <= 64
    assert configs.decode_config(hopper, 128, 4, 64).block_m == 16


def test_portability_set_covers_every_decode_config():
    """Each decode config configs.decode_config can return (at tile height >= 32, which heights
    16 and 32 share) is compiled by the full portability set, for every target."""
    pytest.importorskip("triton")
    from portattn.backends.triton import configs, portability
    compiled = {(c.kernel, str(c.target), c.config) for c in portability.cases()}
    for target, _ in configs.PORTABILITY_TARGETS:
        for block_d in configs.PADDED_DIMS:
            for elem in (2, 4):
                for block_m in configs.DECODE_BLOCK_MS:
                    cfg = configs.decode_config(target, block_d, elem, max(32, block_m))
                    assert ("decode_split", str(target), cfg) in compiled, (target, block_d, elem, block_m)
                    assert cfg.block_n >= 16 and cfg.block_m >= 16
        kernels = {k for k, t, _ in compiled if t == str(target)}
        assert {"decode_combine", "decode_append"} <= kernels
    assert portability.decode_cases(smoke=True) == []


def test_conformance_cli_runs_the_kvcache_cases(tmp_path, capsys):
    import json

    from portattn.conformance.cli import main
    out = tmp_path / "rows.json"
    assert main(["conformance", "kvcache", "--backends", "reference", "--devices", "cpu", "--cases",
                 "batch4,page256/lengths-0-1-full/new1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(r["verdict"] == "pass" for r in rows)
    assert "2 pass, 0 fail" in capsys.readouterr().out


def test_property_triton_interpreter_matches_oracle():
    """A few drawn problems through the split-KV kernels (interpreter: kept small)."""
    hyp = pytest.importorskip("hypothesis")
    _triton_cpu()

    @hyp.settings(max_examples=6)
    @hyp.given(kv_problem_strategy(max_len=48))
    def run(problem):
        _ok(check_kvcache(problem, "triton"))

    run()


def _same(a, b):
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("case", ["contig-beyond-capacity", "paged-top-left-unread", "two-row-blocks"])
def test_triton_append_in_the_split_kernel_matches_the_separate_launch(case, monkeypatch):
    """decode.FOLD_APPEND (the split kernel's programs write the new rows they read; program
    (split 0, row block 0) writes them all) leaves the same cache and gives the same bits as the
    separate append launch: rows past the capacity dropped, new rows that no query sees (top-left
    causal) written all the same, several row blocks and splits reading the new rows."""
    decode = _triton_cpu()
    if case == "contig-beyond-capacity":   # lengths unchecked as on a GPU: 30 + 3 > 32, 40 > 32
        p = KVProblem(lengths=(5, 0, 0), seqlen_new=3, capacity=32, dtype="bfloat16")
        inp = make_inputs(p)
        inp["cache_seqlens"] = torch.tensor([5, 30, 40], dtype=torch.int32)
        for name in ("k_cache", "v_cache"):      # finite keys where sequences 1 and 2 now read
            inp[name][1:] = torch.randn(inp[name][1:].shape).to(inp[name].dtype)
        kw = dict(num_splits=3)
    elif case == "paged-top-left-unread":
        p = KVProblem(lengths=(20, 3), seqlen_q=2, seqlen_new=4, page_size=8, pages_per_seq=4, dtype="float16",
                      alignment="top_left")
        inp = make_inputs(p)
        kw = dict(num_splits=2)
    else:                                   # GQA 16 x Sq 8 = 128 packed rows: two row blocks of 64
        p = KVProblem(lengths=(50, 7), seqlen_q=8, seqlen_new=2, heads_q=16, heads_kv=1, capacity=64,
                      dtype="bfloat16")
        inp = make_inputs(p)
        kw = dict(num_splits=3)
    results = {}
    for fold in (False, True):
        monkeypatch.setattr(decode, "FOLD_APPEND", fold)
        t = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
        kv = kvcache.KVCacheSpec(q=t["q"], k_cache=t["k_cache"], v_cache=t["v_cache"], cache_seqlens=t["cache_seqlens"],
                                 k_new=t["k"], v_new=t["v"], block_table=t["block_table"], scale=0.125, causal=True,
                                 alignment=p.alignment, window_right=0, **kw)
        if case == "two-row-blocks":
            assert decode.plan_summary(kv)["m_blocks"] == 2
        out, lse = decode.forward(kv)
        assert decode._launch_plan(kv).fold == fold
        results[fold] = (out, lse, t["k_cache"], t["v_cache"])
    for a, b in zip(results[False], results[True]):
        assert _same(a, b)
    assert not torch.isnan(results[True][0]).any()
    kc = results[True][2]
    assert not _same(kc, inp["k_cache"])   # the append did write
    if case == "contig-beyond-capacity":   # 30 + 2 fit, the third is dropped; 40 has no room
        assert torch.equal(kc[1, 30:], inp["k"][1, :2]) and torch.equal(kc[2], inp["k_cache"][2])


def test_triton_launches_per_call_and_the_cached_plan(monkeypatch):
    """One launch (split) with one split, two (split + combine) with more, the append folded in;
    every argument passed positionally (the count is the kernel's parameter count); a second
    spec with the same host values reuses the cached launch plan."""
    import inspect
    decode = _triton_cpu()
    launches = []

    class Count:
        def __init__(self, name, fn):
            self.name, self.params = name, len(inspect.signature(fn.fn).parameters)

        def __getitem__(self, grid):
            def launch(*args, **options):
                assert len(args) == self.params and set(options) <= {"num_warps", "num_stages", "enable_fp_fusion"}
                launches.append(self.name)
            return launch

    for name in ("decode_split", "decode_combine", "decode_append"):
        monkeypatch.setattr(decode, name, Count(name, getattr(decode, name)))
    p = KVProblem(lengths=(40, 0, 61), seqlen_new=1, capacity=64, dtype="bfloat16")
    inp = make_inputs(p)
    for splits, new, want in ((3, True, ["decode_split", "decode_combine"]), (1, True, ["decode_split"]),
                              (1, False, ["decode_split"]), (2, False, ["decode_split", "decode_combine"])):
        kv = kvcache.build_kvcache_spec(inp["q"], inp["k_cache"], inp["v_cache"], *((inp["k"], inp["v"]) if new else ()),
                                        cache_seqlens=inp["cache_seqlens"], num_splits=splits)
        launches.clear()
        decode.forward(kv)
        assert launches == want, (splits, new)
        again = kvcache.build_kvcache_spec(inp["q"].clone(), inp["k_cache"], inp["v_cache"],
                                           *((inp["k"], inp["v"]) if new else ()),
                                           cache_seqlens=inp["cache_seqlens"], num_splits=splits)
        assert decode._launch_plan(again) is decode._launch_plan(kv)
    monkeypatch.setattr(decode, "FOLD_APPEND", False)
    kv = kvcache.build_kvcache_spec(inp["q"], inp["k_cache"], inp["v_cache"], inp["k"], inp["v"],
                                    cache_seqlens=inp["cache_seqlens"], num_splits=3)
    launches.clear()
    decode.forward(kv)
    assert launches == ["decode_append", "decode_split", "decode_combine"]


def _paged_copy(k_cache, page_size, seed):
    """``k_cache`` (B, S, Hkv, D) laid into a shuffled pool of pages (2 spare): ``(pool, block_table)``,
    NaN in every slot the contiguous cache leaves NaN and in the spare pages."""
    b, cap, hkv, d = k_cache.shape
    pps = cap // page_size
    pool = torch.full((pps * b + 2, page_size, hkv, d), float("nan"), dtype=k_cache.dtype)
    perm = torch.randperm(pps * b + 2, generator=torch.Generator().manual_seed(seed))
    bt = perm[: pps * b].view(b, pps).to(torch.int32)
    for i in range(b):
        for j in range(pps):
            pool[bt[i, j]] = k_cache[i, j * page_size:(j + 1) * page_size]
    return pool, bt


@pytest.mark.parametrize("sq", [1, 8])
@pytest.mark.parametrize("page_size", [16, 32, 64, 256, 24])
def test_triton_paged_reads_equal_the_contiguous_cache(page_size, sq):
    """Every PAGE_FIT case of the paged key-tile addressing (decode._tile_rows, BLOCK_N 64):
    pages of 16 and 32 (the tile covers whole pages), 64 and 256 (a page covers whole tiles) and
    24 (neither: the per-row lookup) give bit-identical results to the contiguous cache holding
    the same keys, GQA 8 (Sq 8: the 64-row tile), 3 splits, NaN in unused slots, shuffled pages,
    garbage block-table entries past each length; the contiguous result matches the oracle."""
    decode = _triton_cpu()
    from portattn.backends.triton.configs import KernelConfig

    from portattn.conformance.kvcache import oracle
    from portattn.numerics import compare, compare_lse
    expected_fit = {16: decode.PAGE_FIT_ROWS, 32: decode.PAGE_FIT_ROWS, 64: decode.PAGE_FIT_TILE,
                    256: decode.PAGE_FIT_TILE, 24: decode.PAGE_FIT_GENERAL}[page_size]
    assert decode.page_fit(page_size, 64) == expected_fit
    p = KVProblem(lengths=(300, 45), seqlen_q=sq, seqlen_new=sq, heads_q=8, heads_kv=1, head_dim=16,
                  dtype="bfloat16", capacity=768, seed=page_size)
    inp = make_inputs(p)
    cfg = KernelConfig(64, 64, 4, 1)
    k_pool, bt = _paged_copy(inp["k_cache"], page_size, seed=sq)
    v_pool, _ = _paged_copy(inp["v_cache"], page_size, seed=sq)
    used = -(-(torch.tensor(p.lengths) + sq) // page_size)
    for i, n in enumerate(used.tolist()):
        bt[i, n:] = 1 << 30
    ref, ref_lse, naive, k_after, _ = oracle(p, inp)
    outs = []
    for k_cache, v_cache, table in ((inp["k_cache"], inp["v_cache"], None), (k_pool, v_pool, bt)):
        kv = kvcache.build_kvcache_spec(inp["q"], k_cache, v_cache, inp["k"], inp["v"],
                                        cache_seqlens=inp["cache_seqlens"], block_table=table, causal=True,
                                        num_splits=3)
        assert decode.plan_summary(kv, cfg)["num_splits"] == 3
        outs.append(decode.forward(kv, cfg))
    (out_c, lse_c), (out_p, lse_p) = outs
    _ok([compare("out", out_c, ref, naive), compare_lse(lse_c, ref_lse)])
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    assert not out_p.isnan().any()
    # the appended rows landed in the pages (the same bytes as in the contiguous cache)
    for i, n in enumerate(p.lengths):
        for t in range(n, n + sq):
            assert torch.equal(k_pool[bt[i, t // page_size], t % page_size], inp["k_cache"][i, t])


def test_triton_paged_window_starts_tiles_on_block_multiples():
    """A sliding window starts the band mid-tile: the paged kernel starts its tiles on a multiple
    of BLOCK_N (keys below the band are masked) and still matches the oracle, for a page that
    covers tiles (64) and one that tiles cover (16)."""
    decode = _triton_cpu()
    from portattn.backends.triton.configs import KernelConfig

    from portattn.conformance.kvcache import oracle
    from portattn.numerics import compare, compare_lse
    for page_size in (16, 64):
        p = KVProblem(lengths=(200, 90), seqlen_q=2, seqlen_new=0, heads_q=4, heads_kv=1, head_dim=16,
                      dtype="bfloat16", page_size=page_size, pages_per_seq=256 // page_size, window=(37, 0))
        inp = make_inputs(p)
        kv = kvcache.build_kvcache_spec(inp["q"], inp["k_cache"], inp["v_cache"], cache_seqlens=inp["cache_seqlens"],
                                        block_table=inp["block_table"], causal=True, window=(37, 0), num_splits=2)
        ref, ref_lse, naive, _, _ = oracle(p, inp)
        out, lse = decode.forward(kv, KernelConfig(16, 64, 4, 1))
        _ok([compare("out", out, ref, naive), compare_lse(lse, ref_lse)])
