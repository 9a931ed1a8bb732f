"""One H200 run for the experimental Gluon forward (``backends/triton/gluon_fwd.py``): compile
report, numerics against float64 and timings beside portattn's triton forward, SDPA flash and
cuDNN, inside a hard time limit.

    PYTHONPATH=. timeout 600 python tools/triton_gluon_check.py --out $OUT --time-limit 500

Phases (each writes its results before the next starts, so a run cut short still reports):

1. compile: the kernel for sm_90 at D 64 / 128 / 256, with and without ping-pong, and the
   training variant (``RESIDUAL``, ping-pong on), and at D 64 / 128 the persistent variant
   (``PERSISTENT``, ping-pong on, inference and training) (shared memory, registers, spills,
   setmaxnreg values, the PTX's wgmma / TMA counts, SASS HGMMA / UTMALDG / UTMASTG);
2. checks, in a child process with a timeout (a barrier deadlock there cannot hang this run; the
   persistent variant in a second child with its own, ``--pers-timeout``):
   every case against float64 with ``portattn.numerics.compare`` / ``compare_lse``, outputs
   poisoned with NaN first (an element the kernel does not write shows as NaN), fully-masked
   rows exactly 0 with lse -inf, two runs bit-identical; the training variant
   (``residual=True``, out / lse / ores poisoned): out and lse bit-identical to the inference
   run, every residual written and at most half an ulp of out, and ores against float64's
   O − round(O): max |out + ores − O| (``res_err``) below the rounding error max |out − O|
   (``round_err``) and at most twice the portable kernel's (``portable_res_err``,
   ``ops.forward_for_backward``), max |ores − (O − out)| reported (``res_vs_f64``; P V takes P in
   16 bits, so the float32 O itself is ~0.4 × round_err from float64 and the residual cannot be
   held tighter to it); then one launch at
   every timing shape; all of it for each of :data:`VARIANTS`: the kernel with and without the
   consumers' ping-pong (``PINGPONG``), and the opt-in persistent kernel (``PERSISTENT``, ping-pong
   on; at D 256 it runs the one-tile kernel);
3. timings (bf16, B·S = 16k tokens, hidden 2048: H = 2048 / D; S 1k / 4k / 16k, D 128 / 256 / 64,
   causal and not): the Gluon forward with and without ping-pong and the persistent one (D 64 /
   128) (each only if its phase-2 checks and launches passed), the triton backend's forward
   (``ops.forward``, PORTATTN_TRITON_FORWARD=portable), SDPA flash and cuDNN; medians of
   ``triton.testing.do_bench`` (L2 flushed before each run); TFLOP/s = 4·B·H·S²·D / t (halved
   for causal) and the ratios of the faster Gluon variant to cuDNN and to triton; at D 128 and 256 also
   the training forwards (with the residual): Gluon's (ping-pong on; and persistent at D 128) and
   the portable kernel's (``ops.forward_for_backward``). No new cell starts after
   ``--time-limit`` seconds; a watchdog ends the process 60 s after it.

Writes ``gluon_check.json`` and ``gluon_check.txt`` to ``--out``. Verdict PASS = compiled with
HGMMA and UTMALDG in the SASS and every check passed; timings decide nothing. Exit 0 on PASS.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
os.environ["PORTATTN_TRITON_FORWARD"] = "portable"   # phase 3's "triton" column is the portable kernel

#: (name, B, Sq, Sk, Hq, Hkv, D, dtype name, build_spec kwargs)
CHECK_CASES = [
    ("plain_d128", 2, 256, 256, 4, 4, 128, "bfloat16", {}),
    ("plain_d64_fp16", 1, 384, 384, 2, 2, 64, "float16", {}),
    ("plain_d256", 1, 192, 192, 2, 2, 256, "bfloat16", {}),
    ("ragged_d128", 1, 200, 333, 3, 3, 128, "bfloat16", {}),
    ("ragged_d64", 2, 77, 130, 2, 2, 64, "float16", {}),
    ("causal_sq<sk", 1, 130, 517, 4, 4, 128, "bfloat16", {"causal": True}),
    ("causal_sq>sk_gqa2", 1, 517, 130, 4, 2, 128, "bfloat16", {"causal": True}),   # fully-masked rows
    ("causal_top_left", 1, 300, 450, 2, 2, 64, "bfloat16", {"causal": True, "causal_alignment": "top_left"}),
    ("causal_tl_sq>sk", 1, 450, 300, 2, 2, 128, "float16", {"causal": True, "causal_alignment": "top_left"}),
    ("gqa8_d64", 2, 128, 1000, 8, 1, 64, "bfloat16", {}),
    ("causal_d256", 1, 333, 333, 2, 2, 256, "bfloat16", {"causal": True}),
    ("sq1", 3, 1, 77, 2, 2, 128, "bfloat16", {}),
    ("sk1_causal", 1, 129, 1, 2, 2, 128, "bfloat16", {"causal": True}),
    ("long_causal_d128", 1, 4096, 4096, 2, 2, 128, "bfloat16", {"causal": True}),
]

#: the consumers' ping-pong off and on (gluon_fwd._turn_wait): both are checked and timed
PINGPONGS = (False, True)

#: the kernels checked and timed: (name, ping-pong, persistent); the timing columns are
#: ``gluon_<name>`` (g_<name> in the table)
VARIANTS = [("nopp", False, False), ("pp", True, False), ("pers", True, True)]

#: (S, D, causal) of the timing table
TIMING_CELLS = [(s, d, c) for d in (128, 256, 64) for s in (1024, 4096, 16384) for c in (False, True)]


def _shape(seqlen: int, d: int) -> tuple[int, int]:
    """(batch, heads) at 16k tokens and hidden 2048."""
    return max(1, 16384 // seqlen), 2048 // d


# ----- phase 2: the child ---------------------------------------------------------------------

def case_spec(case):
    """The spec of check case ``case`` (:data:`CHECK_CASES`' layout) on cuda: q, k, v drawn from a
    generator seeded by the case's name, so every tool that runs the case feeds the same bits."""
    import torch

    from portattn.spec import build_spec
    name, b, sq, sk, hq, hkv, d, dt, kw = case
    dtype = getattr(torch, dt)
    g = torch.Generator(device="cuda").manual_seed(zlib_crc(name))
    q = torch.randn(b, sq, hq, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g, device="cuda").to(dtype)
    return build_spec(q, k, v, **kw)


def _check_case(case, pingpong: bool, persistent: bool = False) -> dict:
    import torch
    from portattn.backends.triton import gluon_fwd

    from portattn.numerics import compare, compare_lse
    from portattn.reference import naive_forward, reference_forward
    name, dt = case[0], case[7]
    dtype = getattr(torch, dt)
    spec = case_spec(case)
    row = {"case": name, "pingpong": pingpong, "persistent": persistent, "dtype": dt,
           "reasons": gluon_fwd.gluon_reasons(spec)}
    if row["reasons"]:
        row["passed"] = False
        return row
    out = torch.full(spec.out_shape, float("nan"), dtype=dtype, device="cuda")
    lse = torch.full(spec.lse_shape, float("nan"), dtype=torch.float32, device="cuda")
    gluon_fwd.gluon_forward(spec, out=out, lse=lse, pingpong=pingpong, persistent=persistent)
    out2, lse2 = gluon_fwd.gluon_forward(spec, pingpong=pingpong, persistent=persistent)
    torch.cuda.synchronize()
    ref, ref_lse = reference_forward(spec)
    c_out = compare("out", out, ref, naive_forward(spec)[0])
    c_lse = compare_lse(lse, ref_lse)
    empty = torch.isneginf(ref_lse)                       # (B, Hq, Sq) rows with no visible key
    empty_ok = bool((out.transpose(1, 2)[empty] == 0).all()) if bool(empty.any()) else True
    row.update(out=str(c_out), lse=str(c_lse), unwritten=int(torch.isnan(out).sum()) + int(torch.isnan(lse).sum()),
               empty_rows=int(empty.sum()), empty_rows_zero=empty_ok,
               repeatable=bool(torch.equal(out, out2) and torch.equal(lse, lse2)))
    row["passed"] = bool(c_out.passed and c_lse.passed and row["unwritten"] == 0 and empty_ok and row["repeatable"])
    if persistent:   # reported, not judged: the same arithmetic per tile as the one-tile kernel (ping-pong on)
        one, one_lse = gluon_fwd.gluon_forward(spec, pingpong=True, persistent=False)
        row["same_as_one_tile"] = bool(torch.equal(out, one) and torch.equal(lse, one_lse))
    res = _check_residual(spec, out, lse, ref, pingpong, persistent)
    row.update(res)
    row["passed"] = bool(row["passed"] and res["res_passed"])
    return row


def _check_residual(spec, out, lse, ref, pingpong: bool, persistent: bool = False) -> dict:
    """The training variant on ``spec`` beside the inference run's ``out`` / ``lse``: out and lse
    bit-identical, every element of out / lse / ores written (NaN-poisoned first), |ores| at most
    half an ulp of out, and ores against float64's O − round(O) (``ref`` the float64 O, canonical
    layout): ``res_err`` = max |out + ores − O| below ``round_err`` = max |out − O| (0 passes)
    and at most twice the portable kernel's ``portable_res_err`` (+1e-6); ``res_vs_f64`` = max
    |ores − (O − out)| is reported, not judged (the float32 O carries P's 16-bit rounding)."""
    import torch
    from portattn.backends.triton import gluon_fwd, ops
    o2 = torch.full_like(out, float("nan"))
    l2 = torch.full_like(lse, float("nan"))
    ores = torch.full_like(out, float("nan"))
    gluon_fwd.gluon_forward(spec, out=o2, lse=l2, ores=ores, pingpong=pingpong, residual=True, persistent=persistent)
    p_out, _, (p_res,) = ops.forward_for_backward(spec)      # PORTATTN_TRITON_FORWARD=portable here
    torch.cuda.synchronize()
    exact = ref.double()
    round_err = (out.double() - exact).abs().max().item() if out.numel() else 0.0
    res_err = (o2.double() + ores.double() - exact).abs().max().item() if out.numel() else 0.0
    portable = (p_out.double() + p_res.double() - exact).abs().max().item() if out.numel() else 0.0
    bits = {torch.bfloat16: 8, torch.float16: 11}[out.dtype]
    ulp = (out.double().abs().clamp_min(1e-30).log2().floor() - (bits - 1)).exp2()
    step = torch.finfo(out.dtype).tiny * 2.0 ** -(bits - 1)
    row = dict(res_unwritten=int(torch.isnan(o2).sum() + torch.isnan(l2).sum() + torch.isnan(ores).sum()),
               res_same_out_lse=bool(torch.equal(o2, out) and torch.equal(l2, lse)),
               res_half_ulp=bool((ores.double().abs() <= torch.clamp(ulp / 2, min=step)).all()),
               round_err=round_err, res_err=res_err, portable_res_err=portable,
               res_vs_f64=(ores.double() - (exact - out.double())).abs().max().item() if out.numel() else 0.0)
    row["res_passed"] = bool(row["res_unwritten"] == 0 and row["res_same_out_lse"] and row["res_half_ulp"]
                             and (res_err < round_err or round_err == 0) and res_err <= 2 * portable + 1e-6)
    return row


def zlib_crc(name: str) -> int:
    import zlib
    return zlib.crc32(name.encode())


def child_main(names: list[str]) -> int:
    """Run the checks and one launch per timing shape of the :data:`VARIANTS` named ``names``;
    print one JSON line per result."""
    import torch
    from portattn.backends.triton import gluon_fwd

    from portattn.spec import build_spec
    variants = [v for v in VARIANTS if v[0] in names]
    for variant, pingpong, persistent in variants:
        for case in CHECK_CASES:
            print(f"BEGIN check {case[0]} variant={variant}", flush=True)
            try:
                row = _check_case(case, pingpong, persistent)
            except Exception as exc:   # a launch or compile error is a failed check, with its message
                row = {"case": case[0], "pingpong": pingpong, "persistent": persistent, "passed": False,
                       "error": f"{type(exc).__name__}: {str(exc)[-800:]}"}
            row["variant"] = variant
            print("CHECK " + json.dumps(row), flush=True)
    for variant, pingpong, persistent in variants:
        for s, d, causal in TIMING_CELLS:
            b, h = _shape(s, d)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            t0 = time.perf_counter()
            row = {"S": s, "D": d, "causal": causal, "pingpong": pingpong, "variant": variant}
            print(f"BEGIN launch S={s} D={d} causal={causal} variant={variant}", flush=True)
            try:
                out, _ = gluon_fwd.gluon_forward(build_spec(q, k, v, causal=causal), pingpong=pingpong,
                                                 persistent=persistent)
                torch.cuda.synchronize()
                row.update(finite=bool(torch.isfinite(out).all()), seconds=round(time.perf_counter() - t0, 2))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
            print("LAUNCH " + json.dumps(row), flush=True)
    return 0


def child_lines(script: str, args: list[str], timeout: float) -> dict:
    """Run ``script --child *args`` from the repository root (killed at ``timeout`` s) and parse
    its protocol: ``rc`` (None when it hung), ``hung``, ``checks`` (the CHECK lines' JSON),
    ``begun`` (BEGIN names), ``launches`` (LAUNCH JSON), ``stderr_tail``, ``seconds``. The
    Gluon forward's and backward's check tools share it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(script), "--child", *args], capture_output=True,
                              text=True, env=env, timeout=timeout, cwd=ROOT)
        stdout, stderr, rc, hung = proc.stdout, proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as exc:   # subprocess.run kills the child on timeout
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        rc, hung = None, True
    return {"rc": rc, "hung": hung, "seconds": round(time.perf_counter() - t0, 1),
            "checks": [json.loads(ln[6:]) for ln in stdout.splitlines() if ln.startswith("CHECK ")],
            "begun": [ln[6:] for ln in stdout.splitlines() if ln.startswith("BEGIN ")],
            "launches": [json.loads(ln[7:]) for ln in stdout.splitlines() if ln.startswith("LAUNCH ")],
            "stderr_tail": stderr[-3000:]}


def write_files(out_dir: str, stem: str, res: dict, text: str) -> str:
    """``stem``.json (``res``) and ``stem``.txt (``text``) into ``out_dir`` (made if missing);
    returns ``text``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, stem + ".json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    with open(os.path.join(out_dir, stem + ".txt"), "w") as fh:
        fh.write(text + "\n")
    return text


def cudnn_forward(q, k, v, causal: bool):
    """A zero-argument function running torch SDPA's cuDNN forward on ``q``, ``k``, ``v``
    ``(B, S, H, D)`` (copied once into SDPA's ``(B, H, S, D)`` layout) and returning its output as a
    ``(B, S, H, D)`` view: the cell tools' reference and their cuDNN column."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    return run


def report_head(res: dict, *lines: str) -> list[str]:
    """A cell tool's report header: the GPU, versions, date and seconds of ``res``, then ``lines``
    (what the columns are) and a blank line."""
    env = res["env"]
    return [f"{env['gpu']} torch {env['torch']} triton {env['triton']} {env['date']}; {res['seconds']:.0f} s",
            *lines, ""]


def parse_cells(text: str) -> list[tuple[int, int]]:
    """``--cells`` of the form ``'128x512,64x2048'`` (D x S) as [(D, S), ...]."""
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",")]


def cell_tool_args(doc: str, cells_help: str, argv=None):
    """The one-call cell tools' arguments: ``--out``, ``--time-limit`` (no new cell after it) and
    ``--cells`` (``cells_help`` says their form; empty: every cell)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--time-limit", type=float, default=400, help="no new cell after this many seconds")
    ap.add_argument("--cells", default="", help=cells_help)
    return ap.parse_args(argv)


def verdict_lines(rows: list, label) -> list[str]:
    """A cell tool's last lines: how many of the rows' checks passed, each failed one (``label(row)``
    names its cell), and the verdict (FAIL without rows)."""
    bad = [(r, c) for r in rows for c in r["checks"] if not c["passed"]]
    return [f"checks: {sum(len(r['checks']) for r in rows) - len(bad)} passed, {len(bad)} failed"
            + "".join(f"\n  FAILED {label(r)}: {c}" for r, c in bad),
            "verdict: " + ("PASS" if not bad and rows else "FAIL")]


def run_cells(cells: list, keys: tuple, run_cell, report, out_dir: str, stem: str, time_limit: float) -> int:
    """The cell loop of the one-call check tools (``head_group_check``, ``q_buffers_check``):
    ``run_cell(*cell)`` for each cell (a tuple named by ``keys``, e.g. ``("d", "s")``) until
    ``time_limit`` seconds have passed (the rest listed as skipped), a cell's exception recorded as a
    failed row while the others still run; then ``report(res)`` (the rows that ran) into
    ``stem``.json / .txt in ``out_dir``, printed. Returns the exit code: 0 when the report's verdict
    is PASS and no cell raised."""
    import torch
    import triton
    t0 = time.time()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    res = {"env": {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "rows": [], "skipped": []}
    for cell in cells:
        if time.time() - t0 > time_limit:
            res["skipped"].append(list(cell))
            continue
        try:
            row = run_cell(*cell)
        except Exception as exc:   # reported as a failed check, the other cells still run
            row = {**dict(zip(keys, cell)), "error": f"{type(exc).__name__}: {str(exc)[-600:]}",
                   "checks": [{"impl": "-", "passed": False, "error": str(exc)[-300:]}], "tflops": {}}
        res["rows"].append(row)
        print(" ".join(f"{k}={v}" for k, v in zip(keys, cell)) + f": {time.time() - t0:.0f} s "
              + " ".join(f"{k}={v:.0f}" for k, v in row["tflops"].items()), flush=True)
    res["seconds"] = time.time() - t0
    ok_rows = [r for r in res["rows"] if "error" not in r]
    text = report({**res, "rows": ok_rows})
    if len(ok_rows) < len(res["rows"]):
        text += "\nerrors: " + "; ".join(" ".join(f"{k}={r[k]}" for k in keys) + f": {r['error']}"
                                         for r in res["rows"] if "error" in r)
        text = text.replace("verdict: PASS", "verdict: FAIL")
    if res["skipped"]:
        text += f"\nskipped (time limit): {res['skipped']}"
    print(write_files(out_dir, stem, res, text))
    return 0 if "verdict: PASS" in text else 1


def run_child(timeout: float, names: list[str] | None = None) -> dict:
    """Phase 2 for the :data:`VARIANTS` named ``names`` (all by default) in one child process."""
    names = [v[0] for v in VARIANTS] if names is None else names
    c = child_lines(__file__, ["--variants", ",".join(names)], timeout)
    rc, hung, checks, begun, launches = c["rc"], c["hung"], c["checks"], c["begun"], c["launches"]
    n = len(names)
    ok = (not hung and rc == 0 and len(checks) == n * len(CHECK_CASES) and all(c.get("passed") for c in checks)
          and len(launches) == n * len(TIMING_CELLS) and all(x.get("finite") for x in launches))
    # a variant whose checks and launches all passed may be timed even if another failed
    good = [name for name in names
            if sum(c.get("variant") == name for c in checks) == len(CHECK_CASES)
            and all(c.get("passed") for c in checks if c.get("variant") == name)
            and sum(x.get("variant") == name for x in launches) == len(TIMING_CELLS)
            and all(x.get("finite") for x in launches if x.get("variant") == name)]
    return {"rc": rc, "hung": hung, "last_begun": begun[-1] if begun else None, "passed": ok, "timed_variants": good,
            "seconds": c["seconds"], "checks": checks, "launches": launches, "stderr_tail": c["stderr_tail"]}


def _merge_children(a: dict, b: dict) -> dict:
    """Two :func:`run_child` results as one (checks and launches in order, passed if both did)."""
    hung = b if b["hung"] else a
    return {"rc": a["rc"] or b["rc"], "hung": a["hung"] or b["hung"], "last_begun": hung["last_begun"],
            "passed": a["passed"] and b["passed"], "timed_variants": a["timed_variants"] + b["timed_variants"],
            "seconds": round(a["seconds"] + b["seconds"], 1), "checks": a["checks"] + b["checks"],
            "launches": a["launches"] + b["launches"],
            "stderr_tail": "\n".join(x["stderr_tail"] for x in (a, b) if x["stderr_tail"])[-3000:]}


# ----- phase 3: timings ---------------------------------------------------------------------------

def _median_ms(fn) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=150, return_mode="median"))


