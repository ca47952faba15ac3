"""The `tokenmill` command line: a light import, usage errors (exit 2), failed rows (exit 3), and the
generate / chat / models commands on a tiny model."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.cli import main

REPO = Path(__file__).resolve().parents[1]


def tiny_flags(model) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--device", "cpu", "--max-model-len", "128",
            "--kv-cache-memory-bytes", str(32 * 2**20), "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=32 * 2**20,
               max_num_seqs=4)


def test_import_is_light_and_help_works():
    code = ("import sys, tokenmill.cli; heavy = [m for m in ('torch', 'transformers', 'pyarrow', 'numpy') if m in sys.modules];"
            "print(heavy)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    help_text = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run", "--help"], env=env, capture_output=True,
                               text=True, check=True).stdout
    for flag in ("--prompt-template", "--id-field", "--text-field", "--overwrite", "--max-num-seqs",
                 "--tensor-parallel-size", "--kv-cache-memory-bytes", "--kv-cache-dtype", "--enforce-eager", "--stop", "--n"):
        assert flag in help_text


def test_run_help_lists_the_columns_a_row_may_carry(capsys):
    """The columns the job reads (requests.py, chat_options.py, pooling.py) are named in --help, not
    only in docs/batch.md: a row's tools, documents and chat_template_kwargs were in neither --help
    nor any error a user would meet."""
    from tokenmill.batch.chat_options import ROW_FIELDS
    from tokenmill.batch.requests import ADAPTER_FIELD
    from tokenmill.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a row's columns:" in help_text
    columns = help_text.split("a row's columns:")[1]
    for name in ("prompt", "messages", "prompt_token_ids", "id", "sampling_params", ADAPTER_FIELD, *ROW_FIELDS,
                 "pooling_params", "text_1", "text_2"):
        assert f"'{name}'" in columns, name


def test_job_state_folders_are_ignored_by_git_and_dtype_help_says_what_auto_does():
    ignored = subprocess.run(["git", "check-ignore", "results.jsonl.tokenmill/state.json", "out/x.parquet.tokenmill/lock"],
                             cwd=REPO, capture_output=True, text=True)
    assert ignored.stdout.split() == ["results.jsonl.tokenmill/state.json", "out/x.parquet.tokenmill/lock"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    help_text = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--help"], env=env, capture_output=True,
                               text=True, check=True).stdout
    assert "bf16 on CPUs with native bf16" in " ".join(help_text.split()) and "fp32 on CPU," not in help_text


def test_docs_and_the_parser_name_the_same_flags():
    """Every flag of every subcommand is in the docs, and every flag the docs name exists (from-vllm.md
    is left out: it quotes vLLM's parser)."""
    import argparse
    import re

    from tokenmill.cli_options import build_parser

    docs = "\n".join((REPO / name).read_text() for name in ("README.md", "docs/batch.md", "docs/scale-out.md"))
    named = set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", docs))
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    actions = [a for command in commands.values() for a in command._actions if a.option_strings and a.dest != "help"]
    undocumented = {a.option_strings[0] for a in actions if not named & set(a.option_strings)}
    assert not undocumented, f"flags the docs never mention: {sorted(undocumented)}"
    flags = {flag for a in actions for flag in a.option_strings}
    other_tools = {"--index-url"}  # pip's, in the README's install note
    unknown = {flag for flag in named if flag.startswith("--") and flag not in flags | other_tools}
    assert not unknown, f"flags the docs name that no subcommand has: {sorted(unknown)}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "in.jsonl", "--temperature", "-1", "-o", "o.jsonl"], "SamplingParams.temperature=-1"),
        (["run", "missing.jsonl", "-o", "o.jsonl"], "does not exist"),
        (["run", "in.txt", "-o", "o.jsonl"], "extension"),
        (["run", "in.jsonl", "-o", "o.txt"], "output format"),
        (["run", "in.jsonl", "-o", "o.jsonl", "--prompt-template", "{"], "malformed"),
        (["run", "in.jsonl", "-o", "o.jsonl", "--prompt-template", "{a}", "--text-field", "b"], "pass one of them"),
        (["run", "in.jsonl", "-o", "o.jsonl", "--max-inflight", "0"], "--max-inflight"),
        (["run", "in.jsonl", "-o", "o.jsonl", "--stall-timeout", "-5"], "--stall-timeout=-5.0 is invalid"),
        (["run", "in.jsonl", "-o", "o.jsonl", "--stall-timeout", "nan"], "--stall-timeout=nan is invalid"),
        (["run", "in.jsonl", "-o", "in.jsonl"], "must not be the input"),
        (["run", "in.jsonl", "-o", "o.jsonl", "--fsync-interval", "nan"], "--fsync-interval=nan is invalid: must be >= 0"),
        (["run", "in.jsonl", "-o", "o.jsonl", "--progress-interval", "-1"], "--progress-interval=-1.0 is invalid"),
        (["run", "in.jsonl", "-o", "o.jsonl", "--chat-template", "tmpl/chatml.jinja"],
         "--chat-template: chat_template='tmpl/chatml.jinja' is neither a file nor a Jinja template"),
        (["generate", "hi", "--top-p", "0"], "SamplingParams.top_p=0"),
    ],
)
def test_usage_errors_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "in.txt").write_text("x\n")
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "in.jsonl"])  # no -o
    assert info.value.code == 2
    assert "-o/--output" in capsys.readouterr().err


