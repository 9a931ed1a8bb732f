"""The ONNX schemas of ``portattn.FlashAttention`` and ``portattn.FlashAttentionKVCache`` (domain
``portattn``, version 1; the KV-cache op is described by :data:`KV_DOC`).

The op computes ``softmax(scale · Q Kᵀ + bias) V`` exactly (docs/semantics.md) with FlashAttention's
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


def _schema_attributes(table: dict) -> list:
    """The optional ``OpSchema.Attribute``s of an attribute table (:data:`ATTRIBUTES` or
    :data:`KV_ATTRIBUTES`: name -> (python type, default, doc))."""
    from onnx import AttributeProto
    from onnx.defs import OpSchema

    attr_types = {float: AttributeProto.FLOAT, int: AttributeProto.INT}
    return [OpSchema.Attribute(name, attr_types[typ], doc, required=False)
            for name, (typ, _default, doc) in table.items()]


def op_schema():
    """Build the :class:`onnx.defs.OpSchema` (not registered)."""
    from onnx.defs import OpSchema

    P = OpSchema.FormalParameter
    attributes = _schema_attributes(ATTRIBUTES)
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
    """Register the schemas of ``FlashAttention`` and ``FlashAttentionKVCache`` with ``onnx.defs``
    once per process; True if this call registered one."""
    import onnx.defs

    registered = False
    for name, build in SCHEMAS.items():
        if onnx.defs.has(name, VERSION, DOMAIN):
            continue
        try:
            onnx.defs.register_schema(build())
        except Exception:
            if onnx.defs.has(name, VERSION, DOMAIN):   # registered concurrently
                continue
            raise
        registered = True
    return registered


# ----- portattn.FlashAttentionKVCache ------------------------------------------------------------

KV_OP_NAME = "FlashAttentionKVCache"
PAGED_KV_OP_NAME = "FlashAttentionPagedKVCache"

#: Attributes of the KV-cache op (a subset of :data:`ATTRIBUTES`: heads come from the 4-D shapes).
KV_ATTRIBUTES = {name: ATTRIBUTES[name] for name in
                 ("scale", "causal", "alignment", "window_left", "window_right", "softcap", "block_size")}

KV_DOC = """Attention of new queries against a KV cache with per-sequence lengths (decoding).

flash-attn's ``flash_attn_with_kvcache`` without the in-place write: ``K_new``/``V_new`` are
written into copies of the caches at each sequence's ``cache_seqlens[b]`` (outputs
``K_present``/``V_present``; a runtime may bind them to the input buffers, see docs/onnx.md),
then the queries of sequence ``b`` attend to its first ``L_b = cache_seqlens[b] + Sk_new`` keys
of the updated cache, with ``Sk = L_b`` in the score of docs/semantics.md (bottom-right causal aligns
query ``i`` to key ``i + L_b - Sq``; ALiBi uses ``|i + L_b - Sq - j|``). Cache slots at or beyond
``L_b`` never reach ``Y`` (NaN there is harmless). Lengths are clamped into ``[0, S_max]``; new
keys beyond the capacity are dropped and ``L_b`` is clamped to ``S_max``.

====================  ==========================================  ===============================
``Q``                 ``(B, Sq, Hq, D)``                           float16 / bfloat16 / float32
``K_cache``           ``(B, S_max, Hkv, D)``                       same type as Q
``V_cache``           ``(B, S_max, Hkv, Dv)``                      same type as Q
``K_new``             ``(B, Sk_new, Hkv, D)`` (``Sk_new`` may be 0) same type as Q
``V_new``             ``(B, Sk_new, Hkv, Dv)``                     same type as Q
``cache_seqlens``     ``(B,)``                                     int32 or int64
``alibi_slopes``      ``(B, Hq)``, ``(1, Hq)`` or ``(1, 1)``        float32 (zeros: no ALiBi)
====================  ==========================================  ===============================

