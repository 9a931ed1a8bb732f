"""Build ONNX models around the portattn ops: their function protos, and one-node models.

:func:`function_proto` gives the op's body as a model-local ``FunctionProto`` stamped with the
model's default opset (onnxruntime requires a local function to import the same ``""`` opset
version as the model); :func:`attach_function` adds it to any model that uses the op;
:func:`one_node_model` builds the model the ``onnx`` backend runs, with dynamic shapes.
"""

from __future__ import annotations

import functools
import re

from .schema import (
    ALIGNMENT_CODES,
    ATTRIBUTES,
    DOMAIN,
    KV_ATTRIBUTES,
    KV_OP_NAME,
    OP_NAME,
    PAGED_KV_OP_NAME,
    VERSION,
    register_schema,
)

#: the portattn ops whose functions :func:`attach_function` adds
OP_NAMES = (OP_NAME, KV_OP_NAME, PAGED_KV_OP_NAME)

#: Default ONNX opset of exported models (23: the first with the standard ``Attention`` op).
DEFAULT_OPSET = 23
#: The IR version written (10: onnxruntime >= 1.20 reads it; onnx 1.16+ writes it).
IR_VERSION = 10


@functools.cache
def _function_bytes(name: str, opset: int) -> bytes:
    from . import function

    fn = function.OPS.get(name) or {h.name: h for h in function.HELPERS + function.KV_HELPERS}[name]
    proto = _canonical(fn.to_function_proto())
    for imp in proto.opset_import:
        if imp.domain == "":
            imp.version = opset
    return proto.SerializeToString()


_SUFFIX = re.compile(r"_\d+$")


def _canonical(proto):
    """``proto`` with the same computation in the same bytes in every process: onnxscript orders a
    ``Loop``'s carried values and an ``If``'s outputs by iterating a set of variable names, so their
    order, and the numbers its value names get, follow ``PYTHONHASHSEED`` (one export, different
    bytes per process). Each ``Loop``'s carried values (its inputs, its outputs, its body's inputs
    and outputs alike) and each ``If``'s outputs (with both branches' outputs) are put in name
    order, so each value still pairs with its own; then every value the function defines is
    renumbered in order of definition. Names of the function's inputs and outputs stay."""
    keep = set(proto.input) | set(proto.output)
    new_names: dict[str, str] = {}

    def name(old: str) -> str:
        if not old or old in keep:
            return old
        if old not in new_names:
            new_names[old] = f"{_SUFFIX.sub('', old)}_{len(new_names)}"
        return new_names[old]

    def permute(seq, at: int, order: list) -> None:
        if not order:
            return
        if isinstance(seq[0], str):
            seq[at:at + len(order)] = [seq[at + i] for i in order]
            return
        items = [type(seq[0])() for _ in order]
        for k, i in enumerate(order):
            items[k].CopyFrom(seq[at + i])
        for k, item in enumerate(items):
            seq[at + k].CopyFrom(item)

    def by_name(names) -> list:
        return sorted(range(len(names)), key=lambda i: _SUFFIX.sub("", names[i]))

    def sort_control_flow(node) -> None:
        graphs = {a.name: a.g for a in node.attribute if a.HasField("g")}
        if node.op_type == "Loop":   # carried values: inputs[2:], the first outputs, body inputs[2:], outputs[1:]
            order = by_name(node.input[2:])
            permute(node.input, 2, order)
            permute(node.output, 0, order)
            permute(graphs["body"].input, 2, order)
            permute(graphs["body"].output, 1, order)
        elif node.op_type == "If":   # the outputs and each branch's outputs alike
            order = by_name(node.output)
            permute(node.output, 0, order)
            for g in graphs.values():
                permute(g.output, 0, order)

    def walk(nodes, graph_inputs=()) -> None:
        for vi in graph_inputs:
            vi.name = name(vi.name)
        for node in nodes:
            if node.domain == "" and node.op_type in ("Loop", "If"):
                sort_control_flow(node)
            node.input[:] = [name(x) for x in node.input]
            for attr in node.attribute:
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    walk(g.node, g.input)
                    for vi in g.output:
                        vi.name = name(vi.name)
            node.output[:] = [name(x) for x in node.output]

    walk(proto.node)
    return proto


def _check_opset(opset: int) -> None:
    if not 18 <= opset <= 23:
        raise ValueError(f"opset={opset} is not supported by the portattn op; use 18..23")


def function_proto(opset: int = DEFAULT_OPSET, name: str = OP_NAME):
    """The body of ``portattn.<name>`` (``FlashAttention``, ``FlashAttentionKVCache`` or one of
    the helpers they call) as a ``FunctionProto`` importing opset ``opset``.

    The bodies only use operators whose semantics are unchanged from opset 18 to 23.
    """
    import onnx

    _check_opset(opset)
    proto = onnx.FunctionProto()
    proto.ParseFromString(_function_bytes(name, opset))
    return proto


def function_protos(opset: int = DEFAULT_OPSET, names=OP_NAMES) -> list:
    """The functions a model using the ops ``names`` must carry: the shared helpers (and the
    KV-cache helpers when a KV-cache op is among them), then the ops."""
    from . import function

    _check_opset(opset)
    helpers = list(function.HELPERS)
    if any(n != OP_NAME for n in names):
        helpers += function.KV_HELPERS
    return [function_proto(opset, n) for n in [h.name for h in helpers] + list(names)]


