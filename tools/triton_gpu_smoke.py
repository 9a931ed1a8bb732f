"""GPU smoke run of the triton backend: correctness at a benchmark size, timing against torch
SDPA (flash and cuDNN), and a small sweep of tile configurations — one command, one JSON.

    python tools/triton_gpu_smoke.py --out results/ [--sweep] [--budget 150]

Sizes: B=4, H=16, S=4096, D=128, bf16 (FLOPs 4·B·H·S²·D forward, halved for causal; backward
2.5× forward). Timing: medians of ``triton.testing.do_bench`` after warm-up, on random data;
each implementation's output is checked before it is timed. The sweep overrides the table in
:mod:`.configs` for the forward and backward kernels and reports each candidate's TFLOP/s, so
the table can be updated from evidence.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time

import torch
import torch.nn.functional as F


def _flops(b, h, s, d, causal, mode):
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f if mode == "fwd" else f * 3.5


def _sdpa(kernel_name, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kernel = getattr(SDPBackend, kernel_name)
    with sdpa_kernel([kernel]):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def _portattn(q, k, v, causal):
    import portattn
    return portattn.attention(q, k, v, causal=causal, backend="triton")


def _bench(fn, mode, q, k, v, dout):
    import triton.testing
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn(q, k, v)
    else:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

        def run():
            out = fn(*leaves)
            torch.autograd.grad(out, leaves, dout)
    return triton.testing.do_bench(run, warmup=100, rep=400, return_mode="median")


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="directory for triton_smoke.json")
    ap.add_argument("--sweep", action="store_true", help="also time a few alternative tile configs")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; the sweep stops when they run out")
    args = ap.parse_args(argv)
    start = time.time()
    torch.manual_seed(0)
    dev = "cuda"
    b, h, s, d = 4, 16, 4096, 128
    dtype = torch.bfloat16
    q, k, v, dout = (torch.randn(b, s, h, d, device=dev, dtype=dtype) for _ in range(4))
    fns = {
        "triton": _portattn,
        "sdpa-flash": lambda q, k, v, c: _sdpa("FLASH_ATTENTION", q, k, v, c),
        "sdpa-cudnn": lambda q, k, v, c: _sdpa("CUDNN_ATTENTION", q, k, v, c),
    }
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": dt.datetime.utcnow().isoformat(),
              "python": platform.python_version(), "shape": dict(B=b, H=h, S=s, D=d, dtype=str(dtype)), "rows": [],
              "checks": [], "sweep": []}
    import triton
    report["triton"] = triton.__version__

    # correctness at the benchmark size, against SDPA flash (both bf16: relative errors)
    for causal in (False, True):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = _portattn(*leaves, causal)
        g = torch.autograd.grad(out, leaves, dout)
        rl = [t.detach().requires_grad_(True) for t in (q, k, v)]
        ref = fns["sdpa-flash"](*rl, causal)
        gr = torch.autograd.grad(ref, rl, dout)
        row = {"causal": causal, "out": _rel_err(out, ref), **{n: _rel_err(a, r) for n, a, r in zip(("dq", "dk", "dv"), g, gr)}}
        report["checks"].append(row)
        print("check vs sdpa-flash", row, flush=True)

    # timing side by side
    for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
            row = {"causal": causal, "mode": mode}
            for name, fn in fns.items():
                try:
                    ms = _bench(lambda q_, k_, v_: fn(q_, k_, v_, causal), mode, q, k, v, dout)
                    row[name] = round(_flops(b, h, s, d, causal, mode) / ms / 1e9, 1)
                except Exception as exc:  # a missing SDPA kernel is recorded, not fatal
                    row[name] = f"error: {type(exc).__name__}: {str(exc)[:80]}"
            report["rows"].append(row)
            print("TFLOP/s", row, flush=True)

    if args.sweep:
        _sweep(report, q, k, v, dout, b, h, s, d, start + args.budget)

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "triton_smoke.json"), "w") as fh:
            json.dump(report, fh, indent=1)
    print(json.dumps(report["rows"]), flush=True)
    return 0


def _sweep(report, q, k, v, dout, b, h, s, d, deadline):
    """Time alternative forward/backward configs by overriding the table (same kernels)."""
    from portattn.backends.triton import ops
    from portattn.backends.triton.configs import BackwardConfigs, KernelConfig
    fwd_candidates = [KernelConfig(128, 64, 8, 3), KernelConfig(128, 64, 4, 3), KernelConfig(128, 128, 8, 3),
                      KernelConfig(64, 64, 4, 3), KernelConfig(128, 32, 4, 4), KernelConfig(128, 128, 8, 2)]
    bwd_candidates = [((64, 128), (128, 64), 8, 2), ((32, 128), (128, 32), 4, 3), ((64, 64), (64, 64), 4, 3),
                      ((64, 128), (128, 64), 8, 3), ((32, 64), (64, 32), 4, 3)]
    orig_fwd, orig_bwd = ops.forward_config_for, ops.backward_configs_for
    try:
        for cfg in fwd_candidates:
            if time.time() > deadline:
                break
            ops.forward_config_for = lambda spec, cfg=cfg: cfg
            for causal in (False, True):
                try:
                    ms = _bench(lambda q_, k_, v_: _portattn(q_, k_, v_, causal), "fwd", q, k, v, dout)
                    tf = round(_flops(b, h, s, d, causal, "fwd") / ms / 1e9, 1)
                except Exception as exc:
                    tf = f"error: {type(exc).__name__}"
                report["sweep"].append({"kernel": "fwd", "config": cfg.short(), "causal": causal, "tflops": tf})
                print("sweep fwd", cfg.short(), causal, tf, flush=True)
        ops.forward_config_for = orig_fwd
        for (m1, n1), (m2, n2), w, st in bwd_candidates:
            if time.time() > deadline:
                break
            cfgs = BackwardConfigs(KernelConfig(m1, n1, w, st), KernelConfig(m2, n2, w, st))
            ops.backward_configs_for = lambda spec, cfgs=cfgs: cfgs
            for causal in (False, True):
                try:
                    ms = _bench(lambda q_, k_, v_: _portattn(q_, k_, v_, causal), "fwd+bwd", q, k, v, dout)
                    tf = round(_flops(b, h, s, d, causal, "fwd+bwd") / ms / 1e9, 1)
                except Exception as exc:
                    tf = f"error: {type(exc).__name__}"
                label = f"dkdv M{m1} N{n1} dq M{m2} N{n2} w{w} s{st}"
                report["sweep"].append({"kernel": "fwd+bwd", "config": label, "causal": causal, "tflops": tf})
                print("sweep fwd+bwd", label, causal, tf, flush=True)
    finally:
        ops.forward_config_for, ops.backward_configs_for = orig_fwd, orig_bwd


if __name__ == "__main__":
    raise SystemExit(main())
