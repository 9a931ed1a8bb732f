"""Does a Triton kernel refactor change the machine code? Compile the portability cases of some
kernels in this tree and in a base git revision, and compare their assembly (no GPU needed).
``gluon_fwd`` / ``gluon_bwd`` stand for every variant of the Hopper Gluon kernels (sm_90 only).

    python tools/same_code.py --base HEAD~1 --kernels decode_split
    python tools/same_code.py --base main --kernels attn_fwd --targets sm_90 sm_80 --quick
    python tools/same_code.py --base main --kernels gluon_fwd gluon_bwd --targets sm_90

A refactor that only moves code (a helper instead of copies) must compile to the same
instructions; when it does for every case, the earlier GPU runs still describe it and it needs
no new one. Each case (``portattn.backends.triton.portability.cases``, filtered by kernel and
target) is compiled in a fresh interpreter per tree, the base from a temporary
``git worktree``; the PTX (NVIDIA) or AMDGCN (AMD) is compared with debug line information and
comments removed (they move with the source). Prints one line per case and a verdict; exit 0
when every case compiled to the same code in both trees, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# run inside each tree: compile the selected cases, print {case: ["ok", assembly] or ["error", why]}
_WORKER = r"""
import json, sys
import triton
from portattn.backends.triton import portability as p, kernels, decode

kernels_wanted, targets, quick = json.loads(sys.argv[1])
out = {}

def record(key, compile_one):
    try:
        asm = compile_one().asm
    except Exception as exc:
        out[key] = ["error", f"{type(exc).__name__}: {exc}"[:200]]
        return
    out[key] = ["ok", asm.get("ptx") or asm.get("amdgcn", "")]

if "gluon_fwd" in kernels_wanted and "sm_90" in targets:   # every variant the host can launch
    from portattn.backends.triton import gluon_fwd as gf
    for d in gf.HEAD_DIMS:
        for causal, br in ((False, True), (True, True), (True, False)):
            for pp in (False, True):
                for res in (False, True):
                    for pers in (False, True) if d in gf.PERSISTENT_HEAD_DIMS else (False,):
                        record(f"gluon_fwd d{d} causal={causal} bottom_right={br} pingpong={pp} residual={res} "
                               f"persistent={pers} sm_90",
                               lambda: gf.compile_for(d, causal=causal, pingpong=pp, residual=res,
                                                      persistent=pers, bottom_right=br))
if "gluon_bwd" in kernels_wanted and "sm_90" in targets:
    from portattn.backends.triton import gluon_bwd as gb
    for d in gb.HEAD_DIMS:
        for kernel in gb.kernels_for(d):
            for causal in (False, True):
                for gqa in (False, True) if kernel != "dq" else (False,):
                    record(f"gluon_bwd {kernel} d{d} causal={causal} gqa={gqa} sm_90",
                           lambda: gb.compile_for(kernel, d, causal=causal, gqa=gqa))
for case in p.cases(quick=quick):
    if case.kernel not in kernels_wanted or str(case.target) not in targets:
        continue
    mod = decode if case.kernel in p.DECODE_KERNELS else kernels
    fn = getattr(mod, case.kernel)
    sig = p._decode_signature(fn, case) if case.kernel in p.DECODE_KERNELS else p._signature(fn, case)
    record(f"{case.kernel} {case.describe()} {case.target}",
           lambda: triton.compile(p._ast_source(fn, *sig), target=p._gpu_target(case.target),
                                  options=case.config.launch_options()))
print(json.dumps(out))
"""


def normalized(asm: str, ignore_params: bool = False) -> list[str]:
    """The instructions and directives of a PTX or AMDGCN text, without what moves with the source:
    the debug sections (DWARF, holding line numbers and paths), ``.loc``/``.file`` lines, the labels
    only they refer to, and comments. ``ignore_params``: also without the kernel's parameter list
    and the parameters' numbers and offsets (a refactor that adds an argument the code path does
    not use: the same instructions, each parameter read from its new place)."""
    kept, debug, meta = [], False, False
    for line in asm.splitlines():
        if ignore_params:
            s = line.strip()
            if s.startswith(".amdgpu_metadata") or s.startswith(".end_amdgpu_metadata"):
                meta = s.startswith(".amdgpu_metadata")
                continue
            if meta or s.startswith(".param") or s.startswith(".amdhsa_kernarg_size"):
                continue
            line = re.sub(r"_param_\d+", "_param_N", line)
            line = re.sub(r"s\[(\d+):(\d+)\], 0x[0-9a-f]+", r"s[\1:\2], KARG", line)
        s = line.strip()
        section = re.match(r"\.section\s+([^\s,]+)", s)
        if section:
            debug = section.group(1).startswith(".debug")
            continue
        if s in (".text", ".data"):
            debug = False
            continue
        if debug or not s or s.startswith(("//", ";", ".loc", ".file")) or re.fullmatch(r"(\$L__tmp|\.Ltmp)\d+:", s):
            continue   # (the $L__tmp / .Ltmp labels mark inlined helpers' bounds for the debug ranges)
        kept.append(re.sub(r"\s*(//|;).*$", "", line).rstrip())
    return kept


def _fingerprints(compiled: dict, ignore_params: bool = False) -> dict:
    """{case: [sha256 of the normalized assembly, its line count]} (errors kept as they are)."""
    out = {}
    for key, (status, text) in compiled.items():
        if status != "ok":
            out[key] = [status, text]
            continue
        kept = normalized(text, ignore_params)
        out[key] = [hashlib.sha256("\n".join(kept).encode()).hexdigest(), len(kept)]
    return out


def _compile_in(tree: str, kernels: list[str], targets: list[str], quick: bool, ignore_params: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _WORKER, json.dumps([kernels, targets, quick])], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compiling in {tree} failed:\n{done.stderr[-3000:]}")
    return _fingerprints(json.loads(done.stdout.strip().splitlines()[-1]), ignore_params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare against (e.g. HEAD~1, main)")
    ap.add_argument("--kernels", nargs="+", required=True, help="kernel names (attn_fwd, decode_split, ...; gluon_fwd, gluon_bwd: every Gluon variant)")
    ap.add_argument("--targets", nargs="+", default=["sm_80", "sm_90", "gfx90a", "gfx942"])
    ap.add_argument("--quick", action="store_true", help="the portability check's quick cases only")
    ap.add_argument("--ignore-params", action="store_true",
                    help="compare without the parameter list (a kernel that gained an argument this path does not use)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="portattn-base-") as tmp:
        base = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", base, args.base], check=True)
        try:
            old = _compile_in(base, args.kernels, args.targets, args.quick, args.ignore_params)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)
    new = _compile_in(ROOT, args.kernels, args.targets, args.quick, args.ignore_params)
    same = 0
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        verdict = ("same" if a == b and a and a[0] != "error" else
                   "only in one tree" if a is None or b is None else
                   "error" if "error" in (a[0], b[0]) else f"DIFFERENT ({a[1]} vs {b[1]} lines)")
        same += verdict == "same"
        print(f"{verdict:>28}  {key}")
    total = len(set(old) | set(new))
    print(f"{same} of {total} cases compiled to the same code in {args.base} and this tree")
    return 0 if total and same == total else 1


if __name__ == "__main__":
    sys.exit(main())
