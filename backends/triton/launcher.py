"""A fast launch path for portattn's Triton kernels: triton's binder once per specialisation.

A small attention call is bound by the host (issues #11 and #13): on the H200 host triton's
``JITFunction.run`` (the generated binder with ``native_specialize_impl`` per argument, the
kernel-cache key, the check of the kernels' module-level constexpr globals, the launch
metadata) is the largest single share of a ~90 us call whose kernel takes a few us. Call sites
change from ``kernels.attn_fwd[grid](*args, **kw)`` to::

    launcher.fast(kernels.attn_fwd)[grid](*args, **kw)

The first call with a given *specialisation key* goes through ``JITFunction.run`` unchanged
(compiling if needed) and remembers the ``CompiledKernel`` it returns; later calls with the same
key call that kernel's launcher directly, as ``JITFunction.run`` itself does at its end::

    kernel.run(grid_x, grid_y, grid_z, stream, kernel.function, kernel.packed_metadata,
               launch_metadata, launch_enter_hook, launch_exit_hook, *all_arguments)

(the same signature in triton 3.6.0 and 3.9.0; ``all_arguments`` are every kernel parameter in
order, constexprs included, which the launcher skips).

The key (:meth:`FastKernel.key`) holds everything triton's binder specialises on, and more (a
finer key only costs an extra first call): per positional argument its exact Python type; per
runtime int ``a >> 31`` (0 or -1 exactly for triton's i32 range; every other bucket lies within
one of its i64/u64 ranges), ``a % 16 == 0`` and ``a == 1``; per tensor its dtype and
``data_ptr() % 16 == 0``; per positional constexpr its value; floats, bools and None by type
only (triton gives them ``fp32``, ``u1`` and ``constexpr None`` whatever the value); every keyword
argument (constexprs and compile options: name, value and type, so that ``True``, ``1`` and
``1.0`` differ); the current device; and the knobs ``JITFunction.run`` folds into the options
(``knobs.runtime.debug``, the kernel's ``debug``, ``knobs.compilation.instrumentation_mode`` and,
in 3.9, ``fpsan_homomorphic_casts``). ``tests/test_triton_launcher.py`` checks that the key
separates every pair of argument values that triton's own ``native_specialize_impl`` separates.

The stream is read per call from triton's active driver (``get_current_stream``: torch's
``_cuda_getCurrentRawStream``), so a launch inside ``torch.cuda.stream(...)`` or a CUDA-graph
capture goes to the right stream.

Falls back to the normal ``kernel[grid](...)`` path (always correct, only slower):

* for anything that is not a plain ``JITFunction`` (the interpreter's ``InterpretedFunction``
  under ``TRITON_INTERPRET=1``, autotuners, test stubs: :func:`fast` returns them unchanged);
* when the installed triton is not a version whose launch path was read for this module
  (:data:`VERIFIED_VERSIONS`), on ROCm (its backend specialises tensors differently), or when
  :func:`set_enabled` turned the fast path off;
* per call, while any hook the fast path would skip is set: ``knobs.runtime.launch_enter_hook``
  or ``launch_exit_hook`` with a hook in its chain (profilers such as proton), the 3.9
  ``add_stages_inspection_hook``, a ``pre_run_hook`` on the kernel; when triton's active driver
  was replaced; when a module-level global the kernel reads is no longer the object it was at
  the first launch (the normal path then compares values, and raises if one changed); for a
  callable grid; for argument types the key does not cover (the call then never records);
* for good, per kernel, when remembering the first launch fails for any reason (an attribute
  missing in a triton release not read here, say): the reason is kept in
  :attr:`FastKernel.disabled` and every later call takes the normal path.

Not covered: a float constexpr ``-0.0`` against ``0.0`` (triton's own first-level cache compares
its key with ``==`` too), and a global the kernel reads mutated in place (triton compares its value
with the one at compile time; the fast path checks that the global is still the same object).
"""

from __future__ import annotations

import functools
import types

import torch

#: triton releases whose ``JITFunction.run`` / ``CompiledKernel`` / ``CudaLauncher`` were read
#: for this module (the GPU image's 3.6.0 and CI's 3.9.0)
VERIFIED_VERSIONS = frozenset({"3.6.0", "3.9.0"})

#: entries per kernel before its table is cleared (each holds a few host values, no tensor)
MAX_ENTRIES = 4096

_ENABLED = True
_MISSING = object()
#: id(fn) -> (fn, what fast(fn) returns); holding fn keeps its id from being reused
_WRAPPERS: dict[int, tuple] = {}


