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
kernel's residual and float64 gradients. The opt-in persistent variant (``PERSISTENT``,
``PORTATTN_TRITON_GLUON_PERSISTENT``) is checked on CPU: its switch, that ``auto`` and the default
launch never take it, the launch plumbing (grid, ``batch``), its work walk and running counts in
Python, and its sm_90 cross-compile; the GPU checks of it live in tools/triton_gluon_check.py.
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


def _setenv(monkeypatch, name: str, value: str | None) -> None:
    """Set the environment variable ``name`` to ``value`` for this test, or unset it (None)."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


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
    (1024, 128, False, "gluon"), (1024, 128, True, "gluon"), (2048, 128, True, "gluon"),
    (16384, 128, False, "gluon"), (512, 128, False, "gluon"),     # D 128: where the H200 timed it faster
    (512, 128, True, "gluon"), (256, 128, True, "triton"),        # (causal 512-4k: the persistent row)
    (256, 128, False, "triton"),                                  # below S 512: untimed
    (16384, 64, False, "gluon"), (2048, 64, False, "gluon"),      # D 64 non-causal from 2k: persistent to 8k
    (8192, 64, False, "gluon"), (8192, 64, True, "gluon"),        # D 64 from 8k (three consumers; causal 8k-16k persistent)
    (16384, 64, True, "gluon"), (8191, 64, True, "gluon"),        # D 64 causal from 2k: persistent (two
    (4096, 64, True, "gluon"), (2048, 64, True, "gluon"),         # consumers below 8k, AUTO_TWO_CONSUMERS)
    (1024, 64, False, "gluon"), (512, 64, False, "gluon"),        # D 64 non-causal from 512 (two consumers below 2k)
    (511, 64, False, "triton"), (2047, 64, True, "triton"),       # D 64 shorter, or short causal: portable
    (1024, 256, True, "gluon"), (512, 256, False, "gluon"),       # D 256 from S 512
    (256, 256, False, "triton"),                                  # D 256 below S 512: untimed
])
def test_auto_takes_gluon_where_the_h200_timed_it_faster(monkeypatch, s, d, causal, auto):
    """``auto`` (the default) follows AUTO_MIN_SEQLEN_Q and AUTO_PERSISTENT wherever gluon_reasons is
    empty (here replaced: a CPU has no sm_90); ``gluon`` takes it wherever it can run; ``portable``
    never; with the persistent variant switched off its rows are left to the portable kernel."""
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: [])
    spec = _meta_spec(s, d, causal)
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    assert gluon_fwd.forward_choice(spec) == auto and gluon_fwd.auto_takes(spec) == (auto == "gluon")
    monkeypatch.setenv(gluon_fwd.ENV_SWITCH, "gluon")
    assert gluon_fwd.forward_choice(spec) == "gluon"
    monkeypatch.setenv(gluon_fwd.ENV_SWITCH, "portable")
    assert gluon_fwd.forward_choice(spec) == "triton"
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    one_tile = s >= gluon_fwd.AUTO_MIN_SEQLEN_Q.get((d, causal), 1 << 40)
    monkeypatch.setenv("PORTATTN_TRITON_GLUON_PERSISTENT", "0")
    assert gluon_fwd.forward_choice(spec) == ("gluon" if one_tile else "triton")
    monkeypatch.setenv("PORTATTN_TRITON_GLUON_PERSISTENT", "1")
    assert gluon_fwd.forward_choice(spec) == auto
    monkeypatch.delenv("PORTATTN_TRITON_GLUON_PERSISTENT")
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: ["no sm_90"])
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
    (1024, 128, False, "gluon"), (1024, 128, True, "gluon"), (2048, 128, True, "gluon"),
    (512, 128, False, "gluon"), (256, 128, False, "triton"),
    (16384, 64, False, "gluon"), (2048, 64, False, "gluon"), (1024, 64, False, "triton"),   # D 64 training:
    (8192, 64, True, "gluon"), (4096, 64, True, "gluon"), (1024, 64, True, "triton"),      # (causal from 2k)
    (4096, 256, True, "gluon"), (512, 256, False, "gluon"), (256, 256, False, "triton"),  # D 256 from S 512
])
def test_forward_for_backward_takes_gluon_where_forward_choice_says(monkeypatch, s, d, causal, auto):
    """A training forward (``ops.forward_for_backward``) takes the Gluon kernel, with its residual,
    with ``gluon`` wherever it can run, with ``auto`` where AUTO_TRAINING_MIN_SEQLEN_Q says, with
    ``portable`` never; else the portable kernel with its residual; the residual comes back either
    way, and float32 keeps none (and stays portable)."""
    from portattn.backends.triton import ops
    calls = _record_forwards(monkeypatch)
    spec = _meta_spec(s, d, causal)
    assert gluon_fwd.auto_takes(spec, training=True) == (auto == "gluon")
    for value, expect in ((None, auto), ("gluon", "gluon"), ("portable", "triton")):
        _setenv(monkeypatch, gluon_fwd.ENV_SWITCH, value)
        calls.clear()
        out, lse, res = ops.forward_for_backward(spec)
        assert calls == [(expect, True)], (value, calls)
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
        _setenv(monkeypatch, gluon_fwd.ENV_SWITCH, value)
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
    """A Q tile per consumer warpgroup and the K/V ring fit sm_90's 227 KiB per block (barriers
    aside), with three consumers where a head dim runs them and with the persistent variant's O
    tiles (one per consumer) and second Q tiles at D 64 / 128 (at D 256 O leaves through Q's tile)."""
    for d in gluon_fwd.HEAD_DIMS:
        for consumers in (2, 3) if d in gluon_fwd.THREE_CONSUMER_HEAD_DIMS else (2,):
            block_n, stages = gluon_fwd.tile_config(d, consumers)
            tiles = consumers * (3 if d <= 128 else 1)
            smem = tiles * gluon_fwd.WG_M * d * 2 + 2 * stages * block_n * d * 2
            assert smem + 1024 <= 232448, (d, consumers, smem)


# ----- cross-compilation for sm_90 (CPU; a subprocess: the test process has the interpreter on) ----

def _compile_rows(dims: str, residual: str = "off", pingpong: str = "both") -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PORTATTN_TRITON_GLUON_CONSUMERS")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "portattn.backends.triton.gluon_fwd", "--json", "--dims", dims,
                           "--residual", residual, "--pingpong", pingpong], capture_output=True, text=True, env=env,
                          timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert lines, f"no report (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _check_compiled(rows, dims, residuals=(False,), pingpongs=(False, True)):
    assert {(r["head_dim"], r["causal"], r["pingpong"], r["residual"]) for r in rows} == {
        (d, c, p, x) for d in dims for c in (False, True) for p in pingpongs for x in residuals}
    for r in rows:
        assert "error" not in r, r
        assert r["shared"] <= 232448, r
        assert r["wgmma"] > 0 and r["tma"] > 0, r          # async wgmma, TMA bulk tensor copies
        consumers = r.get("consumers", 2)
        assert consumers == gluon_fwd.consumers_for(r["head_dim"]), r
        # 4 warps a consumer, 1 producer padded to a warpgroup; FA3's register split: two consumers
        # grow to 240, three to 160 (168 the default partition's), the producer shrinks to 24
        assert r["num_warps"] == 4 * consumers + 4, r
        assert {2: 240, 3: 160}[consumers] in r["setmaxnreg"] and 24 in r["setmaxnreg"], r
        if r.get("regs") is not None:                      # cuobjdump found: SASS facts
            assert r["HGMMA"] > 0 and r["UTMALDG"] > 0 and r["USETMAXREG"] > 0, r
            # no spills: at every head dim with the H200's triton 3.6; triton 3.9's code spills a
            # few registers at D 64/256 (2026-12-02, any producer/consumer split), never at D 128
            if triton.__version__.startswith("3.6") or r["head_dim"] == 128:
                assert r["stack"] == 0 and r["LDL/STL"] == 0, r


@pytest.fixture(scope="module")
def d128_rows():
    """D 128, causal or not, ping-pong or not, inference and training (``RESIDUAL``) kernels:
    8 compiles, ~1 min on a busy CPU (the triton cache makes a second run quick)."""
    return _compile_rows("128", residual="both")


@needs_gluon
def test_cross_compiles_for_sm90_into_wgmma_and_tma(d128_rows):
    """Both variants at D 128 compile to async wgmma, TMA and the register split, without
    spills under either triton (the residual's stores included)."""
    _check_compiled(d128_rows, (128,), residuals=(False, True))


@needs_gluon
def test_residual_adds_only_its_stores(d128_rows):
    """The training kernel is the inference kernel plus ORES: one more parameter and one more
    TMA store per consumer warpgroup (PTX and SASS), the same shared memory, products, loads and
    register split. The inference kernel keeps the parameters and stores it had before RESIDUAL
    existed (2 stores; 29 parameters: 28 and the causal walk's ``head_group``; ORES is the constexpr
    None there, no parameter); its PTX and TTGIR were compared before and after the change under
    triton 3.6 and 3.9 (identical but for debug lines and SSA names, 2026-12-04)."""
    by_key = {(r["causal"], r["pingpong"], r["residual"]): r for r in d128_rows}
    for causal in (False, True):
        for pp in (False, True):
            inf, res = by_key[causal, pp, False], by_key[causal, pp, True]
            assert inf["params"] == 29 and inf["tma_store"] == 2, inf
            assert res["params"] == inf["params"] + 1, (inf, res)
            assert res["tma_store"] == 2 * inf["tma_store"] and res["tma"] == inf["tma"] + inf["tma_store"], res
            for key in ("shared", "num_warps", "wgmma", "setmaxnreg"):
                assert res[key] == inf[key], (key, inf, res)
            if res.get("regs") is not None:
                assert res["UTMASTG"] == 2 * inf["UTMASTG"] and res["UTMALDG"] == inf["UTMALDG"], (inf, res)
                assert res["HGMMA"] == inf["HGMMA"], (inf, res)


