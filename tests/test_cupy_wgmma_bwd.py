"""The cupy backend's sm_90a wgmma backward (attn_bwd_wgmma.cu, issue 16).

CPU tests (no GPU): the PORTATTN_CUPY_BACKWARD=wgmma switch, which problems the wgmma backward
takes and the reason when it does not, kernel_families, the launch plan against the kernels'
signatures, the fused atomic dQ (PORTATTN_CUPY_DQ, configs.fused_dq_choice, the plan of the
fused-dQ dK/dV kernel), the fallback when the sm_90a module does not compile, the sm_90a compile (no spills,
no stack, the expected number of HGMMA per kernel in the SASS when a cuobjdump is at hand) and
the PTX check that no ordinary instruction touches a wgmma chain's registers between its
wgmma.fence and wait_group. The operand layouts are emulated in test_cupy_wgmma_bwd_layout.py.
GPU tests (sm_90 + cupy only; skipped elsewhere): dq / dk / dv against the float64 reference
under the equivalence rule (docs/semantics.md) on tests/test_cupy.py's cases the wgmma backward
covers, bit-identical repeats, rows with no visible key getting exactly zero gradient, agreement
with the mma.sync backward, the lse gradient, larger shapes and bad cu_seqlens.
"""

import dataclasses
import os
import re
import sys

import pytest
import torch
from _ptx_wgmma import wgmma_register_hazards
from portattn.backends.cupy import compile_check, configs

from portattn.spec import build_spec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cupy_wgmma import (  # noqa: E402
    _compile_90a_without_spills,
    _sass,
    _sm90a_ptx_entries,
    _wgmma_param_count,
    have_cupy,
    is_sm90,
    needs_nvrtc,
)

sm90_only = pytest.mark.skipif(not (is_sm90 and have_cupy), reason="needs an sm_90 GPU and cupy")


# ----- CPU: the switch and the choice ------------------------------------------------------------
def test_backward_mode_env(monkeypatch):
    monkeypatch.delenv(configs.BACKWARD_ENV, raising=False)
    assert configs.backward_mode() == "auto"
    monkeypatch.setenv(configs.BACKWARD_ENV, " WGMMA ")
    assert configs.backward_mode() == "wgmma"
    monkeypatch.setenv(configs.BACKWARD_ENV, "hgmma")
    with pytest.raises(ValueError, match="PORTATTN_CUPY_BACKWARD='hgmma'.*auto, mma128, fma, wgmma"):
        configs.backward_mode()


def _choose(mode, dt, d, dv, extras=False, cap=(9, 0), smem=None):
    return configs.backward_choice(dt, d, dv, extras=extras, capability=cap, smem_limit=smem, mode=mode)


@pytest.mark.parametrize("mode", ["auto", "mma128", "fma", "wgmma"])
def test_backward_choice(mode):
    fam = lambda *a, **kw: _choose(mode, *a, **kw)[0].family  # noqa: E731
    wg = "bwd_wgmma" if mode in ("wgmma", "auto") else ("bwd" if mode == "fma" else "bwd_mma")
    wg128 = wg   # auto: the wgmma backward at padded HD 64 and 128, where it is instantiated
    assert set(configs.WGMMA_BWD_AUTO_HEAD_DIMS) <= set(configs.WGMMA_BWD_HEAD_DIMS)
    assert fam("bfloat16", 128, 128) == wg128
    assert fam("float16", 64, 64) == wg
    assert fam("float16", 40, 40) == wg            # padded to 64
    assert fam("bfloat16", 100, 128) == wg128      # padded to 128
    assert fam("bfloat16", 64, 128) == wg128       # Dv != D: padded to max(D, Dv) = 128
    other = "bwd" if mode == "fma" else "bwd_mma"
    assert fam("bfloat16", 96, 96) == other        # no HD-96 instantiation
    assert fam("bfloat16", 32, 32) == other
    # HD 256: the split wgmma backward (one warpgroup dV, one dK) when forced; auto takes it only
    # where WGMMA_BWD_AUTO_HEAD_DIMS says the H200 timed it faster
    wg256 = "bwd_wgmma" if mode == "wgmma" or (mode == "auto" and 256 in configs.WGMMA_BWD_AUTO_HEAD_DIMS) else None
    assert fam("bfloat16", 256, 256) == (wg256 or ("bwd" if mode in ("fma", "mma128") else "bwd_mma"))
    assert fam("bfloat16", 256, 192) == fam("bfloat16", 256, 256)   # Dv != D, padded to 256
    assert fam("bfloat16", 128, 128, extras=True) == other
    for cap in ((8, 0), (8, 9), (10, 0), None):
        assert fam("bfloat16", 128, 128, cap=cap) == other
    assert fam("float32", 128, 128) == "bwd"
    # 131 KB: the mma.sync modules at HD 128 fit (<= 104 KB), the wgmma one (226 KB with the
    # warp-specialized kernel's two K/V buffers) does not; HD 64's wgmma module (130 KB) does
    assert fam("bfloat16", 128, 128, smem=131 * 1024) == ("bwd_mma" if mode != "fma" else "bwd")
    assert fam("bfloat16", 64, 64, smem=131 * 1024) == wg
    cfg, why = _choose(mode, "bfloat16", 128, 128)
    assert configs.BACKWARD_ENV in why and mode in why
    if mode == "auto":
        assert cfg == configs.KernelConfig("bwd_wgmma", "bfloat16", 128) and "sm_90a" in why
        assert _choose(mode, "float16", 64, 64)[0] == configs.KernelConfig("bwd_wgmma", "float16", 64)
    if mode == "wgmma":
        assert cfg == configs.KernelConfig("bwd_wgmma", "bfloat16", 128) and "sm_90a" in why
        assert "softcap" in _choose(mode, "bfloat16", 128, 128, extras=True)[1]
        assert "needs 9.0" in _choose(mode, "bfloat16", 128, 128, cap=(8, 0))[1]
        why224 = _choose(mode, "bfloat16", 224, 224)[1]
        assert "padded head dim 224" in why224 and "64, 128, 256" in why224
        assert "shared memory" in _choose(mode, "bfloat16", 128, 128, smem=120 * 1024)[1]
        # the plain config function never answers wgmma (backward_choice upgrades it)
        assert configs.backward_config("bfloat16", 128, 128, mode="wgmma").family == "bwd_mma"


def test_backward_choice_reads_the_env(monkeypatch):
    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    cfg, _ = configs.backward_choice("float16", 128, 128, extras=False, capability=(9, 0))
    assert cfg.family == "bwd_wgmma"
    monkeypatch.delenv(configs.BACKWARD_ENV)
    cfg, why = configs.backward_choice("float16", 128, 128, extras=False, capability=(9, 0))
    assert cfg.family == "bwd_wgmma" and "auto" in why
    cfg, why = configs.backward_choice("float16", 64, 64, extras=False, capability=(9, 0))
    assert cfg.family == "bwd_wgmma" and "auto" in why
    cfg, why = configs.backward_choice("float16", 256, 256, extras=False, capability=(9, 0))
    assert cfg.family == "bwd_wgmma" and "auto" in why
    cfg, why = configs.backward_choice("float16", 160, 160, extras=False, capability=(9, 0))
    assert cfg.family == "bwd_mma" and "auto" in why and "padded head dim 160" in why
    monkeypatch.setenv(configs.BACKWARD_ENV, "mma128")
    cfg, why = configs.backward_choice("float16", 128, 128, extras=False, capability=(9, 0))
    assert cfg.family == "bwd_mma" and "mma128" in why


