"""Host side of the Triton backend: turn an :class:`AttentionSpec` into kernel launches.

Imported lazily by :class:`portattn.backends.triton.TritonBackend` (it imports triton).
Inputs are never copied except when their last dimension is not contiguous.
"""

from __future__ import annotations

import torch
import triton

from . import kernels
from .configs import (
    ELEM_SIZES,
    BackwardConfigs,
    KernelConfig,
    Target,
    backward_configs,
    device_target,
    forward_config,
    padded_dim,
)

#: stands for an unbounded window side inside the kernels (|row ± window| stays far from int32 limits)
UNBOUNDED = 1 << 30


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _seq_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, sequence, head) strides of a canonical tensor; batch stride 0 for varlen."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(spec, lse: torch.Tensor | None = None) -> tuple[int, int]:
    """(batch, head) strides of lse/delta: (B, Hq, Sq) dense, (Hq, total_q) varlen; of ``lse``
    itself when given (unit stride along the rows), else of a contiguous one."""
    if lse is not None:
        return (0, lse.stride(0)) if spec.is_varlen else (lse.stride(0), lse.stride(1))
    if spec.is_varlen:
        return 0, spec.q.shape[0]
    return spec.num_heads_q * spec.seqlen_q, spec.seqlen_q


def _packed_totals(spec) -> tuple[int, int]:
    """(total_q, total_k): the packed rows the kernels clamp cu_seqlens into (varlen; dense
    problems pass 0, unread, so that the batch size does not change the kernels' specialisation)."""
    return (spec.q.shape[0], spec.k.shape[0]) if spec.is_varlen else (0, 0)


def _output(spec, given: torch.Tensor | None, shape, dtype, fill: float) -> torch.Tensor:
    """An output buffer: ``given`` (a view the kernels write through its strides; tests use one
    inside a guarded buffer) or a new one. Varlen outputs start filled: rows that no (clamped)
    sequence covers (a bad cu_seqlens, not validated under torch.compile) read 0 / -inf."""
    if given is None:
        if spec.is_varlen:
            return torch.full(shape, fill, dtype=dtype, device=spec.device)
        return torch.empty(shape, dtype=dtype, device=spec.device)
    if tuple(given.shape) != tuple(shape) or given.dtype != dtype or given.stride(-1) != 1:
        raise ValueError(f"output buffer must be {dtype} of shape {tuple(shape)} with unit last stride; "
                         f"got {given.dtype} {tuple(given.shape)} strides {given.stride()}")
    if spec.is_varlen:
        given.fill_(fill)
    return given


def _bias_args(spec, dummy: torch.Tensor):
    """(tensor, 4 strides, mode) for the bias; a bool mask is read as uint8."""
    bias = spec.attn_bias
    if bias is None:
        return dummy, (0, 0, 0, 0), kernels.BIAS_NONE
    if bias.dtype == torch.bool:
        return bias.view(torch.uint8), tuple(bias.stride()), kernels.BIAS_BOOL
    return bias, tuple(bias.stride()), kernels.BIAS_ADD


def _common(spec):
    """Scalars and constexprs shared by the forward, dK/dV and dQ kernels."""
    log2e = float(kernels.LOG2E.value)
    softcap = spec.softcap
    scalars = dict(
        qk_scale2=spec.scale * log2e,
        softcap_scale=spec.scale / softcap if softcap else 1.0,
        softcap2=softcap * log2e if softcap else 1.0,
        window_left=UNBOUNDED if spec.window_left is None else spec.window_left,
        window_right=UNBOUNDED if spec.window_right is None else spec.window_right,
    )
    # one tile width for D and Dv (see kernels.py), the larger one padded
    block_d = _block_d(spec)
    consts = dict(
        HEAD_D=spec.head_dim, HEAD_DV=spec.head_dim_v, BLOCK_D=block_d,
        IS_VARLEN=spec.is_varlen, BOTTOM_RIGHT=spec.alignment == "bottom_right",
        SOFTCAP=softcap is not None, ALIBI=spec.alibi_slopes is not None,
        IEEE=spec.dtype == torch.float32 and not spec.allow_tf32,
        # float32 and the score is qk_scale2·qk (scale > 0 is validated): keep qk and scale after
        # subtracting the max (one rounding fewer in P; 16-bit P is rounded to 16 bits anyway)
        RAW_SCORES=spec.dtype == torch.float32 and softcap is None and spec.alibi_slopes is None
        and (spec.attn_bias is None or spec.attn_bias.dtype == torch.bool),
    )
    return scalars, consts


