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
