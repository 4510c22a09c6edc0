"""The mocker: a simulated vLLM-v1-style engine, the GPU stand-in of tests and benchmarks.

Modules, bottom up: :mod:`.options` (configuration and timing model), :mod:`.tokens`
(deterministic output tokens), :mod:`.block_manager` (KV pool, prefix cache, KV
events), :mod:`.scheduler` (continuous batching), :mod:`.engine` (the real-time
:class:`~kvmesh.engines.base.Engine`), :mod:`.sim` (virtual-clock driver for replays).
"""

from kvmesh.engines.mocker.engine import MockerEngine
from kvmesh.engines.mocker.options import MockerOptions

__all__ = ["MockerEngine", "MockerOptions"]
