"""benchmarks/bench_attention.py's GPU-free parts: interleaved timing rounds and the table."""

from __future__ import annotations

from _scripts import load_script

bench = load_script("bench_attention")


def test_rounds_are_interleaved_and_summarised():
    calls = []
    fake_ms = {"a": iter([1.0, 1.2]), "b": iter([2.0, 2.0]), "c": iter([4.0, 3.0])}

    def timer(fn):
        calls.append(fn())
        return next(fake_ms[calls[-1]])

    fns = {name: (lambda n=name: n) for name in ("a", "b", "c")}
    out = bench.time_rounds(fns, 2, timer)
    assert calls == ["a", "b", "c", "c", "b", "a"]          # odd rounds in reverse
    assert out["a"] == {"ms": 1.1, "ms_rounds": [1.0, 1.2], "spread": (1.2 - 1.0) / 1.1}
    assert out["b"]["spread"] == 0.0 and out["c"]["ms"] == 3.5


def test_a_failing_timing_is_an_error_entry_and_not_retried():
    seen = []

    def timer(fn):
        seen.append(fn)
        if fn == "bad":
            raise RuntimeError("out of resources\nmore")
        return 1.0

    out = bench.time_rounds({"ok": "ok", "bad": "bad"}, 3, timer)
    assert out["bad"] == {"error": "RuntimeError: out of resources"} and seen.count("bad") == 1
    assert out["ok"]["ms_rounds"] == [1.0, 1.0, 1.0]


def test_table_marks_noisy_cells_and_prints_ratios():
    rows = [{"case": "D128 S1024", "mode": "fwd", "results": {
        "triton": {"tflops": 300.0, "spread": 0.2}, "sdpa-flash": {"tflops": 200.0, "spread": 0.01},
        "sdpa-cudnn": {"error": "x"}}}]
    text = bench.table(rows, ["triton", "sdpa-flash", "sdpa-cudnn"])
    line = text.splitlines()[1]
    assert "300.0~" in line and "200.0 " in line and "triton 1.50/nan" in line
    assert "interleaved timings" in text.splitlines()[-1]
