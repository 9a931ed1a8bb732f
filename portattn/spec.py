"""AttentionSpec: the arguments of :func:`portattn.attention`, validated once.

Backends never see the raw arguments, only an :class:`AttentionSpec`. Its tensors are in the
*canonical* layout:

* dense:  ``q (B, Sq, Hq, D)``, ``k (B, Sk, Hkv, D)``, ``v (B, Sk, Hkv, Dv)`` — views of the
  caller's tensors (a ``layout="bhsd"`` input is transposed, never copied);
* varlen: ``q (total_q, Hq, D)``, ``k (total_k, Hkv, D)``, ``v (total_k, Hkv, Dv)`` with
  ``cu_seqlens_q/k`` (int32, ``B + 1``) and ``max_seqlen_q/k``.

Masking is normalised to one window ``(window_left, window_right)`` on the aligned row
``i' = i + Sk - Sq`` (``bottom_right``) or ``i' = i`` (``top_left``): key ``j`` is visible iff
``i' - window_left <= j <= i' + window_right``, ``None`` meaning unbounded; ``causal=True`` is
``window_right = 0``. For varlen, ``Sq``/``Sk`` are each sequence's own lengths.

``alibi_slopes`` is normalised to float32 ``(B, Hq)`` and ``attn_bias`` to a (possibly
stride-0) view of shape ``(B, Hq, Sq, Sk)`` (varlen: ``(B, Hq, max_seqlen_q, max_seqlen_k)``
indexed by positions inside each sequence).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from . import config
from .errors import describe

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ALIGNMENTS = ("bottom_right", "top_left")
LAYOUTS = ("bshd", "bhsd")


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream (no host reads then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _real(name: str, value, hint: str) -> float:
    """A Python or NumPy real number (not bool, not a tensor) as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}; {hint}")
    return float(value)


def device_vendor(device: torch.device) -> str:
    """``"nvidia"``, ``"amd"``, ``"cpu"`` or the device type for anything else."""
    if device.type == "cuda":
        return "amd" if getattr(torch.version, "hip", None) else "nvidia"
    return device.type


class QueryViews:
    """The views of a problem that follow from its query tensor, head counts and mask, shared by
    :class:`AttentionSpec` and :class:`portattn.kvcache.KVCacheSpec` (each has ``q``,
    ``num_heads_q``, ``num_heads_kv``, ``causal``, ``window_left`` and ``window_right``)."""

    __slots__ = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def vendor(self) -> str:
        return device_vendor(self.q.device)

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads_q // self.num_heads_kv

    @property
    def has_window(self) -> bool:
        """True when a finite window (beyond plain causal) restricts the keys."""
        return self.window_left is not None or (self.window_right is not None and not self.causal)


