"""A tensor-parallel worker process (ranks 1..N-1): ``python -m tokenmill.distributed.worker_process FD``.

FD is this process's end of a socket pair to rank 0 (the control pipe). The process is started
as a fresh interpreter rather than by multiprocessing's spawn, so the user's main module is not
re-imported in it (a script without an ``if __name__ == "__main__"`` guard works, and so do
notebooks), and no resource tracker process is left behind.

Life cycle: read the WorkerSetup, join the process group, load this rank's shard, reply ready,
then loop: mirror a forward or compute_logits call, answer a collective_rpc, or stop. Waiting
between calls happens on the pipe, never inside a collective, so an idle engine never hits the
collective timeout. The process ends when told to stop, when rank 0's end of the pipe closes,
when its parent disappears (a watcher thread notices within a second) or when a mirrored call
fails (the ranks are then out of step, so carrying on would only hang them).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import pickle
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from tokenmill.distributed.child_process import exit_with_parent
from tokenmill.distributed.messages import Failed, Joining, Reply, RpcCall, Stop, WorkerSetup, dumps_value, receive, send
from tokenmill.distributed.mirror import replay
from tokenmill.distributed.process_group import connect_store, create_group, rank_device
from tokenmill.worker.worker import Worker, worker_class


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    exit_with_parent(int(argv[1]))
    try:
        setup: WorkerSetup = receive(conn)
    except EOFError:
        return 1  # rank 0 went away before sending the set-up
    sys.path.extend(p for p in setup.sys_path if p not in sys.path)
    # Rank 0 logs the same warnings (same config, same model); errors still show.
    logging.getLogger("tokenmill").setLevel(logging.ERROR)
    try:
        config = setup.config
        if config.device.type == "cpu":
            torch.set_num_threads(setup.num_threads)
        device = rank_device(config.device, setup.rank)
        store = connect_store(setup.store_port, config.tensor_parallel_size)
        send(conn, Joining())
        group = create_group(store, setup.rank, config.tensor_parallel_size, device)
        torch.manual_seed(config.seed)
        worker = worker_class(config.worker_extension_cls)(config, setup.source, setup.load_format, setup.rank, device, group)
    except BaseException:
        send(conn, Reply(-1, False, error=traceback.format_exc()))
        return 1
    gc.collect()  # the start-up's objects walked now, not mid-run with every rank waiting (LLM.__init__ says why)
    send(conn, Reply(-1, True))
    return serve(conn, worker, group)


def serve(conn: Connection, worker: Worker, group: Any) -> int:
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            return 1  # rank 0 is gone
        if isinstance(message, Stop):
            return 0
        if isinstance(message, RpcCall):
            try:
                send(conn, run_rpc(worker, message))
            except OSError:
                return 1  # rank 0 is gone
            continue
        try:
            replay(message, worker, group)
        except Exception as error:
            traceback.print_exc()
            print(f"tokenmill: tensor-parallel worker rank {worker.rank} failed a mirrored call; exiting", file=sys.stderr)
            with contextlib.suppress(OSError):  # rank 0 may be gone already
                send(conn, Failed("".join(traceback.format_exception_only(error)).strip()))
            return 1


def run_rpc(worker: Worker, call: RpcCall) -> Reply:
    try:
        method, args, kwargs = pickle.loads(call.payload)
        result = worker.execute_method(method, args, kwargs)
        return Reply(call.call_id, True, dumps_value(result, "the result of collective_rpc"))
    except Exception:
        return Reply(call.call_id, False, error=traceback.format_exc())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
