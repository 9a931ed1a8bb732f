"""CPU tests of tools/cupy_wgmma_bwd_check.py (the H200 run of the wgmma backward): its argument
parsing, the verdict and the report built from synthetic results, that every check case runs the
wgmma backward, and its sm_90a compile step (registers / spills and the SASS counts it reports);
the timing helper both wgmma tools share, and the forward tool's family -> module map."""

import os
import sys

import pytest
from portattn.backends.cupy import compile_check, configs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import cupy_wgmma_bwd_check as tool  # noqa: E402
from test_cupy_wgmma import needs_nvrtc  # noqa: E402


def test_parse_args():
    a = tool.parse_args(["--out", "/tmp/x"])
    assert a.out == "/tmp/x" and a.time_limit == 185.0 and a.child is None and not a.no_tests
    assert tool.parse_args(["--time-limit", "50", "--no-tests"]).no_tests
    with pytest.raises(SystemExit):
        tool.parse_args(["--time-limit", "0"])
    with pytest.raises(SystemExit):
        tool.parse_args(["--child", "everything"])


def test_check_cases_run_the_wgmma_backward():
    seen = set()
    for name, _b, _sq, _sk, hq, hkv, d, dv, kw, dt in tool.CHECK_CASES:
        cfg = configs.wgmma_backward_config(dt, d, dv)
        assert cfg is not None and cfg.family == "bwd_wgmma", name
        assert hq % hkv == 0, name
        seen.add(cfg.head_dim)
        assert not any(x in kw for x in ("softcap", "alibi", "bias")), name
    assert seen == set(configs.WGMMA_BWD_HEAD_DIMS)
    assert {d for _, d, _ in tool.TIME_CELLS} == set(configs.WGMMA_BWD_HEAD_DIMS)


def _grads(score=0.5):
    return {n: {"passed": True, "score": score, "max_err": 1e-3, "tol": 1e-2, "nan": 0, "max_diff_vs_mma": 1e-3,
                "text": f"{n} ok"} for n in ("dq", "dk", "dv")}


def _result(**over):
    kern = {"registers": 200, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 1000}
    res = {"device": "H200", "compile": {"errors": [], "modules": {"m": {"kernels": {
        "attn_bwd_dkdv_wgmma<pa_bf16, 128, 64, 2>": dict(kern)}}},
        "sass": {"m": {"_Z19attn_bwd_dkdv_wgmma": {"HGMMA": 24, "HMMA": 0, "LDL": 0, "STL": 0}}}},
        "checks": {"rc": 0, "rows": [{"case": c[0], "dtype": c[-1], "grads": _grads(), "repeat_bit_identical": True,
                                      "empty_rows": 0, "passed": True} for c in tool.CHECK_CASES]},
        "timings": {"rc": 0, "rows": [{"S": 4096, "D": 128, "causal": False, "wgmma_tflops": 300.0,
                                       "mma_tflops": 150.0, "fa2_tflops": 250.0, "cudnn_tflops": 450.0}]}}
    res.update(over)
    return res


