"""Where does triton's atomic-dQ backward fault on the GPU? (issue #14, H200 session 6)

The session-6 H200 run (2026-12-02) saw an illegal memory access in tests/test_triton_atomic_dq.py
at head dim 40 (padded 64) while the backward sweep's checks at D 64/128/256 passed. This runs one
backward per case in its own process (a CUDA fault poisons the process that saw it), under
``CUDA_LAUNCH_BLOCKING=1`` and ``PORTATTN_TRITON_DQ=atomic`` (the device table's atomic rows at
every padded head dim), compares dQ/dK/dV with the deterministic path of the same call, and prints
a table: ok, mismatch (max error over the gradient's magnitude) or fault. For the first faulting
case it reruns under ``compute-sanitizer --tool memcheck`` and prints what that says.

    python tools/triton_atomic_diag.py --out DIR [--jobs 12] [--quick] [--narrow]

Without ``--narrow`` a head dim narrower than its padded block runs the deterministic backward on
both sides (``ops.atomic_config``), so only ``--narrow`` tests atomic dQ there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

CHILD = r"""
import json, sys, torch, portattn
from portattn.backends.triton import ops
d, dv, sq, sk, hq, hkv, causal, dtype, narrow = json.loads(sys.argv[1])
ops.ATOMIC_NARROW_HEAD = narrow   # --narrow: atomic dQ for head dims narrower than their block too
dt = getattr(torch, dtype)
g = torch.Generator().manual_seed(0)
def rnd(*s): return torch.randn(*s, generator=g).to("cuda", dt)
q, k, v = rnd(1, sq, hq, d), rnd(1, sk, hkv, d), rnd(1, sk, hkv, dv)
do = rnd(1, sq, hq, dv)
def grads():
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = portattn.attention(*leaves, causal=causal, backend="triton")
    return torch.autograd.grad(out, leaves, do)
import os
got = grads(); torch.cuda.synchronize()
os.environ["PORTATTN_TRITON_DQ"] = "kernel"
ref = grads(); torch.cuda.synchronize()
err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item() for a, b in zip(got, ref))
print(json.dumps({"err": err}))
"""


def cases(quick: bool, narrow: bool = False):
    dims = [(24, 24), (40, 40), (64, 64), (96, 96), (128, 128), (128, 64), (200, 200), (256, 256)]
    sizes = [(40, 40), (70, 80), (200, 333)] if not quick else [(70, 80), (200, 333)]
    heads = [(2, 2), (4, 2)] if not quick else [(4, 2)]
    for (d, dv), (sq, sk), (hq, hkv), causal in itertools.product(dims, sizes, heads, (False, True)):
        yield [d, dv, sq, sk, hq, hkv, causal, "bfloat16", narrow]


def run_case(case, timeout=240):
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PORTATTN_TRITON_DQ="atomic")
    env.pop("PORTATTN_DETERMINISTIC", None)
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return case, "timeout", ""
    if p.returncode == 0:
        err = json.loads(p.stdout.strip().splitlines()[-1])["err"]
        return case, ("ok" if err < 2e-2 else f"mismatch {err:.3g}"), ""
    tail = (p.stderr or p.stdout).strip().splitlines()
    kind = "fault" if any("illegal" in line or "CUDA" in line for line in tail) else "error"
    return case, kind, "\n".join(tail[-6:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--narrow", action="store_true",
                    help="also run atomic dQ for head dims narrower than their block (ops.ATOMIC_NARROW_HEAD), "
                         "whose accumulator is padded to the block: the check before that is turned on")
    args = ap.parse_args(argv)
    todo = list(cases(args.quick, args.narrow))
    rows = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for case, verdict, tail in pool.map(run_case, todo):
            rows.append({"case": case, "verdict": verdict, "tail": tail})
            d, dv, sq, sk, hq, hkv, causal, _, _ = case
            print(f"D{d:<3} Dv{dv:<3} Sq{sq:<4} Sk{sk:<4} H{hq}/{hkv} causal={causal!s:<5} {verdict}", flush=True)
    bad = [r for r in rows if r["verdict"] != "ok"]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} ok; not ok: "
          + ", ".join(f"D{r['case'][0]}/Dv{r['case'][1]} S{r['case'][2]}x{r['case'][3]} H{r['case'][4]}/{r['case'][5]}"
                      f" c={int(r['case'][6])}: {r['verdict']}" for r in bad))
    for r in bad[:2]:
        print(f"--- {r['case']}:\n{r['tail']}")
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    first = next((r for r in bad if r["verdict"] == "fault"), None)
    if first and os.path.exists(sanitizer):
        env = dict(os.environ, PORTATTN_TRITON_DQ="atomic")
        p = subprocess.run([sanitizer, "--tool", "memcheck", "--print-limit", "8", sys.executable, "-c", CHILD,
                            json.dumps(first["case"])], capture_output=True, text=True, timeout=400, env=env)
        text = (p.stdout + p.stderr).strip().splitlines()
        keep = [line for line in text if line.startswith("=========")][:60]
        print(f"--- compute-sanitizer memcheck on {first['case']}:\n" + "\n".join(keep))
        rows.append({"sanitizer": "\n".join(text[-200:])})
    with open(os.path.join(args.out, "triton_atomic_diag.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
