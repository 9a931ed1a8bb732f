"""Attention against a KV cache (decoding): :func:`attention_with_kvcache` and flash-attn's
:func:`flash_attn_with_kvcache`.

One decoding step attends a few new queries to a long cache of keys and values::

    q        (B, Sq, Hq, D)                        Sq = 1 (greedy) .. 16 (speculative)
    k_cache  (B, S_cache, Hkv, D)                  contiguous cache, or with block_table
             (num_pages, page_size, Hkv, D)        a paged cache (pages shared by all sequences)
    v_cache  like k_cache with Dv
    k, v     (B, Sk_new, Hkv, D / Dv) or None      new keys/values, written into the cache in place
    cache_seqlens  int32 (B,) or an int            each sequence's length before the append
    block_table    int32 (B, max_pages)            page ids of each sequence, in order

Sequence ``b`` first gets ``k[b]``/``v[b]`` written at positions ``cache_seqlens[b] ..
cache_seqlens[b] + Sk_new - 1`` (paged: position ``p`` lives in page ``block_table[b, p //
page_size]``, row ``p % page_size``), then its queries attend to its first ``L_b =
cache_seqlens[b] + Sk_new`` keys with the score of docs/semantics.md, where ``Sk`` is ``L_b``:
bottom-right causal aligns query ``i`` to key ``i + L_b - Sq``, ALiBi uses ``|i + L_b - Sq - j|``.
Cache slots at or beyond ``L_b`` are never read (NaN there never reaches the output); a query
row that sees no key outputs 0 with ``lse = -inf``. The capacity of a sequence is ``S_cache``
(contiguous) or ``max_pages · page_size`` (paged): new keys that would land beyond it are not
written and ``L_b`` is clamped to it (a caller error, handled without reading out of bounds);
negative lengths count as 0, page ids are clamped into ``[0, num_pages)``.

No host synchronisation: nothing here reads ``cache_seqlens`` or ``block_table`` on the host
(their contents are checked only for CPU tensors, where it is free), so a call is capturable in a
CUDA graph with backends whose kernels do not synchronise either (triton; see docs/decoding.md).

Backends. Selection follows :mod:`portattn.dispatch` (``backend=``, ``use_backend``,
``PORTATTN_BACKEND``, then the device's priority list). A backend runs a KV-cache problem natively
by defining two methods:

* ``kvcache_reasons(kv: KVCacheSpec) -> list[str]``: why it cannot run ``kv`` (empty: it can);
* ``forward_kvcache(kv: KVCacheSpec) -> (out, lse)``: append ``kv.k_new``/``kv.v_new`` into the
  caches in place, then return ``out (B, Sq, Hq, Dv)`` in q's dtype and float32
  ``lse (B, Hq, Sq)``.

Every other backend runs through the generic path here: the new keys are appended with torch
indexing, the visible keys are gathered from the cache (pages included) into a dense
``(B, capacity, Hkv, D)`` problem, right-aligned so that each sequence's last key is the last
column (then bottom-right causal, windows and ALiBi of the dense problem are exactly the
per-sequence ones), unused slots are set to 0 and hidden by a bool key mask, and the backend's
ordinary :meth:`~portattn.registry.Backend.forward` computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import config, dispatch, registry
from .errors import BackendNotAvailableError, describe
from .registry import get_backend
from .spec import ALIGNMENTS, SUPPORTED_DTYPES, QueryViews, _norm_window, build_spec

Tensor = torch.Tensor

__all__ = ["KVCacheSpec", "build_kvcache_spec", "attention_with_kvcache", "explain_kvcache",
           "flash_attn_with_kvcache", "visible_problem", "append_kv"]


# ----- the problem ---------------------------------------------------------------------------

@dataclass(eq=False, slots=True)
class KVCacheSpec(QueryViews):
    """A validated KV-cache attention problem (build it with :func:`build_kvcache_spec`).
    Read-only by contract (``dataclasses.replace`` makes a variant); not frozen because a frozen
    dataclass of this size costs ~8 us per construction, on every decoding step.

    Tensors are the caller's (never copied): ``q (B, Sq, Hq, D)``; ``k_cache``/``v_cache``
    contiguous ``(B, S_cache, Hkv, D/Dv)`` or paged ``(num_pages, page_size, Hkv, D/Dv)`` with
    ``block_table`` int32 ``(B, max_pages)``; ``cache_seqlens`` int32 ``(B,)`` on q's device;
    ``k_new``/``v_new`` ``(B, Sk_new, Hkv, D/Dv)`` or None. Masking is one window
    ``(window_left, window_right)`` (None = unbounded; causal is ``window_right = 0``) on the
    aligned row ``i + L_b - Sq`` (``bottom_right``) or ``i`` (``top_left``). ``alibi_slopes`` is
    float32 ``(B, Hq)``. ``num_splits`` is a hint for split-KV kernels (0: their heuristic).
    """

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    cache_seqlens: Tensor
    k_new: Tensor | None = None
    v_new: Tensor | None = None
    block_table: Tensor | None = None
    scale: float = 1.0
    causal: bool = False
    alignment: str = "bottom_right"
    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    return_lse: bool = False
    num_splits: int = 0
    deterministic: bool = False
    allow_tf32: bool = False
    batch: int = field(init=False)
    seqlen_q: int = field(init=False)
    num_heads_q: int = field(init=False)
    num_heads_kv: int = field(init=False)
    head_dim: int = field(init=False)
    head_dim_v: int = field(init=False)
    seqlen_new: int = field(init=False)
    page_size: int = field(init=False)
    num_pages: int = field(init=False)
    capacity: int = field(init=False)

    def __post_init__(self):
        self.batch, self.seqlen_q, self.num_heads_q, self.head_dim = self.q.shape
        self.num_pages, self.page_size, self.num_heads_kv, _ = self.k_cache.shape
        self.head_dim_v = self.v_cache.shape[3]
        self.seqlen_new = 0 if self.k_new is None else self.k_new.shape[1]
        self.capacity = (self.block_table.shape[1] if self.block_table is not None else 1) * self.page_size

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def is_empty(self) -> bool:
        """Nothing to attend: no query rows, no head dim of v, or a cache that holds no key."""
        return self.q.numel() == 0 or self.head_dim_v == 0 or self.capacity == 0

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.batch, self.seqlen_q, self.num_heads_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.batch, self.num_heads_q, self.seqlen_q)

    def features(self) -> frozenset[str]:
        """Optional features used, with :data:`portattn.registry.ALL_FEATURES` names plus
        ``paged`` (block_table) and ``append`` (new k/v)."""
        f = set()
        if self.causal:
            f.add("causal")
        if self.alignment == "top_left" and (self.causal or self.has_window):
            f.add("top_left")
        if self.has_window:
            f.add("window")
        if self.softcap is not None:
            f.add("softcap")
        if self.alibi_slopes is not None:
            f.add("alibi")
        if self.num_heads_q != self.num_heads_kv:
            f.add("gqa")
        if self.head_dim != self.head_dim_v:
            f.add("head_dim_v")
        if self.paged:
            f.add("paged")
        if self.k_new is not None:
            f.add("append")
        return frozenset(f)

    def summary(self) -> str:
        cache = (f"paged {self.num_pages}x{self.page_size} (capacity {self.capacity})" if self.paged
                 else f"cache {self.capacity}")
        parts = [f"B={self.batch}", f"Sq={self.seqlen_q}", cache, f"Sk_new={self.seqlen_new}",
                 f"Hq={self.num_heads_q}", f"Hkv={self.num_heads_kv}",
                 f"D={self.head_dim}" + (f"/Dv={self.head_dim_v}" if self.head_dim_v != self.head_dim else ""),
                 str(self.dtype).replace("torch.", ""), str(self.device)]
        feats = sorted(self.features())
        return "kvcache " + " ".join(parts) + (f" [{', '.join(feats)}]" if feats else "")


# ----- validation ----------------------------------------------------------------------------

def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _same_device(name, t, q):
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with .to(q.device) "
                         f"({name}={describe(t)})")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def build_kvcache_spec(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                       causal=False, causal_alignment="bottom_right", window=None, scale=None, softcap=None,
                       alibi_slopes=None, return_lse=False, num_splits=0) -> KVCacheSpec:
    """Validate the arguments of :func:`attention_with_kvcache` (shapes, dtypes, devices; the
    contents of ``cache_seqlens``/``block_table`` only for CPU tensors) and build the spec.
    Raises ``TypeError``/``ValueError`` naming the argument. Never synchronises with a GPU."""
    # Each check is a cheap condition first (this runs on every decoding step); the messages
    # (describe() strings) are built only when one fails.
    if not (isinstance(q, Tensor) and isinstance(k_cache, Tensor) and isinstance(v_cache, Tensor)):
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            _tensor(name, t)
    dtype, device = q.dtype, q.device
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported dtypes are "
                        f"{', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)}")
    if k_cache.dtype != dtype or v_cache.dtype != dtype or k_cache.device != device or v_cache.device != device:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype; got q={describe(q)}, {name}={describe(t)}; "
                                f"cast with .to(q.dtype)")
            _same_device(name, t, q)
    qs, ks, vs = q.shape, k_cache.shape, v_cache.shape
    if len(qs) != 4:
        raise ValueError(f"q must be 4-D (B, Sq, Hq, D); got q={describe(q)}"
                         + ("; add the query axis with q.unsqueeze(1)" if q.dim() == 3 else ""))
    paged = block_table is not None
    if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3]:
        cache_order = "(num_pages, page_size, Hkv, D)" if paged else "(B, S_cache, Hkv, D)"
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D {cache_order}; got {describe(t)}")
        raise ValueError(f"k_cache and v_cache must agree on {cache_order[:-4]}); got "
                         f"k_cache={describe(k_cache)}, v_cache={describe(v_cache)}")
    batch, sq, hq, d = qs
    hkv = ks[2]
    if ks[3] != d:
        raise ValueError(f"q and k_cache must have the same head_dim; got q={describe(q)}, k_cache={describe(k_cache)}")
    if d == 0:
        raise ValueError(f"head_dim must be >= 1; got q={describe(q)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of key/value "
                         f"heads ({hkv}); got q={describe(q)}, k_cache={describe(k_cache)}")

    if paged:
        _tensor("block_table", block_table)
        _same_device("block_table", block_table, q)
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be int32 (B, max_pages)=({batch}, ...) of page ids; got "
                             f"{describe(block_table)}" + ("; cast with .to(torch.int32)"
                                                           if block_table.dtype != torch.int32 else ""))
        if ks[1] == 0:
            raise ValueError(f"a paged cache needs page_size >= 1; got k_cache={describe(k_cache)}")
    elif ks[0] != batch:
        raise ValueError(f"a contiguous k_cache must have q's batch size {batch} on axis 0; got "
                         f"k_cache={describe(k_cache)}, q={describe(q)} (for a cache shared across a batch "
                         f"use block_table, or flash_attn_with_kvcache's cache_batch_idx)")
    capacity = (block_table.shape[1] if paged else 1) * ks[1]

    if (k is None) != (v is None):
        raise ValueError("give both k and v (the new keys and values to append), or neither; got "
                         f"k={describe(k) if k is not None else None}, v={describe(v) if v is not None else None}")
    new = 0
    if k is not None:
        kns = k.shape if isinstance(k, Tensor) else None
        vns = v.shape if isinstance(v, Tensor) else None
        if not (kns is not None and vns is not None and k.dtype == dtype and v.dtype == dtype
                and k.device == device and v.device == device and len(kns) == 4 and len(vns) == 4
                and kns[0] == batch and vns[0] == batch and kns[2] == hkv and vns[2] == hkv
                and kns[3] == d and vns[3] == vs[3]):
            for name, t, last in (("k", k, d), ("v", v, vs[3])):
                _tensor(name, t)
                if t.dtype != q.dtype:
                    raise TypeError(f"{name} must have q's dtype; got q={describe(q)}, {name}={describe(t)}")
                _same_device(name, t, q)
                if t.dim() != 4 or t.shape[0] != batch or t.shape[2] != hkv or t.shape[3] != last:
                    raise ValueError(f"{name} must be (B, Sk_new, Hkv, {'D' if name == 'k' else 'Dv'})="
                                     f"({batch}, Sk_new, {hkv}, {last}); got {describe(t)}")
        if kns[1] != vns[1]:
            raise ValueError(f"k and v must have the same number of new positions; got k={describe(k)}, v={describe(v)}")
        new = kns[1]
        if cache_seqlens is None:
            raise ValueError("k/v are appended at cache_seqlens: give cache_seqlens (an int or int32 (B,) tensor "
                             "of the current lengths)")

    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int or an int32 (B,) tensor, got {type(cache_seqlens).__name__}")
    elif isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity - new:
            raise ValueError(f"cache_seqlens={cache_seqlens} is out of range: with Sk_new={new} new keys it must be "
                             f"in [0, {capacity - new}] (cache capacity {capacity})")
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        _same_device("cache_seqlens", cache_seqlens, q)
        if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
            raise ValueError(f"cache_seqlens must be an int32 tensor of shape (B,)=({batch},); got "
                             f"{describe(cache_seqlens)}" + ("; cast with .to(torch.int32)"
                                                             if cache_seqlens.dtype != torch.int32 else ""))
        seqlens = cache_seqlens
        if seqlens.is_cpu and seqlens.numel():   # free to check on the host
            lo, hi = int(seqlens.min()), int(seqlens.max())
            if lo < 0 or hi + new > capacity:
                raise ValueError(f"cache_seqlens must lie in [0, {capacity - new}] (capacity {capacity}, "
                                 f"Sk_new={new}); got values in [{lo}, {hi}]")
    if paged and block_table.is_cpu and block_table.numel() and batch:
        used = (seqlens.long() + new).clamp(0, capacity)
        pages = torch.arange(block_table.shape[1]).unsqueeze(0) * k_cache.shape[1] < used.unsqueeze(1)
        ids = block_table[pages]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]):
            raise ValueError(f"block_table holds page ids outside [0, {k_cache.shape[0]}) in pages that the "
                             f"sequences use (got [{int(ids.min())}, {int(ids.max())}])")

    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite float > 0 (default 1/sqrt(head_dim)); got {scale!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
                or softcap < 0:
            raise ValueError(f"softcap must be a finite float > 0, or None/0 to disable it; got {softcap!r}")
        softcap = float(softcap) or None
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment={causal_alignment!r} is not supported; use one of {ALIGNMENTS}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    left = right = None
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a (left, right) pair of ints (-1/None = unbounded), got {window!r}")
        left = _norm_window("window[0] (left)", window[0])
        right = _norm_window("window[1] (right)", window[1])
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True already means window right = 0; got window={window!r}")
        right = 0
    alibi = None
    if alibi_slopes is not None:
        _tensor("alibi_slopes", alibi_slopes)
        _same_device("alibi_slopes", alibi_slopes, q)
        if not alibi_slopes.is_floating_point() or alibi_slopes.shape not in ((hq,), (batch, hq)):
            raise ValueError(f"alibi_slopes must be a float tensor of shape (Hq,)=({hq},) or (B, Hq)=({batch}, {hq}); "
                             f"got {describe(alibi_slopes)}")
        alibi = alibi_slopes.detach().to(torch.float32).expand(batch, hq).contiguous()
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the kernel's heuristic), got {num_splits!r}")

    return KVCacheSpec(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, k_new=k, v_new=v,
        block_table=block_table, scale=float(scale), causal=causal, alignment=causal_alignment,
        window_left=left, window_right=right, softcap=softcap, alibi_slopes=alibi,
        return_lse=bool(return_lse), num_splits=num_splits,
        deterministic=config.deterministic() or torch.are_deterministic_algorithms_enabled(),
        allow_tf32=config.allow_tf32(),
    )


# ----- the generic path: append with torch indexing, gather the visible keys -------------------

def _positions(kv: KVCacheSpec, pos: Tensor, batch_rows: Tensor) -> tuple[Tensor, Tensor]:
    """(index on axis 0, index on axis 1) of cache positions ``pos`` (long, clamped to
    [0, capacity)) of the sequences ``batch_rows``: (b, pos) or (page id, row in page)."""
    if not kv.paged:
        return batch_rows, pos
    page = kv.block_table.long()[batch_rows, pos // kv.page_size].clamp(0, kv.num_pages - 1)
    return page, pos % kv.page_size


def lengths(kv: KVCacheSpec) -> Tensor:
    """Each sequence's number of visible keys after the append, long (B,), on the device:
    ``min(clamp(cache_seqlens, 0, capacity) + Sk_new, capacity)``."""
    s = kv.cache_seqlens.long().clamp(0, kv.capacity)
    return (s + kv.seqlen_new).clamp(max=kv.capacity)


def append_kv(kv: KVCacheSpec) -> None:
    """Write ``kv.k_new``/``kv.v_new`` into the caches in place at ``cache_seqlens`` (torch
    indexing; no host synchronisation). Positions beyond the capacity are not written: their
    index is clamped to the last slot the sequence may write, which then receives the same value
    from every duplicate (the last new key that fits, or the slot's own old value)."""
    if kv.k_new is None or kv.seqlen_new == 0 or kv.batch == 0 or kv.capacity == 0:
        return
    dev = kv.device
    s = kv.cache_seqlens.long().clamp(0, kv.capacity)                       # (B,)
    room = kv.capacity - 1 - s                                              # last index of k_new that fits
    t = torch.arange(kv.seqlen_new, device=dev)
    src = torch.minimum(t.unsqueeze(0), room.clamp(min=0).unsqueeze(1))     # (B, T) which new key
    pos = (s.unsqueeze(1) + src).clamp(max=kv.capacity - 1)                 # (B, T) where it goes
    rows = torch.arange(kv.batch, device=dev).unsqueeze(1).expand_as(pos)
    i0, i1 = _positions(kv, pos, rows)
    fits = (room >= 0).view(kv.batch, 1, 1, 1)
    for cache, new in ((kv.k_cache, kv.k_new), (kv.v_cache, kv.v_new)):
        value = new[rows, src]                                              # (B, T, Hkv, D)
        cache[i0, i1] = torch.where(fits, value, cache[i0, i1])


def visible_problem(kv: KVCacheSpec, *, probe: bool = False):
    """The dense attention problem that :func:`attention_with_kvcache` computes (after the
    append), as an :class:`~portattn.spec.AttentionSpec` for a backend's ordinary forward.

    Keys are gathered right-aligned into ``(B, capacity, Hkv, D)``: key ``j`` of sequence ``b``
    sits in column ``j + capacity - L_b``; the columns before are zero-filled and hidden by a
    bool ``attn_bias`` key mask ``(B, 1, 1, capacity)``. With ``top_left`` alignment the window is
    put into the mask ``(B, 1, Sq, capacity)`` instead. ``probe=True`` builds a spec of the same
    shapes from stride-0 views (no gather, no device work) for support checks.
    """
    dev, cap, b, sq = kv.device, kv.capacity, kv.batch, kv.seqlen_q
    shapes = ((b, cap, kv.num_heads_kv, kv.head_dim), (b, cap, kv.num_heads_kv, kv.head_dim_v))
    top_left = kv.alignment == "top_left" and (kv.causal or kv.has_window)
    mask_shape = (b, 1, sq if top_left else 1, cap)
    if probe:
        k_vis, v_vis = (kv.q.new_empty(()).expand(s) for s in shapes)
        mask = torch.ones((), dtype=torch.bool, device=dev).expand(mask_shape)
    else:
        n = lengths(kv)                                                     # (B,)
        col = torch.arange(cap, device=dev)
        src = col.unsqueeze(0) - (cap - n).unsqueeze(1)                     # (B, cap) key index, < 0: unused
        used = src >= 0
        rows = torch.arange(b, device=dev).unsqueeze(1).expand_as(src)
        i0, i1 = _positions(kv, src.clamp(min=0), rows)
        keep = used.view(b, cap, 1, 1)
        k_vis = torch.where(keep, kv.k_cache[i0, i1], 0)
        v_vis = torch.where(keep, kv.v_cache[i0, i1], 0)
        if top_left:
            i = torch.arange(sq, device=dev).view(1, sq, 1)
            j = src.unsqueeze(1)                                            # (B, 1, cap)
            vis = used.unsqueeze(1).expand(b, sq, cap)
            if kv.window_left is not None:
                vis = vis & (j >= i - kv.window_left)
            if kv.window_right is not None:
                vis = vis & (j <= i + kv.window_right)
            mask = vis.unsqueeze(1)
        else:
            mask = used.view(b, 1, 1, cap)
    window = None if top_left else (kv.window_left, kv.window_right)
    with torch.no_grad():   # not differentiable: no backend is declined for lacking a backward
        return build_spec(kv.q, k_vis, v_vis, causal=kv.causal and not top_left, window=window, scale=kv.scale,
                      softcap=kv.softcap, alibi_slopes=kv.alibi_slopes, attn_bias=mask, return_lse=True)


# ----- selection -----------------------------------------------------------------------------

def _reasons(backend, kv: KVCacheSpec) -> list[str]:
    native = getattr(backend, "kvcache_reasons", None)
    if native is not None and hasattr(backend, "forward_kvcache"):
        try:
            return list(native(kv))
        except Exception as exc:   # a broken backend is a reason, not a crash of selection
            return [f"kvcache_reasons failed: {type(exc).__name__}: {exc}"]
    reasons = backend.not_supported_reasons(visible_problem(kv, probe=True))
    return [f"generic KV-cache path (gathered keys + key mask): {r}" for r in reasons]


def explain_kvcache(q, k_cache, v_cache, k=None, v=None, *, backend=None, **kwargs) -> dispatch.Explanation:
    """Which backend :func:`attention_with_kvcache` would use, and why each other would not."""
    return _explain(build_kvcache_spec(q, k_cache, v_cache, k, v, **kwargs), backend)


def _explain(kv: KVCacheSpec, backend) -> dispatch.Explanation:
    names, source = dispatch._requested(backend)
    candidates = list(names) if names else dispatch.priority_for(kv.vendor)
    from .registry import list_backends
    exp = dispatch.Explanation(kv.summary(), candidates, pinned_by=source,
                               not_candidates=[] if names else [n for n in list_backends() if n not in candidates])
    for name in candidates:
        exp.reasons[name] = _reasons(get_backend(name), kv)
        if not exp.reasons[name] and exp.selected is None:
            exp.selected = name
    return exp


#: (pinned names, registry generation, priority override, problem signature) -> backend:
#: selection without the reasons' cost on every decoding step. Keys hold only host values; any
#: change of the registry (a registration, a replacement, a backend loaded) changes the
#: generation, and PORTATTN_PRIORITY_<VENDOR> is part of the key when nothing is pinned.
_SELECTED: dict = {}
_SELECTED_MAX = 256


def _signature(kv: KVCacheSpec) -> tuple:
    """Everything a backend's reasons may depend on, as host values (no tensor contents)."""
    q = kv.q
    sig = [q.dtype, q.device, kv.alignment, kv.causal, kv.window_left, kv.window_right, kv.softcap is None,
           kv.deterministic, kv.allow_tf32]
    for t in (q, kv.k_cache, kv.v_cache, kv.k_new, kv.v_new, kv.block_table, kv.alibi_slopes):
        sig.append(None if t is None else (t.shape, t.stride(), t.dtype))
    return tuple(sig)


def _selection_key(kv: KVCacheSpec, names: tuple) -> tuple:
    return (names, registry.generation(), None if names else config.priority_raw(kv.vendor), _signature(kv))


def select_kvcache(kv: KVCacheSpec, backend=None):
    """The backend that will run ``kv``; :class:`~portattn.errors.BackendNotAvailableError` with
    every candidate's reasons otherwise (a pinned backend never falls back silently)."""
    names, source = dispatch._requested(backend)
    chosen = _SELECTED.get(_selection_key(kv, names))
    if chosen is not None:
        return chosen
    candidates = tuple(names) if names else tuple(dispatch.priority_for(kv.vendor))
    for name in candidates:
        chosen = get_backend(name)
        if not _reasons(chosen, kv):
            if len(_SELECTED) >= _SELECTED_MAX:
                _SELECTED.clear()
            _SELECTED[_selection_key(kv, names)] = chosen   # the generation after any load above
            return chosen
    exp = _explain(kv, backend)
    detail = "\n".join(f"  - {n}: {'; '.join(exp.reasons[n]) or 'supported'}" for n in exp.candidates)
    if exp.pinned_by and len(exp.candidates) == 1:
        msg = (f"backend {exp.candidates[0]!r} (pinned by {exp.pinned_by}) cannot run this problem "
               f"({exp.spec_summary}):\n{detail}\nunpin it to let portattn choose, or change the inputs")
    elif exp.pinned_by:
        msg = f"none of the backends pinned by {exp.pinned_by} can run this problem ({exp.spec_summary}):\n{detail}"
    else:
        msg = f"no backend can run this problem ({exp.spec_summary}):\n{detail}"
    raise BackendNotAvailableError(msg, exp.reasons)


def run_kvcache(kv: KVCacheSpec, backend=None) -> tuple[Tensor, Tensor]:
    """Select a backend and compute ``kv``: ``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq))``."""
    if kv.is_empty:
        append_kv(kv)
        out = torch.zeros(kv.out_shape, dtype=kv.dtype, device=kv.device)
        return out, torch.full(kv.lse_shape, float("-inf"), dtype=torch.float32, device=kv.device)
    chosen = select_kvcache(kv, backend)
    native = getattr(chosen, "forward_kvcache", None)
    if native is not None and hasattr(chosen, "kvcache_reasons"):
        if not torch.is_grad_enabled():   # inference: skip the ~2 us of entering no_grad
            return native(kv)
        with torch.no_grad():
            return native(kv)
    with torch.no_grad():
        append_kv(kv)
        out, lse = chosen.forward(visible_problem(kv))
    return out, lse


# ----- public functions ----------------------------------------------------------------------

def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                           causal=False, causal_alignment="bottom_right", window=None, scale=None, softcap=None,
                           alibi_slopes=None, return_lse=False, backend=None):
    """Attention of new queries against a KV cache, appending new keys/values first (in place).

    Shapes (flash-attn's ``flash_attn_with_kvcache``)::

        q (B, Sq, Hq, D)
        k_cache, v_cache (B, S_cache, Hkv, D/Dv), or paged (num_pages, page_size, Hkv, D/Dv)
        k, v (B, Sk_new, Hkv, D/Dv) or None           ->  out (B, Sq, Hq, Dv)  [, lse (B, Hq, Sq)]
        cache_seqlens int or int32 (B,)  (None: every sequence fills the cache; required with k/v)
        block_table int32 (B, max_pages): sequence b's position p is page block_table[b, p // page_size]

    Sequence ``b`` attends to its first ``L_b = cache_seqlens[b] + Sk_new`` keys (after ``k[b]``
    is written at ``cache_seqlens[b]``), with ``causal``/``window``/``softcap``/``alibi_slopes``
    as in :func:`portattn.attention` for ``Sk = L_b`` (``causal_alignment="bottom_right"``: query
    ``i`` sits at position ``i + L_b - Sq``). Cache slots at or beyond ``L_b`` are never read. A
    query row with no visible key gives 0 and ``lse = -inf``. Not differentiable. No host
    synchronisation (CUDA-graph capturable with the triton backend). See docs/decoding.md.

    ``backend`` pins a backend (else ``use_backend``, ``PORTATTN_BACKEND``, the priority list);
    a pinned backend that cannot run raises :class:`portattn.BackendNotAvailableError`.
    """
    if torch.compiler.is_exporting():   # torch.export / portattn.onnx.export: one functional op (onnx_ops/kvcache_op.py)
        from portattn.onnx_ops.kvcache_op import export_attention_with_kvcache
        return export_attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
            causal_alignment=causal_alignment, window=window, scale=scale, softcap=softcap,
            alibi_slopes=alibi_slopes, return_lse=return_lse, backend=backend)
    kv = build_kvcache_spec(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                            causal=causal, causal_alignment=causal_alignment, window=window, scale=scale,
                            softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse)
    out, lse = run_kvcache(kv, backend)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's ``flash_attn_with_kvcache`` (same signature and results) on portattn.

    ``cache_batch_idx`` (B,) int32 selects cache rows: it is run as a paged cache whose pages
    are the cache's rows (``block_table = cache_batch_idx[:, None]``). ``window_size=(-1, -1)``
    is unbounded; ``softcap=0`` is off; ``num_splits`` (0: heuristic) is a hint to split-KV
    kernels. Rotary embeddings and ``cache_leftpad`` are not supported (a ``ValueError``:
    apply the rotary embedding to q and k before the call). Returns ``out`` or
    ``(out, softmax_lse)``.
    """
    if rotary_cos is not None or rotary_sin is not None:
        raise ValueError("flash_attn_with_kvcache: rotary_cos/rotary_sin are not supported by portattn; "
                         "apply the rotary embedding to q and k before the call")
    if cache_leftpad is not None:
        raise ValueError("flash_attn_with_kvcache: cache_leftpad is not supported by portattn")
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("flash_attn_with_kvcache: cache_batch_idx and block_table cannot be combined")
        _tensor("cache_batch_idx", cache_batch_idx)
        if cache_batch_idx.dim() != 1 or cache_batch_idx.shape[0] != q.shape[0]:
            raise ValueError(f"cache_batch_idx must be (B,)=({q.shape[0]},); got {describe(cache_batch_idx)}")
        block_table = cache_batch_idx.to(torch.int32).view(-1, 1)
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype != torch.int32:
        raise ValueError(f"cache_seqlens must be int32 (flash-attn's dtype); got {describe(cache_seqlens)}")
    window = None
    if window_size is not None and tuple(window_size) != (-1, -1):
        window = tuple(window_size)
        if causal:   # flash-attn: causal sets the right side to 0
            window = (window[0], 0)
    kv = build_kvcache_spec(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                            causal=causal, window=window, scale=softmax_scale, softcap=softcap or None,
                            alibi_slopes=alibi_slopes, return_lse=return_softmax_lse, num_splits=num_splits)
    out, lse = run_kvcache(kv, None)
    return (out, lse) if return_softmax_lse else out
