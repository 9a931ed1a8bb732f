"""``tools/triton_sweep.py --bwd-variants``: the Triton backward with FlashAttention-2's atomic dQ
against the deterministic two-kernel backward (issue #14: the backward at >= 1.0 x FA2), in ONE
bounded run on one GPU.

    python tools/triton_sweep.py --bwd-variants --out $OUT --time-limit 185 [--dims 128,256,64]

Candidates per head dim (bf16): ``det``, the table's deterministic rows (dQ kernel + dK/dV
kernel); ``atomic``, the table's atomic-dQ row (``BackwardConfigs.atomic``: the dK/dV kernel also
adds dS K into a float32 dQ, no dQ kernel; for D 256 also the table's dK/dV row with atomic dQ);
and the atomic rows of :data:`ATOMIC_VARIANTS`. PORTATTN_DETERMINISTIC is cleared and
PORTATTN_TRITON_DQ=atomic set for the run (atomic dQ runs only when determinism is not requested;
``auto`` would take only rows marked timed).

1. every candidate is compiled and checked in ``--jobs`` parallel processes, causal and not:
   dq/dk/dv (and out, lse) against the float64 reference under docs/semantics.md's equivalence
   rule (``portattn.testing.check_backend``, i.e. ``portattn.numerics.compare``) on ragged bf16
   problems (S 200 and 333, several key tiles adding into each dQ row), then two backward passes
   at S 640: ``det`` must repeat bit-identically; ``atomic`` must repeat dK and dV bit-identically
   (each program owns its tile) and dQ to within 1 % of its largest element (the order of the
   float32 additions follows the schedule: expect a bf16 ulp or so), and must have taken the
   atomic path. A failing candidate is reported, never timed;
2. the backward alone (``torch.autograd.grad`` of one saved forward, as benchmarks/bench_attention.py
   times it) of every passing candidate, beside torch SDPA's flash (FA2) and cuDNN backward, on bf16
   problems of 16k tokens and hidden 2048, S 1k/4k/16k, causal and not;
3. ``triton_bwd_sweep.json`` and ``triton_bwd_sweep.txt`` under ``--out``, rewritten after every
   timed cell (so an outer ``timeout`` keeps what was measured): per cell each candidate's time and
   ratio x FA2 and x cuDNN; per head dim the ranking, the best row's verdict against the targets,
   atomic's speed-up over ``det`` per cell, and last the ``_BWD_ATOMIC_NVIDIA['hopper']`` rows to
   paste into backends/triton/configs.py (None where the deterministic backward was faster).

Compile time counts against the limit: the compiles get 60% of it, and cells not reached in time
are reported as such. On the H200 (16 cores, 14 compile processes) 30 compile+check jobs and 18
cells fit in ~100-150 s with a cold triton cache.
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

# Atomic-dQ dK/dV rows timed beside the table's, per head dim: (block_m streamed queries, block_n
# resident keys, warps, stages, split). sm_90 bf16 cross-compiles with triton 3.9 (2026-12-01;
# shared memory bytes, stack bytes per thread at 255 registers; the H200's triton 3.6 allocates
# differently): D64 M32 N128 w4 s3 (table) 66048/904, M32 N128 w8 s3 66048/16, M64 N128 w8 s2
# 82432/280, M64 N64 w4 s3 74752/496; D128 M64 N128 w8 s2 (table) 147968/760, M32 N128 w8 s2
# 114944/368, M64 N64 w8 s2 115712/632; D256 split M16 N128 w8 s2 (table) 180352/344, M32 N128
# w8 s2 (the deterministic table's split row) 229632/680 (limit 232448), M32 N64 w8 s2 164096/704.
# Every product is a wgmma (dQ is formed transposed, Kᵀ dSᵀ: its M dimension is the head dim).
ATOMIC_VARIANTS = {
    128: [(32, 128, 8, 2, False), (64, 64, 8, 2, False), (64, 128, 8, 3, False)],
    256: [(32, 128, 8, 2, True), (32, 64, 8, 2, True), (16, 128, 8, 3, True)],
    64: [(32, 128, 8, 3, False), (64, 128, 8, 2, False), (64, 64, 4, 3, False)],
}
TARGETS = ("D128 S>=2k >= 1.0 x FA2 in every cell (goal 0.85 x cuDNN); D64, D256 >= 1.0 x FA2; "
           "no cell below 0.5 x FA2")
DET, ATOMIC = "det (table)", "atomic (table)"


def _kc(t) -> KernelConfig:
    m, n, w, s, *flag = t
    return KernelConfig(m, n, w, s, split=bool(flag and flag[0]))


def _norm(t) -> tuple:
    """A (m, n, warps, stages, split) row from a 4- or 5-tuple."""
    m, n, w, s, *flag = t
    return (m, n, w, s, bool(flag and flag[0]))


def label(t) -> str:
    """A candidate ``(dkdv, dq, atomic or None)``'s name: the rows that run."""
    dkdv, dq, atomic = t
    if atomic is None:
        return f"det dkdv {_kc(dkdv).short()} / dq {_kc(dq).short()}"
    return f"atomic dkdv {_kc(atomic).short()}"


