"""Whole attention problems: a small frozen description, and the tensors it stands for.

A :class:`Problem` names every choice of docs/semantics.md (sizes, GQA, head dims, dtype, scale,
masking, softcap, ALiBi, bias, varlen, layout, strides, magnitude) plus a ``seed``. The tensor
*values* are not part of the description: :func:`make_inputs` draws them from a seeded
``torch.Generator`` on the CPU, then moves them to the device, so every machine and vendor sees
the same bits for the same problem. The property tests draw problems with
:func:`problem_strategy` (Hypothesis); the conformance catalogue lists fixed ones.

Storage tricks that turn wrong indexing into visible failures:

* ``strided=True``: q/k/v are views into larger buffers (padded head dim, padded heads, a
  permuted sequence axis); everything outside the view is NaN.
* varlen: the packed q/k/v sit inside NaN-filled buffers (rows before and after), and a float
  bias is NaN outside each sequence's ``(Sq_b, Sk_b)`` corner.

A NaN that reaches an output where the reference is finite always fails the §3 rule.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}

#: Sequence lengths the strategy draws from, small first (Hypothesis shrinks towards the
#: front): 1, 2, 3, odd primes, block multiples and their neighbours.
SEQ_POOL = (1, 2, 3, 5, 7, 13, 16, 17, 31, 32, 33, 37, 61, 63, 64, 65, 67, 127, 128, 129,
            191, 255, 256, 257, 509, 511, 512, 513, 1021, 1024, 1025, 2047, 2049)
#: Head dims: the usual ones, then odd ones that need masking inside kernels.
HEAD_DIM_POOL = (16, 32, 64, 8, 24, 40, 48, 72, 80, 96, 128, 160, 192, 256, 1, 3, 17, 33, 57, 100, 129)

BIAS_KINDS = ("float", "float_keys", "float_heads", "bool_keys", "bool")
#: Non-finite values a problem can write into masked K or V positions (``Problem.poison``).
POISONS = ("k:nan", "k:inf", "k:-inf", "v:nan", "v:inf")
POISON_AT = ("hidden", "partial")
ALIBI_KINDS = ("head", "batch")


@dataclass(frozen=True)
class SizeCap:
    """Per-device size limits for drawn problems (the Triton interpreter is slow on the CPU)."""

    max_seq: int = 70
    max_dim: int = 64
    max_batch: int = 3
    max_heads: int = 8
    max_batch_heads: int = 12          # cap on B * Hq (interpreter cost grows with it)
    max_varlen_total: int = 140
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")


CPU_CAP = SizeCap()
GPU_CAP = SizeCap(max_seq=1100, max_dim=256, max_batch=4, max_heads=16, max_batch_heads=32,
                  max_varlen_total=3000)


def cap_for(device: str | torch.device) -> SizeCap:
    return CPU_CAP if torch.device(device).type == "cpu" else GPU_CAP


@dataclass(frozen=True)
class Problem:
    """One attention problem (everything except tensor values, which come from ``seed``).

    Dense problems use ``batch``, ``seqlen_q``, ``seqlen_k``; varlen problems set ``seqlens_q``
    and ``seqlens_k`` (per-sequence lengths, equal counts; ``batch`` is then ignored, see ``num_seqs``).
    ``window`` is ``(left, right)`` with ``None`` = unbounded; with ``causal`` the right side is 0.
    ``bias`` is one of :data:`BIAS_KINDS` (``float``: (B,Hq,Sq,Sk); ``float_keys``: (B,1,1,Sk);
    ``float_heads``: (1,Hq,Sq,Sk); ``bool_keys``: a key-padding mask (B,1,1,Sk); ``bool``:
    (B,Hq,Sq,Sk) with some rows fully masked, always row 0 of head 0). ``alibi`` is ``head``
    (Hq,) or ``batch`` (B,Hq).
    ``magnitude`` multiplies q, k and v; ``extreme`` gives logits a large row offset (~150) with a moderate spread.
    ``grad``: gradients of q, k, v (and of a float bias when ``bias_grad``) are checked too.
    ``poison`` (one of :data:`POISONS`, e.g. ``"k:nan"``) writes that value into K or V at masked
    keys: ``poison_at="hidden"``, every key no query row (of any head) sees; ``"partial"``, one
    key that some rows see and others do not (see docs/semantics.md, "Non-finite values").
    """

    batch: int = 1
    seqlen_q: int = 16
    seqlen_k: int = 16
    heads_q: int = 2
    heads_kv: int = 2
    head_dim: int = 32
    head_dim_v: int | None = None
    dtype: str = "float16"
    seqlens_q: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None
    scale: float | None = None
    causal: bool = False
    alignment: str = "bottom_right"
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi: str | None = None
    bias: str | None = None
    bias_grad: bool = False
    magnitude: float = 1.0
    extreme: bool = False
    layout: str = "bshd"
    strided: bool = False
    grad: bool = True
    seed: int = 0
    poison: str | None = None
    poison_at: str = "hidden"

    # ----- derived ------------------------------------------------------------------------
    @property
    def is_varlen(self) -> bool:
        return self.seqlens_q is not None

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_q) if self.is_varlen else self.batch

    @property
    def max_q(self) -> int:
        return max(self.seqlens_q) if self.is_varlen else self.seqlen_q

    @property
    def max_k(self) -> int:
        return max(self.seqlens_k) if self.is_varlen else self.seqlen_k

    @property
    def total_q(self) -> int:
        return sum(self.seqlens_q) if self.is_varlen else self.batch * self.seqlen_q

    @property
    def features(self) -> frozenset[str]:
        """Feature names in the vocabulary of ``portattn.registry.ALL_FEATURES``."""
        f = set()
        if self.causal:
            f.add("causal")
        w = self.window or (None, None)
        has_window = w[0] is not None or (w[1] is not None and not self.causal)
        if has_window:
            f.add("window")
        if self.alignment == "top_left" and (self.causal or has_window):
            f.add("top_left")
        if self.softcap is not None:
            f.add("softcap")
        if self.alibi:
            f.add("alibi")
        if self.bias:
            f.add("bool_mask" if self.bias.startswith("bool") else "bias")
        if self.bias_grad:
            f.add("bias_grad")
        if self.is_varlen:
            f.add("varlen")
        if self.heads_q != self.heads_kv:
            f.add("gqa")
        if self.dv != self.head_dim:
            f.add("head_dim_v")
        return frozenset(f)

    def fits(self, cap: SizeCap) -> list[str]:
        """Reasons this problem exceeds ``cap`` (empty when it fits)."""
        reasons = []
        if max(self.max_q, self.max_k) > cap.max_seq:
            reasons.append(f"sequence length {max(self.max_q, self.max_k)} > {cap.max_seq}")
        if max(self.head_dim, self.dv) > cap.max_dim:
            reasons.append(f"head dim {max(self.head_dim, self.dv)} > {cap.max_dim}")
        if self.num_seqs * self.heads_q > cap.max_batch_heads * 2:
            reasons.append(f"batch*heads {self.num_seqs * self.heads_q} > {cap.max_batch_heads * 2}")
        return reasons

    def describe(self) -> str:
        """Compact one-line description (used in ids, notes and reports)."""
        if self.is_varlen:
            size = f"varlen q{list(self.seqlens_q)} k{list(self.seqlens_k)}"
        else:
            size = f"B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k}"
        parts = [size, f"H{self.heads_q}/{self.heads_kv}", f"D{self.head_dim}"
                 + (f"/{self.dv}" if self.dv != self.head_dim else ""), self.dtype]
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}")
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.causal or self.window is not None:
            parts.append(self.alignment)
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi={self.alibi}")
        if self.bias:
            parts.append(f"bias={self.bias}" + ("+grad" if self.bias_grad else ""))
        if self.magnitude != 1:
            parts.append(f"x{self.magnitude:g}")
        if self.extreme:
            parts.append("extreme")
        if self.layout != "bshd":
            parts.append(self.layout)
        if self.strided:
            parts.append("strided")
        if self.poison:
            parts.append(f"poison={self.poison}@{self.poison_at}")
        parts.append("fwd+bwd" if self.grad else "fwd")
        parts.append(f"seed={self.seed}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("seqlens_q", "seqlens_k", "window"):
            if d[key] is not None:
                d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Problem:
        d = dict(d)
        for key in ("seqlens_q", "seqlens_k", "window"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)


# ----- tensors ---------------------------------------------------------------------------------

@dataclass
class Inputs:
    """The tensors of one problem on one device.

    ``q, k, v`` are what the caller passes (API layout; views into NaN-padded storage when
    strided or varlen); ``kwargs`` the remaining keyword arguments of ``portattn.attention``;
    ``dout`` the upstream gradient in the API layout; ``bias`` the attn_bias leaf (or None).
    ``canonical(t)`` maps an API-layout (B, ., ., D) tensor to the canonical bshd one.
    ``poisoned_rows``: with ``Problem.poison``, bool over the canonical output rows,
    ``(B, Sq, Hq)`` or varlen ``(total_q, Hq)``: the rows that *see* a poisoned key (empty for
    ``poison_at="hidden"``); None without poison.
    """

    problem: Problem
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    kwargs: dict = field(default_factory=dict)
    bias: torch.Tensor | None = None
    poisoned_rows: torch.Tensor | None = None

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if self.problem.layout == "bhsd" else t

    def from_canonical(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if self.problem.layout == "bhsd" else t


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(-8 (h+1) / H), float32 (H,)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)


def _randn(gen: torch.Generator, shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale


def _into_nan_storage(values: torch.Tensor, problem: Problem, gen: torch.Generator, device) -> torch.Tensor:
    """Place ``values`` (canonical, CPU) inside a larger NaN buffer on ``device``; return the view.

    Varlen (total, H, D): NaN rows before and after (and, when strided, padded heads/dims).
    Dense strided (B, S, H, D): buffer (S, B, H + 1, D + 3) permuted, so the view has
    non-trivial strides on every axis but the last.
    """
    nan = float("nan")
    if values.dim() == 3:                                  # varlen packed rows
        total, h, d = values.shape
        front, back = 3, 5
        hp, dp = (h + 1, d + 3) if problem.strided else (h, d)
        buf = torch.full((front + total + back, hp, dp), nan, dtype=values.dtype)
        buf[front:front + total, :h, :d] = values
        buf = buf.to(device)
        return buf[front:front + total, :h, :d]
    b, s, h, d = values.shape
    if not problem.strided:
        return values.to(device)
    buf = torch.full((s, b, h + 1, d + 3), nan, dtype=values.dtype)
    buf[:, :, :h, :d] = values.transpose(0, 1)
    buf = buf.to(device)
    return buf.transpose(0, 1)[:, :, :h, :d]


def _sequence_rows(lengths) -> list[slice]:
    out, start = [], 0
    for n in lengths:
        out.append(slice(start, start + n))
        start += n
    return out


def _draw_qk(p: Problem, gen: torch.Generator, q_shape, k_shape):
    """q and k; with ``extreme``, logits get a large per-row offset and a moderate spread.

    Extreme: every key of a (batch, kv head) shares a large component ``base``, so
    ``scale * q_i . k_j`` = a row offset of standard deviation ~150 (``exp`` overflows without
    the running max; float32 keeps only ~1e-5 absolute precision there) plus a spread of
    standard deviation ~6 (a peaked but not one-hot softmax, so gradients stay well above the
    dtype's resolution and the §3 yardstick does not degenerate to an exact zero).
    """
    if not p.extreme:
        return _randn(gen, q_shape, p.magnitude), _randn(gen, k_shape, p.magnitude)
    d = q_shape[-1]
    eff_scale = p.scale if p.scale is not None else 1.0 / math.sqrt(d)
    g = eff_scale * math.sqrt(d)             # score std per unit of q-std x k-std
    sigma_q = 3.0
    q = _randn(gen, q_shape, sigma_q)
    base_shape = (1,) * (len(k_shape) - 2) + tuple(k_shape[-2:]) if len(k_shape) == 3 else \
        (k_shape[0], 1, k_shape[2], k_shape[3])
    base = _randn(gen, base_shape, 150.0 / (sigma_q * g))
    k = base + _randn(gen, k_shape, 6.0 / (sigma_q * g))
    return q, k


def make_inputs(problem: Problem, device="cpu", *, requires_grad: bool = False, bias_requires_grad: bool = False,
                perturb_except: int | None = None, clean: bool = False) -> Inputs:
    """Draw the tensors of ``problem`` from its seed on the CPU and move them to ``device``.

    ``perturb_except=b`` redraws q, k, v of every sequence except ``b`` from another seed (the
    per-sequence independence check); sequence ``b`` keeps exactly the same bits.
    ``clean=True`` leaves out ``problem.poison`` (same bits otherwise; ``poisoned_rows`` is still
    set): the reference of a poisoned problem is computed on the clean inputs.
    """
    p = problem
    dt = p.torch_dtype
    gen = torch.Generator().manual_seed(p.seed)
    hq, hkv, d, dv = p.heads_q, p.heads_kv, p.head_dim, p.dv
    if p.is_varlen:
        q_shape, k_shape, v_shape = (p.total_q, hq, d), (sum(p.seqlens_k), hkv, d), (sum(p.seqlens_k), hkv, dv)
        o_shape = (p.total_q, hq, dv)
    else:
        q_shape, k_shape = (p.batch, p.seqlen_q, hq, d), (p.batch, p.seqlen_k, hkv, d)
        v_shape, o_shape = (p.batch, p.seqlen_k, hkv, dv), (p.batch, p.seqlen_q, hq, dv)
    q, k = _draw_qk(p, gen, q_shape, k_shape)
    v = _randn(gen, v_shape, p.magnitude)
    dout = _randn(gen, o_shape)
    if perturb_except is not None:
        other = torch.Generator().manual_seed(p.seed ^ 0x5EED)
        q2, k2 = _draw_qk(p, other, q_shape, k_shape)
        v2 = _randn(other, v_shape, p.magnitude)
        if p.is_varlen:
            qrows, krows = _sequence_rows(p.seqlens_q), _sequence_rows(p.seqlens_k)
            keep_q = torch.zeros(q_shape[0], dtype=torch.bool)
            keep_q[qrows[perturb_except]] = True
            keep_k = torch.zeros(k_shape[0], dtype=torch.bool)
            keep_k[krows[perturb_except]] = True
            q = torch.where(keep_q.view(-1, 1, 1), q, q2)
            k = torch.where(keep_k.view(-1, 1, 1), k, k2)
            v = torch.where(keep_k.view(-1, 1, 1), v, v2)
        else:
            sel = (torch.arange(p.batch) == perturb_except).view(-1, 1, 1, 1)
            q, k, v = torch.where(sel, q, q2), torch.where(sel, k, k2), torch.where(sel, v, v2)
    q, k, v, dout = q.to(dt), k.to(dt), v.to(dt), dout.to(dt)

    kwargs: dict = {"scale": p.scale, "causal": p.causal, "causal_alignment": p.alignment, "layout": p.layout}
    if p.window is not None:
        left, right = p.window
        kwargs["window"] = (-1 if left is None else left, -1 if right is None else right)
    if p.softcap is not None:
        kwargs["softcap"] = p.softcap
    b = p.num_seqs
    if p.alibi:
        slopes = alibi_slopes(hq)
        if p.alibi == "batch":
            slopes = slopes.unsqueeze(0) * (0.5 + torch.rand(b, 1, generator=gen))
        kwargs["alibi_slopes"] = slopes.to(device)
    bias = None
    if p.bias:
        bias = _make_bias(p, gen, dt)
        bias = bias.to(device)
        if bias_requires_grad:
            bias.requires_grad_(True)
        kwargs["attn_bias"] = bias

    poisoned_rows = None
    if p.poison:
        k, v, poisoned_rows = _poison(p, k, v, bias, clean)

    if p.is_varlen:
        cu_q = torch.tensor([0] + list(torch.tensor(p.seqlens_q).cumsum(0).tolist()), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(p.seqlens_k).cumsum(0).tolist()), dtype=torch.int32)
        kwargs.update(cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
                      max_seqlen_q=p.max_q, max_seqlen_k=p.max_k)
        q, k, v = (_into_nan_storage(t, p, gen, device) for t in (q, k, v))
        dout = dout.to(device)
    else:
        if p.layout == "bhsd":   # the caller's tensors are contiguous in bhsd (SDPA's order)
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        q, k, v = (_into_nan_storage(t, p, gen, device) for t in (q, k, v))
        if p.layout == "bhsd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            dout = dout.transpose(1, 2).contiguous()
        dout = dout.to(device)
    if requires_grad:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    return Inputs(problem=p, q=q, k=k, v=v, dout=dout, kwargs=kwargs, bias=bias,
                  poisoned_rows=None if poisoned_rows is None else poisoned_rows.to(device))


def _seen(p: Problem, b: int, sq: int, sk: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Bool (Hq, sq, sk): which key each query row of sequence ``b`` sees (causal/window, bool bias)."""
    left, right = p.window if p.window is not None else (None, None)
    if p.causal:
        right = 0
    off = sk - sq if p.alignment == "bottom_right" else 0
    i = torch.arange(sq).view(-1, 1) + off
    j = torch.arange(sk).view(1, -1)
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        seen &= j >= i - left
    if right is not None:
        seen &= j <= i + right
    seen = seen.expand(p.heads_q, sq, sk)
    if bias is not None and bias.dtype == torch.bool:
        seen = seen & bias.cpu()[min(b, bias.shape[0] - 1), :, :sq, :sk].expand(p.heads_q, sq, sk)
    return seen


def _poison(p: Problem, k: torch.Tensor, v: torch.Tensor, bias, clean: bool):
    """Write ``p.poison`` into K or V (CPU, canonical) at the keys of ``p.poison_at``; return
    ``(k, v, poisoned_rows)`` (see :class:`Inputs`)."""
    if p.poison not in POISONS:
        raise ValueError(f"poison={p.poison!r} is not one of {POISONS}")
    if p.poison_at not in POISON_AT:
        raise ValueError(f"poison_at={p.poison_at!r} is not one of {POISON_AT}")
    which, name = p.poison.split(":")
    value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[name]
    target = (k if which == "k" else v).clone()
    lens_q = p.seqlens_q if p.is_varlen else (p.seqlen_q,) * p.batch
    lens_k = p.seqlens_k if p.is_varlen else (p.seqlen_k,) * p.batch
    rows_k = _sequence_rows(lens_k)
    row_masks = []
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        seen = _seen(p, b, sq, sk, bias)                     # (Hq, sq, sk)
        counts = seen.sum(dim=(0, 1))                        # rows (of any head) that see each key
        if p.poison_at == "hidden":
            keys = (counts == 0).nonzero().flatten()
        else:
            some = ((counts > 0) & (counts < seen.shape[0] * sq)).nonzero().flatten()
            keys = some[len(some) // 2:len(some) // 2 + 1]   # one key in the middle of those
        rows = seen[:, :, keys].any(dim=-1).transpose(0, 1) if len(keys) else torch.zeros(sq, p.heads_q, dtype=torch.bool)
        row_masks.append(rows)                               # (sq, Hq)
        if not clean and len(keys):
            if p.is_varlen:
                target[rows_k[b].start + keys] = value
            else:
                target[b, keys] = value
    if p.is_varlen:
        poisoned_rows = torch.cat(row_masks, dim=0) if row_masks else torch.zeros(0, p.heads_q, dtype=torch.bool)
    else:
        poisoned_rows = torch.stack(row_masks, dim=0)
    return (target, v, poisoned_rows) if which == "k" else (k, target, poisoned_rows)


def _make_bias(p: Problem, gen: torch.Generator, dt: torch.dtype) -> torch.Tensor:
    """attn_bias of kind ``p.bias``; for varlen, NaN (float) outside each sequence's corner."""
    b, hq, sq, sk = p.num_seqs, p.heads_q, p.max_q, p.max_k
    kind = p.bias
    if kind == "float":
        bias = _randn(gen, (b, hq, sq, sk))
    elif kind == "float_keys":
        bias = _randn(gen, (b, 1, 1, sk), 2.0)
    elif kind == "float_heads":
        bias = _randn(gen, (1, hq, sq, sk))
    elif kind == "bool_keys":
        bias = torch.rand(b, 1, 1, sk, generator=gen) < 0.75
    elif kind == "bool":
        bias = torch.rand(b, hq, sq, sk, generator=gen) < 0.7
        rows = torch.rand(b, hq, sq, 1, generator=gen) < 0.15     # a few rows fully masked,
        rows[:, 0, 0] = True                                       # always row 0 of head 0
        bias = bias & ~rows
    else:
        raise ValueError(f"unknown bias kind {kind!r}; use one of {BIAS_KINDS}")
    if p.is_varlen and bias.is_floating_point():
        # storage beyond each sequence's (Sq_b, Sk_b) corner must never be read
        for i, (nq, nk) in enumerate(zip(p.seqlens_q, p.seqlens_k)):
            if bias.shape[0] == 1:
                break
            if bias.shape[2] > 1:
                bias[i, :, nq:, :] = float("nan")
            bias[i, :, :, nk:] = float("nan")
    return bias if kind.startswith("bool") else bias.to(dt)


# ----- the Hypothesis strategy ---------------------------------------------------------------

def problem_strategy(cap: SizeCap = CPU_CAP, *, varlen: bool | None = None, grad: bool | None = None,
                     need: frozenset[str] = frozenset()):
    """A Hypothesis strategy drawing whole :class:`Problem` s within ``cap``.

    ``varlen``/``grad`` force those choices when not None; ``need`` forces features (any of
    ``softcap``, ``causal``, ``bool_mask``, ``batch2`` (at least two sequences)).
    Imported lazily: Hypothesis is a test dependency only.
    """
    from hypothesis import strategies as st

    seqs = [s for s in SEQ_POOL if s <= cap.max_seq]
    dims = [d for d in HEAD_DIM_POOL if d <= cap.max_dim]

    @st.composite
    def draw_problem(draw):
        is_varlen = draw(st.sampled_from([False, False, False, True])) if varlen is None else varlen
        min_b = 2 if "batch2" in need else 1
        if is_varlen:
            nseq = draw(st.integers(min_b, cap.max_batch + 1))
            small = [0, 1] + seqs
            lens_q = draw(st.lists(st.sampled_from(small), min_size=nseq, max_size=nseq))
            same = draw(st.booleans())
            lens_k = list(lens_q) if same else draw(st.lists(st.sampled_from(small), min_size=nseq, max_size=nseq))
            # at least one query row and one key; keep the packed totals bounded
            if sum(lens_q) == 0:
                lens_q[0] = 1
            if sum(lens_k) == 0:
                lens_k[-1] = 1
            while sum(lens_q) > cap.max_varlen_total or sum(lens_k) > cap.max_varlen_total:
                i = max(range(nseq), key=lambda j: lens_q[j] + lens_k[j])
                lens_q[i] //= 2
                lens_k[i] //= 2
            if sum(lens_q) == 0:
                lens_q[0] = 1
            if sum(lens_k) == 0:
                lens_k[-1] = 1
            batch, sq, sk = nseq, 0, 0
            sizes = dict(seqlens_q=tuple(lens_q), seqlens_k=tuple(lens_k))
        else:
            batch = draw(st.integers(min_b, cap.max_batch))
            sq = draw(st.sampled_from(seqs))
            sk = sq if draw(st.booleans()) else draw(st.sampled_from(seqs))
            sizes = dict(seqlen_q=sq, seqlen_k=sk)
        hkv = draw(st.sampled_from([1, 2, 3]))
        ratio = draw(st.sampled_from([1, 2, 4, 1, 3, 8]))
        while hkv * ratio > cap.max_heads or batch * hkv * ratio > cap.max_batch_heads:
            if ratio > 1:
                ratio //= 2
            elif hkv > 1:
                hkv -= 1
            else:
                break
        d = draw(st.sampled_from(dims))
        dv = d if draw(st.integers(0, 4)) else draw(st.sampled_from(dims))
        dtype = draw(st.sampled_from(cap.dtypes))
        scale = draw(st.sampled_from([None, None, None, 0.08, 0.5, 1.0]))

        mask = draw(st.sampled_from(["none", "causal", "window", "causal_window"]))
        if "causal" in need and "causal" not in mask:
            mask = "causal"
        causal = mask.startswith("causal")
        window = None
        if "window" in mask:
            sides = [None, 0, 1, 4, 16]
            left = draw(st.sampled_from(sides))
            right = 0 if causal else draw(st.sampled_from(sides))
            window = (left, right)
        alignment = draw(st.sampled_from(["bottom_right", "top_left"]))
        softcap = draw(st.sampled_from([None, None, None, 2.0, 10.0, 30.0]))
        if "softcap" in need and softcap is None:
            softcap = draw(st.sampled_from([2.0, 10.0, 30.0]))
        alibi = draw(st.sampled_from([None, None, None, "head", "batch"]))
        bias = draw(st.sampled_from([None, None, None, *BIAS_KINDS]))
        if "bool_mask" in need:
            bias = "bool"
        want_grad = draw(st.booleans()) if grad is None else grad
        bias_grad = bool(want_grad and bias in ("float", "float_keys", "float_heads") and draw(st.booleans()))
        extreme = draw(st.integers(0, 6)) == 0
        magnitude = 1.0 if extreme else draw(st.sampled_from([1.0, 2.0, 3.0, 5.0]))
        layout = "bshd" if is_varlen else draw(st.sampled_from(["bshd", "bhsd"]))
        strided = draw(st.booleans())
        seed = draw(st.integers(0, 2**31 - 1))
        return Problem(batch=batch, heads_q=hkv * ratio, heads_kv=hkv, head_dim=d,
                       head_dim_v=None if dv == d else dv, dtype=dtype, scale=scale, causal=causal,
                       alignment=alignment, window=window, softcap=softcap, alibi=alibi, bias=bias,
                       bias_grad=bias_grad, magnitude=magnitude, extreme=extreme, layout=layout,
                       strided=strided, grad=want_grad, seed=seed, **sizes)

    return draw_problem()


def with_changes(problem: Problem, **changes) -> Problem:
    """``dataclasses.replace`` re-exported for callers that only import this module."""
    return replace(problem, **changes)
