"""Block hashing: fixed vectors, computed here independently of the implementation.

These values are the wire contract between engines, the router and replays: a
change here breaks routing against every worker already running.
"""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.kv.hashing import HASH_SEED, block_hashes, chain_hashes, chain_one, local_block_hashes


def ref_local(tokens: list[int], bs: int) -> list[int]:
    """The definition: xxh3-64 (seed 1337) of each full block as little-endian u32."""
    return [
        xxhash.xxh3_64_intdigest(struct.pack("<%dI" % bs, *tokens[i : i + bs]), seed=1337)
        for i in range(0, len(tokens) - bs + 1, bs)
    ]


def ref_seq(tokens: list[int], bs: int) -> list[int]:
    """The definition: seq[0] = local[0], seq[i] = xxh3(le_u64(seq[i-1]) || le_u64(local[i]))."""
    out: list[int] = []
    for local in ref_local(tokens, bs):
        out.append(local if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed=1337))
    return out


# Literal vectors: (tokens, block_size, local hashes, sequence hashes).
VECTORS = [
    (list(range(8)), 4, [9143094415614847814, 12124091508212882195], [9143094415614847814, 9510318385840434533]),
    (list(range(1, 17)), 16, None, [16863443419780771464]),
    (
        list(range(100, 164)),
        16,
        None,
        [10823191264391160519, 4102179227871607950, 18410735291254320318, 4506128744525108053],
    ),
]


def test_seed_is_1337() -> None:
    assert HASH_SEED == 1337


@pytest.mark.parametrize(("tokens", "bs", "local", "seq"), VECTORS)
def test_literal_vectors(tokens: list[int], bs: int, local: list[int] | None, seq: list[int]) -> None:
    if local is not None:
        assert local_block_hashes(tokens, bs) == local
    assert block_hashes(tokens, bs) == seq
    # the literals are the definition, not just whatever the code printed once
    assert ref_seq(tokens, bs) == seq


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=70),
    bs=st.integers(min_value=1, max_value=17),
)
@settings(max_examples=200, deadline=None)
def test_matches_reference(tokens: list[int], bs: int) -> None:
    assert local_block_hashes(tokens, bs) == ref_local(tokens, bs)
    assert block_hashes(tokens, bs) == ref_seq(tokens, bs)


def test_partial_tail_block_is_not_hashed() -> None:
    tokens = list(range(10))
    assert len(block_hashes(tokens, 4)) == 2
    assert block_hashes(tokens, 4) == block_hashes(tokens[:8], 4)
    assert block_hashes(tokens[:3], 4) == []
    assert local_block_hashes([], 4) == []


def test_chaining_names_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    # same tokens in block 1, different prefix: same local hash, different sequence hash
    assert local_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] == local_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)[1]
    assert a[1] != b[1]
    # a shared prefix gives a shared leading run
    c = block_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4)
    assert c[0] == a[0] and c[1] != a[1]


def test_chain_continues_after_parent() -> None:
    tokens = list(range(40))
    whole = block_hashes(tokens, 8)
    local = local_block_hashes(tokens, 8)
    assert chain_hashes(local[2:], parent=whole[1]) == whole[2:]
    assert chain_one(None, local[0]) == whole[0]
    assert chain_one(whole[0], local[1]) == whole[1]


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        local_block_hashes([1, 2], 0)
