"""The cupy backend's sm_90a wgmma forward (attn_fwd_wgmma.cu, issue 16).

CPU tests (no GPU): the PORTATTN_CUPY_FORWARD switch and which problems the wgmma forward takes,
the generated wgmma wrappers are up to date, the sm_90a module compiles with NVRTC (no spills)
and its SASS has HGMMA (when a cuobjdump is at hand), and sm_90a never leaks into the sm_80 /
sm_90 source. GPU tests (sm_90 + cupy only): the wgmma forward against the float64 reference
under the equivalence rule (docs/semantics.md) on tests/test_cupy.py's cases it covers, bit-
identical repeats, and the switch really launching it (the warp-specialized variant too; it passed
tools/cupy_wgmma_check.py's child-process run on the H200 first; PORTATTN_TEST_WGMMA_WS=0 skips it).
"""

import dataclasses
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from _ptx_wgmma import wgmma_register_hazards
from portattn.backends.cupy import compile_check, configs

from portattn.spec import build_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    from cuda.bindings import nvrtc  # noqa: F401
    have_nvrtc = True
except Exception:
    have_nvrtc = False
needs_nvrtc = pytest.mark.skipif(not have_nvrtc, reason="needs cuda-bindings + nvidia-cuda-nvrtc (portattn[nvrtc])")

try:
    import cupy  # noqa: F401
    have_cupy = True
except Exception:
    have_cupy = False
is_sm90 = (torch.cuda.is_available() and not getattr(torch.version, "hip", None)
           and torch.cuda.get_device_capability() == (9, 0))
sm90_only = pytest.mark.skipif(not (is_sm90 and have_cupy), reason="needs an sm_90 GPU and cupy")


# ----- CPU: the switch and the choice ------------------------------------------------------------
def test_forward_mode_env(monkeypatch):
    monkeypatch.delenv(configs.FORWARD_ENV, raising=False)
    assert configs.forward_mode() == "auto"
    for v in ("mma", "WGMMA", " auto "):
        monkeypatch.setenv(configs.FORWARD_ENV, v)
        assert configs.forward_mode() == v.strip().lower()
    monkeypatch.setenv(configs.FORWARD_ENV, "tma")
    with pytest.raises(ValueError, match="PORTATTN_CUPY_FORWARD.*auto, mma, wgmma"):
        configs.forward_mode()


@pytest.mark.parametrize("mode", ["auto", "mma", "wgmma", "wgmma_ws"])
def test_forward_choice(mode):
    choose = lambda dt, d, dv, extras=False, cap=(9, 0): configs.forward_choice(  # noqa: E731
        dt, d, dv, extras=extras, capability=cap, mode=mode)[0]
    wg = mode.startswith("wgmma")
    fam = {"wgmma": "fwd_wgmma", "wgmma_ws": "fwd_wgmma_ws", "auto": "fwd_wgmma"}.get(mode, "fwd_mma")
    assert choose("bfloat16", 128, 128).family == fam
    # padded to 64: auto takes wgmma there too (timed 1.14-1.27 x mma.sync on the H200, 2026-12-04)
    assert choose("float16", 40, 64).family == fam
    assert all(hd in configs.WGMMA_HEAD_DIMS for hd in configs.WGMMA_AUTO_HEAD_DIMS)
    assert choose("bfloat16", 256, 200).family == fam
    assert choose("float16", 100, 128).family == fam   # padded to 128
    assert choose("bfloat16", 96, 96).family == "fwd_mma"           # no HD-96 instantiation
    assert choose("bfloat16", 128, 128, extras=True).family == "fwd_mma"
    assert choose("bfloat16", 128, 128, cap=(8, 0)).family == "fwd_mma"
    assert choose("bfloat16", 128, 128, cap=(10, 0)).family == "fwd_mma"   # sm_90a code runs on 9.0 only
    assert choose("bfloat16", 128, 128, cap=None).family == "fwd_mma"
    assert choose("float32", 128, 128).family == "fwd_fma"
    cfg, why = configs.forward_choice("bfloat16", 128, 128, extras=True, capability=(9, 0), mode=mode)
    assert configs.FORWARD_ENV in why and (("softcap" in why) if wg or mode == "auto" else True)
    # two K/V stages are the mma.sync forward's knob: auto keeps that kernel; wgmma ignores the knob
    cfg, why = configs.forward_choice("bfloat16", 128, 128, extras=False, capability=(9, 0), mode=mode, kv_stages=2)
    assert cfg.family == ("fwd_mma" if mode in ("auto", "mma") else fam), why
    if mode == "auto":
        assert "K/V stages" in why


