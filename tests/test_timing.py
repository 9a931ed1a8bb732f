"""portattn.timing: the interleaved-rounds method the fastest policy and benchmarks/bench_fastest.py
share, with a fake clock (the order of samples, reps from the estimate, pruning, the deadline,
errors, the median of per-round medians, the tie rule)."""

import pytest
import torch

from portattn import timing


class Clock:
    """Reports ``cost[name]`` ms per call, times ``factors[name][k]`` for its k-th sample; logs samples."""

    def __init__(self, cost, factors=None):
        self.cost, self.factors, self.log, self.t, self.k = cost, factors or {}, [], 0.0, {}

    def sync(self):
        pass

    def now(self):
        return self.t

    def sample(self, name, fn, reps):
        fn()
        k = self.k[name] = self.k.get(name, -1) + 1
        f = self.factors.get(name)
        ms = self.cost[name] * (f[k] if f and k < len(f) else 1.0)
        self.log.append((name, reps))
        self.t += 1.0
        return ms


def _fns(names):
    calls = {n: 0 for n in names}

    def make(n):
        def f():
            calls[n] += 1
        return f
    return {n: make(n) for n in names}, calls


def test_round_order_puts_every_name_first_and_last_equally_often():
    names = ["a", "b", "c"]
    orders = [timing.round_order(names, r) for r in range(6)]
    assert all(sorted(o) == names for o in orders)
    assert sorted(o[0] for o in orders) == ["a", "a", "b", "b", "c", "c"]
    assert sorted(o[-1] for o in orders) == ["a", "a", "b", "b", "c", "c"]
    assert timing.round_order([], 3) == []


def test_compare_interleaves_rounds_and_sizes_samples_from_the_estimate():
    fns, calls = _fns(["a", "b", "c"])
    clock = Clock({"a": 0.1, "b": 0.12, "c": 2.0})
    res = timing.compare(fns, clock, warmup=2, rounds=4, round_ms=6.0, samples_per_round=3)
    est = [n for n, _ in clock.log[:5]]          # a, b: 1 call then a ~1 ms sample; c: one call
    assert est == ["a", "a", "b", "b", "c"] and clock.log[1][1] == 10
    rounds = clock.log[5:]
    assert len(rounds) == 4 * 3 * 3
    for r in range(4):
        block = [n for n, _ in rounds[r * 9:(r + 1) * 9]]
        assert block == [n for n in timing.round_order(["a", "b", "c"], r) for _ in range(3)]
    assert dict(rounds[:9:3])["a"] == 20 and dict(rounds[:9:3])["c"] == 1   # ~6 ms per round, >= 1 call
    assert res["a"].ms == pytest.approx(0.1) and res["a"].rounds == [pytest.approx(0.1)] * 4
    assert res["a"].calls == 2 + 1 + 10 + 4 * 3 * 20 and calls["a"] == 2 + 2 + 4 * 3   # (the fake runs fn once per sample)


def test_median_of_round_medians_ignores_an_outlier_sample_and_round():
    fns, _ = _fns(["a"])
    # sample 0 is the estimate; round 0 has one wild sample, round 2 is slow as a whole
    factors = {"a": [1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.5, 1.5, 1.5, 1.0, 1.0, 1.0]}
    res = timing.compare(fns, Clock({"a": 2.0}, factors), rounds=4, samples_per_round=3)
    assert res["a"].ms == pytest.approx(2.0) and res["a"].rounds == pytest.approx([2.0, 2.0, 3.0, 2.0])
    assert res["a"].spread == pytest.approx(0.5)


def test_pruning_deadline_and_errors():
    fns, _ = _fns(["a", "b", "slow"])

    def broken():
        raise RuntimeError("out of memory\nmore")
    fns["bad"] = broken
    seen = []
    clock = Clock({"a": 1.0, "b": 1.0, "slow": 3.0})
    res = timing.compare(fns, clock, rounds=50, min_rounds=3, prune=1.5, deadline=20.0,
                         on_error=lambda n, e: seen.append(n))
    assert list(res) == ["a", "b", "slow", "bad"]
    assert res["bad"].error == "RuntimeError: out of memory" and seen == ["bad"] and res["bad"].as_dict() == {
        "error": "RuntimeError: out of memory"}
    assert res["slow"].pruned and res["slow"].ms == 3.0 and ("slow", 1) in clock.log
    assert 3 <= len(res["a"].rounds) < 50                       # stopped by the deadline after min_rounds
    assert [n for n, _ in clock.log].count("slow") == 2                     # its two estimates
    order = [n for n, _ in clock.log][:6]
    assert order == ["a", "b", "slow", "slow", "b", "a"]                    # the second in reverse


