"""The decode variants of issue 13 beside the current rows, one time-limited H200 command.

    PYTHONPATH=. python tools/decode_variants.py --out $OUT --time-limit 140

Points: Sq 1 and 8, batch 1 and 8, Sk 4k, 32k and 128k, each on a contiguous cache and on paged
caches of 16 and 256 rows per page (GQA 32:4, D 128, bf16, full cache, bottom-right causal).
Every trial runs the production kernel (``decode.forward(kv, config)``), its output checked once
against the float32 reference (``bench_decode.check``: ``portattn.numerics``-style relative
error) and timed with ``bench_decode.queued_ms`` (GPU time per call, launches queued behind a
spin kernel, cache copies rotated past L2); torch SDPA's cuDNN and flash kernels on the
contiguous cache in the same run. Trials, in this order (each pass over all points before the
next, so a time limit leaves the current rows everywhere):

1. ``current``: what ``attention_with_kvcache`` runs today (the table and the split heuristic);
2. the :data:`VARIANTS` of each tile-height class (``configs.DecodeConfig``: tile, programs
   per SM the split heuristic plans for, the paged loop's ``page_ids`` carry or
   ``page_direct`` loads), round robin
   between Sq 1 and Sq 8, each at the split count its row gives;
3. after the first variant of each class: a split-count scan at Sq 8 / B1 / Sk 32k (the point
   furthest from its target) for the current row and the first Sq 8 variant.

Writes ``decode-variants.json`` (every trial, the baselines, the environment) and
``decode-variants.txt``: per point and row TB/s, paged / contiguous, x cuDNN; per (Sq, layout)
the best row (geometric mean over the batch / Sk points of TB/s against the current row's) with
the ``configs._DECODE_ROWS_NVIDIA`` line to paste; the issue's verdicts for the current rows
and for the best rows. ``--time-limit`` counts from the process's start: no trial starts after
``time-limit - RESERVE`` seconds, and the files are written before the limit.
"""

from __future__ import annotations

import time

_T0 = time.time()   # the process's start: --time-limit counts imports and set-up too

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ds = _load("decode_sweep")
bench = ds.bench

from portattn.backends.triton.configs import DecodeConfig  # noqa: E402

LAYOUTS = ds.LAYOUTS
#: seconds kept for the report, the files and the exit after the last trial
RESERVE = 12.0

#: (name, config, layouts it runs on (None: all)) per tile-height class, best guesses first.
#: Sq 1 at GQA 8 packs 8 rows (tile 16, "narrow"); Sq 8 packs 64 ("wide"). ``ids`` only changes
#: paged caches whose pages do not hold whole tiles (paged 16 at BLOCK_N 64); N16 makes paged 16
#: one page per tile (decode.PAGE_FIT_TILE: a scalar page id per tile). Shared memory per program
#: (sm_90 D128 bf16, triton 3.9's cross-compile): M64 N64 s3 112 KB (two fit an SM), s4 144 KB
#: (one); M64 N32 s4 80 KB; M16 N64 s3 70 KB. ``direct`` (decode.PAGE_FIT_DIRECT: page ids
#: loaded in the tile's own iteration) lets the pipeliner prefetch the page ids as cp.async
#: copies (the default carry leaves one synchronous block-table load per iteration, the likely
#: stall of the 64-row paged tiles at one program per SM) but gives K/V about half the stages:
#: M64 N64 s6 direct keeps 3 tiles in flight in 112 KB (186 registers: two per SM), M64 N32 s8
#: 6 in 82 KB, M16 N64 s6 3 in 72 KB.
PAGED = ("paged16", "paged256")
VARIANTS = {
    "narrow": [
        ("N64 s3 p1", DecodeConfig(16, 64, 4, 3, programs_per_sm=1), None),
        ("N64 s6 direct", DecodeConfig(16, 64, 4, 6, page_direct=True), PAGED),
        ("N64 s3 p3", DecodeConfig(16, 64, 4, 3, programs_per_sm=3), None),
        ("N64 s3 ids", DecodeConfig(16, 64, 4, 3, page_ids=True), ("paged16",)),
        ("N16 s6", DecodeConfig(16, 16, 4, 6), ("paged16",)),
        ("N64 s4 p2", DecodeConfig(16, 64, 4, 4, programs_per_sm=2), None),
    ],
    "wide": [
        ("N64 s3 p2", DecodeConfig(64, 64, 4, 3, programs_per_sm=2), None),
        ("N64 s6 p2 direct", DecodeConfig(64, 64, 4, 6, programs_per_sm=2, page_direct=True), PAGED),
        ("N32 s4 p2", DecodeConfig(64, 32, 4, 4, programs_per_sm=2), None),
        ("N32 s8 p2 direct", DecodeConfig(64, 32, 4, 8, programs_per_sm=2, page_direct=True), PAGED),
        ("N16 s8 p2 direct", DecodeConfig(64, 16, 4, 8, programs_per_sm=2, page_direct=True), ("paged16",)),
        ("N64 s3 p2 ids", DecodeConfig(64, 64, 4, 3, programs_per_sm=2, page_ids=True), ("paged16",)),
        ("N32 s6 p2", DecodeConfig(64, 32, 4, 6, programs_per_sm=2), None),
    ],
}
#: interpreter (--tiny) variants: tiles of 16 rows and 16/32 keys
TINY_VARIANTS = {
    "narrow": [("N32 s1 p1", DecodeConfig(16, 32, 4, 1, programs_per_sm=1), None),
               ("N32 s1 ids", DecodeConfig(16, 32, 4, 1, page_ids=True), ("paged16",))],
}
#: the split counts of the Sq 8 / B1 / Sk 32k scan
SCAN_SPLITS = (16, 29, 33, 48, 66, 99, 128)