def test_wgmma_config_geometry():
    for cfg in configs.wgmma_configs(with_probe=True):
        assert cfg.arch == "sm_90a" and cfg.source_files == configs.WGMMA_SOURCE_FILES
        bn, nwg = configs.wgmma_tile(cfg.head_dim)
        if cfg.family == "fwd_wgmma_ws":
            bn = configs.wgmma_ws_tile(cfg.head_dim)
        if cfg.family == "fwd_wgmma":
            assert cfg.threads("plain") == 128 * nwg and cfg.block_rows("plain") == 64 * nwg
            ov = "false" if cfg.tile is not None and not cfg.tile[2] else "true"   # serial / overlapped walk
            assert configs.WGMMA_OVERLAP or cfg.tile is not None
            assert cfg.kernel_names() == {"plain": f"attn_fwd_wgmma<{cfg.ctype}, {cfg.head_dim}, {bn}, {nwg}, {ov}>"}
        if cfg.family == "fwd_wgmma_ws":
            assert cfg.threads("plain") == 384 and cfg.block_rows("plain") == 128
            pp = "false" if cfg.tile is not None and not cfg.tile[2] else "true"
            assert cfg.kernel_names() == {"plain": f"attn_fwd_wgmma_ws<{cfg.ctype}, {cfg.head_dim}, {bn}, {pp}>"}
        assert cfg.max_smem_bytes() <= configs.SMEM_LIMITS[90]
    fwd = [n for c in configs.wgmma_configs() if c.family.startswith("fwd") for n in c.name_expressions()]
    # 2 dtypes x 3 head dims x (overlapped, serial, warp-specialized with and without pingpong)
    assert len(fwd) == len(set(fwd)) == 24
    assert configs.wgmma_tile(64)[0] == 64 and configs.wgmma_ws_tile(64) == 128   # two CTAs / one per SM
    bwd = [n for c in configs.wgmma_configs() if c.family == "bwd_wgmma" for n in c.name_expressions()]
    # 2 dtypes x (dK/dV, dQ) x (HD 64 and 128 with either walk, HD 256 serial, HD 64's other
    # tiles), the preprocess once per dtype, and the fused-dQ dK/dV (serial walk, one-CTA tiles)
    # at HD 64 and 128 once per dtype; 12 configs of three kernels each, plus the fused one in the
    # 8 configs of HD 64 / 128 on the one-CTA tiles (either walk: both carry the same fused kernel),
    # and beside it the warp-specialized one
    fused = [c for c in configs.wgmma_configs() if c.family == "bwd_wgmma" and c.has_fused_dq]
    assert sorted({(c.dtype, c.head_dim) for c in fused}) == sorted(
        (dt, hd) for dt in configs.TENSOR_CORE_DTYPES for hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS)
    assert len(fused) == 8 and not any(c.bwd_two_cta for c in fused)
    assert {c.kernel_names()["dkdv_dq"] for c in fused} == {
        f"attn_bwd_dkdv_wgmma<{configs.KernelConfig('bwd_wgmma', dt, hd).ctype}, {hd}, 64, 2, false, true>"
        for dt in configs.TENSOR_CORE_DTYPES for hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS}
    assert {c.kernel_names()["dkdv_dq_ws"] for c in fused} == {
        f"attn_bwd_dkdv_wgmma_ws<{configs.KernelConfig('bwd_wgmma', dt, hd).ctype}, {hd}>"
        for dt in configs.TENSOR_CORE_DTYPES for hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS}
    assert len(set(bwd)) == 26 + 4 + 4 and len(bwd) == 36 + 8 * 2
    assert configs.KernelConfig("fwd_mma", "bfloat16", 128).arch is None


