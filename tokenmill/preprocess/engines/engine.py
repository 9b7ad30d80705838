"""Engines: where a run's chunks are processed and its shards written.

The pipeline talks to one interface: `session()` holds what the run needs (Ray: a
connection), `results()` yields each chunk's `ChunkResult` in chunk order, and `writer()`
gives a domain's shard writer for its `ShardSpec` (for output to a bucket, `bucket` is the
run's BucketOutput:
the Ray engine's write tasks upload their shards themselves; the local engine's shards are
uploaded by the BucketOutput as they are published). `LocalEngine` uses threads of this
machine (two to a process); `RayEngine` (ray/engine.py) a Ray cluster, with the same chunks,
cut and bytes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import chain, islice
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.shards.writer import ShardSpec, ShardWriter

if TYPE_CHECKING:  # the chunk machinery (tokenizer, templates) loads when a run starts
    from tokenmill.preprocess.config import PipelineConfig
    from tokenmill.preprocess.engines.chunks import Chunk, ChunkResult
    from tokenmill.preprocess.inputs.files import InputPath

ENGINES = ("local", "ray")


class Engine(Protocol):
    """`collect_errors`: read errors travel in each chunk instead of raising at the read; the
    Ray engine always collects them, and the pipeline decides what an error stops."""

    def session(self) -> contextlib.AbstractContextManager[Any]: ...

    def results(
        self,
        files: Sequence[InputPath],
        config: PipelineConfig,
        tokenizer_path: str,
        collect_errors: bool,
        first_chunk: int,
    ) -> Generator[ChunkResult, None, None]: ...

    def writer(self, spec: ShardSpec, bucket: Any = None) -> Any:
        """The shard writer of one domain's shards."""
        ...


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

    def results(
        self,
        files: Sequence[InputPath],
        config: PipelineConfig,
        tokenizer_path: str,
        collect_errors: bool,
        first_chunk: int,
    ) -> Generator[ChunkResult, None, None]:
        from tokenmill.preprocess.engines.chunks import (
            THREADS,
            iter_chunks,
            process_chunks,
            process_here,
        )

        chunks = (c for c in iter_chunks(files, config, collect_errors) if c.index >= first_chunk)
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

    def writer(self, spec: ShardSpec, bucket: Any = None) -> ShardWriter:
        """A ShardWriter here; a bucket's uploads are the BucketOutput's."""
        return ShardWriter(spec)


def _groups(chunks: Iterator[Chunk], size: int) -> Iterator[list[Chunk]]:
    """Consecutive chunks, `size` at a time: a worker process's work item."""
    while group := list(islice(chunks, size)):
        yield group
