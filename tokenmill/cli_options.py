"""The `tokenmill` command's options: the argument tables of every subcommand, and the flags that were
given turned into SamplingParams / PoolingParams fields and LLM(...) keywords (checked by those
classes: a bad value is a usage error). The commands themselves are in ``cli.py``.

Importing this module stays light (argparse and stdlib-only tokenmill modules), like ``cli.py``.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenmill.batch.config import DEFAULT_MODEL  # stdlib-only imports: keeps the CLI light
from tokenmill.batch.pooling import DEFAULT_EMBEDDING_MODEL, POOLING_JOB_TASKS
from tokenmill.batch.readers import INPUT_FORMATS

# flag dest -> SamplingParams field
_SAMPLING_FLAGS = {
    "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "stop": "stop", "n": "n", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs", "ignore_eos": "ignore_eos",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
}
# flag dests that are PoolingParams fields
_POOLING_FLAGS = ("dimensions", "normalize", "use_activation", "truncate_prompt_tokens")
# flag dest -> LLM(...) keyword
_ENGINE_FLAGS = (
    "max_model_len", "dtype", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
    "tensor_parallel_size", "enforce_eager", "kv_cache_memory_bytes", "device", "tokenizer", "revision",
    "load_format", "trust_remote_code", "kv_cache_dtype", "deterministic", "hf_overrides", "max_logprobs",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_target_modules",
)
CHAT_MAX_TOKENS = 256  # `tokenmill chat`'s max_tokens unless --max-tokens says otherwise
# flag dests of LoRA adapters (generation only)
_LORA_FLAGS = ("lora_modules", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_target_modules")


class UsageError(Exception):
    """A mistake in how the command was called: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="Offline LLM batch inference with vLLM's offline API.",
        epilog="Start with: tokenmill run examples/products.jsonl -o results.jsonl",
        allow_abbrev=False,  # an abbreviation (--max-token) would change meaning when a flag sharing it is added
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run", allow_abbrev=False, help="run a crash-safe, resumable batch job over a JSONL/CSV/Parquet/OpenAI-batch file",
        description="Generate for every row of INPUT and append each result to OUTPUT as it finishes. "
        "After a crash or kill, run the same command again to continue: finished rows are kept, "
        "the rest run once. Exit code 3 when some rows failed (their 'error' says why).",
        epilog="a row's columns: its prompt is 'prompt' (text or token ids), 'messages' (a chat) or "
        "'prompt_token_ids' (unless --prompt-template or --text-field say otherwise); with 'messages', 'tools', "
        "'documents' and 'chat_template_kwargs' for its chat template; 'id' (see --id-field), 'sampling_params' "
        "(an object of SamplingParams values over the job's), 'lora' (an adapter of --lora-modules). Pooling tasks: "
        "'pooling_params'; score rows: 'text_1' and 'text_2'. OpenAI batch lines: 'custom_id', 'url', 'body'. "
        "See docs/batch.md.",
    )
    run.add_argument("input", metavar="INPUT", help="input file: .jsonl (rows or OpenAI batch lines), .csv, .tsv or .parquet")
    run.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="output file: .jsonl or .parquet")
    run.add_argument("--input-format", default="auto", choices=INPUT_FORMATS,
                     help="override the format guessed from the extension (and, for JSONL, the first lines)")
    run.add_argument("--task", default="generate", choices=("generate", *POOLING_JOB_TASKS),
                     help="generate (default), or run a pooling model: embed (vectors), classify (label and "
                     "probabilities) or score (rows with text_1 and text_2); see docs/batch.md")
    _add_prompt_options(run, with_rows=True)
    _add_sampling_options(run)
    _add_pooling_options(run)
    _add_engine_options(run, default_model=None)
    _add_lora_options(run)
    job = run.add_argument_group("job")
    job.add_argument("--overwrite", action="store_true", help="start over: delete OUTPUT and its resume state first")
    job.add_argument("--max-inflight", type=int, metavar="N",
                     help="requests inside the engine at once (default: 2 x max_num_seqs); bounds memory")
    job.add_argument("--fsync-interval", type=float, default=1.0, metavar="SECONDS",
                     help="fsync the output at most this often (0: every commit); a killed process loses nothing "
                     "either way, this bounds what a power failure can cost (default: 1)")
    job.add_argument("--replicas", type=int, default=1, metavar="N",
                     help="run N engines on this host, one per GPU (tensor_parallel_size GPUs each) or N CPU "
                     "processes sharing the cores; one output, the same resume guarantee (default: 1)")
    job.add_argument("--ray", metavar="ADDRESS", dest="ray_address",
                     help="run the job on a Ray cluster, one engine per Ray actor ('auto', 'local' or ray://host:port; "
                     "needs pip install 'tokenmill[ray]'); --replicas sets the number of engines (default: one per "
                     "GPU of the cluster); see docs/scale-out.md")
    job.add_argument("--stall-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="stop the job (exit code 1, finished rows kept) when an engine step has not returned after "
                     "this long, or ten times the longest step so far if that is longer: a hung device or "
                     "collective would otherwise hold the machine forever; 0: never (default: 600)")
    job.add_argument("--no-progress", action="store_true", help="no progress line on stderr (the summary is still printed)")
    job.add_argument("--progress-interval", type=float, default=10.0, metavar="SECONDS",
                     help="seconds between progress lines when stderr is not a terminal (default: 10)")

    gen = sub.add_parser("generate", allow_abbrev=False, help="complete one prompt and print the text",
                         description="Complete PROMPT (use '-' to read it from stdin) and print the completion.")
    gen.add_argument("prompt", metavar="PROMPT")
    _add_prompt_options(gen, with_rows=False)
    _add_sampling_options(gen)
    _add_engine_options(gen)

    chat = sub.add_parser("chat", allow_abbrev=False, help="interactive chat that streams tokens",
                          description="Chat with a model. Commands: /reset clears the conversation, /exit quits "
                          "(or Ctrl-D). Ctrl-C stops the current answer.")
    chat.add_argument("--system", metavar="TEXT", help="system message")
    chat.add_argument("--chat-template", metavar="FILE_OR_TEXT", help="a Jinja chat template instead of the model's")
    _add_sampling_options(chat, max_tokens_default=f"default: {CHAT_MAX_TOKENS}")
    _add_engine_options(chat)

    sub.add_parser("models", allow_abbrev=False, help="list the built-in models and where local models are looked up")
    return parser


