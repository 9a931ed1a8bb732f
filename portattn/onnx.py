"""Export PyTorch models that call :func:`portattn.attention` to ONNX.

>>> import portattn.onnx
>>> portattn.onnx.export(model, (tokens,), "model.onnx", target="portattn",
...                      dynamic_shapes={"tokens": {0: "batch", 1: "seq"}})

Every ``portattn.attention`` call becomes exactly one fused node:

* ``target="portattn"`` (default): ``portattn.FlashAttention`` (domain ``portattn``, version 1),
  whose body — FlashAttention's tiled online softmax, peak memory ∝ ``Sq·block_size`` — travels
  with the model as a local function, so onnxruntime (or any runtime that inlines functions)
  runs it without a plugin. Every feature of docs/semantics.md except varlen.
* ``target="standard"``: the ONNX ``Attention`` operator (opset 23). Bottom-right causal
  alignment and sliding windows become an explicit boolean mask input; ALiBi, varlen and
  ``return_lse=True`` raise :class:`UnsupportedFeatureError` naming the feature.

Every :func:`portattn.kvcache.attention_with_kvcache` call (KV cache with per-sequence lengths)
becomes one ``portattn.FlashAttentionKVCache`` node (``FlashAttentionPagedKVCache`` with a
``block_table``) whose outputs include the updated caches (``target="portattn"`` only), so an exported decoder generates in
onnxruntime by feeding its present caches back as past (docs/onnx.md, "KV cache").

This module imports onnx/onnxscript only when :func:`export` is called; ``import portattn``
never imports them. See docs/onnx.md.
"""

from __future__ import annotations

TARGETS = ("portattn", "standard")


def _unsupported_cause(exc: BaseException):
    from portattn.onnx_ops.export import UnsupportedFeatureError

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UnsupportedFeatureError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _warn_dropped_cache_updates(program) -> None:
    """ONNX graphs have no in-place updates: an input the model updates in place (a KV cache written
    by ``attention_with_kvcache``) but does not return loses the update in the exported model."""
    import warnings

    from torch.export.graph_signature import OutputKind

    exported = getattr(program, "exported_program", None)
    if exported is None:
        return
    specs = exported.graph_signature.output_specs
    returned = {getattr(s.arg, "name", None) for s in specs if s.kind == OutputKind.USER_OUTPUT}
    dropped = [s.target for s in specs
               if s.kind == OutputKind.USER_INPUT_MUTATION and getattr(s.arg, "name", None) not in returned]
    if dropped:
        warnings.warn(f"the model updates its input(s) {', '.join(map(repr, dropped))} in place (e.g. a KV cache "
                      f"written by attention_with_kvcache) but does not return them: the exported ONNX model has "
                      f"no output carrying the update; return the updated caches from forward() to get "
                      f"present-key/value outputs (docs/onnx.md, 'KV cache')", UserWarning, stacklevel=3)


def export(model, args, path=None, *, target: str = "portattn", dynamic_shapes=None, opset: int = 23,
           block_size: int = 256, kwargs: dict | None = None, check: bool = True, **export_kwargs):
    """Export ``model(*args, **kwargs)`` to ONNX with one fused node per ``portattn.attention`` call.

    Args:
        model: a ``torch.nn.Module`` (or a callable ``torch.export`` accepts).
        args: tuple of example inputs.
        path: where to save the ``.onnx`` file (None: do not save).
        target: ``"portattn"`` (the ``portattn.FlashAttention`` op, every feature but varlen) or
            ``"standard"`` (ONNX ``Attention``, opset 23; no ALiBi, no return_lse).
        dynamic_shapes: as for ``torch.export``/``torch.onnx.export``, e.g.
            ``{"x": {0: "batch", 1: "seq"}}``.
        opset: default ONNX opset of the model (18..23 for "portattn"; 23 for "standard").
        block_size: keys per tile of the portattn op (its ``block_size`` attribute).
        check: run ``onnx.checker.check_model(full_check=True)`` on the result.
        **export_kwargs: passed to ``torch.onnx.export``.

    Returns:
        the ``onnx.ModelProto``.

    Raises:
        UnsupportedFeatureError (a ``ValueError``): a call uses a feature the target cannot
        express (the message names it and what to do instead).
    """
    import onnx
    import torch

    import portattn.api  # noqa: F401  (defines torch.ops.portattn.attention)
    from portattn.onnx_ops import export as translations
    from portattn.onnx_ops.model import attach_function

    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not supported; use one of {TARGETS}")
    if target == "standard" and opset < 23:
        raise ValueError(f"target='standard' emits ONNX Attention, which needs opset >= 23 (got opset={opset})")
    if target == "portattn" and not 18 <= opset <= 23:
        raise ValueError(f"target='portattn' supports opset 18..23 (got opset={opset})")
    if "dynamo" in export_kwargs and not export_kwargs.pop("dynamo"):
        raise ValueError("portattn.onnx.export needs the dynamo exporter (dynamo=True)")

    from portattn.onnx_ops import kvcache_op  # noqa: F401  (defines torch.ops.portattn.attention_with_kvcache)

    if target == "portattn":
        translation = translations.make_portattn_translation(block_size)
        kv_translation = translations.make_kvcache_translation(block_size)
    else:
        translation = translations.make_standard_translation()
        kv_translation = translations.make_standard_kvcache_translation()
    table = {torch.ops.portattn.attention.default: translation,
             torch.ops.portattn.attention_with_kvcache.default: kv_translation}
    try:
        program = torch.onnx.export(model, tuple(args), kwargs=kwargs, dynamo=True, opset_version=opset,
                                    dynamic_shapes=dynamic_shapes, custom_translation_table=table,
                                    **export_kwargs)
    except Exception as exc:
        cause = _unsupported_cause(exc)
        if cause is not None:
            raise type(cause)(str(cause)) from exc
        raise
    _warn_dropped_cache_updates(program)
    proto = program.model_proto
    attach_function(proto)
    if check:
        onnx.checker.check_model(proto, full_check=True)
    if path is not None:
        onnx.save(proto, str(path))
    return proto


def __getattr__(name):
    if name == "UnsupportedFeatureError":
        from portattn.onnx_ops.export import UnsupportedFeatureError

        return UnsupportedFeatureError
    raise AttributeError(f"module 'portattn.onnx' has no attribute {name!r}")
