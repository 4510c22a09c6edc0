"""Wire types: every value that crosses a process is one of these msgspec Structs.

Grouped by the channel they travel on:

* engine / request plane: :class:`PreprocessedRequest` in, :class:`OutputChunk` out,
  :class:`ErrorInfo` for a typed mid-stream failure;
* model card: :class:`EngineConfig` (what a worker's engine serves);
* event plane: :class:`KvEventBatch` of :class:`KvEvent` data (stored / removed / cleared;
  defined in :mod:`kvmesh.kv.events`, with the bounds of a batch) and :class:`LoadReport`.

Structs use ``omit_defaults`` so msgpack frames stay small; chunks are ``gc=False``
because they are created per token and never form cycles.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvmesh.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDump,
    KvEvent,
    KvEventBatch,
    KvEventData,
    KvEventsSince,
)

# issue 30: the longest adapter name and cache salt a request may carry
MAX_ADAPTER_NAME = 128
MAX_CACHE_SALT = 128
MAX_LORA_PATH = 4096  # a LoRA adapter's folder path (a load command)
MAX_ADAPTERS = 256  # adapters a worker reports holding (LoadReport, LoraState)
MAX_KNOWN_ADAPTERS = 4096  # adapters a worker reports knowing the folder of (LoraState.known)

__all__ = [
    "FinishReason",
    "SamplingOptions",
    "StopConditions",
    "OutputOptions",
    "RoutingHints",
    "DisaggregatedParams",
    "PreprocessedRequest",
    "GuidedDecoding",
    "Usage",
    "TokenLogprob",
    "OutputChunk",
    "ErrorInfo",
    "EngineConfig",
    "KvLayout",
    "KvReservation",
    "KvEndpoint",
    "DisaggThresholds",
    "PrefillJob",
    "QueueStatus",
    "DisaggStats",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEventData",
    "KvEvent",
    "KvEventBatch",
    "LoadReport",
    "KvDump",
    "KvEventsSince",
    "InstanceInfo",
    "ModelFiles",
    "WorkerMetrics",
    "LoraCommand",
    "LoraState",
]

FinishReason = Literal["stop", "length", "cancelled", "error"]


class SamplingOptions(msgspec.Struct, omit_defaults=True):
    """How to pick the next token. ``None`` means the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


class StopConditions(msgspec.Struct, omit_defaults=True):
    """When to stop. ``max_tokens`` is always set by the frontend before routing.

    ``stop`` strings are matched by the frontend on detokenized text; engines may
    ignore them. ``stop_token_ids`` and EOS (``PreprocessedRequest.eos_token_ids``)
    are the engine's job, unless ``ignore_eos``.
    """

    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class OutputOptions(msgspec.Struct, omit_defaults=True):
    """``logprobs``: number of top alternatives per generated token (0 = only the chosen)."""

    logprobs: int | None = None


class RoutingHints(msgspec.Struct, omit_defaults=True):
    """Hints for the router; none of them changes what the engine computes."""

    worker_id: int | None = None
    priority: str | None = None
    overlap_weight: float | None = None
    router_temperature: float | None = None
    explain: bool = False
    # issue 30: the caller's tenant (API keys file) and its weight: fair queuing's share
    tenant: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    tenant_weight: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 1.0
    # issue 33: the router's word that another worker holds this prompt's prefix (set by
    # the router only, never from a client's request; router/peer.py)
    peer: PeerPrefix | None = None


class PeerPrefix(msgspec.Struct, frozen=True):
    """A prefix from a peer: worker ``worker_id`` (KV-transfer server ``kv``) holds the
    prompt's first ``blocks`` blocks; the chosen worker reads them instead of prefilling
    (:class:`~kvmesh.disagg.engine.DisaggEngine`; any failure: it prefills them)."""

    worker_id: int
    kv: KvEndpoint
    blocks: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class KvLayout(msgspec.Struct, frozen=True):
    """How an engine's KV blocks look to a KV connector (decode workers publish it).

    ``block_shape`` and ``dtype`` describe one block's tensor (for example
    ``(layers, 2, kv_heads, block_size, head_dim)``, ``"float32"``). ``bytes_per_block``
    is the block's real size, what a transfer is charged for; ``wire_bytes_per_block``
    is what ``kv_export`` returns per block: the same for engines with real tensors,
    less for the mocker, which sends a digest of each block's tokens and simulates the
    rest: connectors then add ``bytes_per_block`` × blocks ÷ ``simulated_bytes_per_s``
    seconds to every transfer.
    """

    engine: str
    block_size: int
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str
    bytes_per_block: int
    wire_bytes_per_block: int
    simulated_bytes_per_s: float = 0.0


