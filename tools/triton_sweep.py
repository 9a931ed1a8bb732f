"""Tile sweep of the Triton training kernels on one GPU (issue #14): which config per head dim.

    python tools/triton_sweep.py --out $OUT [--dims 64,128,256] [--seqlens 1024,4096,16384]
    python tools/triton_sweep.py --compile-only --dims 128     # fill triton's cache (parallel)
    python tools/triton_sweep.py --fwd-only --out $OUT [--time-limit 240] [--jobs 14]
    python tools/triton_sweep.py --bwd-variants --out $OUT --time-limit 170   # tools/triton_bwd_sweep.py

For each head dim and each candidate config of the forward, the dQ and the dK/dV kernels (the
config table of ``backends/triton/configs.py`` is overridden, nothing else changes), on bf16
problems of 16k tokens and hidden 2048 (the benchmark's grid), causal and not:

* the candidate's output and gradients are checked once against float32 math (torch SDPA's math
  kernel on upcast inputs) on a small problem — a failing candidate is reported, never timed;
* forward time, and backward time (``torch.autograd.grad`` of a saved forward) with one kernel's
  config varied at a time (dQ first with dK/dV at the table's value, then dK/dV with the best dQ);
* torch SDPA's flash and cuDNN kernels in the same run, for the ratios.

Prints the best config per (D, direction) and its ratios; writes ``triton_sweep.json``.

``--fwd-only`` (issue #14, the forward at cuDNN speed): the forward table's row against the
variants of :data:`FWD_VARIANTS` (tiles, and the sm_90 tensor-descriptor ``tma`` and
warp-specialised ``ws`` kernels), D 64/128/256 x S 1k/4k/16k x causal and not, with torch SDPA's
cuDNN and flash kernels in the same run. Every candidate is first compiled and checked against the
float64 reference (docs/semantics.md's equivalence rule, out and lse, ragged sizes) in ``--jobs``
parallel processes; a failing one is reported, never timed. Writes ``triton_fwd_sweep.json`` and
``triton_fwd_sweep.txt`` (per cell the best candidate, per head dim the best config over all cells
with its ratios against the targets, and the config-table rows to paste). ``--time-limit``
(default 240 s) bounds the whole run: compiles get 60% of it, cells not reached are reported.
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


def _forget_prepared() -> None:
    """Drop ops' prepared forward launches (kept per call signature, whatever the config): after
    a config change the next call must launch the new one."""
    getattr(ops, "_prepared", {}).clear()


class Override:
    """Patch ops' config lookups (forward_config_for / backward_configs_for read these globals)."""

    @property
    def fwd(self):
        return self._fwd

    @fwd.setter
    def fwd(self, cfg):
        self._fwd = cfg
        _forget_prepared()

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
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run (default 400; 240 with --fwd-only)")
    ap.add_argument("--fwd-only", action="store_true",
                    help="forward only: the table's row against TMA / warp-specialised / tile variants")
    ap.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                    help="--fwd-only: processes compiling and checking candidates in parallel")
    ap.add_argument("--bwd-variants", action="store_true",
                    help="backward only: atomic dQ against the table's deterministic rows (tools/triton_bwd_sweep.py)")
    ap.add_argument("--fwd-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bwd-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fwd_worker:
        return _fwd_worker(args.fwd_worker)
    if args.bwd_worker:
        from triton_bwd_sweep import bwd_worker
        return bwd_worker(args.bwd_worker)
    if args.time_limit is None:
        args.time_limit = 170.0 if args.bwd_variants else 240.0 if args.fwd_only else 400.0
    if args.bwd_variants:
        from triton_bwd_sweep import bwd_variants
        return bwd_variants(args)
    if args.fwd_only:
        return fwd_only(args)
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


# ----- forward-only mode (--fwd-only): the table against TMA / warp-specialised / tile variants ---------
# (block_m, block_n, warps, stages, tma, ws); the table's current row is always timed as "table".
# Hopper shared memory (227 KiB) bounds the tiles: Q (M x D) + stages x (K + V) (N x D), 2 bytes each.
# Cross-compiled for sm_90 with triton 3.6 (registers / spilled bytes per thread): TMA frees the
# pointer tiles, D128 M128 N64 w8 s3 223/0 -> 158/0, M128 N128 w8 s2 255/0 -> 188/0; D256 at M128
# spills with or without TMA (table M128 N32 w8 s3: 255/56, tma 255/104) while M64 w8 tma does
# not (N64 s2 167/0, N32 s3 160/0; plain M64 N64 w8 s2 242/0).
# ws: cross-compiled for sm_90 (2026-12-01), triton 3.6 and 3.9 leave 8-warp loops unspecialised and
# their Hopper warp-specialisation pass fails on the 4-warp kernel's three phase loops; one 4-warp
# candidate stays so that a triton that handles it shows up here.
FWD_VARIANTS = {
    64: [(128, 64, 4, 3, False, False), (128, 128, 8, 3, False, False),
         (128, 64, 4, 3, True, False), (128, 64, 8, 3, True, False), (128, 128, 8, 3, True, False),
         (128, 128, 8, 2, True, False), (64, 64, 4, 3, True, False), (128, 64, 4, 4, True, False),
         (128, 64, 4, 3, True, True)],
    128: [(128, 64, 8, 3, False, False), (128, 128, 8, 2, False, False),
          (128, 64, 8, 3, True, False), (128, 128, 8, 3, True, False), (128, 128, 8, 2, True, False),
          (128, 64, 8, 4, True, False), (128, 64, 8, 2, True, False), (64, 64, 4, 3, True, False),
          (128, 64, 4, 3, True, True)],
    256: [(128, 32, 8, 3, False, False), (128, 64, 8, 2, False, False),
          (128, 32, 8, 3, True, False), (128, 64, 8, 2, True, False), (128, 32, 8, 2, True, False),
          (64, 64, 8, 2, False, False), (64, 64, 8, 2, True, False), (64, 32, 8, 3, True, False),
          (64, 64, 8, 3, True, False), (64, 32, 8, 4, True, False)],
}
#: issue #14's targets: forward time of cuDNN / triton per cell
TARGETS = "D128 S>=2k >= 1.0 x cuDNN (causal and not); D64, D256 >= 0.9 x cuDNN; S < 2k >= 0.8 x cuDNN"


def _target_ratio(d, s):
    if s < 2048:
        return 0.8
    return 1.0 if d == 128 else 0.9


def _fwd_cfg(t) -> KernelConfig:
    m, n, w, s, tma, ws = t
    return KernelConfig(m, n, w, s, tma=tma, ws=ws)


def _fwd_label(t) -> str:
    return _fwd_cfg(t).short()


#: where --fwd-worker's checks run ("cpu" with TRITON_INTERPRET=1: a smoke test of this tool without a GPU)
WORKER_DEVICE = os.environ.get("TRITON_SWEEP_DEVICE", "cuda")


def _fwd_spec(b, s, h, d, causal, seed=0, device="cuda"):
    from portattn.spec import build_spec
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    return build_spec(q, k, v, causal=causal)


def _fwd_check(d, causal, t) -> str:
    """'' if candidate ``t`` passes docs/semantics.md's equivalence rule (out against the float64
    reference with the bf16 naive math as yardstick, lse within its tolerance) on a ragged
    problem (S 640 and 200: partial tiles for every candidate), else why."""
    from portattn.numerics import compare, compare_lse
    from portattn.reference import naive_forward, reference_forward
    cfg = _fwd_cfg(t)
    ops._forward_config = lambda *a: cfg
    for s in (640, 200):
        spec = _fwd_spec(2, s, 4, d, causal, seed=1, device=WORKER_DEVICE)
        if cfg.tma and not ops.forward_config_for(spec).tma:
            return "override not applied"
        out, lse = ops.forward(spec)
        ref, ref_lse = reference_forward(spec)
        for c in (compare("out", out, ref, naive_forward(spec)[0]), compare_lse(lse, ref_lse)):
            if not c.passed:
                return f"S{s}: {c}"
    return ""


def _fwd_worker(jobs_json: str) -> None:
    """Compile (into triton's cache) and check each job; one JSON line per job on stdout."""
    for d, causal, t in json.loads(jobs_json):
        t = tuple(t)
        start = time.time()
        try:
            why = _fwd_check(d, causal, t)
        except Exception as exc:
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        print("JOB " + json.dumps(dict(d=d, causal=causal, t=t, why=why, s=round(time.time() - start, 1))),
              flush=True)


def _fwd_precompile(jobs, n_procs, deadline, flag="--fwd-worker", label=None, alone=None) -> dict:
    """Run the jobs in ``n_procs`` worker processes (a compiler crash loses one worker's remaining
    jobs, reported as failures); returns {(d, causal, t): why}. ``flag`` picks the worker
    (``--fwd-worker`` or ``--bwd-worker``), ``label`` names a job's candidate, ``alone(job)`` says
    which jobs get a worker of their own."""
    import subprocess
    label = label or _fwd_label
    alone = alone or (lambda j: j[2][5])
    chunks = [jobs[i::n_procs] for i in range(n_procs)]
    # warp-specialised candidates each get their own worker: the Hopper warp-specialisation pass
    # can abort the process on loops it does not handle
    ws = [j for j in jobs if alone(j)]
    chunks = [[j for j in c if not alone(j)] for c in chunks] + [[j] for j in ws]
    chunks = [c for c in chunks if c]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [(c, subprocess.Popen([sys.executable, os.path.abspath(__file__), flag, json.dumps(c)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
             for c in chunks]
    results, done = {}, 0
    import selectors
    sel = selectors.DefaultSelector()
    for c, p in procs:
        sel.register(p.stdout, selectors.EVENT_READ, (c, p))
    tails = {}
    while sel.get_map():
        if time.time() > deadline:
            break
        for key, _ in sel.select(timeout=1.0):
            c, p = key.data
            line = p.stdout.readline()
            if not line:
                sel.unregister(p.stdout)
                continue
            if line.startswith("JOB "):
                r = json.loads(line[4:])
                t = _tuple(r["t"])
                results[(r["d"], r["causal"], t)] = r["why"]
                done += 1
                state = f"FAILED {r['why']}" if r["why"] else "ok"
                print(f"  [{done}/{len(jobs)} {time.time() - T0:5.0f}s] D{r['d']} {'causal' if r['causal'] else 'full'}"
                      f" {label(t)}: compiled+checked in {r['s']}s, {state}", flush=True)
            else:
                tails.setdefault(id(p), []).append(line.rstrip()[-200:])
    for c, p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        for j in c:
            if (j[0], j[1], _tuple(j[2])) not in results:
                tail = " | ".join(tails.get(id(p), [])[-3:])
                results[(j[0], j[1], _tuple(j[2]))] = (f"worker exited {p.returncode} before this job: {tail}"
                                                      if time.time() <= deadline else "not compiled in time")
    return results


def _tuple(t):
    """A job's candidate as a hashable tuple (JSON turns nested tuples into lists)."""
    return tuple(_tuple(x) for x in t) if isinstance(t, (list, tuple)) else t


T0 = time.time()


def fwd_only(args) -> None:
    """The --fwd-only sweep: see the module docstring."""
    global T0
    T0 = time.time()
    deadline = T0 + args.time_limit
    dims = [int(x) for x in args.dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    orig = ops._forward_config
    table = {d: orig(torch.device("cuda", 0), torch.bfloat16, d, d) for d in dims}
    cands = {}
    for d in dims:
        tt = table[d]
        row = (tt.block_m, tt.block_n, tt.num_warps, tt.num_stages, tt.tma, tt.ws)
        cands[d] = [row] + [t for t in FWD_VARIANTS.get(d, []) if t != row]
    jobs = [(d, c, t) for d in dims for c in (False, True) for t in cands[d]]
    print(f"forward sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}: {len(jobs)} compiles+checks in {args.jobs} processes", flush=True)
    bad = _fwd_precompile(jobs, args.jobs, T0 + args.time_limit * 0.6)
    ops._forward_config = orig
    cells = []
    try:
        _fwd_time_cells(cells, dims, seqlens, cands, bad, table, orig, deadline)
    except Exception as exc:   # a dead CUDA context, say: keep what was measured
        print(f"timing stopped: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    finally:
        ops._forward_config = orig
    report = _fwd_report(cells, cands, table)
    print(report, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                    date=dt.datetime.now(dt.timezone.utc).isoformat(), seconds=round(time.time() - T0, 1),
                    candidates={d: [_fwd_label(t) for t in cands[d]] for d in dims}, targets=TARGETS)
        fails = {f"D{d} {'causal' if c else 'full'} {_fwd_label(t)}": w for (d, c, t), w in bad.items() if w}
        with open(os.path.join(args.out, "triton_fwd_sweep.json"), "w") as fh:
            json.dump(dict(meta=meta, cells=cells, compile_failures=fails), fh, indent=1)
        with open(os.path.join(args.out, "triton_fwd_sweep.txt"), "w") as fh:
            fh.write(report + "\n")
    print(f"forward sweep done in {time.time() - T0:.0f}s", flush=True)


def _fwd_time_cells(cells, dims, seqlens, cands, bad, table, orig, deadline) -> None:
    """Time SDPA cuDNN / flash and every checked candidate per (D, causal, S) cell into ``cells``."""
    for d in dims:
        h = 2048 // d
        for causal in (False, True):
            for s in seqlens:
                if time.time() > deadline - 5:
                    print(f"time limit: D{d} S{s} causal={causal} and later cells not timed", flush=True)
                    break
                b = max(1, 16384 // s)
                spec = _fwd_spec(b, s, h, d, causal)
                cell = dict(d=d, s=s, b=b, h=h, causal=causal, sdpa={}, triton={}, failed={})
                q, k, v = (t.transpose(1, 2) for t in (spec.q, spec.k, spec.v))
                for kern in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    try:
                        with sdpa_kernel([getattr(SDPBackend, kern)]):
                            cell["sdpa"][kern] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    except Exception as exc:
                        cell["sdpa"][kern] = None
                        cell["failed"][kern] = str(exc)[:200]
                for i, t in enumerate(cands[d]):
                    why = bad.get((d, causal, t), "not checked")
                    name = "table" if i == 0 else _fwd_label(t)
                    if why:
                        cell["failed"][name] = why
                        continue
                    cfg = _fwd_cfg(t)
                    ops._forward_config = lambda *a, cfg=cfg: cfg
                    _forget_prepared()
                    try:
                        cell["triton"][name] = bench(lambda: ops.forward(spec))
                    except Exception as exc:
                        cell["failed"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    ops._forward_config = orig
                cells.append(cell)
                print(_fwd_cell_line(cell, table[d]), flush=True)
                spec = q = k = v = None
                torch.cuda.empty_cache()


def _fwd_flops(c):
    return 4 * c["b"] * c["h"] * c["s"] * c["s"] * c["d"] * (0.5 if c["causal"] else 1.0)


def _fwd_cell_line(c, table_cfg) -> str:
    cu = c["sdpa"].get("CUDNN_ATTENTION")
    fa = c["sdpa"].get("FLASH_ATTENTION")
    head = f"D{c['d']} S{c['s']} {'causal' if c['causal'] else 'full  '}"
    if not c["triton"]:
        return f"{head} | no triton candidate timed ({len(c['failed'])} failed)"
    name, ms = min(c["triton"].items(), key=lambda kv: kv[1])
    tab = c["triton"].get("table")
    r = (lambda x, y: f"{x / y:4.2f}" if x and y else " n/a")
    return (f"{head} | cuDNN {cu or float('nan'):.3f} ms FA2 {fa or float('nan'):.3f} ms"
            f" | table {table_cfg.short()} x cuDNN {r(cu, tab)}"
            f" | best {name} {_fwd_flops(c) / ms / 1e9:4.0f} TF x cuDNN {r(cu, ms)} x FA2 {r(fa, ms)}")


def mean_relative(cells: list[dict], names: list[str]) -> dict:
    """``name -> (mean over cells of its triton time relative to the cell's fastest, its index
    in names)`` for the names timed in every one of ``cells`` (their ``"triton"`` dicts)."""
    scores = {}
    for i, name in enumerate(names):
        rel = [c["triton"][name] / min(c["triton"].values()) for c in cells if name in c["triton"]]
        if cells and len(rel) == len(cells):
            scores[name] = (sum(rel) / len(rel), i)
    return scores


def ranking_text(scores: dict, pretty) -> str:
    """``mean_relative``'s scores, best first, as ``"name 1.000, other 1.061"``."""
    return ", ".join(f"{pretty(n)} {v:.3f}" for n, (v, _) in sorted(scores.items(), key=lambda kv: kv[1][0]))


def _fwd_report(cells, cands, table) -> str:
    """Per cell the best candidate; per head dim the config with the least mean time relative to
    each cell's best (the config-table row to paste) and the verdict against issue #14's targets."""
    lines = ["# triton forward sweep (bf16, 16k tokens, hidden 2048): time ratios cuDNN / triton (>1: faster)",
             f"# targets: {TARGETS}", ""]
    lines += [_fwd_cell_line(c, table[c["d"]]) for c in cells]
    lines.append("")
    rows = []
    for d in sorted({c["d"] for c in cells}):
        dc = [c for c in cells if c["d"] == d and c["triton"]]
        names = ["table"] + [_fwd_label(t) for t in cands[d][1:]]
        scores = mean_relative(dc, names)
        if not scores:
            lines.append(f"D{d}: no config timed in every cell")
            continue
        best = min(scores, key=lambda n: scores[n][0])
        t = cands[d][scores[best][1]]
        pretty = lambda n: table[d].short() + " (table)" if n == "table" else n  # noqa: E731
        ranking = ranking_text(scores, pretty)
        lines.append(f"D{d}: mean time relative to each cell's best: {ranking}")
        verdict = []
        for c in dc:
            cu = c["sdpa"].get("CUDNN_ATTENTION")
            if cu:
                ratio = cu / c["triton"][best]
                ok = ratio >= _target_ratio(d, c["s"])
                verdict.append(f"S{c['s']}{'c' if c['causal'] else ''} {ratio:.2f}{'' if ok else ' (below target)'}")
        lines.append(f"D{d}: best {pretty(best)} x cuDNN per cell: " + ", ".join(verdict))
        m, n, w, s, tma, ws = t
        flags = f", {tma}, {ws}" if (tma or ws) else ""
        rows.append(f"{d}: ({m}, {n}, {w}, {s}{flags})")
    lines += ["", "# rows for _FWD_NVIDIA['hopper'] in backends/triton/configs.py (BLOCK_D: (M, N, warps, stages[, tma, ws])):",
              "    " + ", ".join(rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
