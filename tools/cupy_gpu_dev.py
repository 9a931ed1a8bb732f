"""Developer tool for the GPU machine: compile every kernel, then time the forward against
torch SDPA's flash backend (FA2) side by side; check and time the tensor-core backward.

    python tools/cupy_gpu_dev.py [--compile] [--bench] [--json PATH] [--bwd-check --out DIR]

``--compile`` builds every configuration of :func:`configs.all_configs` through CuPy in a pool
of processes (filling CuPy's on-disk kernel cache, so later processes load the binaries) and
reports failures. ``--bench`` times the FA3 paper's setting (B·S = 16k tokens, hidden 2048,
D = 128, bf16) with ``triton.testing.do_bench`` medians, checks each timed output against
SDPA, and prints a table last. ``--bwd-check`` (about a minute, see :mod:`cupy_bwd_check`)
checks the tensor-core backward on a few shapes (D 160-256 and Dv != D included) against the
float64 reference under the equivalence rule, for determinism and against the FMA kernels,
then times backward TFLOP/s against the FMA path and torch SDPA's flash backward; it writes
``bwd_check.json`` and ``bwd_check.txt`` to ``--out`` and exits 1 on any failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

#: head dim -> (warps, BLOCK_N, MT) forward tile shapes tried by --bench besides the default
#: (D 256: 8 warps = 128 rows per CTA, or 64-key tiles; both compile with no spills, sm_90)
VARIANT_TILES = {128: ((4, 64, 2), (4, 32, 2)), 256: ((8, 32, 1), (4, 64, 1))}


def _compile_one(cfg_tuple):
    import cupy
    from portattn.backends.cupy import configs

    cfg = configs.KernelConfig(*cfg_tuple)
    t0 = time.perf_counter()
    try:
        mod = cupy.RawModule(code=configs.source(), options=configs.NVRTC_OPTIONS,
                             name_expressions=cfg.name_expressions())
        for name in cfg.name_expressions():
            fn = mod.get_function(name)
            _ = fn.num_regs
        return cfg_tuple, time.perf_counter() - t0, None, {n: mod.get_function(n).num_regs for n in cfg.name_expressions()}
    except Exception as exc:
        return cfg_tuple, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:2000], {}


def compile_all(workers: int = 16) -> int:
    import multiprocessing as mp

    from portattn.backends.cupy import configs

    cfgs = [(c.family, c.dtype, c.head_dim, c.tile, c.kv_stages) for c in configs.all_configs()]
    cfgs += [("fwd_mma", "bfloat16", d, t) for d, tiles in VARIANT_TILES.items() for t in tiles]
    t0 = time.perf_counter()
    failures = 0
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for cfg, secs, err, regs in pool.map(_compile_one, cfgs):
            if err:
                failures += 1
                print(f"FAIL {cfg}: {err}", flush=True)
            else:
                print(f"ok   {cfg} {secs:.1f}s regs={regs}", flush=True)
    print(f"compiled {len(cfgs)} configs in {time.perf_counter() - t0:.1f}s, {failures} failure(s)", flush=True)
    return failures


def bench(json_path: str | None = None) -> list[dict]:
    import torch
    import triton
    from portattn.backends.cupy import CupyBackend
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from portattn.spec import build_spec

    be = CupyBackend()
    rows = []
    # (seqlen, causal, head_dim, dtype, softcap): the FA3 paper's setting (B*S = 16k tokens,
    # hidden 2048) at D = 128 bf16, then other head dims, fp16 and the EXTRAS kernel.
    settings = [(s, c, 128, torch.bfloat16, None) for s in (1024, 2048, 4096, 8192, 16384) for c in (False, True)]
    settings += [(4096, False, 64, torch.bfloat16, None), (4096, False, 256, torch.bfloat16, None),
                 (4096, False, 128, torch.float16, None), (4096, True, 128, torch.bfloat16, 30.0)]
    for seqlen, causal, d, dtype, softcap in settings:
        heads = 2048 // d
        batch = max(1, 16384 // seqlen)
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype) for _ in range(3))
        spec = build_spec(q, k, v, causal=causal, softcap=softcap)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def run_cupy():
            return be.forward(spec)[0]

        def run_flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        ref = run_flash().transpose(1, 2)
        err = (run_cupy().float() - ref.float()).abs().max().item() if softcap is None else float("nan")
        flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
        t_c = triton.testing.do_bench(run_cupy, warmup=50, rep=300, return_mode="median")
        t_f = triton.testing.do_bench(run_flash, warmup=50, rep=300, return_mode="median")
        row = dict(seqlen=seqlen, batch=batch, heads=heads, d=d, causal=causal,
                   dtype=str(dtype).replace("torch.", ""), softcap=softcap,
                   cupy_ms=t_c, flash_ms=t_f, cupy_tflops=flops / t_c * 1e-9,
                   flash_tflops=flops / t_f * 1e-9, ratio=t_f / t_c, max_abs_diff_vs_flash=err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    from portattn.backends.cupy import configs, runtime

    variant_rows = []
    for d, causal in ((d, c) for d in VARIANT_TILES for c in (False, True)):
        seqlen, batch, heads = 4096, 4, 2048 // d
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        spec = build_spec(q, k, v, causal=causal)
        ref = be.forward(spec)[0]
        for tile in VARIANT_TILES[d]:
            cfg = configs.KernelConfig("fwd_mma", "bfloat16", d, tile)

            def run_variant():
                plan = runtime.plan_forward(spec, cfg)
                runtime.execute(plan, spec.device)
                return plan.outputs[0]

            diff = (run_variant().float() - ref.float()).abs().max().item()
            t = triton.testing.do_bench(run_variant, warmup=50, rep=300, return_mode="median")
            flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
            variant_rows.append(dict(d=d, tile=tile, causal=causal, ms=t, tflops=flops / t * 1e-9, diff=diff))
            print(json.dumps(variant_rows[-1]), flush=True)
    bwd_rows = []
    for causal in (False, True):
        seqlen, batch, heads, d = 2048, 4, 16, 128
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype) for _ in range(3))
        spec = build_spec(q, k, v, causal=causal)
        out, lse = be.forward(spec)
        dout = torch.randn_like(out)
        t_b = triton.testing.do_bench(lambda: be.backward(spec, out, lse, dout), warmup=20, rep=200,
                                      return_mode="median")
        flops = 2.5 * 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
        bwd_rows.append(dict(seqlen=seqlen, causal=causal, bwd_ms=t_b, bwd_tflops=flops / t_b * 1e-9))
        print(json.dumps(bwd_rows[-1]), flush=True)
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'seqlen':>6} {'B':>3} {'D':>4} {'dtype':>8} {'causal':>6} {'softcap':>7} {'cupy TF/s':>10} "
          f"{'flash TF/s':>10} {'ratio':>6} {'maxdiff':>8}")
    for r in rows:
        print(f"{r['seqlen']:>6} {r['batch']:>3} {r['d']:>4} {r['dtype']:>8} {str(r['causal']):>6} "
              f"{str(r['softcap']):>7} {r['cupy_tflops']:>10.1f} "
              f"{r['flash_tflops']:>10.1f} {r['ratio']:>6.2f} {r['max_abs_diff_vs_flash']:>8.1e}")
    for r in variant_rows:
        print(f"D={r['d']} tile warps={r['tile'][0]} BN={r['tile'][1]} MT={r['tile'][2]} causal={r['causal']}: "
              f"{r['tflops']:.1f} TF/s "
              f"(diff vs default {r['diff']:.1e})")
    for r in bwd_rows:
        print(f"backward seqlen={r['seqlen']} causal={r['causal']}: {r['bwd_ms']:.2f} ms, {r['bwd_tflops']:.1f} TF/s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d", time.gmtime()), "forward": rows, "backward": bwd_rows,
                       "tiles": variant_rows},
                      f, indent=1)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--json")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--bwd-check", action="store_true",
                   help="check + time the tensor-core backward (D <= 256, Dv != D) vs reference, FMA, SDPA flash")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for --bwd-check's files")
    a = p.parse_args(argv)
    rc = 0
    if a.bwd_check:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import cupy_bwd_check

        rc |= cupy_bwd_check.main(a.out)
    if a.compile:
        rc |= 1 if compile_all(a.workers) else 0
    if a.bench:
        bench(a.json)
    return rc


if __name__ == "__main__":
    sys.exit(main())
