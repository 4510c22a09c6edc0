"""The frontend's LoRA admin routes over fake workers (frontend/app.py, frontend/models.py
Adapters): a load some workers refuse answers with each worker's adapters and the others'
reasons; a load no worker takes is that worker's error; an unload one worker refuses
keeps the adapter served; a worker that never answers is a timeout, not a hung route;
a name clash with a model, an adapter of another model, and bad bodies are 400s."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from kvmesh.config import FrontendConfig, SecurityConfig
from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.frontend import models as models_module
from kvmesh.frontend.app import Frontend
from kvmesh.frontend.server import Request
from kvmesh.preprocess.model import bundled_model_path
from kvmesh.protocol import EngineConfig, InstanceInfo, LoraCommand, LoraState

pytestmark = pytest.mark.timeout(30)


class _Worker:
    """A worker's request plane answering ``lora`` commands from a plain list of adapters."""

    def __init__(self, refuse: type[Exception] | None = None, hang: bool = False) -> None:
        self.held: list[str] = []
        self.refuse = refuse
        self.hang = hang

    async def stream(self, endpoint: str, payload: bytes, ctx: object, decode: object = None):  # type: ignore[no-untyped-def]
        assert endpoint == "lora"
        cmd = msgspec.msgpack.decode(payload, type=LoraCommand)
        if self.hang:
            await asyncio.sleep(3600)
        if self.refuse is not None and cmd.op != "list":
            raise self.refuse(f"refused {cmd.op} of {cmd.name}")
        if cmd.op == "load" and cmd.name not in self.held:
            self.held.append(cmd.name)  # type: ignore[arg-type]
        elif cmd.op == "unload" and cmd.name in self.held:
            self.held.remove(cmd.name)  # type: ignore[arg-type]
        yield LoraState(list(self.held), 4, 1.5 if cmd.op == "load" else 0.0)

    async def close(self) -> None:
        pass


async def _frontend(workers: dict[int, _Worker]) -> Frontend:
    frontend = Frontend(FrontendConfig(canary_interval_s=0, security=SecurityConfig(admin=True)))
    engine = EngineConfig("mocker", "kvmesh-tiny", 2048, 16, 1024, 8, 1024, max_adapters=4)
    for w, client in workers.items():
        await frontend.registry.attach(InstanceInfo(w, f"127.0.0.1:{9000 + w}", engine, str(bundled_model_path())), client)  # type: ignore[arg-type]
    return frontend


async def _post(frontend: Frontend, path: str, body: object) -> tuple[int, dict]:  # type: ignore[type-arg]
    raw = json.dumps(body).encode()
    request = Request("POST", path, "", {"content-type": "application/json", "host": "127.0.0.1"}, raw, len(raw), True, "1.1")
    handler = frontend.load_lora if path.endswith("/load_lora_adapter") else frontend.unload_lora
    response = await handler(request)
    return response.status, json.loads(response.body)


async def test_partial_loads_and_unloads_say_who_refused() -> None:
    ok, refusing = _Worker(), _Worker(refuse=InvalidArgument)
    frontend = await _frontend({1: ok, 2: refusing})
    status, body = await _post(frontend, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"})
    assert status == 200 and body["workers"] == {"1": {"adapters": ["sql"], "load_ms": 1.5}}
    assert body["errors"] == {"2": "refused load of sql"}
    assert frontend.registry.adapters.parents == {"sql": "kvmesh-tiny"}
    # an unload one worker refuses (a running sequence uses it): still served, by the others' count
    busy = _Worker(refuse=ResourceExhausted)
    busy.held = ["sql"]
    frontend.registry.models["kvmesh-tiny"].instances.get(2).client = busy  # type: ignore[union-attr]
    status, body = await _post(frontend, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 200 and "2" in body["errors"] and body["workers"] == {"1": {"adapters": [], "load_ms": 0.0}}
    assert frontend.registry.adapters.parents == {"sql": "kvmesh-tiny"}
    busy.refuse = None
    status, body = await _post(frontend, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 200 and "errors" not in body and frontend.registry.adapters.parents == {}
    status, body = await _post(frontend, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404


async def test_no_worker_takes_it_is_that_workers_error() -> None:
    frontend = await _frontend({1: _Worker(refuse=InvalidArgument)})
    status, body = await _post(frontend, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"})
    assert status == 400 and body["error"]["message"] == "refused load of sql"
    assert frontend.registry.adapters.parents == {}


async def test_a_silent_worker_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models_module, "LORA_COMMAND_TIMEOUT_S", 0.2)
    frontend = await _frontend({1: _Worker(), 2: _Worker()})
    frontend.registry.models["kvmesh-tiny"].instances.get(2).client = _Worker(hang=True)  # type: ignore[union-attr]
    status, body = await _post(frontend, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"})
    assert status == 200 and list(body["workers"]) == ["1"] and "2" in body["errors"]


async def test_bad_names_and_bodies_are_400s() -> None:
    frontend = await _frontend({1: _Worker()})
    cases = [
        ({"lora_name": "kvmesh-tiny", "lora_path": "/x"}, "a model's name"),
        ({"lora_path": "/x"}, "lora_name"),
        ({"lora_name": "a", "lora_path": "/x", "worker": "zz"}, "worker"),
        ({"lora_name": "a", "lora_path": "/x", "worker": "7"}, "no worker 7"),
        ({"lora_name": "a", "lora_path": "/x", "model": "other"}, "does not exist"),
        ({"lora_name": "a" * 200, "lora_path": "/x"}, "lora_name"),
    ]
    for body, want in cases:
        status, answer = await _post(frontend, "/v1/load_lora_adapter", body)
        assert status in (400, 404) and want in answer["error"]["message"], (body, answer)


class _Knows(_Worker):
    """A worker started with more --lora adapters than it keeps resident."""

    async def stream(self, endpoint: str, payload: bytes, ctx: object, decode: object = None):  # type: ignore[no-untyped-def]
        yield LoraState(["a"], 1, 0.0, known=["a", "b", "c"])


async def test_adapters_a_worker_knows_are_served_resident_or_not() -> None:
    frontend = await _frontend({1: _Knows()})
    response = await frontend.list_models(Request("GET", "/v1/models", "", {}, b"", 0, True, "1.1"))
    listed = [(m["id"], m.get("parent")) for m in json.loads(response.body)["data"]]
    assert listed == [("kvmesh-tiny", None), ("a", "kvmesh-tiny"), ("b", "kvmesh-tiny"), ("c", "kvmesh-tiny")]
    assert frontend.registry.get("c").name == "kvmesh-tiny"