class DisaggregatedParams(msgspec.Struct, omit_defaults=True):
    """KV that lives on another worker.

    ``kind="kv_source"``: a draining worker handed this request off; its KV for the
    first ``num_tokens`` tokens sits in ``block_ids`` on ``worker_id``, readable at
    the KV-transfer ``address`` under ``transfer_id`` until the new worker says done.
    (A stream carries it in one chunk just before its migratable error; the frontend
    copies it onto the resumed request when moving the KV beats re-prefilling.)
    """

    kind: str = ""
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    block_ids: list[int] = []
    worker_id: int | None = None
    first_token_id: int | None = None
    num_tokens: int = 0
    address: str = ""
    transfer_id: str = ""
    layout: KvLayout | None = None


GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class GuidedDecoding(msgspec.Struct, omit_defaults=True, frozen=True):
    """A constraint on what may be generated (structured outputs, forced tool calls).

    ``kind`` says how ``spec`` reads: ``json_schema`` a JSON Schema (JSON text),
    ``json_object`` any JSON object (``spec`` empty), ``regex`` a regular expression
    (Rust ``regex`` syntax), ``grammar`` a Lark grammar (llguidance's dialect);
    ``choice``: ``choices`` holds the strings one of which is the whole output.
    Engines compile it with :mod:`kvmesh.preprocess.guided`.
    """

    kind: GuidedKind
    spec: str = ""
    choices: tuple[str, ...] = ()


class PreprocessedRequest(msgspec.Struct, omit_defaults=True):
    """A tokenized request, ready for an engine."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop: StopConditions = msgspec.field(default_factory=StopConditions)
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = []
    routing: RoutingHints | None = None
    disaggregated_params: DisaggregatedParams | None = None
    # Set when the frontend re-issues a request after a worker failed mid-stream:
    # ``token_ids`` is then the original prompt followed by the tokens already
    # streamed, and this is the original prompt's length. Engines that derive anything
    # from "the prompt" (a random stream key, usage) use the first this-many tokens.
    original_prompt_len: int | None = None
    # --- tracing (observability/tracing.py): the W3C ``traceparent`` of the caller's span,
    # and the span this request continues from on another worker (a migration retry, a
    # remote prefill): ``"{trace_id:032x}-{span_id:016x}"``. Both bounded by the decoder.
    trace_context: str | None = None
    migration_link: str | None = None
    # structured outputs: what the output must match (issue 18); None = free text
    guided: GuidedDecoding | None = None
    # issue 30: the LoRA adapter to apply (None: the base model), and the cache namespace
    # (a tenant's, with --cache-isolation tenant). Both salt the request's block hashes
    # (kv.hashing.hash_salt), so KV blocks are never shared across adapters or namespaces.
    adapter: Annotated[str, msgspec.Meta(max_length=MAX_ADAPTER_NAME)] | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_CACHE_SALT)] | None = None


class Usage(msgspec.Struct, omit_defaults=True, gc=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """Log-probability of one generated token, with the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class OutputChunk(msgspec.Struct, omit_defaults=True, gc=False):
    """One item of an engine's output stream.

    Non-terminal: ``finish_reason is None``. Terminal: ``finish_reason`` is set; it
    may still carry the last tokens. ``error`` is the message of an ``"error"``
    terminal (the untyped form; a typed failure is raised as a KvmeshError).
    """

    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    disaggregated_params: DisaggregatedParams | None = None
    error: str | None = None
    cached_tokens: int | None = None
    # tracing: the worker's engine.generate span ("{trace_id:032x}-{span_id:016x}"), on the
    # first non-empty chunk, only while spans are recorded (export on)
    trace_link: str | None = None

    @property
    def is_terminal(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def stop(cls, token_ids: list[int] | None = None) -> OutputChunk:
        return cls(token_ids=token_ids or [], finish_reason="stop")

    @classmethod
    def length(cls, token_ids: list[int] | None = None) -> OutputChunk:
        return cls(token_ids=token_ids or [], finish_reason="length")

    @classmethod
    def cancelled(cls) -> OutputChunk:
        return cls(finish_reason="cancelled")

    @classmethod
    def failed(cls, message: str) -> OutputChunk:
        return cls(finish_reason="error", error=message)


class ErrorInfo(msgspec.Struct):
    """A typed error on the wire; see :func:`kvmesh.errors.from_wire`."""

    kind: str
    message: str


class EngineConfig(msgspec.Struct, omit_defaults=True):
    """What ``Engine.start()`` reports: the model card's engine half."""

    model: str
    served_model_name: str
    context_length: int
    kv_block_size: int
    total_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    # issue 30: the most LoRA adapters the engine keeps resident at once (0: no LoRA)
    max_adapters: int = 0


class KvReservation(msgspec.Struct):
    """Blocks an engine holds for one request outside its scheduler (disaggregation, migration).

    ``block_ids`` (engine-local) cover the first ``num_tokens`` tokens of the request;
    the KV of the first ``cached_tokens`` of them is valid (a prefix-cache hit, or
    tokens already computed), always a whole number of blocks except for a detached
    in-flight request.
    """

    request_id: str
    block_ids: list[int]
    num_tokens: int
    cached_tokens: int


# ---------------------------------------------------------------------------- events
# KV events live in kvmesh.kv.events (imported above); the load report stays here.


class LoadReport(msgspec.Struct, omit_defaults=True):
    """A worker's load, published after scheduler steps that change it."""

    worker_id: int
    active_blocks: int
    total_blocks: int
    num_waiting: int
    num_running: int
    timestamp_ms: float = 0.0
    # tokens per forward pass lately (prefill + decode; a moving average; 0: not reported).
    # Health checks read it to tell a loaded worker from a slow one.
    batch_tokens: float = 0.0
    # issue 30: the LoRA adapters the engine holds now (the router's adapter affinity)
    adapters: Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_ADAPTER_NAME)]], msgspec.Meta(max_length=MAX_ADAPTERS)] = []