@dataclass(eq=False, slots=True)
class AttentionSpec(QueryViews):
    """A validated attention problem. Build it with :func:`build_spec` (from user arguments) or
    :func:`spec_from_canonical` (from canonical, validated ones). Read-only by contract: a
    backend never assigns to it (``dataclasses.replace`` makes a variant). Not frozen because a
    frozen dataclass costs ~6 us per construction, on every call.

    Attributes are documented in the module docstring; derived sizes are plain ints so that
    backends can reason about them without touching tensors.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str = "bshd"
    scale: float = 1.0
    causal: bool = False
    alignment: str = "bottom_right"
    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    attn_bias: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    return_lse: bool = False
    needs_grad: bool = False
    deterministic: bool = False
    allow_tf32: bool = False
    # derived sizes (filled in __post_init__)
    batch: int = field(init=False)
    seqlen_q: int = field(init=False)
    seqlen_k: int = field(init=False)
    num_heads_q: int = field(init=False)
    num_heads_kv: int = field(init=False)
    head_dim: int = field(init=False)
    head_dim_v: int = field(init=False)
    _features: frozenset = field(init=False, repr=False)
    #: the call signature (:mod:`portattn.callcache`) this spec was built for, or None: specs with
    #: the same signature have the same metadata (shapes, strides, dtypes, device, arguments),
    #: so backends may key host-side caches on it. Not copied by ``dataclasses.replace`` (a
    #: variant has other metadata).
    signature: tuple | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        set_ = object.__setattr__
        if self.attn_bias is not None and self.attn_bias.dim() == 4:
            target = self._bias_target()
            if tuple(self.attn_bias.shape) != target:   # a broadcastable bias: a stride-0 view
                set_(self, "attn_bias", self.attn_bias.expand(target))
        if self.is_varlen:
            set_(self, "batch", self.cu_seqlens_q.shape[0] - 1)
            set_(self, "seqlen_q", int(self.max_seqlen_q))
            set_(self, "seqlen_k", int(self.max_seqlen_k))
            heads_axis = 1
        else:
            set_(self, "batch", self.q.shape[0])
            set_(self, "seqlen_q", self.q.shape[1])
            set_(self, "seqlen_k", self.k.shape[1])
            heads_axis = 2
        set_(self, "num_heads_q", self.q.shape[heads_axis])
        set_(self, "num_heads_kv", self.k.shape[heads_axis])
        set_(self, "head_dim", self.q.shape[-1])
        set_(self, "head_dim_v", self.v.shape[-1])
        set_(self, "_features", self._compute_features())

    def _bias_target(self) -> tuple[int, int, int, int]:
        if self.is_varlen:
            return (self.cu_seqlens_q.shape[0] - 1, self.q.shape[1], int(self.max_seqlen_q), int(self.max_seqlen_k))
        return (self.q.shape[0], self.q.shape[2], self.q.shape[1], self.k.shape[1])

    # ----- convenience views for backends -------------------------------------------------
    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def bias_is_mask(self) -> bool:
        return self.attn_bias is not None and self.attn_bias.dtype == torch.bool

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to compute (no query rows, or no keys at all)."""
        if self.q.numel() == 0 or self.v.shape[-1] == 0:
            return True
        return (not self.is_varlen) and self.seqlen_k == 0

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Canonical output shape: q's shape with the last dim replaced by ``Dv``."""
        return (*self.q.shape[:-1], self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        if self.is_varlen:
            return (self.num_heads_q, self.q.shape[0])
        return (self.batch, self.num_heads_q, self.seqlen_q)

    def features(self) -> frozenset[str]:
        """The optional features this problem uses (names of :mod:`portattn.features`)."""
        return self._features

    @property
    def capability_key(self) -> tuple:
        """Everything declared capabilities depend on (``Backend.static_reasons``): the dispatch
        core caches the backends that pass them under this key."""
        return (self.q.device, self.q.dtype, self.head_dim, self.head_dim_v, self._features,
                self.needs_grad, self.deterministic, self.allow_tf32)

    def _compute_features(self) -> frozenset[str]:
        f = set()
        if self.causal:
            f.add("causal")
        if self.causal and self.alignment == "top_left" or self.has_window and self.alignment == "top_left":
            f.add("top_left")
        if self.has_window:
            f.add("window")
        if self.softcap is not None:
            f.add("softcap")
        if self.alibi_slopes is not None:
            f.add("alibi")
        if self.attn_bias is not None:
            f.add("bool_mask" if self.bias_is_mask else "bias")
        if self.is_varlen:
            f.add("varlen")
        if self.num_heads_q != self.num_heads_kv:
            f.add("gqa")
        if self.head_dim != self.head_dim_v:
            f.add("head_dim_v")
        if self.needs_grad and self.attn_bias is not None and self.attn_bias.requires_grad:
            f.add("bias_grad")
        return frozenset(f)

    def summary(self) -> str:
        """Short human-readable description, e.g. for ``explain``."""
        parts = [
            f"B={self.batch}",
            f"Sq={self.seqlen_q}",
            f"Sk={self.seqlen_k}",
            f"Hq={self.num_heads_q}",
            f"Hkv={self.num_heads_kv}",
            f"D={self.head_dim}" + (f"/Dv={self.head_dim_v}" if self.head_dim_v != self.head_dim else ""),
            str(self.dtype).replace("torch.", ""),
            str(self.device),
        ]
        feats = sorted(self.features())
        if self.needs_grad:
            feats.append("grad")
        return " ".join(parts) + (f" [{', '.join(feats)}]" if feats else "")


def _make_copier():
    """``copy_with_tensors(spec, q, k, v, attn_bias)``: a new AttentionSpec with every field of
    ``spec`` but those four, which it takes as given (canonical layout; nothing is validated:
    :mod:`portattn.callcache` guarantees that the metadata match). Generated straight-line code:
    ~0.4 us, against ~6 us for ``copy.copy``."""
    names = [n for n in AttentionSpec.__slots__ if n not in ("q", "k", "v", "attn_bias")]
    body = "".join(f"    n.{x} = s.{x}\n" for x in names)
    src = f"def copy_with_tensors(s, q, k, v, attn_bias):\n    n = new(cls)\n{body}    n.q = q\n    n.k = k\n" \
          f"    n.v = v\n    n.attn_bias = attn_bias\n    return n\n"
    namespace = {"new": object.__new__, "cls": AttentionSpec}
    exec(src, namespace)   # fixed source, built from the dataclass's own slot names
    return namespace["copy_with_tensors"]


copy_with_tensors = _make_copier()


# ----- validation --------------------------------------------------------------------------

def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _norm_window(name: str, w) -> int | None:
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int):
        raise TypeError(f"{name} must be an int >= 0, -1 or None (unbounded), got {w!r}")
    if w == -1:
        return None
    if w < 0:
        raise ValueError(f"{name}={w} is out of range: use an int >= 0, or -1/None for unbounded")
    return w


