"""One GPU call for the persistent Gluon forward's second Q buffer (``Q_BUFS``,
``PORTATTN_TRITON_Q_BUFFERS``): whether loading the next work item's Q while the consumers still run
the current one (two Q tiles a consumer warpgroup) is as exact as, and faster than, one Q tile
loaded after the current band's last product.

    PYTHONPATH=. timeout 600 python tools/q_buffers_check.py --out $OUT --time-limit 400

For each cell (bf16, B·S = 16k tokens, hidden 2048; D 128 S 512 … 16k and D 64 S 2k … 16k, causal
and not) the persistent kernel runs with one and with two Q buffers, inference and training (O's
rounding residual): the two outputs (out, lse, residual) must be bit-identical (the buffers change
when a tile's Q loads, not its arithmetic), and the inference output is compared once with cuDNN's;
then each variant's TFLOP/s (median of ``triton.testing.do_bench``, interleaved over two rounds, the
second reversed) beside cuDNN's. Writes ``q_buffers.json`` / ``.txt`` to ``--out``; exit 0 when
every check passed.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import triton_gluon_check as chk  # noqa: E402

CELLS = ([(128, s, c) for c in (False, True) for s in (512, 1024, 2048, 4096, 8192, 16384)]
         + [(64, s, False) for s in (2048, 4096, 8192, 16384)] + [(64, s, True) for s in (8192, 16384)])
VARIANTS = ("p@q1", "p@q2", "p_train@q1", "p_train@q2")


def run_cell(d: int, s: int, causal: bool) -> dict:
    """Checks and timings of one cell (:func:`triton_gluon_check.env_variant_cell`); returns its row."""
    return chk.env_variant_cell(d, s, causal, "PORTATTN_TRITON_Q_BUFFERS", (1, 2), "q")


def report(res: dict) -> str:
    lines = chk.report_head(
        res, "bf16, B·S = 16k tokens, hidden 2048; TFLOP/s (best of two interleaved do_bench medians) of the",
        "persistent Gluon forward with one (q1) and two (q2) Q buffers a consumer warpgroup;",
        "p inference, p_train with O's rounding residual; gain q2 / q1")
    lines.append(f"{'D':>4} {'S':>6} {'causal':>6}" + "".join(f" {v:>11}" for v in VARIANTS)
                 + f" {'cudnn':>7} {'gain':>6} {'gain_tr':>7} {'q2/cudnn':>8}")
    for r in res["rows"]:
        t = r["tflops"]
        lines.append(f"{r['d']:>4} {r['s']:>6} {'yes' if r['causal'] else 'no':>6}"
                     + "".join(f" {t[v]:>11.1f}" for v in VARIANTS)
                     + f" {t['cudnn']:>7.1f} {t['p@q2'] / t['p@q1']:>6.3f} {t['p_train@q2'] / t['p_train@q1']:>7.3f}"
                     + f" {t['p@q2'] / t['cudnn']:>8.2f}")
    lines.append("")
    lines += chk.verdict_lines(res["rows"], lambda r: f"D{r['d']} S{r['s']} causal={r['causal']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    return chk.causal_cell_tool(__doc__, CELLS, run_cell, report, "q_buffers", argv)


if __name__ == "__main__":
    raise SystemExit(main())
