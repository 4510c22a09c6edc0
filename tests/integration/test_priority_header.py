"""The header x-kvmesh-priority sets a request's tier for the workers too, not only for
shedding (it did only the latter: workers scheduled a header-premium request as standard)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvmesh.protocol import PreprocessedRequest
from tests.helpers import InProcessStack

pytestmark = pytest.mark.timeout(60)


async def _post(port: int, body: dict[str, object], headers: dict[str, str]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{head}"
                 f"content-length: {len(data)}\r\nconnection: close\r\n\r\n".encode() + data)  # fmt: skip
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    await reader.read()
    writer.close()
    return status


@pytest.mark.parametrize("how", ["header", "body"])
async def test_the_tier_reaches_the_worker(how: str) -> None:
    stack = InProcessStack()
    async with stack.running():
        seen: list[str | None] = []
        generate = stack.engine.generate

        def spy(request: PreprocessedRequest, *args: object, **kw: object):  # type: ignore[no-untyped-def]
            seen.append(request.routing.priority if request.routing else None)
            return generate(request, *args, **kw)

        stack.engine.generate = spy  # type: ignore[method-assign]
        body: dict[str, object] = {"model": "kvmesh-tiny", "prompt": "hello", "max_tokens": 2}
        headers = {"x-kvmesh-priority": "best_effort"} if how == "header" else {}
        if how == "body":
            body["priority"] = "best_effort"
        assert await _post(stack.port, body, headers) == 200
        assert seen == ["best_effort"]
