"""Host side of the Triton backend: turn an :class:`AttentionSpec` into kernel launches.

Imported lazily by :class:`portattn.backends.triton.TritonBackend` (it imports triton).
Inputs are never copied except when their last dimension is not contiguous.

Host cost (issue #11: a small call is bound by the host, not the GPU). Per call this module does
only what depends on the tensors: one ``stride()`` per tensor, the output buffers, the grid.
Everything that depends only on the device, dtype, head dims, features and the tile table (the
device target, the tile configs, the constexpr and launch-option dicts, the float/int scalars)
is cached under exactly the values it is computed from; the launch arguments are the same values
of the same types as before the caches (checked over every feature mix and vendor table).
Each launch goes through :func:`launcher.fast` (``backends/triton/launcher.py``): after the first
launch of a specialisation it calls the compiled kernel's launcher directly, skipping triton's
binder (its per-argument ``native_specialize_impl``, key hashing and constexpr-global checks,
~30 us a launch on a slow host; ``tools/host_overhead.py`` measures both paths without a GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from portattn import config

from . import kernels, launcher
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


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``triton.cdiv`` is a constexpr function in triton >= 3.x: it
    wraps and unwraps constexprs, several microseconds a call on the host)."""
    return -(-a // b)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _with_strides(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(t', t'.stride())`` with ``t'`` = :func:`_last_contiguous` of ``t``: one ``stride()``
    call (a few microseconds each on a slow host) serves the check and the kernel arguments."""
    st = t.stride()
    if st[-1] != 1 and t.shape[-1] != 1:
        t = t.contiguous()
        st = t.stride()
    return t, st


def _seq3(st: tuple[int, ...], varlen: bool) -> tuple[int, int, int]:
    """(batch, sequence, head) strides from a canonical tensor's ``stride()``; batch stride 0 for varlen."""
    return (0, st[0], st[1]) if varlen else st[:3]


def _seq_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, sequence, head) strides of a canonical tensor; batch stride 0 for varlen."""
    return _seq3(t.stride(), varlen)


def _lse_strides(spec, lse: torch.Tensor | None = None) -> tuple[int, int]:
    """(batch, head) strides of lse/delta: (B, Hq, Sq) dense, (Hq, total_q) varlen; of ``lse``
    itself when given (unit stride along the rows), else of a contiguous one."""
    if lse is not None:
        st = lse.stride()
        return (0, st[0]) if spec.is_varlen else st[:2]
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


def _bias_mode(spec) -> int:
    bias = spec.attn_bias
    if bias is None:
        return kernels.BIAS_NONE
    return kernels.BIAS_BOOL if bias.dtype == torch.bool else kernels.BIAS_ADD


def _bias_args(spec, dummy: torch.Tensor):
    """(tensor, 4 strides, mode) for the bias; a bool mask is read as uint8."""
    bias = spec.attn_bias
    if bias is None:
        return dummy, (0, 0, 0, 0), kernels.BIAS_NONE
    if bias.dtype == torch.bool:
        return bias.view(torch.uint8), tuple(bias.stride()), kernels.BIAS_BOOL
    return bias, tuple(bias.stride()), kernels.BIAS_ADD


# ----- what depends only on the problem's static description: computed once, cached --------
# The host cost of a small call is all Python (the kernel itself is a few microseconds): every
# value below depends only on dtypes, head dims, features and the tile table, never on tensor
# sizes, strides or pointers, and is cached under exactly the arguments it is computed from.

def _scalars(scale: float, softcap: float | None, window_left: int | None, window_right: int | None) -> tuple:
    """(qk_scale2, softcap_scale, softcap2, window_left, window_right): the kernels' float/int
    scalars, in their argument order. Cached by value *and type* (``typed``: 1, 1.0 and True
    specialise differently in triton, so they must not share an entry); a value that cannot be
    hashed is computed each time."""
    try:
        return _scalars_cached(scale, softcap, window_left, window_right)
    except TypeError:
        return _compute_scalars(scale, softcap, window_left, window_right)


def _compute_scalars(scale, softcap, window_left, window_right) -> tuple:
    log2e = float(kernels.LOG2E.value)
    return (scale * log2e,
            scale / softcap if softcap else 1.0,
            softcap * log2e if softcap else 1.0,
            UNBOUNDED if window_left is None else window_left,
            UNBOUNDED if window_right is None else window_right)


_scalars_cached = functools.lru_cache(maxsize=1024, typed=True)(_compute_scalars)


def _static_key(spec) -> tuple:
    """Everything :func:`_consts` reads from ``spec`` (hashable)."""
    bias = spec.attn_bias
    return (spec.head_dim, spec.head_dim_v, spec.cu_seqlens_q is not None, spec.alignment == "bottom_right",
            spec.softcap is not None, spec.alibi_slopes is not None, spec.q.dtype, bool(spec.allow_tf32),
            bias is not None and bias.dtype != torch.bool)


@functools.lru_cache(maxsize=1024, typed=True)
def _consts(head_dim, head_dim_v, is_varlen, bottom_right, softcap, alibi, dtype, allow_tf32, float_bias) -> dict:
    """The constexprs shared by the forward, dK/dV and dQ kernels (a cached dict: read only)."""
    fp32 = dtype == torch.float32
    return dict(
        # one tile width for D and Dv (see kernels.py), the larger one padded
        HEAD_D=head_dim, HEAD_DV=head_dim_v, BLOCK_D=_block_dims(head_dim, head_dim_v),
        IS_VARLEN=is_varlen, BOTTOM_RIGHT=bottom_right, SOFTCAP=softcap, ALIBI=alibi,
        IEEE=fp32 and not allow_tf32,
        # float32 and the score is qk_scale2·qk (scale > 0 is validated): keep qk and scale after
        # subtracting the max (one rounding fewer in P; 16-bit P is rounded to 16 bits anyway)
        RAW_SCORES=fp32 and not softcap and not alibi and not float_bias,
    )


def _common(spec):
    """Scalars (a dict) and constexprs shared by the forward, dK/dV and dQ kernels."""
    names = ("qk_scale2", "softcap_scale", "softcap2", "window_left", "window_right")
    scalars = dict(zip(names, _scalars(spec.scale, spec.softcap, spec.window_left, spec.window_right)))
    return scalars, dict(_consts(*_static_key(spec)))


def _target(spec) -> Target:
    return device_target(spec.device)


@functools.lru_cache(maxsize=64)
def _block_dims(head_dim: int, head_dim_v: int) -> int:
    return max(padded_dim(head_dim), padded_dim(head_dim_v))


def _block_d(spec) -> int:
    return _block_dims(spec.head_dim, spec.head_dim_v)


def forward_config_for(spec) -> KernelConfig:
    return _forward_config(spec.q.device, spec.q.dtype, spec.head_dim, spec.head_dim_v)


def backward_configs_for(spec) -> BackwardConfigs:
    return _backward_configs(spec.q.device, spec.q.dtype, spec.head_dim, spec.head_dim_v)


# keyed on the device itself (hashed in C), not on its Target (a dataclass hashed in Python)
@functools.lru_cache(maxsize=256)
def _forward_config(device: torch.device, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> KernelConfig:
    return forward_config(device_target(device), _block_dims(head_dim, head_dim_v), ELEM_SIZES[dtype])


@functools.lru_cache(maxsize=256)
def _backward_configs(device: torch.device, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> BackwardConfigs:
    return backward_configs(device_target(device), _block_dims(head_dim, head_dim_v), ELEM_SIZES[dtype])


@functools.lru_cache(maxsize=1024, typed=True)
def _launch_kwargs(cfg: KernelConfig, bias_mode: int, static_key: tuple, **extra) -> dict:
    """The keyword arguments of one launch (tile constexprs, feature constexprs, compiler
    options): a cached dict, only ever unpacked (``**``), never mutated."""
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BIAS_MODE=bias_mode, **extra,
                **_consts(*static_key), **cfg.launch_options())


def _causal_like(spec) -> bool:
    """A band whose right side is bounded and left side is not (causal, or causal + sink): the
    last query tiles see the most keys, so the forward and dQ grids run them first (and dK/dV,
    whose first key tiles see the most queries, keeps its natural order)."""
    return spec.window_right is not None and spec.window_left is None


def _anticausal_like(spec) -> bool:
    return spec.window_left is not None and spec.window_right is None


def _empty_result(spec):
    out = torch.zeros(spec.out_shape, dtype=spec.dtype, device=spec.device)
    lse = torch.full(spec.lse_shape, float("-inf"), dtype=torch.float32, device=spec.device)
    return out, lse


def forward(spec, *, out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: ``(out, lse)`` in the canonical layout (see the backend), written
    into ``out``/``lse`` when given (views are fine: the kernel uses their strides)."""
    if out is None and lse is None and config.triton_forward() != "portable" and spec.q.is_cuda:
        # PORTATTN_TRITON_FORWARD (an unknown value raises here, on any device): gluon_fwd.forward_choice
        from . import gluon_fwd
        if gluon_fwd.forward_choice(spec) == "gluon":
            return gluon_fwd.gluon_forward(spec)
    out, lse, _ = _forward(spec, out, lse, residual=False)
    return out, lse


