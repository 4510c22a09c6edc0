"""A structured (JSON-schema) request whose worker is SIGKILLed mid-stream migrates to
another worker and still ends in valid JSON, identical to an undisturbed run (the
mocker's guided oracle is deterministic and the constraint travels in the typed
request, so the new worker's grammar resumes over the tokens already streamed)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.helpers import kvmesh_run, migrations_total, streams_cut_mid_way

pytestmark = pytest.mark.processes

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string"}}, "required": ["id", "label"]}},
        "done": {"type": "boolean"},
    },
    "required": ["title", "items", "done"],
}
STREAMS = 4
MAX_TOKENS = 160


def _body(i: int, stream: bool) -> dict:
    return {
        "model": "kvmesh-tiny", "messages": [{"role": "user", "content": f"order {i}"}], "max_tokens": MAX_TOKENS,
        "seed": 100 + i, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}},
    }  # fmt: skip


async def _stream(client: httpx.AsyncClient, i: int, progress: list[int]) -> str:
    parts: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=_body(i, True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text = choice["delta"].get("content")
                if text:
                    parts.append(text)
                    progress[i] += 1
    return "".join(parts)



@pytest.mark.timeout(240)
async def test_a_migrated_structured_stream_still_validates(tmp_path):
    # speedup 1: modelled step times, so a stream lasts long enough to be cut mid-way
    with kvmesh_run(tmp_path, "--router-mode", "round_robin", workers=2, speedup="1") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            reference = []
            for i in range(STREAMS):
                r = await client.post("/v1/chat/completions", json=_body(i, False))
                assert r.status_code == 200, r.text
                reference.append(r.json()["choices"][0]["message"]["content"])
            assert all(len(t) > 20 for t in reference), reference
            before = migrations_total(server.url)
            streamed = await streams_cut_mid_way(server, lambda i, progress: _stream(client, i, progress), STREAMS)
        assert migrations_total(server.url) > before, "no stream was migrated"
    for text, ref in zip(streamed, reference, strict=True):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == ref
