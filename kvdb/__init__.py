"""kvdb: an embedded storage engine for LLM KV-cache blocks."""

__version__ = "0.1.0"
