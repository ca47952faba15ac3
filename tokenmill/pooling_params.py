"""PoolingParams: what a pooling request asks of the model's pooler (vLLM's fields and meanings).

One object serves every pooling task; which fields apply depends on the task:

    embed, token_embed        dimensions (Matryoshka truncation), use_activation (L2 normalisation,
                              default True; ``normalize`` is its name before vLLM 0.26)
    classify, token_classify  use_activation (softmax / sigmoid on the logits, default True)
    score                     as classify (tokenmill's name for a cross-encoder's pair scores;
                              vLLM 0.26 runs them as "classify")

Fields left None take the model's defaults (its pooler config, then vLLM's), filled in by
`resolved`, which the engine calls once per request; the user's object is never modified.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from tokenmill.param_checks import as_python_number, check, is_int as _is_int, named_keywords
from tokenmill.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from tokenmill.pooling.config import PoolerConfig

PoolingTask = Literal["embed", "token_embed", "classify", "token_classify", "score"]
POOLING_TASKS: tuple[str, ...] = ("embed", "token_embed", "classify", "token_classify", "score")
_check = functools.partial(check, owner="PoolingParams")
# Which optional fields each task accepts (vLLM's valid_parameters).
_TASK_FIELDS = {
    "embed": ("dimensions", "normalize", "use_activation"),
    "token_embed": ("dimensions", "normalize", "use_activation"),
    "classify": ("use_activation",),
    "token_classify": ("use_activation",),
    "score": ("use_activation",),
}
_TASK_SPECIFIC = ("dimensions", "normalize", "use_activation")
EXTRA_KWARGS = ("max_tokens_per_query", "max_tokens_per_doc")  # the extra_kwargs LLM.score reads (vLLM's)
# vLLM's fields for its engine's use, not set from batch rows or the command line.
_INTERNAL = {"task", "requires_token_ids", "late_interaction_params", "output_kind"}


@named_keywords
@dataclass
class PoolingParams:
    truncate_prompt_tokens: int | None = None  # keep only k prompt tokens (-1: max_model_len); None: no truncation
    dimensions: int | None = None  # embeddings: keep the first k dimensions (Matryoshka models only)
    normalize: bool | None = None  # embeddings: L2-normalise (after truncating to `dimensions`)
    use_activation: bool | None = None  # classify/score: apply the model's activation to the logits
    softmax: bool | None = None  # older name of use_activation (vLLM keeps it, deprecated)
    activation: bool | None = None  # older name of use_activation (vLLM keeps it, deprecated)
    task: PoolingTask | None = None  # set by LLM.embed/classify/score/encode; None: the model's default task
    # vLLM's: a pooling step keeps no KV cache here, so there is no cached prefix to skip reading.
    skip_reading_prefix_cache: bool | None = None
    # vLLM's STEP pooling (process reward models), which tokenmill does not implement: None only.
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    # vLLM 0.26's other fields. requires_token_ids: every output carries prompt_token_ids anyway.
    requires_token_ids: bool = False
    # Late-interaction (ColBERT MaxSim) scoring, which tokenmill does not implement: None only.
    late_interaction_params: Any = None
    # Read by LLM.score: {"max_tokens_per_query": k, "max_tokens_per_doc": k} cut the texts (0: no cut).
    extra_kwargs: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY  # pooling outputs are final only

    def __post_init__(self) -> None:
        for old in ("softmax", "activation"):
            value = getattr(self, old)
            if value is None:
                continue
            _check(self.use_activation in (None, value), old, value,
                   f"left unset, or equal to use_activation ({self.use_activation}): it is its older name")
            self.use_activation = value
            setattr(self, old, None)
        # vLLM's PoolingParams (a msgspec Struct) checks no types: numpy integers are taken, as Python ints.
        self.truncate_prompt_tokens = as_python_number(self.truncate_prompt_tokens)
        self.dimensions = as_python_number(self.dimensions)
        _check(
            self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                    and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)),
            "truncate_prompt_tokens", self.truncate_prompt_tokens, "None, -1 (max_model_len) or an integer >= 1",
        )
        _check(self.dimensions is None or (_is_int(self.dimensions) and self.dimensions >= 1),
               "dimensions", self.dimensions, "None or an integer >= 1")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, bool), name, value, "None, True or False")
        _check(self.task is None or self.task in POOLING_TASKS, "task", self.task, f"None or one of {POOLING_TASKS}")
        _check(self.skip_reading_prefix_cache is None or isinstance(self.skip_reading_prefix_cache, bool),
               "skip_reading_prefix_cache", self.skip_reading_prefix_cache, "None, True or False")
        for name in ("step_tag_id", "returned_token_ids"):
            _check(getattr(self, name) is None, name, getattr(self, name),
                   "None: STEP pooling (process reward models) is not implemented")
        _check(isinstance(self.requires_token_ids, bool), "requires_token_ids", self.requires_token_ids, "True or False")
        _check(self.late_interaction_params is None, "late_interaction_params", self.late_interaction_params,
               "None: late-interaction (ColBERT MaxSim) scoring is not implemented; score() serves cross-encoders "
               "and embedding models (cosine)")
        _check(self.extra_kwargs is None or (isinstance(self.extra_kwargs, dict) and set(self.extra_kwargs) <= set(EXTRA_KWARGS)),
               "extra_kwargs", self.extra_kwargs, f"None or a dict with keys among {EXTRA_KWARGS} (read by LLM.score)")
        for name, value in (self.extra_kwargs or {}).items():
            _check(_is_int(value) and value >= 0, f"extra_kwargs[{name!r}]", value, "an integer >= 0 (0: no cut)")
        _check(self.output_kind == RequestOutputKind.FINAL_ONLY, "output_kind", self.output_kind,
               "RequestOutputKind.FINAL_ONLY: a pooling request has one output")

    def clone(self, **changes: Any) -> "PoolingParams":
        return replace(self, **changes)

    def resolved(self, task: str, defaults: "PoolerConfig") -> "PoolingParams":
        """A copy for ``task`` with every applicable field decided: the request's value, else the
        model's pooler config, else vLLM's default (normalize and use_activation True).

        Raises ValueError for a field the task does not take (dimensions on a classifier, ...).
        """
        if self.task is not None and self.task != task:
            raise ValueError(f"PoolingParams.task={self.task!r} does not match the requested task {task!r}")
        allowed = _TASK_FIELDS[task]
        wrong = [name for name in _TASK_SPECIFIC if name not in allowed and getattr(self, name) is not None]
        if wrong:
            raise ValueError(f"PoolingParams field(s) {wrong} do not apply to task {task!r}; it takes {list(allowed)}")
        if "normalize" in allowed:  # an embedding task: use_activation is normalize's vLLM 0.26 name
            if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
                raise ValueError(f"PoolingParams.normalize={self.normalize} and use_activation={self.use_activation} "
                                 f"disagree: for task {task!r} both name the L2 normalisation; set one")
            normalize = next((v for v in (self.normalize, self.use_activation, defaults.normalize) if v is not None), True)
            dimensions = self.dimensions if self.dimensions is not None else defaults.dimensions
            return replace(self, task=task, dimensions=dimensions, normalize=normalize, use_activation=normalize)  # type: ignore[arg-type]
        use_activation = next((v for v in (self.use_activation, defaults.use_activation) if v is not None), True)
        return replace(self, task=task, use_activation=use_activation)  # type: ignore[arg-type]

    @classmethod
    def field_names(cls) -> set[str]:
        """The user-settable fields (for batch rows and the CLI)."""
        return {f.name for f in fields(cls)} - _INTERNAL