def test_kernel_families_names_the_forward(monkeypatch):
    from portattn.backends.cupy import kernel_families

    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    spec = build_spec(q, q, q, causal=True)
    monkeypatch.setenv(configs.FORWARD_ENV, "wgmma")
    assert kernel_families(spec, capability=(9, 0))["forward"].startswith("fwd_wgmma (Hopper")
    fam = kernel_families(spec, capability=(8, 0))["forward"]
    assert fam.startswith("fwd_mma") and "needs 9.0" in fam
    assert kernel_families(build_spec(q, q, q, softcap=5.0), capability=(9, 0))["forward"].startswith("fwd_mma")
    monkeypatch.delenv(configs.FORWARD_ENV)   # auto: wgmma at padded HD 64/128/256 on 9.0, mma.sync elsewhere
    assert kernel_families(spec, capability=(9, 0))["forward"].startswith("fwd_wgmma (Hopper")
    assert kernel_families(spec, capability=(8, 0))["forward"].startswith("fwd_mma")
    q64 = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    assert kernel_families(build_spec(q64, q64, q64), capability=(9, 0))["forward"].startswith("fwd_wgmma")
    q96 = torch.randn(1, 8, 2, 96, dtype=torch.bfloat16)   # no HD-96 wgmma instantiation
    assert kernel_families(build_spec(q96, q96, q96), capability=(9, 0))["forward"].startswith("fwd_mma")
    monkeypatch.setenv(configs.FORWARD_ENV, "mma")
    assert kernel_families(spec, capability=(9, 0))["forward"].startswith("fwd_mma")


def test_generated_wgmma_wrappers_are_current():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_wgmma_ops.py"), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_sm80_source_has_no_sm90a_code():
    """The sm_80 / sm_90 translation unit stays free of wgmma (it must compile for sm_80)."""
    src = configs.source()
    assert "wgmma" not in src and "fence.proxy.async" not in src
    assert "wgmma.mma_async" in configs.source(configs.WGMMA_SOURCE_FILES)


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return p if os.path.exists(p) else None
    except Exception:
        return None


