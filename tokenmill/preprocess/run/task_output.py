"""A task's output: its shards, and the record that says the task is done.

Whoever runs a task (the local engine's writing thread, or a Ray task on any node) writes
its shards into the output itself (`shard_TTTTT_III` in each domain folder; to a bucket:
staged in a temp folder, then uploaded, meta.json last), then its record,
`.tokenmill-run/tasks/TTTTT.json`: its counts, its bad records, its shards' manifest
entries and what the dataset's index needs of them (`shards/index.py`: read here, where the
shards are, so the driver never reads a shard). The record is the task's commit point: a task without one is done again from the
start, its own shard names rewritten (a retried task writes the same bytes); the driver only
orders the records into the manifest, the summary and `rejects.jsonl`. A dry run's tasks
(`OutputSpec.dry_run`) write nothing: their record, returned, counts the rows' and the
documents' lengths instead.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from tokenmill.preprocess.document.filters import FILTER_REASONS
from tokenmill.preprocess.engines.chunks import ChunkResult
from tokenmill.preprocess.engines.tasks import TaskPlan
from tokenmill.preprocess.ledger import Ledger
from tokenmill.shards.files import write_atomic
from tokenmill.shards.format import RUN_DIR, shard_name
from tokenmill.shards.index import shard_facts
from tokenmill.shards.writer import ShardSpec, ShardWriter
from tokenmill.storage.remote import Remote

TASKS = f"{RUN_DIR}/tasks"
COUNTS = ("records_read", "records_written", "rows", "tokens", "trained_tokens")


def record_name(task: int) -> str:
    return f"{TASKS}/{task:05d}.json"


@dataclass(frozen=True)
class OutputSpec:
    """Where and how a run's tasks write (picklable: Ray tasks get it): `out` the output folder,
    or with `remote` the bucket (`out` unused); every domain's shards as the layout says."""

    out: Path | None
    remote: Remote | None
    dtypes: dict[str, str]
    primary_key: str
    max_tokens_per_shard: int
    storage_format: str
    on_error: str
    dry_run: bool = False


