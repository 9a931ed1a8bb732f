"""One GPU call for the Gluon forward's three consumer warpgroups at D 64 (``gluon_fwd.consumers_for``,
FA3's 192-row tiles): numerics against float64, then timings beside the two-consumer kernels, the
portable kernel, SDPA flash and cuDNN.

    PYTHONPATH=. timeout 600 python tools/gluon_consumers_check.py --out $OUT --time-limit 420

1. checks, in a child process with a timeout (a barrier deadlock in the three-way ping-pong cannot
   hang the run), with ``PORTATTN_TRITON_GLUON_CONSUMERS=3``: ``tools/triton_gluon_check.py``'s
   check cases at D 64 (its own D 64 cases, every other case with D set to 64) plus cases aimed
   at 192-row tiles (a third warpgroup partly or wholly past Sq, causal bands whose edges fall
   inside a tile, several work items per persistent CTA with the grid forced to 1-3 CTAs), each
   for the one-tile kernel with and without ping-pong and the persistent one: outputs against
   float64 (``portattn.numerics``), NaN-poisoned outputs all written, fully-masked rows 0 / -inf,
   two runs bit-identical, the training epilogue's residual (the check tool's ``_check_residual``),
   and with ping-pong whether out and lse are bit-identical to the two-consumer kernel's
   (reported: each row sees the same key tiles in the same order, so they should be); one child
   per variant, side by side (most of their time is compiling);
2. timings (bf16, B·S = 16k tokens, hidden 2048, S 512 … 16k, causal and not), TFLOP/s of the
   median of ``triton.testing.do_bench``: inference ``g2`` / ``g3`` (one-tile, ping-pong on, two
   or three consumers), ``p2`` / ``p3`` (persistent), the portable kernel, flash and cuDNN;
   training forwards (with O's rounding residual) ``g3_train`` / ``p3_train`` / ``p2_train``
   beside the portable ``ops.forward_for_backward`` — only once every check passed.

Writes ``gluon_consumers.json`` / ``.txt`` to ``--out``; exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import triton_gluon_check as chk  # noqa: E402  (sets PORTATTN_TRITON_FORWARD=portable for the "triton" column)

#: cases for 192-row tiles: (name, B, Sq, Sk, Hq, Hkv, D, dtype, build_spec kwargs, forced grid or None)
EXTRA_CASES = [
    ("wg2_partly_past_sq", 2, 130, 300, 2, 2, 64, "bfloat16", {}, None),
    ("wg2_wholly_past_sq", 1, 100, 257, 3, 3, 64, "float16", {}, None),
    ("causal_edges_in_tile", 1, 1000, 1000, 2, 2, 64, "bfloat16", {"causal": True}, None),
    ("causal_sq>sk_3wg", 1, 700, 333, 4, 2, 64, "bfloat16", {"causal": True}, None),
    ("causal_tl_192", 2, 576, 640, 2, 1, 64, "bfloat16", {"causal": True, "causal_alignment": "top_left"}, None),
    ("pers_grid1", 1, 577, 577, 2, 2, 64, "bfloat16", {}, 1),
    ("pers_grid2_causal", 2, 800, 800, 2, 2, 64, "bfloat16", {"causal": True}, 2),
    ("pers_grid3_gqa", 2, 384, 700, 4, 2, 64, "float16", {}, 3),
]

#: (name, ping-pong, persistent) of the checked kernels
CHECK_VARIANTS = [("g3_nopp", False, False), ("g3", True, False), ("p3", True, True)]

#: the timing cells (S, causal) at D 64
TIMING_CELLS = [(s, c) for c in (False, True) for s in (512, 1024, 2048, 4096, 8192, 16384)]


def _cases(head_dim: int = 64) -> list:
    """Every check case at ``head_dim``, with its forced persistent grid (None: one CTA per SM)."""
    out = []
    for name, b, sq, sk, hq, hkv, d, dt, kw in chk.CHECK_CASES:
        out.append(((name if d == head_dim else f"{name}@d{head_dim}"), b, sq, sk, hq, hkv, head_dim, dt, kw, None))
    return out + [c[:6] + (head_dim,) + c[7:] for c in EXTRA_CASES]


def child_main(names: list[str], head_dim: int = 64) -> int:
    """In a child: every case for the :data:`CHECK_VARIANTS` named ``names``, one CHECK line each."""
    import torch
    from portattn.backends.triton import gluon_fwd
    os.environ["PORTATTN_TRITON_GLUON_CONSUMERS"] = "3"
    real_sm_count = gluon_fwd._sm_count
    for variant, pingpong, persistent in (v for v in CHECK_VARIANTS if v[0] in names):
        for case in _cases(head_dim):
            grid = case[-1]
            if grid is not None and not persistent:
                continue
            print(f"BEGIN check {case[0]} variant={variant}", flush=True)
            gluon_fwd._sm_count = real_sm_count if grid is None else (lambda device, n=grid: n)
            try:
                row = chk._check_case(case[:-1], pingpong, persistent)
                if pingpong:
                    row.update(_same_as_two(case[:-1], pingpong, persistent))
            except Exception as exc:   # a launch or compile error is a failed check, with its message
                row = {"case": case[0], "passed": False, "error": f"{type(exc).__name__}: {str(exc)[-800:]}"}
            finally:
                gluon_fwd._sm_count = real_sm_count
            row.update(variant=variant, grid=grid)
            print("CHECK " + json.dumps(row), flush=True)
            torch.cuda.synchronize()
    return 0


def _same_as_two(case, pingpong: bool, persistent: bool) -> dict:
    """Whether three consumers give the two-consumer kernel's out and lse bit for bit (reported)."""
    import torch
    from portattn.backends.triton import gluon_fwd
    spec = chk.case_spec(case)
    o3, l3 = gluon_fwd.gluon_forward(spec, pingpong=pingpong, persistent=persistent, consumers=3)
    o2, l2 = gluon_fwd.gluon_forward(spec, pingpong=pingpong, persistent=persistent, consumers=2)
    return {"same_as_two": bool(torch.equal(o3, o2) and torch.equal(l3, l2))}


