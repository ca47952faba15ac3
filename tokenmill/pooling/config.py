"""Whether a model runs as a pooling model, and how it pools: resolved once when the engine starts.

The runner follows vLLM: ``runner="auto"`` picks pooling for architectures with a pooling head
(``BertModel``, ``*ForSequenceClassification``, ``*ForTokenClassification``, base models such as
``Qwen3Model``) and for sentence-transformers embedder folders whatever their architecture
(Qwen3-Embedding's is ``Qwen3ForCausalLM``), and generation for other ``*ForCausalLM``;
``runner="pooling"`` runs a causal LM as an embedder of its final hidden states (``convert="embed"``). The older ``task="embed" | "classify" | "score" | "generate"`` spelling
maps onto the same choices.

How the model pools, in increasing priority: the model class's default (CLS for BERT, LAST for
decoders), the sentence-transformers files in the model folder (read in
``models/sentence_transformers_folder.py``), then the user's ``pooler_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from tokenmill.models.source import ModelSource

# Default token budget of a pooling step on a GPU with >= 70 GiB, and below that (see step_limits).
_LARGE_GPU_STEP_TOKENS, _GPU_STEP_TOKENS, _LARGE_GPU_BYTES = 65536, 16384, 70 * 2**30

PoolingType = Literal["CLS", "LAST", "MEAN"]
POOLING_TYPES: tuple[str, ...] = ("CLS", "LAST", "MEAN")
Activation = Literal["softmax", "sigmoid", "identity"]


@dataclass(frozen=True)
class PoolerConfig:
    """Model-level pooling settings (vLLM's ``PoolerConfig``); request fields left None take these.

    ``LLM(model, pooler_config=PoolerConfig(pooling_type="MEAN"))`` or a dict with these keys.
    ``use_activation`` is the classifier's activation, and for an embedder (as in vLLM 0.26) its
    L2 normalisation, which older vLLM called ``normalize``.
    """

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    # Classifiers: logits calibrated as (logit - logit_mean) / logit_sigma before the activation
    # (vLLM's Platt scaling), raw outputs included.
    logit_mean: float | None = None
    logit_sigma: float | None = None
    # vLLM 0.26's split of pooling_type: the sequence pooling is pooling_type; token-wise pooling
    # (token_embed) keeps every token ("ALL"), the only kind tokenmill has.
    seq_pooling_type: PoolingType | None = None
    tok_pooling_type: Literal["ALL"] | None = None
    task: str | None = None  # vLLM's; the runner and the LLM method called decide the task here
    # vLLM features tokenmill lacks, taken only at their "off" values.
    enable_chunked_processing: bool = False
    max_embed_len: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if str(self.pooling_type).upper() in ("ALL", "STEP"):
            # vLLM reads a token-wise type given as pooling_type as tok_pooling_type.
            if self.tok_pooling_type is not None:
                raise ValueError(f"PoolerConfig.pooling_type={self.pooling_type!r} and tok_pooling_type="
                                 f"{self.tok_pooling_type!r}: set one")
            object.__setattr__(self, "tok_pooling_type", str(self.pooling_type).upper())
            object.__setattr__(self, "pooling_type", None)
        if self.seq_pooling_type is not None:
            if self.pooling_type is not None and str(self.pooling_type).upper() != str(self.seq_pooling_type).upper():
                raise ValueError(f"PoolerConfig.pooling_type={self.pooling_type!r} and seq_pooling_type="
                                 f"{self.seq_pooling_type!r} disagree: set one")
            object.__setattr__(self, "pooling_type", self.seq_pooling_type)
            object.__setattr__(self, "seq_pooling_type", None)
        _refuse_unless_off(self)
        for name in ("logit_mean", "logit_sigma"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value):
                raise ValueError(f"PoolerConfig.{name}={value!r} is invalid: must be None or a number")
        if self.logit_sigma == 0:
            raise ValueError("PoolerConfig.logit_sigma=0 is invalid: the logits are divided by it")
        if self.pooling_type is not None:
            upper = str(self.pooling_type).upper()
            if upper not in POOLING_TYPES:
                raise ValueError(f"PoolerConfig.pooling_type={self.pooling_type!r} is invalid: must be one of {POOLING_TYPES}")
            object.__setattr__(self, "pooling_type", upper)
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"PoolerConfig.{name}={value!r} is invalid: must be None, True or False")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"PoolerConfig.dimensions={self.dimensions!r} is invalid: must be None or an integer >= 1")

    @classmethod
    def coerce(cls, value: Any, where: str = "pooler_config") -> "PoolerConfig":
        """A PoolerConfig from a PoolerConfig, a dict of its fields, or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"{where} has unknown key(s) {unknown}; allowed: {sorted(known)}")
            return cls(**value)
        raise TypeError(f"{where} must be a PoolerConfig or a dict, got {type(value).__name__}")

    def calibrated(self, logits: "torch.Tensor") -> "torch.Tensor":
        """A classifier's logits after logit_mean and logit_sigma (unchanged when neither is set)."""
        if self.logit_mean is not None:
            logits = logits - self.logit_mean
        if self.logit_sigma is not None:
            logits = logits / self.logit_sigma
        return logits

    def merged_over(self, base: "PoolerConfig") -> "PoolerConfig":
        """These settings where set, ``base``'s elsewhere."""
        return PoolerConfig(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(base, f.name)
                               for f in fields(self)})


