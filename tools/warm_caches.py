"""Fill triton's and cupy's on-disk kernel caches for one head dim and dtype before a benchmark
(the compiles are CPU-bound: one process per (D, dtype) side by side, then the timed run hits
the caches). Runs what ``portattn bench`` runs — the forward without grad, the training forward
and the backward, causal and not — on a tiny problem of the benchmark's hidden size.

    for d in 64 128 256; do for t in bf16 fp16; do python tools/warm_caches.py --d $d --dtype $t & done; done; wait
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import portattn  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--d", type=int, required=True)
ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
ap.add_argument("--backends", default="triton,cupy")
ap.add_argument("--hidden", type=int, default=2048)
a = ap.parse_args()
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
h = max(1, a.hidden // a.d)
t0 = time.time()
for name in a.backends.split(","):
    for causal in (False, True):
        try:
            q, k, v, do = (torch.randn(1, 256, h, a.d, device="cuda", dtype=dtype) for _ in range(4))
            with torch.no_grad():
                portattn.attention(q, k, v, causal=causal, backend=name)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = portattn.attention(q, k, v, causal=causal, backend=name)
            torch.autograd.grad(out, (q, k, v), do)
        except Exception as exc:   # a backend that cannot run the cell is the benchmark's to report
            print(f"{name} D{a.d} {a.dtype} causal={causal}: {type(exc).__name__}: {str(exc)[:160]}")
torch.cuda.synchronize()
print(f"warm D{a.d} {a.dtype}: {time.time() - t0:.0f}s")
