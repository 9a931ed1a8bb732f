"""Every ``PORTATTN_*`` environment variable, read in one place.

Values are read at call time (not import time) so that tests and users can change them in a
running process. docs/env.md documents each one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

_TRUE = {"1", "true", "yes", "on"}
#: set inside :func:`deterministic_scope` (per thread / task)
_DETERMINISTIC_SCOPE: contextvars.ContextVar[bool] = contextvars.ContextVar("portattn_deterministic", default=False)
_FALSE = {"", "0", "false", "no", "off"}

#: name -> one-line description (docs/env.md and ``portattn info`` print this table).
VARIABLES = {
    "PORTATTN_BACKEND": "pin a backend by name for every call (an unknown name is an error listing the known ones); "
                        "'fastest' = the fastest-backend policy",
    "PORTATTN_POLICY": "how calls that pin nothing choose: 'priority' (default: first backend of the device's list "
                       "that can run) or 'fastest' (timed once per shape class, remembered in the cache directory)",
    "PORTATTN_DETERMINISTIC": "1 = backends use their deterministic mode (bit-identical gradients across runs)",
    "PORTATTN_ALLOW_TF32": "1 = float32 inputs may use TF32 matrix units (default: IEEE float32)",
    "PORTATTN_DISABLE_ENTRY_POINTS": "1 = do not discover third-party backends through entry points",
    "PORTATTN_PRIORITY_NVIDIA": "comma-separated backend order for NVIDIA devices (overrides the built-in list)",
    "PORTATTN_PRIORITY_AMD": "comma-separated backend order for AMD ROCm devices",
    "PORTATTN_PRIORITY_CPU": "comma-separated backend order for CPU tensors",
    "PORTATTN_HYPOTHESIS_PROFILE": "Hypothesis profile for the property tests: ci, gpu or nightly",
    "PORTATTN_CUPY_BACKWARD": "cupy's fp16/bf16 backward: auto (default: tensor cores at every head dim — the "
                              "sm_90a wgmma kernels on Hopper at padded head dims 64/128/256 without softcap/ALiBi/bias, "
                              "where the H200 timed them faster, mma.sync elsewhere), mma128 (FMA above padded head "
                              "dim 128, the earlier kernels), fma (FMA always) or wgmma (the wgmma kernels wherever "
                              "they apply and fit); read on every call by backends/cupy/configs.py",
    "PORTATTN_CUPY_FORWARD": "cupy's fp16/bf16 forward: auto (default: the sm_90a wgmma kernel at padded head dims "
                             "64/128/256 on Hopper, where the H200 timed it faster; the mma.sync kernel elsewhere), "
                             "mma, wgmma (the wgmma kernel wherever it applies) or wgmma_ws (its warp-specialised "
                             "variant); read on every call by backends/cupy/configs.py",
    "PORTATTN_CUPY_DQ": "cupy's fp16/bf16 wgmma backward when determinism is not requested: auto (default: dQ "
                        "fused into the dK/dV kernel with float32 atomics at padded head dims 64/128, where the "
                        "H200 timed it faster; the deterministic dQ kernel elsewhere), atomic (fused wherever it "
                        "exists) or kernel (the deterministic dQ kernel always); read on every backward",
    "PORTATTN_TRITON_DQ": "triton's fp16/bf16 backward when determinism is not requested: auto (default: "
                          "FlashAttention-2's atomic dQ at the head dims whose atomic rows the H200 timed faster, "
                          "Hopper D 128 and 256; the deterministic dQ kernel elsewhere), atomic (every atomic row) "
                          "or kernel (the deterministic dQ kernel always); never for a head dim narrower than its "
                          "padded block; read on every backward",
    "PORTATTN_TRITON_FORWARD": "triton's forward: auto (default: the Hopper Gluon kernel, "
                               "backends/triton/gluon_fwd.py, where the H200 timed it faster - D 128 from 1k queries, "
                               "D 256 from 1k, D 64 non-causal from 2k and causal from 8k (three consumer warpgroups) - "
                               "and gluon_reasons is empty; the "
                               "portable kernel elsewhere), gluon "
                               "(wherever gluon_reasons is empty) or portable (never Gluon); read on every forward",
    "PORTATTN_TRITON_GLUON_PINGPONG": "0/false/no/off = the Gluon forward's consumer warpgroups do not take turns issuing their "
                                      "matrix products (FA3's ping-pong off; default 1)",
    "PORTATTN_TRITON_GLUON_PERSISTENT": "the Gluon forward's persistent variant at D 64/128/256 (one CTA per SM walking "
                                        "(query tile, head) work items): unset or empty = auto (where the H200 timed "
                                        "it faster, gluon_fwd.AUTO_PERSISTENT), 1/true/yes/on = always, 0/false/no/off "
                                        "= never; read on every forward",
    "PORTATTN_TRITON_GLUON_CONSUMERS": "the Gluon forward's consumer warpgroups (64 query rows each): unset or "
                                       "empty = gluon_fwd.DEFAULT_CONSUMERS per head dim, 2, or 3 (D 64 only: "
                                       "FA3's 192-row tiles); read on every forward",
    "PORTATTN_TRITON_HEAD_GROUP": "how many (batch, head)s the Gluon forward's causal walk takes its query tiles "
                                  "from longest first, together: unset or empty = gluon_fwd.head_group (as many as "
                                  "keep their K and V in L2), or a positive number (1: one head after the other); "
                                  "read on every forward",
    "PORTATTN_TRITON_PAIRED_WALK": "whether the Gluon forward's persistent causal walk gives each CTA a head's tiles "
                                   "in long + short pairs (gluon_fwd._work_tile) or every #SMs-th query tile: unset or "
                                   "empty = pairs at gluon_fwd.PAIRED_HEAD_DIMS (D 128, 256), 1/true/yes/on = pairs, "
                                   "0/false/no/off = no pairs; read on every forward",
    "PORTATTN_TRITON_Q_BUFFERS": "the persistent Gluon forward's Q tiles a consumer warpgroup: unset or empty = 2 "
                                 "(config.Q_BUFFERS_DEFAULT: the next work item's Q loads during the current one), "
                                 "or 1 (it loads after the current band's last product); read on every forward",
    "PORTATTN_TRITON_GLUON_STAGES": "the persistent Gluon forward's K/V ring depth (key tiles loaded ahead): unset "
                                    "or empty = gluon_fwd.tile_config's per head dim, or 2 to 8 (a deeper ring "
                                    "stores O through the Q tile and keeps one Q buffer where O's own tiles no "
                                    "longer fit, gluon_fwd.smem_plan); read on every forward",
    "PORTATTN_TRITON_GLUON_ONE_STEP": "whether the Gluon forward runs a band's key tiles through one step whose element "
                                      "mask sits behind a runtime branch (one copy of the step's code: fewer "
                                      "instruction-cache misses) instead of one step per phase: unset or empty = no, "
                                      "1/true/yes/on = yes, 0/false/no/off = no; read on every forward",
    "PORTATTN_CACHE_DIR": "where portattn keeps the fastest policy's timings and backends their compiled kernels "
                          "(default: the platform's user cache directory, ~/.cache/portattn on Linux)",
}


# The call path reads a few variables on every call (a change is seen by the next call).
# ``os.environ.get`` encodes the key and decodes the value each time (~1.5 us); on POSIX the
# mapping's own bytes dictionary answers the same question in ~0.1 us, and parsed values are
# memoised by their raw bytes.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_KEYS: dict[str, bytes] = {}
_PARSED: dict[tuple[str, bytes | str | None], object] = {}


def _tracing() -> bool:
    """Under torch.compile the memo dictionaries are not touched: dynamo guards on their
    contents, and filling one while tracing would recompile the graph on the next call."""
    try:
        return torch.compiler.is_compiling()
    except AttributeError:   # torch < 2.3
        return False


def _raw(name: str):
    """The variable's raw value (bytes on POSIX, str elsewhere) or None, cheaply."""
    if _ENV_BYTES is None or _tracing():
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.fsencode(name)
    return _ENV_BYTES.get(key)


