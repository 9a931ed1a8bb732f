"""One GPU run for the cupy backend's sm_90a wgmma backward (issue 16): compile report, numerics
against float64, bit-identical repeats and timings beside the mma.sync backward, SDPA flash (FA2)
and cuDNN, inside a hard time limit.

    PYTHONPATH=. timeout 200 python tools/cupy_wgmma_bwd_check.py --out $OUT --time-limit 185

Phases (each writes its results before the next starts, so a run cut short still reports):

1. compile: the sm_90a modules (attn_bwd_wgmma: preprocess, dK/dV, dQ; and the wgmma forward
   the checks use), fp16/bf16, padded head dim 64 / 128, through :mod:`portattn.backends.cupy.sm90a`,
   and the mma.sync backward modules through CuPy, in a process pool; registers / spills / stack
   per kernel from the ptxas log, HGMMA / HMMA / LDL / STL counts from ``cuobjdump -sass``;
2. checks, in a child process with a timeout (an illegal address or a hang in the new kernels
   costs only the child): dq, dk, dv of the wgmma backward (NaN-poisoned outputs, so an element
   the kernels never write shows) on ragged sizes, causal (both alignments), Sq != Sk, rows with
   no visible key, CTAs with no key, GQA / MQA, window, varlen, Dv != D, padded HD 40 -> 64,
   Sq = 1, a gradient through lse (dlse), fp16 and bf16, against float64 under the equivalence
   rule (``portattn.numerics.compare``, factor 3, as tests/test_cupy.py), two runs bit-identical,
   dq of rows with no visible key and dv of keys no row sees exactly 0, and the distance to the
   mma.sync backward; the other walk of the wgmma kernels (:data:`OTHER_WALK`: products left in
   flight across tiles, or not) must give the same bits (its own verdict line);
3. timings, in a child process with a timeout (bf16, B*S = 16k tokens, hidden 2048; S 1k / 4k /
   16k, D 64 / 128, causal and not): the backward alone (preprocess, dK/dV, dQ) of wgmma, its
   other walk and mma.sync, and SDPA flash (FA2) and cuDNN's backward, TFLOP/s (2.5 x the forward's
   4 B H S^2 D, halved when causal) and ratios; only when every check passed;
4. tests: tests/test_cupy_wgmma_bwd.py in a subprocess with the time that is left (the same
   checks through the public switch ``PORTATTN_CUPY_BACKWARD=wgmma``, plus the test_cupy cases;
   a timeout there is reported, not a failure).

Writes ``wgmma_bwd_check.json`` and ``wgmma_bwd_check.txt`` to ``--out`` (the children also
``bwd_checks.json`` / ``bwd_timings.json``) and prints the report, a short table last. Verdict
PASS = compiled, no spills, HGMMA in every wgmma kernel's SASS, every check (and the tests, when
run) passed; timings decide nothing. Exit 0 on PASS, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _cupy_gpu_check import (  # noqa: E402
    child_env,
    report_head,
    run_captured,
    run_info,
    run_pytest,
    write_result,
)
from cupy_fwd_check import _fmt, _ratio  # noqa: E402  (the forward check's table helpers)

#: (name, B, Sq, Sk, Hq, Hkv, D, Dv, kwargs, dtype); kwargs "varlen": sequence lengths, "dlse": a
#: gradient through the returned lse too
CHECK_CASES = [
    ("d64", 2, 333, 333, 4, 2, 64, 64, {}, "bfloat16"),
    ("d64_causal_br", 2, 300, 400, 4, 2, 64, 64, {"causal": True}, "bfloat16"),
    ("d128", 2, 257, 391, 4, 2, 128, 128, {}, "bfloat16"),
    ("d128_causal_br_sq_gt_sk", 1, 400, 300, 4, 4, 128, 128, {"causal": True}, "bfloat16"),
    ("d128_causal_tl", 2, 200, 333, 4, 2, 128, 128, {"causal": True, "causal_alignment": "top_left"}, "bfloat16"),
    ("d128_fp16_causal_long", 1, 1500, 1500, 2, 1, 128, 128, {"causal": True}, "float16"),
    ("d64_fp16_gqa", 2, 300, 300, 8, 2, 64, 64, {}, "float16"),
    ("d128_dv64", 1, 190, 250, 2, 2, 128, 64, {"causal": True}, "bfloat16"),
    ("d40_pad64", 1, 100, 150, 2, 2, 40, 40, {}, "float16"),
    ("d128_window", 2, 300, 300, 2, 2, 128, 128, {"window": (70, 20)}, "bfloat16"),
    ("d64_varlen_causal", 3, None, None, 4, 2, 64, 64, {"varlen": [1, 230, 64], "causal": True}, "bfloat16"),
    ("d128_varlen_window", 3, None, None, 2, 2, 128, 128, {"varlen": [77, 5, 200], "window": (40, 0)}, "bfloat16"),
    ("d128_seqlen1", 2, 1, 257, 4, 4, 128, 128, {}, "bfloat16"),
    ("d128_empty_ctas", 2, 300, 20, 4, 1, 128, 128, {"causal": True}, "bfloat16"),
    ("d128_mqa_long_dlse", 1, 1024, 1024, 8, 1, 128, 128, {"causal": True, "dlse": True}, "bfloat16"),
    ("d64_dlse_window_tl", 2, 200, 300, 4, 4, 64, 64, {"window": (30, 10), "causal_alignment": "top_left",
                                                       "dlse": True}, "bfloat16"),
    # HD 256: one warpgroup accumulates dV, the other dK, of the same 64 keys; dQ against 64-key
    # tiles (one V buffer: windows and ragged ends make the two warpgroups skip different tiles
    # around its CTA barrier)
    ("d256", 2, 257, 391, 4, 2, 256, 256, {}, "bfloat16"),
    ("d256_causal_br_sq_gt_sk", 1, 400, 300, 4, 4, 256, 256, {"causal": True}, "bfloat16"),
    ("d256_fp16_dv192_window", 1, 200, 260, 2, 1, 256, 192, {"window": (50, 10)}, "float16"),
    ("d256_varlen_causal_dlse", 3, None, None, 4, 2, 256, 256, {"varlen": [1, 150, 70], "causal": True,
                                                                 "dlse": True}, "bfloat16"),
    ("d240_pad256_empty_ctas", 2, 300, 20, 2, 1, 240, 240, {"causal": True}, "bfloat16"),
]
#: where the checks run (tests/test_cupy_wgmma_bwd_tool.py runs them on the CPU with the kernels
#: replaced by the float64 reference, to check this script's own plumbing)
DEVICE = "cuda"
#: The wgmma backward's walk that ``auto`` does not build (configs.WGMMA_BWD_OVERLAP), checked bit
#: for bit against the default and timed beside it: ``tile=(1,)`` overlapped across tiles, ``(0,)`` not.
sys.path.insert(0, ROOT)
from portattn.backends.cupy import configs as _configs  # noqa: E402

OTHER_WALK = (int(not _configs.WGMMA_BWD_OVERLAP),)   # at WGMMA_BWD_OVERLAP_HEAD_DIMS (HD 256: one walk)
OTHER_WALK_NAME = ("the walk that leaves each tile's dV/dK and dQ in flight into the next"
                   if OTHER_WALK[0] else "the walk that retires each tile's products within it")
ALT_TILES_NAME = (f"at HD {'/'.join(map(str, _configs.WGMMA_BWD_TWO_CTA_CAPABLE))}: the "
                  + ("one-CTA tiles" if _configs.WGMMA_BWD_TWO_CTA_HEAD_DIMS else "two-CTA tiles"))
#: The fused atomic-dQ dK/dV kernels, as families of this tool: family -> configs.FUSED_DQ_ROLES role
#: ("fused" the two-warpgroup kernel, PORTATTN_CUPY_DQ=atomic; "ws" the warp-specialized one that
#: auto runs, configs.WGMMA_BWD_FUSED_DQ_AUTO_ROLE), as (role, persistent: the plan's grid,
#: runtime._work_item_grid: one CTA per SM, "ws1" one per work item, "ws3" three CTAs taking every
#: item: checked, not timed)
FUSED_FAMILIES = {"fused": ("dkdv_dq", None), "ws": ("dkdv_dq_ws", True), "ws1": ("dkdv_dq_ws", False),
                  "ws3": ("dkdv_dq_ws", 3)}
#: the fused families timed
TIMED_FUSED = ("fused", "ws", "ws1")
#: timed cells (S, D, causal), most informative first
TIME_CELLS = [(s, d, c) for s in (4096, 1024, 16384) for d in (128, 256, 64) for c in (False, True)]


def has_other_walk(dt: str, d: int, dv: int) -> bool:
    """Whether the wgmma backward of a problem has the other walk (not at padded HD 256, nor where
    ``auto`` takes the two-CTA tiles, which have the serial walk only)."""
    cfg = _configs.wgmma_backward_config(dt, d, dv)
    return cfg.head_dim in _configs.WGMMA_BWD_OVERLAP_HEAD_DIMS and not cfg.bwd_two_cta


def has_alt_tiles(dt: str, d: int, dv: int) -> bool:
    """Whether the wgmma backward of a problem has other tiles to check and time (``alt``): the
    two-CTA tiles where ``auto`` does not take them, the one-CTA ones where it does
    (configs.WGMMA_BWD_TWO_CTA_CAPABLE)."""
    return _configs.wgmma_backward_config(dt, d, dv).head_dim in _configs.WGMMA_BWD_TWO_CTA_CAPABLE


# ----- phase 1: compile ---------------------------------------------------------------------------
def compile_phase(workers: int) -> dict:
    from _cupy_gpu_check import compile_modules
    from cupy_gpu_dev import _compile_one
    from cupy_wgmma_check import _compile_sm90a, sass_counts
    from portattn.backends.cupy import configs

    dts, hds = configs.TENSOR_CORE_DTYPES, configs.WGMMA_BWD_HEAD_DIMS
    wg = [(fam, dt, hd, None) for fam in ("bwd_wgmma", "fwd_wgmma") for hd in hds for dt in dts]
    wg += [("bwd_wgmma", dt, hd, configs.wgmma_bwd_other_walk(hd)) for hd in configs.WGMMA_BWD_OVERLAP_HEAD_DIMS
           for dt in dts]   # the other walk (overlapped or not)
    wg += [("bwd_wgmma", dt, hd, configs.wgmma_bwd_other_tiles(hd)) for hd in configs.WGMMA_BWD_TWO_CTA_CAPABLE
           for dt in dts]   # the other tiles (two CTAs per SM or one)
    mma = [(c.family, c.dtype, c.head_dim, c.tile, c.kv_stages)
           for c in (configs.backward_config(dt, hd, hd, mode="auto") for hd in hds for dt in dts)]
    res = compile_modules([(_compile_sm90a, c) for c in wg] + [(_compile_one, c) for c in mma], workers)
    for key, m in res["modules"].items():
        if "cubin" in m and "bwd_wgmma" in key:
            res["sass"][key] = sass_counts(m["cubin"])
    return res


# ----- phase 2: checks (child) --------------------------------------------------------------------
def _inputs(case):
    """cupy_wgmma_check's inputs of a case, on DEVICE, without the "dlse" flag (check_case's)."""
    from cupy_wgmma_check import _inputs as case_inputs

    q, k, v, kw, g = case_inputs(case, DEVICE)
    kw.pop("dlse", None)
    return q, k, v, kw, g


def _config(family: str, dt: str, d: int, dv: int):
    """The backward module of ``family``: "wgmma" (the sm_90a kernels as ``auto`` builds them;
    "fused", "ws", "ws1", "ws3": the same module, whose fused-dQ kernel of :data:`FUSED_FAMILIES`
    :func:`_plan` runs on its grid),
    "other" (the same with the other walk, :data:`OTHER_WALK`: overlapped across tiles or not),
    "alt" (the other tiles, :func:`has_alt_tiles`), "mma" (mma.sync)."""
    from portattn.backends.cupy import configs

    if family == "mma":
        return configs.backward_config(dt, d, dv, mode="auto")
    cfg = configs.wgmma_backward_config(dt, d, dv)
    if family == "wgmma" or family in FUSED_FAMILIES:
        return cfg
    tile = (configs.wgmma_bwd_other_tiles if family == "alt" else configs.wgmma_bwd_other_walk)(cfg.head_dim)
    return configs.KernelConfig(cfg.family, cfg.dtype, cfg.head_dim, tile=tile)


def has_fused(dt: str, d: int, dv: int) -> bool:
    """Whether the wgmma backward of a problem has the fused atomic-dQ dK/dV kernel (``fused``)."""
    return _configs.wgmma_backward_config(dt, d, dv).has_fused_dq


def _plan(spec, out, lse, dout, dlse, family: str):
    """The backward plan of ``family`` (:func:`_config`; ``fused``, ``ws``, ``ws1``, ``ws3``: the wgmma
    module's fused atomic-dQ dK/dV kernel of that role, every other family the deterministic dK/dV
    and dQ kernels)."""
    from portattn.backends.cupy import runtime

    dt = runtime._DTYPE_NAMES[spec.dtype]
    cfg = _config(family, dt, spec.head_dim, spec.head_dim_v)
    role, persistent = FUSED_FAMILIES.get(family, (False, None))
    return runtime.plan_backward(spec, out, lse, dout, cfg, dlse, fused_dq=role if cfg.family == "bwd_wgmma" else None,
                                 persistent=persistent)


def run_backward(spec, out, lse, dout, dlse, family: str, poison: bool = True):
    """dq, dk, dv of ``family`` (:func:`_plan`), forced (no switch); ``poison``: the gradient
    buffers' visible parts are NaN before the launch."""
    import torch
    from portattn.backends.cupy import runtime

    plan = _plan(spec, out, lse, dout, dlse, family)
    if poison and plan.launches:
        for t in plan.outputs:
            t.fill_(float("nan"))
    runtime.execute(plan, spec.device)
    if spec.device.type == "cuda":
        torch.cuda.synchronize()
    return plan.outputs


