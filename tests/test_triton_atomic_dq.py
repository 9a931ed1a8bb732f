"""FlashAttention-2's atomic dQ in the Triton backward (issue #14): when determinism is not
requested, a 16-bit call whose tile table has an atomic row (``BackwardConfigs.atomic``) skips
the dQ kernel, and the dK/dV kernel (``kernels.attn_bwd_dkdv`` with ``DQ_ATOMIC``) adds each
tile pair's dS K into a float32 dQ with atomic adds.

Checked against the float64 reference under docs/semantics.md (``portattn.testing.check_backend``,
i.e. ``portattn.numerics.compare``) for every feature the atomic path runs with, and that the
deterministic two-kernel path runs — bit-identically — whenever determinism is requested, a bias
gradient is needed or the inputs are float32. A spy on the launcher records which kernels ran.

On CPU the kernels run in Triton's interpreter (tiles of 32, S <= 128; the CPU table has no
atomic row, so the tests give it one); the ``gpu`` tests at the end run at real sizes on the
device's own table.
"""

from __future__ import annotations

import pytest
import torch

import portattn
from portattn.numerics import GRAD_FACTOR, compare
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec
from portattn.testing import check_backend

pytest.importorskip("triton")

from portattn.backends.triton import configs, kernels, ops  # noqa: E402
from portattn.backends.triton.configs import BackwardConfigs, KernelConfig, Target  # noqa: E402
from test_lse_grad import check_lse_grads  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA/ROCm GPU (run on the H200)")


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=DEVICE, dtype=dtype)


class Launches:
    """The backward kernels launched since the last ``clear()``: names, and the dK/dV launches'
    ``DQ_ATOMIC``."""

    def __init__(self):
        self.names, self.dq_atomic = [], []

    def clear(self):
        self.names.clear()
        self.dq_atomic.clear()

    @property
    def atomic(self) -> bool:
        """True iff the last backward ran the atomic path (no dQ kernel, every dK/dV launch with DQ_ATOMIC)."""
        return "attn_bwd_dq" not in self.names and bool(self.dq_atomic) and all(self.dq_atomic)

    @property
    def deterministic(self) -> bool:
        return "attn_bwd_dq" in self.names and bool(self.dq_atomic) and not any(self.dq_atomic)


@pytest.fixture
def launches(monkeypatch):
    """Record the backward's launches (ops calls ``launcher.fast(kernel)[grid](...)``). The
    portable backward is pinned: the atomic dQ is its dK/dV kernel's, and on Hopper ``auto``
    takes the Gluon backward at D 128 / 256 (``gluon_bwd.auto_takes``), which launches neither."""
    monkeypatch.setenv("PORTATTN_TRITON_BACKWARD", "portable")
    rec = Launches()
    fast = ops.launcher.fast
    names = {id(getattr(kernels, n)): n for n in ("attn_bwd_prep", "attn_bwd_dq", "attn_bwd_dkdv")}

    def spy(fn):
        launch = fast(fn)
        name = names.get(id(fn))
        if name is None:
            return launch

        class Grid:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    rec.names.append(name)
                    if name == "attn_bwd_dkdv":
                        rec.dq_atomic.append(bool(kwargs["DQ_ATOMIC"]))
                    return launch[grid](*args, **kwargs)
                return call
        return Grid()

    monkeypatch.setattr(ops.launcher, "fast", spy)
    return rec


@pytest.fixture
def atomic_row(monkeypatch):
    """Give every backward an atomic row: the table's own, else its dK/dV tiles (tiles of 32 on
    the interpreter); set ``.split = True`` for a split row, ``.row = None`` for none. Under
    ``PORTATTN_TRITON_DQ=atomic`` (the default ``auto`` takes only rows marked timed)."""
    orig = ops._backward_configs

    class Row:
        split = False
        row = "the table's"

    def patched(device, dtype, hd, hdv):
        base = orig(device, dtype, hd, hdv)
        atomic = None
        if Row.row is not None:
            d = base.atomic or base.dkdv
            atomic = KernelConfig(d.block_m, d.block_n, d.num_warps, d.num_stages, split=Row.split or d.split)
        return BackwardConfigs(base.dkdv, base.dq, base.prep, atomic=atomic)

    monkeypatch.setattr(ops, "_backward_configs", patched)
    monkeypatch.delenv("PORTATTN_DETERMINISTIC", raising=False)
    monkeypatch.setenv("PORTATTN_TRITON_DQ", "atomic")
    return Row


