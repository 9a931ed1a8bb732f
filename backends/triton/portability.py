"""Portability check: compile every Triton kernel in every configuration the backend can choose,
for NVIDIA sm_80 / sm_90 and AMD gfx90a / gfx942, with no GPU.

    python -m portattn.backends.triton.portability            # the full set (CI)
    python -m portattn.backends.triton.portability --quick    # one hard case per kernel and target
    python -m portattn.backends.triton.portability --smoke    # the forward kernel, once per target
    python -m portattn.backends.triton.portability --jobs 2 --json report.json

Each case is ``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget(...))``
with the launch options of :mod:`.configs`. A case fails on any compile error or when its shared
memory (LDS on AMD) exceeds the target's per-block limit; the exit status is 1 if any case
failed. The table lists kernel, configuration, target, shared memory and, where the target
reports them, registers and spills (cuobjdump's resource usage for cubin, the AMDGPU metadata
for hsaco).

The case list (:func:`cases`) is built from :mod:`.configs`: for every target, dtype and padded
head dimension the backend can pick, each kernel with its config; the feature constexprs that
change code (varlen, softcap, ALiBi, additive bias and its gradient, bool mask, top-left,
non-power-of-two head dims, Dv ≠ D, IEEE vs TF32 float32) are covered by variants on top, and
the dK/dV kernel with atomic dQ (``DQ_ATOMIC``) for sm_80, sm_90 and gfx942: the atomic row of
the table, or its dK/dV row where the target has none.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from .configs import (
    ELEM_SIZES,
    PORTABILITY_TARGETS,
    KernelConfig,
    Target,
    atomic_dkdv_config,
    backward_configs,
    forward_config,
)

_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Features:
    """The feature constexprs of one case (defaults: plain dense attention)."""

    varlen: bool = False
    bottom_right: bool = True
    softcap: bool = False
    alibi: bool = False
    bias_mode: int = 0        # 0 none, 1 additive, 2 bool
    bias_grad: bool = False
    dlse: bool = False        # a gradient reaches lse (attn_bwd_dq's HAS_DLSE)
    ieee: bool = True         # float32 only: IEEE products (False = TF32 where the target has it)
    head_d: int | None = None  # None = the padded dim itself; else a non-power-of-two dim
    head_dv: int | None = None
    dq_atomic: bool = False   # attn_bwd_dkdv's DQ_ATOMIC (FA2's atomic dQ; configs.atomic_dkdv_config)

    def label(self) -> str:
        names = [n for n, on in (("varlen", self.varlen), ("top_left", not self.bottom_right),
                                 ("softcap", self.softcap), ("alibi", self.alibi),
                                 ("bias", self.bias_mode == 1), ("bool", self.bias_mode == 2),
                                 ("dbias", self.bias_grad), ("dlse", self.dlse),
                                 ("atomic_dq", self.dq_atomic)) if on]
        if self.head_d is not None:
            names.append(f"D{self.head_d}/Dv{self.head_dv}")
        return "+".join(names) or "plain"


PLAIN = Features()


@dataclass(frozen=True)
class Case:
    kernel: str            # attn_fwd | attn_bwd_prep | attn_bwd_dkdv | attn_bwd_dq
    target: Target
    smem_limit: int
    dtype: torch.dtype
    block_d: int
    config: KernelConfig
    features: Features = field(default=PLAIN)

    def describe(self) -> str:
        dt = _TRITON_DTYPE[self.dtype]
        prec = "" if self.dtype != torch.float32 else ("/ieee" if self.features.ieee else "/tf32")
        return f"{dt}{prec} D{self.block_d} {self.config.short()} [{self.features.label()}]"


# ----- the case list ------------------------------------------------------------------------

def _configs_for(kernel: str, target: Target, block_d: int, dtype: torch.dtype,
                 features: Features = PLAIN) -> KernelConfig:
    es = ELEM_SIZES[dtype]
    if kernel == "attn_fwd":
        return forward_config(target, block_d, es)
    if features.dq_atomic:
        return atomic_dkdv_config(target, block_d, es)
    bwd = backward_configs(target, block_d, es)
    return {"attn_bwd_dkdv": bwd.dkdv, "attn_bwd_dq": bwd.dq, "attn_bwd_prep": bwd.prep}[kernel]


MAIN_KERNELS = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")
ALL_FEATURES_ON = Features(varlen=True, bottom_right=False, softcap=True, alibi=True, bias_mode=1, bias_grad=True,
                           dlse=True, ieee=False)
#: the atomic-dQ dK/dV kernel with every feature it can run with (a float bias, but no bias gradient)
ATOMIC_FEATURES = Features(varlen=True, bottom_right=False, softcap=True, alibi=True, bias_mode=1, dlse=True,
                           dq_atomic=True)
#: the targets whose atomic-dQ kernels are compiled (gfx90a shares gfx942's tables and code path;
#: all four compiled, 2026-12-01, triton 3.9)
ATOMIC_TARGETS = ("sm_80", "sm_90", "gfx942")


def _odd_dims(block_d: int) -> tuple[int, int]:
    """A non-power-of-two head dim padded to ``block_d`` and a different Dv with the same padding."""
    return (block_d * 3 // 4, block_d * 5 // 8) if block_d >= 32 else (12, 10)


def _with_odd_dims(features: Features, block_d: int) -> Features:
    d, dv = _odd_dims(block_d)
    return Features(**{**features.__dict__, "head_d": d, "head_dv": dv})


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    """Every configuration the backend can choose (``quick``: the hardest one per kernel and
    target; ``smoke``: only the forward kernel with every feature, once per target).

    Configs depend on (target, padded head dim, element size) and the tables give D 16/32 the
    tiles of D 64, so for each target the full set compiles the three main kernels with fp16 and
    every feature on (non-power-of-two D ≠ Dv) at D 64/128/256, bf16 plain at D 128, fp32 at D 64, 128 (TF32)
    and 256 (IEEE); a bool mask with varlen (fwd and dq) at D 32.
    ``test_full_set_covers_every_config_the_backend_can_choose`` checks the coverage.
    """
    out: list[Case] = []
    for target, limit in PORTABILITY_TARGETS:
        def add(kernel, dtype, block_d, features=PLAIN, target=target, limit=limit):
            cfg = _configs_for(kernel, target, block_d, dtype, features)
            out.append(Case(kernel, target, limit, dtype, block_d, cfg, features))

        if smoke:
            add("attn_fwd", torch.bfloat16, 128, _with_odd_dims(ALL_FEATURES_ON, 128))
            continue
        if quick:
            for kernel in MAIN_KERNELS:
                add(kernel, torch.bfloat16, 128, _with_odd_dims(ALL_FEATURES_ON, 128))
            add("attn_fwd", torch.float32, 256)
            add("attn_bwd_prep", torch.bfloat16, 128, Features(varlen=True, dlse=True))
            if str(target) in ATOMIC_TARGETS:
                add("attn_bwd_dkdv", torch.bfloat16, 256, _with_odd_dims(ATOMIC_FEATURES, 256))
            continue
        for kernel in MAIN_KERNELS:
            for block_d in (64, 128, 256):
                add(kernel, torch.float16, block_d, _with_odd_dims(ALL_FEATURES_ON, block_d))
            add(kernel, torch.bfloat16, 128)
            add(kernel, torch.float32, 64)
            add(kernel, torch.float32, 128, Features(ieee=False))
            add(kernel, torch.float32, 256)
        # atomic dQ (16-bit only): every head dim's atomic row with every feature on; where the
        # target's table has none (off there), its dK/dV row, so that turning it on is known to
        # compile; bf16 without features where the table has atomic rows (Hopper)
        if str(target) in ATOMIC_TARGETS:
            for block_d in (64, 128, 256):
                add("attn_bwd_dkdv", torch.float16, block_d, _with_odd_dims(ATOMIC_FEATURES, block_d))
            if backward_configs(target, 128, 2).atomic is not None:
                add("attn_bwd_dkdv", torch.bfloat16, 128, Features(dq_atomic=True))
        add("attn_fwd", torch.bfloat16, 32, Features(varlen=True, bias_mode=2))
        add("attn_bwd_dq", torch.bfloat16, 32, Features(varlen=True, bias_mode=2))
        # the 16-bit backward's row-statistics kernel (no feature but varlen and dlse changes its code)
        for block_d in (64, 256):
            add("attn_bwd_prep", torch.float16, block_d, _with_odd_dims(Features(varlen=True, dlse=True), block_d))
        add("attn_bwd_prep", torch.bfloat16, 128)
    return out


# ----- building one compile -----------------------------------------------------------------

_FLOAT_ARGS = {"qk_scale2", "softcap_scale", "softcap2", "sm_scale"}
_FP32_PTRS = {"LSE", "ROWMAX", "ROWINV", "DELTA", "DLSE", "SLOPES", "DQ_ACC"}
_I32_PTRS = {"CU_Q", "CU_K"}


def _signature(fn, case: Case):
    """(signature, constexprs, attrs) for ``triton.compile`` of ``case``."""
    from . import kernels
    f = case.features
    dt = _TRITON_DTYPE[case.dtype]
    cfg = case.config
    head_d = f.head_d or case.block_d
    head_dv = f.head_dv or case.block_d
    values = dict(
        HEAD_D=head_d, HEAD_DV=head_dv, BLOCK_D=case.block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, IS_VARLEN=f.varlen, BOTTOM_RIGHT=f.bottom_right,
        SOFTCAP=f.softcap, ALIBI=f.alibi, BIAS_MODE=f.bias_mode, BIAS_GRAD=f.bias_grad, HAS_DLSE=f.dlse,
        IEEE=case.dtype == torch.float32 and f.ieee,
        RAW_SCORES=case.dtype == torch.float32 and not f.softcap and not f.alibi and f.bias_mode != kernels.BIAS_ADD,
        EXACT_STATS=case.dtype == torch.float32, LONGEST_FIRST=not f.bottom_right,
        RESIDUAL=case.dtype != torch.float32,
        TMA=cfg.tma, WS=cfg.ws,
        PART=2 if cfg.split else 0,   # attn_bwd_dkdv: a split config's heavier (dK) launch
        DQ_ATOMIC=f.dq_atomic,
    )
    bias_ty = "*u8" if f.bias_mode == kernels.BIAS_BOOL else f"*{dt}"
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in values:
            signature[name] = "constexpr"
            constexprs[name] = values[name]
        elif name.isupper():   # pointers
            if name in _FP32_PTRS:
                signature[name] = "*fp32"
            elif name in _I32_PTRS:
                signature[name] = "*i32"
            elif name in ("BIAS", "DBIAS"):
                signature[name] = bias_ty
            else:
                signature[name] = f"*{dt}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_") and name[-1] in "bsh" and not name.startswith(("stride_b", "stride_l",
                                                                                          "stride_il")):
                attrs[(i,)] = [["tt.divisibility", 16]]   # row strides of q/k/v/o/grads (H·D)
    return signature, constexprs, attrs


def _gpu_target(target: Target):
    from triton.backends.compiler import GPUTarget
    if target.vendor == "nvidia":
        return GPUTarget("cuda", int(target.arch), 32)
    return GPUTarget("hip", str(target.arch), 64)


def _ast_source(fn, signature, constexprs, attrs):
    """ASTSource across triton versions: constexprs in the signature (3.3+) or left out (older)."""
    from triton.compiler import ASTSource
    try:
        return ASTSource(fn, signature, constexprs, attrs)
    except (TypeError, KeyError, AssertionError):
        plain = {k: v for k, v in signature.items() if v != "constexpr"}
        return ASTSource(fn, plain, constexprs, attrs)


def _nvidia_resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack-frame bytes per thread: where spills go) from cuobjdump, if available."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if not tool:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        try:
            text = subprocess.run([tool, "-res-usage", fh.name], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return (int(regs.group(1)) if regs else None, int(stack.group(1)) if stack else None)


def _amd_resources(amdgcn: str) -> tuple[int | None, int | None]:
    """(VGPRs, spilled VGPRs) from the AMDGPU assembly's metadata comments."""
    vgpr = re.search(r";\s*NumVgprs:\s*(\d+)", amdgcn)
    spills = [int(x) for x in re.findall(r"\.vgpr_spill_count:\s*(\d+)", amdgcn)]
    return (int(vgpr.group(1)) if vgpr else None, sum(spills) if spills else None)


