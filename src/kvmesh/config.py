"""Configuration: one frozen dataclass per role, parsed from CLI and environment once
(in :mod:`kvmesh.cli`), read-only afterwards. Invalid values raise ``ValueError`` with
a message that says what to fix."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = [
    "MockerConfig",
    "WorkerConfig",
    "FrontendConfig",
    "HttpLimits",
    "SecurityConfig",
    "RunConfig",
    "RuntimeConfig",
    "ROUTER_MODES",
    "ENGINES",
    "WORKER_MODES",
    "DISCOVERY_BACKENDS",
    "REQUEST_PLANES",
    "EVENT_PLANES",
    "ENV_VARS",
]

ROUTER_MODES = ("round_robin", "random", "kv", "kv-approx")
WORKER_MODES = ("aggregated", "prefill", "decode")
ENGINES = ("mocker", "vllm", "hf")
DISCOVERY_BACKENDS = ("memory", "file", "etcd")
REQUEST_PLANES = ("tcp", "nats")
EVENT_PLANES = ("zmq", "nats", "memory")

# flag name -> environment variable; flags win over the environment
ENV_VARS = {
    "namespace": "KVMESH_NAMESPACE",
    "discovery": "KVMESH_DISCOVERY",
    "etcd_endpoints": "KVMESH_ETCD_ENDPOINTS",
    "file_discovery_dir": "KVMESH_FILE_DISCOVERY_DIR",
    "nats_url": "KVMESH_NATS_URL",
    "request_plane": "KVMESH_REQUEST_PLANE",
    "event_plane": "KVMESH_EVENT_PLANE",
    "host": "KVMESH_HOST",
    "lease_ttl_s": "KVMESH_LEASE_TTL",
    "etcd_ca_file": "KVMESH_ETCD_CA",
    "etcd_cert_file": "KVMESH_ETCD_CERT",
    "etcd_key_file": "KVMESH_ETCD_KEY",
    "etcd_user": "KVMESH_ETCD_USER",
    "nats_creds_file": "KVMESH_NATS_CREDS",
    "nats_ca_file": "KVMESH_NATS_CA",
    "nats_cert_file": "KVMESH_NATS_CERT",
    "nats_key_file": "KVMESH_NATS_KEY",
}


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class MockerConfig:
    """The mocker's knobs as the CLI exposes them (``--speedup`` etc.)."""

    speedup: float = 1.0
    block_size: int = 16
    num_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    fault: str = ""  # fault injection, e.g. "hang", "slow:factor=4" (kvmesh.engines.mocker.faults)
    eos_probability: float = 0.0  # natural EOS per generated token (0: always max_tokens)

    def __post_init__(self) -> None:
        for name in ("speedup", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            _positive(f"--{name.replace('_', '-')}", getattr(self, name))
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError(f"--eos-probability must be within [0, 1], got {self.eos_probability}")
        if self.fault:
            from kvmesh.engines.mocker.faults import FaultSpec

            try:
                FaultSpec.parse(self.fault)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"--fault {self.fault!r}: {exc}") from None

    def to_args(self) -> list[str]:
        return [
            "--speedup", repr(self.speedup),
            "--block-size", str(self.block_size),
            "--num-blocks", str(self.num_blocks),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
        ] + (["--fault", self.fault] if self.fault else []) + (
            ["--eos-probability", repr(self.eos_probability)] if self.eos_probability else []
        )  # fmt: skip


