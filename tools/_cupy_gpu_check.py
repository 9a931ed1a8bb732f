"""Pieces the cupy GPU check tools share (tools/cupy_fwd_check.py, tools/cupy_wgmma_check.py,
tools/cupy_wgmma_bwd_check.py): the sm_90a + mma.sync compile pool with its NVRTC report, and
the subprocess runs (pytest, a child process of the tool) with a timeout.

Imported the way these tools import each other: ``tools/`` on ``sys.path`` (the directory of
the script being run, or ``sys.path.insert(0, HERE)``), then ``from _cupy_gpu_check import ...``.
Not a tool itself; standard library only at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ----- compile ------------------------------------------------------------------------------------
def nvrtc_report() -> str:
    """Which NVRTC builds the sm_90a modules here (cuda.bindings or CuPy's; its version), or
    ``none: <why>``."""
    try:
        from portattn.backends.cupy import sm90a

        nv = sm90a.nvrtc_binding()
        return f"{type(nv).__name__.strip('_')} {'.'.join(map(str, nv.version()))}"
    except Exception as exc:
        return f"none: {type(exc).__name__}: {exc}"[:300]


def compile_modules(jobs, workers: int) -> dict:
    """Compile in a spawn process pool; ``jobs``: (function, config tuple) pairs, the function
    (cupy_wgmma_check._compile_sm90a, cupy_gpu_dev._compile_one) answering (config, seconds,
    error, info). Prints a line per module; returns {"errors", "modules", "sass" (empty: the
    caller fills it), "nvrtc"}, a module's entry {"seconds", and the ptxas report (``info``) or
    {"registers": info}}."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    res = {"errors": [], "modules": {}, "sass": {}, "nvrtc": nvrtc_report()}
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(fn, c) for fn, c in jobs]
        for f in futs:
            cfg, secs, err, info = f.result()
            print(f"{'FAIL' if err else 'ok  '} {cfg} {secs:.1f}s {err or ''}", flush=True)
            if err:
                res["errors"].append(f"{cfg}: {err}")
            else:
                res["modules"][str(cfg)] = {"seconds": secs, **(info if isinstance(info, dict) and "kernels" in info
                                                                else {"registers": info})}
    return res


def run_info() -> dict:
    """The head of a check's result: device, capability, torch version, date (UTC), "seconds": {}."""
    import torch

    return {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": {}}


def write_result(out_dir: str, stem: str, res: dict, report) -> str:
    """``<stem>.json`` (``res``, every number) and ``<stem>.txt`` (``report(res)``) in ``out_dir``;
    returns the text."""
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    text = report(res)
    with open(os.path.join(out_dir, f"{stem}.txt"), "w") as f:
        f.write(text + "\n")
    return text


def report_head(res: dict, warnings: bool = False) -> list:
    """A report's first lines: device, torch, date and the phases' seconds; the compile errors
    (count, NVRTC, the first 3) and each kernel's registers / spills / stack / smem from
    compile_modules' result in ``res["compile"]`` (and each module's ptxas warnings: ``warnings``)."""
    L = [f"{res.get('device', '?')} torch {res.get('torch', '?')} {res.get('date', '')}; phases (s): "
         f"{json.dumps({k: round(v, 1) for k, v in res.get('seconds', {}).items()})}"]
    c = res.get("compile", {})
    L.append(f"compile errors: {len(c.get('errors', []))}; NVRTC {c.get('nvrtc', '?')}")
    L += ["  " + e[:1500] for e in c.get("errors", [])[:3]]
    for key, m in c.get("modules", {}).items():
        for kname, k in m.get("kernels", {}).items():
            L.append(f"  {kname:<44} regs {k['registers']} spill {k['spill_stores']}/{k['spill_loads']} "
                     f"stack {k['stack']} smem {k['smem']}")
        if warnings:
            for w in m.get("warnings", []):
                L.append(f"  WARNING {key}: {w[:300]}")
        L += _no_registers_lines(key, m)
    return L


def _no_registers_lines(key: str, m: dict) -> list:
    """For a module some kernel of which parsed with no registers: which NVRTC made its log,
    whether it came from the cache or is a PTX fallback's, and the log's lines about the kernel."""
    missing = [k for k, v in m.get("kernels", {}).items() if v.get("registers") is None]
    if not missing or "log" not in m:
        return []
    L = [f"  NO REGISTERS in {key} for {', '.join(missing)}: NVRTC {m.get('nvrtc', '?')}, cached {m.get('cached')}, "
         f"PTX fallback {m.get('ptx_fallback')}"]
    try:
        from portattn.backends.cupy.compile_check import log_context

        for k in missing[:1]:
            L += ["    " + ln for ln in log_context(m["log"], m.get("lowered", {}).get(k, ""), limit=4000).splitlines()]
    except Exception as exc:   # the report never fails for its diagnostics
        L.append(f"    (no log context: {type(exc).__name__}: {exc})")
    return L


# ----- subprocesses -------------------------------------------------------------------------------
def child_env() -> dict:
    """This process's environment with the repository root first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_captured(cmd, timeout_s: float, env: dict | None = None):
    """Run ``cmd`` in the repository root; (return code, stdout + stderr), or ("timeout", what
    stdout held when the timeout killed it)."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=child_env() if env is None else env, capture_output=True, text=True,
                           timeout=timeout_s)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        return "timeout", exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")


def run_pytest(args, timeout_s: float, tail: int, env: dict | None = None) -> dict:
    """``python -m pytest *args`` with at least 5 s: {"rc" (or "timeout"), "passed", "seconds",
    "tail" (the last ``tail`` lines of its output)}."""
    t0 = time.perf_counter()
    rc, out = run_captured([sys.executable, "-m", "pytest", *args], max(timeout_s, 5), env)
    return {"rc": rc, "passed": rc == 0, "seconds": time.perf_counter() - t0, "tail": out.strip().splitlines()[-tail:]}


def time_side_by_side(fns: dict, flops: float, clock=None, rounds: int = 5, round_ms: float = 5.0) -> dict:
    """Each callable of ``fns`` timed against the others with portattn.timing.compare — the
    fastest policy's and the benchmark's method: a warm-up, then interleaved rounds of
    back-to-back calls between two CUDA events, the L2 cache flushed before each sample, the
    median over rounds — as ``{name}_tflops`` (``flops`` per call), or ``{name}_error`` for a
    callable that raised. One call timed alone between two events (the earlier method) charges
    the host's launch latency to kernels of a few hundred microseconds and put the same kernel at
    half its grid speed (D 256 S 1k). ``clock``: default a CudaClock on the current GPU."""
    from portattn import timing

    if clock is None:
        import torch

        clock = timing.CudaClock(torch.device("cuda"))
    res = timing.compare(fns, clock, warmup=2, warmup_ms=20.0, rounds=rounds, round_ms=round_ms, samples_per_round=2)
    row = {}
    for name, t in res.items():
        if t.error is not None or not t.ms:
            row[f"{name}_error"] = t.error or "no time"
        else:
            row[f"{name}_tflops"] = flops / t.ms * 1e-9
            row[f"{name}_spread"] = round(t.spread, 4)
    return row
