"""What LLM's blocking generation calls (generate, chat, beam_search, wait_for_completion) and the
batch job's loop ask of Python's cyclic garbage collector: young collections only, at step
boundaries (docs/perf.md 62; the job also a full one every few minutes, 70, and for pooling rows
only that, 107); and the collector paused while a call makes its prompts in bulk, and through the
pooling calls (`collections_paused`).

Why. A call keeps every finished request's output until it returns, and with logprobs that is a
dict and one or two `Logprob` objects per generated token: 273,681 tokens of a 1,024-request chat
call at ``logprobs=1`` are ~700,000 tracked objects. CPython's full (generation-2) collection walks
every tracked object of the process and comes whenever the objects promoted since the last one
reach a quarter of those that survived it, so a heap growing through the call is walked again and
again: 8-9 full collections inside that call, ~1.8 s of its ~5 s of host time on the dev CPU and
about as much on an H100's host, where the GPU waits meanwhile.

What. `young_collections_only` turns automatic collection off for the call and hands the call a
function that runs a young (generation-0) collection whenever the collector would have run one
(its allocation count past the first threshold), called by `LLM._collect` after each engine step.
A young collection walks only the objects made since the previous one, so each object is walked
about once during the call, and cyclic garbage that dies young (a user's logits processor's,
an exception's traceback) is still freed during the call. The collector is turned back on when the
call returns or raises; what is older then is collected as usual afterwards (the first full
collection after the call walks the outputs once, where the old behaviour walked them 8-9 times
inside it).

Why it loses nothing. The engine's loop makes no garbage cycles of its own: its one cycle, a
`Request` and its `Sequence`s pointing at each other, is broken when the request leaves the engine
(`Request.release`: finished with its last output built, or aborted), so reference counting frees
a finished request's state (blocks lists, detokenizer, grammar matcher) at once, with or without a
collector (tests/test_gc_policy.py checks both: every collection inside a call is a young one, and
every finished request's `Request` and `Sequence`s are freed with the collector off). Cycles made
by other code that live past a step (rare: per-request objects are made before the call and die
after it) wait until the call returns.

Not `gc.freeze()` (a frozen heap is never collected: the user's process would keep garbage for
good), not raising the third threshold (ignored by Python 3.14's incremental collector and by
free-threaded builds; a young collection by hand means the same on every version), and not a
collector paused outright as the pooling calls do (tokenmill/pooling/llm_methods.py: their loop
runs no user code and makes no cycles, and they collect nothing young either): a generation call
runs user code every step (logits processors, stop-string and structured-output callbacks) whose
short-lived cycles should not pile up over a call of millions of tokens. A collector the user
turned off stays off (no young collections either), as does one a pooling call has paused.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator


def _collect_young() -> None:
    """A young collection if the collector would have run one by now (count past its first threshold)."""
    threshold = gc.get_threshold()[0]
    if threshold and gc.get_count()[0] > threshold:  # a first threshold of 0 turns collection off
        gc.collect(0)


def _nothing() -> None:
    pass


@contextlib.contextmanager
def young_collections_only(full_every_s: float | None = None) -> Iterator[Callable[[], None]]:
    """Automatic collection off for the block; yields the function to call at each step boundary
    (a no-op when the collector was already off: the user's choice, or an enclosing pause).

    ``full_every_s``: that function also runs a full collection when that long has passed since
    the last one, for a block that runs for hours (the batch job), so that cyclic garbage older
    than a young collection is freed within that time rather than at the end; one full
    collection (~0.1 s) every few minutes costs ~0.1% of them, where the automatic ones came
    about every 2,000 short rows (docs/perf.md 70)."""
    if not gc.isenabled():
        yield _nothing
        return
    with collections_paused():
        yield _collect_young if full_every_s is None else _timed_full(full_every_s, between=_collect_young)


@contextlib.contextmanager
def timed_full_collections_only(every_s: float) -> Iterator[Callable[[], None]]:
    """Automatic collection off for the block; yields the function to call at each step boundary,
    which runs a full collection when ``every_s`` has passed since the last one and nothing in
    between: for a loop that runs no user code and makes no cycles of its own, as the pooling calls
    (which pause the collector outright), but that runs for hours (the batch job's pooling rows: its
    young collections were ~10% of an embedding job's host time a row, docs/perf.md 107), so that
    what cyclic garbage there is (a bad row's exception) is still freed within that time."""
    if not gc.isenabled():
        yield _nothing
        return
    with collections_paused():
        yield _timed_full(every_s, between=_nothing)


def _timed_full(every_s: float, between: Callable[[], None]) -> Callable[[], None]:
    last = time.monotonic()

    def collect() -> None:
        nonlocal last
        if time.monotonic() - last >= every_s:
            gc.collect()
            last = time.monotonic()
        else:
            between()

    return collect


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Automatic collection off for a block that builds many objects no collection could free (a
    call's prompts tokenized or rendered in bulk, a pooling call): outside `young_collections_only`,
    the collector's full passes would walk them again and again. Nested blocks and a collector the
    user turned off leave it as it is."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
