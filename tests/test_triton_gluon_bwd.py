"""The opt-in Gluon backward for Hopper (``backends/triton/gluon_bwd.py``, docs/triton.md).

Without a GPU: :func:`gluon_bwd_reasons` refuses what the kernels cannot run with a clear
sentence; ``PORTATTN_TRITON_BACKWARD`` keeps today's backward unless asked and falls back where
the Gluon one cannot run; both kernels cross-compile for sm_90 under whichever triton is
installed into async wgmma + TMA + setmaxnreg code without spills; the Gluon band arithmetic is
the portable kernels' (same text); and a float64 emulation of the kernels' tile schedule (which
(query tile, key tile) pairs each CTA visits, which of them are masked, the producer's and the
consumers' tile order, the dK/dV CTA's walk over a GQA group) matches the float64 reference gradients. The kernels
themselves have not run here: on an sm_90 GPU they are compared with the float64 reference
(the §3 rule, factor 3 for gradients), repeated bit-identically, and fully-masked rows get 0.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from portattn.numerics import GRAD_FACTOR, compare
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec

pytest.importorskip("triton")

import triton  # noqa: E402
from portattn.backends.triton import gluon_bwd, kernels  # noqa: E402
from test_triton_gluon import _key_phases, _kv_tile, _longest_first, _qkv, _Recorder  # noqa: E402

ON_SM90 = torch.cuda.is_available() and not getattr(torch.version, "hip", None) \
    and torch.cuda.get_device_capability() == (9, 0)
requires_sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an NVIDIA sm_90 GPU (run on the H200)")
needs_gluon = pytest.mark.skipif(bool(gluon_bwd.GLUON_ERROR), reason=gluon_bwd.GLUON_ERROR or "-")


# ----- reasons and the switch (CPU) ---------------------------------------------------------

def test_reasons_name_what_is_missing():
    q, k, v = _qkv(1, 8, 8, 2, 2, 64)
    reasons = gluon_bwd.gluon_bwd_reasons(build_spec(q, k, v))
    assert any("NVIDIA CUDA device" in r and "cpu" in r for r in reasons), reasons
    q32, k32, v32 = (t.float() for t in (q, k, v))
    assert any("float32" in r for r in gluon_bwd.gluon_bwd_reasons(build_spec(q32, k32, v32)))
    assert any("residual" in r for r in gluon_bwd.gluon_bwd_reasons(build_spec(q, k, v), has_residual=False))
    for d in (96, 32):
        qd, kd, vd = _qkv(1, 8, 8, 2, 2, d)
        assert any(f"D={d}" in r for r in gluon_bwd.gluon_bwd_reasons(build_spec(qd, kd, vd))), d
    vdv = torch.randn(1, 8, 2, 128).to(torch.bfloat16)
    assert any("Dv=128" in r for r in gluon_bwd.gluon_bwd_reasons(build_spec(q, k, vdv)))
    for kw, word in ((dict(softcap=5.0), "softcap"), (dict(alibi_slopes=torch.ones(2)), "ALiBi"),
                     (dict(attn_bias=torch.zeros(1, 2, 8, 8, dtype=torch.bfloat16)), "attn_bias")):
        assert any(word in r for r in gluon_bwd.gluon_bwd_reasons(build_spec(q, k, v, **kw))), kw
    cu = torch.tensor([0, 8], dtype=torch.int32)
    spec = build_spec(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)
    assert any("varlen" in r for r in gluon_bwd.gluon_bwd_reasons(spec))
    big = torch.empty(65536, 1, 1, 64, dtype=torch.bfloat16, device="meta")
    assert any("65535" in r for r in gluon_bwd.gluon_bwd_reasons(build_spec(big, big, big)))
    # causal (both alignments), windows, GQA, Sq != Sk, fp16 and D 256 (two dK/dV passes) are not reasons
    for d in (128, 256):
        q2, k2, v2 = _qkv(1, 8, 24, 4, 1, d, dtype=torch.float16)
        for kw in (dict(), dict(causal=True), dict(causal=True, causal_alignment="top_left"), dict(window=(5, 3))):
            spec = build_spec(q2, k2, v2, **kw)
            assert not [r for r in gluon_bwd.gluon_bwd_reasons(spec) if "device" not in r], (d, kw)
        spec = build_spec(*_qkv(1, 8, 24, 2, 2, d))
        assert not [r for r in gluon_bwd.gluon_bwd_reasons(spec) if "device" not in r], d


def test_gluon_backward_refuses_with_the_reasons():
    q, k, v = _qkv(1, 8, 8, 2, 2, 64)
    spec = build_spec(q, k, v)
    stats = torch.zeros(spec.lse_shape)
    with pytest.raises(ValueError, match="NVIDIA CUDA device"):
        gluon_bwd.gluon_backward(spec, torch.zeros_like(q), stats, stats, *(torch.empty_like(t) for t in (q, k, v)))


def test_switch_defaults_to_todays_backward_and_falls_back(monkeypatch):
    q, k, v = _qkv(1, 8, 8, 2, 2, 64)
    spec = build_spec(q, k, v)
    monkeypatch.delenv(gluon_bwd.ENV_SWITCH, raising=False)
    assert gluon_bwd.backward_choice(spec) == "triton"
    monkeypatch.setenv(gluon_bwd.ENV_SWITCH, "gluon")         # asked, but a CPU problem: refused
    assert gluon_bwd.backward_choice(spec) == "triton"
    monkeypatch.setenv(gluon_bwd.ENV_SWITCH, "fast")
    with pytest.raises(ValueError, match="PORTATTN_TRITON_BACKWARD.*auto.*gluon.*portable"):
        gluon_bwd.backward_choice(spec)


@pytest.mark.parametrize("value, expect", [(None, "gluon"), ("", "gluon"), ("auto", "gluon"),
                                           ("gluon", "gluon"), ("GLUON", "gluon"), ("portable", "triton")])
def test_switch_takes_gluon_only_when_asked(monkeypatch, value, expect):
    """With the reasons empty (replaced: a CPU has no sm_90) ``gluon`` and ``auto`` (here a shape
    its rule takes: D 128, S 2k) take the Gluon backward, ``portable`` never."""
    monkeypatch.setattr(gluon_bwd, "gluon_bwd_reasons", lambda spec, has_residual=True: [])
    if value is None:
        monkeypatch.delenv(gluon_bwd.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(gluon_bwd.ENV_SWITCH, value)
    x = torch.empty(1, 2048, 2, 128, dtype=torch.bfloat16, device="meta")
    assert gluon_bwd.backward_choice(build_spec(x, x, x, causal=True)) == expect
    monkeypatch.setattr(gluon_bwd, "gluon_bwd_reasons", lambda spec, has_residual=True: ["no sm_90"])
    assert gluon_bwd.backward_choice(build_spec(x, x, x)) == "triton"


@pytest.mark.parametrize("sq, sk, d, hkv, auto", [
    (1024, 1024, 128, 4, "gluon"), (16384, 16384, 128, 4, "gluon"),   # D 128 from S 1k
    (512, 512, 128, 4, "triton"), (1024, 512, 128, 4, "triton"),      # shorter: untimed
    (4096, 4096, 64, 4, "gluon"), (2048, 2048, 64, 4, "triton"),      # D 64 from S 4k (0.84-0.90 x at 1k)
    (4096, 4096, 128, 2, "gluon"), (16384, 16384, 128, 1, "gluon"),   # GQA at D 128 from S 4k
    (2048, 2048, 128, 2, "triton"), (4096, 4096, 64, 2, "triton"),    # GQA shorter or at D 64: untimed
    (1024, 1024, 256, 4, "gluon"), (16384, 16384, 256, 4, "gluon"),    # D 256 from S 1k
    (512, 512, 256, 4, "triton"), (16384, 16384, 256, 2, "triton"),   # D 256 at S 512 or with GQA: untimed
])
def test_auto_takes_gluon_where_the_h200_timed_it_faster(monkeypatch, sq, sk, d, hkv, auto):
    """``auto`` (the default) follows AUTO_MIN_SEQLEN wherever gluon_bwd_reasons is empty (here
    replaced: a CPU has no sm_90); ``gluon`` takes it wherever it can run; ``portable`` never."""
    monkeypatch.setattr(gluon_bwd, "gluon_bwd_reasons", lambda spec, has_residual=True: [])
    q = torch.empty(1, sq, 4, d, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, sk, hkv, d, dtype=torch.bfloat16, device="meta")
    spec = build_spec(q, kv, kv, causal=True)
    monkeypatch.delenv(gluon_bwd.ENV_SWITCH, raising=False)
    assert gluon_bwd.backward_choice(spec) == auto and gluon_bwd.auto_takes(spec) == (auto == "gluon")
    monkeypatch.setenv(gluon_bwd.ENV_SWITCH, "gluon")
    assert gluon_bwd.backward_choice(spec) == "gluon"
    monkeypatch.setenv(gluon_bwd.ENV_SWITCH, "portable")
    assert gluon_bwd.backward_choice(spec) == "triton"


_OPS_SWITCH = """
import torch
from portattn.backends.triton import ops
from portattn.spec import build_spec
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, 2, 32, generator=g).to(torch.float16) for _ in range(3))
spec = build_spec(q, k, v, causal=True)
try:
    out, lse, res = ops.forward_for_backward(spec)
    dq, dk, dv, _ = ops.backward(spec, out, lse, torch.ones_like(out), residuals=res)
    print("RAN", tuple(dq.shape), bool(all(torch.isfinite(t).all() for t in (dq, dk, dv))))
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors), as test_triton.py's cpu_only")
@pytest.mark.parametrize("value, expect", [("gluon", "RAN (1, 8, 2, 32) True"), ("portable", "RAN (1, 8, 2, 32) True"),
                                           ("fast", "REFUSED")])
