"""kvmesh: a distributed LLM inference runtime.

The public API: the engine contract, the wire types and the error tree. Everything
else is reached through its module (``kvmesh.frontend``, ``kvmesh.worker``, ...).
"""

from kvmesh.engines.base import Engine
from kvmesh.errors import KvmeshError
from kvmesh.protocol import EngineConfig, OutputChunk, PreprocessedRequest
from kvmesh.runtime.context import Context

__all__ = ["Context", "Engine", "EngineConfig", "KvmeshError", "OutputChunk", "PreprocessedRequest", "__version__"]

__version__ = "0.1.0"
