"""SamplingParams and BeamSearchParams: vLLM's field names, defaults and meanings, validated on construction."""

from __future__ import annotations

import copy
import functools
import logging
import math
import operator
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum, IntFlag
from typing import TYPE_CHECKING, Any, Callable

# vLLM's import path: vllm.sampling_params.RepetitionDetectionParams.
from tokenmill.repetition_detection import RepetitionDetectionParams
from tokenmill.param_checks import as_python_number, check, is_foreign_int, is_int as _is_int, is_number as _is_number
from tokenmill.param_checks import named_keywords

if TYPE_CHECKING:
    from tokenmill.structured_outputs import StructuredOutputsParams

# vLLM's two logits-processor forms: (output_ids, logits) or (prompt_ids, output_ids, logits) -> logits.
LogitsProcessor = Callable[..., Any]
# Fields the engine fills in; not user settings.
ENGINE_FILLED_FIELDS = frozenset({"all_stop_token_ids", "bad_words_token_ids"})

_GREEDY_EPS = 1e-5
# vLLM's smallest sampling temperature (its _MAX_TEMP): a lower positive one is raised to it, since
# dividing logits by less risks inf/nan; vLLM logs the same warning.
_MIN_TEMPERATURE = 1e-2
_MAX_TEMPERATURE = 2.0  # vLLM 0.26 refuses a higher temperature
logger = logging.getLogger(__name__)
_check = functools.partial(check, owner="SamplingParams")  # BeamSearchParams passes its own owner

# The longest logprob_token_ids list (vLLM's limit and name).
MAX_LOGPROB_TOKEN_IDS = 128
# Fields vLLM's checks never isinstance-test, so it takes numpy's numbers there (param_checks.as_python_number).
_NUMBER_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p",
                  "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens",
                  "routed_experts_prompt_start")
_NUMBER_LIST_FIELDS = ("allowed_token_ids", "logprob_token_ids")
# Fields vLLM checks with isinstance(x, int), which numpy's integers fail.
_PYTHON_INT_FIELDS = ("n", "best_of", "top_k", "stop_token_ids")


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplerNeeds(IntFlag):
    """What a request's sampling needs beyond temperature (``SamplingParams.sampler_needs``): the
    runner skips every per-row pass whose need no row of a step has."""

    FILTERS = 1  # top-k, top-p or min-p
    PENALTIES = 2  # repetition, frequency or presence
    LOGIT_BIAS = 4  # logit_bias or allowed_token_ids
    BAD_WORDS = 8
    MIN_TOKENS = 16
    PROCESSORS = 32  # Python logits processors
    LOGPROB_IDS = 64  # logprob_token_ids: the logprobs of given ids, gathered per row


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a running request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output of that request
    FINAL_ONLY = 2  # one output, when the request finishes


