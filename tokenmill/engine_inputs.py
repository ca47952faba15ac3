"""What an engine is built from: the resolved model, its settings and its tokenizer.

`create_engine` (tokenmill/engine_factory.py) then picks the engine that serves the model;
`LLMEngine.from_engine_args` (vLLM's constructor) builds the generation engine from the same.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs, EngineConfig
    from tokenmill.models.source import ModelSource


def resolve_engine_inputs(args: "EngineArgs") -> tuple["EngineConfig", "ModelSource", Any]:
    """The model (with ``hf_overrides`` applied), the engine's settings and the tokenizer (None with
    skip_tokenizer_init); seeds Python's, numpy's and torch's global generators with ``args.seed``."""

    from tokenmill.config import resolve_config
    from tokenmill.models.token_classifier import classifier_token_ids, classifier_tokens

    source = resolve_source(args)
    from_tokens = classifier_tokens(source.hf_config)  # sets num_labels before the pooling settings read it
    config = resolve_config(args, source)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(source, args)
    if tokenizer is not None and config.pooling is None:
        # As vLLM loads a generation model's tokenizer: text cut in the tokenizer (truncation=True,
        # SamplingParams.truncate_prompt_tokens) keeps its last tokens.
        tokenizer.truncation_side = "left"
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and not isinstance(eos, bool):  # as vLLM: the tokenizer's eos ends a sequence too
        config = dataclasses.replace(config, eos_token_ids=config.eos_token_ids | {eos}, primary_eos_token_id=eos)
    if from_tokens is not None:
        source.hf_config.classifier_token_ids = classifier_token_ids(from_tokens[0], tokenizer)
    seed_global_generators(args.seed)
    return config, source, tokenizer


def resolve_source(args: "EngineArgs") -> "ModelSource":
    """The model ``args`` name, found (a local path, a built-in, the hub cache) and its config read,
    ``hf_overrides`` applied; no weights are read."""
    from tokenmill.models.source import apply_hf_overrides, resolve_model

    source = resolve_model(
        args.model, tokenizer=args.tokenizer, revision=args.revision, gguf_file=args.gguf_file,
        trust_remote_code=args.trust_remote_code, dtype=args.dtype, device=args.device, load_format=args.load_format,
    )
    return apply_hf_overrides(source, args.hf_overrides) if args.hf_overrides else source


def seed_global_generators(seed: int) -> None:
    """As vLLM's workers do when they start (vLLM's reproducibility example relies on it): the
    caller's ``random`` and numpy draws after ``LLM(seed=s)`` are the same on every run."""
    import random

    import numpy
    import torch

    random.seed(seed)
    numpy.random.seed(seed % 2**32)  # numpy takes 32-bit seeds only; every int seed stays usable
    torch.manual_seed(seed)


def load_tokenizer(source: "ModelSource", args: "EngineArgs") -> Any:
    from tokenmill.models.source import tokenizer_class

    path = source.tokenizer_path
    kwargs = dict(source.tokenizer_kwargs)
    if args.tokenizer_revision:
        kwargs["revision"] = args.tokenizer_revision
    if args.tokenizer_mode == "slow":
        kwargs["use_fast"] = False
    try:
        if "gguf_file" in kwargs:  # load_format="gguf": the file's own tokenizer, as llama.cpp reads it
            from tokenmill.models.gguf_tokenizer import load_gguf_tokenizer

            rest = {k: v for k, v in kwargs.items() if k != "gguf_file"}
            # A config read from the same file (no config.json beside it) tells the tokenizer's class.
            model_type = source.hf_config.model_type if source.config_dir is None else None
            return load_gguf_tokenizer(Path(path) / kwargs["gguf_file"], source.gguf_reader, model_type=model_type,
                                       trust_remote_code=args.trust_remote_code, **rest)
        cls = tokenizer_class(path, kwargs)
        return cls.from_pretrained(path, trust_remote_code=args.trust_remote_code, **kwargs)
    except Exception as exc:  # transformers raises many types; the user needs the path
        if "gguf_file" not in kwargs and _has_no_tokenizer_files(path):
            # transformers' message then blames a missing sentencepiece or tiktoken.
            raise ValueError(
                f"{path} has no tokenizer files (none of {list(_TOKENIZER_FILES)}): give tokenizer= (a folder or "
                "cached hub id that has them), or skip_tokenizer_init=True to pass and get token ids only"
            ) from exc
        raise ValueError(f"could not load the tokenizer from {path!r}: {exc}") from exc


# The files transformers builds a tokenizer from (fast, SentencePiece, BPE, WordPiece, tiktoken).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "*.tiktoken")


def _has_no_tokenizer_files(path: str) -> bool:
    folder = Path(path)
    return folder.is_dir() and not any(next(folder.glob(pattern), None) for pattern in _TOKENIZER_FILES)
