"""Moved to :mod:`kvmesh.engines.batching.block_manager` (one pool for every engine)."""

from kvmesh.engines.batching.block_manager import BlockManager

__all__ = ["BlockManager"]
