"""``portattn.attention``: the public function, its call paths and its autograd.

One validation (:func:`portattn.spec.build_spec`) and one backend choice
(:func:`portattn.dispatch.select_stable`) per call *signature*: a dense call whose shapes,
strides, dtypes, arguments and selection state were seen before reuses the validated spec and,
when the choice is stable, the backend (:mod:`portattn.callcache`). Then one of three paths,
with identical results:

* **eager, no gradient needed**: the backend's ``forward`` is called directly;
* **eager, gradient needed**: :class:`_Attention` (a ``torch.autograd.Function``) calls the
  chosen backend's ``forward`` and, later, the same backend's ``backward`` (with the gradient
  of ``lse`` when the caller used it);
* **under torch.compile**: the ``torch.library`` custom op ``portattn::attention`` (one graph
  node, with a fake implementation; the ONNX exporter translates it into the portattn
  ``FlashAttention`` op). The op selects its backend when it runs (``use_backend`` and
  ``PORTATTN_BACKEND`` are read then) and hands the name to its backward op.

Empty problems (no query rows or no keys) compute nothing: the output is 0 and lse −inf
(docs/semantics.md), and gradients are 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import callcache, dispatch
from .registry import get_backend
from .spec import AttentionSpec, build_spec, spec_from_canonical

Tensor = torch.Tensor


# ----- running one backend -------------------------------------------------------------------

class _Empty:
    """Stands in for a backend on empty problems: nothing to compute, nothing to differentiate."""

    name = "(empty problem)"

    @staticmethod
    def forward(spec: AttentionSpec):
        out = torch.zeros(spec.out_shape, dtype=spec.dtype, device=spec.device)
        lse = torch.full(spec.lse_shape, float("-inf"), dtype=torch.float32, device=spec.device)
        return out, lse

    @staticmethod
    def backward(spec: AttentionSpec, out, lse, dout, dlse=None):
        dbias = None
        if spec.attn_bias is not None and spec.attn_bias.requires_grad:
            dbias = torch.zeros(spec.attn_bias.shape, dtype=spec.attn_bias.dtype, device=spec.device)
        return torch.zeros_like(spec.q), torch.zeros_like(spec.k), torch.zeros_like(spec.v), dbias


def _choose(spec: AttentionSpec, backend: str | None):
    return _choose_stable(spec, backend)[0]


def _choose_stable(spec: AttentionSpec, backend: str | None):
    """``(backend, stable)``: see :func:`portattn.dispatch.select_stable`."""
    if spec.is_empty:
        dispatch._requested(backend)   # an unknown name fails even on an empty problem
        return _Empty, True            # empty is a matter of shapes alone
    return dispatch.select_stable(spec, backend)


def _not_an_input(out, spec: AttentionSpec):
    """``out``, or a copy of it when it is (a view of) an input: never hand one back as the output."""
    if out.numel() and out.data_ptr() in (spec.q.data_ptr(), spec.k.data_ptr(), spec.v.data_ptr()):
        return out.clone()
    return out


def _forward(impl, spec: AttentionSpec):
    out, lse = impl.forward(spec)
    return _not_an_input(out, spec), lse


def _forward_for_backward(impl, spec: AttentionSpec):
    """``(out, lse, residuals)``: the forward of a call whose backward follows on ``impl``
    (:meth:`Backend.forward_for_backward`; a backend without it keeps no residuals)."""
    fwd = getattr(impl, "forward_for_backward", None)
    if fwd is None:
        return (*_forward(impl, spec), ())
    out, lse, residuals = fwd(spec)
    return _not_an_input(out, spec), lse, tuple(residuals)


def _backward(impl, spec: AttentionSpec, out, lse, dout, dlse, residuals=()):
    if dout is None:
        dout = torch.zeros_like(out)
    extra = {"residuals": residuals} if residuals else {}
    if dlse is None:
        return impl.backward(spec, out, lse, dout.contiguous(), **extra)
    return impl.backward(spec, out, lse, dout.contiguous(), dlse.contiguous(), **extra)


def _dbias_for(dbias, bias: Tensor | None):
    """The gradient of the caller's (broadcastable) bias from the backend's expanded one."""
    if dbias is None or bias is None:
        return None
    return dbias.sum_to_size(bias.shape).to(bias.dtype)


class _Attention(torch.autograd.Function):
    """Eager autograd: forward and backward on the one backend chosen for the call."""

    @staticmethod
    def forward(ctx, impl, spec, q, k, v, bias):
        out, lse, residuals = _forward_for_backward(impl, spec)
        ctx.impl, ctx.spec, ctx.bias = impl, spec, bias
        ctx.save_for_backward(out, lse, *residuals)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse, *residuals = ctx.saved_tensors
        dq, dk, dv, dbias = _backward(ctx.impl, ctx.spec, out, lse, dout, dlse, tuple(residuals))
        bias = ctx.bias
        return None, None, dq, dk, dv, _dbias_for(dbias, bias) if bias is not None and bias.requires_grad else None


# ----- the custom op (torch.compile and ONNX export) -----------------------------------------

def _op_spec(q, k, v, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             scale, causal, alignment, window_left, window_right, softcap, return_lse, needs_grad) -> AttentionSpec:
    """The spec inside the op, from canonical, already-validated arguments."""
    return spec_from_canonical(
        q, k, v, scale=scale, causal=causal, alignment=alignment,
        window_left=None if window_left < 0 else window_left, window_right=None if window_right < 0 else window_right,
        softcap=softcap if softcap > 0 else None, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        return_lse=return_lse, needs_grad=needs_grad)


@torch.library.custom_op("portattn::attention", mutates_args=())
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], attn_bias: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
    scale: float, causal: bool, alignment: str, window_left: int, window_right: int, softcap: float,
    backend: str, return_lse: bool, needs_grad: bool,
) -> tuple[Tensor, Tensor]:
    spec = _op_spec(q, k, v, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    scale, causal, alignment, window_left, window_right, softcap, return_lse, needs_grad)
    out, lse = _forward(_choose(spec, backend or None), spec)
    return out.contiguous(), lse.contiguous()   # the strides _attention_fake declares


def _lse_shape(q, cu_seqlens_q):
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


@_attention_op.register_fake
def _attention_fake(q, k, v, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    scale, causal, alignment, window_left, window_right, softcap, backend, return_lse, needs_grad):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("portattn::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    alibi_slopes: Optional[Tensor], attn_bias: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
    scale: float, causal: bool, alignment: str, window_left: int, window_right: int, softcap: float,
    backend: str, bias_requires_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if bias_requires_grad:
        attn_bias = attn_bias.detach().requires_grad_(True)
    spec = _op_spec(q, k, v, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    scale, causal, alignment, window_left, window_right, softcap, False, True)
    impl = _Empty if spec.is_empty else get_backend(backend) if backend else dispatch.select(spec)
    dq, dk, dv, dbias = _backward(impl, spec, out, lse, dout, dlse)
    dbias = _dbias_for(dbias, attn_bias) if bias_requires_grad else None
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), q.new_empty(0) if dbias is None else dbias.contiguous()


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, scale, causal, alignment, window_left, window_right,
                             softcap, backend, bias_requires_grad):
    dbias = torch.empty_like(attn_bias) if bias_requires_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


def _setup_context(ctx, inputs, output):
    (q, k, v, alibi, bias, cu_q, cu_k, max_q, max_k, scale, causal, alignment, wl, wr, softcap,
     backend, return_lse, needs_grad) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi, bias, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, causal, alignment, wl, wr, softcap, backend)
    ctx.bias_requires_grad = bias is not None and bias.requires_grad
    ctx.return_lse = return_lse
    ctx.set_materialize_grads(False)


def _op_backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi, bias, cu_q, cu_k = ctx.saved_tensors
    if not ctx.return_lse:   # lse was not handed to the caller: any gradient it has is a materialised 0
        dlse = None
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias = _attention_backward_op(dout, dlse, q, k, v, out, lse, alibi, bias, cu_q, cu_k, *ctx.args,
                                               ctx.bias_requires_grad)
    return (dq, dk, dv, None, dbias if ctx.bias_requires_grad else None,
            None, None, None, None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("portattn::attention", _op_backward, setup_context=_setup_context)


# ----- the public function -------------------------------------------------------------------

def _bias_4d(attn_bias: Tensor | None) -> Tensor | None:
    """The caller's bias as a 4-D view, broadcastable (not expanded) to (B, Hq, Sq, Sk)."""
    if attn_bias is None or attn_bias.dim() == 4:
        return attn_bias
    return attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))


