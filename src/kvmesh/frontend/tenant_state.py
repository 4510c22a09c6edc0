"""The frontend's tenant gate: the pure :class:`~kvmesh.frontend.tenants.TenantLimiter`
on this process's monotonic clock, with the usage views (``/metrics``,
``/admin/usage``).

Only requests whose key has a tenant (a ``tenant=`` or a limit in the keys file, or any
key with ``--cache-isolation tenant``) come here; every other request skips it.

Scope: the limits hold per frontend process; for ``kvmesh frontend`` with
``--tenant-budget shared`` (or ``auto``, the default, when it uses NATS) requests per minute and
tokens per minute also hold across every frontend of the fleet: :meth:`TenantGate.share`
spends leases of a shared per-minute budget (:mod:`kvmesh.frontend.tenant_shared`,
:mod:`kvmesh.frontend.tenant_budget`) after the local limiter admitted the request.
Concurrent requests stay a per-frontend limit. See the README's Tenants section.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from kvmesh.frontend.tenant_budget import window_end_s, window_of
from kvmesh.frontend.tenants import MAX_METRIC_TENANTS, Grant, Refusal, TenantLimiter, TenantPolicy, format_reset

if TYPE_CHECKING:
    from kvmesh.frontend.tenant_shared import SharedBudget

__all__ = ["TenantGate"]

_OTHER = "other"


class TenantGate:
    __slots__ = ("limiter", "_labelled", "shared")

    def __init__(self, policies: list[TenantPolicy]) -> None:
        self.limiter = TenantLimiter(policies, time.monotonic())
        names = list(dict.fromkeys(p.name for p in policies))
        self._labelled = frozenset(names[:MAX_METRIC_TENANTS])  # the rest are "other" in /metrics
        self.shared: SharedBudget | None = None  # set in distributed mode (kvmesh.assembly.frontend)

    def reserve(self, tenant: TenantPolicy, prompt_tokens: int, max_tokens: int) -> Grant | Refusal:
        return self.limiter.reserve(tenant.name, prompt_tokens, max_tokens, time.monotonic())

    def shares(self, tenant: TenantPolicy) -> bool:
        """Whether ``tenant``'s requests also spend the fleet's shared budget."""
        return self.shared is not None and bool(tenant.rpm or tenant.tpm)

    async def share(self, grant: Grant, tenant: TenantPolicy) -> Grant | Refusal:
        """Spend the fleet's shared budget for a request the local limiter admitted
        (``grant``): the grant with what is left in the fleet in its remaining headers,
        or a refusal (the local reservation undone)."""
        shared = self.shared
        assert shared is not None
        window = window_of(shared.clock())
        left_requests = left_tokens = None
        if tenant.rpm:
            left_requests = await shared.take(tenant.name, "requests", tenant.rpm, 1)
            if left_requests is None:
                return self._refused(grant, tenant, "requests")
        if tenant.tpm:
            left_tokens = await shared.take(tenant.name, "tokens", tenant.tpm, grant.reserved_tokens)
            if left_tokens is None:
                if tenant.rpm:
                    shared.refund(tenant.name, "requests", window, 1)
                return self._refused(grant, tenant, "tokens")
        headers = list(grant.headers)  # (limit, remaining, reset) of requests, then of tokens: tenants._headers
        if left_requests is not None:
            headers[1] = ("x-ratelimit-remaining-requests", _fewer(headers[1][1], left_requests))
        if left_tokens is not None:
            at = 4 if tenant.rpm else 1
            headers[at] = ("x-ratelimit-remaining-tokens", _fewer(headers[at][1], left_tokens))
        return Grant(grant.tenant, grant.reserved_tokens, tuple(headers), window)

    def _refused(self, grant: Grant, tenant: TenantPolicy, kind: str) -> Refusal:
        assert self.shared is not None
        self.limiter.cancel(grant, kind)
        wait = window_end_s(self.shared.clock())
        fixed = {f"x-ratelimit-remaining-{kind}": "0", f"x-ratelimit-reset-{kind}": format_reset(wait)}
        headers = tuple((name, fixed.get(name, value)) for name, value in grant.headers)
        return Refusal(tenant.name, kind, wait, headers)

    def settle(self, grant: Grant, prompt_tokens: int, completion_tokens: int) -> None:
        self.limiter.settle(grant, prompt_tokens, completion_tokens, time.monotonic())
        if grant.window >= 0 and self.shared is not None and grant.reserved_tokens:
            self.shared.refund(grant.tenant, "tokens", grant.window, grant.reserved_tokens - prompt_tokens - completion_tokens)

    def usage_json(self) -> bytes:
        """``GET /admin/usage``: every tenant's usage, limits and what is left now."""
        now = time.monotonic()
        out = {}
        for name, usage in self.limiter.usage().items():
            policy = self.limiter.policy(name)
            assert policy is not None  # usage() lists the configured tenants only
            requests_left, tokens_left = self.limiter.remaining(name, now)
            if self.shared is not None:  # what is left in the fleet, as this frontend last saw it
                requests_left = self._fleet_left(name, "requests", policy.rpm, requests_left)
                tokens_left = self._fleet_left(name, "tokens", policy.tpm, tokens_left)
            out[name] = {
                "usage": msgspec.structs.asdict(_UsageView(**_fields(usage))),
                "limits": {"rpm": policy.rpm, "tpm": policy.tpm, "concurrent": policy.concurrent, "weight": policy.weight},
                "remaining": {"requests": _whole(requests_left), "tokens": _whole(tokens_left)},
            }
        body: dict[str, object] = {"object": "usage", "tenants": out}
        if self.shared is not None:
            s = self.shared
            body["shared_budget"] = {"bucket": s.bucket, "store_operations": s.operations, "store_errors": s.store_errors,
                                     "ignored_values": s.ignored}  # fmt: skip
        return msgspec.json.encode(body)

    def _fleet_left(self, tenant: str, kind: str, limit: int, local: float | None) -> float | None:
        assert self.shared is not None
        if not limit or local is None:
            return local
        return min(local, self.shared.remaining(tenant, kind, limit))

    def metric_usage(self) -> Mapping[str, Mapping[str, int]]:
        """Usage per metric label: the first MAX_METRIC_TENANTS tenants of the keys file
        by name, the rest summed under ``other``."""
        out: dict[str, dict[str, int]] = {}
        for name, usage in self.limiter.usage().items():
            label = name if name in self._labelled else _OTHER
            counts = _fields(usage)
            into = out.setdefault(label, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                into[key] += value
        return out


class _UsageView(msgspec.Struct):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    limited_requests: int
    limited_tokens: int
    limited_concurrent: int
    in_flight: int


def _fields(usage: object) -> dict[str, int]:
    return {f: getattr(usage, f) for f in _UsageView.__struct_fields__}


def _whole(left: float | None) -> int | None:
    return None if left is None else max(0, int(left))


def _fewer(value: str, left: int) -> str:
    """A remaining header: the fewer of this frontend's bucket and the fleet's budget."""
    return value if int(value) <= left else str(left)