def points(tiny: bool = False) -> list[dict]:
    """The (Sq, B, Sk, layout) points, grouped by Sq."""
    if tiny:
        return [dict(Sq=sq, B=1, Sk=128, layout=lay) for sq in (1, 2) for lay in ("contig", "paged16")]
    return [dict(Sq=sq, B=b, Sk=sk, layout=lay) for sq in (1, 8) for b in (1, 8) for sk in (4096, 32768, 131072)
            for lay in LAYOUTS]


def height_class(rows: int) -> str:
    """``"wide"`` for packed tiles of more than 32 rows (64-row tiles), else ``"narrow"``."""
    return "wide" if rows > 32 else "narrow"


def make_sweep(variants: dict, scan: bool = True):
    """The trial order of the module docstring, as ``decode_sweep.run``'s ``sweep`` argument."""

    def sweep(pts, trial, spec, deadline, progress, tiny, group, max_candidates, sms, time_limit):
        skipped = 0

        def go(p, name, cfg, splits=0):
            nonlocal skipped
            if time.time() > deadline:
                skipped += 1
                return
            trial(p, name, cfg, splits, splits == 0)

        for p in pts:
            go(p, "current", None)
        queues = []
        for sq in sorted({p["Sq"] for p in pts}):
            grp = [p for p in pts if p["Sq"] == sq]
            queues.append([(name, cfg, lays, grp) for name, cfg, lays in variants.get(height_class(group * sq), [])])
        order = [item for tier in zip(*queues) for item in tier] if queues else []
        for q in queues:
            order += q[min(map(len, queues)):]
        if max_candidates:
            order = order[:max_candidates * len(queues)]
        for i, (name, cfg, lays, grp) in enumerate(order):
            for p in grp:
                if lays is None or p["layout"] in lays:
                    go(p, name, cfg)
            if scan and i == len(queues) - 1:   # after the first tier: no new compiles, a few seconds
                wide = variants.get("wide", [])
                for p in pts:
                    if (p["Sq"], p["B"], p["Sk"]) == (8, 1, 32768):
                        for sname, scfg in [("current", None)] + [(n, c) for n, c, _ in wide[:1]]:
                            for s in SCAN_SPLITS:
                                go(p, f"{sname} scan", scfg, s)
        if skipped:
            progress(f"time limit ({time_limit:.0f} s) reached: {skipped} trials skipped")
    return sweep


# ----- the report -------------------------------------------------------------------------------

def _table(trials: list[dict]) -> dict:
    """(point key, row name) -> trial, for trials at the row's own split count that passed."""
    return {(t["point"], t["cand"]): t for t in trials if t.get("ok") and "tbps" in t and t.get("heuristic_splits")}


def _pkey(sq, b, sk, lay):
    return f"Sq{sq} B{b} Sk{sk} {lay}"


