"""The float64 oracle, and the plain "naive" math the equivalence rule compares against.

:func:`reference_forward` computes docs/semantics.md literally, materialising the score matrix in
float64 (one sequence and a few heads at a time, so memory stays bounded). It is differentiable
through torch autograd, which is how the ``reference`` backend gets its backward.

:func:`naive_forward` is the same formula in the input dtype (scores and ``P·V`` in that dtype,
softmax in float32): its error against the reference is the yardstick of docs/semantics.md.
"""

from __future__ import annotations

import torch

from .registry import ALL_FEATURES, Backend
from .spec import AttentionSpec

# Score chunks larger than this many elements are split across heads.
_CHUNK_ELEMENTS = 1 << 27


def visible_keys(spec: AttentionSpec, sq: int, sk: int, device) -> torch.Tensor | None:
    """Bool (sq, sk) mask of visible keys from causal/window, or None when all are visible."""
    if spec.window_left is None and spec.window_right is None:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    row = i + (sk - sq) if spec.alignment == "bottom_right" else i
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if spec.window_left is not None:
        keep &= j >= row - spec.window_left
    if spec.window_right is not None:
        keep &= j <= row + spec.window_right
    return keep


def _one_sequence(spec: AttentionSpec, q, k, v, bias, slopes, compute_dtype, naive: bool):
    """Attention for one sequence and a group of heads.

    q (Sq, H, D), k (Sk, H, D), v (Sk, H, Dv) (K/V already gathered per query head), bias (Hq, Sq, Sk) or None, slopes (Hq,) or None.
    Returns out (Sq, Hq, Dv) in ``compute_dtype`` and lse (Hq, Sq) float64/float32.
    """
    sq, hq, _ = q.shape
    sk = k.shape[0]
    dv = v.shape[-1]
    if sk == 0 or sq == 0:
        out = torch.zeros(sq, hq, dv, dtype=compute_dtype, device=q.device)
        return out, torch.full((hq, sq), float("-inf"), dtype=torch.float64, device=q.device)
    qh = q.to(compute_dtype).transpose(0, 1)   # (H, Sq, D)
    kh = k.to(compute_dtype).transpose(0, 1)   # (H, Sk, D): K/V heads already matched to q's
    vh = v.to(compute_dtype).transpose(0, 1)   # (H, Sk, Dv)
    keep = visible_keys(spec, sq, sk, q.device)
    if naive:
        s = (qh * spec.scale) @ kh.transpose(1, 2)
    else:
        s = (qh @ kh.transpose(1, 2)) * spec.scale
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if slopes is not None:
        i = torch.arange(sq, device=q.device).unsqueeze(1)
        j = torch.arange(sk, device=q.device).unsqueeze(0)
        dist = (i + (sk - sq) - j).abs().to(s.dtype)
        s = s - slopes.to(s.dtype).view(hq, 1, 1) * dist
    if bias is not None:
        if bias.dtype == torch.bool:
            keep = bias if keep is None else (bias & keep)
        else:
            s = s + bias.to(s.dtype)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if naive:
        p_dtype = compute_dtype
        s = s.float()
    # Row max over finite entries; rows with no visible key get max 0 and an empty sum.
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    if naive:
        p = (p / l_safe).to(p_dtype)
        out = p @ vh
    else:
        out = (p @ vh) / l_safe
    # differentiable (∂lse_i/∂s_ij = P_ij; m is a constant that cancels); empty rows are -inf
    # through a where, so they get no gradient (log(l_safe) keeps 1/0 out of the backward)
    lse = torch.where(empty, float("-inf"), m + torch.log(l_safe)).squeeze(-1).to(torch.float64)
    return out.transpose(0, 1), lse


def _heads_chunks(hq: int, sq: int, sk: int):
    per_head = max(1, sq * sk)
    step = max(1, min(hq, _CHUNK_ELEMENTS // per_head))
    return [(h, min(hq, h + step)) for h in range(0, hq, step)]


def _host_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_name: str, max_len: int) -> list[int]:
    """``cu`` as a list, checked: under torch.compile nothing validated its contents before the
    backend runs (portattn.spec does only in eager mode), and this backend reads them anyway."""
    host = cu.tolist()
    lengths = [b - a for a, b in zip(host[:-1], host[1:])]
    if host[0] != 0 or host[-1] != total or any(n < 0 for n in lengths) or max(lengths) > max_len:
        shown = f"{host[:8]}{' ...' if len(host) > 8 else ''}"
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the packed length {total}, with no "
            f"sequence longer than {max_name}={max_len}; got {shown} (last={host[-1]}). Its contents "
            f"are not checked under torch.compile: fix the values, or call eagerly to have them validated")
    return host