# PoolerConfig fields of vLLM's whose features tokenmill lacks: their "off" value, and why.
_OFF_ONLY: dict[str, tuple[Any, str]] = {
    "tok_pooling_type": ("ALL", "token-wise pooling keeps every token; STEP pooling (reward models) is not implemented"),
    "enable_chunked_processing": (False, "inputs longer than max_model_len are refused (or cut with "
                                         "truncate_prompt_tokens), not embedded in chunks"),
    "max_embed_len": (None, "an input may be as long as max_model_len"),
    "step_tag_id": (None, "STEP pooling (process reward models) is not implemented"),
    "returned_token_ids": (None, "STEP pooling (process reward models) is not implemented"),
}


def _refuse_unless_off(config: PoolerConfig) -> None:
    for name, (off, why) in _OFF_ONLY.items():
        value = getattr(config, name)
        if value is not None and value != off:
            raise ValueError(f"PoolerConfig.{name}={value!r} is not supported: {why}")
    if config.task is not None and config.task not in CONFIG_TASKS:
        raise ValueError(f"PoolerConfig.task={config.task!r} is invalid: must be None or one of {CONFIG_TASKS}"
                         + ("; vLLM 0.26 scores with the 'classify' task" if config.task == "score" else ""))


# PoolerConfig.task values: vLLM 0.26's pooling tasks that tokenmill serves.
CONFIG_TASKS = ("embed", "token_embed", "classify", "token_classify")


RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's older `task=` values -> (runner, convert).
TASK_SPELLINGS: dict[str, tuple[str, str]] = {
    "auto": ("auto", "auto"),
    "generate": ("generate", "auto"),
    "embed": ("pooling", "embed"),
    "embedding": ("pooling", "embed"),
    "classify": ("pooling", "classify"),
    "score": ("pooling", "auto"),
}
# Which LLM method serves each pooling task (for error messages).
TASK_METHODS = {"embed": "embed()", "token_embed": "encode(pooling_task='token_embed')", "classify": "classify()",
                "token_classify": "encode(pooling_task='token_classify')", "score": "score()"}
_ST_ACTIVATIONS: dict[str, Activation] = {"Sigmoid": "sigmoid", "Identity": "identity"}


