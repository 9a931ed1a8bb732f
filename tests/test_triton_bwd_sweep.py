"""tools/triton_bwd_sweep.py (issue #14, atomic dQ against the deterministic backward), without a
GPU: the report's best row per head dim is the one with the least mean time relative to each
cell's best, its verdict names the cells below target, atomic's speed-up over the deterministic
rows is printed, and the rows printed for configs.py parse back into rows the atomic table
accepts (None where the deterministic backward won). The candidate check runs on CPU tensors
through the interpreter on a shrunken problem."""

from __future__ import annotations

import ast
import os
import sys

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import triton_bwd_sweep as sweep  # noqa: E402

DKDV, DQ = (64, 128, 8, 2, False), (64, 32, 4, 3)
DET = (DKDV, DQ, None)
ATOMIC = (DKDV, DQ, (64, 128, 8, 2, False))
VARIANT = (DKDV, DQ, (32, 128, 8, 2, False))
CANDS = {128: [DET, ATOMIC, VARIANT]}
NAMES = {128: [sweep.DET, sweep.ATOMIC, sweep.label(VARIANT)]}


def _cell(s, causal, fa, cu, det_ms, atomic_ms, variant_ms, d=128):
    return dict(d=d, s=s, b=16384 // s, h=2048 // d, causal=causal, failed={},
                sdpa={"FLASH_ATTENTION": fa, "CUDNN_ATTENTION": cu},
                triton={sweep.DET: det_ms, sweep.ATOMIC: atomic_ms, sweep.label(VARIANT): variant_ms})


def _pasted(text) -> dict:
    """The rows the report prints for configs.py (the line after its header), as a dict."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# rows for _BWD_ATOMIC_NVIDIA['hopper']"))
    return ast.literal_eval("{" + lines[at + 1].strip() + "}")


def _on_by_default(text) -> set:
    """The head dims the report marks for _BWD_ATOMIC_BY_DEFAULT['hopper']."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# and _BWD_ATOMIC_BY_DEFAULT['hopper']"))
    inside = lines[at + 1].strip().removeprefix("frozenset(").removesuffix(")")
    return set(ast.literal_eval(inside)) if inside else set()


def test_labels_name_the_rows_that_run():
    assert sweep.label(DET) == "det dkdv M64 N128 w8 s2 / dq M64 N32 w4 s3"
    assert sweep.label(VARIANT) == "atomic dkdv M32 N128 w8 s2"
    assert sweep.label((DKDV, DQ, (16, 128, 8, 2, True))) == "atomic dkdv M16 N128 w8 s2 split"


def test_report_picks_the_fastest_atomic_row_and_prints_it_to_paste():
    cells = [_cell(4096, False, 2.0, 1.0, 2.2, 1.8, 1.7), _cell(4096, True, 1.0, 0.6, 1.1, 0.9, 1.0),
             _cell(16384, False, 8.0, 5.0, 8.4, 7.0, 6.6)]
    text = sweep.report(cells, CANDS, NAMES, {128: DET})
    # variant: (1 + 1.0/0.9 + 1) / 3 = 1.037 < atomic's (1.8/1.7 + 1 + 7/6.6) / 3 = 1.041
    best = [line for line in text.splitlines() if line.startswith("D128: best ")]
    assert len(best) == 1 and "atomic dkdv M32 N128 w8 s2:" in best[0], text
    assert "S4096 FA2 1.18" in best[0] and "S4096c FA2 1.00" in best[0], best[0]
    speed = [line for line in text.splitlines() if line.startswith("D128: speed-up of the best atomic row")]
    assert speed and "S4096 1.29" in speed[0], text   # det 2.2 ms / variant 1.7 ms
    assert _pasted(text) == {128: (32, 128, 8, 2)} and _on_by_default(text) == {128}


def test_report_keeps_atomic_off_by_default_where_the_deterministic_backward_wins():
    cells = [_cell(4096, False, 2.0, 1.0, 1.5, 1.8, 1.9), _cell(16384, True, 4.0, 2.0, 3.0, 3.3, 3.6)]
    text = sweep.report(cells, CANDS, NAMES, {128: DET})
    assert "D128: the deterministic backward was faster" in text
    assert _pasted(text) == {128: (64, 128, 8, 2)}          # the best atomic row, for PORTATTN_TRITON_DQ=atomic
    assert _on_by_default(text) == set()


def test_report_d64_row_is_pasted_for_d16_and_d32_and_split_rows_keep_the_flag():
    split = (DKDV, DQ, (16, 128, 8, 2, True))
    cands = {64: [DET, split], 256: [DET, split]}
    names = {64: [sweep.DET, sweep.ATOMIC], 256: [sweep.DET, sweep.ATOMIC]}
    cells = []
    for d in (64, 256):
        c = _cell(4096, False, 2.0, 1.0, 2.0, 1.5, 1.0, d=d)
        del c["triton"][sweep.label(VARIANT)]
        cells.append(c)
    got = _pasted(sweep.report(cells, cands, names, {64: DET, 256: DET}))
    assert got == {16: (16, 128, 8, 2, True), 32: (16, 128, 8, 2, True), 64: (16, 128, 8, 2, True),
                   256: (16, 128, 8, 2, True)}
    from portattn.backends.triton.configs import KernelConfig
    assert sweep._kc(got[256]) == KernelConfig(16, 128, 8, 2, split=True)


