"""The experimental Gluon forward for Hopper (``backends/triton/gluon_fwd.py``, docs/triton.md).

Without a GPU: :func:`gluon_reasons` refuses what the kernel cannot run with a clear sentence, the
``PORTATTN_TRITON_FORWARD`` switch keeps today's kernel unless asked, the kernel cross-compiles for
sm_90 under whichever triton is installed (skipped, with the reason, where Gluon's Hopper API is
missing) into async wgmma + TMA + setmaxnreg code without spills, and a float64 emulation of the
kernel's tile schedule (band phases, the first tile peeled, P V one tile behind) matches the
reference. The training variant (``RESIDUAL``: O's rounding residual for the backward's delta)
cross-compiles with the extra TMA stores and no spills, leaves the inference kernel as it was, is
what ``ops.forward_for_backward`` takes where ``forward_choice`` says ``gluon``, and its residual
arithmetic is checked in torch. On an sm_90 GPU the kernel itself is compared with the float64
reference (§3 rule), the training variant with the inference one (bit for bit), the portable
kernel's residual and float64 gradients.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from portattn.numerics import compare, compare_lse
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec

pytest.importorskip("triton")

import triton  # noqa: E402
from portattn.backends.triton import gluon_fwd  # noqa: E402

ON_SM90 = torch.cuda.is_available() and not getattr(torch.version, "hip", None) \
    and torch.cuda.get_device_capability() == (9, 0)
requires_sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an NVIDIA sm_90 GPU (run on the H200)")
needs_gluon = pytest.mark.skipif(bool(gluon_fwd.GLUON_ERROR), reason=gluon_fwd.GLUON_ERROR or "-")


def _qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(device=device, dtype=dtype)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    return q, k, v


# ----- reasons and the switch (CPU) ---------------------------------------------------------

def test_reasons_name_what_is_missing():
    q, k, v = _qkv(1, 8, 8, 2, 2, 64)
    reasons = gluon_fwd.gluon_reasons(build_spec(q, k, v))
    assert any("NVIDIA CUDA device" in r and "cpu" in r for r in reasons), reasons
    q32, k32, v32 = (t.float() for t in (q, k, v))
    assert any("float32" in r for r in gluon_fwd.gluon_reasons(build_spec(q32, k32, v32)))
    q96, k96, v96 = _qkv(1, 8, 8, 2, 2, 96)
    assert any("D=96" in r for r in gluon_fwd.gluon_reasons(build_spec(q96, k96, v96)))
    vdv = torch.randn(1, 8, 2, 128).to(torch.bfloat16)
    assert any("Dv=128" in r for r in gluon_fwd.gluon_reasons(build_spec(q, k, vdv)))
    for kw, word in ((dict(softcap=5.0), "softcap"), (dict(window=(4, 0)), "window"),
                     (dict(alibi_slopes=torch.ones(2)), "ALiBi"),
                     (dict(attn_bias=torch.zeros(1, 2, 8, 8, dtype=torch.bfloat16)), "attn_bias")):
        assert any(word in r for r in gluon_fwd.gluon_reasons(build_spec(q, k, v, **kw))), kw
    cu = torch.tensor([0, 8], dtype=torch.int32)
    spec = build_spec(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)
    assert any("varlen" in r for r in gluon_fwd.gluon_reasons(spec))
    big = torch.empty(65536, 1, 1, 64, dtype=torch.bfloat16, device="meta")
    assert any("65535" in r for r in gluon_fwd.gluon_reasons(build_spec(big, big, big)))
    # causal (bottom-right or top-left), GQA and Sq != Sk are not reasons
    q2, k2, v2 = _qkv(1, 8, 24, 4, 1, 128)
    for spec in (build_spec(q2, k2, v2, causal=True), build_spec(q2, k2, v2, causal=True, causal_alignment="top_left")):
        assert not [r for r in gluon_fwd.gluon_reasons(spec) if "device" not in r], gluon_fwd.gluon_reasons(spec)


def test_gluon_forward_refuses_with_the_reasons():
    q, k, v = _qkv(1, 8, 8, 2, 2, 64)
    with pytest.raises(ValueError, match="NVIDIA CUDA device"):
        gluon_fwd.gluon_forward(build_spec(q, k, v))


def test_switch_falls_back_where_gluon_cannot_run(monkeypatch):
    q, k, v = _qkv(1, 8, 8, 2, 2, 64)
    spec = build_spec(q, k, v)
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    assert gluon_fwd.forward_choice(spec) == "triton"
    monkeypatch.setenv(gluon_fwd.ENV_SWITCH, "gluon")      # asked, but a CPU problem: refused
    assert gluon_fwd.forward_choice(spec) == "triton"
    monkeypatch.setenv(gluon_fwd.ENV_SWITCH, "fast")
    with pytest.raises(ValueError, match="PORTATTN_TRITON_FORWARD"):
        gluon_fwd.forward_choice(spec)


def _meta_spec(s, d, causal):
    x = torch.empty(1, s, 2, d, dtype=torch.bfloat16, device="meta")
    return build_spec(x, x, x, causal=causal)


@pytest.mark.parametrize("s, d, causal, auto", [
    (1024, 128, False, "gluon"), (1024, 128, True, "triton"), (2048, 128, True, "gluon"),
    (16384, 128, False, "gluon"), (512, 128, False, "triton"),    # D 128: where the H200 timed it faster
    (16384, 64, False, "triton"), (4096, 256, True, "triton"),    # D 64 slower at short S, D 256 untimed
])
def test_auto_takes_gluon_where_the_h200_timed_it_faster(monkeypatch, s, d, causal, auto):
    """``auto`` (the default) follows AUTO_MIN_SEQLEN_Q wherever gluon_reasons is empty (here
    replaced: a CPU has no sm_90); ``gluon`` takes it wherever it can run; ``portable`` never."""
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: [])
    spec = _meta_spec(s, d, causal)
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    assert gluon_fwd.forward_choice(spec) == auto and gluon_fwd.auto_takes(spec) == (auto == "gluon")
    monkeypatch.setenv(gluon_fwd.ENV_SWITCH, "gluon")
    assert gluon_fwd.forward_choice(spec) == "gluon"
    monkeypatch.setenv(gluon_fwd.ENV_SWITCH, "portable")
    assert gluon_fwd.forward_choice(spec) == "triton"
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: ["no sm_90"])
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    assert gluon_fwd.forward_choice(spec) == "triton"


def _record_forwards(monkeypatch):
    """Replace the Gluon forward and the portable one in ops by recorders; returns the list of
    (kernel, residual) calls made. A CPU has no sm_90, so ``gluon_reasons`` is replaced too."""
    from portattn.backends.triton import ops
    calls = []

    def fake_gluon(spec, **kw):
        calls.append(("gluon", bool(kw.get("residual"))))
        out = torch.empty(spec.out_shape, dtype=spec.dtype, device=spec.device)
        lse = torch.empty(spec.lse_shape, device=spec.device)
        return (out, lse, torch.empty_like(out)) if kw.get("residual") else (out, lse)

    def fake_portable(spec, out, lse, residual):
        calls.append(("triton", residual))
        out = torch.empty(spec.out_shape, dtype=spec.dtype, device=spec.device)
        return out, torch.empty(spec.lse_shape, device=spec.device), torch.empty_like(out) if residual else None

    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: [])
    monkeypatch.setattr(gluon_fwd, "gluon_forward", fake_gluon)
    monkeypatch.setattr(ops, "_forward", fake_portable)
    return calls


@pytest.mark.parametrize("s, d, causal, auto", [
    (1024, 128, False, "gluon"), (1024, 128, True, "triton"), (2048, 128, True, "gluon"),
    (512, 128, False, "triton"), (16384, 64, False, "triton"), (4096, 256, True, "triton"),
])
def test_forward_for_backward_takes_gluon_where_forward_choice_says(monkeypatch, s, d, causal, auto):
    """A training forward (``ops.forward_for_backward``) takes the Gluon kernel, with its residual,
    exactly where forward_choice says ``gluon`` (auto: AUTO_MIN_SEQLEN_Q; ``gluon``: wherever it
    can run; ``portable``: never), else the portable kernel with its residual; the residual comes
    back either way, and float32 keeps none (and stays portable)."""
    from portattn.backends.triton import ops
    calls = _record_forwards(monkeypatch)
    spec = _meta_spec(s, d, causal)
    for value, expect in ((None, auto), ("gluon", "gluon"), ("portable", "triton")):
        if value is None:
            monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
        else:
            monkeypatch.setenv(gluon_fwd.ENV_SWITCH, value)
        calls.clear()
        out, lse, res = ops.forward_for_backward(spec)
        assert calls == [(expect, True)] and gluon_fwd.forward_choice(spec) == expect, (value, calls)
        assert len(res) == 1 and res[0].shape == out.shape and res[0].dtype == out.dtype
    monkeypatch.setenv(gluon_fwd.ENV_SWITCH, "fast")
    with pytest.raises(ValueError, match="PORTATTN_TRITON_FORWARD"):
        ops.forward_for_backward(spec)
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    x = torch.empty(1, s, 2, d, dtype=torch.float32, device="meta")
    calls.clear()
    assert ops.forward_for_backward(build_spec(x, x, x, causal=causal))[2] == ()
    assert calls == [("triton", False)]


def test_forward_for_backward_stays_portable_where_gluon_cannot_run(monkeypatch):
    """Where gluon_reasons names a reason, even ``gluon`` keeps the portable training forward."""
    from portattn.backends.triton import ops
    calls = _record_forwards(monkeypatch)
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: ["no sm_90"])
    for value in (None, "gluon"):
        if value is None:
            monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
        else:
            monkeypatch.setenv(gluon_fwd.ENV_SWITCH, value)
        calls.clear()
        ops.forward_for_backward(_meta_spec(4096, 128, False))
        assert calls == [("triton", True)], (value, calls)


_OPS_SWITCH = """
import torch
from portattn.backends.triton import ops
from portattn.spec import build_spec
q = torch.randn(1, 8, 2, 32)
try:
    out, lse = ops.forward(build_spec(q, q, q, causal=True))
    print("RAN", tuple(out.shape), bool(torch.isfinite(out).all()))
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors), as test_triton.py's cpu_only")
@pytest.mark.parametrize("value, expect", [("gluon", "RAN (1, 8, 2, 32) True"), ("portable", "RAN (1, 8, 2, 32) True"),
                                           ("fast", "REFUSED")])
