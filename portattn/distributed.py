"""Context parallelism: ring attention over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

One sequence of ``S`` tokens is split across the ``W`` ranks of a process group; rank ``r``
holds a shard of q, k and v of ``S / W`` tokens. :func:`ring_attention` computes exact
attention over the whole sequence: the K/V shards travel around the ring
``r -> r + 1 (mod W)`` with point-to-point ops (``torch.distributed.batch_isend_irecv``) while
each rank attends its queries to the K/V shard it holds (any registered backend that returns
lse computes that block, chosen by the normal dispatch), and the per-step partial results are
merged through their lse (the online softmax) in float32 (float64 for float32 inputs). The backward sends K/V around the
same ring again, with the dK/dV accumulators travelling alongside: each rank adds its share of
a shard's gradient as the shard passes, and the sum arrives at the owner after the last step.

Shardings (``W = 4`` shown, ``S`` split into chunks)::

    contiguous   rank:    0    1    2    3                  (S / W per rank)
                 chunk:  [0]  [1]  [2]  [3]

    zigzag       rank:    0       1       2       3         (2W chunks of S / 2W; rank r holds
                 chunks: [0,7]   [1,6]   [2,5]   [3,4]      chunks r and 2W-1-r, in that order)

Causal work per step under zigzag (``C`` = chunk length; rank ``r`` holds K/V from ``src``)::

    src == r   q [r, 2W-1-r] x k [r, 2W-1-r]: the local positions are increasing, so this is
               plain causal attention over the 2C local tokens (one call).
    src <  r   k chunk src is before both q chunks (fully visible); k chunk 2W-1-src is after
               both (2W-1-src > 2W-1-r > r): all 2C queries x the first C keys, unmasked.
    src >  r   q chunk r is before both k chunks (src > r, 2W-1-src >= W > r): nothing; q chunk
               2W-1-r is after both (src <= W-1 < 2W-1-r, 2W-1-src < 2W-1-r): the last C
               queries x all 2C keys, unmasked.

so every step costs 2C² scores on every rank (the diagonal step too: (2C)²/2), where contiguous
sharding leaves rank ``r`` idle for the ``W-1-r`` steps whose keys lie in its future.

Sliding windows (and any causal/window mask) are planned per pair of (query segment, key
segment) of global positions, see :func:`_pair_call`: a block is skipped, computed unmasked,
or given the local window that reproduces the global one (trimming key columns or query rows
that the band cannot reach). With a finite left window the ring stops after the last step in
which any rank still sees keys.

Gradient of one block (derivation; ``o_b, l_b`` the block's output and lse, ``O, L`` the
global ones, ``w = exp(l_b - L)``, ``O = Σ_b w_b o_b``, ``L = log Σ_b exp(l_b)``)::

    ∂w_c/∂l_b = w_c (δ_cb - w_b)      =>   ∂O/∂l_b = w_b (o_b - O),   ∂L/∂l_b = w_b
    dLoss/do_b = w dO
    dLoss/dl_b = w (rowsum(dO∘o_b) - rowsum(dO∘O) + dL)

The backend's backward with ``dout_b = w dO`` and ``dlse_b`` as above gives
``dS = P_b∘(dP_b - rowsum(dout_b∘o_b) + dlse_b) = w P_b∘(dO Vᵀ - rowsum(dO∘O) + dL)``, and
``w P_b = exp(S - L)`` is the global softmax: exactly the block's share of the global gradient
(``dV_b = P_bᵀ dout_b`` likewise). ``o_b, l_b`` are recomputed in the backward (one extra
block forward per block; the alternative, saving every block's output, costs the memory of
the whole sequence's output on every rank). The contract is docs/semantics.md; the costs and
launching are in docs/distributed.md. :func:`simulate_ring` runs the same ring in one process
(threads as ranks), for tests and for single-GPU runs of a W-GPU ring's local blocks.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import dispatch
from .registry import get_backend
from .spec import build_spec

__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "simulate_ring", "SHARDINGS"]

SHARDINGS = ("contiguous", "zigzag")

# What the ring does, for tools/ring_bench.py: with "comm" off each rank keeps its own K/V
# (wrong results, same compute), with "compute" off only the K/V (and dK/dV) travel.
_ABLATION = {"compute": True, "comm": True}


@contextlib.contextmanager
def _ablation(*, compute: bool = True, comm: bool = True):
    """Time the ring's compute or its communication alone (benchmarks only: results are wrong)."""
    saved = dict(_ABLATION)
    _ABLATION.update(compute=compute, comm=comm)
    try:
        yield
    finally:
        _ABLATION.update(saved)


# The backends the latest ring forward of this process used (tools/ring_bench.py reports them).
_LAST: dict = {}