def _row(atomic) -> str:
    if atomic is None:
        return "None"
    m, n, w, s, split = _norm(atomic)
    return f"({m}, {n}, {w}, {s}{', True' if split else ''})"


def _cfg_tuple(c: KernelConfig) -> tuple:
    return (c.block_m, c.block_n, c.num_warps, c.num_stages, c.split)


def _table_rows(d) -> tuple[tuple, tuple | None]:
    """(the deterministic candidate, the table's atomic candidate or None) for head dim ``d``."""
    cfgs = _ORIG(torch.device("cuda", 0), torch.bfloat16, d, d)
    dkdv, dq = _cfg_tuple(cfgs.dkdv), _cfg_tuple(cfgs.dq)[:4]
    det = (dkdv, dq, None)
    return det, ((dkdv, dq, _cfg_tuple(cfgs.atomic)) if cfgs.atomic is not None else None)


def candidates(d) -> list[tuple]:
    """det first, then the table's atomic row, then the table's dK/dV row with atomic dQ and the variants."""
    det, atomic = _table_rows(d)
    dkdv, dq, _ = det
    out = [det] + ([atomic] if atomic else [])
    for row in [dkdv] + ATOMIC_VARIANTS.get(d, []):
        t = (dkdv, dq, _norm(row))
        if t not in out:
            out.append(t)
    return out


_ORIG = ops._backward_configs


def _use(t) -> None:
    """Make every backward launch use candidate ``t`` (the forward keeps its table row)."""
    if t is None:
        ops._backward_configs = _ORIG
        return
    dkdv, dq = _kc(t[0]), _kc(t[1])
    atomic = _kc(t[2]) if t[2] is not None else None

    def patched(device, dtype, hd, hdv):
        return BackwardConfigs(dkdv, dq, _ORIG(device, dtype, hd, hdv).prep, atomic=atomic)
    ops._backward_configs = patched


def _nondeterministic() -> None:
    """Atomic dQ runs only when determinism is not requested: clear both switches for this process."""
    os.environ.pop("PORTATTN_DETERMINISTIC", None)
    os.environ["PORTATTN_TRITON_DQ"] = "atomic"   # every candidate's own row, timed or not
    torch.use_deterministic_algorithms(False)


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
    """'' if candidate ``t`` passes the equivalence rule and its repeat check (bit-identical for
    det; dK, dV bit-identical and dQ within 1 % for atomic, which must take the atomic path), else why."""
    from portattn.spec import build_spec
    from portattn.testing import check_backend
    _nondeterministic()
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
        spec = build_spec(*(x.detach().requires_grad_(True) for x in (q, k, v)), causal=causal)
        cfgs = ops.backward_configs_for(spec)
        want = None if t[2] is None else _kc(t[2])
        exact = spec.dtype == torch.float32   # 16-bit autograd calls keep the forward's residual
        if spec.deterministic or ops.atomic_config(spec, cfgs, exact, False) != want:
            return f"the backward would not run this candidate's path (deterministic={spec.deterministic})"
        first, second = _grads(q, k, v, do, causal), _grads(q, k, v, do, causal)
        for name, a, b in zip(("dq", "dk", "dv"), first, second):
            if torch.equal(a, b):
                continue
            if t[2] is None or name != "dq":
                return f"{name} differs between two identical backward passes"
            spread = ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30)).item()
            if spread > 0.01:
                return f"dq of two identical backward passes differs by {spread:.3g} of its largest element"
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


def _time_cells(cells, dims, seqlens, cands, names, bad, deadline, save=lambda: None) -> None:
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
                for t, name in zip(cands[d], names[d]):
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
        parts.append(f"{name}: {ms:.3f} ms x FA2 {_r(fa, ms)} x cuDNN {_r(cu, ms)}")
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


