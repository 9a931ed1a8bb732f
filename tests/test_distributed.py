"""portattn.distributed on CPU: ring attention with 2 and 4 gloo processes against single-process
attention over the full sequence, under the equivalence rule (docs/semantics.md, the float64
reference as oracle, the in-dtype naive math as yardstick), plus the ring's block planner.

One process group serves every case: this file re-runs itself as 4 worker processes
(``python tests/test_distributed.py --worker RANK 4 PORT OUT``, gloo on 127.0.0.1); each runs
every case of :data:`CASES` and :func:`_worker_checks` on the 4-rank WORLD and then on its
2-rank subgroup ({0, 2} or {1, 3}, both at once), runs tools/ring_bench.py at CPU sizes, and
saves its shards; the test reassembles the shards by global position (computed here,
independently of the module) and compares them with ``portattn.reference`` over the full
sequence. Rings of other sizes (3, 5, 6, 8) run in one process through ``simulate_ring``.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # the worker processes run this file as a script
    sys.path.insert(0, str(ROOT))

from portattn import distributed as D  # noqa: E402
from portattn.numerics import GRAD_FACTOR, compare, compare_lse  # noqa: E402
from portattn.reference import naive_forward, reference_forward, visible_keys  # noqa: E402
from portattn.spec import build_spec  # noqa: E402

# name -> case. ``L``: tokens per rank (the full sequence is L·W); ``lk``: key tokens per rank
# when they differ from q's (cross-attention, unmasked only).
_BASE = dict(dtype=torch.float32, b=2, L=8, hq=4, hkv=2, d=16, dv=16, kw={}, sharding="contiguous",
             layout="bshd", grad=True, lse_grad=False, backend=None, lk=None)
CASES = {name: dict(_BASE, **over) for name, over in {
    "plain": dict(),
    "plain_zigzag": dict(sharding="zigzag"),
    "causal": dict(kw=dict(causal=True)),
    "causal_zigzag_lse_grad": dict(kw=dict(causal=True), sharding="zigzag", lse_grad=True),
    "gqa_mqa_causal_zigzag_bhsd": dict(hq=4, hkv=1, kw=dict(causal=True), sharding="zigzag", layout="bhsd"),
    "window": dict(kw=dict(window=(3, 2))),
    "window_causal_zigzag": dict(kw=dict(causal=True, window=(5, -1)), sharding="zigzag"),
    # 8 tokens per rank, left window 3: the ring stops after 2 steps, dK/dV hop straight home
    "window_stops_early": dict(kw=dict(causal=True, window=(3, -1))),
    "softcap_scale_causal_zigzag": dict(kw=dict(causal=True, softcap=2.0, scale=0.4), sharding="zigzag"),
    "bf16_causal_zigzag": dict(dtype=torch.bfloat16, kw=dict(causal=True), sharding="zigzag"),
    "head_dim_v": dict(d=16, dv=8, kw=dict(causal=True)),
    "reference_backend": dict(backend="reference", kw=dict(causal=True), sharding="zigzag", hq=2, hkv=2),
    "cross_lengths": dict(lk=6),
    "forward_only": dict(grad=False, kw=dict(causal=True), sharding="zigzag"),
}.items()}


def _positions(sharding: str, world: int, rank: int, length: int) -> list[int]:
    """Global positions of rank ``rank``'s shard, in local order (written from the definition)."""
    if sharding == "contiguous":
        n = length // world
        return list(range(rank * n, (rank + 1) * n))
    c = length // (2 * world)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))