def _assert_ok(results):
    bad = [r for r in results if not r.passed]
    assert not bad, "\n".join(map(str, results))


# name -> (B, Sq, Sk, Hq, Hkv, D, Dv, dtype, kwargs): ragged tiles of 32 everywhere; D equal to its
# padded block (atomic dQ is off for narrower head dims: ops.atomic_config)
CASES = {
    "causal_bottom_right_bf16": (1, 70, 80, 2, 2, 64, 64, torch.bfloat16, {"causal": True}),
    "causal_top_left_gqa2_fp16": (1, 90, 50, 4, 2, 32, 32, torch.float16,
                                  {"causal": True, "causal_alignment": "top_left"}),
    "window_bf16": (2, 64, 70, 2, 2, 32, 32, torch.bfloat16, {"window": (9, 4)}),
    "softcap_window_fp16": (1, 65, 65, 2, 1, 64, 64, torch.float16, {"softcap": 3.0, "window": (20, 0)}),
    "alibi_causal_gqa2": (2, 40, 40, 4, 2, 32, 32, torch.bfloat16, {"alibi": True, "causal": True}),
    "gqa4_plain": (1, 33, 50, 4, 1, 16, 16, torch.float16, {}),
    "dv_ne_d": (1, 17, 80, 2, 2, 64, 40, torch.float16, {}),
    "bias_no_grad_bf16": (1, 40, 50, 2, 2, 32, 32, torch.bfloat16, {"bias": True}),
    "bool_mask_empty_rows": (2, 33, 40, 2, 1, 32, 32, torch.float16, {"mask": True}),
}


def _case(name, seed=0):
    b, sq, sk, hq, hkv, d, dv, dtype, kw = CASES[name]
    g = torch.Generator().manual_seed(seed)
    q = _randn(b, sq, hq, d, dtype=dtype, gen=g)
    k = _randn(b, sk, hkv, d, dtype=dtype, gen=g)
    v = _randn(b, sk, hkv, dv, dtype=dtype, gen=g)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(b, hq, generator=g).to(DEVICE) * 0.5
    if kw.pop("bias", False):   # a float bias without requires_grad: no dBias, so atomic dQ applies
        kw["attn_bias"] = _randn(b, hq, sq, sk, dtype=dtype, gen=g)
    if kw.pop("mask", False):
        keep = torch.rand(b, 1, sq, sk, generator=g) > 0.3
        keep[:, :, ::5] = False           # every 5th row sees no key: output 0, lse -inf, dq 0
        kw["attn_bias"] = keep.to(DEVICE)
    return q, k, v, kw


