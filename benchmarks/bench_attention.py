"""portattn's training benchmark: portattn backends side by side with torch SDPA's flash (FA2)
and cuDNN kernels, forward and backward timed separately, in one run, as TFLOP/s and ratios.

    portattn bench --out results/ --time-limit 280     # the full grid (72 cells); no new cell after 280 s
    portattn bench --quick                             # D 128, S 1k/4k, bf16 (4 cells)
    portattn bench --cpu --out /tmp/b                  # tiny grid on the CPU (tests, no GPU)
    portattn bench --decode --out results/             # the decode grid (benchmarks/bench_decode.py)

Grid (issue 14): D 64/128/256 × S 512..16k × causal and not × bf16 and fp16; B·S = 16k tokens
and hidden 2048 (B = 16384 / S, H = 2048 / D), the FA3 paper's setting. Each cell times every
implementation's forward and backward.

Conventions (shared/GPU.md): FLOPs = 4·B·H·S²·D forward, halved for causal; backward =
2.5 × forward. The forward is timed without autograd (``torch.no_grad``); the backward alone, as
``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` of one saved forward, so no
forward is in it. A timing is the mean of ``n`` back-to-back calls between two CUDA events, ``n``
chosen so a round lasts ``--round-ms``, queued behind a GPU sleep as long as the host needs to
launch them (so host overhead is not in it; the host's ms per call is recorded beside it, as
``host_ms``); every implementation is timed ``--rounds`` times,
interleaved (odd rounds in reverse order), and the median round is reported with the spread.
Inputs are random normal; when one set of inputs fits twice in the L2 cache, the calls rotate
over copies (never on the full grid: each of q, k, v is 64 MiB). Every timed output (forward
out, backward dq/dk/dv) is checked once against the float64 reference under the equivalence
rule of docs/semantics.md (``portattn.numerics.compare``) on a slice: the last batch entry,
heads 0 and H-1. Writes ``bench-<tag>-<date>.json`` (GPU, driver, versions, date, every timing),
``.md`` (the ratio table) and ``.png`` (TFLOP/s against S, a panel per dtype, direction and D).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

import portattn
from portattn.numerics import GRAD_FACTOR, compare
from portattn.reference import naive_forward, reference_forward
from portattn.spec import build_spec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import (  # noqa: E402  (the ratio table, targets, markdown and plot)
    BASELINES,
    NOISY,  # noqa: F401  (benchmarks/bench_fastest.py reads it here)
    _num,
    card_tag,
    first_calls,
    format_markdown,
    format_text,
    label,
    legend,
    plot,
    summary,
    table,
    target_lines,
    targets,
)

HEAD_DIMS = (128, 64, 256)        # D 128 first: a run stopped by its time limit keeps the headline cells
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = ("bf16", "fp16")
TOKENS, HIDDEN = 16384, 2048
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DIRECTIONS = ("fwd", "bwd")
#: at most this many copies of the inputs when they fit in L2
MAX_COPIES = 8
BWD_METHOD = "torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) of one saved forward (no forward timed)"
FLOP_CONVENTION = "fwd 4*B*H*S*S*D (x0.5 causal); bwd 2.5 x fwd"


# ----- the grid --------------------------------------------------------------------------------

class Cell(NamedTuple):
    """One problem: q, k, v (B, S, H, D) in ``dtype``, causal or not."""

    dtype: str
    D: int
    S: int
    causal: bool
    B: int
    H: int

    @property
    def name(self) -> str:
        return f"{self.dtype} D{self.D} S{self.S}{' causal' if self.causal else ''}"


def grid(head_dims=HEAD_DIMS, seqlens=SEQLENS, dtypes=DTYPES, causal=(False, True),
         tokens: int = TOKENS, hidden: int = HIDDEN) -> list[Cell]:
    """The cells by head dim, causality, sequence length and dtype (in the given orders): the dtypes
    of one shape run back to back, so that their comparison (fp16 within 5 % of bf16) does not
    take in the machine's drift over the run. On the H200 (2026-12-05) a dtype-major grid put
    every implementation's fp16 forward, FA2's included, up to 9 % below bf16 in the same cells."""
    for dtype in dtypes:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    for s in seqlens:
        if s < 1:
            raise ValueError(f"sequence length {s} must be >= 1")
    cells = []
    for d in head_dims:
        if d < 1 or hidden % d:
            raise ValueError(f"head dim {d} does not divide the hidden size {hidden}; choose --hidden or --head-dims")
        for c in causal:
            for s in seqlens:
                cells += [Cell(dtype, d, s, c, max(1, tokens // s), hidden // d) for dtype in dtypes]
    return cells


def flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool, mode: str) -> float:
    """FLOPs of ``mode`` fwd (4·B·H·Sq·Sk·D, halved for causal), bwd (2.5 × fwd) or fwd+bwd (3.5 ×)."""
    f = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def cell_flops(cell: Cell, direction: str) -> float:
    return flops(cell.B, cell.H, cell.S, cell.S, cell.D, cell.causal, direction)


def tflops(cell: Cell, direction: str, ms: float) -> float:
    return cell_flops(cell, direction) / (ms * 1e-3) / 1e12


def cell_weight(cell: Cell, directions) -> float:
    """Expected relative cost of a cell (for the ETA): its FLOPs plus a per-cell overhead."""
    return sum(cell_flops(cell, d) for d in directions) / 1e12 + 0.05


def rotation_copies(set_bytes: int, l2_bytes: int) -> int:
    """How many copies of the inputs to rotate over so the L2 cache cannot hold them (1: none)."""
    if l2_bytes <= 0 or set_bytes <= 0:
        return 1
    return max(1, min(MAX_COPIES, math.ceil(2 * l2_bytes / set_bytes)))


# ----- implementations -------------------------------------------------------------------------

def portattn_fn(impl: str, causal: bool):
    """``fn(q, k, v) -> out``: ``portattn.attention`` pinned to backend ``impl`` (bottom-right
    causal: the same as SDPA's top-left when Sq == Sk)."""
    return lambda q, k, v: portattn.attention(q, k, v, causal=causal, backend=impl)


def forward_fn(impl: str, causal: bool):
    """``fn(q, k, v) -> out`` on (B, S, H, D) tensors: a baseline (torch SDPA kernel called
    directly, without portattn's dispatch) or :func:`portattn_fn`."""
    if impl not in BASELINES:
        return portattn_fn(impl, causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kernel = getattr(SDPBackend, BASELINES[impl])

    def run(q, k, v):
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
    return run


#: benchmarks/bench_fastest.py's rounds per implementation (it times with do_bench medians)
ROUNDS = 2


def make_fn(impl: str, q, k, v, causal: bool, mode: str):
    """A closure for benchmarks/bench_fastest.py: ``mode`` "fwd" or "fwd+bwd" (forward, then
    dq/dk/dv) of ``portattn.attention(backend=impl)``; "sdpa-flash" / "sdpa-cudnn" call torch
    SDPA's kernel directly (the registry names sdpa_flash / sdpa_cudnn go through portattn)."""
    direct = {"sdpa-flash": "sdpa_flash", "sdpa-cudnn": "sdpa_cudnn"}
    run = forward_fn(direct[impl], causal) if impl in direct else portattn_fn(impl, causal)
    if mode == "fwd":
        return lambda: run(q, k, v)
    dout = torch.randn_like(q[..., : v.shape[-1]])

    def fwd_bwd():
        torch.autograd.grad(run(q, k, v), (q, k, v), dout)
    return fwd_bwd


class Rotating:
    """Calls ``fns[0], fns[1], ...`` in turn (one per copy of the inputs)."""

    def __init__(self, fns):
        self.fns, self.i = list(fns), 0

    def __call__(self):
        fn = self.fns[self.i]
        self.i = (self.i + 1) % len(self.fns)
        return fn()


# ----- timing ----------------------------------------------------------------------------------

def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """``timer(fn) -> ms per call``: the GPU time of ``n`` back-to-back calls between two CUDA
    events (the host clock on a CPU). ``n`` is fixed per ``fn`` on its first use from one probe
    call, so that a round lasts about ``round_ms`` (``min_calls`` to ``max_calls``; 1 for a call
    longer than 4 rounds). On a GPU the calls are queued behind a ``torch.cuda._sleep`` as long
    as the host needs to launch them, so the host's launch overhead (portattn's dispatch,
    Python) is not in the time: it is recorded beside it (``stats[fn]["host_ms"]``, per call), as
    what an eager caller would add when the GPU is faster than the host. Call :meth:`forget` once a cell is done (the callables hold
    its tensors)."""

    #: GPU clock cycles per ms for the sleep (an H200 boosts to 1.98 GHz; a slower clock sleeps longer)
    CYCLES_PER_MS = 2.0e6
    #: the sleep never exceeds this (ms): a host slower than that shows up in the timing
    MAX_LEAD_MS = 200.0

    def __init__(self, device: torch.device, round_ms: float = 25.0, min_calls: int = 2, max_calls: int = 200):
        self.device, self.round_ms, self.min_calls, self.max_calls = device, round_ms, min_calls, max_calls
        self.stats: dict = {}
        self.can_sleep = device.type == "cuda" and hasattr(torch.cuda, "_sleep")

    def measure(self, fn, n: int, lead_ms: float = 0.0) -> tuple[float, float]:
        """(device ms per call, host ms per call) of ``n`` calls."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if lead_ms > 0 and self.can_sleep:
                torch.cuda._sleep(int(lead_ms * self.CYCLES_PER_MS))
            start.record()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host = (time.perf_counter() - t0) * 1e3 / n
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / n, host
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / n
        return ms, ms

    def __call__(self, fn) -> float:
        st = self.stats.get(fn)
        if st is None:
            probe, host = self.measure(fn, 1)
            least = 1 if probe > 4 * self.round_ms else self.min_calls   # a very slow call: one a round is enough
            n = max(least, min(self.max_calls, int(self.round_ms / max(probe, 1e-3))))
            st = self.stats[fn] = {"calls": n, "host_ms": host}
        lead = min(self.MAX_LEAD_MS, 1.25 * st["calls"] * st["host_ms"] + 0.05)
        ms, host = self.measure(fn, st["calls"], lead)
        st["host_ms"] = host
        return ms

    def forget(self, fns):
        for fn in fns:
            self.stats.pop(fn, None)


def _error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def time_rounds(fns: dict, rounds: int, timer) -> dict:
    """Time every callable of ``fns`` ``rounds`` times, interleaved (round r visits them in order,
    odd rounds in reverse, so that none is always first or last). Returns per name
    ``{"ms": median of the rounds, "ms_rounds": [...], "spread": (max - min) / ms}`` or
    ``{"error": ...}`` if a timing raised (that name is not timed again)."""
    names = list(fns)
    times = {n: [] for n in names}
    errors = {}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if name in errors:
                continue
            try:
                times[name].append(float(timer(fns[name])))
            except Exception as exc:
                errors[name] = _error(exc)
    out = {}
    for name in names:
        if name in errors:
            out[name] = {"error": errors[name]}
            continue
        ms = statistics.median(times[name])
        out[name] = {"ms": ms, "ms_rounds": times[name], "spread": (max(times[name]) - min(times[name])) / ms}
    return out


# ----- the check against the float64 reference -------------------------------------------------

def _slice(t: torch.Tensor, b: int, heads: list[int]) -> torch.Tensor:
    return t[b:b + 1, :, heads]


def reference_slice(q, k, v, dout, causal: bool, grad: bool) -> dict:
    """The float64 reference and the in-dtype naive yardstick (docs/semantics.md §3) of the last
    batch entry, heads 0 and H-1: heads and batch entries are independent problems, so the slice
    of a backend's full output (and gradients) must match them."""
    b, heads = q.shape[0] - 1, sorted({0, q.shape[2] - 1})
    qs, ks, vs, ds = (_slice(t, b, heads).detach() for t in (q, k, v, dout))
    out = {"b": b, "heads": heads}
    with torch.enable_grad():
        r = [t.double().requires_grad_(grad) for t in (qs, ks, vs)]
        n = [t.clone().requires_grad_(grad) for t in (qs, ks, vs)]
        ref_out, _ = reference_forward(build_spec(*r, causal=causal))
        naive_out, _ = naive_forward(build_spec(*n, causal=causal))
        out["out"] = (ref_out.detach(), naive_out.detach())
        if grad:
            g_ref = torch.autograd.grad(ref_out, r, ds.double())
            g_naive = torch.autograd.grad(naive_out, n, ds)
            for name, gr, gn in zip(("dq", "dk", "dv"), g_ref, g_naive):
                out[name] = (gr, gn)
            scale = qs.shape[-1] ** -0.5
            out["magnitude"] = (ds.abs().max() * vs.abs().max() * ks.abs().max()).item() * scale
    return out


def check(name: str, t: torch.Tensor, refs: dict) -> dict:
    """``{"ok", "max_err", "tol", "score"}`` of one output (its reference slice) under the rule."""
    ref, naive = refs[name]
    grad = name != "out"
    c = compare(name, _slice(t, refs["b"], refs["heads"]), ref, naive, factor=GRAD_FACTOR if grad else 2.0,
                zero_ref_scale=refs.get("magnitude", 1.0) if grad else 1.0)
    return {"ok": bool(c.passed), "max_err": c.max_err, "tol": c.tolerance, "score": c.score}


# ----- one cell --------------------------------------------------------------------------------

def _fwd_call(run, inputs):
    """The timed forward: ``run(q, k, v)`` without autograd."""
    def call():
        with torch.no_grad():
            return run(*inputs[:3])
    return call


def _bwd_call(out, inputs):
    """The timed backward alone: dq, dk, dv of the saved forward ``out`` (its graph kept)."""
    return lambda: torch.autograd.grad(out, inputs[:3], inputs[3], retain_graph=True)


def bench_cell(cell: Cell, impls, directions, device, timer, rounds: int, l2_bytes: int = 0, seed: int = 0) -> dict:
    """Check, then time, every implementation on one cell; the row of the JSON."""
    dtype = _DTYPES[cell.dtype]
    want_bwd = "bwd" in directions
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (cell.B, cell.S, cell.H, cell.D)
    set_bytes = 5 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()   # q, k, v, dout, out
    copies = rotation_copies(set_bytes, l2_bytes)
    sets = []
    for _ in range(copies):
        q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4))
        sets.append(tuple(t.requires_grad_(want_bwd) for t in (q, k, v)) + (dout,))
    refs = reference_slice(*sets[0], cell.causal, want_bwd)
    row = {"dtype": cell.dtype, "D": cell.D, "S": cell.S, "B": cell.B, "H": cell.H, "causal": cell.causal,
           "copies": copies, "results": {}}
    fns = {d: {} for d in directions}
    for impl in impls:
        entry = row["results"][impl] = {"first_call_s": {}, "check": {}}
        run = forward_fn(impl, cell.causal)
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = run(*sets[0][:3])
            sync(device)
            entry["first_call_s"]["fwd"] = round(time.perf_counter() - t0, 4)
            entry["check"]["out"] = check("out", out, refs)
            del out
            if "fwd" in directions:
                fns["fwd"][impl] = Rotating([_fwd_call(run, s) for s in sets])
        except Exception as exc:   # a backend that cannot run this cell: say why, time nothing
            entry["fwd"] = {"error": _error(exc)}
            if want_bwd:
                entry["bwd"] = {"error": "the forward failed"}
            continue
        if not want_bwd:
            continue
        try:
            t0 = time.perf_counter()
            saved = [run(*s[:3]) for s in sets[:1]]
            grads = torch.autograd.grad(saved[0], sets[0][:3], sets[0][3], retain_graph=True)
            sync(device)
            entry["first_call_s"]["fwd+bwd"] = round(time.perf_counter() - t0, 4)
            for name, g in zip(("dq", "dk", "dv"), grads):
                entry["check"][name] = check(name, g, refs)
            del grads
            saved += [run(*s[:3]) for s in sets[1:]]
            fns["bwd"][impl] = Rotating([_bwd_call(o, s) for o, s in zip(saved, sets)])
        except Exception as exc:
            entry["bwd"] = {"error": _error(exc)}
    for d in directions:
        for impl, timing in time_rounds(fns[d], rounds, timer).items():
            st = getattr(timer, "stats", {}).get(fns[d][impl], {})
            if "ms" in timing:
                timing["tflops"] = tflops(cell, d, timing["ms"])
                timing["calls_per_round"] = st.get("calls")
                timing["host_ms"] = st.get("host_ms")
            row["results"][impl][d] = timing
        if hasattr(timer, "forget"):
            timer.forget(fns[d].values())
    for entry in row["results"].values():   # None: nothing was checked (it did not run)
        entry["ok"] = all(c["ok"] for c in entry["check"].values()) if entry["check"] else None
    row["ratios"] = ratios(row, impls, directions)
    return row