def time_interleaved(impls: dict, setup, flops: float) -> tuple[dict, dict]:
    """TFLOP/s of each of ``impls`` (name -> (setting, fn); ``setup(setting)`` runs before each
    fn's warm-up call and its timing): the best of two :func:`_median_ms` rounds, interleaved, the
    second in reverse order; returns ``(tflops, spread)`` by name (spread: max / min − 1)."""
    import torch
    times: dict[str, list] = {n: [] for n in impls}
    for rnd in range(2):
        for name in (list(impls) if rnd == 0 else list(reversed(impls))):
            setting, fn = impls[name]
            setup(setting)
            fn()
            torch.cuda.synchronize()
            times[name].append(_median_ms(fn))
    return ({n: flops / min(ts) * 1e-9 for n, ts in times.items()},
            {n: max(ts) / min(ts) - 1 for n, ts in times.items()})


def causal_cell_tool(doc: str, cells: list, run_cell, report, stem: str, argv=None) -> int:
    """``main`` of a cell tool over (D, S, causal) cells: ``--cells`` as ``'128x512c,64x2048'`` (D x
    S, ``c`` causal; default ``cells``), then :func:`run_cells` into ``stem``.json / .txt."""
    a = cell_tool_args(doc, "e.g. '128x512c,64x2048' (D x S, c: causal); default every cell", argv)
    if a.cells:
        cells = [(int(c.split("x")[0]), int(c.split("x")[1].rstrip("c")), c.endswith("c")) for c in a.cells.split(",")]
    return run_cells(cells, ("d", "s", "causal"), run_cell, report, a.out, stem, a.time_limit)