def _inputs(case: dict, world: int, seed: int = 0):
    """Full-sequence q, k, v, dout, dlse (same on every process: a seeded CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    b, s = case["b"], case["L"] * world
    sk = (case["lk"] or case["L"]) * world
    dt = case["dtype"]
    q = torch.randn(b, s, case["hq"], case["d"], generator=g).to(dt)
    k = torch.randn(b, sk, case["hkv"], case["d"], generator=g).to(dt)
    v = torch.randn(b, sk, case["hkv"], case["dv"], generator=g).to(dt)
    dout = torch.randn(b, s, case["hq"], case["dv"], generator=g).to(dt)
    dlse = torch.randn(b, case["hq"], s, generator=g)
    if case["layout"] == "bhsd":
        q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
    return q, k, v, dout, dlse


# ----- the worker side ---------------------------------------------------------------------------

def _run_case(case: dict, world: int, group) -> dict:
    q, k, v, dout, dlse = _inputs(case, world)
    sd = 2 if case["layout"] == "bhsd" else 1
    sharding = case["sharding"]
    shards = [D.shard_sequence(t, group, sharding=sharding, seq_dim=sd).detach().requires_grad_(case["grad"])
              for t in (q, k, v)]
    out, lse = D.ring_attention(*shards, group=group, sharding=sharding, layout=case["layout"], return_lse=True,
                                backend=case["backend"], **case["kw"])
    res = {"out": out.detach(), "lse": lse.detach()}
    if case["grad"]:
        loss = (out.float() * D.shard_sequence(dout, group, sharding=sharding, seq_dim=sd).float()).sum()
        if case["lse_grad"]:
            loss = loss + (lse * D.shard_sequence(dlse, group, sharding=sharding, seq_dim=2)).sum()
        loss.backward()
        res.update(dq=shards[0].grad, dk=shards[1].grad, dv=shards[2].grad)
    return res


def _expect_error(fn, exc_type, *needles) -> str:
    """'' when fn raises exc_type with every needle in its message, else what happened."""
    try:
        fn()
    except exc_type as exc:
        missing = [n for n in needles if n not in str(exc)]
        return f"message lacks {missing}: {exc}" if missing else ""
    except Exception as exc:  # noqa: BLE001  (reported to the parent)
        return f"raised {type(exc).__name__} instead of {exc_type.__name__}: {exc}"
    return f"did not raise {exc_type.__name__}"


def _worker_checks(world: int, rank: int, group=None) -> dict[str, str]:
    """Round trips and error cases; '' means passed, else a description of the failure."""
    out = {}
    x = torch.arange(2 * 3 * 8 * world * 5, dtype=torch.float32).reshape(2, 3, 8 * world, 5)
    for sharding, dim in itertools.product(D.SHARDINGS, (2, -2)):
        s = D.shard_sequence(x, group, sharding=sharding, seq_dim=dim)
        want = x[:, :, _positions(sharding, world, rank, x.shape[2])]
        back = D.gather_sequence(s, group, sharding=sharding, seq_dim=dim)
        out[f"shard[{sharding},{dim}]"] = "" if torch.equal(s, want) else f"shard differs: {s.flatten()[:8]}"
        out[f"roundtrip[{sharding},{dim}]"] = "" if torch.equal(back, x) else "gather(shard(x)) != x"
        # differentiable gather: the backward sums every rank's gradient into the shard
        leaf = s.clone().requires_grad_(True)
        weight = torch.linspace(-1, 1, x.numel()).reshape(x.shape)
        (D.gather_sequence(leaf, group, sharding=sharding, seq_dim=dim) * weight).sum().backward()
        want_g = world * weight[:, :, _positions(sharding, world, rank, x.shape[2])]
        out[f"gather_grad[{sharding},{dim}]"] = "" if torch.allclose(leaf.grad, want_g) else "gather grad wrong"

    q = torch.randn(1, 4, 2, 8)
    bad_len = torch.randn(1, 4 + 2 * (rank == 0), 2, 8)
    out["unequal_shards"] = _expect_error(lambda: D.ring_attention(bad_len, bad_len, bad_len, group=group), ValueError,
                                          "ranks disagree", "rank 0")
    out["unequal_gather"] = _expect_error(lambda: D.gather_sequence(bad_len, group), ValueError, "ranks disagree")
    odd = torch.randn(1, 3, 2, 8)
    out["zigzag_odd_shard"] = _expect_error(lambda: D.ring_attention(odd, odd, odd, group=group, sharding="zigzag"),
                                            ValueError, "even", f"2 x world = {2 * world}")
    out["shard_indivisible"] = _expect_error(lambda: D.shard_sequence(torch.randn(1, 2 * world + 1, 2), group),
                                             ValueError, "divisible by", str(world))
    out["zigzag_indivisible"] = _expect_error(
        lambda: D.shard_sequence(torch.randn(1, 3 * world, 2), group, sharding="zigzag"), ValueError,
        f"divisible by {2 * world}")
    out["bad_sharding"] = _expect_error(lambda: D.ring_attention(q, q, q, group=group, sharding="striped"), ValueError,
                                        "sharding", "contiguous", "zigzag")
    out["bias"] = _expect_error(lambda: D.ring_attention(q, q, q, group=group, attn_bias=torch.zeros(1, 2, 4, 4)),
                                ValueError, "attn_bias")
    out["alibi"] = _expect_error(lambda: D.ring_attention(q, q, q, group=group, alibi_slopes=torch.ones(2)), ValueError,
                                 "alibi_slopes")
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out["varlen"] = _expect_error(lambda: D.ring_attention(q[0], q[0], q[0], group=group, cu_seqlens_q=cu, cu_seqlens_k=cu),
                                  ValueError, "varlen")
    kv6 = torch.randn(1, 6, 2, 8)
    out["causal_cross"] = _expect_error(lambda: D.ring_attention(q, kv6, kv6, group=group, causal=True), ValueError,
                                        "equal length", "4 query and 6 key")
    out["bad_layout_shapes"] = _expect_error(lambda: D.ring_attention(q[0], q[0], q[0], group=group), ValueError, "4-D")
    return out


def _run_bench(out_dir: str) -> str:
    """tools/ring_bench.py's logic (correctness, timing, ablations) at CPU sizes, on WORLD."""
    from _scripts import load_script
    try:
        bench = load_script("ring_bench", "tools")
        rc = bench.main(["--backend", "gloo", "--device", "cpu", "--tiny", "--out", os.path.join(out_dir, "bench")])
        return "" if rc == 0 else f"ring_bench exited with {rc}"
    except Exception:  # noqa: BLE001  (reported to the parent)
        return traceback.format_exc()