def check_case(case) -> dict:
    import torch
    from portattn.backends.cupy import configs, runtime

    from portattn.numerics import compare
    from portattn.reference import naive_forward, reference_forward
    from portattn.spec import build_spec

    q, k, v, kw, g = _inputs(case)
    with_dlse = bool(case[8].get("dlse"))
    spec = build_spec(q, k, v, **kw)
    dt = runtime._DTYPE_NAMES[spec.dtype]
    plan = runtime.plan_forward(spec, configs.wgmma_forward_config(dt, spec.head_dim, spec.head_dim_v))
    runtime.execute(plan, spec.device)
    out, lse = plan.outputs
    dout = torch.randn(spec.out_shape, generator=g, device=DEVICE).to(spec.dtype)
    dlse = torch.randn(spec.lse_shape, generator=g, device=DEVICE) if with_dlse else None
    if dlse is not None:
        dlse = dlse.masked_fill(torch.isneginf(lse), 0.0)   # rows with lse -inf: no gradient through them
    g1 = run_backward(spec, out, lse, dout, dlse, "wgmma")
    g2 = run_backward(spec, out, lse, dout, dlse, "wgmma")
    gm = run_backward(spec, out, lse, dout, dlse, "mma", poison=False)
    go = (run_backward(spec, out, lse, dout, dlse, "other")   # the other walk: the same bits expected
          if has_other_walk(dt, spec.head_dim, spec.head_dim_v) else None)
    # the other tiles: other summation orders, so checked against float64 as the default is
    alt = ((run_backward(spec, out, lse, dout, dlse, "alt"), run_backward(spec, out, lse, dout, dlse, "alt"))
           if has_alt_tiles(dt, spec.head_dim, spec.head_dim_v) else None)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        o, lse_r = fn(build_spec(*leaves, **kw))
        outs, seeds = [o], [dout.to(o.dtype)]
        if dlse is not None:
            keep = torch.isfinite(lse_r)
            outs.append(torch.where(keep, lse_r, torch.zeros_like(lse_r)))
            seeds.append(dlse.to(lse_r.dtype))
        return torch.autograd.grad(outs, leaves, seeds)

    ref, naive = grads(reference_forward, torch.float64), grads(naive_forward, spec.dtype)
    zs = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * spec.scale
    if dlse is not None:
        zs += dlse.abs().max().item() * k.abs().max().item() * spec.scale
    row = {"case": case[0], "dtype": case[-1], "D": spec.head_dim, "Dv": spec.head_dim_v, "grads": {},
           "repeat_bit_identical": all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(g1, g2))}
    if go is not None:
        row["other_walk_bit_identical"] = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(g1, go))
    ok = row["repeat_bit_identical"]   # the other walk's equality has its own verdict line
    for name, a, m, r, n in zip(("dq", "dk", "dv"), g1, gm, ref, naive):
        c = compare(name, a, r, n, factor=3, zero_ref_scale=zs)
        diff = float((a.double() - m.double()).abs().nan_to_num(1e30).max()) if a.numel() else 0.0
        row["grads"][name] = {"passed": c.passed, "score": c.score, "max_err": c.max_err, "tol": c.tolerance,
                              "nan": int(torch.isnan(a).sum()), "max_diff_vs_mma": diff, "text": str(c)}
        ok = ok and c.passed and row["grads"][name]["nan"] == 0
    if alt is not None:
        a1, a2 = alt
        rep = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(a1, a2))
        cs = [compare(name, a, r, n, factor=3, zero_ref_scale=zs) for name, a, r, n in zip(("dq", "dk", "dv"), a1, ref, naive)]
        row["alt"] = {"passed": rep and all(c.passed and not torch.isnan(a).any() for c, a in zip(cs, a1)),
                      "repeat_bit_identical": rep, "scores": [c.score for c in cs], "text": [str(c) for c in cs]}
        ok = ok and row["alt"]["passed"]
    fused_dq = {}   # family -> its dq (rows with no visible key are checked below)
    for fam in (FUSED_FAMILIES if has_fused(dt, spec.head_dim, spec.head_dim_v) else ()):
        # the fused atomic dQ: dq's sum order varies, so checked against float64 (dk / dv come from
        # the same arithmetic in the same order as the two-kernel backward's: the same bits)
        f1, f2 = run_backward(spec, out, lse, dout, dlse, fam), run_backward(spec, out, lse, dout, dlse, fam)
        cs = [compare(name, a, r, n, factor=3, zero_ref_scale=zs) for name, a, r, n in zip(("dq", "dk", "dv"), f1, ref, naive)]
        same = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(f1[1:], g1[1:]))
        row[fam] = {"passed": same and all(c.passed and not torch.isnan(a).any() for c, a in zip(cs, f1)),
                    "dkdv_equal_kernel": same, "scores": [c.score for c in cs], "text": [str(c) for c in cs],
                    "dq_repeat_bit_identical": torch.equal(f1[0].nan_to_num(7.0), f2[0].nan_to_num(7.0)),
                    "dq_max_diff_vs_kernel": float((f1[0].double() - g1[0].double()).abs().nan_to_num(1e30).max())
                    if f1[0].numel() else 0.0}
        fused_dq[fam] = f1[0]
        ok = ok and row[fam]["passed"]
    _, ref_lse = reference_forward(build_spec(q.double(), k.double(), v.double(), **kw))
    empty = torch.isneginf(ref_lse)
    row["empty_rows"] = int(empty.sum())
    if bool(empty.any()):
        rows = empty.transpose(0, 1) if spec.is_varlen else empty.transpose(1, 2)
        row["empty_rows_zero_dq"] = bool((g1[0][rows] == 0).all()) and all(bool((d[rows] == 0).all())
                                                                           for d in fused_dq.values())
        ok = ok and row["empty_rows_zero_dq"]
    unseen = (ref[2] == 0).all(dim=-1)   # keys no query sees: float64 dv = sum_i P_ij dO_i is exactly 0
    row["unseen_keys"] = int(unseen.sum())
    if row["unseen_keys"]:
        row["unseen_keys_zero_dv"] = bool((g1[2][unseen] == 0).all())
        ok = ok and row["unseen_keys_zero_dv"]
    row["passed"] = ok
    if not ok:
        row["blocks"] = error_blocks(spec, g1, ref)
    return row


