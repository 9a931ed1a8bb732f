"""Ring attention on several GPUs (issue #18): correctness against single-GPU attention, time per
step at fixed total sequence lengths, the fraction of communication hidden, peak memory per GPU.

    torchrun --nproc-per-node=N tools/ring_bench.py --out DIR        # one world size (NCCL)
    python tools/ring_bench.py --launch 1,2,4 --out DIR               # torchrun per N, merged table
    torchrun --nproc-per-node=2 tools/ring_bench.py --backend gloo --device cpu --tiny --out DIR
    python tools/ring_bench.py --simulate 2,4,8 --out DIR             # one GPU: rings simulated by threads
    python tools/ring_bench.py --cost-table                           # docs/distributed.md's table

Writes ``DIR/ring-w{N}.json`` per world size (rank 0) and, with ``--launch``,
``DIR/ring-scaling.json`` and ``DIR/ring-scaling.txt`` (all world sizes, speed-up against 1 GPU).
``--simulate`` (no process group, one device) writes ``DIR/ring-simulated.json``: the same
correctness cases for rings of each size with threads as ranks, and the busiest rank's compute
time per call with the communication off (the ring's time if the transfers are hidden), its
peak memory, and the speed-up that implies against 1 GPU.

Correctness (``--check-seqlen`` tokens, default 4096; B 1, Hq 8, Hkv 2, D 128): causal zigzag,
causal contiguous and non-causal zigzag in bf16, forward and backward (and the lse with its
gradient), gathered to rank 0 and held to the equivalence rule (docs/semantics.md) against the
float64 reference over the full sequence; single-GPU ``portattn.attention`` on the same inputs
is scored the same way beside it.

Timing (``--seqlens``, default 131072 and 524288 total tokens; B 1, Hq 32, Hkv 8, D 128, bf16,
causal, zigzag): forward and forward+backward per call (medians of ``--reps`` after a warm-up,
CUDA-synchronised, all ranks started together by a barrier), also with the communication
switched off (compute only: every rank keeps its own K/V) and with the compute switched off
(communication only). hidden = (t_compute + t_comm - t_ring) / t_comm, clipped to [0, 1]. Peak
memory: ``torch.cuda.max_memory_allocated`` per rank for the full ring call.

NCCL's NVLink multicast (NVLS) stays off: this script sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before torch is imported.
"""

from __future__ import annotations

import os

# Before torch / NCCL initialise (and inherited by the torchrun children of --launch).
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(_NO_MULTICAST)

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ----- the cost model (docs/distributed.md) ---------------------------------------------------------

def step_cost(L: int, hq: int, hkv: int, d: int, *, batch: int = 1, elem: int = 2, causal: bool = True,
              fwd_flops: float = 590e12, bwd_flops: float = 540e12, bandwidth: float = 400e9,
              latency: float = 20e-6) -> dict:
    """Per ring step and rank, zigzag sharding, ``L`` tokens per GPU: compute and communication
    seconds, forward and backward, with the attention rates (FLOP/s, the GPU.md convention:
    forward 4·B·H·Sq·Sk·D, halved for causal, backward 2.5x forward) and the one-direction link
    bandwidth (bytes/s) given. The ring's backward also recomputes each block's forward."""
    fwd = 4 * batch * hq * L * L * d * (0.5 if causal else 1.0)
    kv_bytes = 2 * batch * L * hkv * d * elem            # K and V of one shard
    dkv_bytes = 2 * batch * L * hkv * d * 4              # dK, dV travel in float32
    out = {
        "fwd_compute_s": fwd / fwd_flops,
        "fwd_comm_s": latency + kv_bytes / bandwidth,
        "bwd_compute_s": fwd / fwd_flops + 2.5 * fwd / bwd_flops,
        "bwd_comm_s": 2 * latency + (kv_bytes + dkv_bytes) / bandwidth,
    }
    out["fwd_hidden"] = out["fwd_compute_s"] >= out["fwd_comm_s"]
    out["bwd_hidden"] = out["bwd_compute_s"] >= out["bwd_comm_s"]
    return out


