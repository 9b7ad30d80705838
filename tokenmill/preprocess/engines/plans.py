"""Plans: where each chunk's records lie in the input files, so a worker elsewhere reads exactly them.

The Ray engine's first half, with no Ray in it: `scan_file` places one file's records,
`plan_chunks` cuts the chunks `iter_chunks` would cut, `work_units` groups them so that an
unseekable file is read in one pass, `joined` groups units into tasks (`task_chunks`), and
`read_chunk` reads a plan back into its Chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.preprocess.engines.chunks import THREADS, Chunk
from tokenmill.preprocess.inputs.files import input_suffix, open_bytes, open_parquet
from tokenmill.preprocess.inputs.records import (
    PARQUET_BATCH_ROWS,
    Record,
    RecordError,
    TextUnit,
    parse_line,
    read_records,
)

_SKIP_BYTES = 1 << 20


@dataclass
class FileScan:
    """Where one file's records are: each one's line (or position) and, for JSONL, the byte
    offset of its line in the decompressed stream; each read error with the records before it."""

    path: str
    lines: np.ndarray
    offsets: np.ndarray
    errors: list[tuple[int, RecordError]]


@dataclass
class FileRange:
    """Records number `first` .. `first + len(lines) - 1` (0-based, in read order) of one file."""

    path: str
    first: int
    lines: np.ndarray  # int64, 8 bytes a record: the driver holds every plan
    offset: int


@dataclass
class ChunkPlan:
    """What a worker needs to rebuild chunk `index` without the driver reading any record."""

    index: int
    ranges: list[FileRange] = field(default_factory=list)
    read_errors: list[RecordError] = field(default_factory=list)
    size: int = 0


def scan_file(path: str, text_unit: TextUnit = "file") -> FileScan:
    """Read one file once to count and place its records (JSONL: also their byte offsets, in the
    same pass); bad lines are collected, never raised."""
    lines: list[int] = []
    starts: list[int] = []
    errors: list[tuple[int, RecordError]] = []

    def on_error(err: RecordError) -> None:
        errors.append((len(lines), err))  # with the count of records before it

    for record in read_records(path, on_error, starts if _is_jsonl(path) else None, text_unit):
        lines.append(record.line)
    line_of = np.asarray(lines, dtype=np.int64)
    return FileScan(path, line_of, np.asarray(starts, dtype=np.int64), errors)


def plan_chunks(
    scans: Iterable[FileScan], batch_size: int, max_items: int | None
) -> Iterator[ChunkPlan]:
    """Cut the scanned records into the chunks `iter_chunks` cuts: `batch_size` records each, in
    file then line order, a read error in the chunk that was filling when it was met."""
    plan = ChunkPlan(0)
    seen = 0
    for scan in scans:
        count = len(scan.lines) if max_items is None else min(len(scan.lines), max_items - seen)
        stops = max_items is not None and seen + count >= max_items
        # iter_chunks stops reading right after the last record it takes: later errors are never met
        errors = [(before, err) for before, err in scan.errors if before < count or not stops]
        done = e = 0
        while True:
            take = min(count - done, batch_size - plan.size)
            if take:
                plan.ranges.append(_file_range(scan, done, take))
                plan.size += take
                done += take
            while e < len(errors) and (
                errors[e][0] < done or (errors[e][0] == done and plan.size < batch_size)
            ):
                plan.read_errors.append(errors[e][1])
                e += 1
            if plan.size == batch_size:
                yield plan
                plan = ChunkPlan(plan.index + 1)
            elif done == count:
                break
        seen += count
        if stops:
            break
    if plan.size or plan.read_errors:
        yield plan


def _file_range(scan: FileScan, first: int, count: int) -> FileRange:
    offset = int(scan.offsets[first]) if len(scan.offsets) else -1
    return FileRange(scan.path, first, scan.lines[first : first + count].copy(), offset)


def read_chunk(plan: ChunkPlan, reader: FileRangeReader | None = None) -> Chunk:
    """The chunk a plan describes, read from the input files (the records `iter_chunks` gives);
    a file that no longer holds the records its scan found raises: none is silently lost."""
    reader = reader or FileRangeReader()
    records: list[Record] = []
    for file_range in plan.ranges:
        got = list(reader.read(file_range))
        if [r.line for r in got] != file_range.lines.tolist():
            raise RuntimeError(
                f"{file_range.path}: changed since it was scanned (records {file_range.first + 1}.."
                f"{file_range.first + len(file_range.lines)} are not the ones found then)"
            )
        records.extend(got)
    return Chunk(plan.index, records, list(plan.read_errors))


def work_units(plans: Iterable[ChunkPlan]) -> Iterator[list[ChunkPlan]]:
    """Consecutive plans grouped so that an unseekable file (.gz, .zst, .json) is read in one pass:
    decompressing from the start for every chunk would cost quadratic time. A unit follows one
    such file, the one its first plan ends in; the next file starts a new unit (which reads past
    the part of it that the last plan took: one prefix per file, not one per chunk)."""
    unit: list[ChunkPlan] = []
    follows: str | None = None
    for plan in plans:
        first = plan.ranges[0].path if plan.ranges else None
        if unit and not (first is not None and first == follows):
            yield unit
            unit = []
        if not unit:
            last = plan.ranges[-1].path if plan.ranges else None
            follows = last if last is not None and not _seekable(last) else None
        unit.append(plan)
    if unit:
        yield unit


TASK_CHUNKS = 4 * THREADS  # the fewest chunks of a task (but the last): each is a round trip
MAX_TASK_CHUNKS = 64  # the most, unless a unit has more (a file that is read from its start)


def task_chunks(chunks: int, slots: int) -> int:
    """Chunks per task: the input shared evenly by the tasks that run at once (`slots`), so
    that a small input is one task per slot. Each task's end costs a drain (its last chunk
    runs on one thread while the other waits for the next task: 0.4 s on one core, seen at
    3,000 records in tasks of 8) and a start. At most MAX_TASK_CHUNKS: a task that Ray runs
    again after its worker died does all its chunks again, and a later task's output waits
    in the object store until the earlier tasks' have been handed on, in chunk order."""
    tasks = slots * -(-chunks // (slots * MAX_TASK_CHUNKS))
    return max(TASK_CHUNKS, -(-chunks // tasks))


def joined(units: list[list[ChunkPlan]], per_task: int) -> Iterator[list[ChunkPlan]]:
    """Consecutive units joined until each has `per_task` plans (a seekable file makes a unit
    per chunk), so that tasks are few (`task_chunks`); plans stay in order, read by one
    reader, as a unit's are."""
    task: list[ChunkPlan] = []
    for unit in units:
        task += unit
        if len(task) >= per_task:
            yield task
            task = []
    if task:
        yield task


class FileRangeReader:
    """Reads ranges in file order; an unseekable stream stays open from one file_range to the next."""

    def __init__(self, text_unit: TextUnit = "file") -> None:
        self.text_unit = text_unit  # what a record of a .txt file is
        self.path: str | None = None
        self.stream: Any = None
        self.position = 0  # bytes of the decompressed stream consumed so far
        self.closer: contextlib.ExitStack | None = None
        self.document: list[Record] = []  # the records of the open .json document

    def read(self, file_range: FileRange) -> Iterator[Record]:
        if _is_jsonl(file_range.path):
            return self._jsonl(file_range)
        if input_suffix(file_range.path) == ".parquet":
            return _read_parquet_rows(file_range)
        if self.path != file_range.path:  # a .json document is parsed whole, once per unit
            self.close()
            self.path = file_range.path
            self.document = list(
                read_records(file_range.path, lambda err: None, text_unit=self.text_unit)
            )
        return iter(self.document[file_range.first : file_range.first + len(file_range.lines)])

    def _jsonl(self, file_range: FileRange) -> Iterator[Record]:
        path = file_range.path
        if self.path != file_range.path or self.stream is None or self.position > file_range.offset:
            self.close()
            self.closer = contextlib.ExitStack()
            self.stream = self.closer.enter_context(open_bytes(path))
            self.path = file_range.path
            self.position = 0
        _skip(self.stream, file_range.offset - self.position, file_range.offset, path)
        self.position = file_range.offset
        wanted = file_range.lines
        taken = 0
        for line, raw in enumerate(self.stream, start=int(wanted[0])):
            self.position += len(raw)
            if line != wanted[taken]:
                continue
            yield Record(path, line, parse_line(raw, path, line))
            taken += 1
            if taken == len(wanted):
                return
        raise RuntimeError(
            f"{path}: changed since it was scanned (record at line {wanted[taken]} is gone)"
        )

    def close(self) -> None:
        if self.closer is not None:
            self.closer.close()
        self.path, self.stream, self.closer, self.document = None, None, None, []


def _read_parquet_rows(file_range: FileRange) -> Iterator[Record]:
    """Rows first..first+n, starting at the row group that holds row `first`."""
    path = file_range.path
    with open_parquet(path) as parquet:
        group, row = 0, 0
        while (
            group < parquet.num_row_groups
            and row + parquet.metadata.row_group(group).num_rows <= file_range.first
        ):
            row += parquet.metadata.row_group(group).num_rows
            group += 1
        groups = list(range(group, parquet.num_row_groups))
        taken = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=groups):
            for data in batch.to_pylist():
                row += 1
                if row > file_range.first:
                    yield Record(path, row, data)
                    taken += 1
                    if taken == len(file_range.lines):
                        return


def _skip(stream: Any, count: int, offset: int, path: str) -> None:
    """Moves `count` bytes on, to `offset`: a seek where the stream can, else reading."""
    if stream.seekable():
        stream.seek(offset)
        return
    while count > 0:
        data = stream.read(min(count, _SKIP_BYTES))
        if not data:
            raise RuntimeError(f"{path}: shorter than when it was scanned")
        count -= len(data)


def _seekable(path: str) -> bool:
    return input_suffix(path) in (".jsonl", ".parquet")


def _is_jsonl(path: str) -> bool:
    return input_suffix(path).startswith(".jsonl")