def test_ops_forward_switch(value, expect):
    """``PORTATTN_TRITON_FORWARD`` in ops.forward: ``gluon`` falls back to today's kernel where the
    Gluon one cannot run (here: CPU tensors, the interpreter); an unknown value is an error."""
    env = dict(os.environ, PORTATTN_TRITON_FORWARD=value, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _OPS_SWITCH], capture_output=True, text=True, env=env, timeout=300)
    assert expect in proc.stdout, proc.stdout + proc.stderr[-2000:]
    if value == "fast":
        assert "PORTATTN_TRITON_FORWARD" in proc.stdout


def test_tile_table_fits_hopper_shared_memory():
    for d in gluon_fwd.HEAD_DIMS:
        block_n, stages = gluon_fwd.tile_config(d)
        smem = 2 * gluon_fwd.WG_M * d * 2 + 2 * stages * block_n * d * 2
        assert smem + 1024 <= 232448, (d, smem)   # sm_90's 227 KiB per block, barriers aside


# ----- cross-compilation for sm_90 (CPU; a subprocess: the test process has the interpreter on) ----

def _compile_rows(dims: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "portattn.backends.triton.gluon_fwd", "--json", "--dims", dims],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert lines, f"no report (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _check_compiled(rows, dims):
    assert {(r["head_dim"], r["causal"], r["pingpong"]) for r in rows} == {
        (d, c, p) for d in dims for c in (False, True) for p in (False, True)}
    for r in rows:
        assert "error" not in r, r
        assert r["shared"] <= 232448, r
        assert r["wgmma"] > 0 and r["tma"] > 0, r          # async wgmma, TMA bulk tensor copies
        assert r["num_warps"] == 12, r                     # 4 + 4 consumers, 1 producer padded to a warpgroup
        # FA3's register split: consumers grow to 240, the producer shrinks to 24
        assert 240 in r["setmaxnreg"] and 24 in r["setmaxnreg"], r
        if r.get("regs") is not None:                      # cuobjdump found: SASS facts
            assert r["HGMMA"] > 0 and r["UTMALDG"] > 0 and r["USETMAXREG"] > 0, r
            # no spills: at every head dim with the H200's triton 3.6; triton 3.9's code spills a
            # few registers at D 64/256 (2026-12-02, any producer/consumer split), never at D 128
            if triton.__version__.startswith("3.6") or r["head_dim"] == 128:
                assert r["stack"] == 0 and r["LDL/STL"] == 0, r


