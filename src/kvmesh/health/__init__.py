"""Fault tolerance policies: pure, synchronous building blocks, the clock an argument.

Modules: :mod:`.breaker` (circuit breaker), :mod:`.state` (worker health state
machine, routing weight, :class:`~kvmesh.health.state.HealthTracker`), :mod:`.canary`
(canary set format and reply evaluation), :mod:`.degradation` (capacity model,
degradation levels, tier admission), :mod:`.migration` (when and how a request moves).
The async glue (checker loop, migration driver) lives with the roles that run it.
"""

from kvmesh.health.breaker import BreakerConfig, BreakerState, CircuitBreaker
from kvmesh.health.canary import (
    Canary,
    CanaryOutput,
    CanarySet,
    evaluate,
    load_canaries,
    record_canaries,
    save_canaries,
)
from kvmesh.health.degradation import (
    CapacityConfig,
    CapacityModel,
    Decision,
    DegradationController,
    DegradationLevel,
    Priority,
    admit,
)
from kvmesh.health.migration import MigrationBudget, estimate_migration, is_migratable
from kvmesh.health.state import (
    CheckKind,
    CheckResult,
    HealthConfig,
    HealthStateMachine,
    HealthStatus,
    HealthTracker,
    Transition,
)

__all__ = [
    "BreakerConfig",
    "BreakerState",
    "CircuitBreaker",
    "Canary",
    "CanaryOutput",
    "CanarySet",
    "evaluate",
    "load_canaries",
    "record_canaries",
    "save_canaries",
    "CapacityConfig",
    "CapacityModel",
    "Decision",
    "DegradationController",
    "DegradationLevel",
    "Priority",
    "admit",
    "MigrationBudget",
    "estimate_migration",
    "is_migratable",
    "CheckKind",
    "CheckResult",
    "HealthConfig",
    "HealthStateMachine",
    "HealthStatus",
    "HealthTracker",
    "Transition",
]
