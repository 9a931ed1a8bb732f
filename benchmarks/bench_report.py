"""The reports of benchmarks/bench_attention.py (``portattn bench``): the ratio table (text and
markdown), the per-backend summary, each backend's issue targets and the PNG plot, all from the result
dict that it writes as JSON (so they can be redrawn from a saved JSON)."""

from __future__ import annotations

import math
import re

#: torch SDPA kernels usable as baselines (called directly, without portattn's dispatch)
BASELINES = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_math": "MATH",
             "sdpa_efficient": "EFFICIENT_ATTENTION"}
LABELS = {"sdpa_flash": "FA2", "sdpa_cudnn": "cuDNN"}
#: a cell whose rounds differ by more than this (relative) is marked noisy (~) in the table
NOISY = 0.05
#: the plot's row order of dtypes
DTYPE_ORDER = ("bf16", "fp16", "fp32")
#: a card's model in its device name: H100, H200, A100, L40S, ... (the word tools/h200_session.sh's GPU_TAG takes)
_CARD = re.compile(r"[abhl][0-9]{2,3}[a-z]?", re.IGNORECASE)


def card_tag(gpu_name: str | None) -> str:
    """The short name of a GPU for report file names: ``"NVIDIA H100 80GB HBM3"`` -> ``h100``,
    ``"NVIDIA H200"`` -> ``h200``; a name without such a model its last word (``"AMD Instinct
    MI300X"`` -> ``mi300x``); no GPU -> ``cpu``."""
    if not gpu_name:
        return "cpu"
    found = _CARD.search(gpu_name)
    return (found.group(0) if found else gpu_name.split()[-1]).lower().replace("/", "-")


def label(impl: str) -> str:
    return LABELS.get(impl, impl)


# ----- the ratio table -------------------------------------------------------------------------

def _num(x: float) -> str:
    """TFLOP/s as an integer from 100 on, three significant digits below (CPU runs)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _pair(entry: dict, directions, key: str, fmt: str) -> str:
    parts = []
    for d in directions:
        e = entry.get(d, {})
        parts.append((fmt.format(e[key]) if fmt else _num(e[key])) if key in e else ("err" if "error" in e else "-"))
    return "/".join(parts)


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the ratio table: per cell, every implementation's TFLOP/s as
    fwd/bwd, then each portattn backend / each baseline as fwd/bwd."""
    impls, directions = result["implementations"], result["directions"]
    ours = [i for i in impls if i not in BASELINES]
    bases = [i for i in impls if i in BASELINES]
    header = ["dtype", "D", "S", "causal"] + [label(i) for i in impls] + [f"{o}/{label(b)}" for o in ours for b in bases]
    body = []
    for r in result["rows"]:
        cells = [r["dtype"], str(r["D"]), str(r["S"]), "yes" if r["causal"] else "no"]
        for i in impls:
            e = r["results"].get(i, {})
            noisy = any(e.get(d, {}).get("spread", 0.0) > NOISY for d in directions)
            bad = e.get("ok") is False
            cells.append(_pair(e, directions, "tflops", None) + ("~" if noisy else "") + ("!" if bad else ""))
        for o in ours:
            for b in bases:
                ratio = r["ratios"].get(o, {}).get(b, {})
                cells.append("/".join(f"{ratio[d]:.2f}" if d in ratio else "-" for d in directions))
        body.append(cells)
    return header, body


def legend(result: dict) -> str:
    d = "/".join(result["directions"])
    return (f"TFLOP/s as {d} ({result['flop_convention']}); ratios portattn / baseline as {d}; "
            "FA2 = torch SDPA flash, cuDNN = torch SDPA cuDNN; "
            f"~ its {result['rounds']} interleaved rounds differ by more than {NOISY:.0%}; "
            "! an output differs from the float64 reference (docs/semantics.md); err / -: see the JSON")


def summary(result: dict) -> list[str]:
    """Per portattn backend, baseline and direction: the geometric mean, the lowest and highest ratio."""
    lines = []
    for o, per_base in _collect_ratios(result).items():
        for b, per_dir in per_base.items():
            for d, vals in per_dir.items():
                geo = math.exp(sum(math.log(v) for v, _ in vals) / len(vals))
                lo, hi = min(vals), max(vals)
                lines.append(f"{o} / {label(b)} {d}: geomean {geo:.2f} over {len(vals)} cells, "
                             f"min {lo[0]:.2f} ({lo[1]}), max {hi[0]:.2f} ({hi[1]})")
    return lines