def test_verdict_and_report():
    res = _result()
    tool.verdict(res)
    assert res["verdict"] == "PASS", res["why"]
    text = tool.report(res)
    assert text.splitlines()[-1].startswith("mma / fa2: geomean 0.600")
    assert "wgmma / mma: geomean 2.000" in text and "VERDICT (attn_bwd_*_wgmma): PASS" in text

    spilled = _result()
    spilled["compile"]["modules"]["m"]["kernels"]["attn_bwd_dkdv_wgmma<pa_bf16, 128, 64, 2>"]["spill_stores"] = 8
    tool.verdict(spilled)
    assert spilled["verdict"] == "FAIL" and "spills" in spilled["why"]
    # the opt-in overlapped walk's kernel may spill <= 8 bytes (NVRTC 13.0 spills 4 there), not more
    opt_in = configs.KernelConfig("bwd_wgmma", "bfloat16", 128, tile=(1,)).kernel_names()["dkdv"]
    for nbytes, verdict in ((4, "PASS"), (12, "FAIL")):
        r = _result()
        r["compile"]["modules"]["m"]["kernels"][opt_in] = {"registers": 255, "spill_stores": nbytes,
                                                           "spill_loads": nbytes, "stack": 8, "smem": 1000}
        tool.verdict(r)
        assert r["verdict"] == verdict, r["why"]
        assert (opt_in in tool.report(r)) == (verdict == "PASS" or opt_in in r["why"])

    failed = _result()
    failed["checks"]["rows"][3]["passed"] = False
    failed["checks"]["rows"][3]["grads"]["dk"]["text"] = "dk: max err 9 > tol 1"
    tool.verdict(failed)
    assert failed["verdict"] == "FAIL" and tool.CHECK_CASES[3][0] in failed["why"]
    assert "dk: max err 9 > tol 1" in tool.report(failed)

    short = _result()
    short["checks"] = {"rc": "timeout", "rows": short["checks"]["rows"][:2]}
    tool.verdict(short)
    assert short["verdict"] == "FAIL" and "only 2/" in short["why"]

    no_hgmma = _result()
    no_hgmma["compile"]["sass"]["m"]["_Z19attn_bwd_dkdv_wgmma"]["HGMMA"] = 0
    tool.verdict(no_hgmma)
    assert no_hgmma["verdict"] == "FAIL"

    timed_out_tests = _result(tests={"rc": "timeout", "passed": False, "seconds": 40.0, "tail": []})
    tool.verdict(timed_out_tests)
    assert timed_out_tests["verdict"] == "PASS"
    failed_tests = _result(tests={"rc": 1, "passed": False, "seconds": 10.0, "tail": ["1 failed"]})
    tool.verdict(failed_tests)
    assert failed_tests["verdict"] == "FAIL"

    # the other walk (overlapped or not): its own line, from the rows' bit-equality with the default
    assert "the other walk" in text and "NOT RUN" in text      # rows without the field: not run
    other = _result()
    for r in other["checks"]["rows"]:
        r["other_walk_bit_identical"] = True
    assert "PASS (the same bits in every check)" in tool.report(other)
    other["checks"]["rows"][1]["other_walk_bit_identical"] = False
    tool.verdict(other)
    assert other["verdict"] == "PASS"                          # the default's verdict does not change
    assert f"FAIL (different bits in 1 of {len(tool.CHECK_CASES)} checks)" in tool.report(other)


@pytest.mark.parametrize("hd,nbytes,verdict", [
    (128, 4, "PASS"), (128, 8, "PASS"), (128, 12, "FAIL"),
    (64, 4, "FAIL"),   # HD 64's fused kernel, in the overlap modules too, is not an opt-in walk kernel
    (64, 0, "PASS")])
def test_verdict_allows_fused_dq_spills_where_configs_does(hd, nbytes, verdict):
    """The fused-dQ dK/dV may spill at the head dims of configs.WGMMA_BWD_FUSED_DQ_SPILL_BYTES (HD
    128: 4 bytes under NVRTC 13.0 and 13.5), at most 8 bytes, and is then listed as allowed; HD
    64's may not spill at all."""
    assert set(configs.WGMMA_BWD_FUSED_DQ_SPILL_BYTES) == {128}
    fused = configs.KernelConfig("bwd_wgmma", "bfloat16", hd).kernel_names()["dkdv_dq"]
    r = _result()
    r["compile"]["modules"]["m"]["kernels"][fused] = {"registers": 255, "spill_stores": nbytes,
                                                      "spill_loads": nbytes, "stack": 8 if nbytes else 0,
                                                      "smem": 1000}
    tool.verdict(r)
    assert r["verdict"] == verdict, r["why"]
    assert (fused in r["opt_in_spills"]) == (verdict == "PASS" and nbytes > 0)
    if verdict == "FAIL":
        assert fused in r["why"]


