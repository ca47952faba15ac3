"""From the engine's request state to what the user gets: logprob dicts, `RequestOutput`s.

After the scheduler has taken in a step's tokens (`Scheduler.update_from_output`), the output
processor records the logprobs that step produced (each position the sampled token first, then
the top-k or the request's logprob_token_ids, with decoded tokens; kept as a list of dicts or a
`FlatLogprobs`, ``tokenmill/logprobs.py``) and builds the `RequestOutput`s: the best ``n`` of
``best_of`` samples, only what is new for DELTA streams, a beam search's finished hypotheses.

Ranks, as vLLM reports them: the sampled (or prompt) token's rank in the distribution, the i-th
top token's i, and the i-th of logprob_token_ids i too (its place in the list, not in the
distribution). A top token that is the sampled one keeps the sampled token's entry; a listed id
that is the sampled one takes its listed rank (vLLM's dict is built in that order).
"""

from __future__ import annotations

import time
from typing import Any

from tokenmill.engine.request import Request, Sequence
from tokenmill.engine.step import StepResult
from tokenmill.logprobs import FlatLogprobs, Logprob, PromptLogprobs, SampleLogprobs, append_position
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # Token id -> its text, for the tokens that decode alone to whole characters (nearly all):
        # looked up, not decoded again (~5 µs a call), where positions carry decoded tokens (a
        # scoring job through `tokenmill run` decodes every prompt position). At most the vocabulary.
        self._whole_texts: dict[int, str] = {}
        self._space_marker = _leading_space_marker(tokenizer)

    def record_prompt_logprobs(self, result: StepResult[Sequence]) -> None:
        """The prompt positions a step scored, appended to their requests' prompt logprobs.

        A scoring job reads back every prompt position (16k a step), so a list container's positions
        are built directly as the sampled tokens' are (`_position`: a third of `_append`'s time),
        their decoded tokens (if asked for) looked up where every token's text is known
        (`_whole_texts`), and a flat one's columns without decoded tokens in one pass
        (`FlatLogprobs.extend_ranked`); the others go through `_append`."""
        for chunk in result.prompt_logprobs.read() if result.prompt_logprobs is not None else ():
            request = chunk.seq.request
            container = request.prompt_logprobs
            assert container is not None, "the runner scores prompts only when asked"
            params = request.params
            skip = max(0, len(container) - chunk.first)  # positions already scored before a preemption
            first = chunk.first + skip
            tokens = request.prompt_token_ids[first : chunk.first + len(chunk.token_logprobs)]
            logprobs, ranks = chunk.token_logprobs[skip:], chunk.ranks[skip:]
            top_ids = chunk.top_ids[skip:] if chunk.top_ids is not None else None
            top_logprobs = chunk.top_logprobs[skip:] if chunk.top_logprobs is not None else None
            text = self.tokenizer is not None and params.detokenize
            if isinstance(container, FlatLogprobs):
                if not text:
                    container.extend_ranked(tokens, logprobs, ranks, top_ids, top_logprobs)
                    continue
                for i, (token, lp, rank) in enumerate(zip(tokens, logprobs, ranks)):
                    top = (top_ids[i], top_logprobs[i]) if top_ids is not None and top_logprobs is not None else None
                    self._append(container, token, lp, rank, top)
                continue
            if top_ids is None or top_logprobs is None:
                positions = [{t: Logprob(lp, r)} for t, lp, r in zip(tokens, logprobs, ranks)]
            else:
                k = params.prompt_logprobs
                positions = [_position(t, lp, r, ti, tl, k) for t, lp, r, ti, tl in zip(tokens, logprobs, ranks, top_ids, top_logprobs)]
            if not text:
                container.extend(positions)
                continue
            for i, position in enumerate(positions):  # with decoded tokens (`tokenmill run`'s scoring rows)
                if self._known_texts(position):
                    container.append(position)
                else:  # a text not known yet: the position built again by the generic path, which decodes it
                    top = (top_ids[i], top_logprobs[i]) if top_ids is not None and top_logprobs is not None else None
                    self._append(container, tokens[i], logprobs[i], ranks[i], top)

    def record_sample_logprobs(self, result: StepResult[Sequence], rows: list[int]) -> None:
        """The logprobs of the tokens taken from ``rows`` (`Scheduler.update_from_output`), for
        sequences that asked for them, and the sums best_of ranks by.

        This runs for every sampled token of a logprobs request (273,681 positions in the chat
        workload's call of 1,024 replies), so the common position, a list-form container with the
        top ones as alternatives, is built here as its dict directly (`_position`), its decoded
        tokens (if any) looked up when their texts are known; the others go through `_append`.
        Both give the same entries in the same order."""
        samples = result.read()
        if samples is None or samples.logprobs is None:
            return
        sampled_lp, ranks, requested = samples.logprobs, samples.ranks, samples.requested_logprobs
        token_ids, top_ids, top_logprobs = samples.token_ids, samples.top_ids, samples.top_logprobs
        assert ranks is not None
        no_text = self.tokenizer is None
        sampled = result.sampled
        for row in rows:
            seq = sampled[row].seq
            request = seq.request
            if request.beam is not None:
                continue  # a beam's logprobs are its search's (BeamSearch.advance)
            params = request.params
            logprob = sampled_lp[row]
            if params.best_of is not None:
                seq.best_of_logprob += logprob
            container = seq.logprobs
            if container is None:
                continue
            # logprobs or logprob_token_ids (intake made the container)
            token, k, listed = token_ids[row], params.logprobs, params.logprob_token_ids
            if listed:
                assert requested is not None, "rows with logprob_token_ids get their ids' logprobs"
                self._append(container, token, logprob, ranks[row], (listed, requested[row]), listed=True,
                             detokenize=params.detokenize)
            elif type(container) is list:
                top = k and top_ids is not None and top_logprobs is not None
                position = _position(token, logprob, ranks[row], top_ids[row] if top else None,
                                     top_logprobs[row] if top else None, k)
                if no_text or not params.detokenize or self._known_texts(position):
                    container.append(position)
                else:  # a text not known yet: decoded (and kept, if whole) by the generic path
                    self._append(container, token, logprob, ranks[row],
                                 (top_ids[row][:k], top_logprobs[row][:k]) if top else None)
            else:
                alternatives = None
                if k and top_ids is not None and top_logprobs is not None:
                    alternatives = (top_ids[row][:k], top_logprobs[row][:k])
                self._append(container, token, logprob, ranks[row], alternatives, detokenize=params.detokenize)
            seq.cumulative_logprob += logprob

    def request_output(self, request: Request) -> RequestOutput:
        if request.beam is not None and request.error is not None:  # the search did not end: no best beams
            completions = [CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                            finish_reason="error")]
        elif request.beam is not None:  # its sequences are live beams; the output is the finished ones
            completions = request.beam.completions(self.tokenizer, self.decoded_alone) if request.beam.done else []
        else:
            completions = self._sample_completions(request)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs(request),
            outputs=completions,
            finished=request.is_finished,
            metrics=self._metrics(request, completions),
            num_cached_tokens=request.num_cached_tokens,
            num_cache_creation_tokens=request.num_cache_creation_tokens,
            lora_request=request.lora_request,
            error=request.error,
        )

    @staticmethod
    def _metrics(request: Request, completions: list[CompletionOutput]) -> RequestMetrics:
        generated = sum(len(s.output_token_ids) for s in request.sequences) if request.beam is None else \
            sum(len(c.token_ids) for c in completions)
        # An output is made in the step that read its newest token (or the one that finished it).
        last = request.finished_time or (time.monotonic() if generated else None)
        return RequestMetrics(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                              request.finished_time, generated, last)

    @staticmethod
    def _prompt_logprobs(request: Request) -> PromptLogprobs | None:
        """A copy (either form). With DELTA outputs, vLLM's rule: all of them in the request's first
        output (its prompt is whole by then: outputs start with the first sampled token), then []."""
        if request.prompt_logprobs is None:
            return None
        if request.params.output_kind is RequestOutputKind.DELTA:
            if request.prompt_logprobs_sent:
                return request.prompt_logprobs[:0]
            request.prompt_logprobs_sent = True
        return request.prompt_logprobs[:]

    def _sample_completions(self, request: Request) -> list[CompletionOutput]:
        delta = request.params.output_kind is RequestOutputKind.DELTA
        completions = []
        sequences = request.sequences
        if request.params.num_samples > request.params.n:
            # best_of: the n samples with the highest cumulative logprob (only final outputs are whole).
            sequences = sorted(sequences, key=lambda s: s.best_of_logprob, reverse=True)[: request.params.n]
        for index, seq in enumerate(sequences):
            first_token, first_char = (seq.num_emitted_tokens, seq.num_emitted_chars) if delta else (0, 0)
            text = seq.text if seq.is_finished or seq.detokenizer is None else seq.detokenizer.settled_text
            if delta:
                seq.num_emitted_tokens, seq.num_emitted_chars = len(seq.output_token_ids), len(text)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text[first_char:],
                    token_ids=seq.output_token_ids[first_token:],
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=seq.logprobs[first_token:] if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return completions

    def _known_texts(self, position: dict[int, Logprob]) -> bool:
        """Fill in the position's decoded tokens from the texts already known (`_whole_texts`); False
        if one is not known yet (the position is then built again by `_append`, which decodes it)."""
        whole = self._whole_texts
        try:
            for token_id, entry in position.items():
                entry.decoded_token = whole[token_id]
        except KeyError:
            return False
        return True

    def _append(self, container: SampleLogprobs | PromptLogprobs, token: int, logprob: float, rank: int,
                alternatives: tuple[list[int], list[float]] | None, listed: bool = False,
                detokenize: bool = True) -> None:
        """One position: the token with its logprob and rank, then the alternatives with ranks 1, 2,
        ... (the top ones, or the listed logprob_token_ids, whose row beyond the list is padding
        that zip drops). A top alternative that is the token itself is left out, so the token keeps
        its rank in the distribution; a listed one is kept and, coming later, takes over the
        token's entry (vLLM builds its dict in that order). With detokenize=False every
        decoded_token is None, as in vLLM."""
        ids, logprobs, ranks = [token], [logprob], [rank]
        if alternatives is not None:
            for r, (tid, lp) in enumerate(zip(*alternatives), start=1):
                if listed or tid != token:
                    ids.append(tid)
                    logprobs.append(lp)
                    ranks.append(r)
        if self.tokenizer is None or not detokenize:
            texts: list[str | None] = [None] * len(ids)
        else:
            context = _recent_tokens(container)
            texts = [self._token_text(t, context) for t in ids]
        append_position(container, ids, logprobs, ranks, texts)

    def decoded_alone(self, token_id: int) -> str:
        """The token decoded on its own; a whole token's text is kept (`_whole_texts`) and looked up
        the next time (part of a character, U+FFFD alone, is decoded each time)."""
        text = self._whole_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if self._space_marker is not None:
                text = _restore_leading_spaces(self.tokenizer.convert_ids_to_tokens(token_id), text, self._space_marker)
            if not text.endswith("\ufffd"):
                self._whole_texts[token_id] = text
        return text

    def _token_text(self, token_id: int, context: list[int]) -> str:
        """The token's text as vLLM 0.26 reports it (v1/engine/logprobs.py, _correct_decoded_token):
        a token that is part of a character split over several tokens (byte-level or byte-fallback
        vocabularies) decodes alone to U+FFFD; it gets the text it completes together with the
        tokens before it at this position's left, or "" when the character is still incomplete."""
        text = self.decoded_alone(token_id)
        if not text.endswith("\ufffd"):
            return text
        for size in range(1, min(len(context), 4) + 1):
            before = context[-size:]
            whole = self.tokenizer.decode(before + [token_id])
            if whole.endswith("\ufffd"):
                continue
            # Context tokens that were themselves incomplete pieces reported "": their bytes belong
            # to this token's text, so only the complete ones before them are cut off.
            clean = len(before)
            while clean > 0 and self.tokenizer.decode([before[clean - 1]]).endswith("\ufffd"):
                clean -= 1
            prefix = self.tokenizer.decode(before[:clean]) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            common = 0
            for a, b in zip(prefix, whole):
                if a != b:
                    break
                common += 1
            return whole[common:]
        return ""


