"""The ``cupy`` backend: CUDA C++ FlashAttention-2 kernels compiled at run time by NVRTC.

Kernels (``attn_fwd.cu``, ``attn_bwd.cu``, ``attn_bwd_mma.cu``, shared helpers in ``attn_common.cuh``):

* forward, fp16/bf16: tensor cores through ``mma.sync.m16n8k16`` (inline PTX), ``ldmatrix``
  fragments, ``cp.async`` K/V tiles overlapping the matmuls, base-2 online softmax with the scale
  folded in; one CTA per (Q tile, head, batch), warps split along the Q rows;
* forward, float32: IEEE float32 FMA (no TF32);
* backward (GQA groups reduced inside the dK/dV CTA): delta preprocess, then dK/dV and dQ
  kernels on tensor cores for fp16/bf16 at every head dim (``attn_bwd_mma.cu``; on Hopper the
  wgmma kernels of ``attn_bwd_wgmma.cu``), in float32 FMA arithmetic for float32
  (``attn_bwd.cu``; also for fp16/bf16 through ``PORTATTN_CUPY_BACKWARD=fma`` or ``mma128``, see
  docs/cupy.md). Deterministic (no atomics) except where determinism is not requested and the
  Hopper backward fuses dQ into its dK/dV kernel with float32 atomics (padded head dims 64/128,
  ``PORTATTN_CUPY_DQ``); a request for determinism always runs the dQ kernel.

Importing this module never imports cupy: a missing cupy or device is a reason from
:meth:`CupyBackend.unavailable_reasons`. See docs/cupy.md.
"""

from __future__ import annotations

import torch

from portattn.registry import Backend

from . import configs

_MIN_CAPABILITY = (8, 0)   # mma.sync bf16, cp.async, ldmatrix
_GRID_YZ_MAX = 65535


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


class CupyBackend(Backend):
    """FlashAttention-2 in CUDA C++ through CuPy/NVRTC (NVIDIA sm_80+)."""

    name = "cupy"
    stable_reasons = True   # device capability and shared memory, and the spec's own limits
    description = "CUDA C++ FlashAttention-2 kernels (mma.sync tensor cores) compiled by NVRTC via CuPy"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (1, configs.MAX_HEAD_DIM)
    vendors = frozenset({"nvidia"})
    features = frozenset({"causal", "top_left", "window", "softcap", "alibi", "bias", "bool_mask",
                          "varlen", "gqa", "head_dim_v"})
    deterministic = True
    has_backward = True

    # ----- availability ------------------------------------------------------------------
    def unavailable_reasons(self) -> list[str]:
        try:
            import cupy  # noqa: F401
        except ImportError:
            return ["cupy is not installed (pip install cupy-cuda12x or cupy-cuda13x, matching your CUDA)"]
        except Exception as exc:  # a broken CUDA install surfaces here
            return [f"cupy failed to import: {type(exc).__name__}: {exc}"]
        if getattr(torch.version, "hip", None):
            return ["this torch is a ROCm build; the cupy backend runs NVIDIA CUDA kernels only"]
        if not torch.cuda.is_available():
            return ["no CUDA device (torch.cuda.is_available() is False)"]
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            return [f"cupy cannot reach the CUDA runtime: {type(exc).__name__}: {exc}"]
        if n == 0:
            return ["no CUDA device visible to cupy"]
        return []

    # ----- support -----------------------------------------------------------------------
    def extra_reasons(self, spec) -> list[str]:
        reasons = []
        idx = spec.device.index if spec.device.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(idx)
        if tuple(cap) < _MIN_CAPABILITY:
            reasons.append(f"needs compute capability >= 8.0 (sm_80: mma.sync bf16, cp.async); "
                           f"{torch.cuda.get_device_name(idx)} is sm_{cap[0]}{cap[1]}")
            return reasons
        smem_limit = getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_block_optin", None)
        reasons += problem_reasons(spec, smem_limit)
        return reasons

    # ----- compute -----------------------------------------------------------------------
    def forward(self, spec):
        from . import runtime

        return runtime.forward(spec)

    def backward(self, spec, out, lse, dout, dlse=None):
        from . import runtime

        return runtime.backward(spec, out, lse, dout, dlse)