def set_enabled(enabled: bool) -> None:
    """Turn the fast path on or off for every kernel (off: every launch goes through
    ``JITFunction.run``). Seen by the next launch."""
    global _ENABLED
    _ENABLED = bool(enabled)


def enabled() -> bool:
    """Whether the fast path may be taken (:func:`set_enabled`)."""
    return _ENABLED


@functools.cache
def unsupported_reason() -> str | None:
    """Why this process cannot use the fast path at all (None when it can): the triton
    version, the interpreter, ROCm. Fixed for the life of the process."""
    try:
        import triton
        from triton.runtime.jit import JITFunction  # noqa: F401
    except Exception as exc:   # no triton, or a broken one: the normal path reports it
        return f"triton did not import: {type(exc).__name__}: {exc}"
    if triton.__version__ not in VERIFIED_VERSIONS:
        return (f"triton {triton.__version__} is not a release whose launch path was verified for the fast path "
                f"({', '.join(sorted(VERIFIED_VERSIONS))})")
    from triton import knobs
    if knobs.runtime.interpret:
        return "TRITON_INTERPRET=1: kernels run in triton's interpreter"
    if getattr(torch.version, "hip", None):
        return "ROCm: triton's AMD backend also specialises tensors on their storage size (buffer ops), not in the key"
    return None


def fast(fn):
    """``fn`` wrapped so that ``fast(fn)[grid](*args, **kwargs)`` launches like
    ``fn[grid](*args, **kwargs)``, through the remembered compiled kernel after the first call of
    each specialisation (see the module docstring). Anything that is not a plain triton
    ``JITFunction``, or a process where :func:`unsupported_reason` gives a reason, gets ``fn``
    itself back. One dict lookup per call; the wrapper is made once per kernel (only
    JITFunctions are remembered: kernels live as long as their module)."""
    hit = _WRAPPERS.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    if _jit_function_type() is not type(fn):
        return fn                     # the interpreter's functions, autotuners, stubs: not remembered
    out = FastKernel(fn) if unsupported_reason() is None else fn
    _WRAPPERS[id(fn)] = (fn, out)
    return out


@functools.cache
def _jit_function_type():
    try:
        from triton.runtime.jit import JITFunction
    except Exception:   # no triton: nothing is a JITFunction
        return None
    return JITFunction


class _Entry:
    """One remembered specialisation: the compiled kernel's launcher and what it is passed
    besides the grid, the stream and the positional arguments."""

    __slots__ = ("run", "function", "packed", "tail", "kernel")

    def __init__(self, kernel, tail):
        self.kernel = kernel            # holds the CompiledKernel (its module stays loaded)
        self.run = kernel.run           # the launcher (CudaLauncher), bound after the first launch
        self.function = kernel.function
        self.packed = kernel.packed_metadata
        self.tail = tail                # values of the parameters after the positional ones


class _State:
    """What the fast path reads from triton, bound at the first recorded launch of a kernel."""

    __slots__ = ("config", "driver", "get_device", "get_stream", "knobs_rt", "knobs_comp", "hook_chain",
                 "globals", "has_fpsan", "has_stages_hook")


