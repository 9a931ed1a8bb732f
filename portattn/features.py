"""The one vocabulary of optional attention features.

A backend declares the subset it supports (``Backend.features``); :class:`~portattn.spec.AttentionSpec`
reports the subset a problem uses (``spec.features()``); the conformance catalogue tags its cases
with the same names. Registration rejects a backend that declares a name not listed here, so a
typo cannot silently read as "unsupported".
"""

from __future__ import annotations

CAUSAL = "causal"          # causal masking (window right = 0)
TOP_LEFT = "top_left"      # causal/window aligned top-left (SDPA's convention) instead of bottom-right
WINDOW = "window"          # sliding window (left, right)
SOFTCAP = "softcap"        # c * tanh(s / c)
ALIBI = "alibi"            # ALiBi slopes (Hq,) or (B, Hq)
BIAS = "bias"              # additive float attn_bias
BOOL_MASK = "bool_mask"    # boolean attn_bias (True = keep)
BIAS_GRAD = "bias_grad"    # gradient with respect to a float attn_bias
VARLEN = "varlen"          # packed sequences with cu_seqlens
GQA = "gqa"                # Hq != Hkv
HEAD_DIM_V = "head_dim_v"  # head_dim of v differs from q/k

#: name -> one-line meaning (``portattn info`` and docs/backends.md list these).
FEATURES = {
    CAUSAL: "causal masking (window right = 0)",
    TOP_LEFT: "causal/window aligned top-left (SDPA's convention) instead of bottom-right",
    WINDOW: "sliding window (left, right)",
    SOFTCAP: "softcap: c * tanh(s / c)",
    ALIBI: "ALiBi slopes (Hq,) or (B, Hq)",
    BIAS: "additive float attn_bias",
    BOOL_MASK: "boolean attn_bias (True = keep)",
    BIAS_GRAD: "gradient with respect to a float attn_bias",
    VARLEN: "packed sequences with cu_seqlens",
    GQA: "grouped-query attention (Hq != Hkv)",
    HEAD_DIM_V: "head_dim of v differs from q/k",
}

ALL_FEATURES = frozenset(FEATURES)


def check_feature_names(names, owner: str) -> frozenset:
    """``names`` as a frozenset; ``ValueError`` naming ``owner`` for any name not in the vocabulary."""
    names = frozenset(names)
    unknown = names - ALL_FEATURES
    if unknown:
        raise ValueError(f"{owner} declares unknown feature name(s) {sorted(unknown)}; "
                         f"the known features are: {', '.join(sorted(ALL_FEATURES))}")
    return names