#: The worlds the pool runs: WORLD (4 ranks), then two groups of 2 ranks at once, {0, 2} and {1, 3}
#: (group ranks differ from global ranks there, which the P2P peers must translate).
POOL = 4
GROUPS_OF_2 = ([0, 2], [1, 3])


_TENSOR = "__tensor__"


def _wire(x, to: bool):
    """Tensors to plain pickle data, ``(_TENSOR, dtype name, numpy array)`` (``to``), or back,
    through dicts, lists and tuples. The workers' results cross the process boundary without
    torch.save, whose files from these workers now and then failed to load in the parent
    ("record size (128 bytes) does not match expected size (0 bytes ...)"); the worker runs this
    file as ``__main__``, so nothing pickled may be a class defined here."""
    if to and isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        return (_TENSOR, str(t.dtype).replace("torch.", ""),
                (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy())
    if not to and isinstance(x, tuple) and len(x) == 3 and x[0] == _TENSOR:
        return torch.from_numpy(x[2]).to(getattr(torch, x[1]))
    if isinstance(x, dict):
        return {k: _wire(v, to) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_wire(v, to) for v in x)
    return x


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pairs = [dist.new_group(ranks) for ranks in GROUPS_OF_2]   # every process creates every group
    mine = pairs[rank % 2]
    results = {}
    try:
        for size, group in ((world, None), (2, mine)):
            group_rank = dist.get_rank(group)
            for name, case in CASES.items():
                try:
                    results[(size, name)] = _run_case(case, size, group)
                except Exception:  # noqa: BLE001  (reported to the parent)
                    results[(size, name)] = {"error": traceback.format_exc()}
            results[(size, "_checks")] = _worker_checks(size, group_rank, group)
        results["bench"] = _run_bench(out_dir)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(_wire(results, to=True), f)
        dist.barrier()
        dist.destroy_process_group()


# ----- the test side -----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   # onnx has no backward and is slow to import: keep it out of the workers
                   PORTATTN_PRIORITY_CPU="sdpa,reference", MASTER_ADDR="127.0.0.1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port), tmp],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=240)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        failed = [(r, p.returncode, log) for r, (p, log) in enumerate(zip(procs, logs)) if p.returncode]
        if failed:
            r, rc, log = failed[0]
            pytest.fail(f"worker {r} of {world} exited with {rc}:\n{log[-4000:]}")
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                results.append(_wire(pickle.load(f), to=False))
        report = Path(tmp, "bench", f"ring-w{world}.json")
        results[0]["bench_report"] = json.loads(report.read_text()) if report.exists() else None
        return results


def _assemble(parts: list[torch.Tensor], sharding: str, dim: int) -> torch.Tensor:
    """Full tensor from per-rank shards by the global positions of :func:`_positions`."""
    world = len(parts)
    length = parts[0].shape[dim] * world
    full = torch.empty((*parts[0].shape[:dim], length, *parts[0].shape[dim + 1:]), dtype=parts[0].dtype)
    for r, part in enumerate(parts):
        full.index_copy_(dim, torch.tensor(_positions(sharding, world, r, length)), part)
    return full


def _check_case(name: str, case: dict, world: int, per_rank: list[dict]) -> list[str]:
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(per_rank) if "error" in res]
    if errors:
        return errors
    q, k, v, dout, dlse = _inputs(case, world)
    sd = 2 if case["layout"] == "bhsd" else 1
    sharding = case["sharding"]
    got = {key: _assemble([res[key] for res in per_rank], sharding, 2 if key == "lse" else sd)
           for key in per_rank[0]}

    def canon(t):
        return t.transpose(1, 2) if case["layout"] == "bhsd" else t

    kw = dict(case["kw"], layout=case["layout"])
    rq, rk, rv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    nq, nk, nv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref_out, ref_lse = reference_forward(build_spec(rq, rk, rv, **kw))
    naive_out, naive_lse = naive_forward(build_spec(nq, nk, nv, **kw))
    results = [compare("out", canon(got["out"]), ref_out, naive_out), compare_lse(got["lse"], ref_lse)]
    if case["grad"]:
        ref_loss = (ref_out * canon(dout).double()).sum()
        naive_loss = (naive_out.float() * canon(dout).float()).sum()
        if case["lse_grad"]:
            ref_loss = ref_loss + (ref_lse.double() * dlse.double()).sum()
            naive_loss = naive_loss + (naive_lse * dlse).sum()
        g_ref = torch.autograd.grad(ref_loss, (rq, rk, rv))
        g_naive = torch.autograd.grad(naive_loss, (nq, nk, nv))
        scale = build_spec(q, k, v, **kw).scale
        magnitude = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * scale
        for key, r, n in zip(("dq", "dk", "dv"), g_ref, g_naive):
            results.append(compare(key, got[key], r, n, factor=GRAD_FACTOR, zero_ref_scale=magnitude))
    return [f"{r}" for r in results if not r.passed]