class FastKernel:
    """``fast(fn)`` for a triton ``JITFunction``: ``[grid]`` gives the launcher of one call.

    Attributes: ``fn`` (the JITFunction), ``disabled`` (None, or why this kernel takes the normal
    path for good), ``stats`` (``{"fast": n, "slow": n}`` launches, for tests and tools)."""

    def __init__(self, fn):
        self.fn = fn
        self._params = fn.params
        self.disabled: str | None = None
        self._keyers: dict = {}      # tuple of argument types -> (raw keyer, exact keyer), or None: not covered
        self._entries: dict = {}     # exact key (:meth:`key`) -> _Entry
        self._hot: dict = {}         # raw key (ints by value) -> _Entry, filled from _entries
        self._state: _State | None = None
        self.stats = {"fast": 0, "slow": 0}

    def __repr__(self):
        return f"fast({self.fn!r})"

    def __getitem__(self, grid):
        if callable(grid):
            return self.fn[grid]
        return functools.partial(self._launch, grid)

    # ----- the keys -----------------------------------------------------------------------
    # Two levels. The exact key (:meth:`key`) classifies every runtime int as triton does (its
    # int32/int64/uint64 range, % 16, == 1); it is what an entry is recorded under. The raw key,
    # tried first, has the runtime ints by value (a finer key: strides and sizes repeat from call
    # to call, and an int costs one load instead of four operations) and the tensors'
    # ``data_ptr() % 16``; a raw key seen for the first time is looked up by its exact key and
    # remembered.

    def _keyer_pair(self, tk: tuple):
        """(raw keyer, exact keyer) of one tuple of argument types (built once), or None when a
        type is not covered (those calls always take the normal path)."""
        try:
            return self._keyers[tk]
        except KeyError:
            pass
        exact = _build_keyer(self._params, tk, exact=True)
        pair = self._keyers[tk] = None if exact is None else (_build_keyer(self._params, tk, exact=False), exact)
        return pair

    def key(self, args: tuple, kwargs: dict):
        """The exact specialisation key of one call (None when the call is not covered). Raises
        TypeError for an unhashable argument where triton needs its value (a constexpr)."""
        st = self._state
        tk = tuple(map(type, args))
        pair = self._keyer_pair(tk)
        if pair is None:
            return None
        return self._exact_key(tk, pair[1], args, kwargs, st.get_device(), st)

    def _exact_key(self, tk, keyer, args, kwargs, device, st) -> tuple:
        return (tk, keyer(*args), tuple(kwargs.items()), tuple(map(type, kwargs.values())), device,
                self._knobs(st))

    def _knobs(self, st: _State) -> tuple:
        """The knobs ``JITFunction.run`` folds into the compile options."""
        comp = st.knobs_comp
        return (st.knobs_rt.debug, self.fn.debug, comp.instrumentation_mode,
                comp.fpsan_homomorphic_casts if st.has_fpsan else None)

    def _guards_ok(self, st: _State) -> bool:
        """Nothing the fast path would skip is set (hooks, a new driver, changed globals)."""
        rt = st.knobs_rt
        h = rt.launch_enter_hook
        if h is not None and (type(h) is not st.hook_chain or h.calls):
            return False
        h = rt.launch_exit_hook
        if h is not None and (type(h) is not st.hook_chain or h.calls):
            return False
        if st.has_stages_hook and rt.add_stages_inspection_hook is not None:
            return False
        if self.fn.pre_run_hooks or st.config._active is not st.driver:
            return False
        for g, name, obj in st.globals:
            if g.get(name, _MISSING) is not obj:
                return False
        return True

    # ----- launching ----------------------------------------------------------------------

    def _launch(self, grid, *args, **kwargs):
        st = self._state
        if st is not None and _ENABLED and self.disabled is None:
            tk = tuple(map(type, args))
            pair = self._keyers.get(tk)
            entry = None
            if pair is not None:
                try:
                    device = st.get_device()
                    # the raw keyer stands for tk (one per tk, never dropped: hashed by identity)
                    raw = (pair[0], pair[0](*args), *kwargs, *kwargs.values(), *map(type, kwargs.values()), device,
                           self._knobs(st))
                    entry = self._hot.get(raw)
                    if entry is None:
                        entry = self._entries.get(self._exact_key(tk, pair[1], args, kwargs, device, st))
                        if entry is not None:
                            if len(self._hot) >= MAX_ENTRIES:
                                self._hot.clear()
                            self._hot[raw] = entry
                except TypeError:     # an unhashable value: the normal path
                    entry = None
            if entry is not None and self._guards_ok(st):
                n = len(grid)
                entry.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, st.get_stream(device),
                          entry.function, entry.packed, None, None, None, *args, *entry.tail)
                self.stats["fast"] += 1
                return entry.kernel
        return self._slow(grid, args, kwargs)

    def bind(self, args, kwargs) -> Bound | None:
        """The remembered launch for calls like this one: a :class:`Bound` to call as
        ``bound(grid, *args)`` for later calls whose positional arguments have the same types, the
        same tensor dtypes and 16-byte alignment, the same other values and the same ``kwargs``
        (the caller guarantees that match and so skips computing the key), or None when no launch
        with this key was recorded (make one through ``[grid]`` first)."""
        st = self._state
        if st is None or self.disabled is not None or not _ENABLED:
            return None
        try:
            key = self.key(args, kwargs)
        except TypeError:
            return None
        entry = self._entries.get(key) if key is not None else None
        return None if entry is None else Bound(self, entry, st.get_device(), self._knobs(st))

    def _slow(self, grid, args, kwargs):
        """The normal launch; then remember its kernel under the call's key."""
        self.stats["slow"] += 1
        kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
        if _ENABLED and self.disabled is None:
            try:
                self._record(args, kwargs, kernel)
            except Exception as exc:   # anything unexpected: this kernel keeps the normal path
                self.disabled = f"recording the first launch failed: {type(exc).__name__}: {exc}"
        return kernel

    def _record(self, args, kwargs, kernel) -> None:
        if kernel is None or hasattr(kernel, "result") or getattr(kernel, "function", None) is None:
            return            # a hook that declined, an async-compile future: nothing to remember
        if self._state is None:
            self._state = _bind_state(self.fn)
        st = self._state
        if not self._guards_ok(st):
            return
        tail = []
        params = self._params
        if len(args) > len(params):
            return
        for p in params[len(args):]:
            if p.name in kwargs:
                if not p.is_constexpr:   # a runtime argument by keyword: not covered by the key
                    return
                tail.append(kwargs[p.name])
            else:
                tail.append(p.default)
        key = self.key(args, kwargs)
        if key is None:
            return
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
            self._hot.clear()
        self._entries[key] = _Entry(kernel, tuple(tail))