@dataclass(frozen=True)
class PoolingModelConfig:
    """What the engine needs to serve a pooling model."""

    head: str  # "embed", "classify" or "token_classify" (a label per token): what the model's head produces
    architecture: str  # the registry entry to build (a causal LM run as an embedder: its base model)
    pooler: PoolerConfig  # pooling_type decided; the other fields are request defaults (None: vLLM's)
    classify_activation: Activation  # classify, token_classify and (one label) score, as vLLM's get_act_fn
    score_activation: Activation | None  # None: not a cross-encoder (score needs exactly one label)
    labels: tuple[str, ...] | None  # config.id2label in label order (classifiers)
    takes_token_type_ids: bool
    max_seq_length: int | None  # sentence-transformers' max_seq_length: the default max_model_len
    matryoshka_dimensions: tuple[int, ...] | None
    is_matryoshka: bool
    hidden_size: int
    # Tasks the model has a head for but serves only when PoolerConfig(task=...) names them, as
    # vLLM 0.26 serves a task other than the model's default: a decoder token classifier's classify.
    switch_tasks: tuple[str, ...] = ()

    @property
    def tasks(self) -> tuple[str, ...]:
        if self.head == "embed":
            return ("embed", "token_embed")
        if self.head == "token_classify":
            return ("token_classify",)
        if self.score_activation is not None:
            return ("classify", "token_classify", "score")
        return ("classify", "token_classify")

    def step_limits(
        self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int, *, max_model_len_given: bool,
        batched_given: bool, seqs_given: bool, tensor_parallel_size: int, device: "torch.device",
    ) -> tuple[int, int, int]:
        """(max_model_len, max_num_batched_tokens, max_num_seqs) for whole-prompt steps: every
        prompt must fit one step's token budget. ``*_given``: the user set that value (else it was
        a default, which pooling may change).

        A pooling step keeps no KV cache, so on a GPU its budget is set by activation memory
        alone, and by default it is far larger than a generation step's: 64K tokens on GPUs with
        >= 70 GiB (16K below). Larger steps buy nothing on the device (GEMMs of >= 16K rows already
        run near peak) but amortise each step's fixed host cost (launching some 10 kernels a layer)
        over more prompts and halve the number of steps whose host work must hide under the
        device's; 64K tokens of Qwen3-0.6B activations take ~3 GB, of an 8B embedder ~8 GB. The
        number of prompts a step may hold is then the token budget's business: short prompts
        cost nothing per prompt on the device, so by default ``max_num_seqs`` does not bind.
        """
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: pooling models run on one device "
                             "(tensor parallelism is for generation); use tensor_parallel_size=1")
        if not max_model_len_given and self.max_seq_length is not None:
            max_model_len = min(max_model_len, self.max_seq_length)
        batched = max_num_batched_tokens
        if not batched_given:
            batched = max(batched, max_model_len, _gpu_step_tokens(device))
        elif batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={batched} is smaller than max_model_len={max_model_len}: a pooling model "
                "computes each prompt in one step, so raise max_num_batched_tokens or lower max_model_len"
            )
        if not seqs_given and device.type == "cuda":
            max_num_seqs = max(max_num_seqs, batched)
        return max_model_len, batched, max_num_seqs


def _gpu_step_tokens(device: "torch.device") -> int:
    """The default pooling step on this device: 0 (no change) off the GPU."""
    if device.type != "cuda":
        return 0
    import torch

    large = torch.cuda.get_device_properties(device).total_memory >= _LARGE_GPU_BYTES
    return _LARGE_GPU_STEP_TOKENS if large else _GPU_STEP_TOKENS


def resolve_pooling(
    source: "ModelSource", runner: str = "auto", convert: str = "auto", task: str | None = None, pooler_config: Any = None,
) -> PoolingModelConfig | None:
    """The pooling settings of the model, or None when it runs as a generative model (the
    arguments are LLM()'s of the same names)."""
    from tokenmill.models.registry import architecture_of, embedding_architecture_of, get_model_class, pooling_task_of
    from tokenmill.models.sentence_transformers_folder import cross_encoder_activation, embedder_settings, has_pooling_module

    arch = architecture_of(source.hf_config)
    head = pooling_task_of(arch)
    runner, convert = _runner_and_convert(runner, convert, task)
    if runner == "auto":
        runner = "pooling" if head or has_pooling_module(source.config_dir) else "generate"
    if runner == "generate":
        if head is not None:
            raise ValueError(
                f"{arch} is a pooling model ({head}): it has no language-model head and cannot generate. "
                f"Start it with runner='pooling' (or 'auto') and use LLM.{TASK_METHODS[head]}"
            )
        if convert not in ("auto", "none"):
            raise ValueError(f"LLM(convert={convert!r}) needs runner='pooling' (got runner='generate')")
        return None
    architecture = arch
    if convert == "embed" and head != "embed" or convert == "auto" and head is None:
        base = embedding_architecture_of(arch)
        if base is None:
            raise ValueError(f"{arch} cannot run as an embedding model; embedders: BertModel, (XLM-)RobertaModel, base models and causal LMs "
                             "of the Llama family")
        architecture, head = base, "embed"
    elif convert == "classify" and head not in ("classify", "token_classify"):  # vLLM's default convert of both
        raise ValueError(f"LLM(convert='classify') needs a *ForSequenceClassification checkpoint (a trained score head); "
                         f"{arch} has none")
    elif head is None:  # convert="none" on a causal LM
        raise ValueError(f"{arch} has no pooling head; use convert='embed' to embed with its final hidden states")
    config = source.hf_config
    model_cls = get_model_class(architecture)
    user = PoolerConfig.coerce(pooler_config)
    head, switch = _token_classifier_head(head, model_cls, user)
    if head == "embed":
        user = _embedder_normalize(user)
    st = embedder_settings(source.config_dir) if head == "embed" else {}
    defaults = PoolerConfig(pooling_type=st.get("pooling_type") or model_cls.default_pooling_type,
                            normalize=st.get("normalize"))
    classifier = head in ("classify", "token_classify")
    num_labels = int(getattr(config, "num_labels", 0) or 0) if classifier else 0
    activation = _classify_activation(config, num_labels, cross_encoder_activation(source.config_dir) if classifier else None)
    served = {"embed": ("embed", "token_embed"), "classify": ("classify", "token_classify"),
              "token_classify": ("token_classify", *switch)}[head]
    if user.task is not None and user.task not in served:
        raise ValueError(f"PoolerConfig.task={user.task!r} is not served by {architecture} ({head}); "
                         f"it serves {served}")
    return PoolingModelConfig(
        head=head,
        architecture=architecture,
        pooler=user.merged_over(defaults),
        classify_activation=activation,
        score_activation=activation if num_labels == 1 and head == "classify" else None,
        labels=_labels(config, num_labels) if classifier else None,
        takes_token_type_ids=bool(getattr(model_cls, "takes_token_type_ids", False)),
        max_seq_length=st.get("max_seq_length"),
        matryoshka_dimensions=tuple(getattr(config, "matryoshka_dimensions", None) or ()) or None,
        is_matryoshka=bool(getattr(config, "matryoshka_dimensions", None) or getattr(config, "is_matryoshka", False)),
        hidden_size=int(config.hidden_size),
        switch_tasks=switch,
    )


