"""Integrations with other libraries, each in its own module and imported only on request.

``import flashtile.integrations.transformers`` makes ``attn_implementation="flashtile"`` available
to Hugging Face transformers; importing ``flashtile`` or this package imports none of them.
"""
