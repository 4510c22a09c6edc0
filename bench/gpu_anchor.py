"""The anchor of the GPU check: what plain transformers does on the same GPU, in the same
run, with the same weights, so that kvmesh's figures are read against a baseline measured
beside them rather than against a figure from another machine or day.

Used by ``bench/gpu.py``; importing this module does nothing (torch and transformers are
imported inside the functions). The measurements:

* :func:`copy_bandwidth` -- device-to-device copy bandwidth, bytes read + bytes written
  per second. Batch-1 decode reads every weight once per token, so
  ``copy_bandwidth() / weight_bytes`` is the memory-bandwidth limit of batch-1 decode in
  tokens/s (an upper bound no engine reaches: the KV cache, activations and launch gaps
  come on top).
* :func:`build_hf_model` -- transformers' ``LlamaForCausalLM`` from a ``config.json``
  dict, made on the meta device and given the caller's tensors with
  ``load_state_dict(assign=True)`` (no second copy of the weights; ``sdpa`` attention).
* :func:`hf_generate_tps` -- batch-1 greedy ``model.generate``: new tokens / wall seconds
  of the whole call (prefill included), after a warm-up run of the same length; plus the
  prefill alone and the decode rate without it.
* :func:`hf_generate_batch_tps` -- transformers' continuous batching (the manager behind
  ``model.generate_batch``): ``n`` random prompts at once, generated tokens / wall seconds
  from submitting them to the last one finished (its own warm-up, CUDA graph capture,
  timed apart).
* :func:`hf_greedy_tokens` -- the first ``n`` greedy tokens of each prompt, batch 1, EOS
  disabled: to compare with kvmesh's engine on the same weights.

Every generation here disables EOS (the random weights of ``--random-weights`` would
otherwise stop a sequence at an arbitrary point) and checks that exactly the asked
number of tokens came out. Timings are wall-clock seconds between
``torch.cuda.synchronize()`` calls (``time.perf_counter``); on a CPU device, which the
functions also accept for a check without a GPU, there is nothing to synchronize.

A check on a tiny model, CPU or GPU (compares with kvmesh's own model when importable)::

    PYTHONPATH=src python bench/gpu_anchor.py --device cpu
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PreTrainedModel

__all__ = [
    "copy_bandwidth",
    "build_hf_model",
    "hf_generate_tps",
    "hf_generate_batch_tps",
    "hf_greedy_tokens",
    "tiny_config",
]

GB = 1e9  # bandwidths are in decimal gigabytes per second


# ---------------------------------------------------------------------------- helpers


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - the GPU machine has torch
        raise RuntimeError("gpu_anchor needs PyTorch") from exc
    return torch


def _sync(device: Any) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    torch = _torch()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _require_cuda(device: Any, what: str) -> None:
    torch = _torch()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{what}: device {device!r} asked for, but torch sees no CUDA device")


def _model_device(model: Any) -> Any:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        raise TypeError(f"expected a transformers model with parameters, got {type(model).__name__}") from None


def _check_model(model: Any, what: str) -> Any:
    """The model's device, after checking it is a causal LM with generate() and real weights."""
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise TypeError(f"{what}: expected a transformers causal LM (e.g. from build_hf_model), got {type(model).__name__}")
    device = _model_device(model)
    if device.type == "meta":
        raise ValueError(f"{what}: the model's weights are still on the meta device (load a state dict first)")
    return device