def test_ops_backward_switch(value, expect):
    """``PORTATTN_TRITON_BACKWARD`` in ops.backward: ``gluon`` falls back to today's kernels where
    the Gluon ones cannot run (here: CPU tensors, the interpreter); an unknown value is an error."""
    env = dict(os.environ, PORTATTN_TRITON_BACKWARD=value, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _OPS_SWITCH], capture_output=True, text=True, env=env, timeout=300)
    assert expect in proc.stdout, proc.stdout + proc.stderr[-2000:]
    if value == "fast":
        assert "PORTATTN_TRITON_BACKWARD" in proc.stdout


def test_tile_table_fits_hopper_shared_memory():
    assert 256 in gluon_bwd.HEAD_DIMS and gluon_bwd.kernels_for(256) == ("dv", "dk", "dq")
    assert all(gluon_bwd.kernels_for(d) == ("dkdv", "dq") for d in gluon_bwd.HEAD_DIMS if d != 256)
    for d in gluon_bwd.HEAD_DIMS:
        cfg = gluon_bwd.tile_config(d)
        block_m, stages = cfg["dkdv"]
        dkdv = 2 * gluon_bwd.BLOCK * d * 2 + 2 * stages * block_m * d * 2   # the D 256 dK pass: the same
        block_n, stages = cfg["dq"]
        dq = 2 * gluon_bwd.BLOCK * d * 2 + 2 * stages * block_n * d * 2
        for smem in (dkdv, dq):
            assert smem + 1024 <= 232448, (d, smem)   # sm_90's 227 KiB per block, barriers aside
        assert block_m % 16 == 0 and block_n % 16 == 0   # the K dimension of the dV / dK / dQ products


def _body(fn) -> list[str]:
    """A jit function's statements without its docstring and comments, tl./gl. spelt alike."""
    src = inspect.getsource(getattr(fn, "fn", fn))
    src = re.sub(r'"""(?:.|\n)*?"""', "", src.split(":\n", 1)[1])
    lines = [re.sub(r"\s+#.*", "", ln).strip().replace("tl.", "X.").replace("gl.", "X.") for ln in src.splitlines()]
    return [ln for ln in lines if ln]


