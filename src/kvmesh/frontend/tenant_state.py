"""The frontend's tenant gate: the pure :class:`~kvmesh.frontend.tenants.TenantLimiter`
on this process's monotonic clock, with the usage views (``/metrics``,
``/admin/usage``).

Only requests whose key has a tenant (a ``tenant=`` or a limit in the keys file, or any
key with ``--cache-isolation tenant``) come here; every other request skips it.

Scope: the limits hold per frontend process. Several frontends share no budget yet:
each enforces the file's limits alone (N frontends admit up to N × the limit); see the
README's Tenants section.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec

from kvmesh.frontend.tenants import MAX_METRIC_TENANTS, Grant, Refusal, TenantLimiter, TenantPolicy

__all__ = ["TenantGate"]

_OTHER = "other"


class TenantGate:
    __slots__ = ("limiter", "_labelled")

    def __init__(self, policies: list[TenantPolicy]) -> None:
        self.limiter = TenantLimiter(policies, time.monotonic())
        names = list(dict.fromkeys(p.name for p in policies))
        self._labelled = frozenset(names[:MAX_METRIC_TENANTS])  # the rest are "other" in /metrics

    def reserve(self, tenant: TenantPolicy, prompt_tokens: int, max_tokens: int) -> Grant | Refusal:
        return self.limiter.reserve(tenant.name, prompt_tokens, max_tokens, time.monotonic())

    def settle(self, grant: Grant, prompt_tokens: int, completion_tokens: int) -> None:
        self.limiter.settle(grant, prompt_tokens, completion_tokens, time.monotonic())

    def usage_json(self) -> bytes:
        """``GET /admin/usage``: every tenant's usage, limits and what is left now."""
        now = time.monotonic()
        out = {}
        for name, usage in self.limiter.usage().items():
            policy = self.limiter.policy(name)
            assert policy is not None  # usage() lists the configured tenants only
            requests_left, tokens_left = self.limiter.remaining(name, now)
            out[name] = {
                "usage": msgspec.structs.asdict(_UsageView(**_fields(usage))),
                "limits": {"rpm": policy.rpm, "tpm": policy.tpm, "concurrent": policy.concurrent, "weight": policy.weight},
                "remaining": {"requests": _whole(requests_left), "tokens": _whole(tokens_left)},
            }
        return msgspec.json.encode({"object": "usage", "tenants": out})

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
