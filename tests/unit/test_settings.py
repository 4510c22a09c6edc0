"""One declaration per setting (kvmesh.settings): flags, KVMESH_* variables, a
--config file and the config objects all come from it, with one precedence."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from kvmesh.cli.main import _frontend_config, _runtime_config, _worker_config, build_parser, main
from kvmesh.config import FrontendConfig, RuntimeConfig, WorkerConfig
from kvmesh.engines import registry
from kvmesh.engines.settings import HfSettings, MockerSettings, VllmSettings
from kvmesh.settings import resolve

# flags the README, docs and tests use: each must still parse (run, frontend or worker)
RUN_FLAGS = [
    "--http-host", "127.0.0.1", "--http-port", "0", "--router-mode", "kv", "--keepalive", "2", "--response-timeout", "9",
    "--migration-limit", "1", "--canary-interval", "0", "--canary-timeout", "3", "--breaker-recovery", "5",
    "--degradation", "--slo-ttft-ms", "400", "--slo-tpot-ms", "20", "--slo-output-tokens", "100", "--slo-max-batch", "8",
    "--shed-retry-after", "7", "--connect-timeout", "2", "--worker-wait", "1", "--log-level", "info",
    "--kv-overlap-weight", "0.5", "--router-temperature", "0.1", "--kv-block-size", "16", "--admission-threshold", "2",
    "--admission-max-queue", "10", "--max-body-bytes", "1000", "--max-url-bytes", "100", "--max-header-bytes", "1000",
    "--max-headers", "10", "--header-timeout", "1", "--body-timeout", "2", "--keepalive-timeout", "3",
    "--send-timeout", "4", "--max-connections", "5", "--max-pipelined", "6", "--admin", "--metrics-auth",
    "--trust-priority-header", "--allow-special-tokens", "--max-stop", "3", "--max-stop-chars", "30",
    "--max-messages", "4", "--max-message-chars", "400", "--engine", "mocker", "--speedup", "1e9", "--block-size", "32",
    "--num-blocks", "100", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--fault", "slow:factor=2",
    "--eos-probability", "0.1", "--validate-streams", "--max-local-prefill-length", "5", "--max-prefill-queue-size", "1",
    "--remote-prefill-timeout", "3", "--metrics-port", "0", "--drain-migrate", "--workers", "3",
]  # fmt: skip


def test_every_existing_run_flag_lands_in_its_config_object():
    ns = build_parser().parse_args(["run", *RUN_FLAGS])
    f = _frontend_config(ns, {})
    w = _worker_config(ns, {})
    assert (f.router_mode, f.keepalive_s, f.http.max_pipelined, f.security.max_stop, f.security.metrics_open) == (
        "kv", 2.0, 6, 3, False
    )
    assert (f.kv_block_size, f.admission_threshold, f.degradation, f.max_body_bytes) == (16, 2.0, True, 1000)
    assert (w.block_size, w.validate_streams, w.metrics_port, w.drain_migrate) == (32, True, 0, True)
    assert w.engine_options == MockerSettings(
        speedup=1e9, num_blocks=100, max_num_seqs=8, max_num_batched_tokens=64, fault="slow:factor=2", eos_probability=0.1
    )


def test_precedence_is_flag_then_environment_then_file_then_default():
    ns = build_parser().parse_args(["frontend", "--namespace", "fromflag"])
    env = {"KVMESH_NAMESPACE": "fromenv", "KVMESH_LEASE_TTL": "3", "KVMESH_NATS_URL": "nats://env:1"}
    file = {"namespace": "fromfile", "lease-ttl": 4, "nats-url": "nats://file:1", "event-plane": "nats"}
    cfg = resolve(RuntimeConfig, ns, file=file, env=env)
    assert (cfg.namespace, cfg.lease_ttl_s, cfg.nats_url) == ("fromflag", 3.0, "nats://env:1")
    assert (cfg.event_plane, cfg.request_plane) == ("nats", "tcp")  # file, then default


def test_engine_variables_are_read_once_by_the_cli_not_in_the_engine(monkeypatch):
    monkeypatch.setenv("KVMESH_HF_THREADS", "2")
    monkeypatch.setenv("KVMESH_VLLM_KV_CACHE_GB", "3")
    monkeypatch.setenv("KVMESH_VLLM_ENGINE_ARGS", '{"swap_space": 0}')
    hf = _worker_config(build_parser().parse_args(["run", "--engine", "hf", "--hf-kv-cache-mb", "64"]), {})
    assert hf.engine_options == HfSettings(threads=2, kv_cache_mb=64)
    vllm = _worker_config(build_parser().parse_args(["run", "--engine", "vllm"]), {})
    assert isinstance(vllm.engine_options, VllmSettings)
    assert (vllm.engine_options.kv_cache_gb, vllm.engine_options.engine_args) == (3, {"swap_space": 0})
    assert pickle.loads(pickle.dumps(vllm)) == vllm  # what a replacement worker reads from stdin


def test_bad_values_name_the_flag_and_variable_on_one_line(monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_LEASE_TTL", "soon")
    assert main(["worker", "--static"]) == 2
    assert capsys.readouterr().err.strip() == "kvmesh worker: KVMESH_LEASE_TTL='soon' is not a number"
    monkeypatch.delenv("KVMESH_LEASE_TTL")
    assert main(["run", "--engine", "tpu"]) == 2
    assert capsys.readouterr().err.strip() == "kvmesh run: --engine must be one of mocker, vllm, hf, got 'tpu'"
    with pytest.raises(ValueError, match=r"--http-port must be in 0..65535, got 70000"):
        FrontendConfig(http_port=70000)
    with pytest.raises(ValueError, match=r"--fault \(or KVMESH_MOCKER_FAULT\) is not a fault spec"):
        MockerSettings(fault="melt")


def test_config_file(tmp_path, capsys):
    path = tmp_path / "kvmesh.toml"
    path.write_text('router-mode = "kv"\n[worker]\nspeedup = 1e9\nblock_size = 32\n[edge]\nmax-headers = 7\n')
    ns = build_parser().parse_args(["run", "--config", str(path), "--block-size", "64"])
    from kvmesh.cli.main import RUN_CLASSES, _file

    file = _file(ns, *RUN_CLASSES)
    f, w = _frontend_config(ns, file), _worker_config(ns, file)
    assert (f.router_mode, f.http.max_headers, w.block_size) == ("kv", 7, 64)
    assert isinstance(w.engine_options, MockerSettings) and w.engine_options.speedup == 1e9
    path.write_text("http-prot = 1\n")
    assert main(["run", "--config", str(path)]) == 2
    assert "no such setting for kvmesh run: http-prot" in capsys.readouterr().err
    path.write_text("workers = 2.5\n")
    assert main(["run", "--config", str(path)]) == 2
    assert capsys.readouterr().err.strip() == "kvmesh run: config file: workers = 2.5 must be an integer"


def test_the_registry_builds_the_engine_and_carries_fault_injection():
    assert registry.names() == ("mocker", "vllm", "hf")
    assert registry.entry("mocker").inject_fault is not None and registry.entry("hf").inject_fault is None


def test_config_and_worker_import_no_engine():
    code = (
        "import sys, kvmesh.config, kvmesh.worker.main, kvmesh.worker.supervisor, kvmesh.worker.service;"
        "print(sorted(m for m in sys.modules if m.startswith('kvmesh.engines.') and m.split('.')[2] in"
        " ('mocker', 'hf', 'vllm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_stays_readable():
    for command in ("run", "frontend", "worker"):
        r = subprocess.run([sys.executable, "-m", "kvmesh.cli.main", command, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "KVMESH_" in r.stdout
        assert "--config FILE.toml" in r.stdout and "(default 8000)" in r.stdout or command == "worker"


def _engine_options(engine: str) -> tuple[type, dict[str, object]]:
    """An engine's options class and the options it has no default for."""
    if engine == "mocker":
        from kvmesh.engines.mocker.options import MockerOptions

        return MockerOptions, {}
    if engine == "hf":
        from kvmesh.engines.hf.options import HfOptions

        return HfOptions, {"model_path": "m"}
    from kvmesh.engines.vllm.options import VllmOptions

    return VllmOptions, {"model": "m"}


