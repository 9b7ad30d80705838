"""Ray engine: the pipeline's chunks read, masked and packed on a Ray cluster via Ray Data.

Used by `Pipeline(engine="ray")` in place of the local process pool. Two Ray Data passes:
a scan of each input file (record count, positions, read errors) lets the driver cut the
same chunks as `iter_chunks`; then an actor pool reads and processes each chunk with
`process_chunk`, and the results come back in chunk order, so the output equals the
local engine's byte for byte.
"""

from __future__ import annotations

import codecs
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq

from tokenmill.chunks import Chunk, ChunkResult, process_chunk
from tokenmill.config import PipelineConfig
from tokenmill.masking import RecordMasker
from tokenmill.records import Record, RecordError, _open_bytes, read_records
from tokenmill.templates import load_tokenizer

INSTALL_HINT = "pip install 'tokenmill[ray]'"
_SKIP_BYTES = 1 << 20


# ---- scan and plan: the same chunks as iter_chunks, from per-file scans ------------------


@dataclass
class FileScan:
    """Where one file's records are: each one's line (or position) and, for JSONL, the byte
    offset of its line in the decompressed stream; each read error with the records before it."""

    path: str
    lines: np.ndarray
    offsets: np.ndarray
    errors: list[tuple[int, RecordError]]


@dataclass
class Segment:
    """Records number `first` .. `first + len(lines) - 1` (0-based, in read order) of one file."""

    path: str
    first: int
    lines: list[int]
    offset: int


@dataclass
class ChunkPlan:
    """What a worker needs to rebuild chunk `index` without the driver reading any record."""

    index: int
    segments: list[Segment] = field(default_factory=list)
    read_errors: list[RecordError] = field(default_factory=list)
    size: int = 0


def scan_file(path: str) -> FileScan:
    """Read one file once to count and place its records; bad lines are collected, never raised."""
    lines: list[int] = []
    errors: list[tuple[int, RecordError]] = []
    for record in read_records(Path(path), on_error=lambda err: errors.append((len(lines), err))):
        lines.append(record.line)
    line_of = np.asarray(lines, dtype=np.int64)
    offsets = np.zeros(0, dtype=np.int64)
    if _is_jsonl(path) and lines:
        offsets = _line_starts(path, lines[-1])[line_of - 1]
    return FileScan(path, line_of, offsets, errors)


def _line_starts(path: str, last_line: int) -> np.ndarray:
    """Byte offset of lines 1..last_line in the decompressed stream (split on b"\\n" as read_records)."""
    starts = np.empty(last_line, dtype=np.int64)
    position = 0
    with _open_bytes(Path(path)) as stream:
        for i, raw in enumerate(stream):
            starts[i] = position
            if i + 1 == last_line:
                break
            position += len(raw)
    return starts


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
                plan.segments.append(_segment(scan, done, take))
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


def _segment(scan: FileScan, first: int, count: int) -> Segment:
    offset = int(scan.offsets[first]) if len(scan.offsets) else -1
    return Segment(scan.path, first, scan.lines[first : first + count].tolist(), offset)


def read_chunk(plan: ChunkPlan) -> Chunk:
    """The chunk a plan describes, read from the input files (the records `iter_chunks` gives)."""
    records: list[Record] = []
    for segment in plan.segments:
        records.extend(_read_segment(segment))
    return Chunk(plan.index, records, list(plan.read_errors))


def _read_segment(segment: Segment) -> Iterator[Record]:
    path = Path(segment.path)
    if _is_jsonl(segment.path):
        yield from _read_jsonl_lines(path, segment)
    elif segment.path.lower().endswith(".parquet"):
        yield from _read_parquet_rows(path, segment)
    else:  # a .json document is parsed whole in any case
        records = read_records(path, on_error=lambda err: None)
        yield from itertools.islice(records, segment.first, segment.first + len(segment.lines))


def _read_jsonl_lines(path: Path, segment: Segment) -> Iterator[Record]:
    """Parse exactly the segment's record lines; the scan already proved each is a JSON object."""
    wanted = segment.lines
    with _open_bytes(path) as stream:
        _skip(stream, segment.offset, path)
        taken = 0
        for line, raw in enumerate(stream, start=wanted[0]):
            if line != wanted[taken]:
                continue
            if line == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            yield Record(str(path), line, orjson.loads(raw))
            taken += 1
            if taken == len(wanted):
                return
    raise RuntimeError(
        f"{path}: changed since it was scanned (record at line {wanted[taken]} is gone)"
    )