def _positive(what: str, **values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{what}: {name} must be a positive int, got {v!r}")


def _random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly from the vocabulary (seeded, on the CPU)."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()  # type: ignore[no-any-return]


def _greedy_config(new_tokens: int) -> GenerationConfig:
    """Greedy, exactly ``new_tokens`` tokens, no EOS, no logits processors."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,  # unused at batch 1; set so generate() does not warn or borrow the EOS
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
    )


@contextlib.contextmanager
def _no_model_eos(model: Any) -> Iterator[None]:
    """Within: the model's own generation config has no EOS either. generate() fills every
    field a passed config leaves None from ``model.generation_config`` (transformers 5.x),
    so an ``eos_token_id=None`` alone would bring the config.json's EOS back."""
    from transformers import GenerationConfig

    saved = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig(pad_token_id=0)
    try:
        yield
    finally:
        model.generation_config = saved


def _generate(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Batch-1 greedy generate of exactly ``new_tokens`` tokens; the new tokens."""
    torch = _torch()
    device = _model_device(model)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    with _no_model_eos(model), torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(new_tokens))
    seq = out.sequences if hasattr(out, "sequences") else out
    got = seq.shape[1] - ids.shape[1]
    if got != new_tokens:
        raise RuntimeError(f"generate() made {got} new tokens, {new_tokens} were asked for (EOS not disabled?)")
    return seq[0, ids.shape[1] :].tolist()  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- measurements


def copy_bandwidth(nbytes: int = 4 << 30, *, device: str = "cuda", reps: int = 10, warmups: int = 3) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes), counting the bytes read and
    the bytes written: each rep copies one ``nbytes`` buffer into another
    (``dst.copy_(src)``, 2 · ``nbytes`` of memory traffic).

    ``warmups`` untimed copies first, then ``reps`` copies each timed with its own pair of
    CUDA events; the median rep gives the figure (robust to a stray slow rep). The two
    buffers (2 · ``nbytes`` of device memory) are freed before returning. On a CPU device
    the reps are timed with ``perf_counter`` instead (memcpy bandwidth, for a check)."""
    torch = _torch()
    _positive("copy_bandwidth", nbytes=nbytes, reps=reps)
    if warmups < 0:
        raise ValueError(f"copy_bandwidth: warmups must be >= 0, got {warmups}")
    _require_cuda(device, "copy_bandwidth")
    n = max(1, nbytes // 4)  # float32 elements: the copy kernel's vectorised path
    try:
        src = torch.empty(n, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
    except torch.OutOfMemoryError as exc:
        raise RuntimeError(f"copy_bandwidth: two buffers of {n * 4 / GB:.2f} GB do not fit on {device}: {exc}") from None
    src.fill_(1.0)
    for _ in range(warmups):
        dst.copy_(src)
    _sync(device)
    times: list[float] = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    moved = 2 * n * 4
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    seconds = statistics.median(times)
    if seconds <= 0:
        raise RuntimeError("copy_bandwidth: a copy took no measurable time (buffer too small?)")
    return moved / seconds / GB


def build_hf_model(
    config: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    *,
    device: str = "cuda",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """transformers' ``LlamaForCausalLM`` for a ``config.json`` dict (e.g.
    ``kvmesh.engines.hf.shapes.shape_config("llama-1b")``) with the weights in
    ``state_dict`` (transformers' names, e.g. from ``shapes.hf_state_dict``).

    The module is made on the meta device (no memory, no random initialisation) and the
    given tensors become its parameters as they are (``load_state_dict(strict=True,
    assign=True)``): no second copy of the weights. A tensor not already on ``device`` in
    ``dtype`` (default bfloat16) is converted first, a copy of that tensor only. The
    rotary embedding's buffers, which no state dict holds, are then computed on
    ``device``; a tied output head is tied to the embeddings again. Returned in eval mode,
    gradients off, with ``attn_implementation`` (``"sdpa"``) attention and a generation
    config without EOS."""
    torch = _torch()
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if dtype is None else dtype
    if not isinstance(config, dict):
        raise TypeError(f"build_hf_model: config must be a config.json dict, got {type(config).__name__}")
    if not isinstance(state_dict, dict) or not state_dict:
        raise ValueError("build_hf_model: state_dict must be a non-empty dict of tensors")
    kind = config.get("model_type", "llama")
    if kind != "llama":
        raise ValueError(f"build_hf_model: builds LlamaForCausalLM only, config has model_type {kind!r}")
    _require_cuda(device, "build_hf_model")
    target = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as the tensors report it

    cfg = LlamaConfig.from_dict(dict(config))
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)

    tensors = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"build_hf_model: state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        tensors[name] = t if (t.device == target and t.dtype == dtype) else t.to(target, dtype)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"build_hf_model: the state dict does not match LlamaForCausalLM for this config: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    bad = [(n, tuple(t.shape), tuple(expected[n].shape)) for n, t in tensors.items() if t.shape != expected[n].shape]
    if bad:
        raise ValueError(f"build_hf_model: shapes differ from the config's (name, given, expected): {bad[:5]}")
    model.load_state_dict(tensors, strict=True, assign=True)

    # non-persistent buffers (RoPE inverse frequencies) are in no state dict: compute them on the device
    for name, module in list(model.named_modules()):
        if any(b.device.type == "meta" for b in module.buffers(recurse=False)):
            if "RotaryEmbedding" not in type(module).__name__:
                raise RuntimeError(f"build_hf_model: {name} ({type(module).__name__}) has buffers no state dict fills")
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device(target):
                setattr(parent, attr, type(module)(config=module.config))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"build_hf_model: still on the meta device after loading: {left[:5]}")
    model.requires_grad_(False)
    model.eval()
    model.generation_config = GenerationConfig(pad_token_id=0)  # no EOS: see _no_model_eos
    built: PreTrainedModel = model
    return built


def hf_generate_tps(
    model: PreTrainedModel,
    prompt_len: int = 128,
    new_tokens: int = 256,
    *,
    seed: int = 0,
    full_warmup: bool = True,
    reps: int = 2,
) -> dict[str, float]:
    """Batch-1 greedy ``model.generate`` of exactly ``new_tokens`` tokens (EOS disabled) after
    a random ``prompt_len``-token prompt.

    First an untimed-for-the-result warm-up: with ``full_warmup`` (default) the very same
    generate, so that every attention shape of the measured run has been seen once.
    This matters on a GPU: torch's SDPA picks cuDNN attention for bfloat16 on Hopper, and
    cuDNN builds an execution plan for each new KV length (~3 ms of CPU per layer call, the
    first time only), which alone makes a first run's decode several times slower
    (measured on an H200, llama-1b: 17.7 tokens/s cold vs ~55 warm). Its time is returned
    as ``first_run_seconds``. Without ``full_warmup``, 8 tokens only.

    Then, each between ``torch.cuda.synchronize()`` calls: a 1-token generate (the prefill
    and generate()'s own overhead: ``prefill_seconds``, the fastest of ``reps``) and
    ``reps`` measured ``new_tokens`` ones (warm runs still differ by ~20% on an H200,
    66 vs 79 tokens/s: the fastest is kept, ``median_seconds`` beside it). Returns
    ``tokens_per_s`` = ``new_tokens / seconds`` over the whole measured call (prefill
    included), ``seconds``, and ``decode_tokens_per_s`` =
    ``(new_tokens - 1) / (seconds - prefill_seconds)``, the steady decode rate."""
    device = _check_model(model, "hf_generate_tps")
    _positive("hf_generate_tps", prompt_len=prompt_len, new_tokens=new_tokens, reps=reps)
    (prompt,) = _random_prompts(model.config.vocab_size, 1, prompt_len, seed)

    def timed(tokens: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        _generate(model, prompt, tokens)
        _sync(device)
        return time.perf_counter() - t0

    first = timed(new_tokens if full_warmup else min(8, new_tokens))  # warm-up
    prefill = min(timed(1) for _ in range(reps))
    runs = [timed(new_tokens) for _ in range(reps)]
    seconds = min(runs)
    decode = seconds - prefill
    return {
        "tokens_per_s": new_tokens / seconds,
        "seconds": seconds,
        "median_seconds": statistics.median(runs),
        "prefill_seconds": prefill,
        "decode_tokens_per_s": (new_tokens - 1) / decode if new_tokens > 1 and decode > 0 else float("nan"),
        "first_run_seconds": first if full_warmup else float("nan"),
        "prompt_len": float(prompt_len),
        "new_tokens": float(new_tokens),
    }


def hf_generate_batch_tps(
    model: PreTrainedModel,
    n: int = 256,
    prompt_len: int = 512,
    new_tokens: int = 128,
    *,
    seed: int = 0,
    timeout_s: float = 600.0,
    cb_config: dict[str, Any] | None = None,
) -> dict[str, float]:
    """transformers' continuous batching on ``n`` random ``prompt_len``-token prompts,
    greedy, EOS disabled, ``new_tokens`` each: ``tokens_per_s`` = tokens generated /
    ``seconds``, the wall time from submitting every request to the last one finishing.

    This is ``model.generate_batch`` (transformers 5.x) taken apart, so that a stuck run
    ends: it opens the same manager the same way
    (``model.continuous_batching_context_manager`` with ``WorkloadHints`` of this workload,
    ``block=True, timeout=5``, ``warmup=True``), submits the prompts with
    ``manager.add_requests`` and collects results with ``manager.get_result(timeout=1)``
    until all have finished, failing after ``timeout_s`` seconds. The manager's
    warm-up (sizing the paged KV cache, capturing CUDA graphs) is timed apart:
    ``warmup_seconds``; ``generate_batch`` itself would include it, hence also
    ``with_warmup_tokens_per_s``.

    On entry transformers switches the model's attention to its paged variant
    (``"sdpa"`` becomes ``"paged|sdpa"``; a flash-attention build is used instead when one
    is installed) and restores it on exit. ``cb_config``: fields of
    ``transformers.ContinuousBatchingConfig`` (e.g. ``{"max_memory_percent": 0.5}``;
    default: its own defaults, the paged KV cache sized to 90% of the GPU memory free at
    entry: free it before, and expect the peak allocation near the card's size; the
    cache is freed on exit).

    Measured (transformers 5.17, torch 2.11, one H200, llama-1b random weights, default
    sizes): 29.3 s and 28.7 s in two calls (~1.1k tokens/s), warm-up 0.03-0.3 s (no CUDA
    graphs with ``paged|sdpa``), every request exactly ``new_tokens`` tokens."""
    torch = _torch()
    device = _check_model(model, "hf_generate_batch_tps")
    _positive("hf_generate_batch_tps", n=n, prompt_len=prompt_len, new_tokens=new_tokens)
    if not hasattr(model, "continuous_batching_context_manager"):
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} has no continuous batching (5.x has)")
    from transformers import ContinuousBatchingConfig

    hints: Any
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints as hints
    except ImportError:  # an older or newer layout: let the manager size itself
        hints = None

    prompts = _random_prompts(model.config.vocab_size, n, prompt_len, seed)
    gen_config = _greedy_config(new_tokens)
    gen_config.eos_token_id = -1  # continuous batching's own "no EOS" (None would take config.json's)
    kwargs: dict[str, Any] = {}
    if hints is not None:
        kwargs["workload_hints"] = hints(
            max_prompt_length=prompt_len, max_generated_length=new_tokens, num_requests=n
        )
    try:
        cb = ContinuousBatchingConfig(**(cb_config or {}))
    except TypeError as exc:
        raise ValueError(f"hf_generate_batch_tps: bad cb_config {cb_config!r}: {exc}") from None

    results: dict[str, Any] = {}
    cb_model: Any = model  # the method comes from transformers' ContinuousMixin
    _sync(device)
    t_enter = time.perf_counter()
    # no_grad, as generate_batch: inference-mode tensors would break the manager's thread
    with contextlib.ExitStack() as stack, _no_model_eos(model), torch.no_grad():
        manager = stack.enter_context(
            cb_model.continuous_batching_context_manager(
                generation_config=gen_config, continuous_batching_config=cb, block=True, timeout=5,
                persistent_manager=False, warmup=True, **kwargs,
            )
        )  # fmt: skip
        _sync(device)
        t0 = time.perf_counter()
        warmup = t0 - t_enter
        ids = manager.add_requests(inputs=prompts, max_new_tokens=new_tokens)
        if len(ids) != n:
            raise RuntimeError(f"hf_generate_batch_tps: the manager took {len(ids)} of {n} requests")
        deadline = t0 + timeout_s
        while len(results) < n:
            if time.perf_counter() > deadline:
                manager.stop(block=False, hard_stop=True)
                raise TimeoutError(
                    f"hf_generate_batch_tps: {len(results)} of {n} requests finished in {timeout_s:.0f} s"
                )
            result = manager.get_result(timeout=1)
            if result is not None:
                if result.is_finished():
                    results[result.request_id] = result
            elif not manager.is_running():
                raise RuntimeError(
                    f"hf_generate_batch_tps: the generation thread died after {len(results)} of {n} requests"
                )
        _sync(device)
        seconds = time.perf_counter() - t0
    failed = [(rid, r.error) for rid, r in results.items() if r.error is not None]
    if failed:
        raise RuntimeError(f"hf_generate_batch_tps: {len(failed)} requests failed, e.g. {failed[0]}")
    lengths = [len(r.generated_tokens) for r in results.values()]
    total = sum(lengths)
    return {
        "tokens_per_s": total / seconds,
        "seconds": seconds,
        "warmup_seconds": warmup,
        "with_warmup_tokens_per_s": total / (seconds + warmup),
        "generated_tokens": float(total),
        "requests": float(n),
        "min_tokens": float(min(lengths)),
        "max_tokens": float(max(lengths)),
    }


def hf_greedy_tokens(model: PreTrainedModel, prompts: Sequence[Sequence[int]], n: int = 32) -> list[list[int]]:
    """The first ``n`` greedy tokens after each prompt, one prompt at a time (batch 1: no
    padding), EOS disabled and no logits processors, so that each token is the argmax of
    the model's logits: comparable token for token with another engine on the same
    weights (up to ties and the dtype's rounding)."""
    _check_model(model, "hf_greedy_tokens")
    _positive("hf_greedy_tokens", n=n)
    vocab = model.config.vocab_size
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"hf_greedy_tokens: prompt {i} is empty")
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"hf_greedy_tokens: prompt {i} has token ids outside 0..{vocab - 1}")
        out.append(_generate(model, ids, n))
    return out


# ---------------------------------------------------------------------------- a check on a tiny model


def tiny_config(base: str = "llama-1b") -> dict[str, Any]:
    """A one-layer model of a named shape's kind (llama3 RoPE, GQA, tied head): for checks."""
    from kvmesh.engines.hf.shapes import shape_config

    return shape_config(base) | {
        "num_hidden_layers": 1, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "intermediate_size": 512, "vocab_size": 2048, "bos_token_id": 0, "eos_token_id": 1,
    }  # fmt: skip


def _kvmesh_greedy(spec: Any, weights: dict[str, Any], prompt: list[int], n: int) -> list[int]:
    """kvmesh's own model (fp32, unpaged passes): prefill, then ``n - 1`` decode steps."""
    torch = _torch()
    from kvmesh.engines.hf.batch import Chunk, make_inputs
    from kvmesh.engines.hf.kv import KvPool
    from kvmesh.engines.hf.model import LlamaModel

    model = LlamaModel(spec, weights)
    bs = 16
    blocks = -(-(len(prompt) + n) // bs)
    pool = KvPool(blocks, bs, spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=model.dtype, device=model.device)
    table = list(range(blocks))
    logits = model.forward(make_inputs([Chunk(prompt, 0, table, True)], bs), pool)
    out = [int(torch.argmax(logits[0]))]
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        logits = model.forward(make_inputs([Chunk([out[-1]], pos, table, True)], bs), pool)
        out.append(int(torch.argmax(logits[0])))
    return out


def _check_tiny(device: str, batch: bool) -> bool:
    """The tiny model in fp32 on ``device``: transformers' greedy tokens against kvmesh's own
    model (on the CPU), then each measurement once at toy sizes."""
    torch = _torch()
    from kvmesh.engines.hf.model import LlamaSpec
    from kvmesh.engines.hf.shapes import hf_state_dict, random_weights

    cfg = tiny_config()
    spec = LlamaSpec.from_config(cfg)
    prompts = _random_prompts(cfg["vocab_size"], 3, 20, seed=1)
    w32 = random_weights(spec, seed=0, device=device, dtype=torch.float32)
    model = build_hf_model(cfg, hf_state_dict(spec, w32), torch.float32, device=device)
    cpu_weights = {k: v.cpu() for k, v in w32.items()}
    ours = [_kvmesh_greedy(spec, cpu_weights, p, 16) for p in prompts]
    theirs = hf_greedy_tokens(model, prompts, 16)
    print("tiny fp32: greedy tokens, transformers == kvmesh:", ours == theirs, flush=True)
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]], device=device)
        ref = model(ids).logits[0, -1].float()
    print("tiny generate", hf_generate_tps(model, prompt_len=32, new_tokens=16), flush=True)
    if batch:
        # on the CPU the manager would size its cache from the machine's RAM: give it a small one
        small = {"num_blocks": 16, "max_batch_tokens": 256, "block_size": 16} if device == "cpu" else None
        print("tiny batch", hf_generate_batch_tps(model, n=4, prompt_len=16, new_tokens=8, timeout_s=120, cb_config=small))
        with torch.inference_mode():  # the attention implementation is restored after the batch
            again = model(ids).logits[0, -1].float()
        print("attention restored:", model.config._attn_implementation, torch.allclose(ref, again, atol=1e-5))
    return ours == theirs


