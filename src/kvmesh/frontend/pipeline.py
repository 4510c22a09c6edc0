"""Preprocessing, protocol-neutral: an OpenAI-shaped request → the engine's
:class:`~kvmesh.protocol.PreprocessedRequest` (prompt templated and tokenized, checked
against the model's context, sampling and stop conditions, routing hints, the output
constraint); request ids; the router's explanation of a choice.

The request then runs under its owner (:mod:`kvmesh.frontend.owner`).
"""

from __future__ import annotations

import itertools
import os

from kvmesh.errors import InvalidArgument
from kvmesh.frontend.models import ModelEntry
from kvmesh.frontend.schemas import ChatCompletionRequest, CompletionRequest, largest_text_field
from kvmesh.frontend.tools import chat_messages, guided_of
from kvmesh.protocol import (
    OutputOptions,
    PeerPrefix,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)

__all__ = ["new_request_id", "preprocess", "preprocess_async", "check_prompt_size", "explain_route"]


_ids = itertools.count(1)
_id_prefix = os.urandom(4).hex()


def new_request_id() -> str:
    return f"{_id_prefix}{next(_ids):x}"


def _prompt_tokens(entry: ModelEntry, req: ChatCompletionRequest | CompletionRequest, parse_special: bool) -> list[int]:
    pre = entry.preprocessor
    if isinstance(req, ChatCompletionRequest):
        messages = chat_messages(req)
        kwargs = req.chat_template_kwargs or {}
        return pre.chat_prompt(messages, add_generation_prompt=req.add_generation_prompt, parse_special=parse_special, **kwargs)
    return pre.text_prompt(req.single_prompt(), parse_special=parse_special)


def check_prompt_size(entry: ModelEntry, req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse, without tokenizing it, a prompt too long for the context whatever it
    tokenizes to (more characters than context × the longest token), counting every
    field that reaches it (messages, tools, template arguments)."""
    chars = req.prompt_chars()
    bound = entry.context_length * entry.preprocessor.tokenizer.max_token_chars
    if chars > bound:
        where, largest = largest_text_field(req)
        raise InvalidArgument(
            f"the prompt has {chars} characters, more than the {entry.context_length} tokens of the model's "
            f"context can hold; shorten the prompt (the largest field has {largest} characters) - at `$.{where}`"
        )


async def _prompt_tokens_async(
    entry: ModelEntry, req: ChatCompletionRequest | CompletionRequest, parse_special: bool
) -> list[int]:
    """:func:`_prompt_tokens` with a large prompt built in the preprocessing pool."""
    pre = entry.preprocessor
    if isinstance(req, ChatCompletionRequest):
        messages = chat_messages(req)
        kwargs = req.chat_template_kwargs or {}
        return await pre.chat_prompt_async(
            messages, add_generation_prompt=req.add_generation_prompt, parse_special=parse_special, **kwargs
        )
    return await pre.text_prompt_async(req.single_prompt(), parse_special=parse_special)


async def preprocess_async(
    entry: ModelEntry, req: ChatCompletionRequest | CompletionRequest, request_id: str, explain: bool = False,
    parse_special: bool = False,
) -> PreprocessedRequest:  # fmt: skip
    """:func:`preprocess` with the prompt templated and tokenized off the event loop
    when it is large, so other streams never wait behind it."""
    check_prompt_size(entry, req)
    tokens = await _prompt_tokens_async(entry, req, parse_special)
    return preprocess(entry, req, request_id, explain, parse_special, tokens)


def preprocess(
    entry: ModelEntry,
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    explain: bool = False,
    parse_special: bool = False,
    tokens: list[int] | None = None,
) -> PreprocessedRequest:
    """Validate against the model and build the engine request (``tokens``: the
    prompt's ids when already built). Special-token text in the user's text is plain
    text unless ``parse_special`` (trusted callers)."""
    if tokens is None:
        check_prompt_size(entry, req)
        tokens = _prompt_tokens(entry, req, parse_special)
    return PreprocessedRequest(
        request_id=request_id,
        model=entry.name,
        token_ids=tokens,
        sampling=SamplingOptions(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
        ),
        stop=StopConditions(
            max_tokens=_token_budget(entry.context_length, len(tokens), req),
            min_tokens=req.min_tokens,
            stop=req.stop_strings(),
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
        ),
        output=OutputOptions(logprobs=req.logprob_count()),
        eos_token_ids=list(entry.info.eos_token_ids),
        routing=_routing_hints(req, explain),
        guided=guided_of(req),
    )


def _token_budget(context: int, n: int, req: ChatCompletionRequest | CompletionRequest) -> int:
    """``max_tokens`` checked against the context (the rest of it when unset)."""
    if n >= context:
        raise InvalidArgument(
            f"the prompt has {n} tokens but the model's context length is {context}; shorten the prompt"
        )
    max_tokens = req.token_limit()
    if max_tokens is None:
        max_tokens = context - n
    elif n + max_tokens > context:
        raise InvalidArgument(
            f"the model's context length is {context} tokens, but {n + max_tokens} were requested "
            f"({n} in the prompt, {max_tokens} to generate); lower max_tokens or shorten the prompt"
        )
    if req.min_tokens > max_tokens:
        raise InvalidArgument(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens})")
    return max_tokens


def _routing_hints(req: ChatCompletionRequest | CompletionRequest, explain: bool) -> RoutingHints | None:
    explain = explain or req.router_explain
    if not (explain or req.priority or req.kv_overlap_weight is not None or req.router_temperature is not None):
        return None
    return RoutingHints(
        priority=req.priority,
        overlap_weight=req.kv_overlap_weight,
        router_temperature=req.router_temperature,
        explain=explain,
    )


def explain_route(
    entry: ModelEntry, request_id: str, worker_id: int | None, peer: PeerPrefix | None = None
) -> dict[str, object]:
    """Why the request went where it went (``router_explain`` / ``x-kvmesh-explain``);
    ``peer``: the prefix the router told the worker to read from a peer (router/peer.py)."""
    out: dict[str, object] = {"worker": f"{worker_id:x}" if worker_id is not None else None}
    if peer is not None:
        out["peer_fetch"] = {"worker": f"{peer.worker_id:x}", "blocks": peer.blocks}
    policy = entry.router.policy
    decision = policy.explain(request_id)
    if decision is None:
        out["mode"] = type(policy).__name__
        return out
    out["mode"] = entry.kv.settings.mode if entry.kv is not None else "kv"
    out["block_size"] = entry.kv.settings.block_size if entry.kv is not None else None
    out["overlap_blocks"] = decision.overlap_blocks
    out["candidates"] = rows = [
        {
            "worker": f"{c.worker_id:x}",
            "overlap_blocks": c.overlap_blocks,
            "prefill_blocks": round(c.prefill_blocks, 3),
            "decode_blocks": round(c.decode_blocks, 3),
            "cost": round(c.cost, 3),
            "weight": c.weight,
        }
        for c in decision.candidates
    ]
    if decision.tiers:  # a prefix in host/disk KV tiers: each candidate's run by tier
        for row, c in zip(rows, decision.candidates):
            g1, g2, g3 = decision.tiers.get(c.worker_id, (0, 0, 0))
            row["tier_blocks"] = {"g1": g1, "g2": g2, "g3": g3}
    return out
