"""``portattn tune``: pre-fill the fastest policy's cache (portattn/tuning.py) for a list of
shapes, or for a model's shapes (heads, KV heads, head dim, or a Hugging Face config.json, with
batch sizes, training/prefill sequence lengths and decode cache lengths), with a progress bar
when ``rich`` is installed.

    portattn tune --shape 4,4096,4096,16,16,128 --causal --grad both
    portattn tune --config config.json --batch 1,8 --seqlen 2048 --kv-len 8192,32768 --causal
"""

from __future__ import annotations

import contextlib
import json

import torch

from .spec import build_spec
from .tuning import (
    _store,
    clear,
    format_timings,
    recheck,
    recheck_due,
    supported_candidates,
    timing_details,
    tune,
)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _model_config(path: str) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) from a Hugging Face ``config.json``."""
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    try:
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--config {path}: needs num_attention_heads and head_dim or hidden_size "
                         f"(and optionally num_key_value_heads); {type(exc).__name__}: {exc}") from None
    return heads, kv, head_dim

def add_arguments(parser) -> None:
    """The arguments of ``portattn tune``."""
    parser.description = ("Pre-fill the fastest policy's cache (PORTATTN_CACHE_DIR) for shapes given as "
                          "--shape B,Sq,Sk,Hq,Hkv,D[,Dv], or for a model: --heads/--kv-heads/--head-dim with "
                          "--batch, --seqlen (training/prefill: Sq = Sk) and --kv-len/--q-len (decoding).")
    parser.add_argument("--shape", action="append", default=[], metavar="B,Sq,Sk,Hq,Hkv,D[,Dv]",
                        help="one problem shape (repeatable)")
    parser.add_argument("--config", help="model: a Hugging Face config.json (heads, kv heads, head dim)")
    parser.add_argument("--heads", type=int, help="model: query heads")
    parser.add_argument("--kv-heads", type=int, help="model: key/value heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, help="model: head dim")
    parser.add_argument("--batch", default="1", help="model: batch sizes, comma-separated")
    parser.add_argument("--seqlen", default="", help="model: training/prefill sequence lengths (Sq = Sk)")
    parser.add_argument("--kv-len", default="", help="model: decode cache lengths Sk")
    parser.add_argument("--q-len", default="1", help="model: decode query lengths Sq (with --kv-len)")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--alignment", choices=["bottom_right", "top_left"], default="bottom_right")
    parser.add_argument("--grad", choices=["no", "yes", "both"], default="no",
                        help="tune the forward, forward+backward, or both")
    parser.add_argument("--backends", default=None, help="restrict the candidates (comma-separated)")
    parser.add_argument("--show", action="store_true", help="print what the cache holds for this device and exit")
    parser.add_argument("--clear", action="store_true", help="delete the cache files first")


def _shapes(args) -> list[tuple[int, ...]]:
    shapes = []
    for text in args.shape:
        dims = _ints(text)
        if len(dims) not in (6, 7) or min(dims) < 1:
            raise ValueError(f"--shape {text!r}: expected B,Sq,Sk,Hq,Hkv,D[,Dv], all >= 1")
        shapes.append(tuple(dims) if len(dims) == 7 else (*dims, dims[5]))
    if getattr(args, "config", None):
        args.heads, args.kv_heads, args.head_dim = _model_config(args.config)
    if args.heads or args.head_dim:
        if not (args.heads and args.head_dim):
            raise ValueError("a model needs both --heads and --head-dim")
        hkv = args.kv_heads or args.heads
        for b in _ints(args.batch):
            shapes += [(b, s, s, args.heads, hkv, args.head_dim, args.head_dim) for s in _ints(args.seqlen)]
            shapes += [(b, sq, sk, args.heads, hkv, args.head_dim, args.head_dim)
                       for sk in _ints(args.kv_len) for sq in _ints(args.q_len)]
    return shapes


def _progress():
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn())


def _row(label: str, spec) -> tuple:
    """``(label, winner, timing lines)`` of a tuned class, as :func:`run` prints it."""
    info = timing_details(spec)
    return label, info.get("winner"), format_timings(info).split("\n", 1)[-1]


def run(args) -> int:
    """Time each shape's class (skipping classes already cached) and print the winners."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    if args.clear:
        for path in clear(disk=True):
            print(f"removed {path}")
    if args.show:
        store = _store(device)
        print(f"{store.path}: {len(store.entries)} classes")
        for key, entry in sorted(store.entries.items()):
            print(f"  {key}: {entry.get('winner')}")
        return 0
    shapes = _shapes(args)
    if not shapes:
        raise ValueError("nothing to tune: give --shape B,Sq,Sk,Hq,Hkv,D or a model (--heads, --head-dim, "
                         "--seqlen and/or --kv-len)")
    modes = {"no": [False], "yes": [True], "both": [False, True]}[args.grad]
    jobs = [(s, g) for s in shapes for g in modes]
    restrict = [n.strip() for n in args.backends.split(",")] if args.backends else None
    rows = []
    bar = _progress()
    with bar or contextlib.nullcontext():
        task = bar.add_task("tuning", total=len(jobs)) if bar else None
        def problem(job):
            (b, sq, sk, hq, hkv, d, dv), grad = job
            q = torch.randn(b, sq, hq, d, dtype=dtype, device=device, requires_grad=grad)
            k = torch.randn(b, sk, hkv, d, dtype=dtype, device=device, requires_grad=grad)
            v = torch.randn(b, sk, hkv, dv, dtype=dtype, device=device, requires_grad=grad)
            return build_spec(q, k, v, causal=args.causal, causal_alignment=args.alignment)

        provisional = []
        for i, ((b, sq, sk, hq, hkv, d, dv), grad) in enumerate(jobs):
            label = f"B={b} Sq={sq} Sk={sk} H={hq}/{hkv} D={d}{'/' + str(dv) if dv != d else ''} " \
                    f"{'fwd+bwd' if grad else 'fwd'}"
            spec = problem(jobs[i])
            candidates = supported_candidates(spec)
            if restrict is not None:
                candidates = [n for n in candidates if n in restrict]
            if not candidates:
                rows.append((label, None, "  no candidate backend can run it (portattn explain says why)"))
                continue

            def step(name, label=label, i=i):
                if bar:
                    bar.update(task, description=f"{label}: {name}")
                else:
                    print(f"[{i + 1}/{len(jobs)}] {label}: {name}", flush=True)
            tune(spec, candidates, progress=step)
            if recheck_due(spec):
                provisional.append((len(rows), i, candidates))
            rows.append(_row(label, spec))
            if bar:
                bar.advance(task)
            del spec
        # the second look at the classes whose first timing was close (tuning.RECHECK_WITHIN), after
        # the others were timed: later than their first timing, as at a program's later calls
        for row, i, candidates in provisional:
            spec = problem(jobs[i])
            if bar:
                bar.update(task, description=f"{rows[row][0]}: second look")
            recheck(spec, candidates, force=True)
            rows[row] = _row(rows[row][0], spec)
            del spec
    for label, winner, detail in rows:
        print(f"{label}: {winner or '-'}\n{detail}")
    print(f"cache: {_store(device).path}\nuse it with PORTATTN_BACKEND=fastest (or backend='fastest')")
    return 0
