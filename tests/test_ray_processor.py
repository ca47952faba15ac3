"""`tokenmill.ray`: the Ray Data processor, on one local Ray cluster (2 CPUs) shared by the session.

- 200 rows through 2 CPU replicas give, row for row, the greedy text of one `LLM` (and the same
  embeddings for embed); bad rows become error rows and skip postprocess.
- vLLM's Ray Data example (the haiku tutorial) runs with only the import and the config class changed.
- Killing one replica's process mid-run: Ray replaces it, and every row comes out once.
- Without a cluster: the replica UDF on Arrow batches (classify, score, logprobs) and the config checks.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.ray import TokenmillProcessorConfig, build_llm_processor

ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 * 2**20)
WORDS = "the cat sat on a warm mat while wind blew over its fur".split()
GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)


def prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(count)]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", **ENGINE)


# --- through the cluster --------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_200_rows_on_two_replicas_equals_one_llm(ray_cluster, tiny_llama_dir, llama):
    texts = prompts(200, seed=1)
    expected = [o.outputs[0].text for o in llama.generate(texts, SamplingParams(**GREEDY), use_tqdm=False)]
    items = [{"i": i, "text": t} for i, t in enumerate(texts)]
    bad = {  # appended after the good rows; each must become an error row
        200: ({"i": 200, "text": "the cat", "sampling": {"temperature": -1.0}}, "temperature"),
        201: ({"i": 201, "text": " ".join(["wind"] * 300)}, "max_model_len"),
        202: ({"i": 202, "text": None}, "prompt"),
    }
    items += [row for row, _ in bad.values()]

    def preprocess(row):
        params = dict(GREEDY, **(row.get("sampling") or {}))
        return dict(prompt=row["text"], sampling_params=params, replica=os.getpid())

    config = TokenmillProcessorConfig(model_source=str(tiny_llama_dir), engine_kwargs=ENGINE, concurrency=2, batch_size=16)
    processor = build_llm_processor(config, preprocess=preprocess,
                                    postprocess=lambda row: dict(i=row["i"], answer=row["generated_text"],
                                                                 tokens=row["num_generated_tokens"], replica=row["replica"]))
    out = ray_cluster.data.from_items(items, override_num_blocks=8)
    rows = processor(out).take_all()

    assert sorted(r["i"] for r in rows) == list(range(203))
    good = {r["i"]: r for r in rows if r["i"] < 200}
    assert [good[i]["answer"] for i in range(200)] == expected
    assert all(good[i]["tokens"] == 4 and good[i]["__inference_error__"] == "" for i in range(200))
    assert len({r["replica"] for r in good.values()}) == 2, "the rows did not reach both replicas"
    for i, (_, needle) in bad.items():
        row = next(r for r in rows if r["i"] == i)
        assert needle in row["__inference_error__"], row["__inference_error__"]
        # postprocess skipped: the row keeps every column ('answer' only as the block's other rows have it)
        assert row.get("answer") is None and row["generated_text"] == "" and row["text"] == items[i]["text"]


@pytest.mark.slow
def test_embed_200_rows_on_two_replicas_equals_one_llm(ray_cluster, tiny_bert_embedder_dir, bert_embedder_llm,
                                                       random_sentences):
    import numpy as np

    texts = random_sentences(200, seed=5)
    expected = np.array([o.outputs.embedding for o in bert_embedder_llm.embed(texts, use_tqdm=False)])
    config = TokenmillProcessorConfig(model_source=str(tiny_bert_embedder_dir), task_type="embed",
                                      engine_kwargs=dict(dtype="float32"), concurrency=2, batch_size=16)
    processor = build_llm_processor(config, preprocess=lambda row: dict(prompt=row["text"]),
                                    postprocess=lambda row: dict(i=row["i"], vector=row["embeddings"],
                                                                 same=row["embedding"], n=row["num_input_tokens"]))
    rows = processor(ray_cluster.data.from_items([{"i": i, "text": t} for i, t in enumerate(texts)], override_num_blocks=8)).take_all()
    assert sorted(r["i"] for r in rows) == list(range(200))
    got = np.array([list(r["vector"]) for r in sorted(rows, key=lambda r: r["i"])])
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert all(list(r["vector"]) == list(r["same"]) and r["n"] > 0 for r in rows)


# vLLM's examples/offline_inference/batch_llm_inference.py (the Ray Data haiku tutorial), as written
# there except for the two lines this test swaps, the model and the dataset (S3 is out of reach here).
VLLM_TUTORIAL = '''
import ray
from ray.data.llm import build_llm_processor, vLLMEngineProcessorConfig

config = vLLMEngineProcessorConfig(
    model_source=MODEL,
    engine_kwargs={
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 4096,
        "max_model_len": 16384,
    },
    concurrency=1,  # set the number of parallel vLLM replicas
    batch_size=64,
)

vllm_processor = build_llm_processor(
    config,
    preprocess=lambda row: dict(
        messages=[{
            "role": "system",
            "content": "You are a bot that responds with haikus."
        }, {
            "role": "user",
            "content": row["text"]
        }],
        sampling_params=dict(
            temperature=0.3,
            max_tokens=250,
        )),
    postprocess=lambda row: dict(
        answer=row["generated_text"],
        **row  # This will return all the original columns in the dataset.
    ),
)

ds = vllm_processor(ds)

outputs = ds.take(limit=10)

for output in outputs:
    prompt = output["prompt"]
    generated_text = output["generated_text"]
    print(f"Prompt: {prompt!r}")
    print(f"Generated text: {generated_text!r}")
'''


@pytest.mark.slow
def test_vllm_haiku_tutorial_runs_with_only_the_import_and_config_class_changed(ray_cluster, tiny_llama_dir, tmp_path, capsys):
    import json
    import shutil

    # The tutorial asks for max_model_len 16384: the tiny Llama with that many positions.
    model = tmp_path / "llama_16k"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    code = VLLM_TUTORIAL.replace("from ray.data.llm import build_llm_processor, vLLMEngineProcessorConfig",
                                 "from tokenmill.ray import build_llm_processor, TokenmillProcessorConfig")
    code = code.replace("vLLMEngineProcessorConfig(", "TokenmillProcessorConfig(")
    changed = [(a, b) for a, b in zip(VLLM_TUTORIAL.splitlines(), code.splitlines()) if a != b]
    assert len(changed) == 2 and "import" in changed[0][1] and "config = TokenmillProcessorConfig(" in changed[1][1]
    lines = [f"line {i}: a river at dawn" for i in range(12)]
    namespace = {"MODEL": str(model), "ds": ray_cluster.data.from_items([{"text": t} for t in lines])}
    exec(compile(code, "batch_llm_inference.py", "exec"), namespace)

    outputs = namespace["outputs"]
    assert len(outputs) == 10
    for row in outputs:
        assert row["answer"] == row["generated_text"] and row["num_generated_tokens"] > 0
        assert row["text"] in lines  # the original column is carried through
        assert row["prompt"].startswith("<|im_start|>system\nYou are a bot that responds with haikus.<|im_end|>\n")
        assert row["text"] in row["prompt"] and row["finish_reason"] in ("stop", "length")
    assert capsys.readouterr().out.count("Generated text: ") == 10


@pytest.mark.slow
def test_killed_replica_is_replaced_and_every_row_comes_out_once(ray_cluster, tiny_llama_dir, llama):
    texts = prompts(64, seed=2)
    params = dict(GREEDY, max_tokens=8)
    expected = [o.outputs[0].text for o in llama.generate(texts, SamplingParams(**params), use_tqdm=False)]
    config = TokenmillProcessorConfig(model_source=str(tiny_llama_dir), engine_kwargs=ENGINE, concurrency=2, batch_size=4,
                                      max_concurrent_batches=2)
    processor = build_llm_processor(config, preprocess=lambda row: dict(prompt=row["text"], sampling_params=params,
                                                                         replica=os.getpid()))
    dataset = processor(ray_cluster.data.from_items([{"i": i, "text": t} for i, t in enumerate(texts)], override_num_blocks=16))
    rows, killed = [], None
    for row in dataset.iter_rows():
        rows.append(row)
        if killed is None:
            killed = row["replica"]
            os.kill(killed, signal.SIGKILL)  # mid-run: this replica holds more batches
    assert sorted(r["i"] for r in rows) == list(range(64)), "a row went missing or came out twice"
    assert [r["generated_text"] for r in sorted(rows, key=lambda r: r["i"])] == expected


# --- the replica UDF and the config, without a cluster ------------------------------------------


def _replica(model: Path, task: str, **engine):
    from tokenmill.ray.replica import TokenmillReplica

    return TokenmillReplica(str(model), {"dtype": "float32", "device": "cpu", **engine}, task, None, True, None, None, True)


def _call(replica, rows: list[dict]) -> list[dict]:
    import pyarrow as pa

    names = list(dict.fromkeys(name for row in rows for name in row))  # from_pylist reads the first row's keys only
    return replica(pa.Table.from_pylist([{name: row.get(name) for name in names} for row in rows])).to_pylist()


def test_replica_udf_generation_columns_and_errors(tiny_llama_dir, llama):
    chat = [{"role": "user", "content": "the warm mat"}]
    replica = _replica(tiny_llama_dir, "generate", **ENGINE)
    out = _call(replica, [
        {"prompt": "the cat sat", "sampling_params": {**GREEDY, "logprobs": 2, "prompt_logprobs": 1}, "keep": 1},
        {"messages": chat, "sampling_params": {**GREEDY, "stop": None}, "keep": 2},  # None: Arrow's absent key
        {"prompt": "the cat", "sampling_params": {"n": 2}, "keep": 3},
        {"prompt": "the cat", "sampling_params": {"top_p": 7.0}, "keep": 4},
        {"prompt": "the cat", "sampling_params": {"no_such_field": 1}, "keep": 5},
        {"prompt": " ".join(["wind"] * 300), "keep": 6},
        # Past the context: capped, as LLM.generate caps it (the sequence fills max_model_len).
        {"prompt": "the cat", "sampling_params": {**GREEDY, "max_tokens": 129}, "keep": 7},
    ])
    assert [r["keep"] for r in out] == [1, 2, 3, 4, 5, 6, 7]
    ref = llama.generate("the cat sat", SamplingParams(**GREEDY, logprobs=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert out[0]["generated_text"] == ref.outputs[0].text and out[0]["generated_tokens"] == ref.outputs[0].token_ids
    assert out[0]["num_input_tokens"] == len(ref.prompt_token_ids) and out[0]["finish_reason"] == "length"
    assert out[0]["cumulative_logprob"] == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-5)
    assert len(out[0]["logprobs"]) == 4 and ref.outputs[0].token_ids[0] in {lp["token_id"] for lp in out[0]["logprobs"][0]}
    prompt_positions = out[0]["prompt_logprobs"]  # the first position, which nothing predicts, is null
    assert len(prompt_positions) == len(ref.prompt_token_ids) and prompt_positions[0] is None
    assert [[(lp["token_id"], lp["rank"]) for lp in position] for position in prompt_positions[1:]] == \
        [[(token_id, lp.rank) for token_id, lp in position.items()] for position in ref.prompt_logprobs[1:]]
    assert [position[0]["logprob"] for position in prompt_positions[1:]] == pytest.approx(
        [ref.prompt_logprobs[i][token_id].logprob for i, token_id in enumerate(ref.prompt_token_ids) if i], abs=1e-5)
    assert out[1]["prompt_logprobs"] is None  # not asked for
    ref_chat = llama.chat(chat, SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert out[1]["generated_text"] == ref_chat.outputs[0].text and out[1]["prompt"] == ref_chat.prompt
    assert all(r["__inference_error__"] == "" for r in out[:2])
    assert "n=2" in out[2]["__inference_error__"]
    assert "top_p" in out[3]["__inference_error__"] and "no_such_field" in out[4]["__inference_error__"]
    assert "max_model_len=128" in out[5]["__inference_error__"]
    assert all(r["generated_tokens"] == [] and r["num_generated_tokens"] == 0 for r in out[2:6])
    capped = llama.generate("the cat", SamplingParams(**{**GREEDY, "max_tokens": 129}), use_tqdm=False)[0]
    assert out[6]["__inference_error__"] == "" and out[6]["generated_tokens"] == capped.outputs[0].token_ids
    assert out[6]["num_input_tokens"] + out[6]["num_generated_tokens"] == 128 and out[6]["finish_reason"] == "length"

    # Other column types (Arrow needs one type per column in a batch): JSON text, token ids, bad messages.
    out = _call(replica, [
        {"prompt_token_ids": [5, 6, 7, 8], "sampling_params": '{"temperature": 0, "max_tokens": 3}', "messages": None},
        {"prompt_token_ids": None, "sampling_params": "{not json", "messages": None},
        {"prompt_token_ids": None, "sampling_params": None, "messages": "not a list"},
    ])
    assert out[0]["num_generated_tokens"] == 3 and out[0]["prompt"] is None and out[0]["__inference_error__"] == ""
    assert "not a JSON object" in out[1]["__inference_error__"]
    assert "'messages' is not a JSON list of messages" in out[2]["__inference_error__"]


def test_replica_udf_rows_pick_their_lora_adapter_by_model(tiny_llama_dir, tmp_path):
    """Ray's rule: a row's 'model' other than the base model names an adapter folder under
    dynamic_lora_loading_path; each row matches LLM.generate with that adapter (or none)."""
    from support.lora_adapters import save_adapter
    from tokenmill.lora.request import LoRARequest
    from tokenmill.ray.replica import TokenmillReplica

    folder = save_adapter(tiny_llama_dir, tmp_path / "sql", seed=5, r=8, lora_alpha=16, std=0.3)
    engine = {"dtype": "float32", "device": "cpu", **ENGINE, "enable_lora": True}
    replica = TokenmillReplica(str(tiny_llama_dir), engine, "generate", None, True, None, None, True, lora_root=str(tmp_path))
    row = {"prompt": "the cat sat", "sampling_params": GREEDY}
    out = _call(replica, [{**row, "model": "sql"}, {**row, "model": None}, {**row, "model": str(tiny_llama_dir)},
                          {**row, "model": "nope"}])
    reference = LLM(str(tiny_llama_dir), **engine)
    with_adapter, base = (reference.generate("the cat sat", SamplingParams(**GREEDY), use_tqdm=False, lora_request=lora)[0]
                          for lora in (LoRARequest("sql", 1, str(folder)), None))
    assert with_adapter.outputs[0].token_ids != base.outputs[0].token_ids
    assert out[0]["generated_tokens"] == with_adapter.outputs[0].token_ids and out[0]["__inference_error__"] == ""
    assert out[1]["generated_tokens"] == out[2]["generated_tokens"] == base.outputs[0].token_ids
    assert "nope" in out[3]["__inference_error__"] and out[3]["generated_tokens"] == []


def test_replica_udf_a_row_whose_adapter_cannot_be_read_again_fails_alone(tiny_llama_dir, tmp_path):
    """An adapter folder deleted after its first rows, needed again from disk (one slot, one adapter in
    CPU memory, another adapter in between): the row naming it fails with an error saying so, the
    base-model row beside it runs; a later row naming it is refused as a missing folder."""
    import shutil

    from support.lora_adapters import save_adapter
    from tokenmill.ray.replica import TokenmillReplica

    for name, seed in (("sql", 5), ("doc", 6)):
        save_adapter(tiny_llama_dir, tmp_path / name, seed=seed, r=8, lora_alpha=16, std=0.3)
    engine = {"dtype": "float32", "device": "cpu", **ENGINE, "enable_lora": True, "max_loras": 1, "max_cpu_loras": 1}
    replica = TokenmillReplica(str(tiny_llama_dir), engine, "generate", None, True, None, None, True, lora_root=str(tmp_path))
    row = {"prompt": "the cat sat", "sampling_params": GREEDY}
    first = _call(replica, [{**row, "model": "sql"}, {**row, "model": "doc"}, {**row, "model": None}])
    assert all(r["__inference_error__"] == "" for r in first)
    shutil.rmtree(tmp_path / "sql")
    out = _call(replica, [{**row, "model": "sql"}, {**row, "model": None}])
    assert "could not be loaded" in out[0]["__inference_error__"] and "'sql'" in out[0]["__inference_error__"]
    assert out[0]["generated_tokens"] == [] and out[1]["__inference_error__"] == ""
    assert out[1]["generated_tokens"] == first[2]["generated_tokens"]
    again = _call(replica, [{**row, "model": "sql"}])
    assert str(tmp_path / "sql") in again[0]["__inference_error__"], again[0]["__inference_error__"]


def test_replica_udf_a_row_whose_output_cannot_become_columns_fails_alone(tiny_llama_dir, monkeypatch):
    """A finished row whose output raises while its result columns are built (an odd output meeting a
    bug) becomes an error row naming the error; the batch's other rows keep their results."""
    from tokenmill.ray import replica as replica_module

    real = replica_module.result_columns

    def flaky(task, job, rows):
        if job.position == 1 and job.error is None:
            raise KeyError("no such column")
        return real(task, job, rows)

    monkeypatch.setattr(replica_module, "result_columns", flaky)
    replica = _replica(tiny_llama_dir, "generate", **ENGINE)
    out = _call(replica, [{"prompt": p, "sampling_params": GREEDY} for p in ("the cat sat", "the warm mat", "wind blew")])
    assert out[1]["__inference_error__"].startswith("the row finished but its output could not become result columns")
    assert "KeyError" in out[1]["__inference_error__"] and out[1]["generated_tokens"] == []
    assert [r["__inference_error__"] for r in (out[0], out[2])] == ["", ""]
    assert [r["num_generated_tokens"] for r in (out[0], out[2])] == [4, 4]


