"""The engine registry: name → settings type → factory.

``--engine NAME`` is looked up here (the worker builds its engine with
:func:`build`, the CLI adds each entry's flags from its settings class), so the
worker and the configuration import no engine. An entry's factory imports its
engine lazily: a worker imports only the engine it runs (and torch only for ``hf``).

An engine's capabilities are the Protocols of :mod:`kvmesh.engines.base` it
implements (KV block access, KV events, load reports, batch tuning); fault injection,
a test aid, registers with the entry: ``inject_fault`` (the mocker's, reached through
the worker's ``fault`` endpoint and ``/admin/fault``; it gets the engine itself, never
a disaggregation front).

To add an engine: declare its settings class (a frozen dataclass of
:func:`kvmesh.settings.setting` fields subclassing
:class:`~kvmesh.settings.EngineSettings`, in :mod:`kvmesh.engines.settings` or any
light module), write ``factory(settings, spec, publisher) -> Engine`` that imports the
engine inside (:func:`~kvmesh.engines.settings.options_from` builds its options from
the settings and the spec), and :func:`register` an :class:`EngineEntry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from kvmesh.engines.base import Engine
from kvmesh.engines.settings import HfSettings, MockerSettings, VllmSettings, options_from
from kvmesh.runtime.events import EventPublisher
from kvmesh.settings import EngineSettings

__all__ = ["EngineSpec", "EngineEntry", "register", "entry", "names", "build", "ENTRIES"]

S = TypeVar("S", bound=EngineSettings)


@dataclass(frozen=True)
class EngineSpec:
    """What every factory gets besides its own settings: the model folder and what
    the worker read from it, the worker's id and the KV block size."""

    model_path: str
    served_model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    special_token_ids: tuple[int, ...]
    context_length: int
    worker_id: int = 0
    block_size: int = 16
    loras: tuple[str, ...] = ()  # --lora NAME=PATH
    max_loras: int | None = None  # None: the engine's default


@dataclass(frozen=True)
class EngineEntry(Generic[S]):
    name: str
    settings: type[S]
    factory: Callable[[S, EngineSpec, EventPublisher], Engine]
    help: str
    inject_fault: Callable[[Engine, str], None] | None = None

    def build(self, settings: EngineSettings | None, spec: EngineSpec, publisher: EventPublisher) -> Engine:
        if settings is None:
            settings = self.settings()
        if not isinstance(settings, self.settings):
            raise TypeError(f"engine {self.name!r} takes {self.settings.__name__}, got {type(settings).__name__}")
        return self.factory(settings, spec, publisher)


ENTRIES: dict[str, EngineEntry[EngineSettings]] = {}


def register(new: EngineEntry[S]) -> None:
    """Add (or replace) an engine."""
    ENTRIES[new.name] = cast(EngineEntry[EngineSettings], new)


def names() -> tuple[str, ...]:
    return tuple(ENTRIES)


def entry(name: str) -> EngineEntry[EngineSettings]:
    try:
        return ENTRIES[name]
    except KeyError:
        raise ValueError(f"--engine must be one of {', '.join(ENTRIES)}, got {name!r}") from None


def build(name: str, settings: EngineSettings | None, spec: EngineSpec, publisher: EventPublisher) -> Engine:
    return entry(name).build(settings, spec, publisher)


# --- the built-in engines ----------------------------------------------------


def _mocker(settings: MockerSettings, spec: EngineSpec, publisher: EventPublisher) -> Engine:
    from kvmesh.engines.mocker import MockerEngine, MockerOptions

    options = MockerOptions.from_settings(settings, spec, model=spec.model_path)
    if options.fault.kind == "start":
        raise RuntimeError(f"mocker fault {settings.fault!r}: the engine refuses to start")
    return MockerEngine(options, publisher)


def _mocker_fault(engine: Engine, text: str) -> None:
    from kvmesh.engines.mocker import MockerEngine
    from kvmesh.engines.mocker.fault_spec import FaultSpec

    if not isinstance(engine, MockerEngine):
        raise ValueError(f"{type(engine).__name__} has no fault injection")
    engine.set_fault(FaultSpec.parse(text) if text else FaultSpec())


def _hf(settings: HfSettings, spec: EngineSpec, publisher: EventPublisher) -> Engine:
    from kvmesh.engines.hf.engine import HfEngine
    from kvmesh.engines.hf.options import HfOptions

    return HfEngine(options_from(HfOptions, spec, settings), publisher)


def _vllm(settings: VllmSettings, spec: EngineSpec, publisher: EventPublisher) -> Engine:
    from kvmesh.engines.vllm.engine import VllmEngine
    from kvmesh.engines.vllm.options import VllmOptions

    return VllmEngine(options_from(VllmOptions, spec, settings, model=spec.model_path), publisher)


register(EngineEntry("mocker", MockerSettings, _mocker, "simulated vLLM-style engine (tests, capacity)", _mocker_fault))
register(EngineEntry("vllm", VllmSettings, _vllm, "vLLM's async engine (pip install vllm)"))
register(EngineEntry("hf", HfSettings, _hf, "a Llama-family model on the CPU through PyTorch"))
