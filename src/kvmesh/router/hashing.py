"""Moved to :mod:`kvmesh.kv.hashing` (the ground floor every layer imports from);
this name stays for code written against it."""

from kvmesh.kv.hashing import HASH_SEED, block_hashes, chain_hashes, chain_one, local_block_hashes

__all__ = ["HASH_SEED", "local_block_hashes", "chain_hashes", "block_hashes", "chain_one"]
