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
          (silent data corruption: the scheduler itself keeps the true tokens)
========= =============================================================================

When it fires: the fault is armed once ``after_tokens`` tokens have been generated
(across all requests) since the spec was set; from then on, each step fires with
``probability`` (drawn from ``random.Random(seed)``, so runs repeat). ``crash`` and
``hang`` end everything the first time they fire.

Specs parse from the CLI/env form ``kind[:key=value,...]``, e.g. ``slow:factor=4`` or
``corrupt:after_tokens=10,probability=0.5,seed=7`` (:meth:`FaultSpec.parse`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeGuard, TypeVar

from kvmesh.errors import EngineShutdown


class _Step(Protocol):
    """What a fault reads of a step's output (the scheduler's ``StepOutput``, a
    dataclass; named structurally, as the scheduler imports options, which import this)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def tokens(self) -> dict[int, int]: ...

    @property
    def duration_ms(self) -> float: ...


StepT = TypeVar("StepT", bound=_Step)

__all__ = ["FaultKind", "FaultSpec", "FaultInjector", "corrupt_token"]

FaultKind = Literal["none", "crash", "hang", "slow", "corrupt"]
_KINDS = ("none", "crash", "hang", "slow", "corrupt")


def _is_kind(kind: str) -> TypeGuard[FaultKind]:
    return kind in _KINDS


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """What goes wrong and when; see the module docstring."""

    kind: FaultKind = "none"
    factor: float = 1.0
    after_tokens: int = 0
    probability: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"fault kind must be one of {_KINDS}, got {self.kind!r}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"fault factor must be a positive finite number, got {self.factor}")
        if self.after_tokens < 0:
            raise ValueError(f"fault after_tokens must be >= 0, got {self.after_tokens}")
        if not (0.0 <= self.probability <= 1.0):
            raise ValueError(f"fault probability must be within [0, 1], got {self.probability}")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``kind[:key=value,...]`` → spec; raises ``ValueError`` on anything unknown."""
        kind, _, rest = text.strip().partition(":")
        fields: dict[str, Any] = {}  # int for after_tokens and seed, else float
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("factor", "after_tokens", "probability", "seed"):
                raise ValueError(f"bad fault option {item!r} in {text!r}")
            fields[key] = int(value) if key in ("after_tokens", "seed") else float(value)
        if not _is_kind(kind):
            raise ValueError(f"fault kind must be one of {_KINDS}, got {kind!r}")
        return cls(kind, **fields)


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

    async def apply(self, out: StepT) -> StepT:
        """Called by the step loop after each step, before the step is slept or delivered."""
        if not self._fires(len(out.tokens)):
            return out
        kind = self.spec.kind
        if kind == "slow":
            return dataclasses.replace(out, duration_ms=out.duration_ms * self.spec.factor)
        if kind == "corrupt":
            seed, vocab = self.spec.seed, self._vocab_size
            return dataclasses.replace(out, tokens={s: corrupt_token(t, seed, vocab) for s, t in out.tokens.items()})
        if kind == "hang":
            await self._released.wait()
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
