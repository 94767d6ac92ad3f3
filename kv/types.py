"""Typed ids shared by the KV cache modules."""

from typing import NewType

BlockId = NewType("BlockId", int)
"""Index of a block in a KV pool (the same on every TP rank)."""