@dataclass(frozen=True)
class WorkerConfig:
    model_path: str | None = None
    engine: str = "mocker"
    worker_id: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    mocker: MockerConfig = field(default_factory=MockerConfig)
    validate_streams: bool = False
    grace_s: float = 30.0
    # disaggregation (kvmesh.disagg): the worker's role and the global prefill queue
    mode: str = "aggregated"  # aggregated | prefill | decode
    prefill_queue: str = ""  # "" / "nats": JetStream (distributed); "tcp://host:port": embedded mode's queue
    max_local_prefill_length: int = 1000
    max_prefill_queue_size: int = 2
    remote_prefill_timeout_s: float = 30.0
    drain_migrate: bool = False  # on SIGTERM, hand in-flight requests (and their KV) to other workers
    metrics_port: int | None = None  # Prometheus endpoint for the disaggregation counters (0: any free port)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.mode not in WORKER_MODES:
            raise ValueError(f"--mode must be one of {', '.join(WORKER_MODES)}, got {self.mode!r}")
        if self.prefill_queue not in ("", "nats") and not self.prefill_queue.startswith("tcp://"):
            raise ValueError(f"--prefill-queue must be 'nats' or tcp://host:port, got {self.prefill_queue!r}")
        if self.max_local_prefill_length < 0 or self.max_prefill_queue_size < 0:
            raise ValueError("--max-local-prefill-length and --max-prefill-queue-size must be >= 0")
        _positive("--remote-prefill-timeout", self.remote_prefill_timeout_s)

    def to_args(self) -> list[str]:
        args = ["--engine", self.engine, "--worker-id", str(self.worker_id), "--host", self.host]
        args += ["--port", str(self.port), "--grace", repr(self.grace_s)]
        if self.model_path:
            args += ["--model-path", self.model_path]
        if self.validate_streams:
            args.append("--validate-streams")
        if self.mode != "aggregated":
            args += ["--mode", self.mode]
        if self.prefill_queue:
            args += ["--prefill-queue", self.prefill_queue]
        args += ["--max-local-prefill-length", str(self.max_local_prefill_length)]
        args += ["--max-prefill-queue-size", str(self.max_prefill_queue_size)]
        args += ["--remote-prefill-timeout", repr(self.remote_prefill_timeout_s)]
        if self.drain_migrate:
            args.append("--drain-migrate")
        if self.metrics_port is not None:
            args += ["--metrics-port", str(self.metrics_port)]
        return args + self.mocker.to_args()