def hiding_length(hq: int, hkv: int, d: int, *, mode: str = "fwd", **kw) -> int:
    """The smallest tokens-per-GPU ``L`` (a multiple of 64) at which a step's compute covers its
    communication; compute grows as L² and bytes as L, so past it everything is hidden."""
    lo, hi = 64, 64
    key_c, key_m = f"{mode}_compute_s", f"{mode}_comm_s"
    while True:
        c = step_cost(hi, hq, hkv, d, **kw)
        if c[key_c] >= c[key_m]:
            break
        lo, hi = hi, hi * 2
        if hi > 1 << 26:
            return -1
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64
        c = step_cost(mid, hq, hkv, d, **kw)
        lo, hi = (lo, mid) if c[key_c] >= c[key_m] else (mid, hi)
    return hi


def cost_table() -> str:
    """The markdown table of docs/distributed.md: bf16, causal, zigzag, B 1, D 128, the H200's
    measured SDPA rates of /work/shared/GPU.md (non-causal, S 16k: zigzag's off-diagonal blocks
    are unmasked) as the compute rate."""
    links = [("NVLink-class", 400e9), ("PCIe Gen5 x16", 50e9), ("PCIe Gen4 x16", 25e9)]
    rates = [("594/539 (cuDNN)", 594e12, 539e12), ("346/310 (FA2)", 346e12, 310e12)]
    heads = [(32, 8), (32, 32)]
    lines = ["| link, one direction | TFLOP/s fwd/bwd | Hq/Hkv | L* fwd, bandwidth only | L* fwd | L* fwd+bwd "
             "| fwd step at L* |", "|---|---|---|---|---|---|---|"]
    for link, bw in links:
        for rate, ff, fb in rates:
            for hq, hkv in heads:
                kw = dict(fwd_flops=ff, bwd_flops=fb, bandwidth=bw)
                l0 = hiding_length(hq, hkv, 128, mode="fwd", latency=0.0, **kw)
                lf = hiding_length(hq, hkv, 128, mode="fwd", **kw)
                lb = hiding_length(hq, hkv, 128, mode="bwd", **kw)
                c = step_cost(lf, hq, hkv, 128, **kw)
                lines.append(f"| {link} {bw / 1e9:.0f} GB/s | {rate} | {hq}/{hkv} | {l0} | {lf} | {max(lf, lb)} | "
                             f"{c['fwd_compute_s'] * 1e6:.0f} µs |")
    return "\n".join(lines)


# ----- the worker (under torchrun) ------------------------------------------------------------------

