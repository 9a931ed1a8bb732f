"""CPU tests of the cupy backend: NVRTC compile of its kernels (no GPU needed), and the
Python side (configuration choice, cache keys, launch arguments against the kernel
signatures, reasons). The GPU numerics live in tests/test_cupy.py.

The full compile check (every instantiation, sm_80 and sm_90; about 3 min per architecture on
two cores) is ``python -m portattn.backends.cupy.compile_check``, a separate CI step; here a
reduced set runs.
"""

import re

import pytest
import torch
from portattn.backends.cupy import CupyBackend, compile_check, configs, problem_reasons, runtime

from portattn.spec import build_spec

try:
    from cuda.bindings import nvrtc  # noqa: F401
    have_nvrtc = True
except Exception:
    have_nvrtc = False

needs_nvrtc = pytest.mark.skipif(not have_nvrtc, reason="needs cuda-bindings + nvidia-cuda-nvrtc (portattn[nvrtc])")


# ----- NVRTC compile ----------------------------------------------------------------------------
@needs_nvrtc
def test_compile_reduced_set_sm80_sm90():
    """Both tensor-core tile shapes and all three kernel families compile with no spills."""
    names_90 = compile_check.select_names(head_dims=(64,))
    names_80 = [configs.KernelConfig("fwd_mma", "bfloat16", 256).kernel_names()["extras"],
                configs.KernelConfig("bwd", "float16", 256).kernel_names()["dkdv"],
                configs.KernelConfig("bwd_mma", "float16", 128).kernel_names()["dkdv_extras"],
                configs.KernelConfig("bwd_mma", "bfloat16", 256).kernel_names()["dkdv"],   # head-dim split
                configs.KernelConfig("bwd_mma", "bfloat16", 192).kernel_names()["dq"]]
    for arch, names in ((90, names_90), (80, names_80)):
        log, lowered = compile_check.compile_names(names, arch)
        reports = compile_check.parse_ptxas_log(log, lowered, arch)
        assert len(reports) == len(names)
        for r in reports:
            assert r.registers is not None and r.registers <= 255, r
            assert not r.spill_stores and not r.spill_loads, f"{r.name} sm_{arch} spills"


@needs_nvrtc
def test_compile_error_is_reported(monkeypatch):
    monkeypatch.setattr(configs, "source", lambda: "__global__ void broken() { this is not C++; }")
    with pytest.raises(compile_check.CompileError, match="NVRTC failed"):
        compile_check.compile_names([], 90)


def test_parse_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z3fooi' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z3fooi\n"
           "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 96 registers, used 1 barriers, 384 bytes smem\n"
           "ptxas info    : Compiling entry function '_Z3bari' for 'sm_90'\n"
           "ptxas info    : Used 40 registers\n")
    reps = {r.name: r for r in compile_check.parse_ptxas_log(log, {"foo<1>": "_Z3fooi", "bar<2>": "_Z3bari"}, 90)}
    assert (reps["foo<1>"].registers, reps["foo<1>"].spill_stores, reps["foo<1>"].spill_loads) == (96, 8, 12)
    assert reps["foo<1>"].stack == 16 and reps["foo<1>"].smem_static == 384
    assert reps["bar<2>"].registers == 40 and reps["bar<2>"].spill_stores is None