def best_rows(result: dict) -> dict:
    """Per (Sq, layout) and per (Sq, layout class ``contig``/``paged``): the row with the best
    geometric mean of TB/s over the current row's at the same points (rows measured at every
    point of the group only), ``{"cand", "score", "per_point"}``."""
    tab = _table(result["trials"])
    pts = result["points"]
    out = {}
    groups = {}
    for p in pts:
        groups.setdefault((p["Sq"], p["layout"]), []).append(p)
        groups.setdefault((p["Sq"], "contig" if p["layout"] == "contig" else "paged"), []).append(p)
    for (sq, lay), grp in groups.items():
        if lay == "paged" and len({p["layout"] for p in grp}) < 2:
            continue
        keys = [ds._key(p) for p in grp]
        names = {c for (k, c) in tab if k in keys}
        scores = {}
        for c in names:
            if not all((k, c) in tab and (k, "current") in tab for k in keys):
                continue
            ratios = [tab[(k, c)]["tbps"] / tab[(k, "current")]["tbps"] for k in keys]
            scores[c] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        if scores:
            c = max(scores, key=scores.get)
            out[(sq, lay)] = {"cand": c, "score": scores[c], "per_point": {k: tab[(k, c)] for k in keys},
                              "ranking": sorted(((round(v, 3), n) for n, v in scores.items()), reverse=True)}
    return out


def paste_row(sq: int, lay: str, cand: str, variants: dict, group: int, family: str, block_d: int = 128) -> str:
    """The ``configs._DECODE_ROWS_NVIDIA`` line that makes ``cand`` the row of its class."""
    cls = height_class(group * sq)
    for name, cfg, _ in variants.get(cls, []):
        if name == cand:
            return (f'_DECODE_ROWS_NVIDIA["{family}"][({block_d}, "{cls}", "{lay}")] = ({cfg.block_m}, {cfg.block_n}, '
                    f"{cfg.num_warps}, {cfg.num_stages}, {cfg.programs_per_sm}, {cfg.page_ids}, {cfg.page_direct})")
    return f"(keep the current {cls} {lay} row)"