def _with_stages(stages, fn):
    """``fn`` run with three consumers' ``tile_config`` stages replaced by ``stages`` (None: as is)."""
    if stages is None:
        return fn()
    from portattn.backends.triton import gluon_fwd
    real = gluon_fwd.tile_config
    gluon_fwd.tile_config = lambda d, c=2: (real(d, c)[0], stages) if c == 3 else real(d, c)
    try:
        return fn()
    finally:
        gluon_fwd.tile_config = real


def time_cell(s: int, causal: bool, d: int = 64, stages: int | None = None) -> dict:
    """One timing row at head dim ``d`` (TFLOP/s per column, see the module's docstring);
    ``stages``: also time three consumers with this many ring stages (columns ``g3s``, ``p3s``)."""
    import torch
    from portattn.backends.triton import gluon_fwd, ops

    from portattn.spec import build_spec
    b, h = chk._shape(s, d)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    spec = build_spec(q, k, v, causal=causal)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    row = {"S": s, "B": b, "H": h, "D": d, "causal": causal}
    impls = [(f"{kind}{c}", lambda c=c, pers=(kind == "p"): gluon_fwd.gluon_forward(spec, persistent=pers, consumers=c))
             for kind in ("g", "p") for c in (2, 3)]
    if stages is not None:
        impls += [(f"{kind}3s", lambda pers=(kind == "p"): _with_stages(stages, lambda: gluon_fwd.gluon_forward(
            spec, persistent=pers, consumers=3))) for kind in ("g", "p")]
    impls += [("triton", lambda: ops.forward(spec))]
    impls += [(f"{kind}{c}_train", lambda c=c, pers=(kind == "p"): gluon_fwd.gluon_forward(
        spec, persistent=pers, consumers=c, residual=True)) for kind, c in (("g", 2), ("g", 3), ("p", 2), ("p", 3))]
    impls += [("triton_train", lambda: ops.forward_for_backward(spec))]
    return chk.time_impls(row, impls, q, k, v, causal, flops)


