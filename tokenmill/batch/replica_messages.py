"""What travels between `tokenmill run --replicas N` (the parent) and each replica process.

parent → replica: ReplicaSetup (first), StopReplica (stop after the current step).
replica → parent: Ready (model loaded), Commit (finished rows, to be journaled by the parent),
ProgressEvents (the replica's progress calls, replayed on the parent's progress line),
Finished (its shard is done, or it stopped when told), Failed (it cannot run: bad model, engine error).

Every message is one pickled frame (``send_bytes``): a replica killed in the middle of sending a
Commit leaves a truncated frame, which the parent drops whole, so a row is journaled completely
or not at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.batch.config import JobConfig
    from tokenmill.batch.progress import Progress

ProgressEvent = tuple[str, tuple[Any, ...]]  # (Progress method name, its arguments)
_PROGRESS_METHODS = frozenset({"on_submitted", "on_tokens", "on_step", "on_row_done", "on_dropped"})


class ReplicaError(RuntimeError):
    """A replica failed for a reason that is not the user's input, or kept dying. Finished rows are
    kept: a rerun continues."""


@dataclass(frozen=True)
class ReplicaSetup:
    config: "JobConfig"  # the job, with this replica's engine options (device)
    shard: int  # this replica runs the input rows whose index % shards == shard
    shards: int
    input_format: str
    output_shape: str  # "generic" or "openai"
    job_key: str  # the settings fingerprint (OpenAI ids derive from it)
    done: bytes  # the journal's bitmap of finished rows when this replica started
    num_threads: int | None  # torch threads of a CPU replica (None: torch's default)
    sys_path: list[str]  # the parent's, so the same modules import
    input_size: int | None = None  # the input's bytes when the job scanned it: the rows a replica reads


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class Commit:
    """The arguments of one `Journal.commit`: encoded output lines and the rows they finish."""

    data: bytes
    rows: list[int]
    failed: list[int]
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ProgressEvents:
    events: list[ProgressEvent]  # in call order


@dataclass(frozen=True)
class Finished:
    complete: bool  # False: stopped early because the parent asked
    errors: list[str] = field(default_factory=list)  # the first few row failures


@dataclass(frozen=True)
class Failed:
    error_type: str  # the exception's class name (ValueError and kin are the user's mistakes)
    message: str
    traceback: str


@dataclass(frozen=True)
class StopReplica:
    pass


class ProgressRecorder:
    """A replica's stand-in for the job's `Progress`: records the calls, to be replayed by the parent
    (`replay_progress`), so the one progress line counts every replica's rows and tokens."""

    def __init__(self, flush_interval_s: float = 0.5):
        self.events: list[ProgressEvent] = []
        self.decoded: dict[Any, int] = {}  # generated tokens per row not yet in an event
        self.flush_interval_s = flush_interval_s
        self.last_flush = time.monotonic()

    def on_submitted(self, key: Any, bound: int, samples: int = 1) -> None:
        self.events.append(("on_submitted", (key, bound, samples)))

    def on_tokens(self, key: Any, prompt: int, generated: int) -> None:
        if prompt:
            self.events.append(("on_tokens", (key, prompt, generated)))
        else:  # decode steps: one event per row and flush, summed
            self.decoded[key] = self.decoded.get(key, 0) + generated

    def on_step(self) -> None:
        self.events.append(("on_step", ()))

    def on_row_done(self, key: Any, failed: bool) -> None:
        self._settle(key)
        self.events.append(("on_row_done", (key, failed)))

    def on_dropped(self, key: Any) -> None:
        self._settle(key)
        self.events.append(("on_dropped", (key,)))

    def _settle(self, key: Any) -> None:
        """A row's summed decode tokens go out before the event that ends it."""
        generated = self.decoded.pop(key, 0)
        if generated:
            self.events.append(("on_tokens", (key, 0, generated)))

    def maybe_draw(self) -> None:
        pass  # the parent draws

    def counts_due(self) -> bool:
        """Whether the running rows' tokens should be told now (`Progress.counts_due`): before a flush."""
        return self.flush_due()

    def flush_due(self) -> bool:
        return time.monotonic() - self.last_flush >= self.flush_interval_s

    def take(self) -> list[ProgressEvent]:
        for key in list(self.decoded):
            self._settle(key)
        events, self.events = self.events, []
        self.last_flush = time.monotonic()
        return events


def replay_progress(events: list[ProgressEvent], progress: "Progress") -> None:
    for name, args in events:
        if name in _PROGRESS_METHODS:
            getattr(progress, name)(*args)