def _frozen_bias_grads(q, k, v, kw) -> list:
    """check_backend's gradient comparisons for a float bias that needs no gradient (check_backend
    makes every float bias a leaf): dq, dk, dv against float64 autograd through the reference."""
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(0)).to(q)
    got = _grads(q, k, v, dout, kw)

    def through(forward, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        out, _ = forward(build_spec(*leaves, **dict(kw, attn_bias=kw["attn_bias"].to(dtype))))
        return torch.autograd.grad(out, leaves, dout.to(dtype))

    ref, naive = through(reference_forward, torch.float64), through(naive_forward, q.dtype)
    magnitude = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * build_spec(q, k, v).scale
    return [compare(n, a, r, b, factor=GRAD_FACTOR, zero_ref_scale=magnitude)
            for n, a, r, b in zip(("dq", "dk", "dv"), got, ref, naive)]


def _check(q, k, v, kw, launches):
    launches.clear()
    bias = kw.get("attn_bias")
    if bias is not None and bias.is_floating_point():
        _assert_ok(_frozen_bias_grads(q, k, v, kw))
    else:
        _assert_ok(check_backend("triton", q, k, v, grad=True, **kw))
    assert launches.atomic, launches.names


@pytest.mark.parametrize("name", sorted(CASES))
def test_atomic_dq_matches_reference(name, atomic_row, launches):
    q, k, v, kw = _case(name)
    _check(q, k, v, kw, launches)


@pytest.mark.parametrize("name", ["causal_bottom_right_bf16", "gqa4_plain"])
def test_atomic_dq_with_a_split_row_matches_reference(name, atomic_row, launches):
    """A split row (D 256's on Hopper): the dV launch, then the dK launch that also adds dS K."""
    atomic_row.split = True
    q, k, v, kw = _case(name)
    _check(q, k, v, kw, launches)
    assert launches.names.count("attn_bwd_dkdv") == 2


def test_atomic_dq_d256_split_matches_reference(atomic_row, launches):
    atomic_row.split = True
    g = torch.Generator().manual_seed(2)
    q, k, v = (_randn(1, 40, 1, 256, dtype=torch.bfloat16, gen=g) for _ in range(3))
    _check(q, k, v, {"causal": True}, launches)


def test_atomic_dq_varlen(atomic_row, launches):
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [17, 1, 0, 40], [30, 5, 3, 40]
    hq, hkv, d = 4, 2, 64
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = _randn(sum(lens_q), hq, d, dtype=torch.bfloat16, gen=g)
    k = _randn(sum(lens_k), hkv, d, dtype=torch.bfloat16, gen=g)
    v = _randn(sum(lens_k), hkv, d, dtype=torch.bfloat16, gen=g)
    _check(q, k, v, dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, window=(12, 0)), launches)


def test_atomic_dq_lse_gradient(atomic_row, launches):
    """A gradient reaching lse too (folded into delta by the prep kernel, so into every dS)."""
    g = torch.Generator().manual_seed(4)
    q = _randn(1, 50, 2, 32, dtype=torch.bfloat16, gen=g)
    k = _randn(1, 60, 2, 32, dtype=torch.bfloat16, gen=g)
    v = _randn(1, 60, 2, 32, dtype=torch.bfloat16, gen=g)
    launches.clear()
    check_lse_grads("triton", q, k, v, causal=True)
    assert launches.atomic, launches.names


def test_atomic_dq_is_exactly_zero_for_fully_masked_rows(atomic_row, launches):
    g = torch.Generator().manual_seed(5)
    q = _randn(1, 45, 2, 32, dtype=torch.float16, gen=g).requires_grad_(True)
    k = _randn(1, 20, 2, 32, dtype=torch.float16, gen=g).requires_grad_(True)
    v = _randn(1, 20, 2, 32, dtype=torch.float16, gen=g).requires_grad_(True)
    launches.clear()
    # bottom-right causal with Sq > Sk: the first Sq - Sk = 25 rows see nothing
    out = portattn.attention(q, k, v, causal=True, backend="triton")
    out.float().square().sum().backward()
    assert launches.atomic, launches.names
    assert torch.equal(q.grad[:, :25], torch.zeros_like(q.grad[:, :25]))
    assert q.grad[:, 25:].abs().amax() > 0
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def _grads(q, k, v, dout, kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = portattn.attention(*leaves, backend="triton", **kw)
    return torch.autograd.grad(out, leaves, dout)


def test_determinism_requested_runs_the_two_kernel_path_bit_identically(atomic_row, launches, monkeypatch):
    q, k, v, kw = _case("causal_bottom_right_bf16")
    dout = _randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, gen=torch.Generator().manual_seed(6))
    launches.clear()
    atomic = _grads(q, k, v, dout, kw)
    assert launches.atomic, launches.names
    for how in ("env", "torch"):
        was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        with monkeypatch.context() as m:
            if how == "env":
                m.setenv("PORTATTN_DETERMINISTIC", "1")
            else:
                torch.use_deterministic_algorithms(True, warn_only=True)
            try:
                runs = []
                for _ in range(2):
                    launches.clear()
                    runs.append(_grads(q, k, v, dout, kw))
                    assert launches.deterministic, (how, launches.names, launches.dq_atomic)
            finally:
                torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        for a, b in zip(*runs):
            assert torch.equal(a, b), f"{how}: the deterministic backward is not bit-identical across runs"
    # dQ of both paths agrees to rounding; on the interpreter both make the same dK, dV bits (the
    # same products in the same order: a GPU compile of another kernel variant may fuse differently)
    det = runs[0]
    assert torch.allclose(atomic[0].float(), det[0].float(), atol=2e-2, rtol=2e-2)
    if DEVICE == "cpu":
        assert torch.equal(atomic[1], det[1]) and torch.equal(atomic[2], det[2])


