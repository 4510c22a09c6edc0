"""LoRA adapters on the mocker (issue 30, engine side): block hashes salted per adapter,
output per adapter, load time and capacity (LRU of idle adapters), the worker's ``lora``
endpoint, and PEFT folder checks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from kvmesh.engines.adapter import validated
from kvmesh.engines.base import LoraAdapters
from kvmesh.engines.lora import read_adapter
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.errors import InvalidArgument, ModelNotFound, ResourceExhausted
from kvmesh.kv.hashing import block_hashes, hash_salt
from kvmesh.protocol import LoraCommand, LoraState, OutputChunk, PreprocessedRequest, StopConditions
from kvmesh.runtime.context import Context
from kvmesh.runtime.names import LORA
from kvmesh.testing.lora import write_adapter
from kvmesh.worker.service import WorkerService

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(1, 65))  # 4 full blocks of 16


def req(rid: str, adapter: str | None = None, max_tokens: int = 8) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="mock", token_ids=PROMPT, adapter=adapter,
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )  # fmt: skip


async def collect(engine: MockerEngine, request: PreprocessedRequest) -> tuple[list[int], int]:
    """The stream's tokens and its cached prompt tokens (the terminal's usage)."""
    tokens: list[int] = []
    last: OutputChunk | None = None
    async for chunk in validated(engine.generate(request, Context(request.request_id))):
        tokens.extend(chunk.token_ids)
        last = chunk
    assert last is not None and last.usage is not None
    return tokens, last.usage.cached_tokens


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, str]:
    return {n: str(write_adapter(tmp_path / n)) for n in ("a", "b", "c")}


async def started(folders: dict[str, str], **kw: object) -> MockerEngine:
    loras = tuple(f"{n}={p}" for n, p in folders.items())
    engine = MockerEngine(MockerOptions(speedup=1e9, loras=loras, **kw))  # type: ignore[arg-type]
    await engine.start()
    return engine


async def test_the_same_prompt_with_two_adapters_shares_no_cached_block(folders: dict[str, str]) -> None:
    engine = await started({"a": folders["a"], "b": folders["b"]}, max_loras=2)
    try:
        await collect(engine, req("base"))
        assert (await collect(engine, req("base2")))[1] >= 48  # the base model's own blocks are reused
        before = engine.kv_dump()
        _, first_a = await collect(engine, req("a1", "a"))
        assert first_a == 0  # the base model's blocks are not a's
        after_a = engine.kv_dump()
        _, first_b = await collect(engine, req("b1", "b"))
        assert first_b == 0  # nor are a's blocks b's
        _, again_a = await collect(engine, req("a2", "a"))
        assert again_a >= 48  # a's own blocks are reused: the cache works
        salted = set(block_hashes(PROMPT, 16, hash_salt("a", None)))
        assert salted <= after_a and not salted & before  # the hashes a router computes for adapter a
        assert not set(block_hashes(PROMPT, 16, hash_salt("b", None))) & after_a
    finally:
        await engine.cleanup()


async def test_each_adapter_gives_its_own_tokens_and_the_same_ones_every_time(folders: dict[str, str]) -> None:
    engine = await started(folders, max_loras=3)
    try:
        base, _ = await collect(engine, req("x"))
        a, _ = await collect(engine, req("y", "a"))
        a2, _ = await collect(engine, req("z", "a"))
        b, _ = await collect(engine, req("w", "b"))
        assert a == a2 and len({tuple(base), tuple(a), tuple(b)}) == 3
    finally:
        await engine.cleanup()


async def test_capacity_unloads_the_least_recently_used_idle_adapter(folders: dict[str, str]) -> None:
    engine = await started(folders, max_loras=2)  # a and b load at start; c is known
    try:
        assert engine.lora_state().adapters == ["a", "b"] and engine.config.max_adapters == 2
        await collect(engine, req("1", "a"))  # a is now the most recently used
        await collect(engine, req("2", "c"))  # loads c in b's slot
        assert engine.load_report().adapters == ["a", "c"]
        assert engine.adapters is not None and engine.adapters.loads == 3
        await collect(engine, req("3", "b"))  # b again: a is the least recently used now
        assert engine.lora_state().adapters == ["b", "c"]
        with pytest.raises(ModelNotFound, match="no LoRA adapter 'zzz'"):
            await collect(engine, req("4", "zzz"))
    finally:
        await engine.cleanup()


async def test_an_adapter_in_use_is_never_unloaded(folders: dict[str, str]) -> None:
    engine = MockerEngine(MockerOptions(speedup=1.0, max_loras=1, loras=(f"a={folders['a']}",), lora_load_ms=0))
    await engine.start()
    try:
        stream = engine.generate(req("long", "a", max_tokens=500), Context("long"))
        await stream.__anext__()  # a runs
        with pytest.raises(ResourceExhausted, match="in use"):
            await engine.lora_load("b", folders["b"])
        with pytest.raises(InvalidArgument, match="in use"):
            await engine.lora_unload("a")
        await stream.aclose()  # a is idle now
        state = await engine.lora_load("b", folders["b"])
        assert state.adapters == ["b"] and state.load_ms >= 0
    finally:
        await engine.cleanup()


async def test_load_time_is_modelled(folders: dict[str, str]) -> None:
    engine = MockerEngine(MockerOptions(speedup=1.0, max_loras=2, lora_load_ms=120.0))
    await engine.start()
    try:
        state = await engine.lora_load("a", folders["a"])
        assert state.load_ms >= 120.0 and state.adapters == ["a"]
        assert (await engine.lora_load("a", None)).load_ms == 0.0  # resident: nothing to load
    finally:
        await engine.cleanup()


async def test_the_worker_serves_the_lora_endpoint(folders: dict[str, str], tmp_path: Path) -> None:
    engine = MockerEngine(MockerOptions(speedup=1e9, max_loras=2))
    service = WorkerService(engine)
    await service.start()

    async def call(command: object) -> LoraState:
        payload = msgspec.msgpack.encode(command)
        stream = service.server.endpoints[LORA](payload, Context("x"))  # type: ignore[attr-defined]
        return [s async for s in stream][0]  # type: ignore[no-any-return]

    try:
        assert isinstance(engine, LoraAdapters)
        assert (await call(LoraCommand("load", "a", folders["a"]))).adapters == ["a"]
        assert (await call(LoraCommand("list"))).adapters == ["a"]
        assert (await call(LoraCommand("unload", "a"))).adapters == []
        with pytest.raises(InvalidArgument, match="not a folder"):
            await call(LoraCommand("load", "a", str(tmp_path / "nowhere")))
        with pytest.raises(InvalidArgument, match="needs the adapter's name"):
            await call(LoraCommand("load"))
        with pytest.raises(InvalidArgument, match="LoraCommand"):
            await call({"op": "load", "name": "x" * 500})
    finally:
        await service.shutdown(grace_s=1)


def test_a_folder_that_is_not_a_peft_lora_is_refused_with_what_is_wrong(tmp_path: Path) -> None:
    good = write_adapter(tmp_path / "good", rank=2)
    assert read_adapter(str(good)).scale == 2.0
    (good / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(InvalidArgument, match="not a safetensors file"):
        read_adapter(str(good))
    wrong = write_adapter(tmp_path / "wrong", rank=2)
    cfg = json.loads((wrong / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**cfg, "r": 3}))
    with pytest.raises(InvalidArgument, match="not of rank 3"):
        read_adapter(str(wrong))
    (wrong / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(InvalidArgument, match="use_dora"):
        read_adapter(str(wrong))
    (wrong / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["lm_head"]}))
    with pytest.raises(InvalidArgument, match="target_modules"):
        read_adapter(str(wrong))
    with pytest.raises(InvalidArgument, match="cannot read"):
        read_adapter(str(tmp_path))


def test_lora_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="NAME=PATH"):
        MockerOptions(loras=("a",))
    with pytest.raises(ValueError, match="twice"):
        MockerOptions(loras=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match="--max-loras"):
        MockerOptions(loras=("a=/x",), max_loras=0)


async def test_no_lora_with_max_loras_zero() -> None:
    engine = MockerEngine(MockerOptions(speedup=1e9, max_loras=0))
    await engine.start()
    try:
        with pytest.raises(InvalidArgument, match="serves no LoRA"):
            await collect(engine, req("1", "a"))
    finally:
        await engine.cleanup()


async def test_loads_and_unloads_publish_the_held_adapters(folders: dict[str, str]) -> None:
    from kvmesh.runtime.events import RecordingPublisher

    rec = RecordingPublisher()
    engine = MockerEngine(MockerOptions(speedup=1e9, max_loras=2), rec)
    await engine.start()
    try:
        await engine.lora_load("a", folders["a"])
        assert rec.load_reports[-1].adapters == ["a"]  # the router's affinity reads these
        await engine.lora_unload("a")
        assert rec.load_reports[-1].adapters == []
    finally:
        await engine.cleanup()
