"""The frontend's view of what is served: models, their preprocessors and workers.

A model entry appears with its first worker instance (its model folder gives the
tokenizer and chat template) and stays while the frontend runs; requests for it wait
(bounded) while it has no instance.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmesh.config import FrontendConfig
from kvmesh.errors import InvalidArgument, ModelNotFound
from kvmesh.observability.metrics import FrontendMetrics, ModelMetrics
from kvmesh.preprocess import Preprocessor
from kvmesh.preprocess.model import ModelInfo, load_model_folder
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.router.push import PushRouter, make_policy
from kvmesh.runtime.instances import Instance, InstanceSet
from kvmesh.runtime.tcp_client import TcpClient

__all__ = ["ModelEntry", "ModelRegistry"]


class ModelEntry:
    def __init__(self, info: ModelInfo, config: FrontendConfig, metrics: ModelMetrics) -> None:
        self.name = info.name
        self.info = info
        self.preprocessor = Preprocessor(info)
        self.engine: EngineConfig | None = None
        self.instances = InstanceSet()
        self.router = PushRouter(self.instances, make_policy(config.router_mode), config.worker_wait_s, f"model {info.name!r}")
        self.metrics = metrics
        self.created = int(time.time())

    @property
    def context_length(self) -> int:
        if self.engine is not None:
            return min(self.engine.context_length, self.info.context_length)
        return self.info.context_length


class ModelRegistry:
    def __init__(self, config: FrontendConfig, metrics: FrontendMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.models: dict[str, ModelEntry] = {}
        self._worker_model: dict[int, str] = {}

    def add_model(self, path: str, name: str | None = None) -> ModelEntry:
        """Load a model folder (tokenizer, template) ahead of its workers."""
        info = load_model_folder(path, name=name)
        entry = self.models.get(info.name)
        if entry is None:
            entry = self.models[info.name] = ModelEntry(info, self.config, self.metrics.model(info.name))
        return entry

    def get(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            available = ", ".join(sorted(self.models)) or "none yet"
            raise ModelNotFound(f"the model {name!r} does not exist; available models: {available}")
        return entry

    def add_instance(self, info: InstanceInfo, client_factory: Callable[[str], TcpClient] | None = None) -> Instance:
        name = info.engine.served_model_name
        entry = self.models.get(name)
        if entry is None:
            if not info.model_path:
                raise InvalidArgument(f"worker {info.worker_id} serves {name!r} but names no model folder")
            entry = self.add_model(info.model_path, name)
        entry.engine = info.engine
        factory = client_factory or self._client
        instance = Instance(info, factory(info.address))
        entry.instances.add(instance)
        self._worker_model[info.worker_id] = name
        self.metrics.workers.labels(name).set(len(entry.instances))
        return instance

    def remove_instance(self, worker_id: int) -> Instance | None:
        name = self._worker_model.pop(worker_id, None)
        if name is None:
            return None
        entry = self.models[name]
        instance = entry.instances.remove(worker_id)
        self.metrics.workers.labels(name).set(len(entry.instances))
        return instance

    def _client(self, address: str) -> TcpClient:
        return TcpClient(address, self.config.connect_timeout_s, self.config.response_timeout_s)

    def ready(self) -> bool:
        return any(len(e.instances) for e in self.models.values())
