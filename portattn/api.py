"""``portattn.attention``: the public function, its torch custom op and its autograd.

The Python wrapper validates the arguments once (:func:`portattn.spec.build_spec`) and resolves
a pinned backend; the work happens inside the ``torch.library`` custom op
``portattn::attention``, which rebuilds the spec from its (already validated, canonical)
arguments, selects the backend at run time and calls it. Because the op has a fake (meta)
implementation, ``torch.compile(fullgraph=True)`` traces it as one node, and the ONNX exporter
translates that node into the portattn ``FlashAttention`` op.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch
from .spec import AttentionSpec, build_spec

Tensor = torch.Tensor


# ----- the custom op -----------------------------------------------------------------------

def _op_spec(q, k, v, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             scale, causal, alignment, window_left, window_right, softcap, return_lse, needs_grad) -> AttentionSpec:
    """Rebuild the spec inside the op from canonical, already-validated arguments."""
    varlen = cu_seqlens_q is not None
    spec = AttentionSpec(
        q=q, k=k, v=v, scale=scale, causal=causal, alignment=alignment,
        window_left=None if window_left < 0 else window_left,
        window_right=None if window_right < 0 else window_right,
        softcap=softcap if softcap > 0 else None, alibi_slopes=alibi_slopes,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if varlen else None, max_seqlen_k=max_seqlen_k if varlen else None,
        return_lse=return_lse, needs_grad=needs_grad,
        deterministic=_deterministic(), allow_tf32=_allow_tf32(),
    )
    if attn_bias is not None:
        object.__setattr__(spec, "attn_bias",
                           attn_bias.expand(spec.batch, spec.num_heads_q, spec.seqlen_q, spec.seqlen_k))
    return spec


def _deterministic() -> bool:
    from . import config
    return config.deterministic() or torch.are_deterministic_algorithms_enabled()


def _allow_tf32() -> bool:
    from . import config
    return config.allow_tf32()


def _run_backend(spec: AttentionSpec, backend: str):
    return dispatch.select(spec, backend or None)


@torch.library.custom_op("portattn::attention", mutates_args=())
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], attn_bias: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
    scale: float, causal: bool, alignment: str, window_left: int, window_right: int, softcap: float,
    backend: str, return_lse: bool, needs_grad: bool,
) -> tuple[Tensor, Tensor]:
    spec = _op_spec(q, k, v, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    scale, causal, alignment, window_left, window_right, softcap, return_lse, needs_grad)
    out, lse = _run_backend(spec, backend).forward(spec)
    if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) and out.numel():
        out = out.clone()   # a custom op's outputs must not alias its inputs
    return out, lse


def _lse_shape(q, cu_seqlens_q, max_seqlen_q):
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


@_attention_op.register_fake
def _attention_fake(q, k, v, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    scale, causal, alignment, window_left, window_right, softcap, backend, return_lse, needs_grad):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q, max_seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("portattn::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    alibi_slopes: Optional[Tensor], attn_bias: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
    scale: float, causal: bool, alignment: str, window_left: int, window_right: int, softcap: float,
    backend: str, bias_requires_grad: bool, dlse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec = _op_spec(q, k, v, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    scale, causal, alignment, window_left, window_right, softcap, False, True)
    if bias_requires_grad:
        object.__setattr__(spec, "attn_bias", spec.attn_bias.detach().requires_grad_(True))
    extra = {} if dlse is None else {"dlse": dlse.contiguous()}   # old-signature backends still work without it
    dq, dk, dv, dbias = _run_backend(spec, backend).backward(spec, out, lse, dout.contiguous(), **extra)
    if dbias is None or not bias_requires_grad:
        dbias = q.new_empty(0)
    else:
        dbias = dbias.sum_to_size(attn_bias.shape).to(attn_bias.dtype).contiguous()
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, alibi_slopes, attn_bias, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, scale, causal, alignment, window_left, window_right,
                             softcap, backend, bias_requires_grad, dlse=None):
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


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi, bias, cu_q, cu_k = ctx.saved_tensors
    # lse not returned to the caller: its (materialised zero) gradient is not needed
    dlse = dlse if ctx.return_lse else None
    dq, dk, dv, dbias = _attention_backward_op(dout, q, k, v, out, lse, alibi, bias, cu_q, cu_k, *ctx.args,
                                               ctx.bias_requires_grad, dlse)
    return (dq, dk, dv, None, dbias if ctx.bias_requires_grad else None,
            None, None, None, None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("portattn::attention", _backward, setup_context=_setup_context)


# ----- the public function -----------------------------------------------------------------

def _bias_4d(spec: AttentionSpec, attn_bias: Tensor | None) -> Tensor | None:
    """The caller's bias as a 4-D view, broadcastable (not expanded) to (B, Hq, Sq, Sk)."""
    if attn_bias is None:
        return None
    return attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))


def attention(q, k, v, *, causal=False, causal_alignment="bottom_right", window=None, scale=None, softcap=None,
              alibi_slopes=None, attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, layout="bshd", return_lse=False, backend=None):
    """Exact attention ``softmax(scale · q kᵀ + bias) v`` with FlashAttention's tiled online softmax.

    Shapes (``layout="bshd"``, flash-attn's; ``layout="bhsd"`` is SDPA's order)::

        q (B, Sq, Hq, D)   k (B, Sk, Hkv, D)   v (B, Sk, Hkv, Dv)   ->  out (B, Sq, Hq, Dv)

    Varlen (packed) sequences: ``q (total_q, Hq, D)``, ``k/v (total_k, Hkv, D/Dv)`` with
    ``cu_seqlens_q/k`` (int32, ``B + 1``, starting at 0) and optional ``max_seqlen_q/k``.
    ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``).
    The output has q's dtype and layout.

    Score of query row ``i`` against key ``j``, in this order:

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
    (varlen: ``(Hq, total_q)``). Differentiable in q, k, v and a float ``attn_bias``.
    float32 inputs are computed in IEEE float32 unless ``PORTATTN_ALLOW_TF32=1``.

    ``backend`` pins a backend by name (else ``use_backend(...)``, ``PORTATTN_BACKEND``, or the
    device's priority list decides; see :func:`portattn.explain`). A pinned backend that cannot
    run raises ``ValueError`` with its reasons.
    """
    spec = build_spec(q, k, v, causal=causal, causal_alignment=causal_alignment, window=window, scale=scale,
                      softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                      layout=layout, return_lse=return_lse)
    if torch.compiler.is_compiling():
        # The op selects at run time (use_backend and PORTATTN_BACKEND are read then).
        pin = backend or ""
    else:
        # Eager: select now (a pinned backend that cannot run fails here, with its reasons) and
        # hand the choice to the op, so forward and backward run on the same backend.
        pin = dispatch.select(spec, backend).name
    out, lse = _attention_op(
        spec.q, spec.k, spec.v, spec.alibi_slopes, _bias_4d(spec, attn_bias), spec.cu_seqlens_q, spec.cu_seqlens_k,
        spec.max_seqlen_q or 0, spec.max_seqlen_k or 0, spec.scale, spec.causal, spec.alignment,
        -1 if spec.window_left is None else spec.window_left, -1 if spec.window_right is None else spec.window_right,
        spec.softcap or 0.0, pin, spec.return_lse, spec.needs_grad,
    )
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def explain(q, k, v, *, backend=None, **kwargs) -> dispatch.Explanation:
    """Which backend :func:`attention` would use for these arguments, and why each other one
    would not. ``print(portattn.explain(q, k, v, causal=True))`` gives a readable report."""
    spec = build_spec(q, k, v, **kwargs)
    return dispatch.explain_spec(spec, backend)
