"""Which feature of the conformance case ``combo/everything`` makes triton's forward go wrong on a
GPU: the case, then variants with one feature changed, each reported as the count of non-finite
outputs and the max error against the float64 reference.

    PYTHONPATH=. python tools/diag_dv_width.py [variant ...]

Made for the H200 finding of 2026-11-29 (fp16/bf16 with D 40 / Dv 24 tile widths 64 / 32 gave NaN,
wrong values and an illegal memory access); raw output in
the H200 diagnostic of 2026-11-29 (in git history: benchmarks/results/triton-dv-width-diagnostic-h200-2026-11-29.txt). Runs on CPU tensors
(interpreter) with ``--cpu``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch

import portattn
from portattn.conformance import make_inputs
from portattn.conformance.catalogue import select_cases

VARIANTS = {
    "base": {}, "fwd-only": dict(grad=False), "not-strided": dict(strided=False),
    "no-softcap": dict(softcap=None), "no-alibi": dict(alibi=None), "no-bias": dict(bias=None, bias_grad=False),
    "no-window": dict(window=None), "d64": dict(head_dim=64, head_dim_v=64), "bf16": dict(dtype="bfloat16"),
    "fp32": dict(dtype="float32"), "no-empty-seq": dict(seqlens_q=(7, 1, 25)),
    "dense": dict(seqlens_q=None, seqlens_k=None, batch=2, seqlen_q=25, seqlen_k=25),
    "mha": dict(heads_kv=4), "no-causal": dict(causal=False, window=(9, 3)),
}


def run(name: str, device: str) -> str:
    t0 = time.time()
    problem = replace(select_cases(patterns=["combo/everything"])[0].problem, **VARIANTS[name])
    inp = make_inputs(problem, device)
    kw = dict(inp.kwargs)
    ref_kw = dict(kw)
    if inp.bias is not None:
        kw["attn_bias"] = inp.bias.detach()
        ref_kw["attn_bias"] = kw["attn_bias"].double() if inp.bias.is_floating_point() else kw["attn_bias"]
    q, k, v = (t.detach() for t in (inp.q, inp.k, inp.v))
    with torch.no_grad():
        out = portattn.attention(q, k, v, backend="triton", **kw)
        ref = portattn.attention(q.double(), k.double(), v.double(), backend="reference", **ref_kw)
    bad = ~torch.isfinite(out.float())
    rows = bad.any(-1).nonzero()[:6].tolist() if bad.any() else []
    err = (out.double() - ref).nan_to_num(nan=float("inf")).abs().max().item()
    return (f"{name:14s} nan={int(bad.sum()):5d}/{out.numel()} maxerr={err:.3g} first bad (row, head)={rows} "
            f"[{time.time() - t0:.0f}s]")


def main(argv: list[str]) -> int:
    device = "cpu" if "--cpu" in argv else "cuda"
    for name in [a for a in argv if a != "--cpu"] or list(VARIANTS):
        print(run(name, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