class TaskWriter:
    """One task's chunk results, in order, to its shards and its record."""

    def __init__(self, spec: OutputSpec, plan: TaskPlan, staging: Path | None = None):
        self.spec, self.task = spec, plan.index
        self.rank = {str(piece.path): piece.file for piece in plan.pieces}
        self.lengths: dict[str, dict[int, int]] = {"rows": {}, "documents": {}}
        if spec.dry_run:
            self.root, self._own_staging = Path(), False  # never written to
        elif spec.remote is not None:
            self.root = staging or Path(tempfile.mkdtemp(prefix="tokenmill-task-"))
            self._own_staging = staging is None
        else:
            assert spec.out is not None
            self.root, self._own_staging = spec.out, False
        self.writers: dict[str, ShardWriter] = {}
        self.counts: dict[str, Any] = dict.fromkeys(COUNTS, 0)
        self.ledgers: dict[str, Ledger] = {}
        self.errors: list[dict[str, Any]] = []

    def add(self, result: ChunkResult) -> None:
        """Counts a chunk and writes its rows; under on_error="raise" its first bad record
        (not a filter's) raises."""
        errors: list[dict[str, Any]] = []
        for err in result.errors:
            if self.spec.on_error == "raise" and err.reason not in FILTER_REASONS:
                raise err
            errors.append(
                {
                    "source": err.source,
                    "line": err.line,
                    "field": err.field,
                    "reason": err.reason,
                    "message": err.message,
                    "text": str(err),
                }
            )
        # a chunk's unreadable lines come before its records' errors: put them in input order
        errors.sort(key=lambda e: (self.rank.get(e["source"], len(self.rank)), e["line"] or 0))
        self.errors += errors
        self.counts["records_read"] += result.records_read
        self.counts["records_written"] += result.records_written
        self.counts["rows"] += len(result.rows)
        self.counts["tokens"] += result.tokens
        self.counts["trained_tokens"] += result.trained_tokens
        for domain, ledger in result.ledgers.items():
            self.ledgers.setdefault(domain, Ledger()).add(ledger)
        if self.spec.dry_run:
            self._count_lengths(result)
            return
        for domain, row in result.rows:
            self._writer(domain).add(row)

    def _count_lengths(self, result: ChunkResult) -> None:
        """The lengths of the chunk's rows (their primary key's tokens) and documents (a packed
        row's `doc_lengths`; a row otherwise), by power of two (`length_bucket`)."""
        for _, row in result.rows:
            value = row[self.spec.primary_key]
            size = len(value) if isinstance(value, np.ndarray) else sum(map(len, value))
            docs = row.get("doc_lengths")
            _count(self.lengths["rows"], [size])
            _count(self.lengths["documents"], [size] if docs is None else list(docs))

    def _writer(self, domain: str) -> ShardWriter:
        writer = self.writers.get(domain)
        if writer is None:
            domain_dir = self.root / domain if domain else self.root
            _remove_own_shards(domain_dir, self.task, self.spec.storage_format)  # a dead try's
            spec = ShardSpec(
                domain_dir,
                self.spec.dtypes,
                self.spec.primary_key,
                self.spec.max_tokens_per_shard,
                self.spec.storage_format,
                task=self.task,
            )
            writer = self.writers[domain] = ShardWriter(spec)
        return writer

    def finish(self) -> dict[str, Any]:
        """Publishes the task's last shards (uploads them, to a bucket), then its record; returns
        the record."""
        if self.spec.dry_run:
            counts = {**self.counts, "ledgers": {d: lg.as_dict() for d, lg in self.ledgers.items()}}
            return {
                "task": self.task,
                "counts": counts,
                "errors": self.errors,
                "shards": {},
                "index": {},
                "lengths": {k: sorted(v.items()) for k, v in self.lengths.items()},
            }
        shards = {domain: writer.close() for domain, writer in sorted(self.writers.items())}
        index = {}  # what the dataset's index needs of each shard, read here where it lies
        if self.spec.storage_format == "bin":
            index = {
                domain: [shard_facts(self._local(domain, info["name"])) for info in infos]
                for domain, infos in shards.items()
            }
        record = {
            "task": self.task,
            "counts": {
                **self.counts,
                "ledgers": {d: ledger.as_dict() for d, ledger in self.ledgers.items()},
            },
            "errors": self.errors,
            "shards": shards,
            "index": index,
        }
        data = orjson.dumps(record)
        remote = self.spec.remote
        if remote is None:
            (self.root / TASKS).mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / record_name(self.task), data)
            return record
        try:
            for domain, infos in shards.items():
                for info in infos:
                    local = self._local(domain, info["name"])
                    remote.upload_shard(local, "/".join(p for p in (domain, info["name"]) if p))
                    shutil.rmtree(local) if local.is_dir() else local.unlink()
            remote.pipe(record_name(self.task), data)
        finally:
            if self._own_staging:
                shutil.rmtree(self.root, ignore_errors=True)
        return record

    def _local(self, domain: str, name: str) -> Path:
        return (self.root / domain if domain else self.root) / name

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        if self._own_staging:
            shutil.rmtree(self.root, ignore_errors=True)


def length_bucket(length: int) -> int:
    """The power of two a length is counted under: the smallest at or above it (0 for 0)."""
    return 0 if length <= 0 else 1 << (int(length) - 1).bit_length()


def _count(buckets: dict[int, int], lengths: list[int]) -> None:
    for length in lengths:
        bucket = length_bucket(length)
        buckets[bucket] = buckets.get(bucket, 0) + 1


def _remove_own_shards(domain_dir: Path, task: int, storage_format: str) -> None:
    """Shards an earlier try of this task published before it died: the retry writes them again."""
    if not domain_dir.is_dir():
        return
    stem = shard_name(0, storage_format, task).rsplit("_", 1)[0]
    for path in domain_dir.glob(f"{stem}_*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def read_task_records(out: Path | None, remote: Remote | None) -> dict[int, dict[str, Any]]:
    """The records of the tasks done so far (a torn or foreign file is not a record: that task
    is done again)."""
    found: dict[int, bytes] = {}
    if remote is not None:
        names = [k for k in remote.listing(TASKS) if k.endswith(".json")]
        found = {_task_of(k): v for k, v in remote.cat_many(names).items() if _task_of(k) >= 0}
    elif out is not None and (out / TASKS).is_dir():
        for path in (out / TASKS).iterdir():
            if _task_of(path.name) >= 0:
                found[_task_of(path.name)] = path.read_bytes()
    records = {}
    for task, data in found.items():
        try:
            record = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("task") == task:
            records[task] = record
    return records


def _task_of(name: str) -> int:
    stem = name.rsplit("/", 1)[-1].removesuffix(".json")
    return int(stem) if stem.isdigit() else -1
