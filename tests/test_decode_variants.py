"""The decode kernel's sweep variants on CPU tensors (Triton's interpreter): configs.DecodeConfig
(programs per SM for the split heuristic, the paged loop's page-id carry), the
configs._DECODE_ROWS_NVIDIA rows, and tools/decode_variants.py's choice and report.

The page-id carry (decode.PAGE_FIT_IDS) must read exactly the keys the default paged loop
reads: bit-identical results to the contiguous cache holding the same keys, NaN in every
unused slot and garbage block-table entries past each length; fully-masked rows give 0 and
lse -inf."""

from __future__ import annotations

import json

import pytest
import torch
from _scripts import load_script
from portattn.backends.triton import configs
from portattn.backends.triton.configs import DecodeConfig, KernelConfig, Target
from test_kvcache import _paged_copy  # a cache laid into a shuffled, NaN-padded pool of pages
from test_triton_portability import compile_in_subprocess  # GPU-target compiles, one JSON line back

from portattn import kvcache


def _ok(results):
    bad = [r for r in results if not r.passed]
    assert not bad, "\n".join(map(str, results))


def _decode():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test (CPU tensors)")
    from portattn.backends.triton import decode
    return decode


@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("page_size", [16, 24, 32])
def test_page_id_variants_read_what_the_default_paged_loop_reads(page_size, sq):
    """Pages of 16 (BLOCK_N 32 covers two: PAGE_FIT_ROWS), 24 (PAGE_FIT_GENERAL) and 32 (one
    page per tile: PAGE_FIT_TILE): the page-id carry (+ PAGE_FIT_IDS) and the direct loads
    (+ PAGE_FIT_DIRECT) give bit-identical results to the default paged loop and to the
    contiguous cache, 3 splits, new rows appended through the block table, a length-0
    sequence; the contiguous result matches the oracle."""
    decode = _decode()
    from portattn.conformance.kvcache import KVProblem, make_inputs, oracle
    from portattn.numerics import compare, compare_lse
    fit = {16: decode.PAGE_FIT_ROWS, 24: decode.PAGE_FIT_GENERAL, 32: decode.PAGE_FIT_TILE}[page_size]
    assert decode.page_fit(page_size, 32) == fit
    # one page per tile: nothing to carry but a scalar (the ids flag changes nothing there)
    assert decode.page_fit(page_size, 32, page_ids=True) == fit + (decode.PAGE_FIT_IDS if page_size != 32 else 0)
    assert decode.page_fit(page_size, 32, page_ids=True, page_direct=True) == fit + decode.PAGE_FIT_DIRECT
    p = KVProblem(lengths=(150, 0), seqlen_q=sq, seqlen_new=sq, heads_q=4, heads_kv=1, head_dim=16,
                  dtype="bfloat16", capacity=192, seed=page_size + sq)
    inp = make_inputs(p)
    k_pool, bt = _paged_copy(inp["k_cache"], page_size, seed=sq)
    v_pool, _ = _paged_copy(inp["v_cache"], page_size, seed=sq)
    used = -(-(torch.tensor(p.lengths) + sq) // page_size)
    for i, n in enumerate(used.tolist()):
        bt[i, n:] = 1 << 30                     # garbage past each length: never read
    ref, ref_lse, naive, _, _ = oracle(p, inp)
    runs = []
    for k_cache, v_cache, table, cfg in (
            (inp["k_cache"], inp["v_cache"], None, KernelConfig(16, 32, 4, 1)),
            (k_pool.clone(), v_pool.clone(), bt, KernelConfig(16, 32, 4, 1)),
            (k_pool.clone(), v_pool.clone(), bt, DecodeConfig(16, 32, 4, 1, page_direct=True)),
            (k_pool, v_pool, bt, DecodeConfig(16, 32, 4, 1, page_ids=True))):
        kv = kvcache.build_kvcache_spec(inp["q"], k_cache.clone() if table is None else k_cache,
                                        v_cache.clone() if table is None else v_cache, inp["k"], inp["v"],
                                        cache_seqlens=inp["cache_seqlens"], block_table=table, causal=True,
                                        num_splits=3)
        runs.append(decode.forward(kv, cfg))
    (out_c, lse_c), (out_p, lse_p), (out_d, lse_d), (out_i, lse_i) = runs
    _ok([compare("out", out_c, ref, naive), compare_lse(lse_c, ref_lse)])
    assert torch.equal(out_d, out_p) and torch.equal(lse_d, lse_p)
    assert torch.equal(out_i, out_p) and torch.equal(lse_i, lse_p)
    assert torch.equal(out_i, out_c) and torch.equal(lse_i, lse_c)
    assert not out_i.isnan().any()
    for i, n in enumerate(p.lengths):           # the appended rows landed in the pages
        for t in range(n, n + sq):
            assert torch.equal(k_pool[bt[i, t // page_size], t % page_size], inp["k"][i, t - n])


def test_page_id_variants_fully_masked_rows_are_zero_and_minus_inf():
    """Length-0 sequences with no new keys: every row is fully masked: 0 and lse -inf, no NaN
    (the pool is NaN)."""
    decode = _decode()
    q = torch.randn(2, 2, 4, 16).to(torch.bfloat16)
    pool = torch.full((6, 16, 1, 16), float("nan"), dtype=torch.bfloat16)
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    kv = kvcache.build_kvcache_spec(q, pool, pool.clone(), cache_seqlens=lens, block_table=bt, causal=True,
                                    num_splits=2)
    for cfg in (DecodeConfig(16, 32, 4, 1, page_ids=True), DecodeConfig(16, 32, 4, 1, page_direct=True)):
        out, lse = decode.forward(kv, cfg)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_programs_per_sm_sets_the_split_heuristic():
    """A DecodeConfig's programs_per_sm replaces decode_programs_per_sm in num_splits_for (the
    interpreter's 8 "SMs")."""
    decode = _decode()
    q = torch.randn(1, 1, 4, 16).to(torch.bfloat16)
    k = torch.randn(1, 2048, 1, 16).to(torch.bfloat16)
    lens = torch.full((1,), 2048, dtype=torch.int32)
    kv = kvcache.build_kvcache_spec(q, k, k.clone(), cache_seqlens=lens, causal=True)
    blocks = 2048 // 16
    got = {per: decode.plan_summary(kv, DecodeConfig(16, 16, 4, 1, programs_per_sm=per))["num_splits"]
           for per in (1, 2, 4)}
    assert got == {per: decode.num_splits_for(1, blocks, 8, per) for per in (1, 2, 4)}
    assert got[1] < got[2] < got[4]
    assert decode.plan_summary(kv, DecodeConfig(16, 16, 4, 1))["num_splits"] == \
        decode.plan_summary(kv, KernelConfig(16, 16, 4, 1))["num_splits"]


def test_rows_table_replaces_the_rule_for_its_class_and_layout(monkeypatch):
    """A _DECODE_ROWS_NVIDIA entry is taken for its tile-height class and layout only (2-byte
    inputs), capped at the tile's rows; without entries decode_config is what it was."""
    hopper = Target("nvidia", 90)
    committed = dict(configs._DECODE_ROWS_NVIDIA["hopper"])
    monkeypatch.setitem(configs._DECODE_ROWS_NVIDIA, "hopper", {})
    before = {(m, pg): configs.decode_config(hopper, 128, 2, m, pg) for m in (16, 64) for pg in (False, True)}
    assert before[(64, False)] == before[(64, True)] and before[(16, False)] == before[(16, True)]
    rows = {(128, "wide", "paged"): (64, 64, 4, 3, 2, True, False),
            (128, "narrow", "contig"): (32, 64, 4, 4, 1, False, True)}
    monkeypatch.setitem(configs._DECODE_ROWS_NVIDIA, "hopper", rows)
    assert configs.decode_config(hopper, 128, 2, 64, True) == DecodeConfig(64, 64, 4, 3, programs_per_sm=2,
                                                                           page_ids=True)
    assert configs.decode_config(hopper, 128, 2, 64, False) == before[(64, False)]
    assert configs.decode_config(hopper, 128, 2, 16, False) == DecodeConfig(16, 64, 4, 4, programs_per_sm=1,
                                                                            page_direct=True)
    assert configs.decode_config(hopper, 128, 2, 16, True) == before[(16, True)]
    assert configs.decode_config(hopper, 128, 4, 64, True) == configs.decode_config(hopper, 128, 4, 64, False)
    assert configs.decode_config(hopper, 64, 2, 64, True) == configs.decode_config(hopper, 64, 2, 64, False)
    assert configs.decode_config(Target("nvidia", 80), 128, 2, 64, True) == \
        configs.decode_config(Target("nvidia", 80), 128, 2, 64, False)
    # the committed table: only the paged 64-row class has a row (the H200 sweep's), the rest is the rule
    monkeypatch.setitem(configs._DECODE_ROWS_NVIDIA, "hopper", committed)
    assert set(committed) == {(128, "wide", "paged")}
    assert configs.decode_config(hopper, 128, 2, 64, True).page_direct
    for key in ((64, False), (16, False), (16, True)):
        assert configs.decode_config(hopper, 128, 2, *key) == before[key]
    assert DecodeConfig(64, 64, 4, 3, programs_per_sm=2, page_ids=True).short() == "M64 N64 w4 s3 p2 ids"
    assert DecodeConfig(64, 64, 4, 6, page_direct=True).short() == "M64 N64 w4 s6 direct"
    assert DecodeConfig(16, 64, 4, 3).short() == KernelConfig(16, 64, 4, 3).short()


# ----- tools/decode_variants.py ----------------------------------------------------------------

@pytest.fixture(scope="module")
def variants_tool():
    return load_script("decode_variants", "tools")


def test_variants_grid_and_classes(variants_tool):
    pts = variants_tool.points()
    assert len(pts) == 2 * 2 * 3 * 3
    assert {p["Sk"] for p in pts} == {4096, 32768, 131072} and {p["layout"] for p in pts} == set(variants_tool.LAYOUTS)
    assert variants_tool.height_class(8) == "narrow" and variants_tool.height_class(64) == "wide"
    for cls, rows in variants_tool.VARIANTS.items():
        assert len({n for n, _, _ in rows}) == len(rows) and all(isinstance(c, DecodeConfig) for _, c, _ in rows)
        assert all(c.block_m == (64 if cls == "wide" else 16) for _, c, _ in rows)


def _t(point, cand, tbps, splits=8):
    sq = int(point.split()[0][2:])
    return dict(point=point, Sq=sq, cand=cand, heuristic_splits=True, ok=True, tbps=tbps, num_splits=splits)


def test_variants_best_rows_report_and_paste(variants_tool):
    """best_rows: the geometric mean of TB/s over the current row's, only rows measured at every
    point of the group; the report pastes a row only where it beats the current one."""
    vt = variants_tool
    pts = [dict(Sq=8, B=b, Sk=131072, layout=lay) for b in (1, 8) for lay in vt.LAYOUTS]
    trials = []
    for p in pts:
        k = vt.ds._key(p)
        paged = p["layout"] != "contig"
        trials.append(_t(k, "current", 4.0 if not paged else 2.0))
        trials.append(_t(k, "N64 s3 p2", 3.9 if not paged else 3.8, 16))
        if p["layout"] == "paged16":
            trials.append(_t(k, "N64 s3 p2 ids", 4.0, 16))
    trials.append(dict(point=vt.ds._key(pts[0]), Sq=8, cand="N32 s4 p2", heuristic_splits=True, ok=False, error="x"))
    result = dict(trials=trials, points=pts, baselines={"Sq8 B1 Sk131072": {"sdpa-cudnn": 0.2}},
                  environment={"gpu": "fake"}, seconds=1.0, timing="fake", heads="32:4", family="hopper")
    best = vt.best_rows(result)
    assert best[(8, "contig")]["cand"] == "current" and best[(8, "contig")]["score"] == 1.0
    assert best[(8, "paged")]["cand"] == "N64 s3 p2" and best[(8, "paged")]["score"] == pytest.approx(1.9)
    assert best[(8, "paged16")]["cand"] == "N64 s3 p2 ids" and best[(8, "paged16")]["score"] == pytest.approx(2.0)
    text = vt.report(result, vt.VARIANTS)
    assert '_DECODE_ROWS_NVIDIA["hopper"][(128, "wide", "paged")] = (64, 64, 4, 3, 2, False, False)' in text
    assert '(128, "wide", "contig")' not in text
    assert "1 failed or wrong" in text and "FAILED" in text
    current = text.split("verdict, current rows:")[1].split("verdict, best row per Sq")[0]
    assert "Sq8 B1 Sk131072 paged16 / contig: 0.50 (target >= 0.9) MISSED" in current
    chosen = text.split("verdict, best row per Sq and layout class:")[1].split("verdict, best row per point")[0]
    assert "Sq8 B1 Sk131072 paged16 / contig: 0.95 (target >= 0.9) MET" in chosen
    assert "Sq8 B1 Sk131072 TB/s: 4.00 (target >= 3.0) MET" in chosen
    assert f"{4.0 / 0.2:>8.2f}" in text   # x cuDNN of the current contiguous row


def test_variants_tool_runs_under_the_interpreter(variants_tool, tmp_path, capsys):
    """The whole tool on a toy grid: every trial checked (the float32 reference and, for the
    variants, portattn.numerics.compare against the current rows), the files written."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    assert variants_tool.main(["--tiny", "--out", str(tmp_path), "--time-limit", "600"]) == 0
    result = json.loads((tmp_path / "decode-variants.json").read_text())
    trials = result["trials"]
    assert trials and all(t["ok"] for t in trials), trials
    assert {t["point"] for t in trials if t["cand"] == "current"} == \
        {variants_tool.ds._key(p) for p in variants_tool.points(tiny=True)}
    variant = [t for t in trials if t["cand"] != "current"]
    assert variant and all(t["compare"].startswith("out: ok") for t in variant)
    assert {t["point"].split()[-1] for t in trials if t["cand"].endswith("ids")} == {"paged16"}
    text = (tmp_path / "decode-variants.txt").read_text()
    assert "best row per (Sq, layout)" in text and "verdict, current rows" in text
    assert variants_tool.main(["--out", str(tmp_path)]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


_IDS_COMPILE = r"""
import json, torch, triton
from portattn.backends.triton import decode, portability as P
from portattn.backends.triton.configs import PORTABILITY_TARGETS, DecodeConfig, decode_config
rows = []
for target, limit in PORTABILITY_TARGETS:
    base = decode_config(target, 128, 2, 64)
    cfg = DecodeConfig(base.block_m, base.block_n, base.num_warps, base.num_stages, page_ids=True,
                       waves_per_eu=base.waves_per_eu, matrix_instr_nonkdim=base.matrix_instr_nonkdim, kpack=base.kpack)
    for page, direct in ((16, False), (24, False), (16, True), (cfg.block_n, True)):
        case = P.Case("decode_split", target, limit, torch.bfloat16, 128, cfg, P.DecodeFeatures(paged=True, page_size=page))
        sig = P._decode_signature(decode.decode_split, case)
        sig[1]["PAGE_FIT"] = decode.page_fit(page, cfg.block_n, True, direct)
        c = triton.compile(P._ast_source(decode.decode_split, *sig), target=P._gpu_target(target),
                           options=cfg.launch_options())
        rows.append(dict(target=str(target), page=page, fit=sig[1]["PAGE_FIT"], shared=int(c.metadata.shared),
                         limit=limit))
print(json.dumps(rows))
"""


def test_page_id_variants_cross_compile_for_every_portability_target():
    """The PAGE_FIT_IDS loop (pages of 16 and 24) and the PAGE_FIT_DIRECT one (pages of 16 and
    of BLOCK_N), each target's 64-row tile, compile for
    sm_80, sm_90, gfx90a and gfx942 within each target's shared memory (the portability
    check's targets; its own case list covers the table's configs)."""
    pytest.importorskip("triton")
    rows = compile_in_subprocess(_IDS_COMPILE)
    assert {r["target"] for r in rows} == {"sm_80", "sm_90", "gfx90a", "gfx942"}
    assert all(r["fit"] >= 4 and r["shared"] <= r["limit"] for r in rows), rows
    assert {r["fit"] for r in rows} == {4, 6, 9, 10}


def test_variants_trial_order_and_deadline(variants_tool):
    """The current rows at every point first, then the first variant of each class, the Sq 8 /
    B1 / Sk 32k split scan, the other variants (paged-only rows on their layouts only); past
    the deadline nothing starts."""
    vt = variants_tool
    pts = vt.points()
    calls = []

    def trial(p, name, cfg, splits, heuristic):
        calls.append((vt.ds._key(p), name, splits, heuristic))

    vt.make_sweep(vt.VARIANTS)(pts, trial, None, float("inf"), lambda *a: None, False, 8, None, 132, 140)
    assert [c[1] for c in calls[:len(pts)]] == ["current"] * len(pts)
    assert {c[0] for c in calls[:len(pts)]} == {vt.ds._key(p) for p in pts}
    names = [c[1] for c in calls]
    first_scan = names.index("current scan")
    assert set(names[len(pts):first_scan]) == {vt.VARIANTS["narrow"][0][0], vt.VARIANTS["wide"][0][0]}
    scans = [c for c in calls if c[1].endswith(" scan")]
    assert len(scans) == 2 * len(vt.LAYOUTS) * len(vt.SCAN_SPLITS)
    assert all(c[0].startswith("Sq8 B1 Sk32768") and not c[3] for c in scans)
    for cls, rows in vt.VARIANTS.items():
        for name, _, lays in rows:
            mine = [c for c in calls if c[1] == name]
            assert mine and all(c[3] and c[2] == 0 for c in mine)
            assert {c[0].split()[-1] for c in mine} == set(lays or vt.LAYOUTS)
            assert {int(c[0].split()[0][2:]) for c in mine} == ({1} if cls == "narrow" else {8})
    calls.clear()
    vt.make_sweep(vt.VARIANTS)(pts, trial, None, 0.0, lambda *a: None, False, 8, None, 132, 140)
    assert calls == []
