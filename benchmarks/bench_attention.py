"""portattn's GPU benchmark: every portattn backend side by side with torch SDPA's flash
(FlashAttention-2) and cuDNN backends, in one run, reported as TFLOP/s and ratios.

    python benchmarks/bench_attention.py --out results/          # all cases
    python benchmarks/bench_attention.py --quick                 # a few cases

Conventions (shared/GPU.md): bf16 by default; FLOPs = 4·B·H·Sq·Sk·D forward, halved for
causal; backward = 2.5 × forward; medians of ``triton.testing.do_bench`` after warm-up, each
implementation timed twice, interleaved, with the spread recorded, on
random data; each implementation's output is checked against SDPA-flash before it is timed.
The JSON written holds the GPU, driver, library versions and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import portattn

SDPA_KERNELS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}


def cases(quick: bool):
    """(name, B, H, Hkv, Sq, Sk, D, causal) — the FA3 paper's setting: 16k tokens, hidden 2048."""
    out = []
    seqlens = [1024, 4096] if quick else [1024, 4096, 16384]
    for causal in (False, True):
        for s in seqlens:
            out.append((f"D128 S{s}{' causal' if causal else ''}", 16384 // s, 16, 16, s, s, 128, causal))
    if not quick:
        out.append(("D64 S4096", 4, 32, 32, 4096, 4096, 64, False))
        out.append(("D256 S4096", 4, 8, 8, 4096, 4096, 256, False))
        out.append(("GQA 32:8 D128 S4096 causal", 4, 32, 8, 4096, 4096, 128, True))
    return out


def flops(b, h, sq, sk, d, causal, mode):
    f = 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return f * (1.0 if mode == "fwd" else 3.5)   # fwd+bwd: forward plus a 2.5x backward


def make_fn(impl, q, k, v, causal, mode):
    """A closure running one implementation; q/k/v are (B, S, H, D)."""
    if impl in SDPA_KERNELS:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kernel = getattr(SDPBackend, SDPA_KERNELS[impl])
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[2] != k.shape[2]

        def run():
            with sdpa_kernel([kernel]):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal,
                                                      **({"enable_gqa": True} if gqa else {})).transpose(1, 2)
    else:
        def run():
            return portattn.attention(q, k, v, causal=causal, backend=impl)
    if mode == "fwd":
        return run
    dout = torch.randn_like(q[..., : v.shape[-1]])

    def fwd_bwd():
        out = run()
        torch.autograd.grad(out, (q, k, v), dout)
    return fwd_bwd


#: each implementation is timed this many times, interleaved (METHOD.md: time the same version
#: twice; a difference smaller than that spread is noise)
ROUNDS = 2
#: a cell whose rounds differ by more than this (relative) is marked noisy in the table
NOISY = 0.05


def _do_bench_median(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def time_rounds(fns: dict, rounds: int, timer) -> dict:
    """Time every callable of ``fns`` ``rounds`` times, interleaved (round r visits them in order,
    odd rounds in reverse, so that none is always first or last). Returns per name
    ``{"ms": median of the rounds, "ms_rounds": [...], "spread": (max - min) / ms}`` or
    ``{"error": ...}`` if a timing raised."""
    names = list(fns)
    times = {n: [] for n in names}
    errors = {}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if name in errors:
                continue
            try:
                times[name].append(float(timer(fns[name])))
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    out = {}
    for name in names:
        if name in errors:
            out[name] = {"error": errors[name]}
            continue
        ms = statistics.median(times[name])
        out[name] = {"ms": ms, "ms_rounds": times[name], "spread": (max(times[name]) - min(times[name])) / ms}
    return out


def bench_case(case, impls, mode, dtype, check_ref):
    name, b, h, hkv, sq, sk, d, causal = case
    g = torch.Generator(device="cuda").manual_seed(0)
    need_grad = mode == "fwd+bwd"
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g).requires_grad_(need_grad)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=g).requires_grad_(need_grad)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=g).requires_grad_(need_grad)
    ref = None
    if check_ref:
        with torch.no_grad():
            ref = make_fn("sdpa-flash", q, k, v, causal, "fwd")()
    row = {"case": name, "mode": mode, "B": b, "H": h, "Hkv": hkv, "Sq": sq, "Sk": sk, "D": d, "causal": causal,
           "results": {}}
    fns = {}
    for impl in impls:
        entry = {}
        try:
            if ref is not None:
                with torch.no_grad():
                    out = make_fn(impl, q, k, v, causal, "fwd")()
                entry["max_abs_diff_vs_sdpa_flash"] = (out.float() - ref.float()).abs().max().item()
            fns[impl] = make_fn(impl, q, k, v, causal, mode)
        except Exception as exc:   # a backend that cannot run this case: record why
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        row["results"][impl] = entry
    for impl, timing in time_rounds(fns, ROUNDS, _do_bench_median).items():
        entry = row["results"][impl]
        entry.update(timing)
        if "ms" in timing:
            entry["tflops"] = flops(b, h, sq, sk, d, causal, mode) / (timing["ms"] * 1e-3) / 1e12
    return row