def _add_prompt_options(parser: argparse.ArgumentParser, with_rows: bool) -> None:
    group = parser.add_argument_group("prompts")
    if with_rows:
        group.add_argument("--chat", action="store_true", help="apply the model's chat template to text prompts")
    else:  # one prompt typed by a person: a chat model answers it through its template
        group.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                           help="apply the model's chat template to the prompt (default: when the model has one; "
                           "--no-chat sends the text as it is)")
    group.add_argument("--system", metavar="TEXT", help="system message for chat prompts (implies --chat)")
    group.add_argument("--chat-template", metavar="FILE_OR_TEXT", help="a Jinja chat template instead of the model's")
    if with_rows:
        group.add_argument("--prompt-template", metavar="TEMPLATE",
                           help="build each prompt from row fields, e.g. 'Describe {name} for {audience}.'")
        group.add_argument("--text-field", metavar="FIELD",
                           help="take the prompt text from this field (default: the row's messages, prompt or "
                           "prompt_token_ids, the first not null)")
        group.add_argument("--id-field", metavar="FIELD", help="the row id to carry into the output (default: id, else the row index)")
        group.add_argument("--truncate-prompt-tokens", type=int, metavar="K",
                           help="cut longer prompts to K tokens (-1: max_model_len) instead of failing the row")


