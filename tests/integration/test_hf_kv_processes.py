"""Real KV tensors between processes: a prefill in one worker process, its KV sent as
bytes over a pipe and imported by another process, which decodes on; and a request
detached mid-stream in one process and resumed from its KV in another. Greedy tokens
equal a single-process run."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from multiprocessing.connection import Connection

import pytest

pytest.importorskip("torch")

from kvmesh.preprocess.model import bundled_model_path  # noqa: E402
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402

pytestmark = pytest.mark.processes

PROMPT = "<|im_start|>user\nWrite a function that parses a config file.<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 24


def _request(ids: list[int], rid: str, max_tokens: int = MAX_TOKENS) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="kvmesh-tiny",
        token_ids=ids,
        sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


# ---------------------------------------------------------------------------- the worker process


def _worker(conn: Connection) -> None:
    """One engine per process; answers commands from the pipe until ``quit``."""
    import torch

    torch.set_num_threads(1)
    asyncio.run(_serve(conn))


async def _serve(conn: Connection) -> None:
    from kvmesh.engines.hf import HfEngine, HfOptions

    engine = HfEngine(HfOptions(str(bundled_model_path()), num_blocks=64, seed=0))
    await engine.start()
    try:
        while True:
            cmd, *args = await asyncio.to_thread(conn.recv)
            if cmd == "quit":
                return
            conn.send(await _COMMANDS[cmd](engine, *args))
    finally:
        await engine.cleanup()


async def _generate(engine, request: PreprocessedRequest, stop_after: int | None = None):
    """Tokens of a stream; with ``stop_after``, detach it once that many are out and
    return (tokens, reservation, KV bytes of its valid blocks)."""
    from kvmesh.testing import mock_context

    tokens: list[int] = []
    res = None
    async for chunk in engine.generate(request, mock_context(request.request_id)):
        tokens += chunk.token_ids
        if stop_after is not None and res is None and len(tokens) >= stop_after and not chunk.finish_reason:
            res = engine.kv_detach(request.request_id)
    if stop_after is None:
        return tokens
    valid = -(-res.cached_tokens // engine.kv_layout().block_size)
    data = engine.kv_export(res.block_ids[:valid])
    engine.kv_release(request.request_id)
    return tokens, res.cached_tokens, data


async def _prefill(engine, request: PreprocessedRequest, upto: int) -> bytes:
    return await engine.prefill_remote(request, b"", 0, upto)


async def _decode_from(engine, request: PreprocessedRequest, data: bytes, computed: int) -> list[int]:
    res = engine.kv_reserve(request)
    assert res is not None and res.cached_tokens == 0
    n = len(data) // engine.kv_layout().wire_bytes_per_block
    engine.kv_import(res.block_ids[:n], data)
    engine.kv_commit(request.request_id, computed)
    before = engine.stats.forward_tokens
    tokens = await _generate(engine, request)
    # the imported KV was used: only the tokens after ``computed`` went through the model
    assert engine.stats.forward_tokens - before == len(request.token_ids) - computed + len(tokens) - 1
    return tokens


_COMMANDS = {"generate": _generate, "prefill": _prefill, "decode_from": _decode_from}


# ---------------------------------------------------------------------------- the test


@pytest.fixture
def workers():
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for _ in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child,), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        yield conns
    finally:
        for conn in conns:
            conn.send(("quit",))
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _call(conn: Connection, *cmd: object, timeout: float = 120.0) -> object:
    conn.send(cmd)
    if not conn.poll(timeout):
        raise TimeoutError(f"worker process did not answer {cmd[0]!r} within {timeout} s")
    return conn.recv()


def test_prefill_in_one_process_decode_in_another(workers):
    from kvmesh.preprocess.tokenizer import load_tokenizers_file

    prefill, decode = workers
    ids = load_tokenizers_file(bundled_model_path() / "tokenizer.json").encode(PROMPT, add_special_tokens=False).ids
    upto = len(ids) - 1
    data = _call(prefill, "prefill", _request(ids, "p"), upto)
    assert isinstance(data, bytes) and len(data) == -(-upto // 16) * 4 * 2 * 2 * 16 * 64 * 4
    disagg = _call(decode, "decode_from", _request(ids, "d"), data, upto)
    solo = _call(prefill, "generate", _request(ids, "solo"))
    assert disagg == solo
    assert len(set(solo)) > 3


def test_request_detached_in_one_process_resumes_in_another(workers):
    from kvmesh.preprocess.tokenizer import load_tokenizers_file

    source, target = workers
    ids = load_tokenizers_file(bundled_model_path() / "tokenizer.json").encode(PROMPT, add_special_tokens=False).ids
    solo = _call(source, "generate", _request(ids, "solo"))
    delivered, computed, data = _call(source, "generate", _request(ids, "mig"), 8)
    assert 8 <= len(delivered) < MAX_TOKENS and computed == len(ids) + len(delivered) - 1
    rest = _call(target, "decode_from", _request(ids + delivered, "mig", MAX_TOKENS - len(delivered)), data, computed)
    assert delivered + rest == solo
