"""Tile / split-count sweep of the triton split-KV decode kernel at the issue-13 grid points.

    PYTHONPATH=. python tools/decode_sweep.py --out $OUT --time-limit 170

Points: Sq 1 and 8, batch 1 and 8, Sk 32k and 128k, each on a contiguous cache and on paged
caches of 16 and 256 rows per page (GQA 32:4, D 128, bf16, full cache, bottom-right causal).
At every point it times, with the same timer as ``benchmarks/bench_decode.py`` (``queued_ms``:
GPU time per call, the launches queued behind a spin kernel, rotating cache copies past L2):

* the current heuristic (``decode_config`` + ``num_splits_for``: what ``attention_with_kvcache``
  runs today);
* candidate tiles (:func:`candidates`: BLOCK_M cap, BLOCK_N, num_warps, num_stages), each with
  the split counts of :func:`split_options` (its heuristic count and one, two and four programs
  per SM) through ``decode.forward(kv, config)`` and ``KVCacheSpec.num_splits`` (the production
  kernel, no fork);
* torch SDPA's cuDNN and flash kernels on the contiguous cache (the issue's baselines).

Every timed (config, split count) output is checked once against a float32 reference
(``bench_decode.check``) and, beside the heuristic's output at the same point, with
``portattn.numerics.compare`` (the heuristic's error as the yardstick). The
candidates are visited best-guess first, alternating Sq 1 and Sq 8, each over all its points,
so a ``--time-limit`` that stops the sweep early (compiles included) still leaves every point
with the heuristic and the first candidates. Writes ``decode-sweep.json`` and
``decode-sweep.txt``: per point the heuristic's and the best config, the table rows to paste
into ``backends/triton/configs.py`` (the candidate with the best geometric-mean time over the
points of its Sq, at its heuristic split count), and the verdict against issue 13's targets
for the current table and the proposed rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def _bench():
    """benchmarks/bench_decode.py as a module (its timer, reference, paged copies, progress)."""
    spec = importlib.util.spec_from_file_location("bench_decode", _ROOT / "benchmarks" / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()

LAYOUTS = ("contig", "paged16", "paged256")
#: the issue's targets (TB/s of K/V bytes; ratios to cuDNN or to the contiguous cache)
TARGETS = {"sq1_vs_cudnn": 1.0, "b8_128k_sq1": 3.8, "b1_128k_sq1": 3.3, "sq8": 3.0, "paged_vs_contig": 0.9}
#: calls per queued timing run and runs per timing in the sweep (the benchmark uses more)
CALLS, REPEATS = 16, 3


class Cand(NamedTuple):
    """One tile candidate: the packed tile's height cap, BLOCK_N, warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def config(self):
        from portattn.backends.triton.configs import KernelConfig
        return KernelConfig(self.block_m, self.block_n, self.num_warps, self.num_stages)

    def short(self) -> str:
        return f"M{self.block_m} N{self.block_n} w{self.num_warps} s{self.num_stages}"


# best guesses first (the sweep may stop early); the heuristic's own tile is put in front by candidates()
_NARROW = [(16, 128, 4, 3), (16, 64, 4, 3), (16, 64, 4, 5), (16, 128, 4, 4), (16, 32, 4, 6), (16, 64, 8, 4),
           (16, 128, 8, 3), (16, 32, 4, 4), (16, 64, 2, 4), (16, 128, 4, 2)]
_WIDE = [(64, 64, 8, 3), (32, 64, 4, 3), (64, 64, 4, 4), (32, 64, 4, 4), (64, 32, 4, 4), (64, 128, 4, 2),
         (32, 128, 4, 3), (16, 64, 4, 4), (32, 32, 4, 5), (64, 64, 8, 4)]   # (64, 64, 8, 3): the rule before
_TINY = [(16, 16, 4, 1), (16, 32, 4, 1), (32, 32, 4, 1)]