#: What each kernel family is, for reasons and docs (which path runs: configs.backward_config).
_FAMILY_LABELS = {
    "fwd_mma": "tensor-core forward, fp16/bf16, mma.sync",
    "fwd_wgmma": "Hopper tensor-core forward, fp16/bf16, sm_90a wgmma (no softcap/ALiBi/bias)",
    "fwd_wgmma_ws": "Hopper tensor-core forward, warp-specialized (producer warpgroup, mbarriers, pingpong), "
                    "fp16/bf16, sm_90a wgmma (no softcap/ALiBi/bias)",
    "fwd_fma": "float32 FMA forward",
    "bwd_mma": "tensor-core backward, fp16/bf16, mma.sync",
    "bwd_wgmma": "Hopper tensor-core backward, fp16/bf16, sm_90a wgmma (no softcap/ALiBi/bias)",
    "bwd": "FMA backward: float32, and fp16/bf16 where PORTATTN_CUPY_BACKWARD or shared memory says so",
}


def kernel_families(spec, smem_limit: int | None = None, capability: tuple | None = None) -> dict[str, str]:
    """Which kernel family runs the forward and (when a gradient is needed) the backward;
    ``smem_limit``: the device's opt-in shared memory per block (None: no limit); ``capability``:
    the device's compute capability (None: the spec's CUDA device's, or none for a CPU spec).
    Each entry ends with why (``PORTATTN_CUPY_FORWARD``: the wgmma forward runs only on sm_90,
    fp16/bf16, padded head dim 64/128/256, without softcap/ALiBi/bias; ``PORTATTN_CUPY_BACKWARD``
    = ``wgmma``: the wgmma backward likewise at padded head dim 64/128/256)."""
    dtype = _dtype_name(spec.dtype)
    if capability is None and spec.device.type == "cuda":
        idx = spec.device.index if spec.device.index is not None else torch.cuda.current_device()
        capability = tuple(torch.cuda.get_device_capability(idx))
    extras = spec.softcap is not None or spec.alibi_slopes is not None or spec.attn_bias is not None
    fwd, why = configs.forward_choice(dtype, spec.head_dim, spec.head_dim_v, extras=extras, capability=capability)
    if fwd is None:
        return {}
    out = {"forward": f"{fwd.family} ({_FAMILY_LABELS[fwd.family]}), padded head dim {fwd.head_dim}; {why}"}
    if spec.needs_grad:
        bwd, why = configs.backward_choice(dtype, spec.head_dim, spec.head_dim_v, extras=extras, capability=capability,
                                           smem_limit=smem_limit)
        out["backward"] = f"{bwd.family} ({_FAMILY_LABELS[bwd.family]}), padded head dim {bwd.head_dim}; {why}"
    return out


def problem_reasons(spec, smem_limit: int | None) -> list[str]:
    """Limits of the kernels for one problem (device-independent apart from ``smem_limit``)."""
    reasons = []
    dtype = _dtype_name(spec.dtype)
    fwd = configs.forward_config(dtype, spec.head_dim, spec.head_dim_v)
    if fwd is None:
        return [f"head_dim={spec.head_dim}/head_dim_v={spec.head_dim_v}: kernels exist up to "
                f"{configs.MAX_HEAD_DIM} (buckets {', '.join(map(str, configs.HEAD_DIM_BUCKETS))})"]
    if spec.num_heads_q > _GRID_YZ_MAX or spec.batch > _GRID_YZ_MAX:
        reasons.append(f"Hq={spec.num_heads_q}, B={spec.batch}: the grid allows at most {_GRID_YZ_MAX} "
                       f"heads and batch entries; split the call")
    if spec.seqlen_q >= 1 << 30 or spec.seqlen_k >= 1 << 30:
        reasons.append(f"sequence lengths Sq={spec.seqlen_q}, Sk={spec.seqlen_k} must be < 2**30")
    if smem_limit:
        needed = [(cfg, cfg.max_smem_bytes()) for cfg in
                  ([fwd] + ([configs.backward_config(dtype, spec.head_dim, spec.head_dim_v, smem_limit=smem_limit)]
                            if spec.needs_grad else []))]
        for cfg, n in needed:
            if n > smem_limit:
                reasons.append(f"{cfg.family} kernels ({_FAMILY_LABELS[cfg.family]}) at padded head dim {cfg.head_dim} "
                               f"need {n} bytes of shared memory per block; this GPU allows {smem_limit} "
                               f"(use head_dim <= 128 here)")
    return reasons


__all__ = ["CupyBackend", "problem_reasons", "kernel_families"]