def test_ring_attention_matches_full_sequence_attention():
    """Every case of CASES (fwd + bwd, causal and not, both shardings, GQA, window, softcap,
    bf16, return_lse with its gradient) and the worker-side checks (shard/gather round trips,
    the differentiable gather, error cases), with 4 ranks and with two groups of 2 ranks, from
    one pool of 4 gloo processes."""
    per_rank = _spawn(POOL)
    worlds = [(POOL, list(range(POOL)))] + [(2, ranks) for ranks in GROUPS_OF_2]
    failures = []
    for size, ranks in worlds:
        label = f"world {size} {ranks}"
        for name, case in CASES.items():
            for msg in _check_case(name, case, size, [per_rank[r][(size, name)] for r in ranks]):
                failures.append(f"{label} {name}: {msg}")
        for r in ranks:
            checks = per_rank[r][(size, "_checks")]
            failures += [f"{label} rank {r} {check}: {msg}" for check, msg in checks.items() if msg]
            if not checks:
                failures.append(f"{label} rank {r}: no checks ran")
    failures += [f"ring_bench rank {r}: {res['bench']}" for r, res in enumerate(per_rank) if res["bench"]]
    failures += _check_bench_report(per_rank[0]["bench_report"])
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures)


def _check_bench_report(report) -> list[str]:
    """tools/ring_bench.py's JSON: what issue 18 asks for is there and sane."""
    if report is None:
        return ["ring_bench wrote no report"]
    bad = []
    if report["versions"]["env"] != {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                     "NVSHMEM_DISABLE_NVLS": "1"}:
        bad.append(f"ring_bench multicast settings: {report['versions']['env']}")
    checks = report["correctness"]
    if sorted((c["causal"], c["sharding"]) for c in checks) != [(False, "zigzag"), (True, "contiguous"), (True, "zigzag")]:
        bad.append(f"ring_bench correctness cases: {[(c['causal'], c['sharding']) for c in checks]}")
    bad += [f"ring_bench check failed: {c}" for c in checks if not c["passed"] or set(c["ring"]) != {"out", "lse", "dq", "dk", "dv"}]
    for row in report["timing"]:
        for mode in ("fwd", "fwdbwd"):
            e = row[mode]
            if not (e["ring_s"] > 0 and e["compute_only_s"] > 0 and e["comm_only_s"] > 0
                    and 0 <= e["comm_hidden_fraction"] <= 1 and len(e["peak_mem_gib_per_rank"]) == report["world"]):
                bad.append(f"ring_bench timing {mode}: {e}")
    return bad


