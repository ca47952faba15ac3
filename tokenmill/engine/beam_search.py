"""Beam search inside the engine, with the semantics of Hugging Face transformers' beam search.

A beam search request starts as one sequence, its prompt. Its live beams are ordinary sequences,
batched and scheduled with everything else; the sampler gives each one's top-K next-token
log-probabilities (``SamplingParams(logprobs=K)``). When every live beam of a request has them
(a beam that has reported is ``on_hold`` until its group moves on), `BeamSearch.advance` runs one
step of transformers' algorithm (``num_beams=beam_width``, ``do_sample=False``,
``early_stopping=False``):

1. the K best continuations (parent beam, token) by cumulative log-probability, K = 2 * width
   (more with several eos ids, so ``width`` of them never end);
2. a candidate ending with eos (or reaching the length limit) becomes a finished hypothesis, scored
   ``cumulative logprob / generated_length ** length_penalty``, if it ranks among the first
   ``width`` candidates; the ``width`` best finished hypotheses are kept;
3. the first ``width`` candidates that do not end are the next live beams;
4. the search ends at the length limit, or when the best live beam, scored at its current length,
   can no longer beat the worst of ``width`` finished hypotheses (transformers' heuristic).

Under a grammar (``BeamSearchParams.structured_outputs``) a beam's top-K are the best tokens its
matcher allows, with their raw log-probabilities (transformers with a ``prefix_allowed_tokens_fn``);
a fork takes a fork of its parent's matcher, and each beam's matcher accepts the token it continues with.

A parent that continues with one token keeps its sequence and blocks. Each extra token forks a new
sequence that, when admitted, takes references on the parent's full KV blocks and a copy of its
partial last block, and computes only its new token (see `Scheduler._shareable_prefix`; at TP > 1
it recomputes the partial block instead). A parent with no continuation is freed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.outputs import (
    BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput, SampleLogprobs,
)
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.request import Request, Sequence


class BeamHost(Protocol):
    """What a search step may do to the scheduler's sequences (the `Scheduler` is one)."""

    def new_sequence(self, request: "Request", index: int) -> "Sequence":
        """A fresh sequence of ``request`` (its id, sampling state), not queued yet."""
        ...

    def finish(self, seq: "Sequence") -> None:
        """Free a beam that does not continue."""
        ...

    def add_forks(self, seqs: list["Sequence"]) -> None:
        """Queue new beams (they share their parent's full blocks when admitted)."""
        ...


def candidates_per_step(beam_width: int, num_eos_ids: int) -> int:
    """transformers' ``beams_to_keep``: enough candidates that ``beam_width`` of them are not eos."""
    return max(2, 1 + num_eos_ids) * beam_width


def beam_sampling_params(params: BeamSearchParams, num_eos_ids: int) -> SamplingParams:
    """What each beam asks the sampler for: its top-K log-probabilities (the sampled token is unused)."""
    eos_ids = 0 if params.ignore_eos else num_eos_ids
    return SamplingParams(
        temperature=0.0,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        logprobs=candidates_per_step(params.beam_width, eos_ids),
        detokenize=False,  # only the final beams are decoded
        output_kind=RequestOutputKind.FINAL_ONLY,
        structured_outputs=params.structured_outputs,  # the first beam's matcher; forks fork it
    )