@needs_gluon
def test_gluon_band_arithmetic_is_the_portable_kernels():
    """The Gluon ``_query_phases`` / ``_phase_bounds`` are the portable kernels' (GPU-tested)
    ``_query_phases`` / ``_phase_range`` statement for statement, so the emulation below, which
    mirrors them, mirrors the kernels."""
    assert _body(gluon_bwd._query_phases) == _body(kernels._query_phases)
    assert _body(gluon_bwd._phase_bounds) == _body(kernels._phase_range)
    from portattn.backends.triton import gluon_fwd
    assert _body(gluon_fwd._key_phases) == _body(kernels._key_phases)


# ----- cross-compilation for sm_90 (CPU; a subprocess: the test process has the interpreter on) ----

def _compile_rows(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "portattn.backends.triton.gluon_bwd", "--json", *args],
                          capture_output=True, text=True, env=env, timeout=1200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert lines, f"no report (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _check_compiled(rows):
    assert rows
    for r in rows:
        assert "error" not in r, r
        assert r["shared"] <= 232448, r
        assert r["wgmma"] > 0 and r["tma"] > 0, r          # async wgmma, TMA bulk tensor copies
        assert r["num_warps"] == 12, r                     # 4 + 4 consumers, 1 producer padded to a warpgroup
        assert 240 in r["setmaxnreg"] and 24 in r["setmaxnreg"], r   # FA3's register split
        if r.get("regs") is not None:                      # cuobjdump found: SASS facts
            assert r["HGMMA"] > 0 and r["UTMALDG"] > 0 and r["USETMAXREG"] > 0, r
            if r.get("gqa") and r["head_dim"] == 128 and triton.__version__.startswith("3.6"):
                # the one known exception: triton 3.6's ptxas keeps 24 bytes of stack for a few
                # prologue scalars of the GQA dK/dV kernel (reloaded between the phase loops)
                assert r["stack"] <= 24 and r["LDL/STL"] <= 16, r
            elif r["kernel"] == "dk" and triton.__version__.startswith("3.6"):
                # and the D 256 dK pass: 24 bytes the same way (48 with GQA, a few reloads in the
                # loop); BLOCK_M 16 would clear it, triton 3.9 has none (docs/triton.md)
                assert r["stack"] <= (48 if r.get("gqa") else 24) and r["LDL/STL"] <= (64 if r.get("gqa") else 16), r
            else:
                assert r["stack"] == 0 and r["LDL/STL"] == 0, r   # no spills, no local memory


@needs_gluon
def test_cross_compiles_for_sm90_into_wgmma_and_tma():
    """Both kernels at D 128 (2 compiles, ~15 s)."""
    rows = _compile_rows("--dims", "128")
    assert {r["kernel"] for r in rows} == {"dkdv", "dq"}
    _check_compiled(rows)


@needs_gluon
def test_cross_compiles_d256_as_two_dkdv_passes():
    """D 256: the dV pass, the dK pass (the dK/dV kernel with PART 1 / 2, one float32
    accumulator each) and dQ (3 compiles, ~15 s); the dV pass loads no V, so its shared
    memory holds K and the ring only."""
    rows = _compile_rows("--dims", "256")
    assert [r["kernel"] for r in rows] == ["dv", "dk", "dq"]
    _check_compiled(rows)
    shared = {r["kernel"]: r["shared"] for r in rows}
    assert shared["dv"] < 160 * 1024 < shared["dk"], shared


@needs_gluon
@pytest.mark.slow
def test_cross_compiles_every_variant(request):
    """D 64 / 128 / 256, causal or not, the dK/dV kernel's GQA group walk too (22 compiles)."""
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("every variant: run with -m slow, or python -m portattn.backends.triton.gluon_bwd --causal both --gqa")
    rows = _compile_rows("--causal", "both", "--gqa")
    assert len(rows) == 22
    _check_compiled(rows)


@pytest.mark.skipif(not triton.__version__.startswith(("3.6", "3.9")), reason="written against triton 3.6 and 3.9")
def test_version_is_one_the_kernels_were_compiled_with():
    """The H200 runs triton 3.6; the kernels were cross-compiled with 3.6.0 and 3.9.0 (docs/triton.md)."""
    assert gluon_bwd.GLUON_ERROR == ""


def test_check_tool_report_renders():
    """tools/triton_gluon_bwd_check.py's report on a made-up result (the H200 run must not die there)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import triton_gluon_bwd_check as tool
    child = {"rc": 0, "hung": False, "passed": False, "seconds": 1.0,
             "checks": [{"case": "plain_d128", "passed": False, "dq": "dq FAIL", "dk": "dk ok", "dv": "dv ok"}],
             "launches": [{"S": 1024, "D": 128, "causal": False, "error": "boom"}], "stderr_tail": "Traceback"}
    timings = [{"S": 1024, "B": 16, "H": 16, "D": 128, "causal": False, "gluon": 500.0, "triton_det": 250.0,
                "triton_atomic": 400.0, "flash": 300.0, "cudnn": 400.0},
               {"S": 4096, "B": 4, "H": 16, "Hkv": 2, "D": 128, "causal": True, "gluon": 300.0, "triton_det": 200.0}]
    text = tool.report({"compile": [{"kernel": "dkdv", "head_dim": 128}], "child": child, "timings": timings,
                        "verdict": "FAIL"})
    assert "FAIL plain_d128" in text and "boom" in text and "VERDICT: FAIL" in text
    row = next(ln for ln in text.splitlines() if ln.lstrip().startswith("1024"))
    assert "1.25" in row and "500.0" in row and "2.00" in row, row   # gluon / cuDNN, / triton deterministic
    gqa = next(ln for ln in text.splitlines() if ln.lstrip().startswith("4096"))
    assert "16/2" in gqa and "1.50" in gqa, gqa                    # a GQA cell: Hq/Hkv and gluon / portable
    assert all(len(cell) == 4 for cell in tool.TIMING_CELLS) and any(cell[3] for cell in tool.QUICK_CELLS)


# ----- the tile schedule, emulated in float64 (CPU) -------------------------------------------

def _query_phases(n0, sq, sk, off, wl, wr, bm, bn):
    """kernels._query_phases / gluon_bwd._query_phases in Python."""
    c1 = min(n0 + bn, sk) - 1
    lo = max(n0 - wr - off, 0) // bm * bm
    hi = min(c1 + wl - off + 1, sq)
    full_lo = -(-max(n0 + bn - 1 - wr - off, 0) // bm) * bm
    full_lo = min(max(full_lo, lo), max(hi, lo))
    full_hi = min(max(n0 + wl - off + 1, 0) // bm * bm, sq // bm * bm)
    if n0 + bn > sk:
        full_hi = full_lo
    return lo, full_lo, max(full_hi, full_lo), hi


def _phase_tiles(lo, full_lo, full_hi, hi, block):
    """[(tile start, masked)] of the consumers' three phases (gluon_bwd._phase_bounds)."""
    return [(t, phase != 1) for phase, (a, b) in enumerate(((lo, full_lo), (full_lo, full_hi), (full_hi, hi)))
            for t in range(a, b, block)]


