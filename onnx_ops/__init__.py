"""The portattn ONNX op ``portattn.FlashAttention`` (domain ``portattn``, version 1).

* :mod:`.schema` — the ``OpSchema`` (inputs, attributes, types) and :func:`register_schema`;
* :mod:`.function` — the op's body, an onnxscript function: FlashAttention's tiled online softmax;
* :mod:`.model` — the body as a model-local function, and one-node models of the op;
* :mod:`.export` — translations of the torch op ``portattn::attention`` for ``torch.onnx.export``.

Importing this package needs ``onnx`` only for the functions that build protos; the submodules
that need onnxscript/onnxruntime import them when used.
"""

from .schema import ALIGNMENT_CODES, ATTRIBUTES, DOMAIN, NEUTRAL_DOC, OP_NAME, VERSION, register_schema

__all__ = ["ALIGNMENT_CODES", "ATTRIBUTES", "DOMAIN", "NEUTRAL_DOC", "OP_NAME", "VERSION", "register_schema"]
