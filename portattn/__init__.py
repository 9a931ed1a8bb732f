"""portattn: exact FlashAttention-style attention, one contract, several backends.

>>> import torch, portattn
>>> q = k = v = torch.randn(2, 128, 8, 64)            # (batch, seqlen, heads, head_dim)
>>> out = portattn.attention(q, k, v, causal=True)
>>> print(portattn.explain(q, k, v, causal=True))     # which backend, and why not the others
"""

from .api import attention, explain
from .dispatch import Explanation, use_backend
from .errors import BackendNotAvailableError
from .registry import Backend, get_backend, list_backends, register_backend, unregister_backend
from .spec import AttentionSpec, build_spec

__version__ = "0.1.0"

__all__ = [
    "attention", "explain", "use_backend", "Explanation", "Backend", "AttentionSpec", "build_spec",
    "register_backend", "unregister_backend", "list_backends", "get_backend", "BackendNotAvailableError",
]
