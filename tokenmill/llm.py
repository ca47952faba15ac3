"""The LLM class: vLLM's offline API over tokenmill's engine.

    from tokenmill import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from typing import Any, Callable, Sequence

from tokenmill.config import EngineArgs
from tokenmill.engine.beam_search import beam_search_output
from tokenmill.engine_factory import create_engine
from tokenmill.gc_policy import collections_paused, young_collections_only
from tokenmill.generation_defaults import default_sampling_params
from tokenmill.inputs import (
    PromptType, load_chat_template, one_per_prompt, priority_per_prompt, prompt_list,
    render_chat_prompts, tokenize_prompts,
)
from tokenmill.llm_controls import EngineControlMethods
from tokenmill.llm_iterators import IteratorMethods
from tokenmill.pooling.llm_methods import PoolingMethods
from tokenmill.pooling_params import PoolingParams
from tokenmill.request_progress import ProgressOption, RequestProgress
from tokenmill.outputs import BeamSearchOutput, RequestOutput
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, for_call


class LLM(PoolingMethods, EngineControlMethods, IteratorMethods):
    """A model and its engine, started once, with vLLM's offline API (``LLM(model, **engine_args)``:
    `EngineArgs`' names and defaults).

    A generative model answers `generate`, `chat`, `beam_search`, `enqueue` / `wait_for_completion`
    (here), `imap` and `stream` (tokenmill/llm_iterators.py); a pooling model answers `encode`,
    `embed`, `classify`, `score` and `reward` (tokenmill/pooling/llm_methods.py). The engine
    controls (sleep, wake_up, profiling, metrics, weight transfer, collective_rpc) are in
    tokenmill/llm_controls.py.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any):
        self.args = EngineArgs.from_kwargs(model, **kwargs)
        # LLMEngine for a generative model, PoolingEngine for a pooling model (engine/protocol.py).
        self.llm_engine = create_engine(self.args)
        self._request_counter = itertools.count()
        # Request ids from enqueue() in order (a dict for membership tests), collected by wait_for_completion().
        self._queued: dict[str, None] = {}
        # Enqueued requests that finished while another call (generate, imap, ...) stepped the engine.
        self._queued_done: dict[str, RequestOutput] = {}
        # Requests of open imap() / stream() iterators -> that iterator's mailbox (llm_iterators.py).
        self._mailboxes: dict[str, dict[str, RequestOutput]] = {}
        # Starting the engine leaves hundreds of thousands of new objects (modules, compiled kernels,
        # the tokenizer) that the interpreter would otherwise walk in a full collection early in the
        # first long call: ~0.1 s with the host stopped and the GPU starved of steps (docs/perf.md 49).
        # Walked once here, they count as survivors, and the next full collection waits until a
        # quarter as many new long-lived objects have piled up.
        gc.collect()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """An LLM with these EngineArgs (vLLM's constructor)."""
        return cls(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})

    # ---- information ----------------------------------------------------------------------
    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's LLM.supported_tasks: ("generate",), or the pooling tasks of a pooling model."""
        return self.llm_engine.get_supported_tasks()

    @property
    def model_config(self) -> Any:
        """vLLM's LLM.model_config: the engine's settings (max_model_len, dtype, ...)."""
        return self.llm_engine.model_config

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_world_size(self, include_dp: bool = True) -> int:
        """The number of ranks (tensor parallel; tokenmill has no data or pipeline parallelism)."""
        return self.llm_engine.config.tensor_parallel_size

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams carrying the model's generation_config.json defaults (vLLM's 'auto'), with
        ``override_generation_config`` laid over them."""
        return default_sampling_params(self.args.generation_config, self.llm_engine.source.generation_config,
                                       self.args.override_generation_config)

    # ---- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressOption = True,
        *,
        lora_request: Any = None,
        priority: int | list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        vLLM's keywords: ``lora_request``: a `LoRARequest` for every prompt, or one (or None) per
        prompt (needs ``LLM(enable_lora=True)``); ``tokenization_kwargs`` go to the tokenizer for
        text prompts; ``priority`` (one int per prompt, or one for every prompt; lower first) orders
        the requests under ``LLM(scheduling_policy="priority")`` and, as in vLLM under
        first-come-first-served scheduling, has no effect otherwise; ``mm_processor_kwargs`` must be None (text only).
        """
        self._refuse_pooling_model("generate")
        prompts = self._prepared(prompt_list(prompts), priority, tokenization_kwargs, mm_processor_kwargs)
        return self._run(prompts, self._params_per_prompt(sampling_params, len(prompts)), use_tqdm,
                         _adapters(lora_request, len(prompts)), priority)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressOption = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of conversations.

        The conversation is rendered straight to token ids with the chat template (the template's
        own BOS is the only one); ``chat_template_kwargs`` are more template variables (e.g.
        ``{"enable_thinking": False}``). ``chat_template`` defaults to LLM(chat_template=...), then
        to the tokenizer's.
        """
        prompts = self._chat_prompts(messages, chat_template, add_generation_prompt, continue_final_message, tools,
                                     chat_template_kwargs, chat_template_content_format)
        prompts = self._prepared(prompts, None, tokenization_kwargs, mm_processor_kwargs)
        return self._run(prompts, self._params_per_prompt(sampling_params, len(prompts)), use_tqdm,
                         _adapters(lora_request, len(prompts)))

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt; per prompt, its ``beam_width`` best beams, best first.

        The search runs in the engine (a prompt's beams are sequences sharing KV blocks, batched
        with the other prompts' beams) and follows transformers' beam search (see
        `BeamSearchParams`). ``concurrency_limit`` searches that many prompts at a time (default: all).
        """
        self._refuse_pooling_model("beam_search")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (
            not isinstance(concurrency_limit, int) or isinstance(concurrency_limit, bool) or concurrency_limit < 1
        ):
            raise ValueError(f"concurrency_limit={concurrency_limit!r} is invalid: must be None or an integer >= 1")
        prompts = prompt_list(prompts)
        adapters = _adapters(lora_request, len(prompts))
        chunk = concurrency_limit or max(1, len(prompts))
        parts = [(start, prompts[start : start + chunk], adapters[start : start + chunk]) for start in range(0, len(prompts), chunk)]
        for start, part, part_adapters in parts[1:]:  # checked before any search runs: a bad prompt in a
            # later chunk would otherwise raise after the searches before it, dropping them
            self.llm_engine.abort_request(self._submit(part, [params] * len(part), adapters=part_adapters, first_index=start))
        outputs: list[RequestOutput] = []
        for start, part, part_adapters in parts:
            outputs += self._run(part, [params] * len(part), use_tqdm, part_adapters, first_index=start)
        return [beam_search_output(output, params, self.get_tokenizer()) for output in outputs]

    # ---- the queue: submit now, collect later --------------------------------------------
    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: Any = None,
        priority: int | list[int] | None = None,
        use_tqdm: ProgressOption = True,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """Queue prompts without running them; returns their request ids (all or none are queued)."""
        prompts = self._prepared(prompt_list(prompts), priority, tokenization_kwargs, mm_processor_kwargs)
        ids = self._submit(prompts, self._params_per_prompt(sampling_params, len(prompts)),
                           adapters=_adapters(lora_request, len(prompts)), priorities=priority)
        self._queued.update(dict.fromkeys(ids))
        return ids

    def enqueue_chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressOption = True,
        lora_request: Any = None,
        priority: int | list[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """Queue conversations without running them (vLLM's argument order; ``priority`` as in
        generate); returns their request ids."""
        prompts = self._chat_prompts(messages, chat_template, add_generation_prompt, continue_final_message, tools,
                                     chat_template_kwargs, chat_template_content_format)
        return self.enqueue(prompts, sampling_params, lora_request, priority, use_tqdm, tokenization_kwargs,
                            mm_processor_kwargs)

    def wait_for_completion(self, output_type: Any = None, *, use_tqdm: ProgressOption = True) -> list[RequestOutput]:
        """Run until every enqueued request is done; outputs in the order they were enqueued, less those
        aborted meanwhile, e.g. by sleep() (``output_type``: vLLM's filter; every output here is a RequestOutput).
        If the call is stopped (Ctrl-C) or fails, the requests stay queued and the outputs that finished
        are kept: calling it again goes on where it stopped."""
        ids, self._queued = list(self._queued), {}
        done, self._queued_done = self._queued_done, {}

        def requeue(finished: dict[str, RequestOutput]) -> None:  # the call failed (Ctrl-C, an error):
            # what finished and what still runs wait for the next wait_for_completion(), not lost.
            self._queued, self._queued_done = dict.fromkeys(ids), finished

        with young_collections_only() as collect_young:
            return self._collect(ids, use_tqdm, done, collect_young, requeue=requeue)

    # ---- internals ------------------------------------------------------------------------
    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return one_per_prompt(sampling_params, count, SamplingParams, "sampling_params")

    def _chat_prompts(
        self,
        messages: list[dict] | Sequence[list[dict]],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict] | None,
        chat_template_kwargs: dict[str, Any] | None = None,
        content_format: str = "auto",
    ) -> list[PromptType]:
        self._refuse_pooling_model("chat")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs the tokenizer, but it was not loaded (skip_tokenizer_init=True)")
        template = load_chat_template(chat_template or self.args.chat_template)
        with collections_paused():  # before _run's young collections: a call's conversations in bulk
            rendered = render_chat_prompts(
                tokenizer, conversations, template, add_generation_prompt, continue_final_message, tools,
                [f"messages[{i}]" for i in range(len(conversations))], chat_template_kwargs, content_format,
            )
            return [{"prompt_token_ids": ids, "prompt": tokenizer.decode(ids)} for ids in rendered]

    def _prepared(
        self, prompts: list[PromptType], priority: int | list[int] | None,
        tokenization_kwargs: dict[str, Any] | None, mm_processor_kwargs: dict[str, Any] | None,
    ) -> list[PromptType]:
        """Check vLLM's per-call keywords and apply ``tokenization_kwargs`` to text prompts."""
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: tokenmill serves text-only models")
        priority_per_prompt(priority, len(prompts))  # checked before any prompt is tokenized
        tokenizer = self.get_tokenizer()
        if tokenization_kwargs or tokenizer is not None:  # all text prompts in one tokenizer call
            with collections_paused():  # before _run's young collections: a call's prompts in bulk
                prompts = tokenize_prompts(prompts, tokenizer, tokenization_kwargs or {})
        return prompts

    def _generation_engine(self, method: str) -> Any:
        """The LLMEngine (its engine controls), or a clear error for a pooling model."""
        if self.llm_engine.config.pooling is not None:
            raise ValueError(f"LLM.{method}() is available for generative models; {self.llm_engine.config.model!r} "
                             "is served as a pooling model")
        return self.llm_engine

    def _submit(
        self, prompts: Sequence[PromptType], params: Sequence[SamplingParams | BeamSearchParams | PoolingParams],
        kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY, adapters: Sequence[Any] | None = None,
        priorities: int | Sequence[int] | None = None, first_index: int = 0,
    ) -> list[str]:
        """Add every request to the engine, or none: one invalid prompt rejects the whole call.
        ``adapters``: each prompt's LoRARequest or None; ``priorities``: each prompt's priority, or one for all;
        ``first_index``: the first prompt's index in the caller's list (errors name ``prompts[i]``).

        Like vLLM's LLM, the batch methods collect final outputs only, whatever output_kind says.
        """
        engine = self.llm_engine
        ids = [str(next(self._request_counter)) for _ in prompts]
        per_prompt = priority_per_prompt(priorities, len(prompts))  # one int stands for every prompt
        # One copy of each distinct params object (most calls pass one for every prompt), checked
        # once: the engine never changes a request's params in place, so the requests may share it.
        copies: dict[int, SamplingParams] = {}
        try:
            for index, (request_id, prompt, sp) in enumerate(zip(ids, prompts, params)):
                if isinstance(sp, SamplingParams):
                    made = copies.get(id(sp))
                    if made is None:
                        made = copies[id(sp)] = for_call(sp, kind, f"prompts[{first_index + index}]")
                    sp = made
                lora = adapters[index] if adapters is not None else None
                priority = per_prompt[index] if per_prompt is not None else 0
                engine.add_request(request_id, prompt, sp, lora_request=lora, priority=priority, index=first_index + index)
        except Exception:
            engine.abort_request(ids)
            raise
        return ids

    def _run(
        self, prompts: Sequence[PromptType], params: Sequence[SamplingParams | BeamSearchParams | PoolingParams],
        use_tqdm: ProgressOption, adapters: Sequence[Any] | None = None, priorities: int | Sequence[int] | None = None,
        first_index: int = 0,
    ) -> list[Any]:
        # Young collections only, at step boundaries, for the whole call (intake included): its
        # outputs pile up until it returns and full collections would walk them again and again
        # (tokenmill/gc_policy.py says why that is safe; docs/perf.md 62).
        with young_collections_only() as collect_young:
            return self._collect(self._submit(prompts, params, adapters=adapters, priorities=priorities, first_index=first_index), use_tqdm,
                                 collect_young=collect_young)

    def _step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step. Outputs of enqueued requests that finish here, during some other call,
        are kept for wait_for_completion (they are returned too; callers skip ids not theirs)."""
        outputs = self.llm_engine.step(finished_only=finished_only)
        if self._queued:
            self._queued_done.update((o.request_id, o) for o in outputs if o.finished and o.request_id in self._queued)
        if self._mailboxes:
            self._to_mailboxes(outputs)
        return outputs

    def _collect(
        self, ids: list[str], use_tqdm: ProgressOption, done: dict[str, RequestOutput] | None = None,
        collect_young: Callable[[], None] | None = None, feed: Callable[[], bool] | None = None,
        finish: Callable[[Any], Any] | None = None, requeue: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[Any]:
        """Step the engine until the requests ``ids`` finish; their outputs in the order of ``ids``
        (``done``: outputs of some of them that already finished; aborted ones are left out).
        ``collect_young``: called after each step (`gc_policy.young_collections_only`). ``feed``:
        called before each step to add more of the requests, False once all are in (an error it
        raises aborts every one of ``ids``). ``finish``: applied to each output as it arrives, so
        that work overlaps the device's next step. ``requeue``: if the call fails, it gets the
        outputs that finished, and the requests are left in the engine, not aborted."""
        engine = self.llm_engine
        order = {request_id: i for i, request_id in enumerate(ids)}
        results: list[Any] = [None] * len(ids)
        progress = RequestProgress(len(ids), use_tqdm)
        for request_id, output in (done or {}).items():
            results[order[request_id]] = output if finish is None else finish(output)
            progress.finished(output)
        remaining = sum(r is None for r in results)
        feeding = feed is not None
        try:
            while remaining and (feeding or engine.has_unfinished_requests()):
                if feeding:
                    feeding = feed()  # type: ignore[misc]
                for output in self._step(finished_only=True):
                    if output.request_id in order:  # requests queued by others finish here too
                        results[order[output.request_id]] = output if finish is None else finish(output)
                        progress.finished(output)
                        remaining -= 1
                if collect_young is not None:
                    collect_young()
        except BaseException:
            if requeue is None:
                engine.abort_request(ids)  # leave the engine clean for the next call (e.g. after Ctrl-C)
            else:
                requeue({request_id: results[i] for request_id, i in order.items() if results[i] is not None})
            raise
        finally:
            progress.close()
        # A request aborted meanwhile (sleep(), llm_engine.abort_request) has no output: left out, as in vLLM.
        return [output for output in results if output is not None]


def _adapters(lora_request: Any, count: int) -> list[Any]:
    """vLLM's ``lora_request``: one LoRARequest (or None) for every prompt, or a list with one per prompt."""
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * count
    if len(lora_request) != count:
        raise ValueError(f"got {len(lora_request)} lora_request entries for {count} prompts; give one, or one per prompt")
    return list(lora_request)
