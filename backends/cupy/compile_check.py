"""Compile every kernel the CuPy backend can launch with NVRTC, without a GPU.

Usage::

    python -m portattn.backends.cupy.compile_check            # sm_80 and sm_90, all kernels
    python -m portattn.backends.cupy.compile_check --quick    # one head dim per family
    python -m portattn.backends.cupy.compile_check --arch 90 --head-dims 128

NVRTC comes from NVIDIA's PyPI wheels through ``cuda.bindings.nvrtc`` (``pip install
portattn[nvrtc]``); no driver or device is needed. The source is the same text CuPy compiles
at run time (:func:`configs.source`) and the name expressions come from
:func:`configs.all_configs`, so what passes here is what the backend can choose. NVRTC is asked
for cubin of each real architecture with ``-Xptxas -v``; the per-kernel registers, spills and
stack frames it reports are printed in a table, with each kernel's dynamic shared memory from
:meth:`configs.KernelConfig.smem_bytes`. Exit status 1 on any compile error and on any kernel
whose shared memory exceeds the architecture's opt-in limit (:data:`configs.SMEM_LIMITS`: 227 KB
on sm_90, 163 KB on sm_80); spills are listed (``--fail-on-spills`` makes them an error too).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from dataclasses import dataclass

from . import configs


class CompileError(RuntimeError):
    pass


@dataclass
class KernelReport:
    name: str
    arch: int
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    smem_static: int | None = None


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CompileError("cuda.bindings is not installed: pip install 'portattn[nvrtc]' "
                           "(cuda-bindings, nvidia-cuda-nvrtc)") from exc
    return nvrtc


def _check(result, what: str, log: str = ""):
    err = result[0]
    if int(err) != 0:
        raise CompileError(f"{what} failed: {err}" + (f"\n{log}" if log else ""))
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


@contextlib.contextmanager
def _program(names: list[str], options):
    """An NVRTC program of the backend source instantiating ``names``, compiled with ``options``:
    yields (nvrtc, program, log); raises CompileError when NVRTC fails; destroyed afterwards."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(configs.source().encode(), b"portattn_cupy.cu", 0, [], []),
                  "nvrtcCreateProgram")
    try:
        for n in names:
            _check(nvrtc.nvrtcAddNameExpression(prog, n.encode()), f"nvrtcAddNameExpression({n})")
        opts = [o.encode() for o in (*configs.NVRTC_OPTIONS, *options)]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.decode(errors="replace").rstrip("\x00 \n")
        if int(result[0]) != 0:
            raise CompileError(f"NVRTC failed ({' '.join(options)}):\n{log}")
        yield nvrtc, prog, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_names(names: list[str], arch: int, extra_options=()) -> tuple[str, dict[str, str]]:
    """Compile the backend source for ``sm_<arch>`` instantiating ``names``.

    Returns (NVRTC log, {name expression: lowered (mangled) name}). Raises CompileError.
    """
    with _program(names, (f"--gpu-architecture=sm_{arch}", "--ptxas-options=-v", *extra_options)) as (nvrtc, prog, log):
        lowered = {}
        for n in names:
            low = _check(nvrtc.nvrtcGetLoweredName(prog, n.encode()), f"nvrtcGetLoweredName({n})")
            lowered[n] = low.decode() if isinstance(low, bytes) else str(low)
        return log, lowered


def ptx_for(names: list[str], arch: int = 90) -> str:
    """The PTX NVRTC makes for ``names`` (virtual ``compute_<arch>``): what the CUDA C++ compiles
    to before ptxas, e.g. to check that a product is rounded (``mul.rn``) rather than fused."""
    with _program(names, (f"--gpu-architecture=compute_{arch}",)) as (nvrtc, prog, _log):
        size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf.decode(errors="replace").rstrip("\x00")


