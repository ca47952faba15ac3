"""LLM's methods for pooling models: encode, embed, classify and score (vLLM's signatures and outputs).

    llm = LLM("sentence-transformers/all-MiniLM-L6-v2")     # BertModel: a pooling model
    vectors = [o.outputs.embedding for o in llm.embed(["a cat", "a dog"])]
    scores = llm.score("a cat", ["a kitten", "a car"])      # cosine similarity, 1-to-N

`LLM` inherits these. A pooling model's `LLM` runs a `PoolingEngine` (chosen when it starts);
these methods refuse a generative model, and LLM's generation methods refuse a pooling model.
"""

from __future__ import annotations

import functools
import gc
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from tokenmill.inputs import one_per_prompt, prompt_list
from tokenmill.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.pooling.engine import PoolingEngine
from tokenmill.pooling_params import POOLING_TASKS, PoolingParams

if TYPE_CHECKING:
    from tokenmill.engine.protocol import Engine
    from tokenmill.inputs import PromptType


_F = TypeVar("_F", bound=Callable[..., Any])


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
        if not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()

    return paused  # type: ignore[return-value]


class PoolingMethods:
    llm_engine: "Engine"

    def _run(self, prompts: Sequence[Any], params: Sequence[Any], use_tqdm: bool) -> list[Any]:
        """Submit every prompt and collect the outputs in input order (`LLM._run`)."""
        raise NotImplementedError

    @_gc_paused
    def encode(
        self,
        prompts: "PromptType | Sequence[PromptType]",
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Run a pooling model over every prompt; the raw pooled tensors, in input order.

        ``pooling_task`` is "embed", "token_embed" (one vector per token), "classify" or "score";
        None means the model's own task (embed for embedders, classify for classifiers).
        """
        self._pooling_engine("encode")
        if pooling_task is not None and pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task={pooling_task!r} is invalid: must be None or one of {POOLING_TASKS}")
        prompts = prompt_list(prompts)
        params = _params_per_prompt(pooling_params, len(prompts), truncate_prompt_tokens, pooling_task)
        return self._run(prompts, params, use_tqdm)

    @_gc_paused
    def embed(
        self,
        prompts: "PromptType | Sequence[PromptType]",
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), normalised unless the model or
        ``PoolingParams(normalize=False)`` says otherwise."""
        self._pooling_engine("embed")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    @_gc_paused
    def classify(
        self,
        prompts: "PromptType | Sequence[PromptType]",
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``outputs.probs``, in the order of the model's id2label)."""
        self._pooling_engine("classify")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    @_gc_paused
    def score(
        self,
        data_1: "PromptType | Sequence[PromptType]",
        data_2: "PromptType | Sequence[PromptType]",
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs: one ``data_1`` against each of ``data_2`` (1-to-1, 1-to-N), or
        pairwise (N-to-N, equal lengths).

        A cross-encoder (a classifier with one label) reads each pair as one input, text_1 and
        text_2 joined by the tokenizer as a pair; an embedding model embeds both texts and scores
        their cosine similarity.
        """
        engine = self._pooling_engine("score")
        first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if not first or not second:
            raise ValueError("score needs at least one text in data_1 and in data_2")
        if len(first) > 1 and len(first) != len(second):
            raise ValueError(
                f"score got {len(first)} texts in data_1 and {len(second)} in data_2: give one data_1 text "
                "for any number of data_2 texts (1-to-N), or the same number of each (N-to-N)"
            )
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        if engine.pooling.head == "embed":
            return self._embedding_scores(first, second, pooling_params, truncate_prompt_tokens, use_tqdm)
        return self._cross_encoder_scores(engine, first, second, pooling_params, truncate_prompt_tokens, use_tqdm)

    # ---- internals ------------------------------------------------------------------------
    def _embedding_scores(self, first: list, second: list, params: PoolingParams | None,
                          truncate_prompt_tokens: int | None, use_tqdm: bool) -> list[ScoringRequestOutput]:
        # Each distinct input is embedded once: data_1's text(s), then data_2's.
        embedded = self.encode(first + second, params, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, pooling_task="embed")
        lefts, rights = embedded[: len(first)], embedded[len(first):]
        if len(lefts) == 1:
            lefts = lefts * len(rights)
        return [embedding_score(a, b) for a, b in zip(lefts, rights)]

    def _cross_encoder_scores(self, engine: "PoolingEngine", first: list, second: list, params: PoolingParams | None,
                              truncate_prompt_tokens: int | None, use_tqdm: bool) -> list[ScoringRequestOutput]:
        if "score" not in engine.pooling.tasks:
            raise ValueError(engine.unsupported("score"))
        params = _params_per_prompt(params, 1, truncate_prompt_tokens, "score")[0]
        if len(first) == 1:
            first = first * len(second)
        prompts = [engine.pair_prompt(a, b, params.truncate_prompt_tokens) for a, b in zip(first, second)]
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm)
        return [ScoringRequestOutput.from_base(o) for o in outputs]

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