def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _versions(device) -> dict:
    import torch
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "env": dict(_NO_MULTICAST)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
        try:   # how the GPUs are linked (NVLink / PCIe), for reading the bandwidth
            info["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                              timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            pass
    return info


CHECK_CASES = ((True, "zigzag"), (True, "contiguous"), (False, "zigzag"))


def _check_inputs(args, device, dtype):
    """Full-sequence q, k, v, dout, dlse of the correctness cases (same on every rank)."""
    import torch
    s, hq, hkv, d = args.check_seqlen, args.check_heads, args.check_kv_heads, args.check_head_dim
    g = torch.Generator(device="cpu").manual_seed(7)
    q, k, v = (torch.randn(1, s, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv))
    dout = torch.randn(1, s, hq, d, generator=g).to(device, dtype)
    dlse = torch.randn(1, hq, s, generator=g).to(device)
    return q, k, v, dout, dlse


def _score(args, causal: bool, sharding: str, world: int, inputs, got: dict) -> dict:
    """The ring's full-sequence results ``got`` and single-device ``portattn.attention`` on the
    same inputs, each held to the equivalence rule against the float64 reference."""
    import torch

    import portattn
    from portattn.numerics import GRAD_FACTOR, compare, compare_lse
    from portattn.reference import naive_forward, reference_forward
    from portattn.spec import build_spec

    q, k, v, dout, dlse = inputs
    sq, sk, sv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o1, l1 = portattn.attention(sq, sk, sv, causal=causal, return_lse=True, backend=args.local_backend)
    ((o1.float() * dout.float()).sum() + (l1 * dlse).sum()).backward()
    single = {"out": o1.detach(), "lse": l1.detach(), "dq": sq.grad, "dk": sk.grad, "dv": sv.grad}
    rq, rk, rv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    nq, nk, nv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ro, rl = reference_forward(build_spec(rq, rk, rv, causal=causal))
    no, nl = naive_forward(build_spec(nq, nk, nv, causal=causal))
    g_ref = torch.autograd.grad((ro * dout.double()).sum() + (rl.double() * dlse.double()).sum(), (rq, rk, rv))
    g_naive = torch.autograd.grad((no.float() * dout.float()).sum() + (nl * dlse).sum(), (nq, nk, nv))
    magnitude = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * q.shape[-1] ** -0.5
    row = {"causal": causal, "sharding": sharding, "dtype": str(q.dtype).replace("torch.", ""),
           "seqlen": q.shape[1], "heads": [q.shape[2], k.shape[2]], "head_dim": q.shape[-1], "world": world}
    for who, res in (("ring", got), ("single", single)):
        comps = [compare("out", res["out"], ro, no), compare_lse(res["lse"], rl)]
        comps += [compare(n, res[n], r, nv_, factor=GRAD_FACTOR, zero_ref_scale=magnitude)
                  for n, r, nv_ in zip(("dq", "dk", "dv"), g_ref, g_naive)]
        row[who] = {c.name: {"passed": c.passed, "max_err": c.max_err, "score": c.score} for c in comps}
    row["ring_vs_single_max_abs"] = {n: (got[n].double() - single[n].double()).abs().max().item() for n in got}
    row["passed"] = all(c["passed"] for c in row["ring"].values())
    return row


def _correctness(args, device, dtype) -> list[dict]:
    """Ring (this process group) vs the float64 reference, scored on rank 0."""
    import torch.distributed as dist

    from portattn import distributed as D

    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for causal, sharding in CHECK_CASES:
        inputs = _check_inputs(args, device, dtype)
        q, k, v, dout, dlse = inputs
        leaves = [D.shard_sequence(t, sharding=sharding).detach().requires_grad_(True) for t in (q, k, v)]
        out, lse = D.ring_attention(*leaves, causal=causal, sharding=sharding, return_lse=True,
                                    backend=args.local_backend)
        loss = (out.float() * D.shard_sequence(dout, sharding=sharding).float()).sum() + \
            (lse * D.shard_sequence(dlse, sharding=sharding, seq_dim=2)).sum()
        loss.backward()
        got = {"out": D.gather_sequence(out.detach(), sharding=sharding),
               "lse": D.gather_sequence(lse.detach(), sharding=sharding, seq_dim=2)}
        for name, leaf in zip(("dq", "dk", "dv"), leaves):
            got[name] = D.gather_sequence(leaf.grad, sharding=sharding)
        if rank == 0:
            results.append(_score(args, causal, sharding, world, inputs, got))
        del got, leaves, out, lse
        dist.barrier()
    return results


def _time(fn, reps: int, device) -> float:
    import torch.distributed as dist
    fn()                      # warm-up (kernel compilation, NCCL connections)
    times = []
    for _ in range(reps):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timing(args, device, dtype) -> list[dict]:
    import torch
    import torch.distributed as dist

    from portattn import distributed as D

    world, rank = dist.get_world_size(), dist.get_rank()
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    rows = []
    start = time.perf_counter()
    for total in sorted(args.seqlens):
        # every rank must agree to go on (a rank that stopped alone would leave the others waiting)
        go = torch.tensor([1.0 if not args.time_limit or time.perf_counter() - start < args.time_limit else 0.0],
                          device=device)
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if go.item() < 1:
            if rank == 0:
                print(f"time limit {args.time_limit} s reached: skipping {total} tokens and longer", flush=True)
            break
        L = total // world
        g = torch.Generator(device="cpu").manual_seed(rank)
        t = {"q": torch.randn(1, L, hq, d, generator=g).to(device, dtype)}
        t["k"], t["v"] = (torch.randn(1, L, hkv, d, generator=g).to(device, dtype) for _ in range(2))
        t["dout"] = torch.randn(1, L, hq, d, generator=g).to(device, dtype)
        t["leaves"] = [t[n].detach().requires_grad_(True) for n in "qkv"]
        kw = dict(causal=args.causal, sharding=args.sharding, backend=args.local_backend)

        def fwd():
            with torch.no_grad():
                D.ring_attention(t["q"], t["k"], t["v"], **kw)

        def fwdbwd():
            out = D.ring_attention(*t["leaves"], **kw)
            torch.autograd.grad(out, t["leaves"], t["dout"])

        row = {"total_tokens": total, "tokens_per_gpu": L, "world": world, "heads": [hq, hkv],
               "head_dim": d, "dtype": str(dtype).replace("torch.", ""), "causal": args.causal,
               "sharding": args.sharding}
        for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t_ring = _time(fn, args.reps, device)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            entry = {"ring_s": t_ring, "per_ring_step_s": t_ring / world,
                     "local_backends": D._LAST.get("backends")}
            if world > 1:
                with D._ablation(comm=False):
                    entry["compute_only_s"] = _time(fn, args.reps, device)
                with D._ablation(compute=False):
                    entry["comm_only_s"] = _time(fn, args.reps, device)
                exposed = t_ring - entry["compute_only_s"]
                comm = entry["comm_only_s"]
                # bytes one rank sends per call: K and V in W-1 steps of the forward (and again in
                # the backward), dK/dV in float32 in W hops of the backward
                elem = torch.empty(0, dtype=dtype).element_size()
                shard = 2 * L * hkv * d
                sent = (world - 1) * shard * elem * (1 if mode == "fwd" else 2) + (0 if mode == "fwd" else world * shard * 4)
                entry["bytes_sent_per_rank"] = sent
                entry["link_GBps_measured"] = sent / comm / 1e9 if comm > 0 else None
                entry["comm_hidden_fraction"] = max(0.0, min(1.0, 1 - exposed / comm)) if comm > 0 else 1.0
            peaks = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
            dist.all_gather(peaks, torch.tensor([float(peak)], dtype=torch.float64, device=device))
            entry["peak_mem_gib_per_rank"] = [p.item() / 2**30 for p in peaks]
            row[mode] = entry
        model = step_cost(L, hq, hkv, d, causal=args.causal)
        row["model_step_s"] = {k: v for k, v in model.items() if k.endswith("_s")}
        rows.append(row)
        if rank == 0:
            print(_row_line(row), flush=True)
        t.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _row_line(row: dict) -> str:
    f, b = row["fwd"], row["fwdbwd"]
    hid = (f"hidden fwd {f['comm_hidden_fraction']:.2f} fwd+bwd {b['comm_hidden_fraction']:.2f}"
           if "comm_hidden_fraction" in f else "hidden -")
    return (f"W={row['world']} S={row['total_tokens']} L={row['tokens_per_gpu']} "
            f"[{','.join(b.get('local_backends') or [])}]: fwd {f['ring_s'] * 1e3:.1f} ms "
            f"fwd+bwd {b['ring_s'] * 1e3:.1f} ms {hid} peak {max(b['peak_mem_gib_per_rank']):.1f} GiB")


def _device(args):
    """This rank's device; for NCCL it must be current before the process group starts."""
    import torch
    if args.device != "cuda":
        return torch.device(args.device)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def run(args) -> dict:
    """The measurements of one world size; the caller has initialised torch.distributed."""
    import torch
    import torch.distributed as dist

    device = _device(args)
    rank = dist.get_rank()
    dtype = getattr(torch, args.dtype)
    report = {"versions": _versions(device), "world": dist.get_world_size(), "backend": dist.get_backend(),
              "args": {k: v for k, v in vars(args).items() if k not in ("launch",)}}
    report["correctness"] = _correctness(args, device, dtype)
    report["timing"] = _timing(args, device, dtype)
    if rank == 0 and args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"ring-w{report['world']}.json").write_text(json.dumps(report, indent=1))
        for row in report["correctness"]:
            print(f"check W={row['world']} causal={row['causal']} {row['sharding']}: "
                  f"{'ok' if row['passed'] else 'FAIL'} " + " ".join(
                      f"{n}={c['max_err']:.2g}" if n == "lse" else f"{n}={c['score']:.2f}/{row['single'][n]['score']:.2f}"
                      for n, c in row["ring"].items()),
                  flush=True)
    return report


