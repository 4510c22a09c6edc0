"""What the HTTP API exposes beyond its routes' purpose (issue 29, items 3, 5, 6):

* ``/dashboard`` and its event stream (worker addresses, request ids, routing
  decisions) behind any API key when keys are set, by header or by the session
  cookie a browser gets for the key, with a cap on streams per key;
* ``POST /v1/*`` only as ``application/json`` (a web page can make a browser send
  ``text/plain`` or a form to any address without a CORS preflight);
* a 5xx body never carries an engine's exception text (driven through the vLLM
  adapter's real error mapping, a worker service and the frontend);
* no API served beyond loopback without keys unless the operator says so, ``--admin``
  never; the Dockerfile's default command included;
* secrets off the command line: a warning for a key given as a flag, README/docs
  examples and the Kubernetes manifests pass them through files or the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.config import FrontendConfig, SecurityConfig
from tests.helpers import InProcessStack, kvmesh_run

ROOT = Path(__file__).resolve().parents[2]
KEY_A = "sk-exposure-a-0123456789abcdef"
KEY_B = "sk-exposure-b-0123456789abcdef"
MODEL = "kvmesh-tiny"
BODY = {"model": MODEL, "prompt": "def f():", "max_tokens": 2}
# what the fake vLLM puts in its exception: none of it may reach a client
ENGINE_TEXT = "CUDA out of memory at 0x7f3a2c000000 on worker 10.9.8.7:9000 (/opt/models/secret-llama/model.safetensors)"


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@contextlib.asynccontextmanager
async def _stack(*keys: str) -> AsyncIterator[InProcessStack]:
    """Frontend + one mocker worker in this loop; ``keys`` turn API keys on."""
    stack = InProcessStack()
    security = SecurityConfig(api_keys=tuple((k, "standard") for k in keys))
    stack.frontend_config = FrontendConfig(http_port=0, keepalive_s=0.2, canary_interval_s=0, security=security)
    async with stack.running():
        yield stack


async def _first_event(response: httpx.Response) -> dict[str, Any]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            return dict(json.loads(line[6:]))
    raise AssertionError("the event stream ended without an event")


async def _wait_streams(stack: InProcessStack, count: int) -> None:
    while stack.frontend.dashboard.streams != count:
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------- the dashboard


@pytest.mark.timeout(60)
async def test_with_keys_the_dashboard_and_its_events_need_a_key() -> None:
    async with _stack(KEY_A) as stack, httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        page = await client.get("/dashboard")
        assert page.status_code == 401, "the dashboard page is served without a key"
        assert "API key" in page.text and 'type="password"' in page.text  # the form that asks for one
        assert "tr[data-worker]" not in page.text and "EventSource" not in page.text
        for headers in ({}, _bearer("sk-wrong"), {"cookie": "kvmesh_dashboard=1.abc"}):
            events = await client.get("/dashboard/events", headers=headers)
            assert events.status_code == 401, (headers, events.text[:200])
            assert "API key" in events.json()["error"]["message"]
            assert stack.service.address not in events.text
        assert stack.frontend.dashboard.streams == 0
        assert (await client.get("/dashboard", headers=_bearer(KEY_A))).status_code == 200
        async with client.stream("GET", "/dashboard/events", headers=_bearer(KEY_A)) as r:
            assert r.status_code == 200
            snap = await _first_event(r)
        assert [w["address"] for w in snap["workers"]] == [stack.service.address]


@pytest.mark.timeout(60)
async def test_a_browser_trades_the_key_for_a_strict_httponly_session_cookie() -> None:
    async with _stack(KEY_A, KEY_B) as stack, httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        refused = await client.post("/dashboard/session", headers=_bearer("sk-wrong"))
        assert refused.status_code == 401 and "set-cookie" not in refused.headers
        r = await client.post("/dashboard/session", headers=_bearer(KEY_B))
        assert r.status_code == 204, r.text
        cookie = r.headers["set-cookie"]
        attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "samesite", "path", "max-age"} <= attributes, cookie
        assert "SameSite=Strict" in cookie and "Path=/dashboard" in cookie
        name, _, token = cookie.split(";")[0].partition("=")
        assert name == "kvmesh_dashboard" and KEY_B not in token and token
        client.cookies.clear()  # sent by hand below, as a browser would
        async with client.stream("GET", "/dashboard/events", headers={"cookie": f"{name}={token}"}) as events:
            assert events.status_code == 200
            assert (await _first_event(events))["workers"]
        assert (await client.get("/dashboard", headers={"cookie": f"{name}={token}"})).status_code == 200
        # a forged or altered token opens nothing
        expires, _, mac = token.partition(".")
        for bad in (f"{int(expires) + 3600}.{mac}", f"{expires}.{mac[:-2]}00", f"{expires}.", "9" * 40 + "." + mac):
            r = await client.get("/dashboard/events", headers={"cookie": f"{name}={bad}"})
            assert r.status_code == 401, bad


@pytest.mark.timeout(60)
async def test_unauthenticated_streams_cannot_lock_an_operator_out() -> None:
    async with _stack(KEY_A) as stack, httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        async with contextlib.AsyncExitStack() as held:
            statuses = []
            for _ in range(40):  # more than every stream the dashboard allows
                r = await held.enter_async_context(client.stream("GET", "/dashboard/events"))
                statuses.append(r.status_code)
            assert set(statuses) == {401}, f"unauthenticated clients held {statuses.count(200)} event streams"
            async with client.stream("GET", "/dashboard/events", headers=_bearer(KEY_A)) as mine:
                assert mine.status_code == 200, "the operator was locked out of the dashboard"
                assert (await _first_event(mine))["workers"]


@pytest.mark.timeout(60)
async def test_one_key_cannot_take_every_dashboard_stream() -> None:
    from kvmesh.frontend import dashboard

    per_key = getattr(dashboard, "MAX_STREAMS_PER_KEY", 4)
    async with _stack(KEY_A, KEY_B) as stack:
        limits = httpx.Limits(max_connections=dashboard.MAX_STREAMS + 8)
        async with httpx.AsyncClient(base_url=stack.url, timeout=30, limits=limits) as client:
            async with contextlib.AsyncExitStack() as held:
                for _ in range(per_key):
                    r = await held.enter_async_context(client.stream("GET", "/dashboard/events", headers=_bearer(KEY_A)))
                    assert r.status_code == 200
                await _wait_streams(stack, per_key)
                async with client.stream("GET", "/dashboard/events", headers=_bearer(KEY_A)) as over:
                    assert over.status_code == 429, f"key A opened stream {per_key + 1}"
                    refusal = json.loads(await over.aread())
                assert "retry-after" in over.headers and "close one" in refusal["error"]["message"]
                async with client.stream("GET", "/dashboard/events", headers=_bearer(KEY_B)) as other:
                    assert other.status_code == 200, "another key was locked out"
            await _wait_streams(stack, 0)  # every closed page gave its slot back
            async with client.stream("GET", "/dashboard/events", headers=_bearer(KEY_A)) as again:
                assert again.status_code == 200


@pytest.mark.timeout(60)
async def test_without_keys_the_dashboard_stays_open() -> None:
    async with _stack() as stack, httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        page = await client.get("/dashboard")
        assert page.status_code == 200 and "EventSource" in page.text
        assert (await client.post("/dashboard/session")).status_code == 204
        async with client.stream("GET", "/dashboard/events") as r:
            assert r.status_code == 200 and (await _first_event(r))["workers"]


# ---------------------------------------------------------------------------- JSON-only POSTs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keys", [(), (KEY_A,)], ids=["no keys", "keys"])
async def test_v1_posts_need_content_type_json(keys: tuple[str, ...]) -> None:
    headers = _bearer(KEY_A) if keys else {}
    body = json.dumps(BODY).encode()
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    async with _stack(*keys) as stack, httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for path, content in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            # what a cross-site page can make a browser send without a preflight, and no type at all
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
                sent = {**headers, **({"content-type": ctype} if ctype else {})}
                r = await client.post(path, content=content, headers=sent)
                assert r.status_code == 415, (path, ctype, r.status_code, r.text[:200])
                message = r.json()["error"]["message"]
                assert "content-type: application/json" in message, message
            ok = await client.post(path, content=content, headers={**headers, "content-type": "application/json; charset=utf-8"})
            assert ok.status_code == 200, ok.text
        assert (await client.post("/v1/completions", json=BODY, headers=headers)).status_code == 200


# ---------------------------------------------------------------------------- engine text in 5xx


def _fake_vllm(error: str, text: str) -> types.ModuleType:
    """The names of ``kvmesh.engines.vllm.api``, faked: an AsyncLLM whose every request
    fails with the exception class ``error`` (one of vLLM's, else a builtin) carrying
    ``text``, as vLLM's output handler raises it into a generate call."""
    api = types.ModuleType("kvmesh.engines.vllm.api")

    class EngineDeadError(Exception): ...

    class GracefulHTTPError(Exception): ...

    class VLLMClientError(Exception): ...

    class StatLoggerBase:
        pass

    class FakeLLM:
        errored = False
        vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=2048),
            cache_config=types.SimpleNamespace(block_size=16, num_gpu_blocks=256),
            scheduler_config=types.SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=2048),
        )

        @classmethod
        def from_engine_args(cls, args: Any, stat_loggers: Any = None) -> FakeLLM:
            return cls()

        def get_tokenizer(self) -> Any:
            raise RuntimeError("skip_tokenizer_init")

        async def generate(self, prompt: Any, params: Any, rid: str) -> AsyncIterator[Any]:
            raise vllm_errors.get(error, RuntimeError)(text)
            yield  # an async generator, as vLLM's

        async def abort(self, rid: Any) -> None:
            pass

        def shutdown(self) -> None:
            pass

    api.AsyncLLM = FakeLLM  # type: ignore[attr-defined]
    api.AsyncEngineArgs = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    api.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    api.StructuredOutputsParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    api.KVEventsConfig = api.KVTransferConfig = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    api.RequestOutputKind = types.SimpleNamespace(DELTA=2)  # type: ignore[attr-defined]
    api.prompt = lambda ids: {"prompt_token_ids": ids}  # type: ignore[attr-defined]
    api.StatLoggerBase = StatLoggerBase  # type: ignore[attr-defined]
    vllm_errors: dict[str, type[Exception]] = {
        "EngineDeadError": EngineDeadError, "GracefulHTTPError": GracefulHTTPError, "VLLMClientError": VLLMClientError
    }  # fmt: skip
    for name, cls in vllm_errors.items():
        setattr(api, name, cls)
    return api


