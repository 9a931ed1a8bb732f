"""The ``fastest`` policy: the fastest correct backend per shape class, measured once and remembered.

Dispatch calls :func:`choose` with the backends that have no reasons for a problem, in priority
order. The problem's *shape class* (:func:`shape_class`: dtype, head dims, features, GQA ratio,
needs-grad, return_lse/determinism/TF32, and batch·heads, Sq, Sk and window sizes rounded up to
powers of two) is looked up in memory, then in the cache file; on a miss, while timing is allowed,
every candidate is

1. checked once against the float64 reference on a small problem with the same features
   (:func:`check_candidate`, the equivalence rule of docs/semantics.md through
   :mod:`portattn.numerics`); a candidate that fails is never chosen for the class, and why is
   recorded;
2. timed against the other candidates on the caller's own inputs, through
   ``portattn.attention(..., backend=name)`` (forward, and forward + backward when a gradient is
   needed), by :func:`portattn.timing.compare`: warm-up, a ~1 ms estimate (over ``PRUNE`` × the
   best: not timed further), ``ROUNDS`` interleaved rounds of ~``ROUND_MS`` of back-to-back
   calls per candidate (CUDA events after an L2 flush and a sync on GPUs, ``perf_counter`` on
   CPUs), up to ``MAX_ROUNDS`` while a candidate is too close to the fastest to call
   (:func:`portattn.timing.unsettled`), the median of per-round medians and the rounds' spread,
   within ``TUNE_BUDGET_S``;
3. ranked with the tie rule of :func:`portattn.timing.pick`: within the measured noise of the
   fastest (0.3-1 %), the first in priority order wins (the entry's ``tied``).

A class where another candidate came within ``RECHECK_WITHIN`` × the winner's time is
*provisional*: at its first call ``RECHECK_AFTER_S`` later, a **second look** (:func:`recheck`)
times those candidates again in full rounds (no pruning), ranks them, and then lets every
candidate within ``DUEL_WITHIN`` of the winner (all of them, by default) **duel** it (:func:`_duel`): back-to-back pairs
of samples (:func:`portattn.timing.paired_ratios`, how ``benchmarks/bench_fastest.py`` judges
the policy), the challenger taking the class when the pairs' median puts it more than
``DUEL_MARGIN`` faster. Then the choice is final.

The winner and every timing are kept in memory and in a JSON file per device and software
versions (:func:`cache_path`) under ``config.cache_dir()`` (``$PORTATTN_CACHE_DIR``), written
atomically (temporary file + ``os.replace``) under a ``filelock`` lock so that several processes
can tune at once; a corrupt file, or one written by other versions, is ignored with a warning.

During CUDA-graph capture and ``torch.compile`` tracing nothing is timed and nothing waits for
the device: :func:`choose` returns the cached winner, or the first candidate (the priority list's
own choice). ``reference`` (the float64 oracle) and ``sdpa_math`` (O(S²) memory) are never timed:
they are chosen only when no timed candidate passes.

``portattn tune`` (:mod:`portattn.tuning_cli`, reached through :func:`add_arguments` and :func:`run`)
fills the cache ahead of time.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib.metadata
import json
import math
import os
import re
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from . import config, timing
from .spec import AttentionSpec, _is_compiling

FORMAT = 2   # 2: interleaved rounds and the tie rule (portattn.timing); format-1 winners are re-timed
#: never timed: the float64 oracle and the O(S²)-memory math kernel (chosen only as a last resort)
NOT_TIMED = frozenset({"reference", "sdpa_math"})
#: the policy's timing (portattn.timing.compare): warm-up calls, interleaved rounds (at least
#: MIN_ROUNDS, ROUNDS while the class's TUNE_BUDGET_S lasts, up to MAX_ROUNDS while the order of the
#: fastest and a close candidate is unsettled), ~ROUND_MS of calls per candidate per round in
#: SAMPLES_PER_ROUND samples; a candidate whose estimate is over PRUNE x the best cannot win.
#: A sample starts from an idle device, so each costs one start-up (the host enqueuing the first
#: kernels while the GPU waits) over its back-to-back calls: on the H200 (2026-12-02, D64 S4k causal
#: fwd+bwd, ~3.5 ms a call) torch SDPA's cuDNN path measured 3.75 ms per call in samples of one
#: call (ROUND_MS 10) and 3.40 ms in samples of five (the benchmark's), triton 3.62 and 3.51 ms, so
#: the policy chose triton where cuDNN was 3.5 % faster. Samples of ~20 ms (ROUND_MS 60, the
#: benchmark's longest) keep that start-up under ~2 % of a sample.
WARMUP, ROUNDS, MIN_ROUNDS, MAX_ROUNDS, ROUND_MS, SAMPLES_PER_ROUND = 2, 5, 3, 15, 60.0, 3
#: wall time each candidate keeps being called (each call waited for) after WARMUP calls
WARMUP_MS = 30.0
#: (1.5 pruned cuDNN on an estimate taken before WARMUP_MS existed: 1.83 x, at its true 0.94 x)
PRUNE = 2.0
TUNE_BUDGET_S = 2.0
#: the second look: a class whose first timing found a candidate within RECHECK_WITHIN x the
#: winner's time is timed once more among those candidates, at its first call RECHECK_AFTER_S
#: seconds (wall time) later (a backend's first moments after a new shape can be unrepresentative:
#: on the H200, torch SDPA's cuDNN path measured 1.2-1.9 x slower in the policy's first timing
#: than a benchmark measured it seconds later); until then the choice is provisional
RECHECK_WITHIN = 2.0
RECHECK_AFTER_S = 2.0
#: the second look's duel: each candidate whose rounds put it within DUEL_WITHIN of the winner's
#: time (1.0: every candidate of the look, all within RECHECK_WITHIN x at the first timing) is
#: timed against the winner in DUEL_PAIRS back-to-back pairs of ~DUEL_SAMPLE_MS samples
#: (portattn.timing.paired_ratios, the benchmark's judge) and takes the class when the pairs'
#: median puts it more than DUEL_MARGIN faster. Rounds of several candidates span seconds, and on
#: the H200 they misjudged twice (2026-12-03): in a power-bound cell (D128 S16k fwd) every backend
#: ran at two speeds by round order, and the rounds put triton 2.4 % ahead of sdpa where the pairs
#: put it 5.6 % behind; in D128 S1k causal fwd both looks' rounds timed sdpa at 0.32 ms (1.27 x
#: triton, outside the 10 % this bound was then) where the benchmark's rounds and pairs a second
#: later timed it at 0.18 (0.70 x triton)
DUEL_WITHIN, DUEL_PAIRS, DUEL_SAMPLE_MS, DUEL_MARGIN = 1.0, 16, 10.0, 0.01

_lock = threading.RLock()
_busy = threading.local()
_stores: dict[str, _Store] = {}
_versions_cache: dict[str, dict] = {}


# ----- shape classes -----------------------------------------------------------------------

def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0): 1000 -> 1024, 1024 -> 1024, 1025 -> 2048."""
    n = int(n)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _class_tuple(spec: AttentionSpec) -> tuple:
    """The shape class as a tuple (cheap: the call path's in-memory key)."""
    window = None
    if spec.has_window:
        window = (bucket(spec.window_left) if spec.window_left is not None else -1,
                  bucket(spec.window_right) if spec.window_right is not None else -1)
    return (spec.dtype, spec.head_dim, spec.head_dim_v, spec.features(), spec.gqa_ratio, spec.needs_grad,
            spec.return_lse, spec.deterministic, spec.allow_tf32 and spec.dtype == torch.float32, window,
            bucket(spec.batch * spec.num_heads_q), bucket(spec.seqlen_q), bucket(spec.seqlen_k))