# ----- one GPU, the ring simulated (threads as ranks) --------------------------------------------------

def _time_local(fn, reps: int, device) -> float:
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def simulate(args) -> dict:
    """The ring of each world size in ``args.simulate`` on this one device: correctness of the
    local blocks, merges and gradient formulas (threads pass the messages), and the compute time
    of the busiest rank per call with the communication off, i.e. the ring's time on that many
    GPUs if the transfers are hidden (docs/distributed.md's cost model says when they are)."""
    import torch

    from portattn import distributed as D
    from portattn.spec import build_spec

    device = _device(args) if args.device == "cuda" else torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    report = {"versions": _versions(device), "mode": "simulate", "worlds": args.simulate,
              "args": {k: v for k, v in vars(args).items() if k not in ("launch", "merge")},
              "correctness": [], "timing": []}
    for world in args.simulate:
        for causal, sharding in CHECK_CASES:
            inputs = _check_inputs(args, device, dtype)
            q, k, v, dout, dlse = inputs
            got = D.simulate_ring(q, k, v, world, causal=causal, sharding=sharding, backend=args.local_backend,
                                  dout=dout, dlse=dlse)
            row = _score(args, causal, sharding, world, inputs, got)
            report["correctness"].append(row)
            print(f"simulated check W={world} causal={causal} {sharding}: {'ok' if row['passed'] else 'FAIL'} "
                  + " ".join(f"{n}={c['max_err']:.2g}" if n == "lse" else f"{n}={c['score']:.2f}"
                             for n, c in row["ring"].items()), flush=True)
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    start = time.perf_counter()
    for total in sorted(args.seqlens):
        base = None
        for world in sorted({1, *args.simulate}):
            if args.time_limit and time.perf_counter() - start > args.time_limit:
                print(f"time limit {args.time_limit} s reached: stopping before W={world} S={total}", flush=True)
                break
            meta = [torch.empty(1, total, h, d, device="meta", dtype=dtype) for h in (hq, hkv, hkv)]
            spec = build_spec(*meta, causal=args.causal)
            # zigzag: every rank does the same work, time rank 0; contiguous: the last rank is the busiest
            rank = 0 if args.sharding == "zigzag" else world - 1
            cfg = D._local_config(spec, world, rank, args.sharding, args.local_backend, True)
            L = total // world
            g = torch.Generator(device="cpu").manual_seed(rank)
            t = {"q": torch.randn(1, L, hq, d, generator=g).to(device, dtype)}
            t["k"], t["v"] = (torch.randn(1, L, hkv, d, generator=g).to(device, dtype) for _ in range(2))
            t["dout"] = torch.randn(1, L, hq, d, generator=g).to(device, dtype)

            def fwd():
                with torch.no_grad():
                    t["saved"] = D._ring_forward(cfg, t["q"], t["k"], t["v"], t.setdefault("chosen", {}))

            def fwdbwd():
                fwd()
                out, lse = t.pop("saved")
                D._ring_backward(cfg, t["q"], t["k"], t["v"], out, lse, t["dout"], None, t["chosen"])

            row = {"total_tokens": total, "tokens_per_gpu": L, "world": world, "rank_timed": rank,
                   "heads": [hq, hkv], "head_dim": d, "dtype": args.dtype, "causal": args.causal,
                   "sharding": args.sharding}
            with D._ablation(comm=False):
                for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    secs = _time_local(fn, args.reps, device)
                    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
                    row[mode] = {"compute_s": secs, "peak_mem_gib": peak, "local_backends": D._LAST.get("backends")}
                    t.pop("saved", None)
            model = step_cost(L, hq, hkv, d, causal=args.causal)
            row["model_step_s"] = {k: v for k, v in model.items() if k.endswith("_s")}
            if base is None:
                base = row
            row["speedup_if_hidden"] = {m: base[m]["compute_s"] / row[m]["compute_s"] for m in ("fwd", "fwdbwd")}
            report["timing"].append(row)
            print(f"simulated W={world} S={total} L={L} rank {rank} [{','.join(row['fwd']['local_backends'] or [])}]: fwd {row['fwd']['compute_s'] * 1e3:.1f} ms "
                  f"fwd+bwd {row['fwdbwd']['compute_s'] * 1e3:.1f} ms (speed-up if hidden "
                  f"{row['speedup_if_hidden']['fwd']:.2f}x / {row['speedup_if_hidden']['fwdbwd']:.2f}x) peak "
                  f"{row['fwdbwd']['peak_mem_gib']:.1f} GiB", flush=True)
            t.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ring-simulated.json").write_text(json.dumps(report, indent=1))
    return report