def _producer_walk(phases, n_heads, block):
    """[(group head, tile start)] the dK/dV producer loads: ``_stream_pairs`` (one head: the band
    [lo, hi) in order) or, for a GQA group, ``_stream_group`` (phase, then head, then tile)."""
    lo, full_lo, full_hi, hi = phases
    if n_heads == 1:
        return [(0, t) for t in range(lo, hi, block)]
    bounds = ((lo, full_lo), (full_lo, full_hi), (full_hi, hi))
    return [(hh, t) for a, b in bounds for hh in range(n_heads) for t in range(a, b, block)]


def _consumer_walk(phases, n_heads, block):
    """[(group head, tile start, masked)] a dK/dV consumer takes from the ring: the three phases
    of ``_dkdv_band`` (one head) or, for a GQA group, ``_dkdv_group_band``'s flat loop per phase
    (its trip count and its running (tile, head), statement for statement)."""
    lo, full_lo, full_hi, hi = phases
    if n_heads == 1:
        return [(0, t, masked) for t, masked in _phase_tiles(lo, full_lo, full_hi, hi, block)]
    walk = []
    for phase, (start, stop) in enumerate(((lo, full_lo), (full_lo, full_hi), (full_hi, hi))):
        m, head = start, 0
        count = n_heads * _c_div(stop - start + block - 1, block)   # triton's // on i32 truncates
        for _ in range(count):
            walk.append((head, m, phase != 1))
            m += block
            if m >= stop:
                m, head = start, head + 1
    return walk


def _c_div(a, b):
    """Integer division truncating toward zero (the kernels' i32 ``//``)."""
    return abs(a) // abs(b) * (1 if (a >= 0) == (b > 0) else -1)


def _visible(rows, cols, sq, sk, off, wl, wr):
    """(len(rows), len(cols)) bool: query row i sees key j (and both exist)."""
    al = rows[:, None] + off
    c = cols[None, :]
    return (rows[:, None] < sq) & (c < sk) & (c >= al - wl) & (c <= al + wr)


class _Schedule:
    """What the emulation saw: visited (query tile, key tile) pairs per kernel, and the
    violations (a consumer/producer tile-count mismatch would deadlock the kernel; an unmasked
    tile with an invisible pair would leak a masked score)."""

    def __init__(self):
        self.pairs = {"dkdv": [], "dq": set()}   # dkdv: in the walk's order, repeats would show
        self.problems = []


def _stats(kw, q, k, v, dout, dlse):
    """(rowmax, delta) as the prep kernel writes them, from the float64 forward: m = lse·log2(e)
    (+inf for rows with no visible key), delta = rowsum(dO ∘ O) − dlse (dlse 0 on those rows)."""
    out, lse = reference_forward(build_spec(q, k, v, **kw))
    out, lse = out.double(), lse.double()
    empty = torch.isneginf(lse)
    rowmax = torch.where(empty, math.inf, lse * math.log2(math.e))
    delta = (dout * out).sum(-1).transpose(1, 2)                   # (B, Hq, Sq)
    if dlse is not None:
        delta = delta - torch.where(empty, 0.0, dlse.double())
    return rowmax, delta


