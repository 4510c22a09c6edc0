"""The vllm engine's pure parts: request → SamplingParams kwargs, vLLM deltas →
OutputChunks, options. No vLLM needed (tests/vllm/ runs the real engine, opt-in)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvmesh.engines.vllm.mapping import OutputMapper, sampling_kwargs
from kvmesh.engines.settings import VllmSettings, options_from
from kvmesh.engines.vllm.options import VllmOptions
from kvmesh.protocol import OutputOptions, PreprocessedRequest, SamplingOptions, StopConditions, TokenLogprob, Usage
from kvmesh.settings import resolve


@dataclass
class Lp:  # the shape of vllm.logprobs.Logprob
    logprob: float
    rank: int
    decoded_token: str | None = None


def _from_env(env: dict[str, str], **given: object) -> VllmOptions:
    return options_from(VllmOptions, resolve(VllmSettings, env=env), **given)


def _request(**kw) -> PreprocessedRequest:
    base = dict(request_id="r", model="m", token_ids=[5, 6, 7], eos_token_ids=[2])
    base.update(kw)
    return PreprocessedRequest(**base)


def test_sampling_kwargs_pass_set_fields_only():
    req = _request(
        sampling=SamplingOptions(temperature=0.0, top_k=5, seed=7),
        stop=StopConditions(max_tokens=9, min_tokens=2, stop=["x"], stop_token_ids=[11]),
        output=OutputOptions(logprobs=3),
    )
    kw = sampling_kwargs(req, vllm_eos=[2])
    assert kw == {
        "n": 1, "detokenize": False, "skip_special_tokens": False, "temperature": 0.0, "top_k": 5, "seed": 7,
        "max_tokens": 9, "min_tokens": 2, "ignore_eos": False, "stop_token_ids": [11], "logprobs": 3,
    }  # fmt: skip
    assert "stop" not in kw  # stop strings are the frontend's


def test_request_eos_unknown_to_vllm_becomes_a_stop_token():
    req = _request(eos_token_ids=[2, 3], stop=StopConditions(max_tokens=4, stop_token_ids=[3, 9]))
    assert sampling_kwargs(req, vllm_eos=[2])["stop_token_ids"] == [3, 9]
    assert sampling_kwargs(req, vllm_eos=[])["stop_token_ids"] == [3, 9, 2]
    ignoring = _request(eos_token_ids=[2, 3], stop=StopConditions(max_tokens=4, ignore_eos=True))
    kw = sampling_kwargs(ignoring, vllm_eos=[])
    assert kw["ignore_eos"] is True and "stop_token_ids" not in kw


def test_stream_of_deltas_to_chunks_with_usage_and_cached_tokens():
    m = OutputMapper(_request(), vllm_eos=[2])
    first = m.chunk([40], None, None, None, num_cached_tokens=32)
    assert first.token_ids == [40] and first.cached_tokens == 32 and not first.is_terminal
    second = m.chunk([41], None, None, None, num_cached_tokens=32)
    assert second.cached_tokens is None  # said once
    last = m.chunk([42], None, "length", None, num_cached_tokens=32)
    assert last.finish_reason == "length" and last.token_ids == [42]
    assert last.usage == Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=32)


def test_eos_is_not_emitted_a_stop_token_is():
    eos = OutputMapper(_request(), vllm_eos=[2]).chunk([40, 2], None, "stop", None)
    assert eos.token_ids == [40] and eos.finish_reason == "stop" and eos.usage.completion_tokens == 1
    # an EOS id kvmesh passed as a stop token id is still an EOS
    added = OutputMapper(_request(eos_token_ids=[2, 3]), vllm_eos=[2]).chunk([3], None, "stop", 3)
    assert added.token_ids == [] and added.finish_reason == "stop"
    user = _request(stop=StopConditions(max_tokens=5, stop_token_ids=[3]), eos_token_ids=[2, 3])
    stop_id = OutputMapper(user, vllm_eos=[2]).chunk([40, 3], None, "stop", 3)
    assert stop_id.token_ids == [40, 3] and stop_id.usage.completion_tokens == 2


def test_abort_and_unknown_reasons():
    cancelled = OutputMapper(_request()).chunk([], None, "abort")
    assert cancelled.finish_reason == "cancelled"
    failed = OutputMapper(_request()).chunk([], None, "repetition")
    assert failed.finish_reason == "error" and "repetition" in failed.error


def test_migrated_request_counts_the_original_prompt():
    m = OutputMapper(_request(token_ids=[5, 6, 7, 40, 41], original_prompt_len=3))
    assert m.chunk([42], None, "length").usage.prompt_tokens == 3


def test_logprobs_chosen_and_top_n_by_rank():
    m = OutputMapper(_request(output=OutputOptions(logprobs=1)), vllm_eos=[2])
    entry = {40: Lp(-0.5, 2), 50: Lp(-0.2, 1)}  # sampled 40, which was not the top token
    out = m.chunk([40, 2], [entry, {2: Lp(-0.1, 1)}], "stop")
    assert out.token_ids == [40]
    assert out.logprobs == [TokenLogprob(40, -0.5, [(50, -0.2)])]
    only_chosen = OutputMapper(_request(output=OutputOptions(logprobs=0))).chunk([40], [entry], None)
    assert only_chosen.logprobs == [TokenLogprob(40, -0.5, [])]


def test_options_validate_and_read_the_environment():
    with pytest.raises(ValueError, match="block_size"):
        VllmOptions(model="m", block_size=0)
    with pytest.raises(ValueError, match="engine_args"):
        VllmOptions(model="m", engine_args={"model": "other"})
    env = {
        "KVMESH_VLLM_BLOCK_SIZE": "64",
        "KVMESH_VLLM_ENFORCE_EAGER": "1",
        "KVMESH_VLLM_KV_CACHE_GB": "2",
        "KVMESH_VLLM_KV_TRANSFER_CONFIG": '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}',
    }
    opts = _from_env(env, model="/models/x", served_model_name="x", worker_id=7)
    assert (opts.block_size, opts.enforce_eager, opts.kv_cache_gb, opts.worker_id) == (64, True, 2, 7)
    assert opts.kv_transfer_config == {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    kw = opts.engine_kwargs()
    assert kw["model"] == "/models/x" and kw["block_size"] == 64 and "max_model_len" not in kw
    with pytest.raises(ValueError, match="KVMESH_VLLM_MAX_MODEL_LEN"):
        _from_env({"KVMESH_VLLM_MAX_MODEL_LEN": "lots"}, model="m")
    with pytest.raises(ValueError, match="JSON object"):
        _from_env({"KVMESH_VLLM_ENGINE_ARGS": "[1]"}, model="m")


def test_vllm_exceptions_map_onto_the_kvmesh_tree():
    from types import SimpleNamespace

    from kvmesh.engines.vllm.engine import _kvmesh_error
    from kvmesh.errors import EngineShutdown, InvalidArgument, ResourceExhausted, Unknown

    class Dead(Exception): ...

    class Graceful(Exception): ...

    class Client(Exception): ...

    names = SimpleNamespace(EngineDeadError=Dead, GracefulHTTPError=Graceful, VLLMClientError=Client)
    assert type(_kvmesh_error(names, Dead("gone"))) is EngineShutdown
    assert type(_kvmesh_error(names, Graceful("queue full"))) is ResourceExhausted
    assert type(_kvmesh_error(names, Client("prompt too long"))) is InvalidArgument
    assert type(_kvmesh_error(names, ValueError("bad"))) is InvalidArgument
    wrapped = RuntimeError("generate failed")
    wrapped.__cause__ = KeyError("x")
    err = _kvmesh_error(names, wrapped)
    assert type(err) is Unknown and "KeyError" in err.message


def test_cpu_defaults_the_models_own_dtype_and_a_kv_cache_from_available_memory(tmp_path):
    from kvmesh.engines.vllm.options import default_kv_cache_gb, mem_available_bytes, model_dtype
    from kvmesh.preprocess.model import bundled_model_path

    # float32 weights stay float32 (vLLM's "auto" would make them bfloat16 on a CPU)
    assert model_dtype(str(bundled_model_path())) == "float32"
    assert VllmOptions(model=str(bundled_model_path())).engine_kwargs()["dtype"] == "float32"
    assert VllmOptions(model=str(bundled_model_path()), dtype="bfloat16").engine_kwargs()["dtype"] == "bfloat16"
    assert model_dtype(str(tmp_path)) is None and VllmOptions(model=str(tmp_path)).engine_kwargs()["dtype"] == "auto"
    # a quarter of what is available now, within bounds (vLLM's own default wants most of the node)
    gib = 1 << 30
    assert default_kv_cache_gb(8 * gib) == 2
    assert default_kv_cache_gb(gib // 2) == 1 and default_kv_cache_gb(512 * gib) == 16
    assert default_kv_cache_gb(int(22.2 * gib)) == 5  # whole GiB: vLLM refuses "5.55"
    assert default_kv_cache_gb(None) is None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable: 2048 kB\n")
    assert mem_available_bytes(str(meminfo)) == 2048 * 1024
    assert mem_available_bytes(str(tmp_path / "none")) is None
