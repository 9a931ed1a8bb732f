"""One H200 run for the opt-in Gluon backward (``backends/triton/gluon_bwd.py``): compile report,
gradients against float64 and backward timings beside portattn's triton backward (deterministic
and atomic dQ), SDPA flash (FA2) and cuDNN, inside a hard time limit.

    PYTHONPATH=. python3 tools/triton_gluon_bwd_check.py --out $OUT --time-limit 180 [--quick]

Phases (each writes its results before the next starts, so a run cut short still reports):

1. compile: both kernels (dK/dV, dQ) and the dK/dV kernel's GQA group walk for sm_90 at D 64 / 128,
   and at D 256 the dK/dV kernel's two passes (dV, dK; ``gluon_bwd.kernels_for``) and dQ (shared memory, registers, spills, setmaxnreg values, the PTX's wgmma / TMA counts, SASS
   HGMMA / UTMALDG);
2. checks, in a child process with a timeout (a barrier deadlock there cannot hang this run):
   ``ops.backward`` under ``PORTATTN_TRITON_BACKWARD=gluon`` (the Gluon launch is seen) for every
   case, gradients written into NaN-poisoned buffers (an element the kernels do not write shows
   as NaN), against float64 autograd with ``portattn.numerics.compare`` (factor 3), rows with no
   visible key exactly 0, a second run bit-identical; then one launch at every timing shape;
3. timings of the backward alone (bf16, B·S = 16k tokens, hidden 2048: first D 256 H 8, S 1k /
   4k / 16k — the cells that decide whether ``auto`` takes the D 256 Gluon backward (issue #14:
   >= 1.0 x FA2) —, then GQA at D 128 Hq 16 with Hkv 4 and 2, S 4k / 16k, then D 128 H 16 and
   D 64 H 32, S 1k / 4k / 16k; causal and not): the Gluon backward (only if phase 2 passed), the triton
   backward deterministic (two kernels) and with atomic dQ (``PORTATTN_TRITON_DQ=atomic``), SDPA
   flash and cuDNN (``autograd.grad`` of a saved graph); medians of ``triton.testing.do_bench``;
   TFLOP/s = 2.5 · 4·B·H·S²·D / t (halved for causal) and the Gluon kernel's ratios. No new cell
   starts after ``--time-limit`` seconds; a watchdog ends the process 60 s after it.

``--quick``: D 128 compiles, half the checks, S 4k timings only. Writes ``gluon_bwd_check.json``
and ``gluon_bwd_check.txt`` to ``--out``. Verdict PASS = compiled with HGMMA and UTMALDG in the
SASS and every check passed; timings decide nothing. Exit 0 on PASS.
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
from triton_gluon_check import (  # noqa: E402  (the forward tool's helpers)
    _fmt,
    _median_ms,
    _shape,
    child_lines,
    write_files,
    zlib_crc,
)

#: (name, B, Sq, Sk, Hq, Hkv, D, dtype name, build_spec kwargs); every second one (from the first)
#: runs in --quick
CHECK_CASES = [
    ("plain_d128", 2, 256, 256, 4, 4, 128, "bfloat16", {}),
    ("plain_d64_fp16", 1, 384, 384, 2, 2, 64, "float16", {}),
    ("ragged_d128", 1, 200, 333, 3, 3, 128, "bfloat16", {}),
    ("ragged_d64", 2, 77, 130, 2, 2, 64, "float16", {}),
    ("causal_sq<sk", 1, 130, 517, 4, 4, 128, "bfloat16", {"causal": True}),
    ("causal_sq>sk_gqa2", 1, 517, 130, 4, 2, 128, "bfloat16", {"causal": True}),   # fully-masked rows
    ("causal_top_left", 1, 300, 450, 2, 2, 64, "bfloat16", {"causal": True, "causal_alignment": "top_left"}),
    ("causal_tl_sq>sk_fp16", 1, 450, 300, 2, 2, 128, "float16", {"causal": True, "causal_alignment": "top_left"}),
    ("window_d128", 1, 400, 420, 2, 2, 128, "bfloat16", {"window": (100, 17)}),
    ("gqa8_d64", 2, 128, 1000, 8, 1, 64, "bfloat16", {}),
    ("sq1", 3, 1, 77, 2, 2, 128, "bfloat16", {}),
    ("long_causal_d128", 1, 2048, 2048, 2, 2, 128, "bfloat16", {"causal": True}),
    # the dK/dV kernel's in-CTA GQA walk (ratios 2, 4, 8 beside gqa2 / gqa8 above)
    ("gqa4_causal_tl_d128", 1, 300, 517, 8, 2, 128, "bfloat16", {"causal": True, "causal_alignment": "top_left"}),
    ("gqa4_window_d64_fp16", 2, 333, 290, 8, 2, 64, "float16", {"window": (70, 9)}),
    ("gqa8_causal_sq>sk_d128", 1, 700, 260, 16, 2, 128, "bfloat16", {"causal": True}),
    # D 256: the dK/dV kernel as two passes (dV, then dK), then dQ
    # (--quick: plain, causal Sq > Sk and the GQA walk)
    ("ragged_d256", 1, 200, 333, 3, 3, 256, "bfloat16", {}),
    ("plain_d256", 2, 256, 256, 4, 4, 256, "bfloat16", {}),
    ("causal_sq<sk_d256", 1, 130, 517, 2, 2, 256, "bfloat16", {"causal": True}),
    ("causal_sq>sk_d256", 1, 517, 130, 2, 2, 256, "bfloat16", {"causal": True}),   # fully-masked rows
    ("window_d256_fp16", 1, 400, 420, 2, 2, 256, "float16", {"window": (100, 17)}),
    ("gqa4_causal_tl_d256", 1, 300, 517, 8, 2, 256, "bfloat16", {"causal": True, "causal_alignment": "top_left"}),
    ("plain_d256_fp16", 1, 256, 256, 2, 2, 256, "float16", {}),
]
QUICK_CASES = CHECK_CASES[::2]

#: (S, D, causal, Hkv) of the timing table (Hkv None: as many KV heads as query heads). The D 256
#: cells come first: they decide whether ``auto`` takes the Gluon backward at D 256 (untimed so
#: far); then the GQA cells (D 128, Hq 16, Hkv 4 and 2), then the MHA cells timed on 2026-12-03
#: (a run cut short keeps the new ones)
TIMING_CELLS = ([(s, 256, c, None) for s in (1024, 4096, 16384) for c in (False, True)]
                + [(s, 128, c, hkv) for hkv in (4, 2) for s in (4096, 16384) for c in (False, True)]
                + [(s, d, c, None) for d in (128, 64) for s in (1024, 4096, 16384) for c in (False, True)])
QUICK_CELLS = [cell for cell in TIMING_CELLS if cell[0] == 4096]


# ----- phase 2: the child ---------------------------------------------------------------------

def _grads(spec, dout, grads=None):
    """(dq, dk, dv) of ``spec`` by ops.backward after ops.forward_for_backward."""
    from portattn.backends.triton import ops
    out, lse, res = ops.forward_for_backward(spec)
    return ops.backward(spec, out, lse, dout, grads=grads, residuals=res)[:3], lse


def _check_case(case) -> dict:
    import torch
    from portattn.backends.triton import gluon_bwd

    from portattn.numerics import GRAD_FACTOR, compare
    from portattn.reference import naive_forward, reference_forward
    from portattn.spec import build_spec
    name, b, sq, sk, hq, hkv, d, dt, kw = case
    dtype = getattr(torch, dt)
    g = torch.Generator(device="cuda").manual_seed(zlib_crc(name))
    q = torch.randn(b, sq, hq, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g, device="cuda").to(dtype)
    dout = torch.randn(b, sq, hq, d, generator=g, device="cuda").to(dtype)
    spec = build_spec(q, k, v, **kw)
    row = {"case": name, "dtype": dt, "reasons": gluon_bwd.gluon_bwd_reasons(spec)}
    if row["reasons"]:
        row["passed"] = False
        return row
    ran = []
    real = gluon_bwd.gluon_backward
    gluon_bwd.gluon_backward = lambda s, *a, **k_: ran.append(1) or real(s, *a, **k_)
    try:
        poisoned = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        (dq, dk, dv), lse = _grads(spec, dout, poisoned)
        (dq2, dk2, dv2), _ = _grads(spec, dout)
        torch.cuda.synchronize()
    finally:
        gluon_bwd.gluon_backward = real
    checks = []
    for fwd, cast in ((reference_forward, torch.float64), (naive_forward, dtype)):
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (q, k, v)]
        out_r, _ = fwd(build_spec(*leaves, **kw))
        checks.append(torch.autograd.grad(out_r, leaves, dout.to(cast)))
    magnitude = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * spec.scale
    for label, got, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), *checks):
        c = compare(label, got, ref, naive, factor=GRAD_FACTOR, zero_ref_scale=magnitude)
        row[label], row[label + "_ok"] = str(c), c.passed
    empty = torch.isneginf(lse).transpose(1, 2)                  # (B, Sq, Hq) rows with no visible key
    row.update(gluon_ran=len(ran), unwritten=sum(int(torch.isnan(t).sum()) for t in (dq, dk, dv)),
               empty_rows=int(empty.sum()), empty_rows_zero=bool((dq[empty] == 0).all()) if bool(empty.any()) else True,
               repeatable=bool(torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)))
    row["passed"] = bool(row["dq_ok"] and row["dk_ok"] and row["dv_ok"] and row["gluon_ran"] == 2
                         and row["unwritten"] == 0 and row["empty_rows_zero"] and row["repeatable"])
    return row


def child_main(quick: bool) -> int:
    """Run the checks and one launch per timing shape; print one JSON line per result."""
    import torch

    from portattn.spec import build_spec
    os.environ["PORTATTN_TRITON_BACKWARD"] = "gluon"
    for case in (QUICK_CASES if quick else CHECK_CASES):
        print(f"BEGIN check {case[0]}", flush=True)
        try:
            row = _check_case(case)
        except Exception as exc:   # a launch or compile error is a failed check, with its message
            row = {"case": case[0], "passed": False, "error": f"{type(exc).__name__}: {str(exc)[-800:]}"}
        print("CHECK " + json.dumps(row), flush=True)
    for s, d, causal, hkv in (QUICK_CELLS if quick else TIMING_CELLS):
        b, h = _shape(s, d)
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, hkv or h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        t0 = time.perf_counter()
        row = {"S": s, "D": d, "causal": causal, "Hkv": hkv or h}
        print(f"BEGIN launch S={s} D={d} causal={causal} Hkv={hkv or h}", flush=True)
        try:
            grads, _ = _grads(build_spec(q, k, v, causal=causal), torch.randn_like(q))
            torch.cuda.synchronize()
            row.update(finite=all(bool(torch.isfinite(t).all()) for t in grads),
                       seconds=round(time.perf_counter() - t0, 2))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
        print("LAUNCH " + json.dumps(row), flush=True)
    return 0


def run_child(timeout: float, quick: bool) -> dict:
    c = child_lines(__file__, ["--quick"] if quick else [], timeout)
    rc, hung, checks, begun, launches = c["rc"], c["hung"], c["checks"], c["begun"], c["launches"]
    n_checks = len(QUICK_CASES if quick else CHECK_CASES)
    n_cells = len(QUICK_CELLS if quick else TIMING_CELLS)
    ok = (not hung and rc == 0 and len(checks) == n_checks and all(c.get("passed") for c in checks)
          and len(launches) == n_cells and all(x.get("finite") for x in launches))
    return {"rc": rc, "hung": hung, "last_begun": begun[-1] if begun else None, "passed": ok,
            "seconds": c["seconds"], "checks": checks, "launches": launches, "stderr_tail": c["stderr_tail"]}


# ----- phase 3: timings ---------------------------------------------------------------------------

def time_cell(s: int, d: int, causal: bool, with_gluon: bool, hkv: int | None = None) -> dict:
    """Backward-only TFLOP/s of every implementation at one cell (see the module docstring);
    ``hkv``: GQA with that many KV heads (SDPA with ``enable_gqa``)."""
    import torch
    import torch.nn.functional as F
    from portattn.backends.triton import ops
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from portattn.spec import build_spec
    b, h = _shape(s, d)
    g = torch.Generator(device="cuda").manual_seed(0)
    hkv = hkv or h
    q, dout = (torch.randn(b, s, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    row = {"S": s, "B": b, "H": h, "Hkv": hkv, "D": d, "causal": causal}
    # (name, environment while built and timed): the spec reads PORTATTN_DETERMINISTIC when built
    variants = [("triton_det", {"PORTATTN_TRITON_BACKWARD": "portable", "PORTATTN_DETERMINISTIC": "1"}),
                ("triton_atomic", {"PORTATTN_TRITON_BACKWARD": "portable", "PORTATTN_DETERMINISTIC": "0",
                                   "PORTATTN_TRITON_DQ": "atomic"})]
    if with_gluon:
        variants.insert(0, ("gluon", {"PORTATTN_TRITON_BACKWARD": "gluon", "PORTATTN_DETERMINISTIC": "1"}))
    saved = {key: os.environ.get(key) for key in ("PORTATTN_TRITON_BACKWARD", "PORTATTN_DETERMINISTIC",
                                                   "PORTATTN_TRITON_DQ")}
    for name, env in variants:
        try:
            os.environ.update(env)
            spec = build_spec(q, k, v, causal=causal)
            out, lse, res = ops.forward_for_backward(spec)
            fn = (lambda spec=spec, out=out, lse=lse, res=res: ops.backward(spec, out, lse, dout, residuals=res))
            fn()
            torch.cuda.synchronize()
            row[name] = flops / _median_ms(fn) * 1e-9
        except Exception as exc:
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            for key, val in saved.items():
                if val is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = val
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    dot = dout.transpose(1, 2).contiguous()
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                gqa = {"enable_gqa": True} if hkv != h else {}
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)
            fn = (lambda out=out: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True))
            fn()
            torch.cuda.synchronize()
            row[name] = flops / _median_ms(fn) * 1e-9
        except Exception as exc:   # e.g. a backend that does not take this shape
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


# ----- report ----------------------------------------------------------------------------------------

def _ratio(r: dict, a: str, b: str):
    return r[a] / r[b] if r.get(a) and r.get(b) else None


def report(res: dict) -> str:
    lines = [f"{res.get('device', '?')} torch {res.get('torch', '?')} triton {res.get('triton', '?')} "
             f"{res.get('date', '')}; phases (s): {json.dumps(res.get('seconds', {}))}", "", "compile (sm_90):"]
    for r in res.get("compile", []):
        lines.append("  " + " ".join(f"{k}={v}" for k, v in r.items()))
    ch = res.get("child")
    if ch:
        lines += ["", f"checks (child process, {ch['seconds']} s): {'PASS' if ch['passed'] else 'FAIL'}"
                  f"{' (killed at its time limit - a hang, or compiles from a cold cache taking longer - in ' + str(ch.get('last_begun')) + ')' if ch['hung'] else ''}"
                  f" rc={ch['rc']}"]
        for c in ch["checks"]:
            lines.append(f"  {'ok  ' if c.get('passed') else 'FAIL'} {c['case']:<22} "
                         + " ".join(f"{k}={c[k]}" for k in ("dtype", "gluon_ran", "unwritten", "empty_rows",
                                                            "empty_rows_zero", "repeatable", "reasons", "error")
                                    if k in c))
            if not c.get("passed"):
                lines += [f"       {c[k]}" for k in ("dq", "dk", "dv") if k in c]
        for x in ch["launches"]:
            lines.append(f"  launch S={x['S']} D={x['D']} causal={x['causal']} Hkv={x.get('Hkv', '-')}: "
                         + (f"finite={x['finite']} {x['seconds']} s" if "finite" in x else x.get("error", "?")))
        if not ch["passed"] and ch["stderr_tail"]:
            lines += ["  child stderr (tail):"] + ["    " + ln for ln in ch["stderr_tail"].splitlines()[-15:]]
    cells = res.get("timings", [])
    if cells:
        lines += ["", "backward TFLOP/s (bf16, 16k tokens, hidden 2048; 2.5 x 4·B·H·S²·D, halved for causal; "
                  "do_bench medians)",
                  f"{'S':>6} {'D':>4} {'causal':>6} {'Hq/Hkv':>6} {'gluon':>7} {'tr_det':>7} {'tr_atom':>7} {'flash':>7} "
                  f"{'cudnn':>7} {'g/cudnn':>8} {'g/flash':>8} {'g/tr_det':>8} {'g/tr_atom':>9}"]
        for r in cells:
            heads = f"{r.get('H', '?')}/{r.get('Hkv', r.get('H', '?'))}"
            lines.append(f"{r['S']:>6} {r['D']:>4} {str(r['causal']):>6} {heads:>6} {_fmt(r.get('gluon'))} "
                         f"{_fmt(r.get('triton_det'))} {_fmt(r.get('triton_atomic'))} {_fmt(r.get('flash'))} "
                         f"{_fmt(r.get('cudnn'))} {_fmt(_ratio(r, 'gluon', 'cudnn'), 8, 2)} "
                         f"{_fmt(_ratio(r, 'gluon', 'flash'), 8, 2)} {_fmt(_ratio(r, 'gluon', 'triton_det'), 8, 2)} "
                         f"{_fmt(_ratio(r, 'gluon', 'triton_atomic'), 9, 2)}")
            errs = {k: v for k, v in r.items() if k.endswith("_error")}
            if errs:
                lines.append("       " + json.dumps(errs))
    if res.get("skipped"):
        lines.append(f"skipped at the time limit: {res['skipped']}")
    lines += ["", f"VERDICT: {res.get('verdict', '?')}"]
    return "\n".join(lines)


def _write(out_dir: str, res: dict) -> str:
    return write_files(out_dir, "gluon_bwd_check", res, report(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for gluon_bwd_check.json / .txt")
    ap.add_argument("--time-limit", type=float, default=180.0, help="no new phase or cell starts after this (s)")
    ap.add_argument("--child-timeout", type=float, default=150.0, help="phase 2's child process limit (s)")
    ap.add_argument("--quick", action="store_true", help="D 128 compiles, half the checks, S 4k timings")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child_main(a.quick)
    if not a.out:
        ap.error("--out DIR is required")
    os.makedirs(a.out, exist_ok=True)
    start = time.perf_counter()
    faulthandler.dump_traceback_later(a.time_limit + 60, exit=True)   # never hang past the limit
    sys.path.insert(0, ROOT)
    import torch
    import triton
    from portattn.backends.triton import gluon_bwd
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU",
           "torch": torch.__version__, "triton": triton.__version__, "quick": a.quick,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "seconds": {}, "compile": [], "timings": [], "skipped": []}

    t0 = time.perf_counter()
    compiled_ok = not gluon_bwd.GLUON_ERROR
    if gluon_bwd.GLUON_ERROR:
        res["compile"].append({"error": gluon_bwd.GLUON_ERROR})
    else:
        for d in ((128,) if a.quick else gluon_bwd.HEAD_DIMS):
            launches = gluon_bwd.kernels_for(d)   # dkdv, dq; at D 256 dv, dk, dq
            for kernel, gqa in [(k, False) for k in launches] + [(k, True) for k in launches if k != "dq"]:
                try:
                    r = gluon_bwd.compile_report(kernel, d, gqa=gqa)
                    compiled_ok &= r.get("HGMMA", 1) > 0 and r.get("UTMALDG", 1) > 0
                except Exception as exc:
                    r = {"kernel": kernel, "head_dim": d, "gqa": gqa,
                         "error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
                    compiled_ok = False
                res["compile"].append(r)
                print(json.dumps(r), flush=True)
    res["seconds"]["compile"] = round(time.perf_counter() - t0, 1)
    _write(a.out, res)

    child_ok = False
    if compiled_ok and torch.cuda.is_available():
        limit = max(30.0, min(a.child_timeout, a.time_limit - (time.perf_counter() - start)))
        res["child"] = run_child(limit, a.quick)
        child_ok = res["child"]["passed"]
        res["seconds"]["checks"] = res["child"]["seconds"]
        print(report({"child": res["child"]}), flush=True)
        _write(a.out, res)

    t0 = time.perf_counter()
    if torch.cuda.is_available():
        for s, d, causal, hkv in (QUICK_CELLS if a.quick else TIMING_CELLS):
            if time.perf_counter() - start > a.time_limit:
                res["skipped"].append(f"S={s} D={d} causal={causal} Hkv={hkv or 'H'}")
                continue
            row = time_cell(s, d, causal, child_ok, hkv)
            res["timings"].append(row)
            print(json.dumps(row), flush=True)
            _write(a.out, res)
    res["seconds"]["timings"] = round(time.perf_counter() - t0, 1)
    res["verdict"] = "PASS" if compiled_ok and child_ok else "FAIL"
    print(_write(a.out, res), flush=True)
    return 0 if res["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
