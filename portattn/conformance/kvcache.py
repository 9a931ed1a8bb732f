"""Conformance of :func:`portattn.kvcache.attention_with_kvcache` against the float64 reference.

A :class:`KVProblem` describes one decoding step (sizes, cache lengths before the append, new
keys, contiguous or paged cache, masking); :func:`make_inputs` draws its tensors from a seeded
generator on the CPU (the same bits on every machine) and poisons every cache slot that no
sequence may read with NaN: slots at or beyond each length, pages no sequence owns, and the
pages of a paged cache are shuffled so that a wrong page lookup reads the wrong keys.

:func:`oracle` computes the expected result independently of portattn's KV-cache code: per
sequence it concatenates the cache's first ``cache_seqlens[b]`` keys (following the block table
by hand) with the new ones and runs the dense reference (float64) and naive (input dtype)
math; it also gives the caches as they must be after the in-place append. :func:`check_kvcache`
runs one backend and compares out and lse under the §3 rule (docs/semantics.md) and the caches
exactly. :func:`kv_catalogue` is the fixed case list (cache lengths 0, 1 and full, page sizes
16 and 256, appended keys, NaN in unused slots, GQA, Sq up to 16, windows, softcap, ALiBi);
:func:`kv_problem_strategy` draws problems for Hypothesis.

    python -m portattn.conformance.kvcache --backends reference,sdpa,triton [--devices cpu,cuda]
    portattn conformance kvcache ...                                     (the same)
"""

from __future__ import annotations

import argparse
import sys
import zlib
from dataclasses import dataclass, replace

import torch

from ..numerics import Comparison, compare, compare_lse
from ..reference import naive_forward, reference_forward
from ..spec import build_spec
from .problems import DTYPES

KV_CATALOGUE_VERSION = "1"


@dataclass(frozen=True)
class KVProblem:
    """One KV-cache step. ``lengths``: each sequence's cache length before the append (its
    count is the batch); ``seqlen_new`` new keys are appended. ``page_size`` None is a contiguous
    cache of ``capacity`` slots; else ``pages_per_seq`` pages of ``page_size`` per sequence in a
    pool of ``pages_per_seq * batch + spare_pages`` pages (capacity = pages_per_seq·page_size)."""

    lengths: tuple[int, ...] = (5, 0)
    seqlen_q: int = 1
    seqlen_new: int = 1
    heads_q: int = 4
    heads_kv: int = 2
    head_dim: int = 32
    head_dim_v: int | None = None
    dtype: str = "float16"
    capacity: int = 64
    page_size: int | None = None
    pages_per_seq: int = 4
    spare_pages: int = 2
    causal: bool = True
    alignment: str = "bottom_right"
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi: bool = False
    magnitude: float = 1.0
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def cap(self) -> int:
        return self.capacity if self.page_size is None else self.pages_per_seq * self.page_size

    def kwargs(self) -> dict:
        """Keyword arguments of attention_with_kvcache besides the tensors."""
        return dict(causal=self.causal, causal_alignment=self.alignment, window=self.window, softcap=self.softcap)


