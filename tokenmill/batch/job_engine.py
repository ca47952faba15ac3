"""The engine a `tokenmill run` job drives, and what the job reads from it: loaded from the job's
settings, the model's default sampling values under the job's own, and how many sequences it runs
at once (which sizes the rows the job keeps in flight); a tensor-parallel size checked against the
model's config before replicas start."""

from __future__ import annotations

from typing import Any

from tokenmill.batch.config import JobConfig


def load_llm(config: JobConfig) -> Any:
    from tokenmill import LLM

    return LLM(model=config.model, seed=config.seed, **_engine_kwargs(config))


def _engine_kwargs(config: JobConfig) -> dict[str, Any]:
    engine = dict(config.engine)
    if config.task != "generate":
        engine.setdefault("runner", "pooling")
    return engine


def check_tensor_parallel_fits(config: JobConfig) -> None:
    """Refuse a tensor_parallel_size the job's model cannot be split over, from the model's config
    alone (no weights read), as ``LLM()`` would: the parent of ``--replicas`` checks it before
    starting replica processes that would each fail in their own ``LLM()``. A pooling job is left
    to ``LLM()``, which checks only generation models."""
    tp_size = config.engine.get("tensor_parallel_size")
    if config.task != "generate" or tp_size is None or tp_size == 1:
        return
    from tokenmill.config import EngineArgs
    from tokenmill.tensor_parallel_shapes import check_tensor_parallel
    from tokenmill.engine_inputs import resolve_source

    args = EngineArgs.from_kwargs(config.model, seed=config.seed, **_engine_kwargs(config))
    check_tensor_parallel(args.tensor_parallel_size, resolve_source(args).hf_config)


def base_sampling(llm: Any, explicit: dict[str, Any]) -> dict[str, Any]:
    """The model's defaults (generation_config), then the job's explicit values."""
    from tokenmill.batch.requests import sampling_field_names

    names = sampling_field_names()
    defaults = llm.get_default_sampling_params()
    values = {name: getattr(defaults, name) for name in names if hasattr(defaults, name)}
    values.update(explicit)
    return values


def max_num_seqs(engine: Any, config: JobConfig) -> int:
    """The engine's max_num_seqs (its config's, wherever this engine keeps it), else the job's setting."""
    for holder in (getattr(engine, "config", None), getattr(engine, "scheduler_config", None), getattr(engine, "scheduler", None)):
        value = getattr(holder, "max_num_seqs", None)
        if isinstance(value, int) and value > 0:
            return value
    return int(config.engine.get("max_num_seqs") or 256)
