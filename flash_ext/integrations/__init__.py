"""Glue between flash_ext and model libraries.

Each integration is its own module and imports its library only when used, so ``import flash_ext`` (and
``import flash_ext.integrations``) never pulls one in:

* ``flash_ext.integrations.transformers``: an attention implementation for Hugging Face transformers
  (``register()``, then ``attn_implementation="fx_attention"``).
* ``python -m flash_ext.integrations.demo``: a small transformers model generating with flash_ext, checked
  against eager attention, and its attention memory vs eager.
"""