# ----- the launcher ---------------------------------------------------------------------------------

def _launch(args, argv: list[str]) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rest = [a for i, a in enumerate(argv) if a != "--launch" and not a.startswith("--launch=")
            and (i == 0 or argv[i - 1] != "--launch")]
    reports, rc = [], 0
    for n in args.launch:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               str(Path(__file__).resolve()), *rest]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=dict(os.environ, **_NO_MULTICAST)) or rc
        path = out / f"ring-w{n}.json"
        if path.exists():
            reports.append(json.loads(path.read_text()))
    _summary(reports, out)
    return rc


def _summary(reports: list[dict], out: Path) -> None:
    """ring-scaling.json / .txt: every world size, with the speed-up against 1 GPU."""
    reports = sorted(reports, key=lambda r: r["world"])
    lines = []
    base = {r["total_tokens"]: r for rep in reports if rep["world"] == 1 for r in rep["timing"]}
    for rep in reports:
        for row in rep["timing"]:
            one = base.get(row["total_tokens"])
            speed = (f" speed-up fwd {one['fwd']['ring_s'] / row['fwd']['ring_s']:.2f}x "
                     f"fwd+bwd {one['fwdbwd']['ring_s'] / row['fwdbwd']['ring_s']:.2f}x") if one else ""
            lines.append(_row_line(row) + speed)
        for row in rep["correctness"]:
            lines.append(f"check W={row['world']} causal={row['causal']} {row['sharding']} {row['dtype']}: "
                         f"{'ok' if row['passed'] else 'FAIL'}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ring-scaling.json").write_text(json.dumps(reports, indent=1))
    (out / "ring-scaling.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for the JSON/text results (rank 0 writes)")
    p.add_argument("--launch", type=lambda s: [int(x) for x in s.split(",")],
                   help="run torchrun for each of these GPU counts, e.g. 1,2,4, and merge the results")
    p.add_argument("--backend", default="nccl", help="torch.distributed backend (nccl, or gloo with --device cpu)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--local-backend", default=None, help="pin the portattn backend of the local blocks")
    p.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="total tokens of the timed problems (default 131072,524288; --tiny 256)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sharding", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=0, help="seconds of timing per world size, then skip "
                   "the longer sequences (0: no limit)")
    p.add_argument("--simulate", type=lambda s: [int(x) for x in s.split(",")],
                   help="no process group: simulate rings of these sizes on one device (e.g. 2,4,8)")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="merge the ring-w*.json of these directories "
                   "into --out's ring-scaling.json/.txt and exit")
    p.add_argument("--check-seqlen", type=int, default=4096)
    p.add_argument("--check-heads", type=int, default=8)
    p.add_argument("--check-kv-heads", type=int, default=2)
    p.add_argument("--check-head-dim", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="CPU-sized problems (tests of the script's logic)")
    p.add_argument("--cost-table", action="store_true", help="print docs/distributed.md's cost table and exit")
    args = p.parse_args(argv)
    if args.seqlens is None:
        args.seqlens = [256] if args.tiny else [131072, 524288]
    if args.tiny:
        args.heads, args.kv_heads, args.head_dim, args.reps = 4, 2, 16, 1
        args.check_seqlen, args.check_heads, args.check_kv_heads, args.check_head_dim = 64, 4, 2, 16
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.cost_table:
        print(cost_table())
        return 0
    if args.merge:
        if not args.out:
            raise SystemExit("--merge needs --out")
        _summary([json.loads(p.read_text()) for d in args.merge for p in sorted(Path(d).glob("ring-w*.json"))],
                 Path(args.out))
        return 0
    if args.simulate:
        report = simulate(args)
        return 0 if all(r["passed"] for r in report["correctness"]) else 1
    if args.launch:
        if not args.out:
            raise SystemExit("--launch needs --out")
        return _launch(args, argv)
    import torch.distributed as dist
    owned = not dist.is_initialized()
    if owned:
        _device(args)
        dist.init_process_group(args.backend)
    try:
        report = run(args)
        ok = all(r["passed"] for r in report["correctness"]) if dist.get_rank() == 0 else True
    finally:
        if owned:
            dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
