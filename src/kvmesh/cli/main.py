"""``kvmesh`` command line: ``run`` (embedded: frontend + worker processes),
``frontend`` and ``worker`` (one role per process, distributed or static).

Arguments are parsed once into the frozen configs of :mod:`kvmesh.config`; a bad value
prints one line and exits 2, a startup failure prints one line and exits 1.
Subcommand modules are imported lazily so a worker never imports the HTTP stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from collections.abc import Callable

from kvmesh.config import (
    ClusterCredentials,
    FrontendCommandConfig,
    FrontendConfig,
    HttpLimits,
    LogConfig,
    ModelFleet,
    PlannerConfig,
    RunConfig,
    RuntimeConfig,
    SecurityConfig,
    WorkerConfig,
    debug_enabled,
)
from kvmesh.engines import registry
from kvmesh.settings import add_flags, file_keys, load_file, resolve

__all__ = ["main", "build_parser"]

# Every flag below comes from a declaration (kvmesh.settings.setting) in kvmesh.config or
# kvmesh.engines.settings, except the few that are no setting of a config object
# (--static, --config).
_ENGINE_FIELDS = ("model", "model_path", "served_model_name", "engine", "block_size", "validate_streams", "lora", "max_loras")
_DISAGG_FIELDS = ("max_local_prefill_length", "max_prefill_queue_size", "max_prefill_queue_tokens",
                  "remote_prefill_timeout_s", "drain_migrate", "peer_fetch", "metrics_port", "metrics_host")  # fmt: skip
_WORKER_ONLY = ("worker_id", "port", "grace_s", "mode", "prefill_queue", "standby", "replicas")
# the config classes whose settings each command takes (its flags and its --config keys)
_ENGINE_SETTINGS = tuple(e.settings for e in registry.ENTRIES.values())
RUN_CLASSES = (
    RunConfig, PlannerConfig, FrontendConfig, LogConfig, HttpLimits, SecurityConfig, WorkerConfig, ClusterCredentials,
    *_ENGINE_SETTINGS,
)  # fmt: skip
FRONTEND_CLASSES = (
    FrontendConfig, FrontendCommandConfig, LogConfig, HttpLimits, SecurityConfig, RuntimeConfig, ClusterCredentials
)
PLANNER_CLASSES = (PlannerConfig, LogConfig, RuntimeConfig, ClusterCredentials)
WORKER_CLASSES = (WorkerConfig, RuntimeConfig, ClusterCredentials, *_ENGINE_SETTINGS)
# accepted in any command's file (one file may serve several commands): --static, and keys
# of commands that have them
_EXTRA_FILE_KEYS = {"model", "model-path", "log-level", "log_level", "static-workers", "static_workers", "static"}


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, WorkerConfig, only=_ENGINE_FIELDS, choices={"engine": registry.names()})
    for one in registry.ENTRIES.values():
        add_flags(p, one.settings)
    add_flags(p, WorkerConfig, only=_DISAGG_FIELDS)


def _add_frontend_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, FrontendConfig)
    add_flags(p, LogConfig)
    add_flags(p, HttpLimits)
    add_flags(p, SecurityConfig)


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, metavar="FILE.toml",
        help="read settings from a TOML file (keys: the flag names, e.g. http-port = 8080; precedence:"
        " flag > KVMESH_* variable > this file > default)",
    )  # fmt: skip


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, RuntimeConfig)


def _file(ns: argparse.Namespace, *classes: type) -> dict[str, object]:
    """The ``--config`` file of this command (empty without one); a key that names no
    setting of the command is an error, not silently ignored."""
    path = getattr(ns, "config", None)
    if not path:
        return {}
    data = load_file(path)
    known = set(_EXTRA_FILE_KEYS) | ({"models"} if ns.command == "run" else set())
    for cls in classes:
        known |= file_keys(cls)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--config {path}: no such setting for kvmesh {ns.command}: {', '.join(unknown)}")
    return data


def _runtime_config(ns: argparse.Namespace, file: dict[str, object]) -> RuntimeConfig:
    return resolve(RuntimeConfig, ns, file=file)


def _add_secret_arg(p: argparse.ArgumentParser, distributed: bool = True) -> None:
    add_flags(p, ClusterCredentials, exclude=() if distributed else ("insecure",))  # run makes its own secret


def _apply_cluster_secret(ns: argparse.Namespace, file: dict[str, object]) -> None:
    """Given credentials go into the environment (child processes inherit it); the
    secret is read and checked now, so a bad file is one line at start-up (ValueError)."""
    from kvmesh.runtime import auth

    creds = resolve(ClusterCredentials, ns, file=file)
    if creds.cluster_secret_file:
        os.environ[auth.SECRET_FILE_ENV] = os.path.abspath(creds.cluster_secret_file)
    auth.process_secret()
    for name, env in auth.TLS_ENV.items():
        value = getattr(creds, f"tls_{name}")
        if value:
            os.environ[env] = os.path.abspath(value)
    auth.process_tls()
    if ns.command in ("frontend", "worker", "planner"):
        _guard_listeners(ns, file, creds.insecure)


def _guard_listeners(ns: argparse.Namespace, file: dict[str, object], insecure: bool) -> None:
    """A distributed command's internal listeners off loopback need the cluster secret or
    TLS (ValueError: one line), or ``--insecure``: then a warning now and every minute."""
    from kvmesh.runtime import auth

    hosts = {"--host": _runtime_config(ns, file).host}
    if ns.command == "worker":
        hosts["--metrics-host"] = resolve(WorkerConfig, ns, file=file).metrics_host
    elif ns.command == "planner" and (planner := resolve(PlannerConfig, ns, file=file)).planner_metrics_port is not None:
        hosts["--planner-metrics-host"] = planner.planner_metrics_host
    exposed = auth.check_exposure(hosts, insecure)
    if exposed:
        auth.warn_insecure(", ".join(exposed))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvmesh`` parser, every subcommand with its flags; with ``command`` (one of
    them), only that one: ``kvmesh run`` does not build the ~350 flags (and import the
    modules), nor the parsers, of commands it does not run, before it forks its workers
    (issue 36). Its help and errors are the same (``kvmesh run: error: ...``)."""
    parser = argparse.ArgumentParser(prog="kvmesh", description="Distributed LLM inference runtime")
    every = command is None or command not in _COMMANDS
    listed = {} if every else {"metavar": "{" + ",".join(_COMMANDS) + "}"}  # the usage line names them all
    sub = parser.add_subparsers(dest="command", required=True, **listed)
    for name, (help_text, add) in _COMMANDS.items():
        if every or command == name:
            add(sub.add_parser(name, help=help_text))
    return parser


