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

    entry = SimpleNamespace(preprocessor=big, context_length=big.context_length, info=big.info, name="m")
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
