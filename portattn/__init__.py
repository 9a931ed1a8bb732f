"""portattn: exact FlashAttention-style attention, one contract, several backends."""
from .registry import Backend, register_backend, unregister_backend, list_backends, get_backend
from .spec import AttentionSpec, build_spec
__version__ = "0.1.0"
