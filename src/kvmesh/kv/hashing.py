"""KV block hashing: the one function every engine, the router and the replay use.

Conventions (shared with NVIDIA Dynamo, so real engines' events line up):

* token ids are encoded as little-endian u32 and cut into full blocks of ``block_size``
  tokens; a partial tail block is not hashed;
* ``local[i] = xxh3_64(block_bytes, seed=1337)``;
* chained sequence hashes: ``seq[0] = local[0]``,
  ``seq[i] = xxh3_64(le_u64(seq[i-1]) || le_u64(local[i]), seed=1337)``.

A sequence hash names a block *and* everything before it, so two prompts share KV for
exactly their common leading run of sequence hashes.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

__all__ = ["HASH_SEED", "local_block_hashes", "chain_hashes", "block_hashes", "chain_one", "hash_salt"]

HASH_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest
_PAIR = struct.Struct("<QQ")
_BIG_ENDIAN = sys.byteorder == "big"


def _le_u32(token_ids: Sequence[int]) -> bytes:
    arr = array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        arr = array("L", token_ids)
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def local_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """``local[i]`` for every full block of ``token_ids``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size
    if full == 0:
        return []
    data = _le_u32(token_ids[: full * block_size])
    step = block_size * 4
    return [_xxh3(data[i : i + step], HASH_SEED) for i in range(0, len(data), step)]


def chain_one(parent: int | None, local: int) -> int:
    """The sequence hash of a block whose local hash is ``local`` after ``parent``."""
    if parent is None:
        return local
    return _xxh3(_PAIR.pack(parent, local), HASH_SEED)


def chain_hashes(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes of ``local_hashes``, continuing after ``parent`` if given."""
    out = []
    for local in local_hashes:
        parent = chain_one(parent, local)
        out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, salt: int | None = None) -> list[int]:
    """Chained sequence hashes of every full block of ``token_ids``; with ``salt``
    (:func:`hash_salt`) the chain starts after it, so salted and unsalted prompts never
    share a sequence hash."""
    # (local_block_hashes + chain_hashes in one loop, without a call per block: this runs
    # on every KV-routed request; the hashes are the same)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size
    if full == 0:
        return []
    data = memoryview(_le_u32(token_ids[: full * block_size] if len(token_ids) != full * block_size else token_ids))
    step = block_size * 4
    xxh3, pack, seed = _xxh3, _PAIR.pack, HASH_SEED
    out = []
    parent = salt
    for i in range(0, full * step, step):
        local = xxh3(data[i : i + step], seed)
        parent = local if parent is None else xxh3(pack(parent, local), seed)
        out.append(parent)
    return out


def hash_salt(adapter: str | None, cache_salt: str | None) -> int | None:
    """The parent every block chain of a request starts from: None for the base model
    in the shared namespace (today's hashes, unchanged), else a hash of the LoRA
    adapter's name and the cache namespace (a tenant's, with cache isolation)."""
    if adapter is None and cache_salt is None:
        return None
    data = b"kvmesh-salt\0" + (adapter or "").encode() + b"\0" + (cache_salt or "").encode()
    return _xxh3(data, HASH_SEED)
