"""A tenant's budget shared by several frontends: leases from a per-window counter
(pure: no I/O, no asyncio; the clock is an argument).

The shared store (:mod:`kvmesh.frontend.tenant_shared`) holds, per tenant, kind
(``requests``, ``tokens``) and wall-clock minute (the *window*), one number: how much
of that minute's limit the frontends have leased between them (``granted``). A
frontend leases a slice by compare-and-set (``granted`` read at revision R, written
as ``granted + n`` over R), then spends it locally with no store operation until it
is gone::

    n = plan_lease(limit, granted, shortfall)     # 0: the window's budget is spent
    # compare-and-set granted + n over the revision read; on success:
    ledger.credit(key, window, n)

Invariants: every lease is one successful compare-and-set that kept ``granted <=
limit``, so what all frontends spend in a window never exceeds the limit, however
their operations interleave (a lost race re-reads and re-plans); a frontend that dies
leaks at most its unspent leases, until its window ends. Slices are
``LEASE_FRACTION`` of the limit but never more than half of what is left, so the last
units of a window are spread thin instead of stranded in one frontend.

Tokens are reserved before a request runs and settled at its end
(:meth:`BudgetLedger.refund`): what was not used goes back to the local lease (if
the window is still the same), a request that used more than it reserved leaves a
debt, carried into the next window's lease.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["WINDOW_S", "LEASE_FRACTION", "window_of", "window_end_s", "plan_lease", "Lease", "BudgetLedger"]

WINDOW_S = 60.0  # a limit is per minute
LEASE_FRACTION = 0.1  # a slice: this share of the minute's limit (at least what the request needs)


def window_of(wall_s: float) -> int:
    """The window (wall-clock minute) a time falls in."""
    return int(wall_s // WINDOW_S)


def window_end_s(wall_s: float) -> float:
    """Seconds until the window of ``wall_s`` ends (when the budget is whole again)."""
    return (window_of(wall_s) + 1) * WINDOW_S - wall_s


def plan_lease(limit: int, granted: int, shortfall: int, fraction: float = LEASE_FRACTION) -> int:
    """How much to lease now: at least ``shortfall`` (what the local lease lacks), up
    to a slice, never more than half of what is left unless the shortfall needs it;
    0 when what is left cannot cover the shortfall (refuse the request)."""
    left = limit - max(0, granted)
    if shortfall <= 0 or left < shortfall:
        return 0
    slice_ = max(1, math.ceil(limit * fraction))
    return max(shortfall, min(slice_, math.ceil(left / 2)))


@dataclass(slots=True)
class Lease:
    """One frontend's lease of one tenant's kind in one window: ``leased`` taken from
    the shared counter, ``balance`` not spent yet (negative: a debt)."""

    window: int = -1
    leased: int = 0
    balance: float = 0.0


class BudgetLedger:
    """One frontend's leases, by key (``tenant.kind``). Bounded: one lease per key,
    replaced when its window ends."""

    __slots__ = ("_leases",)

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def lease(self, key: str, window: int) -> Lease:
        """The key's lease in ``window`` (a new window's starts with the old one's debt)."""
        lease = self._leases.get(key)
        if lease is None:
            lease = self._leases[key] = Lease(window)
        elif lease.window != window:
            debt = min(0.0, lease.balance) if window > lease.window else 0.0
            lease.window, lease.leased, lease.balance = window, 0, debt
        return lease

    def take(self, key: str, window: int, n: float) -> bool:
        """Spend ``n`` from the local lease if it holds that much (no store operation)."""
        lease = self.lease(key, window)
        if lease.balance < n:
            return False
        lease.balance -= n
        return True

    def shortfall(self, key: str, window: int, n: float) -> int:
        """What the local lease lacks to spend ``n`` (whole units)."""
        return max(0, math.ceil(n - self.lease(key, window).balance))

    def credit(self, key: str, window: int, n: int) -> None:
        """A lease of ``n`` was written to the shared counter for ``window``."""
        lease = self.lease(key, window)
        lease.leased += n
        lease.balance += n

    def refund(self, key: str, window: int, now_window: int, n: float) -> None:
        """A settled request gives back ``n`` (negative: it used more than it took).
        Given back only in the window it was taken from; a debt is charged to the
        current window (carried into the next one's lease)."""
        if n >= 0 and window != now_window:
            return
        self.lease(key, now_window).balance += n

    def unspent(self, key: str, window: int) -> int:
        """Whole units leased and not spent, which may be returned to the counter."""
        lease = self._leases.get(key)
        if lease is None or lease.window != window:
            return 0
        return max(0, min(lease.leased, math.floor(lease.balance)))

    def returned(self, key: str, window: int, n: int) -> None:
        """``n`` unspent units were taken off the shared counter."""
        lease = self.lease(key, window)
        lease.leased -= n
        lease.balance -= n

    def leased(self, key: str, window: int) -> int:
        lease = self._leases.get(key)
        return lease.leased if lease is not None and lease.window == window else 0

    def keys(self) -> list[str]:
        return list(self._leases)
