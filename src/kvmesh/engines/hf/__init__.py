"""The ``hf`` engine: a Llama-family Hugging Face model on the CPU through PyTorch.

Needs the optional extra ``hf`` (``pip install -e '.[hf]'``); importing this package
without torch raises ImportError naming that command.
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the hf engine needs PyTorch: pip install -e '.[hf]'") from exc

from kvmesh.engines.hf.engine import EngineStats, HfEngine
from kvmesh.engines.hf.options import HfOptions

__all__ = ["HfEngine", "HfOptions", "EngineStats"]
