"""The frontend's one object per served model: prompts in, ids out, ids back to text.

Large prompts are built off the event loop: :meth:`Preprocessor.chat_prompt_async` and
:meth:`Preprocessor.text_prompt_async` template and tokenize a prompt of
``OFFLOAD_CHARS`` characters or more in a thread pool shared by the process (sized to
the machine), so a short prompt, built inline, never waits behind a long one. The pool
runs the smallest waiting prompt first and keeps one thread free of prompts of
``LONG_CHARS`` or more, so a mid-sized prompt does not queue behind a burst of huge ones
either (FIFO made a 900-token prompt wait a second behind 250k tokens of a trace burst).
Long prompts themselves go largest first. The order prompts leave the pool is the order
they are routed and reach a worker's queue: shortest first keeps the many short prompts'
wait low, while among long ones, whose prefills occupy a worker for a long time, largest
first is the classic LPT rule for spreading jobs over parallel machines (the cost-based
router sends each to the least loaded worker), and a burst's long prompts reach the fleet
in an order that does not depend on how the client happened to send them. ``kvmesh
replay`` of the Mooncake conversation trace, each burst in a random client order
(``bench/burst_order.py --shuffle``, 6 seeds), long ones after the rest in the order they
came: kv router TTFT p99 712–787 ms, round robin 852–959 ms; largest first (about 10k
tokens and up): 711–716 and 850–866 ms, and TTFT p50 94 → 83 and 84 → 75 ms.
Threads suffice: ``tokenizers`` releases the GIL in ``encode_batch_fast``, the call
:meth:`~kvmesh.preprocess.tokenizer.Tokenizer.encode` uses for long inputs
(``bench/tokenize_gil.py`` measures it), and rendering a template is cheap next to
tokenizing its output.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvmesh.errors import InvalidArgument
from kvmesh.preprocess.model import ModelInfo, load_model_folder
from kvmesh.preprocess.stop import StopMatcher
from kvmesh.preprocess.tokenizer import Detokenizer, Tokenizer, encode_chat

if TYPE_CHECKING:
    from kvmesh.preprocess.template import ChatTemplate

__all__ = ["Preprocessor", "OFFLOAD_CHARS", "LONG_CHARS", "SizedPool", "preprocess_pool"]

# Prompts shorter than this (characters of text) are built on the caller's thread:
# they take well under a millisecond, less than a hop to the pool and back.
OFFLOAD_CHARS = 2048
# Prompts this large (about 6k tokens of English, 10k of the trace benches' text; some
# 5-10 ms of tokenizing) never take the pool's last free thread (it stays for smaller ones),
# and wait after every smaller prompt, the largest first.
LONG_CHARS = 24 * 1024

_pool: SizedPool | None = None
_pool_lock = threading.Lock()


class SizedPool:
    """Threads that build prompts: the smallest waiting one first (shortest job first:
    a job's size is its characters), except that jobs of ``long_chars`` or more come after
    every smaller one and among themselves the largest first; at most ``workers - 1`` of
    them run at once (at least 1). Threads start on demand and live as long as the process
    (daemons)."""

    def __init__(self, workers: int, long_chars: int = LONG_CHARS, name: str = "kvmesh-preprocess") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.long_chars = long_chars
        self._name = name
        self._cv = threading.Condition()
        # (long?, rank, arrival, build, future): short jobs by size, then long ones by size, largest first
        self._heap: list[tuple[bool, int, int, Callable[[], list[int]], Future[list[int]]]] = []
        self._order = itertools.count()
        self._threads = 0
        self._idle = 0
        self._long_running = 0

    @property
    def long_slots(self) -> int:
        return max(1, self.workers - 1)

    def submit(self, build: Callable[[], list[int]], size: int) -> Future[list[int]]:
        fut: Future[list[int]] = Future()
        with self._cv:
            is_long = size >= self.long_chars
            heapq.heappush(self._heap, (is_long, -size if is_long else size, next(self._order), build, fut))
            if self._idle == 0 and self._threads < self.workers:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()
            self._cv.notify_all()
        return fut

    def _take(self) -> tuple[bool, Callable[[], list[int]], Future[list[int]]]:
        """(called holding the lock) The first job allowed to start now; waits."""
        while True:
            if self._heap and (not self._heap[0][0] or self._long_running < self.long_slots):
                is_long, _, _, build, fut = heapq.heappop(self._heap)
                return is_long, build, fut
            self._idle += 1
            self._cv.wait()
            self._idle -= 1

    def _work(self) -> None:
        while True:
            with self._cv:
                is_long, build, fut = self._take()
                self._long_running += is_long
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(build())
                    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                        fut.set_exception(exc)
            finally:
                with self._cv:
                    self._long_running -= is_long
                    self._cv.notify_all()


def preprocess_pool() -> SizedPool:
    """The process's preprocessing threads (created on first use; one per core, 2-8)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = SizedPool(max(2, min(8, os.cpu_count() or 2)))
    return _pool


def _chars(messages: Sequence[Mapping[str, Any]], arguments: Mapping[str, Any]) -> int:
    """Characters of text in OpenAI-shaped messages (content strings or text parts) and
    in the template arguments' strings."""
    total = sum(len(v) for v in arguments.values() if isinstance(v, str)) if arguments else 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return total


class Preprocessor:
    """Prompt building and detokenization for one model.

    Construction loads the tokenizer and compiles the chat template (tens of ms for a
    large vocabulary; do it at startup; ``defer_template``: the template on first use).
    After that every method may be called by many requests at once. Per-request state lives in the objects that
    :meth:`detokenizer` and :meth:`stop_matcher` return.

    Prompts are checked against the context: an empty prompt, an id outside the
    vocabulary, or a prompt that leaves no room for one generated token is an
    :class:`~kvmesh.errors.InvalidArgument`. Fitting ``max_tokens`` is the caller's check.
    """

    __slots__ = ("info", "tokenizer", "eos_token_ids", "_template", "_compiled", "_compiling")

    def __init__(self, info: ModelInfo, *, defer_template: bool = False) -> None:
        """``defer_template``: compile the chat template on first use (or
        :meth:`compile_template`) instead of now; ``kvmesh run`` compiles it in the
        background once serving, and exits with its error if it does not compile."""
        self.info = info
        self.tokenizer = Tokenizer.from_file(info.tokenizer_path)
        self.eos_token_ids: frozenset[int] = frozenset(info.eos_token_ids)
        self._template: ChatTemplate | None = None
        self._compiled = info.chat_template is None
        self._compiling = threading.Lock()
        if not defer_template:
            self.compile_template()

    def compile_template(self) -> ChatTemplate | None:
        """The chat template, compiled now if it was not yet (jinja2 is imported here);
        :class:`~kvmesh.errors.InvalidArgument` if it does not compile. Thread-safe."""
        if self._compiled:
            return self._template
        with self._compiling:
            if not self._compiled and self.info.chat_template is not None:
                from kvmesh.preprocess.template import ChatTemplate  # jinja2: ~0.15 s of a start

                self._template = ChatTemplate(
                    self.info.chat_template, origin=str(self.info.path), variables=self.info.special_tokens()
                )
                self._compiled = True
        return self._template

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self.compile_template()

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str], *, name: str | None = None) -> Preprocessor:
        return cls(load_model_folder(path, name=name))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """The chat template applied to ``messages`` (plain dicts, OpenAI-shaped)."""
        template = self.compile_template()
        if template is None:
            raise InvalidArgument(
                f"model {self.info.name!r} has no chat template: send a text prompt to "
                f"/v1/completions, or add chat_template to {self.info.path}/tokenizer_config.json"
            )
        return template.render(messages, add_generation_prompt, **template_kwargs)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        parse_special: bool = False, **template_kwargs: Any,
    ) -> list[int]:  # fmt: skip
        """Token ids of the rendered chat. The template writes BOS and other special
        tokens as text; encoding parses them back into their ids. Special-token text
        inside the user's text (the messages' content, ``template_kwargs``' strings)
        stays plain text unless ``parse_special``."""
        if parse_special:
            text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
            return self._checked(self.tokenizer.encode(text, add_special_tokens=False))
        render = lambda msgs, args: self.render_chat(msgs, add_generation_prompt, **args)  # noqa: E731
        return self._checked(encode_chat(render, messages, self.tokenizer, template_kwargs))

    def text_prompt(self, prompt: str | Sequence[int], parse_special: bool = False) -> list[int]:
        """Token ids of a completions prompt: text (with the tokenizer's own special
        tokens, e.g. a BOS, added; special-token text in it is plain text unless
        ``parse_special``) or ids passed through after a range check."""
        if isinstance(prompt, str):
            return self._checked(self.tokenizer.encode(prompt, add_special_tokens=True, parse_special=parse_special))
        ids = list(prompt)
        if ids:
            self._check_ids(ids)
        return self._checked(ids)

    async def chat_prompt_async(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        parse_special: bool = False, **template_kwargs: Any,
    ) -> list[int]:  # fmt: skip
        """:meth:`chat_prompt`, in the pool when the messages are large."""
        build = functools.partial(self.chat_prompt, messages, add_generation_prompt, parse_special, **template_kwargs)
        return await _run(build, _chars(messages, template_kwargs))

    async def text_prompt_async(self, prompt: str | Sequence[int], parse_special: bool = False) -> list[int]:
        """:meth:`text_prompt`, in the pool when the text is large (ids stay inline)."""
        size = len(prompt) if isinstance(prompt, str) else 0
        return await _run(functools.partial(self.text_prompt, prompt, parse_special), size)

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        return self.tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)

    def stop_matcher(self, stop: str | Iterable[str] | None, include_stop: bool = False) -> StopMatcher:
        """A matcher for an OpenAI ``stop`` field (a string, a list, or null)."""
        stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
        return StopMatcher(stops, include_stop=include_stop)

    def _check_ids(self, ids: list[int]) -> None:
        try:
            low, high = min(ids), max(ids)
        except TypeError:
            raise InvalidArgument("prompt token ids must all be integers") from None
        if low < 0 or high >= self.info.vocab_size:
            bad = low if low < 0 else high
            raise InvalidArgument(
                f"prompt token id {bad} is outside the vocabulary of model {self.info.name!r}: "
                f"ids must be in [0, {self.info.vocab_size})"
            )

    def _checked(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidArgument("the prompt is empty: send at least one token of prompt")
        if len(ids) >= self.info.context_length:
            raise InvalidArgument(
                f"the prompt has {len(ids)} tokens but model {self.info.name!r} has a context of "
                f"{self.info.context_length} tokens, which must hold the prompt and at least one "
                f"generated token: shorten the prompt"
            )
        return ids


async def _run(build: Callable[[], list[int]], size: int) -> list[int]:
    if size < OFFLOAD_CHARS:
        return build()
    return await asyncio.wrap_future(preprocess_pool().submit(build, size))
