"""Who may call what on the frontend (pure: no I/O but the keys file reader).

* API keys (``--api-key`` / ``KVMESH_API_KEY``, ``--api-keys-file``): when any is
  configured every ``/v1/*`` route needs ``Authorization: Bearer <key>`` (or, as
  Anthropic's clients send it, ``x-api-key: <key>``: :func:`presented`); the key is
  compared in constant time against every configured key (no early exit that would
  time which one nearly matched). ``/health`` and ``/live`` stay open; ``/metrics``
  is open unless ``--metrics-auth``.
* Each key carries the highest priority tier its requests may ask for; without keys
  a client may ask for ``standard`` or ``best_effort`` only, unless the operator
  trusts the header (``--trust-priority-header``).
* A key may name its tenant and the tenant's limits (:mod:`kvmesh.frontend.tenants`):
  ``KEY [TIER] [tenant=NAME] [rpm=N] [tpm=N] [concurrent=N] [weight=W]``; the old
  ``KEY [TIER]`` lines are keys without a tenant. :meth:`Authenticator.tenant_at`
  gives a key's :class:`~kvmesh.frontend.tenants.TenantPolicy` (None: no tenant, no
  limits; with ``--cache-isolation tenant`` every key has a tenant, ``key-N`` when the
  file names none).
* ``/admin/*`` needs the admin key when keys are configured (it is not served at all
  without ``--admin``: that is the app's routing).
* ``/dashboard`` needs any API key when keys are configured. A browser's
  ``EventSource`` cannot send a header, so the page trades a key once for a session
  cookie (:meth:`Authenticator.session_token`): ``EXPIRES.HMAC(key, label|EXPIRES)``,
  no state on the server, valid on every frontend replica holding the same key, void
  when the key is removed, and never the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.config import SecurityConfig
from kvmesh.errors import InvalidArgument, PermissionDenied, Unauthorized

if TYPE_CHECKING:
    from kvmesh.frontend.tenants import TenantPolicy

__all__ = ["Authenticator", "read_keys_file", "read_keys", "presented", "TIERS", "SESSION_S"]

TIERS = ("best_effort", "standard", "premium")  # lowest to highest
_RANK = {tier: i for i, tier in enumerate(TIERS)}
_UNKEYED_TIER = "standard"
SESSION_S = 12 * 3600  # a dashboard session cookie's lifetime
_SESSION_LABEL = b"kvmesh dashboard session\0"
_MAX_TOKEN = 128  # a session token is ~75 characters


def presented(headers: Mapping[str, str]) -> str | None:
    """The caller's key as an ``Authorization`` value: that header, else Anthropic's
    ``x-api-key: KEY`` read as ``Bearer KEY``."""
    authorization = headers.get("authorization")
    if authorization is None:
        key = headers.get("x-api-key")
        if key:
            return "Bearer " + key
    return authorization


def read_keys_file(path: str) -> list[tuple[str, str]]:
    """``(key, tier)`` of every line of the keys file (:func:`read_keys`)."""
    return [(key, tier) for key, tier, _ in read_keys(path)]


def read_keys(path: str) -> list[tuple[str, str, str]]:
    """``KEY [TIER] [OPTION=VALUE ...]`` per line (TIER defaults to standard; options:
    :func:`kvmesh.frontend.tenants.parse_policy`); ``#`` starts a comment. Returns
    ``(key, tier, options)`` with the options as written (checked here). A bad line is
    a ValueError naming its line number (the CLI prints it)."""
    from kvmesh.frontend.tenants import parse_policy

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--api-keys-file {path}: {exc.strerror or exc}") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        tiered = len(words) > 1 and "=" not in words[1]
        options = words[2:] if tiered else words[1:]
        if tiered and words[1] not in _RANK:
            raise ValueError(f"--api-keys-file {path}:{number}: write 'KEY [{'|'.join(TIERS)}] [tenant=NAME rpm=N ...]'")
        try:
            parse_policy(options, "key")
        except ValueError as exc:
            raise ValueError(f"--api-keys-file {path}:{number}: {exc}") from None
        keys.append((words[0], words[1] if tiered else _UNKEYED_TIER, " ".join(options)))
    if not keys:
        raise ValueError(f"--api-keys-file {path} holds no key")
    return keys


class Authenticator:
    """Checks one request's credentials against the frontend's SecurityConfig."""

    __slots__ = ("_keys", "_admin_key", "_trust", "required", "_tenants")

    def __init__(self, config: SecurityConfig) -> None:
        self._keys = [(key.encode(), tier) for key, tier in config.api_keys]
        self._admin_key = config.admin_key.encode()
        self._trust = config.trust_priority_header
        self.required = bool(self._keys)
        options = dict(config.api_key_options)
        isolated = config.cache_isolation == "tenant"
        self._tenants: list[TenantPolicy | None] = []
        if not config.api_keys:
            return
        from kvmesh.frontend.tenants import TenantPolicy, parse_policy  # with keys only (issue 36: not at every start)

        first: dict[str, TenantPolicy] = {}  # keys naming one tenant share the first such line's limits and weight
        for i, (key, _) in enumerate(config.api_keys, 1):
            words = options.get(key, "").split()
            policy = parse_policy(words, f"key-{i}")
            if policy is None and isolated:
                policy = TenantPolicy(f"key-{i}")
            self._tenants.append(first.setdefault(policy.name, policy) if policy is not None else None)

    def tenant_at(self, index: int) -> TenantPolicy | None:
        """The tenant of key ``index`` (:meth:`key_of`); None: no tenant."""
        return self._tenants[index]

    def tier_at(self, index: int) -> str:
        return self._keys[index][1]

    def tenants(self) -> list[TenantPolicy]:
        """Every key's tenant (keys sharing a tenant: each listed once per key)."""
        return [t for t in self._tenants if t is not None]

    def tier_of(self, authorization: str | None) -> str | None:
        """The highest tier of the caller's key; None when keys are off.
        Raises Unauthorized (401) for a missing or unknown key."""
        if not self.required:
            return None
        return self._keys[self.key_of(authorization)][1]

    def key_of(self, authorization: str | None) -> int:
        """Which configured key the caller presents (its index). Raises Unauthorized."""
        presented = _bearer(authorization)
        found = -1
        for i, (key, _) in enumerate(self._keys):  # every key is compared: the time does not tell which one matched
            if hmac.compare_digest(presented, key) and found < 0:
                found = i
        if found < 0:
            raise Unauthorized("Incorrect API key provided. Send Authorization: Bearer <your key>.")
        return found

    def session_token(self, index: int, now: float) -> str:
        """A dashboard session for the holder of key ``index``, valid for SESSION_S."""
        expires = str(int(now) + SESSION_S)
        return f"{expires}.{_session_mac(self._keys[index][0], expires)}"

    def session_key(self, token: str, now: float) -> int | None:
        """The key a session token was made from, while it is valid; else None."""
        expires, _, mac = token.partition(".")
        if len(token) > _MAX_TOKEN or not (expires.isascii() and expires.isdigit()) or int(expires) <= now:
            return None
        found = None
        for i, (key, _) in enumerate(self._keys):  # every key is tried, as in key_of
            if hmac.compare_digest(mac.encode("latin-1", "replace"), _session_mac(key, expires).encode()) and found is None:
                found = i
        return found

    def check_admin(self, authorization: str | None) -> None:
        if not self.required:
            return
        if not hmac.compare_digest(_bearer(authorization), self._admin_key):
            raise Unauthorized("the admin routes need the admin key: send Authorization: Bearer <admin key>")

    def check_tier(self, asked: str | None, allowed: str | None) -> None:
        """``asked``: the tier the request wants; ``allowed``: its key's (None: no keys)."""
        if asked is None:
            return
        if asked not in _RANK:
            raise InvalidArgument(f"priority must be premium, standard or best_effort, got {asked!r}")
        if allowed is None:
            if self._trust:
                return
            allowed = _UNKEYED_TIER
        if _RANK[asked] > _RANK[allowed]:
            raise PermissionDenied(
                f"this caller may ask for priority {allowed} at most, not {asked}"
                + ("" if self.required else " (the operator can allow it with --trust-priority-header or API keys)")
            )


def _session_mac(key: bytes, expires: str) -> str:
    return hmac.new(key, _SESSION_LABEL + expires.encode(), hashlib.sha256).hexdigest()


def _bearer(authorization: str | None) -> bytes:
    if not authorization:
        return b""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return token.strip().encode("latin-1", "replace")
