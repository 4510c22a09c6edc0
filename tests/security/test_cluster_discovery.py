"""Discovery records and what they lead to are data, not commands: model files under
names a model folder does not have, records that take too long, a file-discovery
directory owned by someone else, records not signed with the cluster secret."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.frontend.models import fetch_model_files
from kvmesh.preprocess.model import bundled_model_path
from kvmesh.protocol import ModelFiles
from kvmesh.runtime.names import MODEL_FILES
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.tcp_server import TcpServer

pytestmark = pytest.mark.timeout(60)


async def _stub_worker(files: dict[str, bytes]) -> TcpServer:
    async def model_files(payload, ctx):
        yield ModelFiles(name="evil", files=files)

    server = TcpServer(secret=None)
    server.register(MODEL_FILES, model_files)
    await server.start()
    return server


def _everything_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("bad_name", ["../x", "../../x", "/ABSOLUTE/x", "sub/tokenizer.json", "x\x00y", "weights.bin"])
async def test_a_stub_worker_cannot_write_outside_the_model_cache(tmp_path, monkeypatch, bad_name):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    outside = tmp_path / "outside"
    outside.mkdir()
    name = bad_name.replace("/ABSOLUTE", str(outside))
    tokenizer = (bundled_model_path() / "tokenizer.json").read_bytes()
    server = await _stub_worker({"tokenizer.json": tokenizer, name: b"pwned"})
    client = TcpClient(server.address, secret=None)
    try:
        with pytest.raises(InvalidArgument, match="allowed: config.json"):
            await fetch_model_files(client, "../../evil/model")
    finally:
        await client.close()
        await server.close()
    assert _everything_under(outside) == set()
    assert not (tmp_path / "x").exists() and not (tmp_path / "cache" / "x").exists()
    assert not (tmp_path / "cache" / "kvmesh" / "x").exists()
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


async def test_model_files_with_the_right_names_are_cached_inside_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = bundled_model_path()
    files = {n: (folder / n).read_bytes() for n in ("tokenizer.json", "config.json") if (folder / n).is_file()}
    server = await _stub_worker(files)
    client = TcpClient(server.address, secret=None)
    try:
        path = Path(await fetch_model_files(client, "../../evil/model"))
    finally:
        await client.close()
        await server.close()
    models = (tmp_path / "cache" / "kvmesh" / "models").resolve()
    assert path.resolve().parent == models
    assert sorted(p.name for p in path.iterdir()) == sorted(files)


async def test_the_file_discovery_directory_is_private_and_refused_if_another_user_owns_it(tmp_path):
    from kvmesh.runtime.discovery.file import FileDiscovery

    d = tmp_path / "disc"
    disc = FileDiscovery(d)
    await disc.connect()
    assert (d.stat().st_mode & 0o777) == 0o700
    await disc.close()
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    disc = FileDiscovery(loose)
    await disc.connect()  # ours: tightened
    assert (loose.stat().st_mode & 0o777) == 0o700
    await disc.close()
    if os.getuid() != 0:
        pytest.skip("needs root to create a directory owned by another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4321, 4321)
    with pytest.raises(InvalidArgument, match="owned by user 4321"):
        await FileDiscovery(theirs).connect()


async def test_a_record_that_cannot_be_processed_in_time_does_not_stall_the_watch(caplog):
    """A rogue worker that never answers (its model files) is skipped after the record
    timeout; a real worker registered right after it is attached meanwhile."""
    from kvmesh.config import RuntimeConfig
    from kvmesh.protocol import EngineConfig, InstanceInfo
    from kvmesh.runtime.discovery.memory import MemoryDiscovery, MemoryStore
    from kvmesh.runtime.distributed import DistributedRuntime, call

    never = asyncio.Event()

    async def stall(payload, ctx):
        await never.wait()
        yield 1

    async def info(payload, ctx):
        yield "ok"

    rogue, real = TcpServer(secret=None), TcpServer(secret=None)
    rogue.register("info", stall)
    real.register("info", info)
    await rogue.start()
    await real.start()
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory"), MemoryDiscovery(MemoryStore()), secret=None)
    await runtime.start()
    attached: list[int] = []

    async def on_added(i: InstanceInfo, client) -> None:
        await call(client, "info")  # the rogue never answers this
        attached.append(i.worker_id)

    async def on_removed(worker_id: int) -> None:
        pass

    endpoint = runtime.namespace().component("backend").endpoint("generate")
    client = endpoint.client(on_added, on_removed, record_timeout_s=3.0)
    await client.start()
    try:
        engine = EngineConfig("m", "m", 2048, 16, 1024, 8, 2048)
        for wid, server in ((0xBAD, rogue), (0x600D, real)):
            record = msgspec.json.encode(InstanceInfo(wid, server.address, engine))
            await runtime.discovery.put(f"{endpoint.prefix}{wid:x}", record)
        while 0x600D not in attached and client.skipped == 0:
            await asyncio.sleep(0.01)
        # attached while the rogue's record was still being processed: the watch went on
        assert 0x600D in attached and client.skipped == 0, "the watch stalled behind the rogue's record"
        while client.skipped < 1:
            await asyncio.sleep(0.05)
        assert "not processed within 3 s" in caplog.text
        assert attached == [0x600D] and 0xBAD not in client.known
    finally:
        never.set()
        await client.close()
        await runtime.shutdown()
        await rogue.close()
        await real.close()
