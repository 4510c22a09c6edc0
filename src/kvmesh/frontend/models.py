"""The frontend's view of what is served: models, their preprocessors and workers.

A model entry appears with its first worker instance (its model folder gives the
tokenizer and chat template) and stays while the frontend runs; requests for it wait
(bounded) while it has no instance, then get a 503 naming the model. Several models are
served side by side, each with its own workers, router and KV index.

LoRA adapters (:class:`Adapters`): a request whose ``model`` names an adapter is served
by its base model's entry with ``PreprocessedRequest.adapter`` set. The registry learns
adapters from the admin routes (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``,
fanned out to the model's workers that take adapters: ``EngineConfig.max_adapters`` > 0)
and from each such worker's list when it attaches (its ``--lora`` adapters); each
worker's answer also tells the KV router which adapters it holds (affinity).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.config import FrontendConfig
from kvmesh.errors import InvalidArgument, KvmeshError, ModelNotFound, ResponseTimeout, StreamIncomplete
from kvmesh.observability.metrics import FrontendMetrics, ModelMetrics
from kvmesh.preprocess import Preprocessor
from kvmesh.preprocess.model import ModelInfo, load_model_folder
from kvmesh.protocol import (
    MAX_MODEL_FILE_BYTES, MODEL_FILE_NAMES, EngineConfig, InstanceInfo, LoraCommand, LoraState, ModelFiles,
)  # fmt: skip
from kvmesh.router.push import PushRouter, make_policy
from kvmesh.runtime.distributed import RequestClient, call
from kvmesh.runtime.event_plane.base import EventPlane
from kvmesh.runtime.instances import Instance, InstanceSet
from kvmesh.runtime.names import KV_EVENTS_TOPIC, LORA, MODEL_FILES

if TYPE_CHECKING:
    from kvmesh.health.degradation import CapacityConfig
    from kvmesh.health.monitor import HealthMonitor
    from kvmesh.health.shedding import LoadShedder
    from kvmesh.health.state import HealthConfig
    from kvmesh.router.service import KvRouterService

__all__ = ["Adapters", "ModelEntry", "ModelRegistry", "fetch_model_files", "check_model_files", "model_cache_dir"]

log = logging.getLogger("kvmesh.frontend")

MAX_SERVED_ADAPTERS = 4096  # adapter names one frontend knows, at most
LORA_LIST_TIMEOUT_S = 2.0  # a LoRA worker's list of adapters, asked when it attaches
LORA_COMMAND_TIMEOUT_S = 60.0  # a worker's answer to an admin load / unload (a real load reads and places weights)
_decode_lora = msgspec.msgpack.Decoder(LoraState).decode


def _capacity_config(c: FrontendConfig) -> CapacityConfig:
    from kvmesh.health.degradation import CapacityConfig

    return CapacityConfig(
        slo_ttft_ms=c.slo_ttft_ms,
        slo_tpot_ms=c.slo_tpot_ms,
        avg_output_tokens=c.slo_output_tokens,
        max_batch_size=c.slo_max_batch,
        retry_after_s=c.shed_retry_after_s,
        recover_hold_s=min(30.0, 10 * c.slo_ttft_ms / 1000 + 5),
    )


def _health_config(c: FrontendConfig) -> HealthConfig:
    from kvmesh.health.breaker import BreakerConfig
    from kvmesh.health.state import HealthConfig

    return HealthConfig(check_interval_s=c.canary_interval_s, breaker=BreakerConfig(recovery_timeout_s=c.breaker_recovery_s))

_decode_files = msgspec.msgpack.Decoder(ModelFiles).decode


def model_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvmesh" / "models"


def check_model_files(files: ModelFiles, name: str) -> None:
    """InvalidArgument unless every file has one of the fixed ``MODEL_FILE_NAMES`` (so
    no name can leave the cache folder) and at most ``MAX_MODEL_FILE_BYTES``."""
    allowed = ", ".join(MODEL_FILE_NAMES)
    for file_name, data in files.files.items():
        if file_name not in MODEL_FILE_NAMES:
            raise InvalidArgument(f"the worker serving {name!r} sent a model file named {file_name[:80]!r}; allowed: {allowed}")
        if len(data) > MAX_MODEL_FILE_BYTES:
            raise InvalidArgument(f"the worker serving {name!r} sent {file_name} of {len(data)} bytes, over {MAX_MODEL_FILE_BYTES}")
    if "tokenizer.json" not in files.files:
        raise InvalidArgument(f"the worker serving {name!r} sent no tokenizer.json")


def _cache_folder_name(name: str, digest: str) -> str:
    # Model names come from workers: keep a safe subset, never a separator or a leading dot.
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("/", "--"))[:100].lstrip(".")
    return f"{safe or 'model'}-{digest}"


async def fetch_model_files(client: RequestClient, name: str) -> str:
    """Copy a worker's model files (config, tokenizer, template) into the local cache.

    The files are data from the network: only the fixed names of a model folder are
    accepted (:func:`check_model_files`), each written inside a fresh folder of ours."""
    files: ModelFiles | None = await call(client, MODEL_FILES, decode=_decode_files)
    if files is None:
        raise InvalidArgument(f"the worker serving {name!r} sent no model files")
    check_model_files(files, name)
    digest = hashlib.sha256(b"".join(files.files[k] for k in sorted(files.files))).hexdigest()[:16]
    cache = model_cache_dir()
    folder = cache / _cache_folder_name(name, digest)
    if not (folder / "tokenizer.json").is_file():
        import shutil  # here: shutil brings zlib, bz2 and lzma to every frontend's start

        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
        tmp.mkdir(mode=0o700)  # new, ours: nothing planted in it
        try:
            for file_name, data in files.files.items():
                (tmp / file_name).write_bytes(data)
            if folder.exists():  # another process cached it meanwhile
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(folder)


class ModelEntry:
    def __init__(self, info: ModelInfo, config: FrontendConfig, metrics: ModelMetrics, defer_template: bool = False) -> None:
        self.name = info.name
        self.info = info
        self.preprocessor = Preprocessor(info, defer_template=defer_template)
        self.engine: EngineConfig | None = None
        self.instances = InstanceSet()
        # kv modes swap in their policy when the first worker tells the block size
        mode = "round_robin" if config.kv_routing else config.router_mode
        self.router = PushRouter(self.instances, make_policy(mode), config.worker_wait_s, f"model {info.name!r}")
        self.metrics = metrics
        self.kv: KvRouterService | None = None  # the KV router, in kv / kv-approx modes
        self.kv_starting = asyncio.Lock()  # one KV router, however many workers attach at once
        self.migration_limit = config.migration_limit
        self.health: HealthMonitor | None = None
        self.created = int(time.time())

    @property
    def context_length(self) -> int:
        if self.engine is not None:
            return min(self.engine.context_length, self.info.context_length)
        return self.info.context_length


class ModelRegistry:
    def __init__(self, config: FrontendConfig, metrics: FrontendMetrics, event_plane: EventPlane | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.event_plane = event_plane
        self.health: HealthMonitor | None = None
        self.shedder: LoadShedder | None = None
        # the shedder's and the canaries' modules: imported only where switched on (issue 36)
        if config.degradation:
            from kvmesh.health.shedding import LoadShedder

            self.shedder = LoadShedder(self, _capacity_config(config), metrics=metrics)
        if config.canary_interval_s > 0:
            from kvmesh.health.monitor import HealthMonitor

            self.health = HealthMonitor(self, _health_config(config), config.canary_timeout_s, config.canary_files, metrics)
            shedder = self.shedder
            if shedder is not None:  # levels 3-4 relax the canaries' latency threshold as they relax the SLOs
                self.health.latency_multiplier = lambda: shedder.controller.actions.latency_multiplier
        self.models: dict[str, ModelEntry] = {}
        self._worker_model: dict[int, str] = {}
        self.adapters = Adapters(self)

    def add_model(self, path: str, name: str | None = None, defer_template: bool = False) -> ModelEntry:
        """Load a model folder (tokenizer, template) ahead of its workers; ``defer_template``:
        its chat template compiled on first use (``Preprocessor.compile_template``)."""
        info = load_model_folder(path, name=name)
        entry = self.models.get(info.name)
        if entry is None:
            metrics = self.metrics.model(info.name)
            entry = self.models[info.name] = ModelEntry(info, self.config, metrics, defer_template)
            entry.health = self.health
            entry.router.weights = self.health.weights if self.health is not None else None
        return entry

    def get(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            base = self.adapters.parents.get(name)
            if base is not None:
                return self.models[base]  # an adapter: its base model's entry (the caller sets the request's adapter)
            available = ", ".join(sorted(self.models)) or "none yet"
            raise ModelNotFound(f"the model {name!r} does not exist; available models: {available}")
        return entry

    async def attach(self, info: InstanceInfo, client: RequestClient) -> Instance:
        """Route to a new worker instance; load its model first if it is new here."""
        name = info.engine.served_model_name
        if name not in self.models:
            self.add_model(await self._model_folder(info, client), name)
        entry = self.models[name]
        if self.config.kv_routing and entry.kv is None:
            async with entry.kv_starting:  # subscribing awaits (NATS): the next attaches must wait for it
                if entry.kv is None:
                    await self._start_kv(entry, info)
        policy = entry.router.policy
        if info.kv is not None and info.kv.serves_prefixes and getattr(policy, "peer_fetch", False) is None:
            policy.peer_fetch = self._peer_fetch(entry, info)  # type: ignore[attr-defined]  # (KvPolicy: checked)
        instance = self._add_instance(info, client)
        if info.engine.max_adapters > 0:
            await self.adapters.ask(entry, instance)
        return instance

    async def _start_kv(self, entry: ModelEntry, info: InstanceInfo) -> None:
        from kvmesh.router.core import RouterSettings
        from kvmesh.router.service import AdmissionSettings, KvPolicy, KvRouterService

        from kvmesh.router.cost import adapter_load_tokens

        c = self.config
        settings = RouterSettings(
            block_size=c.kv_block_size or info.engine.kv_block_size,
            mode=c.router_mode,
            overlap_weight=c.kv_overlap_weight,
            temperature=c.router_temperature,
            adapter_load_tokens=adapter_load_tokens(c.lora_load_ms, c.router_prefill_rate),
            tier_weights=(c.kv_tier_weights[0], c.kv_tier_weights[1]),
        )
        subscription = index = None
        if c.router_mode == "kv" and c.router_shards > 1:
            index = await self._start_shards(entry, settings)
        elif self.event_plane is not None and c.router_mode == "kv":
            subscription = await self.event_plane.subscribe(KV_EVENTS_TOPIC)
        admission = AdmissionSettings(threshold=c.admission_threshold, max_queue=c.admission_max_queue)
        entry.kv = KvRouterService(settings, subscription, entry.metrics.router, admission, index, self._worker_model)
        entry.kv.start()
        entry.router.policy = KvPolicy(entry.kv)  # peer_fetch: set by attach once a worker serves prefixes

    def _peer_fetch(self, entry: ModelEntry, info: InstanceInfo) -> Any:
        """(settings, worker → KV endpoint) when the model's workers serve prefixes to
        peers (``--peer-fetch``; router/peer.py), else None: no work per request."""
        from kvmesh.router.peer import PeerFetchSettings

        if info.kv is None or not info.kv.serves_prefixes:
            return None
        instances = entry.router.instances

        def endpoint_of(worker_id: int) -> Any:
            instance = instances.get(worker_id)
            return instance.info.kv if instance is not None else None

        c = self.config
        return PeerFetchSettings(c.peer_fetch_gbps, c.router_prefill_rate), endpoint_of

    async def _start_shards(self, entry: ModelEntry, settings: Any) -> Any:
        """The KV index over ``router_shards`` processes (router/shards.py), fed by zmq."""
        from kvmesh.router.shards import Hello, ShardedKvIndex

        host = getattr(self.event_plane, "host", None)
        if self.event_plane is None or self.event_plane.name != "zmq" or not isinstance(host, str):
            raise InvalidArgument("--router-shards above 1 needs the zmq event plane")
        index = ShardedKvIndex(self.config.router_shards, entry.metrics.router)
        index.timeout_s = self.config.router_shard_wait_ms / 1000
        await index.start(Hello(entry.name, settings.block_size, settings.max_blocks_per_worker, host))
        return index

    async def _model_folder(self, info: InstanceInfo, client: RequestClient) -> str:
        path = info.model_path
        if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
            return path
        return await fetch_model_files(client, info.engine.served_model_name)

    def _add_instance(self, info: InstanceInfo, client: RequestClient) -> Instance:
        name = info.engine.served_model_name
        entry = self.models[name]
        entry.engine = info.engine
        instance = Instance(info, client)
        if entry.kv is not None:
            entry.kv.add_worker(instance)  # refuses a worker whose block size differs
        entry.instances.add(instance)
        if self.health is not None:
            self.health.attached(instance)
        self._worker_model[info.worker_id] = name
        self.metrics.workers.labels(name).set(len(entry.instances))
        return instance

    async def detach(self, worker_id: int) -> None:
        """Stop routing to a worker; its streams in flight finish on their own."""
        instance = self.remove_instance(worker_id)
        if instance is not None and not self._shares_client(instance):
            close = getattr(instance.client, "close_when_idle", instance.client.close)
            await close()

    def _shares_client(self, instance: Instance) -> bool:
        return any(i.client is instance.client for e in self.models.values() for i in e.instances.all())

    def remove_instance(self, worker_id: int) -> Instance | None:
        name = self._worker_model.pop(worker_id, None)
        if name is None:
            return None
        entry = self.models[name]
        instance = entry.instances.remove(worker_id)
        if entry.kv is not None:
            entry.kv.remove_worker(worker_id)
        if self.health is not None:
            self.health.detached(worker_id)
        self.metrics.workers.labels(name).set(len(entry.instances))
        return instance

    async def close(self) -> None:
        if self.shedder is not None:
            await self.shedder.close()
        if self.health is not None:
            await self.health.close()
        for entry in self.models.values():
            if entry.kv is not None:
                await entry.kv.close()
        if self.event_plane is not None:
            await self.event_plane.close()

    def find_instance(self, worker_id: int) -> Instance:
        name = self._worker_model.get(worker_id)
        instance = self.models[name].instances.get(worker_id) if name is not None else None
        if instance is None:
            raise ModelNotFound(f"no worker {worker_id:x}; see GET /admin/workers")
        return instance

    # -- the fleet view health uses (kvmesh.health.fleet.FleetView)
    def workers(self) -> list[Instance]:
        return [i for e in self.models.values() for i in e.instances.all()]

    def weight(self, worker_id: int) -> float:
        return self.health.weight(worker_id) if self.health is not None else 1.0

    def capacities(self, worker_ids: Sequence[int]) -> dict[int, float] | None:
        health = self.health
        return {w: health.capacity(w) for w in worker_ids} if health is not None else None

    def canary_prompt(self, model: str, text: str) -> list[int] | None:
        entry = self.models.get(model)
        return entry.preprocessor.text_prompt(text) if entry is not None else None

    def ready(self) -> bool:
        return any(len(e.instances) for e in self.models.values())


class Adapters:
    """The LoRA adapters the frontend serves: each adapter's base model, and the
    commands (load, unload, list) sent to that model's workers."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.parents: dict[str, str] = {}  # adapter → its base model's name

    def listed(self) -> list[tuple[str, str]]:
        """(adapter, base model) of every adapter, by name."""
        return sorted(self.parents.items())

    def base_of(self, model: str | None) -> ModelEntry:
        """The entry a load names (``model``), or the only one; a 400 that says what to send."""
        models = self.registry.models
        if model is None:
            if len(models) != 1:
                names = ", ".join(sorted(models)) or "none yet"
                raise InvalidArgument(f"name the base model: send \"model\": one of {names}")
            return next(iter(models.values()))
        if model in self.parents:
            raise InvalidArgument(f"{model!r} is an adapter; name its base model {self.parents[model]!r}")
        return self.registry.get(model)

    def check_name(self, name: str, entry: ModelEntry) -> None:
        if name in self.registry.models:
            raise InvalidArgument(f"lora_name {name!r} is a model's name; give the adapter another name")
        parent = self.parents.get(name)
        if parent is not None and parent != entry.name:
            raise InvalidArgument(f"the adapter {name!r} is already loaded on model {parent!r}; unload it first")
        if parent is None and len(self.parents) >= MAX_SERVED_ADAPTERS:
            raise InvalidArgument(f"this frontend serves {MAX_SERVED_ADAPTERS} adapters already; unload one first")

    def workers(self, entry: ModelEntry, worker: int | None) -> list[Instance]:
        """The model's workers that take adapters (or the one named), else a 400."""
        if worker is not None:
            instance = entry.instances.get(worker)
            if instance is None:
                raise InvalidArgument(f"no worker {worker:x} serves {entry.name!r}; see GET /admin/workers")
            chosen = [instance]
        else:
            chosen = entry.instances.all()
        able = [i for i in chosen if i.info.engine.max_adapters > 0]
        if not able:
            raise InvalidArgument(
                f"no worker of {entry.name!r} takes LoRA adapters now: start its workers with adapters enabled "
                "(the engine's maximum of loaded adapters above 0)"
            )
        return able

    async def command(
        self, entry: ModelEntry, workers: list[Instance], cmd: LoraCommand
    ) -> tuple[dict[int, LoraState], dict[int, Exception]]:
        """``cmd`` on every one of ``workers`` at once (each within ``LORA_COMMAND_TIMEOUT_S``):
        each worker's answer, which updates the router's view of it, or its error."""
        payload = msgspec.msgpack.encode(cmd)

        async def one(instance: Instance) -> LoraState | None:
            return await asyncio.wait_for(call(instance.client, LORA, payload, _decode_lora), LORA_COMMAND_TIMEOUT_S)

        got = await asyncio.gather(*(one(i) for i in workers), return_exceptions=True)
        states: dict[int, LoraState] = {}
        errors: dict[int, Exception] = {}
        for instance, answer in zip(workers, got):
            if isinstance(answer, LoraState):
                states[instance.worker_id] = answer
                self._observe(entry, instance.worker_id, answer)
            elif isinstance(answer, asyncio.TimeoutError):
                errors[instance.worker_id] = ResponseTimeout(f"no answer within {LORA_COMMAND_TIMEOUT_S:g} s")
            elif isinstance(answer, Exception):
                errors[instance.worker_id] = answer
            elif isinstance(answer, BaseException):
                raise answer
            else:
                errors[instance.worker_id] = StreamIncomplete("the worker sent no answer")
        return states, errors

    async def ask(self, entry: ModelEntry, instance: Instance) -> None:
        """A LoRA worker just attached: learn its adapters (those it was started with)."""
        try:
            cmd = msgspec.msgpack.encode(LoraCommand("list"))
            state = await asyncio.wait_for(call(instance.client, LORA, cmd, _decode_lora), LORA_LIST_TIMEOUT_S)
        except (KvmeshError, asyncio.TimeoutError, OSError) as exc:
            log.warning("worker %x did not list its LoRA adapters: %s", instance.worker_id, exc)
            return
        if state is not None:
            self._observe(entry, instance.worker_id, state)

    def _observe(self, entry: ModelEntry, worker_id: int, state: LoraState) -> None:
        for name in (*state.adapters, *state.known):  # known: it can load them (--lora beyond its maximum)
            if name not in self.registry.models and len(self.parents) < MAX_SERVED_ADAPTERS:
                self.parents.setdefault(name, entry.name)
        if entry.kv is not None:
            entry.kv.adapters.observe(worker_id, state.adapters, state.known)

    def forget(self, entry: ModelEntry, name: str, worker: int | None = None) -> None:
        """``name`` unloaded from ``worker``, or from every worker of ``entry`` (then
        no longer served)."""
        if worker is None and self.parents.get(name) == entry.name:
            del self.parents[name]
        if entry.kv is not None:
            entry.kv.adapters.forget(name, worker)