def ptx_instructions(kernel: str, dtype: torch.dtype, features: Features = PLAIN, arch: int = 90,
                     block_d: int = 64) -> dict[str, int]:
    """Counts of the division/exp/reciprocal/fma/mma instructions in one kernel's PTX for sm_``arch``
    (no GPU needed): how the kernels' float32 arithmetic is actually compiled."""
    import collections

    import triton

    from . import kernels
    target = next(t for t, _ in PORTABILITY_TARGETS if t.vendor == "nvidia" and int(t.arch) == arch)
    limit = dict(PORTABILITY_TARGETS)[target]
    case = Case(kernel, target, limit, dtype, block_d, _configs_for(kernel, target, block_d, dtype, features), features)
    fn = getattr(kernels, kernel)
    compiled = triton.compile(_ast_source(fn, *_signature(fn, case)), target=_gpu_target(target),
                              options=case.config.launch_options())
    ops = re.findall(r"\b((?:div|ex2|rcp|lg2|fma|mma)\.[a-z0-9.]+)", compiled.asm["ptx"])
    return dict(collections.Counter(ops))


def _compile_row(case: Case, fn, signature_of) -> dict:
    """Compile ``fn`` for ``case``'s target: a row of the report (``ok`` False on a compile error
    or over the shared-memory limit). ``signature_of(fn, case)`` gives :func:`_ast_source`'s
    (signature, constexprs, attrs); it is called inside the row's ``try``, so that its errors are
    the case's too."""
    import triton

    row = dict(kernel=case.kernel, config=case.describe(), target=str(case.target), limit=case.smem_limit,
               shared=None, regs=None, spills=None, ok=False, error="", seconds=0.0)
    start = time.perf_counter()
    try:
        compiled = triton.compile(_ast_source(fn, *signature_of(fn, case)), target=_gpu_target(case.target),
                                  options=case.config.launch_options())
        row["shared"] = shared = int(compiled.metadata.shared)
        if case.target.vendor == "nvidia":
            row["regs"], row["spills"] = _nvidia_resources(compiled.asm["cubin"])
        else:
            row["regs"], row["spills"] = _amd_resources(compiled.asm.get("amdgcn", ""))
        if shared > case.smem_limit:
            row["error"] = f"shared memory {shared} B > limit {case.smem_limit} B"
        else:
            row["ok"] = True
    except Exception as exc:  # any compile error is a failed case, reported with its message
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
        row["error"] = " | ".join(line for line in msg if line.strip())[-400:]
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def compile_case(case: Case) -> dict:
    """Compile one case; returns a row of the report (``ok`` False on error or over the limit)."""
    from . import kernels
    fn = getattr(kernels, case.kernel)
    return _compile_row(case, fn, _signature)