def report(res: dict) -> str:
    f = chk._fmt
    lines = [f"{res.get('device', '?')} torch {res.get('torch', '?')} triton {res.get('triton', '?')} "
             f"{res.get('date', '')}; seconds {json.dumps(res.get('seconds', {}))}", "", "compile (sm_90, 3 consumers):"]
    lines += ["  " + " ".join(f"{k}={v}" for k, v in r.items()) for r in res.get("compile", [])]
    ch = res.get("child")
    if ch:
        n_ok = sum(bool(c.get("passed")) for c in ch["checks"])
        same = sum(bool(c.get("same_as_two")) for c in ch["checks"])
        asked = sum("same_as_two" in c for c in ch["checks"])
        lines += ["", f"checks (PORTATTN_TRITON_GLUON_CONSUMERS=3): {n_ok} of {len(ch['checks'])} passed, "
                  f"{same} of {asked} bit-identical to two consumers; rc={ch['rc']} hung={ch['hung']} "
                  f"last begun: {ch['last_begun']} ({ch['seconds']} s)"]
        for c in ch["checks"]:
            if not c.get("passed") or c.get("same_as_two") is False:
                lines.append("  " + " ".join(f"{k}={c.get(k)}" for k in ("case", "variant", "grid", "passed",
                                                                          "same_as_two", "out", "lse", "unwritten",
                                                                          "res_passed", "error")))
        if ch["stderr_tail"] and not ch["passed"]:
            lines += ["  stderr: " + ch["stderr_tail"][-1500:]]
    if res.get("timings"):
        cols = ["g2", "g3", "p2", "p3"] + (["g3s", "p3s"] if "g3s" in res["timings"][0] else []) + [
            "triton", "flash", "cudnn"]
        lines += ["", f"inference TFLOP/s (bf16, D {res['timings'][0]['D']}, 16k tokens; g one-tile, p persistent, "
                  "2 / 3 consumers; g3s / p3s three with --stages ring stages)",
                  f"{'S':>6} {'causal':>6} " + " ".join(f"{c:>7}" for c in cols)
                  + f" {'g3/g2':>6} {'p3/p2':>6} {'best3/best':>10} {'best3/cudnn':>11}"]
        for r in res["timings"]:
            best3 = max((r[k] for k in ("g3", "p3", "g3s", "p3s") if k in r), default=None)
            best = max((r[k] for k in ("g2", "p2", "triton") if k in r), default=None)
            lines.append(f"{r['S']:>6} {str(r['causal']):>6} " + " ".join(f(r.get(c)) for c in cols) + " "
                         + " ".join(f(a / b_ if a and b_ else None, w, 2) for a, b_, w in (
                             (r.get("g3"), r.get("g2"), 6), (r.get("p3"), r.get("p2"), 6), (best3, best, 10),
                             (best3, r.get("cudnn"), 11))))
        tcols = ["g2_train", "g3_train", "p2_train", "p3_train", "triton_train"]
        lines += ["", "training forward TFLOP/s (with O's rounding residual)",
                  f"{'S':>6} {'causal':>6} " + " ".join(f"{c:>12}" for c in tcols) + f" {'best3/triton':>12}"]
        for r in res["timings"]:
            best3 = max((r[k] for k in ("g3_train", "p3_train") if k in r), default=None)
            lines.append(f"{r['S']:>6} {str(r['causal']):>6} " + " ".join(f(r.get(c), 12) for c in tcols)
                         + " " + f(best3 / r["triton_train"] if best3 and r.get("triton_train") else None, 12, 2))
    if res.get("skipped"):
        lines += ["", "skipped (time limit): " + ", ".join(res["skipped"])]
    lines += ["", f"verdict: {res.get('verdict', '?')}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for gluon_consumers.json / .txt")
    ap.add_argument("--time-limit", type=float, default=420.0, help="no new cell starts after this (s)")
    ap.add_argument("--child-timeout", type=float, default=240.0, help="the checks' child process limit (s)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variants", default="", help=argparse.SUPPRESS)
    ap.add_argument("--d", type=int, default=64, choices=(64, 128),
                    help="the head dim (128 needs gluon_fwd.THREE_CONSUMER_HEAD_DIMS and tile_config to take it: "
                         "its run of 2026-12-05 had them, benchmarks/results/triton-gluon-consumers-d128-h100.txt)")
    ap.add_argument("--stages", type=int, default=None,
                    help="also time three consumers with this many ring stages (columns g3s / p3s)")
    ap.add_argument("--cells", default="", help="S:causal,... instead of S 512-16k causal and not")
    ap.add_argument("--check-variants", default=",".join(v[0] for v in CHECK_VARIANTS),
                    help="which of the checked kernels to check (g3_nopp, g3, p3)")
    a = ap.parse_args(argv)
    if a.child:
        return child_main(a.variants.split(","), a.d)
    if not a.out:
        ap.error("--out DIR is required")
    os.makedirs(a.out, exist_ok=True)
    start = time.perf_counter()
    faulthandler.dump_traceback_later(a.time_limit + 60, exit=True)
    sys.path.insert(0, ROOT)
    import torch
    import triton
    from portattn.backends.triton import gluon_fwd
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU",
           "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": {}, "compile": [],
           "timings": [], "skipped": []}
    t0 = time.perf_counter()
    for causal in (False, True):
        for persistent in (False, True):
            try:
                res["compile"].append(gluon_fwd.compile_report(a.d, causal, persistent=persistent, consumers=3))
            except Exception as exc:
                res["compile"].append({"causal": causal, "persistent": persistent,
                                       "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})
    res["seconds"]["compile"] = round(time.perf_counter() - t0, 1)
    write = lambda: chk.write_files(a.out, "gluon_consumers", res, report(res))  # noqa: E731
    write()
    ok = torch.cuda.is_available() and not any("error" in r for r in res["compile"])
    if ok:
        from concurrent.futures import ThreadPoolExecutor
        limit = min(a.child_timeout, a.time_limit)
        checked = [v for v in CHECK_VARIANTS if v[0] in a.check_variants.split(",")]
        with ThreadPoolExecutor(len(checked)) as pool:
            kids = list(pool.map(lambda v: chk.child_lines(__file__, ["--variants", v[0], "--d", str(a.d)], limit),
                                 checked))
        n = sum(len([x for x in _cases(a.d) if v[2] or x[-1] is None]) for v in checked)
        checks = [x for k in kids for x in k["checks"]]
        c = {"rc": max((k["rc"] if k["rc"] is not None else 99) for k in kids), "hung": any(k["hung"] for k in kids),
             "checks": checks, "seconds": max(k["seconds"] for k in kids),
             "last_begun": "; ".join(k["begun"][-1] for k in kids if k["hung"] and k["begun"]) or None,
             "stderr_tail": "\n".join(k["stderr_tail"] for k in kids if k["stderr_tail"])[-3000:]}
        c["passed"] = not c["hung"] and c["rc"] == 0 and len(checks) == n and all(x.get("passed") for x in checks)
        res["child"] = c
        res["seconds"]["checks"] = c["seconds"]
        ok = c["passed"]
        print(report({"child": res["child"]}), flush=True)
        write()
    if ok:
        t0 = time.perf_counter()
        cells = ([(int(x), bool(int(y))) for x, y in (c.split(":") for c in a.cells.split(","))] if a.cells
                 else TIMING_CELLS)
        for s, causal in cells:
            if time.perf_counter() - start > a.time_limit:
                res["skipped"].append(f"S={s} causal={causal}")
                continue
            res["timings"].append(time_cell(s, causal, a.d, a.stages))
            print(json.dumps(res["timings"][-1]), flush=True)
            write()
        res["seconds"]["timings"] = round(time.perf_counter() - t0, 1)
    res["verdict"] = "PASS" if ok else "FAIL"
    print(write(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