def _emulate(q, k, v, dout, dlse, kw, head_dim_cfg, sched):
    """attn_bwd_dkdv_gluon and attn_bwd_dq_gluon's grids in float64: dq, dk, dv."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    spec = build_spec(q, k, v, **kw)
    nb, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    c = spec.scale * math.log2(math.e)
    wl = 1 << 30 if spec.window_left is None else spec.window_left
    wr = 0 if spec.causal else (1 << 30 if spec.window_right is None else spec.window_right)
    off = sk - sq if spec.alignment == "bottom_right" else 0
    rowmax, delta = _stats(kw, q, k, v, dout, dlse)
    bm, _ = gluon_bwd.tile_config(head_dim_cfg)["dkdv"]
    bn, _ = gluon_bwd.tile_config(head_dim_cfg)["dq"]
    blk, wg_m = gluon_bwd.BLOCK, gluon_bwd.WG_M
    dq = torch.zeros_like(q)

    def stat_rows(stat, b, h, rows):
        m = torch.full((rows.shape[0],), math.inf if stat is rowmax else 0.0, dtype=torch.float64)
        keep = rows < sq
        m[keep] = stat[b, h, rows[keep]]
        return m

    dk_out = torch.zeros(nb, sk, hkv, d, dtype=torch.float64)
    dv_out = torch.zeros_like(dk_out)
    for b in range(nb):
        # dK/dV: a CTA per (128 keys, KV head), two warpgroups of 64; each query head of the
        # KV head's group streamed in the producer's order, the sums kept, one store
        for hk in range(hkv):
            kh, vh = k[b, :, hk], v[b, :, hk]
            for n0 in range(0, sk, blk):
                phases = _query_phases(n0, sq, sk, off, wl, wr, bm, blk)
                walk = _consumer_walk(phases, g, bm)
                if [(hh, t) for hh, t, _ in walk] != _producer_walk(phases, g, bm):
                    sched.problems.append(("dkdv producer/consumer tiles differ", hk, n0, phases))
                for wg in range(2):
                    keys = torch.arange(n0 + wg * wg_m, n0 + (wg + 1) * wg_m)
                    kt, vt = _kv_tile(kh, n0 + wg * wg_m, wg_m), _kv_tile(vh, n0 + wg * wg_m, wg_m)
                    dk = torch.zeros(wg_m, d, dtype=torch.float64)
                    dv = torch.zeros_like(dk)
                    for hh, m0, masked in walk:
                        h = hk * g + hh
                        sched.pairs["dkdv"].append((b, h, m0 // bm, n0 // blk))
                        qrows = torch.arange(m0, m0 + bm)
                        qt, dot = _kv_tile(q[b, :, h], m0, bm), _kv_tile(dout[b, :, h], m0, bm)
                        vis = _visible(qrows, keys, sq, sk, off, wl, wr).T        # (keys, queries)
                        s_t = kt @ qt.T
                        if masked:
                            s_t = torch.where(vis, s_t, -math.inf)
                        elif not bool(vis[(keys < sk)][:, qrows < sq].all()):
                            sched.problems.append(("dkdv unmasked tile not fully visible", n0, m0))
                        p_t = torch.exp2(s_t * c - stat_rows(rowmax, b, h, qrows)[None, :])
                        dp_t = vt @ dot.T
                        ds_t = p_t * (dp_t - stat_rows(delta, b, h, qrows)[None, :])
                        dv = dv + p_t @ dot
                        dk = dk + ds_t @ qt
                    keep = keys < sk
                    dk_out[b, keys[keep], hk] = (dk * spec.scale)[keep]
                    dv_out[b, keys[keep], hk] = dv[keep]
        for h in range(hq):
            kh, vh = k[b, :, h // g], v[b, :, h // g]
            qh, doh = q[b, :, h], dout[b, :, h]
            # dQ: a CTA per 128 query rows, two warpgroups of 64, key tiles streamed
            for m0 in range(0, sq, blk):
                phases = _key_phases(m0, sq, sk, off, wl, wr, blk, bn)
                tiles = _phase_tiles(*phases, bn)
                if [t for t, _ in tiles] != list(range(phases[0], phases[3], bn)):
                    sched.problems.append(("dq producer/consumer tiles differ", m0, phases))
                for wg in range(2):
                    rows = torch.arange(m0 + wg * wg_m, m0 + (wg + 1) * wg_m)
                    qt, dot = _kv_tile(qh, rows[0].item(), wg_m), _kv_tile(doh, rows[0].item(), wg_m)
                    m2, dl = stat_rows(rowmax, b, h, rows), stat_rows(delta, b, h, rows)
                    acc = torch.zeros(wg_m, d, dtype=torch.float64)
                    for n, masked in tiles:
                        sched.pairs["dq"].add((b, h, m0 // blk, n // bn))
                        cols = torch.arange(n, n + bn)
                        vis = _visible(rows, cols, sq, sk, off, wl, wr)
                        s = qt @ _kv_tile(kh, n, bn).T
                        if masked:
                            s = torch.where(vis, s, -math.inf)
                        elif not bool(vis[rows < sq][:, cols < sk].all()):
                            sched.problems.append(("dq unmasked tile not fully visible", m0, n))
                        p = torch.exp2(s * c - m2[:, None])
                        dp = dot @ _kv_tile(vh, n, bn).T
                        ds = p * (dp - dl[:, None])
                        acc = acc + ds @ _kv_tile(kh, n, bn)
                    keep = rows < sq
                    dq[b, rows[keep], h] = (acc * spec.scale)[keep]
    return dq, dk_out, dv_out


def _reference_grads(q, k, v, dout, dlse, kw, dtype):
    """Gradients of Σ out·dout (+ Σ lse·dlse) through reference_forward (float64) or, with
    ``dtype``, naive_forward in that dtype (the §3 yardstick)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    fwd = reference_forward if dtype == torch.float64 else naive_forward
    out, lse = fwd(build_spec(*leaves, **kw))
    loss = (out * dout.to(dtype)).sum()
    if dlse is not None:
        lse_ok = torch.where(torch.isneginf(lse), 0.0, lse)
        loss = loss + (lse_ok * dlse.to(lse.dtype)).sum()
    return torch.autograd.grad(loss, leaves)


#: name -> ((B, Sq, Sk, Hq, Hkv, D), build_spec kwargs, with an lse gradient)
EMULATED = {
    "plain_ragged": ((1, 200, 150, 2, 2, 16), {}, False),
    "causal_sq_lt_sk": ((1, 70, 300, 2, 2, 16), {"causal": True}, False),
    "causal_off65": ((1, 135, 200, 2, 2, 16), {"causal": True}, False),     # a band edge one row before a tile
    "causal_sq_gt_sk_gqa2": ((1, 300, 70, 4, 2, 16), {"causal": True}, False),     # fully-masked first rows
    "causal_top_left": ((1, 150, 260, 2, 2, 16), {"causal": True, "causal_alignment": "top_left"}, False),
    "causal_top_left_sq_gt_sk": ((1, 260, 150, 2, 2, 16), {"causal": True, "causal_alignment": "top_left"}, False),
    "window": ((1, 230, 260, 2, 2, 16), {"window": (95, 7)}, False),   # hi - 1 on a tile start
    "window_left_only": ((1, 200, 200, 1, 1, 16), {"window": (50, None)}, False),   # anti-causal-like band
    "gqa4_lse_grad": ((2, 100, 190, 4, 1, 16), {"causal": True}, True),
    "single_key": ((1, 130, 1, 1, 1, 16), {"causal": True}, False),
    # GQA: the dK/dV CTA walks its KV head's group (ratios 2, 4, 8), causal both alignments, Sq != Sk
    "gqa2_causal_sq_lt_sk": ((1, 70, 300, 4, 2, 16), {"causal": True}, False),
    "gqa2_causal_top_left_sq_gt_sk": ((1, 260, 150, 4, 2, 16), {"causal": True, "causal_alignment": "top_left"},
                                      False),
    "gqa4_causal_top_left_sq_lt_sk": ((1, 150, 260, 8, 2, 16), {"causal": True, "causal_alignment": "top_left"},
                                      False),
    "gqa4_plain_ragged_b2": ((2, 200, 150, 4, 1, 16), {}, False),
    "gqa8_causal_sq_gt_sk": ((1, 300, 130, 8, 1, 16), {"causal": True}, False),     # fully-masked rows
    "gqa8_causal_top_left_sq_lt_sk": ((1, 135, 200, 8, 1, 16), {"causal": True, "causal_alignment": "top_left"},
                                      False),
    "gqa8_window": ((1, 230, 260, 8, 1, 16), {"window": (95, 7)}, False),
}


