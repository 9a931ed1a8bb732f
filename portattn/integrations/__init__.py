"""Integrations with model libraries (optional dependencies, imported only from their modules).

* :mod:`portattn.integrations.transformers` — ``attn_implementation="portattn"`` for Hugging
  Face transformers models (``register()`` first).

``import portattn`` never imports these libraries. See docs/integrations.md.
"""