def test_bias_gradient_float32_and_no_row_keep_the_two_kernel_path(atomic_row, launches):
    g = torch.Generator().manual_seed(7)
    q, k, v = (_randn(1, 33, 2, 32, dtype=torch.float16, gen=g) for _ in range(3))
    bias = _randn(1, 2, 33, 33, dtype=torch.float16, gen=g)
    launches.clear()
    _assert_ok(check_backend("triton", q, k, v, grad=True, attn_bias=bias))   # dBias wanted
    assert launches.deterministic, launches.names
    launches.clear()
    _assert_ok(check_backend("triton", q.float(), k.float(), v.float(), grad=True, causal=True))
    assert launches.deterministic, launches.names
    atomic_row.row = None
    launches.clear()
    _assert_ok(check_backend("triton", q, k, v, grad=True, causal=True))
    assert launches.deterministic, launches.names


def test_atomic_config_choice(monkeypatch):
    """ops.atomic_config: the row, unless the call is exact (float32 / no residual), wants dBias
    or requests determinism; PORTATTN_TRITON_DQ=auto (the default) only a row marked timed,
    kernel never, anything else is an error naming the choices."""
    row = KernelConfig(32, 32, 4, 1)
    cfgs = BackwardConfigs(row, row, atomic=KernelConfig(16, 64, 4, 1))
    q = torch.zeros(1, 8, 1, 16, dtype=torch.bfloat16)
    spec = build_spec(q, q, q)
    monkeypatch.delenv("PORTATTN_TRITON_DQ", raising=False)
    assert ops.atomic_config(spec, cfgs, False, False) is None                    # auto: the row is untimed
    timed = BackwardConfigs(row, row, atomic=KernelConfig(16, 64, 4, 1), atomic_by_default=True)
    assert ops.atomic_config(spec, timed, False, False) == KernelConfig(16, 64, 4, 1)
    monkeypatch.setenv("PORTATTN_TRITON_DQ", "kernel")
    assert ops.atomic_config(spec, timed, False, False) is None
    monkeypatch.setenv("PORTATTN_TRITON_DQ", "sometimes")
    with pytest.raises(ValueError, match="PORTATTN_TRITON_DQ='sometimes': use one of auto, atomic, kernel"):
        ops.atomic_config(spec, timed, False, False)
    monkeypatch.setenv("PORTATTN_TRITON_DQ", "atomic")
    assert ops.atomic_config(spec, cfgs, False, False) == KernelConfig(16, 64, 4, 1)
    assert ops.atomic_config(spec, cfgs, True, False) is None
    assert ops.atomic_config(spec, cfgs, False, True) is None
    assert ops.atomic_config(spec, BackwardConfigs(row, row), False, False) is None
    object.__setattr__(spec, "deterministic", True)
    assert ops.atomic_config(spec, cfgs, False, False) is None


def test_tables_give_atomic_rows_to_hopper_16_bit_only():
    h200 = Target("nvidia", 90)
    for block_d in configs.PADDED_DIMS:
        bf16 = configs.backward_configs(h200, block_d, 2)
        assert bf16.atomic is not None and bf16.atomic.block_m >= 16, block_d
        # on by default (PORTATTN_TRITON_DQ=auto) only where the table marks the row timed
        assert bf16.atomic_by_default == (block_d in configs._BWD_ATOMIC_BY_DEFAULT["hopper"]), block_d
        assert configs.backward_configs(h200, block_d, 4).atomic is None          # float32: never atomic
        for other in (Target("nvidia", 80), Target("nvidia", 89), Target("amd", "gfx942"), Target("cpu")):
            assert configs.backward_configs(other, block_d, 2).atomic is None, other
        # where a table has no atomic row, the portability check compiles its dK/dV row with DQ_ATOMIC
        a100 = Target("nvidia", 80)
        assert configs.atomic_dkdv_config(a100, block_d, 2) == configs.backward_configs(a100, block_d, 2).dkdv
        assert configs.atomic_dkdv_config(h200, block_d, 2) == bf16.atomic
    assert configs.backward_configs(h200, 256, 2).atomic.split


