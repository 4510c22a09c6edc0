"""Preprocessing: model folders, chat templates, tokenization, streaming detokenization, stop strings.

The frontend builds one :class:`Preprocessor` per served model and, per request, one
``IncrementalDetokenizer`` and one ``StopMatcher``.

The package's names resolve on first use (PEP 562 ``__getattr__``): reading a model
folder (:mod:`.model`, what ``kvmesh run`` does before it forks its workers, and what a
worker does) loads neither the tokenizers library nor the template engine (issue 36).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.lazy import lazy_names

if TYPE_CHECKING:
    from kvmesh.preprocess.model import BUNDLED_MODEL_NAME, ModelInfo, bundled_model_path, load_model_folder
    from kvmesh.preprocess.preprocessor import Preprocessor
    from kvmesh.preprocess.stop import StopMatcher
    from kvmesh.preprocess.template import ChatTemplate
    from kvmesh.preprocess.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "BUNDLED_MODEL_NAME",
    "ChatTemplate",
    "IncrementalDetokenizer",
    "ModelInfo",
    "Preprocessor",
    "StopMatcher",
    "Tokenizer",
    "bundled_model_path",
    "load_model_folder",
]

_HOME = {
    "BUNDLED_MODEL_NAME": "model",
    "ModelInfo": "model",
    "bundled_model_path": "model",
    "load_model_folder": "model",
    "Preprocessor": "preprocessor",
    "StopMatcher": "stop",
    "ChatTemplate": "template",
    "IncrementalDetokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
}


__getattr__ = lazy_names(__name__, _HOME)
