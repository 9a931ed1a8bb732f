"""Timing several implementations of one call against each other, robustly.

Used by the ``fastest`` policy (:mod:`portattn.tuning`) to choose, and by
``benchmarks/bench_fastest.py`` to judge the choice — the same method on both sides, so the
policy is judged on the quantity it optimises.

Method (:func:`compare`):

1. **warm-up**: every callable runs ``warmup`` times (compilation, allocation, autotuning), then
   on, one call at a time with the device waited for, until ``warmup_ms`` of wall time have
   passed: a GPU left idle by compiles clocks up, and a library's lazily built plans settle
   (on the H200, torch SDPA's cuDNN path ran at twice its time in the first milliseconds after a
   new shape, which pruned it from the policy's timing at D128 S1k causal);
2. **estimate**: one *sample* of ~1 ms per callable gives its time per call;
3. optional **pruning**: the estimates are taken a second time in reverse order and the least
   kept (a GPU whose clock still ramps up must not prune the first callable); one whose estimate
   is over ``prune`` × the best cannot win and keeps its estimate (``pruned``), timed no further;
4. **interleaved rounds**: round ``r`` visits the callables in an order rotated by ``r // 2`` (and
   reversed on odd rounds, :func:`round_order`), so none is always first or last and drifts of the machine (clocks,
   other processes) hit every callable alike; in each round every callable takes
   ``samples_per_round`` samples of ``reps`` back-to-back calls, ``reps`` chosen from the estimate
   so that a round gives each callable about ``round_ms`` of calls (at least one call per
   sample);
5. **settling** (``max_rounds`` > ``rounds``): while a callable is *unsettled* against the
   fastest so far — its median within the larger of the two spreads of the fastest's and their
   per-round ranges overlapping (:func:`unsettled`) — further rounds run, up to ``max_rounds`` and
   the deadline, so that a kernel whose time jumps between two levels (seen on the H200 with
   cuDNN: rounds at 0.21 and 0.38 ms in one run) is judged over a longer stretch of time;
6. the result per callable is the **median over rounds of the per-round medians** of the
   per-call time, with the rounds' relative **spread** ``(max - min) / median``.

A *sample* is measured by a clock: :class:`CudaClock` flushes the L2 cache, waits for the device
(so that the host and the GPU start together), records a CUDA event, makes ``reps`` back-to-back
calls, records a second event and waits: the per-call time is the events' interval over ``reps``
— the wall time an eager loop of calls sees, host cost (Python, launches) included whenever the
host is slower than the kernels. :class:`CpuClock` does the same with ``time.perf_counter``.
Tests pass a fake clock (any object with ``sync()``, ``now()`` and ``sample(name, fn, reps)``).

:func:`pick` chooses among timed results with a deterministic **tie rule**: every candidate
within the measured noise of the fastest (half the larger of the two spreads, at least
``TIE_MIN`` and at most ``TIE_MAX``) counts as tied with it, and the first tied one in priority
order wins. So two kernels that are equally fast (``sdpa`` and ``sdpa_cudnn`` running the same
cuDNN kernel) give the same choice on every run, and the choice costs at most ``TIE_MAX``.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

#: a tie is declared within the measured noise, clamped to [TIE_MIN, TIE_MAX] (relative)
TIE_MIN, TIE_MAX = 0.003, 0.01
#: the estimate's sample length (ms of back-to-back calls)
ESTIMATE_MS = 1.0


@dataclass
class Timing:
    """One callable's result: ``ms`` per call (median of the per-round medians), the per-round
    medians, calls per sample, total calls, the rounds' relative spread, and whether it was
    pruned (``ms`` is then the estimate) or raised (``error``)."""

    ms: float | None
    rounds: list[float] = field(default_factory=list)
    reps: int = 0
    calls: int = 0
    spread: float = 0.0
    pruned: bool = False
    error: str | None = None

    def as_dict(self) -> dict:
        if self.error is not None:
            return {"error": self.error}
        d = {"ms": self.ms, "runs": self.calls, "reps": self.reps, "spread": round(self.spread, 5),
             "ms_rounds": [round(x, 6) for x in self.rounds]}
        if self.pruned:
            d["pruned"] = True
        return d


class CpuClock:
    """Samples with ``time.perf_counter`` (milliseconds per call)."""

    def sync(self) -> None:
        pass

    def now(self) -> float:
        return time.perf_counter()

    def sample(self, name: str, fn: Callable, reps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps


_flush_buffers: dict[int, torch.Tensor] = {}


class CudaClock:
    """Samples between two CUDA events on the current stream of ``device``, the L2 cache flushed
    (``flush=True``) and the device idle before each sample (milliseconds per call)."""

    def __init__(self, device: torch.device | None = None, flush: bool = True):
        self.device = torch.device("cuda") if device is None else torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.index = index
        self.flush = None
        if flush:
            buf = _flush_buffers.get(index)
            if buf is None:   # 256 MB, over any current GPU's L2 (H200: 50 MB)
                buf = _flush_buffers[index] = torch.empty(64 << 20, dtype=torch.int32, device=f"cuda:{index}")
            self.flush = buf
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        torch.cuda.synchronize(self.index)

    def now(self) -> float:
        return time.perf_counter()

    def sample(self, name: str, fn: Callable, reps: int) -> float:
        with torch.cuda.device(self.index):
            if self.flush is not None:
                self.flush.zero_()
            torch.cuda.synchronize(self.index)
            self.start.record()
            for _ in range(reps):
                fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / reps


def clock_for(device: torch.device, flush: bool = True):
    """:class:`CudaClock` for a CUDA (or ROCm) device, else :class:`CpuClock`."""
    return CudaClock(device, flush) if device.type == "cuda" else CpuClock()


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s visiting order: rotated by ``r // 2``, reversed on odd rounds (A B C, C B A,
    B C A, A C B, C A B, B A C for three), so that every callable is first, and last, equally often."""
    if not names:
        return []
    k = (r // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if r % 2 else order


def unsettled(per_round: dict[str, list[float]]) -> list[str]:
    """The callables whose order against the fastest (lowest median of ``per_round``) is not
    settled yet: median within the larger of the two relative spreads of the fastest's, and the
    per-round ranges overlapping. Empty when there is nothing to decide."""
    timed = {n: r for n, r in per_round.items() if r}
    if len(timed) < 2:
        return []
    med = {n: statistics.median(r) for n, r in timed.items()}
    best = min(med, key=med.get)
    b = timed[best]
    spread_b = (max(b) - min(b)) / med[best] if med[best] else 0.0
    out = []
    for n, r in timed.items():
        if n == best or not med[n]:
            continue
        spread = max(spread_b, (max(r) - min(r)) / med[n])
        if med[n] <= med[best] * (1 + spread) and min(r) <= max(b):
            out.append(n)
    return out


def compare(fns: dict[str, Callable], clock, *, warmup: int = 2, warmup_ms: float = 0.0, rounds: int = 5,
            min_rounds: int = 3, max_rounds: int | None = None, round_ms: float = 10.0, samples_per_round: int = 3,
            max_reps: int = 10_000, prune: float | None = None, deadline: float | None = None,
            on_error=None) -> dict[str, Timing]:
    """Time the callables of ``fns`` against each other (module docstring). ``deadline``
    (``clock.now()`` units) stops starting rounds after ``min_rounds``; ``warmup_ms`` extends the
    warm-up by wall time (step 1); ``max_rounds`` (default ``rounds``: no settling) bounds the
    rounds run while :func:`unsettled` names a callable; ``on_error(name, exc)`` runs when a
    callable raises (it is then left out, with its ``error``). Python's cyclic
    garbage collector is paused meanwhile (as ``timeit`` does: a collection inside one sample
    would be charged to whichever callable it hit). Returns a :class:`Timing` per name, in the
    order of ``fns``."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return _compare(fns, clock, warmup=warmup, warmup_ms=warmup_ms, rounds=rounds, min_rounds=min_rounds,
                        max_rounds=rounds if max_rounds is None else max(rounds, max_rounds), round_ms=round_ms,
                        samples_per_round=samples_per_round, max_reps=max_reps, prune=prune, deadline=deadline,
                        on_error=on_error)
    finally:
        if enabled:
            gc.enable()


def _warm(fn, clock, warmup: int, warmup_ms: float, max_calls: int) -> int:
    """``warmup`` calls, then more, each waited for, until ``warmup_ms`` of wall time have passed
    (at most ``max_calls`` in all). Returns the number of calls."""
    for _ in range(warmup):
        fn()
    clock.sync()
    n = warmup
    end = time.perf_counter() + warmup_ms / 1e3
    while warmup_ms > 0 and n < max_calls and time.perf_counter() < end:
        fn()
        clock.sync()
        n += 1
    return n


def _compare(fns, clock, *, warmup, warmup_ms, rounds, min_rounds, max_rounds, round_ms, samples_per_round,
             max_reps, prune, deadline, on_error) -> dict[str, Timing]:
    out: dict[str, Timing] = {}
    live: list[str] = []

    def fail(name, exc):
        out[name] = Timing(None, error=_error(exc))
        if on_error is not None:
            on_error(name, exc)

    calls: dict[str, int] = {}
    for name, fn in fns.items():                 # 1. warm-up
        try:
            calls[name] = _warm(fn, clock, warmup, warmup_ms, max_reps) + 1
        except Exception as exc:
            fail(name, exc)
            continue
        live.append(name)
    estimate: dict[str, float] = {}
    for name in list(live):                      # 2. estimate: one call, then a ~1 ms sample
        try:
            one = clock.sample(name, fns[name], 1)
            reps = max(1, min(max_reps, int(ESTIMATE_MS / max(one, 1e-6))))
            estimate[name] = clock.sample(name, fns[name], reps) if reps > 1 else one
            calls[name] += reps if reps > 1 else 0
        except Exception as exc:
            fail(name, exc)
            live.remove(name)
    if prune is not None and len(live) > 1:      # a second estimate in reverse order, the least kept:
        for name in live[::-1]:                  # a clock still ramping up must not prune the first
            try:
                one = estimate[name]
                reps = max(1, min(max_reps, int(ESTIMATE_MS / max(one, 1e-6))))
                estimate[name] = min(one, clock.sample(name, fns[name], reps))
                calls[name] += reps
            except Exception as exc:
                fail(name, exc)
                live.remove(name)
    if not live:
        return {n: out[n] for n in fns}
    best = min(estimate[n] for n in live)
    if prune is not None:                        # 3. pruning
        for name in list(live):
            if estimate[name] > prune * best:
                out[name] = Timing(estimate[name], [estimate[name]], reps=1, calls=calls[name], pruned=True)
                live.remove(name)
    samples_per_round = max(1, samples_per_round)
    reps = {n: max(1, min(max_reps, math.ceil(round_ms / samples_per_round / max(estimate[n], 1e-6))))
            for n in live}
    per_round: dict[str, list[float]] = {n: [] for n in live}
    for r in range(max_rounds):                  # 4. interleaved rounds, 5. settling
        if r >= min_rounds and deadline is not None and clock.now() > deadline:
            break
        if r >= rounds and not unsettled(per_round):
            break
        for name in round_order(list(live), r):
            try:
                samples = [clock.sample(name, fns[name], reps[name]) for _ in range(samples_per_round)]
            except Exception as exc:
                fail(name, exc)
                live.remove(name)
                per_round.pop(name, None)
                continue
            per_round[name].append(statistics.median(samples))
    for name in live:                            # 6. median of the per-round medians
        meds = per_round[name]
        ms = statistics.median(meds)
        total = calls[name] + len(meds) * samples_per_round * reps[name]
        out[name] = Timing(ms, meds, reps=reps[name], calls=total, spread=(max(meds) - min(meds)) / ms if ms else 0.0)
    return {n: out[n] for n in fns}


def paired_ratios(fa: Callable, fb: Callable, clock, *, ms_a: float, ms_b: float, pairs: int = 24,
                  sample_ms: float = 10.0, max_reps: int = 10_000, deadline: float | None = None,
                  names: tuple[str, str] = ("a", "b")) -> list[float]:
    """``a``'s time per call over ``b``'s, one ratio per *pair* of samples taken back to back:
    pair ``i`` samples ``a`` then ``b`` (``b`` then ``a`` on odd ``i``, so neither always goes
    first), each sample ``~sample_ms`` of back-to-back calls sized from the per-call estimates
    ``ms_a`` / ``ms_b`` (at least one call). Two samples ~``sample_ms`` apart see the same state of
    the machine, where two rounds of :func:`compare` (each callable's samples one after another,
    every callable in turn) can be a second apart: on the H200 (2026-12-02) host-bound decode
    calls moved by up to 50 % between rounds for every backend alike, which paired rounds cancel
    only partly. The median of the returned ratios is the judged ratio. Stops after two pairs
    once ``deadline`` (``clock.now()`` units) has passed; ``names`` label the two callables'
    samples for the clock; the garbage collector is paused."""
    if not (ms_a > 0 and ms_b > 0):
        raise ValueError(f"paired_ratios needs positive per-call estimates, got ms_a={ms_a!r}, ms_b={ms_b!r}")
    reps_a = max(1, min(max_reps, math.ceil(sample_ms / ms_a)))
    reps_b = max(1, min(max_reps, math.ceil(sample_ms / ms_b)))
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    out: list[float] = []
    try:
        for i in range(max(1, pairs)):
            if i >= 2 and deadline is not None and clock.now() > deadline:
                break
            if i % 2 == 0:
                a = clock.sample(names[0], fa, reps_a)
                b = clock.sample(names[1], fb, reps_b)
            else:
                b = clock.sample(names[1], fb, reps_b)
                a = clock.sample(names[0], fa, reps_a)
            if b > 0:
                out.append(a / b)
    finally:
        if enabled:
            gc.enable()
    return out


def tie_tolerance(a: Timing, b: Timing) -> float:
    """The relative difference below which ``a`` and ``b`` count as equally fast: half the larger
    spread of their rounds, clamped to [TIE_MIN, TIE_MAX]."""
    return min(TIE_MAX, max(TIE_MIN, max(a.spread, b.spread) / 2))


def pick(results: dict[str, Timing], priority: list[str]) -> tuple[str | None, list[str]]:
    """``(winner, tied)``: the fastest timed result, or — when several are within the tie
    tolerance of the fastest (:func:`tie_tolerance`) — the first of those in ``priority`` order
    (names not in ``priority`` come after, by name). ``tied`` lists them in that order."""
    timed = {n: t for n, t in results.items() if t.error is None and t.ms is not None}
    if not timed:
        return None, []
    rank = {n: i for i, n in enumerate(priority)}
    fastest = min(timed, key=lambda n: (timed[n].ms, rank.get(n, len(rank)), n))
    best = timed[fastest]
    tied = [n for n, t in timed.items() if not t.pruned and t.ms <= best.ms * (1 + tie_tolerance(best, t))]
    if fastest not in tied:
        tied.append(fastest)
    tied.sort(key=lambda n: (rank.get(n, len(rank)), n))
    return tied[0], tied
