"""torch SDPA's kernels as separate, individually pinnable backends.

``sdpa`` lets torch choose a kernel per call; these backends force one kernel each (through
``torch.nn.attention.sdpa_kernel([...])``) and declare what that kernel accepts, so that a user
can pin one (``backend="sdpa_cudnn"``) and the ``fastest`` policy can time them against each
other and against portattn's own kernels:

=================  ==========================================================================
``sdpa_cudnn``     cuDNN's fused attention (NVIDIA sm_80..sm_121, fp16/bf16, D and Dv multiples
                   of 8, D <= 128, or <= 256 on sm_90/sm_100 with a recent cuDNN); GQA; Dv != D;
                   causal top-left, or bottom-right through a materialised mask; no arbitrary
                   bias; its backward is not deterministic.
``sdpa_flash``     FlashAttention-2 inside torch (NVIDIA sm_80..sm_121, ROCm; fp16/bf16;
                   D == Dv <= 256); GQA; causal either alignment (bottom-right through
                   ``causal_lower_right``); no mask or bias of any kind.
``sdpa_efficient`` the memory-efficient (xFormers/CUTLASS) kernel: fp16/bf16 (float32 is left
                   to ``sdpa``'s math path, see backends/sdpa.py), D and Dv multiples of 8;
                   GQA, Dv != D, float bias (with its gradient), boolean masks, ALiBi, windows.
``sdpa_math``      the math kernel: every device and dtype (float32/float64 on GPUs included);
                   slow and O(S²) memory, useful as a pinnable exact fallback.
=================  ==========================================================================

The constraints come from torch's ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
(2.11 .. 2.13); they depend on the GPU, the cuDNN version and strides, so each backend also asks
torch itself (``torch.backends.cuda.can_use_<kernel>_attention``) on CUDA devices, with the
tensors SDPA will see, and turns a refusal into a reason. Masking follows docs/semantics.md
exactly as the ``sdpa`` backend does (rows with no visible key give 0, lse -inf).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from portattn.backends.sdpa import _ENABLE_GQA, SdpaBackend, _fused_kernel_friendly

_HALF = frozenset({torch.float16, torch.bfloat16})
#: torch's verdicts per _verdict_key (bounded)
_verdicts: dict[tuple, tuple[str, ...]] = {}
_VERDICTS_LIMIT = 4096


def _sdp_backend(name: str):
    from torch.nn.attention import SDPBackend
    return getattr(SDPBackend, name)


def _trivial_causal(spec) -> bool:
    """True for bottom-right causal with one query row (decoding): every key is visible, so the
    mask can be dropped (SDPA would otherwise materialise it for kernels without lower-right)."""
    return (spec.causal and spec.alignment == "bottom_right" and spec.seqlen_q == 1 and not spec.is_varlen
            and spec.window_left is None and spec.window_right == 0)


def _plain_causal(spec) -> bool:
    return (spec.causal and spec.window_left is None and spec.attn_bias is None and spec.alibi_slopes is None
            and not spec.is_varlen)


def _lower_right_causal(spec) -> bool:
    """Plain causal that SDPA expresses with ``causal_lower_right`` (bottom-right, Sq < Sk)."""
    return _plain_causal(spec) and spec.alignment == "bottom_right" and spec.seqlen_q < spec.seqlen_k


def _without_trivial_causal(spec):
    if not _trivial_causal(spec):
        return spec
    return dataclasses.replace(spec, causal=False, window_right=None)


def _sdpa_view(t: torch.Tensor, needs_grad: bool) -> torch.Tensor | None:
    """``t`` (B, S, H, D) as SDPA will receive it, (B, H, S, D): the view itself, or a
    contiguous stand-in (same storage, no copy) when the backend would copy it first. None when
    no stand-in can be built (an expanded tensor smaller than its contiguous copy)."""
    base = t.detach()
    if not _fused_kernel_friendly(base):
        shape = tuple(base.shape)
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        try:
            base = base.as_strided(shape, tuple(reversed(strides)), 0)
        except RuntimeError:
            return None
    if needs_grad and base.is_floating_point():
        base = base.detach().requires_grad_(True)
    return base.transpose(1, 2)


class _PinnedSdpaBackend(SdpaBackend):
    """One of SDPA's kernels, forced with ``sdpa_kernel([kernel])``; subclasses declare it."""

    kernel: ClassVar[str] = ""            # attribute of torch.nn.attention.SDPBackend
    torch_check: ClassVar[str] = ""       # torch.backends.cuda.can_use_<...>_attention
    #: torch's verdict also reads pointer alignment and torch's determinism flags: asked per call
    stable_reasons: ClassVar[bool] = False
    cpu_fused_forward: ClassVar[bool] = False

    def unavailable_reasons(self) -> list[str]:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
            _sdp_backend(self.kernel)
        except (ImportError, AttributeError) as exc:
            return [f"torch {torch.__version__} has no SDPBackend.{self.kernel} ({exc}); upgrade torch (>= 2.3)"]
        return []

    # ----- reasons -----------------------------------------------------------------------
    def _kernel_reasons(self, spec) -> list[str]:
        """This kernel's own limits, known without asking torch (override)."""
        return []

    def extra_reasons(self, spec) -> list[str]:
        reasons = list(self._kernel_reasons(spec))
        if spec.is_varlen:
            reasons.append("varlen (cu_seqlens) is not expressible through SDPA; pad the sequences or use triton/cupy")
        if spec.dtype == torch.float32 and spec.vendor != "cpu" and spec.allow_tf32 is False \
                and torch.backends.cuda.matmul.allow_tf32:
            reasons.append("torch.backends.cuda.matmul.allow_tf32 is on, so SDPA would use TF32 for float32; "
                           "turn it off or set PORTATTN_ALLOW_TF32=1")
        if not reasons and self.torch_check and spec.device.type == "cuda":
            reasons.extend(self._torch_reasons(spec))
        return reasons

    def _call_spec(self, spec):
        """The spec handed to SdpaBackend._sdpa: trivial decode causal dropped; for cuDNN,
        bottom-right causal with Sq < Sk as the equivalent window (0 right), which _Plan turns
        into a bool mask (torch's causal_lower_right would fall back with a warning per call)."""
        spec = _without_trivial_causal(spec)
        if self.kernel == "CUDNN_ATTENTION" and _lower_right_causal(spec):
            spec = dataclasses.replace(spec, causal=False)   # window_right stays 0
        return spec

    def _params(self, spec):
        """torch's SDPAParams for the call _sdpa will make, or None when it cannot be mimicked."""
        from torch.backends.cuda import SDPAParams
        spec = self._call_spec(spec)
        views = [_sdpa_view(t, spec.needs_grad) for t in (spec.q, spec.k, spec.v)]
        if any(t is None for t in views):
            return None
        q, k, v = views
        gqa = spec.num_heads_q != spec.num_heads_kv
        if gqa and not _ENABLE_GQA:
            k = k.repeat_interleave(spec.gqa_ratio, dim=1)
            v = v.repeat_interleave(spec.gqa_ratio, dim=1)
            gqa = False
        mask, is_causal = None, False
        if _plain_causal(spec) and (spec.alignment == "top_left" or spec.seqlen_q == spec.seqlen_k):
            is_causal = True
        elif _lower_right_causal(spec):
            pass   # causal_lower_right calls flash/efficient with no mask (their own bottom-right causal)
        elif spec.has_window or spec.causal or spec.attn_bias is not None or spec.alibi_slopes is not None:
            # a stand-in of the dtype and shape of the mask _Plan builds (a stride-0 view: no
            # memory); torch picks the kernel from the mask as given (bool or additive)
            additive = spec.alibi_slopes is not None or (spec.attn_bias is not None and not spec.bias_is_mask)
            per_head = spec.alibi_slopes is not None or spec.attn_bias is not None
            shape = ((spec.batch, spec.num_heads_q) if per_head else ()) + (spec.seqlen_q, spec.seqlen_k)
            mask = torch.zeros((), dtype=spec.dtype if additive else torch.bool, device=spec.device).expand(shape)
        return SDPAParams(q, k, v, mask, 0.0, is_causal, gqa)

    def _verdict_key(self, spec) -> tuple:
        """Everything torch's check reads: shapes, strides, alignment, dtype, device, grad,
        masking, determinism (cheaper than building the check's arguments)."""
        def geometry(t):
            return tuple(t.shape), t.stride(), (t.storage_offset() * t.element_size()) % 16
        return (self.name, spec.capability_key, spec.alignment, spec.window_left, spec.window_right,
                geometry(spec.q), geometry(spec.k), geometry(spec.v),
                torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())

    def _torch_reasons(self, spec) -> list[str]:
        """torch's own verdict on this kernel for the call _sdpa will make, memoised (asking
        costs ~20x more than the key). Asked under this backend's sdpa_kernel pin, so a kernel
        disabled globally with torch.backends.cuda.enable_*_sdp(False) still runs when pinned."""
        key = self._verdict_key(spec)
        cached = _verdicts.get(key)
        if cached is None:
            cached = self._ask_torch(spec)
            if len(_verdicts) >= _VERDICTS_LIMIT:
                _verdicts.clear()
            _verdicts[key] = cached
        return list(cached)

    def _ask_torch(self, spec) -> tuple[str, ...]:
        import torch.backends.cuda as tbc
        from torch.nn.attention import sdpa_kernel
        check = getattr(tbc, self.torch_check, None)
        if check is None:   # an older torch: the declared limits above are all we know
            return ()
        try:
            params = self._params(spec)
            with sdpa_kernel([_sdp_backend(self.kernel)]):
                if params is None or check(params, debug=False):
                    return ()
        except Exception as exc:   # torch's own check failing is a reason too, never a crash
            return (f"torch.backends.cuda.{self.torch_check} failed: {type(exc).__name__}: {exc}",)
        return (f"torch {torch.__version__} refuses this problem for its {self.kernel} kernel "
                f"(torch.backends.cuda.{self.torch_check}(params, debug=True) prints why: GPU architecture, "
                f"head dims, strides, cuDNN version); use backend='sdpa' to let torch choose a kernel",)

    # ----- compute -----------------------------------------------------------------------
    def _sdpa(self, spec, q, k, v, for_grad: bool = False):
        from torch.nn.attention import sdpa_kernel
        spec = self._call_spec(spec)
        if self.kernel == "EFFICIENT_ATTENTION" and _lower_right_causal(spec) \
                and spec.num_heads_q != spec.num_heads_kv:
            # causal_lower_right calls the efficient kernel directly, without SDPA's GQA expansion
            k = k.repeat_interleave(spec.gqa_ratio, dim=2)
            v = v.repeat_interleave(spec.gqa_ratio, dim=2)
        with sdpa_kernel([_sdp_backend(self.kernel)]):
            return super()._sdpa(spec, q, k, v, for_grad)