@needs_nvrtc
def test_compile_step_reports_registers_and_hgmma(tmp_path, monkeypatch):
    """The tool's sm_90a compile of a bwd_wgmma module (the cache in tmp_path): every kernel with
    registers and no spills (the fused-dQ dK/dV of HD 64 too), and HGMMA in the SASS of the three
    wgmma kernels (dK/dV, dQ and the fused-dQ dK/dV, whose third chain dQ += dS K adds 128 keys / 16
    = 8 per tile to the dK/dV's) when cuobjdump exists."""
    from cupy_wgmma_check import _compile_sm90a, _cuobjdump, sass_counts

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    cfg, secs, err, info = _compile_sm90a(("bwd_wgmma", "bfloat16", 64, None))
    assert err is None, err
    kernels = info["kernels"]
    names = configs.KernelConfig("bwd_wgmma", "bfloat16", 64).kernel_names()
    assert set(names) == {"preprocess", "dkdv", "dq", "dkdv_dq", "dkdv_dq_ws"}
    assert names["dkdv_dq"] == "attn_bwd_dkdv_wgmma<pa_bf16, 64, 64, 2, false, true>"
    # the warp-specialized kernel: its producer's spill, within configs.WGMMA_BWD_WS_SPILL_BYTES
    ws = {names[r] for r in configs.WS_FUSED_DQ_ROLES}
    assert set(kernels) == set(configs.KernelConfig("bwd_wgmma", "bfloat16", 64).name_expressions())
    assert "NVRTC" in info["nvrtc"] and not info["cached"], info.get("nvrtc")
    # ptxas -v's lines where NVRTC's log has them, the cubin's resource usage where it lacks them
    assert all(k["from"] in ("ptxas -v", "cuobjdump -res-usage") for k in kernels.values()), kernels
    assert info["log"] or all(k["from"] == "cuobjdump -res-usage" for k in kernels.values()), kernels
    for name, k in kernels.items():
        # on a failure: the parsed report, which NVRTC made the log, and the log's lines about the
        # kernel (all of it when the kernel is in none): on the H200 (NVRTC 13.0) a kernel once
        # parsed with no registers here, with no log kept to say why
        rep = compile_check.KernelReport(name, "90a", k["registers"], k["spill_stores"], k["spill_loads"], k["stack"])
        why = compile_check.report_message(rep, info["lowered"], info["log"], f"{info['nvrtc']}; cached "
                                           f"{info['cached']}; PTX fallback {info['ptx_fallback']}")
        if name in ws:
            assert k["registers"] and max(k["spill_stores"] or 0, k["stack"] or 0, k.get("local") or 0) <= \
                configs.WGMMA_BWD_WS_SPILL_BYTES, why
            continue
        assert k["registers"] and not k["spill_stores"] and not k["stack"] and not k.get("local"), why
    if _cuobjdump() is None:
        pytest.skip("no cuobjdump")
    counts = sass_counts(info["cubin"])
    low = info["lowered"]
    wg = {n: c for n, c in counts.items() if "wgmma" in n}
    assert len(wg) == 4 and all(c["HGMMA"] > 0 and (c["LDL"] == 0 or n in {low[x] for x in ws})
                                for n, c in wg.items()), counts
    assert set(wg) == {low[names[r]] for r in ("dkdv", "dq", "dkdv_dq", "dkdv_dq_ws")}, counts
    assert wg[low[names["dkdv_dq"]]]["HGMMA"] == wg[low[names["dkdv"]]]["HGMMA"] + 128 // 16, counts
    # the same products per tile: dQ over the CTA's 128 keys
    assert wg[low[names["dkdv_dq_ws"]]]["HGMMA"] == wg[low[names["dkdv_dq"]]]["HGMMA"], counts


@needs_nvrtc
def test_registers_come_from_the_cubin_when_the_log_lacks_them(tmp_path, monkeypatch):
    """A compile whose NVRTC log is empty (as on the H200 with NVRTC 13.0 through cuda.bindings,
    now and then) still reports every kernel's registers and stack, read from the cubin by
    cuobjdump: the same numbers as the unpatched compile gives (ptxas -v's log where NVRTC kept
    the kernel's lines; on the H200 that log, too, may lack them, and then the cubin again)."""
    import cupy_wgmma_check as tool

    if tool._cuobjdump() is None:
        pytest.skip("no cuobjdump")
    from portattn.backends.cupy import sm90a

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "with_log"))
    cfg = ("bwd_wgmma", "bfloat16", 64, None)
    _, _, err, with_log = tool._compile_sm90a(cfg)
    assert err is None, err
    real = sm90a.compile_info
    monkeypatch.setattr(sm90a, "compile_info", lambda *a, **k: {**real(*a, **k), "log": ""})
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "no_log"))
    _, _, err, no_log = tool._compile_sm90a(cfg)
    assert err is None, err
    assert no_log["log"] == "" and set(no_log["kernels"]) == set(with_log["kernels"])
    for name, k in no_log["kernels"].items():
        assert k["from"] == "cuobjdump -res-usage"
        assert with_log["kernels"][name]["from"] in ("ptxas -v", "cuobjdump -res-usage")
        assert k["registers"] == with_log["kernels"][name]["registers"], k
        if "_ws<" in name:   # the warp-specialized kernels: the stack and spill ptxas reported
            assert k["stack"] == with_log["kernels"][name]["stack"] <= configs.WGMMA_BWD_WS_SPILL_BYTES, k
            continue
        assert k["stack"] == 0 and k["local"] == 0, k


