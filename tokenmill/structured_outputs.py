"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice list or grammar.

Built on xgrammar. The engine compiles each distinct constraint once (``GrammarCache``); every
sequence that uses one gets its own matcher, which masks the logits before sampling and advances
on each sampled token. A constraint that fails to compile is refused with xgrammar's message.

A step's matchers are served together (``bitmask``, ``accept``) through xgrammar's batch matcher,
which spreads the rows over a pool of threads: a matcher's mask takes ~50-200 µs of host time at a
150k vocabulary (more inside a JSON string, where most tokens are allowed), so 256 rows one after
another would take longer than the GPU's whole decode step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenmill.host_cpus import usable_cpus
from tokenmill.json_schema_support import unenforced_json_keyword

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names): ``json`` (a schema, as a dict or a JSON string),
    ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (EBNF/GBNF),
    ``json_object=True`` (any JSON object), or ``structural_tag`` (free text in which each trigger
    opens a tagged, schema-constrained section; xgrammar's format as a JSON string, or vLLM's
    older ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``).

    vLLM's options: JSON is always compact here (no free whitespace between tokens, so a model
    cannot pad forever; vLLM's xgrammar backend allows it unless the engine's
    ``structured_outputs_config`` sets ``disable_any_whitespace``) and objects never take properties
    the schema does not name, so ``disable_any_whitespace`` and ``disable_additional_properties``
    are accepted and change nothing; ``whitespace_pattern`` needs another backend and is refused.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        # Set means not None (json={} is a schema, not "none"); json_object=False asks for nothing.
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of {', '.join(_CONSTRAINTS)}; got {given or 'none'}")
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple)) and self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"StructuredOutputsParams.choice={self.choice!r} is invalid: must be a non-empty list of non-empty strings")
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            raise ValueError(f"StructuredOutputsParams.structural_tag must be a JSON string, got {type(self.structural_tag).__name__}")
        if self.whitespace_pattern is not None:
            raise ValueError(f"StructuredOutputsParams.whitespace_pattern={self.whitespace_pattern!r} is not supported: "
                             "tokenmill's grammars (xgrammar) write compact JSON; leave it None")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"StructuredOutputsParams.{name}={getattr(self, name)!r:.100} is invalid: must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"StructuredOutputsParams.json={self.json!r:.100} is invalid: must be a JSON schema: a dict or a JSON string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"StructuredOutputsParams.json_object={self.json_object!r:.100} is invalid: must be None, True or False")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StructuredOutputsParams.{name}={getattr(self, name)!r} is invalid: must be True or False")

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar."""
        if self.json is not None:
            # The schema as written: xgrammar emits an object's properties in the schema's order, so
            # the order is part of the constraint (vLLM hands xgrammar json.dumps of it too).
            return ("json", self.json if isinstance(self.json, str) else json.dumps(self.json))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        if self.structural_tag is not None:
            return ("structural_tag", self.structural_tag)
        return ("json_object", "")


# vLLM's older spelling.
GuidedDecodingParams = StructuredOutputsParams

# The compiled grammars an engine keeps: thousands of distinct constraints.
GRAMMAR_CACHE_BYTES = 512 * 2**20


class GrammarCache:
    """One xgrammar compiler per engine; its cache keeps the compiled grammars of recent constraints.
    Also the engine's batch matcher: the masks of a step's matchers, filled together on xgrammar's
    threads (the scheduler steps each matcher by its token: xgrammar's batch call for that runs them
    one after the other too, and then converts its results).

    The cache is bounded (least recently used out first): a job whose rows each bring their own
    JSON schema would otherwise keep every compiled grammar for its whole run (~45 KB each at a
    49K vocabulary, more at larger ones). A repeated constraint is a cache hit (microseconds).

    xgrammar sees the tokenizer's vocabulary only; the model's padding ids past it (an lm_head
    rounded up, or a model paired with a smaller tokenizer) are cleared here. Told the model's
    size, xgrammar would take each padding id for a special token, and every mask and token step
    grows with them: 102,784 of them made masks ~9x and token steps ~4.6x slower (docs/perf.md 66).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, cache_limit_bytes: int = GRAMMAR_CACHE_BYTES,
                 threads: int | None = None):
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        ids = tokenizer.get_vocab().values()
        # The ids the tokenizer has (xgrammar's own count), never more than the model has.
        self.grammar_vocab_size = min(vocab_size, max(len(ids), max(ids) + 1))
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.grammar_vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_limit_bytes=cache_limit_bytes)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads or matcher_threads())
        self._filled: Any = None  # the tokenizer-wide masks xgrammar fills, reused (bitmask)

    def matcher(self, params: StructuredOutputsParams, stop_token_ids: Iterable[int] = ()) -> Any:
        """A fresh matcher for one sequence; ValueError with the compiler's message if it fails.

        ``stop_token_ids``: every id that ends the sequence (the model's eos ids, the request's
        stop_token_ids). They become the grammar's stop tokens, allowed only where the constraint
        is complete, as vLLM's xgrammar backend hands them over (``override_stop_tokens``).
        Told nothing, xgrammar knows the tokenizer's eos only: any other stop id that is also text
        (a quote, a digit, an end-of-turn token the generation_config lists) stayed allowed
        mid-constraint and ended the output there, "stop" with half a JSON. Ids past the tokenizer's are
        padding, which no grammar row draws (xgrammar refuses them)."""
        stops = sorted({t for t in stop_token_ids if 0 <= t < self.grammar_vocab_size})
        return self._xgr.GrammarMatcher(self._compile(params), override_stop_tokens=stops or None)

    def cache_size_bytes(self) -> int:
        return int(self._compiler.get_cache_size_bytes())

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind, spec = params.key
        c = self._compiler
        if kind == "json" and (refusal := unenforced_json_keyword(spec)):
            raise ValueError(f"structured_outputs.json is not supported: {refusal}")
        try:
            if kind == "json":
                return c.compile_json_schema(spec, any_whitespace=False)  # compact: no runaway whitespace
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                # An EBNF alternation of the literal choices (JSON string escapes are EBNF's).
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(choice) for choice in params.choice))
            if kind == "grammar":
                return c.compile_grammar(spec)
            if kind == "structural_tag":
                return self._compile_structural_tag(spec)
            return c.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)  # an object, as vLLM
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses with the reason
            # The value too (a batch job's rows may each bring their own), cut short: a schema can be long.
            value = params.json_object if kind == "json_object" else params.choice if kind == "choice" else spec
            raise ValueError(f"structured_outputs.{kind} does not compile: {_reason(exc)} ({kind}={value!r:.200})") from exc

    def _compile_structural_tag(self, spec: str) -> Any:
        try:
            tag = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"it is not JSON ({exc}): give xgrammar's format as a JSON string") from exc
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's older form: xgrammar's tag items and triggers
            structures, triggers = tag["structures"], tag.get("triggers")
            # Checked here: a missing key would otherwise surface as a bare KeyError's "'schema'".
            if not (isinstance(structures, list) and isinstance(triggers, list)
                    and all(isinstance(s, dict) and {"begin", "schema", "end"} <= s.keys() for s in structures)):
                raise ValueError('the older form is {"structures": [{"begin": ..., "schema": ..., "end": ...}, ...], '
                                 f'"triggers": [...]}}; got {spec:.200}')
            items = [self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in structures]
            return self._compiler.compile_structural_tag(items, triggers)
        return self._compiler.compile_structural_tag(spec)

    def bitmask(self, matchers: list[Any], out: Any = None) -> Any:
        """[N, ceil(V/32)] int32 allowed-token bitmask of the model's vocabulary V; rows without a
        live matcher allow everything, the others no padding id. Written into ``out[:N]`` when
        given (a buffer reused step after step: no allocation, no page faults, pinned if it is)."""
        import torch

        n = len(matchers)
        mask = self._xgr.allocate_token_bitmask(n, self.vocab_size) if out is None else out[:n]
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None and not matcher.is_terminated()]
        if out is not None and len(rows) < n:
            mask[torch.tensor(sorted(set(range(n)) - set(rows)), dtype=torch.long)] = -1
        if not rows:
            return mask
        live = [matchers[row] for row in rows]
        if self.grammar_vocab_size == self.vocab_size:
            self._batch.batch_fill_next_token_bitmask(live, mask, rows)
            return mask
        words, tail_bits = divmod(self.grammar_vocab_size, 32)
        if self._filled is None or self._filled.shape[0] < len(rows):
            self._filled = self._xgr.allocate_token_bitmask(max(len(rows), n), self.grammar_vocab_size)
        filled = self._filled[:len(rows)]
        self._batch.batch_fill_next_token_bitmask(live, filled)
        if tail_bits:  # the last word's ids past the tokenizer's are padding
            filled[:, words] &= (1 << tail_bits) - 1
        width = filled.shape[1]
        if len(rows) == n:  # every row constrained (the usual case): slices, not index lists
            mask[:, :width] = filled
            mask[:, width:] = 0
        else:
            index = torch.tensor(rows, dtype=torch.long)
            mask[index] = 0
            mask[index, :width] = filled
        return mask

    def apply(self, logits: Any, bitmask: Any) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size)


def matcher_threads() -> int:
    """Threads for a step's masks (xgrammar's batch fill): half the CPUs this process may run on (the
    other half keeps the engine's own thread and the tokenizer's free). Not xgrammar's "auto",
    which halves the host's hardware threads: in a container or a job allocation limited to 16 of
    a host's 192 CPUs that is 96 threads contending for 16."""
    return max(1, usable_cpus() // 2)


def _reason(exc: Exception) -> str:
    """xgrammar's message without the C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: ") and the
    failed internal check before it ("Check failed: (error.empty()) is false: "), which say nothing
    about the constraint."""
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", message)