@pytest.mark.parametrize("timed", [False, True])
def test_the_default_non_deterministic_call_takes_a_timed_atomic_row_only(monkeypatch, launches, timed):
    """With a table row (here: the CPU table given an atomic row of tiles of 32), a plain 16-bit
    training call runs atomic dQ (no dQ kernel) by default only when the row is marked timed;
    an untimed row runs under PORTATTN_TRITON_DQ=atomic."""
    monkeypatch.delenv("PORTATTN_DETERMINISTIC", raising=False)
    monkeypatch.delenv("PORTATTN_TRITON_DQ", raising=False)
    orig = configs.backward_configs

    def with_row(target, block_d, elem_size):
        base = orig(target, block_d, elem_size)
        return BackwardConfigs(base.dkdv, base.dq, base.prep, atomic=KernelConfig(32, 32, 4, 1),
                               atomic_by_default=timed)

    monkeypatch.setattr(ops, "backward_configs", with_row)
    ops._backward_configs.cache_clear()
    try:
        g = torch.Generator().manual_seed(8)
        q, k, v = (_randn(1, 40, 2, 32, dtype=torch.bfloat16, gen=g).requires_grad_(True) for _ in range(3))
        launches.clear()
        portattn.attention(q, k, v, causal=True, backend="triton").sum().backward()
        assert launches.atomic if timed else launches.deterministic, launches.names
        if not timed:
            monkeypatch.setenv("PORTATTN_TRITON_DQ", "atomic")
            launches.clear()
            portattn.attention(q, k, v, causal=True, backend="triton").sum().backward()
            assert launches.atomic, launches.names
    finally:
        ops._backward_configs.cache_clear()


# ----- GPU, real sizes: the device's own table (the H200: Hopper's atomic rows) ----------------

@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_atomic_dq_matches_reference(d, launches, monkeypatch):
    monkeypatch.delenv("PORTATTN_DETERMINISTIC", raising=False)
    monkeypatch.setenv("PORTATTN_TRITON_DQ", "atomic")   # the table's rows, timed or not
    cfgs = ops._backward_configs(torch.device(DEVICE), torch.bfloat16, d, d)
    if cfgs.atomic is None:
        pytest.skip(f"this device's table has no atomic row for D {d}")
    g = torch.Generator().manual_seed(31 + d)
    b, s, h = 2, 2048, 2048 // d
    q, k, v = (_randn(b, s, h, d, dtype=torch.bfloat16, gen=g) for _ in range(3))
    launches.clear()
    _assert_ok(check_backend("triton", q, k, v, grad=True, causal=True))
    assert launches.atomic, launches.names
    # a ragged, bottom-right case with GQA too
    q = _randn(1, 1000, 8, d, dtype=torch.bfloat16, gen=g)
    k, v = (_randn(1, 1500, 2, d, dtype=torch.bfloat16, gen=g) for _ in range(2))
    launches.clear()
    _assert_ok(check_backend("triton", q, k, v, grad=True, causal=True))
    assert launches.atomic, launches.names


@requires_gpu
@pytest.mark.gpu
def test_gpu_determinism_requested_is_bit_identical_with_atomic_rows(monkeypatch, launches):
    monkeypatch.setenv("PORTATTN_DETERMINISTIC", "1")
    monkeypatch.setenv("PORTATTN_TRITON_DQ", "atomic")
    g = torch.Generator().manual_seed(37)
    q, k, v, dout = (_randn(2, 2048, 16, 128, dtype=torch.bfloat16, gen=g) for _ in range(4))
    first = None
    for _ in range(5):
        launches.clear()
        grads = _grads(q, k, v, dout, {"causal": True})
        assert launches.deterministic, launches.names
        if first is None:
            first = grads
        else:
            for a, b in zip(first, grads):
                assert torch.equal(a, b)


