"""One GPU call for a switch of the persistent Gluon forward that changes how it runs, not what it
computes (``PORTATTN_TRITON_GLUON_ONE_STEP``, ``PORTATTN_TRITON_Q_BUFFERS``, ...): every setting
bit-identical to the first, the first once against cuDNN, then each setting's TFLOP/s beside
cuDNN's, interleaved (``triton_gluon_check.env_variant_cell``).

    PYTHONPATH=. timeout 600 python tools/gluon_switch_check.py --env PORTATTN_TRITON_GLUON_ONE_STEP \\
        --settings 0,1 --out $OUT --time-limit 400 [--cells 128x512c,128x1024c,...]

Cells (bf16, B·S = 16k tokens, hidden 2048): D 128 and D 64, S 512 … 4k, causal and not, unless
``--cells`` names others. Writes ``switch.json`` / ``.txt`` to ``--out``; exit 0 when every check
passed.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import triton_gluon_check as chk  # noqa: E402

CELLS = [(d, s, c) for d in (128, 64) for c in (True, False) for s in (512, 1024, 2048, 4096)]


def report(res: dict) -> str:
    env, settings = res.get("switch", "?"), res.get("settings", [])
    lines = chk.report_head(
        res, "bf16, B·S = 16k tokens, hidden 2048; TFLOP/s (best of two interleaved do_bench medians) of the",
        f"persistent Gluon forward with {env} = each of {settings}; p inference, p_train with O's rounding",
        "residual; gain: the last setting / the first")
    for r in res["rows"]:
        t = r["tflops"]
        cols = "  ".join(f"{n}: {t[f'p@={n}']:6.1f} / {t[f'p_train@={n}']:6.1f}" for n in settings)
        first, last = settings[0], settings[-1]
        lines.append(f"D{r['d']:<4} S{r['s']:<6} {'causal' if r['causal'] else 'full':<6}  {cols}  cudnn {t['cudnn']:6.1f}"
                     f"  gain {t[f'p@={last}'] / t[f'p@={first}']:.3f} / {t[f'p_train@={last}'] / t[f'p_train@={first}']:.3f}"
                     f"  last/cudnn {t[f'p@={last}'] / t['cudnn']:.2f}")
    lines.append("")
    lines += chk.verdict_lines(res["rows"], lambda r: f"D{r['d']} S{r['s']} causal={r['causal']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--env", default="PORTATTN_TRITON_GLUON_ONE_STEP", help="the switch (an environment variable)")
    ap.add_argument("--settings", default="0,1", help="its values, comma-separated; the first is the reference")
    a, rest = ap.parse_known_args(argv)
    env, settings = a.env, a.settings.split(",")

    def run_cell(d: int, s: int, causal: bool) -> dict:
        return chk.env_variant_cell(d, s, causal, env, tuple(settings), "=")

    def report_with(res: dict) -> str:
        res.update(switch=env, settings=settings)
        return report(res)
    return chk.causal_cell_tool(__doc__, CELLS, run_cell, report_with, "switch", rest)


if __name__ == "__main__":
    raise SystemExit(main())