def make_inputs(p: KVProblem, device="cpu") -> dict:
    """The tensors of ``p`` on ``device``: q, k_cache, v_cache, k, v (None when seqlen_new is 0),
    cache_seqlens (int32), block_table (int32 or None), alibi_slopes (or None)."""
    if any(n < 0 or n + p.seqlen_new > p.cap for n in p.lengths):
        raise ValueError(f"cache lengths {p.lengths} + {p.seqlen_new} new keys exceed the capacity {p.cap}")
    g = torch.Generator().manual_seed(p.seed)
    dt = DTYPES[p.dtype]
    b, hkv = p.batch, p.heads_kv

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * p.magnitude).to(dt)

    q = rand(b, p.seqlen_q, p.heads_q, p.head_dim)
    k_new = rand(b, p.seqlen_new, hkv, p.head_dim) if p.seqlen_new else None
    v_new = rand(b, p.seqlen_new, hkv, p.dv) if p.seqlen_new else None
    lengths = torch.tensor(p.lengths, dtype=torch.int32)
    if p.page_size is None:
        k_cache, v_cache = rand(b, p.cap, hkv, p.head_dim), rand(b, p.cap, hkv, p.dv)
        block_table = None
        for i, n in enumerate(p.lengths):
            k_cache[i, n:] = float("nan")
            v_cache[i, n:] = float("nan")
    else:
        pool = p.pages_per_seq * b + p.spare_pages
        k_cache, v_cache = rand(pool, p.page_size, hkv, p.head_dim), rand(pool, p.page_size, hkv, p.dv)
        block_table = torch.randperm(pool, generator=g)[: p.pages_per_seq * b].view(b, p.pages_per_seq).to(torch.int32)
        owned = torch.zeros(pool, p.page_size, dtype=torch.bool)
        for i, n in enumerate(p.lengths):
            for pos in range(n):
                owned[block_table[i, pos // p.page_size], pos % p.page_size] = True
        k_cache[~owned] = float("nan")
        v_cache[~owned] = float("nan")
    slopes = (torch.rand(p.heads_q, generator=g) * 0.5 + 0.05) if p.alibi else None
    out = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
               block_table=block_table, alibi_slopes=slopes)
    return {name: (t.to(device) if t is not None else None) for name, t in out.items()}


def _positions(p: KVProblem, inputs: dict, b: int, n: int):
    """(axis-0, axis-1) cache indices of the first n positions of sequence b (plain Python)."""
    if p.page_size is None:
        return [b] * n, list(range(n))
    table = inputs["block_table"][b].tolist()   # the oracle may read on the host
    return [table[j // p.page_size] for j in range(n)], [j % p.page_size for j in range(n)]


def oracle(p: KVProblem, inputs: dict, device="cpu"):
    """``(ref_out float64 (B,Sq,Hq,Dv), ref_lse, naive_out, k_cache_after, v_cache_after)``,
    computed from ``inputs`` (not modified) sequence by sequence on ``device`` (the CPU by
    default; a GPU makes long caches affordable)."""
    cpu = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    k_after, v_after = cpu["k_cache"].clone(), cpu["v_cache"].clone()
    refs, lses, naives = [], [], []
    for b, n in enumerate(p.lengths):
        i0, i1 = _positions(p, cpu, b, n + p.seqlen_new)
        keys = cpu["k_cache"][i0[:n], i1[:n]]
        vals = cpu["v_cache"][i0[:n], i1[:n]]
        if p.seqlen_new:
            keys = torch.cat([keys, cpu["k"][b]], 0)
            vals = torch.cat([vals, cpu["v"][b]], 0)
            k_after[i0[n:], i1[n:]] = cpu["k"][b]
            v_after[i0[n:], i1[n:]] = cpu["v"][b]
        spec_kw = dict(p.kwargs(), alibi_slopes=cpu["alibi_slopes"], return_lse=True)
        qb = cpu["q"][b:b + 1]
        kb, vb = keys.unsqueeze(0), vals.unsqueeze(0)
        ref, lse = reference_forward(build_spec(qb.double(), kb.double(), vb.double(), **spec_kw))
        naive, _ = naive_forward(build_spec(qb, kb, vb, **spec_kw))
        refs.append(ref)
        lses.append(lse)
        naives.append(naive)
    return torch.cat(refs), torch.cat(lses), torch.cat(naives), k_after, v_after


def _cache_check(name: str, got: torch.Tensor, want: torch.Tensor) -> Comparison:
    got = got.to(want.device)
    same = torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(want, nan=7.0)) and \
        torch.equal(torch.isnan(got), torch.isnan(want))
    return Comparison(name, same, 0.0 if same else float("inf"), 0.0, 0.0,
                      "" if same else "cache contents after the append differ from the expected ones")


def check_kvcache(p: KVProblem, backend: str | None, device="cpu", *, inputs: dict | None = None,
                  num_splits: int = 0) -> list[Comparison]:
    """Run ``attention_with_kvcache`` on ``backend`` and compare out, lse and both caches
    (``num_splits`` > 0 forces a split count on split-KV kernels)."""
    from ..kvcache import build_kvcache_spec, run_kvcache
    inputs = inputs or make_inputs(p, device)
    ref, ref_lse, naive, k_after, v_after = oracle(p, inputs, device)
    kw = dict(p.kwargs(), cache_seqlens=inputs["cache_seqlens"], block_table=inputs["block_table"],
              alibi_slopes=inputs["alibi_slopes"], return_lse=True, num_splits=num_splits)
    kv = build_kvcache_spec(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["k"], inputs["v"], **kw)
    out, lse = run_kvcache(kv, backend)
    return [compare("out", out, ref, naive), compare_lse(lse, ref_lse),
            _cache_check("k_cache", inputs["k_cache"], k_after), _cache_check("v_cache", inputs["v_cache"], v_after)]


# ----- the fixed case list -------------------------------------------------------------------

def _seed(case_id: str) -> int:
    return zlib.crc32(case_id.encode()) & 0x7FFFFFFF


def kv_catalogue() -> list[tuple[str, KVProblem]]:
    """Every KV-cache conformance case ``(id, problem)`` of :data:`KV_CATALOGUE_VERSION` (sizes
    the Triton interpreter affords on a CPU)."""
    cases: list[tuple[str, KVProblem]] = []

    def add(case_id, **kw):
        cases.append((f"kvcache/{case_id}", KVProblem(**kw, seed=_seed(case_id))))

    dts = ("float16", "bfloat16", "float32")
    # cache lengths 0, 1 and full, with and without appended keys, contiguous and paged 16 / 256
    for layout, extra in (("contig", dict(capacity=64)), ("page16", dict(page_size=16, pages_per_seq=4)),
                          ("page256", dict(page_size=256, pages_per_seq=1, spare_pages=1))):
        cap = extra.get("capacity") or extra["page_size"] * extra["pages_per_seq"]
        for new, dt in ((0, "float16"), (1, "bfloat16"), (3, "float32")):
            add(f"{layout}/lengths-0-1-full/new{new}",
                lengths=(0, 1, cap - new), seqlen_new=new, dtype=dt, **extra)
        add(f"{layout}/sq4-spec/gqa4", lengths=(cap // 2, 7), seqlen_q=4, seqlen_new=4, heads_q=8, heads_kv=2,
            dtype=dts[len(cases) % 3], **extra)
    add("sq16/gqa8/causal", lengths=(40, 3), seqlen_q=16, seqlen_new=16, heads_q=8, heads_kv=1, head_dim=64,
        capacity=96, dtype="bfloat16")
    add("sq8/no-causal", lengths=(20, 0), seqlen_q=8, seqlen_new=2, causal=False, page_size=16, dtype="float16")
    add("sq8-gt-keys/causal", lengths=(0, 2), seqlen_q=8, seqlen_new=1, capacity=16, dtype="float32")
    add("sq3/top-left", lengths=(10, 1), seqlen_q=3, seqlen_new=1, alignment="top_left", capacity=32)
    add("window/left8", lengths=(50, 5), seqlen_q=2, seqlen_new=2, window=(8, 0), page_size=16, dtype="bfloat16")
    add("window/band-no-causal", lengths=(30, 12), seqlen_q=4, seqlen_new=0, causal=False, window=(6, 2),
        capacity=48)
    add("softcap/5", lengths=(33, 9), seqlen_q=2, seqlen_new=1, softcap=5.0, magnitude=3.0, capacity=48)
    add("alibi/causal", lengths=(25, 60), seqlen_q=1, seqlen_new=1, alibi=True, page_size=16, dtype="float32")
    add("headdim/d40-dv24", lengths=(17, 4), seqlen_q=2, seqlen_new=1, head_dim=40, head_dim_v=24, capacity=40)
    add("mqa/hq8-hkv1/d128", lengths=(60, 31), seqlen_q=1, seqlen_new=1, heads_q=8, heads_kv=1, head_dim=128,
        page_size=32, pages_per_seq=2, dtype="bfloat16")
    add("batch4/mixed", lengths=(0, 63, 17, 1), seqlen_q=1, seqlen_new=1, heads_q=2, heads_kv=2, capacity=64)
    return cases


def kv_problem_strategy(max_len: int = 80, dtypes=("float16", "bfloat16", "float32")):
    """Hypothesis strategy of :class:`KVProblem` (small sizes: the Triton interpreter runs them)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw_):
        batch = draw_(st.integers(1, 3))
        hkv = draw_(st.sampled_from((1, 2)))
        hq = hkv * draw_(st.sampled_from((1, 2, 4)))
        sq = draw_(st.sampled_from((1, 1, 2, 4, 16)))
        new = draw_(st.sampled_from((0, 1, sq)))
        paged = draw_(st.booleans())
        if paged:
            page = draw_(st.sampled_from((16, 32, 256)))
            pages = max(1, min(4, -(-max_len // page)))
            layout = dict(page_size=page, pages_per_seq=pages)
            cap = page * pages
        else:
            cap = draw_(st.integers(max(1, new), max_len))
            layout = dict(capacity=cap)
        lengths = tuple(draw_(st.sampled_from((0, 1, cap - new, draw_(st.integers(0, cap - new)))))
                        for _ in range(batch))
        window = draw_(st.sampled_from((None, None, (4, 0), (10, None))))
        causal = draw_(st.booleans())
        if window is not None and window[1] is None and causal:
            window = (window[0], 0)
        return KVProblem(lengths=lengths, seqlen_q=sq, seqlen_new=new, heads_q=hq, heads_kv=hkv,
                         head_dim=draw_(st.sampled_from((16, 32, 40, 64))), dtype=draw_(st.sampled_from(dtypes)),
                         causal=causal, alignment=draw_(st.sampled_from(("bottom_right", "bottom_right", "top_left"))),
                         window=window, softcap=draw_(st.sampled_from((None, None, 4.0))),
                         alibi=draw_(st.booleans()), seed=draw_(st.integers(0, 2**31 - 1)), **layout)

    return draw()


# ----- stand-alone runner --------------------------------------------------------------------

def run(backends: list[str], devices: list[str], patterns: list[str] | None = None, out=sys.stdout) -> list[dict]:
    """Every catalogue case x backend x device: one row each (``verdict`` pass / fail / skip)."""
    from ..errors import BackendNotAvailableError
    rows = []
    for case_id, problem in kv_catalogue():
        if patterns and not any(pat in case_id for pat in patterns):
            continue
        for device in devices:
            for backend in backends:
                row = dict(case=case_id, backend=backend, device=device, verdict="pass", detail="")
                try:
                    results = check_kvcache(replace(problem), backend, device)
                    bad = [r for r in results if not r.passed]
                    if bad:
                        row.update(verdict="fail", detail="; ".join(map(str, bad)))
                    else:
                        row["score"] = results[0].score
                except BackendNotAvailableError as exc:
                    row.update(verdict="skip", detail=str(exc).splitlines()[-2].strip() if "\n" in str(exc) else str(exc))
                rows.append(row)
                print(f"{row['verdict']:<5} {backend:<10} {device:<5} {case_id} {row['detail'][:200]}", file=out,
                      flush=True)
    return rows


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default="reference,sdpa,triton", help="comma-separated backend names")
    parser.add_argument("--devices", default=None, help="comma-separated; default: cpu, and cuda when present")
    parser.add_argument("--cases", default=None, help="comma-separated id substrings")
    parser.add_argument("--json", default=None, help="write the rows to this file")


def cmd_kvcache(args) -> int:
    """Run the KV-cache cases; exit 1 on any failure."""
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if "cpu" in devices and not torch.cuda.is_available():
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
    rows = run(args.backends.split(","), devices, args.cases.split(",") if args.cases else None)
    if args.json:
        import json
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    failed = [r for r in rows if r["verdict"] == "fail"]
    print(f"kvcache conformance v{KV_CATALOGUE_VERSION}: {sum(r['verdict'] == 'pass' for r in rows)} pass, "
          f"{len(failed)} fail, {sum(r['verdict'] == 'skip' for r in rows)} skip")
    return 1 if failed else 0


def register(subparsers) -> None:
    """Add ``kvcache`` to ``portattn conformance``'s subcommands."""
    p = subparsers.add_parser("kvcache", help="run the KV-cache (decoding) cases against the reference",
                              description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    p.set_defaults(func=cmd_kvcache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portattn.conformance.kvcache", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    return cmd_kvcache(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
