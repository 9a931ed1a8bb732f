"""One GPU call for the Gluon forward's grouped causal walk (``gluon_fwd._longest_first``,
``gluon_fwd.head_group``) and the persistent kernel's long + short pairs (``gluon_fwd._work_tile``):
whether taking the query tiles longest first a group of heads at a time, and in pairs, is as exact
as, and faster than, the orders before it.

    PYTHONPATH=. timeout 600 python tools/head_group_check.py --out $OUT --time-limit 400

The orders (``PORTATTN_TRITON_HEAD_GROUP``): ``1``, one head's tiles longest first, then the next
head's (the one-tile kernel's grid order before the groups); ``all``, every head's last tile, then
every head's tile before it (the persistent kernel's walk before the groups: Nsight Compute on an
H100 measured it moving 1.6 x the bytes the forward needs at S 512 causal, K and V re-read from
DRAM); ``auto``, ``gluon_fwd.head_group``'s groups (their K and V fit in L2); these three with
``PORTATTN_TRITON_PAIRED_WALK=0``, each persistent CTA taking every #SMs-th tile of the walk; and
``pairs``, ``auto``'s groups with the persistent CTAs taking a head's tiles in long + short pairs
(the default; the one-tile kernel has no pairs, so it runs the first three orders only).

For each causal cell (bf16, B·S = 16k tokens, hidden 2048, D 64/128/256, S 512 … 16k) and each
kernel that can run it (one-tile; persistent at D 64/128), inference and training (O's rounding
residual): the orders' outputs (out, lse, residual) must be bit-identical (a tile's
arithmetic does not depend on when it runs), and ``auto``'s is compared once with cuDNN's;
then each order's TFLOP/s (median of ``triton.testing.do_bench``, the orders interleaved over two
rounds) beside cuDNN's and the portable kernel's. Writes ``head_group.json`` / ``.txt`` to
``--out``; exit 0 when every check passed.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import triton_gluon_check as chk  # noqa: E402  (sets PORTATTN_TRITON_FORWARD=portable for the portable column)

ORDERS = ("1", "all", "auto", "pairs")
CELLS = [(d, s) for d in (128, 64, 256) for s in (512, 1024, 2048, 4096, 8192, 16384)]


def _set_order(order: str, num_bh: int) -> None:
    os.environ["PORTATTN_TRITON_PAIRED_WALK"] = "1" if order == "pairs" else "0"
    if order in ("auto", "pairs"):
        os.environ.pop("PORTATTN_TRITON_HEAD_GROUP", None)
    else:
        os.environ["PORTATTN_TRITON_HEAD_GROUP"] = str(num_bh if order == "all" else int(order))


def _orders(persistent: bool) -> tuple:
    return ORDERS if persistent else ORDERS[:3]


def run_cell(d: int, s: int) -> dict:
    """Checks and timings of one causal cell; returns its row."""
    import torch
    from portattn.backends.triton import gluon_fwd, ops

    from portattn.spec import build_spec
    b, h = chk._shape(s, d)
    g = torch.Generator(device="cuda").manual_seed(1000 * d + s)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    spec = build_spec(q, k, v, causal=True)
    cudnn = chk.cudnn_forward(q, k, v, causal=True)
    flops = 4 * b * h * s * s * d * 0.5
    row = {"d": d, "s": s, "batch": b, "heads": h, "auto_group": None, "checks": [], "tflops": {}}
    _set_order("auto", b * h)
    row["auto_group"] = gluon_fwd.head_group(spec)
    kernels = [("g", False)] + ([("p", True)] if d in gluon_fwd.PERSISTENT_HEAD_DIMS else [])
    impls = {}
    for kname, persistent in kernels:
        for residual in (False, True):
            name = kname + ("_train" if residual else "")
            outs = {}
            for order in _orders(persistent):
                _set_order(order, b * h)
                res = gluon_fwd.gluon_forward(spec, persistent=persistent, residual=residual)
                torch.cuda.synchronize()
                outs[order] = [t.clone() for t in res]
            same = all(torch.equal(x, y) for o in _orders(persistent)[1:] for x, y in zip(outs["1"], outs[o]))
            check = {"impl": name, "bit_identical": same}
            if not residual:
                ref = cudnn()
                best = "pairs" if persistent else "auto"
                check["max_abs_vs_cudnn"] = float((outs[best][0].float() - ref.float()).abs().max())
                check["passed"] = same and check["max_abs_vs_cudnn"] < 2e-2
            else:
                check["passed"] = same
            row["checks"].append(check)
            for order in _orders(persistent):
                impls[f"{name}@{order}"] = (order, lambda p=persistent, r=residual: gluon_fwd.gluon_forward(
                    spec, persistent=p, residual=r))
    impls["portable"] = ("auto", lambda: ops.forward(spec))
    impls["portable_train"] = ("auto", lambda: ops.forward_for_backward(spec))
    impls["cudnn"] = ("auto", cudnn)
    row["tflops"], row["spread"] = chk.time_interleaved(impls, lambda order: _set_order(order, b * h), flops)
    _set_order("pairs", b * h)
    return row


def report(res: dict) -> str:
    lines = chk.report_head(
        res, "causal bf16, B·S = 16k tokens, hidden 2048; TFLOP/s (best of two interleaved do_bench medians);",
        "orders: 1 = one head after the other, all = longest first over every head, auto = gluon_fwd.head_group",
        "(these three unpaired), pairs = auto's groups, each persistent CTA taking long + short tiles in pairs",
        "g one-tile, p persistent, _train with O's rounding residual; gains: g auto / best(1, all), "
        "p pairs / best(1, all, auto)")
    names = ["g", "g_train", "p", "p_train"]
    head = f"{'D':>4} {'S':>6} {'grp':>4}"
    for n in names:
        head += "".join(f" {n + '@' + o:>12}" for o in ORDERS if n.startswith("p") or o != "pairs")
    head += f" {'portable':>9} {'port_tr':>8} {'cudnn':>7}  gains  best/cudnn(inf)"
    lines.append(head)
    for r in res["rows"]:
        t = r["tflops"]
        line = f"{r['d']:>4} {r['s']:>6} {r['auto_group']:>4}"
        for n in names:
            line += "".join(f" {t.get(f'{n}@{o}', float('nan')):>12.1f}" for o in ORDERS
                            if n.startswith("p") or o != "pairs")
        line += f" {t['portable']:>9.1f} {t['portable_train']:>8.1f} {t['cudnn']:>7.1f}"
        gains = []
        for n in names:
            new = "pairs" if n.startswith("p") else "auto"
            if f"{n}@{new}" in t:
                old = [t[f"{n}@{o}"] for o in ORDERS if o != new and f"{n}@{o}" in t]
                gains.append(f"{n} {t[f'{n}@{new}'] / max(old):.3f}")
        best_inf = max(t[k] for k in ("g@auto", "p@pairs", "portable") if k in t)
        line += "  " + ", ".join(gains) + f"  {best_inf / t['cudnn']:.2f}"
        lines.append(line)
    lines.append("")
    lines += chk.verdict_lines(res["rows"], lambda r: f"D{r['d']} S{r['s']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = chk.cell_tool_args(__doc__, "e.g. '128x512,64x2048' (D x S); default every cell", argv)
    cells = chk.parse_cells(a.cells) if a.cells else CELLS
    return chk.run_cells(cells, ("d", "s"), run_cell, report, a.out, "head_group", a.time_limit)


if __name__ == "__main__":
    raise SystemExit(main())
