"""Salted block hashes (issue 30): adapters and cache namespaces never share a block."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.kv.hashing import block_hashes, hash_salt
from kvmesh.protocol import MAX_ADAPTER_NAME, PreprocessedRequest

pytestmark = pytest.mark.timeout(30)

PROMPT = list(range(64))


def test_unsalted_hashes_are_todays() -> None:
    assert hash_salt(None, None) is None
    assert block_hashes(PROMPT, 16, None) == block_hashes(PROMPT, 16)


@pytest.mark.parametrize("adapter, salt", [("a", None), (None, "tenant-a"), ("a", "tenant-a")])
def test_a_salt_changes_every_block(adapter: str | None, salt: str | None) -> None:
    plain = block_hashes(PROMPT, 16)
    salted = block_hashes(PROMPT, 16, hash_salt(adapter, salt))
    assert len(salted) == len(plain)
    assert not set(salted) & set(plain)


def test_adapter_and_namespace_do_not_collide() -> None:
    # "a" as an adapter is not "a" as a namespace, and names are not concatenated
    salts = {hash_salt("a", None), hash_salt(None, "a"), hash_salt("ab", None), hash_salt("a", "b")}
    assert len(salts) == 4


def test_request_bounds_adapter_name() -> None:
    raw = msgspec.msgpack.encode(
        PreprocessedRequest(request_id="r", model="m", token_ids=[1], adapter="x" * (MAX_ADAPTER_NAME + 1)))
    with pytest.raises(msgspec.ValidationError, match="adapter"):
        msgspec.msgpack.decode(raw, type=PreprocessedRequest)