# ----- driver -------------------------------------------------------------------------------

def _fmt(row: dict) -> str:
    shared = "-" if row["shared"] is None else f"{row['shared']}"
    regs = "-" if row["regs"] is None else str(row["regs"])
    spills = "-" if row["spills"] is None else str(row["spills"])
    status = "ok" if row["ok"] else "FAIL " + row["error"]
    return (f"{row['kernel']:<20} {row['target']:<7} {row['config']:<64} {shared:>7}/{row['limit']:<6} "
            f"{regs:>4} {spills:>6}  {row['seconds']:>5.1f}s {status}")


def run(quick: bool = False, jobs: int = 2, out=sys.stdout, only: str | None = None, smoke: bool = False) -> list[dict]:
    """Compile every case (in ``jobs`` processes), print progress and the table; return the rows."""
    todo = cases(quick, smoke)
    if only:
        todo = [c for c in todo if only in c.kernel or only in str(c.target) or only in c.describe()]
    print(f"portability: {len(todo)} compiles, {jobs} job(s)", file=out, flush=True)
    print(f"{'kernel':<20} {'target':<7} {'config':<64} {'shared/limit':>14} {'regs':>4} {'spills':>6}", file=out)
    rows: list[dict] = []
    if jobs <= 1:
        for i, case in enumerate(todo, 1):
            row = compile_case(case)
            rows.append(row)
            print(f"[{i}/{len(todo)}] {_fmt(row)}", file=out, flush=True)
    else:
        with cf.ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(compile_case, c) for c in todo]
            for i, fut in enumerate(cf.as_completed(futures), 1):
                row = fut.result()
                rows.append(row)
                print(f"[{i}/{len(todo)}] {_fmt(row)}", file=out, flush=True)
    failed = [r for r in rows if not r["ok"]]
    print(f"portability: {len(rows) - len(failed)}/{len(rows)} ok", file=out)
    for r in failed:
        print(f"FAILED: {_fmt(r)}", file=out)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portattn.backends.triton.portability", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one hard case per kernel and target")
    parser.add_argument("--smoke", action="store_true", help="the forward kernel with every feature, once per target")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel compiles (default 2)")
    parser.add_argument("--only", default=None, help="keep cases whose kernel/target/config contains this text")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("portability: unset TRITON_INTERPRET (the interpreter cannot compile for GPU targets)", file=sys.stderr)
        return 2
    rows = run(quick=args.quick, jobs=args.jobs, only=args.only, smoke=args.smoke)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if rows and all(r["ok"] for r in rows) else 1