def env_variant_cell(d: int, s: int, causal: bool, env_var: str, settings: tuple, tag: str) -> dict:
    """One cell of a persistent-forward switch tool (``q_buffers_check``, ``ring_depth_check``): bf16,
    B·S = 16k tokens, hidden 2048; the persistent Gluon forward with ``env_var`` set to each of
    ``settings`` in turn, inference and training (O's rounding residual). Every setting's outputs
    (out, lse, residual) must be bit-identical to the first's (a switch of when things load, not of
    the arithmetic), and the first's inference output is compared once with cuDNN's; then TFLOP/s of
    each (``p@<tag><setting>``, ``p_train@<tag><setting>``) and cuDNN's, interleaved
    (:func:`time_interleaved`). Returns the row; ``env_var`` is unset afterwards."""
    import torch
    from portattn.backends.triton import gluon_fwd

    from portattn.spec import build_spec

    def setting(n):
        if n is None:
            os.environ.pop(env_var, None)
        else:
            os.environ[env_var] = str(n)

    b, h = _shape(s, d)
    g = torch.Generator(device="cuda").manual_seed(1000 * d + s + causal)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    spec = build_spec(q, k, v, causal=causal)
    cudnn = cudnn_forward(q, k, v, causal)
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    row = {"d": d, "s": s, "causal": causal, "batch": b, "heads": h, "checks": [], "tflops": {}}
    impls = {}
    for residual in (False, True):
        name = "p_train" if residual else "p"
        outs = {}
        for n in settings:
            setting(n)
            res = gluon_fwd.gluon_forward(spec, persistent=True, residual=residual)
            torch.cuda.synchronize()
            outs[n] = [t.clone() for t in res]
        same = all(torch.equal(x, y) for n in settings[1:] for x, y in zip(outs[settings[0]], outs[n]))
        check = {"impl": name, "bit_identical": same}
        if not residual:
            ref = cudnn()
            check["max_abs_vs_cudnn"] = float((outs[settings[0]][0].float() - ref.float()).abs().max())
            check["passed"] = same and check["max_abs_vs_cudnn"] < 2e-2
        else:
            check["passed"] = same
        row["checks"].append(check)
        for n in settings:
            impls[f"{name}@{tag}{n}"] = (n, lambda r=residual: gluon_fwd.gluon_forward(spec, persistent=True, residual=r))
    impls["cudnn"] = (None, cudnn)
    row["tflops"], row["spread"] = time_interleaved(impls, setting, flops)
    setting(None)
    return row


