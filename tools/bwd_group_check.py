"""One GPU call for the Gluon backward's grouped walk (``gluon_bwd.head_group``,
``gluon_bwd.GROUPED_WALK``): whether a causal backward's dQ grid (query tiles longest first) and
dK/dV grid (key tiles, the first first) taken a group of heads at a time, as the forward's causal
walk, is as exact as, and faster than, one head after the other.

    PYTHONPATH=. timeout 600 python tools/bwd_group_check.py --out $OUT --time-limit 300

For each causal cell (bf16, B·S = 16k tokens, hidden 2048; D 128 S 2k … 16k, D 256 S 2k / 8k) the
triton backend's backward (``torch.autograd.grad`` through ``portattn.attention``, the forward run
once) with the walk grouped and not: dq, dk and dv must be bit-identical (the order changes no
arithmetic), and the grouped gradients are compared once with cuDNN's; then each walk's TFLOP/s
(2.5 × the forward's FLOPs; median of ``triton.testing.do_bench``, interleaved over two rounds)
beside cuDNN's backward. Writes ``bwd_group.json`` / ``.txt`` to ``--out``; exit 0 when every check
passed.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
_FORWARD = os.environ.get("PORTATTN_TRITON_FORWARD")
import triton_gluon_check as chk  # noqa: E402  (sets PORTATTN_TRITON_FORWARD=portable: undone below)

if _FORWARD is None:
    os.environ.pop("PORTATTN_TRITON_FORWARD", None)
else:
    os.environ["PORTATTN_TRITON_FORWARD"] = _FORWARD

CELLS = [(128, s) for s in (2048, 4096, 8192, 16384)] + [(256, 2048), (256, 8192)]


def run_cell(d: int, s: int) -> dict:
    """Checks and timings of one causal cell; returns its row."""
    import torch
    import torch.nn.functional as F
    from portattn.backends.triton import gluon_bwd
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import portattn
    from portattn.spec import build_spec
    b, h = chk._shape(s, d)
    g = torch.Generator(device="cuda").manual_seed(2000 * d + s)
    q, k, v, do = (torch.randn(b, s, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = portattn.attention(q, k, v, causal=True, backend="triton")
    row = {"d": d, "s": s, "batch": b, "heads": h, "checks": [], "tflops": {},
           "group": gluon_bwd.head_group(build_spec(q, k, v, causal=True))}

    def bwd(grouped: bool):
        gluon_bwd.GROUPED_WALK = grouped
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    grads = {w: [t.clone() for t in bwd(w)] for w in (False, True)}
    torch.cuda.synchronize()
    same = all(torch.equal(x, y) for x, y in zip(grads[False], grads[True]))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    ref = [x.transpose(1, 2) for x in torch.autograd.grad(ref_out, (qt, kt, vt), do.transpose(1, 2),
                                                          retain_graph=True)]
    err = max(float((x.float() - y.float()).abs().max()) for x, y in zip(grads[True], ref))
    row["checks"].append({"impl": "bwd", "bit_identical": same, "max_abs_vs_cudnn": err,
                          "passed": same and err < 5e-2})

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.autograd.grad(ref_out, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)
    impls = {"one_head": (False, lambda: bwd(False)), "grouped": (True, lambda: bwd(True)),
             "cudnn": (True, cudnn)}
    flops = 2.5 * 4 * b * h * s * s * d * 0.5
    row["tflops"], row["spread"] = chk.time_interleaved(
        impls, lambda w: setattr(gluon_bwd, "GROUPED_WALK", w), flops)
    gluon_bwd.GROUPED_WALK = True
    return row


def report(res: dict) -> str:
    lines = chk.report_head(
        res, "causal bf16 backward, B·S = 16k tokens, hidden 2048; TFLOP/s (2.5 x the forward's FLOPs; best of two",
        "interleaved do_bench medians): one_head = each grid one head after the other, grouped = head groups")
    lines.append(f"{'D':>4} {'S':>6} {'group':>5} {'one_head':>9} {'grouped':>8} {'cudnn':>7} {'gain':>6} {'x cudnn':>8}")
    for r in res["rows"]:
        t = r["tflops"]
        lines.append(f"{r['d']:>4} {r['s']:>6} {r['group']:>5} {t['one_head']:>9.1f} {t['grouped']:>8.1f}"
                     f" {t['cudnn']:>7.1f} {t['grouped'] / t['one_head']:>6.3f} {t['grouped'] / t['cudnn']:>8.2f}")
    lines.append("")
    lines += chk.verdict_lines(res["rows"], lambda r: f"D{r['d']} S{r['s']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = chk.cell_tool_args(__doc__, "e.g. '128x2048,256x8192' (D x S); default every cell", argv)
    cells = chk.parse_cells(a.cells) if a.cells else CELLS
    return chk.run_cells(cells, ("d", "s"), run_cell, report, a.out, "bwd_group", a.time_limit)


if __name__ == "__main__":
    raise SystemExit(main())
