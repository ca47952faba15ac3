"""tokenmill: offline batch inference for large language models, with vLLM's offline API.

Public names load lazily so `import tokenmill` (and the CLI's --help) stays fast; torch and
transformers are imported only when an engine is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "tokenmill.llm",
    "LLMEngine": "tokenmill.engine.engine",
    "LoRARequest": "tokenmill.lora.request",
    "EngineArgs": "tokenmill.config",
    "PromptType": "tokenmill.inputs",
    "TextPrompt": "tokenmill.inputs",
    "TokensPrompt": "tokenmill.inputs",
    "SamplingParams": "tokenmill.sampling_params",
    "BeamSearchParams": "tokenmill.sampling_params",
    "RequestOutputKind": "tokenmill.sampling_params",
    "RepetitionDetectionParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.structured_outputs",
    "GuidedDecodingParams": "tokenmill.structured_outputs",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "Logprob": "tokenmill.logprobs",
    "BeamSearchOutput": "tokenmill.outputs",
    "BeamSearchSequence": "tokenmill.outputs",
    "PoolingParams": "tokenmill.pooling_params",
    "PoolerConfig": "tokenmill.pooling.config",
    "PoolingOutput": "tokenmill.outputs",
    "PoolingRequestOutput": "tokenmill.outputs",
    "EmbeddingOutput": "tokenmill.outputs",
    "EmbeddingRequestOutput": "tokenmill.outputs",
    "ClassificationOutput": "tokenmill.outputs",
    "ClassificationRequestOutput": "tokenmill.outputs",
    "ScoringOutput": "tokenmill.outputs",
    "ScoringRequestOutput": "tokenmill.outputs",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.inputs import PromptType, TextPrompt, TokensPrompt
    from tokenmill.llm import LLM
    from tokenmill.logprobs import Logprob
    from tokenmill.lora.request import LoRARequest
    from tokenmill.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from tokenmill.pooling.config import PoolerConfig
    from tokenmill.pooling_params import PoolingParams
    from tokenmill.sampling_params import BeamSearchParams, RepetitionDetectionParams, RequestOutputKind, SamplingParams
    from tokenmill.structured_outputs import GuidedDecodingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
