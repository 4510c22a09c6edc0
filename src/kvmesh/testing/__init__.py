"""Test helpers for engine authors: the conformance kit and request contexts.

``await run_conformance(lambda: MyEngine(...))`` runs the eight checks of
:mod:`kvmesh.testing.conformance`; :func:`mock_context` and :func:`cancelling_context`
help hand-written engine tests.
"""

from kvmesh.testing import conformance
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

__all__: list[str] = []
__all__ += conformance.__all__  # the kit's public names, listed once (there)
