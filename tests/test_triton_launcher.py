"""backends/triton/launcher.py: the fast launch path of the Triton kernels.

CPU (no GPU, no compiler): the specialisation key against triton's own binder over many drawn
argument values, and the launch plumbing against ``JITFunction.run`` with a fake driver and a
fake compiled kernel (what the fast path passes to ``kernel.run`` is what triton passes, and
every guard falls back); the interpreter passthrough. GPU (skipped without CUDA): bit-identical
results against the normal path for the forward, backward and decode kernels, an unaligned view,
and a CUDA-graph capture (the checks of ``tools/gpu_launcher_check.py``).
"""

from __future__ import annotations

import random

import pytest
import torch
from portattn.backends.triton import launcher

from tests._scripts import load_script

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime import jit as tjit  # noqa: E402
from triton.runtime.driver import driver as triton_driver  # noqa: E402

_TOY_GLOBAL = tl.constexpr(7)


def _toy(X, Y, n, m, f, b, Z, W, C1: tl.constexpr, C2: tl.constexpr = 3):   # the kernels' kinds of parameter
    pass


def _toy_global(X, n, C: tl.constexpr):
    _ = _TOY_GLOBAL


class _FakeDriver:
    """What ``JITFunction.run`` needs of a driver: device, stream, an sm_90 target."""

    def __init__(self):
        self.target, self.stream = GPUTarget("cuda", 90, 32), 1234

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return self.stream

    def get_current_target(self):
        return self.target


class _FakeKernel:
    """A "compiled kernel" per triton key: ``run`` records its arguments."""

    packed_metadata = ("packed",)

    def __init__(self, key, log):
        self.function, self.log = f"function<{key}>", log

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        self.log.append(args)


@pytest.fixture
def fake_triton():
    """``make(pyfn) -> (JITFunction, log)``: kernels that "compile" to a :class:`_FakeKernel`
    (one per triton cache key), with a fake driver active; restores the driver after."""
    old = triton_driver._active
    triton_driver.set_active(_FakeDriver())
    was = launcher.enabled()
    launcher.set_enabled(True)

    def make(pyfn):
        fn = tjit.JITFunction(pyfn)
        log = []
        _ = fn.cache_key   # fills used_global_vals (as a first compile does)

        def _do_compile(key, signature, device, *args, **kwargs):
            kernel = fn.device_caches[device][0][key] = _FakeKernel(key, log)
            return kernel

        fn._do_compile = _do_compile
        return fn, log

    yield make
    triton_driver._active = old
    launcher.set_enabled(was)


def _triton_key(fn, args, kwargs):
    """triton's own compile-cache key of a call (its binder's specialisation and options, as
    ``JITFunction.run`` str-s them): the authority the fast path's key must refine."""
    binder = tjit.create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    _, spec, options = binder(*args, **kwargs)
    return str(spec) + str(options)


INTS = [0, 1, -1, 2, 15, 16, 17, 31, 32, 48, 1000, 1024, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31,
        -2**31 - 1, -2**31 - 16, -16, -17, 2**32, 2**40 + 1, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16,
        2**64 - 1]


def _drawn_ints(rng, count):
    out = list(INTS)
    for _ in range(count):
        bits = rng.choice((4, 8, 20, 31, 32, 40, 62, 63, 64))
        v = rng.randrange(0, 2**bits)
        if rng.random() < 0.3:
            v = -v
        if -2**63 <= v < 2**64:
            out.append(v)
    return out


def _tensors():
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.bool,
                  torch.int8, torch.float64):
        base = torch.zeros(64, dtype=dtype)
        for offset in (0, 1, 2, 3, 4, 8, 16, 17):
            out.append(base[offset:])
    return out


def _distinct_classes(fk, fn, slot, values, base_args, kwargs):
    """{fast-path key: set of triton keys} over ``values`` put in positional ``slot``."""
    by_key = {}
    for v in values:
        args = list(base_args)
        args[slot] = v
        args = tuple(args)
        by_key.setdefault(fk.key(args, kwargs), set()).add(_triton_key(fn, args, kwargs))
    return by_key


def _bound(fake_triton, pyfn):
    fn, log = fake_triton(pyfn)
    fk = launcher.FastKernel(fn)
    fk._state = launcher._bind_state(fn)
    return fn, fk, log


def _base_args():
    x = torch.zeros(64)
    return (x, x, 16, 16, 0.5, True, None, 16)