def _run_flags(p: argparse.ArgumentParser) -> None:
    _add_config_arg(p)
    add_flags(p, RunConfig, title="worker processes")
    add_flags(p, PlannerConfig, title="planner", exclude=("planner_metrics_port", "planner_metrics_host", "worker_flags"))
    _add_frontend_args(p)
    _add_engine_args(p)
    _add_secret_arg(p, distributed=False)


def _frontend_flags(p: argparse.ArgumentParser) -> None:
    _add_config_arg(p)
    _add_frontend_args(p)
    _add_runtime_args(p)
    add_flags(p, FrontendCommandConfig)
    _add_secret_arg(p)


def _canary_flags(p: argparse.ArgumentParser) -> None:
    from kvmesh.cli.canary import add_canary_args

    add_canary_args(p)


def _replay_flags(p: argparse.ArgumentParser) -> None:
    from kvmesh.cli.replay import add_replay_args

    add_replay_args(p)


def _simulate_flags(p: argparse.ArgumentParser) -> None:
    from kvmesh.cli.simulate import add_simulate_args

    add_simulate_args(p)


def _planner_flags(p: argparse.ArgumentParser) -> None:
    _add_config_arg(p)
    add_flags(p, PlannerConfig, title="planner", exclude=("planner",))
    add_flags(p, LogConfig)
    _add_runtime_args(p)
    _add_secret_arg(p)


def _worker_flags(p: argparse.ArgumentParser) -> None:
    _add_config_arg(p)
    add_flags(p, WorkerConfig, only=_WORKER_ONLY, title="this worker")
    _add_engine_args(p)
    _add_runtime_args(p)
    p.add_argument("--static", action="store_true", help="no discovery: serve TCP on --host/--port only")
    p.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    _add_secret_arg(p)


def _metrics_token_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, ClusterCredentials, only=("cluster_secret_file",))


