"""Why float32 dV failed on the H200 at Sq=1 (catalogue case core/fp32/sq1-sk17/d32/causal-br).

Emulates, in float64 with explicit float32 rounding, the kernels' float32 path for one query row:
scores q.k either as one float32 FMA chain over D (what the GPU ran, triton's FMA-lowered dot and
cupy's loop alike) or rounded once from the exact sum (the fix: float64 accumulation), then
P = exp2((s - m) * scale*log2e) / l with a tree-summed l, dV = P dO, O = P V / l. Prints the max
errors against the float64 reference; the H200 measured dV 3.279e-07 for both backends.

    python tools/diag_fp32_score_chain.py
"""

from __future__ import annotations

import math

import numpy as np

from portattn.conformance.catalogue import build_catalogue
from portattn.conformance.checker import Checker
from portattn.conformance.problems import make_inputs

CASE = "core/fp32/sq1-sk17/d32/causal-br"
LOG2E = 1.4426950408889634


def f32(x):
    return np.float64(np.float32(x))


def chain_dot(a, b):
    acc = 0.0
    for x, y in zip(a, b):
        acc = f32(acc + x * y)     # product exact in float64, one rounding per step: an FMA
    return acc


def exact_dot(a, b):
    return f32(float(np.dot(a, b)))


def emulate(q, k, v, do, dot):
    batch, _, heads, d = q.shape
    scale2 = f32(LOG2E / math.sqrt(d))
    dv = np.zeros_like(v)
    out = np.zeros((batch, 1, heads, v.shape[-1]))
    for b in range(batch):
        for h in range(heads):
            s = np.array([dot(q[b, 0, h], k[b, j, h]) for j in range(k.shape[1])])
            p = np.array([f32(2.0 ** f32(f32(x - s.max()) * scale2)) for x in s])
            l_ = f32(p.sum())
            probs = np.array([f32(x * f32(1.0 / l_)) for x in p])
            dv[b, :, h] = np.vectorize(f32)(probs[:, None] * do[b, 0, h][None, :])
            out[b, 0, h] = np.vectorize(f32)((p[:, None] * v[b, :, h]).sum(0) / l_)
    return out, dv


def main():
    case = next(c for c in build_catalogue() if c.id == CASE)
    ref = Checker(case.problem, "cpu").reference
    inp = make_inputs(case.problem, "cpu")
    q, k, v, do = (t.double().numpy() for t in (inp.q, inp.k, inp.v, inp.dout))
    for name, dot in (("float32 FMA chain", chain_dot), ("float64 sum, rounded once", exact_dot)):
        out, dv = emulate(q, k, v, do, dot)
        print(f"{name:28s} max|dV - ref| = {np.abs(dv - ref.grads['dv'].numpy()).max():.4g}   "
              f"max|O - ref| = {np.abs(out - ref.out.numpy()).max():.4g}")


if __name__ == "__main__":
    main()