def _check_cu_type(name: str, cu) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32 torch.Tensor of length B + 1 on q's device, got "
                        f"{type(cu).__name__}; build it with torch.tensor([0, len0, len0+len1, ...], "
                        f"dtype=torch.int32, device=q.device)")


def _check_cu_seqlens(name: str, cu: torch.Tensor, q: torch.Tensor, total: int, max_name: str,
                      max_len: int | None) -> int:
    """Validate one cu_seqlens tensor; return the max sequence length (computed if not given).
    Its contents are read on the host only in eager mode outside CUDA-graph capture; under
    torch.compile or capture ``max_len`` must be given, and the kernels clamp what they read."""
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"{name} must be a 1-D int32 tensor of length B + 1 >= 2 starting at 0, got "
            f"{describe(cu)}; build it with torch.tensor([0, len0, len0+len1, ...], dtype=torch.int32)")
    if cu.device != q.device:
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; move it with .to(q.device)")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0):
        raise ValueError(f"{max_name} must be an int >= 0, got {max_len!r}")
    if _is_compiling() or _capturing(cu.device):
        if max_len is None:
            raise ValueError(f"{max_name} must be given under torch.compile and CUDA-graph capture "
                             f"(it cannot be read from {name} without a host synchronisation)")
        return max_len
    host = cu.tolist()
    lengths = [b - a for a, b in zip(host[:-1], host[1:])]
    if host[0] != 0 or any(n < 0 for n in lengths) or host[-1] != total:
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the packed length {total}; got {host[:8]}"
            f"{' ...' if len(host) > 8 else ''} (last={host[-1]})")
    longest = max(lengths)
    if max_len is None:
        return longest
    if max_len < longest:
        raise ValueError(f"{max_name}={max_len} is smaller than the longest sequence in {name} ({longest})")
    return max_len


