"""The Triton portability check: every kernel config the backend can choose compiles for
NVIDIA sm_80/sm_90 and AMD gfx90a/gfx942 without a GPU and fits the target's shared memory.

By default only a smoke subset compiles (the forward kernel with every feature on, once per
target); the full set (`python -m portattn.backends.triton.portability`, ~96 compiles) runs in
CI through .ci/run and here under ``-m slow``. Compiles run in a subprocess because the test
process has Triton's interpreter on (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from portattn.backends.triton import configs, portability  # noqa: E402


def _run_cli(*args, timeout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, "-m", "portattn.backends.triton.portability", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_full_set_covers_every_config_the_backend_can_choose():
    """Each (kernel, target, config) reachable from configs.py is compiled by the full set."""
    compiled = {(c.kernel, str(c.target), c.config) for c in portability.cases()}
    for target, _limit in configs.PORTABILITY_TARGETS:
        for block_d in configs.PADDED_DIMS:
            for elem in sorted(set(configs.ELEM_SIZES.values())):
                fwd = configs.forward_config(target, block_d, elem)
                bwd = configs.backward_configs(target, block_d, elem)
                for kernel, cfg in (("attn_fwd", fwd), ("attn_bwd_dkdv", bwd.dkdv), ("attn_bwd_dq", bwd.dq)):
                    assert (kernel, str(target), cfg) in compiled, (kernel, str(target), block_d, elem, cfg)
    # atomic dQ (16-bit): every target's atomic dK/dV config, its table's dK/dV row where it has none
    atomic = {(str(c.target), c.config) for c in portability.cases() if getattr(c.features, "dq_atomic", False)}
    for target, _limit in configs.PORTABILITY_TARGETS:
        if str(target) not in portability.ATOMIC_TARGETS:
            continue
        for block_d in configs.PADDED_DIMS:
            cfg = configs.atomic_dkdv_config(target, block_d, 2)
            assert (str(target), cfg) in atomic, (str(target), block_d, cfg)
    features = {c.features.label() for c in portability.cases()}
    for name in ("varlen", "softcap", "alibi", "bias", "bool", "dbias", "top_left"):
        assert any(name in f.split("+") for f in features), name


def test_config_tables_stay_within_tl_dot_minimums():
    for target, _ in configs.PORTABILITY_TARGETS + ((configs.Target("cpu"), 0),):
        for block_d in configs.PADDED_DIMS:
            for elem in (2, 4):
                bwd = configs.backward_configs(target, block_d, elem)
                for cfg in (configs.forward_config(target, block_d, elem), bwd.dkdv, bwd.dq):
                    assert cfg.block_m >= 16 and cfg.block_n >= 16, (target, block_d, elem, cfg)


def test_padded_dim():
    assert [configs.padded_dim(d) for d in (1, 16, 24, 40, 72, 96, 128, 160, 256)] == \
        [16, 16, 32, 64, 128, 128, 128, 256, 256]


def test_smoke_compiles_for_all_four_targets(tmp_path):
    report = tmp_path / "rows.json"
    res = _run_cli("--smoke", "--jobs", "2", "--json", str(report), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(report.read_text())
    assert {r["target"] for r in rows} == {"sm_80", "sm_90", "gfx90a", "gfx942"}
    for r in rows:
        assert r["ok"] and 0 < r["shared"] <= r["limit"], r


@pytest.mark.slow
def test_full_portability_set(request):
    """~6 min on 2 cores: runs only when asked for (``-m slow``); CI runs the CLI instead."""
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("full compile set: run with -m slow, or python -m portattn.backends.triton.portability")
    res = _run_cli("--jobs", str(min(4, os.cpu_count() or 1)), timeout=1800)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def ptx_ops():
    """Instruction counts of the float32 forward and dQ kernels (softcap on) and the bf16
    forward, compiled for sm_90 without a GPU (one subprocess: no interpreter there)."""
    code = (
        "import json, torch\n"
        "from portattn.backends.triton import portability as P\n"
        "f = P.Features(softcap=True)\n"
        "out = {k: P.ptx_instructions(k, torch.float32, f) for k in ('attn_fwd', 'attn_bwd_dq', 'attn_bwd_dkdv')}\n"
        "out['bf16'] = P.ptx_instructions('attn_fwd', torch.bfloat16, f)\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_float32_divisions_are_ieee_in_the_ptx(ptx_ops):
    """float32 (IEEE mode) divides with div.rn.f32, not Triton's default div.full.f32 (up to 2 ulp),
    which left the H200's float32 outputs ~2x further from the reference than naive float32 math
    (2026-11-29); 16-bit inputs keep the fast division."""
    ops = ptx_ops
    for kernel in ("attn_fwd", "attn_bwd_dq"):
        assert ops[kernel].get("div.rn.f32", 0) > 0, ops[kernel]
        assert ops[kernel].get("div.full.f32", 0) == 0, ops[kernel]
    assert ops["bf16"].get("div.full.f32", 0) > 0, ops["bf16"]


def test_float32_scores_are_float64_dots_in_the_ptx(ptx_ops):
    """float32 scores Q Kᵀ are float64 dots (kernels._scores: DMMA or fma.rn.f64 on sm_90) in all
    three kernels that form them; the float32 FMA chain over D gave dV 5.9x and O 2.7x the naive
    error on the H200 (Sq=1, D=32, 2026-11-29). bf16 has no float64 arithmetic."""
    for kernel in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"):
        assert any(op.endswith(".f64") for op in ptx_ops[kernel]), ptx_ops[kernel]
    assert not any(".f64" in op for op in ptx_ops["bf16"]), ptx_ops["bf16"]


def compile_in_subprocess(code: str):
    """Run ``code`` (which compiles kernels for GPU targets and prints one JSON line last) in a
    fresh interpreter without ``TRITON_INTERPRET`` (fp fusion on by default, as the launches pin
    it); returns that JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_tma_forward_compiles_to_bulk_tensor_copies_on_sm90_only():
    """The forward's ``tma`` variant (issue #14) compiles for sm_90 to TMA copies
    (cp.async.bulk.tensor) feeding wgmma, with no cp.async left; the pointer kernel has no TMA;
    and a table row asking for TMA gives sm_80 and AMD the portable kernel (forward_config drops
    the flags), which still compiles there. One subprocess, no GPU."""
    code = (
        "import json, re, torch, triton\n"
        "from portattn.backends.triton import configs as C, kernels, portability as P\n"
        "C._FWD_NVIDIA['hopper'][128] = C._FWD_NVIDIA['ampere'][128] = (128, 64, 8, 3, True, False)\n"
        "C.forward_config.cache_clear()\n"
        "out = {}\n"
        "for tgt in (C.Target('nvidia', 90), C.Target('nvidia', 80), C.Target('amd', 'gfx942')):\n"
        "    cfg = C.forward_config(tgt, 128, 2)\n"
        "    for name, c in (('table', cfg), ('plain', C.KernelConfig(128, 64, 8, 3))):\n"
        "        if name == 'plain' and tgt.vendor != 'nvidia':\n"
        "            continue\n"
        "        case = P.Case('attn_fwd', tgt, 232448, torch.bfloat16, 128, c, P.PLAIN)\n"
        "        k = triton.compile(P._ast_source(kernels.attn_fwd, *P._signature(kernels.attn_fwd, case)),\n"
        "                           target=P._gpu_target(tgt), options=c.launch_options())\n"
        "        asm = k.asm.get('ptx') or k.asm['amdgcn']\n"
        "        out[f'{tgt} {name}'] = dict(tma=c.tma, bulk=asm.count('cp.async.bulk.tensor'),\n"
        "            wgmma=asm.count('wgmma.mma_async'), cp_async=len(re.findall(r'cp\\.async\\.(?:ca|cg)', asm)))\n"
        "print(json.dumps(out))\n")
    got = compile_in_subprocess(code)
    tma = got["sm_90 table"]
    assert tma["tma"] and tma["bulk"] > 0 and tma["wgmma"] > 0 and tma["cp_async"] == 0, got
    plain = got["sm_90 plain"]
    assert not plain["tma"] and plain["bulk"] == 0 and plain["cp_async"] > 0 and plain["wgmma"] > 0, got
    assert not got["sm_80 table"]["tma"] and got["sm_80 table"]["bulk"] == 0, got
    assert not got["gfx942 table"]["tma"], got


