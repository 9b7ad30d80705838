"""Engines: where a run's tasks are done (engines/tasks.py).

The pipeline talks to one interface: `session()` holds what the run needs (Ray: a
connection), and `run_tasks()` does the tasks it is given and yields each one's record
(run/task_output.py) in task order; each task writes its own shards. `hash_tasks()` is the
dedup pre-pass's (dedup.py): each task's records' keys, worked out where tasks run.
`LocalEngine` uses threads of this machine (two to a process) and writes the shards here;
`RayEngine` (ray/engine.py) runs each task on a Ray cluster, where the task writes its own
shards.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import chain, islice, repeat
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the chunk machinery (tokenizer, templates) loads when a run starts
    import numpy as np

    from tokenmill.preprocess.config import PipelineConfig
    from tokenmill.preprocess.engines.chunks import Chunk, ChunkResult
    from tokenmill.preprocess.engines.tasks import TaskPlan
    from tokenmill.preprocess.run.task_output import OutputSpec

ENGINES = ("local", "ray")


class Engine(Protocol):
    """`run_tasks` does `plans` (in task order) and yields each task's record in that order;
    under on_error="raise" the first bad record in input order raises, after every task
    started has stopped (nothing is written after the error reaches the pipeline).
    `duplicates`: task index -> sorted positions of the records it sets aside (dedup.py).
    `hash_tasks`: each plan's records' dedup keys (`dedup.task_hashes`), in plan order."""

    def session(self) -> contextlib.AbstractContextManager[Any]: ...

    def run_tasks(
        self,
        plans: Sequence[TaskPlan],
        config: PipelineConfig,
        tokenizer_path: str,
        spec: OutputSpec,
        staging: Path | None,
        duplicates: Mapping[int, np.ndarray] | None = None,
    ) -> Generator[dict[str, Any], None, None]: ...

    def hash_tasks(self, plans: Sequence[TaskPlan], config: PipelineConfig) -> list[np.ndarray]: ...


def make_engine(name: str, workers: int | None, ray_address: str | None = None) -> Engine:
    """The engine called `name`; the Ray one checks that Ray is installed before any output."""
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {name!r}")
    if name == "ray":
        from tokenmill.preprocess.ray.engine import RayEngine

        return RayEngine(workers, ray_address)
    return LocalEngine(workers)


def _pool_worker(parent: int, config_data: dict, tokenizer_path: str) -> None:
    """A pool worker: set up, and gone within a second of its parent's death (the kernel's
    OOM killer does not stop a pool's workers; each holds a tokenizer's memory)."""
    from tokenmill.preprocess.engines.chunks import setup_worker

    # a thread per core: a batched encode on threads of its own would crowd the other workers
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    setup_worker(config_data, tokenizer_path)


def _watch_parent(parent: int) -> None:
    """A hashing worker: gone within a second of its parent's death."""
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


class LocalEngine:
    """Chunks processed by `workers` threads (default: a thread per core), in chunk order,
    THREADS to a process: while one thread encodes (the tokenizer lets go of the GIL), another
    renders and masks. Up to THREADS workers run in this process, with nothing to start or
    pickle; more run in spawned processes of THREADS threads each (workers rounded up)."""

    def __init__(self, workers: int | None):
        self.workers = workers

    def session(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def run_tasks(
        self,
        plans: Sequence[TaskPlan],
        config: PipelineConfig,
        tokenizer_path: str,
        spec: OutputSpec,
        staging: Path | None,
        duplicates: Mapping[int, np.ndarray] | None = None,
    ) -> Generator[dict[str, Any], None, None]:
        """The tasks' chunks in one stream, so the threads stay busy across tasks' ends; this
        thread writes each task's shards as its results come, in order."""
        from tokenmill.preprocess.engines.tasks import task_chunks
        from tokenmill.preprocess.run.task_output import TaskWriter

        pre = config.preprocessing
        budget = None if pre.max_items is None else [pre.max_items]
        unit = config.input.text_unit
        dups = duplicates or {}
        chunks = chain.from_iterable(
            task_chunks(plan, pre.batch_size, unit, budget, dups.get(plan.index)) for plan in plans
        )
        by_index = {plan.index: plan for plan in plans}
        writer: TaskWriter | None = None
        with contextlib.closing(self._results(chunks, config, tokenizer_path)) as results:
            try:
                for result in results:
                    if writer is None:
                        writer = TaskWriter(spec, by_index[result.task], staging)
                    writer.add(result)
                    if result.last:
                        done, writer = writer, None
                        yield done.finish()
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise

    def hash_tasks(self, plans: Sequence[TaskPlan], config: PipelineConfig) -> list[np.ndarray]:
        """Up to THREADS workers: hashed here, a task after another (a process to start would
        cost more); more: in up to `workers` spawned processes, a task each at a time (hashing
        holds the GIL: threads would not help)."""
        from tokenmill.preprocess.dedup import task_hashes
        from tokenmill.preprocess.engines.chunks import THREADS

        data = config.model_dump(mode="json")
        workers = min(self.workers or os.cpu_count() or 1, len(plans))
        if workers <= THREADS:
            return [task_hashes(plan, data) for plan in plans]
        ctx = get_context("spawn")
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_watch_parent, initargs=(os.getpid(),)
        ) as pool:
            return list(pool.map(task_hashes, plans, repeat(data)))

    def _results(
        self, chunks: Iterator[Chunk], config: PipelineConfig, tokenizer_path: str
    ) -> Generator[ChunkResult, None, None]:
        """The chunks' results in order, worked on `workers` threads."""
        from tokenmill.preprocess.engines.chunks import THREADS, process_chunks, process_here

        args = (config.model_dump(mode="json"), tokenizer_path)
        workers = self.workers or os.cpu_count() or 1
        first = list(islice(chunks, THREADS + 1))
        if workers <= THREADS or len(first) <= THREADS:  # a process to start would cost more
            threads = max(1, min(workers, THREADS, len(first)))
            yield from process_here(chain(first, chunks), threads, args)
            return
        processes = -(-workers // THREADS)
        ctx = get_context("spawn")  # safe beside a parent running torch or tokenizer threads
        setup = (os.getpid(), *args)
        pool = ProcessPoolExecutor(
            processes, mp_context=ctx, initializer=_pool_worker, initargs=setup
        )
        try:
            pending: deque[Future[list[ChunkResult]]] = deque()
            for group in _groups(chain(first, chunks), THREADS):
                pending.append(pool.submit(process_chunks, group))
                if len(pending) >= 2 * processes:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # an error or a closed run: no more


def _groups(chunks: Iterator[Chunk], size: int) -> Iterator[list[Chunk]]:
    """Consecutive chunks, `size` at a time: a worker process's work item."""
    while group := list(islice(chunks, size)):
        yield group
