"""The ``sdpa`` backend: ``torch.nn.functional.scaled_dot_product_attention``.

It covers what SDPA can express and declines the rest with reasons:

* causal top-left is SDPA's own ``is_causal``; bottom-right causal and sliding windows become a
  boolean mask (``Sq <= Sk`` causal uses ``causal_lower_right``, which keeps the fused kernels);
* GQA through ``enable_gqa`` (torch >= 2.5) or by repeating K/V heads;
* ALiBi and float ``attn_bias`` become an additive mask; a bool ``attn_bias`` a boolean one;
* softcap and varlen are not expressible: reasons.

Rows with no visible key are given one visible key for SDPA (so it never sees an all-masked
row, which gives NaN in some kernels) and are then multiplied by 0, which also zeroes their
gradients. ``lse`` is not exposed by SDPA: when ``return_lse=True`` it is computed by an extra
float32 pass over ``Q Kᵀ`` (row chunks, bounded memory); a gradient reaching that lse is
added to SDPA's own backward by a second such pass (``dS = dlse · P``).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F

from portattn.reference import visible_keys
from portattn.registry import Backend

_LSE_CHUNK_ELEMENTS = 1 << 26


def _has_enable_gqa() -> bool:
    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return torch.__version__ >= "2.5"


_ENABLE_GQA = _has_enable_gqa()


def _keep_mask(spec, device) -> torch.Tensor | None:
    """Bool (Sq, Sk) mask of keys visible under causal/window, or None if all are."""
    return visible_keys(spec, spec.seqlen_q, spec.seqlen_k, device)


def _alibi_bias(spec, dtype, device) -> torch.Tensor:
    sq, sk = spec.seqlen_q, spec.seqlen_k
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    dist = (i + (sk - sq) - j).abs().to(torch.float32)
    return (-spec.alibi_slopes.view(spec.batch, spec.num_heads_q, 1, 1) * dist).to(dtype)


def _fused_kernel_friendly(t: torch.Tensor) -> bool:
    """True when SDPA's fused GPU kernels can read ``t`` as it is: unit stride on the last
    dim, other strides and the base address 16-byte aligned. On the H200 (torch 2.11, 2026-11-29)
    views with a padded head dim (row stride D + 3) gave NaN from the fused fp16/bf16 kernels
    and "cutlassF: no kernel found" for fp32, so such views are copied first. Every stride counts,
    a size-1 dim's too: the memory-efficient kernel checks them all (an fp16 view of shape
    (1, 1, 1, 16) with strides (38, 38, 19, 1) raised "cutlassF: no kernel found to launch!" on the
    H200, 2026-12-04, found by the property suite)."""
    size = t.element_size()
    if t.stride(-1) != 1 or (t.data_ptr() % 16):
        return False
    return all((s * size) % 16 == 0 for s in t.stride()[:-1])


def _dense(t: torch.Tensor) -> bool:
    """Whether canonical ``t`` (B, S, H, D) is dense in (B, S, H, D) or (B, H, S, D) order."""
    return t.is_contiguous() or t.transpose(1, 2).is_contiguous()


def _dense_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in the dense layout of its own sequence/head order: (B, S, H, D) when its
    sequence stride is the larger, else (B, H, S, D) seen as (B, S, H, D). So a padded view
    computes on the layout of the dense tensor it is a window of. Always a new tensor with the
    strides its sizes give (``contiguous()`` would return a view whose size-1 dims have odd
    strides as it is: torch counts it contiguous)."""
    if t.stride(1) >= t.stride(2):
        return t.clone(memory_format=torch.contiguous_format)
    return t.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


def _copies_unfriendly_views(spec) -> bool:
    """Only SDPA's fused CUDA kernels misread unaligned views (a function, so that a CPU test can
    turn the copy path on)."""
    return spec.device.type == "cuda"


