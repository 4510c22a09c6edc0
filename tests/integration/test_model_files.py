"""A frontend on another host has no model folder: it fetches the worker's small model
files (config, tokenizer, template) over the request plane and caches them."""

from __future__ import annotations

from kvmesh.config import FrontendConfig, WorkerConfig
from kvmesh.engines.settings import MockerSettings
from kvmesh.frontend.models import ModelRegistry
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.worker.main import build_engine
from kvmesh.worker.service import WorkerService


async def test_frontend_fetches_model_files_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    engine, path = build_engine(WorkerConfig(engine_options=MockerSettings(speedup=1e9)))
    service = WorkerService(engine)
    config = await service.start()
    try:
        registry = ModelRegistry(FrontendConfig(), FrontendMetrics())
        info = InstanceInfo(7, service.address, config, model_path="/nonexistent/elsewhere")
        client = TcpClient(service.address)
        await registry.attach(info, client)
        entry = registry.get("kvmesh-tiny")
        cached = entry.info.path
        assert str(cached).startswith(str(tmp_path / "cache" / "kvmesh" / "models"))
        assert (cached / "tokenizer.json").read_bytes() == (path_of(path) / "tokenizer.json").read_bytes()
        assert entry.preprocessor.chat_prompt([{"role": "user", "content": "hi"}])
        assert len(entry.instances) == 1
        await client.close()
    finally:
        await service.shutdown(grace_s=1)


def path_of(p: str):
    from pathlib import Path

    return Path(p)
