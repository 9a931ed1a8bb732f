"""Compile every kernel the CuPy backend can launch with NVRTC, without a GPU.

Usage::

    python -m portattn.backends.cupy.compile_check            # sm_80, sm_90 and sm_90a, all kernels
    python -m portattn.backends.cupy.compile_check --quick    # one head dim per family
    python -m portattn.backends.cupy.compile_check --arch 90 --head-dims 128
    python -m portattn.backends.cupy.compile_check --arch 90a # the wgmma forwards and backward only

``90a`` compiles the sm_90a translation unit (:data:`configs.WGMMA_SOURCE_FILES`: the wgmma
forwards and backward of :func:`configs.wgmma_configs` and the layout probe) for the arch-specific target;
``80`` / ``90`` compile everything else (:data:`configs.SOURCE_FILES`, :func:`configs.all_configs`).

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
    arch: int | str
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
def _program(names: list[str], options, source_files=None):
    """An NVRTC program of the backend source (``source_files``, default
    :data:`configs.SOURCE_FILES`) instantiating ``names``, compiled with ``options``: yields
    (nvrtc, program, log); raises CompileError when NVRTC fails; destroyed afterwards."""
    nvrtc = _nvrtc()
    src = configs.source() if source_files is None else configs.source(tuple(source_files))
    prog = _check(nvrtc.nvrtcCreateProgram(src.encode(), b"portattn_cupy.cu", 0, [], []),
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


def compile_names(names: list[str], arch, extra_options=(), source_files=None,
                  cubin_out: str | None = None) -> tuple[str, dict[str, str]]:
    """Compile the backend source for ``sm_<arch>`` (``arch`` 80, 90 or "90a") instantiating
    ``names``; ``source_files`` default: :data:`configs.WGMMA_SOURCE_FILES` for "90a", else
    :data:`configs.SOURCE_FILES`. ``cubin_out``: write the cubin there (for cuobjdump).

    Returns (NVRTC log, {name expression: lowered (mangled) name}). Raises CompileError.
    """
    if source_files is None and str(arch) == "90a":
        source_files = configs.WGMMA_SOURCE_FILES
    with _program(names, (f"--gpu-architecture=sm_{arch}", "--ptxas-options=-v", *extra_options),
                  source_files) as (nvrtc, prog, log):
        lowered = {}
        for n in names:
            low = _check(nvrtc.nvrtcGetLoweredName(prog, n.encode()), f"nvrtcGetLoweredName({n})")
            lowered[n] = low.decode() if isinstance(low, bytes) else str(low)
        if cubin_out:
            size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            buf = b" " * size
            _check(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            with open(cubin_out, "wb") as f:
                f.write(buf)
        return log, lowered


def ptx_for(names: list[str], arch: int = 90) -> str:
    """The PTX NVRTC makes for ``names`` (virtual ``compute_<arch>``): what the CUDA C++ compiles
    to before ptxas, e.g. to check that a product is rounded (``mul.rn``) rather than fused."""
    with _program(names, (f"--gpu-architecture=compute_{arch}",)) as (nvrtc, prog, _log):
        size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf.decode(errors="replace").rstrip("\x00")


# a kernel's lines start at "Compiling entry function '<name>'" or at "Function properties for <name>"
# (keyed on both, so that a log whose blocks come in another order still names each kernel's lines);
# the name may come quoted and followed by punctuation ("for '<name>':" as well as "for <name>")
_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_FOR_RE = re.compile(r"Function properties for '?([^'\s:,]+)")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str, lowered: dict[str, str], arch: int) -> list[KernelReport]:
    """Per-kernel resources from ptxas' verbose output (empty fields when it printed none).

    "Used N registers" goes to the entry function whose block it is in (the last "Compiling entry
    function" or "Function properties for" one of ``lowered``); a stack / spill line to the function
    named by the last "Function properties for" (none when that is not one of ``lowered``: a
    non-inlined device function's frame is not its caller's), so a device function's block between
    an entry's lines never takes the entry's registers away from it."""
    by_mangled = {v: KernelReport(k, arch) for k, v in lowered.items()}
    entry = props = None
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            entry = props = by_mangled.get(m.group(1))
            continue
        m = _PROPS_FOR_RE.search(line)
        if m:
            props = by_mangled.get(m.group(1))
            if props is not None:
                entry = props
            continue
        m = _PROPS_RE.search(line)
        if m:
            if props is not None:
                props.stack, props.spill_stores, props.spill_loads = map(int, m.groups())
            continue
        m = _USED_RE.search(line)
        if m and entry is not None:
            entry.registers = int(m.group(1))
            if m.group(2):
                entry.smem_static = int(m.group(2))
    return list(by_mangled.values())


def log_context(log: str, lowered_name: str, around: int = 4, limit: int = 12000) -> str:
    """The lines of an NVRTC / ptxas ``log`` that mention ``lowered_name``, each with ``around``
    lines either side (for an assertion message: what ptxas printed about one kernel); the whole
    log (its last ``limit`` characters) when no line names it."""
    lines = log.splitlines()
    hits = [i for i, ln in enumerate(lines) if lowered_name and lowered_name in ln]
    if not hits:
        text = log if len(log) <= limit else "[... " + str(len(log) - limit) + " characters cut]\n" + log[-limit:]
        return f"[{lowered_name!r} is in no line of the log ({len(lines)} lines); the whole log:]\n{text}"
    keep = sorted({j for i in hits for j in range(max(0, i - around), min(len(lines), i + around + 1))})
    out, prev = [], -1
    for j in keep:
        if j != prev + 1:
            out.append(f"[... lines {prev + 2}-{j} left out]" if prev >= 0 else f"[lines 1-{j} left out]")
        out.append(lines[j])
        prev = j
    if prev < len(lines) - 1:
        out.append(f"[... lines {prev + 2}-{len(lines)} left out]")
    return "\n".join(out)[-limit:]


def report_message(report: KernelReport, lowered: dict[str, str], log: str, nvrtc: str | None = None) -> str:
    """An assertion message about one kernel's ptxas report: the parsed report, which NVRTC made
    the log (``nvrtc``), whether the log is a PTX fallback's (no ptxas ran: no registers at all),
    and the log's lines around the kernel's lowered name (the whole log when it is missing)."""
    low = lowered.get(report.name, "")
    head = [f"{report}", f"lowered name: {low!r}"]
    if nvrtc:
        head.append(f"NVRTC: {nvrtc}")
    if log.startswith("[no cubin"):
        head.append("the log is the PTX fallback's: NVRTC made no cubin, so ptxas printed nothing")
    return "\n".join(head) + "\n--- ptxas log ---\n" + log_context(log, low)


def _configs_for(arch) -> list:
    return configs.wgmma_configs(with_probe=True) if str(arch) == "90a" else configs.all_configs()


def select_names(quick: bool = False, head_dims=None, arch=90) -> list[str]:
    """Name expressions to check: all, or one head dim per tile shape (``quick``); ``arch`` "90a":
    the sm_90a module's (the wgmma forwards, their probe and the wgmma backward)."""
    if head_dims is None and quick:
        head_dims = (64, 256)   # one per tensor-core tile shape and per float32 key-tile size
    names: dict[str, None] = {}
    for cfg in _configs_for(arch):
        if head_dims is not None and cfg.head_dim not in head_dims:
            continue
        for n in cfg.name_expressions():
            names[n] = None
    return list(names)


def smem_by_name(head_dims=None) -> dict[str, int]:
    """Dynamic shared memory of every name expression (the largest, should two configs share one)."""
    out: dict[str, int] = {}
    for cfg in configs.all_configs() + configs.wgmma_configs(with_probe=True):
        if head_dims is not None and cfg.head_dim not in head_dims:
            continue
        for role, name in cfg.kernel_names().items():
            out[name] = max(out.get(name, 0), cfg.smem_bytes(role))
    return out


def smem_violations(archs=(80, 90), head_dims=None) -> list[str]:
    """Kernels whose dynamic shared memory exceeds an architecture's opt-in limit (each
    architecture's own kernels: "90a" the sm_90a module's, with sm_90's limit)."""
    smem = smem_by_name(head_dims)
    out = []
    for arch in archs:
        limit = configs.SMEM_LIMITS.get(int(str(arch).rstrip("a")), min(configs.SMEM_LIMITS.values()))
        mine = set(select_names(head_dims=head_dims, arch=arch))
        out += [f"{name} sm_{arch}: {n} bytes > {limit}" for name, n in smem.items() if name in mine and n > limit]
    return out


def run(archs=(80, 90, "90a"), quick=False, head_dims=None, fail_on_spills=False, out=sys.stdout) -> int:
    smem = smem_by_name(head_dims)
    reports: list[KernelReport] = []
    for arch in archs:
        names = select_names(quick, head_dims, arch=arch)
        if not names:
            continue
        t0 = time.perf_counter()
        log, lowered = compile_names(names, arch)
        reports += parse_ptxas_log(log, lowered, arch)
        print(f"sm_{arch}: {len(names)} kernels compiled in {time.perf_counter() - t0:.1f} s", file=out)
    spilled = [r for r in reports if r.spill_stores or r.spill_loads]
    print(f"{'kernel':<52} {'arch':>5} {'regs':>5} {'spill st/ld':>12} {'stack':>6} {'smem':>7}", file=out)
    for r in reports:
        fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
        print(f"{r.name:<52} {'sm_' + str(r.arch):>6} {fmt(r.registers):>5} "
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
    p.add_argument("--arch", nargs="+", default=["80", "90", "90a"],
                   help="SM versions: 80, 90 (every module but the wgmma ones), 90a (the wgmma forwards and backward); "
                        "default: all three")
    p.add_argument("--quick", action="store_true", help="one head dim per tile shape (64, 256)")
    p.add_argument("--head-dims", type=int, nargs="+", help="only these padded head dims")
    p.add_argument("--fail-on-spills", action="store_true", help="exit 1 when a kernel spills")
    args = p.parse_args(argv)
    try:
        archs = [a if a == "90a" else int(a) for a in args.arch]
        return run(archs, args.quick, args.head_dims, args.fail_on_spills)
    except CompileError as exc:
        print(str(exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