def _sdp_flags():
    """(getter, setter, enabled-for-math) of every SDPA kernel flag torch has."""
    from torch.nn.attention import _backend_names
    flags = []
    for name in _backend_names:
        get, put = getattr(torch._C, f"_get_{name}_sdp_enabled", None), getattr(torch._C, f"_set_sdp_use_{name}", None)
        if get is not None and put is not None:
            flags.append((get, put, name == "math"))
    return tuple(flags)


class _MathOnly:
    """Only SDPA's math kernel inside the block: what ``sdpa_kernel([SDPBackend.MATH])`` does
    (same global flags, restored on exit), without its Python overhead, which at small sizes
    cost more than the attention itself."""

    __slots__ = ("saved",)
    _flags = None

    def __enter__(self):
        flags = _MathOnly._flags or _sdp_flags()
        _MathOnly._flags = flags
        self.saved = [get() for get, _, _ in flags]
        for _, put, math in flags:
            put(math)
        return self

    def __exit__(self, *exc):
        for (_, put, _), was in zip(_MathOnly._flags, self.saved):
            put(was)


#: the context of a call where torch picks SDPA's kernel (reusable: nullcontext keeps no state)
_ANY_KERNEL = contextlib.nullcontext()


def _kernel_choice(spec, for_grad: bool):
    """The context SDPA runs in: its math kernel only, or :data:`_ANY_KERNEL` (torch chooses).
    Gradients (``for_grad``: the recomputation under ``torch.func.vjp``) use the math kernel on
    CPU: the fused CPU kernel approximates exp, and its backward missed the equivalence rule
    (docs/semantics.md; fp16 with extreme logits: dq 13x the naive error, found by the property
    suite; float32 bhsd views: dk 3.6x, the conformance catalogue on CPU, 2026-12-01). Its forward meets the rule (the CPU catalogue and
    tests/test_sdpa.py::test_cpu_forward_uses_the_fused_kernel), and costs ~40 us less than the
    math kernel per small call, so the forward lets torch choose on CPU (float64 keeps the
    math). On GPUs float32/float64 always take the math kernel: on the H200 (2026-11-29) the
    fused CUDA float32 kernel missed the rule on small problems (e.g. 4.8e-7 on a one-key row
    the math gives exactly)."""
    cpu = spec.q.device.type == "cpu"
    if spec.dtype == torch.float64 or (not cpu and spec.dtype == torch.float32) or (cpu and for_grad):
        return _MathOnly()
    return _ANY_KERNEL


class _Plan:
    """How one spec maps onto an SDPA call: the mask argument, is_causal, and empty rows."""

    def __init__(self, spec, dtype):
        device = spec.device
        self.is_causal = False
        self.mask = None           # bool or float, broadcastable to (B, Hq, Sq, Sk)
        self.row_keep = None       # float (B|1, Hq|1, Sq, 1) multiplier: 0 for rows with no key
        self.structured = False    # mask is SDPA's own causal (is_causal / causal_lower_right)
        keep = _keep_mask(spec, device)
        plain_causal = (spec.causal and spec.window_left is None and spec.attn_bias is None
                        and spec.alibi_slopes is None)
        if plain_causal and (spec.alignment == "top_left" or spec.seqlen_q == spec.seqlen_k):
            self.is_causal = self.structured = True
            return
        if plain_causal and spec.seqlen_q < spec.seqlen_k:
            from torch.nn.attention.bias import causal_lower_right
            self.mask = causal_lower_right(spec.seqlen_q, spec.seqlen_k)
            self.structured = True
            return
        if spec.bias_is_mask:
            keep = spec.attn_bias if keep is None else (spec.attn_bias & keep)
        additive = None
        if spec.alibi_slopes is not None:
            additive = _alibi_bias(spec, dtype, device)
        if spec.attn_bias is not None and not spec.bias_is_mask:
            b = spec.attn_bias.to(dtype)
            additive = b if additive is None else additive + b
        if keep is None and additive is None:
            return
        # Which rows keep at least one key? (float -inf in the bias also hides a key.)
        visible = keep
        if additive is not None and bool(torch.isneginf(additive).any()):
            finite = ~torch.isneginf(additive)
            visible = finite if visible is None else (visible & finite)
        if visible is not None:
            any_key = visible.any(dim=-1, keepdim=True)
            if not bool(any_key.all()):
                self.row_keep = any_key.to(dtype)
                first = torch.zeros_like(visible)
                first[..., 0] = True
                # give empty rows one visible key, then zero their output (and gradients)
                visible = visible | (~any_key & first)
                if additive is not None:
                    additive = torch.where(visible & torch.isneginf(additive), torch.zeros_like(additive), additive)
                keep = visible
        if additive is None:
            self.mask = keep
        else:
            self.mask = additive if keep is None else additive.masked_fill(~keep, float("-inf"))


