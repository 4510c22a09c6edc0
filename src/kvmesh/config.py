"""Configuration: one frozen dataclass per role, built once (in :mod:`kvmesh.cli`) from
flags, ``KVMESH_*`` variables and an optional ``--config`` file, read-only afterwards.

Every setting is declared once, as a field made with :func:`kvmesh.settings.setting`
(type, default, help, variable, flag, validation); the CLI flags, the environment and
the config file are derived from the declarations (see :mod:`kvmesh.settings`).
Invalid values raise ``ValueError`` with a message that says what to fix. Engine
settings are declared by each engine and found through
:mod:`kvmesh.engines.registry`; this module imports no engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvmesh.kv.tiers import DEFAULT_TIER_WEIGHTS, check_tier_weights
from kvmesh.settings import port as a_port
from kvmesh.settings import NO_FLAG, EngineSettings, at_least, check, non_negative, positive, setting, split_commas, within

__all__ = [
    "WorkerConfig",
    "FrontendConfig",
    "HttpLimits",
    "SecurityConfig",
    "ClusterCredentials",
    "FrontendCommandConfig",
    "LogConfig",
    "LOG_LEVELS",
    "RunConfig",
    "ModelFleet",
    "PlannerConfig",
    "RuntimeConfig",
    "ROUTER_MODES",
    "WORKER_MODES",
    "DISCOVERY_BACKENDS",
    "REQUEST_PLANES",
    "EVENT_PLANES",
    "ENV_VARS",
]

ROUTER_MODES = ("round_robin", "random", "kv", "kv-approx")
WORKER_MODES = ("aggregated", "prefill", "decode")
DISCOVERY_BACKENDS = ("memory", "file", "etcd")
REQUEST_PLANES = ("tcp", "nats")
EVENT_PLANES = ("zmq", "nats", "memory")
LOG_LEVELS = ("debug", "info", "warning", "error")

_DISAGG = "disaggregated prefill/decode"


def _model_name_ok(value: object) -> str | None:
    ok = isinstance(value, str) and 0 < len(value) <= 256 and value.isprintable()
    return None if ok else "must be 1 to 256 printable characters"


def _lora_ok(value: object) -> str | None:
    bad = [v for v in value if not str(v).partition("=")[0] or not str(v).partition("=")[2]] if isinstance(value, tuple) else [value]
    return f"must be NAME=PATH, got {bad[0]!r}" if bad else None


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process. ``engine_options``: the settings of ``engine`` (its
    registry entry's settings class; None: that engine's defaults)."""

    model_path: str | None = setting(None, "Hugging Face model folder (default: the bundled tiny model)", metavar="DIR")
    model: str | None = setting(
        None, "a named model instead of --model-path: smollm2 (converted once into ~/.cache/kvmesh; see docs/engines.md)",
        env="KVMESH_MODEL", metavar="NAME",
    )  # fmt: skip
    engine: str = setting("mocker", "engine to run in each worker")
    served_model_name: str | None = setting(
        None, "the name clients ask for (default: the model folder's name)", check=_model_name_ok, metavar="NAME"
    )
    engine_options: EngineSettings | None = None
    block_size: int = setting(16, "KV block size in tokens (mocker and hf; vLLM: --vllm-block-size)", check=positive)
    worker_id: int = setting(0, "id in static mode (default: the port); distributed mode uses the lease id", check=non_negative)
    # LoRA adapters (issue 30; kvmesh.engines.lora): PEFT folders loaded at start, and how many stay resident
    lora: tuple[str, ...] = setting(
        (), "a LoRA adapter to load at start: NAME=PATH of a PEFT folder (repeat the flag for more)",
        env="KVMESH_LORA", metavar="NAME=PATH", check=lambda v: _lora_ok(v),
    )  # fmt: skip
    max_loras: int = setting(
        4, "LoRA adapters resident at once per worker (the least recently used idle one is unloaded; 0: no LoRA)",
        env="KVMESH_MAX_LORAS", check=non_negative,
    )  # fmt: skip
    host: str = "127.0.0.1"  # from the runtime's --host
    # kvmesh run: whether its frontend subscribes to KV events (--router-mode kv); a static worker of a
    # run that does not publishes none (no event plane, no zmq); distributed workers always publish
    publish_events: bool = True
    port: int = setting(0, "request-plane TCP port (0: any free port)", check=a_port)
    validate_streams: bool = setting(False, "check every engine stream against the contract (also KVMESH_DEBUG=1)")
    grace_s: float = setting(30.0, "seconds in-flight requests get to finish on SIGTERM", flag="--grace", check=non_negative)
    replicas: int = setting(
        1, "run this many workers in this process, each a full instance (own lease, discovery record, request-plane"
        " endpoint, KV events); they share the event loop and the etcd/NATS connections (kvmesh.worker.replicas)",
        env="KVMESH_WORKER_REPLICAS", check=at_least(1),
    )  # fmt: skip
    # disaggregation (kvmesh.disagg): the worker's role and the global prefill queue
    mode: str = setting(
        "aggregated", "aggregated, prefill (pulls the prefill queue) or decode (prefills long prompts remotely)",
        choices=WORKER_MODES,
    )  # fmt: skip
    prefill_queue: str = setting(
        "", "distributed: JetStream on --nats-url (default); embedded: tcp://host:port of kvmesh run's queue",
        check=lambda v: None if v in ("", "nats") or str(v).startswith("tcp://") else "must be 'nats' or tcp://host:port",
    )  # fmt: skip
    # issue 16: a hot spare of a distributed fleet (kvmesh planner promotes or stops it by signed order)
    standby: bool = setting(False, "distributed: start and offer this worker as a standby; serve only when "
                            "kvmesh planner orders it (a signed order in discovery)")  # fmt: skip
    max_local_prefill_length: int = setting(
        1000, "decode workers prefill remotely only prompts with more uncached tokens than this",
        check=non_negative, group=_DISAGG,
    )  # fmt: skip
    max_prefill_queue_size: int = setting(
        2, "... and only while the prefill queue holds fewer jobs than this", check=non_negative, group=_DISAGG
    )
    max_prefill_queue_tokens: int = setting(
        0, "... and fewer tokens left to prefill than this (0: no token bound)", check=non_negative, group=_DISAGG
    )
    remote_prefill_timeout_s: float = setting(
        30.0, "seconds a decode worker waits for a remote prefill before prefilling locally", check=positive, group=_DISAGG
    )
    drain_migrate: bool = setting(
        False, "on SIGTERM, hand in-flight requests with their KV to other workers instead of finishing them", group=_DISAGG
    )
    peer_fetch: bool = setting(
        False, "read a prompt's prefix from the worker that holds it when the router says so, and serve prefixes to"
        " peers (KV-transfer port; issue 33)", group=_DISAGG,
    )  # fmt: skip
    metrics_port: int | None = setting(
        None, "serve the worker's metrics for Prometheus on this port (0: any free port; distributed: a free one by default)",
        check=a_port, group=_DISAGG,
    )  # fmt: skip
    metrics_host: str = setting(
        "127.0.0.1", "address the worker's metrics port binds to and advertises (0.0.0.0: every interface,"
        " advertised as --host); with a cluster secret it asks for the metrics token (kvmesh metrics-token)",
        env="KVMESH_METRICS_HOST", group=_DISAGG,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check(self)


_LIMITS = "HTTP limits (enforced as bytes arrive)"


@dataclass(frozen=True)
class HttpLimits:
    """What the frontend's HTTP server accepts, enforced as bytes arrive
    (kvmesh.frontend.server)."""

    max_url_bytes: int = setting(8 * 1024, "URL limit (414)", check=positive, group=_LIMITS)
    max_header_bytes: int = setting(32 * 1024, "request head limit: request line + headers (431)", check=positive, group=_LIMITS)
    max_headers: int = setting(100, "headers per request (431)", check=positive, group=_LIMITS)
    header_timeout_s: float = setting(10.0, "seconds for a request head to arrive", check=positive, group=_LIMITS)
    body_timeout_s: float = setting(30.0, "longest pause inside a request body (s)", check=positive, group=_LIMITS)
    keepalive_timeout_s: float = setting(30.0, "idle keep-alive connections close after this (s)", check=positive, group=_LIMITS)
    send_timeout_s: float = setting(60.0, "a client that reads nothing for this long is dropped (s)", check=positive, group=_LIMITS)
    max_connections: int = setting(4096, "open client connections; past it: 503 and close", check=positive, group=_LIMITS)
    max_pipelined: int = setting(16, "requests queued per connection before reading pauses", check=positive, group=_LIMITS)
    max_pipelined_bytes: int = setting(
        4 * 1024 * 1024, "bytes of request bodies queued per connection before reading pauses", check=positive, group=_LIMITS
    )
    request_read_timeout_s: float = setting(
        600.0, "seconds for a whole request, head and body, to arrive (408): a 4 MiB body makes it at 56 kbit/s "
        "(a dial-up modem); a body drip-fed to dodge --body-timeout does not", check=positive, group=_LIMITS,
    )  # fmt: skip
    min_body_rate: int = setting(
        1024, "bytes/s a request body must average once --body-rate-grace has passed (408; 0: off): 8 kbit/s, "
        "below any real link", check=non_negative, group=_LIMITS,
    )  # fmt: skip
    body_rate_grace_s: float = setting(5.0, "seconds of a request body before --min-body-rate applies", check=positive, group=_LIMITS)
    max_connections_per_client: int = setting(
        512, "open connections from one address (an IPv6 /64 is one); past it that client gets a 503, others are "
        "served (behind a proxy: at least the proxy's connection pool)", check=positive, group=_LIMITS,
    )  # fmt: skip
    max_connection_age_s: float = setting(
        300.0, "a keep-alive connection older than this takes no new request: the next response closes it (one in "
        "flight is never cut), so a periodic cheap request cannot hold a socket forever", check=positive, group=_LIMITS,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check(self)


_AUTH = "authentication and admin"
TIERS = ("premium", "standard", "best_effort")


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call what (kvmesh.frontend.auth). ``api_keys`` is what the CLI makes of
    ``--api-key`` (tier premium) and ``--api-keys-file`` (``key tier`` per line)."""

    api_keys: tuple[tuple[str, str], ...] = ()  # (key, highest priority tier it may ask for)
    # (key, its tenant and limits as written in the keys file: "tenant=NAME rpm=N ..."; kvmesh.frontend.tenants)
    api_key_options: tuple[tuple[str, str], ...] = ()
    api_key: str = setting("", "require Authorization: Bearer KEY on /v1/*", env="KVMESH_API_KEY", group=_AUTH)
    api_keys_file: str = setting(
        "", "a file of 'KEY [TIER]' lines: several keys, each with the highest priority tier it may ask for",
        env="KVMESH_API_KEYS_FILE", group=_AUTH,
    )  # fmt: skip
    admin: bool = setting(False, "serve /admin/* (fault injection, worker list); off by default", group=_AUTH)
    admin_key: str = setting("", "the key /admin/* requires when API keys are on", env="KVMESH_ADMIN_KEY", group=_AUTH)
    metrics_auth: bool = setting(False, "/metrics needs an API key too (default: open)", group=_AUTH)
    cache_isolation: str = setting(
        "none", "tenant: salt each tenant's KV block hashes (tenants never share cached blocks; see README Tenants)",
        choices=("none", "tenant"), env="KVMESH_CACHE_ISOLATION", group=_AUTH,
    )  # fmt: skip
    tenant_budget: str = setting(
        "auto", "kvmesh frontend: tenants' rpm/tpm held across frontends (shared: leased from a NATS KV budget; local: "
        "each frontend alone; auto: shared when the frontend uses NATS; see README Tenants)",
        choices=("auto", "shared", "local"), env="KVMESH_TENANT_BUDGET", group=_AUTH,
    )  # fmt: skip
    allow_unauthenticated: bool = setting(
        False, "serve /v1/* without API keys on an address other than loopback (refused otherwise; never with --admin)",
        env="KVMESH_ALLOW_UNAUTHENTICATED", group=_AUTH,
    )  # fmt: skip
    trust_priority_header: bool = setting(
        False, "without keys, accept the priority tier a client asks for (default: premium is refused)", group=_AUTH
    )
    allow_special_tokens: bool = setting(
        False, "parse special tokens typed in user text as control tokens (trusted callers only)", group=_AUTH
    )
    max_stop: int = setting(16, "stop strings per request", check=positive, group=_AUTH)
    max_stop_chars: int = setting(1024, "characters per stop string", check=positive, group=_AUTH)
    max_messages: int = setting(1024, "chat messages per request", check=positive, group=_AUTH)
    max_message_chars: int = setting(
        4 * 1024 * 1024, "characters of prompt text per request (messages, tools, template arguments; a completions prompt)",
        check=positive, group=_AUTH,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for key, tier in self.api_keys:
            if not key or tier not in TIERS:
                raise ValueError(f"an API key needs a tier in {', '.join(TIERS)}, got {tier!r}")
        if self.admin and self.api_keys and not self.admin_key:
            raise ValueError("--admin with API keys needs --admin-key (or KVMESH_ADMIN_KEY)")
        check(self)

    def __repr__(self) -> str:  # keys stay out of logs
        return f"SecurityConfig(keys={len(self.api_keys)}, admin={self.admin})"

    @property
    def metrics_open(self) -> bool:
        """/metrics without a key even when keys are configured."""
        return not self.metrics_auth


_HEALTH = "health (canary checks, circuit breakers)"
_DEGRADE = "graceful degradation (capacity of healthy workers vs demand, priority shedding)"
_KV = "KV-aware routing (--router-mode kv | kv-approx)"
_STORE = "stored responses (/v1/responses previous_response_id; in this process's memory)"


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in split_commas(text))
    except ValueError:
        raise ValueError("is not a comma-separated list of numbers") from None


def _tier_weights_ok(value: object) -> str | None:
    if not isinstance(value, tuple):
        return "must be two numbers in [0, 1]: HOST,DISK"
    try:
        check_tier_weights(value)
    except ValueError:
        return "must be two numbers in [0, 1]: HOST,DISK"
    return None


@dataclass(frozen=True)
class FrontendConfig:
    http_host: str = setting("127.0.0.1", "address to serve HTTP on")
    http_port: int = setting(8000, "HTTP port", check=a_port)
    router_mode: str = setting("round_robin", "how to pick a worker", choices=ROUTER_MODES)
    keepalive_s: float = setting(15.0, "seconds between SSE keep-alive comments", check=positive)
    max_body_bytes: int = setting(4 * 1024 * 1024, "request body limit (413)", check=positive, group=_LIMITS)
    connect_timeout_s: float = setting(5.0, "seconds to connect to a worker", check=positive)
    response_timeout_s: float = setting(120.0, "seconds to wait for a worker's first response", check=positive)
    worker_wait_s: float = setting(5.0, "seconds a request waits for a worker to appear, then 503", check=non_negative)
    kv_overlap_weight: float = setting(1.0, "weight of prefill cost vs decode load", check=non_negative, group=_KV)
    router_temperature: float = setting(0.0, "0: pick the cheapest; >0: sample", check=non_negative, group=_KV)
    kv_block_size: int | None = setting(
        None, "router block size (default: the workers'; must match them)", check=positive, group=_KV
    )
    lora_load_ms: float = setting(
        50.0, "what loading a LoRA adapter on a worker that lacks it costs in routing (ms)", check=non_negative, group=_KV
    )
    router_prefill_rate: float = setting(
        8.0, "a worker's prefill rate in tokens per ms: what --lora-load-ms is worth in prefill tokens",
        check=positive, group=_KV,
    )  # fmt: skip
    peer_fetch_gbps: float = setting(
        25.0, "the KV-transfer link between workers (GB/s): with workers on --peer-fetch, a request's prefix is read "
        "from the worker holding it when that takes less time than prefilling it (router/peer.py)",
        check=positive, group=_KV,
    )  # fmt: skip
    kv_tier_weights: tuple[float, ...] = setting(
        tuple(round(w, 4) for w in DEFAULT_TIER_WEIGHTS), "price of a prefix hit in a worker's host (G2) and disk (G3) "
        "KV tiers, as a fraction of prefilling it: HOST,DISK in [0, 1] (default: the mocker's bandwidths; kv/tiers.py)",
        parse=_fractions, check=_tier_weights_ok, metavar="HOST,DISK", group=_KV,
    )  # fmt: skip
    admission_threshold: float | None = setting(
        None, "queue requests while every worker has more than this × its batch token budget in prefill (default: off)",
        check=positive, group=_KV,
    )  # fmt: skip
    admission_max_queue: int = setting(1024, "past this many waiting: 503", check=positive, group=_KV)
    router_shards: int = setting(
        1, "kv mode: the KV index split by worker over this many processes (1: in the frontend; zmq event plane)",
        check=positive, group=_KV,
    )  # fmt: skip
    router_shard_wait_ms: float = setting(
        2.0, "with --router-shards: how long a decision waits for the shards' overlaps (a late shard's workers count as "
        "holding nothing)", check=positive, group=_KV,
    )  # fmt: skip
    migration_limit: int = setting(
        3, "times a request may move to another worker after a mid-stream failure (0: never)", check=non_negative
    )
    canary_interval_s: float = setting(30.0, "seconds between canary checks per worker (0: off)", check=non_negative, group=_HEALTH)
    canary_timeout_s: float = setting(10.0, "seconds a canary may take", check=positive, group=_HEALTH)
    canary_files: tuple[str, ...] = setting(
        (), "a canary set (JSON; see `kvmesh canary record`); repeatable", flag="--canaries", metavar="FILE", group=_HEALTH
    )
    breaker_recovery_s: float = setting(60.0, "seconds an open circuit waits before a trial", check=positive, group=_HEALTH)
    # graceful degradation (off unless asked for): SLOs the capacity model is held to
    degradation: bool = setting(False, "shed by priority tier when capacity falls short of demand", group=_DEGRADE)
    slo_ttft_ms: float = setting(500.0, "time-to-first-token SLO", check=positive, group=_DEGRADE)
    slo_tpot_ms: float = setting(30.0, "time per output token SLO", check=positive, group=_DEGRADE)
    slo_output_tokens: int = setting(256, "average output tokens", check=positive, group=_DEGRADE)
    slo_max_batch: int = setting(256, "sequences one worker runs at once", check=positive, group=_DEGRADE)
    shed_retry_after_s: float = setting(30.0, "Retry-After of shed requests (s)", check=positive, group=_DEGRADE)
    responses_store_entries: int = setting(
        10_000, "responses kept for previous_response_id, oldest dropped first (0: none kept)", check=non_negative,
        group=_STORE,
    )  # fmt: skip
    responses_store_bytes: int = setting(
        256 * 1024 * 1024, "bytes of stored conversations in all; one larger than this is not kept", check=positive,
        group=_STORE,
    )  # fmt: skip
    responses_store_ttl_s: float = setting(3600.0, "seconds a stored response can be continued", check=positive, group=_STORE)
    # the public edge (issue 12): HTTP limits and who may call what
    http: HttpLimits = field(default_factory=HttpLimits)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        check(self)

    @property
    def kv_routing(self) -> bool:
        return self.router_mode in ("kv", "kv-approx")


_PLAN = "planner (issue 16)"


@dataclass(frozen=True)
class PlannerConfig:
    """The planner: ``--planner`` in ``kvmesh run`` (it acts on the run's worker
    supervisor), or the ``kvmesh planner`` process (it acts through discovery)."""

    planner: bool = setting(False, "run the planner: keep hot spares, replace lost workers, scale and reshape the fleet",
                            env="KVMESH_PLANNER", group=_PLAN)  # fmt: skip
    hot_spares: int = setting(0, "workers kept started and canary-checked but not routed to, promoted when one fails",
                              env="KVMESH_HOT_SPARES", check=non_negative, group=_PLAN)  # fmt: skip
    min_workers: int | None = setting(
        None, "the planner never goes below this many serving workers (default: the start size; kvmesh planner: 1)",
        check=positive, group=_PLAN,
    )  # fmt: skip
    max_workers: int | None = setting(
        None, "the planner never runs more workers than this, spares included (default: the start size + spares)",
        check=positive, group=_PLAN,
    )  # fmt: skip
    planner_interval_s: float = setting(2.0, "seconds between planner rounds (a lost worker is handled at once)",
                                        check=positive, group=_PLAN)  # fmt: skip
    planner_cooldown_s: float = setting(30.0, "seconds between two reshaping actions (role moves; without a capacity profile, scaling too)",
                                        check=non_negative, group=_PLAN)  # fmt: skip
    planner_hold_rounds: int = setting(3, "rounds a signal must hold before the planner reshapes", check=positive,
                                       group=_PLAN)  # fmt: skip
    capacity_profile: str | None = setting(
        None, "the workers' capacity profile (JSON, from kvmesh replay --profile-capacity): size each role from the "
        "load forecast", metavar="FILE", group=_PLAN,
    )  # fmt: skip
    planner_headroom: float = setting(
        0.85, "with a capacity profile: run each worker at most at this share of its profiled capacity",
        check=within(0.05, 1.0), group=_PLAN,
    )  # fmt: skip
    # kvmesh planner only: the local worker processes it may start and stop (issue 32)
    worker_flags: str = setting(
        "", "kvmesh planner: start and stop local `kvmesh worker` processes with these flags (one string, split like a"
        " shell; e.g. \"--engine mocker --speedup 10\"; its own runtime settings are added); empty: it only promotes"
        " --standby workers", env="KVMESH_PLANNER_WORKER_FLAGS", metavar="FLAGS", check=lambda v: _shell_line_ok(v),
        group=_PLAN,
    )  # fmt: skip
    # kvmesh planner only: its /metrics (kvmesh run serves them on the frontend's)
    planner_metrics_port: int | None = setting(None, "serve the planner's Prometheus metrics on this port",
                                               check=a_port, group=_PLAN)  # fmt: skip
    planner_metrics_host: str = setting(
        "127.0.0.1", "address the planner's metrics port binds to (with a cluster secret: the metrics token is asked)",
        env="KVMESH_PLANNER_METRICS_HOST", group=_PLAN,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check(self)
        if self.max_workers is not None and self.min_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"--max-workers ({self.max_workers}) must be at least --min-workers ({self.min_workers})")
        if self.worker_flags and self.max_workers is None:
            raise ValueError("--worker-flags needs --max-workers: how many worker processes the planner may run here")


@dataclass(frozen=True)
class RunConfig:
    """``kvmesh run``: one frontend supervising ``workers`` worker processes."""

    frontend: FrontendConfig
    worker: WorkerConfig
    workers: int = setting(2, "number of workers", check=at_least(1))
    workers_per_process: int = setting(
        1, "run up to this many of the workers in each worker process (see kvmesh worker --replicas)", check=at_least(1)
    )
    # disaggregated: this many prefill and decode workers instead of ``workers`` aggregated ones
    prefill_workers: int = setting(0, "disaggregated: prefill worker processes", check=non_negative)
    decode_workers: int = setting(0, "disaggregated: decode worker processes", check=non_negative)
    max_failed_starts: int = setting(
        5, "give up (exit 1 with the worker's error) after this many worker starts in a row fail",
        check=positive,
    )  # fmt: skip
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    # several models (``[[models]]`` tables of --config): each its workers' config and count;
    # empty: the one model of ``worker`` × ``workers``
    models: tuple[ModelFleet, ...] = ()

    def __post_init__(self) -> None:
        check(self)
        if self.models and (self.disaggregated or self.planner.planner):
            raise ValueError("several models ([[models]] in --config) run aggregated workers without --planner for now")
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            raise ValueError("disaggregated serving needs both --prefill-workers and --decode-workers (at least 1 each)")
        if self.planner.hot_spares and not self.planner.planner:
            raise ValueError("--hot-spares needs --planner (the planner starts, checks and promotes them)")
        if self.workers_per_process > 1 and self.disaggregated:
            raise ValueError("--workers-per-process is for aggregated workers (--workers); not with --prefill-workers")
        if self.workers_per_process > 1 and self.planner.planner:
            raise ValueError("--workers-per-process is not for --planner (the planner starts and stops workers one at a time)")

    @property
    def disaggregated(self) -> bool:
        return self.decode_workers > 0

    @property
    def fleets(self) -> tuple[ModelFleet, ...]:
        """Every model's workers: ``models``, or the one model of ``worker`` × ``workers``."""
        return self.models or (ModelFleet(self.worker, self.workers),)


@dataclass(frozen=True)
class ModelFleet:
    """One model of ``kvmesh run`` (a ``[[models]]`` table): its workers' config and count."""

    worker: WorkerConfig
    workers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
        if self.worker.mode != "aggregated":
            raise ValueError(f"a model's workers are aggregated (mode = {self.worker.mode!r} is not for [[models]])")


def _default_file_dir() -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"kvmesh-discovery-{os.getuid()}")


def _shell_line_ok(value: object) -> str | None:
    import shlex  # kvmesh planner --worker-flags only

    try:
        shlex.split(str(value))
    except ValueError as exc:
        return f"must split like a shell line ({exc})"
    return None


def _namespace_ok(value: object) -> str | None:
    ok = isinstance(value, str) and value and "." not in value and "/" not in value
    return None if ok else "must be a non-empty name without '.' or '/'"


_RT = "distributed runtime"
_SEC = "secured etcd / NATS (the etcd password only from KVMESH_ETCD_PASSWORD)"


@dataclass(frozen=True)
class RuntimeConfig:
    """How a process joins the distributed runtime (``kvmesh frontend`` / ``worker``)."""

    namespace: str = setting("kvmesh", "namespace of this fleet", env="KVMESH_NAMESPACE", check=_namespace_ok, group=_RT)
    discovery: str = setting("file", "discovery backend", env="KVMESH_DISCOVERY", choices=DISCOVERY_BACKENDS, group=_RT)
    etcd_endpoints: tuple[str, ...] = setting(
        ("http://127.0.0.1:2379",), "etcd endpoints, comma-separated", env="KVMESH_ETCD_ENDPOINTS",
        parse=split_commas, group=_RT,
    )  # fmt: skip
    # "" : a per-user folder in the temporary directory (file_discovery_path)
    file_discovery_dir: str = setting("", "folder of file discovery (default: a per-user temporary folder)",
                                      env="KVMESH_FILE_DISCOVERY_DIR", group=_RT)  # fmt: skip
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS server", env="KVMESH_NATS_URL", group=_RT)
    request_plane: str = setting("tcp", "request plane", env="KVMESH_REQUEST_PLANE", choices=REQUEST_PLANES, group=_RT)
    event_plane: str = setting("zmq", "event plane", env="KVMESH_EVENT_PLANE", choices=EVENT_PLANES, group=_RT)
    host: str = setting("127.0.0.1", "address to bind and advertise", env="KVMESH_HOST", group=_RT)
    lease_ttl_s: float = setting(
        10.0, "seconds a dead process stays in discovery (etcd grants at least its minimum, 2 s by default)",
        env="KVMESH_LEASE_TTL", check=positive, group=_RT,
    )  # fmt: skip
    # secured etcd / NATS (all optional; see README "Securing a fleet")
    etcd_ca_file: str = setting("", "CA bundle for https:// endpoints", flag="--etcd-ca", env="KVMESH_ETCD_CA", group=_SEC)
    etcd_cert_file: str = setting("", "client certificate", flag="--etcd-cert", env="KVMESH_ETCD_CERT", group=_SEC)
    etcd_key_file: str = setting("", "client key", flag="--etcd-key", env="KVMESH_ETCD_KEY", group=_SEC)
    etcd_user: str = setting("", "etcd user (password: KVMESH_ETCD_PASSWORD)", env="KVMESH_ETCD_USER", group=_SEC)
    etcd_password: str = setting("", "etcd password", flag=NO_FLAG, env="KVMESH_ETCD_PASSWORD")
    nats_creds_file: str = setting(
        "", "NATS credentials file (JWT + nkey)", flag="--nats-creds", env="KVMESH_NATS_CREDS", group=_SEC
    )
    nats_ca_file: str = setting("", "CA bundle for tls:// servers", flag="--nats-ca", env="KVMESH_NATS_CA", group=_SEC)
    nats_cert_file: str = setting("", "client certificate", flag="--nats-cert", env="KVMESH_NATS_CERT", group=_SEC)
    nats_key_file: str = setting("", "client key", flag="--nats-key", env="KVMESH_NATS_KEY", group=_SEC)

    def __post_init__(self) -> None:
        if not self.file_discovery_dir:
            object.__setattr__(self, "file_discovery_dir", _default_file_dir())
        check(self)

    def __repr__(self) -> str:  # the password stays out of logs
        return f"RuntimeConfig(namespace={self.namespace!r}, discovery={self.discovery!r}, host={self.host!r})"

    @property
    def needs_nats(self) -> bool:
        return self.request_plane == "nats" or self.event_plane == "nats"


_CLUSTER = "cluster credentials (internal connections)"


@dataclass(frozen=True)
class ClusterCredentials:
    """The fleet's shared secret and mutual TLS (kvmesh.runtime.auth reads them from
    the environment, which child processes inherit; the CLI puts given flags there)."""

    cluster_secret_file: str = setting(
        "", "the fleet's shared secret: internal connections are authenticated and discovery records and NATS"
        " messages signed (or the secret itself in KVMESH_CLUSTER_SECRET; kvmesh run makes a random one by default)",
        env="KVMESH_CLUSTER_SECRET_FILE", metavar="FILE", group=_CLUSTER,
    )  # fmt: skip
    tls_cert: str = setting(
        "", "mutual TLS on internal TCP connections: this process's certificate", env="KVMESH_TLS_CERT", metavar="PEM",
        group=_CLUSTER,
    )  # fmt: skip
    tls_key: str = setting("", "its private key", env="KVMESH_TLS_KEY", metavar="PEM", group=_CLUSTER)
    tls_ca: str = setting(
        "", "the fleet's CA: peers must present a certificate it signed", env="KVMESH_TLS_CA", metavar="PEM", group=_CLUSTER
    )
    insecure: bool = setting(
        False, "kvmesh frontend/worker/planner: listen on an address other than loopback (--host, --metrics-host) without"
        " a cluster secret or TLS (refused otherwise; warned about at start and every minute)",
        env="KVMESH_INSECURE", group=_CLUSTER,
    )  # fmt: skip


@dataclass(frozen=True)
class LogConfig:
    """How a command logs (``kvmesh run``, ``frontend``, ``planner``)."""

    log_level: str = setting("warning", "logging level", env="KVMESH_LOG_LEVEL", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class FrontendCommandConfig:
    """What ``kvmesh frontend`` reads besides its config objects: where its workers
    are without discovery, a model folder to load at once."""

    static_workers: tuple[str, ...] = setting(
        (), "comma-separated host:port of static workers: no discovery at all", env="KVMESH_STATIC_WORKERS",
        parse=split_commas, metavar="HOST:PORT,...",
    )  # fmt: skip
    model_path: str | None = setting(
        None, "load this model folder now (optional: models come from workers)", metavar="DIR"
    )

    def __post_init__(self) -> None:
        check(self)


def _env_vars() -> dict[str, str]:
    from kvmesh.settings import settings_of

    return {f.name: m.env for f, m in settings_of(RuntimeConfig) if m.env}


# field name -> environment variable of the runtime settings (derived from the declarations)
ENV_VARS = _env_vars()


def debug_enabled() -> bool:
    return os.environ.get("KVMESH_DEBUG", "") not in ("", "0", "false")