class Bound:
    """One specialisation of a :class:`FastKernel`, bound for a caller that has checked the
    match of its arguments itself (:meth:`FastKernel.bind`). ``bound(grid, *args)`` launches and
    returns True, or returns False without launching when the fast path may not be taken now
    (disabled, another current device, changed knobs, a hook set, a global replaced): the caller
    then launches through ``fast(fn)[grid]``."""

    __slots__ = ("kernel", "entry", "device", "knobs")

    def __init__(self, kernel: FastKernel, entry: _Entry, device, knobs: tuple):
        self.kernel, self.entry, self.device, self.knobs = kernel, entry, device, knobs

    def __call__(self, grid: tuple, *args) -> bool:
        fk = self.kernel
        st = fk._state
        if not _ENABLED or fk.disabled is not None:
            return False
        device = st.get_device()
        if device != self.device or fk._knobs(st) != self.knobs or not fk._guards_ok(st):
            return False
        e = self.entry
        n = len(grid)
        e.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, st.get_stream(device), e.function, e.packed,
              None, None, None, *args, *e.tail)
        fk.stats["fast"] += 1
        return True


def _bind_state(fn) -> _State:
    """Bind the driver functions, knobs and the kernel's globals after a successful launch."""
    from triton import knobs
    from triton.runtime.driver import driver as config  # the DriverConfig (runtime.driver is shadowed)
    drv = config._active
    if drv is None:
        raise RuntimeError("triton's active driver is not set after a launch")
    st = _State()
    st.config, st.driver = config, drv
    get_device = drv.get_current_device
    # torch.cuda.current_device is _lazy_init() + torch._C._cuda_getDevice(): initialised by now
    st.get_device = torch._C._cuda_getDevice if get_device is torch.cuda.current_device else get_device
    st.get_stream = drv.get_current_stream
    st.knobs_rt, st.knobs_comp = knobs.runtime, knobs.compilation
    st.hook_chain = getattr(knobs, "HookChain", type(None))
    st.has_fpsan = hasattr(type(knobs.compilation), "fpsan_homomorphic_casts")
    st.has_stages_hook = hasattr(type(knobs.runtime), "add_stages_inspection_hook")
    st.globals = []
    for (name, _), (val, g) in fn.used_global_vals.items():
        live = g.get(name, _MISSING)
        if live is _MISSING or live != val:
            raise RuntimeError(f"global {name} of {fn} differs from its value at compile time")
        st.globals.append((g, name, live))
    st.globals = tuple(st.globals)
    return st


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_BY_TYPE_ONLY = (float, bool, types.NoneType)


def _build_keyer(params, tk: tuple, exact: bool):
    """A function of the positional arguments returning the value part of their key (see the
    module docstring and :class:`FastKernel`), generated for one tuple of argument types; None
    when a type is not covered or there are more arguments than parameters. ``exact``: runtime
    ints by triton's classes (range, % 16, == 1), else by value."""
    if len(tk) > len(params):
        return None
    names, parts = [], []
    for i, (p, t) in enumerate(zip(params, tk)):
        a = f"a{i}"
        names.append(a)
        if p.is_constexpr:
            parts.append(a)                        # triton: ("constexpr", value); its type is in tk
        elif t is int:
            parts.append(f"{a} >> 31, ({a} & 15) == 0, {a} == 1" if exact else a)
        elif t in _TENSOR_TYPES:
            parts.append(f"{a}.dtype, ({a}.data_ptr() & 15) == 0" if exact else f"{a}.dtype, {a}.data_ptr() & 15")
        elif t in _BY_TYPE_ONLY:
            continue
        else:
            return None
    body = ", ".join(parts)
    src = f"def keyer({', '.join(names)}):\n    return ({body}{',' if parts else ''})\n"
    namespace: dict = {}
    exec(src, namespace)   # generated from parameter indices only
    return namespace["keyer"]