_NANS: dict = {}


def _nan_lse(device: torch.device, shape: tuple) -> torch.Tensor:
    """A float32 NaN of ``shape`` on ``device`` that costs no memory: an expanded view of one NaN
    scalar, made once per (device, shape). It stands for an lse nobody asked for: writes into an
    expanded view raise, reads give NaN."""
    key = (device, shape)
    t = _NANS.get(key)
    if t is None:
        if len(_NANS) > 256:
            _NANS.clear()
        t = _NANS[key] = torch.full((), float("nan"), dtype=torch.float32, device=device).expand(*shape)
    return t


class _NoMask:
    """The plan of a problem with nothing to mask (the common case): no tensor work at all."""

    is_causal = False
    mask = None
    row_keep = None
    structured = False


def _plan(spec, dtype):
    if (spec.window_left is None and spec.window_right is None and spec.attn_bias is None
            and spec.alibi_slopes is None):
        return _NoMask
    return _Plan(spec, dtype)


class SdpaBackend(Backend):
    """torch's scaled_dot_product_attention (FlashAttention-2, cuDNN, memory-efficient or math,
    as torch chooses) for the problems it can express."""

    name = "sdpa"
    stable_reasons = True   # determinism and the TF32 flag (keyed); _PinnedSdpaBackend asks torch: not stable
    #: the forward on CPU lets torch choose its fused kernel (see _kernel_choice); the pinned
    #: kernels' backends run the math kernel on CPU (their CPU runs check the rewrites)
    cpu_fused_forward = True
    description = "torch.nn.functional.scaled_dot_product_attention"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    head_dims = (1, 512)
    vendors = frozenset({"nvidia", "amd", "cpu", "mps", "xpu"})
    features = frozenset({"causal", "top_left", "window", "alibi", "bias", "bool_mask", "bias_grad", "gqa",
                          "head_dim_v"})
    deterministic = True
    has_backward = True

    def extra_reasons(self, spec) -> list[str]:
        reasons = []
        if spec.deterministic and spec.needs_grad and spec.vendor != "cpu":
            reasons.append("torch SDPA's GPU backward kernels are not guaranteed deterministic "
                           "(determinism was requested)")
        if spec.dtype == torch.float32 and spec.vendor != "cpu" and spec.allow_tf32 is False \
                and torch.backends.cuda.matmul.allow_tf32:
            reasons.append("torch.backends.cuda.matmul.allow_tf32 is on, so SDPA would use TF32 for float32; "
                           "turn it off or set PORTATTN_ALLOW_TF32=1")
        return reasons

    # ----- compute -----------------------------------------------------------------------
    @staticmethod
    def _friendly(spec, tensors):
        """Dense copies of the views SDPA's fused CUDA kernels cannot read (see
        _fused_kernel_friendly) and, elsewhere, of the views that are not dense (padded heads or
        head dims): torch's fused CPU kernel rounds differently on such a view than on the dense
        tensor of the same values (a float32 ulp on an AMD EPYC, 2026-12-03), and a view must
        give the bits its dense copy gives (tests/test_properties.py). Called on real tensors
        only: under torch.func.vjp they are wrappers without storage."""
        if _copies_unfriendly_views(spec):
            return [t if _fused_kernel_friendly(t) else _dense_copy(t) for t in tensors]
        return [t if _dense(t) else _dense_copy(t) for t in tensors]

    def _sdpa(self, spec, q, k, v, for_grad: bool = False):
        """q/k/v in canonical (B, S, H, D), already made friendly; returns out (B, Sq, Hq, Dv).
        ``for_grad``: the call is differentiated (see :func:`_kernel_choice`)."""
        plan = _plan(spec, q.dtype)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kwargs = {}
        if spec.num_heads_q != spec.num_heads_kv:
            if _ENABLE_GQA:
                kwargs["enable_gqa"] = True
            else:
                kh = kh.repeat_interleave(spec.gqa_ratio, dim=1)
                vh = vh.repeat_interleave(spec.gqa_ratio, dim=1)
        with _kernel_choice(spec, for_grad or not self.cpu_fused_forward):
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=plan.mask, is_causal=plan.is_causal,
                                                 scale=spec.scale, **kwargs)
        if plan.row_keep is not None:
            out = out * plan.row_keep
        return out.transpose(1, 2), plan

    @staticmethod
    def _score_chunks(spec, dtype):
        """Masked scores ``scale · q kᵀ (+ mask)`` in ``dtype``, in row chunks of bounded size:
        yields ``(r0, r1, s (B, Hq, r1 - r0, Sk), keep)``, ``keep`` bool (B, Hq, r1 - r0) False
        for rows with no visible key (their scores are not all -inf: see :class:`_Plan`), or None."""
        plan = _plan(spec, dtype)
        b, hq, sq, sk = spec.batch, spec.num_heads_q, spec.seqlen_q, spec.seqlen_k
        q, k = SdpaBackend._friendly(spec, (spec.q, spec.k))   # a view's bits are its dense copy's
        q = q.transpose(1, 2).to(dtype)
        k = k.transpose(1, 2).to(dtype).repeat_interleave(spec.gqa_ratio, dim=1)
        mask = _keep_mask(spec, spec.device) if plan.structured else plan.mask
        step = max(1, _LSE_CHUNK_ELEMENTS // max(1, b * hq * sk))
        for r0 in range(0, sq, step):
            r1 = min(sq, r0 + step)
            s = (q[:, :, r0:r1] @ k.transpose(-1, -2)) * spec.scale
            if mask is not None:
                m = mask[..., r0:r1, :]
                s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(dtype)
            keep = None
            if plan.row_keep is not None:
                keep = plan.row_keep.expand(b, hq, sq, 1)[:, :, r0:r1, 0] > 0
            yield r0, r1, s, keep

    def _lse(self, spec) -> torch.Tensor:
        """log-sum-exp of the masked scores in float32, computed in row chunks."""
        lse = torch.empty(spec.lse_shape, dtype=torch.float32, device=spec.device)
        for r0, r1, s, keep in self._score_chunks(spec, torch.float32):
            chunk = torch.logsumexp(s, dim=-1)
            lse[:, :, r0:r1] = chunk if keep is None else chunk.masked_fill(~keep, float("-inf"))
        return lse

    def _lse_grads(self, spec, dlse: torch.Tensor, want_dbias: bool):
        """The gradients of ``Σ dlse · lse``: with ``dS = dlse_i · P_ij`` (∂lse_i/∂s_ij = P_ij),
        ``dq = scale · dS k``, ``dk = scale · dSᵀ q`` (summed over each GQA group) and
        ``dbias = dS``; rows with no visible key get none. Row chunks as :meth:`_lse`, in float32
        (float64 for float64 inputs). Returns canonical ``(dq, dk, dbias or None)`` in that dtype."""
        dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32
        b, hkv, sk = spec.batch, spec.num_heads_kv, spec.seqlen_k
        q, k = self._friendly(spec, (spec.q.detach(), spec.k.detach()))
        q = q.transpose(1, 2).to(dtype)
        k = k.transpose(1, 2).to(dtype).repeat_interleave(spec.gqa_ratio, dim=1)
        dq = torch.empty(q.shape, dtype=dtype, device=spec.device)
        dk = torch.zeros(k.shape, dtype=dtype, device=spec.device)
        dbias = torch.empty(spec.attn_bias.shape, dtype=dtype, device=spec.device) if want_dbias else None
        dlse = dlse.to(dtype)
        for r0, r1, s, keep in self._score_chunks(spec, dtype):
            g = dlse[:, :, r0:r1]
            if keep is not None:
                g = g.masked_fill(~keep, 0.0)
            ds = torch.softmax(s, dim=-1) * g.unsqueeze(-1)
            if keep is not None:   # (the plan gave these rows one key: P there is not 0)
                ds = ds.masked_fill(~keep.unsqueeze(-1), 0.0)
            dq[:, :, r0:r1] = (ds @ k) * spec.scale
            dk += (ds.transpose(-1, -2) @ q[:, :, r0:r1]) * spec.scale
            if dbias is not None:
                dbias[:, :, r0:r1] = ds
        dk = dk.view(b, hkv, spec.gqa_ratio, sk, -1).sum(dim=2)
        return dq.transpose(1, 2), dk.transpose(1, 2), dbias

    def forward(self, spec):
        if spec.needs_grad and torch.is_grad_enabled():   # called directly (autograd.Function and
            with torch.no_grad():                           # the custom op run without grad)
                return self._forward(spec)
        return self._forward(spec)

    def _forward(self, spec):
        """``out`` is a (B, Sq, Hq, Dv) view of SDPA's (B, Hq, Sq, Dv) output (the custom op makes
        its outputs contiguous, as its fake implementation declares)."""
        out, _ = self._sdpa(spec, *self._friendly(spec, (spec.q, spec.k, spec.v)))
        if spec.return_lse:
            lse = self._lse(spec)
        elif spec.needs_grad:   # saved for the backward, which never reads it
            lse = torch.full(spec.lse_shape, float("nan"), dtype=torch.float32, device=spec.device)
        else:                   # not requested and not saved: a read-only NaN view (no allocation)
            lse = _nan_lse(spec.device, spec.lse_shape)
        return out, lse

    def backward(self, spec, out, lse, dout, dlse=None):
        # Recompute SDPA under torch.func.vjp (works inside the custom op) and pull dout back;
        # SDPA has no lse output, so dlse's share is added by _lse_grads.
        want_dbias = spec.attn_bias is not None and not spec.bias_is_mask and spec.attn_bias.requires_grad
        # made friendly here, outside vjp (the copy is the identity, so are its gradients)
        primals = self._friendly(spec, (spec.q.detach(), spec.k.detach(), spec.v.detach()))
        if want_dbias:
            primals.append(spec.attn_bias.detach())

        def f(q, k, v, bias=None):
            s = spec if bias is None else _with_bias(spec, bias)
            return self._sdpa(s, q, k, v, for_grad=True)[0]

        with torch.enable_grad():
            _, vjp = torch.func.vjp(f, *primals)
            grads = vjp(dout.to(spec.dtype))
        dq, dk, dv = grads[:3]
        dbias = grads[3] if want_dbias else None
        if dlse is not None:
            lq, lk, lb = self._lse_grads(spec, dlse, want_dbias)
            dq = (dq.to(lq.dtype) + lq).to(spec.dtype)
            dk = (dk.to(lk.dtype) + lk).to(spec.dtype)
            if want_dbias:
                dbias = (dbias.to(lb.dtype) + lb).to(dbias.dtype)
        return dq, dk, dv, dbias


def _with_bias(spec, bias):
    import dataclasses
    new = dataclasses.replace(spec)
    object.__setattr__(new, "attn_bias", bias)
    return new
