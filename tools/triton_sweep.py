"""Tile sweep of the Triton training kernels on one GPU (issue #14): which config per head dim.

    python tools/triton_sweep.py --out $OUT [--dims 64,128,256] [--seqlens 1024,4096,16384]
    python tools/triton_sweep.py --compile-only --dims 128     # fill triton's cache (parallel)

For each head dim and each candidate config of the forward, the dQ and the dK/dV kernels (the
config table of ``backends/triton/configs.py`` is overridden, nothing else changes), on bf16
problems of 16k tokens and hidden 2048 (the benchmark's grid), causal and not:

* the candidate's output and gradients are checked once against float32 math (torch SDPA's math
  kernel on upcast inputs) on a small problem — a failing candidate is reported, never timed;
* forward time, and backward time (``torch.autograd.grad`` of a saved forward) with one kernel's
  config varied at a time (dQ first with dK/dV at the table's value, then dK/dV with the best dQ);
* torch SDPA's flash and cuDNN kernels in the same run, for the ratios.

Prints the best config per (D, direction) and its ratios; writes ``triton_sweep.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from portattn.backends.triton import ops  # noqa: E402  (the module the registered backend uses)
from portattn.backends.triton.configs import BackwardConfigs, KernelConfig  # noqa: E402

import portattn  # noqa: E402

# (block_m, block_n, warps, stages)
FWD = {
    64: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4)],
    256: [(128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (64, 64, 8, 2), (128, 32, 8, 3)],
}
# dK/dV: (block_m streaming queries, block_n resident keys, warps, stages)
DKDV = {
    64: [(32, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 4), (64, 64, 4, 3)],
    128: [(32, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (16, 128, 8, 4), (64, 128, 8, 3),
          (32, 64, 4, 4), (128, 64, 8, 2)],
    256: [(32, 64, 8, 1), (32, 32, 4, 2), (32, 64, 8, 2), (16, 32, 4, 3), (64, 32, 4, 2), (32, 32, 4, 3)],
}
# dQ: (block_m resident queries, block_n streaming keys, warps, stages)
DQ = {
    64: [(64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3)],
    128: [(64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 32, 4, 4), (64, 64, 4, 3), (128, 16, 8, 4)],
    256: [(64, 32, 8, 1), (32, 32, 4, 2), (64, 32, 8, 2), (32, 16, 4, 3), (64, 16, 4, 2), (32, 64, 4, 2)],
}


def _cfg(t):
    return KernelConfig(*t)


class Override:
    """Patch ops' config lookups (forward_config_for / backward_configs_for read these globals)."""

    def __init__(self):
        self.fwd = None
        self.bwd = None
        self._orig_f = ops._forward_config
        self._orig_b = ops._backward_configs

        def f(device, dtype, hd, hdv):
            return self.fwd or self._orig_f(device, dtype, hd, hdv)

        def b(device, dtype, hd, hdv):
            base = self._orig_b(device, dtype, hd, hdv)
            if self.bwd is None:
                return base
            dkdv, dq = self.bwd
            return BackwardConfigs(dkdv or base.dkdv, dq or base.dq, base.prep)
        ops._forward_config = f
        ops._backward_configs = b

    def table(self, d):
        return self._orig_f(torch.device("cuda", 0), torch.bfloat16, d, d), self._orig_b(
            torch.device("cuda", 0), torch.bfloat16, d, d)


def problem(b, s, h, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def check(d, causal) -> str:
    """'' if the current configs give O and grads within bf16 tolerance of float32 math, else why."""
    q, k, v, do = problem(2, 640, 4, d, seed=1)   # 640: ragged tiles for every candidate size
    out = portattn.attention(q, k, v, causal=causal, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), do)
    qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
    rgrads = torch.autograd.grad(ref, (qf, kf, vf), do.float().transpose(1, 2))
    ref = ref.transpose(1, 2)
    rgrads = [g.transpose(1, 2) for g in rgrads]
    for name, a, r in (("out", out, ref), *zip(("dq", "dk", "dv"), grads, rgrads)):
        err = ((a.float() - r).norm() / r.norm()).item()
        if not err < 2e-2:
            return f"{name} rel err {err:.3g}"
    return ""


def bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sdpa_fns(q, k, v, do, causal, kernel):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kern = getattr(SDPBackend, kernel)
    qh, kh, vh = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    doh = do.transpose(1, 2)

    def fwd():
        with sdpa_kernel([kern]):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    out = fwd()

    def bwd():
        torch.autograd.grad(out, (qh, kh, vh), doh, retain_graph=True)
    return fwd, bwd