def forward_for_backward(spec) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``(out, lse, residuals)`` for a call whose backward follows: 16-bit inputs also return O's
    rounding residual (``(ores,)``, O's shape, dtype and strides), which lets the backward take
    delta = rowsum(dO ∘ O) of the unrounded output in one cheap pass; float32 returns none (its
    backward recomputes exact row statistics).

    The kernel: the Gluon Hopper forward (its ``RESIDUAL`` epilogue) where
    :func:`gluon_fwd.forward_choice` says so for a training forward (``auto``: the shapes of
    :data:`gluon_fwd.AUTO_TRAINING_MIN_SEQLEN_Q`; ``gluon``: wherever ``gluon_reasons`` is empty,
    CUDA tensors on sm_90 only), else the portable kernel."""
    if spec.dtype == torch.float32 or spec.is_empty:
        out, lse = forward(spec)
        return out, lse, ()
    from . import gluon_fwd
    if gluon_fwd.forward_choice(spec, training=True) == "gluon":   # an unknown PORTATTN_TRITON_FORWARD raises
        out, lse, ores = gluon_fwd.gluon_forward(spec, residual=True)
        return out, lse, (ores,)
    out, lse, ores = _forward(spec, None, None, residual=True)
    return out, lse, (ores,)


#: (call signature, residual, 16-byte alignment of q, k, v, bias) -> _Prepared
_prepared: dict[tuple, _Prepared] = {}
_PREPARED_LIMIT = 1024


class _Prepared:
    """A forward launch with everything but the tensors computed (issue #11: the host path of
    a small call). Valid for every spec of one call signature (:mod:`portattn.callcache`: same
    shapes, strides, dtypes, device and arguments) whose tensors have the same alignment."""

    __slots__ = ("bound", "grid", "out_shape", "lse_shape", "dtype", "device", "ints", "bool_bias", "tma")

    def run(self, spec, residual: bool):
        """``(out, lse, ores or None)``, or None when the bound launch declined (see launcher.Bound)."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        ores = torch.empty(self.out_shape, dtype=self.dtype, device=self.device) if residual else out
        q = spec.q
        bias = spec.attn_bias
        if bias is None:
            bias = q
        elif self.bool_bias:
            bias = bias.view(torch.uint8)
        slopes = spec.alibi_slopes if spec.alibi_slopes is not None else lse
        if self.tma:   # the allocator is per thread / context (alignment: in the key, out is new)
            _ensure_allocator()
        if not self.bound(self.grid, q, spec.k, spec.v, out, ores, lse, bias, slopes, lse, lse, *self.ints):
            return None
        return out, lse, (ores if residual else None)


def _prepared_key(spec, residual: bool):
    """The key of a prepared launch, or None when the call takes the full path (no signature,
    varlen, a last dimension that needs a copy)."""
    sig = spec.signature
    if sig is None or spec.cu_seqlens_q is not None:
        return None
    bias = spec.attn_bias
    return (sig, residual, spec.q.data_ptr() & 15, spec.k.data_ptr() & 15, spec.v.data_ptr() & 15,
            None if bias is None else bias.data_ptr() & 15)


def _prepare(key, spec, kernel_args: tuple, kwargs: dict, grid: tuple, bias_mode: int, tma: bool = False) -> None:
    """Remember the launch just made for ``spec`` under ``key`` (after a normal launch, which
    recorded the kernel in the fast launcher)."""
    fk = launcher.fast(kernels.attn_fwd)
    bind = getattr(fk, "bind", None)
    if bind is None:   # the interpreter, or a process without the fast path
        return
    bound = bind(kernel_args, kwargs)
    if bound is None:
        return
    p = _Prepared()
    p.bound, p.grid = bound, grid
    p.out_shape, p.lse_shape = tuple(spec.out_shape), tuple(spec.lse_shape)
    p.dtype, p.device = spec.dtype, spec.device
    p.ints = kernel_args[10:]
    p.bool_bias = bias_mode == kernels.BIAS_BOOL
    p.tma = tma
    if len(_prepared) >= _PREPARED_LIMIT:
        _prepared.clear()
    _prepared[key] = p


def _forward(spec, out, lse, residual: bool):
    if spec.is_empty:
        return (*_empty_result(spec), None)
    pkey = _prepared_key(spec, residual) if out is None and lse is None else None
    if pkey is not None:
        prep = _prepared.get(pkey)
        if prep is not None:
            done = prep.run(spec, residual)
            if done is not None:
                return done
    (q, qs), (k, ks), (v, vs) = _with_strides(spec.q), _with_strides(spec.k), _with_strides(spec.v)
    out = _output(spec, out, spec.out_shape, spec.dtype, 0.0)
    lse = _output(spec, lse, spec.lse_shape, torch.float32, float("-inf"))
    ores = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device) if residual else out
    varlen = spec.is_varlen
    bias, bias_strides, bias_mode = _bias_args(spec, q)
    slopes = spec.alibi_slopes if spec.alibi_slopes is not None else lse
    cu_q = spec.cu_seqlens_q if varlen else lse
    cu_k = spec.cu_seqlens_k if varlen else lse
    cfg = forward_config_for(spec)
    if cfg.tma:
        cfg = _tma_config(cfg, q, k, v, out)
    ls = lse.stride()
    grid = (_cdiv(spec.seqlen_q, cfg.block_m), spec.batch * spec.num_heads_q)
    args = (q, k, v, out, ores, lse, bias, slopes, cu_q, cu_k,
            *_seq3(qs, varlen), *_seq3(ks, varlen), *_seq3(vs, varlen), *_seq3(out.stride(), varlen),
            *((0, ls[0]) if varlen else ls[:2]), *bias_strides,
            spec.num_heads_q, spec.num_heads_q // spec.num_heads_kv, spec.seqlen_q, spec.seqlen_k,
            *((q.shape[0], k.shape[0]) if varlen else (0, 0)),
            *_scalars(spec.scale, spec.softcap, spec.window_left, spec.window_right))
    kwargs = _launch_kwargs(cfg, bias_mode, _static_key(spec), LONGEST_FIRST=_causal_like(spec), RESIDUAL=residual,
                            TMA=cfg.tma, WS=cfg.ws)
    launcher.fast(kernels.attn_fwd)[grid](*args, **kwargs)
    if pkey is not None and q is spec.q and k is spec.k and v is spec.v:   # (no copies were made)
        _prepare(pkey, spec, args, kwargs, grid, bias_mode, cfg.tma)
    return out, lse, (ores if residual else None)


