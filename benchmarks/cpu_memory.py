"""Wall time and peak memory of attention on the CPU: torch SDPA's default, portattn's default
(``chunked``) and portattn's ``sdpa`` backend (torch's fused CPU kernel forward, its math kernel
under a gradient: backends/sdpa.py).

Problem: ``(B, S, H, D)`` float32, causal, S = 1024 … 8192 (forward), and forward+backward at
one size. Each measurement runs in a fresh subprocess (Linux): it builds the inputs, makes one
small warm-up call of the same implementation (imports, first-call setup), resets the kernel's
peak-RSS counter (``/proc/self/clear_refs`` = 5), runs the call once and reads the peak
(``VmHWM``). ``peak_rss_mib`` is the whole process (what the 2× target compares),
``peak_delta_mib`` the peak minus the resident set before the call. Threads default to 1 so that
a shared machine gives repeatable times (``--threads``).

The table is printed; ``--out`` writes the JSON report and a ``.txt`` copy of the table next to it
(the committed ones are ``benchmarks/results/cpu-default.{json,txt}``)::

    python benchmarks/cpu_memory.py                                    # printed only
    python benchmarks/cpu_memory.py --seqlens 1024 2048 --skip sdpa
    python benchmarks/cpu_memory.py --out benchmarks/results/cpu-default.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

IMPLS = {
    "torch": "torch SDPA (default kernel choice)",
    "chunked": "portattn default (chunked)",
    "sdpa": "portattn backend='sdpa'",
}

CHILD = r"""
import json, sys, time
import torch
import portattn

impl, mode = sys.argv[1], sys.argv[2]
b, s, h, d, threads = map(int, sys.argv[3:8])
torch.set_num_threads(threads)

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

def call(q, k, v):
    if impl == "torch":
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)
    return portattn.attention(q, k, v, causal=True, backend=None if impl == "chunked" else impl)

grad = mode == "fwd+bwd"
gen = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(b, s, h, d, generator=gen) for _ in range(4))
w = [torch.randn(1, 8, h, d, requires_grad=grad) for _ in range(3)]
out = call(*w)                                   # warm-up: imports and first-call setup
if grad:
    out.sum().backward()
if grad:
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
del out, w
with open("/proc/self/clear_refs", "w") as f:   # reset the peak-RSS counter (VmHWM) to the current RSS
    f.write("5")
before = status_kib("VmRSS")
t0 = time.perf_counter()
out = call(q, k, v)
if grad:
    out.backward(dout)
seconds = time.perf_counter() - t0
peak = status_kib("VmHWM")
if impl == "chunked":   # after the measurement: explain() asks every backend (and imports onnxruntime)
    assert portattn.explain(q, k, v, causal=True).selected == "chunked", "chunked is not the CPU default"
print(json.dumps({"seconds": seconds, "peak_rss_mib": peak / 1024, "peak_delta_mib": (peak - before) / 1024,
                  "rss_before_mib": before / 1024, "finite": bool(torch.isfinite(out).all())}))
"""


def measure(impl: str, mode: str, b: int, s: int, h: int, d: int, threads: int, timeout: int) -> dict:
    cmd = [sys.executable, "-c", CHILD, impl, mode, str(b), str(s), str(h), str(d), str(threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if result.returncode != 0:
        err = result.stderr.strip().splitlines()
        return {"error": err[-1] if err else f"rc={result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':<8} {'S':>6}  {'implementation':<38} {'seconds':>9} {'peak RSS MiB':>13} "
             f"{'delta MiB':>10} {'RSS before':>11}"]
    for r in rows:
        lines.append(f"{r['mode']:<8} {r['seqlen']:>6}  {IMPLS[r['impl']]:<38} {_fmt(r.get('seconds'), '9.2f')} "
                     f"{_fmt(r.get('peak_rss_mib'), '13.1f')} {_fmt(r.get('peak_delta_mib'), '10.1f')} "
                     f"{_fmt(r.get('rss_before_mib'), '11.1f')}"
                     + (f"  {r['error']}" if "error" in r else ""))
    return "\n".join(lines)


def ratios(rows: list[dict], mode: str, s: int) -> dict:
    """chunked and sdpa against torch SDPA at one size: peak RSS and time ratios."""
    by = {r["impl"]: r for r in rows if r["mode"] == mode and r["seqlen"] == s and "error" not in r}
    out = {}
    base = by.get("torch")
    for name in ("chunked", "sdpa"):
        if base and name in by:
            out[name] = {"peak_rss_ratio": round(by[name]["peak_rss_mib"] / base["peak_rss_mib"], 3),
                         "peak_delta_ratio": round(by[name]["peak_delta_mib"] / max(base["peak_delta_mib"], 1e-9), 3),
                         "time_ratio": round(by[name]["seconds"] / base["seconds"], 3)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--backward-seqlen", type=int, default=2048, help="the size of the fwd+bwd row (0: none)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each measurement")
    parser.add_argument("--skip", nargs="*", default=[], choices=sorted(IMPLS), help="implementations to leave out")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
    parser.add_argument("--out", default=None,
                        help="write the JSON report here and the table next to it (.txt); default: print only")
    args = parser.parse_args(argv)

    import torch

    import portattn

    impls = [i for i in IMPLS if i not in args.skip]
    plan = [("fwd", s) for s in args.seqlens] + ([("fwd+bwd", args.backward_seqlen)] if args.backward_seqlen else [])
    rows = []
    started = time.time()
    for mode, s in plan:
        for impl in impls:
            r = measure(impl, mode, args.batch, s, args.heads, args.head_dim, args.threads, args.timeout)
            row = {"mode": mode, "seqlen": s, "impl": impl, **r}
            rows.append(row)
            print(table([row]).splitlines()[1], flush=True)
    text = table(rows)
    summary = {f"{mode} S={s}": ratios(rows, mode, s) for mode, s in plan}
    print()
    print(text)
    for key, val in summary.items():
        for name, r in val.items():
            print(f"{key}: {name} / torch SDPA: peak RSS x{r['peak_rss_ratio']}, time x{r['time_ratio']}")
    if args.out:
        report = {
            "what": "CPU attention, float32 causal (B, S, H, D): wall time and peak RSS of one call, fresh process each",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "problem": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "dtype": "float32",
                        "causal": True},
            "machine": {"host": platform.node(), "platform": platform.platform(), "cpu": _cpu_model(),
                        "cores": os.cpu_count(), "threads": args.threads,
                        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "portattn": getattr(portattn, "__version__", "?")},
            "implementations": {k: IMPLS[k] for k in impls},
            "results": rows,
            "ratios_vs_torch_sdpa": summary,
        }
        out = Path(args.out)
        out.write_text(json.dumps(report, indent=1) + "\n")
        out.with_suffix(".txt").write_text(
            f"{report['what']}\n{report['created']}  {report['machine']['cpu']}, {args.threads} thread(s), "
            f"torch {torch.__version__}\nB={args.batch} H={args.heads} D={args.head_dim}\n"
            f"peak RSS = the whole process; delta = peak - RSS before the call (after a warm-up call: the\n"
            f"default path's first call loads every CPU backend, onnxruntime included, hence its larger RSS before)\n\n"
            f"{text}\n\n"
            + "\n".join(f"{key}: {name} / torch SDPA: peak RSS x{r['peak_rss_ratio']}, time x{r['time_ratio']}"
                        for key, val in summary.items() for name, r in val.items()) + "\n")
        print(f"wrote {out} and {out.with_suffix('.txt')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
