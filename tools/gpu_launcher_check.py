"""GPU check of the fast Triton launch path (backends/triton/launcher.py): bit-identical results, timings.

    PYTHONPATH=. python tools/gpu_launcher_check.py [--out DIR] [--calls 300]

Checks (each prints PASS/FAIL; the exit status is 1 when one fails):

* ``forward`` / ``backward prep`` / ``backward dq`` / ``backward dkdv``: every launch of ``ops.forward`` and
  ``ops.backward`` (bf16 B1 S128 H8 D64 causal) replayed from the same starting state through
  the normal ``kernel[grid](...)`` path and through ``launcher.fast(kernel)`` (its first call
  records, its second launches directly): every tensor argument bit-identical afterwards;
* ``unaligned``: the same forward with q a view 2 bytes off 16-byte alignment: a new key (a
  second entry, one more normal launch) and bit-identical results;
* ``decode``: ``attention_with_kvcache`` (triton; no append, append 1, paged 256, forced splits)
  with the fast path off and on, three calls each: out, lse and the caches bit-identical, and
  the fast path taken;
* ``cuda graph``: the decode call and the dense forward captured in a ``torch.cuda.CUDAGraph``
  through the fast path, replayed on new inputs, bit-identical to eager normal launches.

Timings: wall time per call (``--calls`` calls, one synchronise) with the fast path off and on,
of ``portattn.attention(backend="triton")`` (bf16 B1 S128 H8 D64 causal), its forward+backward,
and ``attention_with_kvcache`` (bf16 B1 Sq1 Sk8k GQA 32:4 D128, no append and append 1), with
torch SDPA flash on the dense shape for scale. Until ``ops.py`` launches through the launcher
itself, the dense "fast" rows put ``launcher.fast(kernel)`` objects in place of the kernels in
``backends/triton/kernels.py`` for the run (``ops`` then launches through them). Writes
``launcher_check.txt`` and ``launcher_check.json`` to ``--out``. About 30 s on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

#: the dense kernels and their labels (attn_bwd_prep: the 16-bit backward's row statistics, when kernels.py has it)
DENSE_LABELS = {"attn_fwd": "forward", "attn_bwd_prep": "backward prep", "attn_bwd_dq": "backward dq",
                "attn_bwd_dkdv": "backward dkdv"}
DENSE_KERNELS = tuple(DENSE_LABELS)


def _modules():
    from portattn.backends.triton import decode, kernels, launcher, ops

    import portattn  # noqa: F401  (maps backends/ to portattn.backends)
    return kernels, launcher, ops, decode


@contextlib.contextmanager
def fast_dense(on: bool = True):
    """The dense kernels launched through the fast path (``on``) or the normal one, whether or
    not ops.py calls ``launcher.fast`` itself: ``launcher.fast(kernel)`` objects stand in for
    the kernels of ``kernels.py`` while inside (``fast`` of one of them is itself)."""
    kernels, launcher, _, _ = _modules()
    originals = {name: getattr(kernels, name) for name in DENSE_KERNELS if hasattr(kernels, name)}
    was = launcher.enabled()
    launcher.set_enabled(on)
    try:
        if on:
            for name, fn in originals.items():
                setattr(kernels, name, launcher.fast(fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)
        launcher.set_enabled(was)


class _Recorder:
    """Stands in for a kernel: records ``(grid, args, kwargs)`` of each launch and launches it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.fn[grid](*args, **kwargs)
        return launch


@contextlib.contextmanager
def recording():
    """``{name: _Recorder}`` standing in for the dense kernels while inside."""
    kernels, _, _, _ = _modules()
    originals = {name: getattr(kernels, name) for name in DENSE_KERNELS if hasattr(kernels, name)}
    recs = {name: _Recorder(fn) for name, fn in originals.items()}
    try:
        for name, rec in recs.items():
            setattr(kernels, name, rec)
        yield recs
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().contiguous().view(-1).view(torch.uint8)


def replay_identical(fn, grid, args, kwargs, fk=None) -> dict:
    """Launch ``fn[grid](*args, **kwargs)`` normally, then twice through a fast wrapper (``fk``,
    or a new one), each from the same starting state of every tensor argument; returns
    ``{"identical": bool, "entries": n, "stats": {...}}`` (identical: every tensor argument
    bit-identical after each fast-wrapper launch to its state after the normal launch)."""
    _, launcher, _, _ = _modules()
    fk = fk if fk is not None else launcher.FastKernel(fn)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    start = [t.detach().clone() for t in tensors]

    def restore():
        for t, s in zip(tensors, start):
            t.copy_(s)

    fn[grid](*args, **kwargs)
    _sync()
    want = [_bytes(t) for t in tensors]
    identical = True
    for _ in range(2):
        restore()
        fk[grid](*args, **kwargs)
        _sync()
        identical &= all(torch.equal(_bytes(t), w) for t, w in zip(tensors, want))
    restore()
    return {"identical": identical, "entries": len(fk._entries), "stats": dict(fk.stats), "fk": fk}


