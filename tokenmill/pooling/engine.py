"""PoolingEngine: the engine of a pooling model (embeddings, class probabilities, scores).

`create_engine` picks it instead of `LLMEngine` when the model is a pooling model; both serve
the `Engine` protocol (tokenmill/engine/protocol.py). A pooling request is prefill-only: it finishes
in the step that computes its prompt, and there is no KV cache, no preemption and no chunking,
so the generation `Scheduler` has nothing to do here. Requests wait in a FIFO queue; each step
takes whole prompts from its front while they fit the token budget (``max_num_batched_tokens``,
at least ``max_model_len``, so every prompt fits one step) and ``max_num_seqs``. The model is
loaded on one rank: no Executor, no sampler, no decode graphs.

With asynchronous scheduling (on by default on GPUs) ``step`` launches the next batch before it
reads back the one in flight, so the host builds outputs and the next batch while the device
computes; a step's results come back from the call after the one that launched it. The work per
request in the loop is a few attribute reads and two small output objects; everything per token
is numpy or the device (`runner.py`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

from tokenmill.config import EngineConfig
from tokenmill.engine.protocol import check_add_request_keywords, request_id_list
from tokenmill.inputs import PromptType, check_tokenization_kwargs, parse_prompt, tokenize_prompts, validate_prompt_ids
from tokenmill.outputs import PoolingOutput, PoolingRequestOutput
from tokenmill.pooling.config import TASK_METHODS, PoolingModelConfig
from tokenmill.pooling.request import PoolingRequest
from tokenmill.pooling.runner import LaunchedStep, PoolingRunner
from tokenmill.pooling_params import POOLING_TASKS, PoolingParams

if TYPE_CHECKING:
    from tokenmill.models.source import ModelSource


class PoolingEngine:
    def __init__(self, config: EngineConfig, source: "ModelSource", tokenizer: Any, load_format: str = "auto"):
        from tokenmill.models.loader import load_model

        if config.pooling is None:
            raise ValueError(f"model {config.model!r} is not a pooling model; LLMEngine serves it")
        pooling: PoolingModelConfig = config.pooling
        self.config = config
        self.model_config = config  # vLLM code reads llm_engine.model_config.max_model_len
        self.source = source
        self.pooling = pooling
        self.tokenizer = tokenizer
        model = load_model(source, config.dtype, config.device, load_format, seed=config.seed,
                           architecture=pooling.architecture, quantization=config.quantization)
        self.runner = PoolingRunner(model, config.device, pooling)
        self.requests: dict[str, PoolingRequest] = {}  # queued or in flight; aborting removes one
        self.waiting: deque[PoolingRequest] = deque()
        self.queued_tokens = 0  # prompt tokens in ``waiting`` (aborted ones too, until their turn)
        self.in_flight: tuple[list[PoolingRequest], LaunchedStep] | None = None
        # Requests of one call share their PoolingParams object: resolve it once, not per request.
        self._resolved: dict[tuple, PoolingParams] = {}
        self._text_bound: tuple[Any, Callable[[str], int] | None] | None = None  # (tokenizer, its token bound)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Any = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        prompt_text: str | None = None,
        *,
        index: int | None = None,
    ) -> str:
        """Validate and queue one pooling request; a ValueError leaves the engine untouched. Returns its id.

        vLLM 0.26's keywords, as LLMEngine takes them: ``tokenization_kwargs`` as in `tokenized`;
        ``prompt_text`` is a token prompt's text; ``arrival_time``, ``trace_headers`` and ``priority``
        are accepted (a pooling request has no metrics, tracing or priority queue); ``lora_request``
        must be None (adapters apply to generation only).
        """
        check_add_request_keywords(request_id, priority, arrival_time)
        refuse_lora(lora_request)
        if params is None:
            params = PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(self.generation_refused(f"a request with {type(params).__name__}"))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if tokenization_kwargs:
            (prompt,), truncate = self.tokenized([prompt], tokenization_kwargs, params.truncate_prompt_tokens)
            params = params.clone(truncate_prompt_tokens=truncate)
        self.queue(self.make_request(request_id, prompt, self.resolve(params), index, prompt_text))
        return request_id

    def make_request(self, request_id: str, prompt: PromptType, params: PoolingParams, index: int | None = None,
                     prompt_text: str | None = None) -> PoolingRequest:
        """One prompt parsed, tokenized, cut and validated into a request (``params`` resolved), not
        queued; a ValueError names ``prompts[index]`` (or "prompt") and what is wrong with it."""
        where = f"prompts[{index}]" if index is not None else "prompt"
        text, ids, token_types = self._tokenize(prompt, params, index, where)
        validate_prompt_ids(ids, self.config.vocab_size, self.config.max_model_len, where)
        return PoolingRequest(request_id, text if text is not None else prompt_text, ids, params, token_types)

    def queue(self, request: PoolingRequest) -> None:
        """Queue a request `make_request` made (its id checked free by the caller); this cannot fail."""
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.queued_tokens += len(request.prompt_token_ids)

    def text_bound(self) -> Callable[[str], int] | None:
        """`intake.token_bound` of this engine's tokenizer (a text -> at most how many tokens), worked
        out once per tokenizer object: it reads the whole vocabulary."""
        from tokenmill.pooling.intake import token_bound

        if self._text_bound is None or self._text_bound[0] is not self.tokenizer:
            self._text_bound = (self.tokenizer, token_bound(self.tokenizer, self.config.vocab_size))
        return self._text_bound[1]

    def tokenized(self, prompts: list[PromptType], tokenization_kwargs: dict[str, Any] | None,
                  truncate_prompt_tokens: int | None) -> tuple[list[PromptType], int | None]:
        """vLLM 0.26's ``tokenization_kwargs`` applied to pooling prompts: (the prompts, the
        truncation to ask of their requests).

        ``truncate_prompt_tokens`` there is the requests' truncation (vLLM 0.26 has no keyword of
        that name; ours must agree with it); ``truncation_side`` may only name the tokenizer's own
        side; the other keys go to the tokenizer for text prompts (token prompts are left as they are).
        """
        if tokenization_kwargs is None:
            return prompts, truncate_prompt_tokens
        check_tokenization_kwargs(tokenization_kwargs, ("truncate_prompt_tokens", "truncation_side"))
        rest = dict(tokenization_kwargs)
        truncate = rest.pop("truncate_prompt_tokens", None)
        if truncate is not None and truncate_prompt_tokens not in (None, truncate):
            raise ValueError(f"tokenization_kwargs['truncate_prompt_tokens']={truncate!r} and truncate_prompt_tokens="
                             f"{truncate_prompt_tokens!r} disagree; set one")
        truncate = truncate if truncate is not None else truncate_prompt_tokens
        side = rest.pop("truncation_side", None)
        own_side = getattr(self.tokenizer, "truncation_side", "left")
        if side is not None and side != own_side:
            raise ValueError(f"tokenization_kwargs['truncation_side']={side!r} is not supported: this tokenizer "
                             f"truncates on the {own_side!r} side, the only side tokenmill cuts pooling prompts on")
        if rest:
            if truncate is not None:  # cut text in the tokenizer, which keeps the special tokens
                PoolingParams(truncate_prompt_tokens=truncate)  # the value checked first
                rest.update(truncation=True, max_length=self.config.max_model_len if truncate == -1 else truncate)
            prompts = tokenize_prompts(prompts, self.tokenizer, rest)
        return prompts, truncate

    def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM 0.26's pooling tasks of this model (a cross-encoder's score runs as "classify"; a task
        only PoolerConfig.task opens is listed too, as vLLM lists every task the model's pooler has)."""
        served = {*self.pooling.tasks, *self.pooling.switch_tasks} - {"score"}
        return tuple(task for task in POOLING_TASKS if task in served)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Forget these requests: a queued one is skipped when its turn comes, the result of one in
        flight is dropped when it comes back."""
        for request_id in request_id_list(request_ids):
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return True  # a pooling model keeps no cache

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """A pooling model runs on one rank without a Worker: only apply_model(func) is served."""
        if method != "apply_model":
            raise ValueError(f"collective_rpc({method!r}) is not available for a pooling model; LLM.apply_model is")
        return [args[0](self.runner.model)]

    # ---- stepping -------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[PoolingRequestOutput]:
        """Launch the next batch of whole prompts and return the outputs of the batch before it
        (asynchronous scheduling), or of this one (otherwise). Every request of a batch finishes
        in it, so ``finished_only`` changes nothing."""
        batch = self._next_batch()
        launched = (batch, self._launch(batch)) if batch else None
        if not self.config.async_scheduling:
            return self._finish(launched) if launched is not None else []
        previous, self.in_flight = self.in_flight, launched
        return self._finish(previous) if previous is not None else []

    def _next_batch(self) -> list[PoolingRequest]:
        """Whole prompts from the front of the queue while they fit the step (aborted ones skipped)."""
        budget, room = self.config.max_num_batched_tokens, self.config.max_num_seqs
        batch: list[PoolingRequest] = []
        waiting, live = self.waiting, self.requests
        while waiting and room:
            request = waiting[0]
            n = len(request.prompt_token_ids)
            if live.get(request.request_id) is not request:  # aborted
                waiting.popleft()
                self.queued_tokens -= n
                continue
            if n > budget:
                # step_limits keeps the budget >= max_model_len, so only a later step can take it.
                assert batch, "a prompt longer than a whole step's token budget was accepted"
                break
            waiting.popleft()
            self.queued_tokens -= n
            batch.append(request)
            budget -= n
            room -= 1
        return batch

    def _launch(self, batch: list[PoolingRequest]) -> LaunchedStep:
        try:
            return self.runner.launch(batch)
        except BaseException:
            self._forget(batch)  # they left the queue: without this the engine would wait for them forever
            raise

    def _finish(self, launched: tuple[list[PoolingRequest], LaunchedStep]) -> list[PoolingRequestOutput]:
        """Outputs of a launched batch (waiting for the device), less the requests aborted meanwhile."""
        batch, step = launched
        try:
            results = step.results()
        except BaseException:
            self._forget(batch)
            raise
        live = self.requests
        outputs = []
        for request, data in zip(batch, results):
            if live.get(request.request_id) is request:
                del live[request.request_id]
                outputs.append(PoolingRequestOutput(request.request_id, PoolingOutput(data), request.prompt_token_ids, 0, True))
        return outputs

    def _forget(self, batch: list[PoolingRequest]) -> None:
        for request in batch:
            if self.requests.get(request.request_id) is request:
                del self.requests[request.request_id]

    def pair_prompt(self, text_1: str, text_2: str, truncate_prompt_tokens: int | None = None,
                    tokenizer_kwargs: dict[str, Any] | None = None, chat_template: str | None = None) -> dict[str, Any]:
        """A cross-encoder's input for a text pair, built as vLLM builds it. The tokenizer joins the two
        as a pair ([CLS] a [SEP] b [SEP] for BERT, with segment ids), cutting the longer first when
        truncating; a causal LM scoring from tokens' logits (``classifier_from_token``) reads them as
        one text, ``a + b`` (vLLM's ``use_sep_token``: off for those, on for the rest; hf_overrides may
        set it). A score template (``chat_template``) renders the pair as two messages, roles "query"
        and "document", and the rendered text is tokenized as one."""
        if self.tokenizer is None:
            raise ValueError("scoring text pairs needs the tokenizer, but it was not loaded (skip_tokenizer_init=True)")
        for name, text in (("text_1", text_1), ("text_2", text_2)):
            if not isinstance(text, str):
                raise TypeError(f"a cross-encoder scores text pairs; {name} is a {type(text).__name__}")
        keep = self.config.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        hf_config = self.source.hf_config
        if chat_template is not None:
            texts: tuple[str, ...] = (render_score_template(self.tokenizer, chat_template, text_1, text_2),)
        elif not getattr(hf_config, "use_sep_token", getattr(hf_config, "classifier_token_ids", None) is None):
            texts = (text_1 + text_2,)
        else:
            texts = (text_1, text_2)
        try:
            encoded = self.tokenizer(*texts, **{"truncation": keep is not None, "max_length": keep, **(tokenizer_kwargs or {})})
        except TypeError as exc:
            raise ValueError(f"tokenization_kwargs={tokenizer_kwargs!r} are not tokenizer arguments: {exc}") from exc
        prompt: dict[str, Any] = {"prompt_token_ids": list(encoded["input_ids"]), "prompt": text_1}
        if self.pooling.takes_token_type_ids and "token_type_ids" in encoded:
            prompt["token_type_ids"] = list(encoded["token_type_ids"])
        return prompt

    # ---- building blocks ------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType, params: PoolingParams, index: int | None, where: str):
        """(text, token ids, token type ids) of a prompt, cut to ``truncate_prompt_tokens``.

        Text is truncated by the tokenizer, which keeps the special tokens ([CLS] ... [SEP]) and
        cuts on its truncation side, as sentence-transformers does; token ids given directly are
        cut on the same side (the left when there is no tokenizer).
        """
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = self.config.max_model_len
        if keep is not None and keep > self.config.max_model_len:
            raise ValueError(f"{where}: truncate_prompt_tokens={keep} is larger than max_model_len={self.config.max_model_len}")
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
        if keep is not None and text is not None and self.tokenizer is not None:
            return text, list(self.tokenizer(text, truncation=True, max_length=keep)["input_ids"]), None
        processed = parse_prompt(prompt, self.tokenizer, index)
        ids = processed.token_ids
        token_types = self._token_types(prompt, len(ids), where)
        if keep is not None and len(ids) > keep:
            cut = slice(-keep, None) if getattr(self.tokenizer, "truncation_side", "left") == "left" else slice(keep)
            ids = ids[cut]
            token_types = token_types[cut] if token_types is not None else None
        return processed.prompt, ids, token_types

    def _token_types(self, prompt: PromptType, length: int, where: str) -> list[int] | None:
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is None:
            return None
        if not self.pooling.takes_token_type_ids:
            raise ValueError(f"{where}.token_type_ids: {self._describe()} has no token types; leave them out")
        limit = int(getattr(self.runner.model.config, "type_vocab_size", 2))
        if (not isinstance(types, (list, tuple)) or len(types) != length
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in types)):
            raise ValueError(f"{where}.token_type_ids must be {length} integers in [0, {limit}), one per prompt token")
        return list(types)

    def resolve(self, params: PoolingParams, index: int | None = None) -> PoolingParams:
        """The request's params for its task with the model's defaults filled in; checked, and
        shared by every request that asks the same (the engine never modifies them). An error
        names ``pooling_params[index]`` when ``index`` is past the first prompt (a list's entry)."""
        key = (params.task, params.truncate_prompt_tokens, params.dimensions, params.normalize, params.use_activation)
        resolved = self._resolved.get(key)
        if resolved is None:
            try:
                # vLLM's encode() needs a task; ours without one takes the PoolerConfig's, else the model's.
                task = params.task or self.pooling.pooler.task or self.pooling.head
                if task not in self.pooling.tasks:
                    raise ValueError(self.unsupported(task))
                resolved = params.resolved(task, self.pooling.pooler)
                self._check_dimensions(resolved)
            except ValueError as exc:
                if index:
                    raise ValueError(f"pooling_params[{index}]: {exc}") from None
                raise
            self._resolved[key] = resolved
        return resolved

    def _check_dimensions(self, params: PoolingParams) -> None:
        dims = params.dimensions
        if dims is None:
            return
        p = self.pooling
        if not p.is_matryoshka:
            raise ValueError(
                f"PoolingParams.dimensions={dims}: {self._describe()} was not trained for Matryoshka embeddings "
                "(its config has no matryoshka_dimensions or is_matryoshka), so shortened vectors would be poor"
            )
        if p.matryoshka_dimensions and dims not in p.matryoshka_dimensions:
            raise ValueError(f"PoolingParams.dimensions={dims} is invalid: this model supports {list(p.matryoshka_dimensions)}")
        if dims > p.hidden_size:
            raise ValueError(f"PoolingParams.dimensions={dims} is invalid: must be <= the hidden size {p.hidden_size}")

    # ---- error messages that say which method fits -----------------------------------------
    def unsupported(self, task: str) -> str:
        """Why ``task`` is refused, opening with vLLM 0.26's words for it (scripts may match them)."""
        if task in self.pooling.switch_tasks:
            return (f"Try switching the model's pooling_task via `PoolerConfig(task=\"{task}\")`: {self._describe()} "
                    f"serves LLM.{self._methods()}, and {task!r} when LLM(..., pooler_config=PoolerConfig(task={task!r})) "
                    "makes that its task")
        if task == "score" and self.pooling.head == "token_classify":
            return (f"This model does not support the Scoring API: {self._describe()} labels each prompt token; "
                    f"use LLM.{self._methods()}")
        if task == "score" and self.pooling.head == "classify":
            return (f"Scoring API is only enabled for num_labels == 1. score needs a cross-encoder (a classifier with "
                    f"one output label); {self._describe()} has {len(self.pooling.labels or ())} labels: use LLM.classify()")
        if task == "score":
            return "an embedding model scores text pairs by the cosine of their embeddings: use LLM.score()"
        api = "Embedding" if task in ("embed", "token_embed") else "Classification"
        return (f"{api} API is not supported by this model: task {task!r} is not served by {self._describe()}; "
                f"use LLM.{self._methods()}")

    def generation_refused(self, what: str) -> str:
        return (f"{what} needs a generative model, but {self._describe()} is a pooling model: "
                f"use LLM.{self._methods()}")

    def _methods(self) -> str:
        return " or LLM.".join(TASK_METHODS[task] for task in self.pooling.tasks)

    def _describe(self) -> str:
        return f"model {self.config.model!r} ({self.pooling.architecture}, {self.pooling.head})"


def refuse_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError(f"lora_request={lora_request!r} is not supported for pooling models: tokenmill applies "
                         "LoRA adapters to generation only; leave it None")


def render_score_template(tokenizer: Any, chat_template: str, query: str, document: str) -> str:
    """vLLM's score template: a Jinja chat template given the pair as messages of roles "query" and
    "document" (no generation prompt added; the template writes whatever the model expects)."""
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
    except Exception as exc:  # jinja2's errors and transformers' ValueErrors: the user needs the reason
        raise ValueError(f"score chat_template does not render the pair (roles 'query', 'document'): "
                         f"{type(exc).__name__}: {exc}") from exc
