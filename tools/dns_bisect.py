"""Which ``do_not_specialize`` argument group breaks the triton kernels on a GPU (docs/triton.md).

    python tools/dns_bisect.py --out DIR [--runs 3]

docs/triton.md records that marking the kernels' integer arguments ``do_not_specialize`` on triton
3.6 (H200) made D = Dv = 128 gradients differ between runs and ``large/alibi/causal`` dK 136x the
naive error, not understood. Without specialisation triton passes an int as a plain ``i32``: no
``== 1`` folding into a constant and no "divisible by 16" attribute (``tt.divisibility``), so the
compiler takes other code paths (vector widths, pipelined loads), while the host launch cost is the
same (``native_specialize_impl`` runs for every argument either way). This script turns
``do_not_specialize`` on at run time, one argument group at a time (strides / sizes / window
sides / all), for the three attention kernels, recompiles, and runs the ``large/alibi/causal``
problem (bf16 B2 S1024 H8 D128, ALiBi, causal) forward and backward ``--runs`` times. Per group
it writes whether every run is bitwise identical and the largest difference from the fully
specialised kernels (the validated ones) to ``DIR/dns_bisect.json``. GPU only; nothing here is
used by portattn.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from portattn.backends.triton import kernels

import portattn

KERNELS = ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv")


def _groups(fn) -> dict[str, list[str]]:
    ints = [p.name for p in fn.params if not p.is_constexpr and p.name[:1].islower()]
    strides = [n for n in ints if n.startswith("stride_")]
    window = [n for n in ints if n.startswith("window_")]
    scalars = {"sm_scale", "qk_scale2", "softcap_scale", "softcap2"}
    sizes = [n for n in ints if n not in strides and n not in window and n not in scalars]
    return {"none": [], "strides": strides, "sizes": sizes, "window": window,
            "all": strides + sizes + window}


def _set_dns(names_per_kernel: dict[str, list[str]]) -> None:
    for kname in KERNELS:
        fn = getattr(kernels, kname)
        names = set(names_per_kernel.get(kname, ()))
        for p in fn.params:
            if not p.is_constexpr:
                p.do_not_specialize = p.name in names
        fn.device_caches.clear()   # new binder (it reads the flags when generated) and kernels


def _problem():
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 8, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    slopes = torch.rand(8, generator=g).to("cuda")
    return q, k, v, slopes


def _run(q, k, v, slopes):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = portattn.attention(*leaves, causal=True, alibi_slopes=slopes, backend="triton")
    out.float().square().sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import triton
    problem = _problem()
    per_kernel = {kname: _groups(getattr(kernels, kname)) for kname in KERNELS}
    report = {"triton": triton.__version__, "torch": torch.__version__, "groups": {}}
    baseline = None
    for group in ("none", "strides", "sizes", "window", "all"):
        _set_dns({kname: per_kernel[kname][group] for kname in KERNELS})
        runs = [_run(*problem) for _ in range(args.runs)]
        torch.cuda.synchronize()
        if baseline is None:
            baseline = runs[0]
        names = ("out", "dq", "dk", "dv")
        report["groups"][group] = {
            "args": {kname: per_kernel[kname][group] for kname in KERNELS},
            "bitwise_deterministic": all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r)),
            "max_abs_diff_vs_specialised": {n: (a.float() - b.float()).abs().max().item()
                                            for n, a, b in zip(names, runs[0], baseline)},
            "max_abs_baseline": {n: b.float().abs().max().item() for n, b in zip(names, baseline)},
        }
        print(group, json.dumps(report["groups"][group]["bitwise_deterministic"]),
              report["groups"][group]["max_abs_diff_vs_specialised"], flush=True)
    _set_dns({})
    with open(os.path.join(args.out, "dns_bisect.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
