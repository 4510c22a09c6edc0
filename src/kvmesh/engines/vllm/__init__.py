"""The ``vllm`` engine: a kvmesh worker over vLLM's async engine (see :mod:`.engine`).

Importing this package does not import vLLM; :meth:`VllmEngine.start` does, and says
how to install it when it is missing.
"""

from kvmesh.engines.vllm.engine import VLLM_INSTALL_HINT, VllmEngine
from kvmesh.engines.vllm.options import VllmOptions

__all__ = ["VllmEngine", "VllmOptions", "VLLM_INSTALL_HINT"]