def test_parse_ptxas_log_other_shapes():
    """Log shapes the first parser (keyed on 'Function properties for (\\S+)') lost an entry's
    registers in: a quoted name with a colon after it, and another function's properties block
    between an entry's header and its "Used N registers" line (a non-inlined device function).
    The other function's frame does not become the entry's, and an unknown entry takes nothing."""
    low = {"foo<1>": "_Z3fooi", "bar<2>": "_Z3bari"}
    quoted = ("ptxas info    : Compiling entry function '_Z3fooi' for 'sm_90a'\n"
              "ptxas info    : Function properties for '_Z3fooi':\n"
              "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
              "ptxas info    : Used 29 registers, used 0 barriers\n")
    r = compile_check.parse_ptxas_log(quoted, low, "90a")[0]
    assert (r.registers, r.stack, r.spill_stores) == (29, 0, 0), r
    between = ("ptxas info    : Compiling entry function '_Z3bari' for 'sm_90a'\n"
               "ptxas info    : Function properties for _Z3bari\n"
               "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
               "ptxas info    : Function properties for _Z6helperv\n"
               "ptxas         .     24 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
               "ptxas info    : Used 212 registers, used 1 barriers\n"
               "ptxas info    : Compiling entry function '_Z5otherv' for 'sm_90a'\n"
               "ptxas info    : Used 7 registers\n")
    reps = {r.name: r for r in compile_check.parse_ptxas_log(between, low, "90a")}
    assert (reps["bar<2>"].registers, reps["bar<2>"].stack, reps["bar<2>"].spill_stores) == (212, 0, 0)
    assert reps["foo<1>"].registers is None


def test_log_context_and_report_message():
    """An assertion message about a kernel's ptxas report: the lines around its lowered name, or
    the whole log when no line names it; a PTX fallback's log is called one."""
    lines = [f"line {i}" for i in range(30)]
    lines[12] = "ptxas info    : Compiling entry function '_Z3fooi' for 'sm_90a'"
    log = "\n".join(lines)
    ctx = compile_check.log_context(log, "_Z3fooi", around=2)
    assert ctx.splitlines()[1:6] == lines[10:15] and "line 9\n" not in ctx and "left out" in ctx
    whole = compile_check.log_context(log, "_Z3bari")
    assert "is in no line" in whole and "line 0" in whole and "line 29" in whole
    rep = compile_check.KernelReport("bar<2>", "90a")
    msg = compile_check.report_message(rep, {"bar<2>": "_Z3bari"}, "[no cubin for sm_90a, PTX ...]\n", "NVRTC 13.0")
    assert "registers=None" in msg and "NVRTC 13.0" in msg and "PTX fallback" in msg


def test_sm90a_compile_info_records_the_nvrtc_and_the_cache(tmp_path, monkeypatch):
    """compile_info (no NVRTC needed: a fake binding): the NVRTC that made a cubin is kept beside
    its log in the cache and reported, with whether the result came from the cache; a module
    NVRTC cannot make a cubin of comes back as the PTX fallback, marked as one."""
    from portattn.backends.cupy import sm90a

    class Fake:
        calls = []

        def version(self):
            return (13, 0)

        def describe(self):
            return "fake binding, NVRTC 13.0"

        def compile(self, src, names, options):
            Fake.calls.append(options)
            if "fail" in src and any(o.startswith("--ptxas") for o in options):
                raise sm90a.Sm90aCompileError("no sm_90a here")
            return b"binary", {n: "_Z" + n for n in names}, "ptxas info    : Used 9 registers"

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sm90a, "nvrtc_binding", Fake)
    first = sm90a.compile_info("src", ["k"])
    assert not first["cached"] and first["nvrtc"] == "fake binding, NVRTC 13.0" and not first["ptx_fallback"]
    again = sm90a.compile_info("src", ["k"])
    assert again["cached"] and again["nvrtc"] == first["nvrtc"] and again["log"] == first["log"]
    assert len(Fake.calls) == 1 and sm90a.compile_cubin("src", ["k"], with_log=True)[2] == first["log"]
    ptx = sm90a.compile_info("fail", ["k"])
    assert ptx["ptx_fallback"] and ptx["path"].endswith(".ptx") and ptx["log"].startswith("[no cubin")
    assert sm90a.compile_info("fail", ["k"])["ptx_fallback"]

# ----- configuration choice -------------------------------------------------------------------
@pytest.mark.parametrize("d,dv,expected", [(1, 1, 32), (8, 8, 32), (32, 32, 32), (33, 16, 64), (64, 128, 128),
                                           (72, 72, 96), (128, 128, 128), (129, 64, 160), (200, 200, 224),
                                           (256, 256, 256), (257, 64, None)])