# ----- the ring in one process (threads), for world sizes the pool does not cover ------------------

@pytest.mark.parametrize("world,sharding,kw", [
    (3, "zigzag", dict(causal=True)),
    (5, "zigzag", dict(window=(4, 9), softcap=3.0)),
    (8, "contiguous", dict(causal=True, window=(5, -1))),
    (6, "contiguous", dict()),
], ids=["w3-zigzag-causal", "w5-zigzag-band-softcap", "w8-contiguous-window", "w6-plain"])
def test_simulated_ring_matches_full_sequence_attention(world, sharding, kw):
    g = torch.Generator().manual_seed(world)
    s = 2 * world * 4
    q = torch.randn(2, s, 4, 16, generator=g)
    k, v = (torch.randn(2, s, 2, 16, generator=g) for _ in range(2))
    dout = torch.randn(2, s, 4, 16, generator=g)
    dlse = torch.randn(2, 4, s, generator=g)
    got = D.simulate_ring(q, k, v, world, sharding=sharding, dout=dout, dlse=dlse, backend="reference"
                          if "softcap" in kw else None, **kw)
    rq, rk, rv = (t.double().requires_grad_(True) for t in (q, k, v))
    nq, nk, nv = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref_out, ref_lse = reference_forward(build_spec(rq, rk, rv, **kw))
    naive_out, naive_lse = naive_forward(build_spec(nq, nk, nv, **kw))
    g_ref = torch.autograd.grad((ref_out * dout.double()).sum() + (ref_lse.double() * dlse.double()).sum(), (rq, rk, rv))
    g_naive = torch.autograd.grad((naive_out * dout).sum() + (naive_lse * dlse).sum(), (nq, nk, nv))
    magnitude = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * build_spec(q, k, v, **kw).scale
    results = [compare("out", got["out"], ref_out, naive_out), compare_lse(got["lse"], ref_lse)]
    results += [compare(n, got[n], r, nv_, factor=GRAD_FACTOR, zero_ref_scale=magnitude)
                for n, r, nv_ in zip(("dq", "dk", "dv"), g_ref, g_naive)]
    assert all(r.passed for r in results), "\n".join(map(str, results))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("world,sharding,kw,dtype,d", [
    (4, "zigzag", dict(causal=True), torch.bfloat16, 128),
    (2, "contiguous", dict(causal=True), torch.float16, 64),
    (4, "zigzag", dict(), torch.bfloat16, 64),
    (3, "contiguous", dict(causal=True, window=(100, -1)), torch.bfloat16, 128),
    (2, "zigzag", dict(causal=True), torch.float32, 64),
], ids=["w4-zigzag-causal-bf16-d128", "w2-contig-causal-fp16", "w4-zigzag-bf16", "w3-window-bf16", "w2-fp32"])
def test_simulated_ring_on_the_gpu(world, sharding, kw, dtype, d):
    """The local blocks of a W-GPU ring on this GPU's default backend (triton on NVIDIA), with
    the block shapes the ring really uses (2C x C, C x 2C, trimmed windows), against the float64
    reference over the full sequence."""
    g = torch.Generator().manual_seed(world * d)
    s = 2 * world * 96
    q = torch.randn(2, s, 8, d, generator=g).cuda().to(dtype)
    k, v = (torch.randn(2, s, 2, d, generator=g).cuda().to(dtype) for _ in range(2))
    dout = torch.randn(2, s, 8, d, generator=g).cuda().to(dtype)
    dlse = torch.randn(2, 8, s, generator=g).cuda()
    got = D.simulate_ring(q, k, v, world, sharding=sharding, dout=dout, dlse=dlse, **kw)
    rq, rk, rv = (t.double().requires_grad_(True) for t in (q, k, v))
    nq, nk, nv = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref_out, ref_lse = reference_forward(build_spec(rq, rk, rv, **kw))
    naive_out, naive_lse = naive_forward(build_spec(nq, nk, nv, **kw))
    g_ref = torch.autograd.grad((ref_out * dout.double()).sum() + (ref_lse.double() * dlse.double()).sum(), (rq, rk, rv))
    g_naive = torch.autograd.grad((naive_out.float() * dout.float()).sum() + (naive_lse * dlse).sum(), (nq, nk, nv))
    magnitude = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * build_spec(q, k, v, **kw).scale
    results = [compare("out", got["out"], ref_out, naive_out), compare_lse(got["lse"], ref_lse)]
    results += [compare(n, got[n], r, nv_, factor=GRAD_FACTOR, zero_ref_scale=magnitude)
                for n, r, nv_ in zip(("dq", "dk", "dv"), g_ref, g_naive)]
    assert all(r.passed for r in results), "\n".join(map(str, results))