# each subcommand: its help line and what adds its flags
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "run": ("serve a model: frontend + N worker processes on this host, no external services", _run_flags),
    "frontend": ("serve the HTTP API for the workers that discovery (or --static-workers) names", _frontend_flags),
    "canary": ("canary sets for health checks", _canary_flags),
    "replay": ("replay a Mooncake-format trace against mocker workers and compare routing policies", _replay_flags),
    "simulate": ("a day of a large fleet on the virtual clock: faults at the seed's rates, the live policies", _simulate_flags),
    "planner": ("the planner for a distributed fleet: signed orders to --standby workers, local worker processes (--worker-flags)", _planner_flags),
    "worker": ("run one worker process", _worker_flags),
    "metrics-token": ("print the bearer token workers' and the planner's /metrics ask for", _metrics_token_flags),
}


def _named_model(cfg: WorkerConfig) -> WorkerConfig:
    """``--model NAME`` resolved through the catalog (converting once) into ``model_path``."""
    if cfg.model is None:
        return cfg
    if cfg.model_path is not None:
        raise ValueError("pass --model or --model-path, not both")
    from kvmesh.errors import InvalidArgument
    from kvmesh.preprocess.catalog import resolve_model

    try:
        return dataclasses.replace(cfg, model_path=str(resolve_model(cfg.model)))
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


def _worker_config(ns: argparse.Namespace, file: dict[str, object] | None = None, **given: object) -> WorkerConfig:
    """The worker's config with its engine's settings (the registry says which class)."""
    file = file or {}
    if debug_enabled():
        given["validate_streams"] = True
    cfg = _named_model(resolve(WorkerConfig, ns, file=file, given=given))
    options = resolve(registry.entry(cfg.engine).settings, ns, file=file)
    return dataclasses.replace(cfg, engine_options=options)


def _model_fleets(ns: argparse.Namespace, file: dict[str, object], workers: int) -> tuple[ModelFleet, ...]:
    """``kvmesh run``'s ``[[models]]``: each table's keys over the file's top level."""
    from kvmesh.cli.models import model_fleets

    known = file_keys(WorkerConfig).union(*(file_keys(cls) for cls in _ENGINE_SETTINGS))
    top = {k: v for k, v in file.items() if k != "models"}
    return model_fleets(file["models"], known, workers, lambda keys: _worker_config(ns, {**top, **keys}))


def _frontend_config(ns: argparse.Namespace, file: dict[str, object]) -> FrontendConfig:
    return resolve(
        FrontendConfig, ns, file=file,
        given={"http": resolve(HttpLimits, ns, file=file), "security": _security_config(ns, file)},
    )  # fmt: skip


def _security_config(ns: argparse.Namespace, file: dict[str, object]) -> SecurityConfig:
    """``api_keys`` from ``--api-key`` (tier premium) and ``--api-keys-file``."""
    plain = resolve(SecurityConfig, ns, file=file)
    keys: list[tuple[str, str]] = [(plain.api_key, "premium")] if plain.api_key else []
    options: list[tuple[str, str]] = []
    if plain.api_keys_file:
        from kvmesh.frontend.auth import read_keys

        for key, tier, written in read_keys(plain.api_keys_file):
            keys.append((key, tier))
            if written:
                options.append((key, written))  # tenant and limits (kvmesh.frontend.tenants)
    return dataclasses.replace(plain, api_keys=tuple(keys), api_key_options=tuple(options))


# flags that carry a secret (field: flag, where it belongs instead); --nats-url only with user:password@
_ARGV_SECRETS = {
    "api_key": ("--api-key", "the KVMESH_API_KEY variable or --api-keys-file FILE"),
    "admin_key": ("--admin-key", "the KVMESH_ADMIN_KEY variable"),
    "nats_url": ("--nats-url", "--nats-creds FILE or the KVMESH_NATS_URL variable"),
}


def warn_secrets_on_argv(ns: argparse.Namespace) -> None:
    """One line per secret given as a flag (flags are None unless given): every user of
    the host can read a process's arguments (``ps``, /proc/PID/cmdline) and the shell
    keeps them in its history."""
    for field, (flag, instead) in _ARGV_SECRETS.items():
        value = getattr(ns, field, None)
        if value is None or (field == "nats_url" and "@" not in str(value)):
            continue
        print(f"kvmesh {ns.command}: warning: {flag} puts a secret on the command line, where other users of this "
              f"host see it (ps) and your shell history keeps it; use {instead} instead", file=sys.stderr)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["run"]:
        return _main(args)
    _collect_later()
    try:
        return _main(args)
    finally:
        gc.enable()


_AT_FORK: list[bool] = []