def _tma_aligned(t: torch.Tensor) -> bool:
    """A tensor descriptor of ``t``'s (S, D) slabs needs 16-byte aligned bases and row strides:
    every stride but the (contiguous) last one, and the data pointer, multiples of 16 bytes."""
    e = t.element_size()
    return t.data_ptr() % 16 == 0 and all((st * e) % 16 == 0 for st in t.stride()[:-1])


def _tma_config(cfg: KernelConfig, q, k, v, out) -> KernelConfig:
    """``cfg`` when Q, K, V and O allow tensor descriptors (then triton's allocator is set: device-side
    descriptors live in a per-launch global scratch buffer), else ``cfg`` without TMA and warp
    specialisation (the portable pointer kernel). The residual output copies O's strides."""
    if not all(_tma_aligned(t) for t in (q, k, v, out)):
        return _without_tma(cfg)
    _ensure_allocator()
    return cfg


@functools.lru_cache(maxsize=64)
def _without_tma(cfg: KernelConfig) -> KernelConfig:
    return dataclasses.replace(cfg, tma=False, ws=False)


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Install a torch-backed allocator for triton's global scratch unless one is set (triton keeps
    it in a context variable: set per thread / context, so this is checked at every TMA launch)."""
    from triton.runtime import _allocation
    current = getattr(_allocation, "_allocator", None)
    get = getattr(current, "get", None)
    if get is not None and get() is not getattr(_allocation, "_NULL_ALLOCATOR", None):
        return
    triton.set_allocator(_scratch)


def backward(spec, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None,
             *, grads: tuple | None = None, residuals: tuple = ()):
    """The backward kernels (kernels.py): ``(dq, dk, dv, dbias or None)``.

    With ``residuals`` from :func:`forward_for_backward` (16-bit): :func:`kernels.attn_bwd_prep`
    turns ``lse`` into the row statistics and computes delta = rowsum(dO ∘ (O + residual)) − dlse,
    then dQ and dK/dV. Otherwise (float32, or no residual): the dQ kernel recomputes exact row
    statistics first (``out`` and ``lse`` unread), then dK/dV. ``dlse`` (float32,
    ``spec.lse_shape``) is the gradient of the returned lse. ``grads``: ``(dq, dk, dv)`` buffers
    to write into (views are fine), else new ones.

    Atomic dQ (FlashAttention-2's): a 16-bit call with residuals that does not request
    determinism (``spec.deterministic``: PORTATTN_DETERMINISTIC, torch.use_deterministic_algorithms;
    docs/semantics.md "Gradients") and needs no bias gradient, on a target whose table has a
    :attr:`BackwardConfigs.atomic` row, skips the dQ kernel: the dK/dV kernel (that row's tiles)
    adds every tile pair's dS K into a zero-initialised float32 tensor of q's shape (B·S·H·D·4
    bytes for the launch, from torch's caching allocator), cast into dq after. dQ is then not
    bit-identical across runs (the order of the additions follows the schedule); dK, dV are."""
    want_dbias = (spec.attn_bias is not None and spec.attn_bias.dtype != torch.bool
                  and spec.attn_bias.requires_grad)
    if spec.is_empty:
        dbias = torch.zeros(spec.attn_bias.shape, dtype=spec.attn_bias.dtype, device=spec.device) if want_dbias else None
        return torch.zeros_like(spec.q), torch.zeros_like(spec.k), torch.zeros_like(spec.v), dbias
    (q, qs), (k, ks), (v, vs) = _with_strides(spec.q), _with_strides(spec.k), _with_strides(spec.v)
    dout, dos = _with_strides(dout)
    varlen = spec.is_varlen
    dq, dk, dv = (_output(spec, g, t.shape, spec.dtype, 0.0) for g, t in zip(grads or (None,) * 3, (q, k, v)))
    # per-row (m, 1/l, delta) in base 2, contiguous spec.lse_shape: written by the prep kernel
    # (16-bit) or the dQ kernel's first pass (float32), read by dQ and dK/dV
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
    cfgs = backward_configs_for(spec)
    lse_strides = _lse_strides(spec)
    bh_q = spec.batch * spec.num_heads_q
    static_key = _static_key(spec)
    consts = _consts(*static_key)
    exact = spec.dtype == torch.float32 or not residuals
    seq = (*_seq3(qs, varlen), *_seq3(ks, varlen), *_seq3(vs, varlen), *_seq3(dos, varlen))
    gqa = spec.num_heads_q // spec.num_heads_kv
    sizes = (spec.seqlen_q, spec.seqlen_k, *_packed_totals(spec))
    scalars = (spec.scale, *_scalars(spec.scale, spec.softcap, spec.window_left, spec.window_right))
    # PORTATTN_TRITON_BACKWARD (an unknown value raises here, on any device): gluon_bwd.backward_choice
    gluon = config.triton_backward() != "portable" and spec.q.is_cuda and _gluon_backward(spec, not exact)
    if not exact:
        # 0. row statistics from lse, delta = rowsum(dO ∘ O) - dlse
        (ores,) = residuals
        ost = out.stride()
        if ores.stride() != ost or ost[-1] != 1:   # the prep kernel reads both through O's strides
            out, ores = out.contiguous(), ores.contiguous()
            ost = out.stride()
        if lse.stride(-1) != 1:
            lse = lse.contiguous()
        cp = cfgs.prep
        launcher.fast(kernels.attn_bwd_prep)[(_cdiv(spec.seqlen_q, cp.block_m), bh_q)](
            out, ores, dout, lse, dlse, rowmax, rowinv, delta, cu_q,
            *_seq3(ost, varlen), *_seq3(dos, varlen), *_lse_strides(spec, lse), *lse_strides,
            spec.num_heads_q, spec.seqlen_q, _packed_totals(spec)[0],
            **_prep_kwargs(cp, consts["HEAD_DV"], consts["BLOCK_D"], varlen, has_dlse),
        )
    if gluon:   # then dK/dV and dQ by the Gluon Hopper kernels (deterministic), from the same statistics
        gluon.gluon_backward(spec, dout, rowmax, delta, dq, dk, dv)
        return dq, dk, dv, None
    c1 = atomic_config(spec, cfgs, exact, want_dbias)
    if c1 is None:
        # 1. dQ (and dBias; float32: the exact row statistics first): one program per (query tile, batch·head)
        c1, dq_acc, dq_acc_strides = cfgs.dkdv, delta, (0, 0, 0)
        c2 = cfgs.dq
        launcher.fast(kernels.attn_bwd_dq)[(_cdiv(spec.seqlen_q, c2.block_m), bh_q)](
            q, k, v, dout, rowmax, rowinv, delta, dlse, dq, bias, dbias_arg, slopes, cu_q, cu_k,
            *seq, *_seq3(dq.stride(), varlen),
            *lse_strides, *bias_strides, *dbias_strides,
            spec.num_heads_q, gqa, *sizes, *scalars,
            **_launch_kwargs(c2, bias_mode, static_key, BIAS_GRAD=want_dbias, HAS_DLSE=has_dlse, EXACT_STATS=exact,
                             LONGEST_FIRST=_causal_like(spec)),
        )
    else:
        # atomic dQ: accumulated in float32 by the dK/dV kernel below (rows no key reaches stay 0),
        # the head dim padded to BLOCK_D so that the atomic add needs no head-dim mask
        dq_acc = torch.zeros((*q.shape[:-1], consts["BLOCK_D"]), dtype=torch.float32, device=spec.device)
        dq_acc_strides = _seq3(dq_acc.stride(), varlen)
    # 2. dK, dV (reads the row statistics): one program per (key tile, batch·kv head)
    #    (a ``split`` config: a dV launch, then a dK launch, each program with one accumulator;
    #    with atomic dQ the launch that forms dS also adds dS K into dq_acc)
    for part in ((1, 2) if c1.split else (0,)):
        launcher.fast(kernels.attn_bwd_dkdv)[(_cdiv(spec.seqlen_k, c1.block_n), spec.batch * spec.num_heads_kv)](
            q, k, v, dout, rowmax, rowinv, delta, dk, dv, dq_acc, bias, slopes, cu_q, cu_k,
            *seq, *_seq3(dk.stride(), varlen), *_seq3(dv.stride(), varlen), *dq_acc_strides,
            *lse_strides, *bias_strides,
            spec.num_heads_q, spec.num_heads_kv, gqa, *sizes, *scalars,
            **_launch_kwargs(c1, bias_mode, static_key, EXACT_STATS=exact, LONGEST_FIRST=_anticausal_like(spec),
                             PART=part, DQ_ATOMIC=dq_acc is not delta),
        )
    if dq_acc is not delta:
        dq.copy_(dq_acc[..., :spec.head_dim])
    return dq, dk, dv, dbias


def _gluon_backward(spec, has_residual: bool):
    """The :mod:`gluon_bwd` module when ``PORTATTN_TRITON_BACKWARD`` (``auto`` by its rule, or
    ``gluon``) picks it for ``spec`` (its reasons empty), else None."""
    from . import gluon_bwd
    return gluon_bwd if gluon_bwd.backward_choice(spec, has_residual) == "gluon" else None


#: padded blocks (BLOCK_D) in which a narrower head dim (D == Dv) may take atomic dQ into the
#: BLOCK_D-wide float32 accumulator: the H200 check of 2026-12-03 (tools/triton_atomic_diag.py
#: --narrow, benchmarks/results/triton-atomic-diag-h200.*) passed D 24, 40 and 96 (blocks 32, 64,
#: 128; 12 of 12 cases) and failed D 200 in block 256 (4 of 4: dQ off by 1.6-3.3 x its magnitude or
#: an illegal address), as with the masked add before, so 256 stays out
ATOMIC_NARROW_BLOCKS = frozenset({32, 64, 128})
#: every block (tools/triton_atomic_diag.py --narrow sets it in its child processes, to check them)
ATOMIC_NARROW_HEAD = False


def atomic_config(spec, cfgs: BackwardConfigs, exact: bool, want_dbias: bool) -> KernelConfig | None:
    """The dK/dV config of the atomic-dQ backward for this call, or None for the deterministic
    two-kernel one: atomic only for 16-bit calls with residuals (not ``exact``) that do not request
    determinism, need no bias gradient (the dQ kernel writes dBias) and whose table row has one —
    under ``PORTATTN_TRITON_DQ=auto`` (the default) only a row timed faster than the deterministic
    backward (``atomic_by_default``), under ``atomic`` every row, under ``kernel`` none.

    A head dim narrower than its padded block (``BLOCK_D``) takes it only with ``D == Dv`` in the
    blocks of :data:`ATOMIC_NARROW_BLOCKS`: on the H200 (triton 3.6, ``tools/triton_atomic_diag.py``)
    D 200 in block 256 gave wrong dQ (relative error 1.6-4.8 against the deterministic backward)
    or an illegal address, with the masked atomic add (2026-12-02) and with the BLOCK_D-wide
    accumulator (2026-12-03) alike; D 24, 40 and 96 passed with the latter. Every other such
    call keeps the two-kernel backward."""
    if exact or want_dbias or spec.deterministic or cfgs.atomic is None:
        return None
    block = _block_d(spec)
    if spec.head_dim != block and not ATOMIC_NARROW_HEAD and not (
            block in ATOMIC_NARROW_BLOCKS and spec.head_dim_v == spec.head_dim):
        return None
    mode = config.triton_dq()
    if mode == "kernel" or (mode == "auto" and not cfgs.atomic_by_default):
        return None
    return cfgs.atomic


@functools.lru_cache(maxsize=256)
def _prep_kwargs(cfg: KernelConfig, head_dv: int, block_d: int, varlen: bool, has_dlse: bool) -> dict:
    return dict(HEAD_DV=head_dv, BLOCK_D=block_d, BLOCK_M=cfg.block_m, IS_VARLEN=varlen, HAS_DLSE=has_dlse,
                **cfg.launch_options())


def interpreter_active() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return type(kernels.attn_fwd).__name__ == "InterpretedFunction"


def triton_library_interpreted() -> bool:
    """True when triton's own ``@jit`` library functions (``tl.zeros``, ``tl.cdiv``, ...) were
    defined under the interpreter too: they are fixed when triton is first imported."""
    import triton.language.standard as standard
    return type(standard.zeros).__name__ == "InterpretedFunction"


