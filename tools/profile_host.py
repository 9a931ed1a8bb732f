"""Where the host time of small attention calls goes: cProfile of N calls per path, on a GPU.

    python tools/profile_host.py [--calls 300] [--top 25] [--launch fast|normal] [--out DIR]

Paths: ``portattn.attention`` (triton, bf16 B1 S128 H8 D64), ``portattn.attention_with_kvcache``
(triton, bf16 B1 Sq1 Sk8k GQA 32:4 D128), and torch SDPA flash on the first shape for scale.
Prints per-call wall time (N calls, one synchronise) and the top functions by own time.
``--launch normal`` turns the fast Triton launch path (``backends/triton/launcher.py``) off, to
profile the launches through triton's ``JITFunction.run``; the default is the library's own path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import portattn


def _paths(device):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    q, k, v = rnd(1, 128, 8, 64), rnd(1, 128, 8, 64), rnd(1, 128, 8, 64)
    qd = rnd(1, 1, 32, 128)
    kc, vc = rnd(1, 8192, 4, 128), rnd(1, 8192, 4, 128)
    lens = torch.full((1,), 8191, dtype=torch.int32, device=device)
    kn, vn = rnd(1, 1, 4, 128), rnd(1, 1, 4, 128)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qh, kh, vh)

    return {
        "attention triton": lambda: portattn.attention(q, k, v, causal=True, backend="triton"),
        "attention auto": lambda: portattn.attention(q, k, v, causal=True),
        "kvcache triton (append 1)": lambda: portattn.attention_with_kvcache(
            qd, kc, vc, kn, vn, cache_seqlens=lens, causal=True, backend="triton"),
        "kvcache triton (no append)": lambda: portattn.attention_with_kvcache(
            qd, kc, vc, cache_seqlens=lens, causal=True, backend="triton"),
        "sdpa flash (ctx each call)": flash,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    ap.add_argument("--launch", choices=("fast", "normal"), default="fast")
    args = ap.parse_args(argv)
    from portattn.backends.triton import launcher
    launcher.set_enabled(args.launch == "fast")
    device = torch.device("cuda")
    report = io.StringIO()
    report.write(f"triton launches: {args.launch} ({launcher.unsupported_reason() or 'fast path supported'})\n")
    for name, fn in _paths(device).items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        per_call = (time.perf_counter() - t0) / args.calls * 1e6
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        stream = io.StringIO()
        pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(args.top)
        block = f"===== {name}: {per_call:.1f} us/call (no profiler)\n{stream.getvalue()}"
        print(f"{name}: {per_call:.1f} us/call", flush=True)
        report.write(block)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile_host{'' if args.launch == 'fast' else '-normal'}.txt").write_text(report.getvalue())
    else:
        print(report.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