@needs_gluon
def test_three_consumers_cross_compile_at_d64():
    """D 64's default launch (three consumer warpgroups, ping-pong on; causal and not): 16 warps,
    the 160 / 24 register split, 192 query rows of Q tiles beside the ring, async wgmma and TMA;
    no spills under the H200's triton 3.6 (3.9's code spills at D 64, as with two consumers)."""
    rows = _compile_rows("64", pingpong="on")
    _check_compiled(rows, (64,), pingpongs=(True,))
    block_n, stages = gluon_fwd.tile_config(64, 3)
    for r in rows:
        assert r["consumers"] == 3 and r["shared"] >= (3 * 64 + 2 * stages * block_n) * 64 * 2, r


@pytest.mark.parametrize("value, head_dim, arg, expect", [
    (None, 64, None, 3), (None, 128, None, 2), (None, 256, None, 2),    # DEFAULT_CONSUMERS
    ("", 64, None, 3), ("2", 64, None, 2), ("3", 64, None, 3), ("3", 128, None, 2),   # 3 where it can run
    ("3", 64, 2, 2), (None, 64, 3, 3), (None, 128, 3, ValueError), (None, 64, 4, ValueError),
    ("4", 64, None, ValueError), ("three", 64, None, ValueError)])
def test_consumers_switch_and_argument(monkeypatch, value, head_dim, arg, expect):
    """``consumers_for``: the argument, else PORTATTN_TRITON_GLUON_CONSUMERS (3 only where the head
    dim can run it), else DEFAULT_CONSUMERS; a count other than 2 or 3, an explicit 3 above D 64
    or an unparseable switch raise, naming what to change; the launch constexpr follows it."""
    _setenv(monkeypatch, "PORTATTN_TRITON_GLUON_CONSUMERS", value)
    if expect is ValueError:
        with pytest.raises(ValueError, match="consumer|PORTATTN_TRITON_GLUON_CONSUMERS"):
            gluon_fwd.consumers_for(head_dim, arg)
        return
    assert gluon_fwd.consumers_for(head_dim, arg) == expect
    assert gluon_fwd.launch_constexprs(head_dim, False, consumers=arg)["CONSUMERS"] == expect


@pytest.mark.parametrize("sq, causal, value, arg, expect", [
    (2048, True, None, None, 2), (8191, True, None, None, 2), (2047, True, None, None, 3),
    (8192, True, None, None, 3), (4096, False, None, None, 3),          # AUTO_TWO_CONSUMERS' D 64 rows
    (512, False, None, None, 2), (2047, False, None, None, 2), (2048, False, None, None, 3), (511, False, None, None, 3),
    (4096, True, "3", None, 3), (4096, True, None, 3, 3), (16384, True, "2", None, 2)])   # the switch, the argument
