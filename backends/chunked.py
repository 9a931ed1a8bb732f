"""The ``chunked`` backend: exact attention in plain torch ops, memory linear in the sequence length.

The default on a CPU (and usable on any torch device). The score matrix is never materialised:
query rows are processed in chunks, and when one chunk's keys do not fit, key chunks are merged
with the online softmax (FlashAttention's running max and sum). A chunk's scores stay within
``_ELEMENT_BUDGET`` elements (``B_chunk · Hq · rows · keys``), so the extra memory is a few
chunk-sized float32 buffers (16 MiB each at the default budget) plus float32 copies of K and V.
Under causal masking and sliding windows only the key range some row of the chunk can see is
computed (about half the work of the full square for causal).

Numerics (docs/semantics.md): scores, softmax and ``P·V`` in float32 for float16 and bfloat16
inputs (IEEE float32 matmuls, no TF32), in float64 for float32 and float64 inputs; ``s = (q·k)·scale`` like the
reference. Masking is ``masked_fill`` on the score (never an additive ``-inf``), so a non-finite
K at a position hidden from a row never reaches that row's output or lse; K and V columns hidden
from every row of a chunk are zeroed before the products, so a key hidden from every query row
(key padding, varlen padding) never reaches any output, lse or gradient even when its K or V is
NaN or inf. Rows with no visible key output exactly 0 with ``lse = -inf``. Deterministic: a
fixed order of chunks and no atomics.

Backward (memory linear too): per query chunk, one pass recomputes the row statistics (lse with a
float64 sum, and ``δ = Σ_j P dP`` in float64 rather than ``rowsum(dO ∘ O)``, which carries O's
rounding; see :func:`_row_stats`), then per key chunk ``P = exp(s − lse)``, ``dV += Pᵀ dO``,
``dP = dO Vᵀ``, ``dS = P ∘ (dP − δ + dlse)``, ``dQ += dS K · scale``,
``dK += dSᵀ Q · scale``; softcap multiplies dS by ``1 − tanh²``; a float bias that requires grad
gets ``dS`` summed over its broadcast dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portattn.registry import ALL_FEATURES, Backend

#: Elements of one score chunk (float32: 16 MiB). Tests shrink it to exercise chunk boundaries.
_ELEMENT_BUDGET = 1 << 22
#: Fewest query rows per chunk before keys are split into chunks too (online softmax).
_MIN_ROWS = 16

_NEG_INF = float("-inf")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs; float64 for float32 and float64 inputs. float32 inputs computed
    in float32 carry the rounding of every float32 score gemm (~ulp(|s|) in each P), of the same
    size as the naive yardstick's, so the factor-2 rule failed by chance (8 of 900 random problems,
    and softcap 30 at D 1); in float64 the result is the float32 rounding of nearly exact math."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64


def _heads_first(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(nb, S, H, X) view -> contiguous (nb, H, S, X) in ``dtype``."""
    t = t.permute(0, 2, 1, 3)
    if t.dtype == dtype:   # .to() returns a same-dtype tensor as it is, whatever memory_format says
        return t.contiguous()
    return t.to(dtype, memory_format=torch.contiguous_format)


