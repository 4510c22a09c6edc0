"""Pure mapping between kvmesh's engine types and vLLM's request/output fields.

Nothing here imports vLLM: requests become the keyword arguments of vLLM's
``SamplingParams``, and vLLM outputs are read through their plain fields
(``token_ids``, ``logprobs``, ``finish_reason``, ``stop_reason``,
``num_cached_tokens``), so the mapping is unit-tested without vLLM installed.

Request (``PreprocessedRequest`` → ``SamplingParams`` kwargs):

* sampling fields pass through when set (``None`` leaves vLLM's default);
* ``max_tokens``, ``min_tokens``, ``ignore_eos`` and ``stop_token_ids`` pass through;
  the request's ``eos_token_ids`` that vLLM does not already treat as EOS are added
  to ``stop_token_ids`` (unless ``ignore_eos``), so the frontend's model card decides
  EOS as for every other engine;
* stop *strings* are not passed: the frontend matches them on detokenized text, and
  vLLM runs with ``detokenize=False`` (kvmesh detokenizes once, at the frontend);
* ``output.logprobs`` N → vLLM ``logprobs=N`` (the chosen token's logprob and the top N);
* outputs are requested as deltas (``RequestOutputKind.DELTA``);
* ``guided`` (structured outputs) → :func:`structured_outputs_kwargs`, the fields of
  vLLM's ``StructuredOutputsParams`` (``json``, ``json_object``, ``regex``, ``choice``,
  ``grammar``), which the engine wraps and passes as ``SamplingParams(structured_outputs=…)``
  (vLLM's documented API since the ``guided_*`` fields went away in 0.12). A Lark
  grammar is passed as is: vLLM's ``guidance`` backend reads llguidance's Lark, as the
  hf engine does.

Output (vLLM deltas → ``OutputChunk``), following the Engine contract's finish rules:

* ``stop`` on an EOS token: the EOS token is *not* emitted (vLLM appends it to
  ``token_ids``); ``stop`` on a ``stop_token_ids`` token: it *is* emitted;
* ``length`` → ``length``; ``abort`` → ``cancelled``; anything else (``error``, a
  reason this version does not know) → an ``error`` terminal naming it;
* the terminal carries :class:`~kvmesh.protocol.Usage` (prompt tokens: the original
  prompt's length on a migrated request, as the other engines count them; completion
  tokens: the tokens emitted; cached tokens: vLLM's prefix-cache hit);
* ``cached_tokens`` is set on the first chunk, as soon as vLLM reports it.

LoRA adapters (issue 30): vLLM names an adapter by ``LoRARequest(name, int id, path)``;
:class:`LoraIds` gives each adapter name a stable positive id and keeps its path, and
:meth:`LoraIds.request_args` is what a request naming ``adapter`` runs with (vLLM salts
its own block hashes with the adapter). A request's ``cache_salt`` goes to vLLM's prompt
(``cache_salt``), so cache namespaces hold there too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from kvmesh.errors import InvalidArgument, ModelNotFound
from kvmesh.protocol import GuidedDecoding, OutputChunk, PreprocessedRequest, TokenLogprob, Usage

__all__ = ["sampling_kwargs", "structured_outputs_kwargs", "OutputMapper", "LoraIds"]


class LoraIds:
    """The adapters a vLLM worker knows: name → (stable positive id, PEFT folder path). Pure."""

    def __init__(self, known: Mapping[str, str] | None = None) -> None:
        self._paths: dict[str, str] = {}
        self._ids: dict[str, int] = {}
        self._next = 1
        for name, path in (known or {}).items():
            self.add(name, path)

    @property
    def names(self) -> list[str]:
        return sorted(self._paths)

    def add(self, name: str, path: str) -> tuple[str, int, str]:
        """Know ``name`` at ``path`` (a known name keeps its id); its ``LoRARequest`` arguments."""
        if name not in self._ids:
            self._ids[name] = self._next
            self._next += 1
        self._paths[name] = path
        return name, self._ids[name], path

    def remove(self, name: str) -> int:
        """Forget ``name``; its id. ModelNotFound when it is not known."""
        if name not in self._paths:
            raise ModelNotFound(f"this worker has no LoRA adapter {name!r}")
        del self._paths[name]
        return self._ids.pop(name)

    def request_args(self, adapter: str | None) -> tuple[str, int, str] | None:
        """``LoRARequest(lora_name, lora_int_id, lora_path)`` arguments for a request's
        adapter (None: the base model); ModelNotFound for an adapter this worker lacks."""
        if adapter is None:
            return None
        path = self._paths.get(adapter)
        if path is None:
            raise ModelNotFound(f"this worker has no LoRA adapter {adapter!r} (load it first, or start it with --lora)")
        return adapter, self._ids[adapter], path

# kvmesh SamplingOptions field -> vLLM SamplingParams field (same meaning, same units)
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_kwargs(request: PreprocessedRequest, vllm_eos: Iterable[int] = ()) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for ``request`` (without
    ``output_kind``, which the caller adds: it is a vLLM enum)."""
    s, stop = request.sampling, request.stop
    kw: dict[str, Any] = {"n": 1, "detokenize": False, "skip_special_tokens": False}
    for name in _SAMPLING_FIELDS:
        value = getattr(s, name)
        if value is not None:
            kw[name] = value
    if stop.max_tokens is not None:
        kw["max_tokens"] = stop.max_tokens
    if stop.min_tokens:
        kw["min_tokens"] = stop.min_tokens
    kw["ignore_eos"] = stop.ignore_eos
    stop_ids = list(stop.stop_token_ids)
    if not stop.ignore_eos:
        known = set(vllm_eos)
        stop_ids += [t for t in request.eos_token_ids if t not in known]
    if stop_ids:
        kw["stop_token_ids"] = list(dict.fromkeys(stop_ids))
    if request.output.logprobs is not None:
        kw["logprobs"] = request.output.logprobs
    return kw


