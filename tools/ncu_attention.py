"""One forward + backward of a backend for Nsight Compute (issues #14, #16: profile before guessing).

    ncu --clock-control none --profile-from-start off --kernel-name regex:attn_ \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python tools/ncu_attention.py --backend cupy --d 128 --s 4096 [--causal]

Runs the step once outside the profiler's range (it compiles, and ncu skips it through
``--profile-from-start off``), then once more between ``cudaProfilerStart`` and ``cudaProfilerStop``,
so every launch of the second step is profiled whatever number of kernels the backend launches
(triton: forward, prep, dK/dV, dQ; cupy: forward, preprocess, dK/dV, dQ). bf16, 16k tokens,
hidden 2048; ``--fwd-only`` leaves the backward out.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import portattn  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="triton")
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--s", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--fwd-only", action="store_true")
a = ap.parse_args()
b, h = 16384 // a.s, 2048 // a.d
q, k, v, do = (torch.randn(b, a.s, h, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_(not a.fwd_only) for t in (q, k, v))


def step():
    out = portattn.attention(q, k, v, causal=a.causal, backend=a.backend)
    if not a.fwd_only:
        torch.autograd.grad(out, (q, k, v), do)


step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