def time_cell(s: int, d: int, causal: bool, variants: list) -> dict:
    """One timing row; ``variants``: the names of :data:`VARIANTS` whose checks passed."""
    import torch
    from portattn.backends.triton import gluon_fwd, ops

    from portattn.spec import build_spec
    b, h = _shape(s, d)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    spec = build_spec(q, k, v, causal=causal)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    row = {"S": s, "B": b, "H": h, "D": d, "causal": causal}
    # the persistent kernel only where it exists (at D 256 it would time the one-tile kernel again)
    timed = [(name, pp, pers) for name, pp, pers in VARIANTS
             if name in variants and (not pers or d in gluon_fwd.PERSISTENT_HEAD_DIMS)]
    impls = [(f"gluon_{name}", lambda pp=pp, pers=pers: gluon_fwd.gluon_forward(spec, pingpong=pp, persistent=pers))
             for name, pp, pers in timed]
    impls.append(("triton", lambda: ops.forward(spec)))
    if d in (128, 256):   # the training forwards (with O's rounding residual): Gluon's, if its checks passed
        if "pp" in variants:
            impls.append(("gluon_train", lambda: gluon_fwd.gluon_forward(spec, pingpong=True, residual=True,
                                                                         persistent=False)))
        if any(pers for _, _, pers in timed):
            impls.append(("gluon_pers_train", lambda: gluon_fwd.gluon_forward(spec, pingpong=True, residual=True,
                                                                              persistent=True)))
        impls.append(("triton_train", lambda: ops.forward_for_backward(spec)))
    return time_impls(row, impls, q, k, v, causal, flops)


