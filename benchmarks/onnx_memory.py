"""Peak memory of one attention in onnxruntime: the portattn op versus MatMul–Softmax–MatMul.

Both models compute the same attention of ``(B, S, H, D)`` float32 inputs and are exported from
PyTorch with a dynamic sequence axis:

* ``portattn``: ``portattn.attention`` exported with ``portattn.onnx.export(target="portattn")``
  — one ``portattn.FlashAttention`` node (tiled online softmax, ``block_size`` keys per tile);
* ``standard``: the same call exported with ``target="standard"`` — one ONNX ``Attention`` node,
  run by onnxruntime's own kernel (for comparison);
* ``decomposed``: the plain formula ``softmax(q kᵀ · scale) v`` exported by
  ``torch.onnx.export(dynamo=True)`` — MatMul, Softmax, MatMul over the full ``S×S`` scores.

Each (model, S) runs in a fresh subprocess (Linux): it creates the session and the inputs, resets
the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5), runs the model once and reads the
peak (``VmHWM``); peak minus the resident set before the run is the memory the run needed. The
report is printed; ``--out`` writes it (the committed one is ``benchmarks/results/onnx_memory.json``)::

    python benchmarks/onnx_memory.py                 # S = 1024 .. 8192, printed
    python benchmarks/onnx_memory.py --seqlens 8192 --heads 2
    python benchmarks/onnx_memory.py --out benchmarks/results/onnx_memory.json   # replace the committed report
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
import numpy as np, onnxruntime as ort

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

path, b, s, h, d, threads = sys.argv[1], *map(int, sys.argv[2:7])
options = ort.SessionOptions()
options.intra_op_num_threads = threads
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
feeds = {name: rng.standard_normal((b, s, h, d), dtype=np.float32) for name in ("q", "k", "v")}
with open("/proc/self/clear_refs", "w") as f:   # reset the peak-RSS counter (VmHWM) to the current RSS
    f.write("5")
before = status_kib("VmRSS")
t0 = time.perf_counter()
out = session.run(None, feeds)[0]
seconds = time.perf_counter() - t0
peak = status_kib("VmHWM")
print(json.dumps({"peak_delta_mib": (peak - before) / 1024, "peak_rss_mib": peak / 1024,
                  "seconds": seconds, "finite": bool(np.isfinite(out).all())}))
"""

def export_models(directory: Path, heads: int, head_dim: int, block_size: int) -> dict[str, Path]:
    import torch

    import portattn
    import portattn.onnx

    class Fused(torch.nn.Module):
        def forward(self, q, k, v):
            return portattn.attention(q, k, v)

    class Decomposed(torch.nn.Module):
        def forward(self, q, k, v):
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))           # (B, H, S, D)
            p = torch.softmax(qt @ kt.transpose(-1, -2) * head_dim ** -0.5, dim=-1)
            return (p @ vt).transpose(1, 2)

    example = tuple(torch.randn(1, 64, heads, head_dim) for _ in range(3))
    seq = torch.export.Dim("seq", max=65536)
    dyn = {name: {1: seq} for name in ("q", "k", "v")}
    paths = {"portattn": directory / "portattn.onnx", "standard": directory / "standard.onnx",
             "decomposed": directory / "decomposed.onnx"}
    portattn.onnx.export(Fused(), example, paths["portattn"], dynamic_shapes=dyn, block_size=block_size)
    portattn.onnx.export(Fused(), example, paths["standard"], target="standard", dynamic_shapes=dyn)
    program = torch.onnx.export(Decomposed(), example, dynamo=True, dynamic_shapes=dyn, opset_version=23)
    program.save(str(paths["decomposed"]))
    return paths


def measure(path: Path, batch: int, seqlen: int, heads: int, head_dim: int, threads: int) -> dict:
    cmd = [sys.executable, "-c", CHILD, str(path), str(batch), str(seqlen), str(heads), str(head_dim), str(threads)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"rc={result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0 = default)")
    parser.add_argument("--out", default=None,
                        help="write the JSON report here (the committed one is benchmarks/results/onnx_memory.json: "
                             "name it to replace it); default: print only")
    args = parser.parse_args(argv)

    import onnxruntime
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = export_models(Path(tmp), args.heads, args.head_dim, args.block_size)
        for s in args.seqlens:
            for name, path in paths.items():
                r = measure(path, args.batch, s, args.heads, args.head_dim, args.threads)
                scores_mib = args.batch * args.heads * s * s * 4 / 2**20
                rows.append({"model": name, "seqlen": s, "scores_matrix_mib": scores_mib, **r})
                print(f"{name:>10}  S={s:>6}  peak delta {r.get('peak_delta_mib', float('nan')):9.1f} MiB  "
                      f"(one S×S float32 score matrix: {scores_mib:8.1f} MiB)  {r.get('seconds', float('nan')):.2f} s"
                      + (f"  ERROR {r['error']}" if "error" in r else ""), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
        "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "dtype": "float32",
        "block_size": args.block_size, "method": "VmHWM (reset via /proc/self/clear_refs) minus VmRSS before one session.run, fresh subprocess",
        "rows": rows,
    }
    if args.out is None:
        print(json.dumps(report, indent=2))
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
