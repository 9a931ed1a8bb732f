"""One forward + backward of a backend for Nsight Compute (issues #14, #16: profile before guessing).

    ncu --clock-control none --profile-from-start off --kernel-name regex:attn_ \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python tools/ncu_attention.py --backend cupy --d 128 --s 4096 [--causal]

Runs the step once outside the profiler's range (it compiles, and ncu skips it through
``--profile-from-start off``), then once more between ``cudaProfilerStart`` and ``cudaProfilerStop``,
so every launch of the second step is profiled whatever number of kernels the backend launches
(triton: forward, prep, dK/dV, dQ; cupy: forward, preprocess, dK/dV, dQ). bf16, 16k tokens,
hidden 2048; ``--fwd-only`` leaves the backward out. ``--backend cudnn`` / ``flash`` profile torch
SDPA's cuDNN / FlashAttention-2 kernels on the same tensors (match their kernel names with a
``--kernel-name`` regex of their own: ``regex:cudnn|sdpa|flash|fmha``).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import portattn  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="triton",
                help="a portattn backend, or torch SDPA's 'cudnn' / 'flash' (the bench's anchors)")
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--s", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--fwd-only", action="store_true")
a = ap.parse_args()
b, h = 16384 // a.s, 2048 // a.d
q, k, v, do = (torch.randn(b, a.s, h, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_(not a.fwd_only) for t in (q, k, v))


SDPA_ANCHORS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}
if a.backend in SDPA_ANCHORS:   # (B, H, S, D) views, made outside the profiled step
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))


def step():
    if a.backend in SDPA_ANCHORS:
        with sdpa_kernel(getattr(SDPBackend, SDPA_ANCHORS[a.backend])):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
    else:
        out = portattn.attention(q, k, v, causal=a.causal, backend=a.backend)
    if not a.fwd_only:
        torch.autograd.grad(out, (q, k, v), do)


step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
