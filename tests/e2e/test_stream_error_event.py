"""The mid-stream SSE error (issue 32, item 4): a stream whose every migration target
fails ends with the OpenAI-style ``event: error`` (``data: {"error": {message, type,
param, code}}``) and then ``data: [DONE]``, never a silently cut or hung stream. Real
processes: ``kvmesh run --workers 2 --migration-limit 1`` with a slow mocker; the
worker serving the stream is SIGKILLed (the stream migrates and goes on), then every
worker process of the run is SIGKILLed (the one move allowed is spent: no target
left). Conditions are waited on, never times."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.e2e.test_health import _wait, _workers
from tests.helpers import kvmesh_run, migrations_total

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

MAX_TOKENS = 400


class Stream:
    """One streamed completion read line by line in a thread."""

    def __init__(self, url: str) -> None:
        self.url, self.lines, self.route, self.error = url, [], None, None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        body = {"model": "kvmesh-tiny", "prompt": "def f(x):", "max_tokens": MAX_TOKENS, "stream": True,
                "ignore_eos": True}  # fmt: skip
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, headers={"x-kvmesh-explain": "1"},
                              timeout=httpx.Timeout(60, read=60)) as r:  # fmt: skip
                self.route = json.loads(r.headers["x-kvmesh-route"])["worker"]
                for line in r.iter_lines():
                    self.lines.append(line)
        except Exception as exc:  # noqa: BLE001 - asserted on
            self.error = repr(exc)

    @property
    def chunks(self) -> int:
        return sum(1 for line in self.lines if line.startswith("data: {") and '"choices"' in line)


def test_a_stream_whose_every_migration_target_fails_ends_with_an_error_event(tmp_path):
    args = ("--admin", "--canary-interval", "0", "--migration-limit", "1")
    with kvmesh_run(tmp_path, *args, workers=2, speedup="0.05") as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 2, 60, "two workers routed")
        stream = Stream(url)
        _wait(lambda: stream.chunks >= 3, 60, lambda: f"the stream under way ({stream.lines[-3:]}, {stream.error})")
        os.kill(_workers(url)[stream.route]["pid"], signal.SIGKILL)  # its worker: the stream moves (the one move)
        _wait(lambda: migrations_total(url) >= 1, 60, "the stream migrated")
        moved = stream.chunks
        _wait(lambda: stream.chunks >= moved + 3, 60, lambda: f"the migrated stream going on ({stream.lines[-3:]})")
        for pid in server.worker_pids():  # every worker: no target left for a second move
            os.kill(pid, signal.SIGKILL)
        stream.thread.join(60)
        assert not stream.thread.is_alive(), "the stream ended (not hung)"
        assert stream.error is None, stream.error
        tail = [line for line in stream.lines if line]
        assert tail[-3] == "event: error" and tail[-1] == "data: [DONE]", tail[-4:]
        error = json.loads(tail[-2].removeprefix("data: "))["error"]
        assert error["message"] and error["type"] and error["code"] >= 500, error
        assert stream.chunks < MAX_TOKENS and '"finish_reason":"length"' not in "".join(stream.lines)
        print(f"stream: {stream.chunks} chunks, then {tail[-3]} {tail[-2]}")