#: issue 14's speed targets (the triton backend's; bf16, ratios from one run): (what, direction,
#: baseline, minimum, cells)
TARGETS = (
    ("fwd D128 S>=2k >= 1.0 x cuDNN", "fwd", "sdpa_cudnn", 1.0, lambda r: r["D"] == 128 and r["S"] >= 2048),
    ("fwd D64/D256 S>=2k >= 0.9 x cuDNN", "fwd", "sdpa_cudnn", 0.9, lambda r: r["D"] != 128 and r["S"] >= 2048),
    ("fwd S 512/1k >= 0.8 x cuDNN", "fwd", "sdpa_cudnn", 0.8, lambda r: r["S"] <= 1024),
    ("bwd D128 S>=2k >= 1.0 x FA2", "bwd", "sdpa_flash", 1.0, lambda r: r["D"] == 128 and r["S"] >= 2048),
    ("bwd D128 S>=2k >= 0.85 x cuDNN (goal)", "bwd", "sdpa_cudnn", 0.85, lambda r: r["D"] == 128 and r["S"] >= 2048),
    ("bwd D64/D256 S>=2k >= 1.0 x FA2", "bwd", "sdpa_flash", 1.0, lambda r: r["D"] != 128 and r["S"] >= 2048),
    ("fwd every cell >= 0.5 x FA2", "fwd", "sdpa_flash", 0.5, lambda r: True),
    ("bwd every cell >= 0.5 x FA2", "bwd", "sdpa_flash", 0.5, lambda r: True),
)
#: issue 16's speed targets (the cupy backend's): >= 1.0 x FA2 at every head dim from S 1k, causal
#: and not, and no cell there below 0.8 x FA2
CUPY_TARGETS = (
    ("fwd S>=1k >= 1.0 x FA2", "fwd", "sdpa_flash", 1.0, lambda r: r["S"] >= 1024),
    ("bwd S>=1k >= 1.0 x FA2", "bwd", "sdpa_flash", 1.0, lambda r: r["S"] >= 1024),
    ("fwd S>=1k no cell below 0.8 x FA2", "fwd", "sdpa_flash", 0.8, lambda r: r["S"] >= 1024),
    ("bwd S>=1k no cell below 0.8 x FA2", "bwd", "sdpa_flash", 0.8, lambda r: r["S"] >= 1024),
)
#: backend -> (issue, its targets); a backend not named here is held to issue 14's
ISSUE_TARGETS = {"triton": (14, TARGETS), "cupy": (16, CUPY_TARGETS)}
#: fp16 within this (relative) of bf16, per cell, backend and direction
FP16_TOLERANCE = 0.05


def _cell_name(r: dict) -> str:
    return f"{r['dtype']} D{r['D']} S{r['S']}{' causal' if r['causal'] else ''}"


def targets(result: dict) -> list[dict]:
    """Each portattn backend's issue targets (:data:`ISSUE_TARGETS`: triton issue 14's, cupy issue
    16's) over the bf16 cells that have both ratios: ``{"backend", "issue", "target", "cells",
    "missed", "worst", "worst_cell"}`` (``missed`` lists cells below the minimum with their ratio);
    then fp16 against bf16 per cell and direction."""
    out = []
    bf16 = [r for r in result["rows"] if r["dtype"] == "bf16"]
    for o in result.get("portattn_backends", []):
        issue, table = ISSUE_TARGETS.get(o, (14, TARGETS))
        for what, d, base, minimum, cells in table:
            vals = [(r["ratios"][o][base][d], _cell_name(r)) for r in bf16 if cells(r)
                    and d in r.get("ratios", {}).get(o, {}).get(base, {})]
            if vals:
                worst = min(vals)
                out.append({"backend": o, "issue": issue, "target": what, "cells": len(vals), "worst": worst[0],
                            "worst_cell": worst[1], "missed": [[n, round(v, 3)] for v, n in vals if v < minimum]})
        fp16 = {(r["D"], r["S"], r["causal"]): r for r in result["rows"] if r["dtype"] == "fp16"}
        vals = []
        for r in bf16:
            twin = fp16.get((r["D"], r["S"], r["causal"]))
            for d in result["directions"] if twin else ():
                a = r["results"].get(o, {}).get(d, {}).get("tflops")
                b = twin["results"].get(o, {}).get(d, {}).get("tflops")
                if a and b:
                    vals.append((b / a, f"{_cell_name(twin)} {d}"))
        if vals:
            worst = max(vals, key=lambda x: abs(x[0] - 1.0))
            out.append({"backend": o, "issue": issue, "target": f"fp16 within {FP16_TOLERANCE:.0%} of bf16",
                        "cells": len(vals),
                        "worst": worst[0], "worst_cell": worst[1],
                        "missed": [[n, round(v, 3)] for v, n in vals if abs(v - 1.0) > FP16_TOLERANCE]})
    return out


def target_lines(result: dict) -> list[str]:
    lines = []
    for t in result.get("targets", []):
        verdict = "met" if not t["missed"] else f"MISSED in {len(t['missed'])} of {t['cells']} cells"
        issue = f" (#{t['issue']})" if "issue" in t else ""
        lines.append(f"{t['backend']}{issue}: {t['target']}: {verdict}; worst {t['worst']:.2f} ({t['worst_cell']})")
    return lines


def _collect_ratios(result: dict) -> dict:
    acc: dict = {}
    for r in result["rows"]:
        name = _cell_name(r)
        for o, per_base in r["ratios"].items():
            for b, per_dir in per_base.items():
                for d, v in per_dir.items():
                    acc.setdefault(o, {}).setdefault(b, {}).setdefault(d, []).append((v, name))
    return acc


