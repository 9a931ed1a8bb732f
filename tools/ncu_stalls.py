"""Summarise Nsight Compute's per-instruction stall sampling (the ``ncu`` step's ``NCU_SOURCE=1``
export, ``ncu -i REPORT --page source --csv --print-source sass``): for each CSV, the kernel's
SASS size, the warp-stall samples by reason, and the instructions that collect the most samples.

    python tools/ncu_stalls.py ncu_triton_d128_causal_sass.csv ncu_cudnn_d128_causal_sass.csv [--top 15]

Reading it: ``stall_no_inst`` is the instruction fetch (the code a warp runs next is not in the
instruction cache), ``stall_long_sb`` a wait on a long-scoreboard result (an mbarrier try-wait, a
global or shared load), ``stall_barrier`` a named barrier or a wgmma wait (``WARPGROUP.DEPBAR``),
also where idle warps that pad a warp-specialised partition to a warpgroup park (a ``NOP`` after
their barrier), ``stall_wait`` a fixed-latency dependency.
"""

from __future__ import annotations

import argparse
import collections
import csv


def summarise(path: str, top: int = 15) -> str:
    rows = list(csv.reader(open(path, newline="")))
    kernel = next((r[1] for r in rows if r and r[0] == "Kernel Name"), "?")
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[head]
    col = {k: i for i, k in enumerate(names)}
    data = [r for r in rows[head + 1:] if len(r) == len(names)]
    reasons = [k for k in names if k.startswith("stall_") and "Not Issued" not in k]
    samples = "Warp Stall Sampling (All Samples)"

    def num(r, k):
        try:
            return float(r[col[k]] or 0)
        except ValueError:
            return 0.0

    total = collections.Counter()
    for r in data:
        for k in reasons:
            total[k] += num(r, k)
    all_samples = sum(total.values()) or 1.0
    lines = [f"{kernel}: {len(data)} SASS instructions ({len(data) * 16 // 1024} KiB of code), "
             f"{sum(num(r, samples) for r in data):.0f} stall samples",
             "  by reason: " + ", ".join(f"{k[6:]} {100 * v / all_samples:.1f} %" for k, v in total.most_common(8))]
    lines.append(f"  the {top} instructions with the most samples (samples, the two main reasons):")
    for r in sorted(data, key=lambda r: -num(r, samples))[:top]:
        main = sorted(((num(r, k), k[6:]) for k in reasons), reverse=True)[:2]
        lines.append(f"    {num(r, samples):7.0f}  {r[col['Source']].strip()[:64]:64s} "
                     + ", ".join(f"{k} {v:.0f}" for v, k in main if v))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    print("\n\n".join(summarise(p, a.top) for p in a.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