@named_keywords
@dataclass
class SamplingParams:
    """How to sample the completion of one prompt (same fields and defaults as vLLM's).

    temperature=0 means greedy. top_k 0 or -1 disables top-k; top_p=1 disables nucleus sampling.
    ``seed`` makes one request's samples reproducible whatever else shares its batch.
    """

    n: int = 1
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top tokens per output position besides the sampled one; -1: the whole vocabulary
    prompt_logprobs: int | None = None  # top tokens per prompt position besides the prompt's own; -1 as for logprobs
    # Instead of the top ``logprobs`` tokens, each output position lists the sampled token and exactly
    # these ids (raw logprobs, like ``logprobs``; prompt logprobs are not affected). Each listed id's
    # rank is its place in this list (1 first), as vLLM reports it; the sampled token keeps its
    # rank in the distribution unless it is listed too.
    logprob_token_ids: list[int] | None = None
    # Return CompletionOutput.logprobs and RequestOutput.prompt_logprobs as a FlatLogprobs (a few
    # flat lists per request, tokenmill/logprobs.py) rather than a list of dicts.
    flat_logprobs: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens (-1: max_model_len)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never generated (every tokenization of each)
    logits_processors: list[LogitsProcessor] | None = None
    structured_outputs: "StructuredOutputsParams | None" = None
    guided_decoding: "StructuredOutputsParams | None" = None  # vLLM's older name for structured_outputs
    # vLLM's free-form arguments for custom sampling code and plugins; tokenmill's own sampling reads none.
    extra_args: dict[str, Any] | None = None
    # End the completion once its output ends in a pattern repeated min_count times in a row
    # (finish_reason "repetition"; tokenmill/repetition_detection.py). A dict of its fields is taken too.
    repetition_detection: RepetitionDetectionParams | None = None
    # True: the request takes no blocks from the prefix cache (it still commits its own for later
    # requests). None or False: it reads the cache. vLLM turns None into True when prompt_logprobs
    # is set, since a cache hit would leave prompt positions unscored; tokenmill leaves it None:
    # its scheduler skips the cache for such a request until every prompt position is scored, so
    # prompt logprobs are complete whatever this says.
    skip_reading_prefix_cache: bool | None = None
    # vLLM's flag: clone() makes a shallow copy instead of a deep one. The engine itself never
    # deep-copies a request's params (it copies them shallowly, only to set its own fields).
    skip_clone: bool = False
    # vLLM: with enable_return_routed_experts, routing data skips this many prompt tokens.
    # tokenmill returns no routing data (enable_return_routed_experts is refused): only 0 is accepted.
    routed_experts_prompt_start: int = 0
    # vLLM: a cap on the tokens of a reasoning model's thinking section, which needs a reasoning
    # parser. tokenmill has none (LLM(reasoning_parser=...) is refused): only None, or -1 (vLLM's
    # "unlimited", stored as None), is accepted.
    thinking_token_budget: int | None = None
    # Filled by the engine: the model's eos ids (from its config and generation_config).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: bad_words as token-id sequences.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._take_numpy_numbers()
        # vLLM's spellings: logprobs=True / prompt_logprobs=True mean 1, seed=-1 means no seed.
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Checked before list() below: list() of a number raises a bare "not iterable", and of a
        # dict or a string (a JSON row's "stop": {...}, "stop_token_ids": "12") keeps what it iterates.
        _check(self.stop is None or isinstance(self.stop, (list, tuple)), "stop", self.stop,
               "a string, a list of strings or None")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
               self.stop_token_ids, "a list of non-negative integers or None")
        self.stop = list(self.stop) if self.stop else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []
        # Tuples as lists: the runner indexes tensors with these, and a tuple would index dimensions.
        for name in ("logprob_token_ids", "allowed_token_ids"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None, "guided_decoding", self.guided_decoding,
                   "left unset when structured_outputs is given (it is the older name of the same field)")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None:
            from tokenmill.structured_outputs import StructuredOutputsParams

            if isinstance(self.structured_outputs, dict):  # from a JSON row of a batch file
                allowed = [f.name for f in fields(StructuredOutputsParams)]
                _check(set(self.structured_outputs) <= set(allowed), "structured_outputs", self.structured_outputs,
                       f"a StructuredOutputsParams, or a dict with keys among {allowed}")
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   self.structured_outputs, "a StructuredOutputsParams")
        if self.top_k == -1:
            self.top_k = 0  # vLLM accepts both spellings of "disabled"
        if self.repetition_detection is not None:
            self.repetition_detection = RepetitionDetectionParams.coerce(self.repetition_detection)
        if self.thinking_token_budget == -1 and _is_int(self.thinking_token_budget):
            self.thinking_token_budget = None  # vLLM's "unlimited"
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            _check(False, "output_kind", self.output_kind, f"one of {[k.name for k in RequestOutputKind]}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias, "a dict of token id -> bias")
            try:  # JSON rows carry the ids as strings; 1.5 is no token id (int() would make it 1)
                bias = {int(k): float(v) for k, v in self.logit_bias.items() if isinstance(k, (int, str)) or _whole(k)}
            except (TypeError, ValueError):
                bias = {0: math.nan}
            _check(len(bias) == len(self.logit_bias) and all(math.isfinite(v) for v in bias.values()), "logit_bias",
                   self.logit_bias, "a dict of integer token ids -> finite numbers")
            self.logit_bias = {k: max(-100.0, min(100.0, v)) for k, v in bias.items()}
        self._validate()
        if 0.0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in tensors; "
                           "raised to %s (as vLLM does)", self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        if self.temperature < _GREEDY_EPS:
            # Greedy ignores the filtering knobs; normalising keeps the sampler's fast path simple.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)
        self._checked = _checked_fields(self)  # what these checks saw (changed_since_checked)

    def _take_numpy_numbers(self) -> None:
        """numpy's numbers as vLLM takes them: as Python numbers where it checks no type, refused by
        name where its isinstance(x, int) check refuses them."""
        for name in _NUMBER_FIELDS:
            setattr(self, name, as_python_number(getattr(self, name)))
        for name in _NUMBER_LIST_FIELDS:
            ids = getattr(self, name)
            if isinstance(ids, (list, tuple)):  # a new list: the caller's stays as it was
                setattr(self, name, [as_python_number(t) for t in ids])
        for name in _PYTHON_INT_FIELDS:
            value = getattr(self, name)
            _check(not any(map(is_foreign_int, value if isinstance(value, (list, tuple)) else [value])), name, value,
                   "Python int(s): vLLM's isinstance(x, int) check refuses numpy integers here (pass int(x))")

    def changed_since_checked(self) -> bool:
        """Whether a field was set after the checks ran (vLLM's examples set fields on the object
        ``get_default_sampling_params()`` returns); a list changed in place goes unseen."""
        return getattr(self, "_checked", None) != _checked_fields(self)

    def _validate(self) -> None:
        # Types as strict as vLLM's request models: a bool is not an integer, a string is not a
        # bool, and a float must be finite (JSON rows can carry true, "no", Infinity or NaN).
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            _check(_is_number(value) and math.isfinite(value), name, value, "a finite number")
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            _check(_is_int(value), name, value, "an integer")
        for name in ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            value = getattr(self, name)
            _check(value is None or _is_int(value), name, value, "an integer or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize", "skip_clone", "flat_logprobs"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "True or False")
        _check(self.skip_reading_prefix_cache is None or isinstance(self.skip_reading_prefix_cache, bool),
               "skip_reading_prefix_cache", self.skip_reading_prefix_cache, "None, True or False")
        _check(self.routed_experts_prompt_start == 0 and _is_int(self.routed_experts_prompt_start),
               "routed_experts_prompt_start", self.routed_experts_prompt_start,
               "0: tokenmill returns no routed experts (enable_return_routed_experts is refused), so there are none to skip")
        budget = self.thinking_token_budget
        _check(budget is None or (_is_int(budget) and budget >= 0), "thinking_token_budget", budget,
               "None, a non-negative integer or -1 (unlimited)")
        _check(budget is None, "thinking_token_budget", budget,
               "None or -1 (unlimited): tokenmill has no reasoning parsers (LLM(reasoning_parser=...) is refused), "
               "so there is no thinking section to cap")
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(
            self.best_of is None or (isinstance(self.best_of, int) and not isinstance(self.best_of, bool) and self.best_of >= self.n),
            "best_of", self.best_of, f"None or an integer >= n ({self.n})",
        )
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "[-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "[-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(0.0 <= self.temperature <= _MAX_TEMPERATURE, "temperature", self.temperature,
               f"in [0, {_MAX_TEMPERATURE:g}] (0 means greedy)")
        _check(self.n == 1 or self.temperature > 0.0, "n", self.n,
               "1 when using greedy sampling (temperature=0): every sample would be the same")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "(0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "-1, 0 (disabled) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "[0, 1]")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "an integer >= 1 or None (up to max_model_len)",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or self.logprobs >= -1, "logprobs", self.logprobs,
               "None, an integer >= 0 or -1 (the whole vocabulary)")
        _check(
            self.truncate_prompt_tokens is None
            or (isinstance(self.truncate_prompt_tokens, int) and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)),
            "truncate_prompt_tokens",
            self.truncate_prompt_tokens,
            "None, -1 (max_model_len) or an integer >= 1",
        )
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs", self.prompt_logprobs,
               "None, an integer >= 0 or -1 (the whole vocabulary)")
        self._validate_logprob_token_ids()
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(not self.stop or self.detokenize, "stop", self.stop,
               "empty when detokenize=False: stop strings are found in the text (set detokenize=True to use stop)")
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "non-negative integers",
        )

        _check(
            self.allowed_token_ids is None
            or (isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids",
            self.allowed_token_ids,
            "None or a non-empty list of token ids",
        )
        _check(
            self.bad_words is None or (isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
            "bad_words",
            self.bad_words,
            "None or a list of non-empty strings",
        )
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", self.extra_args, "None or a dict")
        _check(
            self.logits_processors is None
            or (isinstance(self.logits_processors, (list, tuple)) and all(callable(f) for f in self.logits_processors)),
            "logits_processors",
            self.logits_processors,
            "None or a list of callables (output_ids, logits) -> logits",
        )

    def _validate_logprob_token_ids(self) -> None:
        """vLLM's rules, but for the vocabulary's bound: intake checks that one, against the model."""
        ids = self.logprob_token_ids
        if ids is None:
            return
        _check(isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids), "logprob_token_ids", ids,
               "None or a list of token ids (integers >= 0)")
        _check(len(ids) <= MAX_LOGPROB_TOKEN_IDS, "logprob_token_ids", ids,
               f"at most {MAX_LOGPROB_TOKEN_IDS} token ids (got {len(ids)})")
        _check(self.logprobs is None or self.logprobs == len(ids), "logprob_token_ids", ids,
               f"as long as logprobs ({self.logprobs}) when both are set; or leave logprobs None")

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's count of sample logprobs per position besides the sampled token's: ``logprobs``,
        else ``len(logprob_token_ids)``; None when no sample logprobs are returned."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs for the request: best_of when given, else n."""
        return self.best_of or self.n

    @property
    def adjusts_logits(self) -> bool:
        """Whether some logit control (bias, allow list, bad words, processors) applies."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids or self.logits_processors)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def sampler_needs(self) -> int:
        """``SamplerNeeds`` bits, as a plain int. Each condition is the one its sampling state (or
        pass) uses to take a row. The runner reads it through ``Request.sampler_needs``, computed
        once per request after intake has filled ``bad_words_token_ids``: not cached here, since a
        caller may edit and reuse one SamplingParams between calls."""
        needs = SamplerNeeds(0)
        if self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0:
            needs |= SamplerNeeds.FILTERS
        if self.uses_penalties:
            needs |= SamplerNeeds.PENALTIES
        if self.logit_bias or self.allowed_token_ids:
            needs |= SamplerNeeds.LOGIT_BIAS
        if self.bad_words_token_ids:
            needs |= SamplerNeeds.BAD_WORDS
        if self.min_tokens > 0:
            needs |= SamplerNeeds.MIN_TOKENS
        if self.logits_processors:
            needs |= SamplerNeeds.PROCESSORS
        if self.logprob_token_ids:
            needs |= SamplerNeeds.LOGPROB_IDS
        return int(needs)

    @property
    def reads_output_history(self) -> bool:
        """Whether sampling the next token needs the ids of every earlier one on the host (Python
        logits processors): such requests step synchronously. Penalties and bad words keep their
        history on the device (worker/sampling_state.py); a grammar's matcher takes one token a
        step, read back before the next step's draw is launched (engine.py)."""
        return bool(self.logits_processors)

    def clone(self, **changes: Any) -> "SamplingParams":
        """vLLM's ``clone()``: a deep copy, so that changing the copy's lists or dicts in place
        leaves this one alone (a shallow copy with ``skip_clone=True``). With ``changes`` (a
        tokenmill extension): a shallow copy with those fields replaced and checked again (which
        refills the engine's own fields from the user's)."""
        if changes.keys() == {"output_kind"} and isinstance(changes["output_kind"], RequestOutputKind):
            # No other field depends on output_kind or it on them: nothing to check again (27 µs
            # against 5 a copy, paid per prompt by calls passing one params object a prompt).
            copied = copy.copy(self)
            copied.output_kind = changes["output_kind"]
            return copied
        if changes:
            return replace(self, **changes)
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """Build from keyword arguments, dropping the ones that are None (e.g. from a CLI or JSON row),
        except ``max_tokens``: as in vLLM's from_optional, None there means no cap (up to max_model_len)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {sorted(known - ENGINE_FILLED_FIELDS)}")
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})


# The fields a user sets (the engine's own and output_kind, which LLM's calls set on a copy, left out).
_checked_fields = operator.attrgetter(
    *(f.name for f in fields(SamplingParams) if f.name not in ENGINE_FILLED_FIELDS | {"output_kind"}))


def _whole(key: Any) -> bool:
    """A number key that is a whole number (JSON may carry 5.0 for 5); raises on what is no number."""
    return float(key) == int(float(key))


def for_call(params: SamplingParams, kind: RequestOutputKind, where: str) -> SamplingParams:
    """``params`` as one LLM call's requests take it: with the call's output kind, and made again if
    a field was set after construction (vLLM's examples set fields on ``get_default_sampling_params()``),
    so that the field gets construction's checks (n = 0 would hang the call, a string max_tokens fail
    deep in the engine). ``where``: the prompt an error names."""
    if params.changed_since_checked():
        try:
            params = replace(params)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc} (a field set after the SamplingParams was made)") from exc
    return params if params.output_kind is kind else params.clone(output_kind=kind)


@named_keywords
@dataclass
class BeamSearchParams:
    """Settings of `LLM.beam_search` (vLLM's names and defaults).

    The search is Hugging Face transformers' beam search with ``num_beams=beam_width``,
    ``do_sample=False`` and its default ``early_stopping=False``: a finished beam scores
    ``cumulative logprob / generated_length ** length_penalty`` (the eos token counts in the length).
    Candidates are scored with the model's raw log-probabilities, as vLLM's V1 engine reports them
    and as transformers scores them without sampling, so ``temperature`` does not change the result.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the final eos token's text in BeamSearchSequence.text
    # A grammar every beam follows: each step's candidates are the best tokens it allows, scored
    # by their raw log-probabilities (transformers' beam search with a prefix_allowed_tokens_fn).
    structured_outputs: "StructuredOutputsParams | None" = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            from tokenmill.structured_outputs import StructuredOutputsParams

            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   self.structured_outputs, "None or a StructuredOutputsParams", owner="BeamSearchParams")
        for name in ("beam_width", "max_tokens", "temperature", "length_penalty"):  # vLLM checks no types
            setattr(self, name, as_python_number(getattr(self, name)))
        for name, value in vars(self).items():
            if name == "structured_outputs":
                continue
            if name in ("beam_width", "max_tokens"):
                ok, allowed = _is_int(value) and value >= 1, "an integer >= 1"
            elif name in ("ignore_eos", "include_stop_str_in_output"):
                ok, allowed = isinstance(value, bool), "True or False"
            else:
                ok, allowed = _is_number(value) and math.isfinite(value), "a finite number"
            _check(ok, name, value, allowed, owner="BeamSearchParams")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0", owner="BeamSearchParams")


def __getattr__(name: str) -> Any:
    """vLLM's import path ``sampling_params.StructuredOutputsParams`` (loaded lazily, like the module it lives in)."""
    if name in ("StructuredOutputsParams", "GuidedDecodingParams"):
        from tokenmill import structured_outputs

        return getattr(structured_outputs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


