"""One GPU call for the persistent Gluon forward's K/V ring depth (``STAGES``,
``PORTATTN_TRITON_GLUON_STAGES``): whether more key tiles loaded ahead is as exact as, and faster
than, ``gluon_fwd.tile_config``'s ring where the kernel waits on memory.

    PYTHONPATH=. timeout 600 python tools/ring_depth_check.py --out $OUT --time-limit 400

At S 512 causal and D 128 the persistent kernel moves the four (B, S, H, D) tensors at 49 % of
the H100's DRAM bandwidth while its products take a fifth of the time, where cuDNN reaches ~80 %
(Nsight Compute, benchmarks/results/ncu-h100-d128-s512-causal.txt): loads and products seem to
take turns instead of overlapping, and the ring (two 128-key tiles of K and V at D 128) is the
only slack between them. A deeper ring gives up what no longer fits beside it
(``gluon_fwd.smem_plan``): at D 128 three tiles leave one Q buffer and store O through it; at D 64
five tiles still leave two Q buffers and O's own tiles with two consumer warpgroups (three
consumers keep one Q buffer).

For each cell (bf16, B·S = 16k tokens, hidden 2048; D 128 and D 64, S 512 … 4k, causal and not,
the consumer warpgroups ``auto`` runs) the persistent kernel runs at each depth of :data:`DEPTHS`,
inference and training (O's rounding residual): every depth's outputs (out, lse, residual) must be
bit-identical to the default depth's (the ring changes when a tile loads, not its arithmetic),
and the default's inference output is compared once with cuDNN's; then each variant's TFLOP/s
(median of ``triton.testing.do_bench``, interleaved over two rounds, the second reversed) beside
cuDNN's. Writes ``ring_depth.json`` / ``.txt`` to ``--out``; exit 0 when every check passed.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import triton_gluon_check as chk  # noqa: E402

#: the ring depths timed per head dim, the default (``tile_config``'s) first
DEPTHS = {128: (2, 3), 64: (3, 4, 5)}
CELLS = [(d, s, c) for d in (128, 64) for c in (True, False) for s in (512, 1024, 2048, 4096)]


def run_cell(d: int, s: int, causal: bool) -> dict:
    """Checks and timings of one cell (:func:`triton_gluon_check.env_variant_cell` over
    :data:`DEPTHS`), with the consumers ``auto`` runs and each depth's shared-memory plan; returns
    its row."""
    from types import SimpleNamespace

    from portattn.backends.triton import gluon_fwd
    depths = DEPTHS[d]
    row = chk.env_variant_cell(d, s, causal, "PORTATTN_TRITON_GLUON_STAGES", depths, "s")
    consumers = gluon_fwd.consumers_for(d, None, SimpleNamespace(causal=causal, seqlen_q=s))
    block_n, _ = gluon_fwd.tile_config(d, consumers)
    row.update(consumers=consumers, depths=list(depths),
               plans={str(n): list(gluon_fwd.smem_plan(d, consumers, block_n, n)) for n in depths})
    return row


def report(res: dict) -> str:
    lines = chk.report_head(
        res, "bf16, B·S = 16k tokens, hidden 2048; TFLOP/s (best of two interleaved do_bench medians) of the",
        "persistent Gluon forward at K/V ring depths sN (N key tiles; plan: Q buffers a consumer / O through Q);",
        "p inference, p_train with O's rounding residual; gain: the deepest ring / the default (the first)")
    for r in res["rows"]:
        t = r["tflops"]
        d0, deep = r["depths"][0], r["depths"][-1]
        cols = "  ".join(f"s{n} {t[f'p@s{n}']:6.1f} / {t[f'p_train@s{n}']:6.1f} (q{r['plans'][str(n)][0]}"
                         f"{' O-in-Q' if r['plans'][str(n)][1] else ''})" for n in r["depths"])
        best = max(t[f"p@s{n}"] for n in r["depths"])
        lines.append(f"D{r['d']:<4} S{r['s']:<6} {'causal' if r['causal'] else 'full':<6} c{r['consumers']}  {cols}"
                     f"  cudnn {t['cudnn']:6.1f}  gain {t[f'p@s{deep}'] / t[f'p@s{d0}']:.3f} /"
                     f" {t[f'p_train@s{deep}'] / t[f'p_train@s{d0}']:.3f}  best/cudnn {best / t['cudnn']:.2f}")
    lines.append("")
    lines += chk.verdict_lines(res["rows"], lambda r: f"D{r['d']} S{r['s']} causal={r['causal']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    return chk.causal_cell_tool(__doc__, CELLS, run_cell, report, "ring_depth", argv)


if __name__ == "__main__":
    raise SystemExit(main())