def test_wgmma_backward_config_geometry():
    for hd in configs.WGMMA_BWD_HEAD_DIMS:
        for dt in configs.TENSOR_CORE_DTYPES:
            cfg = configs.KernelConfig("bwd_wgmma", dt, hd)
            assert cfg.arch == "sm_90a" and cfg.source_files == configs.WGMMA_SOURCE_FILES
            assert cfg in configs.wgmma_configs() and cfg not in configs.all_configs()
            two_cta = hd in configs.WGMMA_BWD_TWO_CTA_HEAD_DIMS
            (bm, nwk), (bn, nwq) = configs.wgmma_bwd_tile(hd, "dkdv", two_cta), configs.wgmma_bwd_tile(hd, "dq", two_cta)
            assert cfg.bwd_overlap == (configs.WGMMA_BWD_OVERLAP and hd in configs.WGMMA_BWD_OVERLAP_HEAD_DIMS
                                       and not two_cta)
            ov = "true" if cfg.bwd_overlap else "false"
            expect = {"preprocess": f"attn_bwd_preprocess<{cfg.ctype}>",
                      "dkdv": f"attn_bwd_dkdv_wgmma<{cfg.ctype}, {hd}, {bm}, {nwk}, {ov}, false>",
                      "dq": f"attn_bwd_dq_wgmma<{cfg.ctype}, {hd}, {bn}, {nwq}, {ov}>"}
            # the fused-dQ dK/dV (DQ = true): at HD 64 / 128 on the one-CTA tiles, the serial walk
            # whatever the module's
            fused = hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS and not two_cta
            assert cfg.has_fused_dq == fused
            if fused:
                expect["dkdv_dq"] = f"attn_bwd_dkdv_wgmma<{cfg.ctype}, {hd}, {bm}, {nwk}, false, true>"
                # the warp-specialized ones (attn_bwd_dkdv_wgmma_ws.cu)
                expect["dkdv_dq_ws"] = f"attn_bwd_dkdv_wgmma_ws<{cfg.ctype}, {hd}>"
            assert cfg.kernel_names() == expect
            if hd in configs.WGMMA_BWD_OVERLAP_HEAD_DIMS:
                # the other walk: the same launch geometry, a third Q/dO (dK/dV) or K (dQ) buffer when overlapped
                # (where auto takes the two-CTA tiles: the one-CTA tiles' other walk)
                other = configs.KernelConfig("bwd_wgmma", dt, hd, tile=(int(not configs.WGMMA_BWD_OVERLAP),)
                                             + ((0,) if two_cta else ()))
                assert other in configs.wgmma_configs()
                one = configs.KernelConfig("bwd_wgmma", dt, hd, tile=(int(configs.WGMMA_BWD_OVERLAP), 0))
                assert other.bwd_overlap != one.bwd_overlap
                lo, hi = (one, other) if other.bwd_overlap else (other, one)
                bm, bn = one.bwd_tile("dkdv")[0], one.bwd_tile("dq")[0]
                assert hi.smem_bytes("dkdv") - lo.smem_bytes("dkdv") == 2 * bm * hd * 2 + 8 * bm
                assert hi.smem_bytes("dq") - lo.smem_bytes("dq") == bn * hd * 2
                assert other.max_smem_bytes() <= configs.SMEM_LIMITS[90]
            keys = 64 if hd > 128 else 64 * nwk   # HD 256: both warpgroups on the same 64 keys
            assert configs.wgmma_bwd_keys(hd) == keys
            assert cfg.threads("dkdv") == 128 * nwk and cfg.block_rows("dkdv") == keys
            if fused:
                # the dK/dV's launch geometry; its shared memory: the serial dK/dV's (two Q / dO
                # buffers, whichever walk the module's dK/dV has) plus the dS^T tile [keys x 64]
                serial = configs.KernelConfig("bwd_wgmma", dt, hd, tile=(0, 0))
                assert not serial.bwd_overlap and serial.kernel_names()["dkdv_dq"] == expect["dkdv_dq"]
                assert cfg.threads("dkdv_dq") == cfg.threads("dkdv") and cfg.block_rows("dkdv_dq") == keys
                assert cfg.bwd_tile("dkdv_dq") == (bm, nwk) == (64, 2)
                assert cfg.smem_bytes("dkdv_dq") == serial.smem_bytes("dkdv") + keys * 64 * 2
                assert cfg.smem_bytes("dkdv_dq") <= cfg.max_smem_bytes() <= configs.SMEM_LIMITS[90]
                # warp-specialized: a producer warpgroup beside the two consumers, a second K/V
                # buffer, two dS^T tiles, eight 8-byte mbarriers and two int item slots; the same
                # keys per CTA
                for role in WS_ROLES:
                    assert cfg.threads(role) == 384 and cfg.block_rows(role) == keys
                    assert cfg.smem_bytes(role) == (serial.smem_bytes("dkdv") + 2 * keys * hd * 2
                                                    + 2 * keys * 64 * 2 + 8 * 8 + 8)
                    assert cfg.smem_bytes(role) <= cfg.max_smem_bytes()
            assert cfg.threads("dq") == 128 * nwq and cfg.block_rows("dq") == 64 * nwq
            assert cfg.threads("preprocess") == configs.PRE_THREADS and cfg.smem_bytes("preprocess") == 0
            assert cfg.max_smem_bytes() <= configs.SMEM_LIMITS[90]
    assert compile_check.smem_violations(archs=("90a",)) == []


def test_two_cta_backward_tiles():
    """The two-CTA tiles (WGMMA_BWD_TWO_CTA_CAPABLE): 32-row query tiles in dK/dV and 32-key tiles
    in dQ, the serial walk only, the same keys / rows per CTA as the one-CTA tiles, and the shared
    memory of two CTAs (plus the 1 KB each that the runtime reserves) within the SM's 228 KB;
    another head dim is refused by name."""
    for hd in configs.WGMMA_BWD_TWO_CTA_CAPABLE:
        for dt in configs.TENSOR_CORE_DTYPES:
            two = configs.KernelConfig("bwd_wgmma", dt, hd, tile=(1, 1))   # the walk asked for is not there
            one = configs.KernelConfig("bwd_wgmma", dt, hd, tile=(0, 0))
            assert two.bwd_two_cta and not two.bwd_overlap and not one.bwd_two_cta
            built = [c.kernel_names() for c in configs.wgmma_configs() if c.family == "bwd_wgmma"]
            assert two.kernel_names() in built and one.kernel_names() in built   # both compiled and checked
            assert two.kernel_names()["dkdv"] == f"attn_bwd_dkdv_wgmma<{two.ctype}, {hd}, 32, 2, false, false>"
            assert two.kernel_names()["dq"] == f"attn_bwd_dq_wgmma<{two.ctype}, {hd}, 32, 2, false>"
            # the fused-dQ dK/dV runs on the one-CTA tiles only (64-row query tiles)
            assert set(two.kernel_names()) == {"preprocess", "dkdv", "dq"} and not two.has_fused_dq
            assert ("dkdv_dq" in one.kernel_names()) == one.has_fused_dq == (hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS)
            with pytest.raises(ValueError, match="fused_dq=True"):
                _plan_on_cpu(two, fused_dq=True)
            for role in ("dkdv", "dq"):
                assert two.block_rows(role) == one.block_rows(role) and two.threads(role) == one.threads(role)
                assert 2 * (two.smem_bytes(role) + 1024) <= 228 * 1024, (role, two.smem_bytes(role))
            default = configs.KernelConfig("bwd_wgmma", dt, hd)
            assert default.bwd_two_cta == (hd in configs.WGMMA_BWD_TWO_CTA_HEAD_DIMS)
    with pytest.raises(ValueError, match="padded head dim 128"):
        configs.wgmma_bwd_tile(128, "dq", two_cta=True)
    assert not configs.KernelConfig("bwd_wgmma", "bfloat16", 128, tile=(0, 1)).bwd_two_cta


