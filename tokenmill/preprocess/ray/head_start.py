"""The Ray engine's head start: the driver works a share of the first task's chunks on its own
thread, from the run's start (while the scan runs and Ray Data starts the task) to its end, and
that task runs the threads the driver leaves (THREADS - DRIVER_THREADS). Each chunk is claimed
before it is read, in Ray's key-value store, by either side, one at a time as a thread comes
free, so every chunk is done once, by one side, and a thread that comes free on either side
takes the next chunk, as a local engine's threads do. (A driver that stopped at the task's start left the task's threads one
chunk more at the end, with a core idle: 0.3 s of a 4-5 s run at 3,000 chat records.)"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.engines.chunks import Chunk, ChunkResult, iter_chunks, process_here
from tokenmill.preprocess.engines.plans import ChunkPlan, FileRangeReader, read_chunk
from tokenmill.preprocess.inputs.files import InputPath

# Threads on which the driver works the first task's chunks: one, so that the scan, the task's
# start (Ray Data's scheduling, the worker's tokenizer) and the shard writes keep a core; 0:
# none, the tasks take every chunk.
DRIVER_THREADS = 1
# Chunks past the next one due at the writes that the driver may claim: a task held up (its
# worker slow or replaced) leaves the driver waiting, not holding done chunks without bound.
AHEAD = 4
CLAIMS = "tokenmill"  # the namespace of the claims in Ray's key-value store


def claims_kv() -> ModuleType:
    """Ray's internal key-value store (in the GCS, reached from the driver and every worker):
    its put-if-absent is the claim. Internal to the pinned Ray, as Ray's own libraries use it."""
    from ray.experimental import internal_kv

    return internal_kv


def claim(claims: str, index: int, owner: str) -> bool:
    """Whether chunk `index` is `owner`'s ("driver" or "pool"): taken now, or earlier by the
    same owner (a task that Ray Data runs again after its worker died claims its chunks again)."""
    kv = claims_kv()
    key = f"{claims}{index}"
    if not kv._internal_kv_put(key, owner, overwrite=False, namespace=CLAIMS):
        return True  # the key was not there: taken now
    return kv._internal_kv_get(key, namespace=CLAIMS) == owner.encode()


class Frontier:
    """The next chunk due at the writes, which the driver's reader moves on; the head start
    waits on it before it claims a chunk more than AHEAD past it."""

    def __init__(self, index: int):
        self.index = index
        self.closed = False
        self._moved = threading.Condition()

    def advance(self) -> None:
        with self._moved:
            self.index += 1
            self._moved.notify_all()

    def close(self) -> None:
        with self._moved:
            self.closed = True
            self._moved.notify_all()

    def wait(self, index: int) -> bool:
        """Wait until chunk `index` is at most AHEAD past the next one due; False if the run
        was closed first."""
        with self._moved:
            self._moved.wait_for(lambda: self.closed or index <= self.index + AHEAD)
            return not self.closed


def head_start(
    head: tuple[Sequence[InputPath], PipelineConfig] | None,
    planned: Callable[[], list[list[ChunkPlan]]],
    args: tuple[dict, str],
    claims: str,
    frontier: Frontier,
) -> Iterator[ChunkResult]:
    """The driver's share of the first task's chunks (the first of `planned()`, the units the
    scan gives), processed here on DRIVER_THREADS threads, by the code a task runs, in chunk
    order; each claimed as a thread comes free, not ahead, so that the task may take the next
    one. With `head` (the files and config of a run from its first chunk), chunk 0 is read as
    the local engine reads it, before the scan is done: no core waits for the scan (0.05-0.4 s
    from 3,000 to 24,000 chat records)."""
    if not claims:
        return
    reader = FileRangeReader(args[0]["input"].get("text_unit", "file"))
    try:
        chunks = _chunks(head, planned, claims, reader, frontier)
        yield from process_here(chunks, DRIVER_THREADS, args, in_flight=DRIVER_THREADS)
    finally:
        reader.close()


def _chunks(
    head: tuple[Sequence[InputPath], PipelineConfig] | None,
    planned: Callable[[], list[list[ChunkPlan]]],
    claims: str,
    reader: FileRangeReader,
    frontier: Frontier,
) -> Iterator[Chunk]:
    """The head start's chunks, each claimed before it is read (a chunk the task claimed first is
    left to it); chunk 0 read ahead of the scan must be the one the scan's first plan describes."""
    first = None
    if head is not None:
        stream = iter_chunks(*head, collect_errors=True)
        first = next(stream, None)
        stream.close()
        if first is not None and claim(claims, first.index, "driver"):
            yield first
        else:
            first = None
    units = planned()
    unit = units[0] if units else []
    if first is not None:
        if not unit or not _describes(unit[0], first):
            where = ", ".join(dict.fromkeys(record.source for record in first.records))
            raise RuntimeError(
                f"{where or 'an input file'}: changed while it was scanned (chunk 0, read before"
                " the scan, is not the records the scan found)"
            )
        unit = unit[1:]
    for plan in unit:
        if not frontier.wait(plan.index):
            return
        if claim(claims, plan.index, "driver"):
            yield read_chunk(plan, reader)


def _describes(plan: ChunkPlan, chunk: Chunk) -> bool:
    lines = [line for file_range in plan.ranges for line in file_range.lines.tolist()]
    same_lines = lines == [record.line for record in chunk.records]
    return (
        plan.index == chunk.index and same_lines and len(plan.read_errors) == len(chunk.read_errors)
    )