def _multiple_of_8(spec, who: str) -> list[str]:
    bad = [f"{n}={d}" for n, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)) if d % 8]
    if bad:
        return [f"{who} needs head dims that are multiples of 8 (got {', '.join(bad)}); pad them with zeros "
                f"or use triton/cupy/sdpa"]
    return []


def _deterministic_grad_reasons(spec, who: str) -> list[str]:
    """flash and efficient have a deterministic backward, which torch engages only under
    ``torch.use_deterministic_algorithms(True)`` (not warn_only)."""
    if not (spec.deterministic and spec.needs_grad) or spec.vendor == "cpu":
        return []
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return []
    return [f"{who}'s backward is deterministic only under torch.use_deterministic_algorithms(True) "
            f"(PORTATTN_DETERMINISTIC alone does not reach torch's kernels); call it, or use triton/cupy"]


class SdpaCudnnBackend(_PinnedSdpaBackend):
    """torch SDPA's cuDNN kernel (``SDPBackend.CUDNN_ATTENTION``)."""

    name = "sdpa_cudnn"
    description = "torch SDPA forced to cuDNN fused attention (SDPBackend.CUDNN_ATTENTION)"
    kernel = "CUDNN_ATTENTION"
    torch_check = "can_use_cudnn_attention"
    dtypes = _HALF
    head_dims = (8, 256)
    vendors = frozenset({"nvidia"})
    features = frozenset({"causal", "top_left", "gqa", "head_dim_v"})
    deterministic = False    # torch refuses cuDNN SDPA under torch.use_deterministic_algorithms
    has_backward = True

    def _kernel_reasons(self, spec) -> list[str]:
        reasons = _multiple_of_8(spec, "cuDNN attention")
        if spec.seqlen_k == 1:
            reasons.append("cuDNN attention does not support seqlen_k=1; use sdpa_flash, triton or cupy")
        if spec.batch > 65535 or spec.num_heads_q > 65535:
            reasons.append(f"cuDNN attention needs batch and heads <= 65535 (got B={spec.batch}, "
                           f"Hq={spec.num_heads_q}); split the call")
        if spec.causal and spec.alignment == "bottom_right" and spec.seqlen_q > spec.seqlen_k:
            reasons.append(f"bottom-right causal with seqlen_q={spec.seqlen_q} > seqlen_k={spec.seqlen_k} leaves rows "
                           f"with no key (a mask cuDNN is not given here); use sdpa_efficient, triton or cupy")
        if spec.needs_grad and spec.head_dim > 128 and not (spec.head_dim == spec.head_dim_v == 256
                                                            or (spec.head_dim, spec.head_dim_v) == (192, 128)):
            reasons.append(f"cuDNN's backward supports D, Dv <= 128, (192, 128) or (256, 256) "
                           f"(got D={spec.head_dim}, Dv={spec.head_dim_v})")
        return reasons