Outputs: ``Y (B, Sq, Hq, Dv)`` in Q's type; ``K_present``/``V_present`` shaped like the caches;
``LSE (B, Hq, Sq)`` float32 (optional; ``-inf`` for rows with no visible key, whose ``Y`` is 0).
"""

PAGED_KV_DOC = """``FlashAttentionKVCache`` on a paged cache: ``K_cache``/``V_cache`` are a pool of pages
``(num_pages, page_size, Hkv, D/Dv)`` shared by all sequences, and ``block_table`` int32/int64
``(B, max_pages)`` lists each sequence's pages in order: position ``p`` of sequence ``b`` is row
``p % page_size`` of page ``block_table[b, p // page_size]`` (the capacity of a sequence is
``max_pages · page_size``; page ids are clamped into ``[0, num_pages)``). Inputs Q, K_cache,
V_cache, K_new, V_new, cache_seqlens, block_table, alibi_slopes; outputs and attributes as
``FlashAttentionKVCache`` (the present caches are the updated page pools). Only the pages holding
positions some query can see are gathered.
"""


def kv_op_schema(paged: bool = False):
    """Build the :class:`onnx.defs.OpSchema` of ``FlashAttentionKVCache`` (or, ``paged=True``,
    ``FlashAttentionPagedKVCache``); not registered."""
    from onnx.defs import OpSchema

    P = OpSchema.FormalParameter
    attributes = _schema_attributes(KV_ATTRIBUTES)
    single = OpSchema.FormalParameterOption.Single
    optional = OpSchema.FormalParameterOption.Optional
    cache = "(num_pages, page_size, Hkv, {})" if paged else "(B, S_max, Hkv, {})"
    table = [P("block_table", "T_TABLE", "each sequence's page ids in order (B, max_pages)", param_option=single)]
    return OpSchema(
        PAGED_KV_OP_NAME if paged else KV_OP_NAME, DOMAIN, VERSION, PAGED_KV_DOC if paged else KV_DOC,
        inputs=[
            P("Q", "T", "queries (B, Sq, Hq, D)", param_option=single),
            P("K_cache", "T", "key cache " + cache.format("D"), param_option=single),
            P("V_cache", "T", "value cache " + cache.format("Dv"), param_option=single),
            P("K_new", "T", "new keys (B, Sk_new, Hkv, D), written at cache_seqlens", param_option=single),
            P("V_new", "T", "new values (B, Sk_new, Hkv, Dv)", param_option=single),
            P("cache_seqlens", "T_LEN", "each sequence's cache length before the append (B,)",
              param_option=single),
            *(table if paged else []),
            P("alibi_slopes", "T_SLOPES", "ALiBi slopes (B, Hq), (1, Hq) or (1, 1); zeros = off",
              param_option=single),
        ],
        outputs=[
            P("Y", "T", "attention output (B, Sq, Hq, Dv)", param_option=single),
            P("K_present", "T", "the key cache after the append " + cache.format("D"), param_option=single),
            P("V_present", "T", "the value cache after the append " + cache.format("Dv"), param_option=single),
            P("LSE", "T_LSE", "log-sum-exp of the scores (B, Hq, Sq), -inf for rows with no visible key",
              param_option=optional),
        ],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "queries, caches and Y"),
            ("T_LEN", ["tensor(int32)", "tensor(int64)"], "cache lengths"),
            *([("T_TABLE", ["tensor(int32)", "tensor(int64)"], "page ids")] if paged else []),
            ("T_SLOPES", ["tensor(float)"], "ALiBi slopes"),
            ("T_LSE", ["tensor(float)"], "log-sum-exp"),
        ],
        attributes=attributes,
    )


#: op name -> schema builder, for :func:`register_schema`
SCHEMAS = {OP_NAME: op_schema, KV_OP_NAME: kv_op_schema, PAGED_KV_OP_NAME: lambda: kv_op_schema(paged=True)}