def ratios(row: dict, impls, directions) -> dict:
    """``{ours: {baseline: {direction: ours TFLOP/s / baseline TFLOP/s}}}`` where both were timed."""
    res, out = row["results"], {}
    for o in (i for i in impls if i not in BASELINES):
        for b in (i for i in impls if i in BASELINES):
            for d in directions:
                a, c = res.get(o, {}).get(d, {}).get("tflops"), res.get(b, {}).get(d, {}).get("tflops")
                if a and c:
                    out.setdefault(o, {}).setdefault(b, {})[d] = a / c
    return out


# ----- environment -----------------------------------------------------------------------------

#: the commit to record when git cannot tell it: a copy of the tree whose .git is stale (the
#: device tool's, which carries the working tree but not always the newest git metadata)
COMMIT_ENV = "PORTATTN_BENCH_COMMIT"


def _git_commit() -> str | None:
    """The tree's commit (``+dirty`` with uncommitted changes to tracked files), or
    :data:`COMMIT_ENV`'s value when that is set."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        return given
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        res = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        rev = res.stdout.strip() or None
        # a tree with uncommitted changes to tracked files is not that commit: say so
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{rev}+dirty" if rev and dirty else rev
    except Exception:
        return None


def environment(device: torch.device | str = "cuda") -> dict:
    device = torch.device(device)
    env = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": str(device),
           "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "portattn": portattn.__version__, "commit": _git_commit()}
    for mod in ("triton", "cupy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                   l2_bytes=getattr(props, "L2_cache_size", None))
        try:
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            env["cudnn"] = None
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip() or None
        except Exception:
            env["driver"] = None
    else:
        env.update(gpu=None, driver=None, cpu=platform.processor() or platform.machine(),
                   threads=torch.get_num_threads())
    return env


# ----- progress --------------------------------------------------------------------------------

def _fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


def cell_line(cell: Cell, row: dict, directions) -> str:
    parts = []
    for d in directions:
        parts.append(d + " " + " ".join(
            f"{label(i)} {_num(e[d]['tflops'])}" if "tflops" in e.get(d, {}) else f"{label(i)} err"
            for i, e in row["results"].items()))
    bad = [i for i, e in row["results"].items() if e.get("ok") is False]
    if "error" in row:
        return f"{cell.name}: ERROR {row['error']}"
    return f"{cell.name}: " + " | ".join(parts) + (f"  CHECK FAILED: {', '.join(bad)}" if bad else "")


class Progress:
    """A rich progress bar (cell i/N, elapsed, ETA) when ``stream`` is a terminal and rich is
    installed; otherwise one plain line per finished cell with the same counts. The ETA weighs
    the cells left by their FLOPs (:func:`cell_weight`)."""

    def __init__(self, cells: list[Cell], directions, stream=None, rich: bool | None = None):
        self.stream = stream or sys.stdout
        self.weights = [cell_weight(c, directions) for c in cells]
        self.total, self.done_weight, self.i = sum(self.weights), 0.0, 0
        self.t0 = time.monotonic()
        self.bar = None
        if rich is None:
            rich = bool(getattr(self.stream, "isatty", lambda: False)())
        if rich:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:
                return
            self.bar = Progress(TextColumn("cell {task.fields[cell]}"), BarColumn(), TextColumn("{task.description}"),
                                TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
                                console=Console(file=self.stream))
            self.task = self.bar.add_task(cells[0].name if cells else "", total=self.total, cell=f"1/{len(cells)}",
                                          eta="?")
            self.bar.start()

    def eta(self) -> float:
        elapsed = time.monotonic() - self.t0
        return elapsed * (self.total - self.done_weight) / self.done_weight if self.done_weight else math.nan

    def cell_done(self, line: str, next_cell: Cell | None):
        self.done_weight += self.weights[self.i]
        self.i += 1
        n = len(self.weights)
        if self.bar is not None:
            self.bar.console.print(line, highlight=False)
            self.bar.update(self.task, completed=self.done_weight, cell=f"{min(self.i + 1, n)}/{n}",
                            description=next_cell.name if next_cell else "done", eta=_fmt_s(self.eta()))
        else:
            elapsed = time.monotonic() - self.t0
            print(f"[{self.i}/{n} {_fmt_s(elapsed)} ETA {_fmt_s(self.eta())}] {line}", file=self.stream, flush=True)

    def stop(self):
        if self.bar is not None:
            self.bar.stop()


# ----- main ------------------------------------------------------------------------------------

def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


CPU_PRESET = dict(device="cpu", backends=("chunked", "sdpa"), baselines=("sdpa_flash", "sdpa_math"),
                  head_dims=(16, 32), seqlens=(32, 64), dtypes=("fp32", "bf16"), tokens=128, hidden=64,
                  round_ms=2.0, rounds=2)
QUICK = dict(head_dims=(128,), seqlens=(1024, 4096), dtypes=("bf16",))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="portattn bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", type=_names, default=None, help="portattn backends to time (default triton,cupy)")
    ap.add_argument("--baselines", type=_names, default=None,
                    help=f"torch SDPA kernels to compare with, of {','.join(BASELINES)} (default sdpa_flash,sdpa_cudnn)")
    ap.add_argument("--head-dims", type=_ints, default=None, help="default 128,64,256")
    ap.add_argument("--seqlens", type=_ints, default=None, help="default 512,1024,2048,4096,8192,16384")
    ap.add_argument("--dtypes", type=_names, default=None, help="of bf16,fp16,fp32 (default bf16,fp16)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--directions", type=_names, default=("fwd", "bwd"), help="fwd,bwd (default both)")
    ap.add_argument("--tokens", type=int, default=None, help="B·S per cell (default 16384)")
    ap.add_argument("--hidden", type=int, default=None, help="H·D per cell (default 2048)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds per implementation (default 3)")
    ap.add_argument("--round-ms", type=float, default=None, help="length of one timing round in ms (default 25)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="no new cell starts after this many seconds, or when one like it (same D, S) would end "
                         "after them; what is done is written (default: none)")
    ap.add_argument("--l2-mib", type=float, default=None, help="L2 size for input rotation (default: the device's)")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --cpu)")
    ap.add_argument("--quick", action="store_true", help="D 128, S 1k and 4k, bf16, causal and not (4 cells)")
    ap.add_argument("--cpu", action="store_true",
                    help="a tiny grid on the CPU (chunked and sdpa against SDPA flash and math): checks the tool, not speed")
    ap.add_argument("--no-progress-bar", action="store_true", help="plain progress lines even on a terminal")
    ap.add_argument("--out", default=None, help="directory for the JSON, markdown and PNG results")
    ap.add_argument("--tag", default=None, help="file name tag (default: the GPU's short name, or cpu)")
    ap.add_argument("--decode", action="store_true",
                    help="run benchmarks/bench_decode.py instead, with the other options (see its --help)")
    return ap


def _settings(args) -> dict:
    base = dict(device="cuda", backends=("triton", "cupy"), baselines=("sdpa_flash", "sdpa_cudnn"), head_dims=HEAD_DIMS,
                seqlens=SEQLENS, dtypes=DTYPES, tokens=TOKENS, hidden=HIDDEN, round_ms=25.0, rounds=3)
    if args.quick:
        base.update(QUICK)
    if args.cpu:
        base.update(CPU_PRESET)
    for key in base:
        if getattr(args, key, None) is not None:
            base[key] = getattr(args, key)
    return base


def _run_decode(argv) -> int:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_decode.py")
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(argv) or 0)


def main(argv=None, stream=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--decode" in argv:
        return _run_decode([a for a in argv if a != "--decode"])
    args = parser().parse_args(argv)
    stream = stream or sys.stdout
    s = _settings(args)
    bad = [d for d in args.directions if d not in DIRECTIONS]
    if bad or not args.directions:
        raise SystemExit(f"--directions: {','.join(bad) or 'empty'} is not of fwd,bwd")
    unknown = [b for b in s["baselines"] if b not in BASELINES]
    if unknown:
        raise SystemExit(f"--baselines: {','.join(unknown)} not of {','.join(BASELINES)}")
    clash = set(s["backends"]) & set(s["baselines"])
    if clash:
        raise SystemExit(f"{','.join(clash)} is in --backends and --baselines; the baselines call torch SDPA directly")
    device = torch.device(s["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        print("portattn bench needs a CUDA/ROCm GPU and none is visible; --cpu runs a tiny grid on the CPU",
              file=sys.stderr)
        return 2
    ours = []
    for b in s["backends"]:
        backend = portattn.get_backend(b)
        if backend.available:
            ours.append(b)
        else:
            print(f"skipping {b}: {'; '.join(backend.availability())}", file=sys.stderr)
    impls = ours + list(s["baselines"])
    directions = [d for d in DIRECTIONS if d in args.directions]
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    try:
        cells = grid(s["head_dims"], s["seqlens"], s["dtypes"], causal, s["tokens"], s["hidden"])
    except ValueError as exc:
        print(f"portattn bench: error: {exc}", file=sys.stderr)
        return 2
    env = environment(device)
    l2 = int(args.l2_mib * 2**20) if args.l2_mib is not None else int(env.get("l2_bytes") or 0)
    timer = Timer(device, s["round_ms"])
    result = {"environment": env, "implementations": impls, "portattn_backends": ours,
              "baselines": list(s["baselines"]), "directions": directions, "flop_convention": FLOP_CONVENTION,
              "bwd_method": BWD_METHOD, "tokens": s["tokens"], "hidden": s["hidden"], "rounds": s["rounds"],
              "round_ms": s["round_ms"], "time_limit_s": args.time_limit, "l2_bytes_for_rotation": l2,
              "cells_total": len(cells), "cells_done": 0, "stopped": None, "rows": []}
    progress = Progress(cells, directions, stream, rich=False if args.no_progress_bar else None)
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _sigterm) if _main_thread() else None
    try:   # Ctrl-C, SIGTERM (timeout) and --time-limit keep what is done: it is summarised and written
        taken: dict = {}   # (D, S) -> seconds of the last such cell: the estimate for the next one
        for i, cell in enumerate(cells):
            stop = i and args.time_limit is not None and stop_reason(time.monotonic() - t0, args.time_limit,
                                                                     taken.get((cell.D, cell.S)))
            if stop:
                result["stopped"] = f"time limit {args.time_limit:g} s after {i} of {len(cells)} cells ({stop})"
                break
            started = time.monotonic()
            try:
                row = bench_cell(cell, impls, directions, device, timer, s["rounds"], l2)
            except Exception as exc:   # the inputs or the reference failed (out of memory?): the run goes on
                row = {**cell._asdict(), "error": _error(exc), "results": {}, "ratios": {}}
            row["seconds"] = taken[(cell.D, cell.S)] = round(time.monotonic() - started, 2)
            result["rows"].append(row)
            progress.cell_done(cell_line(cell, row, directions), cells[i + 1] if i + 1 < len(cells) else None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        result["stopped"] = f"interrupted after {len(result['rows'])} of {len(cells)} cells"
    finally:
        progress.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    result["cells_done"] = len(result["rows"])
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["targets"] = targets(result)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"bench-{args.tag or card_tag(env.get('gpu'))}-{env['date'][:10]}")
        with open(stem + ".json", "w") as fh:
            json.dump(result, fh, indent=1)
        with open(stem + ".md", "w") as fh:
            fh.write(format_markdown(result))
        try:
            drew, why = plot(result, stem + ".png"), "no matplotlib"
        except Exception as exc:   # the numbers matter more than the picture: report and go on
            drew, why = False, _error(exc)
        wrote = [stem + ".json", stem + ".md"] + ([stem + ".png"] if drew else [])
        print("wrote " + ", ".join(wrote) + ("" if drew else f" (no plot: {why})"), file=stream)
    if result["stopped"]:
        print(f"stopped: {result['stopped']}", file=stream)
    print(f"\n{result['cells_done']} of {len(cells)} cells in {result['seconds']} s; {first_calls(result)}", file=stream)
    for line in summary(result) + target_lines(result):
        print(line, file=stream)
    header, body = table(result)
    print(legend(result), file=stream)
    print(format_text(header, body), file=stream)
    failed = any(e.get("ok") is False for r in result["rows"] for e in r["results"].values())
    return 1 if failed else 0


def stop_reason(elapsed: float, limit: float, estimate: float | None) -> str | None:
    """Why no new cell starts: the limit is reached, or a cell like it (same D and S) took long
    enough that this one would end after it; None to go on (a cell with no estimate starts)."""
    if elapsed >= limit:
        return f"{elapsed:.0f} s elapsed"
    if estimate is not None and elapsed + estimate > limit:
        return f"{elapsed:.0f} s elapsed, the next cell would take ~{estimate:.0f} s"
    return None


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _sigterm(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
