"""Byte layouts of everything kvdb stores, each documented at the top of its module."""