_FUNC_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str, lowered: dict[str, str], arch: int) -> list[KernelReport]:
    """Per-kernel resources from ptxas' verbose output (empty fields when it printed none)."""
    by_mangled = {v: KernelReport(k, arch) for k, v in lowered.items()}
    current = None
    for line in log.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            current = by_mangled.get(m.group(1))
            continue
        if current is None:
            continue
        m = _PROPS_RE.search(line)
        if m:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
            continue
        m = _USED_RE.search(line)
        if m:
            current.registers = int(m.group(1))
            if m.group(2):
                current.smem_static = int(m.group(2))
    return list(by_mangled.values())


def select_names(quick: bool = False, head_dims=None) -> list[str]:
    """Name expressions to check: all, or one head dim per tile shape (``quick``)."""
    if head_dims is None and quick:
        head_dims = (64, 256)   # one per tensor-core tile shape and per float32 key-tile size
    names: dict[str, None] = {}
    for cfg in configs.all_configs():
        if head_dims is not None and cfg.head_dim not in head_dims:
            continue
        for n in cfg.name_expressions():
            names[n] = None
    return list(names)


def smem_by_name(head_dims=None) -> dict[str, int]:
    """Dynamic shared memory of every name expression (the largest, should two configs share one)."""
    out: dict[str, int] = {}
    for cfg in configs.all_configs():
        if head_dims is not None and cfg.head_dim not in head_dims:
            continue
        for role, name in cfg.kernel_names().items():
            out[name] = max(out.get(name, 0), cfg.smem_bytes(role))
    return out


def smem_violations(archs=(80, 90), head_dims=None) -> list[str]:
    """Kernels whose dynamic shared memory exceeds an architecture's opt-in limit."""
    smem = smem_by_name(head_dims)
    return [f"{name} sm_{arch}: {n} bytes > {configs.SMEM_LIMITS[arch]}"
            for arch in archs for name, n in smem.items()
            if n > configs.SMEM_LIMITS.get(arch, min(configs.SMEM_LIMITS.values()))]


def run(archs=(80, 90), quick=False, head_dims=None, fail_on_spills=False, out=sys.stdout) -> int:
    names = select_names(quick, head_dims)
    smem = smem_by_name(head_dims)
    reports: list[KernelReport] = []
    for arch in archs:
        t0 = time.perf_counter()
        log, lowered = compile_names(names, arch)
        reports += parse_ptxas_log(log, lowered, arch)
        print(f"sm_{arch}: {len(names)} kernels compiled in {time.perf_counter() - t0:.1f} s", file=out)
    spilled = [r for r in reports if r.spill_stores or r.spill_loads]
    print(f"{'kernel':<52} {'arch':>5} {'regs':>5} {'spill st/ld':>12} {'stack':>6} {'smem':>7}", file=out)
    for r in reports:
        fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
        print(f"{r.name:<52} {'sm_' + str(r.arch):>5} {fmt(r.registers):>5} "
              f"{fmt(r.spill_stores) + '/' + fmt(r.spill_loads):>12} {fmt(r.stack):>6} {smem.get(r.name, 0):>7}",
              file=out)
    too_big = smem_violations(archs, head_dims)
    if too_big:
        print("shared memory over the opt-in limit: " + "; ".join(too_big), file=out)
        return 1
    if spilled:
        print(f"{len(spilled)} kernel(s) spill to local memory: "
              + ", ".join(f"{r.name} sm_{r.arch}" for r in spilled), file=out)
        if fail_on_spills:
            return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="SM versions (default: 80 90)")
    p.add_argument("--quick", action="store_true", help="one head dim per tile shape (64, 256)")
    p.add_argument("--head-dims", type=int, nargs="+", help="only these padded head dims")
    p.add_argument("--fail-on-spills", action="store_true", help="exit 1 when a kernel spills")
    args = p.parse_args(argv)
    try:
        return run(args.arch, args.quick, args.head_dims, args.fail_on_spills)
    except CompileError as exc:
        print(str(exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