#: argument names of other libraries -> portattn's (for the TypeError of an unknown keyword)
_ALIASES = {
    "is_causal": "causal=True (bottom-right aligned; add causal_alignment='top_left' for SDPA's is_causal)",
    "softmax_scale": "scale=", "sm_scale": "scale=", "window_size": "window=(left, right)",
    "attn_mask": "attn_bias= (a float bias, or a bool mask with True = keep)", "mask": "attn_bias=",
    "enable_gqa": "nothing: GQA is automatic when k/v have fewer heads than q",
    "dropout_p": "nothing: portattn computes exact attention without dropout",
    "return_softmax_lse": "return_lse=True", "return_attn_probs": "return_lse=True",
}


def _unexpected(kwargs: dict) -> TypeError:
    parts = []
    for name in kwargs:
        hint = _ALIASES.get(name)
        parts.append(f"{name!r}" + (f" (use {hint})" if hint else ""))
    return TypeError(f"attention() got unexpected keyword argument(s) {', '.join(parts)}; see help(portattn.attention)")


def attention(q, k, v, *, causal=False, causal_alignment="bottom_right", window=None, scale=None, softcap=None,
              alibi_slopes=None, attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, layout="bshd", return_lse=False, backend=None, **unexpected):
    """Exact attention ``softmax(scale · q kᵀ + bias) v`` with FlashAttention's tiled online softmax.

    Shapes (``layout="bshd"``, flash-attn's; ``layout="bhsd"`` is SDPA's order)::

        q (B, Sq, Hq, D)   k (B, Sk, Hkv, D)   v (B, Sk, Hkv, Dv)   ->  out (B, Sq, Hq, Dv)

    Varlen (packed) sequences: ``q (total_q, Hq, D)``, ``k/v (total_k, Hkv, D/Dv)`` with
    ``cu_seqlens_q/k`` (int32, ``B + 1``, starting at 0) and optional ``max_seqlen_q/k`` (give
    them under ``torch.compile`` and CUDA-graph capture, where cu_seqlens is not read on the host).
    ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``).
    The output has q's dtype and layout.

    Score of query row ``i`` against key ``j``, in this order (docs/semantics.md):

    1. ``s = scale · q_i · k_j`` (default ``scale = 1/sqrt(D)``), accumulated in float32 at least;
    2. ``softcap=c > 0``: ``s = c · tanh(s / c)``;
    3. ``alibi_slopes`` ``(Hq,)`` or ``(B, Hq)``: ``s -= slope · |i + Sk − Sq − j|``;
    4. ``attn_bias`` broadcastable to ``(B, Hq, Sq, Sk)``: added (float) or a mask (bool, True = keep);
    5. masking: ``causal`` and ``window=(left, right)`` act on the aligned row ``i' = i + Sk − Sq``
       (``causal_alignment="bottom_right"``, flash-attn's, the default) or ``i' = i``
       (``"top_left"``, SDPA's). Key ``j`` is visible iff ``i' − left ≤ j ≤ i' + right``;
       ``None``/``-1`` is unbounded; ``causal=True`` is ``right = 0``::

           Sq=2, Sk=5, causal, bottom_right      top_left
             q0: x x x x .                         q0: x . . . .
             q1: x x x x x                         q1: x x . . .

    A row with no visible key outputs **0** and has ``lse = -inf`` (never NaN).
    ``return_lse=True`` also returns the natural-log log-sum-exp, float32 ``(B, Hq, Sq)``
    (varlen: ``(Hq, total_q)``). Differentiable in q, k, v and a float ``attn_bias``, through
    ``out`` and through ``lse`` (∂lse_i/∂s_ij = P_ij). float32 inputs are computed in IEEE
    float32 unless ``PORTATTN_ALLOW_TF32=1``.

    ``backend`` pins a backend by name, or ``"fastest"`` for the fastest verified one (else
    ``use_backend(...)``, ``PORTATTN_BACKEND``, or the policy decides; see :func:`portattn.explain`).
    A pinned backend that cannot run raises ``ValueError`` with its reasons.
    """
    if unexpected:
        raise _unexpected(unexpected)
    compiling = torch.compiler.is_compiling()
    sig = plan = None
    if (not compiling and alibi_slopes is None and cu_seqlens_q is None and cu_seqlens_k is None
            and max_seqlen_q is None and max_seqlen_k is None):
        try:
            sig = callcache.key(q, k, v, attn_bias, causal, causal_alignment, window, scale, softcap, layout,
                                return_lse, backend)
        except TypeError:   # an unhashable argument: the full path says what is wrong with it
            sig = None
        if sig is not None:
            plan = callcache.spec_for(sig, q, k, v, attn_bias)
    if plan is not None:
        spec, impl = plan
    else:
        spec = build_spec(q, k, v, causal=causal, causal_alignment=causal_alignment, window=window, scale=scale,
                          softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                          layout=layout, return_lse=return_lse)
        impl = None
    bias = _bias_4d(attn_bias)
    if compiling:
        out, lse = _attention_op(
            spec.q, spec.k, spec.v, spec.alibi_slopes, bias, spec.cu_seqlens_q, spec.cu_seqlens_k,
            spec.max_seqlen_q or 0, spec.max_seqlen_k or 0, spec.scale, spec.causal, spec.alignment,
            -1 if spec.window_left is None else spec.window_left,
            -1 if spec.window_right is None else spec.window_right,
            spec.softcap or 0.0, backend or "", spec.return_lse, spec.needs_grad)
    else:
        if impl is None:
            impl, stable = _choose_stable(spec, backend)
            if sig is not None and plan is None:
                spec.signature = sig
                callcache.remember(sig, spec, impl if stable else None,
                                   until=stable if type(stable) is float else None)
        if spec.needs_grad:
            out, lse = _Attention.apply(impl, spec, spec.q, spec.k, spec.v, bias)
        else:
            out, lse = _forward(impl, spec)
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def explain(q, k, v, *, backend=None, **kwargs) -> dispatch.Explanation:
    """Which backend :func:`attention` would use for these arguments, and why each other one
    would not. ``print(portattn.explain(q, k, v, causal=True))`` gives a readable report."""
    spec = build_spec(q, k, v, **kwargs)
    return dispatch.explain_spec(spec, backend)