# P2P tags (gloo matches messages by sender and tag; NCCL ignores tags and matches by order).
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV, _TAG_FINAL_DK, _TAG_FINAL_DV = range(6)


# ----- the process group ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Ring:
    group: object
    rank: int            # rank inside the group
    world: int
    peers: tuple         # global rank of each group rank (P2P ops take global ranks)
    transport: object = None   # None: torch.distributed; else a _ThreadTransport (simulate_ring)

    def peer(self, offset: int) -> int:
        return self.peers[(self.rank + offset) % self.world]


def _ring(group) -> _Ring:
    if not dist.is_available():
        raise RuntimeError("portattn.distributed needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group("
                           "'nccl' or 'gloo') first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT for it)")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    g = group if group is not None else dist.group.WORLD
    peers = tuple(dist.get_global_rank(g, i) for i in range(world))
    return _Ring(group, rank, world, peers)


def _check_sharding(sharding) -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is not supported; use one of {SHARDINGS}")


def _all_equal_across_ranks(ring: _Ring, values: list[int], device, what: str) -> list[list[int]]:
    """all_gather a short list of ints; raise ValueError naming ``what`` if the ranks differ."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    if ring.world == 1:
        return [values]
    got = [torch.empty_like(mine) for _ in range(ring.world)]
    dist.all_gather(got, mine, group=ring.group)
    rows = [g.tolist() for g in got]
    if any(row != rows[0] for row in rows):
        detail = "; ".join(f"rank {i}: {row}" for i, row in enumerate(rows))
        raise ValueError(f"the ranks disagree on {what}: {detail}")
    return rows


# ----- sharding --------------------------------------------------------------------------------

def _shard_ranges(sharding: str, world: int, rank: int, length: int) -> list[tuple[int, int]]:
    """(start, length) of the global sequence pieces rank ``rank`` holds, in local order;
    ``length`` is the global sequence length (divisible by W, or by 2W for zigzag)."""
    if sharding == "contiguous":
        n = length // world
        return [(rank * n, n)]
    c = length // (2 * world)
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]


def _norm_dim(x: torch.Tensor, seq_dim: int) -> int:
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"seq_dim must be an int, got {seq_dim!r}")
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} is out of range for a {x.dim()}-D tensor of shape {tuple(x.shape)}")
    return seq_dim % x.dim()


def _check_divisible(length: int, world: int, sharding: str, what: str) -> None:
    parts = world * (2 if sharding == "zigzag" else 1)
    if length % parts:
        raise ValueError(
            f"{what} has sequence length {length}, which {sharding} sharding over {world} rank(s) cannot split: "
            f"it must be divisible by {parts}" + (" (2 x world: each rank holds 2 chunks)" if sharding == "zigzag" else "")
            + f"; pad the sequence to a multiple of {parts}")


def shard_sequence(x: torch.Tensor, group=None, sharding: str = "contiguous", seq_dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full sequence ``x`` (the same tensor on every rank).

    ``contiguous``: rank ``r`` takes positions ``[r·S/W, (r+1)·S/W)``; ``zigzag``: the sequence
    is cut into ``2W`` chunks and rank ``r`` takes chunks ``r`` and ``2W-1-r`` (concatenated in
    that order), which balances causal work (see the module docstring). ``S`` must be divisible
    by ``W`` (contiguous) or ``2W`` (zigzag). Differentiable (slices and a concatenation);
    :func:`gather_sequence` is its inverse. No communication.
    """
    _check_sharding(sharding)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    ring = _ring(group)
    dim = _norm_dim(x, seq_dim)
    _check_divisible(x.shape[dim], ring.world, sharding, "x")
    pieces = [x.narrow(dim, s, n) for s, n in _shard_ranges(sharding, ring.world, ring.rank, x.shape[dim])]
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def gather_sequence(x: torch.Tensor, group=None, sharding: str = "contiguous", seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard ``x`` (the inverse of :func:`shard_sequence`).

    Every rank must pass a shard of the same shape, dtype and ``sharding``; the result (``W``
    times longer along ``seq_dim``) is the same on every rank. Uses ``all_gather``; when ``x``
    requires grad it goes through ``torch.distributed.nn.functional.all_gather``, whose backward
    *sums* the gradients of all ranks into each shard (reduce-scatter).
    """
    _check_sharding(sharding)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    ring = _ring(group)
    dim = _norm_dim(x, seq_dim)
    if sharding == "zigzag" and x.shape[dim] % 2:
        raise ValueError(f"a zigzag shard holds two chunks of equal length, so its length along seq_dim={seq_dim} "
                         f"must be even; got shape {tuple(x.shape)}")
    _all_equal_across_ranks(ring, [x.dim(), *x.shape, _dtype_code(x.dtype), SHARDINGS.index(sharding), dim],
                            x.device, "the shard's (ndim, shape, dtype, sharding, seq_dim) in gather_sequence")
    if ring.world == 1:
        return x
    return _Gather.apply(x, ring, sharding, dim)


def _assemble(shards: list[torch.Tensor], sharding: str, dim: int) -> torch.Tensor:
    if sharding == "contiguous":
        return torch.cat(shards, dim=dim)
    c = shards[0].shape[dim] // 2
    w = len(shards)
    chunks = [shards[i].narrow(dim, 0, c) if i < w else shards[2 * w - 1 - i].narrow(dim, c, c) for i in range(2 * w)]
    return torch.cat(chunks, dim=dim)


class _Gather(torch.autograd.Function):
    """all_gather + reassembly; the backward sums every rank's gradient of the full tensor and
    keeps this rank's positions (reduce-scatter on NCCL, all_reduce elsewhere: gloo has none)."""

    @staticmethod
    def forward(ctx, x, ring, sharding, dim):
        x = x.contiguous()
        shards = [torch.empty_like(x) for _ in range(ring.world)]
        dist.all_gather(shards, x, group=ring.group)
        ctx.ring, ctx.sharding, ctx.dim = ring, sharding, dim
        return _assemble(shards, sharding, dim)

    @staticmethod
    def backward(ctx, grad):
        ring, dim = ctx.ring, ctx.dim
        if dist.get_backend(ring.group) == "nccl":
            per_rank = [torch.cat([grad.narrow(dim, s, n) for s, n in
                                   _shard_ranges(ctx.sharding, ring.world, r, grad.shape[dim])], dim=dim).contiguous()
                        for r in range(ring.world)]
            mine = torch.empty_like(per_rank[0])
            dist.reduce_scatter(mine, per_rank, group=ring.group)
            return mine, None, None, None
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ring.group)
        pieces = [total.narrow(dim, s, n) for s, n in _shard_ranges(ctx.sharding, ring.world, ring.rank, grad.shape[dim])]
        return torch.cat(pieces, dim=dim), None, None, None


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + hash(str(dtype)) % 1000


