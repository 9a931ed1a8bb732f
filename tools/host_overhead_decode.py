"""Host (Python) cost of one ``attention_with_kvcache`` call on the triton decode path, on CPU.

    python tools/host_overhead_decode.py [--calls 2000] [--repeats 5] [--json FILE]

No GPU and no kernel runs: the CPU tensors are taken for an H200 (sm_90, 132 SMs: the plan, the
tiles and the split count are the GPU's), the triton backend's device check is faked, and each
decode kernel is replaced in one of two ways:

* ``stub``: an object whose ``[grid]`` gives a no-op callable: the cost of portattn's own code
  (validation, selection, planning, allocations, argument lists);
* ``triton``: the real ``triton.runtime.jit.JITFunction.run`` of the kernel (binder,
  specialisation of every argument, cache key, global-value check, grid) against a fake driver,
  with compilation replaced by a fake kernel whose launch is a no-op: portattn's code plus
  Triton's per-launch Python work (the C launcher itself is not counted); the fast launch path
  (``backends/triton/launcher.py``) turned off;
* ``fast``: the same, with the fast launch path on (its key and guards per launch; the fake
  kernel's ``run`` stands for the compiled kernel's launcher).

Cases: bf16 Sq 1, GQA 32:4, D 128, contiguous cache (B1 Sk 8k, B1 Sk 128k, B8 Sk 128k) with a
one-token append and without, plus a paged one (page 256). The caches are ``torch.empty``
(never touched: no memory is committed). Prints microseconds per call (the minimum over
``--repeats`` runs of ``--calls`` calls) for the whole call and for its parts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)   # real JITFunctions (their run is what is measured)

import torch  # noqa: E402
from host_overhead import FakeDriver, fake_compiled, noop  # noqa: E402  (tools/: the same fakes)

H200_SMS = 132


class _Stub:
    """A kernel stand-in whose ``[grid]`` gives a no-op callable."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return noop


def _setup(mode: str):
    """Patch the decode module for ``mode`` ("stub", "triton" or "fast"); returns the undo list."""
    import portattn.backends.triton as tb
    from portattn.backends.triton import configs, decode, launcher
    from triton.runtime.driver import driver as tdriver

    import portattn  # noqa: F401  (maps backends/ to portattn.backends)

    undo = []

    def patch(obj, name, value):
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    h200 = configs.Target("nvidia", 90)
    patch(tb, "_device_reasons", lambda device: ())
    patch(decode, "device_target", lambda device: h200)
    patch(decode, "_sm_count", lambda device_type, index: H200_SMS)
    for name in ("decode_split", "decode_combine", "decode_append", "decode_split_append"):
        if not hasattr(decode, name):
            continue
        kernel = getattr(decode, name)
        if mode == "stub":
            patch(decode, name, _Stub(kernel))
        else:
            patch(decode, name, fake_compiled(kernel))
    if mode != "stub":
        tdriver.set_active(FakeDriver())
        undo.append((None, "driver", tdriver))
        undo.append((launcher, "_ENABLED", launcher._ENABLED))
        launcher.set_enabled(mode == "fast")
    for cache in ("_plan_cached", "_launch_plan"):
        fn = getattr(decode, cache, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()
    getattr(decode, "_LAUNCHES", {}).clear()
    return undo


def _teardown(undo):
    for obj, name, value in reversed(undo):
        if obj is None:
            value._active = None   # the next use finds the real driver (or none) again
        else:
            setattr(obj, name, value)


def _cases():
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(bf)

    out = {}
    for b, sk in ((1, 8192), (1, 131072), (8, 131072)):
        q = rnd(b, 1, 32, 128)
        kc, vc = torch.empty(b, sk, 4, 128, dtype=bf), torch.empty(b, sk, 4, 128, dtype=bf)
        lens = torch.full((b,), sk - 1, dtype=torch.int32)
        kn, vn = rnd(b, 1, 4, 128), rnd(b, 1, 4, 128)
        tag = f"B{b} Sk{sk // 1024}k"
        out[f"{tag} append"] = dict(q=q, k_cache=kc, v_cache=vc, k=kn, v=vn, cache_seqlens=lens, causal=True)
        out[f"{tag} no-append"] = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens, causal=True)
    pages = 8192 // 256
    kp, vp = torch.empty(pages, 256, 4, 128, dtype=bf), torch.empty(pages, 256, 4, 128, dtype=bf)
    bt = torch.arange(pages, dtype=torch.int32).view(1, pages)
    q = rnd(1, 1, 32, 128)
    out["B1 Sk8k paged256 append"] = dict(q=q, k_cache=kp, v_cache=vp, k=rnd(1, 1, 4, 128), v=rnd(1, 1, 4, 128),
                                          cache_seqlens=torch.full((1,), 8191, dtype=torch.int32), block_table=bt,
                                          causal=True)
    return out


def _time(fn, calls: int, repeats: int) -> float:
    """Microseconds per call: the minimum over `repeats` runs of `calls` calls (a shared CPU is noisy)."""
    for _ in range(min(200, calls)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls)
    return best * 1e6


def measure(calls: int = 2000, repeats: int = 5, modes=("stub", "triton", "fast")) -> dict:
    """{mode: {case: {part: microseconds per call}}}."""
    from portattn.backends.triton import decode

    import portattn
    from portattn import kvcache

    results = {}
    for mode in modes:
        undo = _setup(mode)
        try:
            per_case = {}
            for name, kw in _cases().items():
                kw = dict(kw)
                call = lambda kw=kw: portattn.attention_with_kvcache(**kw, backend="triton")  # noqa: E731
                spec_kw = {k: v for k, v in kw.items() if k not in ("q", "k_cache", "v_cache", "k", "v")}
                args = (kw["q"], kw["k_cache"], kw["v_cache"], kw.get("k"), kw.get("v"))
                kv = kvcache.build_kvcache_spec(*args, **spec_kw)
                row = {
                    "total": _time(call, calls, repeats),
                    "build_kvcache_spec": _time(lambda: kvcache.build_kvcache_spec(*args, **spec_kw), calls, repeats),
                    "select_kvcache": _time(lambda: kvcache.select_kvcache(kv, "triton"), calls, repeats),
                    "decode.forward": _time(lambda: decode.forward(kv), calls, repeats),
                    "num_splits": decode.plan_summary(kv)["num_splits"],
                }
                per_case[name] = row
            results[mode] = per_case
        finally:
            _teardown(undo)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", choices=("stub", "triton", "fast", "all"), default="all")
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args(argv)
    modes = ("stub", "triton", "fast") if args.mode == "all" else (args.mode,)
    results = measure(args.calls, args.repeats, modes)
    for mode, per_case in results.items():
        print(f"== kernels: {mode}  (us per call; min of {args.repeats} x {args.calls} calls)")
        parts = ("total", "build_kvcache_spec", "select_kvcache", "decode.forward")
        print(f"{'case':28s}" + "".join(f"{p:>20s}" for p in parts) + f"{'splits':>8s}")
        for name, row in per_case.items():
            print(f"{name:28s}" + "".join(f"{row[p]:20.1f}" for p in parts) + f"{row['num_splits']:8d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