@needs_gluon
def test_cross_compiles_for_sm90_into_wgmma_and_tma():
    """D 128, causal or not, ping-pong or not (4 compiles, ~30 s on a busy CPU)."""
    _check_compiled(_compile_rows("128"), (128,))


@needs_gluon
@pytest.mark.slow
def test_cross_compiles_every_head_dim(request):
    """12 compiles (~2 min on 2 cores): only with ``-m slow``."""
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("every head dim: run with -m slow, or python -m portattn.backends.triton.gluon_fwd")
    _check_compiled(_compile_rows("64,128,256"), gluon_fwd.HEAD_DIMS)


def test_check_tool_report_renders():
    """tools/triton_gluon_check.py's report on a made-up result (the H200 run must not die there)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import triton_gluon_check as tool
    child = {"rc": 0, "hung": False, "passed": False, "seconds": 1.0, "timed_variants": [False],
             "checks": [{"case": "plain_d128", "pingpong": True, "passed": False, "out": "out FAIL", "lse": "lse ok"}],
             "launches": [{"S": 1024, "D": 128, "causal": False, "pingpong": True, "error": "boom"}],
             "stderr_tail": "Traceback"}
    timings = [{"S": 1024, "B": 16, "H": 16, "D": 128, "causal": False, "gluon_nopp": 500.0, "triton": 400.0,
                "flash": 450.0, "cudnn": 400.0, "gluon_pp_error": "x"}]
    text = tool.report({"compile": [{"head_dim": 128}], "child": child, "timings": timings, "verdict": "FAIL"})
    assert "FAIL plain_d128" in text and "boom" in text and "VERDICT: FAIL" in text
    row = next(ln for ln in text.splitlines() if ln.lstrip().startswith("1024"))
    assert "1.25" in row and "500.0" in row, row   # best Gluon / cuDNN and / triton


# ----- the tile schedule, emulated in float64 (CPU) -------------------------------------------

def _key_phases(m0, sq, sk, off, wl, wr, bm, bn):
    """kernels._key_phases / gluon_fwd._key_phases in Python."""
    r0, r1 = m0 + off, min(m0 + bm, sq) - 1 + off
    lo = max(r0 - wl, 0) // bn * bn
    hi = min(r1 + wr + 1, sk)
    full_lo = -(-max(r1 - wl, 0) // bn) * bn
    full_lo = min(max(full_lo, lo), max(hi, lo))
    full_hi = min(max(r0 + wr + 1, 0) // bn * bn, sk // bn * bn)
    return lo, full_lo, max(full_hi, full_lo), hi


def _kv_tile(t, n, block_n):
    """Rows n … n+block_n-1 of ``t`` (S, D), zero past its end (the TMA zero fill)."""
    tile = torch.zeros(block_n, t.shape[-1], dtype=t.dtype)
    part = t[n:n + block_n]
    tile[:part.shape[0]] = part
    return tile


def _emulate_rows(qt, rows, k, v, lo, full_lo, full_hi, hi, sk, off, wl, wr, c, block_n):
    """One consumer warpgroup of attn_fwd_gluon in float64: the first band tile masked and peeled,
    then the three phases from ``lo + BLOCK_N`` (the element mask only in the masked ones), P V one
    tile behind the scores, m_safe for rows with nothing visible yet. Returns (out, lse) rows."""
    m = torch.full((qt.shape[0],), -math.inf, dtype=torch.float64)
    lsum = torch.zeros_like(m)
    acc = torch.zeros(qt.shape[0], v.shape[-1], dtype=torch.float64)
    prev = None   # (P, key tile start) whose P V is still to be added

    def step(n, masked, m, lsum, acc, prev):
        s = qt @ _kv_tile(k, n, block_n).T
        if masked:
            cols = torch.arange(n, n + block_n)[None, :]
            al = rows[:, None] + off
            s = torch.where((cols < sk) & (cols >= al - wl) & (cols <= al + wr), s, -math.inf)
        m_new = torch.maximum(m, s.max(1).values)
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
        alpha = torch.exp2((m - m_safe) * c)
        p = torch.exp2(s * c - (m_safe * c)[:, None])
        if prev is not None:
            acc = acc + prev[0] @ _kv_tile(v, prev[1], block_n)
        return m_new, lsum * alpha + p.sum(1), acc * alpha[:, None], (p, n)

    if lo < hi:
        m, lsum, acc, prev = step(lo, True, m, lsum, acc, None)
        nxt = lo + block_n
        for start, stop, masked in ((nxt, max(full_lo, nxt), True), (max(full_lo, nxt), max(full_hi, nxt), False),
                                    (max(full_hi, nxt), hi, True)):
            for n in range(start, stop, block_n):
                m, lsum, acc, prev = step(n, masked, m, lsum, acc, prev)
        acc = acc + prev[0] @ _kv_tile(v, prev[1], block_n)
    empty = lsum == 0
    ls = torch.where(empty, 1.0, lsum)
    return acc / ls[:, None], torch.where(empty, -math.inf, (m * c + torch.log2(ls)) * math.log(2))


def _emulate(spec, block_n):
    """attn_fwd_gluon's grid in float64: 128-row CTAs of two 64-row warpgroups over every (b, h)."""
    q, k, v = (t.double() for t in (spec.q, spec.k, spec.v))
    nb, sq, hq, d = q.shape
    sk = k.shape[1]
    c = spec.scale * math.log2(math.e)
    wl = 1 << 30 if spec.window_left is None else spec.window_left
    wr = 1 << 30 if spec.window_right is None else spec.window_right
    off = sk - sq if spec.alignment == "bottom_right" else 0
    out = torch.zeros(nb, sq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.empty(nb, hq, sq, dtype=torch.float64)
    r = hq // k.shape[2]
    for b in range(nb):
        for h in range(hq):
            for m0 in range(0, sq, 128):
                phases = _key_phases(m0, sq, sk, off, wl, wr, 128, block_n)
                for wg in range(2):
                    rows = torch.arange(m0 + 64 * wg, m0 + 64 * wg + 64)
                    qt = _kv_tile(q[b, :, h], m0 + 64 * wg, 64)
                    o, lrow = _emulate_rows(qt, rows, k[b, :, h // r], v[b, :, h // r], *phases, sk, off, wl, wr,
                                            c, block_n)
                    keep = rows < sq
                    out[b, rows[keep], h] = o[keep]
                    lse[b, h, rows[keep]] = lrow[keep]
    return out, lse.float()


EMULATED = {
    "plain_ragged": ((1, 200, 200, 2, 2, 16), {}),
    "causal_sq_lt_sk": ((1, 70, 300, 2, 2, 16), {"causal": True}),
    "causal_sq_gt_sk": ((1, 300, 70, 2, 1, 16), {"causal": True}),          # fully-masked first rows, GQA
    "causal_top_left": ((1, 150, 260, 2, 2, 16), {"causal": True, "causal_alignment": "top_left"}),
    "single_key": ((1, 130, 1, 1, 1, 16), {"causal": True}),
}


@pytest.mark.parametrize("name", sorted(EMULATED))
@pytest.mark.parametrize("block_n", [64, 128])
def test_emulated_schedule_matches_reference(name, block_n):
    shape, kw = EMULATED[name]
    q, k, v = _qkv(*shape, dtype=torch.float32, seed=3)
    spec = build_spec(q, k, v, **kw)
    out, lse = _emulate(spec, block_n)
    ref, ref_lse = reference_forward(spec)
    assert compare("out", out.float(), ref, naive_forward(spec)[0]).passed
    assert compare_lse(lse, ref_lse).passed


# ----- the kernel on the H200 ------------------------------------------------------------------

GPU_CASES = {
    "plain_d128": ((2, 256, 256, 4, 4, 128), {}),
    "plain_d64_fp16": ((1, 384, 384, 2, 2, 64), {"dtype": torch.float16}),
    "d256": ((1, 192, 192, 2, 2, 256), {}),
    "ragged_d128": ((1, 200, 333, 3, 3, 128), {}),                          # S not a multiple of the tiles
    "causal_sq_lt_sk": ((1, 130, 517, 4, 4, 128), {"causal": True}),
    "causal_sq_gt_sk": ((1, 517, 130, 4, 2, 128), {"causal": True}),        # fully-masked rows, GQA 2
    "causal_top_left": ((1, 300, 450, 2, 2, 64), {"causal": True, "causal_alignment": "top_left"}),
    "gqa8_d64": ((2, 128, 1000, 8, 1, 64), {}),
    "causal_d256": ((1, 333, 333, 2, 2, 256), {"causal": True}),
    "sq1": ((3, 1, 77, 2, 2, 128), {}),
}


_SMOKE = """
import torch
from portattn.backends.triton import gluon_fwd
from portattn.spec import build_spec
for pp in (False, True):
    for sq, sk, causal in ((200, 333, False), (517, 130, True), (1000, 1000, True)):
        q, k, v = (torch.randn(1, s, 2, 128, device="cuda", dtype=torch.bfloat16) for s in (sq, sk, sk))
        gluon_fwd.gluon_forward(build_spec(q, k, v, causal=causal), pingpong=pp)
        torch.cuda.synchronize()
print("SMOKE OK")
"""


@pytest.fixture(scope="module")
def no_deadlock():
    """First launches in a child with a timeout: a barrier deadlock fails the GPU tests instead
    of hanging the test run."""
    try:
        proc = subprocess.run([sys.executable, "-c", _SMOKE], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ))
    except subprocess.TimeoutExpired:
        pytest.fail("the Gluon forward hung in its first launches (killed after 300 s): a barrier deadlock")
    assert "SMOKE OK" in proc.stdout, proc.stderr[-3000:]


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_matches_reference(name, pingpong):
    shape, kw = GPU_CASES[name]
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    q, k, v = _qkv(*shape, dtype=dtype, device="cuda", seed=7)
    spec = build_spec(q, k, v, **kw)
    assert not gluon_fwd.gluon_reasons(spec), gluon_fwd.gluon_reasons(spec)
    out = torch.full(spec.out_shape, float("nan"), dtype=dtype, device="cuda")   # unwritten -> NaN -> fails
    lse = torch.full(spec.lse_shape, float("nan"), device="cuda")
    gluon_fwd.gluon_forward(spec, out=out, lse=lse, pingpong=pingpong)
    torch.cuda.synchronize()
    ref, ref_lse = reference_forward(spec)
    assert out.shape == spec.out_shape and lse.shape == spec.lse_shape
    res = compare("out", out, ref, naive_forward(spec)[0])
    assert res.passed, res
    res = compare_lse(lse, ref_lse)
    assert res.passed, res


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("sq, causal, kernel", [(2048, True, "gluon"), (1024, False, "gluon"), (1024, True, "triton")])
def test_gpu_default_forward_takes_gluon_where_auto_says(monkeypatch, sq, causal, kernel):
    """``portattn.attention`` on the triton backend with the default switch: the Gluon kernel runs
    where AUTO_MIN_SEQLEN_Q has the shape (the launch is seen), the portable one elsewhere; both
    against float64."""
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    import portattn
    ran = []
    real = gluon_fwd.gluon_forward
    monkeypatch.setattr(gluon_fwd, "gluon_forward", lambda spec, **kw: ran.append(spec) or real(spec, **kw))
    q, k, v = _qkv(1, sq, sq, 4, 2, 128, device="cuda", seed=11)
    out = portattn.attention(q, k, v, causal=causal, backend="triton")
    torch.cuda.synchronize()
    assert bool(ran) == (kernel == "gluon")
    spec = build_spec(q, k, v, causal=causal)
    assert compare("out", out, reference_forward(spec)[0], naive_forward(spec)[0]).passed


@pytest.mark.parametrize("value, expect", [(None, True), ("", True), ("1", True), ("on", True), ("0", False),
                                           ("false", False), ("off", False), ("maybe", ValueError)])
def test_pingpong_switch_reads_a_boolean(monkeypatch, value, expect):
    from portattn import config
    if value is None:
        monkeypatch.delenv("PORTATTN_TRITON_GLUON_PINGPONG", raising=False)
    else:
        monkeypatch.setenv("PORTATTN_TRITON_GLUON_PINGPONG", value)
    if expect is ValueError:
        with pytest.raises(ValueError, match="PORTATTN_TRITON_GLUON_PINGPONG"):
            config.triton_gluon_pingpong()
    else:
        assert config.triton_gluon_pingpong() is expect
