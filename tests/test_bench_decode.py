"""benchmarks/bench_decode.py's GPU-free parts: the grid, bytes, paged copies, the float32
reference, the ratio table and the plot."""

from __future__ import annotations

import math

import pytest
import torch
from _scripts import load_script

bench = load_script("bench_decode")


def test_grid_covers_the_issue_points():
    pts = bench.grid()
    assert {(p["B"], p["Sq"]) for p in pts} == {(1, 1), (1, 8), (8, 1), (8, 8)}
    assert min(p["Sk"] for p in pts) == 1024 and max(p["Sk"] for p in pts) == 131072
    assert {8192, 131072} <= {p["Sk"] for p in bench.grid(quick=True)}


def test_bytes_and_bandwidth():
    # batch 8, 128k keys, 4 KV heads, D 128, bf16: K and V are 1 GiB each
    assert bench.kv_bytes(8, 131072) == 8 * 131072 * 4 * 256 * 2 == 2**31
    assert bench.tbps(2**31, 0.5) == pytest.approx(2**31 / 0.5e-3 / 1e12)


def test_paged_copy_holds_the_same_keys():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 64, 3, 8), torch.randn(2, 64, 3, 8)
    kp, vp, bt = bench.paged_copy(k, v, 16, g)
    assert kp.shape == (8, 16, 3, 8) and bt.shape == (2, 4) and bt.dtype == torch.int32
    assert sorted(bt.view(-1).tolist()) == list(range(8)) and bt.view(-1).tolist() != list(range(8))
    for b in range(2):
        for j in (0, 17, 63):
            assert torch.equal(kp[bt[b, j // 16], j % 16], k[b, j])
            assert torch.equal(vp[bt[b, j // 16], j % 16], v[b, j])


def test_reference32_matches_portattn_reference():
    import portattn
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 3, 8, 16, generator=g), torch.randn(2, 20, 2, 16, generator=g), \
        torch.randn(2, 20, 2, 16, generator=g)
    for causal in (False, True):
        want = portattn.attention(q.double(), k.double(), v.double(), causal=causal, backend="reference")
        torch.testing.assert_close(bench.reference32(q, k, v, causal), want.float(), atol=1e-5, rtol=1e-5)
    assert bench.check(want.float() + 0.5, want.float())["ok"] is False


def _rows():
    return [{"B": 1, "Sq": 1, "Sk": sk, "results": {
        "triton": {"tbps": 3.0 * sk / 8192, "ok": True}, "triton-paged16": {"tbps": 1.0, "ok": False},
        "triton-paged256": {"error": "x"}, "sdpa-cudnn": {"tbps": 2.0}, "sdpa-flash": {"tbps": 1.5}}}
        for sk in (1024, 8192)]


def test_ratio_table_gives_ratios_to_cudnn_and_marks_bad_outputs():
    text = bench.ratio_table(_rows())
    lines = text.splitlines()
    assert "triton/cuDNN" in lines[0]
    last = lines[2].split()
    assert last[:3] == ["1", "1", "8192"] and "BAD" in lines[2] and "err" in lines[2]
    assert float(last[-3]) == pytest.approx(3.0 / 2.0) and float(last[-2]) == pytest.approx(0.5)
    assert math.isclose(float(lines[1].split()[-3]), 3.0 / 8 / 2.0, abs_tol=0.006)   # printed to 2 places


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    assert bench.plot(_rows(), str(path)) and path.stat().st_size > 1000


def test_main_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert bench.main(["--quick"]) == 2
    assert "needs a CUDA" in capsys.readouterr().err


def test_rotations_cover_the_l2():
    assert bench.rotations(bench.kv_bytes(8, 131072)) == 1
    assert bench.rotations(bench.kv_bytes(1, 8192)) * bench.kv_bytes(1, 8192) >= bench.ROTATE_BYTES
    assert bench.rotations(1) == 32 and set(bench.TIMING_METHODS) == {"queued", "eager"}


def test_point_runs_end_to_end_on_cpu(monkeypatch):
    """The GPU code path at toy sizes on CPU tensors (triton under the interpreter; SDPA's
    cuDNN/flash kernels cannot run there and become error entries), with fake timers that
    call what they time: the queued timer gets one callable per cache copy."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU smoke test")
    monkeypatch.setattr(bench, "HQ", 4)
    monkeypatch.setattr(bench, "HKV", 2)
    monkeypatch.setattr(bench, "D", 16)
    seen, copies = [], []

    def timer(fns):
        copies.append(len(fns))
        outs = [f() for f in fns]
        assert all(torch.equal(o, outs[0]) for o in outs)   # the copies hold the same problem
        return {"ms": 0.5}

    gen = torch.Generator().manual_seed(0)
    row = bench.bench_point(dict(B=2, Sq=2, Sk=512), torch.bfloat16, gen, seen.append, device="cpu",
                            timer=timer, eager_timer=lambda fn: (fn(), 2.0)[1])
    res = row["results"]
    for impl in ("triton", "triton-paged16", "triton-paged256"):
        assert res[impl]["ok"] and res[impl]["tbps"] == pytest.approx(bench.tbps(row["bytes"], 0.5)), res[impl]
        assert res[impl]["eager_tbps"] == pytest.approx(bench.tbps(row["bytes"], 2.0))
        assert res[impl]["plan"]["num_splits"] >= 1 and res[impl]["timing"] == "queued"
    assert len(copies) >= 3 and set(copies) == {2} and row["copies"] == 2
    assert row["bytes"] == bench.kv_bytes(2, 512, 2, 16, 16)
    assert "error" in res["sdpa-cudnn"] and len(seen) == len(bench.IMPLS)
    assert "eager" in bench.ratio_table([row]).splitlines()[0]


# ----- tools/decode_sweep.py -------------------------------------------------------------------

@pytest.fixture(scope="module")
def sweep():
    return load_script("decode_sweep", "tools")


def test_sweep_candidates_put_the_heuristic_first_without_duplicates(sweep):
    heur = sweep.Cand(16, 64, 4, 4)
    narrow = sweep.candidates(8, heur)
    assert narrow[0] == heur and len(set(narrow)) == len(narrow) > 5
    assert all(c.block_m == 16 for c in narrow)              # 8 rows: no cap above 16
    wide = sweep.candidates(64, sweep.Cand(64, 64, 4, 3))
    assert {c.block_m for c in wide} == {16, 32, 64} and len(set(wide)) == len(wide)
    # caps above the rows' power of two collapse into the same candidate
    assert sweep.candidates(4, heur, pool=[(32, 64, 4, 4), (16, 64, 4, 4), (64, 32, 4, 1)]) == \
        [heur, sweep.Cand(16, 32, 4, 1)]
    assert len(sweep.candidates(64, heur, limit=3)) == 3


def test_sweep_split_options(sweep):
    # B1 x 4 KV heads: one / two / four programs per SM on 132 SMs, and the heuristic's count
    assert sweep.split_options(57, 4, 2048, 132) == [33, 57, 66, 128]
    assert sweep.split_options(8, 32, 2048, 132) == [4, 8, 16]
    assert sweep.split_options(5, 4, 6, 132) == [3]          # at most key_blocks // 2
    assert sweep.split_options(1, 1000, 2048, 132) == [1]    # the batch fills the GPU


def _trial(point, cand, tbps, splits=4, heuristic=True, sq=1):
    m, n, w, s = (int(x[1:]) for x in (cand if cand != "heuristic" else "M16 N64 w4 s4").split())
    return dict(point=point, Sq=sq, cand=cand, heuristic_splits=heuristic, ok=True, tbps=tbps, num_splits=splits,
                config=f"M{m} N{n} w{w} s{s}")


def test_sweep_choice_report_and_verdict(sweep):
    pts = [dict(Sq=sq, B=b, Sk=131072, layout=lay) for sq in (1, 8) for b in (1, 8) for lay in ("contig", "paged16")]
    keys = [sweep._key(p) for p in pts]
    trials = []
    for k, p in zip(keys, pts):
        sq = p["Sq"]
        trials.append(_trial(k, "heuristic", 3.0, sq=sq))
        trials.append(_trial(k, "M16 N128 w4 s3", 4.0 if sq == 1 else 2.0, sq=sq))
        trials.append(_trial(k, "M16 N128 w4 s3", 4.2 if sq == 1 else 2.0, splits=8, heuristic=False, sq=sq))
        trials.append(_trial(k, "M32 N64 w4 s4", 3.5 if sq == 8 else 1.0, sq=sq))
    trials.append(dict(point=keys[0], Sq=1, cand="M16 N32 w4 s6", heuristic_splits=True, ok=False, error="x"))
    chosen = sweep.choose(trials, pts)
    assert chosen["per_point"][keys[0]]["best"]["tbps"] == 4.2
    assert chosen["proposal"][1]["cand"] == "M16 N128 w4 s3"
    assert chosen["proposal"][1]["score"] == pytest.approx(4.0 / 4.2)
    assert chosen["proposal"][8]["cand"] == "M32 N64 w4 s4" and chosen["proposal"][8]["score"] == 1.0
    rows = sweep.paste_rows(chosen["proposal"], "hopper")
    assert rows[0].startswith('_DECODE_NVIDIA["hopper"][128] = (128, 4, 3)')
    assert rows[1].startswith('_DECODE_WIDE_NVIDIA["hopper"][128] = (32, 64, 4, 4)')
    baselines = {"Sq1 B1 Sk131072": {"sdpa-cudnn": 3.5}, "Sq1 B8 Sk131072": {"sdpa-cudnn": 4.3}}
    result = dict(trials=trials, points=pts, baselines=baselines, environment={"gpu": "fake"}, seconds=1.0,
                  timing="fake", heads="32:4", family="hopper")
    text = sweep.report(result)
    assert '_DECODE_NVIDIA["hopper"][128] = (128, 4, 3)' in text
    current = text.split("verdict, current table")[1].split("verdict, with the proposed")[0]
    assert "Sq1 B1 Sk131072 x cuDNN: 0.86 (target >= 1.0) MISSED" in current
    assert "Sq1 B8 Sk131072 TB/s: 3.00 (target >= 3.8) MISSED" in current
    proposed = text.split("verdict, with the proposed rows pasted:")[1].split("verdict, best")[0]
    assert "Sq1 B1 Sk131072 TB/s: 4.00 (target >= 3.3) MET" in proposed
    assert "Sq8 B8 Sk131072 TB/s: 3.50 (target >= 3.0) MET" in proposed
    assert "paged16 / contig: 1.00 (target >= 0.9) MET" in proposed


def test_sweep_runs_under_the_interpreter(sweep, tmp_path, capsys):
    """The whole tool on a toy grid (CPU tensors, triton's interpreter, a wall-clock timer):
    every trial checked against the float32 reference, the JSON and the text written."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    assert sweep.main(["--tiny", "--max-candidates", "2", "--out", str(tmp_path)]) == 0
    import json
    result = json.loads((tmp_path / "decode-sweep.json").read_text())
    assert result["trials"] and all(t["ok"] for t in result["trials"]), result["trials"]
    assert {t["point"] for t in result["trials"]} == {sweep._key(p) for p in sweep.points(tiny=True)}
    assert any(t["cand"] == "heuristic" for t in result["trials"])
    text = (tmp_path / "decode-sweep.txt").read_text()
    assert "paste into backends/triton/configs.py" in text and "verdict, current table" in text
    assert sweep.main(["--out", str(tmp_path)]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
