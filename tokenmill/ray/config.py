"""`TokenmillProcessorConfig`: vLLM's `vLLMEngineProcessorConfig` fields, for a tokenmill engine.

A script written for ``ray.data.llm`` ports by changing the import and the config class name:
the fields it sets (model_source, engine_kwargs, concurrency, batch_size, max_concurrent_batches,
apply_chat_template, chat_template, accelerator_type, runtime_env, task_type...) mean the same
here. Fields that only steer vLLM's separate tokenize/detokenize stages are accepted and change
nothing (tokenmill tokenizes and detokenizes inside its engine). A field we do not have is a
TypeError naming it, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.ray.rows import TASKS

# vLLM engine options that tokenmill's engine always has on: accepted when set to True, so vLLM
# configs port unchanged (tokenmill computes long prompts in chunks whatever is said).
_ALWAYS_ON = ("enable_chunked_prefill",)
_TASK_ALIASES = {"generate": "generate", "embed": "embed", "embedding": "embed", "classify": "classify", "score": "score"}


@dataclass(kw_only=True)
class TokenmillProcessorConfig:
    """How the processor runs: the model, the engine, and how many replicas of it.

    One replica is one Ray actor holding one `tokenmill.LLM`. By default a replica takes
    ``tensor_parallel_size`` GPUs when the cluster has GPUs, else it is a CPU replica taking
    ``num_cpus`` cores (1 unless given; its torch threads follow).
    """

    model_source: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # tokenmill.LLM(...) keyword arguments
    task: str | None = None  # "generate" (default), "embed", "classify" or "score"
    task_type: str | None = None  # vLLM's name for task
    batch_size: int = 32  # rows per map_batches call
    concurrency: int | tuple[int, int] = 1  # replicas: n, or (min, max) for an autoscaling pool
    max_concurrent_batches: int = 8  # batches one replica holds at once (they share its engine)
    max_tasks_in_flight_per_actor: int | None = None  # Ray Data's; default 2 * max_concurrent_batches
    max_pending_requests: int | None = None  # cap on requests inside one replica's engine (None: none)
    num_gpus: float | None = None  # per replica; None: tensor_parallel_size if the cluster has GPUs, else 0
    num_cpus: float | None = None  # per replica; None: 1
    accelerator_type: str | None = None  # e.g. "H100": replicas only on such GPUs
    resources_per_bundle: dict[str, float] | None = None  # extra Ray resources per replica
    runtime_env: dict[str, Any] | None = None
    apply_chat_template: bool = True  # render 'messages' with the model's chat template
    chat_template: str | None = None  # a template instead of the model's
    # Variables for every row's template (Ray's ChatTemplateStageConfig field, set through
    # chat_template_stage); a row's own chat_template_kwargs go over them.
    chat_template_kwargs: dict[str, Any] | None = field(default=None, init=False)
    should_continue_on_error: bool = True  # a bad row becomes an error row (False: it fails the dataset)
    # LoRA (engine_kwargs enable_lora=True): a row's 'model' other than model_source names its adapter, the
    # folder dynamic_lora_loading_path/<model> (or the folder <model> itself when this is None), as in Ray's.
    dynamic_lora_loading_path: str | None = None
    # Accepted for vLLM configs; tokenmill's engine tokenizes and detokenizes itself.
    tokenize: bool = True
    detokenize: bool = True
    has_image: bool = False
    chat_template_stage: Any = True
    tokenize_stage: Any = True
    detokenize_stage: Any = True
    prepare_multimodal_stage: Any = False
    experimental: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model_source, str) or not self.model_source:
            raise ValueError(f"model_source={self.model_source!r} is invalid: must be a model name or path")
        if not isinstance(self.engine_kwargs, dict):
            raise TypeError(f"engine_kwargs must be a dict of tokenmill.LLM keyword arguments, got {type(self.engine_kwargs).__name__}")
        for name in _ALWAYS_ON:
            if name in self.engine_kwargs:
                if self.engine_kwargs[name] is not True:
                    raise ValueError(f"engine_kwargs {name}={self.engine_kwargs[name]!r}: tokenmill's engine always "
                                     "has it on; leave it out or set it to True")
                self.engine_kwargs = {k: v for k, v in self.engine_kwargs.items() if k != name}
        self.task = self._resolve_task()
        if not _positive_int(self.batch_size):
            raise ValueError(f"batch_size={self.batch_size!r} is invalid: must be an integer >= 1")
        if not _positive_int(self.max_concurrent_batches):
            raise ValueError(f"max_concurrent_batches={self.max_concurrent_batches!r} is invalid: must be an integer >= 1")
        self.concurrency = self.pool_size()
        for name in ("num_gpus", "num_cpus"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name}={value!r} is invalid: must be a number >= 0")
        for name, value, ok, allowed in (
            ("max_pending_requests", self.max_pending_requests, _positive_int, "None or an integer >= 1"),
            ("max_tasks_in_flight_per_actor", self.max_tasks_in_flight_per_actor, _positive_int, "None or an integer >= 1"),
            ("chat_template", self.chat_template, lambda v: isinstance(v, str), "None or a Jinja template (a string)"),
            ("accelerator_type", self.accelerator_type, lambda v: isinstance(v, str), "None or a GPU type such as 'H100'"),
            ("dynamic_lora_loading_path", self.dynamic_lora_loading_path, lambda v: isinstance(v, str), "None or a folder"),
            ("resources_per_bundle", self.resources_per_bundle, lambda v: isinstance(v, dict), "None or a dict of Ray resources"),
            ("runtime_env", self.runtime_env, lambda v: isinstance(v, dict), "None or a Ray runtime_env dict"),
            ("experimental", self.experimental, lambda v: isinstance(v, dict), "a dict"),
            ("apply_chat_template", self.apply_chat_template, lambda v: isinstance(v, bool), "True or False"),
            ("should_continue_on_error", self.should_continue_on_error, lambda v: isinstance(v, bool), "True or False"),
        ):
            if (value is not None or name == "experimental") and not ok(value):
                raise ValueError(f"{name}={value!r:.100} is invalid: must be {allowed}")
        if self.has_image or self.prepare_multimodal_stage:
            raise NotImplementedError("has_image / prepare_multimodal_stage: tokenmill runs text models only")
        stage = self.chat_template_stage
        if hasattr(stage, "model_dump"):  # Ray's ChatTemplateStageConfig (a pydantic model): read as its dict
            stage = stage.model_dump()
        if stage is False or (isinstance(stage, dict) and stage.get("enabled") is False):
            self.apply_chat_template = False
        if isinstance(stage, dict) and stage.get("chat_template"):
            if not isinstance(stage["chat_template"], str):
                raise ValueError(f"chat_template_stage chat_template={stage['chat_template']!r:.100} is invalid: must be a Jinja template (a string)")
            self.chat_template = stage["chat_template"]
        if isinstance(stage, dict) and stage.get("chat_template_kwargs") is not None:
            if not isinstance(stage["chat_template_kwargs"], dict):
                raise ValueError(f"chat_template_stage chat_template_kwargs={stage['chat_template_kwargs']!r:.100} is "
                                 'invalid: must be a dict of template variables, e.g. {"enable_thinking": False}')
            self.chat_template_kwargs = dict(stage["chat_template_kwargs"])
        if "max_tasks_in_flight_per_actor" in self.experimental and self.max_tasks_in_flight_per_actor is None:
            self.max_tasks_in_flight_per_actor = self.experimental["max_tasks_in_flight_per_actor"]
            if not _positive_int(self.max_tasks_in_flight_per_actor):
                raise ValueError(f"experimental max_tasks_in_flight_per_actor={self.max_tasks_in_flight_per_actor!r} "
                                 "is invalid: must be an integer >= 1")

    def _resolve_task(self) -> str:
        given = {name: value for name, value in (("task", self.task), ("task_type", self.task_type)) if value is not None}
        names = {_TASK_ALIASES.get(str(getattr(v, "value", v))) for v in given.values()}
        if None in names:
            raise ValueError(f"{given}: the task must be one of {TASKS}")
        if len(names) > 1:
            raise ValueError(f"task and task_type disagree: {given}")
        return names.pop() if names else "generate"

    def pool_size(self) -> tuple[int, int]:
        """(min, max) replicas."""
        c = self.concurrency
        if _positive_int(c):
            return (c, c)  # type: ignore[return-value]
        if isinstance(c, (tuple, list)) and len(c) == 2 and all(_positive_int(v) for v in c) and c[0] <= c[1]:
            return (int(c[0]), int(c[1]))
        raise ValueError(f"concurrency={c!r} is invalid: must be an integer >= 1 or a pair (min, max) with 1 <= min <= max")

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size") or 1)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