def structured_outputs_kwargs(guided: GuidedDecoding) -> dict[str, Any]:
    """Keyword arguments of ``vllm.sampling_params.StructuredOutputsParams`` for a constraint."""
    if guided.kind == "json_schema":
        try:
            schema = msgspec.json.decode(guided.spec)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"the JSON schema is not valid JSON: {exc}") from None
        return {"json": schema}
    if guided.kind == "json_object":
        return {"json_object": True}
    if guided.kind == "regex":
        return {"regex": guided.spec}
    if guided.kind == "choice":
        return {"choice": list(guided.choices)}
    return {"grammar": guided.spec}


class OutputMapper:
    """Turns one request's stream of vLLM deltas into ``OutputChunk`` s (module docstring).

    Per-request state: how many tokens were emitted, and whether ``cached_tokens``
    went out yet. Feed it every delta in order with :meth:`chunk`.
    """

    __slots__ = ("_eos", "_stop_ids", "_prompt_tokens", "_completion", "_cached", "_cached_sent", "_top_n")

    def __init__(self, request: PreprocessedRequest, vllm_eos: Iterable[int] = ()) -> None:
        self._eos = frozenset(request.eos_token_ids) | frozenset(vllm_eos)
        self._stop_ids = frozenset(request.stop.stop_token_ids)
        n = request.original_prompt_len
        self._prompt_tokens = n if n is not None else len(request.token_ids)
        self._completion = 0
        self._cached = 0
        self._cached_sent = False
        self._top_n = request.output.logprobs or 0

    def chunk(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[Mapping[int, Any]] | None,
        finish_reason: str | None,
        stop_reason: int | str | None = None,
        num_cached_tokens: int | None = None,
    ) -> OutputChunk:
        """The chunk for one delta; terminal when ``finish_reason`` is set."""
        tokens = list(token_ids)
        lps = list(logprobs) if logprobs is not None else None
        if finish_reason == "stop" and tokens and self._is_eos_stop(tokens[-1], stop_reason):
            tokens.pop()
            if lps:
                lps.pop()
        self._completion += len(tokens)
        out = OutputChunk(token_ids=tokens)
        if lps is not None:
            out.logprobs = [_token_logprob(t, lp, self._top_n) for t, lp in zip(tokens, lps)]
        if num_cached_tokens is not None:
            self._cached = num_cached_tokens
            if not self._cached_sent:
                out.cached_tokens = num_cached_tokens
                self._cached_sent = True
        if finish_reason is not None:
            self._finish(out, finish_reason)
        return out

    def _is_eos_stop(self, last: int, stop_reason: int | str | None) -> bool:
        """vLLM reports ``stop_reason`` None for its own EOS and the token id for a
        stop token id; an EOS id kvmesh added to ``stop_token_ids`` is still EOS."""
        if stop_reason is None:
            return last in self._eos
        return stop_reason == last and last in self._eos and last not in self._stop_ids

    def _finish(self, out: OutputChunk, reason: str) -> None:
        if reason == "stop":
            out.finish_reason = "stop"
        elif reason == "length":
            out.finish_reason = "length"
        elif reason == "abort":
            out.finish_reason = "cancelled"
        else:
            out.finish_reason = "error"
            out.error = f"vLLM finished the request with reason {reason!r}"
        out.usage = Usage(prompt_tokens=self._prompt_tokens, completion_tokens=self._completion, cached_tokens=self._cached)


def _token_logprob(token: int, entry: Mapping[int, Any], top_n: int) -> TokenLogprob:
    """One vLLM logprobs entry (token id → object with ``logprob`` and ``rank``; the
    chosen token is always present) as kvmesh's :class:`TokenLogprob`."""
    chosen = entry.get(token)
    top: list[tuple[int, float]] = []
    if top_n:
        ranked = sorted(entry.items(), key=lambda kv: _rank(kv[1]))
        top = [(int(t), float(_value(v))) for t, v in ranked if _rank(v) <= top_n][:top_n]
    return TokenLogprob(token, float(_value(chosen)) if chosen is not None else float("nan"), top)


def _value(lp: Any) -> float:
    return lp if isinstance(lp, float) else lp.logprob


def _rank(lp: Any) -> int:
    rank = getattr(lp, "rank", None)
    return rank if isinstance(rank, int) else 1 << 30