@dataclass
class Candidate:
    parent: "Sequence"
    token: int
    cumulative_logprob: float  # the parent's plus this token's


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (the eos included) and their log-probabilities."""

    token_ids: list[int]
    logprobs: SampleLogprobs
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (ended on eos) or "length"


class BeamSearch:
    """The beam state of one request: pending top-K reports, finished hypotheses, stop rule."""

    def __init__(self, params: BeamSearchParams, stop_token_ids: set[int], max_new_tokens: int):
        self.params = params
        self.width = params.beam_width
        self.stop_token_ids = frozenset(stop_token_ids)
        self.num_candidates = candidates_per_step(self.width, len(self.stop_token_ids))
        self.max_new_tokens = max_new_tokens
        self.finished: list[Hypothesis] = []  # best first, at most width
        self.done = False
        # seq_id -> (top token ids, their log-probabilities) of that beam's next position.
        self._reports: dict[int, tuple[list[int], list[float]]] = {}

    # ---- engine interface -----------------------------------------------------------------
    def report(self, seq: "Sequence", token_ids: list[int], logprobs: list[float]) -> None:
        token_ids, logprobs = token_ids[: self.num_candidates], logprobs[: self.num_candidates]
        if seq.grammar is not None:  # ranked among the allowed tokens: fewer than K leaves -inf ones, impossible
            kept = [i for i, lp in enumerate(logprobs) if lp != float("-inf")]
            token_ids, logprobs = [token_ids[i] for i in kept], [logprobs[i] for i in kept]
        self._reports[seq.seq_id] = (token_ids, logprobs)
        seq.on_hold = True

    def forget_reports(self, beams: list["Sequence"]) -> None:
        """A step failed before the group could move on (`Scheduler.recover`): the beams compute their
        position again and report anew."""
        self._reports.clear()
        for beam in beams:
            beam.on_hold = False

    def ready(self, beams: list["Sequence"]) -> bool:
        return all(seq.seq_id in self._reports for seq in beams)

    def advance(self, beams: list["Sequence"], host: BeamHost) -> list["Sequence"]:
        """One search step over the reports of all live beams (a request's sequences): extend,
        fork and free sequences; returns the next live beams (none once the search is done)."""
        entries = self._logprob_entries(beams)
        chosen = self._step(beams, entries)
        if self.done:
            for beam in beams:
                host.finish(beam)
            return []
        # Forks copy their parent before any parent takes its own next token.
        continuing: list[tuple["Sequence", Candidate]] = []
        forks = []
        kept: set[int] = set()
        for cand in chosen:
            parent = cand.parent
            if parent.seq_id in kept:
                child = host.new_sequence(parent.request, 0)  # beams are hypotheses, not numbered samples
                child.output_token_ids = list(parent.output_token_ids)
                child.logprobs = list(parent.logprobs)
                child.fork_parent = parent
                if parent.grammar is not None:  # the parent's state, before the parent takes its own token
                    child.grammar = parent.grammar.fork()
                forks.append(child)
            else:
                child = parent
                kept.add(parent.seq_id)
            continuing.append((child, cand))
        for beam in beams:
            beam.fork_parent = None  # admitted long ago; let old generations be garbage collected
            if beam.seq_id not in kept:
                host.finish(beam)
        for child, cand in continuing:
            if child.grammar is not None:
                child.grammar.accept_token(cand.token)  # the grammar allowed it: it was a candidate
            child.output_token_ids.append(cand.token)
            child.logprobs.append(entries[cand.parent.seq_id])
            child.cumulative_logprob = cand.cumulative_logprob
            child.on_hold = False
        host.add_forks(forks)
        return [child for child, _ in continuing]

    def completions(self, tokenizer: Any, decoded_alone: Callable[[int], str]) -> list[CompletionOutput]:
        """The finished hypotheses, best first, as completions (what vLLM's server returns);
        ``decoded_alone`` gives a logprob entry's token text (the output processor's, which keeps
        the texts it met: a search's entries are 2 x width tokens a position)."""
        outputs = []
        for index, hyp in enumerate(self.finished):
            text = ""
            if tokenizer is not None:
                text_ids = _text_ids(hyp.token_ids, hyp.finish_reason, self.params)
                text = tokenizer.decode(text_ids, skip_special_tokens=True)
                for entry in hyp.logprobs:
                    for token, logprob in entry.items():
                        if logprob.decoded_token is None:
                            logprob.decoded_token = decoded_alone(token)
            outputs.append(CompletionOutput(
                index=index, text=text, token_ids=hyp.token_ids, cumulative_logprob=hyp.cumulative_logprob,
                logprobs=hyp.logprobs, finish_reason=hyp.finish_reason,
            ))
        return outputs

    # ---- the search -----------------------------------------------------------------------
    def _step(self, beams: list["Sequence"], entries: dict[int, dict[int, Logprob]]) -> list[Candidate]:
        """Records finished hypotheses and returns the next live beams' candidates, best first."""
        generated = len(beams[0].output_token_ids) + 1  # live beams are always equally long
        last_step = generated >= self.max_new_tokens
        candidates = []
        for beam in beams:
            token_ids, logprobs = self._reports.pop(beam.seq_id)
            for token, logprob in zip(token_ids, logprobs):
                candidates.append(Candidate(beam, token, beam.cumulative_logprob + logprob))
        candidates.sort(key=lambda c: c.cumulative_logprob, reverse=True)  # stable: ties keep beam order
        live: list[Candidate] = []
        for rank, cand in enumerate(candidates[: self.num_candidates]):
            ends_on_eos = cand.token in self.stop_token_ids
            if ends_on_eos or last_step:
                if rank < self.width:  # transformers finalises only among the best `width`
                    self._add_finished(cand, generated, entries, "stop" if ends_on_eos else "length")
            elif len(live) < self.width:
                live.append(cand)
        self.done = last_step or not live or not self._can_improve(live[0], generated)
        return live

    def _add_finished(
        self, cand: Candidate, generated: int, entries: dict[int, dict[int, Logprob]], reason: str
    ) -> None:
        parent = cand.parent
        score = cand.cumulative_logprob / generated**self.params.length_penalty
        self.finished.append(Hypothesis(
            parent.output_token_ids + [cand.token], parent.logprobs + [entries[parent.seq_id]],
            cand.cumulative_logprob, score, reason,
        ))
        self.finished.sort(key=lambda h: h.score, reverse=True)  # stable: earlier hypotheses win ties
        del self.finished[self.width:]

    def _can_improve(self, best_live: Candidate, generated: int) -> bool:
        """transformers' early-stop heuristic (early_stopping=False): the best live beam, scored at
        its current length, against the worst of a full set of finished hypotheses."""
        if len(self.finished) < self.width:
            return True
        return best_live.cumulative_logprob / generated**self.params.length_penalty > self.finished[-1].score

    def _logprob_entries(self, beams: list["Sequence"]) -> dict[int, dict[int, Logprob]]:
        """Per beam, the logprobs dict of this step's position (its top candidates, rank 1 first)."""
        entries = {}
        for beam in beams:
            token_ids, logprobs = self._reports[beam.seq_id]
            entries[beam.seq_id] = {token: Logprob(lp, rank) for rank, (token, lp) in enumerate(zip(token_ids, logprobs), 1)}
        return entries


def beam_search_output(output: RequestOutput, params: BeamSearchParams, tokenizer: Any) -> BeamSearchOutput:
    """A finished beam search request's output in the shape of vLLM's `LLM.beam_search`: tokens
    and text cover the prompt too (vLLM decodes with the tokenizer's defaults)."""
    sequences = []
    for completion in output.outputs:
        tokens = output.prompt_token_ids + completion.token_ids
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(_text_ids(tokens, completion.finish_reason, params))
        sequences.append(BeamSearchSequence(
            tokens=tokens, logprobs=completion.logprobs, lora_request=output.lora_request,
            cum_logprob=completion.cumulative_logprob, text=text, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        ))
    return BeamSearchOutput(sequences)


def _text_ids(token_ids: list[int], finish_reason: str | None, params: BeamSearchParams) -> list[int]:
    """The tokens a beam's text shows: the final eos only with include_stop_str_in_output."""
    if finish_reason == "stop" and not params.include_stop_str_in_output:
        return token_ids[:-1]
    return token_ids
