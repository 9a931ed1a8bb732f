"""Launching the CuPy backend's kernels on torch tensors.

Tensors stay torch tensors: kernels receive raw device pointers (``data_ptr()``) and element
strides, outputs are allocated by torch, and every launch goes to torch's current CUDA stream
(wrapped as a ``cupy.cuda.ExternalStream``). Nothing here synchronises the host.

Modules are compiled by ``cupy.RawModule`` once per (:class:`configs.KernelConfig`, device) and
kept in :data:`_MODULES`; CuPy also keeps the binaries in its on-disk kernel cache.
"""

from __future__ import annotations

import functools
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from . import configs, sm90a

UNBOUNDED = 1 << 30            # window side with no limit
_BIAS_KINDS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.bool: 4}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}

_MODULES: dict[tuple, object] = {}
_lock = threading.Lock()


def cache_key(cfg: configs.KernelConfig, device_index: int) -> tuple:
    return (cfg.family, cfg.dtype, cfg.head_dim, cfg.tile, cfg.kv_stages, device_index)


def get_function(cfg: configs.KernelConfig, role: str, device_index: int):
    """The compiled kernel ``role`` of ``cfg`` on a device (compiled on first use, then cached)."""
    import cupy

    key = cache_key(cfg, device_index)
    mod = _MODULES.get(key)
    if mod is None:
        with _lock:
            mod = _MODULES.get(key)
            if mod is None:
                with cupy.cuda.Device(device_index):
                    if cfg.arch is not None:   # sm_90a: NVRTC directly, then a cubin module
                        path, lowered = sm90a.compile_cubin(configs.source(cfg.source_files), cfg.name_expressions(),
                                                            cfg.arch)
                        raw = cupy.RawModule(path=path)
                        get = lambda name: raw.get_function(lowered[name])  # noqa: E731
                    else:
                        raw = cupy.RawModule(code=configs.source(), options=configs.NVRTC_OPTIONS,
                                             name_expressions=cfg.name_expressions())
                        get = raw.get_function
                    funcs = {}
                    for r, name in cfg.kernel_names().items():
                        fn = get(name)
                        smem = cfg.smem_bytes(r)
                        if smem > 48 * 1024:
                            fn.max_dynamic_shared_size_bytes = smem
                        funcs[r] = fn
                mod = funcs
                _MODULES[key] = mod
    return mod[role]


@functools.cache
def _cuda_props(index: int):
    """``torch.cuda.get_device_properties`` of a device index, once per process."""
    return torch.cuda.get_device_properties(index)


def _device_props(device: torch.device):
    """The properties of a CUDA device (its index, or the current device's)."""
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())


def smem_optin(device: torch.device) -> int | None:
    """The device's opt-in shared memory per block (bytes), or None when torch does not say."""
    return getattr(_device_props(device), "shared_memory_per_block_optin", None)


def _ptr(t: torch.Tensor | None):
    return np.uint64(0 if t is None else t.data_ptr())


def _i64(x) -> np.int64:
    return np.int64(x)


def _i32(x) -> np.int32:
    return np.int32(x)


def _strides3(t: torch.Tensor, varlen: bool) -> list:
    """(batch, token, head) element strides of a canonical q/k/v/o tensor (batch 0 for varlen)."""
    if varlen:
        return [_i64(0), _i64(t.stride(0)), _i64(t.stride(1))]
    return [_i64(t.stride(0)), _i64(t.stride(1)), _i64(t.stride(2))]