# ----- decode (split-KV) kernels: backends/triton/decode.py -------------------------------------
# Their cases join the list above (``cases`` and ``compile_case`` are extended, not changed):
# for every target, each distinct decode config the backend can choose (configs.decode_config
# over every padded head dim, element size and packed tile height), compiled at the largest head
# dim that uses it with features alternating (paged, softcap, ALiBi, top-left, odd head dims),
# plus the combine and append kernels once per target and dtype size. Tile heights 16 and 32
# share their tiles (fewer rows: less shared memory and fewer registers), so a config is
# compiled at height 32 for both.

DECODE_KERNELS = ("decode_split", "decode_combine", "decode_append")


@dataclass(frozen=True)
class DecodeFeatures:
    """The feature constexprs of one decode case."""

    paged: bool = False
    softcap: bool = False
    alibi: bool = False
    bottom_right: bool = True
    ieee: bool = True
    head_d: int | None = None
    head_dv: int | None = None
    num_splits: int = 8
    append: bool = False   # decode_split's prologue writes the new k/v rows (APPEND)
    page_size: int = 16    # paged: the cache's page size (decode.page_fit picks PAGE_FIT from it)

    def label(self) -> str:
        names = [n for n, on in ((f"paged{self.page_size}", self.paged), ("softcap", self.softcap), ("alibi", self.alibi),
                                 ("top_left", not self.bottom_right), ("append", self.append)) if on]
        if self.head_d is not None:
            names.append(f"D{self.head_d}/Dv{self.head_dv}")
        return "+".join(names) or "plain"