@dataclass
class _Group:
    """One unit of work: ``nb`` dense batch elements, or one varlen sequence (``nb = 1``).

    ``q (nb, Sq, Hq, D)``, ``k (nb, Sk, Hkv, D)``, ``v (nb, Sk, Hkv, Dv)`` are canonical views;
    ``bias (nb, Hq, Sq, Sk)`` a view of the spec's expanded bias (or None); ``slopes (nb, Hq)``;
    ``rows``/``batch`` say where the group's output rows and bias rows live.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    slopes: torch.Tensor | None
    batch: slice          # batch index range (dense) or [b, b+1) (varlen)
    rows: slice | None    # varlen: packed query rows; None for dense
    keys: slice | None    # varlen: packed key rows; None for dense
    sq: int
    sk: int


def _groups(spec):
    """Split the problem into :class:`_Group` s (dense: batch chunks; varlen: sequences)."""
    hq = spec.num_heads_q
    if spec.is_varlen:
        # Host copies of the offsets (eager checks validated them); clamp anyway so that a bad
        # offset can never index outside the packed tensors or the bias.
        cq, ck = spec.cu_seqlens_q.tolist(), spec.cu_seqlens_k.tolist()
        tq, tk = spec.q.shape[0], spec.k.shape[0]
        for b in range(spec.batch):
            q0 = min(max(cq[b], 0), tq)
            q1 = min(max(cq[b + 1], q0), tq, q0 + spec.seqlen_q)
            k0 = min(max(ck[b], 0), tk)
            k1 = min(max(ck[b + 1], k0), tk, k0 + spec.seqlen_k)
            sq, sk = q1 - q0, k1 - k0
            if sq == 0:
                continue
            bias = spec.attn_bias[b:b + 1, :, :sq, :sk] if spec.attn_bias is not None else None
            slopes = spec.alibi_slopes[b:b + 1] if spec.alibi_slopes is not None else None
            yield _Group(spec.q[q0:q1].unsqueeze(0), spec.k[k0:k1].unsqueeze(0), spec.v[k0:k1].unsqueeze(0),
                         bias, slopes, slice(b, b + 1), slice(q0, q1), slice(k0, k1), sq, sk)
        return
    sq, sk = spec.seqlen_q, spec.seqlen_k
    if spec.batch == 0 or sq == 0:
        return
    per_batch = hq * max(1, sq) * max(1, sk)
    nb = max(1, min(spec.batch, _ELEMENT_BUDGET // per_batch))
    for b0 in range(0, spec.batch, nb):
        b1 = min(spec.batch, b0 + nb)
        bias = spec.attn_bias[b0:b1] if spec.attn_bias is not None else None
        slopes = spec.alibi_slopes[b0:b1] if spec.alibi_slopes is not None else None
        yield _Group(spec.q[b0:b1], spec.k[b0:b1], spec.v[b0:b1], bias, slopes, slice(b0, b1), None, None, sq, sk)


def _key_range(spec, sq: int, sk: int, i0: int, i1: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that some query row in ``[i0, i1)`` can see under causal/window."""
    off = sk - sq if spec.alignment == "bottom_right" else 0
    lo = 0 if spec.window_left is None else max(0, i0 + off - spec.window_left)
    hi = sk if spec.window_right is None else min(sk, i1 - 1 + off + spec.window_right + 1)
    return lo, max(lo, hi)


def _key_chunks(spec, sq: int, sk: int, i0: int, i1: int, lo: int, hi: int, keys: int):
    """Key chunks ``(j0, j1)`` covering ``[lo, hi)``, split where the rows ``[i0, i1)`` stop
    seeing every key, so that only the chunks on the band's edges need a mask."""
    off = sk - sq if spec.alignment == "bottom_right" else 0
    full_lo = lo if spec.window_left is None else max(lo, i1 - 1 + off - spec.window_left)
    full_hi = hi if spec.window_right is None else min(hi, i0 + off + spec.window_right + 1)
    cuts = [lo, full_lo, full_hi, hi] if full_lo < full_hi else [lo, hi]
    for a, b in zip(cuts[:-1], cuts[1:]):
        for j0 in range(a, b, keys):
            yield j0, min(b, j0 + keys)


