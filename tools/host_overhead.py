"""Host cost of the triton backend without a GPU: the Python path of a call, kernels stubbed.

    PYTHONPATH=. python tools/host_overhead.py [--calls 1000] [--repeats 9] [--mode stub|binder|fast|all] [--profile N]

Times ``portattn.attention(q, k, v, causal=True, backend="triton")`` (bf16 B1 S128 H8 D64, the
shape of issue #11) and the backend's ``ops.backward`` on CPU tensors, with the device target
faked as sm_90 (the H200's tile table), in three modes:

* ``stub``: ``kernels.attn_fwd`` / ``attn_bwd_dq`` / ``attn_bwd_dkdv`` are replaced by objects
  whose ``[grid]`` returns a no-op taking the same arguments: portattn's own host cost;
* ``binder``: the launch goes through the installed triton's real per-launch path (its generated
  binder with ``native_specialize_impl`` per argument, the kernel-cache key, the check of the
  kernels' global constexprs) and stops before the C launcher: portattn + triton's host cost,
  without a GPU. It mirrors ``JITFunction.run`` of the installed triton (3.9 here; the H200
  image has 3.6, whose path is the same up to a few knobs reads);
* ``fast``: the kernels launched through ``backends/triton/launcher.py`` (``FastKernel`` over a
  copy of each kernel whose compile step gives a fake compiled kernel, a fake driver active):
  the first call per key runs triton's real ``JITFunction.run``, later ones the fast path's key
  and guards, then the fake kernel's no-op ``run`` (where the C launcher would be).

Run it against another checkout to compare (the tool imports whatever ``portattn`` is on the
path): ``PYTHONPATH=/work/main python tools/host_overhead.py`` is "before". The kernels never run,
so outputs are garbage; this measures time only. Numbers are per call: the least thread CPU time over the repeats.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

# the binder mode needs real JITFunctions (not the interpreter's); the stub mode runs either way
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from portattn.backends import triton as tb  # noqa: E402
from portattn.backends.triton import configs, kernels, ops  # noqa: E402

import portattn  # noqa: E402
from portattn.spec import build_spec  # noqa: E402

#: the kernels ops.py launches (those this checkout's kernels.py defines: attn_bwd_prep is newer)
KERNELS = tuple(name for name in ("attn_fwd", "attn_bwd_prep", "attn_bwd_dq", "attn_bwd_dkdv") if hasattr(kernels, name))
FAKE_TARGET = configs.Target("nvidia", 90)


class _Stub:
    """``kernel[grid](*args, **kwargs)`` that does nothing."""

    def __getitem__(self, grid):
        return noop


def noop(*args, **kwargs):
    return None


class _BinderOnly:
    """``kernel[grid](...)`` through the installed triton's binder, cache key and global check."""

    def __init__(self, fn):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime import jit
        self.fn, self.jit = fn, jit
        _ = fn.cache_key   # fills fn.used_global_vals, as the first launch does
        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binder = jit.create_function_from_signature(fn.signature, fn.params, self.backend)
        self.key_cache = {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            knobs = self.jit.knobs
            kwargs["debug"] = kwargs.get("debug", self.fn.debug) or knobs.runtime.debug
            for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):   # 3.9 knobs, absent in 3.6
                if hasattr(knobs.compilation, name):
                    kwargs[name] = getattr(knobs.compilation, name)
            bound, specialization, options = self.binder(*args, **kwargs)
            self.jit.compute_cache_key(self.key_cache, specialization, options)
            missing = object()
            for (name, _), (val, globals_dict) in self.fn.used_global_vals.items():
                if globals_dict.get(name, missing) != val:
                    raise RuntimeError(name)
            tuple(bound.values())   # the launcher's argument tuple
        return launch


class FakeDriver:
    """Enough of a triton driver for ``JITFunction.run``: device 0, stream 0, an sm_90 target.
    (Also used by tools/host_overhead_decode.py.)"""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