def _token_classifier_head(head: str, model_cls: type, user: PoolerConfig) -> tuple[str, tuple[str, ...]]:
    """The head a model serves and the tasks only PoolerConfig.task opens (``switch_tasks``).

    vLLM 0.26 serves a decoder ``*ForTokenClassification`` as its causal LM converted to a
    classifier: its score head classifies every token (token_classify, the default task of a
    ``ForTokenClassification`` architecture) or the last one (classify), the latter only when
    ``PoolerConfig(task="classify")`` makes it the model's task; the model then serves as a sequence
    classifier. An encoder token classifier has no sequence head (no ``classify`` method): token_classify only.
    """
    if head != "token_classify" or not callable(getattr(model_cls, "classify", None)):
        return head, ()
    if user.task == "classify":
        return "classify", ()
    return head, ("classify",)


def _embedder_normalize(config: PoolerConfig) -> PoolerConfig:
    """An embedder's config with vLLM 0.26's ``use_activation`` read as ``normalize`` (its name before)."""
    if config.use_activation is None:
        return config
    if config.normalize is not None and config.normalize != config.use_activation:
        raise ValueError(f"pooler_config: normalize={config.normalize} and use_activation={config.use_activation} disagree; "
                         "for an embedding model both name the L2 normalisation, so set one")
    return replace(config, normalize=config.use_activation, use_activation=None)


def _runner_and_convert(runner: str, convert: str, task: str | None) -> tuple[str, str]:
    if task is None:
        return runner, convert
    task_runner, task_convert = TASK_SPELLINGS[task]
    for name, given, implied in (("runner", runner, task_runner), ("convert", convert, task_convert)):
        if given != "auto" and implied != "auto" and given != implied:
            raise ValueError(f"LLM(task={task!r}) means {name}={implied!r}, but {name}={given!r} was given")
    return (task_runner if runner == "auto" else runner), (task_convert if convert == "auto" else convert)


def _classify_activation(config: Any, num_labels: int, st_saved: str | None) -> Activation:
    """A classifier's activation, decided as vLLM 0.26's get_act_fn does (for classify, token_classify
    and a cross-encoder's score alike): the problem_type transformers' losses read (regression raw,
    multi-label a sigmoid per label, single-label softmax), else the activation sentence-transformers
    saved with a cross-encoder (``st_saved``, from config_sentence_transformers.json, over config.json's
    older spellings, in sentence-transformers' order), else softmax over labels (sigmoid for a single label)."""
    problem = getattr(config, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    saved = None
    if problem != "single_label_classification":
        saved = st_saved or (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") \
            or getattr(config, "sbert_ce_default_activation_function", None)
    if saved is not None:
        name = str(saved).rsplit(".", 1)[-1]
        if name not in _ST_ACTIVATIONS:
            raise ValueError(f"the cross-encoder's activation {saved!r} is not supported; supported: {sorted(_ST_ACTIVATIONS)}")
        return _ST_ACTIVATIONS[name]
    return "sigmoid" if num_labels == 1 else "softmax"


def _labels(config: Any, num_labels: int) -> tuple[str, ...]:
    id2label = getattr(config, "id2label", None) or {}
    return tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