def _position(token: int, logprob: float, rank: int, top_ids: list[int] | None, top_logprobs: list[float] | None,
              k: int) -> dict[int, Logprob]:
    """One position's dict as `OutputProcessor._append` builds it for the top ``k`` alternatives
    without decoded tokens: the token first with its rank, then the top ones with ranks 1, 2, ...,
    a top one that is the token itself left out (the token keeps its rank in the distribution);
    a top id given twice keeps its first place and its last values, as a dict built from the
    pairs would. Without the intermediate lists and the container's dispatch: the per-position
    work of a logprobs request is this function, once per sampled token."""
    position = {token: Logprob(logprob, rank)}
    if top_ids is None or top_logprobs is None:
        return position
    if k == 1:  # the usual request: one alternative, the sampled token itself about half the time
        top = top_ids[0]
        if top != token:
            position[top] = Logprob(top_logprobs[0], 1)
        return position
    for r, top, lp in zip(range(1, k + 1), top_ids, top_logprobs):
        if top != token:
            position[top] = Logprob(lp, r)
    return position


def _leading_space_marker(tokenizer: Any) -> str | None:
    """The space marker ("▁") of a Metaspace pre-tokenizer (Mistral v0.3, and Llama-2 / TinyLlama /
    Mistral tokenizers as transformers 5 builds them), alone or in a Sequence; None otherwise (byte-level
    and legacy-layout tokenizers, whose single-token decode vLLM 0.26 leaves as it is)."""
    import json

    pre = getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None)
    if pre is None:
        return None
    config = json.loads(pre.__getstate__())
    for part in [config, *config.get("pretokenizers", ())]:
        if part.get("type") == "Metaspace":
            return part.get("replacement", "\u2581")
    return None


def _restore_leading_spaces(piece: str | None, text: str, marker: str) -> str:
    """The token decoded alone as vLLM 0.26 reports it (tokenizers/detokenizer_utils.py,
    convert_ids_list_to_tokens): the decoder's Strip took the piece's leading space ("▁world" decodes
    alone to "world"); the spaces its leading markers stand for are put back (" world")."""
    markers = len(piece) - len(piece.lstrip(marker)) if piece else 0
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def _recent_tokens(container: SampleLogprobs | PromptLogprobs, most: int = 4) -> list[int]:
    """The sampled (or prompt) tokens of the container's last ``most`` positions, oldest first:
    each position's first entry (positions without entries, prompt position 0, are skipped)."""
    if isinstance(container, FlatLogprobs):
        n = len(container.start_indices)
        return [container.token_ids[container.start_indices[i]] for i in range(max(0, n - most), n)
                if container.start_indices[i] < container.end_indices[i]]
    return [next(iter(entry)) for entry in container[-most:] if entry]