def test_unknown_model_and_bad_tensor_parallel_size_are_usage_errors(tmp_path, capsys, tiny_llama_dir):
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    out = str(tmp_path / "o.jsonl")
    assert main(["run", str(tmp_path / "in.jsonl"), "-o", out, "--model", "no-such-model-xyz"]) == 2
    assert "no-such-model-xyz" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "in.jsonl"), "-o", out, "--overwrite", *tiny_flags(tiny_llama_dir),
                 "--tensor-parallel-size", "0"]) == 2
    assert "tensor_parallel_size" in capsys.readouterr().err


def test_run_failed_rows_exit_3_then_resume_refuses_changed_settings(tmp_path, capsys, tiny_llama_dir):
    rows = ['{"prompt": "the cat sat"}', '{"prompt": 5}', "{broken", '{"prompt": "on the mat"}']
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    argv = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--max-tokens", "3",
            "--temperature", "0", "--no-progress", *tiny_flags(tiny_llama_dir)]
    sigint = signal.getsignal(signal.SIGINT)  # not always default_int_handler: SIG_IGN under nohup or `cmd &`
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "4/4 rows, 2 failed" in err and "line 2: 'prompt' must be a string" in err and "line 3 is not valid JSON" in err
    assert signal.getsignal(signal.SIGINT) is sigint  # handlers restored after the run
    out = [json.loads(line) for line in open(tmp_path / "o.jsonl")]
    assert len(out) == 4 and sum(r["error"] is not None for r in out) == 2

    assert main(argv) == 3  # complete already: nothing to do, same verdict
    assert "already complete: 4 rows, 2 failed" in capsys.readouterr().err
    changed = [a if a != "3" else "4" for a in argv]
    assert main(changed) == 2
    err = capsys.readouterr().err
    assert "started with other settings" in err and "max_tokens" in err and "--overwrite" in err
    assert main([*changed, "--overwrite"]) == 3
    assert {r["completion_tokens"] for r in map(json.loads, open(tmp_path / "o.jsonl")) if r["error"] is None} == {4}


