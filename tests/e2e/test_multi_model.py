"""Several models behind one frontend (issue 30, item 1): `kvmesh run --config` with
three `[[models]]` tables — two mocker models under their own names, and one whose
workers never start. Both served models take requests at once through the official
`openai` client; no request reaches a worker of the other model (each answer's worker,
and every worker's own request counter, against /admin/workers); the model without a
worker gets a 503 naming it while the others keep serving; /v1/models lists all three;
the frontend's metrics carry the model label."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import kvmesh_run

pytestmark = pytest.mark.processes

CONFIG = """\
router-mode = "kv"
admin = true
canary-interval = 0        # no canary requests: every request a worker counts is a client's
worker-wait = 1.0
max-failed-starts = 1000   # the broken model's workers keep failing; the run must not give up

[[models]]
name = "alpha"
workers = 2

[[models]]
name = "beta"
workers = 1
block-size = 32

[[models]]
name = "broken"
workers = 1
fault = "start"
"""


def _wait_models(url: str, want: dict[str, int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = httpx.get(url + "/health").json().get("models", {})
        if all(models.get(m, 0) >= n for m, n in want.items()):
            return
        time.sleep(0.1)
    raise TimeoutError(f"models not up: {httpx.get(url + '/health').text}")


def _workers_by_model(url: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for w in httpx.get(url + "/admin/workers").json()["workers"]:
        out.setdefault(w["model"], set()).add(w["worker"])
    return out


def _worker_requests(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    lines = re.finditer(r"^kvmesh_worker_requests_total\{([^}]*)\} (\S+)$", text, re.M)
    return {re.search(r'worker_id="([0-9a-f]+)"', m.group(1)).group(1): float(m.group(2)) for m in lines}  # type: ignore[union-attr]


async def _one(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, str]:
    """(model echoed, worker that served it) of one streamed or unary request."""
    prompt = f"request {i} for {model}: " + "words " * (i % 7)
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=4, extra_headers={"x-kvmesh-explain": "1"}
    )
    body = raw.parse()
    return body.model, json.loads(raw.headers["x-kvmesh-route"])["worker"]


@pytest.mark.timeout(120)
def test_two_models_side_by_side_never_cross(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text(CONFIG)
    with kvmesh_run(tmp_path, "--config", str(config), workers=1) as server:
        _wait_models(server.url, {"alpha": 2, "beta": 1})
        listed = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        assert listed == ["alpha", "beta", "broken"]
        owners = _workers_by_model(server.url)
        assert len(owners["alpha"]) == 2 and len(owners["beta"]) == 1 and "broken" not in owners
        before = _worker_requests(server.url)

        async def load() -> list[tuple[str, str, str]]:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            jobs = [(m, i) for i in range(24) for m in ("alpha", "beta")]
            got = await asyncio.gather(*(_one(client, m, i) for m, i in jobs))
            await client.close()
            return [(m, echoed, worker) for (m, _), (echoed, worker) in zip(jobs, got)]

        results = asyncio.run(load())
        for model, echoed, worker in results:
            assert echoed == model and worker in owners[model], (model, worker, owners)
        assert {w for m, _, w in results if m == "alpha"} == owners["alpha"]  # both alpha workers served
        # the workers' own counters: each model's workers served exactly that model's requests
        after = _worker_requests(server.url)
        for model in ("alpha", "beta"):
            served = sum(after.get(w, 0) - before.get(w, 0) for w in owners[model])
            assert served == 24, (model, after, before)
        # the worker series carry their model: its workers' requests under its label
        text = httpx.get(server.url + "/metrics").text
        labelled = re.findall(r'^kvmesh_worker_requests_total\{[^}]*worker_id="(\w+)"[^}]*model="(\w+)"[^}]*\}', text, re.M)
        labelled += [(w, m) for m, w in re.findall(r'^kvmesh_worker_requests_total\{[^}]*model="(\w+)"[^}]*worker_id="(\w+)"', text, re.M)]
        assert {m: {w for w, mm in labelled if mm == m} for m in ("alpha", "beta")} == {m: owners[m] for m in ("alpha", "beta")}

        # a model with no worker: 503 naming it, while the others keep serving
        with pytest.raises(openai.APIStatusError) as refused:
            openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0).completions.create(
                model="broken", prompt="hi", max_tokens=2
            )
        assert refused.value.status_code == 503 and "broken" in refused.value.message
        still = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert still.completions.create(model="beta", prompt="hi", max_tokens=2).model == "beta"

        metrics = httpx.get(server.url + "/metrics").text
        for model in ("alpha", "beta"):
            assert re.search(rf'^kvmesh_router_decisions_total\{{model="{model}",worker="[0-9a-f]+"\}} ', metrics, re.M)
        assert re.search(r'^kvmesh_frontend_requests_total\{[^}]*model="broken"[^}]*status="503"', metrics, re.M), metrics[:0]


@pytest.mark.timeout(60)
def test_bad_models_tables_are_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    cases = {
        'models = 3\n': "array of tables",
        '[[models]]\nname = "a"\nbogus = 1\n': "no such model setting: bogus",
        '[[models]]\nname = "a"\n[[models]]\nname = "a"\n': "two models are named 'a'",
        '[[models]]\nworkers = 0\n': "workers must be an integer >= 1",
    }
    for text, want in cases.items():
        path = tmp_path / "bad.toml"
        path.write_text(text)
        out = subprocess.run([sys.executable, "-m", "kvmesh.cli.main", "run", "--config", str(path)],
                             capture_output=True, text=True, timeout=50)  # fmt: skip
        assert out.returncode == 2 and want in out.stderr, (text, out.stderr)
    # a named model's bad folder: one line before any worker starts; two models one name
    starts = {
        '[[models]]\nname = "a"\n[[models]]\nname = "b"\nmodel-path = "/nonexistent"\n': "model folder /nonexistent",
        "[[models]]\n[[models]]\n": "two models are served as 'kvmesh-tiny'",
    }
    for text, want in starts.items():
        path = tmp_path / "bad.toml"
        path.write_text(text)
        out = subprocess.run([sys.executable, "-m", "kvmesh.cli.main", "run", "--config", str(path), "--http-port", "0"],
                             capture_output=True, text=True, timeout=50)  # fmt: skip
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1 and lines[0].startswith("kvmesh run: ") and want in lines[0], lines


@pytest.mark.timeout(90)
def test_distributed_workers_of_two_models_register_side_by_side(tmp_path: Path) -> None:
    """File discovery: one `kvmesh frontend`, a `kvmesh worker` per model (--served-model-name,
    another block size each); each model's requests reach its own worker only."""
    from tests.helpers import KvmeshProcess, free_port, wait_healthy

    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "disc"), "KVMESH_NAMESPACE": "models"}
    port = free_port()
    procs = [KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), "--router-mode", "kv", "--canary-interval", "0", env=env)]
    try:
        ids = {}
        for name, block in (("alpha", "16"), ("beta", "32")):
            procs.append(KvmeshProcess(tmp_path, "worker", "--served-model-name", name, "--block-size", block,
                                       "--speedup", "1e9", env=env))  # fmt: skip
            ids[name] = f"{procs[-1].wait_ready()['lease_id']:x}"
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=procs[0].proc)
        _wait_models(url, {"alpha": 1, "beta": 1})
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["alpha", "beta"]

        async def load() -> list[tuple[str, str, str]]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            jobs = [(m, i) for i in range(8) for m in ("alpha", "beta")]
            got = await asyncio.gather(*(_one(client, m, i) for m, i in jobs))
            await client.close()
            return [(m, echoed, worker) for (m, _), (echoed, worker) in zip(jobs, got)]

        for model, echoed, worker in asyncio.run(load()):
            assert echoed == model and worker == ids[model], (model, worker, ids)
    finally:
        for p in reversed(procs):
            p.stop()