def _anchor(shape: str, device: str, batch: bool) -> dict[str, Any]:
    """The anchor's figures for a named ``--random-weights`` shape, bfloat16 on ``device``."""
    torch = _torch()
    from kvmesh.engines.hf.model import LlamaSpec
    from kvmesh.engines.hf.shapes import hf_state_dict, random_weights, shape_config

    out: dict[str, Any] = {"shape": shape, "device": torch.cuda.get_device_name() if device != "cpu" else "cpu"}
    if device != "cpu":
        out["copy_GBps"] = copy_bandwidth(device=device)
    cfg = shape_config(shape)
    spec = LlamaSpec.from_config(cfg)
    model = build_hf_model(cfg, hf_state_dict(spec, random_weights(spec, seed=0, device=device, dtype=torch.bfloat16)), device=device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out["weight_GB"] = weight_bytes / GB
    if "copy_GBps" in out:
        out["bandwidth_limit_tps"] = out["copy_GBps"] * GB / weight_bytes
    out["generate"] = hf_generate_tps(model)
    out["greedy"] = hf_greedy_tokens(model, _random_prompts(spec.vocab_size, 2, 16, seed=7), 8)
    if batch:
        out["generate_batch"] = hf_generate_batch_tps(model)
    return out


def _main() -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="check gpu_anchor on a tiny model; --shape: the anchor of a named shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", action="store_true", help="also run continuous batching")
    ap.add_argument("--shape", help="also measure the anchor of this --random-weights shape (llama-1b, llama-8b)")
    a = ap.parse_args()
    ok = _check_tiny(a.device, a.batch)
    if a.shape:
        print(json.dumps(_anchor(a.shape, a.device, a.batch), indent=1), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())
