"""GPU check and timing of the cupy backend's tensor-core backward (issue 16), in about a minute.

    python tools/cupy_bwd_check.py --out DIR          (or: tools/cupy_gpu_dev.py --bwd-check --out DIR)

1. Compiles the modules it needs in parallel processes first (filling CuPy's on-disk kernel
   cache, so the checks below load binaries instead of compiling one after the other).
2. Checks, on a few small shapes (padded head dim 128 as the baseline, 160-256 with the
   head-dim-split dK/dV kernel, Dv != D both ways, causal / window / softcap / GQA / varlen;
   bf16 and fp16): dq, dk, dv against the float64 reference under the equivalence rule of
   docs/semantics.md (``portattn.numerics.compare``, factor 3, as tests/test_cupy.py), two runs
   bit-identical, and the FMA kernels (``force_fma``) on the same inputs within the same bound.
3. Times the backward (bf16, B*S = 16k tokens, H*D = 2048, as the benchmark's training grid):
   the tensor-core kernels, the FMA kernels (S = 1k rows only: they run at ~6 TFLOP/s) and
   torch SDPA's flash backward (FA2), side by side (tools/_cupy_gpu_check.time_side_by_side:
   interleaved rounds of back-to-back calls, L2 flushed), in TFLOP/s (2.5 x the forward's
   2*B*H*Sq*Sk*(D + Dv), halved when causal).

Writes ``bwd_check.json`` (every number) and ``bwd_check.txt`` (the tables) to ``--out``;
exit status 1 when any check fails. Needs an NVIDIA GPU, cupy and torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

#: (name, B, Sq, Sk, Hq, Hkv, D, Dv, kwargs, dtypes); "varlen" lists sequence lengths
CHECK_CASES = [
    ("d128_causal_gqa", 1, 300, 300, 4, 2, 128, 128, {"causal": True}, ("bfloat16",)),
    ("d256_causal_gqa", 1, 300, 330, 4, 2, 256, 256, {"causal": True}, ("bfloat16", "float16")),
    ("d192_dv64", 2, 130, 170, 2, 2, 192, 64, {}, ("bfloat16", "float16")),
    ("d64_dv256_window", 1, 150, 200, 2, 1, 64, 256, {"window": (50, 10)}, ("bfloat16",)),
    ("d160_softcap_causal", 1, 140, 120, 2, 2, 160, 160, {"softcap": 5.0, "causal": True}, ("bfloat16",)),
    ("d224_varlen_causal", 3, None, None, 4, 2, 224, 224, {"varlen": [100, 1, 180], "causal": True}, ("bfloat16",)),
    ("d256_dv128_alibi", 1, 100, 140, 2, 2, 256, 128, {"alibi": True}, ("bfloat16",)),
]
#: (S, D, Dv, causal) of the timed problems (bf16)
TIME_CASES = [(1024, 128, 128, False), (4096, 128, 128, False), (1024, 256, 256, False), (1024, 256, 256, True),
              (4096, 256, 256, False), (4096, 256, 256, True), (4096, 192, 192, False), (4096, 256, 128, False)]


def _needed_configs():
    from portattn.backends.cupy import configs

    out = {}
    for _name, _b, _sq, _sk, _hq, _hkv, d, dv, _kw, dtypes in CHECK_CASES:
        for dt in dtypes:
            for cfg in (configs.forward_config(dt, d, dv), configs.backward_config(dt, d, dv, mode="auto"),
                        configs.fma_backward_config(dt, d, dv)):
                out[cfg] = None
    for s, d, dv, _c in TIME_CASES:
        out[configs.forward_config("bfloat16", d, dv)] = None
        out[configs.backward_config("bfloat16", d, dv, mode="auto")] = None
        if s <= 1024:
            out[configs.fma_backward_config("bfloat16", d, dv)] = None
    return list(out)


def precompile(workers: int) -> list[str]:
    """Compile the needed modules in parallel processes (CuPy's disk cache keeps them)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from cupy_gpu_dev import _compile_one

    cfgs = [(c.family, c.dtype, c.head_dim, c.tile, c.kv_stages) for c in _needed_configs()]
    errors = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for cfg, secs, err, regs in pool.map(_compile_one, cfgs):
            print(f"{'FAIL' if err else 'ok  '} {cfg} {secs:.1f}s {err or regs}", flush=True)
            if err:
                errors.append(f"{cfg}: {err}")
    return errors


def _inputs(case, dtype, seed):
    import torch

    _name, b, sq, sk, hq, hkv, d, dv, kw, _dts = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(kw)
    if "varlen" in kw:
        lens = kw.pop("varlen")
        lens_k = [n + 7 * (i % 2) for i, n in enumerate(lens)]
        cum = lambda xs: torch.tensor([0] + [sum(xs[: i + 1]) for i in range(len(xs))],  # noqa: E731
                                      dtype=torch.int32, device="cuda")
        kw.update(cu_seqlens_q=cum(lens), cu_seqlens_k=cum(lens_k))
        shapes = [(sum(lens), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, dv)]
        b = len(lens)
    else:
        shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv)]
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(b, hq, generator=g, device="cuda") * 0.5
    q, k, v = (torch.randn(s, generator=g, device="cuda").to(dtype) for s in shapes)
    return q, k, v, kw