def test_ring_bench_simulate_mode(tmp_path):
    """tools/ring_bench.py --simulate (one device, threads as ranks) at CPU sizes: its checks pass
    and its report has the busiest rank's compute time per world size."""
    from _scripts import load_script
    bench = load_script("ring_bench", "tools")
    argv = ["--simulate", "2", "--device", "cpu", "--tiny", "--seqlens", "64", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "ring-simulated.json").read_text())
    assert [(c["world"], c["causal"], c["sharding"]) for c in report["correctness"]] == [
        (2, True, "zigzag"), (2, True, "contiguous"), (2, False, "zigzag")]
    assert [(r["world"], r["tokens_per_gpu"]) for r in report["timing"]] == [(1, 64), (2, 32)]
    assert all(r[m]["compute_s"] > 0 for r in report["timing"] for m in ("fwd", "fwdbwd"))


# ----- the planner, without processes -------------------------------------------------------------

def _coverage(sharding: str, world: int, length: int, left, right) -> torch.Tensor:
    """How many times the plans of every rank and step compute each (query, key) pair."""
    plans = D._steps_for_tests(sharding, world, length, left, right)
    count = torch.zeros(length, length, dtype=torch.int64)
    for r in range(world):
        qpos = torch.tensor(_positions(sharding, world, r, length))
        for t, calls in enumerate(plans[r]):
            kpos = torch.tensor(_positions(sharding, world, (r - t) % world, length))
            for c in calls:
                sq, sk = c.q1 - c.q0, c.k1 - c.k0
                spec = build_spec(torch.zeros(1, sq, 1, 1), torch.zeros(1, sk, 1, 1), torch.zeros(1, sk, 1, 1),
                                  **c.mask_kwargs())
                keep = visible_keys(spec, sq, sk, "cpu")
                keep = torch.ones(sq, sk, dtype=torch.bool) if keep is None else keep
                count[qpos[c.q0:c.q1].unsqueeze(1), kpos[c.k0:c.k1].unsqueeze(0)] += keep.long()
    return count


