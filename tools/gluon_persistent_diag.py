"""Tell a hang of the persistent Gluon forward (``gluon_fwd.PERSISTENT``) from a slow or wrong
launch, on an H200.

On its first GPU run ``tools/triton_gluon_check.py``'s persistent child was killed at its time
limit in ``causal_sq<sk`` (B 1, Sq 130, Sk 517, H 4, D 128, causal), the first of its cases with
(a) a causal band (``LONGEST_FIRST``) and (b) a second warpgroup whose 64 query rows all lie past
Sq (a Q box wholly outside the rank-4 descriptor); it proved to be cold-cache compile time
(benchmarks/results/triton-gluon-persistent-h200.txt). This tool runs one small problem per child
process, each with its own timeout, over cases that separate those causes, plus walks of several
work items per CTA (the grid forced small through ``gluon_fwd._sm_count``), and reports per case:
ok (max error against float64 within the bf16/fp16 rule), wrong, error, or hung.

    python tools/gluon_persistent_diag.py [--out DIR] [--timeout 90] [--jobs 4] [--cases a,b]
    python tools/gluon_persistent_diag.py --sequence   # the check's cases in its order, one
                                                       # process, every launch traced to stdout
    python tools/gluon_persistent_diag.py --time       # pers vs one-tile vs SDPA, D 64/128, to stdout
    python tools/gluon_persistent_diag.py --time --cells 2048:128:1,8192:128:1   # these cells only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

#: (name, B, Sq, Sk, H, D, causal, alignment, grid (None: one CTA per SM), residual, what it isolates)
CASES = [
    ("plain_grid1", 1, 256, 256, 2, 128, False, "bottom_right", 1, False, "4 items on one CTA, full tiles"),
    ("plain_oob_wg1", 1, 130, 517, 4, 128, False, "bottom_right", None, False, "WG1's Q box past Sq, no band"),
    ("plain_oob_wg1_d64", 1, 130, 517, 4, 64, False, "bottom_right", None, False, "as above at D 64"),
    ("causal_full_tiles", 1, 256, 517, 4, 128, True, "bottom_right", None, False, "causal, no box past Sq"),
    ("causal_square", 1, 256, 256, 2, 128, True, "bottom_right", None, False, "causal Sq = Sk"),
    ("causal_top_left", 1, 256, 517, 2, 128, True, "top_left", None, False, "causal off = 0"),
    ("causal_oob_wg1", 1, 130, 517, 4, 128, True, "bottom_right", None, False, "the check's hung case"),
    ("causal_grid1", 1, 512, 512, 1, 128, True, "bottom_right", 1, False, "4 causal items on one CTA"),
    ("causal_grid2_d64", 2, 384, 384, 2, 64, True, "bottom_right", 2, False, "12 causal items on 2 CTAs"),
    ("plain_grid3_residual", 2, 256, 256, 2, 128, False, "bottom_right", 3, True, "training variant, 8 items / 3"),
    ("long_causal", 1, 4096, 4096, 2, 128, True, "bottom_right", None, False, "64 items on 64 CTAs"),
    ("long_plain_many", 4, 2048, 2048, 16, 128, False, "bottom_right", None, False, "1024 items on 132 CTAs"),
    ("plain_grid2_d256", 1, 384, 384, 2, 256, False, "bottom_right", 2, False, "D 256, O in Q's tile: 6 items / 2"),
    ("causal_grid1_d256_res", 1, 520, 520, 1, 256, True, "bottom_right", 1, True,
     "D 256 causal training, 5 items on one CTA (an odd count: a pair past the end)"),
    ("causal_oob_d256", 1, 130, 517, 4, 256, True, "bottom_right", None, False, "D 256, WG1's Q box past Sq"),
]


def run_case(name: str) -> dict:
    """In this (child) process: launch the persistent kernel on case ``name`` and compare."""
    import torch
    from portattn.backends.triton import gluon_fwd

    from portattn.reference import reference_forward
    from portattn.spec import build_spec
    case = {c[0]: c for c in CASES}[name]
    _, b, sq, sk, h, d, causal, align, grid, residual, _ = case
    if grid is not None:
        gluon_fwd._sm_count = lambda device, n=grid: n
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to("cuda", torch.bfloat16) for s in (sq, sk, sk))
    spec = build_spec(q, k, v, causal=causal, causal_alignment=align)
    t0 = time.perf_counter()
    res = gluon_fwd.gluon_forward(spec, persistent=True, residual=residual)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    out, lse = res[0], res[1]
    ref, ref_lse = reference_forward(spec)
    err = (out.double() - ref.to(out.device).double()).abs().max().item()
    finite = ref_lse.to(lse.device).isfinite()
    lerr = (lse.double() - ref_lse.to(lse.device).double())[finite].abs().max().item() if finite.any() else 0.0
    ok = err < 2e-2 and lerr < 1e-3 and not out.isnan().any().item()
    return dict(case=name, status="ok" if ok else "wrong", max_err=err, lse_err=lerr, seconds=round(seconds, 2))


def _check_tool():
    """tools/triton_gluon_check.py as a module (its cases, its checks and its timing rows)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import triton_gluon_check
    return triton_gluon_check