#: the variables the call path reads (selection, determinism, TF32): portattn.callcache keys on them
_CALL_PATH = ("PORTATTN_BACKEND", "PORTATTN_POLICY", "PORTATTN_DETERMINISTIC", "PORTATTN_ALLOW_TF32",
              "PORTATTN_PRIORITY_NVIDIA", "PORTATTN_PRIORITY_AMD", "PORTATTN_PRIORITY_CPU", "PORTATTN_CACHE_DIR")
_CALL_PATH_BYTES = tuple(map(os.fsencode, _CALL_PATH))


def state() -> tuple:
    """The raw values of every variable the call path reads, and whether a
    :func:`deterministic_scope` is open (a change is a new tuple)."""
    if _ENV_BYTES is None:
        return (*map(os.environ.get, _CALL_PATH), _DETERMINISTIC_SCOPE.get())
    return (*map(_ENV_BYTES.get, _CALL_PATH_BYTES), _DETERMINISTIC_SCOPE.get())


def _parsed(name: str, parse, default):
    raw = _raw(name)
    if raw is None:
        return default
    if _tracing():
        return parse(name, os.fsdecode(raw) if isinstance(raw, bytes) else raw)
    memo = (name, raw)
    value = _PARSED.get(memo, _PARSED)
    if value is _PARSED:
        value = parse(name, os.fsdecode(raw) if isinstance(raw, bytes) else raw)
        if len(_PARSED) > 256:
            _PARSED.clear()
        _PARSED[memo] = value
    return value