@dataclass(frozen=True)
class HttpLimits:
    """What the frontend's HTTP server accepts, enforced as bytes arrive
    (kvmesh.frontend.server). Each has a ``--flag`` of the same name."""

    max_url_bytes: int = 8 * 1024  # past it: 414
    max_header_bytes: int = 32 * 1024  # the whole head (request line + headers); past it: 431
    max_headers: int = 100  # past it: 431
    header_timeout_s: float = 10.0  # a request's head must arrive within this (from its first byte / the connection)
    body_timeout_s: float = 30.0  # longest pause between two pieces of a body
    keepalive_timeout_s: float = 30.0  # an idle connection between requests is closed after this
    send_timeout_s: float = 60.0  # longest a response may wait on a client that does not read
    max_connections: int = 4096  # open client connections; past it new ones get 503 and are closed
    max_pipelined: int = 16  # requests queued on one connection before reading pauses

    def __post_init__(self) -> None:
        for name in ("max_url_bytes", "max_header_bytes", "max_headers", "header_timeout_s", "body_timeout_s",
                     "keepalive_timeout_s", "send_timeout_s", "max_connections", "max_pipelined"):  # fmt: skip
            _positive(f"--{name.replace('_s', '').replace('_', '-')}", getattr(self, name))


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call what (kvmesh.frontend.auth). Keys: ``--api-key`` / KVMESH_API_KEY
    (tier premium) and ``--api-keys-file`` (``key tier`` per line)."""

    api_keys: tuple[tuple[str, str], ...] = ()  # (key, highest priority tier it may ask for)
    admin: bool = False  # serve /admin/*
    admin_key: str = ""  # required on /admin/* when keys are configured
    metrics_open: bool = True  # /metrics without a key even when keys are configured
    trust_priority_header: bool = False  # without keys: accept any tier a client asks for
    allow_special_tokens: bool = False  # parse special tokens typed in user text (trusted callers only)
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_messages: int = 1024
    max_message_chars: int = 4 * 1024 * 1024  # all messages together (characters)

    def __post_init__(self) -> None:
        tiers = ("premium", "standard", "best_effort")
        for key, tier in self.api_keys:
            if not key or tier not in tiers:
                raise ValueError(f"an API key needs a tier in {', '.join(tiers)}, got {tier!r}")
        if self.admin and self.api_keys and not self.admin_key:
            raise ValueError("--admin with API keys needs --admin-key (or KVMESH_ADMIN_KEY)")
        for name in ("max_stop", "max_stop_chars", "max_messages", "max_message_chars"):
            _positive(name, getattr(self, name))

    @property
    def keys_required(self) -> bool:
        return bool(self.api_keys)


@dataclass(frozen=True)
class FrontendConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    router_mode: str = "round_robin"
    keepalive_s: float = 15.0
    max_body_bytes: int = 4 * 1024 * 1024
    connect_timeout_s: float = 5.0
    response_timeout_s: float = 120.0
    worker_wait_s: float = 5.0
    kv_overlap_weight: float = 1.0
    router_temperature: float = 0.0
    kv_block_size: int | None = None  # None: take the workers' block size
    admission_threshold: float | None = None  # None: no admission queue
    admission_max_queue: int = 1024
    migration_limit: int = 3  # re-issues of one request after mid-stream failures; 0: off
    canary_interval_s: float = 30.0  # 0: no canary health checks
    canary_timeout_s: float = 10.0
    canary_files: tuple[str, ...] = ()
    breaker_recovery_s: float = 60.0
    # graceful degradation (off unless asked for): SLOs the capacity model is held to
    degradation: bool = False
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 30.0
    slo_output_tokens: int = 256
    slo_max_batch: int = 256
    shed_retry_after_s: float = 30.0
    # the public edge (issue 12): HTTP limits and who may call what
    http: HttpLimits = field(default_factory=HttpLimits)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(f"--router-mode must be one of {', '.join(ROUTER_MODES)}, got {self.router_mode!r}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must be in 0..65535, got {self.http_port}")
        for name in ("keepalive_s", "max_body_bytes", "connect_timeout_s", "response_timeout_s"):
            _positive(name, getattr(self, name))
        if self.canary_interval_s < 0:
            raise ValueError(f"--canary-interval must not be negative, got {self.canary_interval_s}")
        _positive("--canary-timeout", self.canary_timeout_s)
        _positive("--breaker-recovery", self.breaker_recovery_s)
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must not be negative, got {self.migration_limit}")
        if self.worker_wait_s < 0:
            raise ValueError(f"--worker-wait must not be negative, got {self.worker_wait_s}")
        if self.kv_overlap_weight < 0 or self.router_temperature < 0:
            raise ValueError("--kv-overlap-weight and --router-temperature must not be negative")
        if self.kv_block_size is not None:
            _positive("--kv-block-size", self.kv_block_size)
        if self.admission_threshold is not None:
            _positive("--admission-threshold", self.admission_threshold)
        _positive("--admission-max-queue", self.admission_max_queue)

    @property
    def kv_routing(self) -> bool:
        return self.router_mode in ("kv", "kv-approx")


@dataclass(frozen=True)
class RunConfig:
    """``kvmesh run``: one frontend supervising ``workers`` worker processes."""

    frontend: FrontendConfig
    worker: WorkerConfig
    workers: int = 2
    # disaggregated: this many prefill and decode workers instead of ``workers`` aggregated ones
    prefill_workers: int = 0
    decode_workers: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("--prefill-workers and --decode-workers must be >= 0")
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            raise ValueError("disaggregated serving needs both --prefill-workers and --decode-workers (at least 1 each)")

    @property
    def disaggregated(self) -> bool:
        return self.decode_workers > 0


def _default_file_dir() -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"kvmesh-discovery-{os.getuid()}")


@dataclass(frozen=True)
class RuntimeConfig:
    """How a process joins the distributed runtime (``kvmesh frontend`` / ``worker``)."""

    namespace: str = "kvmesh"
    discovery: str = "file"
    etcd_endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    file_discovery_dir: str = field(default_factory=_default_file_dir)
    nats_url: str = "nats://127.0.0.1:4222"
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    host: str = "127.0.0.1"
    lease_ttl_s: float = 10.0
    # secured etcd / NATS (all optional; see README "Securing a fleet"); the etcd password
    # comes from KVMESH_ETCD_PASSWORD only, never a flag
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    etcd_user: str = ""
    etcd_password: str = field(default="", repr=False)
    nats_creds_file: str = ""
    nats_ca_file: str = ""
    nats_cert_file: str = ""
    nats_key_file: str = ""

    def __post_init__(self) -> None:
        for name, allowed in (
            ("discovery", DISCOVERY_BACKENDS),
            ("request_plane", REQUEST_PLANES),
            ("event_plane", EVENT_PLANES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"--{name.replace('_', '-')} (or {ENV_VARS[name]}) must be one of {', '.join(allowed)}, got {value!r}"
                )
        if not self.namespace or "." in self.namespace or "/" in self.namespace:
            raise ValueError(f"--namespace must be a non-empty name without '.' or '/', got {self.namespace!r}")
        _positive("--lease-ttl (or KVMESH_LEASE_TTL)", self.lease_ttl_s)

    @property
    def needs_nats(self) -> bool:
        return self.request_plane == "nats" or self.event_plane == "nats"


def debug_enabled() -> bool:
    return os.environ.get("KVMESH_DEBUG", "") not in ("", "0", "false")
