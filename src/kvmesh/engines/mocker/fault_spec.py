"""What a mocker fault is (:class:`FaultSpec`) and its CLI form; no engine imports, so
the mocker's options and settings can hold one. The run-time side is :mod:`.faults`.

``start`` is the one kind that fires before any step: the mocker's factory refuses to
build the engine (a worker that fails at start, as a misconfigured real engine does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

from kvmesh.settings import non_negative, one_of, positive, require, within

__all__ = ["FaultKind", "FaultSpec"]

FaultKind = Literal["none", "crash", "hang", "slow", "corrupt", "start"]
_KINDS = ("none", "crash", "hang", "slow", "corrupt", "start")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """What goes wrong and when; see the module docstring."""

    kind: FaultKind = "none"
    factor: float = 1.0
    after_tokens: int = 0
    probability: float = 1.0
    seed: int = 0
    # corrupt only: 1 leaves the tokens alone and shifts only their log-probabilities
    # (subtle silent corruption: the argmax survives, the distribution does not)
    subtle: int = 0

    def __post_init__(self) -> None:
        require("fault kind", self.kind, one_of(*_KINDS))
        require("fault factor", self.factor, positive)
        require("fault after_tokens", self.after_tokens, non_negative)
        require("fault probability", self.probability, within(0.0, 1.0))
        require("fault subtle", self.subtle, within(0, 1))

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``kind[:key=value,...]`` → spec; raises ``ValueError`` on anything unknown."""
        kind, _, rest = text.strip().partition(":")
        require("fault kind", kind, one_of(*_KINDS))
        fields: dict[str, float | int] = {}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("factor", "after_tokens", "probability", "seed", "subtle"):
                raise ValueError(f"bad fault option {item!r} in {text!r}")
            fields[key] = int(value) if key in ("after_tokens", "seed", "subtle") else float(value)
        return cls(cast(FaultKind, kind), **fields)  # type: ignore[arg-type]  # each key gets its own type above
