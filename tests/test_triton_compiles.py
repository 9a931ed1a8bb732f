"""How many compiles the triton backend needs (issue #14: a new sequence length costs no compile).

The kernels' sizes and lse strides are ``do_not_specialize`` (kernels.py ``_SIZES``), so triton's
compile-cache key — its binder's specialisation of every argument (divisibility by 16, == 1, int
width, pointer alignment) plus the constexprs — must not depend on the batch or the sequence
lengths. This test builds the exact launch arguments of the forward and of the three backward
kernels for many lengths (``ops`` with the launches intercepted, CPU tensors, no GPU) and asks
triton's own binder for each key. It runs in a subprocess: the kernels must be plain
``JITFunction``s, not the interpreter's (conftest sets TRITON_INTERPRET=1 in this process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_CODE = textwrap.dedent(r"""
    import collections, json, sys
    import torch
    import triton.runtime.jit as tjit
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from portattn.backends.triton import launcher, ops
    from portattn.backends.triton.configs import Target
    from portattn.spec import build_spec

    # the H200's tile table for every spec (the CPU's would be the interpreter's)
    ops._forward_config.cache_clear(); ops._backward_configs.cache_clear()
    import portattn.backends.triton.configs as C
    C.device_target = lambda device: Target("nvidia", 90)
    ops.device_target = C.device_target

    backend = make_backend(GPUTarget("cuda", 90, 32))
    seen = collections.defaultdict(set)

    class Recorder:
        def __init__(self, fn): self.fn = fn
        def __getitem__(self, grid):
            def call(*args, **kwargs):
                binder = tjit.create_function_from_signature(self.fn.signature, self.fn.params, backend)
                _, spec, options = binder(*args, **kwargs)
                seen[self.fn.__name__].add(str(spec) + str(options))
            return call
    launcher.fast = Recorder

    import os
    os.environ["PORTATTN_TRITON_DQ"] = "atomic"   # the table's atomic rows (off by default until timed)
    for deterministic in ("1", "0"):   # the two-kernel backward, then atomic dQ (the sm_90 D128 atomic row)
        os.environ["PORTATTN_DETERMINISTIC"] = deterministic
        for causal in (False, True):
            for b, s in ((1, 1000), (1, 1024), (2, 2048), (4, 4096), (1, 4097), (3, 1536), (16, 512), (1, 16384)):
                q, k, v = (torch.randn(b, s, 16, 128, dtype=torch.bfloat16) for _ in range(3))
                spec = build_spec(q, k, v, causal=causal)
                out, lse, res = ops.forward_for_backward(spec)
                ops.forward(spec)
                dout = torch.randn_like(out)
                ops.backward(spec, out, lse, dout, residuals=res)
    print(json.dumps({k: len(v) for k, v in seen.items()}))
""")


def test_a_new_sequence_length_reuses_the_compiled_kernels():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-3000:]
    import json
    keys = json.loads(res.stdout.strip().splitlines()[-1])
    # one key per kernel variant: forward with and without the residual, times causal and not
    # (LONGEST_FIRST); prep once; dQ once per causal flag (deterministic only); dK/dV once per
    # path (its own tiles and DQ_ATOMIC with atomic dQ) — never one per length
    assert keys == {"attn_fwd": 4, "attn_bwd_prep": 1, "attn_bwd_dq": 2, "attn_bwd_dkdv": 2}, keys