def _add_sampling_options(parser: argparse.ArgumentParser, max_tokens_default: str = "vLLM default: 16") -> None:
    g = parser.add_argument_group("sampling (defaults: the model's generation_config, else vLLM's)")
    g.add_argument("--max-tokens", type=int, metavar="N", help=f"tokens to generate at most ({max_tokens_default})")
    g.add_argument("--temperature", type=float, metavar="T", help="0 is greedy")
    g.add_argument("--top-p", type=float, metavar="P")
    g.add_argument("--top-k", type=int, metavar="K")
    g.add_argument("--min-p", type=float, metavar="P")
    g.add_argument("--min-tokens", type=int, metavar="N")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeat for several)")
    g.add_argument("--n", type=int, metavar="N", help="samples per prompt")
    g.add_argument("--presence-penalty", type=float, metavar="X")
    g.add_argument("--frequency-penalty", type=float, metavar="X")
    g.add_argument("--repetition-penalty", type=float, metavar="X")
    g.add_argument("--logprobs", type=int, metavar="K", help="return log probabilities (and K alternatives per token)")
    g.add_argument("--prompt-logprobs", type=int, metavar="K",
                   help="score the prompt: write each prompt token's logprob and their sum (K > 0 also computes K "
                        "alternatives a position, which only OpenAI batch output holds: otherwise use 0)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating past end-of-sequence")
    g.add_argument("--seed", type=int, default=0,
                   help="engine seed; sampled rows get per-row seeds derived from it, so reruns match (default: 0)")


def _add_pooling_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pooling (--task embed, classify or score)")
    g.add_argument("--dimensions", type=int, metavar="N", help="embed: keep the first N dimensions (Matryoshka models)")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="embed: L2-normalise the vectors (default: the model's setting, else yes)")
    g.add_argument("--use-activation", action=argparse.BooleanOptionalAction, default=None,
                   help="classify/score: apply softmax or sigmoid to the logits (default: yes); embed: "
                        "L2-normalise, vLLM 0.26's name for --normalize")
    g.add_argument("--pooling-type", choices=("CLS", "MEAN", "LAST"),
                   help="how token states become one vector (default: the model's, e.g. its sentence-transformers config)")


