"""`kvmesh run --engine hf` serves the bundled trained model: the official openai
client gets real, repeatable greedy text that is not one token repeated."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.helpers import kvmesh_run

pytest.importorskip("torch")

pytestmark = pytest.mark.processes

CANARY_PROMPTS = ["def main():", "import json\n\n", "class Stack:\n    def push(self, item):\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("hf"), "--engine", "hf") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_serves_the_bundled_model_with_two_workers(server, client):
    assert [m.id for m in client.models.list()] == ["kvmesh-tiny"]
    # healthy means one worker is up; the second may still be loading its weights
    deadline = time.monotonic() + 60
    while (models := httpx.get(server.url + "/health").json()["models"]) != {"kvmesh-tiny": 2}:
        assert time.monotonic() < deadline, models
        time.sleep(0.1)


def test_the_same_greedy_chat_request_gives_the_same_text(client):
    def ask() -> tuple[str, int]:
        resp = client.chat.completions.create(
            model="kvmesh-tiny",
            messages=[{"role": "user", "content": "Write a function that reads a file."}],
            max_tokens=24,
            temperature=0,
        )
        return resp.choices[0].message.content or "", resp.usage.completion_tokens

    first, second = ask(), ask()  # round robin: the two workers answer in turn
    assert first == second
    assert first[0].strip() and first[1] > 0


def test_streamed_greedy_completion_equals_the_unary_one(client):
    kwargs = dict(model="kvmesh-tiny", prompt="def parse(line):\n", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    unary = client.completions.create(**kwargs)
    assert unary.usage.completion_tokens == 16 and unary.choices[0].finish_reason == "length"
    assert streamed == unary.choices[0].text


@pytest.mark.parametrize("prompt", CANARY_PROMPTS)
def test_canary_style_greedy_outputs_are_not_degenerate(client, prompt):
    resp = client.completions.create(
        model="kvmesh-tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    choice = resp.choices[0]
    tokens = choice.logprobs.tokens
    assert len(tokens) == 24
    assert len(set(tokens)) >= 5, f"degenerate output {choice.text!r}"
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def _wait_events_applied(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    pattern = r"^kvmesh_router_kv_events_applied_total\{[^}]*\} ([0-9.e+]+)$"
    while not any(float(v) > 0 for v in re.findall(pattern, httpx.get(url + "/metrics").text, re.M)):
        assert time.monotonic() < deadline, "the first request's KV events never reached the router"
        time.sleep(0.05)


def test_kv_router_sends_a_repeated_prompt_to_the_worker_holding_its_kv(tmp_path):
    prompt = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(12))  # ~10 blocks
    # no canaries: their KV events would end the wait below early
    with kvmesh_run(tmp_path, "--engine", "hf", "--router-mode", "kv", "--canary-interval", "0") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        cached = []
        for i in range(3):
            resp = client.completions.create(model="kvmesh-tiny", prompt=prompt, max_tokens=4, temperature=0)
            details = resp.usage.prompt_tokens_details
            cached.append(details.cached_tokens if details else 0)
            if i == 0:  # the worker's KV events reach the router before the repeat is routed
                _wait_events_applied(srv.url)
    assert cached[0] == 0
    # the router followed the first worker's KV events both times
    assert cached[1] >= 128 and cached[2] == cached[1]