def test_padded_head_dim(d, dv, expected):
    assert configs.padded_head_dim(d, dv) == expected


def test_forward_config_families():
    assert configs.forward_config("bfloat16", 128, 128).family == "fwd_mma"
    assert configs.forward_config("float16", 40, 40).head_dim == 64
    assert configs.forward_config("float32", 128, 128).family == "fwd_fma"
    assert configs.forward_config("float32", 300, 300) is None
    assert configs.backward_config("bfloat16", 96, 64) == configs.KernelConfig("bwd_mma", "bfloat16", 96)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("d,dv", [(1, 1), (8, 8), (32, 32), (40, 24), (64, 64), (72, 96), (128, 128), (100, 128),
                                  (129, 64), (160, 160), (256, 256)])
def test_backward_family_choice(dtype, d, dv, monkeypatch):
    """Tensor cores for fp16/bf16 at every head dim (Dv != D included); FMA for float32."""
    monkeypatch.delenv(configs.BACKWARD_ENV, raising=False)
    cfg = configs.backward_config(dtype, d, dv)
    hd = configs.padded_head_dim(d, dv)
    mma = dtype != "float32"
    assert cfg == configs.KernelConfig("bwd_mma" if mma else "bwd", dtype, hd)
    assert configs.fma_backward_config(dtype, d, dv) == configs.KernelConfig("bwd", dtype, hd)
    if mma:
        names = cfg.kernel_names()
        assert set(names) == {"preprocess", "dkdv", "dkdv_extras", "dq", "dq_extras"}
        assert names["preprocess"] == f"attn_bwd_preprocess<{cfg.ctype}>"
        assert names["dkdv"].startswith(f"attn_bwd_dkdv_mma<{cfg.ctype}, {hd}, ") and names["dkdv"].endswith("false>")
        split = 1 if hd <= 128 else 2   # dK/dV head-dim split above 128
        assert names["dkdv"].endswith(f", {split}, false>")
        assert names["dq_extras"].startswith(f"attn_bwd_dq_mma<{cfg.ctype}, {hd}, ") and names["dq_extras"].endswith("true>")