def portattn_fns(q, k, v, do, causal):
    def fwd():
        return portattn.attention(q, k, v, causal=causal, backend="triton")
    out = fwd()

    def bwd():
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return fwd, bwd


def tflops(b, h, s, d, causal, ms, mode):
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * (1.0 if mode == "fwd" else 2.5)
    return f / ms / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-only", action="store_true", help="run every candidate once on tiny inputs")
    ap.add_argument("--time-limit", type=float, default=400.0)
    args = ap.parse_args(argv)
    t0 = time.time()
    dims = [int(x) for x in args.dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    ov = Override()
    rows = []
    for d in dims:
        h = 2048 // d
        for causal in (False, True):
            # correctness of every candidate (and, with --compile-only, triton's cache filled)
            bad = {}
            for kind, table in (("fwd", FWD[d]), ("dq", DQ[d]), ("dkdv", DKDV[d])):
                for t in table:
                    ov.fwd = _cfg(t) if kind == "fwd" else None
                    ov.bwd = ((_cfg(t), None) if kind == "dkdv" else (None, _cfg(t))) if kind != "fwd" else None
                    try:
                        why = check(d, causal)
                    except Exception as exc:
                        why = f"{type(exc).__name__}: {str(exc)[:200]}"
                    if why:
                        bad[(kind, t)] = why
                        print(f"D{d} causal={causal} {kind} {t}: FAILED {why}", flush=True)
            ov.fwd = ov.bwd = None
            if args.compile_only:
                continue
            for s in seqlens:
                if time.time() - t0 > args.time_limit:
                    break
                b = 16384 // s
                q, k, v, do = problem(b, s, h, d)
                row = dict(d=d, s=s, b=b, h=h, causal=causal, fwd={}, dq={}, dkdv={}, sdpa={}, failed={
                    f"{k_}:{t}": w for (k_, t), w in bad.items()})
                for kern in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                    try:
                        f, bw = sdpa_fns(q, k, v, do, causal, kern)
                        row["sdpa"][kern] = {"fwd": bench(f), "bwd": bench(bw)}
                    except Exception as exc:
                        row["sdpa"][kern] = {"error": str(exc)[:200]}
                for t in FWD[d]:
                    if ("fwd", t) in bad:
                        continue
                    ov.fwd = _cfg(t)
                    f, _ = portattn_fns(q, k, v, do, causal)
                    row["fwd"][str(t)] = bench(f)
                ov.fwd = None
                for t in DQ[d]:
                    if ("dq", t) in bad:
                        continue
                    ov.bwd = (None, _cfg(t))
                    _, bw = portattn_fns(q, k, v, do, causal)
                    row["dq"][str(t)] = bench(bw)
                best_dq = min(row["dq"], key=row["dq"].get) if row["dq"] else None
                for t in DKDV[d]:
                    if ("dkdv", t) in bad:
                        continue
                    ov.bwd = (_cfg(t), _cfg(eval(best_dq)) if best_dq else None)
                    _, bw = portattn_fns(q, k, v, do, causal)
                    row["dkdv"][str(t)] = bench(bw)
                ov.bwd = None
                rows.append(row)
                _print_row(row)
                del q, k, v, do
                torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                    triton=__import__("triton").__version__, date=dt.datetime.now(dt.timezone.utc).isoformat())
        with open(os.path.join(args.out, "triton_sweep.json"), "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    print(f"sweep done in {time.time() - t0:.0f}s")


def _print_row(row):
    d, s, b, h, causal = row["d"], row["s"], row["b"], row["h"], row["causal"]
    fl = row["sdpa"].get("FLASH_ATTENTION", {})
    cu = row["sdpa"].get("CUDNN_ATTENTION", {})
    parts = [f"D{d} S{s} {'causal' if causal else 'full  '}"]
    if row["fwd"]:
        t, ms = min(row["fwd"].items(), key=lambda kv: kv[1])
        parts.append(f"fwd {tflops(b, h, s, d, causal, ms, 'fwd'):5.0f} TF {t}"
                     f" x cuDNN {cu.get('fwd', float('nan')) / ms:4.2f} x FA2 {fl.get('fwd', float('nan')) / ms:4.2f}")
    if row["dkdv"]:
        t, ms = min(row["dkdv"].items(), key=lambda kv: kv[1])
        tq = min(row["dq"], key=row["dq"].get)
        parts.append(f"bwd {tflops(b, h, s, d, causal, ms, 'bwd'):5.0f} TF dkdv{t} dq{tq}"
                     f" x cuDNN {cu.get('bwd', float('nan')) / ms:4.2f} x FA2 {fl.get('bwd', float('nan')) / ms:4.2f}")
    print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