def _dense_inputs(device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(1, 128, 8, 64, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(4))


def check_dense(device) -> dict:
    """forward, backward dq/dkdv and the unaligned-view forward (see the module docstring)."""
    from portattn.spec import build_spec
    kernels, launcher, ops, _ = _modules()
    q, k, v, dout = _dense_inputs(device)
    results = {}
    with recording() as recs:
        spec = build_spec(q, k, v, causal=True)
        out, lse = ops.forward(spec)
        ops.backward(spec, out, lse, dout)
    fwd = None
    for name, rec in recs.items():
        if not rec.calls:
            continue
        label = DENSE_LABELS[name]
        grid, args, kwargs = rec.calls[-1]
        r = replay_identical(getattr(kernels, name), grid, args, kwargs)
        results[label] = r["identical"] and r["stats"] == {"fast": 1, "slow": 1}
        if name == "attn_fwd":
            fwd = r["fk"]
    # q as a view 2 bytes past a 16-byte boundary: triton specialises on the alignment
    base = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)
    qu = base[1:].view(q.shape).copy_(q)
    with recording() as recs:
        ops.forward(build_spec(qu, k, v, causal=True))
    grid, args, kwargs = recs["attn_fwd"].calls[-1]
    assert args[0].data_ptr() % 16 != 0
    r = replay_identical(kernels.attn_fwd, grid, args, kwargs, fk=fwd)
    results["unaligned"] = r["identical"] and r["entries"] == 2 and r["stats"] == {"fast": 2, "slow": 2}
    return results


def _decode_cases(device):
    g = torch.Generator(device="cpu").manual_seed(1)
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=bf)

    sk = 8192
    q = rnd(1, 1, 32, 128)
    kc, vc = rnd(1, sk, 4, 128), rnd(1, sk, 4, 128)
    lens = torch.full((1,), sk - 1, dtype=torch.int32, device=device)
    pages = sk // 256
    cases = {
        "no append": dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens, causal=True),
        "append 1": dict(q=q, k_cache=kc, v_cache=vc, k=rnd(1, 1, 4, 128), v=rnd(1, 1, 4, 128),
                         cache_seqlens=lens, causal=True),
        "paged 256 append": dict(q=q, k_cache=kc.view(pages, 256, 4, 128), v_cache=vc.view(pages, 256, 4, 128),
                                 k=rnd(1, 1, 4, 128), v=rnd(1, 1, 4, 128), cache_seqlens=lens,
                                 block_table=torch.arange(pages, dtype=torch.int32, device=device).view(1, pages),
                                 causal=True),
        "Sq 4 B2 window": dict(q=rnd(2, 4, 32, 128), k_cache=rnd(2, 2048, 4, 128), v_cache=rnd(2, 2048, 4, 128),
                               cache_seqlens=torch.tensor([100, 2000], dtype=torch.int32, device=device),
                               causal=True, window=(256, 0)),
    }
    return cases


def _run_decode(kw, on: bool, calls: int = 3):
    import portattn
    _, launcher, _, _ = _modules()
    was = launcher.enabled()
    launcher.set_enabled(on)
    try:
        outs = []
        for _ in range(calls):
            kw2 = dict(kw)
            for name in ("k_cache", "v_cache"):
                kw2[name] = kw[name].clone()       # the append writes into the caches
            out, lse = portattn.attention_with_kvcache(**kw2, return_lse=True, backend="triton")
            outs.append((out, lse, kw2["k_cache"], kw2["v_cache"]))
        _sync()
        return outs
    finally:
        launcher.set_enabled(was)


def check_decode(device) -> dict:
    _, launcher, _, decode = _modules()
    results = {}
    for name, kw in _decode_cases(device).items():
        split = launcher.fast(decode.decode_split)
        before = split.stats["fast"]
        normal = _run_decode(kw, False)
        fast = _run_decode(kw, True)
        same = all(torch.equal(_bytes(a), _bytes(b)) for n, f in zip(normal, fast) for a, b in zip(n, f))
        results[f"decode {name}"] = same and split.stats["fast"] > before
    return results