def _parse_flag(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={text!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _flag(name: str) -> bool:
    return _parsed(name, _parse_flag, False)


def backend() -> str | None:
    """The backend pinned through ``PORTATTN_BACKEND``, or None."""
    return _parsed("PORTATTN_BACKEND", lambda _, text: text.strip() or None, None)


def policy() -> str:
    """``PORTATTN_POLICY`` (default ``"priority"``); dispatch validates the name."""
    return _parsed("PORTATTN_POLICY", lambda _, text: text.strip().lower() or "priority", "priority")


@contextlib.contextmanager
def deterministic_scope():
    """Request determinism for the calls made inside (as ``PORTATTN_DETERMINISTIC=1`` does, for
    this thread or task only): their specs carry ``deterministic``, so the dispatch takes only
    backends with a deterministic mode and triton runs its two-kernel backward (no atomic dQ) when
    those calls' gradients are computed later. Outside ``torch.compile`` tracing only (there, use
    ``torch.use_deterministic_algorithms(True)``)."""
    token = _DETERMINISTIC_SCOPE.set(True)
    try:
        yield
    finally:
        _DETERMINISTIC_SCOPE.reset(token)


def deterministic() -> bool:
    """``PORTATTN_DETERMINISTIC``, or inside :func:`deterministic_scope` (eager calls)."""
    if _flag("PORTATTN_DETERMINISTIC"):
        return True
    return not torch.compiler.is_compiling() and _DETERMINISTIC_SCOPE.get()


def allow_tf32() -> bool:
    return _flag("PORTATTN_ALLOW_TF32")


TRITON_FORWARD_MODES = ("auto", "gluon", "portable")


def _parse_triton_forward(name: str, text: str) -> str:
    mode = text.strip().lower() or "auto"
    if mode not in TRITON_FORWARD_MODES:
        raise ValueError(f"{name}={text!r}: expected 'auto' (the Gluon kernel where the H200 timed it faster, "
                         f"the portable kernel elsewhere), 'gluon' (wherever it can run) or 'portable'")
    return mode


def triton_forward() -> str:
    """``PORTATTN_TRITON_FORWARD`` (default ``"auto"``): which kernel triton's forward runs
    (``backends/triton/gluon_fwd.forward_choice``)."""
    return _parsed("PORTATTN_TRITON_FORWARD", _parse_triton_forward, "auto")


TRITON_BACKWARD_MODES = ("auto", "gluon", "portable")


def _parse_triton_backward(name: str, text: str) -> str:
    mode = text.strip().lower() or "auto"
    if mode not in TRITON_BACKWARD_MODES:
        raise ValueError(f"{name}={text!r}: expected 'auto' (the default: the Gluon Hopper backward where the "
                         f"H200 timed it faster, else the portable one), 'gluon' (the Gluon backward wherever "
                         f"it can run) or 'portable'")
    return mode


def triton_backward() -> str:
    """``PORTATTN_TRITON_BACKWARD`` (default ``"auto"``): which kernels triton's 16-bit backward
    runs (``backends/triton/gluon_bwd.backward_choice``); ``auto`` takes the Gluon Hopper
    backward where ``gluon_bwd.AUTO_MIN_SEQLEN`` says the H200 timed it faster."""
    return _parsed("PORTATTN_TRITON_BACKWARD", _parse_triton_backward, "auto")


def triton_gluon_pingpong() -> bool:
    """``PORTATTN_TRITON_GLUON_PINGPONG`` (default on; empty is the default; 0/false/no/off turn it
    off; anything else but a boolean raises ``ValueError``)."""
    return _parsed("PORTATTN_TRITON_GLUON_PINGPONG",
                   lambda name, text: True if not text.strip() else _parse_flag(name, text), True)


def triton_gluon_persistent() -> bool | None:
    """``PORTATTN_TRITON_GLUON_PERSISTENT``: None when unset or empty (``auto``: the Gluon forward
    runs its persistent variant where ``gluon_fwd.AUTO_PERSISTENT`` says the H200 timed it
    faster), True for 1/true/yes/on (always, at ``gluon_fwd.PERSISTENT_HEAD_DIMS``), False for
    0/false/no/off (never); anything else raises ``ValueError``."""
    return _parsed("PORTATTN_TRITON_GLUON_PERSISTENT",
                   lambda name, text: None if not text.strip() else _parse_flag(name, text), None)


def _parse_consumers(name: str, text: str) -> int | None:
    text = text.strip()
    if not text:
        return None
    if text not in ("2", "3"):
        raise ValueError(f"{name}={text!r}: use 2 or 3 (consumer warpgroups), or leave it unset")
    return int(text)


def triton_gluon_consumers() -> int | None:
    """``PORTATTN_TRITON_GLUON_CONSUMERS``: None when unset or empty (``gluon_fwd.DEFAULT_CONSUMERS``
    per head dim), else 2 or 3 (the Gluon forward's consumer warpgroups; 3 applies at D 64 only,
    ``gluon_fwd.consumers_for`` runs two at other head dims); anything else raises ``ValueError``."""
    return _parsed("PORTATTN_TRITON_GLUON_CONSUMERS", _parse_consumers, None)


def _parse_head_group(name: str, text: str) -> int | None:
    text = text.strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name}={text!r}: use a positive number of (batch, head)s (1: one head's query tiles "
                         f"after the other's), or leave it unset (gluon_fwd.head_group)")
    return int(text)


def triton_head_group() -> int | None:
    """``PORTATTN_TRITON_HEAD_GROUP``: None when unset or empty (``gluon_fwd.head_group``: as many
    (batch, head)s as keep their K and V in L2), else a positive int: how many (batch, head)s the
    Gluon forward's longest-first (causal) walk takes together; anything else raises ``ValueError``."""
    return _parsed("PORTATTN_TRITON_HEAD_GROUP", _parse_head_group, None)


def triton_paired_walk() -> bool | None:
    """``PORTATTN_TRITON_PAIRED_WALK``: None when unset or empty (pairs at the head dims
    ``gluon_fwd.PAIRED_HEAD_DIMS``, where an H100 timed them faster), True for 1/true/yes/on,
    False for 0/false/no/off; anything else raises ``ValueError``. Whether the persistent Gluon
    forward's causal walk gives each CTA a head's long and short query tiles in pairs
    (``gluon_fwd._work_tile``), so every unit of work costs about the same (docs/triton.md, The
    causal walk in pairs)."""
    return _parsed("PORTATTN_TRITON_PAIRED_WALK",
                   lambda name, text: None if not text.strip() else _parse_flag(name, text), None)


def _parse_q_buffers(name: str, text: str) -> int:
    text = text.strip()
    if text not in ("", "1", "2"):
        raise ValueError(f"{name}={text!r}: use 1 (one Q tile a consumer, loaded once the last item's "
                         f"products have read it) or 2 (the next item's Q loads during this one), or leave it unset")
    return int(text) if text else Q_BUFFERS_DEFAULT


#: the persistent Gluon forward's Q buffers per consumer warpgroup when ``PORTATTN_TRITON_Q_BUFFERS``
#: is unset (docs/triton.md, The next item's Q)
Q_BUFFERS_DEFAULT = 2


def triton_gluon_one_step() -> bool:
    """``PORTATTN_TRITON_GLUON_ONE_STEP`` (a boolean; unset or empty: False): the Gluon forward's band
    in one step with the element mask behind a runtime branch (``gluon_fwd._attend``'s ``ONE_STEP``)
    instead of a step per phase; anything else raises ``ValueError``."""
    return _flag("PORTATTN_TRITON_GLUON_ONE_STEP")


def _parse_stages(name: str, text: str) -> int | None:
    text = text.strip()
    if not text:
        return None
    if text not in {str(n) for n in range(2, 9)}:
        raise ValueError(f"{name}={text!r}: use 2 to 8 (K/V tiles in the ring), or leave it unset")
    return int(text)


def triton_gluon_stages() -> int | None:
    """``PORTATTN_TRITON_GLUON_STAGES``: None when unset or empty (``gluon_fwd.tile_config``'s ring
    depth), else 2 to 8, the persistent Gluon forward's K/V ring depth; anything else raises
    ``ValueError``."""
    return _parsed("PORTATTN_TRITON_GLUON_STAGES", _parse_stages, None)


def triton_q_buffers() -> int:
    """``PORTATTN_TRITON_Q_BUFFERS`` (1 or 2; unset or empty: :data:`Q_BUFFERS_DEFAULT`; anything
    else raises ``ValueError``): the persistent Gluon forward's shared Q tiles per consumer
    warpgroup. With 2 the producer loads the next work item's Q while the consumers still run the
    current one (``gluon_fwd._load_q``), instead of after the current band's last product."""
    return _parsed("PORTATTN_TRITON_Q_BUFFERS", _parse_q_buffers, Q_BUFFERS_DEFAULT)


TRITON_DQ_MODES = ("auto", "atomic", "kernel")


def _parse_triton_dq(name: str, text: str) -> str:
    mode = text.strip().lower() or "auto"
    if mode not in TRITON_DQ_MODES:
        raise ValueError(f"{name}={text!r}: use one of {', '.join(TRITON_DQ_MODES)}")
    return mode


def triton_dq() -> str:
    """``PORTATTN_TRITON_DQ`` (default ``"auto"``): how triton's 16-bit backward adds dQ when
    determinism is not requested (backends/triton/ops.py ``atomic_config``)."""
    return _parsed("PORTATTN_TRITON_DQ", _parse_triton_dq, "auto")


def priority_raw(vendor: str):
    """The raw ``PORTATTN_PRIORITY_<VENDOR>`` value (for cache keys), or None."""
    return _raw(f"PORTATTN_PRIORITY_{vendor.upper()}")


def entry_points_disabled() -> bool:
    return _flag("PORTATTN_DISABLE_ENTRY_POINTS")


def priority_override(vendor: str) -> list[str] | None:
    raw = os.environ.get(f"PORTATTN_PRIORITY_{vendor.upper()}", "").strip()
    if not raw:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def hypothesis_profile() -> str:
    return os.environ.get("PORTATTN_HYPOTHESIS_PROFILE", "ci").strip() or "ci"


def cache_dir() -> str:
    """``$PORTATTN_CACHE_DIR``, else the user cache directory of the platform (platformdirs:
    ``~/.cache/portattn`` on Linux, ``~/Library/Caches/portattn`` on macOS, ...). Without
    platformdirs installed (a bare image running from the source tree) ``~/.cache/portattn``."""
    chosen = _parsed("PORTATTN_CACHE_DIR", lambda _, text: text.strip() or None, None)
    return chosen or _default_cache_dir()


@functools.lru_cache(maxsize=1)
def _default_cache_dir() -> str:
    try:
        import platformdirs
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".cache", "portattn")
    return platformdirs.user_cache_dir("portattn", appauthor=False)