def test_key_refines_triton_specialisation_for_ints(fake_triton):
    fn, fk, _ = _bound(fake_triton, _toy)
    ints = _drawn_ints(random.Random(0), 400)
    for slot in (2, 7):       # a runtime int parameter, in two positions
        by_key = _distinct_classes(fk, fn, slot, ints, _base_args(), {"C1": 4})
        assert all(len(s) == 1 for s in by_key.values()), by_key   # one key never covers two specialisations
        # and no finer than needed within int32: i32 ints fall in exactly triton's 3 classes (1, %16, other)
        small = [v for v in ints if -2**31 <= v < 2**31 and v >= 0]
        assert len({fk.key(tuple(_base_args()[:slot]) + (v,) + _base_args()[slot + 1:], {"C1": 4})
                    for v in small}) == 3


def test_key_refines_triton_specialisation_with_do_not_specialize(fake_triton):
    # as kernels.py declares its sizes (one kernel for every value); the key only (fake driver active)
    fn = tjit.JITFunction(_toy, do_not_specialize=["n", "W"], do_not_specialize_on_alignment=["X"])
    fk = launcher.FastKernel(fn)
    fk._state = launcher._bind_state(fn)
    ints = _drawn_ints(random.Random(1), 200)
    for slot, values in ((2, ints), (7, ints), (0, _tensors())):
        by_key = _distinct_classes(fk, fn, slot, values, _base_args(), {"C1": 4})
        assert all(len(s) == 1 for s in by_key.values()), by_key


def test_key_refines_triton_specialisation_for_tensors_and_mixed_types(fake_triton):
    fn, fk, _ = _bound(fake_triton, _toy)
    tensors = _tensors()
    by_key = _distinct_classes(fk, fn, 0, tensors, _base_args(), {"C1": 4})
    assert all(len(s) == 1 for s in by_key.values()), by_key
    # exact for tensors: a key per (dtype, 16-byte alignment), as triton
    assert len(by_key) == len({_triton_key(fn, (t,) + _base_args()[1:], {"C1": 4}) for t in tensors})
    # one slot given every kind of value triton tells apart: 1, True, 1.0, None, a tensor, ints
    mixed = [1, True, False, 1.0, 0.0, -2.5, None, 16, 17, 2**31, 2**63, torch.zeros(4), torch.zeros(4)[1:]]
    by_key = _distinct_classes(fk, fn, 3, mixed, _base_args(), {"C1": 4})
    assert all(len(s) == 1 for s in by_key.values()), by_key
    assert len(by_key) == len(set().union(*by_key.values()))   # here also no finer than triton


def test_key_covers_constexprs_options_and_knobs(fake_triton, monkeypatch):
    fn, fk, _ = _bound(fake_triton, _toy)
    args = _base_args()
    variants = [{"C1": 4}, {"C1": 5}, {"C1": True}, {"C1": 1}, {"C1": 1.0}, {"C1": 4, "C2": 3}, {"C1": 4, "C2": 2},
                {"C1": 4, "num_warps": 4}, {"C1": 4, "num_warps": 8}, {"C1": 4, "num_stages": 2},
                {"C1": 4, "enable_fp_fusion": False}]
    by_key = {}
    for kw in variants:
        by_key.setdefault(fk.key(args, kw), set()).add(_triton_key(fn, args, kw))
    assert all(len(s) == 1 for s in by_key.values()), by_key
    # a constexpr given positionally is keyed by value and type
    pos = [fk.key(args + (c,), {}) for c in (4, 5, True, 1, 1.0)]
    assert len(set(pos)) == 5
    base = fk.key(args, {"C1": 4})
    monkeypatch.setattr(fn, "debug", True)
    assert fk.key(args, {"C1": 4}) != base
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    monkeypatch.setattr(fn, "debug", None)
    assert fk.key(args, {"C1": 4}) != base


def test_fast_launch_passes_what_triton_passes(fake_triton):
    fn, log = fake_triton(_toy)
    fk = launcher.FastKernel(fn)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    calls = [((3, 2), (x, y, 16, 1, 0.5, True, None, 17), {"C1": 4, "num_warps": 4}),
             ((5,), (x, y[1:], 16, 1, 0.5, True, None, 17), {"C1": 4, "num_warps": 4}),   # unaligned: new key
             ((2, 2, 2), (x, y, 2**33, 1, -1.0, False, None, 0), {"C1": 4, "C2": 9})]
    for grid, args, kwargs in calls:
        fn[grid](*args, **kwargs)          # the normal path
        want = log[-1]
        for i in range(3):    # the first records (the normal path), then fast launches
            fk[grid](*args, **kwargs)
            got = log[-1]
            # grid, stream, function, packed metadata, then every parameter (constexprs too);
            # the launch metadata and the hooks (empty chains) are None on the fast path
            assert got[:6] == want[:6] and (i == 0 or got[6:9] == (None, None, None))
            assert len(got[9:]) == len(want[9:]) and all(a is b or a == b for a, b in zip(got[9:], want[9:]))
    assert fk.stats == {"fast": 6, "slow": 3} and len(fk._entries) == 3 and fk.disabled is None
    # a kernel of another key: the function of the unaligned call is not the aligned one's
    assert len({c[4] for c in log}) == 3


