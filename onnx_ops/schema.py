"""The ONNX schema of ``portattn.FlashAttention`` (domain ``portattn``, version 1).

The op computes ``softmax(scale · Q Kᵀ + bias) V`` exactly (DESIGN.md §2) with FlashAttention's
tiled online softmax; its body is the ONNX function in :mod:`portattn.onnx_ops.function`.

Inputs (all required; an unused feature gets a *neutral* tensor, see :data:`NEUTRAL_DOC`):

====================  ==========================================  ===============================
``Q``                 ``(B, Sq, Hq, D)``                           float16 / bfloat16 / float32
``K``                 ``(B, Sk, Hkv, D)``                          same type as Q
``V``                 ``(B, Sk, Hkv, Dv)``                         same type as Q
``bias``              4-D, broadcastable to ``(B, Hq, Sq, Sk)``    float types (additive; ``-inf``
                                                                   masks)
``mask``              4-D bool, broadcastable to ``(B, Hq, Sq, Sk)`` True = keep
``alibi_slopes``      ``(B, Hq)``, ``(1, Hq)`` or ``(1, 1)``        float32
====================  ==========================================  ===============================

Outputs: ``Y (B, Sq, Hq, Dv)`` in Q's type; ``LSE (B, Hq, Sq)`` float32 (natural log, ``-inf``
for rows with no visible key, whose ``Y`` is 0) — optional.

Why required inputs with neutral values instead of optional inputs: onnxruntime inlines a
model-local function by substituting an empty name for a missing input, and then rejects any
node of the body that reads it, even inside an ``If`` branch that is never taken. A zero bias,
an all-True mask and zero slopes are detected once per call and skip their stage entirely, so
they cost nothing inside the loop.
"""

from __future__ import annotations

DOMAIN = "portattn"
OP_NAME = "FlashAttention"
VERSION = 1

#: The int codes of the ``alignment`` attribute.
ALIGNMENT_CODES = {"bottom_right": 0, "top_left": 1}

#: Attribute name -> (python type, default, doc). Order is the order of the onnxscript signature.
ATTRIBUTES = {
    "scale": (float, 1.0, "multiplier of Q·Kᵀ (portattn passes 1/sqrt(D) by default)"),
    "causal": (int, 0, "1 = causal: key j is visible only up to the aligned row (window right = 0)"),
    "alignment": (int, 0, "0 = bottom-right (i' = i + Sk - Sq, flash-attn), 1 = top-left (i' = i, SDPA)"),
    "window_left": (int, -1, "keys with j < i' - window_left are masked; -1 = unbounded"),
    "window_right": (int, -1, "keys with j > i' + window_right are masked; -1 = unbounded (causal forces 0)"),
    "softcap": (float, 0.0, "> 0: scores become softcap · tanh(score / softcap); 0 = off"),
    "q_num_heads": (int, 0, "query heads; 0 = read from Q's 4-D shape (>0 also accepts (B, Sq, Hq·D))"),
    "kv_num_heads": (int, 0, "key/value heads (GQA: Hq % Hkv == 0); 0 = read from K's 4-D shape"),
    "block_size": (int, 256, "keys per tile of the online softmax; peak memory grows as Sq·block_size"),
}

NEUTRAL_DOC = ("neutral values for unused inputs: bias = float32 zeros of shape (1, 1, 1, 1), "
               "mask = bool True of shape (1, 1, 1, 1), alibi_slopes = float32 zeros of shape (1, 1)")

_DOC = __doc__


def op_schema():
    """Build the :class:`onnx.defs.OpSchema` (not registered)."""
    from onnx import AttributeProto
    from onnx.defs import OpSchema

    P = OpSchema.FormalParameter
    attr_types = {float: AttributeProto.FLOAT, int: AttributeProto.INT}
    attributes = [OpSchema.Attribute(name, attr_types[typ], doc, required=False)
                  for name, (typ, _default, doc) in ATTRIBUTES.items()]
    single = OpSchema.FormalParameterOption.Single
    optional = OpSchema.FormalParameterOption.Optional
    return OpSchema(
        OP_NAME, DOMAIN, VERSION, _DOC,
        inputs=[
            P("Q", "T", "queries (B, Sq, Hq, D)", param_option=single),
            P("K", "T", "keys (B, Sk, Hkv, D)", param_option=single),
            P("V", "T", "values (B, Sk, Hkv, Dv)", param_option=single),
            P("bias", "T_BIAS", "additive bias, 4-D broadcastable to (B, Hq, Sq, Sk); " + NEUTRAL_DOC,
              param_option=single),
            P("mask", "T_MASK", "bool mask (True = keep), 4-D broadcastable to (B, Hq, Sq, Sk)",
              param_option=single),
            P("alibi_slopes", "T_SLOPES", "ALiBi slopes (B, Hq), (1, Hq) or (1, 1)", param_option=single),
        ],
        outputs=[
            P("Y", "T", "attention output (B, Sq, Hq, Dv)", param_option=single),
            P("LSE", "T_LSE", "log-sum-exp of the scores (B, Hq, Sq), -inf for fully-masked rows",
              param_option=optional),
        ],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "Q, K, V and Y"),
            ("T_BIAS", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "additive bias"),
            ("T_MASK", ["tensor(bool)"], "boolean mask"),
            ("T_SLOPES", ["tensor(float)"], "ALiBi slopes"),
            ("T_LSE", ["tensor(float)"], "log-sum-exp"),
        ],
        attributes=attributes,
    )


def register_schema() -> bool:
    """Register the schema with ``onnx.defs`` once per process; True if this call registered it."""
    import onnx.defs

    if onnx.defs.has(OP_NAME, VERSION, DOMAIN):
        return False
    try:
        onnx.defs.register_schema(op_schema())
    except Exception:
        if onnx.defs.has(OP_NAME, VERSION, DOMAIN):   # registered concurrently
            return False
        raise
    return True
