"""Fault tolerance policies: pure, synchronous building blocks, the clock an argument.

Modules: :mod:`.breaker` (circuit breaker), :mod:`.state` (worker health state
machine, routing weight, :class:`~kvmesh.health.state.HealthTracker`), :mod:`.canary`
(canary set format and reply evaluation), :mod:`.degradation` (capacity model,
degradation levels, tier admission), :mod:`.migration` (when and how a request moves).
The async glue (checker loop, migration driver) lives with the roles that run it.

The package's names resolve on first use (PEP 562 ``__getattr__``): a module that
imports one submodule (the frontend's owner: :mod:`.migration`) does not load the
others (issue 36: the canary and degradation modules only where they are switched on).
"""

from typing import TYPE_CHECKING

from kvmesh.lazy import lazy_names

if TYPE_CHECKING:
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

_HOME = {
    "BreakerConfig": "breaker",
    "BreakerState": "breaker",
    "CircuitBreaker": "breaker",
    "Canary": "canary",
    "CanaryOutput": "canary",
    "CanarySet": "canary",
    "evaluate": "canary",
    "load_canaries": "canary",
    "record_canaries": "canary",
    "save_canaries": "canary",
    "CapacityConfig": "degradation",
    "CapacityModel": "degradation",
    "Decision": "degradation",
    "DegradationController": "degradation",
    "DegradationLevel": "degradation",
    "Priority": "degradation",
    "admit": "degradation",
    "MigrationBudget": "migration",
    "estimate_migration": "migration",
    "is_migratable": "migration",
    "CheckKind": "state",
    "CheckResult": "state",
    "HealthConfig": "state",
    "HealthStateMachine": "state",
    "HealthStatus": "state",
    "HealthTracker": "state",
    "Transition": "state",
}


__getattr__ = lazy_names(__name__, _HOME)