def first_calls(result: dict) -> str:
    """Seconds of first calls (compiles, autotuning, the check) per implementation over the run."""
    totals: dict = {}
    for r in result["rows"]:
        for impl, e in r["results"].items():
            totals[impl] = totals.get(impl, 0.0) + sum(e.get("first_call_s", {}).values())
    return "first calls (compile + check), s: " + ", ".join(f"{label(i)} {t:.1f}" for i, t in totals.items())


def format_text(header, body) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(header)] + [fmt(c) for c in body])


def format_markdown(result: dict) -> str:
    env = result["environment"]
    header, body = table(result)
    where = env.get("gpu") or f"CPU {env.get('cpu')}"
    lines = [f"# portattn bench: {where}, {env['date']}", "",
             f"driver {env.get('driver')}, torch {env['torch']} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}), "
             f"triton {env.get('triton')}, cupy {env.get('cupy')}, portattn {env['portattn']} ({env.get('commit')}); "
             f"{result['cells_done']} of {result['cells_total']} cells"
             + (f", stopped: {result['stopped']}" if result.get("stopped") else "") + ".", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c) + " |" for c in body]
    lines += ["", legend(result) + ".", "", "Backward timed alone: " + result["bwd_method"] + ".",
              f"Run: {result.get('seconds')} s; {first_calls(result)}.", ""]
    lines += [f"- {s}" for s in summary(result)]
    if result.get("targets"):
        lines += ["", "The issues' targets (triton: #14, cupy: #16; bf16 cells; fp16 against bf16):", ""]
        lines += [f"- {s}" for s in target_lines(result)]
    return "\n".join(lines) + "\n"


# ----- the plot --------------------------------------------------------------------------------

def plot(result: dict, path: str) -> bool:
    """TFLOP/s against S, one line per implementation (causal solid, non-causal dashed), a panel per
    (dtype, direction) row and head dim column; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return False
    rows, impls = result["rows"], result["implementations"]
    if not rows:
        return False
    dtypes = [d for d in DTYPE_ORDER if any(r["dtype"] == d for r in rows)]
    dtypes += sorted({r["dtype"] for r in rows} - set(dtypes))
    dims = sorted({r["D"] for r in rows})
    panel_rows = [(t, d) for t in dtypes for d in result["directions"]]
    fig, axes = plt.subplots(len(panel_rows), len(dims), figsize=(4.6 * len(dims), 3.4 * len(panel_rows)),
                             squeeze=False, sharex=True, sharey="row")
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    seqlens = sorted({r["S"] for r in rows})
    for (t, d), ax_row in zip(panel_rows, axes):
        for dim, ax in zip(dims, ax_row):
            for impl in impls:
                for causal, style in ((True, "-"), (False, "--")):
                    pts = [(r["S"], r["results"][impl][d]["tflops"]) for r in rows
                           if r["dtype"] == t and r["D"] == dim and r["causal"] == causal
                           and "tflops" in r["results"].get(impl, {}).get(d, {})]
                    if pts:
                        pts.sort()
                        ax.plot(*zip(*pts), style, marker="o", ms=3.5, lw=1.6, color=colors[impl])
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens)
            ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_title(f"{t} {d}, D {dim}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if dim == dims[0]:
                ax.set_ylabel("TFLOP/s")
            if (t, d) == panel_rows[-1]:
                ax.set_xlabel("sequence length S")
    for ax in axes.flat:   # after every panel of a row is drawn (shared y): from 0 to the row's highest
        ax.autoscale_view()
        ax.set_ylim(bottom=0)
    handles = [Line2D([], [], color=colors[i], marker="o", lw=1.6, label=label(i)) for i in impls]
    handles += [Line2D([], [], color="0.3", ls="-", label="causal"), Line2D([], [], color="0.3", ls="--", label="non-causal")]
    height = fig.get_figheight()
    fig.legend(handles=handles, loc="center", ncol=len(handles), frameon=False, fontsize=9,
               bbox_to_anchor=(0.5, 1.0 - 0.42 / height))
    env = result["environment"]
    fig.suptitle(f"portattn bench, {env.get('gpu') or 'CPU'}, {env['date'][:10]}, torch {env['torch']}; "
                 f"B·S = {result['tokens']} tokens, hidden {result['hidden']}", y=1.0 - 0.08 / height, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / height))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    """``python benchmarks/bench_report.py bench-h200-<date>.json``: redraw the .md and .png beside
    a saved result and print its table."""
    import argparse
    import json
    import os
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("json", help="a JSON written by portattn bench")
    args = ap.parse_args(argv)
    with open(args.json) as fh:
        result = json.load(fh)
    stem = os.path.splitext(args.json)[0]
    with open(stem + ".md", "w") as fh:
        fh.write(format_markdown(result))
    drew = plot(result, stem + ".png")
    print(f"wrote {stem}.md" + (f" and {stem}.png" if drew else " (no matplotlib: no plot)"))
    print(legend(result))
    print(format_text(*table(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