# ----- block planning --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Call:
    """One backend call of a ring step: local query rows ``[q0, q1)`` against the held K/V rows
    ``[k0, k1)``, with the visible band ``lo <= j - i <= hi`` in those local coordinates
    (``i`` from ``q0``, ``j`` from ``k0``; None = unbounded)."""

    q0: int
    q1: int
    k0: int
    k1: int
    lo: int | None
    hi: int | None

    def mask_kwargs(self) -> dict:
        """build_spec's causal / window / causal_alignment for this band."""
        sq, sk = self.q1 - self.q0, self.k1 - self.k0
        lo, hi = self.lo, self.hi
        if lo is None and hi is None:
            return {}
        # bottom_right: j - i in [(Sk-Sq) - left, (Sk-Sq) + right]; top_left: j - i in [-left, right]
        off = sk - sq
        left, right = (None if lo is None else off - lo), (None if hi is None else hi - off)
        alignment = "bottom_right"
        if (left is not None and left < 0) or (right is not None and right < 0):
            left, right, alignment = (None if lo is None else -lo), hi, "top_left"
        kw = {} if alignment == "bottom_right" else {"causal_alignment": alignment}
        if right == 0:
            kw["causal"] = True
            if left is not None:
                kw["window"] = (left, -1)
        else:
            kw["window"] = (-1 if left is None else left, -1 if right is None else right)
        return kw


def _pair_call(qpos: int, qn: int, qoff: int, kpos: int, kn: int, koff: int, left, right) -> _Call | None:
    """The call for query positions ``[qpos, qpos+qn)`` (local rows from ``qoff``) against key
    positions ``[kpos, kpos+kn)`` (local rows from ``koff``) under the global band
    ``q - left <= key <= q + right``, or None when no query sees any key of the block.

    With ``d = qpos - kpos`` the band is ``d - left <= j - i <= d + right``. A band entirely to
    the right of the block's diagonal (``lo > 0``) cannot be written as a window (``left`` would
    be negative): its first ``lo`` key columns are invisible to every row (``j < lo <= j - i + ...``
    fails for all ``i >= 0``) and are dropped, which moves the band to ``[0, hi - lo]``. A band
    entirely to the left (``hi < 0``) drops the first ``-hi`` query rows instead (they see no key
    of this block; their share stays lse = -inf): the band becomes ``[lo - hi, 0]``.
    """
    d = qpos - kpos
    lo = None if left is None else d - left
    hi = None if right is None else d + right
    if (lo is not None and lo > kn - 1) or (hi is not None and hi < -(qn - 1)):
        return None
    q0, q1, k0, k1 = qoff, qoff + qn, koff, koff + kn
    if lo is not None and lo > 0:
        k0 += lo
        hi = None if hi is None else hi - lo
        lo = 0
    elif hi is not None and hi < 0:
        q0 += -hi
        lo = None if lo is None else lo - hi
        hi = 0
    if lo is not None and lo <= -(q1 - q0 - 1):
        lo = None
    if hi is not None and hi >= k1 - k0 - 1:
        hi = None
    return _Call(q0, q1, k0, k1, lo, hi)


