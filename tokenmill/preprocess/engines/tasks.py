"""Tasks: the unit of work and of output, planned from the input files' sizes alone.

A task is a run of consecutive pieces of the input, about `task_bytes` of it: a piece is a
whole file, or (a plain `.jsonl` file larger than `task_bytes`) one of its byte ranges.
Each task reads its pieces in order, cuts their records into chunks of `batch_size`, and
writes its own shards (`shard_TTTTT_III`), so shard boundaries are a fixed rule of the input
and the output is the same on every engine, worker count and cluster. Planning reads no
record: the driver knows its tasks as soon as the inputs are listed, in O(files) memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tokenmill.preprocess.engines.chunks import Chunk
from tokenmill.preprocess.inputs.files import InputPath, input_suffix
from tokenmill.preprocess.inputs.hf import DatasetInput
from tokenmill.preprocess.inputs.records import (
    OnError,
    Record,
    RecordError,
    TextUnit,
    read_jsonl_range,
    read_records,
)


@dataclass(frozen=True)
class Piece:
    """Input file number `file` (its place in the run's input list, which orders rejects), whole
    (`end` None) or the records whose lines start in bytes [start, end)."""

    path: InputPath
    file: int
    start: int = 0
    end: int | None = None


@dataclass
class TaskPlan:
    index: int
    pieces: list[Piece] = field(default_factory=list)
    size: int = 0  # input bytes


def splittable(path: InputPath) -> bool:
    """A plain JSONL file: a reader can start at any byte and find the next line."""
    return not isinstance(path, DatasetInput) and input_suffix(path) == ".jsonl"


def plan_tasks(files: Sequence[InputPath], sizes: Sequence[int], task_bytes: int) -> list[TaskPlan]:
    """Pieces in input order, joined into tasks of at most `task_bytes` (a piece larger than
    that, an unsplittable file, is a task of its own); a splittable file is cut at multiples
    of `task_bytes`. Every run has at least one task, so an empty input still ends in one."""
    pieces: list[tuple[Piece, int]] = []
    for number, (path, size) in enumerate(zip(files, sizes, strict=True)):
        size = max(size, 0)
        if splittable(path) and size > task_bytes:
            for start in range(0, size, task_bytes):
                end = min(start + task_bytes, size)
                pieces.append((Piece(path, number, start, end), end - start))
        else:
            pieces.append((Piece(path, number), size))
    tasks = [TaskPlan(0)]
    for piece, size in pieces:
        task = tasks[-1]
        if task.pieces and task.size + size > task_bytes:
            task = TaskPlan(len(tasks))
            tasks.append(task)
        task.pieces.append(piece)
        task.size += size
    return tasks


def read_piece(piece: Piece, on_error: OnError, text_unit: TextUnit) -> Iterator[Record]:
    if piece.end is None:
        return read_records(piece.path, on_error, text_unit)
    return read_jsonl_range(piece.path, piece.start, piece.end, on_error)


def task_chunks(
    plan: TaskPlan,
    batch_size: int,
    text_unit: TextUnit,
    budget: list[int] | None = None,
    duplicates: Iterable[int] | None = None,
) -> Iterator[Chunk]:
    """The task's records in order, cut into chunks of `batch_size`; a read error travels in
    the chunk that was filling when it was met (whoever writes the chunk's rows decides what
    it stops: run/task_output.py), so the first bad record stops a run in input order. The last chunk is marked (an empty one if
    the task has no record). `budget`: records the run may still read (max_items), shared
    by the tasks of a run on one machine; a task past it reads nothing. `duplicates`: the
    sorted positions of the records (counted as read here) that the dedup pre-pass found
    (dedup.py): each goes to its chunk's `duplicates`, and counts for the budget but not for
    `batch_size`, so the chunks are those of the input without them."""
    chunk = Chunk(plan.index, 0)
    dups = iter(duplicates if duplicates is not None else ())
    next_dup, position = next(dups, -1), 0
    for piece in plan.pieces:
        if budget is not None and budget[0] <= 0:
            break
        errors: list[RecordError] = []
        on_error: OnError = errors.append
        for record in read_piece(piece, on_error, text_unit):
            if errors:
                chunk.read_errors.extend(errors)
                errors.clear()
            if position == next_dup:
                chunk.duplicates.append(record)
                next_dup = next(dups, -1)
            else:
                chunk.records.append(record)
            position += 1
            if budget is not None:
                budget[0] -= 1
            if len(chunk.records) == batch_size:
                yield chunk
                chunk = Chunk(plan.index, chunk.index + 1)
            if budget is not None and budget[0] <= 0:
                break
        chunk.read_errors.extend(errors)
    chunk.last = True
    yield chunk