def environment():
    props = torch.cuda.get_device_properties(0)
    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name, "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "portattn": portattn.__version__,
    }
    for mod in ("triton", "cupy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    try:
        import subprocess
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        env["driver"] = None
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        env["cudnn"] = None
    return env


def table(rows, impls):
    lines = []
    header = f"{'case':<28} {'mode':<8}" + "".join(f"{i:>12}" for i in impls) + "   ratios vs sdpa-flash / sdpa-cudnn"
    lines.append(header)
    for r in rows:
        res = r["results"]
        cells = "".join(f"{res[i]['tflops']:>11.1f}{'~' if res[i].get('spread', 0.0) > NOISY else ' '}"
                        if "tflops" in res[i] else f"{'-':>12}" for i in impls)
        ratios = []
        for i in impls:
            if i in SDPA_KERNELS or "tflops" not in res[i]:
                continue
            fa = res.get("sdpa-flash", {}).get("tflops")
            cu = res.get("sdpa-cudnn", {}).get("tflops")
            ratios.append(f"{i} {res[i]['tflops'] / fa if fa else float('nan'):.2f}/"
                          f"{res[i]['tflops'] / cu if cu else float('nan'):.2f}")
        lines.append(f"{r['case']:<28} {r['mode']:<8}{cells}   {'  '.join(ratios)}")
    lines.append(f"~: the {ROUNDS} interleaved timings of that cell differ by more than {NOISY:.0%}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="triton,cupy", help="portattn backends to time (comma-separated)")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA/ROCm GPU; none is visible", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    ours = [b for b in args.backends.split(",") if b]
    available = [b for b in ours if portattn.get_backend(b).available]
    for b in set(ours) - set(available):
        print(f"skipping {b}: {'; '.join(portattn.get_backend(b).availability())}", file=sys.stderr)
    impls = available + list(SDPA_KERNELS)
    rows = []
    all_cases = cases(args.quick)
    t0 = time.time()
    for mode in args.modes.split(","):
        for i, case in enumerate(all_cases):
            row = bench_case(case, impls, mode, dtype, check_ref=(mode == "fwd"))
            rows.append(row)
            print(f"[{mode} {i + 1}/{len(all_cases)} {time.time() - t0:.0f}s] {case[0]}: " + ", ".join(
                f"{k} {v.get('tflops', float('nan')):.1f}" + (f" (ERR {v['error']})" if "error" in v else "")
                for k, v in row["results"].items()), flush=True)
    result = {"environment": environment(), "dtype": args.dtype, "flop_convention":
              "fwd 4*B*H*Sq*Sk*D (x0.5 causal); fwd+bwd = 3.5 x fwd (bwd 2.5 x fwd)", "rows": rows}
    print()
    print(table(rows, impls))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        day = result["environment"]["date"][:10]
        path = os.path.join(args.out, f"bench-{args.tag}-{day}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
