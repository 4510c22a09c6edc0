"""Per-tenant limits: requests per minute, tokens per minute, concurrent requests
(pure: no I/O, no asyncio; the clock is an argument).

A tenant is named in the API keys file (``KEY [TIER] tenant=NAME rpm=N tpm=N
concurrent=N weight=W``, :func:`parse_policy`); several keys may share one tenant,
and then they share its budget. A key with none of these words has no tenant: its
requests never reach this module (they cost nothing extra).

Accounting, for one request of a limited tenant::

    grant = limiter.reserve(tenant, prompt_tokens, max_tokens, now)   # 1. before routing
    ...                                                               #    (a Refusal: 429)
    limiter.settle(grant, completion_tokens, now)                     # 2. once, at its end

1. ``reserve`` admits all or nothing: one request from the requests bucket, the
   request's estimate (prompt + ``max_tokens``, at most the bucket's capacity) from the
   tokens bucket, one concurrency slot. Reservations are taken before the request runs,
   so racing requests cannot overdraw a bucket: the second sees what the first took.
2. ``settle`` gives back the slot and what was reserved beyond the real count
   (prompt + tokens generated). A request whose real count passed its reservation (its
   estimate was capped at the capacity) leaves the bucket in debt, paid by later
   refills: the tokens admitted over any window never exceed the capacity plus the
   refill over the window plus one capped request's excess.

Buckets refill continuously at ``limit / 60`` per second up to ``limit`` (a full
minute's budget may be spent at once). Headers (OpenAI's names) describe the buckets
after the reservation: ``x-ratelimit-limit-*``, ``x-ratelimit-remaining-*`` (whole
units), ``x-ratelimit-reset-*`` (until the bucket is full again, as ``1s``, ``6m0s``,
``250ms``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "TenantPolicy",
    "parse_policy",
    "TokenBucket",
    "Grant",
    "Refusal",
    "TenantUsage",
    "TenantLimiter",
    "format_reset",
    "MAX_TENANT_NAME",
    "MAX_METRIC_TENANTS",
]

MAX_TENANT_NAME = 64
MAX_METRIC_TENANTS = 64  # tenants with their own metric label; the rest are counted as "other"
_OPTIONS = ("tenant", "rpm", "tpm", "concurrent", "weight")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
_CONCURRENCY_RETRY_S = 1.0  # a request refused for concurrency: when to try again (no bucket tells)


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's limits (0: no limit of that kind) and fair-queuing weight."""

    name: str
    rpm: int = 0
    tpm: int = 0
    concurrent: int = 0
    weight: float = 1.0

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.concurrent)


def parse_policy(words: list[str], default_name: str) -> TenantPolicy | None:
    """``tenant=NAME rpm=N tpm=N concurrent=N weight=W`` (any subset, any order) → the
    key's policy; None for no words. Raises ValueError saying what to write."""
    if not words:
        return None
    values: dict[str, str] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq or name not in _OPTIONS or not value:
            raise ValueError(f"{word!r}: write {' '.join(o + '=...' for o in _OPTIONS)}")
        if name in values:
            raise ValueError(f"{name}= is given twice")
        values[name] = value
    tenant = values.get("tenant", default_name)
    if len(tenant) > MAX_TENANT_NAME or not set(tenant) <= _NAME_CHARS:
        raise ValueError(f"tenant={tenant!r}: at most {MAX_TENANT_NAME} letters, digits, '-', '_' or '.'")
    limits = {k: _count(k, values[k]) for k in ("rpm", "tpm", "concurrent") if k in values}
    weight = _weight(values["weight"]) if "weight" in values else 1.0
    return TenantPolicy(tenant, weight=weight, **limits)


def _count(name: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1 or len(value) > 12:
        raise ValueError(f"{name}={value!r}: a whole number >= 1")
    return int(value)


def _weight(value: str) -> float:
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and 0.001 <= weight <= 1000):
        raise ValueError(f"weight={value!r}: a number from 0.001 to 1000")
    return weight


class TokenBucket:
    """``capacity`` units, refilled at ``capacity / 60`` per second. ``level`` may go
    below zero only through :meth:`charge` (a debt); :meth:`take` never overdraws."""

    __slots__ = ("capacity", "rate", "level", "_last")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self._last = now

    def refill(self, now: float) -> None:
        if now > self._last:
            self.level = min(self.capacity, self.level + (now - self._last) * self.rate)
            self._last = now

    def has(self, n: float) -> bool:
        return self.level >= n

    def take(self, n: float) -> None:
        """Take ``n`` (the caller checked :meth:`has`)."""
        self.level -= n

    def charge(self, n: float) -> None:
        """Give back (``n`` < 0) or charge more than was taken: the level is capped at the
        capacity and may fall below zero."""
        self.level = min(self.capacity, self.level - n)

    def wait_s(self, n: float) -> float:
        """Seconds until ``n`` units are there (0 when they are)."""
        return max(0.0, (n - self.level) / self.rate)

    def reset_s(self) -> float:
        """Seconds until the bucket is full."""
        return self.wait_s(self.capacity)