def test_run_prompt_logprobs_flags(tmp_path, capsys, tiny_llama_dir):
    """--prompt-logprobs fills the scoring columns; past --max-logprobs it is a usage error."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "the cat sat on the mat"}\n')
    argv = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--max-tokens", "2", "--no-progress",
            "--overwrite", *tiny_flags(tiny_llama_dir), "--max-logprobs", "5"]
    assert main([*argv, "--prompt-logprobs", "6"]) == 2
    assert "--prompt-logprobs 6 is more than this engine allows (5" in capsys.readouterr().err
    assert main([*argv, "--prompt-logprobs", "5"]) == 0
    record = json.loads(open(tmp_path / "o.jsonl").read())
    assert len(record["prompt_token_logprobs"]) == record["prompt_tokens"] - 1
    assert record["prompt_logprob"] == pytest.approx(sum(record["prompt_token_logprobs"]))


def test_generate_prints_the_completion(tmp_path, capsys, tiny_llm, tiny_llama_dir):
    expected = tiny_llm.generate(["the cat sat"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0].outputs[0].text
    argv = ["generate", "the cat sat", "--no-chat", "--max-tokens", "5", "--temperature", "0"]
    assert main([*argv, *tiny_flags(tiny_llama_dir)]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "the cat", "--n", "2", "--max-tokens", "3", *tiny_flags(tiny_llama_dir)]) == 0
    out = capsys.readouterr().out
    assert "--- sample 0 ---" in out and "--- sample 1 ---" in out
    fp8 = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=32 * 2**20,
              max_num_seqs=4, kv_cache_dtype="fp8")
    expected = fp8.generate(["the cat sat"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0].outputs[0].text
    argv = ["generate", "the cat sat", "--no-chat", "--max-tokens", "5", "--temperature", "0", "--kv-cache-dtype", "fp8"]
    assert main([*argv, *tiny_flags(tiny_llama_dir)]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_generate_applies_the_chat_template_when_the_model_has_one(capsys, tiny_llm, tiny_llama_dir):
    params = SamplingParams(max_tokens=5, temperature=0)
    expected = tiny_llm.chat([{"role": "user", "content": "the cat sat"}], params, use_tqdm=False)[0].outputs[0].text
    assert main(["generate", "the cat sat", "--max-tokens", "5", "--temperature", "0", *tiny_flags(tiny_llama_dir)]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "x", "--no-chat", "--system", "be brief", *tiny_flags(tiny_llama_dir)]) == 2
    assert "--no-chat" in capsys.readouterr().err


def test_generate_says_why_a_completion_is_empty(capsys, tiny_llm, tiny_llama_dir):
    params = SamplingParams(max_tokens=1, temperature=0)
    first = tiny_llm.generate(["the cat sat"], params, use_tqdm=False)[0].outputs[0].text
    assert first.strip(), "pick a prompt whose first token has text"
    stop = first.strip()[0]
    argv = ["generate", "the cat sat", "--no-chat", "--max-tokens", "5", "--temperature", "0", "--stop", stop]
    assert main([*argv, *tiny_flags(tiny_llama_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "\n"
    assert "empty" in captured.err and f"stop string {stop!r}" in captured.err


def test_chat_streams_replies_and_keeps_history(monkeypatch, capsys, tiny_llm, tiny_llama_dir):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = tiny_llm.chat([{"role": "user", "content": "the cat"}], params, use_tqdm=False)[0].outputs[0].text
    history = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "on the mat"}]
    second = tiny_llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
    after_reset = tiny_llm.chat([{"role": "user", "content": "sat"}], params, use_tqdm=False)[0].outputs[0].text

    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat\n\non the mat\n/reset\nsat\n/exit\nnever read\n"))
    assert main(["chat", "--max-tokens", "4", "--temperature", "0", "--ignore-eos", *tiny_flags(tiny_llama_dir)]) == 0
    assert capsys.readouterr().out == f"{first}\n{second}\n{after_reset}\n"


def test_chat_help_states_the_max_tokens_chat_uses(capsys):
    from tokenmill.cli_options import CHAT_MAX_TOKENS

    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    max_tokens = " ".join(capsys.readouterr().out.split("--max-tokens N", 2)[2].split("--", 1)[0].split())
    assert f"default: {CHAT_MAX_TOKENS}" in max_tokens and "16" not in max_tokens


def test_chat_streams_text_deltas(tiny_llm):
    from tokenmill.cli import stream_reply

    class Recorder(io.StringIO):
        writes: list[str] = []

        def write(self, text):
            self.writes.append(text)
            return super().write(text)

    out = Recorder()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    reply = stream_reply(tiny_llm, [{"role": "user", "content": "the cat"}], params, None, "t-1", out=out)
    assert out.getvalue() == reply + "\n"
    assert len([w for w in out.writes if w]) >= 2  # printed step by step, not at the end


def test_models_lists_builtins_and_lookup(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct  [default]" in out
    assert "local path" in out and "Hugging Face" in out and "TOKENMILL_CACHE" in out


def test_run_stops_a_hung_engine_after_600_s_by_default(tmp_path, monkeypatch):
    """`tokenmill run` hands the job a stall limit (batch/stall_watchdog.py): 600 s unless
    --stall-timeout says otherwise (0: never); the Python API's JobConfig leaves it off."""
    from tokenmill.batch import job
    from tokenmill.batch.config import JobConfig

    seen = []
    monkeypatch.setattr(job, "run_job", lambda config, **kwargs: seen.append(config.stall_timeout) or 1 / 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    for extra in ([], ["--stall-timeout", "0"], ["--stall-timeout", "90"]):
        with pytest.raises(ZeroDivisionError):
            main(["run", "in.jsonl", "-o", "o.jsonl", *extra])
    assert seen == [600.0, 0.0, 90.0]
    assert JobConfig(input="in.jsonl", output="o.jsonl").stall_timeout == 0.0


def _cat_job(tmp_path: Path, model: Path, rows: int, *flags: str) -> tuple[list[str], Path]:
    """A ``tokenmill run`` of ``rows`` short prompts on the tiny model, two greedy tokens each, without
    the progress bar (``flags``: more of them): its argv and its output path."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": f"the cat sat {i}"}) + "\n" for i in range(rows)))
    output = tmp_path / "o.jsonl"
    return ["run", str(tmp_path / "in.jsonl"), "-o", str(output), "--max-tokens", "2", "--temperature", "0",
            "--no-progress", *flags, *tiny_flags(model)], output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_while_the_model_loads_stops_at_once(tmp_path, monkeypatch, capsys, tiny_llama_dir, signum):
    """The first SIGTERM, Ctrl-C or SIGHUP before the job runs a row stops it at once (a model load can take
    minutes, and a second SIGTERM, unlike a second Ctrl-C, did nothing): exit code 130, nothing
    written but the resume state, and the same command then runs every row."""
    import time

    if signal.getsignal(signum) is signal.SIG_IGN and signum == signal.SIGHUP:
        pytest.skip("SIGHUP is ignored here (nohup), and the job leaves it so")

    from tokenmill.batch import job

    real_load, loaded = job.load_llm, []

    def slow_load(config):  # a large model: the stop request lands while it loads
        os.kill(os.getpid(), signum)
        for _ in range(150):
            time.sleep(0.1)
        loaded.append(True)
        return real_load(config)

    argv, output = _cat_job(tmp_path, tiny_llama_dir, 3)
    monkeypatch.setattr(job, "load_llm", slow_load)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)  # SIGINT is SIG_IGN under `cmd &`
    started = time.monotonic()
    assert main(argv) == 130
    assert time.monotonic() - started < 10 and not loaded
    err = capsys.readouterr().err
    assert "stopping now" in err and "0/3 rows" in err and "rerun the same command" in err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # restored
    assert not output.exists() or output.read_text() == ""
    monkeypatch.setattr(job, "load_llm", real_load)
    assert main(argv) == 0
    assert sorted(r["row"] for r in map(json.loads, open(output))) == [0, 1, 2]


def test_a_stop_that_python_wraps_while_the_model_loads_still_stops_the_job(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    """The stop handler's KeyboardInterrupt is raised wherever the model load is; inside a
    ``__set_name__`` (every dataclass Field has one: torch's and transformers' imports define hundreds)
    Python 3.11 wraps it in a RuntimeError ("Error calling __set_name__ ..."), which the job took for a
    crash: a traceback and exit code 1. Found by the crash-resume chaos harness (a SIGTERM 0.3 s after
    the start). It is the stop: summary, exit code 130, and the rerun runs every row."""
    import time

    from tokenmill.batch import job

    real_load = job.load_llm

    class Stopped:
        def __set_name__(self, owner, name):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs at the next check: here
                time.sleep(0.01)

    def interrupted_load(config):
        class EngineArguments:  # a class defined by an import the load makes
            field = Stopped()

        return real_load(config)

    argv, output = _cat_job(tmp_path, tiny_llama_dir, 3)
    monkeypatch.setattr(job, "load_llm", interrupted_load)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "stopping now" in err and "0/3 rows" in err and "rerun the same command" in err
    monkeypatch.setattr(job, "load_llm", real_load)
    assert main(argv) == 0
    assert sorted(r["row"] for r in map(json.loads, open(output))) == [0, 1, 2]


def _signal_after_first_commit(monkeypatch, signum, seen=None):
    """Send ``signum`` to this process once the job has committed its first rows (and note, in
    ``seen``, the handler that was in place then)."""
    from tokenmill.batch import journal

    real_commit, calls = journal.Journal.commit, []

    def commit(self, *args, **kwargs):
        real_commit(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            if seen is not None:
                seen.append(signal.getsignal(signum))
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(journal.Journal, "commit", commit)


def test_sighup_stops_the_job_after_its_step_as_sigterm_does(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    """SIGHUP (the terminal that started the job closed, or a supervisor stopping it) left to its
    default killed the job mid-write: no summary, the next run repairing what it tore. It stops it
    as SIGTERM does: after the step, finished rows committed, exit code 130, the rerun finishes."""
    argv, output = _cat_job(tmp_path, tiny_llama_dir, 8, "--max-inflight", "2")
    hangups = []

    def not_the_tests_death(signum, frame):  # what SIGHUP's default would do to pytest, it records
        hangups.append(signum)

    previous = signal.signal(signal.SIGHUP, not_the_tests_death)
    try:
        _signal_after_first_commit(monkeypatch, signal.SIGHUP)
        code = main(argv)
        assert signal.getsignal(signal.SIGHUP) is not_the_tests_death  # restored after the run
    finally:
        signal.signal(signal.SIGHUP, previous)
    err = capsys.readouterr().err
    assert code == 130 and not hangups and "stopping after this step" in err, err
    done = [r["row"] for r in map(json.loads, open(output))]
    assert 0 < len(done) < 8 and len(set(done)) == len(done) and f"{len(done)}/8 rows" in err, err
    assert "repaired" not in err
    monkeypatch.undo()
    assert main(argv) == 0
    assert sorted(r["row"] for r in map(json.loads, open(output))) == list(range(8))


def test_sighup_stays_ignored_under_nohup(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    """`nohup tokenmill run ...` ignores SIGHUP so that the job outlives the terminal: it must."""
    argv, _ = _cat_job(tmp_path, tiny_llama_dir, 4, "--max-inflight", "2")
    previous, seen = signal.signal(signal.SIGHUP, signal.SIG_IGN), []
    try:
        _signal_after_first_commit(monkeypatch, signal.SIGHUP, seen)
        assert main(argv) == 0
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert "4/4 rows" in capsys.readouterr().err


def test_a_refused_run_leaves_the_output_location_as_it_found_it(tmp_path, capsys, tiny_llama_dir):
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    out = tmp_path / "o.jsonl"
    refused = [["--model", "no-such-model-xyz"], [*tiny_flags(tiny_llama_dir), "--tensor-parallel-size", "0"]]
    for flags in refused:
        assert main(["run", str(tmp_path / "in.jsonl"), "-o", str(out), "--no-progress", *flags]) == 2
        assert sorted(os.listdir(tmp_path)) == ["in.jsonl"], flags  # no o.jsonl, no o.jsonl.tokenmill/
    out.write_text("")  # an empty file the user made stays, as it was
    assert main(["run", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", "no-such-model-xyz"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "o.jsonl"] and out.read_text() == ""


def test_a_refused_rerun_keeps_the_resumed_jobs_state_and_output(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    import tokenmill.cli as cli

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": f"the cat {i}"}) + "\n" for i in range(6)))
    argv = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--max-tokens", "3",
            "--temperature", "0", "--no-progress", "--max-inflight", "1", *tiny_flags(tiny_llama_dir)]
    polls = []

    def stop_after_a_few_steps(self):
        self.loop_started = True
        polls.append(1)
        return len(polls) > 4

    monkeypatch.setattr(cli._StopRequests, "__call__", stop_after_a_few_steps)
    assert main(argv) == 130
    monkeypatch.undo()
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "lock"}
    assert 0 < len(before[Path("o.jsonl")].splitlines()) < 6
    assert main([*argv, "--tensor-parallel-size", "0"]) == 2  # a throughput flag: the journal resumes, then the load fails
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "lock"}
    assert after == before
    capsys.readouterr()
    assert main(argv) == 0 and "resumed:" in capsys.readouterr().err
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize("argv", [["run", "in.jsonl", "-o", "o.jsonl", "--max-token", "5"],
                                  ["run", "in.jsonl", "-o", "o.jsonl", "--over"],
                                  ["generate", "hi", "--temp", "0"], ["chat", "--max-model", "64"]])
def test_abbreviated_flags_are_refused(capsys, argv):
    # An abbreviation would silently change meaning once a flag sharing its prefix is added.
    from tokenmill.cli_options import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