def test_error_blocks_locate_the_wrong_warpgroup():
    """A failing case reports the max error per 64 tokens (a warpgroup's rows / keys) and per 64
    columns; a NaN the kernels never overwrote shows as 1e30; the report prints them."""
    import torch

    class Spec:
        is_varlen = False

    ref = torch.zeros(2, 200, 3, 128)
    dq = ref.clone()
    dq[1, 70, 2, 5] = float("nan")      # token block 1, column block 0
    dq[0, 190, 0, 100] = 0.25           # token block 2, column block 1
    blocks = tool.error_blocks(Spec(), (dq, ref, ref), (ref, ref, ref))
    assert blocks["dq"] == {"per_64_tokens": [0.0, 1e30, 0.25, 0.0], "per_64_cols": [1e30, 0.25]}
    assert blocks["dk"]["per_64_tokens"] == [0.0] * 4

    Spec.is_varlen = True   # (tokens, heads, D): no batch axis
    varlen = tool.error_blocks(Spec(), (dq[0], ref[0], ref[0]), (ref[0], ref[0], ref[0]))
    assert varlen["dq"]["per_64_tokens"] == [0.0, 0.0, 0.25, 0.0]

    res = _result()
    res["checks"]["rows"][0].update(passed=False, blocks=blocks)
    assert "dq max err per 64 tokens [0.0, 1e+30, 0.25, 0.0]" in tool.report(res)