class SdpaFlashBackend(_PinnedSdpaBackend):
    """torch SDPA's FlashAttention-2 kernel (``SDPBackend.FLASH_ATTENTION``)."""

    name = "sdpa_flash"
    description = "torch SDPA forced to its FlashAttention-2 kernel (SDPBackend.FLASH_ATTENTION)"
    kernel = "FLASH_ATTENTION"
    torch_check = "can_use_flash_attention"
    dtypes = _HALF
    head_dims = (1, 256)
    vendors = frozenset({"nvidia", "amd"})
    features = frozenset({"causal", "top_left", "gqa"})   # no attn_mask of any kind; D == Dv
    deterministic = True
    has_backward = True

    def _kernel_reasons(self, spec) -> list[str]:
        reasons = _deterministic_grad_reasons(spec, "FlashAttention-2 in torch")
        if spec.causal and spec.alignment == "bottom_right" and spec.seqlen_q > spec.seqlen_k:
            reasons.append(f"bottom-right causal with seqlen_q={spec.seqlen_q} > seqlen_k={spec.seqlen_k} leaves rows "
                           f"with no key, which needs a mask (flash takes none); use sdpa_efficient, triton or cupy")
        if spec.vendor == "nvidia" and spec.needs_grad and 192 < spec.head_dim <= 224:
            major, minor = torch.cuda.get_device_capability(spec.device)
            if (major, minor) in ((8, 6), (8, 7), (8, 9), (12, 0), (12, 1)):
                reasons.append(f"torch's flash backward does not support head_dim in (192, 224] on sm_{major}{minor}")
        return reasons


