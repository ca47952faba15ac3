"""Starting the engine: resolve the model, its settings and tokenizer, then pick the engine
that serves it, once: `LLMEngine` (generation) or `PoolingEngine` (tokenmill/pooling/)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs
    from tokenmill.engine.protocol import Engine
    from tokenmill.models.source import ModelSource


def create_engine(args: "EngineArgs") -> "Engine":
    """Resolve the model, its settings and tokenizer, then start the engine that serves it."""
    import torch

    from tokenmill.config import resolve_config
    from tokenmill.models.source import resolve_model

    source = resolve_model(
        args.model, tokenizer=args.tokenizer, revision=args.revision, gguf_file=args.gguf_file,
        trust_remote_code=args.trust_remote_code,
    )
    config = resolve_config(args, source)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(source, args)
    torch.manual_seed(args.seed)
    if config.pooling is not None:
        from tokenmill.pooling.engine import PoolingEngine

        return PoolingEngine(config, source, tokenizer, args.load_format)
    from tokenmill.engine.engine import LLMEngine

    return LLMEngine(config, source, tokenizer, args.load_format)


def load_tokenizer(source: "ModelSource", args: "EngineArgs") -> Any:
    from tokenmill.models.source import tokenizer_class

    path = source.tokenizer_path
    kwargs = dict(source.tokenizer_kwargs)
    if args.tokenizer_revision:
        kwargs["revision"] = args.tokenizer_revision
    try:
        cls = tokenizer_class(path, kwargs)
        return cls.from_pretrained(path, trust_remote_code=args.trust_remote_code, **kwargs)
    except Exception as exc:  # transformers raises many types; the user needs the path
        raise ValueError(f"could not load the tokenizer from {path!r}: {exc}") from exc