def check_cuda_graph(device) -> dict:
    """The decode call and the dense forward captured through the fast path, replayed on new inputs."""
    import portattn
    _, launcher, _, _ = _modules()
    results = {}
    kw = _decode_cases(device)["no append"]
    q_static = kw["q"].clone()
    kw = dict(kw, q=q_static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):   # records the key outside the capture
            portattn.attention_with_kvcache(**kw, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = portattn.attention_with_kvcache(**kw, backend="triton")
    new_q = torch.randn(q_static.shape, device=device).to(q_static.dtype)
    q_static.copy_(new_q)
    graph.replay()
    _sync()
    launcher.set_enabled(False)
    try:
        want = portattn.attention_with_kvcache(**dict(kw, q=new_q), backend="triton")
    finally:
        launcher.set_enabled(True)
    results["cuda graph decode"] = torch.equal(_bytes(out_g), _bytes(want))

    q, k, v, _ = _dense_inputs(device, seed=3)
    with fast_dense(True):
        with torch.cuda.stream(side):
            for _ in range(3):
                portattn.attention(q, k, v, causal=True, backend="triton")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = portattn.attention(q, k, v, causal=True, backend="triton")
        new = _dense_inputs(device, seed=4)
        for t, n in zip((q, k, v), new):
            t.copy_(n)
        graph.replay()
        _sync()
    with fast_dense(False):
        want = portattn.attention(q, k, v, causal=True, backend="triton")
    results["cuda graph forward"] = torch.equal(_bytes(out_g), _bytes(want))
    return results


def _per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    _sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def timings(device, calls: int) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import portattn
    _, launcher, _, _ = _modules()
    q, k, v, dout = _dense_inputs(device)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    kw_dec = _decode_cases(device)
    rows = {}

    def fwd_bwd():
        out = portattn.attention(qg, kg, vg, causal=True, backend="triton")
        out.backward(dout)

    dense = {"attention triton (B1 S128 H8 D64)": lambda: portattn.attention(q, k, v, causal=True, backend="triton"),
             "attention triton fwd+bwd": fwd_bwd}
    for name, fn in dense.items():
        row = {}
        for mode in (False, True):
            with fast_dense(mode):
                row["fast" if mode else "normal"] = _per_call_us(fn, calls)
        rows[name] = row
    for case in ("no append", "append 1"):
        kw = kw_dec[case]
        fn = lambda kw=kw: portattn.attention_with_kvcache(**kw, backend="triton")  # noqa: E731
        row = {}
        for mode in (False, True):
            was = launcher.enabled()
            launcher.set_enabled(mode)
            try:
                row["fast" if mode else "normal"] = _per_call_us(fn, calls)
            finally:
                launcher.set_enabled(was)
        rows[f"kvcache triton B1 Sk8k {case}"] = row
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        rows["torch sdpa flash (B1 S128 H8 D64)"] = {
            "normal": _per_call_us(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), calls)}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    _, launcher, _, _ = _modules()
    import triton
    lines = [f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(device)}; "
             f"fast path: {launcher.unsupported_reason() or 'supported'}"]
    checks = {}
    for fn in (check_dense, check_decode, check_cuda_graph):
        try:
            checks.update(fn(device))
        except Exception as exc:   # report and go on: the other checks still tell something
            checks[fn.__name__] = False
            lines.append(f"{fn.__name__} raised {type(exc).__name__}: {exc}")
    for name, ok in checks.items():
        lines.append(f"{'PASS' if ok else 'FAIL'}  {name}")
    rows = timings(device, args.calls)
    lines.append(f"\n{'us per call (wall, ' + str(args.calls) + ' calls)':44s}{'normal':>10s}{'fast':>10s}{'saved':>10s}")
    for name, row in rows.items():
        fast = row.get("fast")
        tail = f"{fast:10.1f}{row['normal'] - fast:10.1f}" if fast is not None else ""
        lines.append(f"{name:44s}{row['normal']:10.1f}{tail}")
    kernels, _, _, decode = _modules()
    disabled = {name: getattr(launcher.fast(getattr(module, name)), "disabled", "not wrapped")
                for module, names in ((kernels, DENSE_KERNELS), (decode, ("decode_split", "decode_combine")))
                for name in names if hasattr(module, name)}
    lines.append(f"disabled reasons (None = fast path on): {disabled}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "launcher_check.txt").write_text(text + "\n")
        (out / "launcher_check.json").write_text(json.dumps({"checks": checks, "timings_us": rows}, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