@dataclass(slots=True)
class TenantUsage:
    """What one tenant used since start (``/admin/usage``, ``/metrics``)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    limited_requests: int = 0  # refused: requests per minute
    limited_tokens: int = 0  # refused: tokens per minute
    limited_concurrent: int = 0  # refused: concurrent requests
    in_flight: int = 0


class _Tenant:
    __slots__ = ("policy", "requests", "tokens", "usage")

    def __init__(self, policy: TenantPolicy, now: float) -> None:
        self.policy = policy
        self.requests = TokenBucket(policy.rpm, now) if policy.rpm else None
        self.tokens = TokenBucket(policy.tpm, now) if policy.tpm else None
        self.usage = TenantUsage()


@dataclass(frozen=True, slots=True)
class Grant:
    """An admitted request's reservation; ``headers`` go on its answer."""

    tenant: str
    reserved_tokens: int
    headers: tuple[tuple[str, str], ...]
    window: int = -1  # the shared budget's window it was taken in (kvmesh.frontend.tenant_budget); -1: none


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request over a limit: a 429 with ``Retry-After`` and ``headers``."""

    tenant: str
    limit: str  # "requests" | "tokens" | "concurrent"
    retry_after_s: float
    headers: tuple[tuple[str, str], ...]

    @property
    def message(self) -> str:
        what = {"requests": "requests per minute", "tokens": "tokens per minute", "concurrent": "concurrent requests"}
        return (
            f"tenant {self.tenant} is over its limit of {what[self.limit]}; retry after "
            f"{math.ceil(self.retry_after_s)} s (see the x-ratelimit-* headers)"
        )


class TenantLimiter:
    """Every limited tenant's buckets and usage, for one frontend process (one owner,
    the event loop; every method is synchronous, so no two requests interleave inside
    one). Tenants are the policies given at construction; a name not among them has
    no limits."""

    __slots__ = ("_tenants",)

    def __init__(self, policies: list[TenantPolicy], now: float) -> None:
        self._tenants: dict[str, _Tenant] = {}
        for policy in policies:
            if policy.name not in self._tenants:  # keys sharing a tenant: the first key's limits
                self._tenants[policy.name] = _Tenant(policy, now)

    def policy(self, tenant: str) -> TenantPolicy | None:
        state = self._tenants.get(tenant)
        return state.policy if state is not None else None

    def reserve(self, tenant: str, prompt_tokens: int, max_tokens: int, now: float) -> Grant | Refusal:
        """Admit one request (all of its reservations) or refuse it (none taken)."""
        state = self._tenants[tenant]
        estimate = prompt_tokens + max_tokens
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        refusal = self._refusal(state, estimate)
        if refusal is not None:
            return refusal
        reserved = 0
        if state.requests is not None:
            state.requests.take(1)
        if state.tokens is not None:
            reserved = min(estimate, state.tokens.capacity)
            state.tokens.take(reserved)
        state.usage.in_flight += 1
        state.usage.requests += 1
        return Grant(tenant, reserved, _headers(state))

    def _refusal(self, state: _Tenant, estimate: int) -> Refusal | None:
        usage, policy = state.usage, state.policy
        if policy.concurrent and usage.in_flight >= policy.concurrent:
            usage.limited_concurrent += 1
            return Refusal(policy.name, "concurrent", _CONCURRENCY_RETRY_S, _headers(state))
        if state.requests is not None and not state.requests.has(1):
            usage.limited_requests += 1
            return Refusal(policy.name, "requests", state.requests.wait_s(1), _headers(state))
        if state.tokens is not None:
            need = min(estimate, state.tokens.capacity)
            if not state.tokens.has(need):
                usage.limited_tokens += 1
                return Refusal(policy.name, "tokens", state.tokens.wait_s(need), _headers(state))
        return None

    def settle(self, grant: Grant, prompt_tokens: int, completion_tokens: int, now: float) -> None:
        """The request ended (however): its slot back, its tokens counted for real."""
        state = self._tenants[grant.tenant]
        state.usage.in_flight -= 1
        state.usage.prompt_tokens += prompt_tokens
        state.usage.completion_tokens += completion_tokens
        if state.tokens is not None:
            state.tokens.refill(now)
            state.tokens.charge(prompt_tokens + completion_tokens - grant.reserved_tokens)

    def cancel(self, grant: Grant, limit: str) -> None:
        """Undo a reservation the shared budget refused (``limit``: which of it): the
        slot, the request and its tokens back, counted as refused."""
        state = self._tenants[grant.tenant]
        state.usage.in_flight -= 1
        state.usage.requests -= 1
        if state.requests is not None:
            state.requests.charge(-1)
        if state.tokens is not None:
            state.tokens.charge(-grant.reserved_tokens)
        if limit == "requests":
            state.usage.limited_requests += 1
        else:
            state.usage.limited_tokens += 1

    def count(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Usage of a tenant without limits (one request, counted at its end)."""
        state = self._tenants.get(tenant)
        if state is not None:
            state.usage.requests += 1
            state.usage.prompt_tokens += prompt_tokens
            state.usage.completion_tokens += completion_tokens

    def usage(self) -> dict[str, TenantUsage]:
        return {name: state.usage for name, state in self._tenants.items()}

    def remaining(self, tenant: str, now: float) -> tuple[float | None, float | None]:
        """(requests, tokens) left in the tenant's buckets now (None: no such limit)."""
        state = self._tenants[tenant]
        out: list[float | None] = []
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
            out.append(bucket.level if bucket is not None else None)
        return out[0], out[1]


def _headers(state: _Tenant) -> tuple[tuple[str, str], ...]:
    """(limit, remaining, reset) of requests, then of tokens (TenantGate.share relies on the order)."""
    out: list[tuple[str, str]] = []
    for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
        if bucket is not None:
            out += [
                (f"x-ratelimit-limit-{kind}", str(bucket.capacity)),
                (f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(bucket.level)))),
                (f"x-ratelimit-reset-{kind}", format_reset(bucket.reset_s())),
            ]
    return tuple(out)


def format_reset(seconds: float) -> str:
    """OpenAI's reset durations: ``250ms``, ``1s``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 2):g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
