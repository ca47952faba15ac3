"""`tokenmill run` with LoRA adapters (vLLM's ``--lora-modules NAME=PATH``): every row runs with the
adapter it names (a generic row's ``lora``, an OpenAI line's ``body.model``) and gets exactly what
``LLM(enable_lora=True).generate(..., lora_request=...)`` gives it (that API is checked against
HF + PEFT in tests/test_lora.py); an unknown adapter fails its own row; a resumed job, replicas and
Ray keep each row's adapter; bad flags and bad adapters are usage errors before any row runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.journal import ResumeError
from tokenmill.batch.lora_modules import parse_lora_modules
from tokenmill.cli import main
from tokenmill.lora.request import LoRARequest

from support.jsonl import read_jsonl, write_jsonl

MAX_TOKENS = 6
# logprobs=0: each record's cumulative_logprob sums the chosen tokens' logprobs, a check on the tokens.
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": 32 * 2**20,
          "max_num_seqs": 4}
PROMPTS = ["the cat sat on", "a warm mat while", "wind blew over its fur", "the sun went down and",
           "over the river the", "its fur was warm"]
NAMES = ("alpha", "beta")


# --- adapters ----------------------------------------------------------------------------------


def save_adapter(base_dir: Path, out: Path, seed: int, targets: list[str]) -> Path:
    """A PEFT LoRA adapter for the model in ``base_dir``, its lora_A / lora_B redrawn from ``seed``
    (x 0.3, so greedy tokens change: PEFT starts lora_B at zero, an adapter that changes nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("batch_lora")
    return {
        "alpha": str(save_adapter(tiny_llama_dir, root / "alpha", 11, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj"])),
        "beta": str(save_adapter(tiny_llama_dir, root / "beta", 12, ["q_proj", "v_proj", "down_proj"])),
    }


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), seed=0, enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)


def lora_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    """The adapters as the job names them: ids 1..N in the order given."""
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), start=1)}