@contextlib.asynccontextmanager
async def _vllm_stack(api: types.ModuleType) -> AsyncIterator[str]:
    """A frontend and a worker service over VllmEngine (its vLLM faked), over loopback TCP."""
    from kvmesh.engines.vllm import VllmEngine, VllmOptions
    from kvmesh.frontend.app import Frontend
    from kvmesh.frontend.server import bind_http
    from kvmesh.frontend.serving import make_server
    from kvmesh.preprocess.model import bundled_model_path
    from kvmesh.protocol import InstanceInfo
    from kvmesh.runtime.tcp_client import TcpClient
    from kvmesh.worker.service import WorkerService

    path = str(bundled_model_path())
    engine = VllmEngine(VllmOptions(model=path, served_model_name=MODEL, kv_events=False, kv_cache_gb=1))
    service = WorkerService(engine)
    config = await service.start()
    frontend = Frontend(FrontendConfig(http_port=0, canary_interval_s=0, migration_limit=0))
    await frontend.registry.attach(InstanceInfo(0, service.address, config, path), TcpClient(service.address))
    sock = bind_http("127.0.0.1", 0)
    server = make_server(frontend.app)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        await service.shutdown(grace_s=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", ["GracefulHTTPError", "EngineDeadError", "RuntimeError"])
async def test_5xx_bodies_carry_no_engine_exception_text(
    error: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM is not installed here: the adapter imports these names on first use (engine._import_vllm)
    api = _fake_vllm(error, ENGINE_TEXT)
    monkeypatch.setitem(sys.modules, "kvmesh.engines.vllm.api", api)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the adapter sets these for vLLM's engine core
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    caplog.set_level("WARNING", logger="kvmesh.frontend")
    async with _vllm_stack(api) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code >= 500, r.text
        for leak in ("0x7f3a2c000000", "10.9.8.7", "secret-llama", "CUDA out of memory", "vLLM"):
            assert leak not in r.text, f"a {r.status_code} carried the engine's text: {r.text}"
        request_id = r.headers["x-request-id"]
        assert request_id in r.json()["error"]["message"]
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as s:
            text = (await s.aread()).decode()
        assert "CUDA out of memory" not in text and "10.9.8.7" not in text, text
    if error == "EngineDeadError":
        return  # a dead engine is migratable: the request moved on, and the answer says no other worker serves
    # the operator still finds the text in the frontend's log, under the request id
    assert any(request_id in m and "CUDA out of memory" in m for m in caplog.messages), caplog.messages


# ---------------------------------------------------------------------------- binding beyond loopback


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMESH_API_KEY", "KVMESH_ADMIN", "KVMESH_ALLOW"))}
    return {**env, "PYTHONPATH": str(ROOT / "src"), **extra}


def _kvmesh(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvmesh.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)


@pytest.fixture
def taken_port() -> Any:
    """A port this test holds on 127.0.0.1: a kvmesh that got past its checks fails to
    bind every address on it ("address in use"), so no test binds beyond loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _dockerfile_command() -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["kvmesh"]' in text
    return list(json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1)))  # type: ignore[union-attr]


@pytest.mark.timeout(240)
def test_the_dockerfile_command_refuses_to_serve_every_address_without_keys(taken_port: int, tmp_path: Path) -> None:
    command = _dockerfile_command()
    assert command[:3] == ["run", "--http-host", "0.0.0.0"]
    out = _kvmesh(*command, "--http-port", str(taken_port), env=_clean_env())
    assert out.returncode == 2 and "address already in use" not in out.stderr.lower(), out.stderr
    for hint in ("without API keys", "--api-keys-file", "KVMESH_API_KEY", "KVMESH_ALLOW_UNAUTHENTICATED=1"):
        assert hint in out.stderr, out.stderr
    # with keys (a mounted file, as docs/kubernetes.md does) it goes on to bind
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY_A} standard\n")
    out = _kvmesh(*command, "--http-port", str(taken_port), env=_clean_env(KVMESH_API_KEYS_FILE=str(keys)))
    assert out.returncode == 1 and "cannot serve on 0.0.0.0" in out.stderr, out.stderr


@pytest.mark.timeout(240)
def test_frontend_beyond_loopback_needs_keys_or_the_operators_word(taken_port: int) -> None:
    args = ("frontend", "--http-host", "0.0.0.0", "--http-port", str(taken_port), "--static-workers", "127.0.0.1:1")
    out = _kvmesh(*args, env=_clean_env())
    assert out.returncode == 2 and "KVMESH_ALLOW_UNAUTHENTICATED=1" in out.stderr, out.stderr
    out = _kvmesh(*args, env=_clean_env(KVMESH_ALLOW_UNAUTHENTICATED="1"))
    assert out.returncode == 1 and "cannot serve on 0.0.0.0" in out.stderr, out.stderr  # past the check
    out = _kvmesh(*args, "--allow-unauthenticated", env=_clean_env())
    assert out.returncode == 1 and "cannot serve on 0.0.0.0" in out.stderr, out.stderr


@pytest.mark.timeout(240)
def test_admin_without_keys_beyond_loopback_is_refused_outright(taken_port: int) -> None:
    for command in ("run", "frontend"):
        out = _kvmesh(command, "--http-host", "0.0.0.0", "--http-port", str(taken_port), "--admin",
                      env=_clean_env(KVMESH_ALLOW_UNAUTHENTICATED="1"))  # fmt: skip
        assert out.returncode == 2 and "--admin without API keys" in out.stderr, (command, out.stderr)


def test_loopback_needs_no_key() -> None:
    from kvmesh.cli.frontend import exposure_refusal

    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert exposure_refusal(FrontendConfig(http_host=host)) is None, host
        assert exposure_refusal(FrontendConfig(http_host=host, security=SecurityConfig(admin=True))) is None, host
    for host in ("0.0.0.0", "", "::", "10.0.0.5", "frontend.example"):
        assert exposure_refusal(FrontendConfig(http_host=host)) is not None, host
        keyed = SecurityConfig(api_keys=((KEY_A, "standard"),))
        assert exposure_refusal(FrontendConfig(http_host=host, security=keyed)) is None, host


# ---------------------------------------------------------------------------- secrets off the command line


@pytest.mark.parametrize("flag", ["--api-key", "--admin-key"])
def test_a_key_on_the_command_line_gets_a_warning(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh.cli.main import main

    for args in ([flag, "sk-on-argv-123"], [f"{flag}=sk-on-argv-123"]):
        main(["frontend", *args, "--config", "/nonexistent/kvmesh.toml"])  # fails at once, after the warning
        err = capsys.readouterr().err
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert len(warnings) == 1 and flag in warnings[0], err
        assert "ps" in warnings[0] and "history" in warnings[0] and "KVMESH_" in warnings[0], warnings[0]
        assert "sk-on-argv-123" not in err  # the warning does not print the key again


def test_keys_from_a_file_or_the_environment_get_no_warning(capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh.cli.main import main

    main(["frontend", "--api-keys-file", "/nonexistent/keys", "--config", "/nonexistent/kvmesh.toml"])
    assert "warning" not in capsys.readouterr().err


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, re.S)


def test_readme_and_docs_pass_no_key_on_the_command_line() -> None:
    secret_flag = re.compile(r"--(?:api-key|admin-key)(?:[ =])")
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _shell_blocks(path.read_text()):
            found += [f"{path.name}: {line.strip()}" for line in block.splitlines() if secret_flag.search(line)]
            found += [f"{path.name}: {line.strip()}" for line in block.splitlines() if "--from-literal" in line]
    assert not found, "examples that put a secret in argv:\n" + "\n".join(found)


# ---------------------------------------------------------------------------- Kubernetes


def _rendered(overlay: str) -> list[dict[str, Any]]:
    from tests.unit.test_kubernetes import _render

    return _render(overlay)


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overlay", ["aggregated-mocker", "disaggregated", "vllm-gpu"])
def test_kubernetes_mounts_the_secrets_and_holds_none(overlay: str) -> None:
    objs = _rendered(overlay)
    assert not [o for o in objs if o["kind"] == "Secret"], "a Secret with its data is in the repository"
    config = {k: v for o in objs if o["kind"] == "ConfigMap" for k, v in o["data"].items()}
    assert not {k for k in config if re.search(r"KEY$|SECRET$|PASSWORD", k)}, config
    workloads = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    kvmesh = [(o, c) for o in workloads for c in o["spec"]["template"]["spec"]["containers"] if c["image"].startswith("kvmesh")]
    assert kvmesh
    for obj, c in kvmesh:
        env = _env(c)
        for name, e in env.items():  # a secret's value never written in a manifest
            if re.search(r"KEY$|SECRET$|PASSWORD", name):
                assert "value" not in e and "secretKeyRef" in e.get("valueFrom", {}), (obj["metadata"]["name"], name)
        secret = env.get("KVMESH_CLUSTER_SECRET", {}).get("valueFrom", {}).get("secretKeyRef", {})
        secret_file = env.get("KVMESH_CLUSTER_SECRET_FILE") or ({"value": config["KVMESH_CLUSTER_SECRET_FILE"]} if "KVMESH_CLUSTER_SECRET_FILE" in config else None)
        assert secret.get("name") == "kvmesh-cluster-secret" or _from_secret_volume(obj, c, secret_file, "kvmesh-cluster-secret"), obj["metadata"]["name"]
        if c["args"][0] == "frontend":
            keys = env.get("KVMESH_API_KEYS_FILE")
            assert keys is not None and _from_secret_volume(obj, c, keys, "kvmesh-api-keys"), "the frontend serves without API keys"
            assert "--admin" not in c["args"]


def _from_secret_volume(obj: dict[str, Any], c: dict[str, Any], var: dict[str, Any] | None, secret: str) -> bool:
    """``var``'s path is a file of a volume made from the Secret ``secret``."""
    if var is None or "value" not in var:
        return False
    volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"].get("volumes", [])}
    for mount in c.get("volumeMounts", []):
        source = volumes.get(mount["name"], {}).get("secret", {})
        if source.get("secretName") == secret and var["value"].startswith(mount["mountPath"].rstrip("/") + "/"):
            name = var["value"][len(mount["mountPath"].rstrip("/")) + 1 :]
            return name in {i["path"] for i in source.get("items", [])} or not source.get("items")
    return False


def test_kubernetes_docs_create_both_secrets_from_files() -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    commands = "\n".join(_shell_blocks(text))
    for secret in ("kvmesh-cluster-secret", "kvmesh-api-keys"):  # one command, continued lines included
        assert re.search(rf"create secret generic {secret}(?:[^\n]|\\\n)*--from-file", commands), (secret, commands)


# ---------------------------------------------------------------------------- a real browser


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_browser_opens_the_keyed_dashboard_with_one_key_entry(tmp_path: Path) -> None:
    from tests.cdp import Chromium

    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY_A} standard\n")
    with kvmesh_run(tmp_path, "--api-keys-file", str(keys), "--canary-interval", "0", workers=1) as server:
        browser = Chromium()
        try:
            browser.open(server.url + "/dashboard")
            _until(lambda: browser.poll("document.getElementById('key') !== null"), "the key form")
            assert not browser.evaluate("document.querySelectorAll('tr[data-worker]').length")
            browser.evaluate(f"document.getElementById('key').value = {json.dumps(KEY_A)};"
                             "document.getElementById('login').requestSubmit()")  # fmt: skip
            rows = "document.querySelectorAll('tr[data-worker]').length"
            _until(lambda: browser.poll(rows) == 1, "the live page to list the worker")  # across the reload
            assert browser.evaluate("document.getElementById('conn').textContent") == "live"
            assert browser.evaluate("document.cookie") == ""  # HttpOnly: no script reads the session
            stamp = browser.evaluate("document.body.dataset.updated")
            _until(lambda: browser.evaluate("document.body.dataset.updated") != stamp, "a second event")
        finally:
            browser.close()


def _until(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