def test_consumers_follow_the_problem_where_auto_says(monkeypatch, sq, causal, value, arg, expect):
    """Given the problem, ``consumers_for`` runs two consumer warpgroups at D 64 on AUTO_TWO_CONSUMERS'
    rows (causal 2k <= Sq < 8k, non-causal 512 <= Sq < 2k) and DEFAULT_CONSUMERS' three elsewhere; the switch and the argument
    still win; ``gluon_forward`` launches what it says (the kernel replaced by a recorder)."""
    _setenv(monkeypatch, "PORTATTN_TRITON_GLUON_CONSUMERS", value)
    assert gluon_fwd.AUTO_TWO_CONSUMERS == {(64, True): (2048, 8192), (64, False): (512, 2048)}
    spec = _meta_spec(sq, 64, causal)
    assert gluon_fwd.consumers_for(64, arg, spec) == expect
    rec = _Recorder()
    monkeypatch.setattr(gluon_fwd, "attn_fwd_gluon", rec)
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: [])
    monkeypatch.setattr(gluon_fwd, "_ensure_allocator", lambda: None)
    monkeypatch.setattr(gluon_fwd, "_sm_count", lambda dev: 132)
    q, k, v = (torch.zeros(1, sq, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    gluon_fwd.gluon_forward(build_spec(q, k, v, causal=causal), consumers=arg)
    grid, _, kw = rec.launches[-1]
    tiles = -(-sq // (64 * expect))   # a head's query tiles; D 64's persistent walk is unpaired
    assert kw["CONSUMERS"] == expect and kw["PAIRED"] is False
    assert grid == ((min(132, tiles * 2),) if kw["PERSISTENT"] else (tiles, 2)), grid


@needs_gluon
@pytest.mark.slow
def test_cross_compiles_every_head_dim(request):
    """24 compiles, inference and training (~4 min on 2 cores): only with ``-m slow``."""
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("every head dim: run with -m slow, or python -m portattn.backends.triton.gluon_fwd")
    _check_compiled(_compile_rows("64,128,256", residual="both"), gluon_fwd.HEAD_DIMS, residuals=(False, True))


def test_check_tool_report_renders(monkeypatch):
    """tools/triton_gluon_check.py's report on a made-up result (the H200 run must not die there)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    monkeypatch.setenv("PORTATTN_TRITON_FORWARD", "auto")   # restored afterwards: the import sets it
    import triton_gluon_check as tool
    child = {"rc": 0, "hung": False, "passed": False, "seconds": 1.0, "timed_variants": ["nopp"],
             "checks": [{"case": "plain_d128", "pingpong": True, "passed": False, "out": "out FAIL", "lse": "lse ok",
                         "res_passed": False, "res_unwritten": 3, "res_same_out_lse": True, "round_err": 0.002,
                         "res_err": 1e-5, "portable_res_err": 2e-6}],
             "launches": [{"S": 1024, "D": 128, "causal": False, "pingpong": True, "error": "boom"}],
             "stderr_tail": "Traceback"}
    timings = [{"S": 1024, "B": 16, "H": 16, "D": 128, "causal": False, "gluon_nopp": 500.0, "triton": 400.0,
                "flash": 450.0, "cudnn": 400.0, "gluon_pp_error": "x", "triton_train": 380.0, "gluon_train": 475.0},
               {"S": 2048, "B": 8, "H": 16, "D": 128, "causal": True, "gluon_pp": 400.0, "gluon_nopp": 390.0,
                "gluon_pers": 440.0, "triton": 400.0, "cudnn": 500.0, "triton_train": 300.0, "gluon_train": 360.0,
                "gluon_pers_train": 396.0}]
    text = tool.report({"compile": [{"head_dim": 128}], "child": child, "timings": timings, "verdict": "FAIL"})
    assert "FAIL plain_d128" in text and "boom" in text and "VERDICT: FAIL" in text
    assert "residual FAIL: res_unwritten=3" in text and "res_err=1e-05" in text
    rows = [ln for ln in text.splitlines() if ln.lstrip().startswith("1024")]
    assert "1.25" in rows[0] and "500.0" in rows[0], rows   # best Gluon / cuDNN and / triton
    assert "475.0" in rows[1] and "380.0" in rows[1] and "1.25" in rows[1], rows   # training: Gluon / portable
    pers = [ln for ln in text.splitlines() if ln.lstrip().startswith("2048")]
    assert "440.0" in pers[0] and "0.88" in pers[0] and "1.10" in pers[0], pers   # g_pers, best/cudnn, pers/pp
    assert "396.0" in pers[1] and "1.10" in pers[1], pers                          # g_pers_train, pers/g_train


def test_consumers_tool_cases_and_report():
    """tools/gluon_consumers_check.py: every check case at the head dim asked for (the forced-grid
    cases only for the persistent kernel), and its report on a made-up result: a failed check and
    a two-consumer mismatch are listed, the ratios computed (three consumers' best over the
    two-consumer and portable kernels, and over cuDNN), a cell without a column shows '-'."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import gluon_consumers_check as tool
    cases = tool._cases(64)
    assert {c[6] for c in cases} == {64} and len({c[0] for c in cases}) == len(cases)
    assert sum(c[-1] is not None for c in cases) == 3 and "plain_d128@d64" in {c[0] for c in cases}
    child = {"rc": 0, "hung": False, "passed": False, "seconds": 2.0, "last_begun": None, "stderr_tail": "",
             "checks": [{"case": "a", "variant": "g3", "passed": True, "same_as_two": True},
                        {"case": "b", "variant": "p3", "passed": True, "same_as_two": False},
                        {"case": "c", "variant": "g3_nopp", "passed": False, "out": "out FAIL"}]}
    timings = [{"S": 4096, "D": 64, "causal": False, "g2": 400.0, "g3": 440.0, "p2": 410.0, "p3": 450.0,
                "triton": 390.0, "cudnn": 500.0, "g3_train": 420.0, "triton_train": 350.0},
               {"S": 512, "D": 64, "causal": True, "g2": 90.0, "g3": 70.0, "triton": 180.0, "cudnn": 250.0}]
    text = tool.report({"compile": [], "child": child, "timings": timings, "verdict": "FAIL"})
    assert "2 of 3 passed, 1 of 2 bit-identical" in text and "case=b" in text and "case=c" in text
    assert "case=a " not in text and "verdict: FAIL" in text
    row = [ln for ln in text.splitlines() if ln.lstrip().startswith("4096")]
    assert "1.10" in row[0] and "1.10" in row[0].split()[-2] and "0.90" in row[0], row   # p3/best 2, best 3/cuDNN
    assert row[1].split()[-1] == "1.20", row                                              # training 420 / 350
    short = [ln for ln in text.splitlines() if ln.lstrip().startswith("512")][0]
    assert "0.39" in short and "-" in short, short                                       # 70 / 180, no p2


def test_check_tool_runs_the_persistent_variant_in_its_own_child(monkeypatch):
    """tools/triton_gluon_check.py checks every case for the one-tile variants (``nopp``, ``pp``) in
    one child and the persistent one (``pers``) in a second, so a deadlock there (killed at its own
    timeout) leaves the others checked and timed."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    monkeypatch.setenv("PORTATTN_TRITON_FORWARD", "auto")   # restored afterwards: the import sets it
    import triton_gluon_check as tool
    assert [v for v in tool.VARIANTS if v[2]] == [("pers", True, True)]
    calls = []

    def fake_child_lines(script, args, timeout):
        names = args[args.index("--variants") + 1].split(",")
        calls.append(names)
        hung = names == ["pers"]
        checks = [] if hung else [{"case": c[0], "variant": n, "passed": True} for n in names for c in tool.CHECK_CASES]
        launches = [] if hung else [{"variant": n, "finite": True} for n in names for _ in tool.TIMING_CELLS]
        return {"rc": None if hung else 0, "hung": hung, "seconds": 1.0, "checks": checks,
                "begun": ["check plain_d128 variant=pers"] if hung else [], "launches": launches, "stderr_tail": ""}
    monkeypatch.setattr(tool, "child_lines", fake_child_lines)
    first = tool.run_child(100.0, ["nopp", "pp"])
    second = tool.run_child(100.0, ["pers"])
    merged = tool._merge_children(first, second)
    assert calls == [["nopp", "pp"], ["pers"]]
    assert first["passed"] and first["timed_variants"] == ["nopp", "pp"]
    assert not merged["passed"] and merged["hung"] and merged["timed_variants"] == ["nopp", "pp"]
    assert merged["last_begun"] == "check plain_d128 variant=pers"
    assert len(merged["checks"]) == 2 * len(tool.CHECK_CASES)


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


def _emulate(spec, block_n, consumers=2):
    """attn_fwd_gluon's grid in float64: CTAs of ``consumers`` 64-row warpgroups over every (b, h)."""
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
            for m0 in range(0, sq, 64 * consumers):
                phases = _key_phases(m0, sq, sk, off, wl, wr, 64 * consumers, block_n)
                for wg in range(consumers):
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
@pytest.mark.parametrize("block_n, consumers", [(64, 2), (128, 2), (128, 3)])
def test_emulated_schedule_matches_reference(name, block_n, consumers):
    shape, kw = EMULATED[name]
    q, k, v = _qkv(*shape, dtype=torch.float32, seed=3)
    spec = build_spec(q, k, v, **kw)
    out, lse = _emulate(spec, block_n, consumers)
    ref, ref_lse = reference_forward(spec)
    assert compare("out", out.float(), ref, naive_forward(spec)[0]).passed
    assert compare_lse(lse, ref_lse).passed


# ----- the residual's arithmetic, emulated in torch (CPU) ----------------------------------------

#: significant bits of each 16-bit dtype (the implicit one included)
_MANTISSA = {torch.bfloat16: 8, torch.float16: 11}


def _residual(o32: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The RESIDUAL epilogue on a float32 O (any shape): ``out16 = O.to(dtype)`` and
    ``res = (O − out16.to(float32)).to(dtype)``, both rounded to nearest even as the GPU's
    ``cvt.rn`` (and torch) round. Returns (out16, res)."""
    out16 = o32.to(dtype)
    return out16, (o32 - out16.float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_arithmetic(dtype):
    """For float32 O across magnitudes (signs, exact values, zero, fp16's subnormals): the float32
    subtraction O − round(O) is exact, so the residual is O − round(O) rounded once; it is at most
    half an ulp of round(O) (or the dtype's smallest step, where it underflows) and adds back to
    round(O) unless its own rounding reached exactly half an ulp (a tie, which rounds to even);
    round(O) + residual (in float64) is never farther from O than round(O) alone, closer where O
    was not representable, and within half an ulp of the residual of O."""
    g = torch.Generator().manual_seed(0)
    o = torch.randn(1 << 14, generator=g) * torch.logspace(-6, 4, 1 << 14)
    o[:6] = torch.tensor([0.0, 1.0, -0.5, 3.0, 2.0 ** -10, -1.0e-7])
    out16, res = _residual(o, dtype)
    o64, r64, u64 = o.double(), res.double(), out16.double()
    assert torch.equal((o - out16.float()).double(), o64 - u64)            # exact in float32
    bits = _MANTISSA[dtype]
    tiniest = torch.finfo(dtype).tiny * 2.0 ** -(bits - 1)     # the smallest subnormal step
    ulp = (u64.abs().clamp_min(1e-300).log2().floor() - (bits - 1)).exp2()
    assert bool((r64.abs() <= torch.clamp(ulp / 2, min=tiniest)).all())
    below_half = r64.abs() < ulp / 2
    assert below_half.float().mean() > 0.9    # not: ties, and fp16 residuals in its subnormal range
    back = (out16.float() + res.float()).to(dtype)
    assert torch.equal(back[below_half], out16[below_half])
    err_round = (u64 - o64).abs()
    err_pair = (u64 + r64 - o64).abs()
    assert bool((err_pair <= err_round).all())
    moved = err_round > 0
    assert moved.float().mean() > 0.9
    # the pair's error is the residual's own rounding: half an ulp of it (or of the dtype's tiniest)
    res_ulp = (r64.abs().clamp_min(torch.finfo(dtype).tiny).log2().floor() - (bits - 1)).exp2()
    assert bool((err_pair <= torch.maximum(res_ulp, torch.full_like(res_ulp, tiniest)) / 2 * (1 + 1e-12)).all())
    normal = err_round >= torch.finfo(dtype).tiny   # fp16 residuals below 6e-5 (subnormal) keep fewer bits
    assert bool((err_pair[normal] < err_round[normal]).all()) and normal.float().mean() > 0.3


@pytest.mark.parametrize("name", ["plain_ragged", "causal_sq_gt_sk"])
def test_residual_of_the_emulated_schedule(name):
    """The residual on the emulated kernel's output (float64 schedule, normalised and rounded to
    float32 as the accumulator is): round(O) + residual is closer to the float64 reference than
    round(O) alone, and rows with no visible key get a zero residual (O is exactly 0 there)."""
    shape, kw = EMULATED[name]
    q, k, v = _qkv(*shape, dtype=torch.bfloat16, seed=4)
    spec = build_spec(q, k, v, **kw)
    out64, lse = _emulate(spec, 128)
    out16, res = _residual(out64.float(), torch.bfloat16)
    exact = reference_forward(spec)[0].double()
    err_round = (out16.double() - exact).abs().max()
    err_pair = (out16.double() + res.double() - exact).abs().max()
    assert err_pair < err_round / 50, (err_pair, err_round)
    empty = torch.isneginf(lse).transpose(1, 2)     # (B, Sq, Hq)
    if bool(empty.any()):
        assert bool((res[empty] == 0).all()) and bool((out16[empty] == 0).all())


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
@pytest.mark.parametrize("sq, causal, kernel, d", [(4096, True, "persistent", 128), (2048, True, "persistent", 128),
                                                   (1024, True, "persistent", 128), (1024, False, "persistent", 128),
                                                   (512, True, "persistent", 128), (256, True, "triton", 128),
                                                   (8192, True, "persistent", 64), (8192, False, "gluon", 64),
                                                   (2048, False, "persistent", 64), (4096, True, "persistent", 64),
                                                   (1024, True, "triton", 64), (1024, False, "persistent", 64),
                                                   (1024, False, "persistent", 256),
                                                   (4096, False, "gluon", 256), (2048, True, "persistent", 256)])
def test_gpu_default_forward_takes_gluon_where_auto_says(monkeypatch, sq, causal, kernel, d):
    """``portattn.attention`` on the triton backend with the default switches: the Gluon kernel runs
    where AUTO_MIN_SEQLEN_Q or AUTO_PERSISTENT has the shape (the launch is seen, and whether it
    was the persistent variant; at D 64 with three consumers, or two where AUTO_TWO_CONSUMERS says), the
    portable one elsewhere; each against float64."""
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    monkeypatch.delenv("PORTATTN_TRITON_GLUON_PERSISTENT", raising=False)
    monkeypatch.delenv("PORTATTN_TRITON_GLUON_CONSUMERS", raising=False)
    import portattn
    ran, pers = [], []
    real, real_for = gluon_fwd.gluon_forward, gluon_fwd.persistent_for
    monkeypatch.setattr(gluon_fwd, "gluon_forward", lambda spec, **kw: ran.append(spec) or real(spec, **kw))
    monkeypatch.setattr(gluon_fwd, "persistent_for", lambda *a, **kw: pers.append(real_for(*a, **kw)) or pers[-1])
    q, k, v = _qkv(1, sq, sq, 4, 2, d, device="cuda", seed=11)
    out = portattn.attention(q, k, v, causal=causal, backend="triton")
    torch.cuda.synchronize()
    assert bool(ran) == (kernel != "triton") and pers == ([kernel == "persistent"] if ran else [])
    spec = build_spec(q, k, v, causal=causal)
    two = (2048 <= sq < 8192) if causal else (512 <= sq < 2048)   # AUTO_TWO_CONSUMERS' D 64 rows
    assert gluon_fwd.consumers_for(d, spec=spec) == (2 if d != 64 or two else 3)
    assert compare("out", out, reference_forward(spec)[0], naive_forward(spec)[0]).passed


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("sq, sk, causal, align", [(130, 300, False, "bottom_right"), (100, 257, False, "bottom_right"),
                                                   (1000, 1000, True, "bottom_right"), (700, 333, True, "bottom_right"),
                                                   (576, 640, True, "top_left")])
def test_gpu_three_consumers_match_two_bit_for_bit(monkeypatch, sq, sk, causal, align, persistent):
    """Three consumer warpgroups (192-row tiles; a third warpgroup partly or wholly past Sq, causal
    edges inside a tile, fully-masked rows) give two's out and lse bit for bit (each row sees the
    same key tiles in the same order) and pass against float64, in both kernels."""
    monkeypatch.delenv("PORTATTN_TRITON_GLUON_CONSUMERS", raising=False)
    q, k, v = _qkv(2, sq, sk, 4, 2, 64, device="cuda", seed=5)
    spec = build_spec(q, k, v, causal=causal, causal_alignment=align)
    o3, l3 = gluon_fwd.gluon_forward(spec, persistent=persistent, consumers=3)
    o2, l2 = gluon_fwd.gluon_forward(spec, persistent=persistent, consumers=2)
    torch.cuda.synchronize()
    assert torch.equal(o3, o2) and torch.equal(l3, l2)
    ref, ref_lse = reference_forward(spec)
    assert compare("out", o3, ref, naive_forward(spec)[0]).passed and compare_lse(l3, ref_lse).passed


#: GPU_CASES the training forward (RESIDUAL) is checked on: D 64/128/256, fp16, ragged, causal
#: both alignments, fully-masked rows and GQA
TRAINING_CASES = ["plain_d128", "plain_d64_fp16", "d256", "ragged_d128", "causal_sq_gt_sk", "causal_top_left",
                  "sq1"]


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("name", TRAINING_CASES)
def test_gpu_training_forward_is_inference_plus_residual(monkeypatch, name, pingpong):
    """The Gluon training forward (``residual=True``) against the inference one and the portable
    kernel's residual: out and lse bit-identical to the inference launch; every element of the
    residual written (NaN-poisoned first); the residual at most half an ulp of out and adding back
    to it (but at ties); out + residual closer to float64 than out (P V takes P in 16 bits, so the
    float32 O is itself ~0.4 x the rounding error away: no tighter bound to float64 holds), and
    as close as the portable kernel's out + residual (within 2 x; a zero residual is ~2.5 x)."""
    from portattn.backends.triton import ops
    shape, kw = GPU_CASES[name]
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    q, k, v = _qkv(*shape, dtype=dtype, device="cuda", seed=7)
    spec = build_spec(q, k, v, **kw)
    out, lse = gluon_fwd.gluon_forward(spec, pingpong=pingpong)
    out2 = torch.full(spec.out_shape, float("nan"), dtype=dtype, device="cuda")
    lse2 = torch.full(spec.lse_shape, float("nan"), device="cuda")
    ores = torch.full_like(out2, float("nan"))
    got = gluon_fwd.gluon_forward(spec, out=out2, lse=lse2, ores=ores, pingpong=pingpong, residual=True)
    torch.cuda.synchronize()
    assert len(got) == 3 and got[2] is ores
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert not bool(torch.isnan(ores).any())
    o64, r64 = out.double(), ores.double()
    bits = _MANTISSA[dtype]
    ulp = (o64.abs().clamp_min(1e-30).log2().floor() - (bits - 1)).exp2()
    assert bool((r64.abs() <= torch.clamp(ulp / 2, min=torch.finfo(dtype).tiny * 2.0 ** -(bits - 1))).all())
    below_half = r64.abs() < ulp / 2            # a residual rounded to exactly half an ulp is a tie
    assert torch.equal((out.float() + ores.float()).to(dtype)[below_half], out[below_half])
    monkeypatch.setenv(gluon_fwd.ENV_SWITCH, "portable")
    p_out, _, (p_res,) = ops.forward_for_backward(spec)
    torch.cuda.synchronize()
    exact = reference_forward(spec)[0].double()
    err_round = (o64 - exact).abs().max().item()
    err_pair = (o64 + r64 - exact).abs().max().item()
    err_portable = (p_out.double() + p_res.double() - exact).abs().max().item()
    assert err_pair < err_round or err_round == 0, (err_pair, err_round)
    assert err_pair <= 2 * err_portable + 1e-6, (err_pair, err_portable)


@requires_sm90
@needs_gluon
@pytest.mark.usefixtures("no_deadlock")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_training_step_takes_gluon_and_matches_float64(monkeypatch, causal):
    """``portattn.attention`` with requires_grad at D 128, S 2048 with the default switches (``auto``
    takes the Gluon training forward there: AUTO_TRAINING_MIN_SEQLEN_Q) and the default backward:
    the forward is the Gluon one with its residual (one launch, seen), the backward the
    Gluon one, and out, lse and the gradients pass the float64 rule (factor 3 for gradients)."""
    from portattn.backends.triton import gluon_bwd

    from portattn.testing import check_backend
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    monkeypatch.delenv(gluon_bwd.ENV_SWITCH, raising=False)
    fwd, bwd = [], []
    real_fwd, real_bwd = gluon_fwd.gluon_forward, gluon_bwd.gluon_backward
    monkeypatch.setattr(gluon_fwd, "gluon_forward",
                        lambda spec, **kw: fwd.append(bool(kw.get("residual"))) or real_fwd(spec, **kw))
    monkeypatch.setattr(gluon_bwd, "gluon_backward", lambda spec, *a, **kw: bwd.append(spec) or real_bwd(spec, *a, **kw))
    q, k, v = _qkv(1, 2048, 2048, 4, 4, 128, device="cuda", seed=13)
    results = check_backend("triton", q, k, v, grad=True, causal=causal)
    assert fwd == [True], fwd
    assert len(bwd) == 1
    assert all(r.passed for r in results), "\n".join(map(str, results))


@pytest.mark.parametrize("value, expect", [(None, True), ("", True), ("1", True), ("on", True), ("0", False),
                                           ("false", False), ("off", False), ("maybe", ValueError)])
def test_pingpong_switch_reads_a_boolean(monkeypatch, value, expect):
    from portattn import config
    _setenv(monkeypatch, "PORTATTN_TRITON_GLUON_PINGPONG", value)
    if expect is ValueError:
        with pytest.raises(ValueError, match="PORTATTN_TRITON_GLUON_PINGPONG"):
            config.triton_gluon_pingpong()
    else:
        assert config.triton_gluon_pingpong() is expect


# ----- the persistent variant (opt-in; CPU: the switch, the launch plumbing, the walk, compiles) --

@pytest.mark.parametrize("value, expect", [(None, None), ("", None), ("0", False), ("off", False), ("1", True),
                                           ("true", True), ("on", True), ("maybe", ValueError)])
def test_persistent_switch_reads_a_boolean(monkeypatch, value, expect):
    """Unset or empty leaves the variant to ``auto`` (what AUTO_PERSISTENT says of the problem, the
    ``auto`` argument here); a boolean forces it on or off, at D 256 too (O through the Q tile);
    a head dim without the kernel never has it."""
    from portattn import config
    _setenv(monkeypatch, "PORTATTN_TRITON_GLUON_PERSISTENT", value)
    if expect is ValueError:
        with pytest.raises(ValueError, match="PORTATTN_TRITON_GLUON_PERSISTENT"):
            config.triton_gluon_persistent()
    else:
        assert config.triton_gluon_persistent() is expect
        for auto in (False, True):
            want = auto if expect is None else expect
            assert gluon_fwd.persistent_for(128, auto=auto) is want and gluon_fwd.persistent_for(64, auto=auto) is want
            assert gluon_fwd.persistent_for(256, auto=auto) is want and gluon_fwd.persistent_for(96, True) is False
            assert gluon_fwd.persistent_for(128, False, auto) is False and gluon_fwd.persistent_for(64, True, auto)


def test_persistent_constexprs_and_head_dims():
    assert gluon_fwd.launch_constexprs(128, True)["PERSISTENT"] is False   # the default launch
    assert gluon_fwd.launch_constexprs(64, False, persistent=True)["PERSISTENT"] is True
    assert gluon_fwd.launch_constexprs(256, False, persistent=True)["PERSISTENT"] is True
    with pytest.raises(ValueError, match="persistent"):
        gluon_fwd.launch_constexprs(96, False, persistent=True)
    assert gluon_fwd.PERSISTENT_HEAD_DIMS == (64, 128, 256)
    # its O tiles and two Q tiles a consumer fit beside the default ring at D 64/128, not at D 256,
    # whose persistent kernel has one Q tile a consumer and stores O through it (O_IN_Q)
    for d in gluon_fwd.HEAD_DIMS:
        for consumers in ((2, 3) if d in gluon_fwd.THREE_CONSUMER_HEAD_DIMS else (2,)):
            block_n, stages = gluon_fwd.tile_config(d, consumers)
            smem = (2 + 1) * consumers * gluon_fwd.WG_M * d * 2 + 2 * stages * block_n * d * 2
            assert (smem + 1024 <= 232448) == (d <= 128), (d, smem)
            want = (2, False) if d <= 128 else (1, True)
            assert gluon_fwd.smem_plan(d, consumers, block_n, stages) == want, (d, consumers)
            lc = gluon_fwd.launch_constexprs(d, True, persistent=True, consumers=consumers)
            assert (lc["Q_BUFS"], lc["O_IN_Q"], lc["STAGES"]) == want + (stages,), (d, lc)
            assert gluon_fwd.launch_constexprs(d, True, consumers=consumers)["O_IN_Q"] is False   # one-tile
    params = list(gluon_fwd.attn_fwd_gluon.arg_names)
    assert params[-13:] == ["HEAD_D", "BLOCK_N", "STAGES", "BOTTOM_RIGHT", "LONGEST_FIRST", "PINGPONG", "RESIDUAL",
                            "PERSISTENT", "CONSUMERS", "PAIRED", "Q_BUFS", "O_IN_Q", "ONE_STEP"]
    assert "batch" in params and gluon_fwd._PERSISTENT_ONLY_ARGS == ("batch",)


def test_paired_walk_is_for_persistent_causal_launches(monkeypatch):
    """``PAIRED`` is on for persistent causal-like launches at PAIRED_HEAD_DIMS (D 128, 256; not D 64)
    unless ``PORTATTN_TRITON_PAIRED_WALK`` says otherwise (1: every head dim, 0: none) or ``paired``
    is given; never for the one-tile kernel or a non-causal walk; a value that is not a boolean
    raises naming the variable."""
    lc = gluon_fwd.launch_constexprs
    monkeypatch.delenv("PORTATTN_TRITON_PAIRED_WALK", raising=False)
    assert gluon_fwd.PAIRED_HEAD_DIMS == (128, 256)
    assert lc(128, True, persistent=True)["PAIRED"] is True and lc(256, True, persistent=True)["PAIRED"] is True
    assert lc(64, True, persistent=True)["PAIRED"] is False and lc(64, True, persistent=True, paired=True)["PAIRED"]
    assert lc(128, True, persistent=True, paired=False)["PAIRED"] is False
    assert lc(128, True, paired=True)["PAIRED"] is False and lc(128, False, persistent=True)["PAIRED"] is False
    assert lc(128, False, persistent=True, paired=True)["PAIRED"] is False
    for text, want, want64 in (("0", False, False), ("off", False, False), ("", True, False), ("yes", True, True),
                               ("1", True, True)):
        monkeypatch.setenv("PORTATTN_TRITON_PAIRED_WALK", text)
        assert lc(128, True, persistent=True)["PAIRED"] is want, text
        assert lc(64, True, persistent=True)["PAIRED"] is want64, text
        assert lc(64, True, persistent=True, paired=not want64)["PAIRED"] is (not want64), text
    monkeypatch.setenv("PORTATTN_TRITON_PAIRED_WALK", "pairs")
    with pytest.raises(ValueError, match="PORTATTN_TRITON_PAIRED_WALK"):
        lc(128, True, persistent=True)


def test_q_buffers_are_for_persistent_launches(monkeypatch):
    """``Q_BUFS`` is 2 for persistent launches (``config.Q_BUFFERS_DEFAULT``) unless
    ``PORTATTN_TRITON_Q_BUFFERS`` or ``q_buffers=`` says 1; the one-tile kernel always has 1; other
    values raise naming the variable or the argument."""
    lc = gluon_fwd.launch_constexprs
    monkeypatch.delenv("PORTATTN_TRITON_Q_BUFFERS", raising=False)
    assert lc(128, False, persistent=True)["Q_BUFS"] == 2 and lc(64, True, persistent=True)["Q_BUFS"] == 2
    assert lc(128, False, persistent=True, q_buffers=1)["Q_BUFS"] == 1
    assert lc(128, False)["Q_BUFS"] == 1 and lc(256, True, q_buffers=2)["Q_BUFS"] == 1
    assert lc(256, True, persistent=True)["Q_BUFS"] == 1 == lc(256, False, persistent=True, q_buffers=2)["Q_BUFS"]
    for text, want in (("1", 1), ("2", 2), ("", 2), (" 1 ", 1)):
        monkeypatch.setenv("PORTATTN_TRITON_Q_BUFFERS", text)
        assert lc(128, True, persistent=True)["Q_BUFS"] == want, text
    for text in ("3", "0", "two"):
        monkeypatch.setenv("PORTATTN_TRITON_Q_BUFFERS", text)
        with pytest.raises(ValueError, match="PORTATTN_TRITON_Q_BUFFERS"):
            lc(128, True, persistent=True)
    monkeypatch.delenv("PORTATTN_TRITON_Q_BUFFERS")
    with pytest.raises(ValueError, match="q_buffers"):
        lc(128, True, persistent=True, q_buffers=3)


def test_one_step_follows_its_switch(monkeypatch):
    """``ONE_STEP`` (the band through one step, the mask behind a runtime branch) is off unless
    ``PORTATTN_TRITON_GLUON_ONE_STEP`` turns it on, for the one-tile and the persistent kernel; a
    value that is not a boolean raises naming the variable."""
    lc = gluon_fwd.launch_constexprs
    monkeypatch.delenv("PORTATTN_TRITON_GLUON_ONE_STEP", raising=False)
    assert lc(128, True)["ONE_STEP"] is False and lc(128, True, persistent=True)["ONE_STEP"] is False
    for text, want in (("1", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv("PORTATTN_TRITON_GLUON_ONE_STEP", text)
        assert lc(64, False)["ONE_STEP"] is want and lc(256, True, persistent=True)["ONE_STEP"] is want, text
    monkeypatch.setenv("PORTATTN_TRITON_GLUON_ONE_STEP", "maybe")
    with pytest.raises(ValueError, match="PORTATTN_TRITON_GLUON_ONE_STEP"):
        lc(128, True)


@needs_gluon
def test_one_step_cross_compiles_to_less_code(d128_persistent_rows):
    """With ``PORTATTN_TRITON_GLUON_ONE_STEP=1`` the D 128 persistent kernel compiles with one copy of
    the band step instead of three (fewer wgmma instructions: the first tile's S, one step's S and
    P V, the last P V, per consumer), in the same shared memory and register split; no spills under
    triton 3.6."""
    rows = _persistent_d128_rows("off", PORTATTN_TRITON_GLUON_ONE_STEP="1")
    base = {r["causal"]: r for r in d128_persistent_rows if not r["residual"]}
    assert len(rows) == 2
    for r in rows:
        assert "error" not in r, r
        b = base[r["causal"]]
        # per consumer: first S (8 wgmma of k16 at D 128) + one step (8 + 8) + last P V (8), against three steps
        assert r["wgmma"] == 2 * (8 + 16 + 8) < b["wgmma"], (r["wgmma"], b["wgmma"])
        assert r["shared"] == b["shared"] and r["setmaxnreg"] == b["setmaxnreg"], (r, b)
        if r.get("regs") is not None and triton.__version__.startswith("3.6"):
            assert r["stack"] == 0, r


def test_ring_depth_is_for_persistent_launches(monkeypatch):
    """``STAGES`` of a persistent launch: ``stages=``, else ``PORTATTN_TRITON_GLUON_STAGES``, else
    tile_config's; the one-tile kernel always has tile_config's. A deeper ring gives up what no longer
    fits (smem_plan: the second Q buffer, then O's own tiles); one that cannot fit, or a value
    outside 2-8, raises naming the variable or the argument."""
    lc = gluon_fwd.launch_constexprs
    monkeypatch.delenv("PORTATTN_TRITON_GLUON_STAGES", raising=False)
    monkeypatch.delenv("PORTATTN_TRITON_Q_BUFFERS", raising=False)
    assert lc(128, True, persistent=True)["STAGES"] == gluon_fwd.tile_config(128)[1] == 2
    # D 128, three K/V tiles of 128 keys (192 KiB): one Q tile a consumer, O through it
    deep = lc(128, True, persistent=True, stages=3)
    assert (deep["STAGES"], deep["Q_BUFS"], deep["O_IN_Q"]) == (3, 1, True)
    assert lc(128, True, stages=3)["STAGES"] == 2                        # the one-tile kernel keeps its ring
    # D 64 with two consumers: five tiles still leave room for two Q buffers and O's own tiles
    assert gluon_fwd.smem_plan(64, 2, 128, 5) == (2, False)
    assert gluon_fwd.smem_plan(64, 3, 128, 5) == (1, False)             # three: the second Q buffer goes
    assert gluon_fwd.smem_plan(128, 2, 128, 2, 1) == (1, False)         # one Q buffer asked for
    for text, want in (("3", 3), (" 4 ", 4), ("", 3)):
        monkeypatch.setenv("PORTATTN_TRITON_GLUON_STAGES", text)
        assert lc(64, True, persistent=True, consumers=2)["STAGES"] == want, text
    monkeypatch.setenv("PORTATTN_TRITON_GLUON_STAGES", "4")
    assert lc(64, True, persistent=True, consumers=2, stages=5)["STAGES"] == 5   # the argument wins
    with pytest.raises(ValueError, match="PORTATTN_TRITON_GLUON_STAGES"):
        lc(128, True, persistent=True)                                   # 4 x 64 KiB of K/V do not fit
    for text in ("1", "9", "deep"):
        monkeypatch.setenv("PORTATTN_TRITON_GLUON_STAGES", text)
        with pytest.raises(ValueError, match="PORTATTN_TRITON_GLUON_STAGES"):
            lc(128, True, persistent=True)
    monkeypatch.delenv("PORTATTN_TRITON_GLUON_STAGES")
    with pytest.raises(ValueError, match="does not fit"):
        lc(256, False, persistent=True, stages=3)


class _Recorder:
    """Stands for a Gluon kernel (attn_fwd_gluon; the backward's two): ``[grid](*args, **kw)`` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


@pytest.mark.parametrize("env, arg, d, expect", [
    (None, None, 128, False), ("1", None, 128, True), ("1", None, 64, True), ("1", None, 256, True),
    ("1", False, 128, False), (None, True, 64, True), ("0", True, 256, True), (None, None, 256, False)])
def test_gluon_forward_launches_the_persistent_variant_when_asked(monkeypatch, env, arg, d, expect):
    """The launch plumbing on CPU (the kernel replaced by a recorder): ``auto`` does not take the
    persistent variant for causal bands of 300 or 16384 queries (outside AUTO_PERSISTENT's causal
    rows); the switch or ``persistent=True`` does at D 64/128, with grid (min(#SMs, units),)
    (units: cdiv(tiles, 2) a head, the causal walk's long + short pairs; tiles with
    ``PORTATTN_TRITON_PAIRED_WALK=0``) and ``batch`` = B; otherwise grid (cdiv(Sq, rows), B·Hq) and ``batch`` None;
    ``rows`` is 64 a consumer warpgroup (three at D 64, gluon_fwd.DEFAULT_CONSUMERS: 192)."""
    _setenv(monkeypatch, "PORTATTN_TRITON_GLUON_PERSISTENT", env)
    rec = _Recorder()
    monkeypatch.setattr(gluon_fwd, "attn_fwd_gluon", rec)
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: [])
    monkeypatch.setattr(gluon_fwd, "_ensure_allocator", lambda: None)
    monkeypatch.setattr(gluon_fwd, "_sm_count", lambda dev: 132)
    rows = 64 * gluon_fwd.consumers_for(d)
    assert rows == (192 if d == 64 else 128)   # sq 300 and 16384: outside AUTO_TWO_CONSUMERS' D 64 causal row
    for b, sq, h in ((3, 300, 4), (1, 16384, 16)):    # 36 and 2048 tiles at D 128 (pairs: 24 and 1024 units)
        q, k, v = _qkv(b, sq, sq, h, h // 2, d)
        gluon_fwd.gluon_forward(build_spec(q, k, v, causal=True), persistent=arg)
        grid, args, kw = rec.launches[-1]
        tiles = -(-sq // rows) * b * h
        assert kw["PERSISTENT"] is expect and kw["LONGEST_FIRST"] is True and kw["HEAD_D"] == d
        assert kw["CONSUMERS"] == rows // 64
        assert args[-2] == (b if expect else None)      # batch, then the causal walk's head group
        assert args[-1] == gluon_fwd.head_group(build_spec(q, k, v, causal=True), expect)
        assert args[-1] == (1 if not expect and sq < gluon_fwd.ONE_TILE_GROUP_MIN_SEQLEN_Q else min(b * h, max(
            1, gluon_fwd.HEAD_GROUP_L2_BYTES * 2 // (sq * 2 * d * 2))))   # Hq / Hkv = 2
        paired = expect and d in gluon_fwd.PAIRED_HEAD_DIMS     # D 64's walk goes unpaired
        units = (-(-sq // rows) + 1) // 2 * b * h if paired else tiles
        assert kw["PAIRED"] is paired
        assert grid == ((min(132, units),) if expect else (-(-sq // rows), b * h)), grid
        monkeypatch.setenv("PORTATTN_TRITON_PAIRED_WALK", "0")
        gluon_fwd.gluon_forward(build_spec(q, k, v, causal=True), persistent=arg)
        monkeypatch.delenv("PORTATTN_TRITON_PAIRED_WALK")
        grid, args, kw = rec.launches[-1]
        assert kw["PAIRED"] is False and grid == ((min(132, tiles),) if expect else (-(-sq // rows), b * h)), grid
        # a zero stride (K and V broadcast over heads) keeps the one-tile kernel, whose descriptors
        # take the head offset in their base: a rank-4 descriptor would need a stride of 0
        kx, vx = (t[:, :, :1].expand(-1, -1, h // 2, -1) for t in (k, v))
        gluon_fwd.gluon_forward(build_spec(q, kx, vx, causal=True), persistent=arg)
        grid, args, kw = rec.launches[-1]
        assert kw["PERSISTENT"] is False and grid == (-(-sq // rows), b * h) and args[-2] is None
    # the switch turns the variant on where the Gluon forward runs, not the Gluon forward itself
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: [])
    monkeypatch.delenv(gluon_fwd.ENV_SWITCH, raising=False)
    assert gluon_fwd.forward_choice(_meta_spec(511, 64, False)) == "triton"


@pytest.mark.parametrize("sq, d, causal, residual, expect", [
    (1024, 128, False, False, True), (16384, 128, False, False, True), (512, 128, False, False, True),
    (256, 128, False, False, False), (512, 128, True, True, True),
    (1024, 128, True, False, True), (2048, 128, True, False, True), (4095, 128, True, False, True),
    (4096, 128, True, False, True), (2048, 128, True, True, True), (4095, 128, True, True, True),
    (4096, 128, False, True, True), (4096, 128, True, True, True), (16383, 128, True, False, True),
    (16384, 128, True, False, False), (16383, 128, True, True, True), (16384, 128, True, True, False),
    (8192, 64, True, False, True), (16383, 64, True, True, True), (16384, 64, True, False, False),
    (8191, 64, True, True, True), (2048, 64, True, False, True), (2047, 64, True, True, False),
    (2048, 64, False, False, True), (2047, 64, False, False, True), (4096, 64, True, False, True),
    (512, 64, False, False, True), (511, 64, False, False, False),
    (8191, 64, False, False, True), (8192, 64, False, False, False),        # D 64 inference: 2k-8k
    (4096, 64, False, True, True), (16383, 64, False, True, True), (16384, 64, False, True, False),   # training
    (1024, 64, False, True, False), (4096, 256, False, False, False), (4095, 256, False, True, True),
    (512, 256, False, False, True), (511, 256, True, False, False), (512, 256, True, True, True),
    (8191, 256, True, False, True), (8192, 256, True, True, False)])
def test_auto_launches_the_persistent_variant_on_its_rows(monkeypatch, sq, d, causal, residual, expect):
    """With the switch unset, a launch takes the persistent variant exactly on AUTO_PERSISTENT's rows
    (head dim, causal, training = ``residual``, query-row range); ``0`` turns every row off and
    ``1`` every D 64/128/256 launch on (the kernel replaced by a recorder)."""
    monkeypatch.delenv("PORTATTN_TRITON_GLUON_PERSISTENT", raising=False)
    rec = _Recorder()
    monkeypatch.setattr(gluon_fwd, "attn_fwd_gluon", rec)
    monkeypatch.setattr(gluon_fwd, "gluon_reasons", lambda spec: [])
    monkeypatch.setattr(gluon_fwd, "_ensure_allocator", lambda: None)
    monkeypatch.setattr(gluon_fwd, "_sm_count", lambda dev: 132)
    q, k, v = (torch.zeros(1, sq, 2, d, dtype=torch.bfloat16) for _ in range(3))
    spec = build_spec(q, k, v, causal=causal)
    assert gluon_fwd.auto_persistent(spec, training=residual) is expect
    for env, want in ((None, expect), ("0", False), ("1", d in gluon_fwd.PERSISTENT_HEAD_DIMS)):
        if env is not None:
            monkeypatch.setenv("PORTATTN_TRITON_GLUON_PERSISTENT", env)
        gluon_fwd.gluon_forward(spec, residual=residual)
        assert rec.launches[-1][2]["PERSISTENT"] is want, env


def _longest_first(w, num_m, num_bh, group):
    """gluon_fwd._longest_first in Python: (m, bh) of the w-th item of the grouped causal walk."""
    span = group * num_m
    g0 = w // span * group
    r = w - w // span * span
    g = min(group, num_bh - g0)
    return num_m - 1 - r // g, g0 + r % g


def _cta_tiles(pid, grid, sq, batch, hq, longest_first, rows=128, group=None, paired=False):
    """gluon_fwd._work_range and _work_tile in Python: the (b, h, m0) of persistent CTA ``pid``'s
    tiles in order, of ``rows``-row query tiles (``group``: the walk's head_group, None for all
    B·Hq heads; ``paired``: a causal walk's units in long + short pairs, the middle tile of an odd
    count paired with the tile past the end)."""
    num_m, num_bh = -(-sq // rows), batch * hq
    group = min(group or num_bh, num_bh)
    units = (-(-num_m // 2) if paired else num_m) * num_bh
    n = -(-(units - pid) // grid) * (2 if paired else 1)
    out = []
    for j in range(n):
        if paired:
            x, bh = _longest_first(pid + (j >> 1) * grid, (num_m + 1) >> 1, num_bh, group)
            first, t = num_m - 1 - x, j & 1
            m = first + t * (x - first) + t * int(first == x) * (num_m - x)
        else:
            u = pid + j * grid
            m, bh = _longest_first(u, num_m, num_bh, group) if longest_first else (u % num_m, u // num_m)
        out.append((bh // hq, bh % hq, m * rows))
    return out


def _item_band(m0, sq, rows, bn=128):
    """gluon_fwd._item_band in Python (a causal band, bottom-right, Sk = Sq): no keys past the end."""
    lo, full_lo, full_hi, hi = _key_phases(m0, sq, sq, 0, gluon_fwd._UNBOUNDED, 0, rows, bn)
    return lo, full_lo, full_hi, hi * (m0 < sq)


WALKS = [(False, None, False), (True, None, False), (True, 1, False), (True, 5, False), (True, None, True),
         (True, 1, True), (True, 5, True)]


@pytest.mark.parametrize("sq, batch, hq, grid", [(300, 3, 4, 36), (1024, 16, 16, 132), (4096, 1, 3, 132),
                                                 (129, 2, 5, 7), (1344, 3, 2, 5)])
@pytest.mark.parametrize("longest_first, group, paired", WALKS)
@pytest.mark.parametrize("rows", [128, 192])
def test_persistent_walk_covers_every_tile_once(sq, batch, hq, grid, longest_first, group, paired, rows):
    """Every (query tile, head) is one CTA's tile exactly once; with ``LONGEST_FIRST`` unpaired the
    walk takes the heads ``group`` at a time (the last group may be smaller), within a group no
    shorter tile before a longer one; paired, a CTA's tiles come two by two from one head, the
    long one first, and the only tiles past the end partner the middle tile of an odd count and
    see no keys; and the running counts of the consumers (ring tiles, non-empty bands: the
    ping-pong turn count ``kv + bands``) give every issue point of a CTA a distinct consecutive
    turn number, as the producer's ring count gives the same tiles (a causal band, bottom-right)."""
    seen = {}
    num_m, num_bh = -(-sq // rows), batch * hq
    size = min(group or num_bh, num_bh)
    if longest_first and not paired:
        walk = [_cta_tiles(w % grid, grid, sq, batch, hq, True, rows, group)[w // grid] for w in range(num_m * num_bh)]
        for w, (b, h, m0) in enumerate(walk):
            assert (b * hq + h) // size == w // (size * num_m), (w, b, h)   # its head's group
            if w and (b * hq + h) // size == (walk[w - 1][0] * hq + walk[w - 1][1]) // size:
                assert m0 <= walk[w - 1][2], w
    for pid in range(grid):
        kv = bands = turns = 0
        tiles = _cta_tiles(pid, grid, sq, batch, hq, longest_first, rows, group, paired)
        if paired:
            assert len(tiles) % 2 == 0
            for (b0, h0, long), (b1, h1, short) in zip(tiles[::2], tiles[1::2]):
                assert (b0, h0) == (b1, h1) and long < sq, (pid, tiles)
                assert short < long or (short == num_m * rows and long == (num_m - 1) // 2 * rows and num_m % 2), (
                    pid, long, short)
        for b, h, m0 in tiles:
            lo, full_lo, full_hi, hi = _item_band(m0, sq, rows)
            n = len(range(lo, hi, 128))
            if m0 >= sq:
                assert n == 0, m0
                continue
            assert (b, h, m0) not in seen and 0 <= b < batch and 0 <= h < hq, (b, h, m0)
            seen[b, h, m0] = pid
            if n:   # turn numbers of this band's n + 1 issue points: kv + bands + (0 … n)
                assert kv + bands == turns
                turns += n + 1
                kv += n
                bands += 1
    assert len(seen) == num_m * num_bh


def _busiest(sq, batch, hq, rows, group, paired, grid=132, bn=128):
    """The static walk's balance: the busiest CTA's work over the mean, a tile costing its key
    tiles + 1 (the model of docs/triton.md, The causal walk)."""
    work = []
    for pid in range(grid):
        tiles = _cta_tiles(pid, grid, sq, batch, hq, True, rows, group, paired)
        work.append(sum(len(range(*_item_band(m0, sq, rows, bn)[::3], bn)) + (m0 < sq) for _, _, m0 in tiles))
    return max(work) / (sum(work) / grid)


@pytest.mark.parametrize("d, rows", [(128, 128), (64, 192)])
@pytest.mark.parametrize("sq", [512, 1024, 2048, 4096, 8192, 16384])
def test_paired_walk_balances_the_causal_cells(d, rows, sq):
    """The causal benchmark cells (16k tokens, hidden 2048) on 132 CTAs in head_group's groups: in
    long + short pairs the busiest CTA does 1.03 x the mean work at D 128 (the units' count on 132
    CTAs) and at most 1.09 x at D 64 (192-row tiles: an odd count's middle tile is a short unit),
    where the unpaired walk does 1.18-1.29 x at D 128."""
    batch, hq = 16384 // sq, 2048 // d
    q = torch.zeros(batch, sq, hq, d, dtype=torch.bfloat16)
    group = gluon_fwd.head_group(build_spec(q, q, q, causal=True))
    paired = _busiest(sq, batch, hq, rows, group, True)
    assert paired <= (1.035 if d == 128 else 1.09), paired
    if d == 128:
        assert _busiest(sq, batch, hq, rows, group, False) > 1.17


@pytest.mark.parametrize("num_m, num_bh", [(1, 1), (4, 7), (16, 128), (11, 3)])
def test_one_tile_walk_in_groups_of_one_is_the_grid_order(num_m, num_bh):
    """The one-tile kernel numbers its CTAs in launch order (program_id(1)·num_m + program_id(0)):
    with groups of one head that walk is the grid's own (tile num_m-1-pid0 of head pid1), and with
    every head in one group it is all heads' last tiles first; any group covers every tile once."""
    for pid1 in range(num_bh):
        for pid0 in range(num_m):
            assert _longest_first(pid1 * num_m + pid0, num_m, num_bh, 1) == (num_m - 1 - pid0, pid1)
    walk = [_longest_first(w, num_m, num_bh, num_bh) for w in range(num_m * num_bh)]
    assert walk == [(m, bh) for m in reversed(range(num_m)) for bh in range(num_bh)]
    for group in range(1, num_bh + 1):
        assert sorted(_longest_first(w, num_m, num_bh, group) for w in range(num_m * num_bh)) == sorted(walk)


def test_longest_first_mirror_matches_the_kernel_source():
    """The Python mirrors above compute what the Gluon helpers' sources say (their lines)."""
    import inspect
    src = inspect.getsource(gluon_fwd._longest_first.fn)
    for line in ("span = head_group * num_m", "grp = w // span", "g0 = grp * head_group",
                 "g = gl.minimum(head_group, num_bh - g0)", "r = w - grp * span",
                 "return num_m - 1 - r // g, g0 + r % g"):
        assert line in src, line
    src = inspect.getsource(gluon_fwd._work_tile.fn)
    for line in ("x, bh = _longest_first(gl.program_id(0) + (j >> 1) * gl.num_programs(0), (num_m + 1) >> 1,",
                 "first = num_m - 1 - x", "t = j & 1",
                 "m = first + t * (x - first) + t * (first == x).to(gl.int32) * (num_m - x)",
                 "m, bh = _longest_first(j, num_m, num_bh, head_group)", "m = j % num_m", "bh = j // num_m"):
        assert line in src, line
    assert "hi = hi * (m0 < sq).to(gl.int32)" in inspect.getsource(gluon_fwd._item_band.fn)
    src = inspect.getsource(gluon_fwd._work_range.fn)
    for line in ("units = ((num_m + 1) >> 1) * (batch * num_heads_q)",
                 "mine = (units - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)",
                 "return num_m, 0, mine * 2, 1",
                 "return num_m, gl.program_id(0), num_m * batch * num_heads_q, gl.num_programs(0)"):
        assert line in src, line


@pytest.mark.parametrize("sk, d, hq, hkv, batch, want", [
    (512, 128, 16, 16, 32, 64),       # 256 KiB of K and V a head: 64 heads fill 16 MiB
    (2048, 128, 16, 16, 8, 16),
    (16384, 128, 16, 16, 1, 2),
    (16384, 256, 8, 8, 1, 1),         # one head's K and V (16 MiB) already fill it
    (65536, 128, 16, 16, 1, 1),       # more than fits: still one
    (2048, 128, 16, 4, 8, 64),        # GQA: 4 query heads read one KV head
    (512, 64, 2, 2, 1, 2),            # at most B·Hq
])
def test_head_group_fits_the_group_k_and_v_in_l2(monkeypatch, sk, d, hq, hkv, batch, want):
    q = torch.zeros(batch, sk, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(batch, sk, hkv, d, dtype=torch.bfloat16)
    spec = build_spec(q, k, k, causal=True)
    monkeypatch.delenv("PORTATTN_TRITON_HEAD_GROUP", raising=False)
    assert gluon_fwd.head_group(spec) == want
    # the one-tile kernel's grid: one head after the other below ONE_TILE_GROUP_MIN_SEQLEN_Q query rows
    assert gluon_fwd.head_group(spec, persistent=False) == (want if sk >= gluon_fwd.ONE_TILE_GROUP_MIN_SEQLEN_Q else 1)
    monkeypatch.setenv("PORTATTN_TRITON_HEAD_GROUP", "3")
    assert gluon_fwd.head_group(spec) == gluon_fwd.head_group(spec, persistent=False) == min(3, batch * hq)
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("PORTATTN_TRITON_HEAD_GROUP", bad)
        with pytest.raises(ValueError, match="PORTATTN_TRITON_HEAD_GROUP"):
            gluon_fwd.head_group(spec)


def test_persistent_helpers_are_shared_by_both_kernels():
    """The persistent kernel is the one-tile kernel's stages in a loop, not a copy: both partitions'
    bodies call the same helpers."""
    import inspect
    for one, walk, stages in ((gluon_fwd._producer, gluon_fwd._persistent_producer, ("_load_q(", "_load_kv(")),
                              (gluon_fwd._consumer, gluon_fwd._persistent_consumer, ("_attend(", "_epilogue("))):
        for fn in (one, walk):
            src = inspect.getsource(fn.fn)
            assert all(s in src for s in stages), (fn, stages)


def _persistent_d128_rows(residual: str = "both", dims: str = "128", **env_vars) -> list:
    """The cross-compile report of the persistent kernel at D 128 (or ``dims``), causal or not
    (``residual``: the CLI's off / on / both), in a child with ``env_vars`` set (e.g. a switch of
    the walk)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.update(env_vars)
    proc = subprocess.run([sys.executable, "-m", "portattn.backends.triton.gluon_fwd", "--json", "--dims", dims,
                           "--residual", residual, "--pingpong", "on", "--persistent", "on"],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert lines, f"no report (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def d128_persistent_rows():
    """The persistent kernel at D 128, causal or not, inference and training (4 compiles)."""
    return _persistent_d128_rows()


@needs_gluon
def test_persistent_cross_compiles_for_sm90(d128_persistent_rows, d128_rows):
    """The persistent kernel compiles to the one-tile kernel's products, register split and
    warps, with rank-4 TMA copies, one more parameter (``batch``) and O's own tiles (+32 KiB of
    shared memory); no spills under triton 3.6 (3.9: see below)."""
    rows = d128_persistent_rows
    assert {(r["causal"], r["residual"]) for r in rows} == {(c, x) for c in (False, True) for x in (False, True)}
    one = {(r["causal"], r["residual"]): r for r in d128_rows if r["pingpong"]}
    for r in rows:
        assert "error" not in r, r
        assert r["persistent"] is True and r["num_warps"] == 12 and r["tma_4d"] == r["tma"] > 0, r
        base = one[r["causal"], r["residual"]]
        assert r["shared"] <= 232448 and r["shared"] - base["shared"] >= 2 * 64 * 128 * 2, (r, base)
        assert r["params"] == base["params"] + 1 and r["tma_store"] == base["tma_store"], (r, base)
        assert r["wgmma"] == base["wgmma"] and r["setmaxnreg"] == base["setmaxnreg"], (r, base)
        if r.get("regs") is not None:
            assert r["HGMMA"] > 0 and r["UTMALDG"] > 0 and r["UTMASTG"] > 0, r
            # no spills with the H200's triton 3.6; triton 3.9 keeps the non-causal inference kernel
            # clean but spills 8 bytes in the training one (2026-12-03: two values live across the
            # item loop, stored and reloaded once per item in the epilogue, not in the key loop), and
            # 16 / 32 bytes in the causal ones since the paired walk (2026-12-06: one value stored
            # and reloaded once per key tile in the consumers' key loops; 24 / 32 with two Q buffers)
            if triton.__version__.startswith("3.6") or not (r["residual"] or r["causal"]):
                assert r["stack"] == 0 and r["LDL/STL"] == 0, r
            else:
                assert r["stack"] <= (32 if r["causal"] else 8), r


@needs_gluon
def test_unpaired_persistent_cross_compiles_for_sm90(d128_persistent_rows):
    """The causal persistent kernel with the walk unpaired (``PORTATTN_TRITON_PAIRED_WALK=0``)
    compiles to the paired kernel's products, copies, parameters and shared memory; no spills under
    triton 3.6 (3.9: at most 16 bytes)."""
    base = {(r["causal"], r["residual"]): r for r in d128_persistent_rows}
    rows = [r for r in _persistent_d128_rows(PORTATTN_TRITON_PAIRED_WALK="0") if r["causal"]]
    assert len(rows) == 2
    for r in rows:
        assert "error" not in r, r
        b = base[r["causal"], r["residual"]]
        for key in ("wgmma", "tma", "tma_store", "params", "shared", "num_warps", "setmaxnreg"):
            assert r[key] == b[key], (key, r, b)
        if r.get("regs") is not None:
            assert r["HGMMA"] == b["HGMMA"] and r["UTMALDG"] == b["UTMALDG"], (r, b)
            # triton 3.9: 8 bytes before the two Q buffers, 16 with them (3.6: none)
            assert r["stack"] <= (0 if triton.__version__.startswith("3.6") else 16), r


@needs_gluon
def test_one_q_buffer_cross_compiles_for_sm90(d128_persistent_rows):
    """The persistent kernel with one Q tile a consumer (``PORTATTN_TRITON_Q_BUFFERS=1``) compiles
    to the default two-buffer kernel's products, copies, parameters and registers, with 32 KiB
    (two 64 x 128 bf16 tiles) less shared memory; the default fits the SM's 227 KiB; no spills under
    triton 3.6 in either (3.9: as test_persistent_cross_compiles_for_sm90 bounds them)."""
    base = {(r["causal"], r["residual"]): r for r in d128_persistent_rows}
    rows = _persistent_d128_rows("off", PORTATTN_TRITON_Q_BUFFERS="1")
    assert len(rows) == 2
    for r in rows:
        assert "error" not in r, r
        b = base[r["causal"], r["residual"]]
        # two 64 x 128 bf16 tiles and their two pairs of 8-byte barriers (and alignment)
        assert 2 * 64 * 128 * 2 <= b["shared"] - r["shared"] <= 2 * 64 * 128 * 2 + 64, (r, b)
        assert b["shared"] <= 232448, b
        for key in ("wgmma", "tma", "tma_store", "params", "num_warps", "setmaxnreg"):
            assert r[key] == b[key], (key, r, b)
        if r.get("regs") is not None:
            assert r["HGMMA"] == b["HGMMA"] and r["UTMALDG"] == b["UTMALDG"] and r["regs"] == b["regs"], (r, b)
            if triton.__version__.startswith("3.6"):
                assert r["stack"] == 0 and b["stack"] == 0, (r, b)


@needs_gluon
def test_d256_persistent_cross_compiles_for_sm90():
    """At D 256 the persistent kernel stores O through its Q tile (``O_IN_Q``): it compiles to the
    one-tile kernel's products, register split and warps in the same shared memory (O's own tiles
    would not fit; + its ``q_empty`` barriers), with rank-4 TMA copies and one more parameter
    (``batch``); no spills in the inference kernels under triton 3.6."""
    one = {r["causal"]: r for r in _compile_rows("256", pingpong="on")}
    rows = _persistent_d128_rows("off", dims="256")
    assert len(rows) == 2
    for r in rows:
        assert "error" not in r, r
        b = one[r["causal"]]
        assert r["persistent"] is True and r["num_warps"] == 12 and r["tma_4d"] == r["tma"] > 0, r
        assert 0 <= r["shared"] - b["shared"] <= 64 and r["shared"] <= 232448, (r, b)
        assert r["params"] == b["params"] + 1 and r["tma_store"] == b["tma_store"], (r, b)
        assert r["wgmma"] == b["wgmma"] and r["setmaxnreg"] == b["setmaxnreg"], (r, b)
        if r.get("regs") is not None:
            assert r["HGMMA"] == b["HGMMA"] and r["regs"] == b["regs"], (r, b)
            if triton.__version__.startswith("3.6"):
                assert r["stack"] == 0, r


_PERSISTENT_CHILD = """
import json, os, sys, torch
sys.path.insert(0, "tests")
import test_triton_gluon as t
from portattn.backends.triton import gluon_fwd
from portattn.numerics import compare, compare_lse
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec
for name, (shape, kw) in t.GPU_CASES.items():
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    q, k, v = t._qkv(*shape, dtype=dtype, device="cuda", seed=7)
    spec = build_spec(q, k, v, **kw)
    out = torch.full(spec.out_shape, float("nan"), dtype=dtype, device="cuda")
    lse = torch.full(spec.lse_shape, float("nan"), device="cuda")
    ores = torch.full_like(out, float("nan"))
    gluon_fwd.gluon_forward(spec, out=out, lse=lse, persistent=True)
    o2, l2, r2 = gluon_fwd.gluon_forward(spec, residual=True, persistent=True)
    one, one_lse, one_res = gluon_fwd.gluon_forward(spec, residual=True, pingpong=True, persistent=False)
    # causal: the walk the head dim does not take by default (pairs at D 128/256, every #SMs-th tile at D 64)
    os.environ["PORTATTN_TRITON_PAIRED_WALK"] = "0" if spec.head_dim in gluon_fwd.PAIRED_HEAD_DIMS else "1"
    other_walk = gluon_fwd.gluon_forward(spec, residual=True, persistent=True)
    del os.environ["PORTATTN_TRITON_PAIRED_WALK"]
    os.environ["PORTATTN_TRITON_Q_BUFFERS"] = "1"   # the next item's Q loads after this one's last product
    one_q = gluon_fwd.gluon_forward(spec, residual=True, persistent=True)
    del os.environ["PORTATTN_TRITON_Q_BUFFERS"]
    # a deeper K/V ring (D 128: O through the one Q tile, smem_plan); none fits at D 256
    deep = {64: 5, 128: 3}.get(spec.head_dim)
    deep_ring = gluon_fwd.gluon_forward(spec, residual=True, persistent=True, stages=deep) if deep else (o2, l2, r2)
    os.environ["PORTATTN_TRITON_GLUON_ONE_STEP"] = "1"   # the band through one step, the mask behind a branch
    one_step = gluon_fwd.gluon_forward(spec, residual=True, persistent=True)
    one_step_tile = gluon_fwd.gluon_forward(spec, residual=True, pingpong=True, persistent=False)
    del os.environ["PORTATTN_TRITON_GLUON_ONE_STEP"]
    torch.cuda.synchronize()
    ref, ref_lse = reference_forward(spec)
    c_out, c_lse = compare("out", out, ref, naive_forward(spec)[0]), compare_lse(lse, ref_lse)
    row = dict(case=name, out=bool(c_out.passed), lse=bool(c_lse.passed), detail=str(c_out) + " " + str(c_lse),
               unwritten=int(torch.isnan(out).sum() + torch.isnan(lse).sum() + torch.isnan(r2).sum()),
               training_same=bool(torch.equal(o2, out) and torch.equal(l2, lse)),
               other_walk_same=all(torch.equal(x, y) for x, y in zip(other_walk, (o2, l2, r2))),
               one_q_buffer_same=all(torch.equal(x, y) for x, y in zip(one_q, (o2, l2, r2))),
               deep_ring_same=all(torch.equal(x, y) for x, y in zip(deep_ring, (o2, l2, r2))),
               one_step_same=all(torch.equal(x, y) for x, y in zip(one_step, (o2, l2, r2)))
               and all(torch.equal(x, y) for x, y in zip(one_step_tile, (one, one_lse, one_res))),
               same_as_one_tile=bool(torch.equal(out, one) and torch.equal(lse, one_lse) and torch.equal(r2, one_res)))
    print("ROW " + json.dumps(row), flush=True)
print("PERSISTENT OK")
"""


@requires_sm90
@needs_gluon
def test_gpu_persistent_matches_reference():
    """The persistent variant on every GPU case, in a child with a timeout (never run on a GPU
    before: a barrier deadlock fails this test instead of hanging the run): out and lse against
    float64 (NaN-poisoned first), the training launch's out / lse bit-identical to the inference
    one and its residual written, and the causal walk the head dim does not take by default
    (``PORTATTN_TRITON_PAIRED_WALK=0`` at D 128/256, ``=1`` at D 64: PAIRED_HEAD_DIMS) bit-identical
    to the default one (causal_sq_gt_sk's five tiles pair the middle one with a tile past the end), one Q buffer (``PORTATTN_TRITON_Q_BUFFERS=1``) bit-identical to two, the band in one step (``PORTATTN_TRITON_GLUON_ONE_STEP=1``, persistent and one-tile) to the step per phase, and a deeper K/V ring (``stages``: 5 at D 64, 3 at D 128, O through the Q tile there) to the default one; whether it is bit-identical to the one-tile kernel (ping-pong
    on) is printed, not judged. D 256 cases run its persistent kernel too (O through the Q tile)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, "-c", _PERSISTENT_CHILD], capture_output=True, text=True, timeout=300,
                              env=env, cwd=root)
    except subprocess.TimeoutExpired:
        pytest.fail("the persistent Gluon forward hung (killed after 300 s): a barrier deadlock")
    rows = [json.loads(ln[4:]) for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    print("\n".join(f"{r['case']}: same_as_one_tile={r['same_as_one_tile']}" for r in rows))
    assert "PERSISTENT OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(rows) == len(GPU_CASES)
    for r in rows:
        assert r["out"] and r["lse"] and r["unwritten"] == 0 and r["training_same"] and r["other_walk_same"], r
        assert r["one_q_buffer_same"] and r["deep_ring_same"] and r["one_step_same"], r