def test_replica_udf_an_embedding_that_is_not_a_number_is_the_rows_error(tiny_bert_embedder_dir, monkeypatch):
    """A NaN embedding (an fp16 model that overflowed; injected) is no result: the row's error says
    so, as the batch job's does, not that its columns failed; the other rows keep their vectors."""
    from tokenmill.batch.pooling import PoolingRows
    from tokenmill.outputs import PoolingOutput

    real = PoolingRows.result

    def overflowed(self, request, outputs):
        if request.index == 1:
            data = outputs[0].outputs.data.clone()  # the engine's is an inference tensor
            data[0] = float("nan")
            outputs = [dataclasses.replace(outputs[0], outputs=PoolingOutput(data))]
        return real(self, request, outputs)

    monkeypatch.setattr(PoolingRows, "result", overflowed)
    out = _call(_replica(tiny_bert_embedder_dir, "embed"), [{"prompt": p} for p in ("the cat sat", "the warm mat", "wind")])
    assert out[1]["__inference_error__"].startswith("the model's output is not a number: the embedding has 1 NaN")
    assert out[1]["embedding"] is None and [r["__inference_error__"] for r in (out[0], out[2])] == ["", ""]
    assert all(len(r["embedding"]) > 0 for r in (out[0], out[2]))


def test_a_row_that_preprocess_or_postprocess_raises_for_fails_alone(tiny_llama_dir):
    """With should_continue_on_error, preprocess raising for one row makes it an error row that the
    replica passes by, and postprocess raising keeps the row's results with the error (both failed
    the whole dataset); with should_continue_on_error=False they raise as before."""
    from tokenmill.ray.processor import _MergePreprocess, _Postprocess

    def preprocess(row):
        if row["text"] == "bad":
            raise KeyError("missing")
        return {"prompt": row["text"], "sampling_params": GREEDY}

    merge = _MergePreprocess(preprocess)
    rows = [merge({"text": t}) for t in ("the cat sat", "bad", "wind blew")]
    assert rows[1] == {"text": "bad", "__inference_error__": "preprocess raised KeyError: 'missing'"}
    assert _MergePreprocess(lambda row: [1])({"text": "x"})["__inference_error__"].startswith(
        "preprocess raised TypeError: preprocess must return a dict of columns, got list")
    with pytest.raises(KeyError):
        _MergePreprocess(preprocess, continue_on_error=False)({"text": "bad"})
    columns = ("text", "prompt", "sampling_params", "__inference_error__")
    out = _call(_replica(tiny_llama_dir, "generate", **ENGINE), [{name: row.get(name) for name in columns} for row in rows])
    assert out[1]["__inference_error__"] == "preprocess raised KeyError: 'missing'" and out[1]["generated_tokens"] == []
    assert [r["__inference_error__"] for r in (out[0], out[2])] == ["", ""]
    assert [r["num_generated_tokens"] for r in (out[0], out[2])] == [4, 4]

    post = _Postprocess(lambda row: {"answer": row["generated_text"][100]}, keep_error_column=True)
    kept = post(out[0])
    assert kept["__inference_error__"].startswith("postprocess raised IndexError")
    assert kept["generated_tokens"] == out[0]["generated_tokens"]  # the result is kept
    with pytest.raises(IndexError):
        _Postprocess(post.fn, keep_error_column=False)(out[0])