def decode_cases(quick: bool = False, smoke: bool = False) -> list[Case]:
    """The decode kernels' cases (``smoke``: none; ``quick``: the D 128 bf16 decode kernel with
    every feature, once per target)."""
    from .configs import DECODE_BLOCK_MS, PADDED_DIMS, decode_config
    if smoke:
        return []
    out: list[Case] = []
    every = DecodeFeatures(paged=True, softcap=True, alibi=True, bottom_right=False, append=True, page_size=24)
    for target, limit in PORTABILITY_TARGETS:
        if quick:
            out.append(Case("decode_split", target, limit, torch.bfloat16, 128,
                            decode_config(target, 128, 2, 16), every))
            continue
        chosen: dict = {}
        for block_d in PADDED_DIMS:                      # ascending: the largest head dim wins
            for dtype in (torch.float16, torch.float32):
                for block_m in DECODE_BLOCK_MS:
                    for paged in (False, True):   # a paged row of the table (configs._DECODE_ROWS_NVIDIA)
                        cfg = decode_config(target, block_d, ELEM_SIZES[dtype], max(32, block_m), paged=paged)
                        chosen[cfg] = (dtype, block_d)
        for n, (cfg, (dtype, block_d)) in enumerate(sorted(chosen.items(), key=lambda kv: kv[0].short())):
            if n % 2:
                feats = DecodeFeatures(paged=True, softcap=n % 4 == 1, alibi=n % 4 == 3,
                                       bottom_right=n % 3 != 0, ieee=n % 4 != 3, append=n % 4 == 1,
                                       page_size=(16, 256, 24)[n // 2 % 3])
            else:
                d, dv = _odd_dims(block_d)
                feats = DecodeFeatures(head_d=d, head_dv=dv, ieee=n % 4 != 2, append=n % 4 == 2)
            out.append(Case("decode_split", target, limit, dtype, block_d, cfg, feats))
        for dtype in (torch.bfloat16, torch.float32):
            out.append(Case("decode_combine", target, limit, dtype, 128, KernelConfig(16, 16, 4, 1),
                            DecodeFeatures(num_splits=MAX_DECODE_SPLITS_COMPILED)))
            out.append(Case("decode_append", target, limit, dtype, 128, KernelConfig(16, 16, 1, 1),
                            DecodeFeatures(paged=dtype == torch.bfloat16)))
    return out


MAX_DECODE_SPLITS_COMPILED = 128
_DECODE_I32_PTRS = {"BT", "SEQLENS"}
_DECODE_FP32_PTRS = {"SLOPES", "LSE", "OP", "LSEP"}
_DECODE_FLOATS = {"qk_scale2", "softcap_scale", "softcap2"}


def _decode_signature(fn, case: Case):
    from .decode import page_fit_for
    f = case.features
    dt = _TRITON_DTYPE[case.dtype]
    cfg = case.config
    values = dict(
        HEAD_D=f.head_d or case.block_d, HEAD_DV=f.head_dv or case.block_d, BLOCK_D=case.block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=f.num_splits > 1, PAGED=f.paged,
        PAGE_FIT=page_fit_for(cfg, f.page_size) if f.paged else 0,
        BOTTOM_RIGHT=f.bottom_right, SOFTCAP=f.softcap, ALIBI=f.alibi,
        IEEE=case.dtype == torch.float32 and f.ieee,
        RAW_SCORES=case.dtype == torch.float32 and not f.softcap and not f.alibi, APPEND=f.append,
        BLOCK_S=max(16, MAX_DECODE_SPLITS_COMPILED),
    )
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in values:
            signature[name] = "constexpr"
            constexprs[name] = values[name]
        elif name.isupper():
            signature[name] = ("*i32" if name in _DECODE_I32_PTRS else "*fp32" if name in _DECODE_FP32_PTRS
                               else f"*{dt}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _DECODE_FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_") and name[-1] in "psh" and name not in ("stride_bt",):
                attrs[(i,)] = [["tt.divisibility", 16]]   # row/page/head strides of the caches and q
    return signature, constexprs, attrs


def _compile_decode_case(case: Case) -> dict:
    from . import decode
    fn = getattr(decode, case.kernel)
    return _compile_row(case, fn, _decode_signature)


_attention_cases = cases
_attention_compile_case = compile_case


def cases(quick: bool = False, smoke: bool = False) -> list[Case]:  # noqa: F811 (extends the list above)
    """The attention kernels' cases (see above) followed by the decode kernels' (:func:`decode_cases`)."""
    return _attention_cases(quick, smoke) + decode_cases(quick, smoke)


def compile_case(case: Case) -> dict:  # noqa: F811
    """Compile one case (attention or decode kernel); a row of the report."""
    if case.kernel in DECODE_KERNELS:
        return _compile_decode_case(case)
    return _attention_compile_case(case)


if __name__ == "__main__":
    sys.exit(main())