# ---------------------------------------------------------------------------- LoRA adapters
AdapterName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADAPTER_NAME)]


class LoraCommand(msgspec.Struct, frozen=True, omit_defaults=True):
    """A worker's ``lora`` endpoint request (admin: a load reads a folder on the worker's host).

    ``load``: make ``name`` resident from ``path`` (a PEFT folder: ``adapter_config.json``
    + ``adapter_model.safetensors``; None: the path the worker was started with);
    ``unload``: drop ``name`` (refused while a running sequence uses it); ``list``: nothing
    changes. The answer is a :class:`LoraState`."""

    op: Literal["load", "unload", "list"]
    name: Annotated[str, msgspec.Meta(max_length=MAX_ADAPTER_NAME)] = ""  # "" only with ``list``
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LORA_PATH)] | None = None


class LoraState(msgspec.Struct, omit_defaults=True):
    """The adapters a worker holds after a :class:`LoraCommand`; ``load_ms``: what the
    command's load took (0 when nothing was loaded); ``known``: every adapter it can load
    (resident or not: ``--lora`` beyond ``max_adapters``, or unloaded by LRU), so that a
    frontend serves those names too."""

    adapters: Annotated[list[AdapterName], msgspec.Meta(max_length=MAX_ADAPTERS)]
    max_adapters: int
    load_ms: float = 0.0
    known: Annotated[list[AdapterName], msgspec.Meta(max_length=MAX_KNOWN_ADAPTERS)] = []


# ---------------------------------------------------------------------------- disaggregation


class KvEndpoint(msgspec.Struct, frozen=True):
    """Where and how to move a worker's KV blocks (its KV metadata, in discovery):
    the TCP KV-transfer server's ``host:port`` and the block layout (which gives the
    capacity: ``layout.num_blocks``)."""

    address: str
    layout: KvLayout
    serves_prefixes: bool = False  # answers peers' prefix reads (--peer-fetch; issue 33)


class DisaggThresholds(msgspec.Struct, frozen=True, omit_defaults=True):
    """Conditional disaggregation: prefill remotely only when the prompt's tokens not
    in the prefix cache exceed ``max_local_prefill_length`` and the prefill queue
    holds fewer than ``max_prefill_queue_size`` jobs and (when ``max_prefill_queue_tokens``
    is not 0) fewer than that many tokens still to prefill. Changeable at run time
    (stored in discovery at ``/disagg/{namespace}/thresholds``)."""

    max_local_prefill_length: int = 1000
    max_prefill_queue_size: int = 2
    max_prefill_queue_tokens: int = 0  # 0: no bound on the queued tokens

    def __post_init__(self) -> None:
        if min(self.max_local_prefill_length, self.max_prefill_queue_size, self.max_prefill_queue_tokens) < 0:
            raise ValueError("disaggregation thresholds must be >= 0")

    def wants_remote(self, prompt_len: int, cached_tokens: int) -> bool:
        """Long enough to prefill remotely (then the queue's state decides); pure, the
        rule :mod:`kvmesh.disagg.policy` applies (here so that replays can share it)."""
        return prompt_len - cached_tokens > self.max_local_prefill_length and prompt_len - 1 > cached_tokens

    def admits(self, depth: int, tokens: int) -> bool:
        """Whether a queue holding ``depth`` jobs of ``tokens`` tokens (to prefill)
        takes one more job: the work ahead of it is what it would wait for."""
        if depth >= self.max_prefill_queue_size:
            return False
        return self.max_prefill_queue_tokens == 0 or tokens < self.max_prefill_queue_tokens


