"""LoRA adapters at the frontend (issue 30, item 2): vLLM's admin routes
``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` against `kvmesh run`
(mocker workers that take adapters), behind the admin key; ``/v1/models`` lists the
adapter with its ``parent``; a request naming the adapter as its ``model`` (official
`openai` client) goes to the worker that holds it while that worker is not busy, and
the plain model's requests still go everywhere; unloaded, the adapter is a 404.

Set-up for affinity: ``max-loras = 1``; ``sql`` loaded on both workers (the default
fan-out), then ``chat`` on one of them only, which unloads ``sql`` there (LRU) but keeps
its folder: both workers could serve ``sql``, one holds it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvmesh.testing.lora import write_adapter
from tests.helpers import kvmesh_run

pytestmark = pytest.mark.processes

USER, ADMIN = "user-key-for-lora-test", "admin-key-for-lora-test"


def _workers(url: str) -> list[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = httpx.get(url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}).json()["workers"]
        if len(got) == 2:
            return sorted(w["worker"] for w in got)
        time.sleep(0.1)
    raise TimeoutError("two workers never attached")


def _route(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=3, extra_headers={"x-kvmesh-explain": "1"}
    )
    return raw.parse().model, json.loads(raw.headers["x-kvmesh-route"])["worker"]


def _cached(url: str, model: str, prompt: str) -> tuple[str, int]:
    """(the worker, the prompt tokens it found cached) of one request (with API keys the
    route's overlaps are not shown: another tenant's prefixes would be)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "router_explain": True}
    got = httpx.post(url + "/v1/completions", json=body, headers={"authorization": f"Bearer {USER}"}).json()
    return got["kvmesh_route"]["worker"], got["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.timeout(120)
def test_adapter_routes_listing_and_affinity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_adapter(tmp_path / "sql-adapter")
    monkeypatch.setenv("KVMESH_API_KEY", USER)
    monkeypatch.setenv("KVMESH_ADMIN_KEY", ADMIN)
    config = tmp_path / "lora.toml"
    config.write_text("max-loras = 1\n")
    args = ("--config", str(config), "--router-mode", "kv", "--admin", "--canary-interval", "0")
    with kvmesh_run(tmp_path, *args, workers=2) as server:
        url, admin = server.url, {"authorization": f"Bearer {ADMIN}"}
        holder, other = _workers(url)
        body = {"lora_name": "sql", "lora_path": str(folder)}
        # admin-only: no key, or a user's key, is a 401; a bad body a 400 that says what to send
        assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
        user = {"authorization": f"Bearer {USER}"}
        assert httpx.post(url + "/v1/load_lora_adapter", json=body, headers=user).status_code == 401
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_path": str(folder)}, headers=admin)
        assert bad.status_code == 400 and "lora_name" in bad.json()["error"]["message"]
        missing = httpx.post(url + "/v1/load_lora_adapter", json={**body, "lora_path": str(tmp_path / "none")}, headers=admin)
        assert missing.status_code == 400 and "not a folder" in missing.json()["error"]["message"]

        loaded = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=admin)
        assert loaded.status_code == 200, loaded.text
        assert {w: s["adapters"] for w, s in loaded.json()["workers"].items()} == {holder: ["sql"], other: ["sql"]}
        chat = {"lora_name": "chat", "lora_path": str(folder), "worker": other}
        loaded = httpx.post(url + "/v1/load_lora_adapter", json=chat, headers=admin)
        assert loaded.status_code == 200 and loaded.json()["workers"] == {other: {"adapters": ["chat"], "load_ms": pytest.approx(loaded.json()["workers"][other]["load_ms"])}}
        seen = httpx.get(url + "/admin/workers", headers=admin).json()["workers"]
        assert {w["worker"]: w.get("adapters") for w in seen} == {holder: ["sql"], other: ["chat"]}
        models = httpx.get(url + "/v1/models", headers=user).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("kvmesh-tiny", None), ("chat", "kvmesh-tiny"), ("sql", "kvmesh-tiny")]

        client = openai.OpenAI(base_url=url + "/v1", api_key=USER, max_retries=0)
        adapter = [_route(client, "sql", f"select {i} from t where x = {i}") for i in range(8)]
        assert adapter == [("sql", holder)] * 8  # one at a time: the holder is never busy
        plain = {_route(client, "kvmesh-tiny", f"plain prompt number {i}")[1] for i in range(8)}
        assert plain == {holder, other}  # plain requests are not pinned to the adapter's holder

        # an adapter's KV blocks are its own (hashes salted with its name, in the router and the
        # engine alike): a repeat matches them, the base model's same prompt does not
        long = " ".join(f"word{i}" for i in range(60))
        seen = [_cached(url, model, long) for model in ("sql", "sql", "kvmesh-tiny")]
        assert seen[0] == (holder, 0) and seen[1][0] == holder and seen[1][1] >= 192 and seen[2][1] == 0, seen

        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
        assert gone.status_code == 200, gone.text
        assert [m["id"] for m in httpx.get(url + "/v1/models", headers=user).json()["data"]] == ["kvmesh-tiny", "chat"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="sql", prompt="x", max_tokens=2)
        again = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
        assert again.status_code == 404


@pytest.mark.timeout(120)
def test_a_busy_holder_spills_to_a_worker_that_loads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real timing (speedup 1): eight long adapter prompts at once. The holder takes the
    first; booked with its prefill, it costs more than another worker's load of the
    adapter, so the router sends some to the other worker, which loads it."""
    folder = write_adapter(tmp_path / "sql-adapter")
    monkeypatch.setenv("KVMESH_ADMIN_KEY", ADMIN)
    monkeypatch.setenv("KVMESH_API_KEY", USER)
    config = tmp_path / "lora.toml"
    config.write_text("max-loras = 1\n")
    args = ("--config", str(config), "--router-mode", "kv", "--admin", "--canary-interval", "0")
    with kvmesh_run(tmp_path, *args, workers=2, speedup="1") as server:
        url, admin = server.url, {"authorization": f"Bearer {ADMIN}"}
        holder, other = _workers(url)
        for body in ({"lora_name": "sql", "lora_path": str(folder)}, {"lora_name": "chat", "lora_path": str(folder), "worker": other}):
            assert httpx.post(url + "/v1/load_lora_adapter", json=body, headers=admin).status_code == 200

        async def burst() -> list[str]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=USER, max_retries=0)
            prompts = [f"query {i}: " + " ".join(f"t{i}x{j}" for j in range(120)) for i in range(8)]
            raws = await asyncio.gather(*(
                client.completions.with_raw_response.create(model="sql", prompt=p, max_tokens=2, extra_headers={"x-kvmesh-explain": "1"})
                for p in prompts
            ))  # fmt: skip
            await client.close()
            return [json.loads(r.headers["x-kvmesh-route"])["worker"] for r in raws]

        workers = asyncio.run(burst())
        assert workers.count(holder) >= 1 and workers.count(other) >= 1, workers
        seen = httpx.get(url + "/admin/workers", headers=admin).json()["workers"]
        assert {w["worker"]: w.get("adapters") for w in seen}[other] == ["sql"]  # loaded there, chat unloaded (LRU)
