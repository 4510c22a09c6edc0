"""What the frontend imports to start (issue 36, launch -> first completion): the
canaries' and the shedder's modules (and the health state machine under them), and the
tenants' limiter, only where they are switched on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(150)

_DEFERRED = ("kvmesh.health.monitor", "kvmesh.health.canary", "kvmesh.health.shedding", "kvmesh.health.degradation",
             "kvmesh.health.state", "kvmesh.health.breaker")  # fmt: skip

_TENANTS = ("kvmesh.frontend.tenants", "kvmesh.frontend.tenant_state", "kvmesh.frontend.tenant_budget")

_BUILD = """
import sys
from kvmesh.assembly.frontend import FrontendProcess
from kvmesh.config import FrontendConfig, SecurityConfig
from kvmesh.preprocess.model import bundled_model_path
security = SecurityConfig(api_keys={keys!r}, api_key_options={options!r})
process = FrontendProcess._build(FrontendConfig(canary_interval_s={canary}, degradation={degrade}, security=security),
                                 None, str(bundled_model_path()), True)
assert process.frontend.registry.models and (process.frontend.tenants is not None) == bool({options!r})
print(" ".join(n for n in {names!r} if n in sys.modules))
"""


def _loaded(canary: float, degrade: bool, names: tuple[str, ...] = _DEFERRED, tenant: bool = False) -> list[str]:
    keys, options = ((("k1", "premium"),), (("k1", "tenant=a rpm=5"),)) if tenant else ((), ())
    code = _BUILD.format(canary=canary, degrade=degrade, names=names, keys=keys, options=options)
    # -S with this sys.path: the packages, without what a site-packages .pth imports at start
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_frontend_without_canaries_or_shedding_imports_neither() -> None:
    assert _loaded(0, False) == []


def test_frontend_with_canaries_and_shedding_imports_them() -> None:
    assert set(_loaded(30.0, True)) == set(_DEFERRED)


def test_frontend_start_imports_no_archive_or_pickle_modules() -> None:
    # shutil (zlib, bz2, lzma) serves only a fetched model's cache; pickle only a replacement worker
    assert _loaded(0, False, ("shutil", "pickle", "bz2", "lzma")) == []


def test_tenants_modules_only_with_a_tenant_key() -> None:
    assert _loaded(0, False, _TENANTS) == []
    assert _loaded(0, False, _TENANTS, tenant=True) == list(_TENANTS)


def test_health_package_names_still_import() -> None:
    from kvmesh.health import CapacityConfig, HealthTracker, monitor

    assert CapacityConfig.__module__ == "kvmesh.health.degradation" and HealthTracker.__name__ == "HealthTracker"
    assert monitor.HealthMonitor.__module__ == "kvmesh.health.monitor"
    with pytest.raises(ImportError):
        from kvmesh.health import no_such_name  # noqa: F401


def test_run_starts_without_the_cyclic_collector_and_turns_it_back_on() -> None:
    import gc

    from kvmesh.cli import main as cli

    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert cli.main(["run", "--workers", "0"]) == 2  # a bad value: refused (one line), the collector on again
    assert gc.isenabled()
    cli._collect_later()
    try:
        assert not gc.isenabled()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # a forked worker: the collector on at once
            os.write(write_fd, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.close(write_fd)
        assert os.read(read_fd, 1) == b"1"
        os.close(read_fd)
        os.waitpid(pid, 0)
        assert not gc.isenabled()  # this process: off until the frontend is built
        assert gc.get_freeze_count() > 0  # what the start made: frozen before the fork
    finally:
        gc.unfreeze()
        gc.enable()


_WORKER = """
import asyncio, dataclasses, io, sys
from kvmesh.config import WorkerConfig
from kvmesh.worker.child import event_loop_runner
from kvmesh.worker.main import serve_one
cfg = dataclasses.replace(WorkerConfig(), **{changes!r})
out = io.StringIO()

async def main():
    stop = asyncio.Event()
    await serve_one(cfg, None, stop, out, on_ready=stop.set)  # a static worker: up, READY, drained

event_loop_runner()(main())  # uvloop, as a worker runs
assert out.getvalue().startswith("KVMESH_READY "), out.getvalue()
print(" ".join(n for n in {names!r} if n in sys.modules))
"""

_DISAGG = ("kvmesh.disagg.engine", "kvmesh.disagg.transfer", "kvmesh.disagg.queue", "kvmesh.disagg.prefill")
_ZMQ = ("zmq", "kvmesh.runtime.event_plane.zmq")


def _worker_loaded(names: tuple[str, ...] = _DISAGG + _ZMQ, **changes: object) -> list[str]:
    code = _WORKER.format(changes=changes, names=names)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_an_aggregated_mocker_worker_of_a_run_without_subscribers_imports_neither_disagg_nor_zmq() -> None:
    assert _worker_loaded(publish_events=False) == []


def test_a_worker_imports_zmq_where_it_publishes_and_the_disagg_stack_where_kv_leaves() -> None:
    assert _worker_loaded() == list(_ZMQ)  # distributed and kvmesh run --router-mode kv: as before
    loaded = _worker_loaded(publish_events=False, drain_migrate=True)
    assert {"kvmesh.disagg.engine", "kvmesh.disagg.transfer"} <= set(loaded) and not set(_ZMQ) & set(loaded)


def test_a_static_worker_listens_without_the_idna_codec() -> None:
    """uvloop resolves a host, even an IP address, through the idna codec: a static
    worker binds its IP address itself (a host name is still resolved by the loop)."""
    idna = ("encodings.idna", "stringprep")
    assert _worker_loaded(idna, publish_events=False) == []
    assert _worker_loaded(idna, publish_events=False, host="localhost") == list(idna)


def test_run_tells_its_workers_to_publish_only_to_a_kv_router() -> None:
    from kvmesh.assembly.embedded import _resolve_folders
    from kvmesh.config import FrontendConfig, RunConfig, WorkerConfig

    for mode, publish in (("kv", True), ("kv-approx", False), ("round_robin", False), ("random", False)):
        cfg = _resolve_folders(RunConfig(worker=WorkerConfig(), frontend=FrontendConfig(router_mode=mode)))
        assert [f.worker.publish_events for f in cfg.fleets] == [publish], mode


async def test_a_static_workers_own_listener_serves_and_refuses_a_taken_port() -> None:
    import socket

    from kvmesh.config import WorkerConfig
    from kvmesh.runtime.tcp_server import TcpServer
    from kvmesh.worker.registration import ReadyLine, StaticSeat

    seat = StaticSeat(WorkerConfig(), ReadyLine(sys.stdout))
    server = await seat.request_server("backend")
    assert isinstance(server, TcpServer) and server.started and server.port > 0
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10):
            pass  # accepted: it listens where it says
        taken = StaticSeat(WorkerConfig(port=server.port), ReadyLine(sys.stdout))
        with pytest.raises(OSError):
            await taken.request_server("backend")  # run_worker reports it: "cannot listen on ..."
    finally:
        await server.close()