def _collect_later() -> None:
    """``kvmesh run`` starts with the cyclic garbage collector off: its start (the
    parser, the imports of the embedded assembly and of the HTTP stack, the frontend's
    build) makes tens of thousands of objects that live as long as the process, and
    collecting while they are made is ~5% of the frontend's CPU to its first completion
    (issue 36). As the ``gc.freeze`` documentation has it for a process that forks: the
    objects made so far are frozen right before a fork of the start (none of them is
    scanned again, in the parent or in a child, whose pages stay shared), and the
    collector is on again in every forked child at once (the workers, the template
    check), in the frontend once it is built, the objects of its build frozen too
    (:mod:`kvmesh.assembly.embedded`: no collection of them on the way to the first
    completion), and whatever happens when ``main`` returns."""
    gc.disable()
    if not _AT_FORK:
        os.register_at_fork(before=_freeze_while_starting, after_in_child=gc.enable)
        _AT_FORK.append(True)


def _freeze_while_starting() -> None:
    if not gc.isenabled():  # a fork of the start (later ones freeze nothing)
        gc.freeze()


def _main(args: list[str]) -> int:
    parser = build_parser(args[0] if args and not args[0].startswith("-") else None)
    ns = parser.parse_args(args)
    warn_secrets_on_argv(ns)
    try:
        if ns.command == "run":
            file = _file(ns, *RUN_CLASSES)
            _apply_cluster_secret(ns, file)
            parts = {"frontend": _frontend_config(ns, file), "worker": _worker_config(ns, file),
                     "planner": resolve(PlannerConfig, ns, file=file)}  # fmt: skip
            cfg = resolve(RunConfig, ns, file=file, given=parts)
            if "models" in file:  # several models: [[models]] tables (kvmesh.cli.models)
                cfg = dataclasses.replace(cfg, models=_model_fleets(ns, file, cfg.workers))
            from kvmesh.cli.run import run_embedded

            return run_embedded(cfg, _log_level(ns, file))
        if ns.command == "frontend":
            file = _file(ns, *FRONTEND_CLASSES)
            _apply_cluster_secret(ns, file)
            from kvmesh.cli.frontend import run_frontend

            command = resolve(FrontendCommandConfig, ns, file=file)
            return run_frontend(
                _frontend_config(ns, file), _runtime_config(ns, file), list(command.static_workers),
                command.model_path, _log_level(ns, file),
            )  # fmt: skip
        if ns.command == "planner":
            file = _file(ns, *PLANNER_CLASSES)
            _apply_cluster_secret(ns, file)
            from kvmesh.cli.planner import run_planner

            return run_planner(resolve(PlannerConfig, ns, file=file), _runtime_config(ns, file), _log_level(ns, file))
        if ns.command == "metrics-token":
            return _print_metrics_token(ns)
        if ns.command == "canary":
            from kvmesh.cli.canary import run_canary

            return run_canary(ns)
        if ns.command == "replay":
            from kvmesh.cli.replay import run_replay

            return run_replay(ns)
        if ns.command == "simulate":
            from kvmesh.cli.simulate import run_simulate

            return run_simulate(ns)
        if ns.command == "worker":
            file = _file(ns, *WORKER_CLASSES)
            _apply_cluster_secret(ns, file)
            rcfg = _runtime_config(ns, file)
            wcfg = _worker_config(ns, file, host=rcfg.host)
            if ns.worker_id is None and not {"worker-id", "worker_id"} & set(file):
                wcfg = dataclasses.replace(wcfg, worker_id=wcfg.port)  # static mode: the port names the worker
            from kvmesh.worker.child import run_worker

            static_mode = bool(ns.static) or file.get("static") is True
            return run_worker(wcfg, None if static_mode else rcfg, die_with_parent=ns.die_with_parent)
    except ValueError as exc:
        print(f"kvmesh {ns.command}: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {ns.command}")
    return 2


def _print_metrics_token(ns: argparse.Namespace) -> int:
    """``kvmesh metrics-token``: the token a scraper sends (``Authorization: Bearer``)."""
    from kvmesh.observability.metrics_server import metrics_token
    from kvmesh.runtime import auth

    _apply_cluster_secret(ns, {})
    secret = auth.process_secret()
    if secret is None:
        raise ValueError("no cluster secret: give --cluster-secret-file FILE (or KVMESH_CLUSTER_SECRET[_FILE]);"
                         " without one, /metrics asks for no token")  # fmt: skip
    print(metrics_token(secret))
    return 0


def _log_level(ns: argparse.Namespace, file: dict[str, object]) -> str:
    return resolve(LogConfig, ns, file=file).log_level


if __name__ == "__main__":
    sys.exit(main())