def attach_function(model) -> None:
    """Add the functions of the portattn ops ``model`` uses (and the ``portattn`` opset import) to
    it in place, those it does not carry yet."""
    used = [name for name in OP_NAMES
            if any(n.domain == DOMAIN and n.op_type == name for n in model.graph.node)]
    if not used:
        return
    opset = next((imp.version for imp in model.opset_import if imp.domain == ""), DEFAULT_OPSET)
    have = {(f.domain, f.name) for f in model.functions}
    for proto in function_protos(opset, used):
        if (proto.domain, proto.name) not in have:
            model.functions.append(proto)
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


def _checked_model(node, graph_name: str, inputs: list, outputs: list, opset: int):
    """The model of the graph ``graph_name`` holding ``node`` alone (``inputs``/``outputs``: its
    value infos), importing opset ``opset`` and the portattn domain, with the functions of the
    portattn ops attached, checked with ``onnx.checker`` (``full_check``)."""
    import onnx
    from onnx import helper

    graph = helper.make_graph([node], graph_name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(DOMAIN, VERSION)],
                              producer_name="portattn", ir_version=IR_VERSION)
    attach_function(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def one_node_model(*, dtype: str, bias_dtype: str, attributes: dict, opset: int = DEFAULT_OPSET,
                   with_lse: bool = True, packed_heads: bool = False):
    """A model holding a single ``FlashAttention`` node with dynamic shapes.

    ``dtype``/``bias_dtype`` are ONNX element type names (``"float"``, ``"float16"``,
    ``"bfloat16"``); inputs are named Q, K, V, bias, mask, alibi_slopes, outputs Y (and LSE).
    ``packed_heads=True`` declares Q, K, V as 3-D ``(B, S, H·D)`` (then the attributes
    ``q_num_heads`` and ``kv_num_heads`` must be given).
    """
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
    return _checked_model(node, "portattn_flash_attention", inputs, outputs, opset)


def kv_attribute_values(*, scale: float, causal: bool = False, alignment: str = "bottom_right",
                        window_left: int | None = None, window_right: int | None = None,
                        softcap: float | None = None, block_size: int = 256) -> dict:
    """Attributes of a ``FlashAttentionKVCache`` node from portattn's arguments."""
    values = attribute_values(scale=scale, causal=causal, alignment=alignment, window_left=window_left,
                              window_right=window_right, softcap=softcap, block_size=block_size)
    return {name: values[name] for name in KV_ATTRIBUTES}


def kv_one_node_model(*, dtype: str, attributes: dict, opset: int = DEFAULT_OPSET, with_lse: bool = True,
                      seqlens_dtype: str = "int32", paged: bool = False):
    """A model holding a single ``FlashAttentionKVCache`` (``paged``: ``FlashAttentionPagedKVCache``)
    node with dynamic shapes.

    Inputs Q, K_cache, V_cache, K_new, V_new, cache_seqlens, (block_table, int32,) alibi_slopes;
    outputs Y, K_present, V_present (and LSE). ``dtype`` is the element type name of Q and the caches.
    """
    from onnx import TensorProto, helper

    register_schema()
    unknown = set(attributes) - set(KV_ATTRIBUTES)
    if unknown:
        raise ValueError(f"unknown {KV_OP_NAME} attribute(s) {sorted(unknown)}; known: {sorted(KV_ATTRIBUTES)}")
    elem = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
    lens = {"int32": TensorProto.INT32, "int64": TensorProto.INT64}
    if dtype not in elem:
        raise ValueError(f"dtype={dtype!r}: the op supports {sorted(elem)}")
    if seqlens_dtype not in lens:
        raise ValueError(f"seqlens_dtype={seqlens_dtype!r}: the op supports {sorted(lens)}")
    t = elem[dtype]
    rows = ["num_pages", "page_size"] if paged else ["B", "S_max"]
    inputs = [
        helper.make_tensor_value_info("Q", t, ["B", "Sq", "Hq", "D"]),
        helper.make_tensor_value_info("K_cache", t, [*rows, "Hkv", "D"]),
        helper.make_tensor_value_info("V_cache", t, [*rows, "Hkv", "Dv"]),
        helper.make_tensor_value_info("K_new", t, ["B", "Sk_new", "Hkv", "D"]),
        helper.make_tensor_value_info("V_new", t, ["B", "Sk_new", "Hkv", "Dv"]),
        helper.make_tensor_value_info("cache_seqlens", lens[seqlens_dtype], ["B"]),
        *([helper.make_tensor_value_info("block_table", TensorProto.INT32, ["B", "max_pages"])] if paged else []),
        helper.make_tensor_value_info("alibi_slopes", TensorProto.FLOAT, ["aB", "aH"]),
    ]
    outputs = [helper.make_tensor_value_info("Y", t, ["B", "Sq", "Hq", "Dv"]),
               helper.make_tensor_value_info("K_present", t, [*rows, "Hkv", "D"]),
               helper.make_tensor_value_info("V_present", t, [*rows, "Hkv", "Dv"])]
    if with_lse:
        outputs.append(helper.make_tensor_value_info("LSE", TensorProto.FLOAT, ["B", "Hq", "Sq"]))
    node = helper.make_node(PAGED_KV_OP_NAME if paged else KV_OP_NAME, [i.name for i in inputs], [o.name for o in outputs],
                            domain=DOMAIN, name="attention_with_kvcache", **attributes)
    return _checked_model(node, "portattn_flash_attention_kvcache", inputs, outputs, opset)