def _attention(spec: AttentionSpec, q, k, v, bias, compute_dtype, naive: bool):
    """Loop over sequences (and head chunks); returns canonical out and lse (float64)."""
    ratio = spec.gqa_ratio
    if spec.is_varlen:
        cq = _host_cu_seqlens("cu_seqlens_q", spec.cu_seqlens_q, q.shape[0], "max_seqlen_q", spec.seqlen_q)
        ck = _host_cu_seqlens("cu_seqlens_k", spec.cu_seqlens_k, k.shape[0], "max_seqlen_k", spec.seqlen_k)
        seqs = [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(spec.batch)]
    else:
        seqs = None
    outs, lses = [], []
    for b in range(spec.batch):
        if seqs is None:
            qb, kb, vb = q[b], k[b], v[b]
        else:
            qb, kb, vb = q[seqs[b][0]], k[seqs[b][1]], v[seqs[b][1]]
        sq, sk = qb.shape[0], kb.shape[0]
        bb = bias[b, :, :sq, :sk] if bias is not None else None
        sl = spec.alibi_slopes[b] if spec.alibi_slopes is not None else None
        o_parts, l_parts = [], []
        for h0, h1 in _heads_chunks(spec.num_heads_q, sq, sk):
            kv_heads = torch.arange(h0, h1, device=kb.device) // ratio   # GQA: query head h reads h // ratio
            o, l = _one_sequence(spec, qb[:, h0:h1], kb[:, kv_heads], vb[:, kv_heads],
                                 bb[h0:h1] if bb is not None else None, sl[h0:h1] if sl is not None else None,
                                 compute_dtype, naive)
            o_parts.append(o)
            l_parts.append(l)
        outs.append(torch.cat(o_parts, dim=1))
        lses.append(torch.cat(l_parts, dim=0))
    if spec.is_varlen:
        return torch.cat(outs, dim=0), torch.cat(lses, dim=1)
    if not outs:   # batch 0: empty results that still depend on the inputs (for vjp)
        tie = 0 * (q.sum() + k.sum() + v.sum()).to(compute_dtype)
        out = torch.zeros(spec.out_shape, dtype=compute_dtype, device=q.device) + tie
        return out, torch.zeros(spec.lse_shape, dtype=torch.float64, device=q.device) + tie.double()
    return torch.stack(outs, dim=0), torch.stack(lses, dim=0)


def _float_bias(spec, dtype):
    b = spec.attn_bias
    if b is None or b.dtype == torch.bool:
        return b
    return b.to(dtype)


def reference_forward(spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in float64: ``(out float64 canonical, lse float32)``; both are
    differentiable (in q, k, v and a float bias)."""
    f64 = torch.float64
    out, lse = _attention(spec, spec.q.to(f64), spec.k.to(f64), spec.v.to(f64), _float_bias(spec, f64), f64, naive=False)
    return out, lse.to(torch.float32)


def naive_forward(spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain math in the input dtype (softmax in float32): the §3 yardstick; differentiable."""
    dt = spec.dtype
    out, lse = _attention(spec, spec.q, spec.k, spec.v, _float_bias(spec, dt), dt, naive=True)
    return out.to(dt), lse.to(torch.float32)


class ReferenceBackend(Backend):
    """Exact float64 math on any torch device; every feature; the oracle of every test."""

    name = "reference"
    stable_reasons = True   # no reasons at all
    description = "float64 reference math (slow, exact; any device)"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    head_dims = (1, 1 << 20)
    vendors = frozenset({"nvidia", "amd", "cpu", "mps", "xpu", "meta"})
    features = ALL_FEATURES
    deterministic = True
    has_backward = True

    def not_supported_reasons(self, spec) -> list[str]:
        return []   # every dtype, feature and torch device

    def forward(self, spec):
        with torch.no_grad():
            out, lse = reference_forward(spec)
        return out.to(spec.dtype), lse

    def backward(self, spec, out, lse, dout, dlse=None):
        # torch.func.vjp works inside the custom op, where plain autograd is dispatched away.
        # out and lse are both pulled back: dlse (or zeros) reaches the scores through lse.
        f64 = torch.float64
        bias = _float_bias(spec, f64)
        want_dbias = bias is not None and bias.dtype != torch.bool and spec.attn_bias.requires_grad
        primals = [spec.q.detach().to(f64), spec.k.detach().to(f64), spec.v.detach().to(f64)]
        if want_dbias:
            primals.append(bias.detach())

        def f(q, k, v, b=bias):
            return _attention(spec, q, k, v, b, f64, naive=False)

        with torch.enable_grad():
            (_, lse64), vjp = torch.func.vjp(f, *primals)
            dlse64 = torch.zeros_like(lse64) if dlse is None else dlse.to(device=lse64.device, dtype=f64)
            grads = vjp((dout.to(f64), dlse64))
        dq, dk, dv = (g.to(spec.dtype) for g in grads[:3])
        dbias = grads[3].to(spec.attn_bias.dtype) if want_dbias else None
        return dq, dk, dv, dbias
