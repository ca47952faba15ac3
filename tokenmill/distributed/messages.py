"""What travels over the control pipe between rank 0 and each worker process.

Small messages only: headers, Python values, pickled calls. Tensors of a step travel through
the process group (``torch.distributed.broadcast`` from rank 0), sized by the header that
announced them. Every message is pickled explicitly (``send_bytes(pickle.dumps(...))``), never
through multiprocessing's pickler, which would move tensors through shared-memory handles.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.models.source import ModelSource


@dataclass(frozen=True)
class WorkerSetup:
    """The first message to a new worker process: everything it needs to build its rank."""

    rank: int
    config: "EngineConfig"
    source: "ModelSource"
    load_format: str
    store_port: int
    num_threads: int
    sys_path: list[str]  # rank 0's, so functions pickled by reference import there too


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor sits in a packed byte payload."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # in bytes, aligned to the element size


@dataclass(frozen=True)
class ForwardCall:
    """Run the model's forward; the inputs arrive as one packed broadcast of ``payload_bytes``."""

    specs: tuple[TensorSpec, ...]
    payload_bytes: int
    attn_values: dict[str, Any] | None  # the non-tensor AttentionMetadata fields; None: no metadata


@dataclass(frozen=True)
class DecodeGraphCall:
    """Replay the decode CUDA graph of the batch's bucket (every rank captured the same buckets);
    the graph's inputs arrive as one packed broadcast of ``payload_bytes``."""

    specs: tuple[TensorSpec, ...]
    payload_bytes: int


@dataclass(frozen=True)
class LogitsCall:
    """Run compute_logits on hidden rows that arrive by broadcast (its all-gather needs every rank)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class RpcCall:
    """collective_rpc: ``payload`` pickles (method, args, kwargs); the reply carries ``call_id``."""

    call_id: int
    payload: bytes


@dataclass(frozen=True)
class Stop:
    """Leave the loop and exit."""


@dataclass(frozen=True)
class Joining:
    """The worker is about to join the process group (rank 0 joins only once all are about to)."""


@dataclass(frozen=True)
class Failed:
    """A worker's last message before it exits: the mirrored call it failed, and why (its exception,
    one line; the traceback goes to its stderr). Rank 0 adds it to the error of the failed step."""

    error: str


@dataclass(frozen=True)
class Reply:
    """A worker's answer: to its start-up (call_id -1) or to an RpcCall."""

    call_id: int
    ok: bool
    payload: bytes = b""  # the pickled result when ok
    error: str = ""  # the formatted traceback when not ok


def send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def dumps_value(value: object, what: str) -> bytes:
    """Pickle a call or a result for another process: cloudpickle when installed (it carries
    lambdas and closures by value), the standard pickle otherwise."""
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    try:
        return cloudpickle.dumps(value) if cloudpickle is not None else pickle.dumps(value)
    except Exception as exc:
        hint = "" if cloudpickle is not None else "; install cloudpickle to send lambdas and closures"
        raise TypeError(f"{what} cannot be pickled to reach the tensor-parallel workers: {exc}{hint}") from exc
