"""The split dK/dV backward (``KernelConfig(split=True)``: a dV launch, then a dK launch of
``kernels.attn_bwd_dkdv`` with PART 1 and 2) against the float64 reference under
docs/semantics.md, and against the fused (PART 0) kernel: the split runs the same products in
the same order, so on the interpreter its gradients are bit-identical to the fused kernel's.

Interpreter-sized (tiles of 32, S <= 80); on a GPU the same tests run on the device.
"""

from __future__ import annotations

import pytest
import torch

import portattn
from portattn.testing import check_backend

pytest.importorskip("triton")

from portattn.backends.triton import ops  # noqa: E402
from portattn.backends.triton.configs import BackwardConfigs, KernelConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=DEVICE, dtype=dtype)


@pytest.fixture
def split_dkdv(monkeypatch):
    """Make every backward use its table's configs with the dK/dV one split (set ``.on = False``
    to get the fused kernel with the same tiles)."""
    orig = ops._backward_configs

    class State:
        on = True

    def patched(device, dtype, hd, hdv):
        base = orig(device, dtype, hd, hdv)
        d = base.dkdv
        dkdv = KernelConfig(d.block_m, d.block_n, d.num_warps, d.num_stages, d.waves_per_eu,
                            d.matrix_instr_nonkdim, d.kpack, split=State.on)
        return BackwardConfigs(dkdv, base.dq, base.prep)

    monkeypatch.setattr(ops, "_backward_configs", patched)
    return State


# (B, Sq, Sk, Hq, Hkv, D, dtype, kwargs): causal with ragged tiles, GQA, softcap, float32 (exact
# statistics in the dQ kernel), a float bias with its gradient, Dv != D
SPLIT_CASES = {
    "causal_bf16_ragged": (1, 70, 80, 2, 2, 40, 40, torch.bfloat16, {"causal": True}),
    "gqa2_fp16": (1, 33, 50, 4, 2, 24, 24, torch.float16, {}),
    "softcap_window_bf16": (1, 40, 40, 2, 1, 32, 32, torch.bfloat16, {"softcap": 5.0, "window": (7, 3)}),
    "fp32_causal": (1, 45, 45, 2, 2, 24, 24, torch.float32, {"causal": True}),
    "bias_grad_dv_ne_d": (1, 17, 40, 2, 2, 24, 40, torch.float16, {"bias": True}),
}


def _case(name):
    b, sq, sk, hq, hkv, d, dv, dtype, kw = SPLIT_CASES[name]
    g = torch.Generator().manual_seed(3)
    q = _randn(b, sq, hq, d, dtype=dtype, gen=g)
    k = _randn(b, sk, hkv, d, dtype=dtype, gen=g)
    v = _randn(b, sk, hkv, dv, dtype=dtype, gen=g)
    kw = dict(kw)
    if kw.pop("bias", False):
        kw["attn_bias"] = _randn(b, hq, sq, sk, dtype=dtype, gen=g)
    return q, k, v, kw


@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_split_dkdv_matches_reference(name, split_dkdv):
    q, k, v, kw = _case(name)
    results = check_backend("triton", q, k, v, grad=True, **kw)
    bad = [r for r in results if not r.passed]
    assert not bad, "\n".join(map(str, results))


def _grads(q, k, v, dout, kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = portattn.attention(*leaves, backend="triton", **kw)
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("name", ["causal_bf16_ragged", "gqa2_fp16"])
def test_split_dkdv_equals_fused_and_repeats(name, split_dkdv):
    q, k, v, kw = _case(name)
    dout = _randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, gen=torch.Generator().manual_seed(4))
    split = [_grads(q, k, v, dout, kw) for _ in range(2)]
    split_dkdv.on = False
    fused = _grads(q, k, v, dout, kw)
    for a, b in zip(split[0], split[1]):
        assert torch.equal(a, b), "the split backward is not bit-identical across runs"
    if DEVICE == "cpu":   # the same products in the same order (a GPU compile may fuse differently)
        for a, b, name_ in zip(split[0], fused, ("dq", "dk", "dv")):
            assert torch.equal(a, b), f"{name_}: split and fused kernels differ"


def test_split_is_part_of_the_config_identity():
    a = KernelConfig(32, 64, 8, 2)
    b = KernelConfig(32, 64, 8, 2, split=True)
    assert a != b and hash(a) != hash(b)
    assert b.short().endswith(" split") and not a.short().endswith("split")


def test_a_split_table_row_gives_a_split_config_for_16_bit_only(monkeypatch):
    from portattn.backends.triton import configs
    rows = {fam: dict(table) for fam, table in configs._BWD_NVIDIA.items()}
    rows["hopper"][256] = ((16, 128, 8, 2, True), (64, 16, 4, 2))
    monkeypatch.setattr(configs, "_BWD_NVIDIA", rows)
    configs.backward_configs.cache_clear()
    try:
        h200 = configs.Target("nvidia", 90)
        bf16 = configs.backward_configs(h200, 256, 2)
        assert bf16.dkdv == KernelConfig(16, 128, 8, 2, split=True) and not bf16.dq.split
        assert not configs.backward_configs(h200, 256, 4).dkdv.split      # float32: the fused kernel
        assert not configs.backward_configs(h200, 128, 2).dkdv.split      # other rows unchanged
    finally:
        configs.backward_configs.cache_clear()