def test_bwd_mma_tiles_and_smem():
    """Tile shapes fit the kernels' constraints; shared memory mirrors attn_bwd_mma.cu's carve-up
    and stays under the sm_80 (163 KB) and sm_90 (227 KB) opt-in limits."""
    for hd in configs.HEAD_DIM_BUCKETS:
        cfg = configs.KernelConfig("bwd_mma", "bfloat16", hd)
        for role in ("dkdv", "dkdv_extras", "dq", "dq_extras"):
            warps, tile, split = configs.bwd_mma_tile(hd, role)
            assert tile % 16 == 0 and hd % 16 == 0 and warps * 32 == cfg.threads(role)
            assert split in (1, 2) and (hd // split) % 16 == 0 and warps % split == 0
            assert split == 1 or (role.startswith("dkdv") and hd > 128)
            assert cfg.block_rows(role) == 16 * warps // split
            lds = hd + 8
            if role.startswith("dkdv"):   # K, V | Q, dO double-buffered | lse2, delta | pair partials
                partials = warps * 2 * (tile * 16) * 4 if split == 2 else 0
                expect = 2 * (16 * warps // split) * lds * 2 + 2 * 2 * tile * lds * 2 + 2 * 2 * tile * 4 + partials
            else:
                expect = 2 * (16 * warps) * lds * 2 + 2 * 2 * tile * lds * 2
            assert cfg.smem_bytes(role) == expect
            assert expect <= min(configs.SMEM_LIMITS.values())
    assert compile_check.smem_violations() == []
    assert compile_check.smem_violations(archs=(80,), head_dims=(128,)) == []


def test_backward_env_switch(monkeypatch):
    """PORTATTN_CUPY_BACKWARD: auto (tensor cores everywhere), mma128 (the FMA kernels above
    padded head dim 128, as before issue 16), fma (the FMA kernels always); float32 is FMA in
    every mode; a bad value is a ValueError naming the choices."""
    env = configs.BACKWARD_ENV
    for value, fam_64, fam_256 in (("", "bwd_mma", "bwd_mma"), ("auto", "bwd_mma", "bwd_mma"),
                                   ("mma128", "bwd_mma", "bwd"), ("FMA", "bwd", "bwd")):
        monkeypatch.setenv(env, value)
        assert configs.backward_config("bfloat16", 64, 64).family == fam_64, value
        assert configs.backward_config("float16", 256, 200).family == fam_256, value
        assert configs.backward_config("float32", 64, 64).family == "bwd", value
    monkeypatch.setenv(env, "tensorcores")
    with pytest.raises(ValueError, match="PORTATTN_CUPY_BACKWARD.*auto, mma128, fma"):
        configs.backward_config("bfloat16", 64, 64)
    # the compile check's list does not depend on the variable
    monkeypatch.setenv(env, "fma")
    assert configs.KernelConfig("bwd_mma", "bfloat16", 256) in configs.all_configs()


def test_backward_falls_back_to_fma_when_shared_memory_is_short():
    """sm_86 / sm_89 (99 KB opt-in): the tensor-core modules from HD 128 up (dQ: 102 KB at 128)
    need more, the FMA one runs."""
    small = 99 * 1024
    assert configs.backward_config("bfloat16", 96, 96, smem_limit=small).family == "bwd_mma"
    for d in (128, 160, 256):
        cfg = configs.backward_config("bfloat16", d, d, smem_limit=small)
        assert cfg.family == "bwd" and cfg.head_dim == d
    assert configs.backward_config("bfloat16", 256, 256, smem_limit=227 * 1024).family == "bwd_mma"


def test_smem_violations_reported(monkeypatch):
    monkeypatch.setattr(configs, "SMEM_LIMITS", {80: 1000, 90: 227 * 1024})
    bad = compile_check.smem_violations(archs=(80,), head_dims=(64,))
    assert bad and all("sm_80" in b for b in bad)


def test_all_configs_cover_every_choice_and_fit_shared_memory():
    cfgs = set(configs.all_configs())
    for dtype in configs.CTYPES:
        for d in range(1, configs.MAX_HEAD_DIM + 1, 7):
            assert configs.forward_config(dtype, d, d) in cfgs
            assert configs.backward_config(dtype, d, d) in cfgs
    names = configs.all_name_expressions()
    assert len(names) == len(set(names))
    for cfg in cfgs:
        assert cfg.max_smem_bytes() <= 163 * 1024, (cfg, cfg.max_smem_bytes())   # A100 opt-in limit
        assert all(cfg.threads(role) % 32 == 0 for role in cfg.kernel_names())
    for dtype in configs.CTYPES:   # the forced-FMA backward is launchable for every dtype, too
        for d in range(1, configs.MAX_HEAD_DIM + 1, 7):
            assert configs.fma_backward_config(dtype, d, d) in cfgs


def test_mma_tiles_match_kernel_constraints():
    for hd in configs.HEAD_DIM_BUCKETS:
        for extras in (False, True):
            warps, bn, mt = configs.mma_tile(hd, extras)
            assert hd % 16 == 0 and bn % 16 == 0 and warps * 32 <= 1024 and mt in (1, 2)
            cfg = configs.KernelConfig("fwd_mma", "float16", hd)
            role = "extras" if extras else "plain"
            assert cfg.kernel_names()[role] == f"attn_fwd_mma<pa_half, {hd}, {warps}, {bn}, {mt}, 1, {str(extras).lower()}>"
            assert cfg.block_rows(role) == 16 * mt * warps and cfg.threads(role) == 32 * warps
            two = configs.KernelConfig("fwd_mma", "float16", hd, kv_stages=2)
            assert two.kernel_names()[role] == f"attn_fwd_mma<pa_half, {hd}, {warps}, {bn}, {mt}, 2, {str(extras).lower()}>"
            # two K and two V buffers: the K/V part of the shared memory doubles, Q's does not
            assert two.smem_bytes(role) - cfg.smem_bytes(role) == 2 * bn * (hd + 8) * 2
            assert two.block_rows(role) == cfg.block_rows(role) and two.threads(role) == cfg.threads(role)


def test_forward_kv_stages_switch(monkeypatch):
    """PORTATTN_CUPY_FWD_KV_STAGES picks the tensor-core forward's K/V pipeline; float32 keeps its
    FMA kernel; a bad value is a ValueError naming the variable; both are compiled (all_configs)."""
    monkeypatch.delenv(configs.FORWARD_KV_STAGES_ENV, raising=False)
    assert configs.forward_config("bfloat16", 128, 128).kv_stages == 1
    monkeypatch.setenv(configs.FORWARD_KV_STAGES_ENV, "2")
    cfg = configs.forward_config("bfloat16", 128, 128)
    assert cfg.kv_stages == 2 and cfg.family == "fwd_mma" and cfg in set(configs.all_configs())
    assert configs.forward_config("float32", 128, 128) == configs.KernelConfig("fwd_fma", "float32", 128)
    assert configs.forward_config("float16", 64, 64, kv_stages=1).kv_stages == 1
    plan = runtime.plan_forward(_spec(torch.bfloat16))
    assert plan.launches[0].cfg.kv_stages == 2
    monkeypatch.setenv(configs.FORWARD_KV_STAGES_ENV, "3")
    with pytest.raises(ValueError, match=configs.FORWARD_KV_STAGES_ENV):
        configs.forward_config("bfloat16", 128, 128)
    with pytest.raises(ValueError, match="kv_stages"):
        configs.forward_config("bfloat16", 128, 128, kv_stages=4)


def test_cache_keys_distinguish_configs_and_devices():
    a = configs.KernelConfig("fwd_mma", "float16", 128)
    b = configs.KernelConfig("fwd_mma", "bfloat16", 128)
    c = configs.KernelConfig("fwd_mma", "float16", 64)
    d = configs.KernelConfig("fwd_mma", "float16", 128, kv_stages=2)
    keys = {runtime.cache_key(x, 0) for x in (a, b, c, d)} | {runtime.cache_key(a, 1)}
    assert len(keys) == 5
    assert runtime.cache_key(a, 0) == runtime.cache_key(configs.KernelConfig("fwd_mma", "float16", 128), 0)


# ----- launch arguments against the kernel signatures ---------------------------------------
def _param_count(kernel: str) -> int:
    src = configs.source()
    macro = re.search(r"#define PA_COMMON_PARAMS(.*?)\n\n", src, re.S).group(1)
    n_common = macro.count(",") + 1
    start = src.index(f"\n{kernel}(") + len(kernel) + 2
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        i += 1
    params = src[start:i - 1]
    n = params.count(",") + 1
    return n - 1 + n_common if "PA_COMMON_PARAMS" in params else n


def _spec(dtype=torch.float16, **kw):
    q = torch.randn(2, 37, 4, 40, dtype=dtype)
    k = torch.randn(2, 50, 2, 40, dtype=dtype)
    v = torch.randn(2, 50, 2, 24, dtype=dtype)
    return build_spec(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"softcap": 3.0}, {"window": (4, 2)}])
