"""Test helpers for engine authors: the conformance kit and request contexts.

``await run_conformance(lambda: MyEngine(...))`` runs the eight checks of
:mod:`kvmesh.testing.conformance`; :func:`mock_context` and :func:`cancelling_context`
help hand-written engine tests.
"""

from kvmesh.testing.conformance import (
    CHECKS,
    CancellationIgnored,
    CancellationNotObserved,
    CancellingContext,
    Check,
    ChunkAfterTerminal,
    CleanupWithoutStartFailed,
    ConcurrentGenerateFailed,
    ConformanceFailure,
    EmptyModelInConfig,
    NoTerminalChunk,
    SecondCleanupFailed,
    cancelling_context,
    default_request,
    mock_context,
    run_conformance,
)

__all__ = [
    "run_conformance",
    "CHECKS",
    "Check",
    "ConformanceFailure",
    "EmptyModelInConfig",
    "NoTerminalChunk",
    "ChunkAfterTerminal",
    "ConcurrentGenerateFailed",
    "CancellationNotObserved",
    "CancellationIgnored",
    "SecondCleanupFailed",
    "CleanupWithoutStartFailed",
    "default_request",
    "mock_context",
    "cancelling_context",
    "CancellingContext",
]
