"""tools/triton_bwd_sweep.py's report (pure Python, no GPU): the best row per head dim is the one
with the least mean time relative to each cell's best, its verdict names the cells below target,
and the row printed for configs.py parses back into a row the table accepts."""

from __future__ import annotations

import ast
import os
import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import triton_bwd_sweep as sweep  # noqa: E402

TABLE = ((64, 128, 8, 2, False), (64, 32, 4, 3))
SPLIT = ((64, 128, 8, 2, True), (64, 32, 4, 3))


def _cell(s, causal, fa, cu, table_ms, split_ms):
    return dict(d=128, s=s, b=16384 // s, h=16, causal=causal, failed={},
                sdpa={"FLASH_ATTENTION": fa, "CUDNN_ATTENTION": cu},
                triton={"table": table_ms, sweep.label(SPLIT): split_ms})


def test_report_picks_the_faster_row_and_flags_cells_below_target():
    cells = [_cell(4096, False, 2.0, 1.0, 2.2, 1.8), _cell(4096, True, 1.0, 0.6, 1.1, 3.0),
             _cell(16384, False, 8.0, 5.0, 8.4, 7.0)]
    text = sweep.report(cells, {128: [TABLE, SPLIT]}, {128: TABLE})
    # split: mean relative time (1 + 3/1.1 + 1) / 3 = 1.58 > table's (2.2/1.8 + 1 + 8.4/7) / 3 = 1.14
    best = [line for line in text.splitlines() if line.startswith("D128: best row")]
    assert len(best) == 1 and "(table)" in best[0], text
    assert "S4096 FA2 0.91" in best[0] and "(below target)" in best[0], best[0]
    row = text.strip().splitlines()[-1].strip()
    key, value = row.split(": ", 1)
    assert int(key) == 128 and ast.literal_eval(value) == ((64, 128, 8, 2), (64, 32, 4, 3))


def test_report_prints_the_split_flag_of_a_winning_split_row():
    cells = [_cell(4096, False, 2.0, 1.0, 2.2, 1.8), _cell(16384, True, 4.0, 2.0, 4.4, 3.0)]
    text = sweep.report(cells, {128: [TABLE, SPLIT]}, {128: TABLE})
    assert "D128: table row for comparison" in text
    value = ast.literal_eval(text.strip().splitlines()[-1].split(": ", 1)[1])
    assert value == ((64, 128, 8, 2, True), (64, 32, 4, 3))
    assert sweep._kc(value[0]).split and not sweep._kc(value[1]).split
