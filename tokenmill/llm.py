"""The LLM class: vLLM's offline API over tokenmill's engine.

    from tokenmill import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.inputs import PromptType, render_chat_prompt
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

# generation_config.json keys that map onto SamplingParams fields (vLLM's generation_config="auto").
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any):
        self.args = EngineArgs.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine(self.args)
        self._request_counter = itertools.count()

    # ---- information ----------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams carrying the model's generation_config.json defaults (vLLM's 'auto')."""
        if self.args.generation_config == "vllm":
            return SamplingParams()
        found = self.llm_engine.source.generation_config
        overrides = {field: found[key] for key, field in _GENERATION_DEFAULTS.items() if found.get(key) is not None}
        if not found.get("do_sample", True):
            overrides["temperature"] = 0.0
        return SamplingParams(**overrides)

    # ---- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run(prompts, self._params_per_prompt(sampling_params, len(prompts)), use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of conversations."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs the tokenizer, but it was not loaded (skip_tokenizer_init=True)")
        prompts: list[PromptType] = []
        for i, conversation in enumerate(conversations):
            ids = render_chat_prompt(
                tokenizer, conversation, chat_template, add_generation_prompt, continue_final_message, tools,
                where=f"messages[{i}]",
            )
            prompts.append({"prompt_token_ids": ids, "prompt": tokenizer.decode(ids)})
        return self._run(prompts, self._params_per_prompt(sampling_params, len(prompts)), use_tqdm)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # ---- internals ------------------------------------------------------------------------
    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts; give one, or one per prompt")
        return params

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._request_counter)) for _ in prompts]
        try:
            for index, (request_id, prompt, sp) in enumerate(zip(ids, prompts, params)):
                engine.add_request(request_id, prompt, sp, index=index)
        except Exception:
            engine.abort_request(ids)  # nothing runs unless every request is valid
            raise
        order = {request_id: i for i, request_id in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        progress = _Progress(len(ids), enabled=use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step(finished_only=True):
                    if output.request_id in order:  # requests queued by others finish here too
                        results[order[output.request_id]] = output
                        progress.finished(output)
        except BaseException:
            engine.abort_request(ids)  # leave the engine clean for the next call (e.g. after Ctrl-C)
            raise
        finally:
            progress.close()
        return results  # type: ignore[return-value]


class _Progress:
    """tqdm bar: requests done, with generated tokens per second."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.generated = 0

    def finished(self, output: RequestOutput) -> None:
        if self.bar is None:
            return
        self.generated += sum(len(c.token_ids) for c in output.outputs)
        elapsed = self.bar.format_dict.get("elapsed") or 1e-9
        self.bar.set_postfix_str(f"output {self.generated / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
