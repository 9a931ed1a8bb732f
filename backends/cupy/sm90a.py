"""Compiling the sm_90a module (the wgmma forward) with NVRTC, outside CuPy's RawModule.

``cupy.RawModule(code=...)`` appends its own ``-arch=sm_<cc>`` for the device (cupy/cuda/
compiler.py, ``_get_arch_for_options_for_nvrtc``: the compute capability as a number, no
arch-specific ``a`` suffix), and wgmma assembles only for the ``sm_90a`` target. So this module
asks NVRTC itself (``cuda.bindings.nvrtc`` where installed, else CuPy's own binding
``cupy_backends.cuda.libs.nvrtc``) for a cubin of ``sm_90a``, keeps it in a file under CuPy's kernel cache
directory (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) keyed by the source, options,
names and NVRTC version, and the caller loads it with ``cupy.RawModule(path=...)``, looking the
kernels up by the lowered names NVRTC returned (saved beside the cubin).

No import here needs a GPU; :func:`compile_cubin` needs an NVRTC that knows sm_90a (CUDA 12.0+).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading

#: NVRTC options of the sm_90a module (CuPy compiles its modules with -ftz=true too; ptxas -v
#: puts registers and spills in the log, kept beside the cubin for tools/cupy_wgmma_check.py).
OPTIONS = ("--std=c++17", "-ftz=true", "--ptxas-options=-v")

_lock = threading.Lock()
_FAILED: dict[tuple, str] = {}
_OK: set = set()


class Sm90aCompileError(RuntimeError):
    pass


def _cache_dir() -> str:
    d = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    os.makedirs(d, exist_ok=True)
    return d


def _wants_ptx(options) -> bool:
    return any(o.startswith("--gpu-architecture=compute_") for o in options)


def loaded_nvrtc_libraries() -> list[str]:
    """The libnvrtc files mapped into this process (Linux: /proc/self/maps; empty elsewhere):
    two different ones mean two bindings loaded two NVRTCs."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {ln.split(None, 5)[-1].strip() for ln in f if "libnvrtc" in ln and "/" in ln}
    except OSError:
        return []
    return sorted(p for p in paths if "builtins" not in p)


def _dist_version(*dists) -> str:
    from importlib import metadata

    for d in dists:
        try:
            return f"{d} {metadata.version(d)}"
        except Exception:
            continue
    return "version unknown"


def _describe(binding: str, dist: str, version) -> str:
    libs = loaded_nvrtc_libraries()
    return (f"{binding} ({dist}), NVRTC {'.'.join(map(str, version))}"
            + (f", {', '.join(libs)}" if libs else ""))


class _CupyNvrtc:
    """CuPy's NVRTC binding (raises NVRTCError on failure; strings in, bytes out)."""

    def __init__(self):
        from cupy_backends.cuda.libs import nvrtc

        self.n = nvrtc

    def version(self):
        return tuple(self.n.getVersion())

    def describe(self) -> str:
        return _describe("CuPy's binding", _dist_version("cupy", "cupy-cuda13x", "cupy-cuda12x"), self.version())

    def compile(self, src, names, options):
        n = self.n
        prog = n.createProgram(src, "portattn_sm90a.cu", (), ())
        try:
            for name in names:
                n.addNameExpression(prog, name)
            try:
                n.compileProgram(prog, list(options))
            except Exception as exc:
                log = ""
                try:
                    log = n.getProgramLog(prog)
                except Exception:
                    pass
                raise Sm90aCompileError(f"NVRTC failed ({' '.join(options)}): {exc}\n{log}") from exc
            log = n.getProgramLog(prog)
            lowered = {name: n.getLoweredName(prog, name) for name in names}
            return (n.getPTX(prog) if _wants_ptx(options) else n.getCUBIN(prog)), lowered, log
        finally:
            n.destroyProgram(prog)


class _BindingsNvrtc:
    """cuda.bindings.nvrtc (the compile check's binding)."""

    def __init__(self):
        from cuda.bindings import nvrtc

        self.n = nvrtc

    def version(self):
        r = self.n.nvrtcVersion()
        return (r[1], r[2])

    def describe(self) -> str:
        return _describe("cuda.bindings", _dist_version("cuda-bindings", "cuda-python"), self.version())

    def compile(self, src, names, options):
        n = self.n
        prog = n.nvrtcCreateProgram(src.encode(), b"portattn_sm90a.cu", 0, [], [])[1]
        try:
            for name in names:
                n.nvrtcAddNameExpression(prog, name.encode())
            opts = [o.encode() for o in options]
            res = n.nvrtcCompileProgram(prog, len(opts), opts)
            size = n.nvrtcGetProgramLogSize(prog)[1]
            buf = b" " * size
            n.nvrtcGetProgramLog(prog, buf)
            log = buf.decode(errors="replace").rstrip("\x00 \n")
            if int(res[0]) != 0:
                raise Sm90aCompileError(f"NVRTC failed ({' '.join(options)}):\n{log}")
            if _wants_ptx(options):
                size = n.nvrtcGetPTXSize(prog)[1]
                cubin = b" " * size
                n.nvrtcGetPTX(prog, cubin)
                cubin = cubin.rstrip(b"\x00")
            else:
                size = n.nvrtcGetCUBINSize(prog)[1]
                cubin = b" " * size
                n.nvrtcGetCUBIN(prog, cubin)
            lowered = {}
            for name in names:
                low = n.nvrtcGetLoweredName(prog, name.encode())[1]
                lowered[name] = low.decode() if isinstance(low, bytes) else str(low)
            return cubin, lowered, log
        finally:
            n.nvrtcDestroyProgram(prog)