def report(cells, cands, names, table) -> str:
    """The text report: ``cands[d]`` the candidates of head dim ``d`` (det first), ``names[d]`` their
    names in the cells, ``table[d]`` the table's deterministic candidate."""
    lines = ["# triton backward sweep, atomic dQ vs deterministic (bf16, 16k tokens, hidden 2048, backward alone):"
             " ratio = other's time / triton's (> 1: triton faster)", f"# targets: {TARGETS}", ""]
    lines += [_cell_line(c) for c in cells]
    lines.append("")
    rows, wins = {}, set()
    for d in sorted({c["d"] for c in cells}):
        dc = [c for c in cells if c["d"] == d and c["triton"]]
        full = dict(zip(names[d], (label(t) for t in cands[d])))
        pretty = lambda n: f"{full[n]} (table)" if n in (DET, ATOMIC) else n  # noqa: E731
        scores = base.mean_relative(dc, names[d])
        if not scores:
            lines.append(f"D{d}: no candidate timed in every cell")
            continue
        lines.append(f"D{d}: mean time relative to each cell's best: {base.ranking_text(scores, pretty)}")
        best = min(scores, key=lambda n: scores[n][0])
        lines.append(f"D{d}: best {pretty(best)}: " + ", ".join(_verdict(d, c, c["triton"][best]) for c in dc))
        atomic = [n for n in scores if cands[d][scores[n][1]][2] is not None]
        if atomic:
            top = min(atomic, key=lambda n: scores[n][0])
            speed = ", ".join(f"S{c['s']}{'c' if c['causal'] else ''} {c['triton'][DET] / c['triton'][top]:.2f}"
                              for c in dc if DET in c["triton"])
            lines.append(f"D{d}: speed-up of the best atomic row {pretty(top)} over {pretty(DET)}: {speed or 'n/a'}")
            if best == DET:
                lines.append(f"D{d}: the deterministic backward was faster: atomic dQ stays off by default there")
            else:
                wins.add(d)
            rows[d] = cands[d][scores[top][1]][2]   # the best atomic row, for PORTATTN_TRITON_DQ=atomic
        elif DET in scores:
            lines.append(f"D{d}: no atomic candidate timed in every cell: keep the table's atomic row (untimed)")
    paste = []
    for d in (16, 32, 64, 128, 256):
        src = 64 if d < 64 else d
        if src in rows:
            paste.append(f"{d}: {_row(rows[src])}")
    on = sorted(d for d in (16, 32, 64, 128, 256) if (64 if d < 64 else d) in wins)
    lines += ["", "# rows for _BWD_ATOMIC_NVIDIA['hopper'] in backends/triton/configs.py (BLOCK_D: (dK/dV M, N, warps,"
              " stages[, True = split]): each head dim's best atomic row; D 16/32 take D 64's):",
              "    " + (", ".join(paste) if paste else "(none measured)"),
              "# and _BWD_ATOMIC_BY_DEFAULT['hopper'] (the head dims where atomic dQ beat the deterministic backward):",
              f"    frozenset({{{', '.join(map(str, on))}}})" if on else "    frozenset()"]
    return "\n".join(lines)


def bwd_variants(args) -> None:
    """The --bwd-variants run: see the module docstring."""
    base.T0 = t0 = time.time()
    deadline = t0 + args.time_limit
    _nondeterministic()   # the workers inherit the environment
    dims = [int(x) for x in args.dims.split(",")]
    if args.dims == "64,128,256":   # the default: the most important head dims first
        dims = [128, 256, 64]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    cands = {d: candidates(d) for d in dims}
    table = {d: cands[d][0] for d in dims}
    has_atomic = {d: _table_rows(d)[1] is not None for d in dims}
    names = {d: [DET] + [ATOMIC if (i == 1 and has_atomic[d]) else label(t) for i, t in enumerate(cands[d][1:], 1)]
             for d in dims}
    # the table rows first (each then leads a worker), D128's first, D64's last, then the variants
    order = sorted(dims, key=lambda d: (d == 64, d != 128))
    jobs = [(d, c, t) for d in order for t in cands[d][:2] for c in (False, True)]
    jobs += [(d, c, t) for d in order for t in cands[d][2:] for c in (False, True)]
    print(f"backward sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}: {len(jobs)} compiles+checks in {args.jobs} processes, "
          f"limit {args.time_limit:.0f}s", flush=True)
    bad = base._fwd_precompile(jobs, args.jobs, t0 + args.time_limit * 0.6, flag="--bwd-worker", label=label,
                               alone=lambda j: False)
    cells = []

    passed = sum(1 for why in bad.values() if not why)
    checks = [f"# checks (float64 reference under docs/semantics.md at ragged S 200/333; two identical backward passes"
              f" at S 640: det bit-identical, atomic dK/dV bit-identical and dQ within 1%): {passed}/{len(jobs)}"
              f" candidate x causal compiles passed"]
    checks += [f"#   FAILED D{d} {'causal' if c else 'full'} {label(t)}: {why}" for (d, c, t), why in bad.items() if why]

    def save(final=False):
        text = report(cells, cands, names, table) + "\n\n" + "\n".join(checks)
        if final:
            print(text, flush=True)
        if not args.out:
            return
        os.makedirs(args.out, exist_ok=True)
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                    date=dt.datetime.now(dt.timezone.utc).isoformat(), seconds=round(time.time() - t0, 1),
                    complete=final, candidates={d: dict(zip(names[d], map(label, cands[d]))) for d in dims},
                    targets=TARGETS,
                    method="torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) of one saved forward")
        fails = {f"D{d} {'causal' if c else 'full'} {label(t)}": w for (d, c, t), w in bad.items() if w}
        with open(os.path.join(args.out, "triton_bwd_sweep.json"), "w") as fh:
            json.dump(dict(meta=meta, cells=cells, check_failures=fails), fh, indent=1)
        with open(os.path.join(args.out, "triton_bwd_sweep.txt"), "w") as fh:
            fh.write(text + ("\n" if final else "\n# (partial: the run was still timing)\n"))

    save()
    try:
        _time_cells(cells, dims, seqlens, cands, names, bad, deadline, save)
    except Exception as exc:   # a dead CUDA context, say: keep what was measured
        print(f"timing stopped: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    finally:
        _use(None)
    save(final=True)
    print(f"backward sweep done in {time.time() - t0:.0f}s", flush=True)