def test_replica_udf_classify_and_score(tiny_bert_classifier_dir, bert_classifier_llm, tiny_cross_encoder_dir,
                                        cross_encoder_llm):
    out = _call(_replica(tiny_bert_classifier_dir, "classify"), [{"prompt": "the cat sat"}, {"prompt": ""}, {"prompt": None}])
    ref = bert_classifier_llm.classify(["the cat sat"], use_tqdm=False)[0].outputs.probs
    assert out[0]["probs"] == pytest.approx(ref, abs=1e-6)
    assert out[0]["label"] == ["negative", "neutral", "positive"][max(range(3), key=ref.__getitem__)]
    # "" runs as LLM.classify("") runs it (BERT: [CLS] [SEP]), as the batch job's classify rows do since b09074c.
    assert out[1]["__inference_error__"] == ""
    assert out[1]["probs"] == pytest.approx(bert_classifier_llm.classify("", use_tqdm=False)[0].outputs.probs, abs=1e-6)
    assert "no prompt" in out[2]["__inference_error__"]
    out = _call(_replica(tiny_cross_encoder_dir, "score"), [{"text_1": "a cat", "text_2": "the mat"}, {"text_1": "a cat", "text_2": None}])
    assert out[0]["score"] == pytest.approx(cross_encoder_llm.score("a cat", "the mat", use_tqdm=False)[0].outputs.score, abs=1e-6)
    assert "text_2" in out[1]["__inference_error__"] and out[1]["score"] is None