def run_sequence() -> None:
    """In this (child) process: tools/triton_gluon_check.py's persistent checks in its order, with a
    line before and after every Gluon launch (its arguments, the seconds since the start), so a
    hang shows which launch it was."""
    import torch
    from portattn.backends.triton import gluon_fwd
    chk = _check_tool()
    t0 = time.perf_counter()
    real = gluon_fwd.gluon_forward

    def traced(spec, **kw):
        what = (f"B{spec.batch} Sq{spec.seqlen_q} Sk{spec.seqlen_k} H{spec.num_heads_q}/{spec.num_heads_kv} "
                f"D{spec.head_dim} causal={spec.causal} {spec.dtype} "
                + " ".join(f"{k}={v if k in ('pingpong', 'residual', 'persistent') else 'given'}"
                           for k, v in kw.items() if v is not None))
        print(f"{time.perf_counter() - t0:7.1f} LAUNCH {what}", flush=True)
        res = real(spec, **kw)
        torch.cuda.synchronize()
        print(f"{time.perf_counter() - t0:7.1f} DONE", flush=True)
        return res

    gluon_fwd.gluon_forward = traced
    for case in chk.CHECK_CASES:
        print(f"{time.perf_counter() - t0:7.1f} CASE {case[0]}", flush=True)
        row = chk._check_case(case, True, True)
        print(f"{time.perf_counter() - t0:7.1f} RESULT {case[0]} passed={row.get('passed')}", flush=True)


def time_cells(cells: str = "") -> list:
    """In this (child) process: tools/triton_gluon_check.py's timing rows at D 64/128 (or the
    ``cells`` given, ``S:D:causal`` comma-separated, e.g. ``2048:128:1``) for the one-tile
    (ping-pong) and persistent kernels beside the portable one and SDPA's flash / cuDNN."""
    chk = _check_tool()
    rows = []
    todo = ([(int(x), int(y), bool(int(z))) for x, y, z in (c.split(":") for c in cells.split(","))] if cells
            else [c for c in chk.TIMING_CELLS if c[1] in (64, 128)])
    for s, d, causal in todo:
        rows.append(chk.time_cell(s, d, causal, ["pp", "pers"]))
        print("TIME " + json.dumps(rows[-1]), flush=True)
    return rows


def _child(name: str, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True,
                           timeout=timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return dict(case=name, status="hung", seconds=round(time.perf_counter() - start, 1))
    rows = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    if rows:
        return rows[0]
    return dict(case=name, status="error", rc=p.returncode, tail=(p.stdout + p.stderr)[-1500:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--cases", default="")
    ap.add_argument("--sequence", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--cells", default="", help="--time: S:D:causal,... instead of the check tool's cells")
    a = ap.parse_args(argv)
    if a.sequence or a.time:   # both print to stdout
        run_sequence() if a.sequence else time_cells(a.cells)
        return 0
    if a.child:
        print("ROW " + json.dumps(run_case(a.child)), flush=True)
        return 0
    names = [c[0] for c in CASES if not a.cases or c[0] in a.cases.split(",")]
    with ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda n: _child(n, a.timeout), names))
    what = {c[0]: c[-1] for c in CASES}
    lines = [f"{r['case']:<22} {r['status']:<6} " + " ".join(f"{k}={r[k]}" for k in ("max_err", "lse_err", "seconds", "rc")
                                                           if k in r) + f"   ({what[r['case']]})" for r in rows]
    lines += [f"--- {r['case']}:\n{r['tail']}" for r in rows if r.get("tail")]
    print("\n".join(lines))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gluon_persistent_diag.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
        with open(os.path.join(a.out, "gluon_persistent_diag.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
