"""The ``triton`` backend: FlashAttention-2 forward and backward kernels written in Triton.

Runs on NVIDIA (sm_80+) and AMD CDNA GPUs, and on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is first imported). Every feature of docs/semantics.md;
gradients are bit-identical across runs when determinism is requested; otherwise the 16-bit
backward on Hopper adds dQ with atomics (FlashAttention-2's schedule). See docs/triton.md.

This module imports neither triton nor the kernels: a missing triton is a reason, not an error.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from portattn.registry import ALL_FEATURES, Backend

#: grid axis 1 carries batch × heads; CUDA/HIP limit it to 65535 programs.
MAX_BATCH_HEADS = 65535


def _row_offset_reach(spec) -> int:
    """Largest in-sequence element offset the kernels form in int32 (rows × row stride).
    One ``stride()`` and one ``shape`` per tensor: this runs on every call."""
    seq_axis = 0 if spec.cu_seqlens_q is not None else 1
    reach = 0
    for t, rows in ((spec.q, spec.seqlen_q), (spec.k, spec.seqlen_k), (spec.v, spec.seqlen_k)):
        shape = t.shape
        reach = max(reach, rows * max(t.stride()[seq_axis], shape[-1] * shape[-2]))
    b = spec.attn_bias
    if b is not None:
        bs = b.stride()
        reach = max(reach, spec.seqlen_q * bs[2] + spec.seqlen_k * bs[3])
    return reach


_OPS = None


def _ops():
    """The host side (imports triton and defines the kernels on first use; then a global read)."""
    global _OPS
    if _OPS is None:
        from . import ops
        _OPS = ops
    return _OPS


@functools.cache
def _device_reasons(device: torch.device) -> tuple[str, ...]:
    """Reasons that depend only on the device and on how triton was imported (fixed for the
    life of the process, so computed once per device)."""
    ops = _ops()
    if device.type == "cpu":
        if not ops.interpreter_active():
            return ("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is first "
                    "imported (e.g. in the environment of the process), or move the tensors to a GPU",)
        if not ops.triton_library_interpreted():
            return ("triton was imported before TRITON_INTERPRET=1 was set: portattn's kernels are interpreted but "
                    "triton's own library functions were compiled for a GPU, so the interpreter cannot run them; "
                    "set TRITON_INTERPRET=1 before the first `import triton` (in the process environment)",)
        return ()
    if ops.interpreter_active():
        return ("Triton's interpreter is on (TRITON_INTERPRET=1): it runs only CPU tensors here; "
                "unset TRITON_INTERPRET to run on the GPU",)
    if device.type == "cuda" and not getattr(torch.version, "hip", None):
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return (f"NVIDIA sm_{major}{minor} is too old (needs sm_80 or newer: Ampere, Ada, Hopper, …)",)
    return ()


class TritonBackend(Backend):
    """FlashAttention-2 in Triton: tiled online softmax forward, FA2 backward (delta, dK/dV, dQ)."""

    name = "triton"
    stable_reasons = True   # device facts cached for the process, offsets and grid from the spec
    description = "Triton FlashAttention-2 kernels (NVIDIA sm_80+, AMD CDNA, CPU via TRITON_INTERPRET=1)"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (1, 256)
    vendors = frozenset({"nvidia", "amd", "cpu"})
    features = ALL_FEATURES
    deterministic = True
    has_backward = True

    def unavailable_reasons(self) -> list[str]:
        if importlib.util.find_spec("triton") is None:
            return ["triton is not installed: pip install 'portattn[triton]' (or pip install triton)"]
        try:
            import triton  # noqa: F401
        except Exception as exc:  # a broken install is a reason too
            return [f"triton failed to import: {type(exc).__name__}: {exc}"]
        return []

    def extra_reasons(self, spec) -> list[str]:
        reasons = list(_device_reasons(spec.device))
        reach = _row_offset_reach(spec)
        if reach >= 2 ** 31:
            reasons.append(f"sequence length × row stride = {reach} does not fit in int32 offsets inside one "
                           f"sequence; split the sequence or the heads into smaller calls")
        if spec.batch * spec.num_heads_q > MAX_BATCH_HEADS:
            reasons.append(f"batch × heads = {spec.batch * spec.num_heads_q} > {MAX_BATCH_HEADS} (grid limit); "
                           f"split the batch into chunks")
        return reasons

    def forward(self, spec):
        """``(out, lse)``: out in ``spec.out_shape`` and q's dtype, lse float32 ``spec.lse_shape``.
        Decode-shaped problems (a few queries against many keys, no gradient: see
        :func:`_as_decode`) run on the split-KV decode kernels, which spread the keys over the
        GPU instead of giving each (batch, head) one mostly empty 128-row tile."""
        kv = _as_decode(spec)
        if kv is not None:
            return _forward_kvcache(self, kv)
        return _ops().forward(spec)

    def forward_for_backward(self, spec):
        """``(out, lse, residuals)``: 16-bit inputs also keep O's rounding residual for the backward
        (see :func:`ops.forward_for_backward`)."""
        return _ops().forward_for_backward(spec)

    def backward(self, spec, out, lse, dout, dlse=None, residuals=()):
        """``(dq, dk, dv, dbias)``; dbias has the expanded bias shape when a float bias needs grad;
        ``dlse`` (the gradient of the returned lse, or None) is folded into delta; ``residuals``
        from :meth:`forward_for_backward` (else exact row statistics are recomputed)."""
        return _ops().backward(spec, out, lse, dout, dlse, residuals=residuals)


# ----- KV-cache decoding (portattn.kvcache): split-KV kernels in decode.py ------------------------

def _kvcache_reasons(self, kv) -> list[str]:
    """Why the split-KV decode kernels cannot run ``kv`` (a :class:`portattn.kvcache.KVCacheSpec`)."""
    reasons = list(self.availability())
    if reasons:
        return reasons
    if kv.vendor not in self.vendors:
        reasons.append(f"device {kv.device} ({kv.vendor}) is not supported")
    if kv.dtype not in self.dtypes:
        reasons.append(f"dtype {str(kv.dtype).replace('torch.', '')} is not supported (float16, bfloat16, float32)")
    for label, d in (("head_dim", kv.head_dim), ("head_dim_v", kv.head_dim_v)):
        if not 1 <= d <= 256:
            reasons.append(f"{label}={d} is out of range (supported: 1..256)")
    for name, t in (("k_cache", kv.k_cache), ("v_cache", kv.v_cache)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            reasons.append(f"{name}'s last dimension is not contiguous (stride {t.stride(-1)}); the cache is "
                           f"updated in place, so it is not copied: pass a cache with unit stride on D")
    if reasons:
        return reasons
    reasons.extend(_device_reasons(kv.device))
    rows = kv.page_size if kv.paged else kv.capacity
    for name, t in (("k_cache", kv.k_cache), ("v_cache", kv.v_cache)):
        if rows * abs(t.stride(1)) >= 2 ** 31:
            reasons.append(f"{name}: {rows} rows x row stride {t.stride(1)} does not fit int32 offsets; "
                           f"use a paged cache or fewer heads per call")
    if kv.batch > MAX_BATCH_HEADS or kv.seqlen_new > MAX_BATCH_HEADS:
        reasons.append(f"batch ({kv.batch}) and new keys ({kv.seqlen_new}) must be <= {MAX_BATCH_HEADS} (grid limit)")
    return reasons


_decode = None   # the decode module, imported on first use (it imports triton)


def _forward_kvcache(self, kv):
    """Append the new k/v in place, then split-KV attention: ``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq))``."""
    global _decode
    if _decode is None:
        from . import decode as _decode
    return _decode.forward(kv)


TritonBackend.kvcache_reasons = _kvcache_reasons
TritonBackend.forward_kvcache = _forward_kvcache

#: a dense call with at most this many queries per sequence (and no more than 64 packed rows per
#: KV head) and at least DECODE_MIN_KEYS keys runs on the split-KV decode kernels
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 256
#: (device, batch, Sk) -> int32 (B,) lengths, all Sk: made once (graph-capturable afterwards)
_full_lengths: dict = {}


def _lengths(device, batch: int, seqlen_k: int):
    """The int32 (B,) lengths, all ``Sk``, made once per (device, B, Sk); None when it does not
    exist yet and a CUDA graph is being captured (a tensor filled inside a capture holds nothing
    until the graph replays: the dense kernels run that call instead)."""
    key = (device, batch, seqlen_k)
    t = _full_lengths.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if len(_full_lengths) > 256:
            _full_lengths.clear()
        t = _full_lengths[key] = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    return t


def _as_decode(spec):
    """The dense problem ``spec`` as a KV-cache problem over a full cache (every sequence's length
    ``Sk``), when it is decode-shaped and the decode kernels compute it the same way: no gradient,
    dense (not varlen), no ``attn_bias``, ``Sq <= DECODE_MAX_QUERIES``, at most 64 packed
    (query head x query) rows per KV head, ``Sk >= DECODE_MIN_KEYS``, unit stride on K/V's last
    dimension. Masking, softcap, ALiBi and GQA carry over (docs/semantics.md: the window acts on
    the aligned row ``i + Sk - Sq`` or ``i``, as in the KV-cache API with ``L_b = Sk``). None
    otherwise (the dense kernels run)."""
    if (spec.needs_grad or spec.cu_seqlens_q is not None or spec.attn_bias is not None
            or spec.seqlen_q > DECODE_MAX_QUERIES or spec.seqlen_k < DECODE_MIN_KEYS
            or spec.seqlen_q * (spec.num_heads_q // spec.num_heads_kv) > 64 or spec.q.numel() == 0):
        return None
    k, v = spec.k, spec.v
    if (k.stride(-1) != 1 and k.shape[-1] > 1) or (v.stride(-1) != 1 and v.shape[-1] > 1):
        return None
    lengths = _lengths(spec.device, spec.batch, spec.seqlen_k)
    if lengths is None:
        return None
    from portattn.kvcache import KVCacheSpec
    return KVCacheSpec(
        q=spec.q, k_cache=k, v_cache=v, cache_seqlens=lengths,
        scale=spec.scale, causal=spec.causal, alignment=spec.alignment, window_left=spec.window_left,
        window_right=spec.window_right, softcap=spec.softcap, alibi_slopes=spec.alibi_slopes, return_lse=True,
        deterministic=spec.deterministic, allow_tf32=spec.allow_tf32)