class FakeKernel:
    """A "compiled kernel" whose launch does nothing (``function`` stands for a loaded handle:
    the fast path remembers only loaded kernels)."""

    function = 1
    packed_metadata = None

    def launch_metadata(self, *args):
        return None


def _no_launch(self, *args):
    return None


FakeKernel.run = _no_launch


def fake_compiled(fn):
    """A copy of the JITFunction ``fn`` whose ``run`` takes a :class:`FakeKernel` instead of
    compiling (cached like a real one)."""
    from triton.runtime.jit import JITFunction
    jf = JITFunction(fn.fn, do_not_specialize=fn.do_not_specialize)
    _ = jf.cache_key   # fills used_global_vals, which run checks on every launch
    fake = FakeKernel()

    def _do_compile(key, signature, device, *args, **kwargs):
        jf.device_caches[device][0][key] = fake
        return fake

    jf._do_compile = _do_compile
    return jf


def _fast(fn):
    """``launcher.FastKernel`` over :func:`fake_compiled` of ``fn``."""
    from portattn.backends.triton import launcher
    return launcher.FastKernel(fake_compiled(fn))


def _install(mode: str):
    from triton.runtime.driver import driver
    tb._device_reasons = lambda device: ()        # CPU tensors accepted without the interpreter
    ops.device_target = lambda device: FAKE_TARGET  # the H200's tables (read once per device, cached)
    originals = {name: getattr(kernels, name) for name in KERNELS}
    if mode == "fast":
        originals["driver"] = driver._active
        driver.set_active(FakeDriver())
    for name in KERNELS:
        fn = originals[name]
        setattr(kernels, name, _Stub() if mode == "stub" else _BinderOnly(fn) if mode == "binder" else _fast(fn))
    return originals


def _uninstall(originals):
    from triton.runtime.driver import driver
    if "driver" in originals:
        driver._active = originals.pop("driver")
    for name, fn in originals.items():
        setattr(kernels, name, fn)


def _time(fn, calls: int, repeats: int) -> float:
    """Per-call microseconds: the least of ``repeats`` runs of ``calls`` calls, in this thread's
    CPU time (``time.thread_time``: time spent descheduled on a shared machine is not counted)."""
    for _ in range(50):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - t0) / calls * 1e6)
    return min(runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--mode", choices=("stub", "binder", "fast", "all", "check"), default="all",
                    help="check: the prepared forward launch (ops._Prepared) passes what the full path passes")
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions (cProfile, tottime)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.mode == "check":
        return check_prepared()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 8, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    dout = torch.randn(1, 128, 8, 64, generator=g).to(torch.bfloat16)
    spec = build_spec(q, k, v, causal=True)
    out, lse = torch.empty_like(q), torch.empty(1, 8, 128)
    paths = {
        "attention(triton) fwd": lambda: portattn.attention(q, k, v, causal=True, backend="triton"),
        "build_spec only": lambda: build_spec(q, k, v, causal=True),
        "ops.forward(spec)": lambda: ops.forward(spec),
        "ops.backward(spec)": lambda: ops.backward(spec, out, lse, dout),
    }
    print(f"portattn from {os.path.dirname(portattn.__file__)}; torch {torch.__version__}; "
          f"triton {sys.modules['triton'].__version__}; {args.calls} calls x {args.repeats}, least thread CPU time")
    for mode in (("stub", "binder", "fast") if args.mode == "all" else (args.mode,)):
        originals = _install(mode)
        try:
            for name, fn in paths.items():
                print(f"  [{mode:6}] {name:24} {_time(fn, args.calls, args.repeats):7.1f} us/call")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    paths["attention(triton) fwd"]()
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
                print(s.getvalue())
        finally:
            _uninstall(originals)
    return 0