def test_new_int_values_of_a_recorded_class_launch_fast_with_their_values(fake_triton):
    fn, log = fake_triton(_toy)
    fk = launcher.FastKernel(fn)
    x = torch.zeros(64)
    fk[(1,)](x, x, 16, 3, 0.5, True, None, 16, C1=4)
    for n, m in ((32, 5), (48, 7), (2**20, 2**31 - 1)):      # same classes (%16 == 0; i32, not 1)
        fk[(1,)](x, x, n, m, 0.25, False, None, 16, C1=4)
        assert log[-1][9:13] == (x, x, n, m) and log[-1][13:15] == (0.25, False)
    assert fk.stats == {"fast": 3, "slow": 1} and len(fk._entries) == 1 and len(fk._hot) == 3
    fk[(1,)](x, x, 17, 3, 0.5, True, None, 16, C1=4)          # a new class: the normal path records it
    fk[(1,)](x, x, 2**31, 3, 0.5, True, None, 16, C1=4)
    assert fk.stats == {"fast": 3, "slow": 3} and len(fk._entries) == 3
    assert len({c[4] for c in log}) == 3                      # three kernels


def test_guards_fall_back_to_the_normal_path(fake_triton, monkeypatch):
    fn, log = fake_triton(_toy)
    fk = launcher.FastKernel(fn)
    x = torch.zeros(64)
    args, kw = (x, x, 16, 16, 0.5, True, None, 16), {"C1": 4}
    fk[(1,)](*args, **kw)
    fk[(1,)](*args, **kw)
    assert fk.stats == {"fast": 1, "slow": 1}
    seen = []
    triton.knobs.runtime.launch_enter_hook.add(seen.append)     # a profiler's hook: the normal path passes it
    try:
        fk[(1,)](*args, **kw)
        assert fk.stats["slow"] == 2 and seen.append in log[-1][7].calls   # (the C launcher would call it)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(seen.append)
    fn.add_pre_run_hook(lambda *a, **k: seen.append("pre"))
    fk[(1,)](*args, **kw)
    assert fk.stats["slow"] == 3 and seen[-1] == "pre"
    fn.pre_run_hooks.clear()
    launcher.set_enabled(False)
    fk[(1,)](*args, **kw)
    assert fk.stats["slow"] == 4
    launcher.set_enabled(True)
    fk[lambda meta: (1,)](*args, **kw)                          # a callable grid: triton's own path
    assert fk.stats == {"fast": 1, "slow": 4} and len(log) == 6
    fk[(1,)](x, x, 16, 16, 0.5, True, None, W=16, C1=4)          # a runtime argument by keyword: never recorded
    fk[(1,)](x, x, 16, 16, 0.5, True, None, W=16, C1=4)
    assert fk.stats == {"fast": 1, "slow": 6}
    fk[(1,)](*args, **kw)
    assert fk.stats["fast"] == 2
    other = _FakeDriver()
    triton_driver.set_active(other)                               # a new driver: the normal path
    fk[(1,)](*args, **kw)
    assert fk.stats["slow"] == 7


def test_bound_launch_passes_what_the_fast_path_passes_and_declines_like_it(fake_triton, monkeypatch):
    fn, log = fake_triton(_toy)
    fk = launcher.FastKernel(fn)
    x = torch.zeros(64)
    args, kw = (x, x, 16, 16, 0.5, True, None, 16), {"C1": 4}
    assert fk.bind(args, kw) is None                    # nothing recorded yet
    fk[(2, 3)](*args, **kw)                             # the normal path records
    assert fk.bind(args, {"C1": 5}) is None             # another key: not recorded
    bound = fk.bind(args, kw)
    fk[(2, 3)](*args, **kw)
    want = log[-1]
    assert bound((2, 3), *args) is True
    assert log[-1] == want and fk.stats == {"fast": 2, "slow": 1}
    y = torch.zeros(64)
    assert bound((4,), y, y, 32, 48, 0.25, False, None, 16) is True     # same classes, new values
    assert log[-1][:3] == (4, 1, 1) and log[-1][9:17] == (y, y, 32, 48, 0.25, False, None, 16)
    launcher.set_enabled(False)
    assert bound((1,), *args) is False
    launcher.set_enabled(True)
    seen = []
    triton.knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        assert bound((1,), *args) is False               # a hook the fast path would skip
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(seen.append)
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    assert bound((1,), *args) is False                   # knobs folded into the compile options
    monkeypatch.setattr(triton.knobs.runtime, "debug", False)
    monkeypatch.setattr(fk._state, "get_device", lambda: 1)
    assert bound((1,), *args) is False                   # another current device
    assert fk.stats == {"fast": 3, "slow": 1}


