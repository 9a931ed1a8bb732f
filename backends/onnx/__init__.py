"""The ``onnx`` backend (``portattn.backends.onnx``): portattn's ONNX op on onnxruntime.

Importing this package never imports onnx, onnxscript or onnxruntime; a missing package is a
reason reported by :meth:`OnnxBackend.unavailable_reasons`.
"""

from .backend import OnnxBackend

__all__ = ["OnnxBackend"]
