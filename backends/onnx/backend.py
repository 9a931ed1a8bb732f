"""The ``onnx`` backend: ``portattn.FlashAttention`` executed by onnxruntime.

Each call runs a one-node model of the op (:func:`portattn.onnx_ops.model.one_node_model`).
Sessions are cached per configuration — attributes, element types, provider, whether LSE is
wanted — and every model has dynamic shapes, so one session serves every batch and sequence
length. Tensors are bound through onnxruntime's IOBinding straight from torch's memory (no host
copies): on the CPU provider for CPU tensors, on the CUDA provider (onnxruntime-gpu) for
tensors on an NVIDIA GPU.

Forward only (``has_backward = False``): dispatch does not pick it when a gradient is needed.
"""

from __future__ import annotations

import threading

import torch

from portattn.registry import Backend

_ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.bool: 9}   # TensorProto codes
_ONNX_NAMES = {torch.float32: "float", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def _compact_broadcast(t: torch.Tensor) -> torch.Tensor:
    """Undo ``expand``: a dim with stride 0 becomes size 1, so nothing broadcast is copied."""
    for dim in range(t.dim()):
        if t.stride(dim) == 0 and t.shape[dim] > 1:
            t = t.narrow(dim, 0, 1)
    return t.contiguous()


class OnnxBackend(Backend):
    """portattn's ONNX op on onnxruntime (CPU provider; CUDA provider with onnxruntime-gpu)."""

    name = "onnx"
    stable_reasons = True   # the device type and onnxruntime's providers (fixed once imported)
    description = "portattn.FlashAttention ONNX function run by onnxruntime (forward only)"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (1, 512)
    vendors = frozenset({"cpu", "nvidia"})
    features = frozenset({"causal", "top_left", "window", "softcap", "alibi", "bias", "bool_mask",
                          "gqa", "head_dim_v"})
    deterministic = True
    has_backward = False

    #: keys per tile of the online softmax (the op's ``block_size`` attribute)
    block_size = 256

    def __init__(self):
        self._sessions: dict[tuple, object] = {}
        self._lock = threading.Lock()

    # ----- availability ------------------------------------------------------------------
    def unavailable_reasons(self) -> list[str]:
        reasons = []
        for module in ("onnx", "onnxscript", "onnxruntime"):
            try:
                __import__(module)
            except ImportError as exc:
                reasons.append(f"{module} is not installed ({exc}); install it with `pip install portattn[onnx]`")
        return reasons

    def _providers(self) -> list[str]:
        import onnxruntime

        return list(onnxruntime.get_available_providers())

    def extra_reasons(self, spec) -> list[str]:
        device = spec.device.type
        if device not in _PROVIDERS:
            return [f"tensors on {spec.device} are not supported (supported: cpu, cuda)"]
        provider = _PROVIDERS[device]
        if provider not in self._providers():
            return [f"onnxruntime has no {provider} for tensors on {spec.device}; install onnxruntime-gpu "
                    f"(available providers: {', '.join(self._providers())})"]
        return []

    # ----- sessions ----------------------------------------------------------------------
    def _session(self, key: tuple, attributes: dict, dtype: torch.dtype, bias_dtype: torch.dtype, provider: str,
                 device_id: int):
        with self._lock:
            session = self._sessions.get(key)
            if session is not None:
                return session
        import onnxruntime
        from portattn.onnx_ops.model import one_node_model

        model = one_node_model(dtype=_ONNX_NAMES[dtype], bias_dtype=_ONNX_NAMES[bias_dtype], attributes=attributes)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        providers = [provider] if provider == "CPUExecutionProvider" else [(provider, {"device_id": device_id}),
                                                                            "CPUExecutionProvider"]
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=providers)
        with self._lock:
            return self._sessions.setdefault(key, session)

    # ----- compute -----------------------------------------------------------------------
    def forward(self, spec):
        """Run the op; returns ``out (B, Sq, Hq, Dv)`` in q's dtype and ``lse (B, Hq, Sq)`` float32."""
        from portattn.onnx_ops.model import attribute_values

        device = spec.device
        out = torch.empty(spec.out_shape, dtype=spec.dtype, device=device)
        lse = torch.empty(spec.lse_shape, dtype=torch.float32, device=device)
        if spec.q.numel() == 0 or spec.seqlen_k == 0:   # nothing visible: out 0, lse -inf
            return out.zero_(), lse.fill_(float("-inf"))

        q, k, v = (t.contiguous() for t in (spec.q, spec.k, spec.v))
        bias = mask = None
        if spec.attn_bias is not None:
            compact = _compact_broadcast(spec.attn_bias)
            if spec.bias_is_mask:
                mask = compact
            else:
                bias = compact if compact.dtype in _ONNX_NAMES else compact.to(torch.float32)
        if bias is None:
            bias = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=device)
        if mask is None:
            mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        slopes = (spec.alibi_slopes.contiguous() if spec.alibi_slopes is not None
                  else torch.zeros(1, 1, dtype=torch.float32, device=device))

        attributes = attribute_values(scale=spec.scale, causal=spec.causal, alignment=spec.alignment,
                                      window_left=spec.window_left, window_right=spec.window_right,
                                      softcap=spec.softcap, block_size=self.block_size)
        provider = _PROVIDERS[device.type]
        device_id = (device.index or 0) if device.type == "cuda" else 0
        key = (tuple(sorted(attributes.items())), spec.dtype, bias.dtype, provider, device_id)
        session = self._session(key, attributes, spec.dtype, bias.dtype, provider, device_id)

        binding = session.io_binding()
        ort_device = "cuda" if device.type == "cuda" else "cpu"
        for name, t in (("Q", q), ("K", k), ("V", v), ("bias", bias), ("mask", mask), ("alibi_slopes", slopes)):
            binding.bind_input(name, ort_device, device_id, _ONNX_TYPES[t.dtype], list(t.shape), t.data_ptr())
        binding.bind_output("Y", ort_device, device_id, _ONNX_TYPES[out.dtype], list(out.shape), out.data_ptr())
        binding.bind_output("LSE", ort_device, device_id, _ONNX_TYPES[lse.dtype], list(lse.shape), lse.data_ptr())
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()   # inputs written by torch are ready
        session.run_with_iobinding(binding)
        return out, lse