def _variants():
    """(name, make(seed) -> (q, k, v, kwargs)) for :func:`check_prepared`: the argument kinds the
    prepared launch must reproduce (bf16, the fake sm_90 tables)."""
    def qkv(seed, b=1, sq=128, sk=128, hq=8, hkv=8, d=64, dv=None, grad=False, layout="bshd", pad=0):
        g = torch.Generator().manual_seed(seed)

        def one(s, h, dd):
            shape = (b, h, s, dd + pad) if layout == "bhsd" else (b, s, h, dd + pad)
            t = torch.randn(*shape, generator=g).to(torch.bfloat16)[..., :dd]
            return t.requires_grad_(grad) if pad == 0 else t.detach().requires_grad_(False)
        return one(sq, hq, d), one(sk, hkv, d), one(sk, hkv, dv or d)

    def bias_bool(seed):
        return dict(attn_bias=torch.rand(1, 1, 1, 128, generator=torch.Generator().manual_seed(seed)) > 0.2)

    def bias_float(seed):
        return dict(attn_bias=torch.randn(1, 8, 128, 128, generator=torch.Generator().manual_seed(seed)).bfloat16())
    return [
        ("causal", lambda s: (*qkv(s), dict(causal=True))),
        ("gqa + window + softcap", lambda s: (*qkv(s, hkv=2), dict(window=(32, 0), softcap=20.0))),
        ("bool key mask", lambda s: (*qkv(s), bias_bool(s))),
        ("float bias", lambda s: (*qkv(s), bias_float(s))),
        ("bhsd, Sq 5 Sk 200, Dv 32",      # (Sk < 256: decode-shaped calls take the split-KV kernels)
         lambda s: (*qkv(s, sq=5, sk=200, dv=32, layout="bhsd"), dict(causal=True, layout="bhsd"))),
        ("padded row stride", lambda s: (*qkv(s, pad=8), dict(scale=0.1))),
        ("training forward (residual)", lambda s: (*qkv(s, grad=True), dict(causal=True))),
    ]


def check_prepared() -> int:
    """Every variant twice through ``portattn.attention`` (the second call takes the prepared
    launch) against ``ops._forward`` on the same tensors with no signature (the full path):
    grid, function and every launch argument must match (tensors by shape, strides and dtype,
    the inputs by address too). Returns the number of mismatches."""
    from portattn.backends.triton import ops as tops
    originals = _install("fast")
    log = []
    FakeKernel.run = lambda self, *a: log.append(a)
    bad = 0
    try:
        for name, make in _variants():
            q, k, v, kw = make(0)
            portattn.attention(q, k, v, backend="triton", **kw)          # full path; prepares
            q, k, v, kw = make(1)
            before, stats = len(tops._prepared), dict(kernels.attn_fwd.stats)
            log.clear()
            portattn.attention(q, k, v, backend="triton", **kw)          # the prepared launch
            got = log[-1]
            # one launch, through a Bound (counted as fast), and no new prepared entry
            prepared = (len(tops._prepared) == before and kernels.attn_fwd.stats["fast"] == stats["fast"] + 1
                        and kernels.attn_fwd.stats["slow"] == stats["slow"] and len(log) == 1)
            spec = build_spec(q, k, v, **{a: b for a, b in kw.items()})
            log.clear()
            tops._forward(spec, None, None, residual=spec.needs_grad)     # no signature: the full path
            want = log[-1]

            def same(a, b):
                if isinstance(a, torch.Tensor):
                    return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() == b.stride()
                            and a.dtype == b.dtype)
                return type(a) is type(b) and a == b
            ok = (got[:6] == want[:6] and len(got) == len(want) and all(same(a, b) for a, b in zip(got[9:], want[9:]))
                  and all(got[9 + i].data_ptr() == t.data_ptr() for i, t in enumerate((spec.q, spec.k, spec.v)))
                  and prepared)
            bad += not ok
            why = "" if ok else (f" (prepared={prepared}, head {got[:6] == want[:6]}, lengths {len(got)}/{len(want)}, "
                                 f"args {[i for i, (a, b) in enumerate(zip(got[9:], want[9:])) if not same(a, b)]})")
            print(f"  {'ok  ' if ok else 'FAIL'} {name}{why}")
    finally:
        FakeKernel.run = _no_launch
        _uninstall(originals)
    print(f"prepared launches: {bad} mismatch(es)")
    return bad


if __name__ == "__main__":
    sys.exit(main())
