"""Large prompts are templated and tokenized off the event loop: a short request
finishes while a huge prompt is still being tokenized (event order, no clock)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from types import SimpleNamespace

import pytest

from kvmesh.frontend.pipeline import preprocess_async
from kvmesh.frontend.schemas import ChatCompletionRequest, CompletionRequest
from kvmesh.preprocess import preprocessor as pre_mod
from kvmesh.preprocess.model import bundled_model_path, load_model_folder
from kvmesh.preprocess.preprocessor import OFFLOAD_CHARS, Preprocessor

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def big() -> Preprocessor:
    """The bundled tokenizer with a context that holds a huge prompt."""
    info = load_model_folder(str(bundled_model_path()))
    return Preprocessor(dataclasses.replace(info, context_length=10_000_000))


def _huge_text(tokens: int = 400_000) -> str:
    rng = random.Random(1)
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(tokens // 2))


async def _short_requests_during(big: Preprocessor, huge: asyncio.Task) -> int:
    """Short prompts built one after another, each checked to finish while ``huge``
    is still running; how many made it before it ended."""
    done = 0
    while not huge.done() and done < 50:
        ids = await big.text_prompt_async(f"def f{done}(): return {done}")
        assert ids == big.text_prompt(f"def f{done}(): return {done}")
        if huge.done():
            break
        done += 1
        await asyncio.sleep(0)
    return done


@pytest.mark.parametrize("kind", ["text", "chat"])
async def test_a_short_prompt_does_not_wait_behind_a_huge_one(big: Preprocessor, kind: str) -> None:
    text = _huge_text()
    if kind == "text":
        huge = asyncio.ensure_future(big.text_prompt_async(text))
    else:
        huge = asyncio.ensure_future(big.chat_prompt_async([{"role": "user", "content": text}]))
    await asyncio.sleep(0)  # the huge one starts (and goes to the pool)
    assert not huge.done()
    during = await _short_requests_during(big, huge)
    ids = await huge
    assert len(ids) > 100_000
    # Every short prompt finished while the huge one was still being tokenized.
    assert during >= 10


async def test_small_prompts_stay_on_the_loop_and_large_ones_go_to_the_pool(
    big: Preprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    original = Preprocessor.text_prompt

    def spy(self: Preprocessor, prompt, parse_special=False):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return original(self, prompt, parse_special)

    monkeypatch.setattr(Preprocessor, "text_prompt", spy)
    await big.text_prompt_async("x" * (OFFLOAD_CHARS - 1))
    await big.text_prompt_async("x " * OFFLOAD_CHARS)
    await big.text_prompt_async([i % 2000 for i in range(5000)])  # ids: no tokenizing to offload
    assert threads[0] == threads[2] == threading.current_thread().name
    assert threads[1].startswith("kvmesh-preprocess")
    assert pre_mod.preprocess_pool() is pre_mod.preprocess_pool()


async def test_preprocess_async_builds_the_same_request(big: Preprocessor) -> None:
    import msgspec

    from kvmesh.frontend.pipeline import preprocess

    entry = SimpleNamespace(preprocessor=big, context_length=big.info.context_length, info=big.info, name="m")
    text = _huge_text(20_000)
    for body in (
        {"model": "m", "prompt": text, "max_tokens": 4},
        {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4},
    ):
        cls = CompletionRequest if "prompt" in body else ChatCompletionRequest
        req = msgspec.json.decode(msgspec.json.encode(body), type=cls)
        a = await preprocess_async(entry, req, "r1")  # type: ignore[arg-type]
        b = preprocess(entry, req, "r1")  # type: ignore[arg-type]
        assert a == b and len(a.token_ids) > 10_000


def _job(log: list[str], name: str, gate: threading.Event | None = None, started: threading.Event | None = None):  # type: ignore[no-untyped-def]
    def build() -> list[int]:
        if started is not None:
            started.set()
        if gate is not None:
            assert gate.wait(30)
        log.append(name)
        return [len(log)]

    return build


def _built_order(pool: pre_mod.SizedPool, jobs: tuple[tuple[str, int], ...]) -> list[str]:
    """The order a one-thread ``pool`` builds ``jobs`` (name, size) queued while it is busy."""
    log: list[str] = []
    gate, started = threading.Event(), threading.Event()
    first = pool.submit(_job(log, "busy", gate, started), 10)
    assert started.wait(30)  # the only thread is taken; the rest queue
    futs = [pool.submit(_job(log, name), size) for name, size in jobs]
    gate.set()
    for f in [first, *futs]:
        f.result(30)
    return log


def test_the_pool_builds_the_smallest_waiting_prompt_first() -> None:
    pool = pre_mod.SizedPool(1, long_chars=10**9)
    log = _built_order(pool, (("500", 500), ("100", 100), ("300", 300)))
    assert log == ["busy", "100", "300", "500"]


def test_long_prompts_wait_after_smaller_ones_largest_first() -> None:
    # the order prompts leave the pool is the order they are routed: long ones largest
    # first, whatever order the client sent them in
    pool = pre_mod.SizedPool(1, long_chars=1000)
    order = (("long 2k", 2_000), ("long 50k", 50_000), ("short 900", 900), ("long 1k", 1_000), ("short 20", 20))
    log = _built_order(pool, order)
    assert log == ["busy", "short 20", "short 900", "long 50k", "long 2k", "long 1k"]


def test_a_burst_of_huge_prompts_leaves_a_thread_for_smaller_ones() -> None:
    pool = pre_mod.SizedPool(2, long_chars=1000)
    log: list[str] = []
    gate, started = threading.Event(), threading.Event()
    huge1 = pool.submit(_job(log, "huge1", gate, started), 50_000)
    assert started.wait(30)
    huge2 = pool.submit(_job(log, "huge2", gate), 40_000)  # waits: one long prompt at a time on 2 threads
    mid = pool.submit(_job(log, "mid"), 500)
    assert mid.result(30) and log == ["mid"]  # built while huge1 still holds its thread
    assert not huge2.done()
    gate.set()
    huge1.result(30), huge2.result(30)
    assert log == ["mid", "huge1", "huge2"]


def test_a_failing_build_reaches_its_caller_and_the_pool_goes_on() -> None:
    pool = pre_mod.SizedPool(1)

    def boom() -> list[int]:
        raise ValueError("bad prompt")

    with pytest.raises(ValueError, match="bad prompt"):
        pool.submit(boom, 10).result(30)
    assert pool.submit(lambda: [7], 10).result(30) == [7]
