"""Drop-in replacements for attention APIs people already call.

* :mod:`portattn.compat.flash_attn` — flash-attn 2's ``flash_attn_func`` family (same
  signatures, defaults and return values), computed by :func:`portattn.attention`;
* :mod:`portattn.compat.sdpa` — ``scaled_dot_product_attention`` with torch's signature, and
  :func:`~portattn.compat.sdpa.route_sdpa`, a context manager that sends
  ``torch.nn.functional.scaled_dot_product_attention`` calls made inside it to portattn.

Switching code to portattn is one import line, e.g.
``from portattn.compat.flash_attn import flash_attn_func``. See docs/integrations.md.
"""