@pytest.mark.parametrize("sharding", D.SHARDINGS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plans_compute_every_visible_pair_exactly_once(sharding, world):
    length = 2 * world * 4
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    for left, right in itertools.product([None, 0, 1, 3, 5, 9, 40], [None, 0, 2, 7, 13]):
        want = torch.ones(length, length, dtype=torch.bool)
        if left is not None:
            want &= j >= i - left
        if right is not None:
            want &= j <= i + right
        got = _coverage(sharding, world, length, left, right)
        assert torch.equal(got, want.long()), f"window ({left}, {right}): pairs computed {got.tolist()}"


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    world, length = 4, 64

    def work(sharding):   # scores computed per rank per step (masked-out halves not counted)
        plans = D._steps_for_tests(sharding, world, length, None, 0)
        return [[sum((c.q1 - c.q0) * (c.k1 - c.k0) / (2 if c.hi == 0 else 1) for c in step) for step in plans[r]]
                for r in range(world)]

    zig = work("zigzag")
    chunk = length // (2 * world)
    assert all(len(steps) == world for steps in zig)
    # diagonal step: causal over 2C local tokens; every other step 2C x C unmasked
    assert all(steps[0] == (2 * chunk) ** 2 / 2 and all(s == 2 * chunk * chunk for s in steps[1:]) for steps in zig)
    cont = work("contiguous")
    assert [sum(s > 0 for s in steps) for steps in cont] == [1, 2, 3, 4]


def test_window_stops_the_ring_early():
    # left window 3 with 8 tokens per rank: keys never come from more than one rank back
    plans = D._steps_for_tests("contiguous", 4, 32, 3, 0)
    assert [len(p) for p in plans] == [2, 2, 2, 2]
    assert plans[0][1] == []   # rank 0 has no earlier rank: it only relays


def test_pair_call_trims_a_band_off_the_diagonal():
    # queries 8..11 against keys 0..7, causal with window left 6: query 8+i sees keys >= 2+i
    # (a band right of the block's diagonal, not expressible as a window of the 4 x 8 block)
    call = D._pair_call(8, 4, 0, 0, 8, 0, 6, 0)
    assert (call.q0, call.q1, call.k0, call.k1) == (0, 4, 2, 8)   # keys 0, 1 are in no row's window
    # on the 4 x 6 block that is left: key j' visible iff j' >= i, bottom-right window (2, unbounded)
    assert call.mask_kwargs() == dict(window=(2, -1))
    # queries 0..3 against keys 8..11 with window right 9: query i sees keys <= i + 9, i.e. j <= i + 1
    call = D._pair_call(0, 4, 0, 8, 4, 0, None, 9)
    assert (call.q0, call.k0, call.lo, call.hi) == (0, 0, None, 1)
    # queries 8..11 against keys 0..3 with window left 5: query 8+i sees keys >= 3+i: only rows 0
    call = D._pair_call(8, 4, 0, 0, 4, 0, 5, 0)
    assert (call.q0, call.q1, call.k0, call.k1) == (0, 4, 3, 4)
    assert D._pair_call(0, 4, 0, 8, 4, 0, None, 0) is None          # keys in the future: skipped
    assert D._pair_call(8, 4, 0, 0, 4, 0, None, 0).mask_kwargs() == {}  # keys in the past: unmasked


def test_not_initialised_is_a_clear_error():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        D.ring_attention(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        D.shard_sequence(q)


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
