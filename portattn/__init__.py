"""portattn: exact FlashAttention-style attention, one contract, several backends.

>>> import torch, portattn
>>> q = k = v = torch.randn(2, 128, 8, 64)            # (batch, seqlen, heads, head_dim)
>>> out = portattn.attention(q, k, v, causal=True)
>>> print(portattn.explain(q, k, v, causal=True))     # which backend, and why not the others
"""

import importlib.util as _ilu
import os as _os
import sys as _sys


def _same_tree(origin, root: str) -> bool:
    if not origin:
        return True   # namespace package or similar: leave the import system's answer alone
    return _os.path.realpath(origin).startswith(_os.path.realpath(root) + _os.sep)


def _map_source_tree_packages() -> None:
    """In a source checkout used without installing (``PYTHONPATH=.``), ``backends/`` and
    ``onnx_ops/`` sit beside ``portattn/``; installed (editable or not) they are
    ``portattn.backends`` and ``portattn.onnx_ops``. Map them the same way here."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    for name in ("backends", "onnx_ops"):
        full = f"{__name__}.{name}"
        init = _os.path.join(root, name, "__init__.py")
        if full in _sys.modules or not _os.path.exists(init):
            continue
        found = _ilu.find_spec(full)
        # An editable install of another checkout (e.g. a git worktree's main tree) also
        # resolves portattn.backends; the tree this portattn/ came from wins.
        if found is not None and _same_tree(found.origin, root):
            continue
        spec = _ilu.spec_from_file_location(full, init, submodule_search_locations=[_os.path.dirname(init)])
        module = _ilu.module_from_spec(spec)
        _sys.modules[full] = module
        spec.loader.exec_module(module)


_map_source_tree_packages()

from .api import attention, explain  # noqa: E402
from .dispatch import Explanation, get_policy, set_policy, use_backend  # noqa: E402
from .errors import BackendNotAvailableError  # noqa: E402
from .kvcache import attention_with_kvcache  # noqa: E402
from .registry import Backend, get_backend, list_backends, register_backend, unregister_backend  # noqa: E402
from .spec import AttentionSpec, build_spec  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_with_kvcache", "explain", "use_backend", "set_policy", "get_policy", "Explanation", "Backend", "AttentionSpec", "build_spec",
    "register_backend", "unregister_backend", "list_backends", "get_backend", "BackendNotAvailableError",
]
