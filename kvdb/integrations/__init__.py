"""Adapters that embed kvdb in inference engines.

``kvdb.integrations.transformers`` plugs a Db under a Hugging Face transformers model (5.x):
``layout_for(config)`` derives the block layout, ``PrefixCache`` restores the longest stored
prefix into a cache object and saves the full blocks of a prompt afterwards. vLLM / SGLang
connectors come later. Nothing here is imported by ``import kvdb``: transformers is optional.
"""