def test_forward_plan_matches_signature(dtype, kw):
    spec = _spec(dtype, **kw)
    plan = runtime.plan_forward(spec)
    (launch,) = plan.launches
    kernel = "attn_fwd_mma" if dtype != torch.float32 else "attn_fwd_fma"
    assert launch.cfg.family == ("fwd_mma" if dtype != torch.float32 else "fwd_fma")
    assert len(launch.args) == _param_count(kernel)
    assert launch.role == ("extras" if "softcap" in kw and dtype != torch.float32 else "plain")
    assert launch.grid == (-(-37 // launch.cfg.block_rows(launch.role)), 4, 2)
    out, lse = plan.outputs
    assert out.shape == spec.out_shape and lse.shape == spec.lse_shape and lse.dtype == torch.float32
    if dtype != torch.float32:   # D=40, Dv=24 are padded to multiples of 8 for cp.async
        q_used = plan.keep_alive[0]
        assert q_used.shape[-1] == 40 and q_used.stride(-2) % 8 == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_plan_matches_signatures(dtype):
    """The FMA backward (float32; fp16/bf16 when forced)."""
    spec = _spec(dtype, causal=True)
    out = torch.randn(spec.out_shape, dtype=dtype)
    lse = torch.randn(spec.lse_shape)
    fma = configs.fma_backward_config(runtime._DTYPE_NAMES[dtype], spec.head_dim, spec.head_dim_v)
    plan = runtime.plan_backward(spec, out, lse, torch.randn_like(out), fma)
    roles = {item.role: item for item in plan.launches}
    first = "stats" if dtype == torch.float32 else "preprocess"   # float32: exact row statistics
    assert [item.role for item in plan.launches] == [first, "dkdv", "dq"]
    for role, kernel in ((first, f"attn_bwd_{first}"), ("dkdv", "attn_bwd_dkdv"), ("dq", "attn_bwd_dq")):
        assert len(roles[role].args) == _param_count(kernel), role
    stats_ptrs = [int(a) for a in roles["dq"].args[-2:]]
    assert (all(stats_ptrs) if dtype == torch.float32 else not any(stats_ptrs))
    assert set(roles[first].cfg.kernel_names()) == {first, "dkdv", "dq"}
    assert roles["dkdv"].grid == (-(-50 // configs.BWD_BLOCK_N), 2, 2)
    dq, dk, dv = plan.outputs
    assert dq.shape == spec.q.shape and dk.shape == spec.k.shape and dv.shape == spec.v.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kw,suffix", [({"causal": True}, ""), ({"window": (4, 2)}, ""), ({"softcap": 3.0}, "_extras"),
                                       ({"alibi_slopes": torch.rand(4)}, "_extras")])
def test_backward_mma_plan_matches_signatures(dtype, kw, suffix):
    """fp16/bf16 at D=40, Dv=24 (padded head dim 64) run the tensor-core backward."""
    spec = _spec(dtype, **kw)
    out = torch.randn(spec.out_shape, dtype=dtype)
    lse = torch.randn(spec.lse_shape)
    plan = runtime.plan_backward(spec, out, lse, torch.randn_like(out))
    roles = [item.role for item in plan.launches]
    assert roles == ["preprocess", "dkdv" + suffix, "dq" + suffix]
    launches = dict(zip(roles, plan.launches))
    cfg = plan.launches[0].cfg
    assert cfg == configs.KernelConfig("bwd_mma", runtime._DTYPE_NAMES[dtype], 64)
    for role, kernel in (("preprocess", "attn_bwd_preprocess"), ("dkdv" + suffix, "attn_bwd_dkdv_mma"),
                         ("dq" + suffix, "attn_bwd_dq_mma")):
        assert len(launches[role].args) == _param_count(kernel), role
    assert launches["dkdv" + suffix].grid == (-(-50 // cfg.block_rows("dkdv")), 2, 2)
    assert launches["dq" + suffix].grid == (-(-37 // cfg.block_rows("dq")), 4, 2)
    dq, dk, dv = plan.outputs
    assert dq.shape == spec.q.shape and dk.shape == spec.k.shape and dv.shape == spec.v.shape
    # gradients are written at the 8-aligned widths the kernels store pairs into, then sliced
    dq_buf, dk_buf, dv_buf = plan.keep_alive[-3:]
    assert dq_buf.shape[-1] == 40 and dv_buf.shape[-1] == 24 and dk_buf.is_contiguous()
    for buf in (dq_buf, dk_buf, dv_buf):
        assert all(st % 8 == 0 for st in buf.stride()[:-1])
    # dO with an unaligned row is padded, like q/k/v
    spec3 = build_spec(*(torch.randn(1, 9, 2, 20, dtype=dtype) for _ in range(3)))
    p3 = runtime.plan_backward(spec3, torch.randn(spec3.out_shape, dtype=dtype), torch.randn(spec3.lse_shape),
                               torch.randn(spec3.out_shape, dtype=dtype))
    assert p3.keep_alive[2].shape[-1] == 24 and [o.shape for o in p3.outputs] == [(1, 9, 2, 20)] * 3


@pytest.mark.parametrize("d,dv", [(256, 256), (192, 64), (64, 232)])
def test_backward_mma_plan_above_head_dim_128(d, dv, monkeypatch):
    """Padded head dim > 128 (Dv != D too): the tensor-core backward, with the dK/dV grid over
    64-key CTAs (8 warps, two per 16 keys)."""
    monkeypatch.delenv(configs.BACKWARD_ENV, raising=False)
    q = torch.randn(2, 37, 4, d, dtype=torch.bfloat16)
    k = torch.randn(2, 130, 2, d, dtype=torch.bfloat16)
    v = torch.randn(2, 130, 2, dv, dtype=torch.bfloat16)
    spec = build_spec(q, k, v, causal=True)
    out = torch.randn(spec.out_shape, dtype=torch.bfloat16)
    plan = runtime.plan_backward(spec, out, torch.randn(spec.lse_shape), torch.randn_like(out))
    roles = [item.role for item in plan.launches]
    assert roles == ["preprocess", "dkdv", "dq"]
    launches = dict(zip(roles, plan.launches))
    cfg = plan.launches[0].cfg
    assert cfg == configs.KernelConfig("bwd_mma", "bfloat16", configs.padded_head_dim(d, dv))
    assert cfg.block_rows("dkdv") == 64 and cfg.threads("dkdv") == 256
    assert launches["dkdv"].grid == (-(-130 // 64), 2, 2)
    assert launches["dq"].grid == (-(-37 // cfg.block_rows("dq")), 4, 2)
    for role, kernel in (("dkdv", "attn_bwd_dkdv_mma"), ("dq", "attn_bwd_dq_mma")):
        assert len(launches[role].args) == _param_count(kernel), role
    assert [o.shape for o in plan.outputs] == [q.shape, k.shape, v.shape]
    monkeypatch.setenv(configs.BACKWARD_ENV, "fma")
    fma_plan = runtime.plan_backward(spec, out, torch.randn(spec.lse_shape), torch.randn_like(out))
    assert fma_plan.launches[1].cfg.family == "bwd" and fma_plan.launches[1].role == "dkdv"


def test_varlen_plan_uses_packed_strides():
    q = torch.randn(30, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    spec = build_spec(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)
    (launch,) = runtime.plan_forward(spec).launches
    assert launch.args[3] == 0 and launch.args[4] == q.stride(0)          # q: batch stride 0, token stride
    assert launch.grid == (1, 2, 2)                                         # max_seqlen 20 <= 128 rows
    assert runtime.plan_forward(spec).outputs[1].shape == (2, 30)


def test_bias_conversion_keeps_broadcast():
    bias = torch.randn(1, 1, 5, 7, dtype=torch.float64).expand(3, 4, 5, 7)
    conv = runtime._compact_bias(bias)
    assert conv.dtype == torch.float32 and conv.stride()[:2] == (0, 0)
    assert torch.equal(conv, bias.float())


def test_empty_problem_plans_nothing():
    q = torch.randn(2, 0, 4, 64, dtype=torch.float16)
    k = torch.randn(2, 10, 4, 64, dtype=torch.float16)
    plan = runtime.plan_forward(build_spec(q, k, k))
    assert plan.launches == [] and plan.outputs[0].shape == (2, 0, 4, 64)


# ----- reasons -----------------------------------------------------------------------------
def test_reasons_without_cupy_or_device():
    be = CupyBackend()
    reasons = be.not_supported_reasons(_spec())
    assert reasons, "a CPU tensor must never be accepted"
    if not torch.cuda.is_available():
        joined = " ".join(reasons)
        assert "cupy" in joined or "CUDA" in joined or "device" in joined


def test_problem_reasons_limits():
    assert problem_reasons(_spec(), smem_limit=None) == []
    q = torch.randn(1, 8, 2, 300, dtype=torch.float16)
    (r,) = problem_reasons(build_spec(q, q, q), smem_limit=None)
    assert "300" in r and "256" in r
    q = torch.randn(1, 8, 2, 256, dtype=torch.float16, requires_grad=True)
    small = problem_reasons(build_spec(q, q, q), smem_limit=99 * 1024)
    assert any("shared memory" in r and "bwd" in r for r in small)


def test_kernel_families_name_the_backward_path():
    from portattn.backends.cupy import kernel_families

    def spec(dtype, d):
        q = torch.randn(1, 8, 2, d, dtype=dtype, requires_grad=True)
        return build_spec(q, q, q)

    assert kernel_families(spec(torch.bfloat16, 128))["backward"].startswith("bwd_mma (tensor-core backward")
    assert "padded head dim 64;" in kernel_families(spec(torch.float16, 40))["backward"]
    assert kernel_families(spec(torch.float16, 160))["backward"].startswith("bwd_mma (tensor-core backward")
    assert kernel_families(spec(torch.float16, 256), smem_limit=99 * 1024)["backward"].startswith("bwd (FMA")
    assert kernel_families(spec(torch.float32, 64))["backward"].startswith("bwd (FMA backward")
    assert kernel_families(spec(torch.float32, 64))["forward"].startswith("fwd_fma")
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    assert "backward" not in kernel_families(build_spec(q, q, q))


def test_declared_capabilities():
    be = CupyBackend()
    assert be.vendors == frozenset({"nvidia"}) and be.has_backward and be.deterministic
    assert "bias_grad" not in be.features and be.head_dims == (1, 256)


@needs_nvrtc
def test_scores_are_rounded_before_the_max_is_subtracted():
    """The float32 backward takes the row max and sum over rounded scores, so the exponent must
    use the same rounded score: the score product is __fmul_rn (``mul.rn.f32`` in the PTX), which
    nvrtc never contracts into fma(dot, scale, -m) (that made dq 26x the naive error at extreme
    logits on the H200, 2026-11-29)."""
    names = ["attn_bwd_stats<float, 32>", "attn_bwd_dq<float, 32>"]
    ptx = compile_check.ptx_for(names, 90)
    entries = re.split(r"\.entry ", ptx)[1:]
    assert len(entries) == len(names)
    for entry in entries:
        assert "mul.rn.f32" in entry, entry.split("(")[0]


@needs_nvrtc
def test_float32_scores_accumulate_in_float64():
    """The float32 kernels sum q . k in float64 (``fma.rn.f64`` in the PTX): the float32 FMA chain
    over D gave dV 5.9x the naive error on the H200 (Sq=1, D=32, 2026-11-29). 16-bit inputs keep
    the float32 chain (no float64 arithmetic in their backward)."""
    names = ["attn_fwd_fma<float, 32>", "attn_bwd_dq<float, 32>", "attn_bwd_dkdv<float, 32>",
             "attn_bwd_dq<pa_bf16, 256>"]
    ptx = compile_check.ptx_for(names, 90)
    entries = re.split(r"\.entry ", ptx)[1:]
    assert len(entries) == len(names)
    f64 = {entry.split("(")[0].strip(): "fma.rn.f64" in entry for entry in entries}
    assert sum(f64.values()) == 3, f64
    assert not [name for name, has in f64.items() if "bf16" in name and has], f64