def build_spec(q, k, v, *, causal=False, causal_alignment="bottom_right", window=None, scale=None,
               softcap=None, alibi_slopes=None, attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None,
               max_seqlen_q=None, max_seqlen_k=None, layout="bshd", return_lse=False) -> AttentionSpec:
    """Validate the arguments of :func:`portattn.attention` and build the canonical spec.

    Raises ``TypeError``/``ValueError`` naming the offending argument, with shapes, dtypes and
    devices and a hint on what to change.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use one of {LAYOUTS}")
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment={causal_alignment!r} is not supported; use one of {ALIGNMENTS}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported dtypes are "
                        f"{', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype; got q={describe(q)}, k={describe(k)}, v={describe(v)}; "
                        f"cast them with .to(q.dtype)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device; got q={describe(q)}, k={describe(k)}, v={describe(v)}")

    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("varlen needs both cu_seqlens_q and cu_seqlens_k (got only "
                             f"{'cu_seqlens_q' if cu_seqlens_q is not None else 'cu_seqlens_k'})")
        if layout != "bshd":
            raise ValueError("varlen inputs are packed (total, H, D): use layout='bshd' with cu_seqlens")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise ValueError(f"with cu_seqlens, {name} must be 3-D (total, heads, head_dim); got {describe(t)}")
        _check_cu_type("cu_seqlens_q", cu_seqlens_q)
        _check_cu_type("cu_seqlens_k", cu_seqlens_k)
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length B + 1; got "
                             f"{describe(cu_seqlens_q)} and {describe(cu_seqlens_k)}")
        max_seqlen_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q, q.shape[0], "max_seqlen_q", max_seqlen_q)
        max_seqlen_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q, k.shape[0], "max_seqlen_k", max_seqlen_k)
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must have the same packed length; got k={describe(k)}, v={describe(v)}")
        cq, ck, cv = q, k, v
        heads_axis = 1
    else:
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ValueError("max_seqlen_q/max_seqlen_k are only meaningful with cu_seqlens_q/cu_seqlens_k")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                order = "(B, S, H, D)" if layout == "bshd" else "(B, H, S, D)"
                raise ValueError(f"{name} must be 4-D {order} for layout={layout!r}; got {describe(t)}"
                                 + ("; for packed sequences pass cu_seqlens_q/cu_seqlens_k" if t.dim() == 3 else ""))
        if layout == "bhsd":
            cq, ck, cv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            cq, ck, cv = q, k, v
        if not (cq.shape[0] == ck.shape[0] == cv.shape[0]):
            raise ValueError(f"q, k and v must have the same batch size; got q={describe(q)}, k={describe(k)}, v={describe(v)}")
        if ck.shape[1] != cv.shape[1]:
            raise ValueError(f"k and v must have the same sequence length; got k={describe(k)}, v={describe(v)}")
        heads_axis = 2

    hq, hk, hv = cq.shape[heads_axis], ck.shape[heads_axis], cv.shape[heads_axis]
    if hk != hv:
        raise ValueError(f"k and v must have the same number of heads; got k={describe(k)}, v={describe(v)} ({layout})")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of key/value heads "
                         f"({hk}) for GQA/MQA; got q={describe(q)}, k={describe(k)} ({layout})")
    if cq.shape[-1] != ck.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim; got q={describe(q)}, k={describe(k)}")
    if cq.shape[-1] == 0:
        raise ValueError(f"head_dim must be >= 1; got q={describe(q)}")

    head_dim = cq.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        scale = _real("scale", scale, "pass a float such as 1/sqrt(head_dim), or None for that default")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale={scale} is out of range: it must be finite and > 0 (default 1/sqrt(head_dim))")

    if softcap is not None:
        softcap = _real("softcap", softcap, "pass a float > 0, or None/0 to disable it")
        if not math.isfinite(softcap) or softcap < 0:
            raise ValueError(f"softcap={softcap} is out of range: use a finite value > 0, or None/0 to disable it")
        if softcap == 0:
            softcap = None

    left = right = None
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a (left, right) pair of ints (-1/None = unbounded), got {window!r}")
        left = _norm_window("window[0] (left)", window[0])
        right = _norm_window("window[1] (right)", window[1])
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True already means window right = 0; got window={window!r}. "
                             f"Use causal=False with window=(left, {right}) for a non-causal band")
        right = 0

    batch = cu_seqlens_q.shape[0] - 1 if varlen else cq.shape[0]
    sq = max_seqlen_q if varlen else cq.shape[1]
    sk = max_seqlen_k if varlen else ck.shape[1]

    alibi = None
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes)
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
        if not alibi_slopes.is_floating_point():
            raise TypeError(f"alibi_slopes must be a float tensor, got {describe(alibi_slopes)}")
        if alibi_slopes.shape not in ((hq,), (batch, hq)):
            raise ValueError(f"alibi_slopes must have shape (Hq,)=({hq},) or (B, Hq)=({batch}, {hq}); "
                             f"got {describe(alibi_slopes)}")
        if alibi_slopes.requires_grad and torch.is_grad_enabled():
            raise ValueError("alibi_slopes requires grad, but portattn does not differentiate with respect to the "
                             "ALiBi slopes (no backend computes that gradient); pass alibi_slopes.detach(), or "
                             "compute the slopes' gradient through attn_bias=-slope*|i - j| instead")
        alibi = alibi_slopes.to(torch.float32).expand(batch, hq).contiguous()

    bias = None
    if attn_bias is not None:
        _check_tensor("attn_bias", attn_bias)
        if attn_bias.device != q.device:
            raise ValueError(f"attn_bias is on {attn_bias.device} but q is on {q.device}; move it with .to(q.device)")
        if attn_bias.dtype != torch.bool and not attn_bias.is_floating_point():
            raise TypeError(f"attn_bias must be a float tensor (additive) or bool (True = keep), got {describe(attn_bias)}")
        target = (batch, hq, sq, sk)
        if attn_bias.dim() > 4:
            raise ValueError(f"attn_bias must be broadcastable to (B, Hq, Sq, Sk)={target}; got {describe(attn_bias)}")
        try:
            if torch.broadcast_shapes(attn_bias.shape, target) != torch.Size(target):
                raise RuntimeError
        except RuntimeError:
            raise ValueError(f"attn_bias with shape {tuple(attn_bias.shape)} is not broadcastable to "
                             f"(B, Hq, Sq, Sk)={target}" + (" (varlen: max_seqlen_q, max_seqlen_k)" if varlen else "")
                             + "; give size-1 or matching dims, e.g. (B, 1, 1, Sk) for a key padding mask") from None
        bias = attn_bias.expand(target)

    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (bias is not None and bias.requires_grad))
    return spec_from_canonical(
        cq, ck, cv, layout=layout, scale=scale, causal=causal, alignment=causal_alignment,
        window_left=left, window_right=right, softcap=softcap, alibi_slopes=alibi, attn_bias=bias,
        cu_seqlens_q=cu_seqlens_q if varlen else None, cu_seqlens_k=cu_seqlens_k if varlen else None,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=bool(return_lse), needs_grad=needs_grad)


def spec_from_canonical(q, k, v, *, scale, causal=False, alignment="bottom_right", window_left=None,
                        window_right=None, softcap=None, alibi_slopes=None, attn_bias=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, return_lse=False,
                        needs_grad=False, layout="bshd") -> AttentionSpec:
    """The one constructor of :class:`AttentionSpec`, from arguments already validated and in the
    canonical layout (what :func:`build_spec` produces, and what the custom op receives).

    ``alibi_slopes`` is float32 ``(B, Hq)``; ``attn_bias`` is 4-D and broadcastable to
    ``(B, Hq, Sq, Sk)`` (it is expanded, never copied). Determinism and TF32 are read from the
    configuration now. No validation happens here.
    """
    return AttentionSpec(
        q=q, k=k, v=v, layout=layout, scale=scale, causal=causal, alignment=alignment,
        window_left=window_left, window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
        attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if cu_seqlens_q is not None else None,
        max_seqlen_k=max_seqlen_k if cu_seqlens_q is not None else None, return_lse=return_lse,
        needs_grad=needs_grad, deterministic=config.deterministic() or torch.are_deterministic_algorithms_enabled(),
        allow_tf32=config.allow_tf32(),
    )
