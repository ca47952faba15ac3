"""LLM's methods for pooling models: encode, embed, classify and score (vLLM's signatures and outputs).

    llm = LLM("sentence-transformers/all-MiniLM-L6-v2")     # BertModel: a pooling model
    vectors = [o.outputs.embedding for o in llm.embed(["a cat", "a dog"])]
    scores = llm.score("a cat", ["a kitten", "a car"])      # cosine similarity, 1-to-N

`LLM` inherits these. A pooling model's `LLM` runs a `PoolingEngine` (chosen when it starts);
these methods refuse a generative model, and LLM's generation methods refuse a pooling model.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from tokenmill.gc_policy import collections_paused, young_collections_only
from tokenmill.inputs import one_per_prompt, prompt_list, short_repr
from tokenmill.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.pooling.engine import PoolingEngine, refuse_lora
from tokenmill.pooling.intake import CallIntake
from tokenmill.pooling_params import POOLING_TASKS, PoolingParams
from tokenmill.request_progress import ProgressOption

if TYPE_CHECKING:
    from tokenmill.engine.protocol import Engine
    from tokenmill.inputs import PromptType


_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def _gc_paused(method: _F) -> _F:
    """Run the call with Python's cyclic garbage collector paused (nested calls leave it to the outermost).

    A bulk call creates a few small objects per request, and with tens of thousands of requests
    the collector's full passes come again and again, each traversing every prompt and output
    list built so far (65,536 embeddings of 384 floats are 25M references): on the CPU, P6's BERT
    shape spent 60% of its host time in them. The loop itself makes no reference cycles, so
    nothing is lost by collecting once the call is over, as the collector will do on its own.
    """

    @functools.wraps(method)
    def paused(*args: Any, **kwargs: Any) -> Any:
        with collections_paused():
            return method(*args, **kwargs)

    return paused  # type: ignore[return-value]


# A call's requests enter the engine while it runs the earlier ones, this many steps' worth ahead.
_STEPS_QUEUED = 2


class PoolingMethods:
    llm_engine: "Engine"
    _request_counter: Iterator[int]

    def _collect(self, ids: list[str], use_tqdm: ProgressOption, done: Any = None, collect_young: Any = None,
                 feed: Callable[[], bool] | None = None, finish: Callable[[Any], Any] | None = None) -> list[Any]:
        """Step the engine until the requests ``ids`` finish; their outputs in input order (`LLM._collect`)."""
        raise NotImplementedError

    def _run_pooling(self, prompts: Sequence[Any], params: Sequence[PoolingParams], use_tqdm: ProgressOption,
                     finish: Callable[[PoolingRequestOutput], Any] | None = None) -> list[Any]:
        """Every prompt's output in input order (``finish``: applied to each as it arrives).

        Every prompt is checked before the first step (`CallIntake`: parsed, validated, texts
        tokenized where their length needs it), so a bad one refuses the call before any request
        runs, as in vLLM, rather than after the requests before it ran and were dropped. The
        requests then enter the engine a few steps ahead of it rather than all before its first
        step: queueing them and converting their outputs after the last step left the device idle
        for a good part of a call of tens of thousands of short prompts (docs/perf.md 100).
        """
        engine = self.llm_engine
        assert isinstance(engine, PoolingEngine)
        ids = [str(next(self._request_counter)) for _ in prompts]
        intake = CallIntake(engine, ids, prompts, params)
        ahead = _STEPS_QUEUED * engine.config.max_num_batched_tokens

        def feed() -> bool:
            while engine.queued_tokens < ahead:
                request = intake.next_request()
                if request is None:
                    return False
                engine.queue(request)
            return True

        with young_collections_only() as collect_young:
            return self._collect(ids, use_tqdm, collect_young=collect_young, feed=feed, finish=finish)

    @_gc_paused
    def encode(
        self,
        prompts: "PromptType | Sequence[PromptType]",
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: ProgressOption = True,
        lora_request: Any = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Run a pooling model over every prompt; the raw pooled tensors, in input order.

        ``pooling_task`` is "embed", "token_embed" (one vector per token), "classify",
        "token_classify" (class probabilities per token, [prompt tokens, labels]: a token classifier's
        NER labels, or a sequence classifier's head on every token) or "score"; None (an error in vLLM 0.26)
        means PoolerConfig.task, else the model's own task (embed for embedders, classify for
        classifiers, token_classify for token classifiers). vLLM's keywords: ``tokenization_kwargs`` (``truncate_prompt_tokens`` among
        them: vLLM 0.26's way to truncate; tokenmill's older keyword of that name still works),
        ``use_tqdm`` on/off or a tqdm-like factory, ``lora_request`` None only.
        """
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, pooling_task,
                          tokenization_kwargs)

    @_gc_paused
    def embed(
        self,
        prompts: "PromptType | Sequence[PromptType]",
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: ProgressOption = True,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), L2-normalised unless the model or
        ``PoolingParams(use_activation=False)`` says otherwise. Keywords as `encode`'s."""
        self._pooling_engine("embed")
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, "embed",
                          tokenization_kwargs, EmbeddingRequestOutput.from_base)

    @_gc_paused
    def classify(
        self,
        prompts: "PromptType | Sequence[PromptType]",
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: ProgressOption = True,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``outputs.probs``, in the order of the model's id2label).
        Keywords as `encode`'s."""
        self._pooling_engine("classify")
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, "classify",
                          tokenization_kwargs, ClassificationRequestOutput.from_base)

    @_gc_paused
    def reward(
        self,
        prompts: "PromptType | Sequence[PromptType]",
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: ProgressOption = True,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's LLM.reward: `encode` with ``pooling_task="token_classify"`` (the head's scores on every
        token). Process reward models' STEP pooling is not implemented."""
        self._pooling_engine("reward")
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, "token_classify",
                          tokenization_kwargs)

    @_gc_paused
    def score(
        self,
        data_1: "PromptType | Sequence[PromptType]",
        data_2: "PromptType | Sequence[PromptType]",
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: ProgressOption = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs: one ``data_1`` against each of ``data_2`` (1-to-1, 1-to-N), or
        pairwise (N-to-N, equal lengths).

        A cross-encoder (a classifier with one label) reads each pair as one input, text_1 and
        text_2 joined as vLLM joins them, or rendered by ``chat_template``, a score template
        (PoolingEngine.pair_prompt); an embedding model embeds both texts and scores their cosine
        similarity. ``pooling_params.extra_kwargs`` may hold vLLM's ``max_tokens_per_query`` /
        ``max_tokens_per_doc`` (data_1's / data_2's texts cut to that many tokens, special tokens not counted).
        """
        engine = self._pooling_engine("score")
        refuse_lora(lora_request)
        if engine.pooling.head != "embed" and "score" not in engine.pooling.tasks:
            raise ValueError(engine.unsupported("score"))  # before the inputs, as vLLM checks the model first
        if chat_template is not None and engine.pooling.head == "embed":
            raise ValueError("score(chat_template=...) applies to cross-encoders: an embedding model scores the cosine "
                             "of each text's own embedding (vLLM ignores the template there); leave chat_template None")
        for name, data in (("data_1", data_1), ("data_2", data_2)):
            if not isinstance(data, (str, dict, list, tuple)):
                raise ValueError(f"score {name}={short_repr(data)} is invalid: must be a text, a prompt dict or a list of them")
        first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        for name, items in (("data_1", first), ("data_2", second)):
            for i, item in enumerate(items):
                if isinstance(item, dict) and "content" in item:
                    raise ValueError(f"score {name}: a multi-modal input ({{'content': [...]}}) is not supported for "
                                     f"{engine.pooling.architecture}: tokenmill serves text-only models; give strings")
                if engine.pooling.head != "embed" and not isinstance(item, str):  # as vLLM: texts only
                    raise ValueError(f"score {name}[{i}]={short_repr(item)} is invalid: a cross-encoder scores text "
                                     "pairs, so it must be a string")
        if not first or not second:
            raise ValueError("score needs at least one text in data_1 and in data_2")
        if len(first) > 1 and len(first) != len(second):
            raise ValueError(
                f"score got {len(first)} texts in data_1 and {len(second)} in data_2: give one data_1 text "
                "for any number of data_2 texts (1-to-N), or the same number of each (N-to-N)"
            )
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        extra = (pooling_params.extra_kwargs if pooling_params is not None else None) or {}
        first = cut_texts(engine, first, extra.get("max_tokens_per_query", 0), "max_tokens_per_query")
        second = cut_texts(engine, second, extra.get("max_tokens_per_doc", 0), "max_tokens_per_doc")
        if engine.pooling.head == "embed":
            return self._embedding_scores(first, second, pooling_params, truncate_prompt_tokens, use_tqdm,
                                          tokenization_kwargs)
        return self._cross_encoder_scores(engine, first, second, pooling_params, truncate_prompt_tokens, use_tqdm,
                                          tokenization_kwargs, chat_template)

    # ---- internals ------------------------------------------------------------------------
    def _pool(self, prompts: "PromptType | Sequence[PromptType]", pooling_params: Any, truncate_prompt_tokens: int | None,
              use_tqdm: ProgressOption, lora_request: Any, pooling_task: str | None,
              tokenization_kwargs: dict[str, Any] | None, finish: Callable[[PoolingRequestOutput], Any] | None = None,
              ) -> list[Any]:
        """`encode`'s work; ``finish`` turns each output into the calling method's kind as it arrives."""
        engine = self._pooling_engine("encode")
        _check_pooling_task(pooling_task, prompts)
        refuse_lora(lora_request)
        prompts, truncate_prompt_tokens = engine.tokenized(prompt_list(prompts), tokenization_kwargs,
                                                           truncate_prompt_tokens)
        params = _params_per_prompt(pooling_params, len(prompts), truncate_prompt_tokens, pooling_task)
        return self._run_pooling(prompts, params, use_tqdm, finish)

    def _embedding_scores(self, first: list, second: list, params: PoolingParams | None,
                          truncate_prompt_tokens: int | None, use_tqdm: ProgressOption,
                          tokenization_kwargs: dict[str, Any] | None) -> list[ScoringRequestOutput]:
        # Each distinct input is embedded once: data_1's text(s), then data_2's.
        embedded = self.encode(first + second, params, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, pooling_task="embed", tokenization_kwargs=tokenization_kwargs)
        return [embedding_score(a, b) for a, b in score_pairs(embedded[: len(first)], embedded[len(first):])]

    def _cross_encoder_scores(self, engine: "PoolingEngine", first: list, second: list, params: PoolingParams | None,
                              truncate_prompt_tokens: int | None, use_tqdm: ProgressOption,
                              tokenization_kwargs: dict[str, Any] | None,
                              chat_template: str | None) -> list[ScoringRequestOutput]:
        if params is not None and params.task == "classify":  # vLLM 0.26's name of a cross-encoder's task
            params = params.clone(task=None)
        _, truncate_prompt_tokens = engine.tokenized([], tokenization_kwargs, truncate_prompt_tokens)
        tokenizer_kwargs = {k: v for k, v in (tokenization_kwargs or {}).items()
                            if k not in ("truncate_prompt_tokens", "truncation_side")}
        params = _params_per_prompt(params, 1, truncate_prompt_tokens, "score")[0]
        prompts = [engine.pair_prompt(a, b, params.truncate_prompt_tokens, tokenizer_kwargs, chat_template)
                   for a, b in score_pairs(first, second)]
        return self._run_pooling(prompts, [params] * len(prompts), use_tqdm, ScoringRequestOutput.from_base)

    def _pooling_engine(self, method: str) -> "PoolingEngine":
        engine = self.llm_engine
        if not isinstance(engine, PoolingEngine):
            raise ValueError(
                f"LLM.{method}() needs a pooling model, but {self.llm_engine.config.model!r} runs as a generative "
                "model: use generate() or chat(), or start it as an embedder of its hidden states with "
                "LLM(model, runner='pooling')"
            )
        return engine

    def _refuse_pooling_model(self, method: str) -> None:
        """Generation methods on a pooling model fail at once, saying which methods fit."""
        engine = self.llm_engine
        if isinstance(engine, PoolingEngine):
            raise ValueError(engine.generation_refused(f"LLM.{method}()"))


def _check_pooling_task(pooling_task: str | None, prompts: Any) -> None:
    if pooling_task == "plugin" or (isinstance(prompts, dict) and "data" in prompts):
        raise ValueError("pooling_task='plugin' and {'data': ...} prompts (vLLM's IOProcessor plugins) are not "
                         f"supported: tokenmill has no plugins; pooling_task must be None or one of {POOLING_TASKS}")
    if pooling_task is not None and pooling_task not in POOLING_TASKS:
        raise ValueError(f"pooling_task={pooling_task!r} is invalid: must be None or one of {POOLING_TASKS}"
                         + ("; reward models: 'classify' or 'token_classify' (STEP pooling is not implemented)"
                            if pooling_task in ("reward", "encode") else ""))


def score_pairs(first: Sequence[_T], second: Sequence[_T]) -> list[tuple[_T, _T]]:
    """vLLM's score pairs: one first item against each second one (1-to-N), else pairwise (N-to-N;
    the caller has checked the lengths)."""
    return list(zip(list(first) * len(second) if len(first) == 1 else first, second))


def cut_texts(engine: "PoolingEngine", texts: list, limit: int, name: str) -> list:
    """vLLM's max_tokens_per_query / max_tokens_per_doc: each text cut after its first ``limit``
    tokens (special tokens not counted), at the character where that token ends."""
    if not limit:
        return texts
    if limit >= engine.config.max_model_len:
        raise ValueError(f"PoolingParams.extra_kwargs[{name!r}]={limit} is invalid: must be less than "
                         f"max_model_len={engine.config.max_model_len}")
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"PoolingParams.extra_kwargs[{name!r}] needs a fast (Rust) tokenizer to cut texts "
                         "at token boundaries; this model's is not one")
    out = []
    for text in texts:
        if isinstance(text, str):
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            if len(encoded["input_ids"]) > limit:
                text = text[: encoded["offset_mapping"][limit - 1][1]]
        out.append(text)
    return out


def _params_per_prompt(pooling_params: PoolingParams | Sequence[PoolingParams] | None, count: int,
                       truncate_prompt_tokens: int | None, task: str | None) -> list[PoolingParams]:
    if pooling_params is None:
        pooling_params = PoolingParams()
    given = one_per_prompt(pooling_params, count, PoolingParams, "pooling_params")
    changes: dict[str, Any] = {}
    if truncate_prompt_tokens is not None:
        changes["truncate_prompt_tokens"] = truncate_prompt_tokens
    if task is not None:
        changes["task"] = task
    out = []
    changed: dict[int, PoolingParams] = {}  # one copy per distinct object (usually one for the whole call)
    for params in given:
        copy = changed.get(id(params))
        if copy is None:
            if not isinstance(params, PoolingParams):
                raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
            if task is not None and params.task not in (None, task):
                raise ValueError(f"PoolingParams.task={params.task!r} does not match pooling_task={task!r}")
            copy = changed[id(params)] = params.clone(**changes) if changes else params
        out.append(copy)
    return out


def embedding_score(a: PoolingRequestOutput, b: PoolingRequestOutput) -> ScoringRequestOutput:
    """The cosine similarity of two embeddings, as vLLM's score() reports it for embedding models."""
    import torch.nn.functional as F

    return ScoringRequestOutput(
        request_id=f"{a.request_id}_{b.request_id}",
        outputs=ScoringOutput(float(F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0))),
        prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids,
        num_cached_tokens=0,
        finished=True,
    )
