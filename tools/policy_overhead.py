"""Host cost of the ``fastest`` policy after a class's first call, against its winner pinned (CPU).

    PYTHONPATH=. python tools/policy_overhead.py [--calls 2000] [--repeats 15] [--backends chunked,sdpa]

On CPU tensors (fp32 B1 S8 H4 D16, issue #15's "CPU here via sdpa/chunked"), with the policy's
candidates restricted to ``--backends`` (``PORTATTN_PRIORITY_CPU``) and a fresh cache directory:
one ``backend="fastest"`` call tunes the class, then these are timed in interleaved repeats
(alternating order), each the least over the repeats of this thread's CPU time per call
(``time.thread_time``: time spent descheduled on a shared machine is not counted):

* ``tuning.lookup`` — the remembered-winner lookup alone;
* ``dispatch.select`` with ``"fastest"`` and with the winner pinned (the difference is the
  policy's cost in the dispatch core);
* ``portattn.attention`` with ``backend="fastest"`` and with the winner pinned.

Run it against another checkout to compare: ``PYTHONPATH=/work/main python tools/policy_overhead.py``
is "before".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _least(fns: dict, calls: int, repeats: int) -> dict:
    """Per-call µs of each callable: the least of ``repeats`` runs of ``calls`` calls, the
    callables interleaved (odd repeats in reverse order)."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(50):
            fn()
    runs = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            fn = fns[n]
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            runs[n].append((time.thread_time() - t0) / calls * 1e6)
    return {n: min(t) for n, t in runs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--backends", default="chunked,sdpa", help="the CPU candidates (PORTATTN_PRIORITY_CPU)")
    args = ap.parse_args(argv)
    os.environ["PORTATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="portattn-policy-overhead-")
    os.environ["PORTATTN_PRIORITY_CPU"] = args.backends
    for var in ("PORTATTN_BACKEND", "PORTATTN_POLICY"):
        os.environ.pop(var, None)
    import torch

    import portattn
    from portattn import dispatch, tuning
    from portattn.spec import build_spec
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4, 16, generator=g) for _ in range(3))
    portattn.attention(q, k, v, backend="fastest")           # tunes the class
    spec = build_spec(q, k, v)
    winner = tuning.lookup(spec)
    if winner is None:
        print("the policy remembered no winner for the problem", file=sys.stderr)
        return 1
    paths = {
        "tuning.lookup": lambda: tuning.lookup(spec),
        "select(fastest)": lambda: dispatch.select(spec, "fastest"),
        "select(pinned)": lambda: dispatch.select(spec, winner),
        "attention(fastest)": lambda: portattn.attention(q, k, v, backend="fastest"),
        "attention(pinned)": lambda: portattn.attention(q, k, v, backend=winner),
    }
    us = _least(paths, args.calls, args.repeats)
    print(f"portattn from {os.path.dirname(portattn.__file__)}; torch {torch.__version__}; winner {winner}; "
          f"{args.calls} calls x {args.repeats} interleaved repeats, least thread CPU time per call")
    for name, t in us.items():
        print(f"  {name:20} {t:8.2f} us")
    print(f"  policy in select:    {us['select(fastest)'] - us['select(pinned)']:+8.2f} us")
    print(f"  policy in attention: {us['attention(fastest)'] - us['attention(pinned)']:+8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
