"""`build_llm_processor`: a Ray Data pipeline of preprocess → tokenmill replicas → postprocess.

    dataset ─► map(preprocess) ─► map_batches(TokenmillReplica, actor pool) ─► map(postprocess) ─► dataset
               row + its output     concurrency replicas, each one LLM;         error rows pass by
                                    batches stream in, results stream out

Same shape as ``ray.data.llm.build_llm_processor``: ``preprocess`` returns the columns the engine
reads (``messages`` or ``prompt``, ``sampling_params``...) and they are merged into the row, so
the row's own columns reach ``postprocess``, which sees them next to the result columns
(``generated_text``... see `tokenmill.ray.rows`). Rows stream through: the dataset may be far
larger than the cluster's memory. A row that failed (``__inference_error__`` set) skips
``postprocess`` and comes out with all its columns, as in Ray's processor.
"""

from __future__ import annotations

from typing import Any, Callable

from tokenmill.ray.config import TokenmillProcessorConfig
from tokenmill.ray.rows import ERROR_COLUMN

Row = dict[str, Any]


class Processor:
    """Apply to a `ray.data.Dataset` (``processor(ds)``); returns the processed dataset, not yet executed."""

    def __init__(self, config: TokenmillProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                 postprocess_map_kwargs: dict[str, Any] | None = None):
        if not isinstance(config, TokenmillProcessorConfig):
            raise TypeError(f"config must be a TokenmillProcessorConfig, got {type(config).__name__}")
        for name, fn in (("preprocess", preprocess), ("postprocess", postprocess)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function of a row (dict) returning a dict, got {type(fn).__name__}")
        for name, kwargs in (("preprocess_map_kwargs", preprocess_map_kwargs), ("postprocess_map_kwargs", postprocess_map_kwargs)):
            if kwargs is not None and not isinstance(kwargs, dict):
                raise TypeError(f"{name} must be a dict of Dataset.map keyword arguments, got {type(kwargs).__name__}")
        self.config = config
        self.preprocess, self.postprocess = preprocess, postprocess
        self.preprocess_map_kwargs = dict(preprocess_map_kwargs or {})
        self.postprocess_map_kwargs = dict(postprocess_map_kwargs or {})

    def __call__(self, dataset: Any) -> Any:
        if self.preprocess is not None:
            dataset = dataset.map(_MergePreprocess(self.preprocess, self.config.should_continue_on_error),
                                  **self.preprocess_map_kwargs)
        dataset = dataset.map_batches(**replica_map_kwargs(self.config))
        wait_for_replicas(dataset)
        if self.postprocess is not None:
            dataset = dataset.map(_Postprocess(self.postprocess, self.config.should_continue_on_error),
                                  **self.postprocess_map_kwargs)
        return dataset


def build_llm_processor(config: TokenmillProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                        postprocess: Callable[[Row], Row] | None = None,
                        preprocess_map_kwargs: dict[str, Any] | None = None,
                        postprocess_map_kwargs: dict[str, Any] | None = None) -> Processor:
    """A processor for ``config`` (``ray.data.llm.build_llm_processor``'s signature).

    Connects to Ray first if nothing has (``ray.init()`` with the config's runtime_env), as Ray's does.
    """
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(runtime_env=config.runtime_env)
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


def import_ray() -> Any:
    """The ray module, or an ImportError that says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(f"tokenmill's Ray path needs ray with Ray Data: pip install 'tokenmill[ray]' ({e})") from e
    return ray


def replica_map_kwargs(config: TokenmillProcessorConfig) -> dict[str, Any]:
    """``Dataset.map_batches`` arguments that run `TokenmillReplica` on an actor pool sized by ``config``."""
    from tokenmill.ray.replica import TokenmillReplica

    ray = import_ray()
    if not ray.is_initialized():
        ray.init(runtime_env=config.runtime_env)

    num_gpus = config.num_gpus
    if num_gpus is None:
        num_gpus = config.tensor_parallel_size if ray.cluster_resources().get("GPU", 0) > 0 else 0
    num_cpus = config.num_cpus if config.num_cpus is not None else 1
    engine = dict(config.engine_kwargs)
    engine.setdefault("device", "cuda" if num_gpus > 0 else "cpu")
    if config.task != "generate":
        engine.setdefault("runner", "pooling")
    smallest, largest = config.pool_size()
    per_actor = config.max_concurrent_batches
    kwargs: dict[str, Any] = dict(
        fn=TokenmillReplica,
        fn_constructor_kwargs=dict(
            model_source=config.model_source, engine_kwargs=engine, task=config.task,
            chat_template=config.chat_template, apply_chat_template=config.apply_chat_template,
            chat_template_kwargs=config.chat_template_kwargs,
            max_pending_requests=config.max_pending_requests,
            # A CPU replica's torch threads match its cores, so replicas do not oversubscribe the node.
            num_threads=max(1, int(num_cpus)) if num_gpus == 0 else None,
            continue_on_error=config.should_continue_on_error,
            lora_root=config.dynamic_lora_loading_path,
        ),
        batch_size=config.batch_size, batch_format="pyarrow", zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(
            min_size=smallest, max_size=largest,
            max_tasks_in_flight_per_actor=config.max_tasks_in_flight_per_actor or 2 * per_actor,
            # Several batches run in one replica at once, so its engine never drains between them.
            max_concurrent_calls_per_actor=per_actor, enable_true_multi_threading=per_actor > 1,
        ),
        num_gpus=num_gpus, num_cpus=num_cpus, udf_modifying_row_count=False,
    )
    if config.accelerator_type:
        kwargs["accelerator_type"] = config.accelerator_type
    extra = {k: v for k, v in (config.resources_per_bundle or {}).items() if k not in ("CPU", "GPU")}
    if extra:
        kwargs["resources"] = extra
    if config.runtime_env:
        kwargs["runtime_env"] = config.runtime_env
    return kwargs


def wait_for_replicas(dataset: Any, seconds: int = 600) -> None:
    """Make the actor pools of ``dataset`` start sending batches only once their minimum number of
    replicas is up. Otherwise the first replica to finish loading its model takes every batch in
    flight while the others load, and one replica does most of a small job. (Ray Data raises a
    timeout error if the cluster cannot start them in ``seconds``, instead of waiting forever.)"""
    context = dataset.context  # shared with the datasets it derives from: this applies to them too
    if context.wait_for_min_actors_s <= 0:
        context.wait_for_min_actors_s = seconds


class _MergePreprocess:
    """The row with what ``preprocess`` returned merged in (its values win). With should_continue_on_error,
    a row that ``preprocess`` raises for (or returns no dict for) becomes an error row that the replicas
    pass by, so one bad row does not fail the dataset."""

    def __init__(self, fn: Callable[[Row], Row], continue_on_error: bool = True):
        self.fn, self.continue_on_error = fn, continue_on_error

    def __call__(self, row: Row) -> Row:
        out = _row_function("preprocess", self.fn, row, self.continue_on_error)
        return {**row, ERROR_COLUMN: out} if isinstance(out, str) else {**row, **out}


class _Postprocess:
    """``postprocess`` on rows that succeeded; failed rows pass by with every column (Ray's behaviour)."""

    def __init__(self, fn: Callable[[Row], Row], keep_error_column: bool):
        self.fn, self.keep_error_column = fn, keep_error_column

    def __call__(self, row: Row) -> Row:
        if row.get(ERROR_COLUMN):
            return row
        out = _row_function("postprocess", self.fn, row, self.keep_error_column)
        if isinstance(out, str):  # the row's result is kept: it comes out as a failed row, with every column
            return {**row, ERROR_COLUMN: out}
        if self.keep_error_column:
            out = {**out, ERROR_COLUMN: ""}  # one schema for good and failed rows
        return out


def _row_function(name: str, fn: Callable[[Row], Row], row: Row, continue_on_error: bool) -> Row | str:
    """``fn(row)``, which must return a dict of columns; with ``continue_on_error``, what it raised as
    the row's error message instead of failing the dataset."""
    try:
        out = fn(row)
        if not isinstance(out, dict):
            raise TypeError(f"{name} must return a dict of columns, got {type(out).__name__}")
    except Exception as e:
        if not continue_on_error:
            raise
        return f"{name} raised {type(e).__name__}: {e}"
    return out
