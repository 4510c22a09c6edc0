"""Fault injection for the mocker: make a worker crash, hang, slow down or lie.

A :class:`FaultSpec` says what goes wrong and when; it is set at start
(``MockerOptions.fault``) or swapped at run time (``MockerEngine.set_fault``).

========= =============================================================================
kind      effect, on every step it fires
========= =============================================================================
none      nothing (the engine holds no injector: the step loop pays one ``is None``)
crash     the process exits: ``exit_fn(1)`` (``os._exit`` unless injected). When an
          injected ``exit_fn`` returns, the engine dies instead: every open stream
          ends with :class:`~kvmesh.errors.EngineShutdown` and ``generate`` refuses
hang      the step loop stops before delivering; streams stay open and silent (a
          stop/cancel still ends them) until another spec is set
slow      the step takes ``factor`` × its modelled time (thermal throttling)
corrupt   each delivered token id is replaced by a different, deterministic one
          (silent data corruption: the scheduler itself keeps the true tokens), and
          its log-probability drops by ``CORRUPT_LOGPROB_SHIFT`` nats; with
          ``subtle=1`` only the log-probabilities move (the argmax survives: only a
          canary that checks the top logprob sees it)
start     no step: the mocker's factory refuses to build the engine, so the worker
          fails at start (crash-loop tests of the supervisor); inert at run time
========= =============================================================================

When it fires: the fault is armed once ``after_tokens`` tokens have been generated
(across all requests) since the spec was set; from then on, each step fires with
``probability`` (drawn from ``random.Random(seed)``, so runs repeat). ``crash`` and
``hang`` end everything the first time they fire.

Specs parse from the CLI/env form ``kind[:key=value,...]``, e.g. ``slow:factor=4`` or
``corrupt:after_tokens=10,probability=0.5,seed=7`` or ``corrupt:subtle=1``
(:meth:`FaultSpec.parse`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Callable

from kvmesh.engines.mocker.fault_spec import FaultKind, FaultSpec
from kvmesh.engines.mocker.scheduler import StepOutput
from kvmesh.errors import EngineShutdown

__all__ = ["FaultKind", "FaultSpec", "FaultInjector", "corrupt_token", "CORRUPT_LOGPROB_SHIFT"]

# How far a corrupt step moves the log-probabilities (nats): beyond a canary's recorded
# margin (DEFAULT_LOGPROB_MARGIN, 1 nat), the flattened softmax of a faulty unit.
CORRUPT_LOGPROB_SHIFT = -2.5

def corrupt_token(token: int, seed: int, vocab_size: int) -> int:
    """A token id that differs from ``token``, the same for the same inputs."""
    if vocab_size < 2:
        return token + 1
    shift = 1 + (seed * 0x9E3779B1 + token) % (vocab_size - 1)
    return (token + shift) % vocab_size


class FaultInjector:
    """The run-time state of one :class:`FaultSpec`, owned by one engine's step loop."""

    __slots__ = ("spec", "_vocab_size", "_exit_fn", "_rng", "_seen", "_released")

    def __init__(self, spec: FaultSpec, vocab_size: int, exit_fn: Callable[[int], object] = os._exit) -> None:
        self.spec = spec
        self._vocab_size = vocab_size
        self._exit_fn = exit_fn
        self._rng = random.Random(spec.seed)
        self._seen = 0  # tokens generated since the spec was set
        self._released = asyncio.Event()

    def release(self) -> None:
        """The spec was replaced: a hung step loop may go on."""
        self._released.set()

    async def apply(self, out: StepOutput) -> StepOutput:
        """Called by the step loop after each step, before the step is slept or delivered."""
        if not self._fires(len(out.tokens)):
            return out
        kind = self.spec.kind
        if kind == "slow":
            return dataclasses.replace(out, duration_ms=out.duration_ms * self.spec.factor)
        if kind == "corrupt":
            shift = out.logprob_shift + CORRUPT_LOGPROB_SHIFT
            if self.spec.subtle:
                return dataclasses.replace(out, logprob_shift=shift)
            seed, vocab = self.spec.seed, self._vocab_size
            tokens = {s: corrupt_token(t, seed, vocab) for s, t in out.tokens.items()}
            return dataclasses.replace(out, tokens=tokens, logprob_shift=shift)
        if kind == "hang":
            await self._released.wait()
            return out
        if kind == "start":  # fires only when the engine is built (kvmesh.engines.registry)
            return out
        self._exit_fn(1)  # crash; os._exit never returns
        raise EngineShutdown("mocker fault: crash")

    def _fires(self, new_tokens: int) -> bool:
        armed = self._seen >= self.spec.after_tokens
        self._seen += new_tokens
        if not armed:
            return False
        p = self.spec.probability
        return p >= 1.0 or self._rng.random() < p