def test_kernel_families_name_the_wgmma_backward(monkeypatch):
    from portattn.backends.cupy import kernel_families

    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    spec = build_spec(q, q, q, causal=True)
    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    assert kernel_families(spec, capability=(9, 0))["backward"].startswith("bwd_wgmma (Hopper")
    fam = kernel_families(spec, capability=(8, 0))["backward"]
    assert fam.startswith("bwd_mma") and "needs 9.0" in fam
    fam = kernel_families(build_spec(q, q, q, softcap=5.0), capability=(9, 0))["backward"]
    assert fam.startswith("bwd_mma") and "softcap" in fam
    monkeypatch.delenv(configs.BACKWARD_ENV)   # auto: the wgmma backward at padded HD 64, 128 and 256
    assert kernel_families(spec, capability=(9, 0))["backward"].startswith("bwd_wgmma (Hopper")
    q64 = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    assert kernel_families(build_spec(q64, q64, q64), capability=(9, 0))["backward"].startswith("bwd_wgmma")
    q256 = torch.randn(1, 8, 2, 256, dtype=torch.bfloat16, requires_grad=True)
    assert kernel_families(build_spec(q256, q256, q256), capability=(9, 0))["backward"].startswith("bwd_wgmma")
    q96 = torch.randn(1, 8, 2, 96, dtype=torch.bfloat16, requires_grad=True)   # no HD-96 wgmma backward
    assert kernel_families(build_spec(q96, q96, q96), capability=(9, 0))["backward"].startswith("bwd_mma")


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (4, 2)}])
def test_wgmma_backward_plan_matches_signature(kw):
    """plan_backward with the wgmma config (CPU tensors: nothing launches) passes each kernel its
    argument list (the mma.sync kernels'), one dK/dV CTA per 128 keys and kv head, one dQ CTA per
    128 rows and query head; softcap is refused with a reason."""
    from portattn.backends.cupy import runtime

    q = torch.randn(2, 300, 4, 40, dtype=torch.bfloat16)
    k = torch.randn(2, 150, 2, 40, dtype=torch.bfloat16)
    v = torch.randn(2, 150, 2, 24, dtype=torch.bfloat16)
    spec = build_spec(q, k, v, **kw)
    cfg = configs.wgmma_backward_config("bfloat16", 40, 24)
    assert cfg.family == "bwd_wgmma" and cfg.head_dim == 64
    out = torch.randn(2, 300, 4, 24, dtype=torch.bfloat16)
    lse = torch.randn(spec.lse_shape)
    # the dK/dV and dQ kernels (not the fused dQ, which test_fused_dq_plan checks)
    plan = runtime.plan_backward(spec, out, lse, out.clone(), cfg, fused_dq=False)
    pre, dkdv, dq = plan.launches
    assert (pre.role, dkdv.role, dq.role) == ("preprocess", "dkdv", "dq")
    assert len(dkdv.args) == _wgmma_param_count("attn_bwd_dkdv_wgmma")
    assert len(dq.args) == _wgmma_param_count("attn_bwd_dq_wgmma")
    assert dkdv.grid == (2, 2, 2) and dq.grid == (3, 4, 2)
    assert [t.shape for t in plan.outputs] == [q.shape, k.shape, v.shape]
    # the wgmma dK/dV takes the mma.sync one's arguments and the fused dQ's buffer and its three
    # strides (null and 0 here); the dQ kernels take the same arguments
    mma = runtime.plan_backward(spec, out, lse, out.clone(), configs.KernelConfig("bwd_mma", "bfloat16", 64))
    assert [x.role for x in mma.launches] == ["preprocess", "dkdv", "dq"]
    assert len(dkdv.args) == len(mma.launches[1].args) + 4 and len(dq.args) == len(mma.launches[2].args)
    assert [int(a) for a in dkdv.args[-4:]] == [0, 0, 0, 0] and not plan.setup and not plan.finish
    # the default: the fused dQ where configs.fused_dq_choice takes it
    fused = configs.fused_dq_choice(cfg, spec.deterministic)[0]
    default = runtime.plan_backward(spec, out, lse, out.clone(), cfg)
    assert [x.role for x in default.launches] == (["preprocess", configs.fused_dq_role()] if fused
                                                  else ["preprocess", "dkdv", "dq"])
    with pytest.raises(ValueError, match="softcap"):
        runtime.plan_backward(build_spec(q, k, v, softcap=2.0), out, lse, out.clone(), cfg)


def _plan_on_cpu(cfg, fused_dq=None, deterministic=False, d=None, dv=None, **kw):
    """runtime.plan_backward on CPU tensors (nothing launches) of a GQA problem in ``cfg``'s dtype,
    head dims ``d`` / ``dv`` (default: cfg.head_dim), Sq 300 and Sk 150 (two 128-key dK/dV
    CTAs); ``deterministic``: the spec built inside config.deterministic_scope()."""
    from portattn.backends.cupy import runtime

    from portattn import config

    dtype = {v: k for k, v in runtime._DTYPE_NAMES.items()}[cfg.dtype]
    d = cfg.head_dim if d is None else d
    dv = d if dv is None else dv
    q = torch.randn(2, 300, 4, d, dtype=dtype)
    k = torch.randn(2, 150, 2, d, dtype=dtype)
    v = torch.randn(2, 150, 2, dv, dtype=dtype)
    if deterministic:
        with config.deterministic_scope():
            spec = build_spec(q, k, v, **kw)
    else:
        spec = build_spec(q, k, v, **kw)
    assert spec.deterministic == deterministic
    out = torch.randn(spec.out_shape, dtype=dtype)
    return spec, runtime.plan_backward(spec, out, torch.randn(spec.lse_shape), out.clone(), cfg, fused_dq=fused_dq)


def test_fused_dq_mode_env(monkeypatch):
    monkeypatch.delenv(configs.DQ_ENV, raising=False)
    assert configs.DQ_ENV == "PORTATTN_CUPY_DQ" and configs.DQ_MODES == ("auto", "atomic", "kernel", "ws")
    assert configs.dq_mode() == "auto"
    monkeypatch.setenv(configs.DQ_ENV, "")
    assert configs.dq_mode() == "auto"
    monkeypatch.setenv(configs.DQ_ENV, " ATOMIC ")
    assert configs.dq_mode() == "atomic"
    cfg = configs.KernelConfig("bwd_wgmma", "bfloat16", 64)
    assert configs.fused_dq_choice(cfg, False)[0]                 # read at call time
    monkeypatch.setenv(configs.DQ_ENV, "kernel")
    assert not configs.fused_dq_choice(cfg, False)[0]
    monkeypatch.setenv(configs.DQ_ENV, "atomics")
    with pytest.raises(ValueError, match="PORTATTN_CUPY_DQ='atomics'.*auto, atomic, kernel"):
        configs.dq_mode()
    with pytest.raises(ValueError, match="PORTATTN_CUPY_DQ"):
        configs.fused_dq_choice(cfg, False)
    assert configs.fused_dq_choice(cfg, False, mode="atomic")[0]  # an explicit mode: the env is not read


@pytest.mark.parametrize("dt", configs.TENSOR_CORE_DTYPES)
def test_fused_dq_choice(dt, monkeypatch):
    """The fused atomic dQ runs only where the module has it (wgmma, padded HD 64 / 128, one-CTA
    tiles, either walk's module), never when determinism is requested, never with
    PORTATTN_CUPY_DQ=kernel, always (where it exists) with atomic, and with auto at
    WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS only (monkeypatched here both ways)."""
    assert set(configs.WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS) <= set(configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS) == {64, 128}
    choice = configs.fused_dq_choice
    with_fused = [configs.KernelConfig("bwd_wgmma", dt, hd, tile=t)
                  for hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS for t in (None, (0, 0), (1, 0))]
    without = [configs.KernelConfig("bwd_wgmma", dt, 256), configs.KernelConfig("bwd_wgmma", dt, 64, tile=(0, 1)),
               configs.KernelConfig("bwd_mma", dt, 64), configs.KernelConfig("bwd_mma", dt, 128),
               configs.KernelConfig("bwd", dt, 64)]
    for cfg in with_fused:
        assert cfg.has_fused_dq and "dkdv_dq" in cfg.kernel_names(), cfg
        for mode in configs.DQ_MODES:
            fused, why = choice(cfg, True, mode)
            assert not fused and "determinism" in why, (cfg, mode)
        fused, why = choice(cfg, False, "kernel")
        assert not fused and "PORTATTN_CUPY_DQ=kernel" in why
        fused, why = choice(cfg, False, "atomic")
        assert fused and "atomic" in why and "PORTATTN_CUPY_DQ" in why
        monkeypatch.setattr(configs, "WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS", ())
        fused, why = choice(cfg, False, "auto")
        assert not fused and f"padded head dim {cfg.head_dim}" in why and "auto" in why
        monkeypatch.setattr(configs, "WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS", (128,))
        assert choice(cfg, False, "auto")[0] == (cfg.head_dim == 128)
        assert not choice(cfg, True, "auto")[0]
        monkeypatch.setattr(configs, "WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS", (64, 128))
        assert choice(cfg, False, "auto")[0] and not choice(cfg, True, "auto")[0]
        monkeypatch.undo()
    for cfg in without:
        assert not cfg.has_fused_dq and "dkdv_dq" not in cfg.kernel_names(), cfg
        monkeypatch.setattr(configs, "WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS", (64, 128, 256))
        for mode in configs.DQ_MODES:
            for det in (False, True):
                fused, why = choice(cfg, det, mode)
                assert not fused and "no fused dQ" in why, (cfg, mode, det)
        monkeypatch.undo()