def _emulation(name, head_dim_cfg):
    shape, kw, with_dlse = EMULATED[name]
    b, sq, sk, hq, hkv, d = shape
    q, k, v = _qkv(*shape, dtype=torch.float32, seed=5)
    g = torch.Generator().manual_seed(9)
    dout = torch.randn(b, sq, hq, d, generator=g)
    dlse = torch.randn(b, hq, sq, generator=g) if with_dlse else None
    sched = _Schedule()
    grads = _emulate(q, k, v, dout, dlse, kw, head_dim_cfg, sched)
    ref = _reference_grads(q, k, v, dout, dlse, kw, torch.float64)
    naive = _reference_grads(q, k, v, dout, dlse, kw, torch.float32)
    return grads, ref, naive, sched, (q, k, v, kw)


@pytest.mark.parametrize("name", sorted(EMULATED))
@pytest.mark.parametrize("head_dim_cfg", gluon_bwd.HEAD_DIMS)
def test_emulated_schedule_matches_reference(name, head_dim_cfg):
    """Both kernels' tile schedules (each head dim's tiles) in float64 against the float64
    reference gradients (the §3 rule, factor 3): a skipped tile, a wrong mask or a wrong
    phase shows; the producer's tile list is the consumers' (else the kernel would deadlock),
    and no tile run without the element mask has an invisible pair."""
    grads, ref, naive, sched, _ = _emulation(name, head_dim_cfg)
    assert not sched.problems, sched.problems[:5]
    for label, a, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        res = compare(label, a.float(), r, n, factor=GRAD_FACTOR)   # float32, as the kernels accumulate
        assert res.passed, (name, res)


@pytest.mark.parametrize("name", [n for n in sorted(EMULATED) if EMULATED[n][0][3] > EMULATED[n][0][4]])
def test_emulated_gqa_walk_covers_every_head_once(name):
    """GQA: every dK/dV CTA (batch, KV head, key tile) takes from the ring each (query head of
    its group, visible query tile) pair exactly once — ratio × the band's tiles, each head's
    tiles the band's — and the producer loads the same pairs in the same order (else the
    kernel deadlocks or drops a head's share)."""
    shape, kw, _ = EMULATED[name]
    b, sq, sk, hq, hkv, d = shape
    g = hq // hkv
    spec = build_spec(*_qkv(*shape, dtype=torch.float32, seed=5), **kw)
    wl = 1 << 30 if spec.window_left is None else spec.window_left
    wr = 0 if spec.causal else (1 << 30 if spec.window_right is None else spec.window_right)
    off = sk - sq if spec.alignment == "bottom_right" else 0
    for head_dim_cfg in gluon_bwd.HEAD_DIMS:
        bm = gluon_bwd.tile_config(head_dim_cfg)["dkdv"][0]
        for n0 in range(0, sk, gluon_bwd.BLOCK):
            phases = _query_phases(n0, sq, sk, off, wl, wr, bm, gluon_bwd.BLOCK)
            band = list(range(phases[0], phases[3], bm))
            walk = _consumer_walk(phases, g, bm)
            assert len(walk) == g * len(band), (n0, phases)
            for hh in range(g):
                assert sorted(t for h, t, _ in walk if h == hh) == band, (n0, hh)
            assert [(h, t) for h, t, _ in walk] == _producer_walk(phases, g, bm), (n0, phases)


def _key_walk(pid0, pid1, num_n, num_bh, group, longest_first):
    """gluon_bwd._key_tile's walk in Python (without GQA): (key tile, bh) of CTA (pid0, pid1)."""
    last, bh = _longest_first(pid1 * num_n + pid0, num_n, num_bh, group)
    return (last if longest_first else num_n - 1 - last), bh


