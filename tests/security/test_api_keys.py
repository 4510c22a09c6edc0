"""The key rules themselves (pure, no server): the keys file, tiers, admin key."""

from __future__ import annotations

import pytest

from kvmesh.config import SecurityConfig
from kvmesh.errors import InvalidArgument, PermissionDenied, Unauthorized
from kvmesh.frontend.auth import Authenticator, read_keys_file


def test_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nsk-a premium\n\nsk-b   # standard by default\nsk-c best_effort\n")
    assert read_keys_file(str(path)) == [("sk-a", "premium"), ("sk-b", "standard"), ("sk-c", "best_effort")]
    path.write_text("sk-a gold\n")
    with pytest.raises(ValueError, match=":1:"):
        read_keys_file(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no key"):
        read_keys_file(str(path))


def test_without_keys_no_credentials_and_premium_needs_trust():
    auth = Authenticator(SecurityConfig())
    assert auth.tier_of(None) is None
    auth.check_tier("standard", None)
    with pytest.raises(PermissionDenied):
        auth.check_tier("premium", None)
    Authenticator(SecurityConfig(trust_priority_header=True)).check_tier("premium", None)
    with pytest.raises(InvalidArgument):
        auth.check_tier("gold", None)


def test_keys_map_to_their_tier_and_bound_it():
    auth = Authenticator(SecurityConfig(api_keys=(("sk-std", "standard"), ("sk-prem", "premium")), admin=True, admin_key="sk-admin"))
    assert auth.tier_of("Bearer sk-std") == "standard"
    assert auth.tier_of("bearer   sk-prem ") == "premium"
    for bad in (None, "", "sk-std", "Basic sk-std", "Bearer sk-st", "Bearer sk-stdx", "Bearer sk-admin"):
        with pytest.raises(Unauthorized):
            auth.tier_of(bad)
    with pytest.raises(PermissionDenied):
        auth.check_tier("premium", "standard")
    auth.check_tier("best_effort", "standard")
    auth.check_admin("Bearer sk-admin")
    with pytest.raises(Unauthorized):
        auth.check_admin("Bearer sk-prem")


def test_admin_with_keys_needs_an_admin_key():
    with pytest.raises(ValueError, match="admin-key"):
        SecurityConfig(api_keys=(("k", "standard"),), admin=True)
