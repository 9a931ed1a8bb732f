"""Fill triton's and cupy's on-disk kernel caches for one head dim and dtype before a benchmark
(the compiles are CPU-bound: one process per (D, dtype) side by side, then the timed run hits
the caches). Runs what ``portattn bench`` runs — the forward without grad, the training forward
and the backward, causal and not — at every sequence length of its grid (one sequence of the
benchmark's hidden size: the same dispatch rows, and so the same kernels, as its cells, since the
rows that pick a kernel key on the head dim, causality, training and the query rows, not the batch).

    for d in 64 128 256; do for t in bf16 fp16; do python tools/warm_caches.py --d $d --dtype $t & done; done; wait
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import HIDDEN, SEQLENS  # noqa: E402

import portattn  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--d", type=int, required=True)
ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
ap.add_argument("--backends", default="triton,cupy")
ap.add_argument("--hidden", type=int, default=HIDDEN)
ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)),
                help="comma-separated sequence lengths (default: the benchmark grid's, %(default)s)")
ap.add_argument("--device", default="cuda")
a = ap.parse_args()
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
h = max(1, a.hidden // a.d)
seqlens = [int(s) for s in a.seqlens.split(",") if s]
t0 = time.time()
for name in a.backends.split(","):
    for causal in (False, True):
        for s in seqlens:
            try:
                q, k, v, do = (torch.randn(1, s, h, a.d, device=a.device, dtype=dtype) for _ in range(4))
                with torch.no_grad():
                    portattn.attention(q, k, v, causal=causal, backend=name)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                out = portattn.attention(q, k, v, causal=causal, backend=name)
                torch.autograd.grad(out, (q, k, v), do)
            except Exception as exc:   # a backend that cannot run the cell is the benchmark's to report
                print(f"{name} D{a.d} {a.dtype} S{s} causal={causal}: {type(exc).__name__}: {str(exc)[:160]}")
                break                  # the other lengths would say the same
if a.device.startswith("cuda"):
    torch.cuda.synchronize()
print(f"warm D{a.d} {a.dtype}: {time.time() - t0:.0f}s ({len(seqlens)} lengths)")
