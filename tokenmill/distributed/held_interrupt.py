"""A Ctrl-C held until the tensor-parallel call in progress ends, so that the ranks stay in step.

Rank 0 interrupted inside a mirrored call leaves the workers in a collective it will never join:
they must be stopped, and the LLM can run no more steps. A mirrored call lasts one forward, so the
first SIGINT that lands in one is held and delivered as the call returns; the engine then recovers
from it between calls as it does on one rank (the LLM stays usable, `tokenmill chat`'s Ctrl-C stops
one answer). A second SIGINT within the same call is delivered at once, so a call that hangs can
still be interrupted (the workers are then stopped, as before).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Within: the first SIGINT waits for the block to end (dropped if the block raises: it failed
    anyway); a second one is not held. Only the main thread, which receives signals, holds any, and
    only a Python handler (the default raises KeyboardInterrupt) can be called later."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    held: list[tuple[int, Any]] = []

    def hold(signum: int, frame: Any) -> None:
        held.append((signum, frame))
        signal.signal(signal.SIGINT, previous)  # the next Ctrl-C goes straight through

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is hold:
            signal.signal(signal.SIGINT, previous)
    if held:
        previous(*held[0])