class PrefillJob(msgspec.Struct, frozen=True):
    """One remote prefill on the global prefill queue. Only block ids travel: the
    prefill worker looks up the decode worker's :class:`KvEndpoint` by ``worker_id``.

    The prefill worker reads blocks ``block_ids[:cached_tokens // block_size]`` (the
    decode worker's prefix hit), computes tokens ``[cached_tokens, upto)`` and writes
    the blocks covering them into ``block_ids``, then tells the decode worker done."""

    job_id: str
    worker_id: int
    request: PreprocessedRequest
    block_ids: list[int]
    cached_tokens: int
    upto: int
    enqueued_at: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens the prefill worker computes (what a token-weighted queue counts)."""
        return max(0, self.upto - self.cached_tokens)


class QueueStatus(msgspec.Struct, frozen=True):
    """The prefill queue as a decode worker sees it (embedded mode's queue server also
    hands out the current thresholds)."""

    depth: int
    thresholds: DisaggThresholds | None = None
    tokens: int = 0  # tokens the queued jobs have left to prefill


class DisaggStats(msgspec.Struct, omit_defaults=True):
    """A worker's disaggregation and KV-transfer counters (the ``disagg_stats`` endpoint)."""

    mode: str = "aggregated"
    remote_prefills: int = 0
    local_prefills: int = 0
    local_by_queue: int = 0  # local because the prefill queue was full
    remote_fallbacks: int = 0  # remote prefill failed or timed out: done locally
    prefill_jobs_done: int = 0
    prefill_jobs_failed: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfer_s: float = 0.0
    kv_migrations_in: int = 0
    kv_migrations_out: int = 0
    kv_migration_fallbacks: int = 0
    peer_fetches: int = 0  # prompts whose prefix was read from a peer (issue 33)
    peer_fetch_blocks: int = 0  # ... the blocks read
    peer_fetch_fallbacks: int = 0  # peer fetches that failed or found fewer blocks: prefilled here
    peer_prefixes_served: int = 0  # prefix reads this worker answered for peers
    queue_depth: int = 0  # the prefill queue's depth when last asked
    queue_tokens: int = 0  # ... and the tokens its jobs have left to prefill
    active_blocks: int = 0


# ---------------------------------------------------------------------------- instances


class InstanceInfo(msgspec.Struct, omit_defaults=True):
    """A serving worker endpoint as others see it: the discovery value.

    Stored (JSON) at ``/services/{namespace}/{component}/{endpoint}-{lease_id:x}``.
    ``worker_id`` is the instance's primary lease id (``lease_id`` on the wire).
    ``transport`` says how to reach it: ``tcp`` at ``address`` (host:port) or ``nats``
    at ``subject``. The engine config and ``model_path`` form the model card; a
    frontend on another host fetches the model's small files through the worker's
    ``model_files`` endpoint. Embedded mode passes the same struct on the worker's
    stdout (one ``KVMESH_READY {json}`` line).
    """

    worker_id: int = msgspec.field(name="lease_id")
    address: str
    engine: EngineConfig
    model_path: str = ""
    pid: int = 0
    namespace: str = ""
    component: str = ""
    endpoint: str = ""
    transport: Literal["tcp", "nats"] = "tcp"
    subject: str = ""
    hostname: str = ""
    event_address: str = ""
    kv: KvEndpoint | None = None
    metrics_address: str = ""  # the worker's Prometheus endpoint (host:port), when it serves one
    mac: str = ""  # with a cluster secret: HMAC (hex) of the key and this record with mac "" (runtime/distributed.py)


# The only names a ModelFiles may carry (what a frontend needs from a model folder: no
# weights), and the most bytes one of them may have. A receiver refuses anything else.
MODEL_FILE_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
MAX_MODEL_FILE_BYTES = 48 * 1024 * 1024


class ModelFiles(msgspec.Struct):
    """The small files of a model folder (config, tokenizer, template), by file name
    (one of ``MODEL_FILE_NAMES``)."""

    name: str
    files: dict[str, bytes]


# ---------------------------------------------------------------------------- observability


class WorkerMetrics(msgspec.Struct, omit_defaults=True):
    """One worker's metrics (its ``metrics`` endpoint): what the frontend's ``/metrics``
    shows per worker, and what the worker's own ``/metrics`` serves. Counters are
    cumulative since the worker started."""

    worker_id: int
    mode: str = "aggregated"
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    in_flight: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    output_tokens: int = 0
    preemptions: int = 0
    disagg: DisaggStats | None = None