def reference(llm, adapters, prompts: list[str], names: list[str | None], chat: bool = False) -> list[tuple[str, int, float]]:
    """(text, tokens, cumulative logprob) of each prompt with its adapter, from the LLM API."""
    requests = lora_requests(adapters)
    chosen = [requests[n] if n else None for n in names]
    params = SamplingParams(**GREEDY)
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, lora_request=chosen, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, lora_request=chosen, use_tqdm=False)
    return [(o.outputs[0].text, len(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs]


def config(tmp_path: Path, input_path: Path, adapters: dict[str, str], output: str = "out.jsonl", **extra) -> JobConfig:
    options = dict(input=str(input_path), output=str(tmp_path / output), model="tiny", sampling=dict(GREEDY),
                   progress=False, lora_modules=dict(adapters))
    return JobConfig(**{**options, **extra})


def mixed_rows() -> tuple[list[dict], list[str | None]]:
    """Every prompt once per adapter and once on the base model (null, empty, missing)."""
    rows, names = [], []
    for i, prompt in enumerate(PROMPTS):
        for name in ("alpha", "beta", None):
            row = {"id": f"p{i}-{name}", "prompt": prompt}
            if name is not None:
                row["lora"] = name
            elif i % 3:  # base rows: 'lora' missing, null or "" by turns
                row["lora"] = None if i % 3 == 1 else ""
            rows.append(row)
            names.append(name)
    return rows, names


# --- the job's rows ------------------------------------------------------------------------------


def test_each_row_runs_with_the_adapter_it_names(tmp_path, llm, adapters):
    rows, names = mixed_rows()
    bad = [{"id": "unknown", "prompt": "the cat", "lora": "gamma"}, {"id": "number", "prompt": "the cat", "lora": 5}]
    path = write_jsonl(tmp_path / "in.jsonl", rows[:7] + bad + rows[7:])
    summary = run_job(config(tmp_path, path, adapters), llm=llm)
    assert summary.exit_code == 3 and summary.failed == 2 and summary.rows_done == len(rows) + 2

    records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    expected = reference(llm, adapters, [r["prompt"] for r in rows], names)
    for row, name, (text, tokens, logprob) in zip(rows, names, expected):
        record = records[row["id"]]
        assert (record["text"], record["completion_tokens"], record["lora"], record["error"]) == (text, tokens, name, None)
        assert record["cumulative_logprob"] == pytest.approx(logprob, abs=1e-4)
    # The adapters change the greedy text of every prompt, so the comparison above can tell them apart.
    by_prompt = {}
    for row, name, (text, _, _) in zip(rows, names, expected):
        by_prompt.setdefault(row["prompt"], {})[name] = text
    assert all(len(set(texts.values())) == 3 for texts in by_prompt.values()), by_prompt

    unknown, number = records["unknown"], records["number"]
    assert unknown["text"] is None and unknown["lora"] is None
    assert "'lora'='gamma' is not a LoRA adapter of this job" in unknown["error"] and "['alpha', 'beta']" in unknown["error"]
    assert "line 8" in unknown["error"] and "--lora-modules" in unknown["error"]
    assert "'lora' must be a LoRA adapter's name (a string), got int" in number["error"]


def test_openai_lines_select_the_adapter_with_body_model(tmp_path, llm, adapters, tiny_llama_dir):
    base = str(tiny_llama_dir)
    chat_models = ["alpha", "beta", base, None]  # the base model by its --model value, or no model at all
    completion_models = ["beta", "alpha", Path(base).name, "alpha"]  # ... or by the last part of its path
    lines = []
    for i, model in enumerate(chat_models):
        body = {"messages": [{"role": "user", "content": PROMPTS[i]}], **GREEDY}
        del body["logprobs"]
        lines.append({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": body if model is None else {"model": model, **body}})
    for i, model in enumerate(completion_models):
        lines.append({"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"model": model, "prompt": PROMPTS[i], **GREEDY}})
    lines.append({"custom_id": "typo", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "alpah", "prompt": "the cat", "max_tokens": 3}})
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    summary = run_job(config(tmp_path, path, adapters, model=base), llm=llm)
    assert summary.exit_code == 3 and summary.failed == 1

    out = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    adapter_of = lambda model: model if model in NAMES else None  # noqa: E731
    chat = reference(llm, adapters, PROMPTS[:4], [adapter_of(m) for m in chat_models], chat=True)
    completions = reference(llm, adapters, PROMPTS[:4], [adapter_of(m) for m in completion_models])
    for i, model in enumerate(chat_models):
        body = out[f"chat-{i}"]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == chat[i][0]
        assert body["usage"]["completion_tokens"] == chat[i][1]
        assert body["model"] == (model if model in NAMES else base)  # vLLM's server answers with the adapter's name
    for i, model in enumerate(completion_models):
        body = out[f"cmpl-{i}"]["response"]["body"]
        assert (body["choices"][0]["text"], body["usage"]["completion_tokens"]) == completions[i][:2]
        assert body["model"] == (model if model in NAMES else base)
    # A model the job does not serve is a 404 (vLLM's server: NotFoundError, 404; OpenAI's API:
    # invalid_request_error with code "model_not_found" and param "model"), not a 400.
    typo = out["typo"]["response"]
    assert typo["status_code"] == 404
    error = typo["body"]["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")
    message = error["message"]
    assert "body.model='alpah' is not a LoRA adapter of this job" in message and "['alpha', 'beta']" in message


def test_without_adapters_body_model_is_ignored_and_a_lora_row_fails(tmp_path, adapters, tiny_llama_dir):
    plain = LLM(str(tiny_llama_dir), seed=0, **ENGINE)
    lines = [{"custom_id": "a", "url": "/v1/completions", "body": {"model": "anything", "prompt": "the cat", "max_tokens": 2}}]
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    assert run_job(JobConfig(input=str(path), output=str(tmp_path / "o1.jsonl"), progress=False), llm=plain).exit_code == 0
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "the cat"}, {"prompt": "the cat", "lora": "alpha"}])
    summary = run_job(JobConfig(input=str(rows), output=str(tmp_path / "o2.jsonl"), sampling={"max_tokens": 2},
                                progress=False), llm=plain)
    assert summary.exit_code == 3 and summary.failed == 1
    records = sorted(read_jsonl(tmp_path / "o2.jsonl"), key=lambda r: r["row"])
    assert "lora" not in records[0]  # a job without adapters keeps its record schema
    assert "'lora'='alpha' names a LoRA adapter, and this job has none; pass --lora-modules" in records[1]["error"]
    with pytest.raises(ValueError, match="--lora-modules needs an engine started with enable_lora=True"):
        run_job(config(tmp_path, rows, adapters, output="o3.jsonl"), llm=plain)


# --- resume -------------------------------------------------------------------------------------


class InterruptingLLM:
    """The LLM, whose engine raises KeyboardInterrupt (as Ctrl-C would) at its ``after``-th step."""

    def __init__(self, llm, after: int):
        self._llm, self.llm_engine = llm, _InterruptingEngine(llm.llm_engine, after)

    def __getattr__(self, name):
        return getattr(self._llm, name)


class _InterruptingEngine:
    def __init__(self, engine, after: int):
        self._engine, self._left = engine, after

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, *args, **kwargs):
        self._left -= 1
        if self._left < 0:
            raise KeyboardInterrupt
        return self._engine.step(*args, **kwargs)


def test_a_resumed_job_keeps_each_rows_adapter(tmp_path, llm, adapters):
    import pyarrow.parquet as pq

    rows, names = mixed_rows()
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    first = run_job(config(tmp_path, path, adapters, output="out.parquet", max_inflight=4), llm=InterruptingLLM(llm, 8))
    assert first.interrupted and 0 < first.rows_done < len(rows)
    assert not llm.llm_engine.has_unfinished_requests()

    moved = {**adapters, "beta": adapters["alpha"]}  # another folder under a name: other results, refused
    with pytest.raises(ResumeError, match="lora_modules"):
        run_job(config(tmp_path, path, moved, output="out.parquet"), llm=llm)

    second = run_job(config(tmp_path, path, adapters, output="out.parquet", max_inflight=4), llm=llm)
    assert second.complete and second.resumed_rows == first.rows_done and second.rows_done == len(rows)
    records = {r["id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    assert len(records) == len(rows)
    expected = reference(llm, adapters, [r["prompt"] for r in rows], names)
    for row, name, (text, tokens, _) in zip(rows, names, expected):
        record = records[row["id"]]
        assert (record["text"], record["completion_tokens"], record["lora"]) == (text, tokens, name)


class DeletingLLM(InterruptingLLM):
    """The LLM, whose engine deletes ``folder`` before its ``after``-th step."""

    def __init__(self, llm, after: int, folder: Path):
        self._llm, self.llm_engine = llm, _DeletingEngine(llm.llm_engine, after, folder)


class _DeletingEngine(_InterruptingEngine):
    """The engine, which deletes ``folder`` before its ``after``-th step."""

    def __init__(self, engine, after: int, folder: Path):
        super().__init__(engine, after)
        self._folder = folder

    def step(self, *args, **kwargs):
        self._left -= 1
        if self._left == 0:
            shutil.rmtree(self._folder)
        return self._engine.step(*args, **kwargs)


def test_rows_of_an_adapter_deleted_mid_job_fail_alone(tmp_path, adapters, tiny_llama_dir):
    """beta's folder deleted while the job runs, with one device slot and one adapter in CPU memory
    (so beta is read from disk each time its turn comes): beta's rows after that fail, each with an
    error saying why (could not be loaded, or its folder missing once the engine has forgotten it);
    every other row finishes with LLM.generate's result; the job ends with exit code 3."""
    beta = tmp_path / "beta"
    shutil.copytree(adapters["beta"], beta)
    job_adapters = {"alpha": adapters["alpha"], "beta": str(beta)}
    one_slot = LLM(str(tiny_llama_dir), seed=0, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, **ENGINE)
    rows, names = mixed_rows()
    expected = reference(one_slot, job_adapters, [r["prompt"] for r in rows], names)
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run_job(config(tmp_path, path, job_adapters, max_inflight=4), llm=DeletingLLM(one_slot, 6, beta))
    assert not beta.exists() and summary.exit_code == 3 and summary.rows_done == len(rows)

    records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    failed = [row["id"] for row in rows if records[row["id"]]["error"] is not None]
    assert failed and all(records[i]["lora"] is None and records[i]["text"] is None for i in failed)
    assert summary.failed == len(failed) and any("could not be loaded" in records[i]["error"] for i in failed)
    assert all(records[i]["error"].startswith("line ") for i in failed)
    for row, name, (text, tokens, _) in zip(rows, names, expected):
        record = records[row["id"]]
        if record["error"] is None:
            assert (record["text"], record["completion_tokens"], record["lora"]) == (text, tokens, name)
        else:
            assert name == "beta" and ("'beta'" in record["error"] or str(beta) in record["error"]), record["error"]


# --- replicas and Ray ----------------------------------------------------------------------------


def test_replicas_run_each_row_with_its_adapter(tmp_path, llm, adapters, tiny_llama_dir):
    rows, names = mixed_rows()
    rows, names = rows[:9], names[:9]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    job = config(tmp_path, path, adapters, model=str(tiny_llama_dir), engine={**ENGINE, "max_loras": 2}, replicas=2)
    summary = run_job(job)
    assert summary.exit_code == 0 and summary.rows_done == len(rows)
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    expected = reference(llm, adapters, [r["prompt"] for r in rows], names)
    for row, name, (text, tokens, _) in zip(rows, names, expected):
        assert (records[row["id"]]["text"], records[row["id"]]["completion_tokens"], records[row["id"]]["lora"]) == \
            (text, tokens, name)


@pytest.mark.slow
def test_ray_job_runs_each_row_with_its_adapter(ray_cluster, tmp_path, llm, adapters, tiny_llama_dir):
    rows, names = mixed_rows()
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    job = config(tmp_path, path, adapters, model=str(tiny_llama_dir), engine={**ENGINE, "max_loras": 2},
                 ray_address="auto", replicas=2)
    assert run_job(job).exit_code == 0
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    expected = reference(llm, adapters, [r["prompt"] for r in rows], names)
    for row, name, (text, tokens, _) in zip(rows, names, expected):
        assert (records[row["id"]]["text"], records[row["id"]]["completion_tokens"], records[row["id"]]["lora"]) == \
            (text, tokens, name)


# --- flags ---------------------------------------------------------------------------------------


def test_lora_modules_values():
    assert parse_lora_modules(["a=/x/a", ' {"name": "b", "path": "/x/b", "base_model_name": "m"}', "c = y=z "]) == \
        {"a": "/x/a", "b": "/x/b", "c": "y=z"}
    for values, message in [
        (["a=/x", "a=/y"], "the name 'a' is given twice"),
        (["in.jsonl"], "'in.jsonl' is not NAME=PATH"),
        (["=/x"], "needs both a name and a path"),
        (['{"name": "a"'], "is not valid JSON"),
        (['{"name": "a", "path": "/x", "rank": 8}'], "field(s) ['rank'] are not supported"),
    ]:
        with pytest.raises(ValueError, match="--lora-modules") as info:
            parse_lora_modules(values)
        assert message in str(info.value)


@pytest.mark.parametrize("extra, message", [
    (["--lora-modules", "a=missing-folder"], "--lora-modules a=missing-folder: "),
    (["--lora-modules", "a=."], "has no adapter_config.json"),
    (["--lora-modules", "a=x", "a=y"], "the name 'a' is given twice"),
    (["--lora-modules", "a"], "--lora-modules 'a' is not NAME=PATH"),
    (["--lora-modules", "no-such-model-xyz=."], "'no-such-model-xyz' is the base model's name"),
    (["--lora-modules", "a=x", "--task", "embed"], "--lora-modules do(es) not apply to --task embed"),
    (["--max-loras", "2", "--task", "embed"], "--max-loras do(es) not apply to --task embed"),
])
def test_flag_mistakes_are_usage_errors_before_the_model_loads(tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    assert main(["run", "in.jsonl", "-o", "o.jsonl", "--model", "no-such-model-xyz", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot load model" not in err


def test_command_line_job_and_an_adapter_the_model_cannot_take(tmp_path, capsys, llm, adapters, tiny_llama_dir):
    rows = [{"prompt": PROMPTS[0], "lora": "beta"}, {"prompt": PROMPTS[1]}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--max-model-len", "128",
             "--kv-cache-memory-bytes", str(32 * 2**20), "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
             "--ignore-eos", "--no-progress", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    out = tmp_path / "o.jsonl"
    assert main(["run", str(path), "-o", str(out), *flags, "--max-lora-rank", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--lora-modules alpha={adapters['alpha']}" in err and "above max_lora_rank=1" in err and "--max-lora-rank" in err
    assert not out.exists() or out.read_text() == ""  # refused before any row ran

    assert main(["run", str(path), "-o", str(out), *flags]) == 0  # no row ran: the flag may change
    records = sorted(read_jsonl(out), key=lambda r: r["row"])
    expected = reference(llm, adapters, [r["prompt"] for r in rows], ["beta", None])
    assert [(r["text"], r["lora"]) for r in records] == [(expected[0][0], "beta"), (expected[1][0], None)]


def test_lora_target_modules_flag_reaches_the_engine_and_the_resume_settings():
    """--lora-target-modules becomes LLM(lora_target_modules=...), which decides what rows generate, so
    it is part of the settings a resumed job must match (unlike --max-loras)."""
    from tokenmill.batch.job import _THROUGHPUT_ONLY
    from tokenmill.cli_options import build_parser, engine_kwargs

    args = build_parser().parse_args(["run", "in.jsonl", "-o", "o.jsonl", "--lora-target-modules", "qkv_proj",
                                      "down_proj", "--max-loras", "2"])
    assert engine_kwargs(args)["lora_target_modules"] == ["qkv_proj", "down_proj"]
    assert "lora_target_modules" not in _THROUGHPUT_ONLY and "max_loras" in _THROUGHPUT_ONLY
