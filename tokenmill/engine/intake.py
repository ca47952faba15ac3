"""Request intake: `add_request`'s arguments → a validated `Request` with its sequences.

Everything that can be wrong with a request is found here, before the engine takes it: the
prompt (tokenized, truncated, checked against the vocabulary and max_model_len), whether its
longest possible sequence fits the KV cache (so the scheduler never waits on a request that can
never run), token ids in the logit controls and in logprob_token_ids, beam widths. The engine's
additions to the sampling parameters are filled in: stop ids (with the model's eos), bad_words
tokenised, one grammar matcher per sample, and the length limit (`Request.max_output_tokens`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Container

from tokenmill.engine.beam_search import BeamSearch, beam_sampling_params
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request, Sequence, max_output_tokens
from tokenmill.inputs import PromptType, parse_prompt, truncated_ids, validate_prompt_ids
from tokenmill.logprobs import create_prompt_logprobs, create_sample_logprobs
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.structured_outputs import GrammarCache


class Intake:
    def __init__(
        self, config: "EngineConfig", tokenizer: Any, num_usable_blocks: int,
        on_grammars: Callable[["GrammarCache"], None],
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.num_usable_blocks = num_usable_blocks
        # Called once, with the GrammarCache built for the first structured request (the runner
        # masks logits with it).
        self._on_grammars = on_grammars
        self.grammars: GrammarCache | None = None
        self._next_seq_id = 0
        # The last params object given stop ids (`_with_stop_ids`): it, its fields then, its copy.
        self._stop_ids_copy: tuple[SamplingParams, dict[str, Any], SamplingParams] | None = None

    def make_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | None,
        index: int | None, ids_in_use: Container[str], seed: int | None = None,
    ) -> Request:
        """A ValueError names what is wrong; nothing changes anywhere until the request is returned.
        ``seed``: the request's own, in place of ``params.seed`` (`LLMEngine.add_request`)."""
        params = params if params is not None else SamplingParams()
        where = f"prompts[{index}]" if index is not None else "prompt"
        beam_params = params if isinstance(params, BeamSearchParams) else None
        if beam_params is not None:
            params = self._beam_sampling_params(beam_params, where)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        if request_id in ids_in_use:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer, got {type(seed).__name__} {seed!r}")
        if beam_params is None:
            params = self._check_logprobs(params, where)
            if params.best_of is not None and params.best_of > params.n:
                self._refuse_logits_mode(f"best_of={params.best_of}", where)
                if params.output_kind is RequestOutputKind.DELTA:
                    # Which n samples it returns is known only once all have finished: a delta
                    # stream would hand index 0 the new tokens of whichever sample led that step.
                    raise ValueError(f"{where}: SamplingParams.best_of={params.best_of} with n={params.n} is "
                                     "refused for output_kind=DELTA (LLM.stream): best_of must equal n there, as in vLLM")
        for processor in self.config.logits_processors:  # vLLM's validate_params, where a class has it
            try:
                getattr(processor, "validate_params", lambda params: None)(params)
            except ValueError as exc:
                raise ValueError(f"{where}: {processor.__name__} refuses its SamplingParams: {exc}") from exc
        config = self.config
        processed = parse_prompt(prompt, self.tokenizer, index)
        if params.truncate_prompt_tokens is not None:
            keep = config.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if keep > config.max_model_len:  # as vLLM: a cut that could leave a prompt too long is refused
                raise ValueError(f"{where}: SamplingParams.truncate_prompt_tokens={keep} is invalid: must be -1 or at "
                                 f"most max_model_len ({config.max_model_len})")
            processed.token_ids = truncated_ids(processed, keep, self.tokenizer)
        validate_prompt_ids(processed.token_ids, config.vocab_size, config.max_model_len, where)
        self._check_fits_cache(processed.token_ids, params, where)
        params = self._with_stop_ids(params)
        params = self._with_logit_controls(params, where)
        matchers = self._grammar_matchers(params, where)
        request = Request(request_id, processed.prompt, processed.token_ids, params)
        request.cache_salt, request.seed = processed.cache_salt, seed
        request.max_output_tokens = max_output_tokens(params.max_tokens, len(processed.token_ids), config.max_model_len)
        if beam_params is not None:
            request.beam = BeamSearch(beam_params, params.all_stop_token_ids, max(1, request.max_output_tokens))
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = create_prompt_logprobs(params.flat_logprobs)  # position 0 empty: nothing predicts it
        for i in range(params.num_samples):
            request.sequences.append(self.new_sequence(request, i))
            request.sequences[-1].grammar = matchers[i] if matchers else None
        return request

    def new_sequence(self, request: Request, index: int) -> Sequence:
        """Sample ``index`` of the request (or a forked beam): a fresh id, its draw key, logprobs
        list and detokenizer as its parameters ask."""
        params = request.params
        seq = Sequence(self._next_seq_id, index, request, request.prompt_token_ids)
        self._next_seq_id += 1
        seed = request.seed if request.seed is not None else params.seed
        if seed is not None:
            # A 63-bit draw key of its own for each of the request's sequences (see worker/sampler.py).
            seq.seed = (seed if index == 0 else hash((seed, index))) & (2**63 - 1)
        if params.num_logprobs is not None:  # logprobs, or logprob_token_ids
            seq.logprobs = create_sample_logprobs(params.flat_logprobs)
        if params.detokenize and self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output, params.spaces_between_special_tokens,
            )
        return seq

    # ---- checks and the engine's additions ------------------------------------------------
    def _with_stop_ids(self, params: SamplingParams) -> SamplingParams:
        """The params with the model's eos among the stop ids, the engine's field set on a shallow
        copy (validation would reset it). Requests given one params object one after another (a
        call's prompts, the batch job's rows) share one copy, as they share the object: with a copy
        a request, each step's reads of every row's params touched as many objects as rows (~4 µs
        more a short request on the dev CPU, docs/perf.md 87). The copy serves while the object's
        fields are still those it was made from."""
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.config.eos_token_ids
        if stop_ids == params.all_stop_token_ids:
            return params
        last = self._stop_ids_copy
        if last is not None and last[0] is params and last[2].all_stop_token_ids == stop_ids and last[1] == vars(params):
            return last[2]
        copied = copy.copy(params)
        copied.all_stop_token_ids = stop_ids
        self._stop_ids_copy = (params, dict(vars(params)), copied)
        return copied

    def _grammar_matchers(self, params: SamplingParams, where: str) -> list | None:
        """One matcher per sample, from a grammar compiled once per distinct constraint."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{where}: structured_outputs needs a tokenizer (the engine was started with skip_tokenizer_init)")
        if self.grammars is None:
            from tokenmill.structured_outputs import GrammarCache

            self.grammars = GrammarCache(self.tokenizer, self.config.vocab_size)
            self._on_grammars(self.grammars)
        try:
            # A field set after construction gets construction's checks (clearing the one constraint
            # compiled a JSON-object grammar, two set compiled the first).
            params.structured_outputs.__post_init__()
            # The eos ids even under ignore_eos: a completed constraint still ends on one (nothing else may follow).
            stops = self.config.eos_token_ids | set(params.stop_token_ids)
            return [self.grammars.matcher(params.structured_outputs, stops) for _ in range(params.num_samples)]
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc

    def _with_logit_controls(self, params: SamplingParams, where: str) -> SamplingParams:
        """Check token ids (logit controls, logprob_token_ids, stop_token_ids: min_tokens masks those in
        the logits) against the vocabulary, as vLLM does, and tokenize bad_words (vLLM: each word as is
        and with a leading space, since both spellings occur mid-text)."""
        vocab = self.config.vocab_size
        # vLLM bounds allowed_token_ids by the tokenizer: a model's ids past it (an lm_head padded to a
        # round size) have no text, and allowing only those would generate nothing but them.
        allowed = min(vocab, len(self.tokenizer)) if params.allowed_token_ids and self.tokenizer is not None else vocab
        for name, ids, limit in (("logit_bias", list(params.logit_bias or {}), vocab),
                                 ("allowed_token_ids", params.allowed_token_ids or [], allowed),
                                 ("logprob_token_ids", params.logprob_token_ids or [], vocab),
                                 ("stop_token_ids", params.stop_token_ids, vocab)):
            bad = [t for t in ids if not 0 <= t < limit]
            if bad:
                what = "the vocabulary" if limit == vocab else "the tokenizer's vocabulary"
                padding = f" (the model's ids {limit}..{vocab - 1} are padding, without text)" if limit < vocab else ""
                raise ValueError(f"{where}: SamplingParams.{name} has token ids {bad[:5]} outside {what} [0, {limit}){padding}")
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError(f"{where}: SamplingParams.bad_words needs a tokenizer (the engine was started with skip_tokenizer_init)")
        sequences: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        params = copy.copy(params)
        params.bad_words_token_ids = sequences
        return params

    def logprobs_limit(self) -> tuple[int, str]:
        """The most logprobs (or prompt logprobs) a position may ask for, and the rule in words."""
        vocab, most = self.config.vocab_size, self.config.max_logprobs
        if most == -1 or most >= vocab:
            return vocab, f"<= the size of the vocabulary ({vocab})"
        return most, f"<= max_logprobs ({most}); LLM(max_logprobs=N) raises the limit, -1 allows the whole vocabulary"

    def _check_logprobs(self, params: SamplingParams, where: str) -> SamplingParams:
        """vLLM's rule: at most ``max_logprobs`` alternatives per position (-1: the vocabulary), and
        never more than the vocabulary holds (asking for more would fail inside the step). A
        request's -1 (vLLM: every token of the vocabulary) counts as the vocabulary's size and is
        replaced by it, on a shallow copy, for the runner."""
        vocab = self.config.vocab_size
        limit, allowed = self.logprobs_limit()
        whole = {}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1:
                value = whole[name] = vocab
            if value is not None and value > limit:
                shown = f"-1 (the whole vocabulary, {vocab})" if name in whole else str(value)
                raise ValueError(f"{where}: SamplingParams.{name}={shown} is invalid: must be {allowed}")
        if whole:
            params = copy.copy(params)  # __post_init__ not rerun: the engine's fields stay as they are
            for name, value in whole.items():
                setattr(params, name, value)
        return params

    def _check_fits_cache(self, token_ids: list[int], params: SamplingParams, where: str) -> None:
        longest = len(token_ids) + (params.max_tokens or self.config.max_model_len)
        longest = min(longest, self.config.max_model_len)
        needed = -(-longest // self.config.block_size)
        if needed > self.num_usable_blocks:
            raise ValueError(
                f"{where} may grow to {longest} tokens ({needed} KV blocks) but the KV cache holds only "
                f"{self.num_usable_blocks} blocks; lower max_tokens or max_model_len, or give the cache "
                "more memory (kv_cache_memory_bytes / gpu_memory_utilization)"
            )

    def _refuse_logits_mode(self, what: str, where: str) -> None:
        """Beams and best_of rank candidates by summed logprobs, which logits modes do not report."""
        mode = self.config.logprobs_mode
        if mode.endswith("_logits"):
            raise ValueError(f"{where}: {what} ranks by log-probabilities, but the engine reports logits "
                             f"(logprobs_mode={mode!r}); use 'raw_logprobs' or 'processed_logprobs'")

    def _beam_sampling_params(self, params: BeamSearchParams, where: str) -> SamplingParams:
        try:  # a field set after construction gets construction's checks (beam_width=0 failed an assert)
            params.__post_init__()
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        self._refuse_logits_mode("a beam search", where)
        if params.beam_width > self.config.max_num_seqs:
            raise ValueError(
                f"{where}: BeamSearchParams.beam_width={params.beam_width} is invalid: must be <= max_num_seqs "
                f"({self.config.max_num_seqs}), since all beams of a prompt run in one batch"
            )
        return beam_sampling_params(params, len(self.config.eos_token_ids))