def _cubin_resources(cubin: str) -> dict:
    """tools/cupy_wgmma_check.resource_usage of ``cubin`` (``cuobjdump -res-usage``: {lowered name:
    {"registers", "stack", "local"}}); skips the test when no cuobjdump is at hand."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from cupy_wgmma_check import resource_usage

    res = resource_usage(cubin)
    if "error" in res:
        pytest.skip(f"cuobjdump -res-usage: {res['error']}")
    return res


def _compile_90a_without_spills(names, cubin: str, spill_ok=lambda name: False):
    """Compile ``names`` for sm_90a into ``cubin`` (compile_check: NVRTC, ptxas -v) and check each
    kernel's ptxas report (registers <= 255, no spills, no stack, except where ``spill_ok(name)``
    allows at most 8 bytes) and that ptxas did not serialize the wgmma chains; returns (ptxas
    log, name -> lowered name, the reports).

    NVRTC 13.0 through cuda.bindings (the H200 image's) has returned an empty log for a program
    whose cubin was fine (2026-12-03 in the check tool; 2026-12-04 here, 24 kernels): then the
    registers, stack and local (spilled) bytes come from the cubin, and the serialization (a
    log-only warning) cannot be checked; the callers' SASS checks still run."""
    log, lowered = compile_check.compile_names(names, "90a", cubin_out=cubin)
    reports = compile_check.parse_ptxas_log(log, lowered, "90a")
    assert len(reports) == len(names)
    from portattn.backends.cupy import sm90a

    if not log.strip():
        res = _cubin_resources(cubin)
        reports = [dataclasses.replace(r, registers=u["registers"], stack=u["stack"], spill_stores=u["local"],
                                       spill_loads=u["local"]) if (u := res.get(lowered[r.name])) else r
                   for r in reports]
    for r in reports:
        assert r.registers is not None and r.registers <= 255, compile_check.report_message(
            r, lowered, log, f"compile_check's: {sm90a._BindingsNvrtc().describe()}")
        limit = 8 if spill_ok(r.name) else 0
        assert max(r.spill_stores or 0, r.spill_loads or 0, r.stack or 0) <= limit, f"{r.name} spills: {r}"
    assert "serialized" not in log, log   # ptxas: "wgmma.mma_async instructions are serialized ..."
    return log, lowered, reports


def _sass(cubin: str) -> str:
    """``cuobjdump -sass`` of ``cubin``; skips the test when no cuobjdump is at hand."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS")
    return subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout


@needs_nvrtc
def test_compile_check_reads_the_cubin_when_the_log_is_empty(tmp_path, monkeypatch):
    """With NVRTC's log emptied (as NVRTC 13.0 returned it on the H200), the registers, stack and
    spilled bytes of each kernel come from the cubin, equal to what ptxas -v reported."""
    names = [configs.KernelConfig("fwd_wgmma", "bfloat16", 64).kernel_names()["plain"]]
    _, _, full = _compile_90a_without_spills(names, str(tmp_path / "a.cubin"))
    real = compile_check.compile_names
    monkeypatch.setattr(compile_check, "compile_names", lambda *a, **kw: ("", real(*a, **kw)[1]))
    _, _, from_cubin = _compile_90a_without_spills(names, str(tmp_path / "b.cubin"))
    assert [r.registers for r in from_cubin] == [r.registers for r in full] and from_cubin[0].registers > 0
    assert from_cubin[0].spill_stores == 0 and from_cubin[0].stack == 0


@needs_nvrtc
def test_two_cta_forward_fits_two_ctas_per_sm(tmp_path):
    """The wgmma forward at the head dims of WGMMA_TWO_CTA_HEAD_DIMS (both walks): 64-key tiles, at
    most 128 registers (its __launch_bounds__ asks for two CTAs per SM), no spills, unserialized
    wgmma, and the shared memory of two CTAs within the SM's 228 KB."""
    cfgs = [c for c in configs.wgmma_configs() if c.family == "fwd_wgmma" and c.head_dim in configs.WGMMA_TWO_CTA_HEAD_DIMS]
    assert len(cfgs) == 2 * 2 * len(configs.WGMMA_TWO_CTA_HEAD_DIMS)   # dtypes x walks
    assert all(", 64, 2, " in c.kernel_names()["plain"] for c in cfgs)
    names = [c.kernel_names()["plain"] for c in cfgs]
    _, _, reports = _compile_90a_without_spills(names, str(tmp_path / "m.cubin"))
    for r in reports:
        assert r.registers <= 128, f"{r.name}: {r.registers} registers, over two CTAs' 128"
    for c in cfgs:
        assert 2 * (c.smem_bytes("plain") + 1024) <= 228 * 1024, c


@needs_nvrtc
@pytest.mark.sm90a_compile
def test_sm90a_module_compiles_without_spills_and_uses_hgmma(tmp_path):
    names = [configs.KernelConfig("fwd_wgmma", "bfloat16", 128).kernel_names()["plain"],
             configs.KernelConfig("fwd_wgmma", "float16", 256, tile=(64, 2, 0)).kernel_names()["plain"],
             configs.KernelConfig("fwd_wgmma", "float16", 64).kernel_names()["plain"],
             configs.KernelConfig("fwd_wgmma_ws", "bfloat16", 256).kernel_names()["plain"],
             configs.KernelConfig("wgmma_probe", "bfloat16", 256).kernel_names()["probe"]]
    cubin = str(tmp_path / "m.cubin")
    log, lowered, _ = _compile_90a_without_spills(names, cubin)
    assert "C7508" not in log, log        # ptxas: setmaxnreg ignored
    sass = _sass(cubin)
    for low in lowered.values():
        block = sass.split(f"Function : {low}")[1].split("Function : ")[0]
        assert block.count("HGMMA") >= 8, f"{low}: no HGMMA in the SASS"


def test_nvrtc_binding_skips_a_binding_that_cannot_load_nvrtc(monkeypatch):
    """A cuda.bindings whose libnvrtc does not load (it opens the library on its first call, not
    at import) must not be chosen over CuPy's binding: the sm_90a compile would fail where CuPy's
    NVRTC works."""
    from portattn.backends.cupy import sm90a

    def broken(self):
        raise RuntimeError("Failed to dlopen libnvrtc.so")

    monkeypatch.setattr(sm90a._BindingsNvrtc, "__init__", lambda self: None)
    monkeypatch.setattr(sm90a._BindingsNvrtc, "version", broken)
    monkeypatch.setattr(sm90a._CupyNvrtc, "__init__", lambda self: None)
    monkeypatch.setattr(sm90a._CupyNvrtc, "version", lambda self: (13, 0))
    assert isinstance(sm90a.nvrtc_binding(), sm90a._CupyNvrtc)
    monkeypatch.setattr(sm90a._CupyNvrtc, "version", broken)
    with pytest.raises(sm90a.Sm90aCompileError, match="dlopen"):
        sm90a.nvrtc_binding()


def test_register_hazard_check_sees_a_late_write():
    """The checker below flags an accumulator write moved past the wgmma.fence, and a touch of a
    chain that a ``wait_group 1`` left in flight (it can fail)."""
    ok = ("wgmma.fence.sync.aligned;\nadd.s32 %r9, %r9, 1;\n"
          "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%f1, %f2}, {%r1, %r2, %r3, %r4}, %rd1, p, 1, 1, 1;\n"
          "wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\nmul.f32 %f1, %f1, %f3;\n")
    assert wgmma_register_hazards(ok) == []
    late = ok.replace("add.s32 %r9, %r9, 1;", "mul.f32 %f2, %f2, %f7;")
    assert len(wgmma_register_hazards(late)) == 1
    early_read = ok.replace("wgmma.wait_group.sync.aligned 0;\nmul.f32", "mul.f32 %f5, %r3, %f3;\nwgmma.wait_group.sync.aligned 0;\nmul.f32")
    assert len(wgmma_register_hazards(early_read)) == 1
    second = ("wgmma.fence.sync.aligned;\n"
              "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%f8, %f9}, {%r5, %r6, %r7, %r8}, %rd2, p, 1, 1, 1;\n"
              "wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 1;\n")
    two = ok.replace("wgmma.wait_group.sync.aligned 0;\n", second + "mul.f32 %f1, %f1, %f3;\n"
                     "wgmma.wait_group.sync.aligned 0;\n")
    assert wgmma_register_hazards(two) == []          # chain 1 retired by wait 1, chain 2 untouched
    touch = two.replace("mul.f32 %f1, %f1, %f3;\nwgmma.wait_group.sync.aligned 0;",
                        "mul.f32 %f9, %f9, %f3;\nwgmma.wait_group.sync.aligned 0;")
    assert len(wgmma_register_hazards(touch)) == 1    # chain 2 still in flight under wait 1
    reuse_a = two.replace("mul.f32 %f1, %f1, %f3;\nwgmma.wait_group.sync.aligned 0;",
                          "mov.b32 %r6, %r9;\nwgmma.wait_group.sync.aligned 0;")
    assert len(wgmma_register_hazards(reuse_a)) == 1  # its A fragment rewritten before the wait


def test_register_hazard_check_follows_the_control_flow():
    """A chain committed at the end of a loop body is in flight at the loop's head on the back
    edge: a touch of its registers there (before the wait) is flagged, the same touch after the
    wait is not, and a block no in-flight path reaches (the loop's bypass) may use them freely."""
    mma = "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%f1, %f2}, %rd1, %rd2, p, 1, 1, 0, 0;\n"
    chain = "wgmma.fence.sync.aligned;\n" + mma + "wgmma.commit_group.sync.aligned;\n"

    def loop(head: str) -> str:
        return ("@%p1 bra $L_skip;\n"
                "$L_head:\n" + head + "wgmma.wait_group.sync.aligned 0;\nadd.f32 %f3, %f1, %f2;\n" + chain
                + "@%p2 bra $L_head;\nwgmma.wait_group.sync.aligned 0;\nbra.uni $L_end;\n"
                "$L_skip:\nmov.f32 %f1, 0f00000000;\n$L_end:\nret;\n")

    assert wgmma_register_hazards(loop("add.s32 %r1, %r1, 1;\n")) == []
    flagged = wgmma_register_hazards(loop("mov.f32 %f2, %f9;\n"))
    assert len(flagged) == 1 and "mov.f32 %f2" in flagged[0]
    with pytest.raises(AssertionError, match="never waited"):   # a path to the end with the chain running
        wgmma_register_hazards(loop("").replace("@%p2 bra $L_head;\nwgmma.wait_group.sync.aligned 0;\n",
                                                "@%p2 bra $L_head;\n"))


def _sm90a_ptx_entries(names) -> dict:
    """name -> the PTX entry NVRTC makes of it for compute_90a (the PTX-ISA checks here and in
    test_cupy_wgmma_bwd.py), with the NVRTC the backend would use (sm90a.nvrtc_binding: CuPy's
    where cuda.bindings is missing, as on a GPU host); skips the test when there is none."""
    from portattn.backends.cupy import sm90a

    try:
        nv = sm90a.nvrtc_binding()
    except sm90a.Sm90aCompileError as exc:
        pytest.skip(str(exc))
    opts = (*[o for o in sm90a.OPTIONS if not o.startswith("--ptxas")], "--gpu-architecture=compute_90a")
    ptx, lowered, _ = nv.compile(configs.source(configs.WGMMA_SOURCE_FILES), names, opts)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    entries = re.split(r"\n(?=\.(?:weak|visible) \.entry )", ptx)
    out = {}
    for name, low in lowered.items():
        body = [e for e in entries if e.split("(", 1)[0].endswith(low)]
        assert len(body) == 1, name
        out[name] = body[0]
    return out


def test_sm90a_ptx_keeps_wgmma_registers_behind_the_fences():
    """In the PTX NVRTC makes of the forward, its warp-specialized variant and the probe, no
    ordinary instruction touches a wgmma accumulator or A-fragment register between a chain's
    wgmma.fence and its wgmma.wait_group (the operand fences in attn_sm90.cuh's wg_qk / wg_pv
    make that an order of the source, not of the compiler's scheduling). Uses the NVRTC the
    backend would (sm90a.nvrtc_binding: CuPy's where cuda.bindings is missing, as on a GPU host)."""
    names = [configs.KernelConfig("fwd_wgmma", "bfloat16", 128).kernel_names()["plain"],
             configs.KernelConfig("fwd_wgmma", "float16", 256, tile=(64, 2, 0)).kernel_names()["plain"],
             configs.KernelConfig("fwd_wgmma_ws", "float16", 64).kernel_names()["plain"],
             configs.KernelConfig("wgmma_probe", "bfloat16", 256).kernel_names()["probe"]]
    for name, body in _sm90a_ptx_entries(names).items():
        assert body.count("wgmma.fence") >= 2, name
        assert wgmma_register_hazards(body) == [], name


# ----- GPU ---------------------------------------------------------------------------------------
def _wgmma_cases():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from test_cupy import CASES
    except Exception:
        return []
    out = []
    for name, (*_, d, dv, kw) in CASES.items():
        if any(x in kw for x in ("alibi", "bias", "mask", "softcap")):
            continue
        if configs.padded_head_dim(d, dv) in configs.WGMMA_HEAD_DIMS:
            out.append(name)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", _wgmma_cases())
@pytest.mark.parametrize("mode", ["wgmma", "wgmma_ws"])
@pytest.mark.gpu
@sm90_only
def test_wgmma_forward_matches_reference(monkeypatch, mode, case, dtype):
    from portattn.backends.cupy import CupyBackend, runtime
    from test_cupy import _inputs, forward_results

    q, k, v, kw = _inputs(case, dtype, seed=5)
    spec = build_spec(q, k, v, **kw)
    if mode == "wgmma_ws" and os.environ.get("PORTATTN_TEST_WGMMA_WS") == "0":
        # tools/cupy_wgmma_check.py runs it in a child process with a timeout (a barrier deadlock
        # would hang a test run); it passed there on the H200 (2026-12-02), so it runs by default
        pytest.skip("PORTATTN_TEST_WGMMA_WS=0")
    monkeypatch.setenv(configs.FORWARD_ENV, mode)
    cfg, why = runtime.forward_choice(spec)
    assert cfg.family == "fwd_" + mode, why
    out, lse = CupyBackend().forward(spec)
    out2, lse2 = CupyBackend().forward(spec)
    torch.cuda.synchronize()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "wgmma forward not bit-identical on repeat"
    results = forward_results(spec, q, k, v, kw, out, lse)
    bad = [str(r) for r in results if not r.passed]
    assert not bad, f"{case} {dtype}: " + "; ".join(bad)


@pytest.mark.gpu
@sm90_only
def test_wgmma_switch_falls_back_for_extras(monkeypatch):
    from portattn.backends.cupy import runtime

    q = torch.randn(1, 100, 2, 128, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv(configs.FORWARD_ENV, "wgmma")
    assert runtime.plan_forward(build_spec(q, q, q, causal=True)).launches[0].cfg.family == "fwd_wgmma"
    plan = runtime.plan_forward(build_spec(q, q, q, softcap=3.0))
    assert plan.launches[0].cfg.family == "fwd_mma" and plan.launches[0].role == "extras"
    monkeypatch.setenv(configs.FORWARD_ENV, "mma")
    assert runtime.plan_forward(build_spec(q, q, q)).launches[0].cfg.family == "fwd_mma"
    monkeypatch.setenv(configs.FORWARD_ENV, "auto")   # HD 128 on the H200: the wgmma forward
    assert runtime.plan_forward(build_spec(q, q, q)).launches[0].cfg.family == "fwd_wgmma"


def _wgmma_param_count(kernel: str) -> int:
    src = configs.source(configs.WGMMA_SOURCE_FILES)
    n_common = re.search(r"#define PA_COMMON_PARAMS(.*?)\n\n", src, re.S).group(1).count(",") + 1
    start = src.index(f"\n{kernel}(") + len(kernel) + 2
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        i += 1
    return src[start:i - 1].count(",") + n_common


@pytest.mark.parametrize("family", ["fwd_wgmma", "fwd_wgmma_ws"])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (4, 2)}])
def test_wgmma_plan_matches_signature(family, kw):
    """plan_forward with a wgmma config (CPU tensors: nothing launches) passes the kernel's
    argument list (attn_fwd_mma's), one CTA per 128 rows; softcap is refused with a reason."""
    from portattn.backends.cupy import runtime

    q = torch.randn(2, 300, 4, 40, dtype=torch.bfloat16)
    k = torch.randn(2, 50, 2, 40, dtype=torch.bfloat16)
    v = torch.randn(2, 50, 2, 24, dtype=torch.bfloat16)
    spec = build_spec(q, k, v, **kw)
    cfg = configs.wgmma_forward_config("bfloat16", 40, 24, ws=family == "fwd_wgmma_ws")
    assert cfg.family == family and cfg.head_dim == 64
    (launch,) = runtime.plan_forward(spec, cfg).launches
    kernel = "attn_fwd_wgmma" if family == "fwd_wgmma" else "attn_fwd_wgmma_ws"
    assert len(launch.args) == _wgmma_param_count(kernel)
    assert launch.role == "plain" and launch.grid == (3, 4, 2)
    assert cfg.threads("plain") == (256 if family == "fwd_wgmma" else 384)
    with pytest.raises(ValueError, match="softcap"):
        runtime.plan_forward(build_spec(q, k, v, softcap=2.0), cfg)