def test_changed_global_takes_the_normal_path_which_raises(fake_triton, monkeypatch):
    fn, _ = fake_triton(_toy_global)
    assert fn.used_global_vals
    fk = launcher.FastKernel(fn)
    x = torch.zeros(16)
    fk[(1,)](x, 16, C=2)
    fk[(1,)](x, 16, C=2)
    assert fk.stats == {"fast": 1, "slow": 1}
    monkeypatch.setitem(globals(), "_TOY_GLOBAL", tl.constexpr(8))
    with pytest.raises(RuntimeError, match="_TOY_GLOBAL"):
        fk[(1,)](x, 16, C=2)


def test_a_failing_first_record_disables_that_kernel(fake_triton, monkeypatch):
    fn, log = fake_triton(_toy)
    fk = launcher.FastKernel(fn)
    monkeypatch.setattr(launcher, "_bind_state", lambda fn: (_ for _ in ()).throw(AttributeError("no such knob")))
    x = torch.zeros(64)
    for _ in range(3):
        fk[(1,)](x, x, 16, 16, 0.5, True, None, 16, C1=4)
    assert fk.stats == {"fast": 0, "slow": 3} and len(log) == 3
    assert "no such knob" in fk.disabled


def test_passthrough_for_what_is_not_a_plain_jit_function(monkeypatch):
    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: "stub"
    stub = Stub()
    assert launcher.fast(stub) is stub and launcher.fast(stub)[(1,)]() == "stub"
    fn = tjit.JITFunction(_toy)
    launcher.unsupported_reason.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    try:
        assert "3.7.1" in launcher.unsupported_reason()
        assert launcher.fast(fn) is fn
    finally:
        launcher.unsupported_reason.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU tensors")
def test_interpreter_passthrough_gives_the_direct_launch_results(monkeypatch):
    from portattn.backends.triton import decode, kernels

    import portattn
    assert triton.knobs.runtime.interpret, "tests/conftest.py sets TRITON_INTERPRET=1 without a GPU"
    assert "TRITON_INTERPRET" in launcher.unsupported_reason()
    for k in (kernels.attn_fwd, decode.decode_split, decode.decode_combine, decode.decode_append):
        assert launcher.fast(k) is k
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 16, generator=g)
    kc, vc = torch.randn(1, 64, 2, 16, generator=g), torch.randn(1, 64, 2, 16, generator=g)
    kn, vn = torch.randn(1, 1, 2, 16, generator=g), torch.randn(1, 1, 2, 16, generator=g)
    lens = torch.tensor([40], dtype=torch.int32)

    def call():
        kc2, vc2 = kc.clone(), vc.clone()
        out, lse = portattn.attention_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=lens, causal=True,
                                                   return_lse=True, backend="triton")
        return out, lse, kc2, vc2

    through = call()
    monkeypatch.setattr(launcher, "fast", lambda fn: fn)          # the direct launch
    direct = call()
    assert all(torch.equal(a, b) for a, b in zip(through, direct))


# ----- GPU: the checks of tools/gpu_launcher_check.py ------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_launcher_check", "tools")


@requires_cuda
def test_gpu_dense_kernels_bit_identical_and_unaligned_view_gets_its_own_key(gpu_check):
    assert launcher.unsupported_reason() is None
    results = gpu_check.check_dense(torch.device("cuda"))
    assert {"forward", "backward dq", "backward dkdv", "unaligned"} <= set(results) and all(results.values()), results


@requires_cuda
def test_gpu_decode_bit_identical(gpu_check):
    results = gpu_check.check_decode(torch.device("cuda"))
    assert results and all(results.values()), results


@requires_cuda
def test_gpu_cuda_graph_capture_through_the_fast_path(gpu_check):
    results = gpu_check.check_cuda_graph(torch.device("cuda"))
    assert results == {"cuda graph decode": True, "cuda graph forward": True}, results
