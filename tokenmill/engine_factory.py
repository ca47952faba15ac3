"""Starting the engine: resolve the model, its settings and tokenizer (tokenmill/engine_inputs.py),
then pick the engine that serves it, once: `LLMEngine` (generation) or `PoolingEngine`
(tokenmill/pooling/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.engine_inputs import resolve_engine_inputs

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs
    from tokenmill.engine.protocol import Engine


def create_engine(args: "EngineArgs") -> "Engine":
    """Resolve the model, its settings and tokenizer, then start the engine that serves it."""
    config, source, tokenizer = resolve_engine_inputs(args)
    if config.pooling is not None:
        from tokenmill.pooling.engine import PoolingEngine

        return PoolingEngine(config, source, tokenizer, args.load_format)
    from tokenmill.engine.engine import LLMEngine

    return LLMEngine(config, source, tokenizer, args.load_format)
