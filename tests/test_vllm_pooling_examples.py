"""vLLM's offline pooling examples (embed, classify, score, rerank, reward), run in-process on tiny
local models; the generation ones and the conventions (what may change, how a test names its example)
are in tests/test_vllm_examples.py."""

from __future__ import annotations

import pytest

from test_vllm_examples import ENGINE, PROMPTS, _example_args


def test_flexible_argument_parser_and_print_embeddings(capsys):
    """examples/basic/offline_inference/*.py @41c5903d: the argument parser every example builds,
    an option the script adds taken with underscores as with dashes, and the embeddings printout."""
    from tokenmill import EngineArgs
    from tokenmill.utils.argparse_utils import FlexibleArgumentParser
    from tokenmill.utils.print_utils import print_embeddings

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="m", runner="pooling", enforce_eager=True)
    sampling = parser.add_argument_group("Sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    args = vars(parser.parse_args(["--max_tokens", "5", "--max_model_len=64"]))
    assert (args["max_tokens"], args["max_model_len"], args["runner"], args["model"]) == (5, 64, "pooling", "m")
    with pytest.raises(SystemExit):  # an unknown option stays an error, as in argparse
        parser.parse_args(["--no_such_option", "1"])
    print_embeddings([0.5, 0.25, 0.125, 1.0, 2.0])
    print_embeddings([1.0], prefix="Reward")
    assert capsys.readouterr().out.splitlines()[-2:] == ["Embeddings: [0.5, 0.25, 0.125, 1.0, ...] (size=5)",
                                                         "Reward: [1.0] (size=1)"]


def test_embed_classify_score_and_reward_examples(tiny_bert_embedder_dir, tiny_qwen3_classifier_dir,
                                                  tiny_cross_encoder_dir, capsys):
    """examples/basic/offline_inference/{embed.py @41c5903d, classify.py @4159f5ba, score.py @41c5903d} and
    examples/pooling/reward/sequence_reward_offline.py @7a24fbb3: LLM(**vars(args)) with the examples'
    defaults (runner="pooling", enforce_eager=True) and what each reads from its outputs."""
    from tokenmill import LLM
    from tokenmill.utils.print_utils import print_embeddings

    pooling = dict(runner="pooling", enforce_eager=True)
    llm = LLM(**_example_args(defaults=dict(model=str(tiny_bert_embedder_dir), **pooling)))
    for prompt, output in zip(PROMPTS, llm.embed(PROMPTS)):
        print_embeddings(output.outputs.embedding)
    assert capsys.readouterr().out.count("(size=32)") == len(PROMPTS)

    llm = LLM(**_example_args(defaults=dict(model=str(tiny_qwen3_classifier_dir), **pooling)))
    for output in llm.classify(PROMPTS):
        probs = output.outputs.probs
        assert len(probs) == 4 and sum(probs) == pytest.approx(1.0, abs=1e-5)
    # sequence_reward_offline.py: encode(pooling_task="classify"), outputs.data a tensor (.tolist())
    for output in llm.encode(PROMPTS, pooling_task="classify"):
        print_embeddings(output.outputs.data.tolist(), prefix="Reward")
    assert capsys.readouterr().out.count("Reward: [") == len(PROMPTS)

    llm = LLM(**_example_args(defaults=dict(model=str(tiny_cross_encoder_dir), **pooling)))
    query = "What is the capital of France?"
    documents = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
    outputs = llm.score(query, documents)
    assert len(outputs) == 2 and all(0.0 < output.outputs.score < 1.0 for output in outputs)


def test_matryoshka_embed_example(minilm_dir):
    """examples/pooling/embed/embed_matryoshka_fy_offline.py @41c5903d with all-MiniLM-L6-v2, which was not
    trained for shortened vectors: refused by name, as vLLM does, unless the config says it was."""
    from tokenmill import LLM, PoolingParams

    prompts = ["Follow the white rabbit.", "Sigue al conejo blanco.", "Folge dem weißen Kaninchen."]
    with pytest.raises(ValueError, match="dimensions=32"):
        LLM(model=str(minilm_dir), runner="pooling", trust_remote_code=True).embed(
            prompts, pooling_params=PoolingParams(dimensions=32))
    llm = LLM(model=str(minilm_dir), runner="pooling", trust_remote_code=True, hf_overrides={"is_matryoshka": True})
    outputs = llm.embed(prompts, pooling_params=PoolingParams(dimensions=32))
    assert [len(output.outputs.embedding) for output in outputs] == [32] * 3


# --- rerankers: examples/pooling/score/qwen3_reranker_offline.py @06d0369d -------------------------------
# The original Qwen3-Reranker (a causal LM) served as a classifier from its "no" / "yes" logits, scoring
# query-document pairs rendered by a score template (the example's template/qwen3_reranker.jinja, here an
# equivalent shorter one: the pair is given to it as messages of roles "query" and "document").

SCORE_TEMPLATE = (
    "<|im_start|>user\n<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first }}\n"
    "<Document>: {{ messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first }}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tiny_reranker_dir(tmp_path_factory):
    """A tiny Qwen3 causal LM whose vocabulary has the tokens "no" and "yes" (as Qwen3's has)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from support.tiny_models import build_tiny_tokenizer, randomize_weights, tiny_config_kwargs

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["no", "yes"])
    config = Qwen3Config(**tiny_config_kwargs(vocab_size=len(tokenizer), tie_word_embeddings=True, head_dim=32),
                         architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(21)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, 21)
    out = tmp_path_factory.mktemp("reranker") / "qwen3_reranker"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _yes_probability(model_dir, ids: list[int]) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    no_yes = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([ids])).logits
    return float(logits[0, -1, no_yes].softmax(-1)[1])


def test_qwen3_reranker_example_with_its_score_template(tiny_reranker_dir):
    from tokenmill import LLM

    llm = LLM(model=str(tiny_reranker_dir), runner="pooling", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True}, **ENGINE)
    queries = ["What is the capital of China?", "Explain gravity"]
    documents = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other."]
    outputs = llm.score(queries, documents, chat_template=SCORE_TEMPLATE, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for query, document, output in zip(queries, documents, outputs):
        # (Jinja drops a template's one trailing newline, in vLLM as here.)
        rendered = f"<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant"
        assert output.prompt_token_ids == tokenizer(rendered)["input_ids"]
        assert output.outputs.score == pytest.approx(_yes_probability(tiny_reranker_dir, output.prompt_token_ids), abs=1e-5)
    # Without a template vLLM reads such a model's pair as one text, query + document (use_sep_token off).
    plain = llm.score(queries[0], documents[0], use_tqdm=False)[0]
    assert plain.prompt_token_ids == tokenizer(queries[0] + documents[0])["input_ids"]


def test_score_templates_apply_to_cross_encoders_only(minilm_dir, tiny_reranker_dir):
    from tokenmill import LLM

    with pytest.raises(ValueError, match="applies to cross-encoders"):
        LLM(str(minilm_dir), **ENGINE).score("a", "b", chat_template=SCORE_TEMPLATE, use_tqdm=False)
    llm = LLM(str(tiny_reranker_dir), runner="pooling", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
        "method": "from_2_way_softmax"}, **ENGINE)
    with pytest.raises(ValueError, match="does not render the pair"):
        llm.score("a", "b", chat_template="{{ messages[5]['content'] }}", use_tqdm=False)


# --- NER: examples/pooling/token_classify/ner.py @e5fd201a --------------------------------------------
# (Before vLLM 0.26 it was examples/offline_inference/pooling/ner.py @07b13497, calling encode(prompts) without a task.)


@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_ner_example(tmp_path_factory, capsys, kind):
    """LLM(**vars(args)) with the example's defaults (runner="pooling", enforce_eager, trust_remote_code),
    encode(pooling_task="token_classify"), each token's argmax looked up in config.id2label and printed
    unless it is a special token; the labels against transformers' own argmax. The label map comes
    from transformers' AutoConfig: tokenmill has no llm_engine.vllm_config (docs/from-vllm.md)."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    from support.tiny_token_classifiers import save_bert_token_classifier, save_xlmr_token_classifier
    from tokenmill import LLM

    root = tmp_path_factory.mktemp("ner_example")
    folder = save_bert_token_classifier(root, seed=51) if kind == "bert" else save_xlmr_token_classifier(root, seed=52)
    args = _example_args(defaults=dict(model=str(folder), runner="pooling", enforce_eager=True, trust_remote_code=True))
    prompts = ["Barack Obama visited Microsoft headquarters in Seattle on January 2025."]
    llm = LLM(**args)
    tokenizer = llm.get_tokenizer()
    label_map = AutoConfig.from_pretrained(folder).id2label
    for old_form in (False, True):
        outputs = llm.encode(prompts) if old_form else llm.encode(prompts, pooling_task="token_classify")
        for prompt, output in zip(prompts, outputs):
            logits = output.outputs.data
            predictions = logits.argmax(dim=-1)
            tokens = tokenizer.convert_ids_to_tokens(output.prompt_token_ids)
            labels = [label_map[p.item()] for p in predictions]
            for token, label in zip(tokens, labels):
                if token not in tokenizer.all_special_tokens:
                    print(f"{token:15} → {label}")
    printed = capsys.readouterr().out.splitlines()
    hf = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
    encoded = AutoTokenizer.from_pretrained(folder)(prompts[0], return_tensors="pt")
    with torch.no_grad():
        expected_ids = hf(**encoded).logits[0].argmax(-1).tolist()
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0].tolist())
    expected = [f"{token:15} → {hf.config.id2label[i]}" for token, i in zip(tokens, expected_ids)
                if token not in tokenizer.all_special_tokens]
    assert printed == expected * 2 and len(expected) > 20
    assert len({line.rsplit(" ", 1)[1] for line in printed}) > 1  # a random head gives tokens different labels