_PAGED_DECODE = r"""
import json, re, torch, triton
from portattn.backends.triton import decode, portability as P
from portattn.backends.triton.configs import PORTABILITY_TARGETS, decode_config
rows = []
for target, limit in PORTABILITY_TARGETS:
    cfg = decode_config(target, 128, 2, 64)            # the 64-row (Sq 8 x GQA 8) tile of each target
    sizes = (0, cfg.block_n * 4, cfg.block_n // 4, 24) if str(target) == "sm_90" else (cfg.block_n * 4, 16)
    for page in sizes:
        case = P.Case("decode_split", target, limit, torch.bfloat16, 128, cfg,
                      P.DecodeFeatures(paged=page > 0, page_size=max(page, 1)))
        sig = P._decode_signature(decode.decode_split, case)
        c = triton.compile(P._ast_source(decode.decode_split, *sig), target=P._gpu_target(target),
                           options=cfg.launch_options())
        ttgir = c.asm["ttgir"]
        loop = ttgir[ttgir.index("scf.for"):]
        loop = loop[:loop.index("scf.yield")]
        rows.append(dict(target=str(target), page=page, fit=decode.page_fit(page, cfg.block_n) if page else None,
                         stages=cfg.num_stages, shared=int(c.metadata.shared), limit=limit,
                         async_copies=loop.count("async_copy_global_to_local"),
                         vector_divs=len(re.findall(r"arith\.(?:divsi|remsi) %[\w.]+, %(?!cst)[\w.]+ : tensor<", loop))))
print(json.dumps(rows))
"""