@pytest.mark.parametrize("num_n, num_bh", [(1, 1), (4, 7), (16, 128), (11, 3)])
def test_dkdv_walk_in_groups(num_n, num_bh):
    """The dK/dV grid's CTAs, numbered in launch order, take key tiles in head groups: groups of one
    are the grid's own order (tile pid0 of head pid1; the last first with ``LONGEST_FIRST``); any
    group covers every (tile, head) once, and each group starts with its heads' first tiles (a
    causal band's longest: they see every query tile)."""
    every = sorted((n, bh) for n in range(num_n) for bh in range(num_bh))
    for lf in (False, True):
        for pid1 in range(num_bh):
            for pid0 in range(num_n):
                want = (num_n - 1 - pid0) if lf else pid0
                assert _key_walk(pid0, pid1, num_n, num_bh, 1, lf) == (want, pid1)
        for group in range(1, num_bh + 1):
            walk = [_key_walk(w % num_n, w // num_n, num_n, num_bh, group, lf) for w in range(num_n * num_bh)]
            assert sorted(walk) == every
            if not lf:
                starts = range(0, num_n * num_bh, group * num_n)
                assert all(walk[w][0] == 0 for w in starts), (group, walk[:8])


@needs_gluon
def test_walk_mirrors_match_the_kernel_source():
    """The mirror above is what ``_key_tile`` says, and the dQ kernel hands its ``head_group`` to
    the forward's ``_row_tile`` (the grouped walk the forward's one-tile grid runs)."""
    body = _body(gluon_bwd._key_tile)
    for line in ("num_n = X.num_programs(0)",
                 "last, bh = _longest_first(X.program_id(1) * num_n + X.program_id(0), num_n, X.num_programs(1),",
                 "pid = last", "pid = num_n - 1 - last", "b, h, h_kv = _heads(bh, num_heads_q, gqa_ratio)"):
        assert line in body, line
    dq = " ".join(_body(gluon_bwd.attn_bwd_dq_gluon))
    assert "BOTTOM_RIGHT, LONGEST_FIRST, 2, head_group)" in dq


@pytest.mark.parametrize("causal, sq, grouped", [(True, 4096, True), (True, 4096, False), (False, 4096, True),
                                                 (True, 1024, True)])
def test_gluon_backward_launches_with_the_head_group(monkeypatch, causal, sq, grouped):
    """The launch plumbing on CPU (kernels replaced by recorders): a causal backward's dK/dV and dQ
    launches get ``head_group(spec)`` — the forward one-tile grid's groups (1 below 2048 query
    rows) with ``GROUPED_WALK``, else 1 — as their last argument; a non-causal one gets 1."""
    from portattn.backends.triton import gluon_fwd
    rec = _Recorder()   # both kernels: the dK/dV launches are the ones with a PART
    monkeypatch.setattr(gluon_bwd, "attn_bwd_dkdv_gluon", rec)
    monkeypatch.setattr(gluon_bwd, "attn_bwd_dq_gluon", rec)
    monkeypatch.setattr(gluon_bwd, "gluon_bwd_reasons", lambda spec: [])
    monkeypatch.setattr(gluon_fwd, "_ensure_allocator", lambda: None)
    monkeypatch.setattr(gluon_bwd, "GROUPED_WALK", grouped)
    monkeypatch.delenv("PORTATTN_TRITON_HEAD_GROUP", raising=False)
    q, k, v = _qkv(2, sq, sq, 8, 8, 128)
    spec = build_spec(q, k, v, causal=causal)
    stats = torch.zeros(spec.lse_shape)
    gluon_bwd.gluon_backward(spec, torch.zeros(spec.out_shape, dtype=q.dtype), stats, stats.clone(),
                             torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    launches = [("dkdv" if "PART" in kw else "dq", grid, args, kw) for grid, args, kw in rec.launches]
    assert [name for name, *_ in launches] == ["dkdv", "dq"]
    want = 1
    if causal and grouped and sq >= gluon_fwd.ONE_TILE_GROUP_MIN_SEQLEN_Q:
        want = min(2 * 8, gluon_fwd.HEAD_GROUP_L2_BYTES // (sq * 2 * 128 * 2))
        assert want > 1
    if causal:
        assert gluon_bwd.head_group(spec) == want
    for name, grid, args, kw in launches:
        assert args[-1] == want, (name, args[-1])
        assert grid == (sq // 128, 2 * 8) and kw["LONGEST_FIRST"] is (causal and name == "dq"), (name, grid, kw)


@needs_gluon
def test_gqa_walk_mirrors_are_the_kernels():
    """The emulation's walks are the kernel's: ``_dkdv_group_band``'s trip count and running
    (tile, head), ``_stream_group``'s loop nest (phase, head, tile), and the kernel hands both
    consumers and the producer the same head count (``gqa_ratio``) and the same phases."""
    band = _body(gluon_bwd._dkdv_group_band)
    loop = band.index("for _ in range(n_heads * ((stop - start + BLOCK_M - 1) // BLOCK_M)):")
    assert band[loop - 1:loop] == ["m = start"], band
    advance = band.index("m += BLOCK_M")
    assert band[advance + 1:advance + 5] == ["if m >= stop:", "m = start", "m_base += stride_lh",
                                             "d_base += stride_lh"], band
    stream = _body(gluon_bwd._stream_group)
    nest = [ln for ln in stream if ln.startswith("for ")]
    assert nest == ["for phase in X.static_range(3):", "for hh in range(n_heads):",
                    "for n in range(start, stop, BLOCK):"], stream
    assert "start, stop = _phase_bounds(phase, lo, full_lo, full_hi, hi)" in stream
    assert sum("_tma_load(desc_" in ln and "[hh, n, 0]" in ln for ln in stream) == 2, stream
    consumer = _body(gluon_bwd._dkdv_consumer)
    assert "start, stop = _phase_bounds(phase, lo, full_lo, full_hi, hi)" in consumer
    assert any(ln.startswith("dk, dv, i = _dkdv_group_band(") for ln in consumer)
    kernel = " ".join(_body(gluon_bwd.attn_bwd_dkdv_gluon))
    spec = kernel[kernel.index("X.warp_specialize("):]
    calls = re.findall(r"\((_dkdv_consumer|_resident_producer), \((.*?)\)\),", spec)
    assert [c for c, _ in calls] == ["_dkdv_consumer", "_dkdv_consumer", "_resident_producer"], calls
    cons = [a.split(", ") for c, a in calls if c == "_dkdv_consumer"]
    prod = next(a for c, a in calls if c == "_resident_producer")
    assert all(a[a.index("stride_lh") + 1] == "gqa_ratio" for a in cons), cons   # n_heads
    assert "GQA, gqa_ratio, (lo, full_lo, full_hi, hi)" in prod, prod
    assert all("lo, full_lo, full_hi, hi" in ", ".join(a) for a in cons)


def test_emulated_fully_masked_rows_get_zero_gradient():
    """Causal, Sq > Sk, bottom-right: the first Sq − Sk rows see no key; their dq is exactly 0
    and no gradient is NaN."""
    grads, _, _, _, (q, k, v, kw) = _emulation("causal_sq_gt_sk_gqa2", 128)
    dq = grads[0]
    empty = q.shape[1] - k.shape[1]
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))
    assert all(bool(torch.isfinite(t).all()) for t in grads)


def test_emulated_schedule_skips_invisible_tiles():
    """Causal bands visit only tile pairs with a visible element: the dK/dV CTA of the last keys
    under causal top-left alignment with Sq < Sk sees no query tile at all (and writes zeros)."""
    grads, _, _, sched, (q, k, v, kw) = _emulation("causal_top_left", 128)
    sq, sk = q.shape[1], k.shape[1]
    visited_kv = {n for (_, _, _, n) in sched.pairs["dkdv"]}
    assert (sk - 1) // gluon_bwd.BLOCK not in visited_kv                 # keys >= Sq: nobody sees them
    assert torch.equal(grads[1][:, sq:], torch.zeros_like(grads[1][:, sq:]))
    bm = gluon_bwd.tile_config(128)["dkdv"][0]
    for (_, _, mt, n) in sched.pairs["dkdv"]:                       # each visited pair has a visible element
        assert mt * bm + bm - 1 >= n * gluon_bwd.BLOCK, (mt, n)


# ----- the kernels on the H200 -----------------------------------------------------------------

#: name -> ((B, Sq, Sk, Hq, Hkv, D), build_spec kwargs incl. dtype)
GPU_CASES = {
    "plain_d128": ((2, 256, 256, 4, 4, 128), {}),
    "plain_d64_fp16": ((1, 384, 384, 2, 2, 64), {"dtype": torch.float16}),
    "ragged_d128": ((1, 200, 333, 3, 3, 128), {}),
    "ragged_d64": ((2, 77, 130, 2, 2, 64), {"dtype": torch.float16}),
    "causal_sq_lt_sk": ((1, 130, 517, 4, 4, 128), {"causal": True}),
    "causal_sq_gt_sk_gqa2": ((1, 517, 130, 4, 2, 128), {"causal": True}),
    "causal_top_left": ((1, 300, 450, 2, 2, 64), {"causal": True, "causal_alignment": "top_left"}),
    "causal_tl_sq_gt_sk_fp16": ((1, 450, 300, 2, 2, 128), {"causal": True, "causal_alignment": "top_left",
                                                           "dtype": torch.float16}),
    "window_d128": ((1, 400, 420, 2, 2, 128), {"window": (100, 17)}),
    "gqa8_d64": ((2, 128, 1000, 8, 1, 64), {}),
    "sq1": ((3, 1, 77, 2, 2, 128), {}),
}


_SMOKE = """
import torch
from portattn.backends.triton import ops
from portattn.spec import build_spec
for sq, sk, causal in ((200, 333, False), (517, 130, True), (1000, 1000, True)):
    q, k, v = (torch.randn(1, s, 2, 128, device="cuda", dtype=torch.bfloat16) for s in (sq, sk, sk))
    spec = build_spec(q, k, v, causal=causal)
    out, lse, res = ops.forward_for_backward(spec)
    ops.backward(spec, out, lse, torch.randn_like(out), residuals=res)
    torch.cuda.synchronize()
print("SMOKE OK")
"""


@pytest.fixture(scope="module")
def no_deadlock():
    """First launches in a child with a timeout: a barrier deadlock fails the GPU tests instead
    of hanging the test run."""
    env = dict(os.environ, PORTATTN_TRITON_BACKWARD="gluon")
    try:
        proc = subprocess.run([sys.executable, "-c", _SMOKE], capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the Gluon backward hung in its first launches (killed after 300 s): a barrier deadlock")
    assert "SMOKE OK" in proc.stdout, proc.stderr[-3000:]


@pytest.fixture
def gluon_on(monkeypatch):
    """PORTATTN_TRITON_BACKWARD=gluon, and a list that records every Gluon backward launch."""
    monkeypatch.setenv(gluon_bwd.ENV_SWITCH, "gluon")
    ran = []
    real = gluon_bwd.gluon_backward
    monkeypatch.setattr(gluon_bwd, "gluon_backward", lambda spec, *a, **kw: ran.append(spec) or real(spec, *a, **kw))
    return ran


def _gpu_inputs(name, seed=7):
    shape, kw = GPU_CASES[name]
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    q, k, v = _qkv(*shape, dtype=dtype, device="cuda", seed=seed)
    return q, k, v, kw


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_grads_match_reference(name, gluon_on):
    from portattn.testing import check_backend
    q, k, v, kw = _gpu_inputs(name)
    results = check_backend("triton", q, k, v, grad=True, **kw)
    assert gluon_on, "the Gluon backward did not run"
    assert all(r.passed for r in results), "\n".join(map(str, results))


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("name", [n for n in sorted(GPU_CASES) if GPU_CASES[n][1].get("causal")])
def test_gpu_grouped_walk_is_bit_identical(monkeypatch, name, gluon_on):
    """The causal grids walked in head groups of 3 (``PORTATTN_TRITON_HEAD_GROUP``; the cases are
    too short for ``head_group``'s own groups) give the same gradients, bit for bit, as one head
    after the other (``GROUPED_WALK`` off): the order changes no arithmetic."""
    from portattn.backends.triton import ops
    q, k, v, kw = _gpu_inputs(name)
    spec = build_spec(q, k, v, **kw)
    out, lse, res = ops.forward_for_backward(spec)
    dout = torch.randn_like(out)
    monkeypatch.setenv("PORTATTN_TRITON_HEAD_GROUP", "3")
    runs = {}
    for grouped in (False, True):
        monkeypatch.setattr(gluon_bwd, "GROUPED_WALK", grouped)
        runs[grouped] = ops.backward(spec, out, lse, dout, residuals=res)[:3]
    torch.cuda.synchronize()
    assert len(gluon_on) == 2
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("name", ["causal_sq_gt_sk_gqa2", "ragged_d64", "window_d128"])
def test_gpu_writes_every_element_and_repeats_bit_identically(name, gluon_on):
    """Gradients written into NaN-poisoned buffers: every element written, rows with no visible
    key exactly 0, and three runs bit-identical (the deterministic path)."""
    from portattn.backends.triton import ops
    q, k, v, kw = _gpu_inputs(name)
    spec = build_spec(q, k, v, **kw)
    out, lse, res = ops.forward_for_backward(spec)
    dout = torch.randn_like(out)
    runs = []
    for _ in range(3):
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        runs.append(ops.backward(spec, out, lse, dout, grads=grads, residuals=res)[:3])
    torch.cuda.synchronize()
    assert len(gluon_on) == 3
    for g in runs[0]:
        assert not bool(torch.isnan(g).any())
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    empty = torch.isneginf(lse).transpose(1, 2)     # (B, Sq, Hq)
    if bool(empty.any()):
        assert bool((runs[0][0][empty] == 0).all())


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("case", [((1, 200, 333, 2, 2, 128), {}), ((1, 300, 130, 4, 2, 64), {"causal": True})])
def test_gpu_lse_gradient(case, gluon_on):
    """A gradient through lse too (delta − dlse from the prep kernel)."""
    from test_lse_grad import check_lse_grads
    shape, kw = case
    q, k, v = _qkv(*shape, device="cuda", seed=3)
    check_lse_grads("triton", q, k, v, **kw)
    assert gluon_on