def _compact_bias(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` in a dtype the kernels read, converting only its stored (non-broadcast) part."""
    if bias.dtype in _BIAS_KINDS:
        return bias
    index = tuple(slice(0, 1) if st == 0 else slice(None) for st in bias.stride())
    return bias[index].to(torch.float32).expand(bias.shape)


def _aligned_for_mma(t: torch.Tensor) -> bool:
    """cp.async moves 16 bytes: rows must start on 16-byte boundaries (8 fp16/bf16 elements)."""
    return (t.stride(-1) == 1 and t.shape[-1] % 8 == 0 and t.data_ptr() % 16 == 0
            and all(s % 8 == 0 for s in t.stride()[:-1]))


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    out = t.new_zeros((*t.shape[:-1], width))
    out[..., : t.shape[-1]] = t
    return out


def prepare_inputs(spec, tensor_cores: bool):
    """q, k, v as the kernels need them: last dim contiguous; for the tensor-core path also
    16-byte aligned rows with head dims padded to multiples of 8 (a copy only when needed)."""
    q, k, v = spec.q, spec.k, spec.v
    if tensor_cores:
        d8, dv8 = configs.round_up(spec.head_dim, 8), configs.round_up(spec.head_dim_v, 8)
        q = q if _aligned_for_mma(q) else _pad_last(q, d8)
        k = k if _aligned_for_mma(k) else _pad_last(k, d8)
        v = v if _aligned_for_mma(v) else _pad_last(v, dv8)
    else:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return q, k, v


def common_args(spec, q, k, v) -> list:
    """The PA_COMMON_PARAMS argument list of attn_common.cuh, in order."""
    varlen = spec.is_varlen
    bias = _compact_bias(spec.attn_bias) if spec.attn_bias is not None else None
    if bias is not None and varlen:
        bias_strides = [bias.stride(0), bias.stride(1), bias.stride(2), bias.stride(3)]
    elif bias is not None:
        bias_strides = list(bias.stride())
    else:
        bias_strides = [0, 0, 0, 0]
    alibi = spec.alibi_slopes.contiguous() if spec.alibi_slopes is not None else None
    left = UNBOUNDED if spec.window_left is None else spec.window_left
    right = UNBOUNDED if spec.window_right is None else spec.window_right
    if varlen:
        lse_strides = [0, q.shape[0]]                       # lse (Hq, total_q)
    else:
        lse_strides = [spec.num_heads_q * spec.seqlen_q, spec.seqlen_q]   # lse (B, Hq, Sq)
    args = [_ptr(q), _ptr(k), _ptr(v), *_strides3(q, varlen), *_strides3(k, varlen), *_strides3(v, varlen),
            _ptr(spec.cu_seqlens_q), _ptr(spec.cu_seqlens_k), _i32(spec.seqlen_q), _i32(spec.seqlen_k),
            _i32(q.shape[0]), _i32(k.shape[0]),   # packed totals: the kernels clamp cu_seqlens into them
            _i32(q.shape[-1]), _i32(v.shape[-1]), _i32(spec.gqa_ratio), np.float32(spec.scale),
            np.float32(spec.softcap or 0.0), _i32(left), _i32(right), _i32(spec.alignment == "top_left"),
            _ptr(alibi), _i64(alibi.stride(0) if alibi is not None else 0),
            _ptr(bias), _i32(_BIAS_KINDS[bias.dtype] if bias is not None else 0), *map(_i64, bias_strides),
            *map(_i64, lse_strides)]
    keep_alive = (q, k, v, bias, alibi)
    return args, keep_alive


class _Launcher:
    """Device guard and torch's current stream, as CuPy contexts."""

    def __init__(self, device: torch.device):
        import cupy

        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.dev = cupy.cuda.Device(self.index)
        with warnings.catch_warnings():   # CuPy 14 deprecates ExternalStream; it still works
            warnings.simplefilter("ignore", DeprecationWarning)
            self.stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(self.index).cuda_stream, self.index)

    def __enter__(self):
        self.dev.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.dev.__exit__(*exc)

    def launch(self, cfg, role, grid, args):
        fn = get_function(cfg, role, self.index)
        fn(tuple(int(x) for x in grid), (cfg.threads(role), 1, 1), tuple(args), shared_mem=cfg.smem_bytes(role))


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass
class Launch:
    """One kernel launch: module config, kernel role, grid and the argument list."""

    cfg: configs.KernelConfig
    role: str
    grid: tuple
    args: list


@dataclass
class Plan:
    """Everything a forward/backward call launches, and the tensors it returns."""

    launches: list = field(default_factory=list)
    outputs: tuple = ()
    keep_alive: tuple = ()    # inputs (possibly padded copies) the launches point into
    setup: list = field(default_factory=list)    # torch steps before the launches (same stream)
    finish: list = field(default_factory=list)   # ... and after them


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(torch.cuda.get_device_capability(idx))


def forward_choice(spec) -> tuple[configs.KernelConfig | None, str]:
    """(forward module, why): :func:`configs.forward_choice` for this problem and its device
    (``PORTATTN_CUPY_FORWARD``, read now), falling back to the mma.sync forward, with the reason,
    when the sm_90a module cannot be compiled here (:func:`sm90a.unavailable_reason`)."""
    dtype = _DTYPE_NAMES[spec.dtype]
    cfg, why = configs.forward_choice(dtype, spec.head_dim, spec.head_dim_v, extras=_needs_extras(spec),
                                      capability=_capability(spec.device))
    if cfg is not None and cfg.arch is not None:
        bad = sm90a.unavailable_reason(configs.source(cfg.source_files), cfg.name_expressions(), cfg.arch)
        if bad:
            return configs.forward_config(dtype, spec.head_dim, spec.head_dim_v), \
                f"{configs.FORWARD_ENV}={configs.forward_mode()} but {bad}: the mma.sync forward"
    return cfg, why


def backward_choice(spec) -> tuple[configs.KernelConfig | None, str]:
    """(backward module, why): :func:`configs.backward_choice` for this problem, its device's
    compute capability and opt-in shared memory (``PORTATTN_CUPY_BACKWARD``, read now), falling
    back to the mma.sync backward, with the reason, when the sm_90a module cannot be compiled
    here (:func:`sm90a.unavailable_reason`)."""
    dtype = _DTYPE_NAMES[spec.dtype]
    limit = smem_optin(spec.device) if spec.device.type == "cuda" else None
    cfg, why = configs.backward_choice(dtype, spec.head_dim, spec.head_dim_v, extras=_needs_extras(spec),
                                       capability=_capability(spec.device), smem_limit=limit)
    if cfg is not None and cfg.arch is not None:
        bad = sm90a.unavailable_reason(configs.source(cfg.source_files), cfg.name_expressions(), cfg.arch)
        if bad:
            return configs.backward_config(dtype, spec.head_dim, spec.head_dim_v, smem_limit=limit, mode="auto"), \
                f"{configs.BACKWARD_ENV}={configs.backward_mode()} but {bad}: the mma.sync backward"
    return cfg, why


def plan_forward(spec, cfg: configs.KernelConfig | None = None) -> Plan:
    """Allocate ``(out, lse)`` and describe the forward launch (no device work yet).

    ``cfg`` overrides the configuration choice (tests, benchmarks of other kernels and tile
    shapes); by default :func:`forward_choice` picks it.
    """
    cfg = cfg or forward_choice(spec)[0]
    tensor_cores = cfg.family in ("fwd_mma", "fwd_wgmma", "fwd_wgmma_ws")
    lse = torch.empty(spec.lse_shape, dtype=torch.float32, device=spec.device)
    if spec.is_empty or spec.seqlen_q == 0:
        lse.fill_(float("-inf"))
        return Plan(outputs=(spec.q.new_zeros(spec.out_shape), lse))
    q, k, v = prepare_inputs(spec, tensor_cores)
    dv_alloc = v.shape[-1]
    out = torch.empty((*spec.q.shape[:-1], dv_alloc), dtype=spec.dtype, device=spec.device)
    if spec.is_varlen:   # rows no (clamped) sequence covers (a bad cu_seqlens, unchecked when compiled)
        out.zero_()
        lse.fill_(float("-inf"))
    args, keep = common_args(spec, q, k, v)
    args += [_ptr(out), *_strides3(out, spec.is_varlen), _ptr(lse)]
    if cfg.family in ("fwd_wgmma", "fwd_wgmma_ws") and _needs_extras(spec):
        raise ValueError(f"the wgmma forward has no softcap / ALiBi / bias (cfg={cfg.family}): use the fwd_mma config")
    role = "extras" if cfg.family == "fwd_mma" and _needs_extras(spec) else "plain"
    grid = (_cdiv(spec.seqlen_q, cfg.block_rows(role)), spec.num_heads_q, spec.batch)
    if dv_alloc != spec.head_dim_v:
        out = out[..., : spec.head_dim_v]
    return Plan([Launch(cfg, role, grid, args)], (out, lse), keep)


def _needs_extras(spec) -> bool:
    """The tensor-core kernels' EXTRAS instantiation: softcap, ALiBi or a bias/mask to apply."""
    return spec.softcap is not None or spec.alibi_slopes is not None or spec.attn_bias is not None


def _grad_buffer(like: torch.Tensor, width: int) -> torch.Tensor:
    """A zeroed, contiguous gradient of ``like``'s shape with the last dim widened to ``width``."""
    return torch.zeros((*like.shape[:-1], width), dtype=like.dtype, device=like.device)


def plan_backward(spec, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                  cfg: configs.KernelConfig | None = None, dlse: torch.Tensor | None = None,
                  fused_dq: bool | str | None = None, persistent: bool | int | None = None) -> Plan:
    """Allocate ``(dq, dk, dv)`` and describe the three backward launches.

    ``cfg`` overrides the configuration choice: ``configs.fma_backward_config(...)`` forces the
    FMA kernels for fp16/bf16 (tests compare them with the tensor-core ones); by default
    :func:`backward_choice` chooses (``PORTATTN_CUPY_BACKWARD``, the device's compute capability
    and shared-memory limit: a tensor-core module that does not fit falls back to the FMA one). ``dlse`` (float32,
    ``spec.lse_shape``, or None) is the gradient of the returned lse: the kernel that forms
    delta (preprocess or stats) subtracts it. ``fused_dq``: see :func:`_plan_backward_mma`;
    ``persistent``: the warp-specialized fused-dQ kernels' grid (:func:`_work_item_grid`).
    """
    if cfg is None:
        cfg = backward_choice(spec)[0]
    if spec.is_empty or spec.seqlen_q == 0:
        zeros = tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (spec.q, spec.k, spec.v))
        return Plan(outputs=zeros)
    if dlse is not None:   # laid out like lse (contiguous spec.lse_shape)
        dlse = dlse.to(device=spec.device, dtype=torch.float32).contiguous()
    if cfg.family in ("bwd_mma", "bwd_wgmma"):
        return _plan_backward_mma(spec, out, lse, dout, cfg, dlse, fused_dq, persistent)
    dq = torch.zeros_like(spec.q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(spec.k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(spec.v, memory_format=torch.contiguous_format)
    q, k, v = prepare_inputs(spec, tensor_cores=False)
    out = out if out.stride(-1) == 1 else out.contiguous()
    dout = dout.to(spec.dtype)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    varlen = spec.is_varlen
    args, keep = common_args(spec, q, k, v)
    lse_strides = args[-2:]
    do_args = [_ptr(dout), *_strides3(dout, varlen)]
    if cfg.exact_stats:   # float32: row max/sum and delta = sum_j P dP recomputed (attn_bwd_stats)
        row_m, row_l = torch.empty_like(lse), torch.empty_like(lse)
        stats_ptrs = [_ptr(row_m), _ptr(row_l)]
    else:
        row_m = row_l = None
        stats_ptrs = [_ptr(None), _ptr(None)]
    plan = Plan(outputs=(dq, dk, dv), keep_alive=(keep, out, dout, lse, delta, row_m, row_l, dlse))
    rows_grid = (_cdiv(spec.seqlen_q, configs.BWD_BLOCK_M), spec.num_heads_q, spec.batch)
    if cfg.exact_stats:
        plan.launches.append(Launch(cfg, "stats", rows_grid, args + do_args + [*stats_ptrs, _ptr(delta), _ptr(dlse)]))
    else:
        plan.launches.append(_preprocess_launch(spec, cfg, out, do_args, delta, lse_strides, dlse))
    if spec.seqlen_k > 0:
        plan.launches.append(Launch(cfg, "dkdv", (_cdiv(spec.seqlen_k, configs.BWD_BLOCK_N), spec.num_heads_kv, spec.batch),
                                    args + do_args + [_ptr(lse), _ptr(delta), _ptr(dk), *_strides3(dk, varlen),
                                                      _ptr(dv), *_strides3(dv, varlen), *stats_ptrs]))
    plan.launches.append(Launch(cfg, "dq", rows_grid,
                                args + do_args + [_ptr(lse), _ptr(delta), _ptr(dq), *_strides3(dq, varlen),
                                                  *stats_ptrs]))
    return plan


def _preprocess_launch(spec, cfg, out, do_args, delta, lse_strides, dlse) -> Launch:
    """delta_i = dO_i . O_i - dlse_i (attn_bwd_preprocess; dlse None: no lse gradient), shared
    by both 16-bit backward families."""
    return Launch(cfg, "preprocess", (_cdiv(spec.seqlen_q, configs.PRE_ROWS), spec.num_heads_q, spec.batch),
                  [_ptr(out), *_strides3(out, spec.is_varlen), *do_args, _ptr(delta), *lse_strides,
                   _ptr(spec.cu_seqlens_q), _i32(spec.seqlen_q), _i32(spec.q.shape[0]), _i32(spec.head_dim_v),
                   _ptr(dlse)])


def _plan_backward_mma(spec, out, lse, dout, cfg, dlse, fused_dq: bool | str | None = None,
                       persistent: bool | int | None = None) -> Plan:
    """The tensor-core backward (fp16/bf16; ``cfg.family`` "bwd_mma" or "bwd_wgmma", whose
    kernels take the same arguments, the wgmma dK/dV's plus the fused dQ's buffer): q, k, v and dO
    with 16-byte aligned rows (padded copies only when needed, as in the forward), gradients
    allocated at the padded widths (so the kernels store aligned pairs) and sliced back to the
    caller's head dims. ``fused_dq`` (None: :func:`configs.fused_dq_choice` for the call's
    determinism and ``PORTATTN_CUPY_DQ``) runs the wgmma module's fused atomic-dQ dK/dV kernel in
    place of the dK/dV and dQ kernels, then dq = scale * the float32 sum: True (or the choice)
    runs the role :func:`configs.fused_dq_role` names for ``PORTATTN_CUPY_DQ``, a role of
    :data:`configs.FUSED_DQ_ROLES` that one."""
    if cfg.family == "bwd_wgmma" and _needs_extras(spec):
        raise ValueError("the wgmma backward has no softcap / ALiBi / bias (cfg=bwd_wgmma): use the bwd_mma config")
    q, k, v = prepare_inputs(spec, tensor_cores=True)
    out = out if out.stride(-1) == 1 else out.contiguous()
    dout = dout.to(spec.dtype)
    if not _aligned_for_mma(dout):
        dout = _pad_last(dout, configs.round_up(spec.head_dim_v, 8))
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    varlen = spec.is_varlen
    if isinstance(fused_dq, str) and fused_dq not in configs.FUSED_DQ_ROLES:
        raise ValueError(f"fused_dq={fused_dq!r}: a bool or one of {tuple(configs.FUSED_DQ_ROLES)}")
    fused_role = fused_dq if isinstance(fused_dq, str) else None
    if fused_dq is None:
        fused_dq = cfg.family == "bwd_wgmma" and configs.fused_dq_choice(cfg, spec.deterministic)[0]
    elif fused_dq and not cfg.has_fused_dq:
        raise ValueError(f"fused_dq={fused_dq!r}: {cfg.family} at padded head dim {cfg.head_dim} has no fused-dQ kernel "
                         f"(the wgmma backward has it at {configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS}, one-CTA tiles)")
    fused_dq = fused_dq and spec.seqlen_k > 0
    # the fused path writes every element of dq (scale * its float32 sum), so it needs no zeros
    dq = (torch.empty((*spec.q.shape[:-1], q.shape[-1]), dtype=spec.q.dtype, device=spec.device) if fused_dq
          else _grad_buffer(spec.q, q.shape[-1]))
    dk = _grad_buffer(spec.k, k.shape[-1])
    dv = _grad_buffer(spec.v, v.shape[-1])
    args, keep = common_args(spec, q, k, v)
    do_args = [_ptr(dout), *_strides3(dout, varlen)]
    suffix = "_extras" if _needs_extras(spec) else ""
    # the fused dK/dV adds scale-free dQ partials into a float32 buffer (zeroed: rows no key sees
    # stay 0), scaled and rounded into dq after the kernels
    dq_acc = torch.empty(dq.shape, dtype=torch.float32, device=dq.device) if fused_dq else None
    plan = Plan(outputs=(dq[..., : spec.head_dim], dk[..., : spec.head_dim], dv[..., : spec.head_dim_v]),
                keep_alive=(keep, out, dout, lse, delta, dlse, dq_acc, dq, dk, dv))
    plan.launches.append(_preprocess_launch(spec, cfg, out, do_args, delta, args[-2:], dlse))
    if spec.seqlen_k > 0:
        role = (fused_role or configs.fused_dq_role()) if fused_dq else "dkdv" + suffix
        dkdv_args = args + do_args + [_ptr(lse), _ptr(delta), _ptr(dk), *_strides3(dk, varlen),
                                      _ptr(dv), *_strides3(dv, varlen)]
        if cfg.family == "bwd_wgmma":   # its dK/dV kernels take the fused dQ's buffer (null when unused)
            dkdv_args += [_ptr(dq_acc), *(_strides3(dq_acc, varlen) if fused_dq else map(_i64, (0, 0, 0)))]
        grid = (_cdiv(spec.seqlen_k, cfg.block_rows(role)), spec.num_heads_kv, spec.batch)
        if role in configs.WS_FUSED_DQ_ROLES:
            grid, next_item = _work_item_grid(grid, spec.device, persistent)
            dkdv_args += [_i32(spec.num_heads_kv), _i32(spec.batch), _ptr(next_item)]
            plan.keep_alive += (next_item,)
            plan.setup.append(next_item.zero_)
        plan.launches.append(Launch(cfg, role, grid, dkdv_args))
    if fused_dq:
        scale = float(np.float32(spec.scale))   # the kernels' float32 scale
        plan.setup.append(dq_acc.zero_)
        # one pass: read the float32 sum, write dq (torch.mul's float32 result rounded into dq's dtype)
        plan.finish.append(lambda: torch.mul(dq_acc, scale, out=dq))
        return plan
    role = "dq" + suffix
    plan.launches.append(Launch(cfg, role, (_cdiv(spec.seqlen_q, cfg.block_rows(role)), spec.num_heads_q, spec.batch),
                                args + do_args + [_ptr(lse), _ptr(delta), _ptr(dq), *_strides3(dq, varlen)]))
    return plan


def _sm_count(device: torch.device) -> int | None:
    """The SMs of a CUDA device (None for others: plans built on the CPU, in tests)."""
    return _device_props(device).multi_processor_count if device.type == "cuda" else None


def _work_item_grid(grid: tuple, device: torch.device, persistent: bool | int | None) -> tuple[tuple, torch.Tensor]:
    """The 1-d grid of a kernel that takes work items (``grid``'s blocks, x fastest) from a
    counter, and the counter (an int32, zeroed by the plan's setup before each launch): one CTA per
    SM when ``persistent`` is True (None: :func:`configs.ws_persistent`), one per item when False;
    an int: that many CTAs (at most one per item; tests run many items per CTA with it)."""
    items = grid[0] * grid[1] * grid[2]
    if items >= 2**31:
        raise ValueError(f"{items} work items (key tiles x kv heads x batch) exceed the kernel's int32 counter")
    persistent = configs.ws_persistent() if persistent is None else persistent
    if isinstance(persistent, bool):
        ctas = _sm_count(device) if persistent else None
    elif isinstance(persistent, int) and persistent > 0:
        ctas = persistent
    else:
        raise ValueError(f"persistent={persistent!r}: True, False, None or a positive CTA count")
    return (max(min(items, ctas or items), 1), 1, 1), torch.empty(1, dtype=torch.int32, device=device)


def execute(plan: Plan, device: torch.device) -> None:
    if not plan.launches:
        return
    for step in plan.setup:
        step()
    with _Launcher(device) as launcher:
        for item in plan.launches:
            launcher.launch(item.cfg, item.role, item.grid, item.args)
    for step in plan.finish:
        step()


def forward(spec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` in the canonical layout (see :class:`portattn.registry.Backend`)."""
    plan = plan_forward(spec)
    execute(plan, spec.device)
    return plan.outputs


def backward(spec, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None,
             force_fma: bool = False):
    """``(dq, dk, dv, None)``: deterministic (no atomics) unless the Hopper backward fuses dQ with
    float32 atomics (determinism not requested, ``PORTATTN_CUPY_DQ``, :func:`plan_backward`). fp16/bf16 run on tensor cores (float32
    accumulation) at every head dim unless ``PORTATTN_CUPY_BACKWARD`` says otherwise (see
    :func:`backward_choice`; ``wgmma``: the sm_90a kernels where they apply); float32 runs the
    FMA kernels. ``force_fma`` (private:
    tests, benchmarks) runs the FMA kernels for any dtype. ``dlse``: see :func:`plan_backward`."""
    cfg = None
    if force_fma:
        cfg = configs.fma_backward_config(_DTYPE_NAMES[spec.dtype], spec.head_dim, spec.head_dim_v)
    plan = plan_backward(spec, out, lse, dout, cfg, dlse)
    execute(plan, spec.device)
    return (*plan.outputs, None)