def test_a_ramping_clock_does_not_prune_the_first():
    """The first callable's first estimate is slow (a GPU clock ramping up): the second estimate,
    taken last, keeps it in the rounds."""
    fns, _ = _fns(["first", "second"])
    res = timing.compare(fns, Clock({"first": 1.0, "second": 1.1}, {"first": [2.5]}), rounds=3, prune=1.5)
    assert not res["first"].pruned and res["first"].ms == 1.0 and timing.pick(res, ["second", "first"])[0] == "first"


def test_pick_tie_rule():
    T = timing.Timing
    res = {"x": T(1.000, spread=0.0), "y": T(1.002, spread=0.0), "z": T(1.5)}
    assert timing.pick(res, ["y", "x", "z"]) == ("y", ["y", "x"])     # within TIE_MIN: priority
    assert timing.pick(res, ["x", "y", "z"]) == ("x", ["x", "y"])
    res = {"x": T(1.0, spread=0.012), "y": T(1.008, spread=0.0)}
    assert timing.pick(res, ["y", "x"]) == ("x", ["x"])              # 0.8 % > half the 1.2 % spread
    res = {"x": T(1.0, spread=0.5), "y": T(1.011, spread=0.5)}
    assert timing.pick(res, ["y", "x"])[0] == "x"                     # capped at TIE_MAX
    res = {"x": T(1.0), "y": T(1.001, pruned=True), "e": T(None, error="boom")}
    assert timing.pick(res, ["y", "x", "e"]) == ("x", ["x"])          # a pruned (estimate-only) result never ties
    assert timing.pick({"e": T(None, error="boom")}, ["e"]) == (None, [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_clock_measures_device_time_between_events():
    """Two device-side sleeps of 1 and 2 units, timed against each other: the ratio is 2 and the
    rounds agree (the clock flushes L2 and syncs before each sample, so samples do not overlap)."""
    clock = timing.CudaClock(torch.device("cuda"))
    fns = {"one": lambda: torch.cuda._sleep(100_000), "two": lambda: torch.cuda._sleep(200_000)}
    res = timing.compare(fns, clock, rounds=5, round_ms=5.0)
    assert 1.85 < res["two"].ms / res["one"].ms < 2.15
    assert res["one"].spread < 0.05 and res["two"].spread < 0.05 and res["one"].reps > 1
    assert timing.pick(res, ["two", "one"])[0] == "one"


def test_garbage_collector_paused_while_timing_and_restored():
    import gc
    states = []

    class GcClock(Clock):
        def sample(self, name, fn, reps):
            states.append(gc.isenabled())
            return super().sample(name, fn, reps)
    fns, _ = _fns(["a"])
    assert gc.isenabled()
    timing.compare(fns, GcClock({"a": 1.0}), rounds=2)
    assert states and not any(states) and gc.isenabled()
    gc.disable()
    try:
        timing.compare(fns, GcClock({"a": 1.0}), rounds=2)
        assert not gc.isenabled()                      # a caller's own setting is kept
    finally:
        gc.enable()


def test_unsettled_names_a_close_candidate_whose_rounds_overlap_the_fastest():
    assert timing.unsettled({"a": [1.0, 1.0, 1.0], "b": [0.9, 1.2, 1.3]}) == ["b"]   # within b's spread
    assert timing.unsettled({"a": [1.0, 1.01, 1.0], "b": [1.5, 1.6, 1.55]}) == []    # clearly slower
    assert timing.unsettled({"a": [1.0, 1.0], "b": [1.003, 1.003]}) == []            # no overlap, no noise
    assert timing.unsettled({"a": [1.0]}) == [] and timing.unsettled({"a": [1.0], "b": []}) == []


def test_settling_rounds_judge_a_two_level_kernel_over_a_longer_stretch():
    """b runs at 0.8 ms but its first three rounds hit a slow level (x1.3, as cuDNN did on the
    H200): five rounds pick a; settling rounds run on while a and b are too close to call, and b
    wins; a clearly slower c does not keep the rounds going."""
    slow = [1.0, 1.0] + [1.3] * 9   # two estimate samples, then three rounds of three samples
    for max_rounds, winner, n_rounds in ((None, "a", 5), (15, "b", 15)):
        fns, _ = _fns(["a", "b"])
        res = timing.compare(fns, Clock({"a": 1.0, "b": 0.8}, {"b": slow}), rounds=5, max_rounds=max_rounds)
        assert timing.pick(res, ["a", "b"])[0] == winner and len(res["b"].rounds) == n_rounds
    fns, _ = _fns(["a", "c"])
    res = timing.compare(fns, Clock({"a": 1.0, "c": 2.0}), rounds=5, max_rounds=15)
    assert len(res["a"].rounds) == 5                             # settled: no extra rounds
    fns, _ = _fns(["a", "b"])
    res = timing.compare(fns, Clock({"a": 1.0, "b": 0.8}, {"b": slow}), rounds=5, max_rounds=15, deadline=6.0 * 6)
    assert 5 <= len(res["b"].rounds) < 15                        # the deadline still stops settling


def test_warmup_by_wall_time_keeps_a_slow_starter_from_being_pruned():
    """'b' costs twice its time for its first 200 calls (as torch SDPA's cuDNN path did on the
    H200 after a new shape): with a count-only warm-up its estimate prunes it; with ``warmup_ms``
    the warm-up calls it on until the time passes, and it wins."""
    calls = {"a": 0, "b": 0}

    def make(n):
        def f():
            calls[n] += 1
        return f

    class WarmClock(Clock):
        def sample(self, name, fn, reps):
            fn()
            self.t += 1.0
            return (2.0 if name == "b" and calls["b"] < 200 else 1.0) * self.cost[name]

    for warmup_ms, pruned in ((0.0, True), (20.0, False)):
        calls.update(a=0, b=0)
        fns = {n: make(n) for n in calls}
        res = timing.compare(fns, WarmClock({"a": 1.0, "b": 0.8}), warmup=2, warmup_ms=warmup_ms, rounds=3, prune=1.5)
        assert res["b"].pruned is pruned
        assert timing.pick(res, ["a", "b"])[0] == ("a" if pruned else "b")
    assert calls["a"] > 200 and res["a"].calls >= calls["a"] - 3 * 3   # the warm-up calls are counted


def test_paired_ratios_alternate_the_order_and_size_samples_from_the_estimates():
    clock = Clock(cost={"a": 0.2, "b": 0.1})
    fns, calls = _fns(["a", "b"])
    ratios = timing.paired_ratios(fns["a"], fns["b"], clock, ms_a=0.2, ms_b=0.1, pairs=4, sample_ms=2.0)
    assert ratios == [pytest.approx(2.0)] * 4
    assert clock.log == [("a", 10), ("b", 20), ("b", 20), ("a", 10), ("a", 10), ("b", 20), ("b", 20), ("a", 10)]


def test_paired_ratios_cancel_a_drift_that_rounds_do_not():
    """The machine flips between two speeds every few samples for both callables alike: each pair
    sees one speed, so every ratio is the true 1.01, whatever the speed."""
    speed = [1.0, 1.0, 1.6, 1.6, 1.6, 1.6, 1.0, 1.0, 1.6, 1.6, 1.0, 1.0]

    class Drift:
        def __init__(self):
            self.n = 0

        def sync(self):
            pass

        def now(self):
            return 0.0

        def sample(self, name, fn, reps):
            f = speed[self.n % len(speed)]
            self.n += 1
            return (1.01 if name == "a" else 1.0) * f

    fns, _ = _fns(["a", "b"])
    ratios = timing.paired_ratios(fns["a"], fns["b"], Drift(), ms_a=1.0, ms_b=1.0, pairs=6)
    assert ratios == [pytest.approx(1.01)] * 6


def test_paired_ratios_stop_at_the_deadline_and_refuse_bad_estimates():
    clock = Clock(cost={"a": 1.0, "b": 1.0})
    fns, _ = _fns(["a", "b"])
    assert len(timing.paired_ratios(fns["a"], fns["b"], clock, ms_a=1.0, ms_b=1.0, pairs=10, deadline=-1.0)) == 2
    with pytest.raises(ValueError, match="ms_b"):
        timing.paired_ratios(fns["a"], fns["b"], clock, ms_a=1.0, ms_b=0.0)