@pytest.mark.parametrize("engine", ["mocker", "hf", "vllm"])
def test_an_engine_built_in_code_starts_from_the_cli_defaults(engine):
    """Options built in library code with no arguments equal those a worker builds from
    the CLI given no flag, variable or file: a default that drifts on either side fails."""
    import dataclasses

    from kvmesh.engines.mocker.options import MockerOptions
    from kvmesh.engines.settings import options_from

    ns = build_parser().parse_args(["run", "--engine", engine])
    worker = _worker_config(ns, {})
    settings = worker.engine_options
    options, required = _engine_options(engine)
    if options is MockerOptions:
        from_cli = MockerOptions.from_settings(settings, block_size=worker.block_size)
    elif engine == "hf":
        from_cli = options_from(options, settings, block_size=worker.block_size, **required)
    else:
        from_cli = options_from(options, settings, **required)
    assert options(**required) == from_cli
    names = {f.name for f in dataclasses.fields(options)}
    renamed = {"eos_probability": "eos_rate"}
    unused = [f.name for f in dataclasses.fields(settings) if renamed.get(f.name, f.name) not in names]
    assert unused == [], f"declared settings that reach no {options.__name__} field"


def test_log_level_static_workers_and_model_are_declared_settings():
    from kvmesh.config import FrontendCommandConfig, LogConfig

    parse = build_parser().parse_args
    ns = parse(["frontend", "--log-level", "info", "--static-workers", "127.0.0.1:1, 127.0.0.1:2", "--model-path", "/m"])
    cmd = resolve(FrontendCommandConfig, ns, env={})
    assert (cmd.static_workers, cmd.model_path) == (("127.0.0.1:1", "127.0.0.1:2"), "/m")
    assert resolve(LogConfig, ns, env={}).log_level == "info"
    env = {"KVMESH_LOG_LEVEL": "debug", "KVMESH_STATIC_WORKERS": "h:1"}
    cmd = resolve(FrontendCommandConfig, parse(["frontend"]), env=env)
    assert (cmd.static_workers, cmd.model_path, resolve(LogConfig, parse(["frontend"]), env=env).log_level) == (
        ("h:1",), None, "debug"
    )
    file = {"log-level": "error", "static-workers": "h:2,h:3"}
    assert resolve(FrontendCommandConfig, parse(["frontend"]), file=file, env={}).static_workers == ("h:2", "h:3")
    assert resolve(LogConfig, parse(["frontend"]), file=file, env={}).log_level == "error"
    for command in ("run", "planner"):
        assert resolve(LogConfig, parse([command, "--log-level", "error"]), env={}).log_level == "error"
    with pytest.raises(ValueError, match=r"--log-level \(or KVMESH_LOG_LEVEL\) must be one of"):
        resolve(LogConfig, parse(["frontend"]), env={"KVMESH_LOG_LEVEL": "loud"})
    assert resolve(WorkerConfig, parse(["worker", "--model", "smollm2"]), env={}).model == "smollm2"
    assert resolve(WorkerConfig, parse(["run"]), env={"KVMESH_MODEL": "smollm2"}).model == "smollm2"
    with pytest.raises(ValueError, match="not both"):
        _worker_config(parse(["worker", "--model", "smollm2", "--model-path", "/m"]), {})


def test_the_hf_engines_device_flags_land_in_its_settings_and_bad_ones_are_refused(capsys):
    ns = build_parser().parse_args(
        ["worker", "--static", "--engine", "hf", "--device", "cuda:1", "--dtype", "bfloat16", "--gpu-memory-fraction",
         "0.45", "--random-weights", "llama-8b", "--enforce-eager"]
    )  # fmt: skip
    assert _worker_config(ns, {}).engine_options == HfSettings(
        device="cuda:1", dtype="bfloat16", gpu_memory_fraction=0.45, random_weights="llama-8b", enforce_eager=True
    )
    for flag, value, said in [
        ("--device", "tpu", "must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        ("--device", "cuda:x", "must be auto, cpu, cuda or cuda:N"),
        ("--dtype", "float8", "must be one of auto, bfloat16, float16, float32, got 'float8'"),
        ("--gpu-memory-fraction", "1.5", "must be within [0.01, 1]"),
        ("--random-weights", "llama-70b", "must be one of llama-1b, llama-8b"),
    ]:
        assert main(["run", "--engine", "hf", flag, value]) == 2
        assert said in capsys.readouterr().err
