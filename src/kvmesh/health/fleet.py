"""The fleet as the health monitor and the load shedder see it.

:class:`FleetView` is what they need of the frontend's served models (implemented by
:class:`kvmesh.frontend.models.ModelRegistry`), so that health never reaches into the
frontend: the worker instances, their health weights and capacities, and a model's
tokenizer for canary prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvmesh.runtime.instances import Instance

__all__ = ["FleetView"]


class FleetView(Protocol):
    def workers(self) -> list[Instance]:
        """Every worker instance of every served model."""
        ...

    def weight(self, worker_id: int) -> float:
        """The worker's routing weight from health, in [0, 1] (1 when health is off)."""
        ...

    def capacities(self, worker_ids: Sequence[int]) -> dict[int, float] | None:
        """Each worker's share of a healthy worker's capacity; None when health is off."""
        ...

    def canary_prompt(self, model: str, text: str) -> list[int] | None:
        """``text`` as ``model``'s prompt token ids (chat template applied); None for
        a model not served here."""
        ...