@pytest.mark.parametrize("hd", configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS)
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (40, 8)}])
def test_fused_dq_plan(hd, kw):
    """plan_backward(..., fused_dq="dkdv_dq") with the wgmma module (CPU tensors: nothing launches):
    the preprocess and the fused-dQ dK/dV only (no dQ kernel), the dK/dV's grid and arguments (the
    kernel's signature, the float32 dQ buffer and its strides last), setup zeroing that buffer and
    finish writing dq = scale * it into the caller's dq; the same module without it passes a null
    buffer and plans no setup / finish."""
    d, dv = hd - 24, hd - 40   # padded to hd; dq, dk and dv at their 8-aligned widths
    cfg = configs.KernelConfig("bwd_wgmma", "bfloat16", hd)
    assert configs.wgmma_backward_config("bfloat16", d, dv) == cfg
    spec, plan = _plan_on_cpu(cfg, fused_dq="dkdv_dq", d=d, dv=dv, **kw)
    assert [x.role for x in plan.launches] == ["preprocess", "dkdv_dq"]
    pre, dkdv = plan.launches
    assert dkdv.cfg == cfg and cfg.kernel_names()[dkdv.role] == f"attn_bwd_dkdv_wgmma<pa_bf16, {hd}, 64, 2, false, true>"
    assert len(dkdv.args) == _wgmma_param_count("attn_bwd_dkdv_wgmma")
    assert dkdv.grid == (-(-150 // cfg.block_rows("dkdv_dq")), 2, 2) == (2, 2, 2)
    assert [t.shape for t in plan.outputs] == [spec.q.shape, spec.k.shape, spec.v.shape]
    dq_acc, dq_buf, dk_buf, dv_buf = plan.keep_alive[-4:]
    assert dq_acc.dtype == torch.float32 and dq_acc.shape == dq_buf.shape and dq_acc.is_contiguous()
    assert plan.outputs[0].data_ptr() == dq_buf.data_ptr()
    assert [int(a) for a in dkdv.args[-4:]] == [dq_acc.data_ptr(), *dq_acc.stride()[:3]]
    assert int(dkdv.args[-8]) == dv_buf.data_ptr() and int(dkdv.args[-12]) == dk_buf.data_ptr()
    assert len(plan.setup) == 1 and len(plan.finish) == 1
    # the steps (torch, so they run on CPU): setup zeroes the buffer, finish scales it into dq
    dq_acc.fill_(float("nan"))
    for step in plan.setup:
        step()
    assert bool((dq_acc == 0).all())
    acc = torch.randn(dq_acc.shape)
    dq_acc.copy_(acc)
    for step in plan.finish:
        step()
    torch.testing.assert_close(plan.outputs[0], (acc * spec.scale).to(torch.bfloat16)[..., :d], rtol=0, atol=0)
    # the same module, the dK/dV kernel and the dQ kernel: a null buffer, no steps
    _, two = _plan_on_cpu(cfg, fused_dq=False, d=d, dv=dv, **kw)
    assert [x.role for x in two.launches] == ["preprocess", "dkdv", "dq"] and not two.setup and not two.finish
    assert len(two.launches[1].args) == len(dkdv.args) and [int(a) for a in two.launches[1].args[-4:]] == [0] * 4
    assert two.keep_alive[-4] is None


def test_fused_dq_plan_default_follows_the_choice(monkeypatch):
    """fused_dq=None: configs.fused_dq_choice for the spec's determinism and PORTATTN_CUPY_DQ; a
    spec that requests determinism never fuses; fused_dq=True where the module lacks the kernel
    (HD 256, the two-CTA tiles, mma.sync) is refused by name."""
    cfg = configs.KernelConfig("bwd_wgmma", "float16", 128)
    roles = lambda plan: [x.role for x in plan.launches]  # noqa: E731
    monkeypatch.delenv(configs.DQ_ENV, raising=False)
    monkeypatch.setattr(configs, "WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS", ())
    assert roles(_plan_on_cpu(cfg)[1]) == ["preprocess", "dkdv", "dq"]            # auto, fusing nowhere
    monkeypatch.setattr(configs, "WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS", (128,))
    assert roles(_plan_on_cpu(cfg)[1]) == ["preprocess", configs.WGMMA_BWD_FUSED_DQ_AUTO_ROLE]
    assert roles(_plan_on_cpu(cfg, deterministic=True)[1]) == ["preprocess", "dkdv", "dq"]
    monkeypatch.setenv(configs.DQ_ENV, "atomic")
    assert roles(_plan_on_cpu(cfg)[1]) == ["preprocess", "dkdv_dq"]
    assert roles(_plan_on_cpu(cfg, causal=True)[1]) == ["preprocess", "dkdv_dq"]
    assert roles(_plan_on_cpu(cfg, deterministic=True)[1]) == ["preprocess", "dkdv", "dq"]
    assert roles(_plan_on_cpu(cfg, deterministic=True, causal=True)[1]) == ["preprocess", "dkdv", "dq"]
    assert roles(_plan_on_cpu(cfg, fused_dq=False)[1]) == ["preprocess", "dkdv", "dq"]   # explicit
    monkeypatch.setenv(configs.DQ_ENV, "kernel")
    assert roles(_plan_on_cpu(cfg)[1]) == ["preprocess", "dkdv", "dq"]
    assert roles(_plan_on_cpu(cfg, fused_dq=True)[1]) == ["preprocess", "dkdv_dq"]     # explicit
    monkeypatch.setenv(configs.DQ_ENV, "bogus")
    with pytest.raises(ValueError, match="PORTATTN_CUPY_DQ"):
        _plan_on_cpu(cfg)
    monkeypatch.setenv(configs.DQ_ENV, "atomic")
    for other in (configs.KernelConfig("bwd_wgmma", "float16", 256), configs.KernelConfig("bwd_wgmma", "float16", 64, tile=(0, 1)),
                  configs.KernelConfig("bwd_mma", "float16", 128)):
        with pytest.raises(ValueError, match="fused_dq=True"):
            _plan_on_cpu(other, fused_dq=True)
        assert "dq" in roles(_plan_on_cpu(other)[1])   # the default: its dQ kernel


def test_runtime_falls_back_when_sm90a_does_not_compile(monkeypatch):
    from portattn.backends.cupy import runtime, sm90a

    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    spec = build_spec(q, q, q)
    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    monkeypatch.setattr(runtime, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(sm90a, "unavailable_reason", lambda *a, **kw: "the sm_90a module does not compile here (X)")
    cfg, why = runtime.backward_choice(spec)
    assert cfg.family == "bwd_mma" and "does not compile" in why and configs.BACKWARD_ENV in why
    monkeypatch.setattr(sm90a, "unavailable_reason", lambda *a, **kw: None)
    assert runtime.backward_choice(spec)[0].family == "bwd_wgmma"
    monkeypatch.setattr(runtime, "_capability", lambda device: (8, 0))
    assert runtime.backward_choice(spec)[0].family == "bwd_mma"


# ----- CPU: the sm_90a compile -------------------------------------------------------------------
#: the warp-specialized fused-dQ dK/dV roles (attn_bwd_wgmma_ws.cu), checked by their own tests
WS_ROLES = configs.WS_FUSED_DQ_ROLES


def _bwd_wgmma_names() -> list:
    """The sm_90a backward's kernels (not the preprocess, not the warp-specialized ones), each
    once: the fused-dQ dK/dV is the same kernel in the modules of either walk."""
    return list(dict.fromkeys(n for c in configs.wgmma_configs() if c.family == "bwd_wgmma"
                              for r, n in c.kernel_names().items() if r != "preprocess" and r not in WS_ROLES))


def _ws_names() -> list:
    """The warp-specialized fused-dQ dK/dV kernels, each once."""
    return list(dict.fromkeys(c.kernel_names()[r] for c in configs.wgmma_configs() if c.family == "bwd_wgmma"
                              and c.has_fused_dq for r in WS_ROLES))


def _fused_dq_names() -> set:
    """The fused-dQ dK/dV kernels (role dkdv_dq) of the sm_90a modules."""
    return {c.kernel_names()["dkdv_dq"] for c in configs.wgmma_configs() if c.family == "bwd_wgmma" and c.has_fused_dq}


def _expected_hgmma(name: str) -> int:
    """wgmma instructions per tile in the source: dK/dV: S^T and dP^T (HD / 16 each), dV and dK
    (BM / 16 each), and with the fused dQ (DQ = true) dQ += dS K over the CTA's keys (keys / 16);
    dQ: S and dP (HD / 16 each), dQ (BN / 16)."""
    m = re.fullmatch(r"attn_bwd_(dkdv|dq)_wgmma<\w+, (\d+), (\d+), \d+, (true|false)(?:, (true|false))?>", name)
    assert m and (m.group(5) is not None) == (m.group(1) == "dkdv"), name
    hd, tile, dq = int(m.group(2)), int(m.group(3)), m.group(5) == "true"
    return 2 * hd // 16 + (2 if m.group(1) == "dkdv" else 1) * tile // 16 + (configs.wgmma_bwd_keys(hd) // 16 if dq else 0)


@needs_nvrtc
@pytest.mark.sm90a_compile
def test_wgmma_backward_compiles_without_spills_and_uses_hgmma(tmp_path):
    names = _bwd_wgmma_names()
    fused = _fused_dq_names()
    # 2 dtypes x (dK/dV, dQ) x (HD 64 and 128 with both walks, HD 256 serial, HD 64's other tiles),
    # and 2 dtypes x the fused-dQ dK/dV at HD 64 and 128
    assert len(fused) == 2 * len(configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS) == 4 and fused <= set(names)
    assert len(names) == 2 * 2 * (2 * len(configs.WGMMA_BWD_OVERLAP_HEAD_DIMS) + 1
                                  + len(configs.WGMMA_BWD_TWO_CTA_CAPABLE)) + len(fused) == 24 + 4
    cubin = str(tmp_path / "bwd.cubin")
    # the opt-in overlapped dK/dV walk at HD 128 (not what auto builds): NVRTC 13.0's ptxas (the
    # H200 image's, 2026-12-04) spills 4 bytes there at 255 registers, 13.5's fits it in 246;
    # every kernel auto builds is held to no spills under both
    from portattn.backends.cupy import sm90a

    old_nvrtc = tuple(sm90a.nvrtc_binding().version()) < (13, 5)
    opt_in = {c.kernel_names()["dkdv"] for c in configs.wgmma_configs() if c.family == "bwd_wgmma" and c.bwd_overlap
              and c != configs.KernelConfig("bwd_wgmma", c.dtype, c.head_dim)}
    # the fused-dQ dK/dV at the head dims of WGMMA_BWD_FUSED_DQ_SPILL_BYTES (HD 128: 255 registers
    # and 4 bytes of spill, stack 8, under NVRTC 13.0 and 13.5) may spill that much (at most the
    # 8 bytes _compile_90a_without_spills allows), under any NVRTC; HD 64's is held to none
    assert set(configs.WGMMA_BWD_FUSED_DQ_SPILL_BYTES) <= set(configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS)
    assert all(0 < b <= 8 for b in configs.WGMMA_BWD_FUSED_DQ_SPILL_BYTES.values())
    fused_spill = {c.kernel_names()["dkdv_dq"]: configs.WGMMA_BWD_FUSED_DQ_SPILL_BYTES[c.head_dim]
                   for c in configs.wgmma_configs() if c.family == "bwd_wgmma" and c.has_fused_dq
                   and c.head_dim in configs.WGMMA_BWD_FUSED_DQ_SPILL_BYTES}
    assert set(fused_spill) <= fused
    # the split dK/dV (HD > 128, 64-row tiles): 4 bytes under NVRTC 13.0 (WGMMA_BWD_SPLIT_SPILL_BYTES)
    split = configs.wgmma_bwd_split_names()
    spill_ok = lambda n: (old_nvrtc and n in opt_in | split) or n in fused_spill  # noqa: E731
    _, lowered, reports = _compile_90a_without_spills(names, cubin, spill_ok=spill_ok)
    for r in reports:   # the fused dK/dV's own allowance and the split dK/dV's (the helper allows 8)
        worst = max(r.spill_stores or 0, r.spill_loads or 0, r.stack or 0)
        assert r.name not in fused_spill or worst <= fused_spill[r.name], r
        assert r.name not in split or worst <= configs.WGMMA_BWD_SPLIT_SPILL_BYTES, r
    two_cta = {n for c in configs.wgmma_configs() if c.family == "bwd_wgmma" and c.bwd_two_cta
               for r, n in c.kernel_names().items() if r != "preprocess"}
    assert len(two_cta) == 4 * len(configs.WGMMA_BWD_TWO_CTA_CAPABLE) and not two_cta & fused
    for r in reports:   # __launch_bounds__(256, 2)
        assert r.name not in two_cta or r.registers <= 128, f"{r.name}: {r.registers} registers"
    sass = _sass(cubin)
    for name, low in lowered.items():
        block = sass.split(f"Function : {low}")[1].split("Function : ")[0]
        assert block.count("HGMMA.") == _expected_hgmma(name), f"{name}: HGMMA count"
        assert "HMMA." not in block, name
        if not spill_ok(name):   # local memory: the spill ptxas reported (at most 8 bytes, checked above)
            assert " LDL" not in block and " STL" not in block, name


def test_chain_register_hazard_check():
    """The per-chain check flags an access to an outstanding chain's registers (after its fence,
    before the wait that completes it, also behind a second chain and across a wait_group 1 that
    leaves it running) and accepts writes to a chain's registers before its own fence and reads of
    a chain that a wait_group 1 completed."""
    mma = "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%f1, %f2}, %rd1, %rd2, p, 1, 1, 0, 0;\n"
    mma2 = mma.replace("%f1, %f2", "%f3, %f4")
    fence, commit = "wgmma.fence.sync.aligned;\n", "wgmma.commit_group.sync.aligned;\n"
    wait0, wait1 = "wgmma.wait_group.sync.aligned 0;\n", "wgmma.wait_group.sync.aligned 1;\n"
    ok = (fence + mma + commit + "mov.f32 %f3, %f9;\n" + fence + mma2 + commit + wait1 +
          "add.f32 %f1, %f1, %f1;\n" + wait0 + "add.f32 %f1, %f1, %f3;\n")
    assert wgmma_register_hazards(ok) == []
    assert len(wgmma_register_hazards(ok.replace("mov.f32 %f3, %f9;", "mov.f32 %f2, %f9;"))) == 1
    early = ok.replace("add.f32 %f1, %f1, %f1;", "add.f32 %f1, %f1, %f4;")   # %f4: chain 2, still running
    assert len(wgmma_register_hazards(early)) == 1
    late = ok.replace(wait1, "add.f32 %f5, %f4, %f4;\n" + wait1)
    assert len(wgmma_register_hazards(late)) == 1
    with pytest.raises(AssertionError, match="never waited"):
        wgmma_register_hazards(fence + mma + commit)


def test_sm90a_ptx_keeps_backward_wgmma_registers_behind_the_fences():
    """In the PTX of every wgmma backward kernel, no ordinary instruction touches a wgmma
    accumulator or A-fragment register between a chain's wgmma.fence and its wait_group
    (tests/_ptx_wgmma.py, shown above to flag a late write or an early read)."""
    names = _bwd_wgmma_names()
    fused = _fused_dq_names()
    entries = _sm90a_ptx_entries(names)
    assert set(entries) == set(names) and fused <= set(names)
    for name, body in entries.items():
        dq = name in fused
        assert dq == name.endswith(", false, true>"), name   # DQ = true, the serial walk
        # dK/dV: S^T and dP^T, then dV and dK (two chains each), and with the fused dQ a third
        # chain, dQ += dS K (after a wait_group 1 that retires dV); dQ: S and dP, then dQ
        assert body.count("wgmma.fence") == (5 if dq else 4 if "dkdv" in name else 3), name
        # each wait_group 1 leaves the newest group running; the last wait of a tile is wait_group 0
        # (HD 256 dK/dV: only warpgroup 1's wait for S^T behind dP^T; its dP^T, and warpgroup 0's
        # S^T, are each the only group in flight)
        split = "dkdv" in name and ", 256," in name
        assert body.count("wgmma.wait_group.sync.aligned 1") == (1 if split or "dq_" in name else 3 if dq else 2), name
        assert wgmma_register_hazards(body) == [], name
        # the fused dQ's products read both operands MN-major (trans-a = trans-b = 1), keys / 16 of
        # them, and its partials go out as float2 atomic adds (2 rows x HD / 2 / 8 column pairs per
        # thread); no other kernel has either
        hd = int(re.search(r"<\w+, (\d+),", name).group(1))
        mn_mn = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(?:f16\.f16|bf16\.bf16) [^;]*, p, 1, 1, 1, 1;",
                           body)
        assert mn_mn == ([str(hd // 2)] * (configs.wgmma_bwd_keys(hd) // 16) if dq else []), name
        assert body.count("atom.global.add.v2.f32") + body.count("red.global.add.v2.f32") == (hd // 8 if dq else 0), name


# ----- CPU: the warp-specialized fused-dQ dK/dV (attn_bwd_wgmma_ws.cu) --------------------------
def test_ws_fused_dq_modes_and_roles(monkeypatch):
    """PORTATTN_CUPY_DQ=ws fuses dQ (not when determinism is requested) by the warp-specialized
    role, as auto does; atomic by the two-warpgroup one; a role the module lacks is an error, and
    so is the removed ws_local mode."""
    cfg = configs.KernelConfig("bwd_wgmma", "bfloat16", 128)
    assert configs.FUSED_DQ_ROLES == {"dkdv_dq": "atomic", "dkdv_dq_ws": "ws"}
    assert configs.WS_FUSED_DQ_ROLES == ("dkdv_dq_ws",)
    assert configs.WGMMA_BWD_FUSED_DQ_AUTO_ROLE == "dkdv_dq_ws"   # timed on the H200 (configs says)
    for mode, role in (("auto", "dkdv_dq_ws"), ("atomic", "dkdv_dq"), ("ws", "dkdv_dq_ws")):
        assert configs.fused_dq_role(mode) == role
        monkeypatch.setenv(configs.DQ_ENV, mode)
        assert configs.fused_dq_role() == role
        fused, why = configs.fused_dq_choice(cfg, False)
        assert fused and (("warp-specialized" in why) == role.startswith("dkdv_dq_ws")), why
        assert not configs.fused_dq_choice(cfg, True)[0]
        spec, plan = _plan_on_cpu(cfg)
        assert [x.role for x in plan.launches] == ["preprocess", role]
        spec, plan = _plan_on_cpu(cfg, deterministic=True)
        assert [x.role for x in plan.launches] == ["preprocess", "dkdv", "dq"]
    monkeypatch.setenv(configs.DQ_ENV, "ws_local")
    with pytest.raises(ValueError, match="PORTATTN_CUPY_DQ='ws_local'"):
        configs.fused_dq_choice(cfg, False)
    monkeypatch.delenv(configs.DQ_ENV)
    for gone in ("dkdv_dq_wx", "dkdv_dq_wsl"):
        with pytest.raises(ValueError, match=f"fused_dq='{gone}'"):
            _plan_on_cpu(cfg, fused_dq=gone)
    with pytest.raises(ValueError, match="no fused-dQ kernel"):
        _plan_on_cpu(configs.KernelConfig("bwd_wgmma", "bfloat16", 256), fused_dq="dkdv_dq_ws")


@pytest.mark.parametrize("role", WS_ROLES)
def test_ws_fused_dq_plan(monkeypatch, role):
    """fused_dq=<role>: the preprocess and that kernel, 384 threads, the fused kernel's arguments
    plus (kv heads, batch, the work-item counter), a 1-d grid: one CTA per work item (the fused
    kernel's grid, flattened) or, persistent, min(items, SMs); setup zeroes the counter and the
    dQ buffer, finish writes dq."""
    from portattn.backends.cupy import runtime

    cfg = configs.KernelConfig("bwd_wgmma", "float16", 64)
    _, fused = _plan_on_cpu(cfg, fused_dq="dkdv_dq", causal=True)
    ref = fused.launches[1]
    items = ref.grid[0] * ref.grid[1] * ref.grid[2]
    assert ref.grid == (2, 2, 2)
    auto = 5 if configs.WS_PERSISTENT_AUTO else items
    for persistent, sms, ctas in ((False, 3, items), (True, 3, 3), (True, 132, items), (None, 5, auto)):
        monkeypatch.setattr(runtime, "_sm_count", lambda device, n=sms: n)
        spec = _plan_on_cpu(cfg, causal=True)[0]
        plan = runtime.plan_backward(spec, torch.randn(spec.out_shape, dtype=torch.float16), torch.randn(spec.lse_shape),
                                     torch.randn(spec.out_shape, dtype=torch.float16), cfg, fused_dq=role,
                                     persistent=persistent)
        assert [x.role for x in plan.launches] == ["preprocess", role]
        ws = plan.launches[1]
        assert cfg.kernel_names()[role] == "attn_bwd_dkdv_wgmma_ws<pa_half, 64>"
        assert len(ws.args) == len(ref.args) + 3 == _wgmma_param_count("attn_bwd_dkdv_wgmma_ws")
        counter = plan.keep_alive[-1]
        assert [int(a) for a in ws.args[-3:]] == [spec.num_heads_kv, spec.batch, counter.data_ptr()]
        assert counter.dtype == torch.int32 and counter.numel() == 1
        assert ws.grid == (ctas, 1, 1), (persistent, sms)
        assert cfg.threads(role) == 384 and cfg.smem_bytes(role) > cfg.smem_bytes("dkdv_dq")
        assert len(plan.setup) == 2 and len(plan.finish) == 1
        counter.fill_(7)
        for step in plan.setup:
            step()
        assert int(counter) == 0
    monkeypatch.setenv(configs.WS_PERSISTENT_ENV, "sometimes")
    with pytest.raises(ValueError, match="PORTATTN_CUPY_BWD_PERSISTENT"):
        _plan_on_cpu(cfg, fused_dq=role)


def test_ws_persistent_switch(monkeypatch):
    monkeypatch.delenv(configs.WS_PERSISTENT_ENV, raising=False)
    assert configs.ws_persistent() == configs.WS_PERSISTENT_AUTO
    for mode, want in (("1", True), ("0", False), ("auto", configs.WS_PERSISTENT_AUTO)):
        monkeypatch.setenv(configs.WS_PERSISTENT_ENV, mode)
        assert configs.ws_persistent() == want and configs.ws_persistent(mode) == want
    with pytest.raises(ValueError, match="persistent mode"):
        configs.ws_persistent("yes")


def test_work_item_grid_bounds(monkeypatch):
    """The work-item grid: at most one CTA per item, at least one CTA; an int CTA count must be
    positive; more items than the kernel's int32 counter holds is refused by name."""
    from portattn.backends.cupy import runtime

    cpu = torch.device("cpu")
    monkeypatch.setattr(runtime, "_sm_count", lambda device: 132)
    assert runtime._work_item_grid((3, 2, 2), cpu, True)[0] == (12, 1, 1)
    assert runtime._work_item_grid((30, 8, 4), cpu, True)[0] == (132, 1, 1)
    assert runtime._work_item_grid((30, 8, 4), cpu, False)[0] == (960, 1, 1)
    assert runtime._work_item_grid((30, 8, 4), cpu, 7)[0] == (7, 1, 1)
    assert runtime._work_item_grid((0, 8, 4), cpu, True)[0] == (1, 1, 1)
    grid, counter = runtime._work_item_grid((5, 1, 1), cpu, 100)
    assert grid == (5, 1, 1) and counter.dtype == torch.int32 and counter.shape == (1,)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="positive CTA count"):
            runtime._work_item_grid((5, 1, 1), cpu, bad)
    with pytest.raises(ValueError, match="int32 counter"):
        runtime._work_item_grid((2**20, 2**11, 1), cpu, True)


def test_ws_shared_memory_fits_one_cta_per_sm():
    """Two K/V buffers, the Q / dO ring, two dS^T buffers, 8 mbarriers and the item slots fit the
    227 KB a CTA may have on sm_90 at both head dims."""
    for hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS:
        cfg = configs.KernelConfig("bwd_wgmma", "bfloat16", hd)
        for role in WS_ROLES:
            assert cfg.smem_bytes(role) <= 227 * 1024, (hd, cfg.smem_bytes(role))
    assert configs.KernelConfig("bwd_wgmma", "bfloat16", 128).smem_bytes("dkdv_dq_ws") == 231496


def _ws_source() -> str:
    src = configs.source(configs.WGMMA_SOURCE_FILES)
    return src[src.index("attn_bwd_dkdv_wgmma_ws(PA_COMMON_PARAMS"):]


def test_ws_kernel_protocol_in_the_source():
    """The producer / consumer protocol as written: full barriers count the producer's 128
    threads and empty ones both consumers' 256, for the Q / dO ring and the K/V buffers alike; the
    producer waits on `empty` with the parity of the stage's (K/V buffer's) previous use and every
    consumer waits on `full` with the tile's (item's), ring tiles counted over all items; the
    consumers arrive on `empty` once per tile on every path (skipped tiles too, computed ones once
    dK retired) and on `kv_empty` once per item; the producer publishes every item (one that loads
    nothing too, and the end) on `kv_full`; the dQ barrier is both consumers' 256 threads (id 1),
    the producer's item barrier id 4; the register split fits the register file."""
    src = _ws_source()
    assert "mbar_ring_init<STAGES>(bar_full, bar_empty, 128, 256);" in src
    assert "mbar_ring_init<KV_BUFS>(bar_kv_full, bar_kv_empty, 128, 256);" in src
    ring = configs.source(("attn_sm90.cuh",))
    ring = ring[ring.index("void mbar_ring_init("):]
    assert "mbar_init(bar_full + 8 * st, full_count);" in ring and "mbar_init(bar_empty + 8 * st, empty_count);" in ring
    prod = src[src.index("if (wg == 0) {"):src.index("// ----- consumers -----")]
    cons = src[src.index("// ----- consumers -----"):]
    assert "if (rt >= STAGES) mbar_wait(bar_empty + 8 * st, ((rt / STAGES) - 1) & 1);" in prod
    assert "if (n >= KV_BUFS) mbar_wait(bar_kv_empty + 8 * kb, ((n / KV_BUFS) - 1) & 1);" in prod
    assert prod.count("mbar_arrive(bar_kv_full + 8 * kb);") == 3 and "named_bar_sync(4, 128);" in prod
    assert "mbar_wait(bar_full + 8 * stg, (rt / STAGES) & 1);" in cons
    assert "mbar_wait(bar_kv_full + 8 * kb, (n / KV_BUFS) & 1);" in cons
    assert cons.count("mbar_arrive(bar_kv_empty + 8 * kb);") == 1
    assert cons.index("mbar_arrive(bar_kv_empty + 8 * kb);") > cons.index("dsb ^= 1;")
    loop = cons[cons.index("for (int it = 0; it < n_iter; ++it, ++rt) {"):cons.index("// Epilogue")]
    skip = loop[loop.index("tile_any_visible"):loop.index("continue;")]
    assert skip.count("mbar_arrive(bar_empty + 8 * stg);") == 1
    assert loop.count("mbar_arrive(bar_empty + 8 * stg);") == 2
    assert loop.index("wgmma_wait<0>();") < loop.rindex("mbar_arrive(bar_empty + 8 * stg);")   # after dK retired
    assert loop.count("named_bar_sync(") == 1 and "named_bar_sync(1, 256);" in loop
    assert "dsb ^= 1;" in loop and loop.index("dsb ^= 1;") > loop.index("red_acc_rows")
    regs = re.search(r"PRODUCER_REGS = HD == 64 \? (\d+) : (\d+), CONSUMER_REGS = HD == 64 \? (\d+) : (\d+);", src)
    p64, p128, c64, c128 = map(int, regs.groups())
    for p, c in ((p64, c64), (p128, c128)):
        assert 128 * p + 256 * c <= 64512 and p % 8 == 0 and c % 8 == 0 and 24 <= p and c <= 256


@needs_nvrtc
@pytest.mark.sm90a_compile
def test_ws_kernels_compile_within_their_spill_allowance_and_keep_the_chains(tmp_path):
    """Every warp-specialized kernel compiles for sm_90a (no wgmma serialised), within
    WGMMA_BWD_WS_SPILL_BYTES, with the register split in its SASS (USETMAXREG) and HGMMA only; in
    its PTX no ordinary instruction touches a chain's registers in flight, the fused dQ's products
    are MN-major at N = HD / 2 over 128 keys, with HD / 8 float2 atomic adds per thread and tile."""
    names = _ws_names()
    assert len(names) == 2 * len(configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS)
    log, lowered = compile_check.compile_names(names, "90a", cubin_out=str(tmp_path / "ws.cubin"))
    assert "serialized" not in log, log
    for r in compile_check.parse_ptxas_log(log, lowered, "90a"):
        if log.strip():
            assert max(r.spill_stores or 0, r.spill_loads or 0, r.stack or 0) <= configs.WGMMA_BWD_WS_SPILL_BYTES, r
    for name, body in _sm90a_ptx_entries(names).items():
        hd = int(re.search(r"<\w+, (\d+)>", name).group(1))
        assert wgmma_register_hazards(body) == [], name
        assert body.count("setmaxnreg.dec") == body.count("setmaxnreg.inc") == 1, name
        mn = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(?:f16\.f16|bf16\.bf16) [^;]*, p, 1, 1, 1, 1;",
                        body)
        assert mn == [str(hd // 2)] * 8, name
        adds = body.count("atom.global.add.v2.f32") + body.count("red.global.add.v2.f32")
        assert adds == hd // 8, name
    try:
        sass = _sass(str(tmp_path / "ws.cubin"))
    except pytest.skip.Exception:
        return
    for name, low in lowered.items():
        block = sass.split(f"Function : {low}")[1].split("Function : ")[0]
        assert "USETMAXREG" in block and "HGMMA." in block and "HMMA." not in block, name


# ----- GPU ---------------------------------------------------------------------------------------
def _wgmma_bwd_cases():
    try:
        from test_cupy import CASES
    except Exception:
        return []
    return [name for name, (*_, d, dv, kw) in CASES.items()
            if not any(x in kw for x in ("alibi", "bias", "mask", "softcap"))
            and configs.padded_head_dim(d, dv) in configs.WGMMA_BWD_HEAD_DIMS]


def _zero_grad_rows_ok(spec, kw, q, k, v, dq) -> bool:
    """Rows with no visible key (lse -inf in the reference) have exactly zero dq."""
    from portattn.reference import reference_forward

    _, ref_lse = reference_forward(build_spec(q.double(), k.double(), v.double(), **kw))
    empty = torch.isneginf(ref_lse)
    if not bool(empty.any()):
        return True
    rows = empty.transpose(0, 1) if spec.is_varlen else empty.transpose(1, 2)
    return bool((dq[rows] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", _wgmma_bwd_cases())
@pytest.mark.gpu
@sm90_only
def test_wgmma_backward_matches_reference(monkeypatch, case, dtype):
    from portattn.backends.cupy import CupyBackend, runtime
    from test_cupy import _grad_scale, _grads, _inputs, _to_layout

    from portattn.numerics import compare
    from portattn.reference import naive_forward, reference_forward

    q, k, v, kw = _inputs(case, dtype, seed=9)
    spec = build_spec(q, k, v, **kw)
    be = CupyBackend()
    out, lse = be.forward(spec)
    dout = torch.randn(spec.out_shape, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda")
    dout = dout.to(dtype)
    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    cfg, why = runtime.backward_choice(spec)
    assert cfg.family == "bwd_wgmma", why
    # determinism requested: the two-kernel backward, twice; then the default (the fused atomic dQ
    # at padded HD 64 / 128: configs.fused_dq_choice), whose dk / dv are the same arithmetic
    det = dataclasses.replace(spec, deterministic=True)
    first = be.backward(det, out, lse, dout)[:3]
    second = be.backward(det, out, lse, dout)[:3]
    fused = be.backward(spec, out, lse, dout)[:3]
    assert configs.fused_dq_choice(cfg, False)[0] == (cfg.head_dim in configs.WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS)
    monkeypatch.setenv(configs.BACKWARD_ENV, "auto")
    mma = be.backward(spec, out, lse, dout)[:3]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "wgmma backward not bit-identical on repeat"
    assert torch.equal(fused[1], first[1]) and torch.equal(fused[2], first[2]), "default dk / dv differ"
    assert _zero_grad_rows_ok(spec, kw, q, k, v, first[0]), "rows with no visible key must get zero dq"
    assert _zero_grad_rows_ok(spec, kw, q, k, v, fused[0]), "rows with no visible key must get zero dq (default)"
    ref_g = _grads(reference_forward, q, k, v, kw, dout, torch.float64)
    # keys no query sees (their float64 dv is exactly 0: dv = sum_i P_ij dO_i) get exactly zero dv
    unseen = (_to_layout(ref_g[2], kw) == 0).all(dim=-1)
    assert bool((first[2][unseen] == 0).all()), "keys no query sees must get zero dv"
    naive_g = _grads(naive_forward, q, k, v, kw, dout, dtype)
    zs = _grad_scale(spec, dout, k, v)
    bad = []
    for name, a, m, r, n in zip(("dq", "dk", "dv", "dq (default)"), (*first, fused[0]), (*mma, mma[0]),
                                (*ref_g, ref_g[0]), (*naive_g, naive_g[0])):
        r, n = _to_layout(r, kw), _to_layout(n, kw)
        res = compare(name, a, r, n, factor=3, zero_ref_scale=zs)
        if not res.passed:
            bad.append(str(res))
        diff = (a.double() - m.double()).abs().max().item() if a.numel() else 0.0
        if not diff <= 2 * res.tolerance:
            bad.append(f"{name}: max|wgmma - mma| = {diff:.3g} > {2 * res.tolerance:.3g}")
    assert not bad, f"{case} {dtype}: " + "; ".join(bad)


def _ws_grid(monkeypatch, grid: str) -> None:
    """The warp-specialized kernels' grid for a test: "sm" one CTA per SM (persistent), "3" three
    CTAs taking every work item (many items per CTA, both K/V buffers reused), "item" one CTA per
    work item."""
    from portattn.backends.cupy import runtime

    monkeypatch.setenv(configs.WS_PERSISTENT_ENV, "0" if grid == "item" else "1")
    if grid == "3":
        monkeypatch.setattr(runtime, "_sm_count", lambda device: 3)


WS_GRIDS = ["sm", "3", "item"]


@pytest.mark.parametrize("grid", WS_GRIDS)
@pytest.mark.parametrize("mode", ["ws"])
@pytest.mark.parametrize("case", [c for c in _wgmma_bwd_cases() if c in (
    "basic", "causal_br_sq_gt_sk", "causal_br_empty_ctas", "gqa_causal", "varlen_causal", "varlen_window")])
@pytest.mark.gpu
@sm90_only
def test_ws_fused_dq_matches_reference(monkeypatch, case, mode, grid):
    """The warp-specialized fused-dQ dK/dV (PORTATTN_CUPY_DQ=ws) at the padded
    HD 64 / 128 of the case, on each grid (_ws_grid): dk and dv bit-identical to the deterministic
    backward's (the same products in the same order), dq against float64, rows with no visible
    key exactly 0."""
    from portattn.backends.cupy import CupyBackend, runtime
    from test_cupy import _grad_scale, _grads, _inputs, _to_layout

    from portattn.numerics import compare
    from portattn.reference import naive_forward, reference_forward

    q, k, v, kw = _inputs(case, torch.bfloat16, seed=13)
    spec = build_spec(q, k, v, **kw)
    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    cfg = runtime.backward_choice(spec)[0]
    if not cfg.has_fused_dq:
        pytest.skip(f"padded HD {cfg.head_dim}: no fused dQ")
    be = CupyBackend()
    out, lse = be.forward(spec)
    dout = torch.randn(spec.out_shape, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda")
    dout = dout.to(torch.bfloat16)
    det = be.backward(dataclasses.replace(spec, deterministic=True), out, lse, dout)[:3]
    monkeypatch.setenv(configs.DQ_ENV, mode)
    _ws_grid(monkeypatch, grid)
    ws = be.backward(spec, out, lse, dout)[:3]
    torch.cuda.synchronize()
    assert torch.equal(ws[1], det[1]) and torch.equal(ws[2], det[2]), f"{mode}: dk / dv differ"
    assert _zero_grad_rows_ok(spec, kw, q, k, v, ws[0]), "rows with no visible key must get zero dq"
    r = _to_layout(_grads(reference_forward, q, k, v, kw, dout, torch.float64)[0], kw)
    n = _to_layout(_grads(naive_forward, q, k, v, kw, dout, torch.bfloat16)[0], kw)
    res = compare("dq", ws[0], r, n, factor=3, zero_ref_scale=_grad_scale(spec, dout, k, v))
    assert res.passed, f"{case} {mode}: {res}"


@pytest.mark.parametrize("grid", WS_GRIDS)
@pytest.mark.parametrize("mode", ["ws"])
@pytest.mark.gpu
@sm90_only
def test_ws_fused_dq_large_and_bad_cu_seqlens(monkeypatch, mode, grid):
    """The warp-specialized kernels on many tiles per CTA (GQA, causal and not, HD 64 and 128) and
    on the bad-cu_seqlens cases (they must stay in bounds), on each grid (_ws_grid)."""
    import test_cu_seqlens_safety
    from portattn.backends.cupy import CupyBackend
    from test_cu_seqlens_safety import BAD, run_bad_case
    from test_cupy import assert_large_backward_close

    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    monkeypatch.setenv(configs.DQ_ENV, mode)
    _ws_grid(monkeypatch, grid)
    g = torch.Generator(device="cuda").manual_seed(6)
    for d in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS:
        q = torch.randn(2, 1024, 8, d, generator=g, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(2, 1024, 2, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
        for causal in (False, True):
            spec = build_spec(q, k, v, causal=causal)
            out, lse = CupyBackend().forward(spec)
            dout = torch.randn(spec.out_shape, generator=g, device="cuda").to(torch.bfloat16)
            assert_large_backward_close(q, k, v, causal, dout, CupyBackend().backward(spec, out, lse, dout)[:3])
        monkeypatch.setattr(test_cu_seqlens_safety, "D", d)
        for name in sorted(BAD):
            run_bad_case(monkeypatch, "cupy", name, "causal", dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("d", configs.WGMMA_BWD_HEAD_DIMS)
@pytest.mark.gpu
@sm90_only
def test_wgmma_backward_large_bf16(monkeypatch, d):
    """Many key and query tiles per CTA (the benchmark's shape, smaller), GQA, causal and not."""
    from portattn.backends.cupy import CupyBackend, runtime
    from test_cupy import assert_large_backward_close

    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(2, 1024, 8, d, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, 1024, 2, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    for causal in (False, True):
        spec = build_spec(q, k, v, causal=causal)
        assert runtime.backward_choice(spec)[0].family == "bwd_wgmma"
        out, lse = CupyBackend().forward(spec)
        dout = torch.randn(spec.out_shape, generator=g, device="cuda").to(torch.bfloat16)
        grads = CupyBackend().backward(spec, out, lse, dout)[:3]
        assert_large_backward_close(q, k, v, causal, dout, grads)


@pytest.mark.parametrize("case", ["basic", "causal_br_sq_gt_sk", "causal_br_empty_ctas", "gqa_causal", "varlen_causal",
                                  "varlen_window"])
@pytest.mark.gpu
@sm90_only
def test_wgmma_backward_lse_gradient(monkeypatch, case):
    from test_cupy import _inputs
    from test_lse_grad import check_lse_grads

    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    q, k, v, kw = _inputs(case, torch.bfloat16, seed=11)
    check_lse_grads("cupy", q, k, v, bias_grad=False, **kw)


@pytest.mark.parametrize("d", configs.WGMMA_BWD_HEAD_DIMS)
@pytest.mark.gpu
@sm90_only
def test_wgmma_backward_bad_cu_seqlens_stay_in_bounds(monkeypatch, d):
    """The bad-cu_seqlens cases (test_cu_seqlens_safety.py) with the causal feature set (the
    others carry softcap / ALiBi / bias: the mma.sync kernels) through the wgmma backward."""
    import test_cu_seqlens_safety
    from test_cu_seqlens_safety import BAD, run_bad_case

    monkeypatch.setattr(test_cu_seqlens_safety, "D", d)
    monkeypatch.setenv(configs.BACKWARD_ENV, "wgmma")
    for name in sorted(BAD):
        run_bad_case(monkeypatch, "cupy", name, "causal", dtype=torch.bfloat16, device="cuda")