def _coalesce(calls: list[_Call]) -> list[_Call]:
    """Merge unmasked calls on the same rows with adjacent key ranges (or the same keys with
    adjacent rows): fewer, larger backend calls."""
    calls = list(calls)
    changed = True
    while changed:
        changed = False
        for a in range(len(calls)):
            for b in range(len(calls)):
                x, y = calls[a], calls[b]
                if a == b or x.lo is not None or x.hi is not None or y.lo is not None or y.hi is not None:
                    continue
                merged = None
                if (x.q0, x.q1) == (y.q0, y.q1) and x.k1 == y.k0:
                    merged = _Call(x.q0, x.q1, x.k0, y.k1, None, None)
                elif (x.k0, x.k1) == (y.k0, y.k1) and x.q1 == y.q0:
                    merged = _Call(x.q0, y.q1, x.k0, x.k1, None, None)
                if merged is not None:
                    calls = [c for i, c in enumerate(calls) if i not in (a, b)] + [merged]
                    changed = True
                    break
            if changed:
                break
    return sorted(calls, key=lambda c: (c.q0, c.k0))


def _plan(sharding: str, world: int, rank: int, src: int, lq: int, lk: int, left, right) -> list[_Call]:
    """The backend calls rank ``rank`` makes with the K/V shard of rank ``src``; ``lq``/``lk``
    local lengths; ``left``/``right`` the global band (None = unbounded, causal is right = 0)."""
    if left is None and right is None:
        return [_Call(0, lq, 0, lk, None, None)]
    if left is None and right == 0 and src == rank:
        # the diagonal step: local positions increase, so global causal == local causal
        return [_Call(0, lq, 0, lk, None, 0)]
    calls = []
    for qi, (qpos, qn) in enumerate(_shard_ranges(sharding, world, rank, lq * world)):
        for ki, (kpos, kn) in enumerate(_shard_ranges(sharding, world, src, lk * world)):
            # local offset of a segment: 0 for the first, the chunk length for zigzag's second
            call = _pair_call(qpos, qn, qi * (lq // 2), kpos, kn, ki * (lk // 2), left, right)
            if call is not None:
                calls.append(call)
    return _coalesce(calls)


def _plans(cfg) -> list[list[_Call]]:
    """This rank's calls per ring step, cut after the last step in which any rank has work."""
    w = cfg.ring.world

    def plan(rank, t):
        return _plan(cfg.sharding, w, rank, (rank - t) % w, cfg.lq, cfg.lk, cfg.left, cfg.right)

    steps = 1 + max(t for t in range(w) for r in range(w) if t == 0 or plan(r, t))
    return [plan(cfg.ring.rank, t) for t in range(steps)]


# ----- per-block compute -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Config:
    ring: _Ring
    sharding: str
    lq: int
    lk: int
    left: int | None
    right: int | None
    scale: float
    softcap: float | None
    backend: str | None
    needs_grad: bool


def _block_spec(cfg: _Config, call: _Call, q, k, v, *, needs_grad: bool):
    spec = build_spec(q[:, call.q0:call.q1], k[:, call.k0:call.k1], v[:, call.k0:call.k1], scale=cfg.scale,
                      softcap=cfg.softcap, return_lse=True, **call.mask_kwargs())
    if spec.needs_grad != needs_grad:
        spec = dataclasses.replace(spec, needs_grad=needs_grad)
    return spec


def _accepts_dlse(backend) -> bool:
    try:
        return "dlse" in inspect.signature(backend.backward).parameters
    except (TypeError, ValueError):
        return False


def _select(spec, backend: str | None):
    """The backend for one block: the normal dispatch (pin, use_backend, PORTATTN_BACKEND or the
    device's priority list), except that when a gradient is needed the first supporting
    candidate whose backward takes ``dlse`` wins (the ring's backward needs it)."""
    if not spec.needs_grad:
        return dispatch.select(spec, backend)
    exp = dispatch.explain_spec(spec, backend)
    if exp.selected is None:
        return dispatch.select(spec, backend)   # raises with every candidate's reasons
    ok = [n for n in exp.candidates if not exp.reasons.get(n)]
    for name in ok:
        if _accepts_dlse(get_backend(name)):
            return get_backend(name)
    raise TypeError(f"ring_attention's backward needs a backend whose backward takes dlse "
                    f"(backend.backward(spec, out, lse, dout, dlse=None)); the backends that can run this block "
                    f"({spec.summary()}) do not: {', '.join(ok)}. Pin one that does (e.g. backend='sdpa', "
                    f"'triton' or 'reference') or call without gradients")


def _exchange(ring: _Ring, sends, recvs, tags, to_offset: int = 1, from_offset: int = -1):
    """Post sends of ``sends`` to rank+to_offset and receives into ``recvs`` from
    rank+from_offset (one batch); returns the requests (wait on them before using ``recvs``)."""
    if ring.transport is not None:
        return ring.transport.exchange(ring, sends, recvs, tags, to_offset, from_offset)
    to_peer, from_peer = ring.peer(to_offset), ring.peer(from_offset)
    ops = [dist.P2POp(dist.isend, t, to_peer, ring.group, tag) for t, tag in zip(sends, tags)]
    ops += [dist.P2POp(dist.irecv, t, from_peer, ring.group, tag) for t, tag in zip(recvs, tags)]
    return dist.batch_isend_irecv(ops)


def _compute_guard(ring: _Ring):
    """simulate_ring's threads take turns at the backends (JIT compilers and caches need not be
    thread-safe; one device runs them one at a time anyway); a process group needs no guard."""
    return ring.transport.lock if ring.transport is not None else contextlib.nullcontext()


def _wait(reqs) -> None:
    for r in reqs or ():
        r.wait()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Local accumulators (out, lse, dq): float64 for float32/float64 inputs (the merge then adds
    no rounding of its own to float32 results), float32 for 16-bit ones."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dK/dV accumulators that travel the ring: float32 (float64 for float64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(out, lse, call: _Call, o_b, l_b) -> None:
    """In place: fold one block's (o_b, l_b) into the running (out, lse) rows [q0, q1)."""
    o_run = out[:, call.q0:call.q1]
    l_run = lse[:, :, call.q0:call.q1]
    l_b = l_b.to(lse.dtype)
    new = torch.logaddexp(l_run, l_b)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)   # rows empty so far: weights 0, not NaN
    a = torch.exp(l_run - base).transpose(1, 2).unsqueeze(-1)
    b = torch.exp(l_b - base).transpose(1, 2).unsqueeze(-1)
    o_run.mul_(a).add_(o_b.to(out.dtype) * b)
    l_run.copy_(new)


def _ring_forward(cfg: _Config, q, k, v, chosen: dict):
    """Canonical (B, S, H, D) shards -> (out in q's dtype, lse float32 (B, Hq, S)).
    Fills ``chosen[(step, call)]`` with the backend name used for each block."""
    ring = cfg.ring
    plans = _plans(cfg)
    acc = _acc_dtype(q.dtype)
    b, sq, hq, _ = q.shape
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=acc, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    bufs = [(torch.empty_like(k_cur), torch.empty_like(v_cur)) for _ in range(min(2, len(plans) - 1))]
    compute, comm = _ABLATION["compute"], _ABLATION["comm"]
    for t, calls in enumerate(plans):
        reqs = None
        if t + 1 < len(plans) and comm:
            k_nxt, v_nxt = bufs[t % 2]
            reqs = _exchange(ring, (k_cur, v_cur), (k_nxt, v_nxt), (_TAG_K, _TAG_V))
        for i, call in enumerate(calls if compute else ()):
            with _compute_guard(ring):
                spec = _block_spec(cfg, call, q, k_cur, v_cur, needs_grad=cfg.needs_grad)
                backend = _select(spec, cfg.backend)
                chosen[(t, i)] = backend.name
                o_b, l_b = backend.forward(spec)
                _merge(out, lse, call, o_b, l_b)
        if reqs is not None:
            _wait(reqs)
            k_cur, v_cur = k_nxt, v_nxt
    _LAST["backends"] = sorted(set(chosen.values()))
    return out.to(q.dtype), lse.to(torch.float32)


def _ring_backward(cfg: _Config, q, k, v, out, lse, dout, dlse, chosen: dict):
    """Gradients of the ring forward for this rank's shards: (dq, dk, dv) in the input dtype."""
    ring = cfg.ring
    plans = _plans(cfg)
    acc, wire = _acc_dtype(q.dtype), _wire_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    # delta_i = rowsum(dO∘O) with the global output, (B, Hq, S)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    bufs = [(torch.empty_like(k_cur), torch.empty_like(v_cur)) for _ in range(min(2, len(plans) - 1))]
    dbufs = [(torch.empty(k.shape, dtype=wire, device=k.device), torch.empty(v.shape, dtype=wire, device=v.device))
             for _ in range(min(2, len(plans) - 1))]
    dk_acc = dv_acc = None
    dreqs = None
    compute, comm = _ABLATION["compute"], _ABLATION["comm"]
    for t, calls in enumerate(plans):
        calls = calls if compute else []
        reqs = None
        if t + 1 < len(plans) and comm:
            k_nxt, v_nxt = bufs[t % 2]
            reqs = _exchange(ring, (k_cur, v_cur), (k_nxt, v_nxt), (_TAG_K, _TAG_V))
        dk_b = torch.zeros(k.shape, dtype=wire, device=k.device) if calls else None
        dv_b = torch.zeros(v.shape, dtype=wire, device=v.device) if calls else None
        for i, call in enumerate(calls):
            with _compute_guard(ring):
                _block_backward(cfg, call, chosen[(t, i)], q, k_cur, v_cur, lse, delta, dout, dlse, dq, dk_b, dv_b)
        if t == 0:
            dk_acc = dk_b if dk_b is not None else torch.zeros(k.shape, dtype=wire, device=k.device)
            dv_acc = dv_b if dv_b is not None else torch.zeros(v.shape, dtype=wire, device=v.device)
        elif comm:
            _wait(dreqs)   # the accumulators of this K/V shard, from the previous rank
            dk_acc, dv_acc = dbufs[(t - 1) % 2]
            if dk_b is not None:
                dk_acc.add_(dk_b)
                dv_acc.add_(dv_b)
        elif dk_b is not None:
            dk_acc.add_(dk_b)
            dv_acc.add_(dv_b)
        if t + 1 < len(plans) and comm:
            dreqs = _exchange(ring, (dk_acc, dv_acc), dbufs[t % 2], (_TAG_DK, _TAG_DV))
        if reqs is not None:
            _wait(reqs)
            k_cur, v_cur = k_nxt, v_nxt
    n = len(plans)
    if n > 1 and comm:
        # after n steps this rank holds the accumulators of shard rank-(n-1): hand them to it
        dk_own, dv_own = torch.empty_like(dk_acc), torch.empty_like(dv_acc)
        _wait(_exchange(ring, (dk_acc, dv_acc), (dk_own, dv_own), (_TAG_FINAL_DK, _TAG_FINAL_DV),
                        to_offset=-(n - 1), from_offset=n - 1))
        dk_acc, dv_acc = dk_own, dv_own
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def _block_backward(cfg, call, backend_name, q, k, v, lse, delta, dout, dlse, dq, dk, dv) -> None:
    """Accumulate one block's share of the global gradient into dq/dk/dv (see the module
    docstring for the derivation of dout_b and dlse_b)."""
    backend = get_backend(backend_name)
    if not _accepts_dlse(backend):
        raise TypeError(f"backend {backend_name!r} has a backward without the dlse argument "
                        f"(backend.backward(spec, out, lse, dout, dlse=None)), which ring attention needs to merge "
                        f"block gradients; pin a backend that has it (backend='sdpa' or 'reference')")
    spec = _block_spec(cfg, call, q, k, v, needs_grad=True)
    with torch.no_grad():
        o_b, l_b, res_b = backend.forward_for_backward(spec)   # recomputed: see the module docstring
    acc = dq.dtype
    rows = slice(call.q0, call.q1)
    big_l = lse[:, :, rows].to(acc)
    l_b = l_b.to(acc)
    w = torch.where(torch.isneginf(l_b) | torch.isneginf(big_l), torch.zeros_like(l_b),
                    torch.exp(l_b - torch.where(torch.isneginf(big_l), torch.zeros_like(big_l), big_l)))
    do = dout[:, rows].to(acc)
    r_b = (do * o_b.to(acc)).sum(-1).transpose(1, 2)
    g = r_b - delta[:, :, rows]
    if dlse is not None:
        g = g + dlse[:, :, rows].to(acc)
    dlse_b = (w * g).to(torch.float32).contiguous()
    dout_b = (do * w.transpose(1, 2).unsqueeze(-1)).to(q.dtype).contiguous()
    dq_b, dk_b, dv_b, _ = backend.backward(spec, o_b, l_b.to(torch.float32), dout_b, dlse=dlse_b,
                                           **({"residuals": res_b} if res_b else {}))
    dq[:, rows] += dq_b.to(acc)
    dk[:, call.k0:call.k1] += dk_b.to(dk.dtype)
    dv[:, call.k0:call.k1] += dv_b.to(dv.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        chosen: dict = {}
        out, lse = _ring_forward(cfg, q, k, v, chosen)
        ctx.cfg, ctx.chosen = cfg, chosen
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(ctx.cfg, q, k, v, out, lse, dout, dlse, ctx.chosen)
        return dq, dk, dv, None


# ----- the public function -------------------------------------------------------------------------

def ring_attention(q, k, v, *, group=None, causal=False, sharding="contiguous", window=None, scale=None,
                   softcap=None, layout="bshd", return_lse=False, backend=None, attn_bias=None, alibi_slopes=None,
                   cu_seqlens_q=None, cu_seqlens_k=None):
    """Exact attention over a sequence sharded across the ranks of ``group`` (default: WORLD).

    Every rank passes its shard (see :func:`shard_sequence`)::

        q (B, S/W, Hq, D)   k (B, S/W, Hkv, D)   v (B, S/W, Hkv, Dv)   ->  out (B, S/W, Hq, Dv)

    (``layout="bhsd"``: heads before the sequence, as in :func:`portattn.attention`). The
    result on each rank is that rank's rows of ``portattn.attention`` over the full sequence, to
    the equivalence rule of docs/semantics.md. ``return_lse=True`` also returns the rows' lse,
    float32 ``(B, Hq, S/W)``; both outputs are differentiable and the gradients land on each
    rank's q/k/v shards.

    ``sharding``: ``"contiguous"`` (rank r holds positions ``[r·S/W, (r+1)·S/W)``) or
    ``"zigzag"`` (chunks r and 2W-1-r of 2W; balances causal work). ``causal`` and
    ``window=(left, right)`` act on global positions (self-attention: Sq = Sk, so the causal
    alignment does not matter); ``scale``, ``softcap`` and GQA as in :func:`portattn.attention`.
    Head dims and dtypes are those of the backend that computes the local blocks: ``backend``
    pins one by name (else ``portattn.use_backend`` / ``PORTATTN_BACKEND`` / the device's
    priority list, per block). The backward needs a backend whose ``backward`` takes ``dlse``.

    Every rank must call with the same shapes, dtype and options (checked with a small
    ``all_gather`` per call, which synchronises the host with the device). Not supported, with
    a ``ValueError``: ``attn_bias`` and ``alibi_slopes`` (they depend on global positions the
    local blocks do not see), varlen (``cu_seqlens``), and q/k shards of different lengths
    with ``causal`` or a ``window``.
    """
    for name, val, why in (
        ("attn_bias", attn_bias, "a dense (B, H, Sq, Sk) bias cannot be split along the ring; fold a key-padding "
                                 "mask into the sequences or use portattn.attention on one device"),
        ("alibi_slopes", alibi_slopes, "ALiBi depends on global query-key distances, which the per-block calls "
                                       "do not see"),
        ("cu_seqlens_q", cu_seqlens_q, "varlen (packed) sequences cannot be sharded by ring_attention; pad them "
                                       "to one length"),
        ("cu_seqlens_k", cu_seqlens_k, "varlen (packed) sequences cannot be sharded by ring_attention; pad them "
                                       "to one length"),
    ):
        if val is not None:
            raise ValueError(f"ring_attention does not support {name}: {why}")
    _check_sharding(sharding)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str) or None, got {type(backend).__name__}")
    spec = build_spec(q, k, v, causal=causal, window=window, scale=scale, softcap=softcap, layout=layout,
                      return_lse=return_lse)
    ring = _ring(group)
    lq, lk = spec.seqlen_q, spec.seqlen_k
    left, right = spec.window_left, spec.window_right
    masked = left is not None or right is not None
    if masked and lq != lk:
        raise ValueError(f"with causal or a window, q and k/v must be shards of one sequence of equal length; got "
                         f"{lq} query and {lk} key positions per rank (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"layout={layout!r})")
    if sharding == "zigzag" and (lq % 2 or lk % 2):
        raise ValueError(f"a zigzag shard holds two chunks of equal length, so its sequence length must be even; "
                         f"got {lq} query / {lk} key positions per rank (global length must be divisible by "
                         f"2 x world = {2 * ring.world})")
    _all_equal_across_ranks(
        ring, [spec.batch, lq, lk, spec.num_heads_q, spec.num_heads_kv, spec.head_dim, spec.head_dim_v,
               _dtype_code(spec.dtype), SHARDINGS.index(sharding), -1 if left is None else left,
               -1 if right is None else right, int(round(spec.scale * 1e6)), int(round((spec.softcap or 0) * 1e6))],
        spec.device, "ring_attention's local shapes (B, Sq, Sk, Hq, Hkv, D, Dv), dtype, sharding, window, scale "
                     "and softcap; every rank must hold an equal shard")
    cfg = _Config(ring=ring, sharding=sharding, lq=lq, lk=lk, left=left, right=right, scale=spec.scale,
                  softcap=spec.softcap, backend=backend, needs_grad=spec.needs_grad)
    out, lse = _RingAttention.apply(spec.q, spec.k, spec.v, cfg)
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


# ----- the ring in one process (tests, and single-GPU runs of the local blocks) ---------------------

class _ThreadTransport:
    """Point-to-point messages between the threads of :func:`simulate_ring` (one per rank)."""

    def __init__(self):
        import threading
        self._cond = threading.Condition()
        self._box: dict = {}
        self.lock = threading.Lock()   # held around each block's compute (see _compute_guard)

    def exchange(self, ring, sends, recvs, tags, to_offset, from_offset):
        to, frm = (ring.rank + to_offset) % ring.world, (ring.rank + from_offset) % ring.world
        with self._cond:
            for t, tag in zip(sends, tags):
                self._box.setdefault((to, ring.rank, tag), []).append(t.clone())
            self._cond.notify_all()
        return [_Receive(self, (ring.rank, frm, tag), r) for r, tag in zip(recvs, tags)]


class _Receive:
    def __init__(self, transport, key, buf):
        self.transport, self.key, self.buf = transport, key, buf

    def wait(self):
        tr = self.transport
        with tr._cond:
            if not tr._cond.wait_for(lambda: tr._box.get(self.key), timeout=600):
                raise RuntimeError(f"simulate_ring: no message {self.key} (rank, from, tag) within 600 s")
            self.buf.copy_(tr._box[self.key].pop(0))


def _local_config(spec, world: int, rank: int, sharding: str, backend, needs_grad: bool, transport=None) -> _Config:
    """The _Config of one rank of a ring without a process group (``spec``: the full problem)."""
    return _Config(ring=_Ring(None, rank, world, tuple(range(world)), transport), sharding=sharding,
                   lq=spec.seqlen_q // world, lk=spec.seqlen_k // world, left=spec.window_left,
                   right=spec.window_right, scale=spec.scale, softcap=spec.softcap, backend=backend,
                   needs_grad=needs_grad)


def simulate_ring(q, k, v, world: int, *, causal=False, sharding="contiguous", window=None, scale=None,
                  softcap=None, backend=None, dout=None, dlse=None) -> dict:
    """Run the ring of ``world`` ranks in this process, one thread per rank, on full-sequence
    canonical (B, S, H, D) tensors — the same planning, backend calls, merges and gradient
    formulas as :func:`ring_attention`, with messages passed between threads instead of a
    process group (so one GPU can check the local blocks of a W-GPU ring). With ``dout`` it also
    runs the backward (``dlse``: gradient of the lse, or None). Returns the full ``out``, ``lse`` and, with ``dout``, ``dq``, ``dk``, ``dv``."""
    import threading
    _check_sharding(sharding)
    spec = build_spec(q, k, v, causal=causal, window=window, scale=scale, softcap=softcap)
    _check_divisible(spec.seqlen_q, world, sharding, "q")
    _check_divisible(spec.seqlen_k, world, sharding, "k")
    transport = _ThreadTransport()
    results: dict = {}

    def shard(t, r, dim=1):
        pieces = [t.narrow(dim, a, n) for a, n in _shard_ranges(sharding, world, r, t.shape[dim])]
        return torch.cat(pieces, dim=dim).contiguous()

    def one(r):
        try:
            cfg = _local_config(spec, world, r, sharding, backend, dout is not None, transport)
            qs, ks, vs = shard(q, r), shard(k, r), shard(v, r)
            chosen: dict = {}
            out, lse = _ring_forward(cfg, qs, ks, vs, chosen)
            res = {"out": out, "lse": lse}
            if dout is not None:
                dl = None if dlse is None else shard(dlse, r, dim=2)
                res["dq"], res["dk"], res["dv"] = _ring_backward(cfg, qs, ks, vs, out, lse, shard(dout, r), dl, chosen)
            results[r] = res
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            results[r] = exc

    # each thread runs in a copy of the caller's context, so that use_backend(...) applies there too
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(one, r), daemon=True)
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(world):
        if isinstance(results[r], BaseException):
            raise results[r]
    full = {}
    for key in results[0]:
        dim = 2 if key == "lse" else 1
        length = results[0][key].shape[dim] * world
        pos = torch.cat([torch.arange(a, a + n) for r in range(world) for a, n in _shard_ranges(sharding, world, r, length)])
        parts = torch.cat([results[r][key] for r in range(world)], dim=dim)
        full[key] = torch.empty_like(parts).index_copy_(dim, pos.to(parts.device), parts)
    return full


def _steps_for_tests(sharding: str, world: int, seqlen: int, left=None, right=None) -> list[list[list[_Call]]]:
    """Every rank's plan per step (``[rank][step] -> calls``) without a process group; for tests and docs."""
    lq = seqlen // world
    cfg = _Config(ring=_Ring(None, 0, world, tuple(range(world))), sharding=sharding, lq=lq, lk=lq, left=left,
                  right=right, scale=1.0, softcap=None, backend=None, needs_grad=False)
    return [_plans(dataclasses.replace(cfg, ring=_Ring(None, r, world, tuple(range(world))))) for r in range(world)]