def test_config_takes_vllm_fields_and_refuses_mistakes():
    config = TokenmillProcessorConfig(model_source="m", engine_kwargs={"enable_chunked_prefill": True, "max_model_len": 64},
                                      concurrency=(1, 3), batch_size=8, task_type="embed", accelerator_type="H100",
                                      chat_template_stage={"enabled": False}, detokenize=False)
    assert config.task == "embed" and config.pool_size() == (1, 3) and config.engine_kwargs == {"max_model_len": 64}
    assert config.apply_chat_template is False
    with pytest.raises(TypeError, match="no_such_option"):
        TokenmillProcessorConfig(model_source="m", no_such_option=1)
    with pytest.raises(ValueError, match="concurrency=0 is invalid"):
        TokenmillProcessorConfig(model_source="m", concurrency=0)
    with pytest.raises(ValueError, match="disagree"):
        TokenmillProcessorConfig(model_source="m", task="generate", task_type="embed")
    with pytest.raises(ValueError, match="one of"):
        TokenmillProcessorConfig(model_source="m", task="summarize")
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        TokenmillProcessorConfig(model_source="m", engine_kwargs={"enable_chunked_prefill": False})
    with pytest.raises(NotImplementedError, match="text models"):
        TokenmillProcessorConfig(model_source="m", has_image=True)
    with pytest.raises(ValueError, match="batch_size=0"):
        TokenmillProcessorConfig(model_source="m", batch_size=0)
    for field, value, allowed in (("max_pending_requests", "x", "None or an integer >= 1"),
                                  ("apply_chat_template", "no", "True or False"),
                                  ("should_continue_on_error", "no", "True or False"),
                                  ("chat_template", 5, "None or a Jinja template"),
                                  ("experimental", None, "a dict"),
                                  ("runtime_env", "x", "None or a Ray runtime_env dict")):
        with pytest.raises(ValueError, match=f"{field}={value!r} is invalid: must be {allowed}"):
            TokenmillProcessorConfig(model_source="m", **{field: value})
    from tokenmill.ray.processor import Processor

    with pytest.raises(TypeError, match="preprocess_map_kwargs must be a dict"):
        Processor(TokenmillProcessorConfig(model_source="m"), preprocess_map_kwargs=[1])


def test_importing_tokenmill_ray_does_not_import_ray():
    import subprocess
    import sys

    code = "import sys, tokenmill.ray; print('ray' in sys.modules, 'torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["False", "False"]
