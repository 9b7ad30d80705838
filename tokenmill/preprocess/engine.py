"""Engines: where a run's chunks are processed and its shards written.

The pipeline talks to one interface: `session()` holds what the run needs (Ray: a
connection), `results()` yields each chunk's `ChunkResult` in chunk order, and `writer()`
gives a domain's shard writer (for output to a bucket, `bucket` is the run's BucketOutput:
the Ray engine's write tasks upload their shards themselves; the local engine's shards are
uploaded by the BucketOutput as they are published). `LocalEngine` uses a process pool on this machine;
`RayEngine` (ray_engine.py) a Ray cluster, with the same chunks, cut and bytes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import chain, islice
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.shards.writer import ShardWriter

if TYPE_CHECKING:  # the chunk machinery (tokenizer, templates) loads when a run starts
    from tokenmill.preprocess.chunks import ChunkResult
    from tokenmill.preprocess.config import PipelineConfig
    from tokenmill.preprocess.inputs import InputPath

ENGINES = ("local", "ray")


class Engine(Protocol):
    """`collect_errors`: read errors travel in each chunk instead of raising at the read; the
    Ray engine always collects them, and the pipeline decides what an error stops."""

    def session(self) -> contextlib.AbstractContextManager[Any]: ...

    def results(
        self, files: Sequence[InputPath], config: PipelineConfig, tokenizer_path: str,
        collect_errors: bool, first_chunk: int,
    ) -> Generator[ChunkResult, None, None]: ...  # fmt: skip

    def writer(
        self, domain_dir: Path, dtypes: dict[str, str], primary_key: str,
        max_tokens_per_shard: int, storage_format: str, first_index: int, bucket: Any = None,
    ) -> Any: ...  # fmt: skip


def make_engine(name: str, workers: int | None, ray_address: str | None = None) -> Engine:
    """The engine called `name`; the Ray one checks that Ray is installed before any output."""
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {name!r}")
    if name == "ray":
        from tokenmill.preprocess.ray_engine import RayEngine

        return RayEngine(workers, ray_address)
    return LocalEngine(workers)


def _pool_worker(parent: int, config_data: dict, tokenizer_path: str) -> None:
    """A pool worker: set up, and gone within a second of its parent's death (the kernel's
    OOM killer does not stop a pool's workers; each holds a tokenizer's memory)."""
    from tokenmill.preprocess.chunks import setup_worker

    # a worker per core: a batched encode on threads of its own would crowd the other workers
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    setup_worker(config_data, tokenizer_path)


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


class LocalEngine:
    """Chunks processed by `workers` spawned processes (default: every core), in chunk order."""

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
        from tokenmill.preprocess.chunks import iter_chunks, process_chunk, setup_worker

        chunks = (c for c in iter_chunks(files, config, collect_errors) if c.index >= first_chunk)
        args = (config.model_dump(mode="json"), tokenizer_path)
        workers = self.workers or os.cpu_count() or 1
        first = list(islice(chunks, 2))
        if workers == 1 or len(first) < 2:  # one chunk: starting worker processes costs more
            setup_worker(*args)
            for chunk in chain(first, chunks):
                yield process_chunk(chunk)
            return
        ctx = get_context("spawn")  # safe beside a parent running torch or tokenizer threads
        setup = (os.getpid(), *args)
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_pool_worker, initargs=setup
        ) as pool:
            pending: deque[Future[ChunkResult]] = deque()
            for chunk in chain(first, chunks):
                pending.append(pool.submit(process_chunk, chunk))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def writer(
        self,
        domain_dir: Path,
        dtypes: dict[str, str],
        primary_key: str,
        max_tokens_per_shard: int,
        storage_format: str,
        first_index: int,
        bucket: Any = None,
    ) -> ShardWriter:
        return ShardWriter(
            domain_dir, dtypes, primary_key, max_tokens_per_shard, storage_format, first_index
        )
