"""``tools/triton_sweep.py --bwd-variants``: the Triton backward's table rows against a few variants
(issue #14: the backward at >= 1.0 x FA2), in ONE bounded run on one GPU.

    python tools/triton_sweep.py --bwd-variants --out $OUT --time-limit 170 [--dims 128,256,64]

1. every candidate (the table's row for the head dim, then :data:`BWD_VARIANTS`) is compiled and
   checked in ``--jobs`` parallel processes, causal and not: dq/dk/dv (and out, lse) against the
   float64 reference under docs/semantics.md's equivalence rule (``portattn.testing.check_backend``,
   i.e. ``portattn.numerics.compare``) on ragged bf16 problems, and bit-identical gradients over two
   repeated backward passes; a failing candidate is reported, never timed;
2. the backward alone (``torch.autograd.grad`` of one saved forward, as benchmarks/bench_attention.py
   times it) of every passing candidate, beside torch SDPA's flash (FA2) and cuDNN backward, on bf16
   problems of 16k tokens and hidden 2048, S 1k/4k/16k, causal and not;
3. ``triton_bwd_sweep.json`` and ``triton_bwd_sweep.txt`` under ``--out``, rewritten after every
   timed cell (so an outer ``timeout`` keeps what was measured): per cell each candidate's
   ratio x FA2 and x cuDNN; per head dim the best row over all cells, its verdict against the
   targets and the ``_BWD_NVIDIA['hopper']`` row to paste).

Compile time counts against the limit: the compiles get 60% of it, and cells not reached in time
are reported as such.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time

import torch
import triton_sweep as base
from portattn.backends.triton import ops
from portattn.backends.triton.configs import BackwardConfigs, KernelConfig

# candidates per head dim: (dK/dV (block_m streamed queries, block_n resident keys, warps, stages, split),
#                           dQ (block_m resident queries, block_n streamed keys, warps, stages));
# the table's row is always timed first, as "table". The split (KernelConfig.split) runs dK/dV as a
# dV launch and a dK launch: one float32 accumulator per program, one product more per tile pair
# (5 instead of 4). Registers / spilled bytes per thread of the dK launch (the heavier), sm_90 bf16
# cross-compiled with triton 3.9 (2026-12-01; the H200's triton 3.6 allocates differently: ncu read
# 240 registers for the D128 table row):
#   D128 table M64 N128 w8 s2 fused 255/480; split M64 N128 w8 s2 255/200 (dV launch 255/24),
#        split M32 N128 w8 s3 255/24, split M32 N128 w4 s3 255/928 (not swept);
#   D256 table M32 N32 w4 s3 fused 255/592 -- a 32-row resident tile is below wgmma's 64 rows per
#        warp group, so its products run as Ampere-style mma; split M16 N128 w8 s2 255/0,
#        M16 N64 w8 s2 255/176, M32 N128 w8 s2 255/352, M32 N64 w8 s2 255/440, M64 N64 w8 s2 255/744
#        (not swept), M32 N64 w4 s2 255/880 (not swept); dV launch of split M16 N128 w8 s2 255/0.
#   D256 dQ: table M64 N16 w4 s2 254/0, M128 N16 w8 s2 215/0 (two 64-row warp groups), M64 N32 w8 s2 255/16.
# Prediction: D256 is where the split can pay (wgmma-sized resident tiles without the spills of the
# fused kernel: dK/dV 1.3-2x faster, the backward 1.2-1.5x); at D128 the extra product about cancels
# what fewer spills give (0.9-1.1x); D64 is already at 1.0 x FA2 and is swept for completeness.
BWD_VARIANTS = {
    128: [((64, 128, 8, 2, True), (64, 32, 4, 3)),
          ((32, 128, 8, 3, True), (64, 32, 4, 3)),
          ((32, 128, 8, 2, True), (64, 32, 4, 3))],
    256: [((16, 128, 8, 2, True), (64, 16, 4, 2)),
          ((16, 128, 8, 2, True), (128, 16, 8, 2)),
          ((32, 128, 8, 2, True), (64, 16, 4, 2)),
          ((16, 64, 8, 2, True), (64, 16, 4, 2))],
    64: [((32, 128, 4, 3, True), (64, 64, 4, 3))],
}
TARGETS = ("D128 S>=2k >= 1.0 x FA2 in every cell (goal 0.85 x cuDNN); D64, D256 >= 1.0 x FA2; "
           "no cell below 0.5 x FA2")


def _kc(t, split=False) -> KernelConfig:
    m, n, w, s, *flag = t
    return KernelConfig(m, n, w, s, split=bool(flag and flag[0]) or split)


def label(t) -> str:
    dkdv, dq = t
    return f"dkdv {_kc(dkdv).short()} / dq {_kc(dq).short()}"


def _row(t) -> str:
    (m, n, w, s, split), dq = t
    return f"(({m}, {n}, {w}, {s}{', True' if split else ''}), {tuple(dq)})"


def _table_row(d) -> tuple:
    cfgs = _ORIG(torch.device("cuda", 0), torch.bfloat16, d, d)
    k, q = cfgs.dkdv, cfgs.dq
    return ((k.block_m, k.block_n, k.num_warps, k.num_stages, k.split),
            (q.block_m, q.block_n, q.num_warps, q.num_stages))


_ORIG = ops._backward_configs


def _use(t) -> None:
    """Make every backward launch use candidate ``t`` (the forward keeps its table row)."""
    if t is None:
        ops._backward_configs = _ORIG
        return
    dkdv, dq = _kc(t[0]), _kc(t[1])

    def patched(device, dtype, hd, hdv):
        return BackwardConfigs(dkdv, dq, _ORIG(device, dtype, hd, hdv).prep)
    ops._backward_configs = patched


def _inputs(b, s, h, d, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q, k, v, do


def _grads(q, k, v, do, causal):
    import portattn
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = portattn.attention(*leaves, causal=causal, backend="triton")
    return torch.autograd.grad(out, leaves, do)


def check(d, causal, t, device="cuda") -> str:
    """'' if candidate ``t`` passes the equivalence rule and repeats bit-identically, else why."""
    from portattn.testing import check_backend
    _use(t)
    # the timed problems' head count (hidden 2048): an integer argument divisible by 16 or not
    # compiles differently, and the timing must find these compiles in triton's cache
    h = 2048 // d
    try:
        for s, seed in ((200, 1), (333, 2)):   # ragged query and key tiles for every candidate
            q, k, v, _ = _inputs(2, s, h, d, seed, device)
            bad = [str(r) for r in check_backend("triton", q, k, v, grad=True, causal=causal) if not r.passed]
            if bad:
                return f"S{s}: " + "; ".join(bad)[:300]
        q, k, v, do = _inputs(1, 640, h, d, 3, device)   # the timed call path, twice
        first, second = _grads(q, k, v, do, causal), _grads(q, k, v, do, causal)
        for name, a, b in zip(("dq", "dk", "dv"), first, second):
            if not torch.equal(a, b):
                return f"{name} differs between two identical backward passes"
        return ""
    finally:
        _use(None)


def bwd_worker(jobs_json: str) -> None:
    """Compile (into triton's cache) and check each job; one JSON line per job on stdout."""
    device = base.WORKER_DEVICE
    for d, causal, t in json.loads(jobs_json):
        t = base._tuple(t)
        start = time.time()
        try:
            why = check(d, causal, t, device)
        except Exception as exc:
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        print("JOB " + json.dumps(dict(d=d, causal=causal, t=t, why=why, s=round(time.time() - start, 1))),
              flush=True)


def _bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _sdpa_bwd(q, k, v, do, causal, kernel):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qh, kh, vh = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with sdpa_kernel([getattr(SDPBackend, kernel)]):
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    doh = do.transpose(1, 2)
    return lambda: torch.autograd.grad(out, (qh, kh, vh), doh, retain_graph=True)


def _triton_bwd(q, k, v, do, causal):
    import portattn
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = portattn.attention(*leaves, causal=causal, backend="triton")
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def _time_cells(cells, dims, seqlens, cands, bad, deadline, save=lambda: None) -> None:
    for d in dims:
        h = 2048 // d
        for causal in (False, True):
            for s in seqlens:
                if time.time() > deadline - 4:
                    print(f"time limit: D{d} S{s} causal={causal} and later cells not timed", flush=True)
                    return
                b = max(1, 16384 // s)
                q, k, v, do = _inputs(b, s, h, d, 0)
                cell = dict(d=d, s=s, b=b, h=h, causal=causal, sdpa={}, triton={}, failed={})
                for kern in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                    try:
                        cell["sdpa"][kern] = _bench(_sdpa_bwd(q, k, v, do, causal, kern))
                    except Exception as exc:
                        cell["sdpa"][kern] = None
                        cell["failed"][kern] = f"{type(exc).__name__}: {str(exc)[:200]}"
                for i, t in enumerate(cands[d]):
                    name = "table" if i == 0 else label(t)
                    why = bad.get((d, causal, t), "not checked")
                    if why:
                        cell["failed"][name] = why
                        continue
                    if time.time() > deadline - 2:
                        cell["failed"][name] = "time limit"
                        continue
                    _use(t)
                    try:
                        cell["triton"][name] = _bench(_triton_bwd(q, k, v, do, causal))
                    except Exception as exc:
                        cell["failed"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    finally:
                        _use(None)
                cells.append(cell)
                print(_cell_line(cell), flush=True)
                save()
                q = k = v = do = None
                torch.cuda.empty_cache()


def _r(x, y) -> str:
    return f"{x / y:4.2f}" if x and y else " n/a"


def _cell_line(c) -> str:
    fa, cu = c["sdpa"].get("FLASH_ATTENTION"), c["sdpa"].get("CUDNN_ATTENTION")
    head = f"D{c['d']} S{c['s']:<5} {'causal' if c['causal'] else 'full  '}"
    parts = [f"FA2 {fa or float('nan'):.3f} ms cuDNN {cu or float('nan'):.3f} ms"]
    for name, ms in c["triton"].items():
        parts.append(f"{'table' if name == 'table' else name}: {ms:.3f} ms x FA2 {_r(fa, ms)} x cuDNN {_r(cu, ms)}")
    if c["failed"]:
        parts.append(f"{len(c['failed'])} not timed")
    return head + " | " + " | ".join(parts)


def _verdict(d, c, ms) -> str:
    fa, cu = c["sdpa"].get("FLASH_ATTENTION"), c["sdpa"].get("CUDNN_ATTENTION")
    if not fa:
        return "n/a"
    r = fa / ms
    need = 1.0 if (d != 128 or c["s"] >= 2048) else 0.5
    flag = "" if r >= need else (" (BELOW 0.5)" if r < 0.5 else " (below target)")
    goal = f" cuDNN {cu / ms:.2f}" if cu else ""
    return f"S{c['s']}{'c' if c['causal'] else ''} FA2 {r:.2f}{goal}{flag}"


def report(cells, cands, table) -> str:
    lines = ["# triton backward sweep (bf16, 16k tokens, hidden 2048, backward alone): ratio = other's time /"
             " triton's (> 1: triton faster)", f"# targets: {TARGETS}", ""]
    lines += [_cell_line(c) for c in cells]
    lines.append("")
    rows = []
    for d in sorted({c["d"] for c in cells}):
        dc = [c for c in cells if c["d"] == d and c["triton"]]
        names = ["table"] + [label(t) for t in cands[d][1:]]
        scores = base.mean_relative(dc, names)
        if not scores:
            lines.append(f"D{d}: no candidate timed in every cell")
            continue
        pretty = lambda n: f"{label(table[d])} (table)" if n == "table" else n  # noqa: E731
        ranking = base.ranking_text(scores, pretty)
        lines.append(f"D{d}: mean time relative to each cell's best: {ranking}")
        best = min(scores, key=lambda n: scores[n][0])
        lines.append(f"D{d}: best row {pretty(best)}: " + ", ".join(_verdict(d, c, c["triton"][best]) for c in dc))
        if best != "table":
            lines.append(f"D{d}: table row for comparison: " + ", ".join(
                _verdict(d, c, c["triton"]["table"]) for c in dc if "table" in c["triton"]))
        rows.append(f"{d}: {_row(cands[d][scores[best][1]])}")
    lines += ["", "# best rows for _BWD_NVIDIA['hopper'] in backends/triton/configs.py "
              "(BLOCK_D: ((dK/dV M, N, warps, stages[, split]), (dQ M, N, warps, stages))):", "    " + ", ".join(rows)]
    return "\n".join(lines)


def bwd_variants(args) -> None:
    """The --bwd-variants run: see the module docstring."""
    base.T0 = t0 = time.time()
    deadline = t0 + args.time_limit
    dims = [int(x) for x in args.dims.split(",")]
    if args.dims == "64,128,256":   # the default: the most important head dims first
        dims = [128, 256, 64]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    table = {d: _table_row(d) for d in dims}
    cands = {d: [table[d]] + [t for t in BWD_VARIANTS.get(d, []) if t != table[d]] for d in dims}
    # the table rows first (each then leads a worker), then the variants
    jobs = [(d, c, table[d]) for d in dims for c in (False, True)]
    # then the variants, D256's first (where the split should pay most), D64's last
    order = sorted(dims, key=lambda d: (d == 64, d != 256))
    jobs += [(d, c, t) for d in order for t in cands[d][1:] for c in (False, True)]
    print(f"backward sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}: {len(jobs)} compiles+checks in {args.jobs} processes, "
          f"limit {args.time_limit:.0f}s", flush=True)
    bad = base._fwd_precompile(jobs, args.jobs, t0 + args.time_limit * 0.6, flag="--bwd-worker", label=label,
                               alone=lambda j: False)
    cells = []

    passed = sum(1 for why in bad.values() if not why)
    checks = [f"# checks (float64 reference under docs/semantics.md, ragged S 200/333, and two identical backward"
              f" passes bit-identical at S 640): {passed}/{len(jobs)} candidate x causal compiles passed"]
    checks += [f"#   FAILED D{d} {'causal' if c else 'full'} {label(t)}: {why}" for (d, c, t), why in bad.items() if why]

    def save(final=False):
        text = report(cells, cands, table) + "\n\n" + "\n".join(checks)
        if final:
            print(text, flush=True)
        if not args.out:
            return
        os.makedirs(args.out, exist_ok=True)
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                    date=dt.datetime.now(dt.timezone.utc).isoformat(), seconds=round(time.time() - t0, 1),
                    complete=final, candidates={d: [label(t) for t in cands[d]] for d in dims}, targets=TARGETS,
                    method="torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) of one saved forward")
        fails = {f"D{d} {'causal' if c else 'full'} {label(t)}": w for (d, c, t), w in bad.items() if w}
        with open(os.path.join(args.out, "triton_bwd_sweep.json"), "w") as fh:
            json.dump(dict(meta=meta, cells=cells, check_failures=fails), fh, indent=1)
        with open(os.path.join(args.out, "triton_bwd_sweep.txt"), "w") as fh:
            fh.write(text + ("\n" if final else "\n# (partial: the run was still timing)\n"))

    save()
    try:
        _time_cells(cells, dims, seqlens, cands, bad, deadline, save)
    except Exception as exc:   # a dead CUDA context, say: keep what was measured
        print(f"timing stopped: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    finally:
        _use(None)
    save(final=True)
    print(f"backward sweep done in {time.time() - t0:.0f}s", flush=True)
