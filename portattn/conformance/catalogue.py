"""The fixed, versioned conformance catalogue.

Every case is a :class:`~portattn.conformance.problems.Problem` with a stable id and a seed
derived from that id (crc32), so two machines running the same catalogue version feed every
backend the same input bits. Bump :data:`CATALOGUE_VERSION` whenever a case is added, removed
or changed: ``conformance diff`` warns when two reports were made from different versions.

Tiers: ``small`` cases run on every device (sizes the Triton interpreter can afford on a CPU:
S <= 129, D <= 128); ``large`` cases run on GPU devices only. ``quick`` marks the subset that
``portattn check`` runs (one or two cases per feature of docs/semantics.md, each small).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

from .problems import Problem

CATALOGUE_VERSION = "8"

_DT = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class Case:
    id: str
    problem: Problem
    tier: str = "small"      # "small" (every device) or "large" (GPU devices only)
    quick: bool = False      # part of `portattn check`


def _seed(case_id: str) -> int:
    return zlib.crc32(case_id.encode()) & 0x7FFFFFFF


class _Builder:
    def __init__(self):
        self.cases: list[Case] = []
        self._ids: set[str] = set()

    def add(self, case_id: str, problem: Problem, *, tier: str = "small", quick: bool = False):
        if case_id in self._ids:
            raise ValueError(f"duplicate catalogue id {case_id!r}")
        self._ids.add(case_id)
        self.cases.append(Case(case_id, replace(problem, seed=_seed(case_id)), tier, quick))


def _core(b: _Builder):
    """dtype x shape x {none, causal bottom-right, causal top-left}; head dims cycle."""
    shapes = [(1, 1), (1, 17), (17, 1), (2, 3), (3, 2), (13, 13), (17, 64), (64, 17), (61, 67), (65, 63)]
    dims = [16, 32, 64, 40, 24, 48, 8, 57, 33, 3]
    masks = {"full": {}, "causal-br": {"causal": True}, "causal-tl": {"causal": True, "alignment": "top_left"}}
    for dt_name, dt in _DT.items():
        for (sq, sk), d in zip(shapes, dims):
            for mname, mkw in masks.items():
                quick = dt_name == "fp16" and (sq, sk) in ((17, 64), (64, 17)) or \
                    (dt_name != "fp16" and (sq, sk) == (13, 13) and mname == "causal-br")
                b.add(f"core/{dt_name}/sq{sq}-sk{sk}/d{d}/{mname}",
                      Problem(batch=2, seqlen_q=sq, seqlen_k=sk, heads_q=2, heads_kv=2, head_dim=d, dtype=dt, **mkw),
                      quick=quick)


def _windows(b: _Builder):
    windows = [(4, 0), (8, 8), (0, 5), (None, 3), (16, None), (0, 0)]
    sizes = [(31, 67), (67, 31)]
    dts = list(_DT.values())
    n = 0
    for w in windows:
        for align in ("bottom_right", "top_left"):
            for sq, sk in sizes:
                dt = dts[n % 3]
                n += 1
                b.add(f"window/{w[0]}-{w[1]}/{align}/sq{sq}-sk{sk}",
                      Problem(seqlen_q=sq, seqlen_k=sk, heads_q=2, heads_kv=1, head_dim=32, window=w,
                              alignment=align, dtype=dt),
                      quick=(w, align, sq) in (((8, 8), "bottom_right", 31), ((4, 0), "top_left", 67)))
    for left in (0, 3, 20):
        for align in ("bottom_right", "top_left"):
            b.add(f"window/causal-left{left}/{align}",
                  Problem(batch=2, seqlen_q=45, seqlen_k=61, heads_q=4, heads_kv=2, head_dim=64, causal=True,
                          window=(left, 0), alignment=align, dtype="bfloat16"),
                  quick=left == 3 and align == "bottom_right")


def _softcap(b: _Builder):
    for cap in (2.0, 30.0):
        for dt_name, dt in _DT.items():
            for causal in (False, True):
                b.add(f"softcap/{cap:g}/{dt_name}/{'causal' if causal else 'full'}",
                      Problem(batch=2, seqlen_q=33, seqlen_k=47, heads_q=4, heads_kv=2, head_dim=64, softcap=cap,
                              causal=causal, dtype=dt, magnitude=3.0),
                      quick=cap == 2.0 and dt_name == "fp16" and causal)


def _alibi(b: _Builder):
    for kind in ("head", "batch"):
        for causal in (False, True):
            for sq, sk in ((29, 29), (16, 53)):
                b.add(f"alibi/{kind}/{'causal' if causal else 'full'}/sq{sq}-sk{sk}",
                      Problem(batch=2, seqlen_q=sq, seqlen_k=sk, heads_q=4, heads_kv=4, head_dim=32, alibi=kind,
                              causal=causal, dtype="float16" if causal else "float32"),
                      quick=kind == "batch" and causal and sq == 16)


def _bias(b: _Builder):
    grads = {"float": True, "float_keys": True, "float_heads": True, "bool_keys": False, "bool": False}
    for kind, can_grad in grads.items():
        for sq, sk in ((23, 23), (9, 65)):
            for bias_grad in ((False, True) if can_grad else (False,)):
                for dt_name in ("fp16", "fp32"):
                    b.add(f"bias/{kind}{'+grad' if bias_grad else ''}/{dt_name}/sq{sq}-sk{sk}",
                          Problem(batch=2, seqlen_q=sq, seqlen_k=sk, heads_q=2, heads_kv=2, head_dim=40,
                                  bias=kind, bias_grad=bias_grad, dtype=_DT[dt_name]),
                          quick=dt_name == "fp16" and sq == 9 and kind in ("float", "bool") and not bias_grad
                          or (kind == "float_keys" and bias_grad and dt_name == "fp32" and sq == 23))
    b.add("bias/bool+causal+alibi/bf16",
          Problem(batch=2, seqlen_q=37, seqlen_k=37, heads_q=4, heads_kv=2, head_dim=32, bias="bool",
                  causal=True, alibi="head", dtype="bfloat16"))


def _gqa(b: _Builder):
    for hq, hkv in ((4, 2), (8, 2), (8, 1), (6, 3), (8, 8)):
        for causal in (False, True):
            b.add(f"gqa/{hq}x{hkv}/{'causal' if causal else 'full'}",
                  Problem(batch=1, seqlen_q=37, seqlen_k=37, heads_q=hq, heads_kv=hkv, head_dim=32, causal=causal,
                          dtype="bfloat16"),
                  quick=(hq, hkv) == (8, 1) and causal)


def _head_dims(b: _Builder):
    for d in (1, 3, 8, 16, 17, 24, 32, 33, 40, 48, 57, 64, 72, 80, 96, 100, 128):
        for dt_name in ("fp16", "fp32"):
            b.add(f"headdim/d{d}/{dt_name}",
                  Problem(seqlen_q=19, seqlen_k=35, heads_q=2, heads_kv=1, head_dim=d, causal=d % 2 == 0,
                          dtype=_DT[dt_name]),
                  quick=d in (72, 57) and dt_name == "fp16")
    for d, dv in ((32, 64), (64, 32), (40, 24), (128, 64), (16, 128)):
        b.add(f"headdim/d{d}-dv{dv}",
              Problem(batch=2, seqlen_q=21, seqlen_k=21, heads_q=2, heads_kv=2, head_dim=d, head_dim_v=dv,
                      causal=True, dtype="float16"),
              quick=(d, dv) == (40, 24))


def _varlen(b: _Builder):
    configs = {
        "basic": dict(seqlens_q=(5, 17, 33), seqlens_k=(5, 17, 33)),
        "empty-and-one": dict(seqlens_q=(0, 1, 13, 0, 2), seqlens_k=(3, 1, 13, 0, 0)),
        "q-shorter": dict(seqlens_q=(1, 7, 16), seqlens_k=(31, 64, 17)),
        "q-longer": dict(seqlens_q=(31, 64, 17), seqlens_k=(1, 7, 16)),
        "single": dict(seqlens_q=(67,), seqlens_k=(67,)),
    }
    extras = {
        "full": {},
        "causal": dict(causal=True),
        "causal-tl": dict(causal=True, alignment="top_left"),
        "window": dict(window=(6, 2)),
        "gqa-alibi": dict(heads_q=4, heads_kv=1, alibi="batch", causal=True),
        "bias": dict(bias="float", bias_grad=True),
        "mask": dict(bias="bool_keys"),
        "softcap": dict(softcap=5.0, strided=True),
    }
    n = 0
    for cname, sizes in configs.items():
        for ename, extra in extras.items():
            kw = dict(heads_q=2, heads_kv=2, head_dim=32, dtype=list(_DT.values())[n % 3])
            n += 1
            kw.update(sizes)
            kw.update(extra)
            b.add(f"varlen/{cname}/{ename}", Problem(**kw),
                  quick=(cname, ename) in (("empty-and-one", "causal"), ("q-shorter", "bias"), ("basic", "softcap")))


def _layouts_and_values(b: _Builder):
    for dt_name, dt in _DT.items():
        b.add(f"layout/bhsd/{dt_name}", Problem(batch=2, seqlen_q=24, seqlen_k=40, heads_q=4, heads_kv=2,
                                               head_dim=32, layout="bhsd", causal=True, dtype=dt),
              quick=dt_name == "bf16")
        b.add(f"layout/strided/{dt_name}", Problem(batch=2, seqlen_q=24, seqlen_k=40, heads_q=4, heads_kv=2,
                                                  head_dim=48, strided=True, dtype=dt),
              quick=dt_name == "fp16")
        b.add(f"layout/bhsd-strided/{dt_name}", Problem(batch=2, seqlen_q=33, seqlen_k=17, heads_q=2, heads_kv=2,
                                                       head_dim=16, layout="bhsd", strided=True, dtype=dt))
        for mag in (2.0, 5.0):
            b.add(f"values/x{mag:g}/{dt_name}", Problem(batch=2, seqlen_q=33, seqlen_k=33, heads_q=2, heads_kv=2,
                                                       head_dim=64, magnitude=mag, dtype=dt),
                  quick=mag == 5.0 and dt_name == "fp16")
        for causal in (False, True):
            b.add(f"values/extreme/{dt_name}/{'causal' if causal else 'full'}",
                  Problem(batch=2, seqlen_q=40, seqlen_k=40, heads_q=2, heads_kv=2, head_dim=32, extreme=True,
                          causal=causal, dtype=dt),
                  quick=causal and dt_name == "fp32")
        for scale in (0.05, 1.0):
            b.add(f"values/scale{scale:g}/{dt_name}", Problem(seqlen_q=20, seqlen_k=30, heads_q=2, heads_kv=2,
                                                             head_dim=64, scale=scale, dtype=dt))
        b.add(f"values/fwd-only/{dt_name}", Problem(batch=3, seqlen_q=50, seqlen_k=50, heads_q=2, heads_kv=2,
                                                   head_dim=64, causal=True, grad=False, dtype=dt))


def _masked_rows(b: _Builder):
    """Problems with rows that see no key: the output must be exactly 0 and lse -inf."""
    b.add("masked/causal-br-sq-gt-sk", Problem(batch=2, seqlen_q=40, seqlen_k=9, heads_q=2, heads_kv=2, head_dim=32,
                                               causal=True), quick=True)
    b.add("masked/window-tl-sq-gt-sk", Problem(seqlen_q=30, seqlen_k=10, heads_q=2, heads_kv=1, head_dim=32,
                                               window=(2, 1), alignment="top_left", dtype="bfloat16"))
    b.add("masked/bool-rows", Problem(batch=2, seqlen_q=33, seqlen_k=20, heads_q=2, heads_kv=2, head_dim=16,
                                      bias="bool", dtype="float32"), quick=True)
    b.add("masked/window-0-0-sq-gt-sk", Problem(seqlen_q=25, seqlen_k=5, heads_q=2, heads_kv=2, head_dim=32,
                                                window=(0, 0), dtype="float16"))
    b.add("masked/varlen-empty-keys", Problem(seqlens_q=(4, 6, 3), seqlens_k=(0, 9, 0), heads_q=2, heads_kv=2,
                                              head_dim=32, dtype="float16"))


def _combos(b: _Builder):
    """Everything at once, the way models use it."""
    b.add("combo/llm-decode", Problem(batch=3, seqlen_q=1, seqlen_k=129, heads_q=8, heads_kv=2, head_dim=64,
                                      causal=True, dtype="bfloat16", grad=False), quick=True)
    b.add("combo/llm-prefill", Problem(batch=1, seqlen_q=96, seqlen_k=129, heads_q=8, heads_kv=2, head_dim=128,
                                       causal=True, dtype="bfloat16"))
    b.add("combo/gemma-softcap-window", Problem(batch=2, seqlen_q=64, seqlen_k=64, heads_q=4, heads_kv=2,
                                                head_dim=64, causal=True, window=(15, 0), softcap=50.0,
                                                dtype="bfloat16"))
    b.add("combo/alibi-mask-gqa", Problem(batch=2, seqlen_q=31, seqlen_k=47, heads_q=6, heads_kv=2, head_dim=48,
                                          alibi="batch", bias="bool_keys", causal=True, dtype="float16"))
    b.add("combo/everything", Problem(seqlens_q=(7, 0, 25), seqlens_k=(19, 3, 25), heads_q=4, heads_kv=2,
                                      head_dim=40, head_dim_v=24, causal=True, window=(9, 0), softcap=20.0,
                                      alibi="head", bias="float", bias_grad=True, strided=True, magnitude=2.0,
                                      dtype="float16"))


def _nonfinite(b: _Builder):
    """NaN and ±inf in masked-out K and V positions (docs/semantics.md, "Non-finite values").

    ``hidden``: every key no query row sees is poisoned (causal top-left beyond Sq, left of a
    window, key padding, key padding inside varlen sequences): the output, lse and gradients must
    equal the clean problem's. ``partial``: one key that some rows see is poisoned in K: the rows
    that see it are non-finite (as in the reference), every other row must equal the clean one.
    """
    from .problems import POISONS
    maskings = {
        "causal-tl": dict(batch=2, seqlen_q=24, seqlen_k=40, heads_q=4, heads_kv=2, causal=True, alignment="top_left"),
        "window": dict(batch=2, seqlen_q=20, seqlen_k=45, heads_q=2, heads_kv=1, causal=True, window=(4, 0)),
        "key-padding": dict(batch=3, seqlen_q=17, seqlen_k=29, heads_q=2, heads_kv=2, bias="bool_keys"),
        "varlen-key-padding": dict(seqlens_q=(5, 17, 9), seqlens_k=(12, 17, 30), heads_q=4, heads_kv=1,
                               bias="bool_keys"),
    }
    dts = list(_DT.values())
    n = 0
    for poison in POISONS:
        for mname, kw in maskings.items():
            b.add(f"nonfinite/hidden/{poison.replace(':', '-')}/{mname}",
                  Problem(head_dim=32, dtype=dts[n % 3], poison=poison, **kw))
            n += 1
    # forward only: what every backend promises (the reference's own dq is a known limitation)
    b.add("nonfinite/hidden/k-nan/key-padding/fwd",
          Problem(head_dim=32, poison="k:nan", grad=False, **maskings["key-padding"]), quick=True)
    partial = {
        "causal": dict(batch=1, seqlen_q=33, seqlen_k=33, heads_q=2, heads_kv=2, causal=True),
        "window": dict(batch=2, seqlen_q=31, seqlen_k=40, heads_q=2, heads_kv=1, window=(6, 2)),
        "mask": dict(batch=2, seqlen_q=19, seqlen_k=23, heads_q=2, heads_kv=2, bias="bool"),
    }
    for poison in ("k:nan", "k:inf"):
        for mname, kw in partial.items():
            b.add(f"nonfinite/partial/{poison.replace(':', '-')}/{mname}",
                  Problem(head_dim=32, dtype=dts[n % 3], poison=poison, poison_at="partial", **kw),
                  quick=poison == "k:nan" and mname == "causal")
            n += 1


def _large(b: _Builder):
    """GPU-only sizes: block multiples and their neighbours, long sequences, big head dims."""
    for dt_name in ("fp16", "bf16", "fp32"):
        for s in (255, 256, 257, 1023, 2048):
            for d in (64, 128, 256):
                if dt_name == "fp32" and (s > 1100 or d == 256):
                    continue
                b.add(f"large/{dt_name}/s{s}/d{d}",
                      Problem(batch=2, seqlen_q=s, seqlen_k=s, heads_q=4, heads_kv=2, head_dim=d, causal=s % 2 == 1,
                              dtype=_DT[dt_name]), tier="large")
    for sq, sk in ((1, 4097), (17, 2049), (2049, 511), (511, 2049)):
        for align in ("bottom_right", "top_left"):
            b.add(f"large/bf16/sq{sq}-sk{sk}/causal-{align}",
                  Problem(batch=2, seqlen_q=sq, seqlen_k=sk, heads_q=8, heads_kv=1, head_dim=128, causal=True,
                          alignment=align, dtype="bfloat16"), tier="large")
    for d in (160, 192, 256):
        b.add(f"large/headdim/d{d}", Problem(batch=2, seqlen_q=300, seqlen_k=300, heads_q=2, heads_kv=2, head_dim=d,
                                             causal=True, dtype="float16"), tier="large")
    b.add("large/varlen/mixed", Problem(seqlens_q=(1, 1000, 0, 511, 129), seqlens_k=(700, 1000, 64, 511, 1),
                                        heads_q=8, heads_kv=2, head_dim=128, causal=True, dtype="bfloat16"),
          tier="large")
    b.add("large/varlen/window-softcap", Problem(seqlens_q=(257, 1025, 3), seqlens_k=(257, 1025, 3), heads_q=4,
                                                 heads_kv=4, head_dim=64, causal=True, window=(128, 0),
                                                 softcap=30.0, dtype="float16"), tier="large")
    b.add("large/bias/float+grad", Problem(batch=2, seqlen_q=512, seqlen_k=384, heads_q=4, heads_kv=4, head_dim=64,
                                           bias="float", bias_grad=True, dtype="float16"), tier="large")
    b.add("large/alibi/causal", Problem(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=8, heads_kv=8, head_dim=128,
                                        alibi="head", causal=True, dtype="bfloat16"), tier="large")
    _hopper_defaults(b)


def _hopper_defaults(b: _Builder):
    """GPU-only shapes on which the triton backend's ``auto`` takes its Hopper (Gluon) kernels
    (``gluon_fwd.AUTO_MIN_SEQLEN_Q`` / ``AUTO_TRAINING_MIN_SEQLEN_Q``, ``gluon_bwd.AUTO_MIN_SEQLEN`` /
    ``AUTO_GQA_MIN_SEQLEN``), so that the catalogue holds the kernels users get by default to the
    float64 reference, not only the portable ones; elsewhere they are ordinary large cases."""
    for d, s, causal, hq, hkv, dt in ((128, 1024, False, 4, 4, "bf16"), (128, 2048, True, 4, 4, "fp16"),
                                      (64, 4096, True, 2, 2, "bf16"), (128, 4096, True, 8, 2, "bf16"),
                                      (256, 1024, True, 2, 2, "bf16"), (256, 2048, False, 2, 2, "fp16"),
                                      (64, 8192, True, 1, 1, "bf16")):   # v6: D 64 causal, three consumers
        b.add(f"large/hopper/train-d{d}-s{s}{'-causal' if causal else ''}-h{hq}x{hkv}-{dt}",
              Problem(batch=1, seqlen_q=s, seqlen_k=s, heads_q=hq, heads_kv=hkv, head_dim=d, causal=causal,
                      dtype=_DT[dt]), tier="large")
    # the persistent variant's rows (gluon_fwd.AUTO_PERSISTENT) that no case above reaches: D 128
    # causal at 1k (training and not), D 64 from 2k (inference)
    b.add("large/hopper/train-d128-s1024-causal-h4x2-bf16",
          Problem(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=4, heads_kv=2, head_dim=128, causal=True,
                  dtype="bfloat16"), tier="large")
    for d, s, causal in ((128, 1024, False), (256, 1024, True), (256, 2048, False), (128, 1024, True),
                         (64, 4096, False)):
        b.add(f"large/hopper/infer-d{d}-s{s}{'-causal' if causal else ''}",
              Problem(batch=2, seqlen_q=s, seqlen_k=s, heads_q=4, heads_kv=2, head_dim=d, causal=causal,
                      dtype="bfloat16", grad=False), tier="large")
    # v7: D 64 causal inference from 8k runs the persistent kernel (three consumers, the grouped walk);
    # one batch entry and head, as v6's training case, so the float64 reference stays small
    b.add("large/hopper/infer-d64-s8192-causal-h1x1",
          Problem(batch=1, seqlen_q=8192, seqlen_k=8192, heads_q=1, heads_kv=1, head_dim=64, causal=True,
                  dtype="bfloat16", grad=False), tier="large")
    # v8: D 64 inference on the persistent kernel with two consumers (gluon_fwd.AUTO_TWO_CONSUMERS):
    # causal at 2k-8k, its walk unpaired (the training row is train-d64-s4096-causal above), and
    # non-causal at 512-2k
    b.add("large/hopper/infer-d64-s2048-causal-h2x1",
          Problem(batch=1, seqlen_q=2048, seqlen_k=2048, heads_q=2, heads_kv=1, head_dim=64, causal=True,
                  dtype="bfloat16", grad=False), tier="large")
    b.add("large/hopper/infer-d64-s1024-h4x2",
          Problem(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=4, heads_kv=2, head_dim=64, causal=False,
                  dtype="bfloat16", grad=False), tier="large")


def build_catalogue() -> list[Case]:
    """Every case of catalogue :data:`CATALOGUE_VERSION`, in a fixed order."""
    b = _Builder()
    for part in (_core, _windows, _softcap, _alibi, _bias, _gqa, _head_dims, _varlen, _layouts_and_values,
                 _masked_rows, _combos, _nonfinite, _large):
        part(b)
    return b.cases


def select_cases(*, quick: bool = False, patterns: list[str] | None = None) -> list[Case]:
    """The catalogue, or its quick subset, filtered by id substrings or globs (any match)."""
    import fnmatch
    cases = build_catalogue()
    if quick:
        cases = [c for c in cases if c.quick]
    if patterns:
        cases = [c for c in cases
                 if any(fnmatch.fnmatch(c.id, pat) if any(ch in pat for ch in "*?[") else pat in c.id
                        for pat in patterns)]
    return cases
