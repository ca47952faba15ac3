"""Chaos hooks, loaded by every Python process of a trial (PYTHONPATH). CHAOS_POINT="name:count:sig"
makes the process signal itself at the count-th time it reaches that point (sig: KILL, TERM, INT, INT2).
The points are exact moments a timer cannot hit: mid-write, between a commit's two writes, during the
Parquet rename, during mark_complete, in a replica after a commit."""

import os
import random
import signal
import sys

_spec = os.environ.get("CHAOS_POINT")


def _install(spec: str) -> None:
    name, count, sig = spec.split(":")
    state = {"left": int(count)}
    rng = random.Random(os.getpid())
    with open("/proc/self/cmdline", "rb") as f:
        is_replica = b"tokenmill.batch.replica_process" in f.read()
    log = os.environ.get("CHAOS_LOG")

    def fire(where: str) -> None:
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} fired {where} {sig}\n")
        if sig == "KILL":
            os.kill(os.getpid(), signal.SIGKILL)
        elif sig == "TERM":
            os.kill(os.getpid(), signal.SIGTERM)
        elif sig == "INT":
            os.kill(os.getpid(), signal.SIGINT)
        elif sig == "INT2":
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    def due() -> bool:
        state["left"] -= 1
        if state["left"] != 0:
            return False
        # Once an attempt: a replica's replacement inherits the point, and would die at it again.
        return not (log and os.path.exists(log) and "fired" in open(log).read())

    if name == "replica_commit":
        if not is_replica:
            return
        # The replica runs as __main__ and binds send when it starts: patch it at its source, before.
        import tokenmill.distributed.messages as messages

        send = messages.send

        def patched_send(conn, message):
            send(conn, message)
            if type(message).__name__ == "Commit" and due():
                fire(name)

        messages.send = patched_send
        return
    if is_replica:
        return
    import tokenmill.batch.writers as writers

    if name in ("data_partial", "journal_partial", "before_journal", "after_journal"):
        write = writers.AppendFile.write

        def patched_write(self, data):
            is_journal = self.path.endswith("journal.jsonl")
            if name == "before_journal" and is_journal and due():
                fire(name)
            if name in ("data_partial", "journal_partial") and is_journal == (name == "journal_partial") and due():
                cut = rng.randrange(1, max(2, len(data)))
                os.write(self._file.fileno(), data[:cut])
                fire(name)
            write(self, data)
            if name == "after_journal" and is_journal and due():
                fire(name)

        writers.AppendFile.write = patched_write
        return
    if name == "in_write":  # the signal arrives while the data file's write syscall runs
        write = writers.AppendFile.write

        class Proxy:
            def __init__(self, real):
                self.real = real

            def write(self, data):
                written = self.real.write(data)
                fire(name)
                return written

            def __getattr__(self, attr):
                return getattr(self.real, attr)

        def patched_write2(self, data):
            if not self.path.endswith("journal.jsonl") and due():
                real = self._file
                self._file = Proxy(real)
                try:
                    return write(self, data)
                finally:
                    self._file = real
            return write(self, data)

        writers.AppendFile.write = patched_write2
        return
    if name == "after_truncate":  # right after a (re)open cut a torn tail
        init = writers.AppendFile.__init__

        def patched_init(self, path, expected_size):
            init(self, path, expected_size)
            if not path.endswith("journal.jsonl") and due():
                fire(name)

        writers.AppendFile.__init__ = patched_init
        return
    real_replace, real_remove = os.replace, os.remove

    def replace(src, dst, *a, **k):
        src_s, dst_s = str(src), str(dst)
        target = "state" if dst_s.endswith("state.json") else "output" if src_s.endswith(".tmp") else None
        if name == f"before_replace_{target}" and due():
            fire(name)
        real_replace(src, dst, *a, **k)
        if name == f"after_replace_{target}" and due():
            fire(name)

    def remove(path, *a, **k):
        if name == "before_remove_journal" and str(path).endswith(("journal.jsonl", "staging.jsonl")) and due():
            fire(name)
        real_remove(path, *a, **k)

    os.replace, os.remove = replace, remove
    if name == "parquet_mid":  # while the Parquet file is written (between chunks)
        import pyarrow.parquet as pq

        class Writer(pq.ParquetWriter):
            def write_table(self, *a, **k):
                super().write_table(*a, **k)
                if due():
                    fire(name)

        pq.ParquetWriter = Writer


if _spec:
    try:
        _install(_spec)
    except Exception as e:  # noqa: BLE001
        print(f"chaos hook failed: {e!r}", file=sys.stderr)
