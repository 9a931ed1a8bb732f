"""The portattn ONNX ops ``portattn.FlashAttention``, ``portattn.FlashAttentionKVCache`` and
``portattn.FlashAttentionPagedKVCache`` (domain ``portattn``, version 1).

* :mod:`.schema` — the ``OpSchema``s (inputs, attributes, types) and :func:`register_schema`;
* :mod:`.function` — the ops' bodies, onnxscript functions sharing FlashAttention's tiled online
  softmax (helper functions ``FlashAttentionLoop`` — the key loop — and the stages it calls,
  ``FlashAttentionLayout``/``Block``/``Finish``);
* :mod:`.model` — the bodies as model-local functions, and one-node models of the ops;
* :mod:`.export` — translations of the torch ops ``portattn::attention`` and
  ``portattn::attention_with_kvcache`` for ``torch.onnx.export``;
* :mod:`.kvcache_op` — the functional torch op ``portattn::attention_with_kvcache`` that
  ``attention_with_kvcache`` calls under ``torch.export`` (torch only).

Importing this package needs ``onnx`` only for the functions that build protos; the submodules
that need onnxscript/onnxruntime import them when used.
"""

from .schema import (
    ALIGNMENT_CODES,
    ATTRIBUTES,
    DOMAIN,
    KV_ATTRIBUTES,
    KV_OP_NAME,
    NEUTRAL_DOC,
    OP_NAME,
    PAGED_KV_OP_NAME,
    VERSION,
    register_schema,
)

__all__ = ["ALIGNMENT_CODES", "ATTRIBUTES", "DOMAIN", "KV_ATTRIBUTES", "KV_OP_NAME", "NEUTRAL_DOC", "OP_NAME",
           "PAGED_KV_OP_NAME", "VERSION", "register_schema"]
