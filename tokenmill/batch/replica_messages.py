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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.batch.job import JobConfig


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
    events: list[tuple[str, tuple[Any, ...]]]  # (Progress method name, its arguments), in call order


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