def _reference_kernels(monkeypatch, hole=False):
    """Run the tool's checks on the CPU: plan_forward / plan_backward build their plans as on the
    GPU (CPU tensors launch nothing), and execute() fills the plan's outputs from the float64
    reference instead of launching kernels (``hole``: the dq of one row is left as it was)."""
    import torch
    from portattn.backends.cupy import runtime

    from portattn.reference import reference_forward
    from portattn.spec import build_spec

    orig_f, orig_b = runtime.plan_forward, runtime.plan_backward

    def plan_forward(spec, cfg=None):
        plan = orig_f(spec, cfg)
        plan.fake = ("fwd", spec)
        return plan

    def plan_backward(spec, out, lse, dout, cfg=None, dlse=None, fused_dq=None, persistent=None):
        plan = orig_b(spec, out, lse, dout, cfg, dlse, fused_dq, persistent)
        plan.fake = ("bwd", spec, dout, dlse, cfg)
        assert fused_dq is None or cfg.family == "bwd_wgmma"
        # the plan launches the fused dK/dV only where asked (and the module has it), the role asked
        role = fused_dq if isinstance(fused_dq, str) else "dkdv_dq"
        assert (role in [x.role for x in plan.launches]) == bool(fused_dq and spec.seqlen_k > 0)
        # the warp-specialized kernels on the grid asked: 3 CTAs for "ws3", one per work item for "ws1"
        ws = [x for x in plan.launches if x.role in configs.WS_FUSED_DQ_ROLES]
        if ws and isinstance(persistent, int) and not isinstance(persistent, bool):
            assert ws[0].grid[0] == min(persistent, -(-spec.seqlen_k // 128) * spec.num_heads_kv * spec.batch)
        return plan

    def execute(plan, device):
        kind, spec = plan.fake[:2]
        kw = {key: getattr(spec, key) for key in ("cu_seqlens_q", "cu_seqlens_k") if getattr(spec, key) is not None}
        kw.update(scale=spec.scale, window=(spec.window_left, spec.window_right) if spec.window_left is not None
                  or spec.window_right is not None else None, causal_alignment=spec.alignment)
        leaves = [t.detach().double().requires_grad_(True) for t in (spec.q, spec.k, spec.v)]
        o, lse = reference_forward(build_spec(*leaves, **{k: v for k, v in kw.items() if v is not None}))
        if kind == "fwd":
            for dst, src in zip(plan.outputs, (o, lse)):
                dst.copy_(src.detach())
            return
        _, _, dout, dlse, cfg = plan.fake
        assert cfg.family in ("bwd_wgmma", "bwd_mma")
        outs, seeds = [o], [dout.double()]
        if dlse is not None:
            outs.append(torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
            seeds.append(dlse)
        grads = torch.autograd.grad(outs, leaves, seeds)
        for i, (dst, src) in enumerate(zip(plan.outputs, grads)):
            if hole and i == 0 and cfg.family == "bwd_wgmma":
                src = src.clone()
                src.view(-1, src.shape[-2], src.shape[-1])[5] = dst.view(-1, dst.shape[-2], dst.shape[-1])[5]
            dst.copy_(src)

    monkeypatch.setattr(runtime, "plan_forward", plan_forward)
    monkeypatch.setattr(runtime, "plan_backward", plan_backward)
    monkeypatch.setattr(runtime, "execute", execute)
    monkeypatch.setattr(tool, "DEVICE", "cpu")


@pytest.mark.parametrize("case", [c for c in tool.CHECK_CASES if c[0] in
                                  ("d64_causal_br", "d128_causal_br_sq_gt_sk", "d64_varlen_causal", "d128_dv64",
                                   "d64_dlse_window_tl", "d40_pad64")], ids=lambda c: c[0])
def test_check_case_plumbing_on_cpu(monkeypatch, case):
    """check_case end to end on the CPU with reference 'kernels': every case of this selection
    (causal, rows with no key, varlen, Dv != D, dlse with a window, padding) passes, so on the
    H200 a failure is the kernels' and not the script's."""
    _reference_kernels(monkeypatch)
    row = tool.check_case(case)
    assert row["passed"], row
    assert row["repeat_bit_identical"] and set(row["grads"]) == {"dq", "dk", "dv"}
    assert all(g["nan"] == 0 and g["max_diff_vs_mma"] == 0 for g in row["grads"].values())
    # the fused atomic dQ is checked wherever the module has it (padded HD 64 / 128)
    assert ("fused" in row) == (case[6] <= 128)
    if "fused" in row:
        assert row["fused"]["passed"] and row["fused"]["dkdv_equal_kernel"] and row["fused"]["dq_max_diff_vs_kernel"] == 0
    if case[0] == "d128_causal_br_sq_gt_sk":
        assert row["empty_rows"] > 0 and row["empty_rows_zero_dq"]
    if case[0] == "d64_dlse_window_tl":   # top-left window (30, 10), Sk 300 > Sq 200: keys past 209 unseen
        assert row["unseen_keys"] > 0 and row["unseen_keys_zero_dv"]


def test_check_case_sees_an_unwritten_row(monkeypatch):
    """The same with one dq row never written: the NaN poison stays there and the case fails,
    with the error blocks pointing at the first 64 tokens."""
    _reference_kernels(monkeypatch, hole=True)
    row = tool.check_case(next(c for c in tool.CHECK_CASES if c[0] == "d64_causal_br"))
    assert not row["passed"] and row["grads"]["dq"]["nan"] > 0 and row["grads"]["dk"]["passed"]
    assert row["blocks"]["dq"]["per_64_tokens"][0] == 1e30


def test_time_side_by_side_reports_tflops_spread_and_errors():
    """The wgmma tools' timing helper (tools/_cupy_gpu_check.py) on the CPU clock: a callable that
    takes three times as long gets clearly fewer TFLOP/s (bounds loose enough for a loaded CI
    machine), one that raises is reported by name, not timed."""
    import time

    from _cupy_gpu_check import time_side_by_side

    from portattn import timing

    def busy(ms):
        def call():
            t = time.perf_counter()
            while time.perf_counter() - t < ms / 1e3:
                pass
        return call

    def broken():
        raise RuntimeError("no kernel")

    row = time_side_by_side({"fast": busy(0.5), "slow": busy(1.5), "broken": broken}, flops=1e9,
                            clock=timing.CpuClock(), rounds=5, round_ms=5.0)
    assert set(row) == {"fast_tflops", "fast_spread", "slow_tflops", "slow_spread", "broken_error"}
    assert "no kernel" in row["broken_error"]
    assert 1.5 < row["fast_tflops"] / row["slow_tflops"] < 6
    assert row["fast_tflops"] <= 1e9 / 0.5 * 1e-9 * 1.05   # never faster than the busy loop


def test_forward_check_tool_names_each_family_module():
    """tools/cupy_wgmma_check.py's family -> module map (its checks and its timings, which build
    each family's launch plan once): the default walk, the serial walk, the warp-specialized
    kernel with and without pingpong, and the mma.sync forward."""
    import cupy_wgmma_check as fwd_tool
    import torch

    from portattn.spec import build_spec

    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    spec = build_spec(q, q, q)
    cfg = {f: fwd_tool.forward_family_config(spec, f) for f in ("wgmma", "serial", "ws", "ws_nopp", "mma")}
    assert cfg["wgmma"] == configs.KernelConfig("fwd_wgmma", "bfloat16", 128)
    assert cfg["serial"].kernel_names()["plain"].endswith("false>") and cfg["serial"].family == "fwd_wgmma"
    assert cfg["ws"] == configs.KernelConfig("fwd_wgmma_ws", "bfloat16", 128)
    assert cfg["ws_nopp"].family == "fwd_wgmma_ws" and cfg["ws_nopp"].kernel_names()["plain"].endswith("false>")
    assert cfg["mma"].family == "fwd_mma" and cfg["mma"].kv_stages == 1
    assert len({c.name_expressions()[0] for c in cfg.values()}) == 5
