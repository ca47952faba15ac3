"""`LLM`'s iterators: `imap` (outputs as requests finish, the prompts read lazily) and `stream`
(token deltas), with the mailboxes through which whoever steps the engine hands them their outputs.

Both check their arguments and queue their first requests at the call, as `generate` does: a bad
value raises there, not at the first ``next()`` far from it. An iterator stopped early, closed or
dropped unread aborts the requests it still has in the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from tokenmill.inputs import PromptType, check_prompts_iterable, is_one_prompt, prompt_list
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, for_call

_END = object()


class IteratorMethods:
    """Mixed into `LLM`, which provides the attributes below."""

    llm_engine: Any
    # Requests of open imap() / stream() iterators -> that iterator's mailbox (LLM.__init__ makes it).
    _mailboxes: dict[str, dict[str, RequestOutput]]

    if TYPE_CHECKING:
        def get_default_sampling_params(self) -> SamplingParams: ...

        def _params_per_prompt(self, sampling_params: Any, count: int) -> list[SamplingParams]: ...

        def _submit(self, prompts: Sequence[PromptType], params: Sequence[Any],
                    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY, adapters: Sequence[Any] | None = None,
                    priorities: Any = None, first_index: int = 0) -> list[str]: ...

        def _step(self, finished_only: bool = False) -> list[RequestOutput]: ...

    def imap(
        self,
        prompts: PromptType | Iterable[PromptType],
        sampling_params: SamplingParams | None = None,
        max_in_flight: int | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield outputs as requests finish (completion order; match them by ``request_id``).

        Reads ``prompts`` lazily and keeps at most ``max_in_flight`` requests in the engine
        (default: twice max_num_seqs, enough to keep every batch full), so memory stays flat for
        inputs of any length. The call checks the arguments and queues the first requests (bad
        sampling_params, or a bad prompt among those first ones, raise here); a bad prompt further
        on raises when it is reached. Other calls between two items (generate, another imap or
        stream) keep its outputs for it.
        """
        if max_in_flight is not None and (
            not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1
        ):
            raise ValueError(f"max_in_flight={max_in_flight!r} is invalid: must be None or an integer >= 1")
        if not is_one_prompt(prompts):
            check_prompts_iterable(prompts)  # iterating None would fail with a bare TypeError
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or None (one for every prompt), "
                             f"got {type(sampling_params).__name__}")
        # Made once for the call (checked again if a field was set after construction), so that
        # each prompt's _submit finds it ready instead of copying it.
        params = for_call(sampling_params, RequestOutputKind.FINAL_ONLY, "sampling_params")
        limit = max_in_flight or 2 * self.llm_engine.config.max_num_seqs
        # One prompt, as generate() takes it: iterating it would run each character (or dict key) as a prompt.
        outputs = self._imap_outputs(enumerate([prompts] if is_one_prompt(prompts) else prompts), params, limit)
        next(outputs)  # queues the first requests: the engine checks them (and the params) now
        return outputs  # type: ignore[return-value]

    def _imap_outputs(
        self, source: Iterator[tuple[int, PromptType]], params: SamplingParams, limit: int,
    ) -> Iterator[RequestOutput | None]:
        mine, box = set[str](), dict[str, RequestOutput]()
        exhausted = False

        def top_up() -> None:
            nonlocal exhausted
            while not exhausted and len(mine) < limit:
                index, prompt = next(source, (None, _END))
                if prompt is _END:
                    exhausted = True
                    return
                self._watch(self._submit([prompt], [params], first_index=index), mine, box)

        try:
            top_up()
            yield None  # the priming step `imap` takes; the caller sees the items after it
            while mine:
                yield from self._deliver(mine, box, finished_only=True)
                top_up()
        finally:
            self._unwatch(mine)  # a caller that stops early leaves nothing running

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Token streaming for interactive use: yields a RequestOutput after every engine step that
        advanced a request, holding only what is new (``RequestOutputKind.DELTA``: the new token ids
        and text, ``finished`` on the last one). The call checks the arguments and queues the requests
        (a bad value raises here, not at the first ``next()``); stopping early aborts what still runs.
        Steps made by other calls between two items (generate, another stream) fold into the next delta."""
        prompts = prompt_list(prompts)
        ids = self._submit(prompts, self._params_per_prompt(sampling_params, len(prompts)), RequestOutputKind.DELTA)
        mine, box = set[str](), dict[str, RequestOutput]()
        self._watch(ids, mine, box)
        deltas = self._stream_deltas(mine, box)
        next(deltas)  # into its try: a stream dropped or closed unread still aborts its requests
        return deltas  # type: ignore[return-value]

    def _stream_deltas(self, mine: set[str], box: dict[str, RequestOutput]) -> Iterator[RequestOutput | None]:
        try:
            yield None  # the priming step `stream` takes; the caller sees the items after it
            while mine:
                yield from self._deliver(mine, box, finished_only=False)
        finally:
            self._unwatch(mine)

    # ---- the mailboxes --------------------------------------------------------------------
    def _to_mailboxes(self, outputs: list[RequestOutput]) -> None:
        """Leave each output of an open iterator's request in its mailbox, whoever stepped the engine
        (the iterator itself, another one, a generate() made between two items), so no iterator loses
        an output, or waits forever for one, that another call's step produced."""
        for output in outputs:
            box = self._mailboxes.get(output.request_id)
            if box is None:
                continue
            waiting = box.get(output.request_id)
            if waiting is None:
                box[output.request_id] = output
            else:  # a stream's deltas from several steps before its consumer came back: fold them
                waiting.add(output, aggregate=True)

    def _watch(self, ids: list[str], mine: set[str], box: dict[str, RequestOutput]) -> None:
        """Make ``ids`` an iterator's requests: their outputs go to ``box``."""
        mine.update(ids)
        self._mailboxes.update(dict.fromkeys(ids, box))

    def _unwatch(self, mine: set[str]) -> None:
        """An iterator ends: abort its unfinished requests and close their mailboxes."""
        self.llm_engine.abort_request(list(mine))
        for request_id in mine:
            self._mailboxes.pop(request_id, None)
        mine.clear()

    def _deliver(self, mine: set[str], box: dict[str, RequestOutput], finished_only: bool) -> Iterator[RequestOutput]:
        """Step the engine once unless ``box`` already holds outputs (another call stepped it since),
        then yield what ``box`` holds, oldest first, dropping finished requests from ``mine``."""
        if not box:
            self._step(finished_only=finished_only)
            if not box and not self.llm_engine.has_unfinished_requests():
                # Nothing left to run, yet some of ours never finished: they were aborted under the
                # iterator (sleep(), llm_engine.abort_request). Like generate(), skip them, not wait forever.
                self._unwatch(mine)
                return
        while box:  # the consumer may step the engine between two items: read box afresh each time
            output = box.pop(next(iter(box)))
            if output.finished:
                mine.discard(output.request_id)
                self._mailboxes.pop(output.request_id, None)
            yield output