def time_impls(row: dict, impls: list, q, k, v, causal: bool, flops: float) -> dict:
    """Time each ``(name, fn)`` of ``impls`` and SDPA's flash and cuDNN backends on ``q, k, v``
    ``(B, S, H, D)`` into ``row[name]`` (TFLOP/s of ``flops`` at the median time; a call that
    raises is reported as ``row[name + "_error"]``); returns ``row``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        impls = impls + [(name, sdpa)]
    for name, fn in impls:
        try:
            fn()
            torch.cuda.synchronize()
            row[name] = flops / _median_ms(fn) * 1e-9
        except Exception as exc:   # e.g. a backend that does not take this shape
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


# ----- report ----------------------------------------------------------------------------------------

def _fmt(x, w=7, p=1):
    return f"{x:>{w}.{p}f}" if isinstance(x, (int, float)) and math.isfinite(x) else f"{'-':>{w}}"


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
            lines.append(f"  {'ok  ' if c.get('passed') else 'FAIL'} {c['case']:<20} "
                         + " ".join(f"{k}={c[k]}" for k in ("variant", "pingpong", "persistent", "dtype", "unwritten",
                                                            "empty_rows", "empty_rows_zero", "repeatable",
                                                            "same_as_one_tile", "reasons", "error") if k in c))
            if "res_passed" in c:
                lines.append(f"       residual {'ok' if c['res_passed'] else 'FAIL'}: "
                             + " ".join(f"{k}={c[k]:.3g}" if isinstance(c[k], float) else f"{k}={c[k]}"
                                        for k in ("res_unwritten", "res_same_out_lse", "res_half_ulp", "round_err",
                                                  "res_err", "portable_res_err", "res_vs_f64") if k in c))
            if not c.get("passed"):
                lines += [f"       {c.get('out', '')}", f"       {c.get('lse', '')}"]
        for x in ch["launches"]:
            lines.append(f"  launch S={x['S']} D={x['D']} causal={x['causal']} "
                         f"{x.get('variant', 'pingpong=' + str(x.get('pingpong')))}: "
                         + (f"finite={x['finite']} {x['seconds']} s" if "finite" in x else x.get("error", "?")))
        if not ch["passed"] and ch["stderr_tail"]:
            lines += ["  child stderr (tail):"] + ["    " + ln for ln in ch["stderr_tail"].splitlines()[-15:]]
    cells = res.get("timings", [])
    if cells:
        lines += ["", "forward TFLOP/s (bf16, 16k tokens, hidden 2048; do_bench medians, L2 flushed)",
                  f"{'S':>6} {'D':>4} {'causal':>6} {'g_pp':>7} {'g_nopp':>7} {'g_pers':>7} {'triton':>7} "
                  f"{'flash':>7} {'cudnn':>7} {'best/cudnn':>10} {'best/triton':>11} {'pers/pp':>7}",
                  "  (g_pp / g_nopp: the Gluon forward with / without the consumers' ping-pong; g_pers: the "
                  "persistent one (opt-in, ping-pong on, D 64/128); best = the fastest of the three)"]
        for r in cells:
            best = max((r[k] for k in ("gluon_pp", "gluon_nopp", "gluon_pers") if k in r), default=None)
            gc = best / r["cudnn"] if best and r.get("cudnn") else None
            gt = best / r["triton"] if best and r.get("triton") else None
            pers, pp = r.get("gluon_pers"), r.get("gluon_pp")
            lines.append(f"{r['S']:>6} {r['D']:>4} {str(r['causal']):>6} {_fmt(r.get('gluon_pp'))} "
                         f"{_fmt(r.get('gluon_nopp'))} {_fmt(pers)} {_fmt(r.get('triton'))} {_fmt(r.get('flash'))} "
                         f"{_fmt(r.get('cudnn'))} {_fmt(gc, 10, 2)} {_fmt(gt, 11, 2)} "
                         f"{_fmt(pers / pp if pers and pp else None, 7, 2)}")
            errs = {k: v for k, v in r.items() if k.endswith("_error")}
            if errs:
                lines.append("       " + json.dumps(errs))
        train = [r for r in cells if "triton_train" in r or "gluon_train" in r]
        if train:
            lines += ["", "training forward TFLOP/s (with O's rounding residual; Gluon with ping-pong; g_pers_train "
                      "the persistent one, D 128)",
                      f"{'S':>6} {'D':>4} {'causal':>6} {'g_train':>7} {'g_pers_train':>12} {'t_train':>7} {'g_pp':>7} "
                      f"{'g/t':>6} {'g_train/g_pp':>12} {'pers/g_train':>12}"]
            for r in train:
                g, t, pp = r.get("gluon_train"), r.get("triton_train"), r.get("gluon_pp")
                gp = r.get("gluon_pers_train")
                lines.append(f"{r['S']:>6} {r['D']:>4} {str(r['causal']):>6} {_fmt(g)} {_fmt(gp, 12)} {_fmt(t)} "
                             f"{_fmt(pp)} {_fmt(g / t if g and t else None, 6, 2)} "
                             f"{_fmt(g / pp if g and pp else None, 12, 2)} {_fmt(gp / g if gp and g else None, 12, 2)}")
    if res.get("skipped"):
        lines.append(f"skipped at the time limit: {res['skipped']}")
    lines += ["", f"VERDICT: {res.get('verdict', '?')}"]
    return "\n".join(lines)


def _write(out_dir: str, res: dict) -> str:
    return write_files(out_dir, "gluon_check", res, report(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for gluon_check.json / .txt")
    ap.add_argument("--time-limit", type=float, default=500.0, help="no new phase or cell starts after this (s)")
    ap.add_argument("--child-timeout", type=float, default=300.0, help="phase 2's child process limit (s)")
    ap.add_argument("--pers-timeout", type=float, default=200.0,
                    help="the persistent variant's own child process limit (s): a deadlock there costs this much")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child_main(a.variants.split(","))
    if not a.out:
        ap.error("--out DIR is required")
    os.makedirs(a.out, exist_ok=True)
    start = time.perf_counter()
    faulthandler.dump_traceback_later(a.time_limit + 60, exit=True)   # never hang past the limit
    sys.path.insert(0, ROOT)
    import torch
    import triton
    from portattn.backends.triton import gluon_fwd
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU",
           "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "seconds": {}, "compile": [], "timings": [], "skipped": []}

    t0 = time.perf_counter()
    compiled_ok = not gluon_fwd.GLUON_ERROR
    if gluon_fwd.GLUON_ERROR:
        res["compile"].append({"error": gluon_fwd.GLUON_ERROR})
    else:
        for d in gluon_fwd.HEAD_DIMS:
            rows = [(pp, False, False) for pp in PINGPONGS] + [(True, True, False)]
            if d in gluon_fwd.PERSISTENT_HEAD_DIMS:
                rows += [(True, False, True), (True, True, True)]
            for pp, residual, persistent in rows:
                try:
                    r = gluon_fwd.compile_report(d, False, pingpong=pp, residual=residual, persistent=persistent)
                    compiled_ok &= r.get("HGMMA", 1) > 0 and r.get("UTMALDG", 1) > 0
                except Exception as exc:
                    r = {"head_dim": d, "pingpong": pp, "residual": residual, "persistent": persistent,
                         "error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
                    compiled_ok = False
                res["compile"].append(r)
                print(json.dumps(r), flush=True)
    res["seconds"]["compile"] = round(time.perf_counter() - t0, 1)
    _write(a.out, res)

    child_ok, variants = False, []
    if compiled_ok and torch.cuda.is_available():
        # the one-tile kernels first, then the persistent one in a child of its own (not yet run on a
        # GPU: a deadlock there must not cost the others their checks and timings)
        limit = max(30.0, min(a.child_timeout, a.time_limit - (time.perf_counter() - start)))
        first = run_child(limit, [v[0] for v in VARIANTS if not v[2]])
        limit = max(30.0, min(a.pers_timeout, a.time_limit - (time.perf_counter() - start)))
        res["child"] = _merge_children(first, run_child(limit, [v[0] for v in VARIANTS if v[2]]))
        child_ok = res["child"]["passed"]
        variants = res["child"]["timed_variants"]
        res["seconds"]["checks"] = res["child"]["seconds"]
        print(report({"child": res["child"]}), flush=True)
        _write(a.out, res)

    t0 = time.perf_counter()
    if torch.cuda.is_available():
        for s, d, causal in TIMING_CELLS:
            if time.perf_counter() - start > a.time_limit:
                res["skipped"].append(f"S={s} D={d} causal={causal}")
                continue
            row = time_cell(s, d, causal, variants)
            res["timings"].append(row)
            print(json.dumps(row), flush=True)
            _write(a.out, res)
    res["seconds"]["timings"] = round(time.perf_counter() - t0, 1)
    res["verdict"] = "PASS" if compiled_ok and child_ok else "FAIL"
    print(_write(a.out, res), flush=True)
    return 0 if res["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