def report(result: dict, variants: dict) -> str:
    tab = _table(result["trials"])
    pts = result["points"]
    hq, hkv = (int(x) for x in result["heads"].split(":"))
    group = hq // hkv
    bad = [t for t in result["trials"] if not t.get("ok")]
    lines = [f"decode variants: {result['environment'].get('gpu', '?')}, {result['seconds']} s, "
             f"{len(result['trials'])} trials ({len(bad)} failed or wrong), timing: {result['timing']}"]
    for t in bad[:12]:
        lines.append(f"  FAILED {t['point']} {t['cand']}: {t.get('error') or t.get('max_rel_err', 'wrong output')}")
    lines += ["", "TB/s of K/V bytes (x splits); p16/p256 in brackets: paged / the same row's contiguous TB/s, "
              "or the current contiguous one for a paged-only row; x cuDNN: contiguous / SDPA cuDNN"]
    lines.append(f"{'Sq B Sk':<16} {'row':<16} {'contig':>12} {'paged16':>18} {'paged256':>18} {'x cuDNN':>8}")
    combos = sorted({(p["Sq"], p["B"], p["Sk"]) for p in pts})
    for sq, b, sk in combos:
        base = result["baselines"].get(f"Sq{sq} B{b} Sk{sk}", {})
        cu = base.get("sdpa-cudnn")
        names = ["current"] + [n for n, _, _ in variants.get(height_class(group * sq), [])]
        for name in names:
            cells = {lay: tab.get((_pkey(sq, b, sk, lay), name)) for lay in LAYOUTS}
            if not any(cells.values()):
                continue
            contig = cells["contig"] or tab.get((_pkey(sq, b, sk, "contig"), "current"))
            row = f"{f'{sq} {b} {sk}':<16} {name:<16}"
            c = cells["contig"]
            row += f"{c['tbps']:>7.2f} x{c['num_splits']:<3}" if c else f"{'-':>12}"
            for lay in ("paged16", "paged256"):
                t = cells[lay]
                ratio = f"({t['tbps'] / contig['tbps']:.2f})" if t and contig else ""
                row += f"{t['tbps']:>7.2f} x{t['num_splits']:<3} {ratio:<6}" if t else f"{'-':>18}"
            row += f"{c['tbps'] / cu:>8.2f}" if c and cu else f"{'':>8}"
            lines.append(row)
        if base:
            lines.append(f"{'':<16} {'SDPA':<16} cuDNN {cu or float('nan'):.2f}, flash "
                         f"{base.get('sdpa-flash', float('nan')):.2f}"
                         + "".join(f"; {k}: {v}" for k, v in base.items() if k.endswith("-error")))
    scans = [t for t in result["trials"] if t["cand"].endswith(" scan") and t.get("ok")]
    if scans:
        lines += ["", "split scan, Sq 8 / B1 / Sk 32k (TB/s):"]
        for name in sorted({t["cand"] for t in scans}):
            for lay in LAYOUTS:
                here = [t for t in scans if t["cand"] == name and t["point"].endswith(lay)]
                if here:
                    lines.append(f"  {name:<20} {lay:<9} " + ", ".join(f"x{t['num_splits']} {t['tbps']:.2f}" for t in here))
    best = best_rows(result)
    lines += ["", "best row per (Sq, layout): geometric mean of TB/s / the current row's over the B and Sk points"]
    for (sq, lay), v in sorted(best.items()):
        lines.append(f"  Sq{sq} {lay:<9} {v['cand']:<16} {v['score']:.3f}x current; ranking "
                     + ", ".join(f"{n} {s:.3f}" for s, n in v["ranking"][:4]))
    lines += ["", "rows to paste into backends/triton/configs.py (per Sq's tile class and layout class; "
              "only where the best row beats the current one by > 2 %):"]
    pasted = False
    for (sq, lay), v in sorted(best.items()):
        if lay in ("contig", "paged") and v["cand"] != "current" and v["score"] > 1.02:
            lines.append("  " + paste_row(sq, lay, v["cand"], variants, group, result.get("family", "hopper")))
            pasted = True
    if not pasted:
        lines.append("  (none: keep the current rows)")
    per_point = {ds._key(p): {"point": p} for p in pts}
    now = {k: t["tbps"] for (k, c), t in tab.items() if c == "current"}
    chosen = dict(now)
    for (_sq, lay), v in best.items():
        if lay in ("contig", "paged"):
            for k, t in v["per_point"].items():
                chosen[k] = t["tbps"]
    top = {}
    for (k, _c), t in tab.items():
        top[k] = max(top.get(k, 0.0), t["tbps"])
    for name, nums in (("current rows", now), ("best row per Sq and layout class", chosen),
                       ("best row per point (not one table)", top)):
        lines += ["", f"verdict, {name}:"] + ds.verdict(per_point, nums, result["baselines"])
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for decode-variants.json and decode-variants.txt")
    ap.add_argument("--time-limit", type=float, default=140.0,
                    help="seconds from the process's start (imports, set-up and compiles included) within "
                         "which it writes its files and exits (default 140)")
    ap.add_argument("--max-variants", type=int, default=None, help="variants per Sq at most")
    ap.add_argument("--no-scan", action="store_true", help="skip the Sq 8 / B1 / Sk 32k split scan")
    ap.add_argument("--tiny", action="store_true", help="a toy grid (CPU tensors run under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print("decode_variants needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    pts = points(args.tiny)
    variants = TINY_VARIANTS if args.tiny else VARIANTS
    timer = None
    if device == "cpu":
        def timer(fns):
            t = time.perf_counter()
            fns[0]()
            return {"ms": (time.perf_counter() - t) * 1e3}
    budget = max(1.0, args.time_limit - (time.time() - _T0) - RESERVE)
    progress = bench._Progress(len(pts) * 4) if device == "cuda" else print
    try:
        result = ds.run(pts, device, timer, budget, progress, args.tiny, args.max_variants,
                        sweep=make_sweep(variants, scan=not args.no_scan and not args.tiny))
    finally:
        if hasattr(progress, "stop"):
            progress.stop()
    result["variants"] = {cls: [(n, c.short(), lays) for n, c, lays in rows] for cls, rows in variants.items()}
    text = report(result, variants)
    print(text)
    if args.out:
        ds.write_results(args.out, "decode-variants", result, text)
        print(f"\nwrote {args.out}/decode-variants.json and decode-variants.txt ({time.time() - _T0:.0f} s)")
    return 0 if all(t.get("ok") for t in result["trials"]) else 1


if __name__ == "__main__":
    sys.exit(main())