class SdpaEfficientBackend(_PinnedSdpaBackend):
    """torch SDPA's memory-efficient kernel (``SDPBackend.EFFICIENT_ATTENTION``)."""

    name = "sdpa_efficient"
    description = "torch SDPA forced to its memory-efficient kernel (SDPBackend.EFFICIENT_ATTENTION)"
    kernel = "EFFICIENT_ATTENTION"
    torch_check = "can_use_efficient_attention"
    # float32 is supported by the kernel, but on the H200 (2026-11-29) it missed the §3 bound on
    # small problems, so backends/sdpa.py sends float32 to the math kernel: not offered here.
    dtypes = _HALF
    head_dims = (8, 512)
    vendors = frozenset({"nvidia", "amd"})
    features = frozenset({"causal", "top_left", "window", "alibi", "bias", "bool_mask", "bias_grad", "gqa",
                          "head_dim_v"})
    deterministic = True
    has_backward = True

    def _kernel_reasons(self, spec) -> list[str]:
        reasons = _multiple_of_8(spec, "the memory-efficient kernel")
        reasons += _deterministic_grad_reasons(spec, "the memory-efficient kernel")
        if spec.vendor == "amd" and spec.num_heads_q != spec.num_heads_kv:
            reasons.append("torch's memory-efficient kernel on ROCm does not support GQA (Hq != Hkv)")
        return reasons


class SdpaMathBackend(_PinnedSdpaBackend):
    """torch SDPA's math kernel (``SDPBackend.MATH``): every device and dtype, O(S²) memory."""

    name = "sdpa_math"
    description = "torch SDPA forced to its math kernel (SDPBackend.MATH): O(Sq*Sk) memory"
    kernel = "MATH"
    torch_check = ""
    dtypes = SdpaBackend.dtypes
    head_dims = SdpaBackend.head_dims
    vendors = SdpaBackend.vendors
    features = SdpaBackend.features
    deterministic = True
    has_backward = True
