"""``kvmesh`` command line: ``run`` (embedded: frontend + worker processes),
``frontend`` and ``worker`` (one role per process, distributed or static).

Arguments are parsed once into the frozen configs of :mod:`kvmesh.config`; a bad value
prints one line and exits 2, a startup failure prints one line and exits 1.
Subcommand modules are imported lazily so a worker never imports the HTTP stack.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvmesh.config import (
    DISCOVERY_BACKENDS,
    ENGINES,
    WORKER_MODES,
    ENV_VARS,
    EVENT_PLANES,
    REQUEST_PLANES,
    ROUTER_MODES,
    FrontendConfig,
    HttpLimits,
    MockerConfig,
    SecurityConfig,
    RunConfig,
    RuntimeConfig,
    WorkerConfig,
    debug_enabled,
)

__all__ = ["main", "build_parser"]


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="Hugging Face model folder (default: the bundled tiny model)")
    p.add_argument(
        "--model", default=None, metavar="NAME",
        help="a named model instead of --model-path: smollm2 (converted once into ~/.cache/kvmesh; see docs/engines.md)",
    )  # fmt: skip
    p.add_argument("--engine", default="mocker", choices=ENGINES, help="engine to run in each worker")
    m = p.add_argument_group("mocker engine")
    d = MockerConfig()
    m.add_argument("--speedup", type=float, default=d.speedup, help="divide modelled step times by this (1e9: as fast as possible)")
    m.add_argument("--block-size", type=int, default=d.block_size, help="KV block size in tokens")
    m.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks per worker")
    m.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="max running sequences per worker")
    m.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget per step")
    m.add_argument("--fault", default="", help="inject a fault: crash | hang | slow:factor=K | corrupt [,after_tokens=N,probability=P]")
    m.add_argument("--eos-probability", type=float, default=d.eos_probability,
                   help="chance of a natural end-of-sequence per generated token (default 0: every request gets max_tokens)")
    p.add_argument("--validate-streams", action="store_true", help="check every engine stream against the contract")
    w = WorkerConfig()
    g = p.add_argument_group("disaggregated prefill/decode")
    g.add_argument("--max-local-prefill-length", type=int, default=w.max_local_prefill_length,
                   help="decode workers prefill remotely only prompts with more uncached tokens than this")
    g.add_argument("--max-prefill-queue-size", type=int, default=w.max_prefill_queue_size,
                   help="... and only while the prefill queue holds fewer jobs than this")
    g.add_argument("--remote-prefill-timeout", type=float, default=w.remote_prefill_timeout_s,
                   help="seconds a decode worker waits for a remote prefill before prefilling locally")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve the worker's disaggregation counters for Prometheus on this port (0: any free port)")
    g.add_argument("--drain-migrate", action="store_true",
                   help="on SIGTERM, hand in-flight requests with their KV to other workers instead of finishing them")


def _add_frontend_args(p: argparse.ArgumentParser) -> None:
    d = FrontendConfig()
    p.add_argument("--http-host", default=d.http_host, help="address to serve HTTP on (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=d.http_port, help="HTTP port (default 8000)")
    p.add_argument("--router-mode", default=d.router_mode, choices=ROUTER_MODES, help="how to pick a worker")
    p.add_argument("--keepalive", type=float, default=d.keepalive_s, help="seconds between SSE keep-alive comments")
    p.add_argument("--response-timeout", type=float, default=d.response_timeout_s, help="seconds to wait for a worker's first response")
    p.add_argument(
        "--migration-limit", type=int, default=d.migration_limit,
        help="times a request may move to another worker after a mid-stream failure (0: never)",
    )  # fmt: skip
    h = p.add_argument_group("health (canary checks, circuit breakers)")
    h.add_argument("--canary-interval", type=float, default=d.canary_interval_s, help="seconds between canary checks per worker (0: off)")
    h.add_argument("--canary-timeout", type=float, default=d.canary_timeout_s, help="seconds a canary may take")
    h.add_argument("--canaries", action="append", default=[], metavar="FILE", help="a canary set (JSON; see `kvmesh canary record`)")
    h.add_argument("--breaker-recovery", type=float, default=d.breaker_recovery_s, help="seconds an open circuit waits before a trial")
    g = p.add_argument_group("graceful degradation (capacity of healthy workers vs demand, priority shedding)")
    g.add_argument("--degradation", action="store_true", help="shed by priority tier when capacity falls short of demand")
    g.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms, help="time-to-first-token SLO (default 500)")
    g.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms, help="time per output token SLO (default 30)")
    g.add_argument("--slo-output-tokens", type=int, default=d.slo_output_tokens, help="average output tokens (default 256)")
    g.add_argument("--slo-max-batch", type=int, default=d.slo_max_batch, help="sequences one worker runs at once (default 256)")
    g.add_argument("--shed-retry-after", type=float, default=d.shed_retry_after_s, help="Retry-After of shed requests (s)")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s, help="seconds to connect to a worker")
    p.add_argument("--worker-wait", type=float, default=d.worker_wait_s, help="seconds a request waits for a worker to appear, then 503")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    kv = p.add_argument_group("KV-aware routing (--router-mode kv | kv-approx)")
    kv.add_argument("--kv-overlap-weight", type=float, default=d.kv_overlap_weight, help="weight of prefill cost vs decode load")
    kv.add_argument("--router-temperature", type=float, default=d.router_temperature, help="0: pick the cheapest; >0: sample")
    kv.add_argument("--kv-block-size", type=int, default=None, help="router block size (default: the workers'; must match them)")
    kv.add_argument(
        "--admission-threshold", type=float, default=None,
        help="queue requests while every worker has more than this × its batch token budget in prefill (default: off)",
    )  # fmt: skip
    kv.add_argument("--admission-max-queue", type=int, default=d.admission_max_queue, help="past this many waiting: 503")
    _add_edge_args(p)


def _add_edge_args(p: argparse.ArgumentParser) -> None:
    """The public edge: HTTP limits, API keys, admin routes (README "Security")."""
    lim = HttpLimits()
    h = p.add_argument_group("HTTP limits (enforced as bytes arrive)")
    h.add_argument("--max-body-bytes", type=int, default=FrontendConfig().max_body_bytes, help="request body limit (413)")
    h.add_argument("--max-url-bytes", type=int, default=lim.max_url_bytes, help="URL limit (414)")
    h.add_argument("--max-header-bytes", type=int, default=lim.max_header_bytes, help="request head limit (431)")
    h.add_argument("--max-headers", type=int, default=lim.max_headers, help="headers per request (431)")
    h.add_argument("--header-timeout", type=float, default=lim.header_timeout_s, help="seconds for a request head to arrive")
    h.add_argument("--body-timeout", type=float, default=lim.body_timeout_s, help="longest pause inside a request body (s)")
    h.add_argument("--keepalive-timeout", type=float, default=lim.keepalive_timeout_s, help="idle keep-alive connections close after this (s)")
    h.add_argument("--send-timeout", type=float, default=lim.send_timeout_s, help="a client that reads nothing for this long is dropped (s)")
    h.add_argument("--max-connections", type=int, default=lim.max_connections, help="open client connections; past it: 503 and close")
    h.add_argument("--max-pipelined", type=int, default=lim.max_pipelined, help="requests queued per connection before reading pauses")
    sec = SecurityConfig()
    a = p.add_argument_group("authentication and admin")
    a.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY", ""), help="require Authorization: Bearer KEY on /v1/* (KVMESH_API_KEY)")
    a.add_argument("--api-keys-file", default=os.environ.get("KVMESH_API_KEYS_FILE", ""),
                   help="a file of 'KEY [TIER]' lines: several keys, each with the highest priority tier it may ask for")
    a.add_argument("--admin", action="store_true", help="serve /admin/* (fault injection, worker list); off by default")
    a.add_argument("--admin-key", default=os.environ.get("KVMESH_ADMIN_KEY", ""), help="the key /admin/* requires when API keys are on (KVMESH_ADMIN_KEY)")
    a.add_argument("--metrics-auth", action="store_true", help="/metrics needs an API key too (default: open)")
    a.add_argument("--trust-priority-header", action="store_true",
                   help="without keys, accept the priority tier a client asks for (default: premium is refused)")
    a.add_argument("--allow-special-tokens", action="store_true",
                   help="parse special tokens typed in user text as control tokens (trusted callers only)")
    a.add_argument("--max-stop", type=int, default=sec.max_stop, help="stop strings per request")
    a.add_argument("--max-stop-chars", type=int, default=sec.max_stop_chars, help="characters per stop string")
    a.add_argument("--max-messages", type=int, default=sec.max_messages, help="chat messages per request")
    a.add_argument("--max-message-chars", type=int, default=sec.max_message_chars, help="characters of all messages together")


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_VARS[name], default)


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    d = RuntimeConfig()
    g = p.add_argument_group("distributed runtime (flags override the KVMESH_* environment)")
    g.add_argument("--namespace", default=_env("namespace", d.namespace), help="KVMESH_NAMESPACE")
    g.add_argument("--discovery", default=_env("discovery", d.discovery), help=f"KVMESH_DISCOVERY: {'|'.join(DISCOVERY_BACKENDS)}")
    g.add_argument(
        "--etcd-endpoints", default=_env("etcd_endpoints", ",".join(d.etcd_endpoints)), help="KVMESH_ETCD_ENDPOINTS (comma-separated)"
    )
    g.add_argument("--file-discovery-dir", default=_env("file_discovery_dir", d.file_discovery_dir), help="KVMESH_FILE_DISCOVERY_DIR")
    g.add_argument("--nats-url", default=_env("nats_url", d.nats_url), help="KVMESH_NATS_URL")
    g.add_argument("--request-plane", default=_env("request_plane", d.request_plane), help=f"KVMESH_REQUEST_PLANE: {'|'.join(REQUEST_PLANES)}")
    g.add_argument("--event-plane", default=_env("event_plane", d.event_plane), help=f"KVMESH_EVENT_PLANE: {'|'.join(EVENT_PLANES)}")
    g.add_argument("--host", default=_env("host", d.host), help="KVMESH_HOST: address to bind and advertise")
    g.add_argument(
        "--lease-ttl", type=float, default=_env("lease_ttl_s", str(d.lease_ttl_s)),  # argparse applies type
        help="KVMESH_LEASE_TTL: seconds a dead process stays in discovery (etcd grants at least its minimum, 2 s by default)",
    )  # fmt: skip
    s = p.add_argument_group("secured etcd / NATS (the etcd password only from KVMESH_ETCD_PASSWORD)")
    s.add_argument("--etcd-ca", default=_env("etcd_ca_file", ""), help="KVMESH_ETCD_CA: CA bundle for https:// endpoints")
    s.add_argument("--etcd-cert", default=_env("etcd_cert_file", ""), help="KVMESH_ETCD_CERT: client certificate")
    s.add_argument("--etcd-key", default=_env("etcd_key_file", ""), help="KVMESH_ETCD_KEY: client key")
    s.add_argument("--etcd-user", default=_env("etcd_user", ""), help="KVMESH_ETCD_USER (password: KVMESH_ETCD_PASSWORD)")
    s.add_argument("--nats-creds", default=_env("nats_creds_file", ""), help="KVMESH_NATS_CREDS: NATS credentials file (JWT + nkey)")
    s.add_argument("--nats-ca", default=_env("nats_ca_file", ""), help="KVMESH_NATS_CA: CA bundle for tls:// servers")
    s.add_argument("--nats-cert", default=_env("nats_cert_file", ""), help="KVMESH_NATS_CERT: client certificate")
    s.add_argument("--nats-key", default=_env("nats_key_file", ""), help="KVMESH_NATS_KEY: client key")


def _runtime_config(ns: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(
        namespace=ns.namespace,
        discovery=ns.discovery,
        etcd_endpoints=tuple(e.strip() for e in ns.etcd_endpoints.split(",") if e.strip()),
        file_discovery_dir=ns.file_discovery_dir,
        nats_url=ns.nats_url,
        request_plane=ns.request_plane,
        event_plane=ns.event_plane,
        host=ns.host,
        lease_ttl_s=ns.lease_ttl,
        etcd_ca_file=ns.etcd_ca,
        etcd_cert_file=ns.etcd_cert,
        etcd_key_file=ns.etcd_key,
        etcd_user=ns.etcd_user,
        etcd_password=os.environ.get("KVMESH_ETCD_PASSWORD", ""),
        nats_creds_file=ns.nats_creds,
        nats_ca_file=ns.nats_ca,
        nats_cert_file=ns.nats_cert,
        nats_key_file=ns.nats_key,
    )


def _add_secret_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-secret-file", default=None, metavar="FILE",
        help="the fleet's shared secret: internal connections are authenticated and discovery records and NATS"
        " messages signed (KVMESH_CLUSTER_SECRET_FILE, or the secret itself in KVMESH_CLUSTER_SECRET;"
        " kvmesh run makes a random one by default)",
    )  # fmt: skip
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="mutual TLS on internal TCP connections: this process's certificate (KVMESH_TLS_CERT)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key (KVMESH_TLS_KEY)")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="the fleet's CA: peers must present a certificate it signed (KVMESH_TLS_CA)")


def _apply_cluster_secret(ns: argparse.Namespace) -> None:
    """The flag goes into the environment (child processes inherit it); the secret is
    read and checked now, so a bad file is one line at start-up (ValueError)."""
    from kvmesh.runtime import auth

    path = getattr(ns, "cluster_secret_file", None)
    if path:
        os.environ[auth.SECRET_FILE_ENV] = os.path.abspath(path)
    auth.process_secret()
    for name, env in auth.TLS_ENV.items():
        value = getattr(ns, f"tls_{name}", None)
        if value:
            os.environ[env] = os.path.abspath(value)
    auth.process_tls()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="Distributed LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve a model: frontend + N worker processes on this host, no external services")
    _add_frontend_args(run)
    _add_engine_args(run)
    run.add_argument("--workers", type=int, default=2, help="number of worker processes (default 2)")
    run.add_argument("--prefill-workers", type=int, default=0, help="disaggregated: prefill worker processes")
    run.add_argument("--decode-workers", type=int, default=0, help="disaggregated: decode worker processes")
    _add_secret_arg(run)

    frontend = sub.add_parser("frontend", help="serve the HTTP API for the workers that discovery (or --static-workers) names")
    _add_frontend_args(frontend)
    _add_runtime_args(frontend)
    frontend.add_argument(
        "--static-workers", default=os.environ.get("KVMESH_STATIC_WORKERS", ""),
        help="comma-separated host:port of static workers: no discovery at all (KVMESH_STATIC_WORKERS)",
    )  # fmt: skip
    frontend.add_argument("--model-path", default=None, help="load this model folder now (optional: models come from workers)")
    _add_secret_arg(frontend)

    from kvmesh.cli.canary import add_canary_args
    from kvmesh.cli.replay import add_replay_args

    canary = sub.add_parser("canary", help="canary sets for health checks")
    add_canary_args(canary)

    replay = sub.add_parser("replay", help="replay a Mooncake-format trace against mocker workers and compare routing policies")
    add_replay_args(replay)

    worker = sub.add_parser("worker", help="run one worker process")
    _add_engine_args(worker)
    _add_runtime_args(worker)
    worker.add_argument("--worker-id", type=int, default=None, help="id in static mode (default: the port); distributed mode uses the lease id")
    worker.add_argument("--port", type=int, default=0, help="request-plane TCP port (0: any free port)")
    worker.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM")
    worker.add_argument("--static", action="store_true", help="no discovery: serve TCP on --host/--port only")
    worker.add_argument("--mode", default="aggregated", choices=WORKER_MODES,
                        help="aggregated (default), prefill (pulls the prefill queue) or decode (prefills long prompts remotely)")
    worker.add_argument("--prefill-queue", default="",
                        help="distributed: JetStream on --nats-url (default); embedded: tcp://host:port of kvmesh run's queue")
    worker.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    _add_secret_arg(worker)
    return parser


def _mocker_config(ns: argparse.Namespace) -> MockerConfig:
    return MockerConfig(
        speedup=ns.speedup,
        block_size=ns.block_size,
        num_blocks=ns.num_blocks,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        fault=ns.fault,
        eos_probability=ns.eos_probability,
    )


def _model_path(ns: argparse.Namespace) -> str | None:
    """``--model NAME`` resolved through the catalog (converting once), else ``--model-path``."""
    if ns.model is None:
        path: str | None = ns.model_path
        return path
    if ns.model_path is not None:
        raise ValueError("pass --model or --model-path, not both")
    from kvmesh.errors import InvalidArgument
    from kvmesh.preprocess.catalog import resolve_model

    try:
        return str(resolve_model(ns.model))
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


def _worker_config(ns: argparse.Namespace, **overrides: Any) -> WorkerConfig:
    fields: dict[str, Any] = dict(
        model_path=_model_path(ns),
        engine=ns.engine,
        mocker=_mocker_config(ns),
        validate_streams=ns.validate_streams or debug_enabled(),
        max_local_prefill_length=ns.max_local_prefill_length,
        max_prefill_queue_size=ns.max_prefill_queue_size,
        remote_prefill_timeout_s=ns.remote_prefill_timeout,
        drain_migrate=ns.drain_migrate,
        metrics_port=ns.metrics_port,
    )
    fields.update(overrides)
    return WorkerConfig(**fields)


def _frontend_config(ns: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        http_host=ns.http_host,
        http_port=ns.http_port,
        router_mode=ns.router_mode,
        keepalive_s=ns.keepalive,
        response_timeout_s=ns.response_timeout,
        connect_timeout_s=ns.connect_timeout,
        migration_limit=ns.migration_limit,
        canary_interval_s=ns.canary_interval,
        canary_timeout_s=ns.canary_timeout,
        canary_files=tuple(ns.canaries),
        breaker_recovery_s=ns.breaker_recovery,
        degradation=ns.degradation,
        slo_ttft_ms=ns.slo_ttft_ms,
        slo_tpot_ms=ns.slo_tpot_ms,
        slo_output_tokens=ns.slo_output_tokens,
        slo_max_batch=ns.slo_max_batch,
        shed_retry_after_s=ns.shed_retry_after,
        worker_wait_s=ns.worker_wait,
        kv_overlap_weight=ns.kv_overlap_weight,
        router_temperature=ns.router_temperature,
        kv_block_size=ns.kv_block_size,
        admission_threshold=ns.admission_threshold,
        admission_max_queue=ns.admission_max_queue,
        max_body_bytes=ns.max_body_bytes,
        http=HttpLimits(
            max_url_bytes=ns.max_url_bytes, max_header_bytes=ns.max_header_bytes, max_headers=ns.max_headers,
            header_timeout_s=ns.header_timeout, body_timeout_s=ns.body_timeout,
            keepalive_timeout_s=ns.keepalive_timeout, send_timeout_s=ns.send_timeout,
            max_connections=ns.max_connections, max_pipelined=ns.max_pipelined,
        ),
        security=_security_config(ns),
    )


def _security_config(ns: argparse.Namespace) -> SecurityConfig:
    keys: list[tuple[str, str]] = [(ns.api_key, "premium")] if ns.api_key else []
    if ns.api_keys_file:
        from kvmesh.frontend.auth import read_keys_file

        keys += read_keys_file(ns.api_keys_file)
    return SecurityConfig(
        api_keys=tuple(keys), admin=ns.admin, admin_key=ns.admin_key, metrics_open=not ns.metrics_auth,
        trust_priority_header=ns.trust_priority_header, allow_special_tokens=ns.allow_special_tokens,
        max_stop=ns.max_stop, max_stop_chars=ns.max_stop_chars, max_messages=ns.max_messages,
        max_message_chars=ns.max_message_chars,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        _apply_cluster_secret(ns)
        if ns.command == "run":
            cfg = RunConfig(
                frontend=_frontend_config(ns),
                worker=_worker_config(ns),
                workers=ns.workers,
                prefill_workers=ns.prefill_workers,
                decode_workers=ns.decode_workers,
            )
            from kvmesh.cli.run import run_embedded

            return run_embedded(cfg, ns.log_level)
        if ns.command == "frontend":
            from kvmesh.cli.frontend import run_frontend

            static = [a.strip() for a in ns.static_workers.split(",") if a.strip()]
            return run_frontend(_frontend_config(ns), _runtime_config(ns), static, ns.model_path, ns.log_level)
        if ns.command == "canary":
            from kvmesh.cli.canary import run_canary

            return run_canary(ns)
        if ns.command == "replay":
            from kvmesh.cli.replay import run_replay

            return run_replay(ns)
        if ns.command == "worker":
            rcfg = _runtime_config(ns)
            worker_id = ns.worker_id if ns.worker_id is not None else ns.port
            wcfg = _worker_config(
                ns, worker_id=worker_id, host=rcfg.host, port=ns.port, grace_s=ns.grace,
                mode=ns.mode, prefill_queue=ns.prefill_queue,
            )  # fmt: skip
            from kvmesh.cli.worker import run_worker

            return run_worker(wcfg, None if ns.static else rcfg, die_with_parent=ns.die_with_parent)
    except ValueError as exc:
        print(f"kvmesh {ns.command}: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
