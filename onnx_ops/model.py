"""Build ONNX models around ``portattn.FlashAttention``: the function proto, and one-node models.

:func:`function_proto` gives the op's body as a model-local ``FunctionProto`` stamped with the
model's default opset (onnxruntime requires a local function to import the same ``""`` opset
version as the model); :func:`attach_function` adds it to any model that uses the op;
:func:`one_node_model` builds the model the ``onnx`` backend runs, with dynamic shapes.
"""

from __future__ import annotations

import functools

from .schema import ALIGNMENT_CODES, ATTRIBUTES, DOMAIN, OP_NAME, VERSION, register_schema

#: Default ONNX opset of exported models (23: the first with the standard ``Attention`` op).
DEFAULT_OPSET = 23
#: The IR version written (10: onnxruntime >= 1.20 reads it; onnx 1.16+ writes it).
IR_VERSION = 10


@functools.cache
def _function_bytes(opset: int) -> bytes:
    from . import function

    proto = function.FlashAttention.to_function_proto()
    for imp in proto.opset_import:
        if imp.domain == "":
            imp.version = opset
    return proto.SerializeToString()


def function_proto(opset: int = DEFAULT_OPSET):
    """The body of ``portattn.FlashAttention`` as a ``FunctionProto`` importing opset ``opset``.

    The body only uses operators whose semantics are unchanged from opset 18 to 23.
    """
    import onnx

    if not 18 <= opset <= 23:
        raise ValueError(f"opset={opset} is not supported by the portattn op; use 18..23")
    proto = onnx.FunctionProto()
    proto.ParseFromString(_function_bytes(opset))
    return proto


def attach_function(model) -> None:
    """Add the op's function (and the ``portattn`` opset import) to ``model`` in place, if it
    uses the op and does not carry the function yet."""
    uses = any(n.domain == DOMAIN and n.op_type == OP_NAME for n in model.graph.node)
    if not uses:
        return
    opset = next((imp.version for imp in model.opset_import if imp.domain == ""), DEFAULT_OPSET)
    if not any(f.domain == DOMAIN and f.name == OP_NAME for f in model.functions):
        model.functions.append(function_proto(opset))
    if not any(imp.domain == DOMAIN for imp in model.opset_import):
        imp = model.opset_import.add()
        imp.domain, imp.version = DOMAIN, VERSION
    if model.ir_version < IR_VERSION:
        model.ir_version = IR_VERSION


def attribute_values(*, scale: float, causal: bool = False, alignment: str = "bottom_right",
                     window_left: int | None = None, window_right: int | None = None,
                     softcap: float | None = None, block_size: int = 256) -> dict:
    """Node attributes from portattn's arguments (None = unbounded / off)."""
    if alignment not in ALIGNMENT_CODES:
        raise ValueError(f"alignment={alignment!r}: use one of {sorted(ALIGNMENT_CODES)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1")
    return {
        "scale": float(scale),
        "causal": int(bool(causal)),
        "alignment": ALIGNMENT_CODES[alignment],
        "window_left": -1 if window_left is None else int(window_left),
        "window_right": 0 if causal else (-1 if window_right is None else int(window_right)),
        "softcap": float(softcap or 0.0),
        "block_size": int(block_size),
    }


def one_node_model(*, dtype: str, bias_dtype: str, attributes: dict, opset: int = DEFAULT_OPSET,
                   with_lse: bool = True, packed_heads: bool = False):
    """A model holding a single ``FlashAttention`` node with dynamic shapes.

    ``dtype``/``bias_dtype`` are ONNX element type names (``"float"``, ``"float16"``,
    ``"bfloat16"``); inputs are named Q, K, V, bias, mask, alibi_slopes, outputs Y (and LSE).
    ``packed_heads=True`` declares Q, K, V as 3-D ``(B, S, H·D)`` (then the attributes
    ``q_num_heads`` and ``kv_num_heads`` must be given).
    """
    import onnx
    from onnx import TensorProto, helper

    register_schema()
    unknown = set(attributes) - set(ATTRIBUTES)
    if unknown:
        raise ValueError(f"unknown FlashAttention attribute(s) {sorted(unknown)}; known: {sorted(ATTRIBUTES)}")
    elem = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
    for label, name in (("dtype", dtype), ("bias_dtype", bias_dtype)):
        if name not in elem:
            raise ValueError(f"{label}={name!r}: the op supports {sorted(elem)}")
    t, tb = elem[dtype], elem[bias_dtype]
    if packed_heads and not (attributes.get("q_num_heads", 0) > 0 and attributes.get("kv_num_heads", 0) > 0):
        raise ValueError("packed_heads=True needs the attributes q_num_heads and kv_num_heads (> 0)")
    heads = (lambda h, d: [h + "·" + d]) if packed_heads else (lambda h, d: [h, d])
    inputs = [
        helper.make_tensor_value_info("Q", t, ["B", "Sq", *heads("Hq", "D")]),
        helper.make_tensor_value_info("K", t, ["B", "Sk", *heads("Hkv", "D")]),
        helper.make_tensor_value_info("V", t, ["B", "Sk", *heads("Hkv", "Dv")]),
        helper.make_tensor_value_info("bias", tb, ["bB", "bH", "bSq", "bSk"]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["mB", "mH", "mSq", "mSk"]),
        helper.make_tensor_value_info("alibi_slopes", TensorProto.FLOAT, ["aB", "aH"]),
    ]
    outputs = [helper.make_tensor_value_info("Y", t, ["B", "Sq", "Hq", "Dv"])]
    if with_lse:
        outputs.append(helper.make_tensor_value_info("LSE", TensorProto.FLOAT, ["B", "Hq", "Sq"]))
    node = helper.make_node(OP_NAME, [i.name for i in inputs], [o.name for o in outputs],
                            domain=DOMAIN, name="attention", **attributes)
    graph = helper.make_graph([node], "portattn_flash_attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(DOMAIN, VERSION)],
                              producer_name="portattn", ir_version=IR_VERSION)
    attach_function(model)
    onnx.checker.check_model(model, full_check=True)
    return model