def _grads(fn, q, k, v, kw, dout, dtype):
    import torch

    from portattn.spec import build_spec

    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = fn(build_spec(*leaves, **kw))
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


def check_case(case, dtype_name) -> dict:
    """One case at one dtype: the equivalence rule, determinism, and the FMA kernels' result."""
    import torch
    from portattn.backends.cupy import CupyBackend, configs, runtime

    from portattn.numerics import compare
    from portattn.reference import naive_forward, reference_forward
    from portattn.spec import build_spec

    dtype = getattr(torch, dtype_name)
    q, k, v, kw = _inputs(case, dtype, seed=3)
    spec = build_spec(q, k, v, **kw)
    be = CupyBackend()
    out, lse = be.forward(spec)
    dout = torch.randn(spec.out_shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    dout = dout.to(dtype)
    cfg = configs.backward_config(dtype_name, spec.head_dim, spec.head_dim_v,
                                  smem_limit=runtime.smem_optin(spec.device))
    first = be.backward(spec, out, lse, dout)[:3]
    second = be.backward(spec, out, lse, dout)[:3]
    fma = runtime.backward(spec, out, lse, dout, force_fma=True)[:3]
    torch.cuda.synchronize()
    ref = _grads(reference_forward, q, k, v, kw, dout, torch.float64)
    naive = _grads(naive_forward, q, k, v, kw, dout, dtype)
    zs = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * spec.scale
    row = {"case": case[0], "dtype": dtype_name, "D": spec.head_dim, "Dv": spec.head_dim_v,
           "family": f"{cfg.family} hd {cfg.head_dim}", "deterministic": all(torch.equal(a, b) for a, b in
                                                                          zip(first, second)),
           "grads": {}}
    ok = row["deterministic"] and cfg.family == "bwd_mma"
    for name, a, f, r, n in zip(("dq", "dk", "dv"), first, fma, ref, naive):
        cm = compare(name, a, r, n, factor=3, zero_ref_scale=zs)
        cf = compare(name + "[fma]", f, r, n, factor=3, zero_ref_scale=zs)
        nan = not bool(torch.isfinite(a).all())
        row["grads"][name] = {"passed": cm.passed, "max_err": cm.max_err, "naive_err": cm.naive_err,
                              "tol": cm.tolerance, "score": cm.score, "fma_passed": cf.passed,
                              "fma_score": cf.score, "non_finite": nan}
        ok = ok and cm.passed and cf.passed and not nan
    row["passed"] = ok
    return row


def time_case(seqlen, d, dv, causal) -> dict:
    import torch
    from portattn.backends.cupy import CupyBackend, runtime
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from portattn.spec import build_spec

    heads, batch = 2048 // d, max(1, 16384 // seqlen)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(batch, seqlen, heads, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, seqlen, heads, dv, generator=g, device="cuda").to(torch.bfloat16)
    spec = build_spec(q, k, v, causal=causal)
    be = CupyBackend()
    out, lse = be.forward(spec)
    dout = torch.randn_like(out)
    flops = 2.5 * 2 * batch * heads * seqlen * seqlen * (d + dv) / (2 if causal else 1)
    row = {"seqlen": seqlen, "batch": batch, "heads": heads, "D": d, "Dv": dv, "causal": causal}
    # side by side (tools/_cupy_gpu_check.time_side_by_side: interleaved rounds of back-to-back
    # calls, L2 flushed); the FMA path only on short sequences, where it takes milliseconds
    fns = {"mma": lambda: be.backward(spec, out, lse, dout)}
    if seqlen <= 1024:
        fns["fma"] = lambda: runtime.backward(spec, out, lse, dout, force_fma=True)
    try:
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        do_t = dout.transpose(1, 2)
        fns["flash"] = lambda: torch.autograd.grad(o, (qt, kt, vt), do_t, retain_graph=True)
    except Exception as exc:   # e.g. flash without Dv != D
        row["flash_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _cupy_gpu_check import time_side_by_side

    timed = time_side_by_side(fns, flops)
    row.update(timed)
    for name in fns:
        if f"{name}_tflops" in timed:
            row[f"{name}_ms"] = flops / timed[f"{name}_tflops"] * 1e-9
    return row


def main(out_dir: str, workers: int | None = None) -> int:
    import torch

    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    errors = precompile(workers or min(16, os.cpu_count() or 1))
    t_compile = time.perf_counter() - t0
    checks = []
    for case in CHECK_CASES:
        for dt in case[-1]:
            try:
                row = check_case(case, dt)
            except Exception as exc:
                row = {"case": case[0], "dtype": dt, "passed": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            checks.append(row)
            print(json.dumps(row), flush=True)
    t_check = time.perf_counter() - t0 - t_compile
    timings = []
    for tc in TIME_CASES:
        try:
            row = time_case(*tc)
        except Exception as exc:
            row = {"case": tc, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        timings.append(row)
        print(json.dumps(row), flush=True)
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; compile {t_compile:.0f}s, checks {t_check:.0f}s, "
             f"total {time.perf_counter() - t0:.0f}s",
             "", f"{'case':<22} {'dtype':<9} {'family':<16} {'det':<4} {'dq score':>9} {'dk score':>9} {'dv score':>9} "
             f"{'fma ok':<6} result"]
    for r in checks:
        if "error" in r:
            lines.append(f"{r['case']:<22} {r['dtype']:<9} ERROR {r['error'][:300]}")
            continue
        gs = r["grads"]
        lines.append(f"{r['case']:<22} {r['dtype']:<9} {r['family']:<16} {str(r['deterministic'])[0]:<4} "
                     + " ".join(f"{gs[n]['score']:>9.3g}" for n in ("dq", "dk", "dv"))
                     + f" {str(all(g['fma_passed'] for g in gs.values()))[0]:<6} {'ok' if r['passed'] else 'FAIL'}")
    lines += ["", "backward TFLOP/s (bf16; x FA2 = cupy / SDPA flash)",
              f"{'S':>6} {'B':>3} {'H':>3} {'D':>4} {'Dv':>4} {'causal':>6} {'mma':>7} {'fma':>7} {'flash':>7} "
              f"{'x FA2':>6} {'mma/fma':>8}"]
    for r in timings:
        if "mma_tflops" not in r:
            lines.append(f"{r.get('case')} ERROR {r.get('error', '')[:300]}")
            continue
        f = lambda key: f"{r[key]:>7.1f}" if key in r else f"{'-':>7}"  # noqa: E731
        ratio = f"{r['mma_tflops'] / r['flash_tflops']:>6.2f}" if "flash_tflops" in r else f"{'-':>6}"
        speedup = f"{r['mma_tflops'] / r['fma_tflops']:>8.1f}" if "fma_tflops" in r else f"{'-':>8}"
        lines.append(f"{r['seqlen']:>6} {r['batch']:>3} {r['heads']:>3} {r['D']:>4} {r['Dv']:>4} {str(r['causal']):>6} "
                     f"{f('mma_tflops')} {f('fma_tflops')} {f('flash_tflops')} {ratio} {speedup}")
    failed = [r for r in checks if not r.get("passed")]
    lines.append("")
    lines.append(f"{len(checks) - len(failed)}/{len(checks)} checks passed; compile errors: {len(errors)}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(out_dir, "bwd_check.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "bwd_check.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d", time.gmtime()), "compile_errors": errors,
                   "checks": checks, "timings": timings}, f, indent=1)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--workers", type=int, default=None)
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main(a.out, a.workers))