def _class_string(t: tuple) -> str:
    dtype, d, dv, feats, gqa, grad, lse, det, tf32, window, bh, sq, sk = t
    key = (f"{str(dtype).replace('torch.', '')}|D{d}/{dv}|{','.join(sorted(feats)) or '-'}|gqa{gqa}"
           f"|{'grad' if grad else 'fwd'}{'|lse' if lse else ''}{'|det' if det else ''}{'|tf32' if tf32 else ''}")
    if window is not None:
        key += "|w" + ":".join("inf" if w < 0 else str(w) for w in window)
    return key + f"|bh{bh}|sq{sq}|sk{sk}"


def shape_class(spec: AttentionSpec) -> str:
    """The key under which a winner is remembered (the device is the cache file's, see
    :func:`cache_path`): dtype, head dims, features, GQA ratio, needs-grad, return_lse,
    determinism, TF32, and batch·heads, Sq, Sk and window sizes rounded up to powers of two.
    Two problems of one class run on the same backend."""
    return _class_string(_class_tuple(spec))


def device_name(device: torch.device) -> str:
    """``"cpu"`` or the GPU's name (e.g. ``"NVIDIA H200"``)."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_name(index)



# ----- versions and the cache file ---------------------------------------------------------

def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _driver_version() -> int | None:
    try:
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        out = ctypes.c_int(0)
        return int(out.value) if lib.cuDriverGetVersion(ctypes.byref(out)) == 0 else None
    except Exception:   # no driver, another OS: the CUDA runtime version still tells versions apart
        return None


def kernel_sources_digest() -> str:
    """sha256 (16 hex digits) of the kernel sources every backend runs (``portattn.backends`` and
    ``onnx_ops``: their .py, .cu, .cuh files, by relative path and content). A timing belongs to
    the kernels that made it, and portattn's version string stays the same between commits, so a
    checkout whose kernels changed (an ``auto`` row, a tile, a new kernel) times anew."""
    import onnx_ops

    from . import backends
    h = hashlib.sha256()
    for pkg in (backends, onnx_ops):
        for root in map(Path, pkg.__path__):
            for f in sorted(root.rglob("*")):
                if f.suffix in (".py", ".cu", ".cuh") and "__pycache__" not in f.parts:
                    h.update(f"{pkg.__name__}/{f.relative_to(root).as_posix()}\0".encode())
                    h.update(f.read_bytes())
    return h.hexdigest()[:16]


def software_versions(device: torch.device) -> dict:
    """What a timing depends on besides the problem: device, driver, library versions and the
    kernels' own sources (:func:`kernel_sources_digest`)."""
    dev = device_name(device)
    cached = _versions_cache.get(dev)
    if cached is not None:
        return cached
    from . import __version__
    versions = {
        "format": FORMAT, "device": dev, "portattn": __version__, "torch": torch.__version__,
        "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
        "triton": _dist_version("triton", "pytorch-triton", "triton-rocm"),
        "cupy": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "kernels": kernel_sources_digest(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        versions["capability"] = f"{props.major}.{props.minor}"
        versions["sm_count"] = props.multi_processor_count
        versions["driver"] = _driver_version()
        try:
            versions["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            versions["cudnn"] = None
    _versions_cache[dev] = versions
    return versions


def cache_path(device: torch.device) -> str:
    """``<cache_dir>/tuning/fastest-<device>-<hash of software_versions>.json``."""
    versions = software_versions(device)
    digest = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", versions["device"]).strip("-").lower() or "device"
    return os.path.join(config.cache_dir(), "tuning", f"fastest-{slug}-{digest}.json")


class _Store:
    """The entries of one cache file, in memory; :meth:`save` merges them into the file."""

    def __init__(self, path: str, versions: dict):
        self.path = path
        self.versions = versions
        self.entries: dict[str, dict] = {}
        self._warned_write = False
        data = self._read(warn=True)
        if data:
            self.entries.update(data)

    def _read(self, warn: bool) -> dict | None:
        """The file's classes, or None (missing, corrupt or from other versions: warned once)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as exc:
            if warn:
                warnings.warn(f"portattn: ignoring the tuning cache {self.path}: unreadable or corrupt "
                              f"({type(exc).__name__}: {exc}); it will be rewritten", RuntimeWarning, stacklevel=3)
            return None
        problem = None
        if not isinstance(data, dict) or not isinstance(data.get("classes"), dict):
            problem = "not a portattn tuning cache (no 'classes' table)"
        elif data.get("versions") != self.versions:
            problem = f"written by other versions ({data.get('versions')!r}, now {self.versions!r})"
        elif not all(isinstance(e, dict) and isinstance(e.get("results"), dict) for e in data["classes"].values()):
            problem = "malformed entries"
        if problem:
            if warn:
                warnings.warn(f"portattn: ignoring the tuning cache {self.path}: {problem}; it will be rewritten",
                              RuntimeWarning, stacklevel=3)
            return None
        return data["classes"]

    def save(self, keys) -> None:
        """Merge this process's entries for ``keys`` into the file, atomically, under a lock."""
        new = {k: self.entries[k] for k in keys if k in self.entries}
        try:
            from filelock import FileLock
            directory = os.path.dirname(self.path)
            os.makedirs(directory, exist_ok=True)
            with FileLock(self.path + ".lock", timeout=60):
                merged = self._read(warn=False) or {}
                merged.update(new)
                fd, tmp = tempfile.mkstemp(dir=directory, prefix=".fastest-", suffix=".tmp")
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        json.dump({"format": FORMAT, "versions": self.versions, "classes": merged}, f, indent=1,
                                  sort_keys=True)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            for k, e in merged.items():   # adopt what other processes tuned meanwhile
                self.entries.setdefault(k, e)
        except Exception as exc:   # read-only home, full disk, lock timeout: keep the results in memory
            if not self._warned_write:
                self._warned_write = True
                warnings.warn(f"portattn: could not write the tuning cache {self.path} "
                              f"({type(exc).__name__}: {exc}); winners are kept in memory only "
                              f"(set PORTATTN_CACHE_DIR to a writable directory)", RuntimeWarning, stacklevel=3)


_store_index: dict[tuple, _Store] = {}
#: exact problem key (:func:`_hot_key`) -> entry: the call path's lookup, filled on first sight of
#: a problem, emptied when any entry changes or PORTATTN_CACHE_DIR does
_hot: dict[tuple, dict] = {}
_HOT_LIMIT = 8192
_hot_dir: list = [None]   # the raw PORTATTN_CACHE_DIR value _hot was filled under
#: bumped whenever a remembered winner may change (an entry stored, the memory cleared, another
#: cache directory): the call path (portattn.callcache) keeps a choice made from a remembered
#: winner under this number, so that the next call after a change chooses again
_generation = 0


def generation() -> int:
    """See :data:`_generation`."""
    return _generation


def _forget_hot() -> None:
    global _generation
    _hot.clear()
    _generation += 1


def _hot_key(spec: AttentionSpec) -> tuple:
    """Everything the shape class depends on, unrounded and uncomputed (a few attribute reads:
    no bucketing, no strings). Finer than the class: problems of one class may have several keys,
    all mapped to the class's entry."""
    q = spec.q   # spec.capability_key's fields, flattened (one tuple fewer on the call path)
    return (q.device, q.dtype, spec.head_dim, spec.head_dim_v, spec._features, spec.needs_grad, spec.deterministic,
            spec.allow_tf32, spec.return_lse, spec.batch, spec.num_heads_q, spec.num_heads_kv, spec.seqlen_q,
            spec.seqlen_k, spec.window_left, spec.window_right)


def _hot_get(spec: AttentionSpec) -> tuple:
    """``(entry, winner)`` of ``spec``'s class (``(None, None)`` when never timed): a dict hit on
    :func:`_hot_key` after the first sight of a problem, else the class's entry from the store."""
    raw_dir = config._raw("PORTATTN_CACHE_DIR")
    if raw_dir != _hot_dir[0]:
        _forget_hot()
        _hot_dir[0] = raw_dir
    hot = _hot_key(spec)
    got = _hot.get(hot)
    if got is None:
        entry = _store(spec.device).entries.get(shape_class(spec))
        if entry is None:
            return None, None
        order = entry.get("order")
        got = (entry, order[0] if order else None)
        if len(_hot) >= _HOT_LIMIT:
            _hot.clear()
        _hot[hot] = got
    return got


def _entry(spec: AttentionSpec) -> dict | None:
    """The remembered entry of ``spec``'s class, or None (memory first, then the cache file)."""
    return _hot_get(spec)[0]


def _store(device: torch.device) -> _Store:
    """The store of ``device``'s cache file (memoised per cache directory and device: this is on
    the call path)."""
    index = (config.cache_dir(), device.type, device.index)
    store = _store_index.get(index)
    if store is not None:
        return store
    with _lock:
        path = cache_path(device)
        store = _stores.get(path)
        if store is None:
            store = _stores[path] = _Store(path, software_versions(device))
        _store_index[index] = store
    return store


def clear(*, disk: bool = False) -> list[str]:
    """Forget every remembered winner; with ``disk=True`` also delete the cache files of the
    current cache directory. Returns the files deleted."""
    removed = []
    with _lock:
        _stores.clear()
        _store_index.clear()
        _forget_hot()
        if disk:
            directory = os.path.join(config.cache_dir(), "tuning")
            if os.path.isdir(directory):
                for name in sorted(os.listdir(directory)):
                    if name.startswith("fastest-") and name.endswith(".json"):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(directory, name))
                            removed.append(os.path.join(directory, name))
    return removed


# ----- the correctness gate ----------------------------------------------------------------

def _small_lengths(sq: int, sk: int) -> tuple[int, int]:
    """Small (Sq, Sk) keeping the relation that matters for masking (=, <, >, Sq = 1)."""
    if sq == sk:
        return (min(sq, 96),) * 2
    if sq < sk:
        sk2 = min(sk, 112)
        return min(sq, max(1, sk2 // 2)), sk2
    sq2 = min(sq, 112)
    return sq2, min(sk, max(1, sq2 // 2))


def small_problem(spec: AttentionSpec, seed: int = 0):
    """``(q, k, v, kwargs)``: random inputs of ``spec``'s dtype, device, head dims, GQA ratio and
    features (masking, softcap, ALiBi, bias, varlen, scale), a few heads and at most ~100 rows."""
    g = torch.Generator().manual_seed(seed)
    dev, dt = spec.device, spec.dtype
    hkv = min(spec.num_heads_kv, 2)
    hq = hkv * spec.gqa_ratio
    sq, sk = _small_lengths(spec.seqlen_q, spec.seqlen_k)
    d, dv = spec.head_dim, spec.head_dim_v

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev, dt)

    kw = dict(scale=spec.scale, causal=spec.causal, causal_alignment=spec.alignment, softcap=spec.softcap)
    if spec.window_left is not None or (spec.window_right is not None and not spec.causal):
        kw["window"] = (-1 if spec.window_left is None else spec.window_left,
                        (0 if spec.causal else -1) if spec.window_right is None else spec.window_right)
    if spec.is_varlen:
        lq, lk = [sq, max(1, sq // 2)], [sk, max(1, sk // 2)]
        q, k, v = rand(sum(lq), hq, d), rand(sum(lk), hkv, d), rand(sum(lk), hkv, dv)
        kw["cu_seqlens_q"] = torch.tensor([0, lq[0], sum(lq)], dtype=torch.int32, device=dev)
        kw["cu_seqlens_k"] = torch.tensor([0, lk[0], sum(lk)], dtype=torch.int32, device=dev)
        b = 2
    else:
        b = min(spec.batch, 2)
        q, k, v = rand(b, sq, hq, d), rand(b, sk, hkv, d), rand(b, sk, hkv, dv)
    if spec.alibi_slopes is not None:
        kw["alibi_slopes"] = torch.rand(hq, generator=g).to(dev)
    if spec.attn_bias is not None:
        if spec.bias_is_mask:
            kw["attn_bias"] = (torch.rand(b, hq, sq, sk, generator=g) > 0.25).to(dev)
        else:
            kw["attn_bias"] = torch.randn(b, hq, sq, sk, generator=g).to(dev, spec.attn_bias.dtype)
    return q, k, v, kw


def _compare_backend(name: str, q, k, v, *, grad: bool, bias_grad: bool, **kw):
    """Like portattn.testing.check_backend, with the bias's gradient only when ``bias_grad``."""
    from .api import attention
    from .numerics import GRAD_FACTOR, compare, compare_lse
    from .reference import naive_forward, reference_forward
    from .spec import build_spec

    bias = kw.pop("attn_bias", None)

    def leaves(dtype=None):
        ts = [t.detach().to(dtype or t.dtype).requires_grad_(grad) for t in (q, k, v)]
        b = bias
        if bias is not None and bias_grad:
            b = bias.detach().to(dtype or bias.dtype).requires_grad_(True)
        return ts, b

    (bq, bk, bv), bb = leaves()
    out, lse = attention(bq, bk, bv, attn_bias=bb, return_lse=True, backend=name, **kw)
    (rq, rk, rv), rb = leaves(torch.float64)
    ref_out, ref_lse = reference_forward(build_spec(rq, rk, rv, attn_bias=rb, **kw))
    (nq, nk, nv), nb = leaves()
    naive_out, _ = naive_forward(build_spec(nq, nk, nv, attn_bias=nb, **kw))
    results = [compare("out", out, ref_out, naive_out), compare_lse(lse, ref_lse)]
    if grad:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
        extra = [bias_grad and bb is not None]
        ins = [[bq, bk, bv] + ([bb] if extra[0] else []), [rq, rk, rv] + ([rb] if extra[0] else []),
               [nq, nk, nv] + ([nb] if extra[0] else [])]
        got = torch.autograd.grad(out, ins[0], dout)
        ref = torch.autograd.grad(ref_out, ins[1], dout.double())
        naive = torch.autograd.grad(naive_out, ins[2], dout)
        scale = build_spec(q, k, v, **kw).scale
        magnitude = (dout.abs().max() * v.abs().max() * k.abs().max()).item() * scale if dout.numel() else 1.0
        for label, a, r, n in zip(("dq", "dk", "dv", "dbias"), got, ref, naive):
            results.append(compare(label, a, r, n, factor=GRAD_FACTOR, zero_ref_scale=magnitude))
    return results


def check_candidate(name: str, spec: AttentionSpec) -> str | None:
    """None when backend ``name`` passes the equivalence rule on :func:`small_problem` of
    ``spec`` (forward, and gradients when ``spec`` needs them); otherwise why it failed."""
    q, k, v, kw = small_problem(spec)
    try:
        results = _compare_backend(name, q, k, v, grad=spec.needs_grad, bias_grad="bias_grad" in spec.features(), **kw)
    except Exception as exc:
        return f"could not run the check problem: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    bad = [str(r) for r in results if not r.passed]
    return "; ".join(bad) if bad else None


# ----- timing ------------------------------------------------------------------------------

def _call_kwargs(spec: AttentionSpec) -> dict:
    """Keyword arguments of :func:`portattn.attention` that rebuild ``spec`` from its canonical
    tensors (``q``, ``k``, ``v`` are passed as they are: bshd views)."""
    kw = dict(scale=spec.scale, causal=spec.causal, causal_alignment=spec.alignment, softcap=spec.softcap,
              alibi_slopes=spec.alibi_slopes, attn_bias=spec.attn_bias, return_lse=spec.return_lse)
    if spec.window_left is not None or (spec.window_right is not None and not spec.causal):
        kw["window"] = (-1 if spec.window_left is None else spec.window_left,
                        (0 if spec.causal else -1) if spec.window_right is None else spec.window_right)
    if spec.is_varlen:
        kw.update(cu_seqlens_q=spec.cu_seqlens_q, cu_seqlens_k=spec.cu_seqlens_k, max_seqlen_q=spec.max_seqlen_q,
                  max_seqlen_k=spec.max_seqlen_k)
    return kw


def _api_runner(name: str, spec: AttentionSpec):
    """One ``portattn.attention(..., backend=name)`` call on ``spec``'s tensors (forward, and a
    backward through autograd when a gradient is needed): the call a user makes, so that host
    costs of the call path count as they will (a host-bound call is max(host, device), not a
    sum). None when the arguments cannot be rebuilt to the same class (then :func:`_runner`)."""
    from .api import attention
    from .spec import build_spec
    try:
        kw = _call_kwargs(spec)
        grad = spec.needs_grad
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (spec.q, spec.k, spec.v)]
        bias = spec.attn_bias
        if bias is not None and bias.requires_grad:
            kw["attn_bias"] = bias = bias.detach().requires_grad_(True)
        if shape_class(build_spec(*leaves, **kw)) != shape_class(spec):
            return None
    except Exception:
        return None
    wrt = [t for t in [*leaves, bias] if t is not None and t.requires_grad]
    if not grad:
        def forward():
            with torch.no_grad():
                attention(*leaves, backend=name, **kw)
        return forward
    dout = torch.randn(spec.out_shape, dtype=spec.dtype, device=spec.device)

    def forward_backward():
        with torch.enable_grad():
            out = attention(*leaves, backend=name, **kw)
            torch.autograd.grad(out[0] if isinstance(out, tuple) else out, wrt, dout)
    return forward_backward


def _runner(backend, spec: AttentionSpec):
    """One forward (and backward when a gradient is needed) of ``backend`` on ``spec``'s inputs,
    through the call path (:func:`_api_runner`) or, when that cannot rebuild the call, the
    backend's own methods."""
    fn = _api_runner(backend.name, spec)
    if fn is not None:
        return fn
    if not spec.needs_grad:
        def forward():
            with torch.no_grad():
                backend.forward(spec)
        return forward
    dout = torch.randn(spec.out_shape, dtype=spec.dtype, device=spec.device)

    def forward_backward():
        with torch.no_grad():
            out, lse = backend.forward(spec)
        backend.backward(spec, out, lse, dout)
    return forward_backward


def _clock(device: torch.device):
    """The clock the policy times with (tests replace it with a fake one)."""
    return timing.clock_for(device)


def _measure(names: list[str], spec: AttentionSpec, *, on_error=None,
             prune: float | None = PRUNE) -> dict[str, timing.Timing]:
    """Time backends ``names`` against each other on ``spec``'s inputs (forward, + backward when
    a gradient is needed) with :func:`portattn.timing.compare`: warm-up, a ~1 ms estimate,
    candidates over ``prune`` × the best estimate left out (None: none), then ``ROUNDS``
    interleaved rounds of ~``ROUND_MS`` per candidate (the median of per-round medians), within
    ``TUNE_BUDGET_S``."""
    from .registry import get_backend
    fns = {}
    errors = {}
    for name in names:
        try:
            fns[name] = _runner(get_backend(name), spec)
        except Exception as exc:
            errors[name] = timing.Timing(None, error=timing._error(exc))
    clock = _clock(spec.device)
    out = timing.compare(fns, clock, warmup=WARMUP, warmup_ms=WARMUP_MS, rounds=ROUNDS, min_rounds=MIN_ROUNDS,
                         max_rounds=MAX_ROUNDS, round_ms=ROUND_MS, samples_per_round=SAMPLES_PER_ROUND,
                         prune=prune, deadline=clock.now() + TUNE_BUDGET_S, on_error=on_error)
    return {n: errors.get(n) or out[n] for n in names}


def time_backend(name: str, spec: AttentionSpec) -> tuple[float, int]:
    """``(ms per call, calls)`` of backend ``name`` alone on ``spec``'s inputs (forward, +
    backward when a gradient is needed), by the policy's method. Raises what the backend raises."""
    t = _measure([name], spec)[name]
    if t.error:
        raise RuntimeError(t.error)
    return t.ms, t.calls


# ----- the policy --------------------------------------------------------------------------

def _timing_forbidden(spec: AttentionSpec) -> bool:
    """Under torch.compile tracing or CUDA-graph capture nothing may be timed or synchronised."""
    if _is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _timed(results: dict) -> dict[str, timing.Timing]:
    """The results that passed the check and have a time, as :class:`portattn.timing.Timing`."""
    return {n: timing.Timing(r["ms"], spread=r.get("spread", 0.0), pruned=bool(r.get("pruned")))
            for n, r in results.items() if r.get("ms") is not None and not r.get("failed") and not r.get("error")}


def _rank(results: dict, priority: list[str]) -> tuple[list[str], list[str]]:
    """``(order, tied)``: the backends that passed and were timed, the winner first (the fastest,
    or among those tied with it within the measured noise the first in ``priority``:
    :func:`portattn.timing.pick`), the others fastest first; and the tied ones."""
    timed = _timed(results)
    winner, tied = timing.pick(timed, priority)
    if winner is None:
        return [], []
    rest = sorted((n for n in timed if n != winner), key=lambda n: (timed[n].ms, n))
    return [winner, *rest], tied


def _order(results: dict) -> list[str]:
    """Backends that passed and were timed, fastest first (no tie rule)."""
    timed = _timed(results)
    return sorted(timed, key=lambda n: (timed[n].ms, n))


def _pick(entry: dict | None, candidates: list[str]) -> str | None:
    """The fastest candidate timed in ``entry``, else the first candidate that is not known to
    fail (untimed ones such as reference included), else None."""
    if not entry:
        return None
    allowed = set(candidates)
    for name in entry.get("order", ()):
        if name in allowed:
            return name
    results = entry["results"]
    for name in candidates:
        r = results.get(name)
        if r is not None and not r.get("failed") and not r.get("error"):
            return name
    return None


def _fallback(key: str, candidates: list[str], entry: dict | None) -> str:
    """No timed candidate passed: the first that did not fail the check; if every one failed,
    an error (a backend that fails the equivalence rule is never chosen)."""
    results = entry["results"] if entry else {}
    for name in candidates:
        if not results.get(name, {}).get("failed"):
            return name
    from .errors import BackendNotAvailableError
    reasons = {n: [f"failed the fastest policy's equivalence check: {results[n]['failed']}"] for n in candidates}
    detail = "\n".join(f"  - {n}: {r[0]}" for n, r in reasons.items())
    raise BackendNotAvailableError(
        f"the fastest policy found no candidate that passes the equivalence rule for class {key}:\n{detail}\n"
        f"pin a backend (backend=...) or add 'reference' to the candidates", reasons)


def lookup(spec: AttentionSpec) -> str | None:
    """The remembered winner of ``spec``'s class (provisional or final), or None — no timing, no
    device sync. After the first sight of a problem this is one dict hit on a tuple of the spec's
    attributes."""
    return _hot_get(spec)[1]


def held_winner(spec: AttentionSpec) -> tuple[str | None, float | None]:
    """``(winner, until)`` for the call path, in one dict hit: the remembered winner of ``spec``'s
    class (None when never timed, or when a second look is pending and due), and ``until``:
    None for a final choice, else the ``time.time()`` at which the provisional choice's second
    look falls due (the call path may keep the winner until then, :mod:`portattn.callcache`).
    No timing, no device sync."""
    entry, winner = _hot_get(spec)
    if entry is None or "recheck" not in entry:
        return winner, None
    until = entry["recheck"]["at"]
    return (winner, until) if time.time() < until else (None, None)


def cached_choice(spec: AttentionSpec, candidates: list[str]) -> str | None:
    """What :func:`choose` would return from what is remembered (None when the class was never
    timed): no timing, no device sync (``explain`` uses it)."""
    return _pick(_entry(spec), candidates)


def timings_for(spec: AttentionSpec) -> dict[str, float] | None:
    """Seconds per call measured for ``spec``'s class, per backend (``inf`` for one that failed
    the equivalence check or could not run; untimed ones such as ``reference`` left out), or None
    when the class was never timed. :func:`timing_details` has the whole record."""
    entry = _entry(spec)
    if entry is None:
        return None
    out = {}
    for name, r in entry["results"].items():
        if r.get("skipped"):
            continue
        ok = r.get("ms") is not None and not r.get("failed") and not r.get("error")
        out[name] = r["ms"] * 1e-3 if ok else math.inf
    return out


def timing_details(spec: AttentionSpec) -> dict | None:
    """The remembered record of ``spec``'s class: ``{"class", "device", "winner", "order", "mode",
    "problem", "tuned_at", "tuning_s", "results": {backend: {"ms", "runs"} or {"failed"} /
    {"error"} / {"skipped"}}}``, or None when the class was never timed."""
    entry = _entry(spec)
    if entry is None:
        return None
    return dict(entry, **{"class": shape_class(spec), "device": device_name(spec.device)})


def format_timings(info: dict | None) -> str:
    """A few lines from :func:`timing_details`: each backend's time, or why it is not chosen."""
    if not info:
        return "fastest: this shape class was never timed (the first call times it)"
    lines = [f"fastest: class {info['class']} on {info['device']} ({info.get('mode')}), "
             f"winner {info.get('winner')}, tuned {info.get('tuned_at', '?')}"]
    timed = _timed(info["results"])
    best = min((t.ms for t in timed.values()), default=None)
    tied = set(info.get("tied") or ())
    if len(tied) > 1:
        lines[0] += f" (tied within the noise: {', '.join(info['tied'])}; the priority order decides)"
    if "recheck" in info:
        lines.append(f"  provisional: a second look at {', '.join(info['recheck']['among'])} is due at the first call "
                     f"from {_dt.datetime.fromtimestamp(info['recheck']['at'], _dt.timezone.utc):%H:%M:%S} UTC")
    elif "rechecked" in info:
        lines.append(f"  second look at {info['rechecked'].get('at', '?')} (first winner "
                     f"{info['rechecked'].get('first_winner')}); the times below are from it")
    for name, r in info["results"].items():
        if name in timed:
            rel = f" ({r['ms'] / best:.3f}x)" if best else ""
            how = " estimate only (cannot win)" if r.get("pruned") else (
                f" ±{100 * r['spread'] / 2:.1f}% over {len(r.get('ms_rounds', ()))} rounds" if "spread" in r else "")
            duel = r.get("paired") or {}
            if "ratio" in duel:
                how += f"; {duel['ratio']:.3f}x {duel['vs']} in {duel['pairs']} back-to-back pairs"
            lines.append(f"  {name:<15} {r['ms']:.4g} ms{rel}{how}")
        else:
            why = r.get("failed") or r.get("error") or r.get("skipped") or "?"
            lines.append(f"  {name:<15} {'failed the check: ' if r.get('failed') else ''}{why}")
    return "\n".join(lines)


def _tune(spec: AttentionSpec, candidates: list[str], key: str, store: _Store, progress=None) -> dict:
    """Check the candidates not yet in the class's entry, time those that pass against each other
    (:func:`_measure`), rank them with the tie rule; update memory and the file."""
    t_start = time.perf_counter()
    old = store.entries.get(key)
    results = dict(old["results"]) if old else {}
    _busy.active = True
    try:
        to_time = []
        for name in candidates:
            if name in results:
                continue
            if progress:
                progress(name)
            if name in NOT_TIMED:
                results[name] = {"skipped": "not timed (the float64 oracle / O(S^2) math kernel); "
                                            "chosen only when no timed backend passes"}
                continue
            why = check_candidate(name, spec)
            if why:
                results[name] = {"failed": why}
                continue
            to_time.append(name)
        if to_time:
            if progress:
                progress("timing " + ", ".join(to_time))

            def on_error(name, exc):   # out of memory, a kernel that refuses the real shape: not chosen
                if spec.device.type == "cuda":
                    torch.cuda.empty_cache()
            for name, t in _measure(to_time, spec, on_error=on_error).items():
                results[name] = t.as_dict()
    finally:
        _busy.active = False
    order, tied = _rank(results, candidates)
    entry = {
        "results": results, "order": order, "winner": order[0] if order else None, "tied": tied,
        "mode": "fwd+bwd" if spec.needs_grad else "fwd", "problem": spec.summary(),
        "tuned_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tuning_s": round(time.perf_counter() - t_start + (old or {}).get("tuning_s", 0.0), 3),
    }
    if old and old.get("rechecked"):   # a class that had its second look keeps it
        entry["rechecked"] = old["rechecked"]
    elif among := _close_to_winner(results, order):
        entry["recheck"] = {"at": time.time() + RECHECK_AFTER_S, "among": among}
    return _keep(entry, key, store)


def _keep(entry: dict, key: str, store: _Store) -> dict:
    store.entries[key] = entry
    _forget_hot()   # entries are replaced, not updated: forget the old objects
    store.save([key])
    return entry


def _duel(spec: AttentionSpec, results: dict, order: list[str], tied: list[str],
          among: list[str]) -> tuple[list[str], list[str]]:
    """The second look's last step (:data:`DUEL_WITHIN`): the winner of ``order`` against each
    candidate of ``among`` within ``DUEL_WITHIN`` of its time, in back-to-back pairs; the one whose
    pairs' median is furthest below ``1 - DUEL_MARGIN`` takes the class (``order`` and ``tied``
    updated); each duel is recorded on the challenger's result as ``paired`` (``vs``, the median
    ratio challenger / winner, the pairs' count)."""
    if not order:
        return order, tied
    winner = order[0]
    w_ms = results[winner]["ms"]
    rivals = [n for n in order[1:] if n in among and results[n]["ms"] <= w_ms * (1 + DUEL_WITHIN)]
    if not rivals:
        return order, tied
    from .registry import get_backend
    clock = _clock(spec.device)
    w_fn = _runner(get_backend(winner), spec)
    best, best_ratio = None, 1.0 - DUEL_MARGIN
    for name in rivals:
        try:
            ratios = timing.paired_ratios(_runner(get_backend(name), spec), w_fn, clock, ms_a=results[name]["ms"],
                                          ms_b=w_ms, pairs=DUEL_PAIRS, sample_ms=DUEL_SAMPLE_MS,
                                          names=(name, winner))
        except Exception as exc:   # a backend that fails here keeps its rounds' result
            results[name] = dict(results[name], paired={"vs": winner, "error": timing._error(exc)})
            continue
        if not ratios:
            continue
        ratio = statistics.median(ratios)
        results[name] = dict(results[name], paired={"vs": winner, "ratio": round(ratio, 5), "pairs": len(ratios)})
        if ratio < best_ratio:
            best, best_ratio = name, ratio
    if best is None:
        return order, tied
    return [best, *[n for n in order if n != best]], [best]


def _close_to_winner(results: dict, order: list[str]) -> list[str]:
    """The winner and the timed candidates within :data:`RECHECK_WITHIN` x its time (pruned ones
    by their estimate), or [] when none is that close."""
    timed = _timed(results)
    if not order or order[0] not in timed:
        return []
    best = timed[order[0]].ms
    close = [n for n in order[1:] if n in timed and timed[n].ms <= RECHECK_WITHIN * best]
    return [order[0], *close] if close else []


def recheck_due(spec: AttentionSpec) -> bool:
    """Whether ``spec``'s class has a provisional choice (a second look pending; see
    :data:`RECHECK_WITHIN`). No timing, no device sync."""
    entry = _hot_get(spec)[0]
    return entry is not None and "recheck" in entry


def recheck(spec: AttentionSpec, candidates: list[str] | None = None, *, force: bool = False) -> dict | None:
    """Take the second look at ``spec``'s class now if one is pending and due (``force``: due or
    not): time the close candidates against each other again, keep the first timing under
    ``rechecked``, rank them afresh and make the choice final. Returns the new entry, or None when
    nothing was done (no look pending, not due yet, or timing not allowed here: CUDA-graph
    capture, torch.compile tracing, inside a tuning)."""
    if _timing_forbidden(spec) or getattr(_busy, "active", False):
        return None
    key = shape_class(spec)
    with _lock:
        store = _store(spec.device)
        entry = store.entries.get(key)
        if entry is None or "recheck" not in entry:
            return None
        pending = entry["recheck"]
        if not force and time.time() < pending["at"]:
            return None
        if candidates is None:
            candidates = supported_candidates(spec)
        among = [n for n in pending["among"] if n in candidates]
        t_start = time.perf_counter()
        results = dict(entry["results"])
        first = {n: results.get(n) for n in among}
        _busy.active = True
        try:
            if len(among) > 1:
                # no pruning here: every candidate of the look was within RECHECK_WITHIN x the winner,
                # and a one-sample estimate can catch a backend in a slow moment (on the H200,
                # 2026-12-03, D128 S1k causal fwd: sdpa's estimate 0.70 ms at a steady 0.20 ms
                # pruned it and the look kept triton at 0.25 ms), so each gets the full rounds
                for name, t in _measure(among, spec, prune=None).items():
                    results[name] = t.as_dict()
            order, tied = _rank(results, candidates)
            order, tied = _duel(spec, results, order, tied, among)
        finally:
            _busy.active = False
        new = dict(entry, results=results, order=order, winner=order[0] if order else None, tied=tied,
                   tuning_s=round(entry.get("tuning_s", 0.0) + time.perf_counter() - t_start, 3),
                   rechecked={"first": first, "first_winner": entry.get("winner"),
                              "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})
        new.pop("recheck")
        return _keep(new, key, store)


def tune(spec: AttentionSpec, candidates: list[str] | None = None, *, progress=None) -> dict:
    """Time ``spec``'s class now (the candidates not timed yet) and return its entry.
    ``candidates`` defaults to the device's priority list minus backends with reasons."""
    if candidates is None:
        candidates = supported_candidates(spec)
    key = shape_class(spec)
    with _lock:
        return _tune(spec, list(candidates), key, _store(spec.device), progress)


def supported_candidates(spec: AttentionSpec) -> list[str]:
    """The device's priority list, minus the backends with reasons for ``spec``."""
    from .dispatch import priority_for
    from .registry import get_backend
    return [n for n in priority_for(spec.vendor) if not get_backend(n).not_supported_reasons(spec)]


def choose(spec: AttentionSpec, candidates: list[str]) -> str:
    """The backend the ``fastest`` policy runs ``spec`` on, among ``candidates`` (the backends
    with no reasons, in priority order). Times the class on first sight (see the module
    docstring); under torch.compile tracing or CUDA-graph capture, or while a tuning is already
    running in this thread, returns the cached winner or ``candidates[0]`` without timing."""
    if not candidates:
        raise ValueError("choose() needs at least one candidate backend")
    if len(candidates) == 1 or getattr(_busy, "active", False):
        return candidates[0]
    entry = _entry(spec)
    if entry is not None and "recheck" in entry and time.time() >= entry["recheck"]["at"]:
        entry = recheck(spec, candidates) or entry   # the second look (see RECHECK_WITHIN)
    if entry is not None:
        results = entry["results"]
        if all(n in results for n in candidates):   # the call path after the first call of a class
            for name in entry["order"]:
                if name in candidates:
                    return name
            return _fallback(shape_class(spec), candidates, entry)
    if _timing_forbidden(spec):
        return _pick(entry, candidates) or _fallback(shape_class(spec), candidates, entry)
    with _lock:
        entry = _tune(spec, candidates, shape_class(spec), _store(spec.device))
    return _pick(entry, candidates) or _fallback(shape_class(spec), candidates, entry)


# ----- portattn tune (portattn/tuning_cli.py) ---------------------------------------------

def add_arguments(parser) -> None:
    """The arguments of ``portattn tune`` (see :mod:`portattn.tuning_cli`)."""
    from . import tuning_cli
    tuning_cli.add_arguments(parser)


def run(args) -> int:
    """``portattn tune``: time each shape's class (skipping classes already cached) and print the winners."""
    from . import tuning_cli
    return tuning_cli.run(args)