def test_candidates_start_with_the_table_rows_and_drop_duplicates(monkeypatch):
    monkeypatch.setattr(sweep, "_table_rows", lambda d: (DET, ATOMIC))
    monkeypatch.setitem(sweep.ATOMIC_VARIANTS, 128, [(64, 128, 8, 2), (32, 128, 8, 2, False)])
    assert sweep.candidates(128) == [DET, ATOMIC, VARIANT]
    monkeypatch.setattr(sweep, "_table_rows", lambda d: (DET, None))   # no atomic row: the dK/dV row with atomic dQ
    assert sweep.candidates(128) == [DET, ATOMIC, VARIANT]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
def test_check_passes_both_paths_and_catches_a_wrong_path(monkeypatch):
    """check() on a problem shrunk to interpreter size: the det and atomic candidates pass (the
    environment's PORTATTN_DETERMINISTIC is cleared); a candidate whose path the backward would
    not take is reported."""
    real = sweep._inputs
    # head dim 32 (= its block)
    monkeypatch.setattr(sweep, "_inputs", lambda b, s, h, d, seed, device="cuda": real(1, 40 + seed * 9, 2, 32,
                                                                                     seed, device))
    monkeypatch.setenv("PORTATTN_DETERMINISTIC", "1")
    monkeypatch.setenv("PORTATTN_TRITON_DQ", "auto")   # the sweep sets atomic: restored after the test
    tiles = (32, 32, 4, 1, False)
    det, atomic = (tiles, tiles[:4], None), (tiles, tiles[:4], tiles)
    for t in (det, atomic):
        assert sweep.check(32, True, t, device="cpu") == "", t
    assert "PORTATTN_DETERMINISTIC" not in os.environ
    # an atomic config the table would not use (float32 inputs never take it): reported, not timed
    monkeypatch.setattr(sweep, "_inputs", lambda b, s, h, d, seed, device="cuda": tuple(
        x.float() for x in real(1, 40, 2, 32, seed, device)))
    assert "would not run" in sweep.check(32, False, atomic, device="cpu")
    # a head dim narrower than its block: atomic in the blocks the H200 checked (ops.ATOMIC_NARROW_BLOCKS,
    # block 32 among them), else the backward keeps the two-kernel path, reported too
    monkeypatch.setattr(sweep, "_inputs", lambda b, s, h, d, seed, device="cuda": real(1, 40, 2, 24, seed, device))
    assert sweep.check(24, True, atomic, device="cpu") == ""
    from portattn.backends.triton import ops
    monkeypatch.setattr(ops, "ATOMIC_NARROW_BLOCKS", frozenset())
    assert "would not run" in sweep.check(24, True, atomic, device="cpu")


def test_the_run_glue_without_a_gpu(monkeypatch, tmp_path, capsys):
    """bwd_variants end to end with the GPU parts replaced: every candidate becomes a compile job
    (det and the table's atomic row first, the JSON round trip keeping ``None``), the cells'
    names are the report's, and both files are written with the rows to paste."""
    import json
    import types
    monkeypatch.setattr(sweep, "_table_rows", lambda d: (DET, ATOMIC))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    seen = {}

    def precompile(jobs, n, deadline, **kw):
        seen["jobs"] = [(d, c, sweep.base._tuple(json.loads(json.dumps(t)))) for d, c, t in jobs]
        return {j: "" for j in seen["jobs"]}

    def time_cells(cells, dims, seqlens, cands, names, bad, deadline, save):
        for d in dims:
            ms = dict(zip(names[d], (3.0, 2.0, 2.5, 2.6, 2.7)))
            cells.append(dict(d=d, s=4096, b=4, h=2048 // d, causal=False, failed={}, triton=ms,
                              sdpa={"FLASH_ATTENTION": 2.4, "CUDNN_ATTENTION": 1.5}))
            save()

    monkeypatch.setattr(sweep.base, "_fwd_precompile", precompile)
    monkeypatch.setattr(sweep, "_time_cells", time_cells)
    args = types.SimpleNamespace(time_limit=10.0, dims="128,256", seqlens="4096", jobs=2, out=str(tmp_path))
    sweep.bwd_variants(args)
    jobs = seen["jobs"]
    assert jobs[:4] == [(128, False, DET), (128, True, DET), (128, False, ATOMIC), (128, True, ATOMIC)]
    assert len(jobs) == 2 * sum(len(sweep.candidates(d)) for d in (128, 256))
    text = (tmp_path / "triton_bwd_sweep.txt").read_text()
    assert _pasted(text) == {128: (64, 128, 8, 2), 256: (64, 128, 8, 2)}
    data = json.loads((tmp_path / "triton_bwd_sweep.json").read_text())
    assert data["meta"]["complete"] and len(data["cells"]) == 2
    assert "backward sweep done" in capsys.readouterr().out