def _target(spec) -> Target:
    return device_target(spec.device)


def _block_d(spec) -> int:
    return max(padded_dim(spec.head_dim), padded_dim(spec.head_dim_v))


def forward_config_for(spec) -> KernelConfig:
    return forward_config(_target(spec), _block_d(spec), ELEM_SIZES[spec.dtype])


def backward_configs_for(spec) -> BackwardConfigs:
    return backward_configs(_target(spec), _block_d(spec), ELEM_SIZES[spec.dtype])


def _empty_result(spec):
    out = torch.zeros(spec.out_shape, dtype=spec.dtype, device=spec.device)
    lse = torch.full(spec.lse_shape, float("-inf"), dtype=torch.float32, device=spec.device)
    return out, lse


def forward(spec, *, out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: ``(out, lse)`` in the canonical layout (see the backend), written
    into ``out``/``lse`` when given (views are fine: the kernel uses their strides)."""
    if spec.is_empty:
        return _empty_result(spec)
    q, k, v = (_last_contiguous(t) for t in (spec.q, spec.k, spec.v))
    out = _output(spec, out, spec.out_shape, spec.dtype, 0.0)
    lse = _output(spec, lse, spec.lse_shape, torch.float32, float("-inf"))
    varlen = spec.is_varlen
    bias, bias_strides, bias_mode = _bias_args(spec, q)
    slopes = spec.alibi_slopes if spec.alibi_slopes is not None else lse
    cu_q = spec.cu_seqlens_q if varlen else lse
    cu_k = spec.cu_seqlens_k if varlen else lse
    scalars, consts = _common(spec)
    cfg = forward_config_for(spec)
    grid = (triton.cdiv(spec.seqlen_q, cfg.block_m), spec.batch * spec.num_heads_q)
    kernels.attn_fwd[grid](
        q, k, v, out, lse, bias, slopes, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen), *_seq_strides(out, varlen),
        *_lse_strides(spec, lse), *bias_strides,
        spec.num_heads_q, spec.gqa_ratio, spec.seqlen_q, spec.seqlen_k, *_packed_totals(spec),
        scalars["qk_scale2"], scalars["softcap_scale"], scalars["softcap2"],
        scalars["window_left"], scalars["window_right"],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BIAS_MODE=bias_mode, **consts, **cfg.launch_options(),
    )
    return out, lse


def backward(spec, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None,
             *, grads: tuple | None = None):
    """Run dQ (which first recomputes the row stats) then dK/dV: ``(dq, dk, dv, dbias or None)``.
    ``out`` and ``lse`` are accepted for the backend interface and not read; ``dlse`` (float32,
    ``spec.lse_shape``), the gradient of the returned lse, is subtracted from delta by the dQ kernel.
    ``grads``: ``(dq, dk, dv)`` buffers to write into (views are fine), else new ones."""
    want_dbias = (spec.attn_bias is not None and spec.attn_bias.dtype != torch.bool
                  and spec.attn_bias.requires_grad)
    if spec.is_empty:
        dbias = torch.zeros(spec.attn_bias.shape, dtype=spec.attn_bias.dtype, device=spec.device) if want_dbias else None
        return torch.zeros_like(spec.q), torch.zeros_like(spec.k), torch.zeros_like(spec.v), dbias
    q, k, v = (_last_contiguous(t) for t in (spec.q, spec.k, spec.v))
    dout = _last_contiguous(dout)
    varlen = spec.is_varlen
    dq, dk, dv = (_output(spec, g, t.shape, spec.dtype, 0.0) for g, t in zip(grads or (None,) * 3, (q, k, v)))
    # per-row (m, 1/l, delta), written by the dQ kernel's first pass and read by dK/dV; the
    # forward's lse is not read (see kernels.py: P from separate m and l)
    rowmax, rowinv, delta = (torch.empty(spec.lse_shape, dtype=torch.float32, device=spec.device) for _ in range(3))
    bias, bias_strides, bias_mode = _bias_args(spec, q)
    if want_dbias:   # positions outside every band (and varlen padding) keep gradient 0
        dbias = torch.zeros(spec.attn_bias.shape, dtype=spec.attn_bias.dtype, device=spec.device)
        dbias_arg, dbias_strides = dbias, tuple(dbias.stride())
    else:
        dbias, dbias_arg, dbias_strides = None, q, (0, 0, 0, 0)
    slopes = spec.alibi_slopes if spec.alibi_slopes is not None else delta
    # laid out like lse/delta (contiguous spec.lse_shape), read only when HAS_DLSE
    has_dlse = dlse is not None
    dlse = dlse.to(device=spec.device, dtype=torch.float32).contiguous() if has_dlse else delta
    cu_q = spec.cu_seqlens_q if varlen else delta
    cu_k = spec.cu_seqlens_k if varlen else delta
    scalars, consts = _common(spec)
    cfgs = backward_configs_for(spec)
    lse_strides = _lse_strides(spec)
    bh_q = spec.batch * spec.num_heads_q

    window = (scalars["qk_scale2"], scalars["softcap_scale"], scalars["softcap2"],
              scalars["window_left"], scalars["window_right"])
    # 1. row stats, dQ (and dBias): one program per (query tile, batch·head)
    c2 = cfgs.dq
    kernels.attn_bwd_dq[(triton.cdiv(spec.seqlen_q, c2.block_m), bh_q)](
        q, k, v, dout, rowmax, rowinv, delta, dlse, dq, bias, dbias_arg, slopes, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(dout, varlen), *_seq_strides(dq, varlen),
        *lse_strides, *bias_strides, *dbias_strides,
        spec.num_heads_q, spec.gqa_ratio, spec.seqlen_q, spec.seqlen_k, *_packed_totals(spec),
        spec.scale, *window,
        BLOCK_M=c2.block_m, BLOCK_N=c2.block_n, BIAS_MODE=bias_mode, BIAS_GRAD=want_dbias,
        HAS_DLSE=has_dlse, **consts, **c2.launch_options(),
    )
    # 2. dK, dV (reads the row stats written by the dQ kernel): one program per (key tile, batch·kv head)
    c1 = cfgs.dkdv
    kernels.attn_bwd_dkdv[(triton.cdiv(spec.seqlen_k, c1.block_n), spec.batch * spec.num_heads_kv)](
        q, k, v, dout, rowmax, rowinv, delta, dk, dv, bias, slopes, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(dout, varlen), *_seq_strides(dk, varlen), *_seq_strides(dv, varlen),
        *lse_strides, *bias_strides,
        spec.num_heads_q, spec.num_heads_kv, spec.gqa_ratio, spec.seqlen_q, spec.seqlen_k, *_packed_totals(spec),
        spec.scale, *window,
        BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, BIAS_MODE=bias_mode, **consts, **c1.launch_options(),
    )
    return dq, dk, dv, dbias


def interpreter_active() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return type(kernels.attn_fwd).__name__ == "InterpretedFunction"


def triton_library_interpreted() -> bool:
    """True when triton's own ``@jit`` library functions (``tl.zeros``, ``tl.cdiv``, ...) were
    defined under the interpreter too: they are fixed when triton is first imported."""
    import triton.language.standard as standard
    return type(standard.zeros).__name__ == "InterpretedFunction"