def nvrtc_binding():
    """cuda.bindings' NVRTC (what the CPU compile check uses) where installed and able to load
    libnvrtc, else CuPy's own; Sm90aCompileError when neither works."""
    errors = []
    for cls in (_BindingsNvrtc, _CupyNvrtc):
        try:
            nv = cls()
            nv.version()   # cuda.bindings opens libnvrtc on its first call, not at import
            return nv
        except Exception as exc:   # ImportError, or a binding that cannot load libnvrtc
            errors.append(f"{cls.__doc__.split(' (')[0]}: {type(exc).__name__}: {exc}")
    raise Sm90aCompileError("no NVRTC binding: " + "; ".join(errors))


def compile_cubin(source: str, names, arch: str = "sm_90a", with_log: bool = False):
    """(cubin path, {name expression: lowered name}) of ``source`` compiled for ``arch``, from
    the cache when there (``with_log``: also the NVRTC log of the compile that made it). When
    NVRTC cannot make a cubin for ``sm_<x>``, the PTX of ``compute_<x>`` instead (a ``.ptx``
    path; the driver assembles it at load; its log starts with why). Raises Sm90aCompileError."""
    info = compile_info(source, names, arch)
    return (info["path"], info["lowered"], info["log"]) if with_log else (info["path"], info["lowered"])


def compile_info(source: str, names, arch: str = "sm_90a") -> dict:
    """:func:`compile_cubin`'s result as a dict: "path", "lowered", "log" (NVRTC's, ptxas -v's
    lines in it), "nvrtc" (which binding and NVRTC made it: :meth:`describe` of the one used,
    recorded in the cache beside the log), "cached" (True: read from the cache, made by an earlier
    compile), "ptx_fallback" (True: no cubin could be made, the PTX instead; no ptxas ran) and
    "nvrtc_now" (the binding this process would use now)."""
    names = list(names)
    nv = nvrtc_binding()
    now = nv.describe()
    options = (*OPTIONS, f"--gpu-architecture={arch}")
    key = hashlib.sha256(json.dumps([source, names, options, list(nv.version())]).encode()).hexdigest()[:32]
    d = _cache_dir()
    path, meta = os.path.join(d, f"portattn_{arch}_{key}.cubin"), os.path.join(d, f"portattn_{arch}_{key}.json")
    with _lock:
        if os.path.exists(meta):
            with open(meta, encoding="utf-8") as f:
                m = json.load(f)
            if os.path.exists(m.get("path", path)):
                p = m.get("path", path)
                return {"path": p, "lowered": m["lowered"], "log": m["log"], "cached": True,
                        "nvrtc": m.get("nvrtc", "not recorded (an older cache entry)"), "nvrtc_now": now,
                        "ptx_fallback": p.endswith(".ptx")}
        try:
            cubin, lowered, log = nv.compile(source, names, options)
        except Sm90aCompileError as exc:
            if not arch.startswith("sm_"):
                raise
            ptx_opts = (*[o for o in OPTIONS if not o.startswith("--ptxas")], f"--gpu-architecture=compute_{arch[3:]}")
            cubin, lowered, log = nv.compile(source, names, ptx_opts)
            log = f"[no cubin for {arch}, PTX for compute_{arch[3:]} instead: {str(exc)[:500]}]\n{log}"
            path = path[:-len(".cubin")] + ".ptx"
        made_by = nv.describe()   # after the compile: the library paths of a binding that loads lazily
        for target, data, mode in ((path, cubin, "wb"),
                                   (meta, json.dumps({"lowered": lowered, "log": log, "path": path,
                                                      "nvrtc": made_by}), "w")):
            fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
            with os.fdopen(fd, mode) as f:
                f.write(data)
            os.replace(tmp, target)   # atomic: parallel processes never read half a file
    return {"path": path, "lowered": lowered, "log": log, "cached": False, "nvrtc": made_by, "nvrtc_now": made_by,
            "ptx_fallback": path.endswith(".ptx")}


def unavailable_reason(source: str, names, arch: str = "sm_90a") -> str | None:
    """None when the module compiles (and is now cached), else a one-line reason (remembered,
    so a failing compile is tried once per process)."""
    key = (arch, tuple(names), len(source), hash(source))   # cheap: asked on every forward call
    if key in _OK:
        return None
    if key in _FAILED:
        return _FAILED[key]
    try:
        compile_cubin(source, names, arch)
        _OK.add(key)
        return None
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _FAILED[key] = f"the {arch} module does not compile here ({type(exc).__name__}: {first[:300]})"
        return _FAILED[key]
