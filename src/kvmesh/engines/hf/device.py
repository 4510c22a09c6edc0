"""Where the hf engine runs and in what: the device and dtype from the options, the KV
pool's share of a GPU, and the CUDA graphs that replay decode passes.

* :func:`resolve_device` / :func:`resolve_dtype`: ``auto`` is the first CUDA GPU when one
  is visible (else the CPU), and float32 on the CPU, the model's own 16-bit dtype (else
  bfloat16) on a GPU.
* :func:`gpu_kv_bytes`: the bytes the KV pool may take on a GPU: ``fraction`` of the
  card, less what this process already holds (weights, the CUDA context), less the peak
  of the largest pass measured by running one (:func:`profile_peak`), never more than
  is free (another worker may share the card).
* :class:`DecodeGraphs`: one CUDA graph per batch-size bucket, captured at start over
  :class:`~kvmesh.engines.hf.batch.DecodeBuffers`; a decode batch is copied into the
  buffers and the smallest bucket that holds it is replayed (no kernel launches from
  Python: what makes a small model's decode step cost its memory traffic, not its
  ~15 launches per layer).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvmesh.engines.hf.batch import Chunk, DecodeBuffers, make_paged_inputs
from kvmesh.engines.hf.kv import KvPool
from kvmesh.engines.hf.model import LlamaModel
from kvmesh.errors import InvalidArgument

__all__ = ["resolve_device", "resolve_dtype", "gpu_kv_bytes", "kv_budget", "profile_peak", "DecodeGraphs", "graph_buckets"]

_log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CONTEXT_BYTES = 512 << 20  # a CUDA context and cuBLAS workspaces, not in torch's counters
_GRAPH_MAX_CONTEXT = 16384  # decode graphs serve contexts up to this; longer ones run eagerly


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"--device {name}: no CUDA GPU is visible to this process (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InvalidArgument(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return device


def resolve_dtype(name: str, device: torch.device, folder: str | Path | None = None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    saved = _saved_dtype(folder)
    return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16


def _saved_dtype(folder: str | Path | None) -> torch.dtype | None:
    if folder is None:
        return None
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""))


def profile_peak(model: LlamaModel, tokens: int, block_size: int) -> int:
    """Bytes the activations of one prefill pass of ``tokens`` tokens peak at (run once,
    into a throwaway pool)."""
    s = model.spec
    blocks = -(-tokens // block_size)
    pool = KvPool(blocks, block_size, s.num_layers, s.num_kv_heads, s.head_dim, dtype=model.dtype, device=model.device)
    chunk = Chunk([0] * tokens, 0, list(range(blocks)), True)
    inputs = make_paged_inputs([chunk], block_size, model.device)
    torch.cuda.synchronize(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    before = torch.cuda.memory_allocated(model.device)
    model.forward(inputs, pool)
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - before
    del pool, inputs
    torch.cuda.empty_cache()
    return peak


def gpu_kv_bytes(device: torch.device, fraction: float, activation_peak: int, logits_rows: int, vocab: int) -> int:
    """The KV pool's budget on ``device`` now (see :func:`kv_budget`)."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device) + _CONTEXT_BYTES
    return kv_budget(total, free, held, fraction, activation_peak + 4 * logits_rows * vocab * 4)


def kv_budget(total: int, free: int, held: int, fraction: float, reserve: int) -> int:
    """Bytes for the KV pool: ``fraction`` of the card's ``total`` less what this process
    ``held`` already and the ``reserve`` its passes need (activations, the sampler's rows;
    plus 256 MiB for the graphs' pool), never more than is ``free`` less that reserve
    (another process may share the card); 0 when nothing is left."""
    reserve += 256 << 20
    return max(0, min(int(total * fraction) - held - reserve, free - reserve))


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 8 up to 64, every 32
    past it, and ``max_batch`` itself."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(96, max_batch + 1, 32), max_batch]
    return sorted({b for b in sizes if b <= max_batch})


class DecodeGraphs:
    """Decode passes replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, model: LlamaModel, pool: KvPool, max_batch: int, context: int) -> None:
        self.model, self.pool = model, pool
        max_blocks = -(-min(context, _GRAPH_MAX_CONTEXT) // pool.block_size)
        self.buffers = DecodeBuffers(max_batch, max_blocks, pool.scratch_block, pool.block_size, model.device)
        self.buckets = graph_buckets(max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0

    def capture(self) -> float:
        """Capture every bucket (largest first, one shared memory pool); the seconds taken."""
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        for batch in sorted(self.buckets, reverse=True):
            self.buffers.fill([], batch)
            inputs = self.buffers.inputs(batch)
            for _ in range(2):  # warm up before the capture: Triton compiles, cuBLAS picks its kernels
                self.model.forward(inputs, self.pool)
            torch.cuda.synchronize(self.model.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                logits = self.model.forward(inputs, self.pool)
            self._graphs[batch] = (graph, logits)
        torch.cuda.synchronize(self.model.device)
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    def bucket(self, chunks: Sequence[Chunk]) -> int | None:
        """The bucket that replays ``chunks``, or None (not a decode batch that fits)."""
        if not self._graphs or not self.buffers.fits(chunks):
            return None
        return next((b for b in self.buckets if b >= len(chunks)), None)

    def run(self, chunks: Sequence[Chunk], batch: int) -> torch.Tensor:
        """Logits (len(chunks), vocab) of the decode ``chunks`` through bucket ``batch``
        (a view of the graph's output: read it before the next replay)."""
        self.buffers.fill(chunks, batch)
        graph, logits = self._graphs[batch]
        graph.replay()
        return logits[: len(chunks)]
