"""Runs the model on ``tensor_parallel_size`` ranks: rank 0 in this process, the rest in workers.

With one rank there are no processes and collective_rpc is a local call. With N ranks:
start the workers and join the process group, load rank 0's shard (the workers load theirs at
the same time), size the KV cache on every rank and keep the minimum (every rank must hold
the same blocks), allocate it everywhere (capturing each rank's decode CUDA graphs on a GPU), and route rank 0's
model calls and graph replays through MirroredModel and MirroredGraphs so the workers follow
each step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from tokenmill.param_checks import is_number
from tokenmill.worker.worker import Worker, worker_class

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.distributed.worker_processes import WorkerProcesses
    from tokenmill.engine.step import SchedulerOutput, StepResult
    from tokenmill.models.source import ModelSource
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, config: "EngineConfig", source: "ModelSource", load_format: str):
        self.world_size = config.tensor_parallel_size
        self.workers: "WorkerProcesses | None" = None
        if self.world_size == 1:
            self.driver = worker_class(config.worker_extension_cls)(config, source, load_format)
        else:
            self.driver = self._start_tensor_parallel(config, source, load_format)
        try:
            self.num_blocks: int = min(self.collective_rpc("determine_num_blocks"))
            self.collective_rpc("initialize_cache", args=(self.num_blocks,))
            self.mirror_decode_graphs()
        except BaseException:
            self.shutdown()
            raise

    def _start_tensor_parallel(self, config: "EngineConfig", source: "ModelSource", load_format: str) -> Worker:
        # Imported here: one-rank engines never load torch.distributed.
        from tokenmill.distributed.mirror import MirroredModel
        from tokenmill.distributed.process_group import check_devices, rank_device
        from tokenmill.distributed.worker_processes import WorkerProcesses

        check_devices(config.device, self.world_size)
        device = rank_device(config.device, 0)
        threads = max(1, torch.get_num_threads() // self.world_size)
        if device.type == "cpu" and threads != torch.get_num_threads():
            # Ranks on one CPU share its cores; with more threads than cores each collective waits
            # on a rank whose threads were descheduled (10x slower steps here).
            logger.info("tensor parallel on the CPU: %d torch threads per rank (torch.set_num_threads)", threads)
            torch.set_num_threads(threads)
        self.workers = WorkerProcesses(config, source, load_format, device, threads)
        try:
            driver = worker_class(config.worker_extension_cls)(config, source, load_format, 0, device, self.workers.group)
            self.workers.wait_until_ready()
        except BaseException:
            self.workers.stop(graceful=False)
            raise
        # The engine steps rank 0's runner; its model calls now bring the workers along.
        driver.runner.model = MirroredModel(driver.model, self.workers)
        logger.info("tensor parallel: %d ranks, workers %s", self.world_size, [p.pid for p in self.workers.procs])
        return driver

    def mirror_decode_graphs(self) -> None:
        """With several ranks, route rank 0's decode-graph replays through MirroredGraphs, so every
        rank replays the same graph (each rank captured its own, all at once, in initialize_cache).
        Called after the graphs are captured; a no-op with one rank or without graphs."""
        from tokenmill.distributed.mirror import MirroredGraphs

        runner = self.driver.runner
        if self.workers is not None and runner.graphs is not None and not isinstance(runner.graphs, MirroredGraphs):
            runner.graphs = MirroredGraphs(runner.graphs, self.workers)

    # ---- the engine's calls, served by rank 0 ------------------------------------------------
    def execute_model(self, plan: "SchedulerOutput") -> "StepResult":
        """Launch one step (see `ModelRunner.execute`); the other ranks follow rank 0's model calls."""
        return self.driver.execute_model(plan)

    def use_grammars(self, grammars: Any) -> None:
        """Structured outputs: the grammars whose bitmasks mask the logits (sampling runs on rank 0)."""
        self.driver.use_grammars(grammars)

    @property
    def runner(self) -> "ModelRunner":
        """Rank 0's runner, for inspection (tests and benchmarks read its KV cache and graphs)."""
        return self.driver.runner

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on every rank's Worker; one result per rank, in rank order.

        ``method`` names a Worker method, or is a function called as method(worker, *args,
        **kwargs). Every rank runs it at the same time, so it may use the process group (each
        rank's own calls, not mirrored). ``timeout`` bounds the wait for the other ranks after
        rank 0's part has returned (TimeoutError).
        """
        if not isinstance(args, (tuple, list)):
            raise ValueError(f"collective_rpc: args={args!r:.100} is invalid: must be a tuple of positional arguments")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"collective_rpc: kwargs={kwargs!r:.100} is invalid: must be a dict of keyword arguments or None")
        if timeout is not None and not (is_number(timeout) and timeout > 0):
            # Checked here, not where the wait uses it: a one-rank engine never waits, and would ignore it.
            raise ValueError(f"collective_rpc: timeout={timeout!r:.100} is invalid: must be None or a number of seconds > 0")
        args, kwargs = tuple(args), dict(kwargs or {})
        if isinstance(method, str):
            if not callable(getattr(self.driver, method, None)) or method.startswith("_"):
                raise ValueError(f"collective_rpc: method={method!r} is not a Worker method")
        elif not callable(method):
            raise TypeError(f"collective_rpc: method must be a Worker method name or a callable, got {type(method).__name__}")
        if self.workers is None:
            return [self.driver.execute_method(method, args, kwargs)]
        from tokenmill.distributed.mirror import mirroring_paused

        call_id = self.workers.send_rpc(method, args, kwargs)
        name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        try:
            with mirroring_paused(self.driver.runner.model, self.driver.runner.graphs):
                mine = self.driver.execute_method(method, args, kwargs)
        except Exception:
            self.workers.check_alive()  # a worker's death explains a failed collective best
            raise
        return [mine, *self.workers.collect_rpc(call_id, timeout, f"collective_rpc({name})")]

    def shutdown(self) -> None:
        """Stop the worker processes (idempotent; also runs when the executor is collected)."""
        if self.workers is not None:
            self.workers.stop()