def _tiles(spec, nb: int, sq: int, sk: int) -> tuple[int, int]:
    """``(rows, keys)`` per chunk so that ``nb · Hq · rows · keys <= _ELEMENT_BUDGET`` where possible."""
    h = nb * spec.num_heads_q
    budget = _ELEMENT_BUDGET
    width = max(1, sk)
    rows = min(sq, max(1, budget // (h * width)))
    bounded = spec.window_left is not None and spec.window_right is not None
    if bounded:   # a band: the key range grows with the rows, not with Sk
        band = spec.window_left + spec.window_right
        while rows < sq and h * (2 * rows) * min(width, 2 * rows + band) <= budget:
            rows *= 2
        rows = min(rows, sq)
        width = min(width, rows + band)
    if rows >= min(sq, _MIN_ROWS):
        return rows, width
    rows = min(sq, _MIN_ROWS)
    return rows, max(1, budget // (h * rows))


class _Scratch:
    """Chunk-sized buffers reused across the chunks of a call (one allocation per slot instead
    of one per chunk, so the allocator does not fragment and the peak stays one chunk each)."""

    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, device
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, slot: str, shape) -> torch.Tensor:
        n = 1
        for x in shape:
            n *= x
        buf = self._bufs.get(slot)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=self.dtype, device=self.device)
            self._bufs[slot] = buf
        return buf[:n].view(shape)


class _Chunk:
    """Scores of query rows ``[i0, i1)`` against keys ``[j0, j1)`` of one group, masked.

    ``s`` is ``(nb, Hq, rows, keys)`` in the compute dtype after scale, softcap, ALiBi, bias and
    masking (hidden entries ``-inf``); ``keep`` the bool mask applied (None when every entry is
    visible), ``tanh`` the softcap's ``tanh(s/c)`` (for the backward), ``hidden_cols`` a bool
    ``(nb, Hkv, keys, 1)`` of key columns no row of the chunk sees (None when there are none).
    """

    def __init__(self, spec, g: _Group, qc, kc, i0, i1, j0, j1, cd, scratch: _Scratch, *, backward=False):
        nb, hq, hkv = qc.shape[0], spec.num_heads_q, spec.num_heads_kv
        rows, keys = i1 - i0, j1 - j0
        # s = (q·k)·scale in one gemm (alpha), like the reference's (q @ kᵀ) * scale
        s = scratch.take("s", (nb * hkv, qc.shape[2], keys))
        s.baddbmm_(qc.reshape(nb * hkv, -1, qc.shape[-1]), kc.reshape(nb * hkv, keys, -1).transpose(1, 2),
                   beta=0.0, alpha=spec.scale)
        s = s.view(nb, hq, rows, keys)
        self.tanh = None
        if spec.softcap is not None:
            if backward:   # dS needs 1 - tanh²
                self.tanh = torch.div(s, spec.softcap, out=scratch.take("tanh", s.shape)).tanh_()
                s.copy_(self.tanh).mul_(spec.softcap)
            else:
                s.div_(spec.softcap).tanh_().mul_(spec.softcap)
        device = s.device
        off = g.sk - g.sq
        if g.slopes is not None:
            i = torch.arange(i0, i1, device=device).unsqueeze(1)
            j = torch.arange(j0, j1, device=device).unsqueeze(0)
            dist = (i + off - j).abs().to(cd)
            s.sub_(g.slopes.to(cd).view(nb, hq, 1, 1) * dist)
        keep = _window_keep(spec, g.sq, g.sk, i0, i1, j0, j1, device)
        self.hidden_cols = None
        if g.bias is not None:
            bc = g.bias[:, :, i0:i1, j0:j1]
            if bc.dtype == torch.bool:
                keep = bc if keep is None else (bc & keep)
                seen = keep.expand(nb, hq, rows, keys).reshape(nb, hkv, -1, keys).any(dim=2)
                self.hidden_cols = (~seen).unsqueeze(-1)
            else:
                s.add_(bc.to(cd))
        if keep is not None:
            s.masked_fill_(~keep, _NEG_INF)
        self.s, self.keep = s, keep

    def clean(self, t: torch.Tensor) -> torch.Tensor:
        """K or V chunk ``(nb, Hkv, keys, X)`` with the columns no row sees zeroed (NaN-safe)."""
        if self.hidden_cols is None:
            return t
        return t.masked_fill(self.hidden_cols, 0)


def _window_keep(spec, sq, sk, i0, i1, j0, j1, device) -> torch.Tensor | None:
    """Bool ``(rows, keys)`` of entries visible under causal/window; None when all are."""
    left, right = spec.window_left, spec.window_right
    if left is None and right is None:
        return None
    off = sk - sq if spec.alignment == "bottom_right" else 0
    # every row of the chunk sees every key of the chunk: no mask needed
    if (left is None or j0 >= i1 - 1 + off - left) and (right is None or j1 - 1 <= i0 + off + right):
        return None
    i = torch.arange(i0, i1, device=device).unsqueeze(1) + off
    j = torch.arange(j0, j1, device=device).unsqueeze(0)
    keep = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    return keep


def _grouped(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """(nb, Hq, rows, X) contiguous -> (nb, Hkv, ratio·rows, X): query heads grouped by their kv head."""
    return t.view(t.shape[0], hkv, -1, t.shape[-1])


def _online_max(s: torch.Tensor, m: torch.Tensor | None):
    """One key chunk's step of the online softmax, shared by the forward and the backward's row
    statistics: ``(m_new, m_use, p)`` with the running max ``m_new`` (``m`` None: the first
    chunk), the max actually subtracted ``m_use`` (0 for rows with nothing visible yet: no
    -inf - -inf) and ``p = exp(s - m_use)``, computed in place in ``s``."""
    m_new = s.amax(dim=-1, keepdim=True)
    if m is not None:
        m_new = torch.maximum(m, m_new)
    m_use = m_new.masked_fill(m_new == _NEG_INF, 0.0)
    return m_new, m_use, s.sub_(m_use).exp_()


def _forward_group(spec, g: _Group, cd):
    """Online-softmax forward of one group: ``(out (nb, Hq, Sq, Dv), lse (nb, Hq, Sq))`` in ``cd``."""
    nb, hq, hkv = g.q.shape[0], spec.num_heads_q, spec.num_heads_kv
    dv = g.v.shape[-1]
    device = g.q.device
    out = g.q.new_zeros((nb, hq, g.sq, dv), dtype=cd)
    lse = torch.full((nb, hq, g.sq), _NEG_INF, dtype=cd, device=device)
    if g.sk == 0:
        return out, lse
    kh = _heads_first(g.k, cd)                  # (nb, Hkv, Sk, D): one copy, linear in Sk
    vh = _heads_first(g.v, cd)
    rows, keys = _tiles(spec, nb, g.sq, g.sk)
    scratch = _Scratch(cd, device)
    for i0 in range(0, g.sq, rows):
        i1 = min(g.sq, i0 + rows)
        lo, hi = _key_range(spec, g.sq, g.sk, i0, i1)
        if hi <= lo:
            continue                              # no row of this chunk sees a key: 0 and -inf
        qc = _grouped(_heads_first(g.q[:, i0:i1], cd), hkv)
        m = l = acc = None
        for j0, j1 in _key_chunks(spec, g.sq, g.sk, i0, i1, lo, hi, keys):
            ch = _Chunk(spec, g, qc, kh[:, :, j0:j1], i0, i1, j0, j1, cd, scratch)
            s = ch.s
            m_new, m_use, p = _online_max(s, m)
            vc = ch.clean(vh[:, :, j0:j1])
            pv = torch.matmul(_grouped(p, hkv), vc).view(nb, hq, i1 - i0, dv)
            if m is None:
                l = p.sum(dim=-1, keepdim=True)
                acc = pv
            else:
                alpha = torch.exp(m - m_use)
                l = l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
                acc = acc.mul_(alpha).add_(pv)
            m = m_new
            del ch, s, p   # free this chunk's scores before the next one is allocated
        m_use = m.masked_fill(m == _NEG_INF, 0.0)
        lse[:, :, i0:i1] = (m_use + torch.log(l)).squeeze(-1)
        empty = l == 0
        out[:, :, i0:i1] = torch.where(empty, 0.0, acc / l.masked_fill(empty, 1.0))
    return out, lse


def _row_stats(spec, g: _Group, qc, kh, vh, do, i0, i1, lo, hi, keys, cd, scratch):
    """One pass over the keys of rows ``[i0, i1)``: ``(lse, δ)``, float64 ``(nb, Hq, rows, 1)``.

    ``lse`` is recomputed (running max and sum, the sum in float64) rather than taken from the
    forward: the float32 lse's rounding, ulp(|lse|) (1.5e-5 at logits ~150), would be P's
    relative error. ``δ_i = Σ_j P_ij dP_ij`` is the softmax backward's own row sum, accumulated
    online like the sum, instead of ``dO_i · O_i``, which carries O's rounding to the input dtype:
    where ``dS = P∘(dP − δ)`` cancels (a row that sees one or two keys, a nearly one-hot softmax)
    that rounding alone was 3-400x the naive math's error in dq/dk/dbias (float16 x5 logits:
    408x; float32 rows with two keys: 7x; bfloat16 dbias: 7.7x). Costs the gemms ``Q Kᵀ`` and
    ``dO Vᵀ`` once more.
    """
    nb, hq, hkv = qc.shape[0], spec.num_heads_q, spec.num_heads_kv
    n, dvd = i1 - i0, vh.shape[-1]
    f64 = torch.float64
    m = l = u = None
    for j0, j1 in _key_chunks(spec, g.sq, g.sk, i0, i1, lo, hi, keys):
        ch = _Chunk(spec, g, qc, kh[:, :, j0:j1], i0, i1, j0, j1, cd, scratch)
        s = ch.s
        m_new, m_use, p = _online_max(s, m)
        vc = ch.clean(vh[:, :, j0:j1])
        dp = torch.bmm(do.reshape(nb * hkv, -1, dvd), vc.reshape(nb * hkv, j1 - j0, dvd).transpose(1, 2),
                       out=scratch.take("ds", (nb * hkv, do.shape[2], j1 - j0))).view(nb, hq, n, j1 - j0)
        p_sum = p.sum(dim=-1, keepdim=True, dtype=f64)
        pdp_sum = dp.mul_(p).sum(dim=-1, keepdim=True, dtype=f64)
        if m is None:
            l, u = p_sum, pdp_sum
        else:
            alpha = torch.exp(m.to(f64) - m_use.to(f64))
            l = l.mul_(alpha).add_(p_sum)
            u = u.mul_(alpha).add_(pdp_sum)
        m = m_new
        del ch, s, p, dp
    m_use = m.masked_fill(m == _NEG_INF, 0.0).to(f64)
    empty = l == 0
    lse = m_use + torch.log(l)                                   # -inf where no key is visible
    delta = torch.where(empty, 0.0, u / l.masked_fill(empty, 1.0))
    return lse, delta


def _reduced_shape(bias: torch.Tensor) -> tuple[int, ...]:
    """The bias's shape with its broadcast (stride-0) dims as 1: where its gradient accumulates."""
    return tuple(1 if st == 0 else n for n, st in zip(bias.shape, bias.stride()))


def _bias_index(buf: torch.Tensor, batch: slice, i0: int, i1: int, j0: int, j1: int):
    def pick(dim, sl):
        return slice(0, 1) if buf.shape[dim] == 1 else sl
    return pick(0, batch), slice(None), pick(2, slice(i0, i1)), pick(3, slice(j0, j1))


class ChunkedBackend(Backend):
    """Exact attention in torch ops over query/key chunks (online softmax): memory linear in the
    sequence length, every feature, forward and backward; the CPU default."""

    name = "chunked"
    stable_reasons = True   # dtype/device checks and the TF32 flag (which the call path keys on)
    description = "exact attention in torch ops, query/key chunks with an online softmax (memory-linear; any device)"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    head_dims = (1, 1 << 16)
    vendors = frozenset({"nvidia", "amd", "cpu", "mps", "xpu"})
    features = ALL_FEATURES
    deterministic = True
    has_backward = True

    def extra_reasons(self, spec) -> list[str]:
        reasons = []
        if spec.dtype == torch.float64 and spec.device.type == "mps":
            reasons.append("float64 is not supported on MPS devices; use float32 or a CPU tensor")
        if spec.dtype != torch.float64 and spec.device.type == "cuda" and not spec.allow_tf32 \
                and torch.backends.cuda.matmul.allow_tf32:
            reasons.append("torch.backends.cuda.matmul.allow_tf32 is on, so the float32 matmuls would use TF32; "
                           "turn it off or set PORTATTN_ALLOW_TF32=1")
        return reasons

    # ----- forward -----------------------------------------------------------------------
    def forward(self, spec):
        cd = _compute_dtype(spec.dtype)
        out = torch.zeros(spec.out_shape, dtype=spec.dtype, device=spec.device)
        lse = torch.full(spec.lse_shape, _NEG_INF, dtype=torch.float32, device=spec.device)
        with torch.no_grad():
            for g in _groups(spec):
                o, l = _forward_group(spec, g, cd)
                if g.rows is None:
                    out[g.batch] = o.permute(0, 2, 1, 3)
                    lse[g.batch] = l
                else:
                    out[g.rows] = o[0].transpose(0, 1)
                    lse[:, g.rows] = l[0]
        return out, lse

    # ----- backward ----------------------------------------------------------------------
    def backward(self, spec, out, lse, dout, dlse=None):
        """``(dq, dk, dv, dbias)``; ``dlse`` (float32 ``spec.lse_shape`` or None) is the
        gradient with respect to the returned lse. ``out`` and ``lse`` are not read: the row
        statistics are recomputed in float64 (:func:`_row_stats`). ``dbias`` has the bias's shape
        with its broadcast dimensions reduced to 1 (``sum_to_size`` of it to the caller's shape is
        exact)."""
        cd = _compute_dtype(spec.dtype)
        bias = spec.attn_bias
        want_dbias = bias is not None and bias.dtype != torch.bool and bias.requires_grad
        dq = torch.zeros(spec.q.shape, dtype=spec.dtype, device=spec.device)
        dk = torch.zeros(spec.k.shape, dtype=spec.dtype, device=spec.device)
        dv = torch.zeros(spec.v.shape, dtype=spec.dtype, device=spec.device)
        dbias = torch.zeros(_reduced_shape(bias), dtype=cd, device=spec.device) if want_dbias else None
        with torch.no_grad():
            for g in _groups(spec):
                if g.rows is None:
                    dout_g = dout[g.batch]
                    dlse_g = dlse[g.batch] if dlse is not None else None
                else:
                    dout_g = dout[g.rows].unsqueeze(0)
                    dlse_g = dlse[:, g.rows].unsqueeze(0) if dlse is not None else None
                gq, gk, gv = self._backward_group(spec, g, cd, dout_g, dlse_g, dbias)
                if g.rows is None:
                    dq[g.batch], dk[g.batch], dv[g.batch] = gq, gk, gv
                else:
                    dq[g.rows], dk[g.keys], dv[g.keys] = gq[0], gk[0], gv[0]
        if want_dbias:
            dbias = dbias.to(bias.dtype)
        return dq, dk, dv, dbias

    @staticmethod
    def _backward_group(spec, g: _Group, cd, dout, dlse, dbias):
        """Gradients of one group in its canonical layout (``(nb, Sq, Hq, D)``, ...)."""
        nb, hq, hkv = g.q.shape[0], spec.num_heads_q, spec.num_heads_kv
        d, dvd = g.q.shape[-1], g.v.shape[-1]
        dq = torch.zeros((nb, hq, g.sq, d), dtype=cd, device=g.q.device)
        dk = torch.zeros((nb, hkv, g.sk, d), dtype=cd, device=g.q.device)
        dv = torch.zeros((nb, hkv, g.sk, dvd), dtype=cd, device=g.q.device)
        if g.sk > 0:
            kh, vh = _heads_first(g.k, cd), _heads_first(g.v, cd)
            rows, keys = _tiles(spec, nb, g.sq, g.sk)
            scratch = _Scratch(cd, g.q.device)
            for i0 in range(0, g.sq, rows):
                i1 = min(g.sq, i0 + rows)
                lo, hi = _key_range(spec, g.sq, g.sk, i0, i1)
                if hi <= lo:
                    continue
                n = i1 - i0
                qc = _grouped(_heads_first(g.q[:, i0:i1], cd), hkv)
                do = _heads_first(dout[:, i0:i1], cd)                         # (nb, Hq, n, Dv)
                lse_c, delta = _row_stats(spec, g, qc, kh, vh, _grouped(do, hkv), i0, i1, lo, hi, keys, cd, scratch)
                empty = torch.isneginf(lse_c)
                lse_c = lse_c.masked_fill(empty, 0.0)                          # rows without keys: P = 0
                if dlse is not None:   # rows without keys take no lse gradient (whatever dlse holds there)
                    delta = delta - dlse[:, :, i0:i1].unsqueeze(-1).to(delta.dtype).masked_fill(empty, 0.0)
                do = _grouped(do, hkv)
                dq_c = torch.zeros((nb, hq, n, d), dtype=cd, device=g.q.device)
                for j0, j1 in _key_chunks(spec, g.sq, g.sk, i0, i1, lo, hi, keys):
                    ch = _Chunk(spec, g, qc, kh[:, :, j0:j1], i0, i1, j0, j1, cd, scratch, backward=True)
                    p = ch.s.sub_(lse_c).exp_()                                  # (nb, Hq, n, keys)
                    kc, vc = ch.clean(kh[:, :, j0:j1]), ch.clean(vh[:, :, j0:j1])
                    pg = _grouped(p, hkv)
                    dv[:, :, j0:j1] += torch.matmul(pg.transpose(-1, -2), do)
                    ds = torch.bmm(do.reshape(nb * hkv, -1, dvd), vc.reshape(nb * hkv, j1 - j0, dvd).transpose(1, 2),
                                   out=scratch.take("ds", (nb * hkv, do.shape[2], j1 - j0))).view(nb, hq, n, j1 - j0)
                    ds.sub_(delta).mul_(p)   # hidden entries: P = 0 (their V columns are clean or seen by a row)
                    if dbias is not None:
                        idx = _bias_index(dbias, g.batch, i0, i1, j0, j1)
                        dbias[idx] += ds.sum_to_size(dbias[idx].shape)
                    if ch.tanh is not None:
                        ds.mul_(1.0 - ch.tanh * ch.tanh)
                    dsg = _grouped(ds, hkv)
                    dq_c += torch.matmul(dsg, kc).view(nb, hq, n, d)
                    dk[:, :, j0:j1] += torch.matmul(dsg.transpose(-1, -2), qc)
                    del ch, p, pg, ds, dsg   # free this chunk's buffers before the next one
                dq[:, :, i0:i1] = dq_c
        dq.mul_(spec.scale)
        dk.mul_(spec.scale)
        return dq.permute(0, 2, 1, 3), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)