def _add_engine_options(parser: argparse.ArgumentParser, default_model: str | None = DEFAULT_MODEL) -> None:
    g = parser.add_argument_group("engine")
    shown = default_model or f"{DEFAULT_MODEL}; {DEFAULT_EMBEDDING_MODEL} for --task embed and score"
    g.add_argument("--model", "-m", default=default_model,
                   help=f"built-in name, local folder or .gguf, or a cached hub id (default: {shown})")
    g.add_argument("--max-model-len", type=int, metavar="N")
    g.add_argument("--dtype", metavar="DTYPE", help="auto, float32, float16 or bfloat16 (auto: bf16 on CPUs with native bf16 arithmetic, else fp32; "
                   "on a GPU the checkpoint's 16-bit dtype, bf16 for fp32 checkpoints)")
    g.add_argument("--gpu-memory-utilization", type=float, metavar="F")
    g.add_argument("--kv-cache-memory-bytes", type=int, metavar="BYTES")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"),
                   help="store keys and values as float8 e4m3: twice the cache, less exact (default: auto)")
    g.add_argument("--max-num-seqs", type=int, metavar="N")
    g.add_argument("--max-num-batched-tokens", type=int, metavar="N")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N")
    g.add_argument("--enforce-eager", action="store_true", default=None)
    g.add_argument("--device", metavar="DEVICE", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--tokenizer", metavar="NAME_OR_PATH")
    g.add_argument("--revision", metavar="REV")
    g.add_argument("--load-format", metavar="FORMAT", help="auto, safetensors, pt (PyTorch .bin), gguf or dummy (random weights)")
    g.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="let transformers run the model folder's own code to read its config (the model still runs "
                   "tokenmill's classes)")
    g.add_argument("--hf-overrides", type=_json_object, metavar="JSON",
                   help="config.json fields to replace, as a JSON object (vLLM's flag), e.g. to score with a causal "
                   "LM's token logits: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                   "\"classifier_from_token\": [\"no\", \"yes\"], \"method\": \"from_2_way_softmax\"}'")
    g.add_argument("--max-logprobs", type=int, metavar="K",
                   help="the most --logprobs / --prompt-logprobs alternatives a row may ask for (default: 20; -1: the vocabulary)")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="every row's output independent of the batch, cache and resumes, bit for bit on one GPU "
                        "model and software version; slower (docs/batch.md). A resumed run keeps the mode it started with")


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def _add_lora_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters (vLLM's flags; rows pick one: docs/batch.md)")
    g.add_argument("--lora-modules", nargs="+", action="extend", metavar="NAME=PATH",
                   help="PEFT adapter folders served under their names (or JSON '{\"name\": ..., \"path\": ...}'): "
                   "an OpenAI batch line selects one with body.model, another row with its 'lora' field; implies "
                   "--enable-lora")
    g.add_argument("--enable-lora", action="store_true", default=None, help="start the engine with LoRA support")
    g.add_argument("--max-loras", type=int, metavar="N", help="adapters that may share an engine step (default: 1)")
    g.add_argument("--max-lora-rank", type=int, metavar="R", help="the largest adapter rank (default: 16)")
    g.add_argument("--max-cpu-loras", type=int, metavar="N",
                   help="adapters kept read in CPU memory (default: --max-loras)")
    g.add_argument("--lora-target-modules", nargs="+", metavar="NAME",
                   help="only these projections take adapters (q_proj ... down_proj, qkv_proj, gate_up_proj; "
                   "default: all); adapters' other modules are left out")


# --- flags -> values ----------------------------------------------------------------------------


def sampling_values(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags that were given, checked by SamplingParams itself (a bad value is a usage error)."""
    values = {field: getattr(args, dest) for dest, field in _SAMPLING_FLAGS.items() if getattr(args, dest, None) is not None}
    from tokenmill.sampling_params import SamplingParams

    try:
        SamplingParams(**values)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    return values


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name, None) is not None}
    if getattr(args, "pooling_type", None) is not None:
        kwargs["pooler_config"] = {"pooling_type": args.pooling_type}
    return kwargs


def pooling_values(args: argparse.Namespace) -> dict[str, Any]:
    """The pooling flags that were given, checked by PoolingParams itself for --task (a bad value,
    or one the task does not take, is a usage error rather than every row's error)."""
    values = {name: getattr(args, name) for name in _POOLING_FLAGS if getattr(args, name, None) is not None}
    from tokenmill.pooling.config import PoolerConfig
    from tokenmill.pooling_params import PoolingParams

    try:
        PoolingParams(**values).resolved(args.task, PoolerConfig())
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    return values


def check_task_flags(args: argparse.Namespace) -> None:
    """Flags of the other kind of task are mistakes, not something to ignore silently."""
    pooling = args.task != "generate"
    other = {*_SAMPLING_FLAGS, *_LORA_FLAGS} if pooling else {*_POOLING_FLAGS, "pooling_type"}
    wrong = [f"--{dest.replace('_', '-')}" for dest in sorted(other - (set(_SAMPLING_FLAGS) & set(_POOLING_FLAGS)))
             if getattr(args, dest, None) is not None]
    if pooling:
        wrong += [flag for flag, given in (("--chat", args.chat), ("--system", args.system),
                                           ("--chat-template", args.chat_template)) if given]
    if wrong:
        raise UsageError(f"{', '.join(wrong)} do(es) not apply to --task {args.task}")
    if args.task == "score" and (args.text_field or args.prompt_template):
        raise UsageError("--task score reads the pair from each row's text_1 and text_2; --text-field and "
                         "--prompt-template do not apply")
    if args.task == "classify" and args.model is None:
        raise UsageError("--task classify needs --model: a *ForSequenceClassification checkpoint")
