"""Decode benchmark: portattn.attention_with_kvcache (triton split-KV; contiguous and paged
caches) side by side with torch SDPA's cuDNN and flash backends, as K/V bytes read per second.

    python benchmarks/bench_decode.py --out results/            # the grid and the graph row
    python benchmarks/bench_decode.py --quick --no-eager        # a few points, GPU time only

Grid (issue 13): Sq 1 and 8, batch 1 and 8, Sk 1k..128k, GQA 32:4, D 128, bf16. portattn runs
the decode call on a full cache (``cache_seqlens = Sk``, bottom-right causal: the Sq queries are
the last Sq positions), contiguous and paged with block sizes 16 and 256 (pages shuffled);
SDPA attends q (B, 32, Sq, 128) to the full cache k/v (B, 4, Sk, 128) with ``enable_gqa``
(non-causal: the same bytes; SDPA's ``is_causal`` would align top-left). Every timed output is
checked once against a float32 reference of its own problem. Bandwidth is
``B·Sk·Hkv·(D + Dv)·2 bytes / time``; each row also gives portattn / cuDNN.

Timing (the same for every implementation; :data:`TIMING_METHODS`): the headline column is
the GPU time per call with the launches queued ahead (:func:`queued_ms`: a spin kernel holds
the stream while the host queues the calls, over cache copies that L2 cannot hold), so a
call whose host path is longer than its kernel (portattn's and SDPA's at batch 1 on the H200
host) is still measured as bandwidth; the eager column (``triton.testing.do_bench``, one
call between events) keeps what an un-captured loop sees. Batch 1 / Sk 8k is also timed
inside a CUDA graph of many calls (time per call, with and without the in-place append)
against cuDNN's. Tiles and split counts: ``tools/decode_sweep.py``. Writes
``bench-decode-<tag>-<date>.json``, ``.txt`` and ``.png`` (TB/s against Sk, a panel per (batch, Sq)).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import card_tag  # noqa: E402  (the GPU's short name in the file names)

HQ, HKV, D = 32, 4, 128
SEQLENS = (1024, 4096, 8192, 32768, 131072)
IMPLS = ("triton", "triton-paged16", "triton-paged256", "sdpa-cudnn", "sdpa-flash")
SDPA_KERNELS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
#: relative error (to max |ref|, at least 1) above which a timed output is marked wrong
CHECK_TOL = 2e-2


def grid(quick: bool = False) -> list[dict]:
    """The (B, Sq, Sk) points, batch-major."""
    seqlens = (1024, 8192, 131072) if quick else SEQLENS
    return [dict(B=b, Sq=sq, Sk=sk) for b in (1, 8) for sq in (1, 8) for sk in seqlens]


def kv_bytes(b: int, sk: int, hkv: int | None = None, d: int | None = None, dv: int | None = None,
             elem: int = 2) -> int:
    """Bytes of K and V that one call must read (heads and head dims default to the grid's)."""
    hkv, d = hkv or HKV, d or D
    return b * sk * hkv * (d + (dv or d)) * elem


def tbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def paged_copy(k: torch.Tensor, v: torch.Tensor, page: int, gen: torch.Generator):
    """Paged copies of contiguous (B, S, H, D) caches: (k_pool, v_pool, block_table), pages
    shuffled so that sequence b's page i is pool[block_table[b, i]]; the contents are identical."""
    b, s = k.shape[:2]
    n = s // page
    perm = torch.randperm(b * n, generator=gen).to(k.device)
    pools = []
    for t in (k, v):
        pool = torch.empty((b * n, page, *t.shape[2:]), dtype=t.dtype, device=t.device)
        pool[perm] = t.reshape(b * n, page, *t.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], perm.view(b, n).to(torch.int32)


def reference32(q, k, v, causal: bool) -> torch.Tensor:
    """float32 attention of q (B, Sq, Hq, D) to k/v (B, Sk, Hkv, D), bottom-right causal if asked,
    one sequence at a time; (B, Sq, Hq, D) float32."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    out = torch.empty((b, sq, hq, v.shape[-1]), dtype=torch.float32, device=q.device)
    for i in range(b):
        qi = q[i].float().permute(1, 0, 2).reshape(hkv, g * sq, d)          # rows: head-major, then query
        s = qi @ k[i].float().permute(1, 2, 0) / math.sqrt(d)                # (Hkv, G·Sq, Sk)
        if causal:
            row = torch.arange(sq, device=q.device).repeat(g) + (sk - sq)
            s = s.masked_fill(torch.arange(sk, device=q.device)[None, None, :] > row[None, :, None], float("-inf"))
        o = torch.softmax(s, -1) @ v[i].float().permute(1, 0, 2)             # (Hkv, G·Sq, Dv)
        out[i] = o.reshape(hq, sq, -1).permute(1, 0, 2)
    return out


def check(out: torch.Tensor, ref: torch.Tensor) -> dict:
    err = (out.float() - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    return {"max_abs_err": err, "ok": bool(err <= CHECK_TOL * scale)}


def ratio_table(rows: list[dict]) -> str:
    """The result rows as text: TB/s per implementation and portattn / cuDNN, last."""
    cols = [c for c in IMPLS if any(c in r["results"] for r in rows)]
    with_eager = any("eager_tbps" in e for r in rows for e in r["results"].values())
    head = f"{'B':>2} {'Sq':>3} {'Sk':>7} " + "".join(f"{c:>17}" for c in cols) + "   triton/cuDNN  paged16  paged256"
    if with_eager:
        head += "   eager: triton  cuDNN"
    lines = [head]
    for r in rows:
        res = r["results"]

        def cell(c, res=res):
            e = res.get(c, {})
            if "tbps" not in e:
                return f"{'err' if 'error' in e else '-':>17}"
            return f"{e['tbps']:>13.2f}{'' if e.get('ok', True) else ' BAD':<4}"

        cu = res.get("sdpa-cudnn", {}).get("tbps")
        ratios = "".join(f"{res[c]['tbps'] / cu:>9.2f}" if cu and "tbps" in res.get(c, {}) else f"{'-':>9}"
                         for c in ("triton", "triton-paged16", "triton-paged256"))
        eager = "".join(f"{res[c]['eager_tbps']:>8.2f}" if "eager_tbps" in res.get(c, {}) else f"{'-':>8}"
                        for c in ("triton", "sdpa-cudnn"))
        lines.append(f"{r['B']:>2} {r['Sq']:>3} {r['Sk']:>7} " + "".join(cell(c) for c in cols) + "   " + ratios
                     + (" " + eager if with_eager else ""))
    lines.append("TB/s = K/V bytes read per second, GPU time per call with the launches queued ahead "
                 "(timing 'queued'); BAD: output differs from the float32 reference")
    if with_eager:
        lines.append("eager triton / cuDNN: the same calls timed one at a time by do_bench (timing 'eager': "
                     "the host path included where it is longer than the kernel)")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> bool:
    """TB/s against Sk, one line per implementation, a panel per (batch, Sq); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = sorted({(r["B"], r["Sq"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (b, sq) in zip(axes[0], panels):
        sel = [r for r in rows if r["B"] == b and r["Sq"] == sq]
        for impl in IMPLS:
            pts = [(r["Sk"], r["results"][impl]["tbps"]) for r in sel if "tbps" in r["results"].get(impl, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}, Sq {sq}")
        ax.set_xlabel("Sk (keys)")
        ax.set_ylabel("K/V TB/s")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("decode, GQA 32:4, D 128, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----- GPU parts -------------------------------------------------------------------------------

#: how each timed column was measured (stored in the JSON and printed under the table)
TIMING_METHODS = {
    "queued": "GPU time per call: a spin kernel (torch.cuda._sleep) holds the stream while the host queues "
              "CALLS calls (rotating over cache copies of >= 256 MB in all, so L2 holds none of it), then "
              "events around them; the median of 5 such runs / CALLS. The host's cost per call is "
              "excluded (the sleep outlasts the queueing, checked).",
    "eager": "triton.testing.do_bench median (events around each call, L2 cleared before it): includes "
             "the host path whenever that is longer than the kernel (B 1 rows on the H200 host)",
}
#: cache bytes the queued timer rotates over at least (the H200's L2 is 50 MB)
ROTATE_BYTES = 256 * 2**20
#: calls per queued timing run
CALLS = 24


def rotations(nbytes: int, limit: int = 32) -> int:
    """Copies of a problem's caches that the queued timer cycles through (>= ROTATE_BYTES in all)."""
    return max(1, min(limit, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def _median_ms(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles per millisecond, measured once."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / max(1e-3, start.elapsed_time(end))


def queued_ms(fns, calls: int = CALLS, repeats: int = 5) -> dict:
    """Median GPU time per call (ms) of ``calls`` calls cycling through ``fns`` (callables over
    different copies of the same problem), queued behind a spin kernel so that the host's cost
    per call is not on the clock: ``{"ms", "host_ms" (host time to queue one call),
    "queued_ok" (the spin outlasted the queueing in every run)}``."""
    fns = list(fns)
    for f in fns:
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    host_ms = (time.perf_counter() - t) * 1e3 / calls
    torch.cuda.synchronize()
    per_ms = _sleep_cycles_per_ms()
    times, ok = [], True
    for _ in range(repeats):
        spin_ms = 2.0 * host_ms * calls + 1.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(spin_ms * per_ms))
        start.record()
        t = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        queued = (time.perf_counter() - t) * 1e3
        end.record()
        end.synchronize()
        ok = ok and queued < spin_ms
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return {"ms": times[len(times) // 2], "host_ms": host_ms, "queued_ok": ok}


def _sdpa_fn(kernel_name, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kernel = getattr(SDPBackend, SDPA_KERNELS[kernel_name])
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run():
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True).transpose(1, 2)
    return run


def layouts(k: torch.Tensor, v: torch.Tensor, copies: int, gen: torch.Generator, pages=(16, 256)) -> dict:
    """name -> list of ``copies`` (k_cache, v_cache, block_table or None) holding the same keys:
    ``"contig"`` and ``"paged<P>"`` (shuffled pages, :func:`paged_copy`)."""
    out = {"contig": [(k, v, None)] + [(k.clone(), v.clone(), None) for _ in range(copies - 1)]}
    for page in pages:
        out[f"paged{page}"] = [paged_copy(k, v, page, gen) for _ in range(copies)]
    return out


def bench_point(pt: dict, dtype, gen, progress, device="cuda", timer=None, eager_timer=None) -> dict:
    """One grid point: every implementation checked once, then timed: ``timer(fns) -> {"ms", ...}``
    over rotating cache copies (default :func:`queued_ms`), and ``eager_timer(fn) -> ms``
    on one copy (default do_bench; None: not timed eagerly)."""
    from portattn.kvcache import attention_with_kvcache
    timer = timer or queued_ms
    if eager_timer is None and device == "cuda":
        eager_timer = _median_ms
    b, sq, sk = pt["B"], pt["Sq"], pt["Sk"]
    q = torch.randn(b, sq, HQ, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(b, sk, HKV, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(b, sk, HKV, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
    lens = torch.full((b,), sk, dtype=torch.int32, device=device)
    nbytes = kv_bytes(b, sk)
    ref_causal = reference32(q, k, v, causal=True)
    ref_full = reference32(q, k, v, causal=False)
    copies = rotations(nbytes) if device == "cuda" else 2
    host_gen = torch.Generator().manual_seed(b * 1000003 + sk + sq)
    caches = layouts(k, v, copies, host_gen)
    row = dict(pt, bytes=nbytes, copies=copies, results={})
    for impl in IMPLS:
        entry = row["results"].setdefault(impl, {})
        try:
            if impl.startswith("sdpa"):
                fns = [_sdpa_fn(impl, q, kc, vc) for kc, vc, _ in caches["contig"]]
                ref = ref_full
            else:
                layout = "contig" if impl == "triton" else impl.removeprefix("triton-")

                def make(kc, vc, bt):
                    return lambda: attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=bt, causal=True,
                                                          backend="triton")
                fns = [make(*c) for c in caches[layout]]
                ref = ref_causal
            entry.update(check(fns[0](), ref))
            entry.update(timer(fns))
            entry["tbps"] = tbps(nbytes, entry["ms"])
            entry["timing"] = "queued"
            if eager_timer is not None:
                entry["eager_ms"] = eager_timer(fns[0])
                entry["eager_tbps"] = tbps(nbytes, entry["eager_ms"])
            if impl.startswith("triton"):
                from portattn.backends.triton import decode

                from portattn.kvcache import build_kvcache_spec
                kc, vc, bt = caches[layout][0]
                entry["plan"] = decode.plan_summary(build_kvcache_spec(q, kc, vc, cache_seqlens=lens,
                                                                       block_table=bt, causal=True))
        except Exception as exc:   # a backend that cannot run this point: record why
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        progress(f"B{b} Sq{sq} Sk{sk} {impl}: " + (f"{entry['tbps']:.2f} TB/s" if "tbps" in entry
                                                  else entry.get("error", "")))
    del caches
    return row


def bench_graph(dtype, gen, b=1, sq=1, sk=8192, calls=48) -> dict:
    """Time per call inside one CUDA graph of ``calls`` decode steps over rotating caches
    (more bytes than the L2 holds), triton with and without the append, against SDPA's."""
    from portattn.kvcache import attention_with_kvcache
    rot = max(2, math.ceil(256 * 2**20 / kv_bytes(b, sk)))
    qs = [torch.randn(b, sq, HQ, D, generator=gen, device="cuda").to(dtype) for _ in range(rot)]
    ks = [torch.randn(b, sk, HKV, D, generator=gen, device="cuda").to(dtype) for _ in range(rot)]
    vs = [torch.randn(b, sk, HKV, D, generator=gen, device="cuda").to(dtype) for _ in range(rot)]
    new_k = torch.randn(b, sq, HKV, D, generator=gen, device="cuda").to(dtype)
    new_v = torch.randn(b, sq, HKV, D, generator=gen, device="cuda").to(dtype)
    full = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    before = torch.full((b,), sk - sq, dtype=torch.int32, device="cuda")

    def step(impl, i):
        q, k, v = qs[i % rot], ks[i % rot], vs[i % rot]
        if impl == "triton":
            return attention_with_kvcache(q, k, v, cache_seqlens=full, causal=True, backend="triton")
        if impl == "triton+append":
            return attention_with_kvcache(q, k, v, new_k, new_v, cache_seqlens=before, causal=True, backend="triton")
        return _sdpa_fn(impl, q, k, v)()

    out = {"B": b, "Sq": sq, "Sk": sk, "calls": calls, "rotating_caches": rot, "results": {}}
    for impl in ("triton", "triton+append", "sdpa-cudnn", "sdpa-flash"):
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(2):
                    step(impl, i)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(calls):
                    step(impl, i)
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / calls)
            times.sort()
            us = times[len(times) // 2] * 1e3
            out["results"][impl] = {"us_per_call": us, "tbps": tbps(kv_bytes(b, sk), us * 1e-3)}
        except Exception as exc:
            out["results"][impl] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return out


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    env = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": props.name,
           "sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for mod in ("triton", "portattn"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        env["cudnn"] = None
    return env


class _Progress:
    """A rich progress bar when rich is installed (plain lines otherwise)."""

    def __init__(self, total: int):
        self.bar = None
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.bar.start()
            self.task = self.bar.add_task("decode", total=total)
        except ImportError:
            pass
        self.t0 = time.time()

    def __call__(self, msg: str):
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=msg[:70])
            self.bar.console.log(msg)
        else:
            print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def stop(self):
        if self.bar is not None:
            self.bar.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Sk 1k, 8k, 128k only")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager (do_bench) column")
    ap.add_argument("--out", default=None, help="directory for the JSON and PNG results")
    ap.add_argument("--tag", default=None, help="file name tag (default: the GPU's short name, e.g. h200)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA/ROCm GPU; none is visible", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    points = grid(args.quick)
    progress = _Progress(len(points) * len(IMPLS) + 1)
    t0 = time.time()
    rows, graph, interrupted = [], {"results": {}}, False
    eager = (lambda fn: None) if args.no_eager else None
    try:   # Ctrl-C / SIGINT (timeout -s INT) keeps what is done: it is summarised and written
        graph = bench_graph(dtype, gen)          # first: short, and a headline number
        progress("graph B1 Sk8k: " + ", ".join(f"{k} {v.get('us_per_call', float('nan')):.1f} us"
                                               for k, v in graph["results"].items()))
        torch.cuda.empty_cache()
        for pt in points:
            row = bench_point(pt, dtype, gen, progress, eager_timer=eager)
            if args.no_eager:
                for e in row["results"].values():
                    e.pop("eager_ms", None), e.pop("eager_tbps", None)
            rows.append(row)
            torch.cuda.empty_cache()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.stop()
    result = {"environment": environment(), "dtype": "bf16", "heads": f"{HQ}:{HKV}", "head_dim": D,
              "seconds": round(time.time() - t0, 1), "interrupted": interrupted, "rows": rows, "graph": graph,
              "timing": {**TIMING_METHODS, "calls": CALLS, "graph": "B1 Sk8k: time per call inside one CUDA graph"},
              "convention": "TB/s = B*Sk*Hkv*(D+Dv)*2 bytes / time; tbps: queued (GPU time), eager_tbps: do_bench; "
                            "portattn: full cache, bottom-right causal; SDPA: full cache, non-causal, enable_gqa"}
    print()
    g = graph["results"]
    print("CUDA graph, B1 Sq1 Sk8k, us per call: " + ", ".join(
        f"{k} {v['us_per_call']:.2f}" if "us_per_call" in v else f"{k} {v.get('error')}" for k, v in g.items()))
    print()
    print(ratio_table(rows))
    print("\ntiming: " + "\n        ".join(f"{k}: {v}" for k, v in TIMING_METHODS.items()))
    print("tools/decode_sweep.py times alternative tiles and split counts (same queued timer).")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"bench-decode-{args.tag or card_tag(result['environment'].get('gpu'))}-{result['environment']['date'][:10]}")
        with open(stem + ".json", "w") as fh:
            json.dump(result, fh, indent=1)
        with open(stem + ".txt", "w") as fh:
            fh.write(ratio_table(rows) + "\n")
        print(f"\nwrote {stem}.json, .txt" + (" and .png" if plot(rows, stem + ".png") else " (no matplotlib: no plot)"))
    return 0 if all(e.get("ok", True) for r in rows for e in r["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