def _read_parquet_rows(path: Path, segment: Segment) -> Iterator[Record]:
    """Rows first..first+n, starting at the row group that holds row `first`."""
    with pq.ParquetFile(path) as parquet:
        group, row = 0, 0
        while (
            group < parquet.num_row_groups
            and row + parquet.metadata.row_group(group).num_rows <= segment.first
        ):
            row += parquet.metadata.row_group(group).num_rows
            group += 1
        groups = list(range(group, parquet.num_row_groups))
        taken = 0
        for batch in parquet.iter_batches(batch_size=1024, row_groups=groups):
            for data in batch.to_pylist():
                row += 1
                if row > segment.first:
                    yield Record(str(path), row, data)
                    taken += 1
                    if taken == len(segment.lines):
                        return


def _skip(stream: Any, offset: int, path: Path) -> None:
    if stream.seekable():
        stream.seek(offset)
        return
    while offset > 0:
        data = stream.read(min(offset, _SKIP_BYTES))
        if not data:
            raise RuntimeError(f"{path}: shorter than when it was scanned")
        offset -= len(data)


def _is_jsonl(path: str) -> bool:
    return path.lower().endswith((".jsonl", ".jsonl.gz", ".jsonl.zst"))


# ---- Ray ---------------------------------------------------------------------------------


def require_ray() -> ModuleType:
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"engine='ray' needs Ray Data, which is not installed: {INSTALL_HINT}"
        ) from err
    return ray


class ChunkWorker:
    """One actor of the pool: loads the tokenizer once, then reads, masks and packs chunks."""

    def __init__(self, config_data: dict, tokenizer_path: str):
        self.masker = RecordMasker(
            PipelineConfig.from_dict(config_data), load_tokenizer(tokenizer_path)
        )

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Plans in, ChunkResults out, as Python-object columns that Ray Data serialises itself."""
        results = np.empty(len(batch["plan"]), dtype=object)
        for j, plan in enumerate(batch["plan"]):
            results[j] = process_chunk(read_chunk(plan), self.masker)
        return {"index": batch["index"], "result": results}


def _scan_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"index": row["index"], "scan": scan_file(row["path"])}


def ray_results(
    files: list[Path],
    args: tuple[dict, str],
    workers: int | None,
    address: str | None,
    first_chunk: int = 0,
) -> Iterator[ChunkResult]:
    """ChunkResults of `files` from chunk `first_chunk` on, in chunk order, computed on Ray;
    `args` = (config data, tokenizer path), as `setup_worker` takes them.

    Uses the Ray connection this process already has, else connects to `address`, else starts
    a local Ray (shut down again at the end).
    """
    ray = require_ray()
    config = PipelineConfig.from_dict(args[0])
    started = not ray.is_initialized()
    if started and address:
        ray.init(address=address)
    elif started:
        ray.init(include_dashboard=False)
    try:
        scans = _scans(ray, files)
        pre = config.preprocessing
        plans = plan_chunks(scans, pre.batch_size, pre.max_items)
        items = [{"index": p.index, "plan": p} for p in plans if p.index >= first_chunk]
        if not items:
            return
        size, cpus = _pool_size(ray, workers)
        chunks = _ordered(ray.data.from_items(items, override_num_blocks=len(items)))
        results = chunks.map_batches(
            ChunkWorker,  # Ray Data restarts a dead actor and retries its task (max_restarts=-1)
            fn_constructor_args=args,
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=size),
            num_cpus=cpus,
        )
        for expected, row in enumerate(results.iter_rows(), start=first_chunk):
            if row["index"] != expected:
                raise RuntimeError(
                    f"Ray returned chunk {row['index']} where chunk {expected} was due"
                )
            yield row["result"]
    finally:
        if started:
            ray.shutdown()


def _scans(ray: ModuleType, files: list[Path]) -> Iterator[FileScan]:
    items = [{"index": i, "path": str(f)} for i, f in enumerate(files)]
    scanned = _ordered(ray.data.from_items(items, override_num_blocks=len(items))).map(_scan_row)
    for expected, row in enumerate(scanned.iter_rows()):
        if row["index"] != expected:
            raise RuntimeError(
                f"Ray returned the scan of file {row['index']} where {expected} was due"
            )
        yield row["scan"]


def _ordered(dataset: Any) -> Any:
    """A dataset whose results come back in input order, without Ray Data's own progress output."""
    context = dataset.context
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    return dataset


def _pool_size(ray: ModuleType, workers: int | None) -> tuple[int, float]:
    """(actors, CPUs per actor): `workers` actors (default: one per cluster CPU but one), sharing
    the cluster's CPUs so that one CPU's worth stays free for Ray Data's own tasks."""
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    size = workers if workers is not None else max(1, int(cpus) - 1)
    return size, min(1.0, round(cpus / (size + 1), 2))


__all__ = ["ray_results", "require_ray", "scan_file", "plan_chunks", "read_chunk"]