def error_blocks(spec, grads, ref) -> dict:
    """Where a failing gradient is wrong: the max error per 64-row block of dq (a dQ warpgroup's
    rows) and per 64-key block of dk / dv (a dK/dV warpgroup's keys), over heads, batch entries and
    columns, and per 64-column block; NaN (never written) counts as 1e30."""
    out = {}
    for name, a, r in zip(("dq", "dk", "dv"), grads, ref):
        err = (a.double() - r.double()).abs().nan_to_num(1e30)
        err = err if spec.is_varlen else err.amax(dim=0)   # (tokens, heads, D)
        by_tok = err.amax(dim=(1, 2))
        by_col = err.amax(dim=(0, 1))
        out[name] = {"per_64_tokens": [round(float(by_tok[i:i + 64].max()), 4) for i in range(0, by_tok.numel(), 64)],
                     "per_64_cols": [round(float(by_col[j:j + 64].max()), 4) for j in range(0, by_col.numel(), 64)]}
    return out


def _child_loop(out_dir: str, name: str, items, fn, time_limit: float, reserve: float) -> int:
    t0 = time.perf_counter()
    res = {"rows": [], "skipped": []}
    path = os.path.join(out_dir, name)
    for item in items:
        if time_limit - (time.perf_counter() - t0) < reserve:
            res["skipped"].append(str(item[:1] if isinstance(item[0], str) else item))
            continue
        try:
            row = fn(item)
        except Exception as exc:
            row = {"item": str(item)[:200], "passed": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        res["rows"].append(row)
        print(json.dumps(row, default=str)[:2000], flush=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


# ----- phase 4: timings (child) -------------------------------------------------------------------
def time_cell(cell) -> dict:
    import torch
    import torch.nn.functional as F
    from _cupy_gpu_check import time_side_by_side
    from portattn.backends.cupy import configs, runtime
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from portattn.spec import build_spec

    seqlen, d, causal = cell
    heads, batch = 2048 // d, max(1, 16384 // seqlen)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, d, generator=g, device="cuda").to(torch.bfloat16)
                     for _ in range(4))
    spec = build_spec(q, k, v, causal=causal)
    fwd = runtime.plan_forward(spec, configs.wgmma_forward_config("bfloat16", d, d))   # compiled in phase 1
    runtime.execute(fwd, spec.device)
    out, lse = fwd.outputs
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
    row = {"S": seqlen, "B": batch, "H": heads, "D": d, "causal": causal}
    fams = (("wgmma",) + (("other",) if has_other_walk("bfloat16", d, d) else ())
            + (("alt",) if has_alt_tiles("bfloat16", d, d) else ())
            + (TIMED_FUSED if has_fused("bfloat16", d, d) else ()) + ("mma",))
    fns = {fam: (lambda plan=_plan(spec, out, lse, dout, None, fam): runtime.execute(plan, spec.device))
           for fam in fams}
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
    do = dout.transpose(1, 2)
    for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:   # the backward kernel is the one the forward's op recorded
            with sdpa_kernel(be):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            fns[name] = lambda o=o: torch.autograd.grad(o, (qt, kt, vt), do, retain_graph=True)
        except Exception as exc:
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    row.update(time_side_by_side(fns, flops))
    return row


def run_child(kind: str, out_dir: str, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--out", out_dir, "--time-limit",
           str(max(timeout_s - 6, 5))]
    t0 = time.perf_counter()
    rc, out = run_captured(cmd, max(timeout_s, 10))
    tail = out.strip().splitlines()[-4:] if rc == "timeout" else out.strip().splitlines()[-8:]
    try:
        with open(os.path.join(out_dir, f"bwd_{kind}.json")) as f:
            data = json.load(f)
    except Exception:
        data = {"rows": [], "skipped": []}
    data.update({"rc": rc, "tail": tail, "seconds": time.perf_counter() - t0})
    return data


def run_tests(timeout_s: float) -> dict:
    env = child_env()
    env["PORTATTN_CUPY_FORWARD"] = "wgmma"   # the forward modules phase 1 compiled (sm_90a: fast)
    return run_pytest(["-q", "-x", "-p", "no:cacheprovider", "tests/test_cupy_wgmma_bwd.py"], timeout_s, tail=12,
                      env=env)


# ----- report -------------------------------------------------------------------------------------
def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def check_failures(res: dict) -> list[str]:
    """Why the kernels cannot be trusted: compile errors, failed or missing gradient checks (what
    gates the timings; a spill or a test failure does not)."""
    why = []
    if res.get("compile", {}).get("errors"):
        why.append(f"{len(res['compile']['errors'])} compile error(s)")
    rows = res.get("checks", {}).get("rows", [])
    bad = [r.get("case", r.get("item")) for r in rows if not r.get("passed")]
    if bad or len(rows) < len(CHECK_CASES):
        why.append(f"checks failed: {bad}" if bad else
                   f"only {len(rows)}/{len(CHECK_CASES)} checks ran (rc={res.get('checks', {}).get('rc')})")
    return why


def verdict(res: dict) -> None:
    c = res.get("compile", {})
    why = check_failures(res)
    # the opt-in overlapped walk's kernels (not what auto builds) may spill up to 8 bytes, as
    # tests/test_cupy_wgmma_bwd.py allows under NVRTC < 13.5 (13.0 spills 4 in its HD 128 dK/dV)
    opt_in = {n for cfg in _configs.wgmma_configs() if cfg.family == "bwd_wgmma" and cfg.bwd_overlap
              and cfg != _configs.KernelConfig("bwd_wgmma", cfg.dtype, cfg.head_dim)
              for role, n in cfg.kernel_names().items() if role != "dkdv_dq"}   # that one: the default's
    # ... and the fused-dQ dK/dV where configs allows it a few bytes (HD 128: 4 under NVRTC 13.0 / 13.5)
    opt_in |= {cfg.kernel_names()["dkdv_dq"] for cfg in _configs.wgmma_configs() if cfg.has_fused_dq
               and cfg.head_dim in _configs.WGMMA_BWD_FUSED_DQ_SPILL_BYTES}
    # ... and the split dK/dV (HD > 128, 64-row tiles) up to configs.WGMMA_BWD_SPLIT_SPILL_BYTES
    split = _configs.wgmma_bwd_split_names()
    # ... and the warp-specialized ones up to configs.WGMMA_BWD_WS_SPILL_BYTES (their producer runs
    # on 24 / 56 registers; at HD 128 the consumers on 240)
    ws = {cfg.kernel_names()[role] for cfg in _configs.wgmma_configs() if cfg.has_fused_dq
          for role in _configs.WS_FUSED_DQ_ROLES}
    spills, allowed = [], []
    for m in c.get("modules", {}).values():
        for k, r in m.get("kernels", {}).items():
            worst = max(r.get("spill_stores") or 0, r.get("spill_loads") or 0, r.get("stack") or 0)
            if "wgmma" in k and worst:
                ok = ((k in opt_in and worst <= 8) or (k in ws and worst <= _configs.WGMMA_BWD_WS_SPILL_BYTES)
                      or (k in split and worst <= _configs.WGMMA_BWD_SPLIT_SPILL_BYTES))
                (allowed if ok else spills).append(k)
    if spills:
        why.append(f"spills/stack in {spills}")
    res["opt_in_spills"] = allowed
    hg = [cnt.get("HGMMA", 0) for s in c.get("sass", {}).values() if isinstance(s, dict)
          for name, cnt in s.items() if isinstance(cnt, dict) and "wgmma" in name]
    if not hg or min(hg) == 0:
        why.append("no HGMMA in some wgmma backward kernel's SASS" if hg else "SASS not inspected")
    t = res.get("tests")
    if t is not None and isinstance(t.get("rc"), int) and t["rc"] != 0:   # a timeout is reported, not failed
        why.append(f"tests rc={t.get('rc')}")
    res["verdict"] = "FAIL" if why else "PASS"
    res["why"] = "; ".join(why)


def report(res: dict) -> str:
    L = report_head(res)
    c = res.get("compile", {})
    for s in c.get("sass", {}).values():
        for kname, cnt in (s.items() if isinstance(s, dict) else []):
            L.append(f"  SASS {kname[:60]}: {cnt}")
    ch = res.get("checks")
    if ch is not None:
        L.append(f"checks child: rc={ch.get('rc')} in {ch.get('seconds', 0):.0f}s; skipped {ch.get('skipped')}")
        if ch.get("rc") not in (0, None):
            L += ["  " + x[:300] for x in ch.get("tail", [])]
        for r in ch.get("rows", []):
            if "error" in r:
                L.append(f"  {str(r.get('item'))[:40]:<28} ERROR {r['error'][:800]}")
                continue
            gs = r["grads"]
            L.append(f"  {r['case']:<26} {r['dtype']:<9} "
                     + " ".join(f"{n} {_fmt(gs[n]['score'], 6, 3)}" for n in ("dq", "dk", "dv"))
                     + f" rep {str(r['repeat_bit_identical'])[0]} =other {str(r.get('other_walk_bit_identical'))[0]}"
                     + (f" alt {'/'.join(_fmt(x, 5, 3) for x in r['alt']['scores'])} "
                        f"{'ok' if r['alt']['passed'] else 'FAIL'}" if "alt" in r else "")
                     + "".join(f" {fam} {'/'.join(_fmt(x, 5, 3) for x in r[fam]['scores'])} "
                               f"dkdv= {str(r[fam]['dkdv_equal_kernel'])[0]} "
                               f"dq rep {str(r[fam]['dq_repeat_bit_identical'])[0]} "
                               f"{'ok' if r[fam]['passed'] else 'FAIL'}" for fam in FUSED_FAMILIES if fam in r)
                     + f" empty {r['empty_rows']}"
                     + (f"/{str(r['empty_rows_zero_dq'])[0]}" if "empty_rows_zero_dq" in r else "")
                     + f" unseen {r.get('unseen_keys', 0)}"
                     + (f"/{str(r['unseen_keys_zero_dv'])[0]}" if "unseen_keys_zero_dv" in r else "")
                     + " vs mma " + "/".join(f"{gs[n]['max_diff_vs_mma']:.2g}" for n in ("dq", "dk", "dv"))
                     + f" {'ok' if r['passed'] else 'FAIL'}")
            if not r["passed"]:
                L += [f"    {gs[n]['text']} (nan {gs[n]['nan']})" for n in ("dq", "dk", "dv")]
                for n, b in r.get("blocks", {}).items():
                    L.append(f"    {n} max err per 64 tokens {b['per_64_tokens'][:24]} per 64 cols {b['per_64_cols']}")
    t = res.get("tests")
    if t:
        L.append(f"tests/test_cupy_wgmma_bwd.py: rc={t['rc']} {'PASS' if t['passed'] else 'FAIL'} in {t['seconds']:.0f}s")
        L += ["  " + x for x in t["tail"][-6:]]
    tm = res.get("timings")
    if tm is not None:
        L.append(f"timings child: rc={tm.get('rc')} in {tm.get('seconds', 0):.0f}s; skipped {tm.get('skipped')}")
        if tm.get("rc") not in (0, None):
            L += ["  " + x[:300] for x in tm.get("tail", [])]
    L += ["", f"VERDICT (attn_bwd_*_wgmma): {res.get('verdict', 'INCOMPLETE')}" + (f" ({res['why']})" if res.get("why")
                                                                                   else "")]
    if res.get("opt_in_spills"):
        L.append(f"(allowed: spills in {res['opt_in_spills']}: <= 8 bytes in the opt-in overlapped walk's and the "
                 f"fused dQ's at HD 128, <= {_configs.WGMMA_BWD_SPLIT_SPILL_BYTES} in HD 256's split dK/dV, "
                 f"<= {_configs.WGMMA_BWD_WS_SPILL_BYTES} in the warp-specialized one)")
    other = [r["other_walk_bit_identical"] for r in (ch or {}).get("rows", []) if "other_walk_bit_identical" in r]
    L.append(f"the other walk ({OTHER_WALK_NAME}): "
             + ("NOT RUN" if not other else "PASS (the same bits in every check)" if all(other)
                else f"FAIL (different bits in {other.count(False)} of {len(other)} checks)"))
    rows = [r for r in (tm or {}).get("rows", []) if "wgmma_tflops" in r]
    if rows:
        L += ["bf16 backward TFLOP/s, B*S = 16k tokens, hidden 2048 (the backward alone)",
              f"(other = {OTHER_WALK_NAME}; its gradients must equal wgmma's bit for bit)",
              f"(alt = the other tiles, {ALT_TILES_NAME}, checked against float64)",
              "(fused = dQ fused into dK/dV with float32 atomics, not deterministic; checked against float64)",
              "(ws = the same by the warp-specialized dK/dV kernel, one CTA per SM taking work items; ws1 = ws with "
              "one CTA per work item)",
              f"{'S':>6} {'D':>4} {'causal':>6} {'wgmma':>6} {'other':>6} {'alt':>6} {'fused':>6} {'mma':>6} {'FA2':>6} "
              f"{'cuDNN':>6} {'ot/wg':>6} {'alt/wg':>6} {'fu/wg':>6} {'fu/FA2':>6} {'wg/mma':>6} {'wg/FA2':>6} "
              f"{'wg/cuDNN':>8} {'mma/FA2':>7}"]
        for r in rows:
            L.append(f"{r['S']:>6} {r['D']:>4} {str(r['causal']):>6} {_fmt(r['wgmma_tflops'], 6, 1)} "
                     f"{_fmt(r.get('other_tflops'), 6, 1)} {_fmt(r.get('alt_tflops'), 6, 1)} "
                     f"{_fmt(r.get('fused_tflops'), 6, 1)} "
                     f"{_fmt(r['mma_tflops'], 6, 1)} {_fmt(r.get('fa2_tflops'), 6, 1)} {_fmt(r.get('cudnn_tflops'), 6, 1)} "
                     f"{_fmt(_ratio(r, 'other_tflops', 'wgmma_tflops'))} {_fmt(_ratio(r, 'alt_tflops', 'wgmma_tflops'))} "
                     f"{_fmt(_ratio(r, 'fused_tflops', 'wgmma_tflops'))} {_fmt(_ratio(r, 'fused_tflops', 'fa2_tflops'))} "
                     f"{_fmt(_ratio(r, 'wgmma_tflops', 'mma_tflops'))} {_fmt(_ratio(r, 'wgmma_tflops', 'fa2_tflops'))} "
                     f"{_fmt(_ratio(r, 'wgmma_tflops', 'cudnn_tflops'), 8)} {_fmt(_ratio(r, 'mma_tflops', 'fa2_tflops'), 7)}"
                     + (f"  ws {_fmt(r.get('ws_tflops'), 6, 1)} ws1 {_fmt(r.get('ws1_tflops'), 6, 1)} "
                        f"ws/ws1 {_fmt(_ratio(r, 'ws_tflops', 'ws1_tflops'))} "
                        f"ws/fu {_fmt(_ratio(r, 'ws_tflops', 'fused_tflops'))} "
                        f"ws/FA2 {_fmt(_ratio(r, 'ws_tflops', 'fa2_tflops'))}"
                        if "ws_tflops" in r else ""))
        for a, b in (("wgmma_tflops", "mma_tflops"), ("wgmma_tflops", "fa2_tflops"), ("other_tflops", "wgmma_tflops"),
                     ("other_tflops", "fa2_tflops"), ("alt_tflops", "wgmma_tflops"), ("alt_tflops", "fa2_tflops"),
                     ("fused_tflops", "wgmma_tflops"), ("fused_tflops", "fa2_tflops"), ("fused_tflops", "cudnn_tflops"),
                     ("ws_tflops", "fused_tflops"), ("ws1_tflops", "fused_tflops"), ("ws_tflops", "ws1_tflops"),
                     ("ws_tflops", "fa2_tflops"), ("mma_tflops", "fa2_tflops")):
            xs = [_ratio(r, a, b) for r in rows]
            gm = _geomean(xs)
            if gm:
                xs = [x for x in xs if x]
                L.append(f"{a[:-7]} / {b[:-7]}: geomean {gm:.3f} over {len(xs)} cells, min {min(xs):.3f}, "
                         f"max {max(xs):.3f}")
    return "\n".join(L)


def _write(out_dir, res) -> str:
    return write_result(out_dir, "wgmma_bwd_check", res, report)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--time-limit", type=float, default=185.0, help="seconds for the whole run (default 185)")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--no-tests", action="store_true", help="skip tests/test_cupy_wgmma_bwd.py")
    p.add_argument("--timings-limit", type=float, default=80.0,
                   help="seconds at most for the timings child (default 80; cells it cannot reach are listed)")
    p.add_argument("--checks-limit", type=float, default=110.0,
                   help="seconds at most for the checks child (default 110: each fused family runs twice per case)")
    p.add_argument("--child", choices=("checks", "timings"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.time_limit <= 0:
        p.error("--time-limit must be positive")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    left = lambda: a.time_limit - (time.perf_counter() - t0)  # noqa: E731
    os.makedirs(a.out, exist_ok=True)
    sys.path.insert(0, ROOT)
    for var in ("PORTATTN_CUPY_FORWARD", "PORTATTN_CUPY_BACKWARD"):
        os.environ.pop(var, None)
    if a.child == "checks":
        return _child_loop(a.out, "bwd_checks.json", CHECK_CASES, check_case, a.time_limit, reserve=4)
    if a.child == "timings":
        return _child_loop(a.out, "bwd_timings.json", TIME_CELLS, time_cell, a.time_limit, reserve=5)
    res = run_info()
    t = time.perf_counter()
    res["compile"] = compile_phase(a.workers)
    res["seconds"]["compile"] = time.perf_counter() - t
    _write(a.out, res)
    t = time.perf_counter()
    res["checks"] = run_child("checks", a.out, min(a.checks_limit, left() - 45))
    res["seconds"]["checks"] = time.perf_counter() - t
    verdict(res)
    _write(a.out, res)
    if not check_failures(res) and left() > 15:   # timings of kernels that failed a check mean nothing
        t = time.perf_counter()
        res["timings"] = run_child("timings", a.out, min(a.timings_limit, left() - 6))
        res["seconds"]["timings"] = time.perf_counter() - t
        _write(a.out, res)
    if not a.no_tests and left() > 25:
        t = time.perf_counter()
        res["tests"] = run_tests(left() - 5)
        res["seconds"]["tests"] = time.perf_counter() - t
        verdict(res)
    res["seconds"]["total"] = time.perf_counter() - t0
    print(_write(a.out, res), flush=True)
    return 0 if res["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
