"""One triton forward + backward for Nsight Compute (issue #14: profile before guessing).

    ncu --clock-control none --kernel-name regex:attn_ --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python tools/ncu_attention.py --d 128 --s 4096 [--causal]

Runs the step twice (the first compiles and is skipped by ``--launch-skip 4``: forward, prep, dQ,
dK/dV); bf16, 16k tokens, hidden 2048.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import portattn  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--s", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
a = ap.parse_args()
b, h = 16384 // a.s, 2048 // a.d
q, k, v, do = (torch.randn(b, a.s, h, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
for _ in range(2):
    out = portattn.attention(q, k, v, causal=a.causal, backend="triton")
    torch.autograd.grad(out, (q, k, v), do)
torch.cuda.synchronize()