def test_flash_attn_deterministic_flag_runs_the_two_kernel_path(atomic_row, launches, monkeypatch):
    """flash_attn_func(deterministic=True) requests determinism for its call (config.deterministic_scope):
    the backward then runs the two-kernel path, bit-identically; without the flag, atomic dQ."""
    from portattn.compat import flash_attn as fa

    monkeypatch.setenv("PORTATTN_BACKEND", "triton")
    g = torch.Generator().manual_seed(8)
    q, k, v, dout = (_randn(1, 70, 2, 32, dtype=torch.bfloat16, gen=g) for _ in range(4))

    def grads(**kw):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        launches.clear()
        out = fa.flash_attn_func(*leaves, causal=True, **kw)
        return torch.autograd.grad(out, leaves, dout)

    first = grads(deterministic=True)
    assert launches.deterministic, launches.names
    again = grads(deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not portattn.config.deterministic()        # the scope ended with the call
    grads()
    assert launches.atomic, launches.names


@pytest.mark.parametrize("d, dv", [(200, 200), (24, 32), (64, 128)], ids=["d200", "d24-dv32", "d64-dv128"])
def test_a_head_dim_narrower_than_its_block_keeps_the_two_kernel_path(d, dv, atomic_row, launches):
    """Even under PORTATTN_TRITON_DQ=atomic: block 256 (D 200 gave wrong dQ and an illegal address
    on the H200, ops.atomic_config) and narrow head dims with Dv != D (not checked there) keep the
    deterministic backward; the call is still right."""
    g = torch.Generator().manual_seed(9)
    q = _randn(1, 70, 2, d, dtype=torch.bfloat16, gen=g)
    k = _randn(1, 80, 2, d, dtype=torch.bfloat16, gen=g)
    v = _randn(1, 80, 2, dv, dtype=torch.bfloat16, gen=g)
    launches.clear()
    _assert_ok(check_backend("triton", q, k, v, grad=True, causal=True))
    assert launches.deterministic, launches.names


@pytest.mark.parametrize("d, dv", [(40, 40), (24, 24), (96, 96)], ids=["d40", "d24", "d96"])
def test_narrow_head_dims_take_atomic_dq_in_the_checked_blocks(d, dv, atomic_row, launches):
    """D == Dv narrower than a block of ops.ATOMIC_NARROW_BLOCKS (32, 64, 128: passed on the H200)
    takes atomic dQ into the BLOCK_D-wide accumulator (no head-dim mask on the add) and matches
    the reference."""
    g = torch.Generator().manual_seed(10)
    q = _randn(1, 70, 2, d, dtype=torch.bfloat16, gen=g)
    k = _randn(1, 80, 2, d, dtype=torch.bfloat16, gen=g)
    v = _randn(1, 80, 2, dv, dtype=torch.bfloat16, gen=g)
    _check(q, k, v, {"causal": True}, launches)


@pytest.mark.parametrize("d, dv", [(24, 32), (64, 128)], ids=["d24-dv32", "d64-dv128"])
def test_narrow_head_dims_with_the_padded_accumulator(d, dv, atomic_row, launches, monkeypatch):
    """With ops.ATOMIC_NARROW_HEAD (the diagnosis tool's override), any narrower head dim takes atomic
    dQ into the BLOCK_D-wide accumulator (no head-dim mask on the add) and matches the reference."""
    monkeypatch.setattr(ops, "ATOMIC_NARROW_HEAD", True)
    g = torch.Generator().manual_seed(10)
    q = _randn(1, 70, 2, d, dtype=torch.bfloat16, gen=g)
    k = _randn(1, 80, 2, d, dtype=torch.bfloat16, gen=g)
    v = _randn(1, 80, 2, dv, dtype=torch.bfloat16, gen=g)
    _check(q, k, v, {"causal": True}, launches)
