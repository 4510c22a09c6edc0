"""``kvmesh run``'s several models: the ``[[models]]`` tables of its ``--config`` file.

Each table is one model: its ``name`` (the name clients ask for; default: the model
folder's), ``workers`` (default: ``--workers``) and any worker or engine setting under
its config-file key (``model-path``, ``engine``, ``block-size``, ``speedup``, ...).
A model's value comes, as every setting's, from the first of: a flag, a ``KVMESH_*``
variable, the model's table, the file's top level, the default; so a flag given on the
command line applies to every model, and top-level keys are every model's defaults::

    router-mode = "kv"

    [[models]]
    name = "chat"
    workers = 2

    [[models]]
    name = "code"
    model-path = "/models/other"
    engine = "mocker"
    speedup = 4.0

Pure: tables in, :class:`~kvmesh.config.ModelFleet` values out (the caller builds each
worker config from its merged keys).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvmesh.config import ModelFleet, WorkerConfig

__all__ = ["MAX_MODELS", "model_fleets"]

MAX_MODELS = 64  # models one kvmesh run serves, at most
_OWN_KEYS = {"name", "workers"}  # a table's keys that are no worker setting


def model_fleets(
    tables: object,
    known: set[str],
    default_workers: int,
    worker_config: Callable[[dict[str, object]], WorkerConfig],
) -> tuple[ModelFleet, ...]:
    """The fleets of ``tables`` (the file's ``models`` value); ``known``: the keys a
    table may use besides ``name`` and ``workers``; ``worker_config``: a worker config
    from a model's own keys (merged by the caller over the top-level ones).
    ``ValueError`` naming the table and key that is wrong."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ValueError("models must be an array of tables: [[models]] name = \"...\" ...")
    if not 1 <= len(tables) <= MAX_MODELS:
        raise ValueError(f"[[models]]: give 1 to {MAX_MODELS} models, got {len(tables)}")
    fleets = tuple(_fleet(i, t, known, default_workers, worker_config) for i, t in enumerate(tables))
    _check_names(fleets)
    return fleets


def _fleet(
    index: int, table: Mapping[str, object], known: set[str], default_workers: int,
    worker_config: Callable[[dict[str, object]], WorkerConfig],
) -> ModelFleet:  # fmt: skip
    where = f"[[models]] #{index + 1}"
    unknown = sorted(set(table) - known - _OWN_KEYS)
    if unknown:
        raise ValueError(f"{where}: no such model setting: {', '.join(unknown)} (a model takes name, workers and "
                         "worker/engine settings such as model-path, engine, block-size)")  # fmt: skip
    keys = {k: v for k, v in table.items() if k not in _OWN_KEYS}
    name = table.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ValueError(f"{where}: name must be a string, got {name!r}")
        keys["served-model-name"] = name
    workers = table.get("workers", default_workers)
    try:
        return ModelFleet(worker_config(keys), workers)  # type: ignore[arg-type]  # checked by ModelFleet
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _check_names(fleets: tuple[ModelFleet, ...]) -> None:
    """Two tables that give the same ``name`` are refused now (names defaulting to a
    folder's are checked once the folders are read)."""
    seen: set[str] = set()
    for fleet in fleets:
        name = fleet.worker.served_model_name
        if name is None:
            continue
        if name in seen:
            raise ValueError(f"[[models]]: two models are named {name!r}; give each its own name")
        seen.add(name)
