"""The ``portattn`` command line: ``info``, ``explain``, ``check``, ``conformance``, ``bench``.

``check`` and ``conformance`` live in :mod:`portattn.conformance.cli`; ``bench`` runs
``benchmarks/bench_attention.py`` when portattn is used from a source checkout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys

import torch

from . import __version__, config
from .dispatch import explain_spec, priority_for
from .registry import get_backend, list_backends
from .spec import build_spec, device_vendor

_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64}


def _version(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # an optional package: report, never fail
        return f"not installed ({type(exc).__name__})"
    return getattr(mod, "__version__", "installed")


def _devices() -> list[str]:
    lines = ["cpu"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
            vendor = device_vendor(torch.device("cuda", i))
            lines.append(f"cuda:{i} {props.name} ({vendor}, {arch}, {props.multi_processor_count} SMs/CUs, "
                         f"{props.total_memory / 2**30:.0f} GiB)")
    return lines


def _runs_here(backend) -> list[tuple[str, str]]:
    """Whether an installed backend can run a small problem on each device of this machine
    (installed is not enough: triton on a CPU needs its interpreter, cupy needs a GPU, ...)."""
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    verdicts = []
    for device in devices:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        q = torch.empty(1, 16, 2, 64, dtype=dtype, device=device)
        reasons = backend.not_supported_reasons(build_spec(q, q, q, causal=True))
        verdicts.append((str(device), "runs" if not reasons else "cannot run: " + "; ".join(reasons)))
    return verdicts


def cmd_info(args) -> int:
    print(f"portattn {__version__}  python {platform.python_version()}  {platform.platform()}")
    cuda = torch.version.cuda or "-"
    hip = getattr(torch.version, "hip", None) or "-"
    print(f"torch {torch.__version__} (CUDA {cuda}, HIP {hip})")
    for mod in ("triton", "cupy", "onnx", "onnxruntime", "onnxscript", "hypothesis", "rich"):
        print(f"{mod} {_version(mod)}")
    print("\ndevices:")
    for line in _devices():
        print(f"  {line}")
    set_vars = {k: os.environ[k] for k in config.VARIABLES if k in os.environ}
    if set_vars or os.environ.get("TRITON_INTERPRET"):
        print("\nenvironment:")
        for k, v in set_vars.items():
            print(f"  {k}={v}")
        if os.environ.get("TRITON_INTERPRET"):
            print(f"  TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}")
    print("\nbackends:")
    for name in list_backends():
        backend = get_backend(name)
        reasons = backend.availability()
        status = "available" if not reasons else "unavailable: " + "; ".join(reasons)
        print(f"  {name:<14} {status}")
        if not reasons:
            for device, verdict in _runs_here(backend):
                print(f"  {'':<14} {device}: {verdict}")
            caps = backend.capabilities()
            print(f"  {'':<14} dtypes={','.join(caps['dtypes'])} head_dims={caps['head_dims'][0]}.."
                  f"{caps['head_dims'][1]} vendors={','.join(caps['vendors'])} backward={caps['has_backward']}")
            print(f"  {'':<14} features={','.join(caps['features']) or '-'}")
    print("\npriority:")
    vendors = {"cpu"} | {device_vendor(torch.device("cuda"))} if torch.cuda.is_available() else {"cpu"}
    for vendor in sorted(vendors):
        print(f"  {vendor}: {' > '.join(priority_for(vendor))}")
    return 0


def _explain_tensors(args):
    dtype = _DTYPES[args.dtype]
    device = torch.device(args.device)
    hkv = args.kv_heads or args.heads
    sk = args.seqlen_k or args.seqlen_q
    dv = args.head_dim_v or args.head_dim
    kw = {}
    if args.varlen:
        total_q, total_k = args.batch * args.seqlen_q, args.batch * sk
        q = torch.empty(total_q, args.heads, args.head_dim, dtype=dtype, device=device)
        k = torch.empty(total_k, hkv, args.head_dim, dtype=dtype, device=device)
        v = torch.empty(total_k, hkv, dv, dtype=dtype, device=device)
        kw["cu_seqlens_q"] = torch.arange(0, total_q + 1, args.seqlen_q, dtype=torch.int32, device=device)
        kw["cu_seqlens_k"] = torch.arange(0, total_k + 1, sk, dtype=torch.int32, device=device)
    else:
        q = torch.empty(args.batch, args.seqlen_q, args.heads, args.head_dim, dtype=dtype, device=device)
        k = torch.empty(args.batch, sk, hkv, args.head_dim, dtype=dtype, device=device)
        v = torch.empty(args.batch, sk, hkv, dv, dtype=dtype, device=device)
    q.requires_grad_(args.grad)
    if args.alibi:
        kw["alibi_slopes"] = torch.ones(args.heads, device=device)
    if args.bias != "none":
        shape = (args.batch, 1, 1, sk)
        kw["attn_bias"] = (torch.zeros(shape, dtype=dtype, device=device) if args.bias == "float"
                           else torch.ones(shape, dtype=torch.bool, device=device))
    if args.window is not None:
        kw["window"] = tuple(args.window)
    return q, k, v, kw


def _checked_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r} is not a torch device ({exc}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this machine has no CUDA/ROCm device that torch can use "
                             f"(torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def cmd_explain(args) -> int:
    _checked_device(args.device)
    q, k, v, kw = _explain_tensors(args)
    spec = build_spec(q, k, v, causal=args.causal, causal_alignment=args.alignment, softcap=args.softcap, **kw)
    exp = explain_spec(spec, args.backend)
    print(exp)
    return 0 if exp.selected else 1


def cmd_bench(args) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(os.path.dirname(here), "benchmarks", "bench_attention.py")
    if not os.path.exists(script):
        print("portattn bench runs benchmarks/bench_attention.py from a source checkout of portattn; "
              "it was not found next to this installation", file=sys.stderr)
        return 2
    import runpy
    sys.argv = [script, *args.rest]
    runpy.run_path(script, run_name="__main__")
    return 0


def _size(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be >= {minimum}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="portattn", description="portattn: portable exact attention")
    parser.add_argument("--version", action="version", version=f"portattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, devices, and every backend's availability")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("explain", help="which backend a problem would use, and why not the others")
    p.add_argument("--batch", type=_size(0), default=2)
    p.add_argument("--seqlen-q", type=_size(0), default=1024)
    p.add_argument("--seqlen-k", type=_size(0), default=None, help="default: --seqlen-q")
    p.add_argument("--heads", type=_size(1), default=16)
    p.add_argument("--kv-heads", type=_size(1), default=None, help="default: --heads (GQA when fewer)")
    p.add_argument("--head-dim", type=_size(1), default=128)
    p.add_argument("--head-dim-v", type=_size(1), default=None)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--alignment", choices=["bottom_right", "top_left"], default="bottom_right")
    p.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=None)
    p.add_argument("--softcap", type=float, default=None)
    p.add_argument("--alibi", action="store_true")
    p.add_argument("--bias", choices=["none", "float", "bool"], default="none")
    p.add_argument("--varlen", action="store_true")
    p.add_argument("--grad", action="store_true", help="a gradient is needed")
    p.add_argument("--backend", default=None, help="explain a pinned backend")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("bench", help="run the benchmark (benchmarks/bench_attention.py; needs a GPU)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    from . import tuning
    p = sub.add_parser("tune", help="pre-fill the fastest policy's cache for shapes or a model's shapes")
    tuning.add_arguments(p)
    p.set_defaults(func=tuning.run)

    try:
        from .conformance.cli import register
    except ImportError as exc:
        p = sub.add_parser("check", help="unavailable: " + str(exc))
        p.set_defaults(func=lambda a, e=exc: (print(f"portattn check is unavailable: {e}", file=sys.stderr), 2)[1])
    else:
        register(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:   # every argument after `bench` is the benchmark's (REMAINDER drops leading options)
        return cmd_bench(argparse.Namespace(rest=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"portattn {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`portattn conformance list | head`): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
