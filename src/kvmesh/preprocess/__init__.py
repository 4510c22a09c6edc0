"""Preprocessing: model folders, chat templates, tokenization, streaming detokenization, stop strings.

The frontend builds one :class:`Preprocessor` per served model and, per request, one
``IncrementalDetokenizer`` and one ``StopMatcher``.
"""

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