def test_paged_decode_tiles_compile_and_pipeline_like_contiguous():
    """decode_split with a paged cache, 64-row tile, compiles for every target in each PAGE_FIT
    case; on sm_90 its K/V loads stay cp.async-pipelined in the loop as for a contiguous cache
    (Triton's pipeliner halves the stages when an address depends on a load of the same
    iteration), and the pages that fit the tile (a multiple of BLOCK_N, or a divisor) leave no
    per-row integer division by a run-time value in the loop (issue #13: those made 64-row paged tiles 0.53-0.85x
    of contiguous on the H200)."""
    rows = compile_in_subprocess(_PAGED_DECODE)
    assert {r["target"] for r in rows} == {"sm_80", "sm_90", "gfx90a", "gfx942"}
    for r in rows:
        assert 0 < r["shared"] <= r["limit"], r
    hopper = {r["page"]: r for r in rows if r["target"] == "sm_90"}
    contiguous = hopper.pop(0)
    assert contiguous["async_copies"] >= 2, contiguous
    for r in hopper.values():
        assert r["async_copies"] == contiguous["async_copies"] and r["shared"] == contiguous["shared"], (r, contiguous)
        assert (r["vector_divs"] == 0) == (r["fit"] != 0), r     # only the general fit (page 24) divides per row


_ATOMIC_DQ = r"""
import json, re, torch, triton
from portattn.backends.triton import configs as C, kernels, portability as P
out = {}
for d in (128, 256):
    tgt = C.Target("nvidia", 90)
    for atomic in (False, True):
        cfg = C.atomic_dkdv_config(tgt, d, 2)
        case = P.Case("attn_bwd_dkdv", tgt, 232448, torch.bfloat16, d, cfg, P.Features(dq_atomic=atomic))
        k = triton.compile(P._ast_source(kernels.attn_bwd_dkdv, *P._signature(kernels.attn_bwd_dkdv, case)),
                           target=P._gpu_target(tgt), options=cfg.launch_options())
        ptx = k.asm["ptx"]
        out[f"D{d} {atomic}"] = dict(shared=int(k.metadata.shared), wgmma=ptx.count("wgmma.mma_async"),
                                     mma_sync=ptx.count("mma.sync"), red_f32=len(re.findall(r"red\.[a-z.]*add[a-z0-9.]*f32", ptx)),
                                     atom_f32=len(re.findall(r"\batom\.[a-z.]*add[a-z0-9.]*f32", ptx)),
                                     atom=len(re.findall(r"\batom\.", ptx)))
print(json.dumps(out))
"""


def test_atomic_dq_compiles_to_wgmma_and_float32_reductions_on_sm90():
    """attn_bwd_dkdv with DQ_ATOMIC (issue #14) for sm_90's atomic rows (D 128, and D 256's split
    row): every product a wgmma (dQ is formed transposed, Kᵀ dSᵀ, so its M dimension is the head
    dim even for 16-row query tiles), dQ added with float32 global adds and no other atomic,
    within the shared memory limit; without DQ_ATOMIC no add is left. Which instruction carries
    the add is Triton's choice: 3.7 and later write fire-and-forget reductions (``red``), 3.6 (the
    H200's) vector ``atom.global.gpu.relaxed.add.v4.f32`` whose results nothing reads. One
    subprocess, no GPU."""
    got = compile_in_subprocess(_ATOMIC_DQ)
    for d in (128, 256):
        plain, atomic = got[f"D{d} False"], got[f"D{d} True"]
        adds = atomic["red_f32"] + atomic["atom_f32"]
        assert plain["red_f32"] + plain["atom"] == 0 and adds > 0 and atomic["atom"] == atomic["atom_f32"], got
        assert atomic["wgmma"] > plain["wgmma"] > 0 and atomic["mma_sync"] == 0, got
        assert atomic["shared"] <= 232448, got