def candidates(rows: int, heuristic: Cand, pool: list[tuple] | None = None, limit: int | None = None) -> list[Cand]:
    """Tile candidates for a packed tile of ``rows`` rows (GQA group x Sq): the heuristic's tile
    first, then ``pool`` (default: the narrow list for <= 32 rows, the wide one above), without
    duplicates and without caps above the rows' power of two (they would equal a smaller cap)."""
    top = max(16, 1 << (max(1, rows) - 1).bit_length())
    pool = pool if pool is not None else (_NARROW if top <= 32 else _WIDE)
    out = [heuristic]
    for t in pool:
        c = Cand(*t)
        if c.block_m > top:
            c = Cand(top, c.block_n, c.num_warps, c.num_stages)
        if c not in out:
            out.append(c)
    return out[:limit] if limit else out


def split_options(heuristic: int, units: int, key_blocks: int, num_sms: int, max_splits: int = 128) -> list[int]:
    """Split counts to time for one (config, point): the heuristic's and those giving one, two
    and four programs per SM (``units`` programs without splitting), within ``[1, min(max_splits,
    key_blocks // 2)]``; sorted, heuristic included."""
    top = max(1, min(max_splits, key_blocks // 2))
    opts = {max(1, min(top, heuristic))}
    for per_sm in (1, 2, 4):
        opts.add(max(1, min(top, per_sm * num_sms // max(1, units))))
    return sorted(opts)


def points(tiny: bool = False) -> list[dict]:
    """The sweep's (Sq, B, Sk, layout) points, grouped by Sq."""
    if tiny:
        return [dict(Sq=sq, B=1, Sk=128, layout=lay) for sq in (1, 2) for lay in ("contig", "paged16")]
    return [dict(Sq=sq, B=b, Sk=sk, layout=lay) for sq in (1, 8) for b in (1, 8) for sk in (32768, 131072)
            for lay in LAYOUTS]


def _key(p: dict) -> str:
    return f"Sq{p['Sq']} B{p['B']} Sk{p['Sk']} {p['layout']}"


def choose(trials: list[dict], pts: list[dict]) -> dict:
    """From the timed trials: per point the heuristic's and the best (config, splits); per Sq the
    proposed tile (the candidate with the best geometric mean over the Sq's points of
    ``best time at the point / its time at its heuristic split count``, only candidates measured
    at every point of the Sq count) and its numbers per point."""
    ok = [t for t in trials if t.get("ok") and "tbps" in t]
    per_point = {}
    for p in pts:
        k = _key(p)
        here = [t for t in ok if t["point"] == k]
        heur = [t for t in here if t["cand"] == "heuristic"]
        best = max(here, key=lambda t: t["tbps"], default=None)
        per_point[k] = {"point": p, "heuristic": heur[0] if heur else None, "best": best}
    proposal = {}
    for sq in sorted({p["Sq"] for p in pts}):
        keys = [_key(p) for p in pts if p["Sq"] == sq]
        scores = {}
        for cand in sorted({t["cand"] for t in ok if t["cand"] != "heuristic" and t["Sq"] == sq}):
            ratios, chosen = [], {}
            for k in keys:
                at = [t for t in ok if t["point"] == k and t["cand"] == cand and t["heuristic_splits"]]
                best = per_point[k]["best"]
                if not at or best is None:
                    break
                chosen[k] = at[0]
                ratios.append(at[0]["tbps"] / best["tbps"])
            else:
                scores[cand] = (math.exp(sum(map(math.log, ratios)) / len(ratios)), chosen)
        if scores:
            cand = max(scores, key=lambda c: scores[c][0])
            proposal[sq] = {"cand": cand, "score": scores[cand][0], "per_point": scores[cand][1],
                            "ranking": sorted(((round(v[0], 4), c) for c, v in scores.items()), reverse=True)}
    return {"per_point": per_point, "proposal": proposal}


def paste_rows(proposal: dict, family: str, group: int = 8, block_d: int = 128) -> list[str]:
    """The configs.py lines that make the proposed tiles the table's choice (``group``: query
    heads per KV head; a Sq whose packed rows fit 32 goes to ``_DECODE_NVIDIA``, else to
    ``_DECODE_WIDE_NVIDIA``)."""
    lines = []
    for sq, prop in sorted(proposal.items()):
        m, n, w, s = (int(x[1:]) for x in prop["cand"].split())
        if group * sq <= 32:
            lines.append(f'_DECODE_NVIDIA["{family}"][{block_d}] = ({n}, {w}, {s})   # rows <= 32 (Sq 1 at GQA 8), '
                         f"geomean {prop['score']:.3f} of the per-point best")
        else:
            lines.append(f'_DECODE_WIDE_NVIDIA["{family}"][{block_d}] = ({m}, {n}, {w}, {s})   # 64-row tiles '
                         f"(Sq 8 at GQA 8), geomean {prop['score']:.3f} of the per-point best")
    return lines


def verdict(per_point: dict, numbers: dict, baselines: dict) -> list[str]:
    """Issue 13's targets for one set of per-point TB/s (``numbers``: point key -> TB/s)."""
    out = []

    def get(sq, b, sk, lay="contig"):
        return numbers.get(f"Sq{sq} B{b} Sk{sk} {lay}")

    def line(name, value, target, fmt="{:.2f}"):
        if value is None:
            out.append(f"  {name}: not measured")
        else:
            out.append(f"  {name}: {fmt.format(value)} (target >= {target}) {'MET' if value >= target else 'MISSED'}")

    for b, sk in sorted({(p["point"]["B"], p["point"]["Sk"]) for p in per_point.values() if p["point"]["Sq"] == 1}):
        cu = baselines.get(f"Sq1 B{b} Sk{sk}", {}).get("sdpa-cudnn")
        v = get(1, b, sk)
        line(f"Sq1 B{b} Sk{sk} x cuDNN", v / cu if v and cu else None, TARGETS["sq1_vs_cudnn"])
    line("Sq1 B8 Sk131072 TB/s", get(1, 8, 131072), TARGETS["b8_128k_sq1"])
    line("Sq1 B1 Sk131072 TB/s", get(1, 1, 131072), TARGETS["b1_128k_sq1"])
    for b, sk in sorted({(p["point"]["B"], p["point"]["Sk"]) for p in per_point.values() if p["point"]["Sq"] == 8}):
        line(f"Sq8 B{b} Sk{sk} TB/s", get(8, b, sk), TARGETS["sq8"])
    for p in per_point.values():
        pt = p["point"]
        if pt["layout"] != "contig":
            c = get(pt["Sq"], pt["B"], pt["Sk"])
            v = get(pt["Sq"], pt["B"], pt["Sk"], pt["layout"])
            line(f"Sq{pt['Sq']} B{pt['B']} Sk{pt['Sk']} {pt['layout']} / contig", v / c if v and c else None,
                 TARGETS["paged_vs_contig"])
    return out


def report(result: dict) -> str:
    """The text summary of a sweep result (see the module docstring)."""
    chosen = choose(result["trials"], result["points"])
    per_point, proposal = chosen["per_point"], chosen["proposal"]
    lines = [f"decode sweep: {result['environment'].get('gpu', '?')}, {result['seconds']} s, "
             f"{len(result['trials'])} trials ({sum(1 for t in result['trials'] if not t.get('ok', False))} "
             f"failed or wrong), timing: {result['timing']}",
             "", f"{'point':<28} {'heuristic':<32} {'best':<32} {'gain':>5} {'cuDNN':>6} {'flash':>6}"]
    for k, p in per_point.items():
        h, b = p["heuristic"], p["best"]
        base = result["baselines"].get(k.rsplit(" ", 1)[0], {}) if p["point"]["layout"] == "contig" else {}

        def cell(t):
            return f"{t['config']} x{t['num_splits']}: {t['tbps']:.2f}" if t else "-"
        gain = f"{b['tbps'] / h['tbps']:.2f}" if h and b else "-"
        lines.append(f"{k:<28} {cell(h):<32} {cell(b):<32} {gain:>5} "
                     + "".join(f"{base[c]:>7.2f}" if c in base else f"{'':>7}" for c in ("sdpa-cudnn", "sdpa-flash")))
    lines.append("TB/s of K/V bytes; 'x N': split count; gain: best / heuristic")
    lines += ["", "proposed tiles (geometric mean over the Sq's points of best-time ratio, at the "
              "candidate's heuristic split count; top 5):"]
    for sq, prop in sorted(proposal.items()):
        lines.append(f"  Sq{sq}: {prop['cand']} (score {prop['score']:.3f}); ranking "
                     + ", ".join(f"{c} {s:.3f}" for s, c in prop["ranking"][:5]))
    lines += ["", "paste into backends/triton/configs.py (replacing the entry):"]
    hq, hkv = (int(x) for x in result["heads"].split(":"))
    lines += ["  " + r for r in paste_rows(proposal, result.get("family", "hopper"), hq // hkv)] or ["  (nothing proposed)"]
    # split counts: how often the heuristic's count was the best for the best tile of each point
    lines += ["", "split counts at each point's best tile (heuristic's count -> best count, TB/s; the heuristic "
              "plans configs.decode_programs_per_sm programs per SM: 2 below 64 rows, 1 at 64):"]
    for k, p in per_point.items():
        b = p["best"]
        if b:
            same = [t for t in result["trials"] if t.get("ok") and t["point"] == k and t["cand"] == b["cand"]]
            h = next((t for t in same if t["heuristic_splits"]), None)
            per_sm = b.get("programs", 0) / max(1, result.get("sm_count", 1))
            lines.append(f"  {k:<28} {b['cand']}: " + (f"x{h['num_splits']} {h['tbps']:.2f} -> " if h else "")
                         + f"x{b['num_splits']} {b['tbps']:.2f} ({per_sm:.1f} programs per SM)  ("
                         + ", ".join(f"x{t['num_splits']} {t['tbps']:.2f}" for t in same) + ")")
    now = {k: p["heuristic"]["tbps"] for k, p in per_point.items() if p["heuristic"]}
    prop_numbers = {k: t["tbps"] for prop in proposal.values() for k, t in prop["per_point"].items()}
    for k, v in now.items():   # a point whose Sq has no proposal keeps the current numbers
        prop_numbers.setdefault(k, v)
    best = {k: p["best"]["tbps"] for k, p in per_point.items() if p["best"]}
    for name, nums in (("current table and heuristic", now), ("with the proposed rows pasted", prop_numbers),
                       ("best found per point (not one table)", best)):
        lines += ["", f"verdict, {name}:"] + verdict(per_point, nums, result["baselines"])
    return "\n".join(lines)


# ----- the GPU (or interpreter) part ------------------------------------------------------------

def run(pts: list[dict], device: str = "cuda", timer=None, time_limit: float = 170.0, progress=print,
        tiny: bool = False, max_candidates: int | None = None, sweep=None) -> dict:
    """Time the heuristic, the candidates and the SDPA baselines at ``pts``; the raw result.
    ``sweep``: the trial order (default :func:`_sweep`, the tile candidates; ``--variants``:
    :func:`decode_variants.sweep`)."""
    from portattn.backends.triton import decode
    from portattn.backends.triton.configs import _nvidia_family, device_target

    from portattn.kvcache import build_kvcache_spec
    from portattn.numerics import compare
    t0 = time.time()
    deadline = t0 + time_limit
    if timer is None:
        def timer(fns):
            return bench.queued_ms(fns, calls=CALLS, repeats=REPEATS)
    hq, hkv, d = (4, 2, 16) if tiny else (bench.HQ, bench.HKV, bench.D)
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    host_gen = torch.Generator().manual_seed(1)
    sms = decode._sm_count(device, 0 if device == "cuda" else None)
    target = device_target(torch.device(device, 0) if device == "cuda" else torch.device(device))
    family = _nvidia_family(int(target.arch)) if target.vendor == "nvidia" else str(target)
    problems, trials, baselines = {}, [], {}
    for b, sk in sorted({(p["B"], p["Sk"]) for p in pts}):     # caches shared by the Sq and the layouts
        k = torch.randn(b, sk, hkv, d, generator=gen, device=device).to(dtype)
        v = torch.randn(b, sk, hkv, d, generator=gen, device=device).to(dtype)
        copies = bench.rotations(bench.kv_bytes(b, sk, hkv, d)) if device == "cuda" else 1
        caches = bench.layouts(k, v, copies, host_gen, pages=sorted({int(p["layout"][5:]) for p in pts
                                                                     if p["layout"] != "contig"}))
        for sq in sorted({p["Sq"] for p in pts if (p["B"], p["Sk"]) == (b, sk)}):
            q = torch.randn(b, sq, hq, d, generator=gen, device=device).to(dtype)
            ref = bench.reference32(q, k, v, causal=True)
            lens = torch.full((b,), sk, dtype=torch.int32, device=device)
            problems[(b, sk, sq)] = (q, lens, caches, ref)
            base = baselines.setdefault(f"Sq{sq} B{b} Sk{sk}", {})
            ref_full = bench.reference32(q, k, v, causal=False)
            for impl in ("sdpa-cudnn", "sdpa-flash"):
                try:
                    fns = [bench._sdpa_fn(impl, q, kc, vc) for kc, vc, _ in caches["contig"]]
                    checked = bench.check(fns[0](), ref_full)
                    if checked["ok"]:
                        base[impl] = bench.tbps(bench.kv_bytes(b, sk, hkv, d), timer(fns)["ms"])
                    else:
                        base[impl + "-error"] = f"output differs from the float32 reference: {checked}"
                except Exception as exc:
                    base[impl + "-error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    progress(f"set up {len(problems)} problems in {time.time() - t0:.1f} s; baselines: {baselines}")

    def spec(p, splits):
        q, lens, caches, _ = problems[(p["B"], p["Sk"], p["Sq"])]
        return [build_kvcache_spec(q, kc, vc, cache_seqlens=lens, block_table=bt, causal=True, num_splits=splits)
                for kc, vc, bt in caches[p["layout"]]]

    def trial(p, cand_name, cfg, splits, heuristic_splits):
        kvs = spec(p, splits)
        entry = dict(point=_key(p), Sq=p["Sq"], cand=cand_name, heuristic_splits=heuristic_splits)
        try:
            plan = decode.plan_summary(kvs[0], cfg)
            entry.update(config=f"M{plan['block_m']} " + plan["config"].split(" ", 1)[1],
                         num_splits=plan["num_splits"], programs=plan["programs"], block_m=plan["block_m"])
            fns = [lambda kv=kv: decode.forward(kv, cfg) for kv in kvs]
            out = fns[0]()[0]
            ref = problems[(p["B"], p["Sk"], p["Sq"])][3]
            entry.update(bench.check(out, ref))
            if cfg is None and splits == 0:
                current_out.setdefault(entry["point"], out)
            elif entry["point"] in current_out:   # portattn.numerics.compare, the current rows as yardstick
                cmp = compare("out", out, ref, current_out[entry["point"]])
                entry["compare"] = str(cmp)
                entry["ok"] = entry["ok"] and cmp.passed
            if entry["ok"]:
                entry.update(timer(fns))
                entry["tbps"] = bench.tbps(bench.kv_bytes(p["B"], p["Sk"], hkv, d), entry["ms"])
        except Exception as exc:   # a tile that does not compile or fit: recorded, not fatal
            entry["ok"] = False
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        trials.append(entry)
        progress(f"{entry['point']:<28} {cand_name:<16} x{entry.get('num_splits', '?')}: "
                 + (f"{entry['tbps']:.2f} TB/s" if "tbps" in entry else entry.get("error", "WRONG")))
        return entry

    interrupted = False
    current_out = {}   # point -> the current rows' output (the yardstick of the others' compare)
    try:   # SIGINT (timeout -s INT) keeps the trials done so far
        (sweep or _sweep)(pts, trial, spec, deadline, progress, tiny, hq // hkv, max_candidates, sms, time_limit)
    except KeyboardInterrupt:
        interrupted = True
    return {"environment": bench.environment() if device == "cuda" else {"device": device},
            "family": family, "sm_count": sms, "points": pts, "trials": trials, "baselines": baselines,
            "seconds": round(time.time() - t0, 1), "time_limit": time_limit, "interrupted": interrupted,
            "timing": f"queued ({CALLS} calls x {REPEATS} runs; see bench_decode.TIMING_METHODS)"
            if device == "cuda" else "fake (interpreter)",
            "heads": f"{hq}:{hkv}", "head_dim": d, "dtype": "bf16"}


def _sweep(pts, trial, spec, deadline, progress, tiny, group, max_candidates, sms, time_limit):
    """The trials in their order: the heuristic at every point (what runs today), then the
    candidates, best guesses first, alternating between the Sq groups."""
    from portattn.backends.triton import decode
    for p in pts:
        if time.time() > deadline:
            break
        trial(p, "heuristic", None, 0, True)
    # candidates, best guesses first, alternating between the Sq groups
    queues = []
    for sq in sorted({p["Sq"] for p in pts}):
        grp = [p for p in pts if p["Sq"] == sq]
        plan = decode.plan_summary(spec(grp[0], 0)[0])
        heur = Cand(plan["block_m"], *(int(x[1:]) for x in plan["config"].split()[1:4]))
        cands = candidates(group * sq, heur, _TINY if tiny else None, max_candidates)
        queues.append([(c, grp) for c in cands])
    order = [item for tier in zip(*queues) for item in tier]
    longest = max(queues, key=len)
    order += longest[min(map(len, queues)):]
    skipped = 0
    for cand, grp in order:
        cfg = cand.config()
        for p in grp:
            if time.time() > deadline:
                skipped += 1
                continue
            kv0 = spec(p, 0)[0]
            try:
                plan = decode.plan_summary(kv0, cfg)
            except ValueError as exc:
                progress(f"{cand.short()}: {exc}")
                continue
            units = plan["programs"] // plan["num_splits"]
            opts = split_options(plan["num_splits"], units, -(-p["Sk"] // cand.block_n), sms, decode.MAX_SPLITS)
            for s in opts:
                if time.time() > deadline:
                    skipped += 1
                    break
                trial(p, cand.short(), cfg, s, s == plan["num_splits"])
    if skipped:
        progress(f"time limit ({time_limit:.0f} s) reached: {skipped} point/candidate pairs skipped")


def write_results(out: str, stem: str, result: dict, text: str) -> None:
    """``result`` as ``out/stem.json`` and the report ``text`` as ``out/stem.txt``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    with open(os.path.join(out, f"{stem}.txt"), "w") as fh:
        fh.write(text + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for decode-sweep.json and decode-sweep.txt")
    ap.add_argument("--time-limit", type=float, default=170.0,
                    help="seconds (set-up and compiles included) after which no new trial starts (default 170)")
    ap.add_argument("--max-candidates", type=int, default=None, help="tile candidates per Sq at most")
    ap.add_argument("--tiny", action="store_true", help="a toy grid (CPU tensors run under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print("decode_sweep needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    pts = points(args.tiny)
    timer = None
    if device == "cpu":
        def timer(fns):
            t = time.perf_counter()
            fns[0]()
            return {"ms": (time.perf_counter() - t) * 1e3}
    progress = bench._Progress(len(pts) * 40) if device == "cuda" else print
    try:
        result = run(pts, device, timer, args.time_limit, progress, args.tiny, args.max_candidates)
    finally:
        if hasattr(progress, "stop"):
            progress.stop()
    text = report(result)
    print(text)
    if args.out:
        write_results(args.out, "decode-sweep", result, text)
        print(f"\nwrote {args.out}/decode-sweep.json and decode-sweep.txt")
    return 0 if all(t.get("ok") for t in result["trials"] if t["cand"] == "heuristic") else 1


if __name__ == "__main__":
    sys.exit(main())
