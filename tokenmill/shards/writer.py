"""Writing shards: records in, complete shards out, never a torn one.

A shard is staged in a temp folder (arrays, offsets, fsync, `meta.json` last) and renamed
into place; `ShardCutter` decides where shards end from token counts alone, so the local
writer and the Ray engine's planner cut the same shards.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.shards.buffers import ShardBuffer, jsonl_line
from tokenmill.shards.files import fsync_dir, publish, tmp_path, write_durable
from tokenmill.shards.format import (
    KEY_RE,
    OFFSET_DTYPE,
    STORAGE_FORMATS,
    TMP_MARK,
    Column,
    cast,
    checksum,
    row_tokens,
    shard_name,
)


def write_shard(shard_dir: Path, columns: dict[str, Column], dtypes: dict[str, str]) -> dict:
    """Writes one shard atomically (temp folder, fsync, meta.json last, rename); returns its meta."""
    tmp, meta = stage_shard(shard_dir, columns, dtypes)
    try:
        publish(tmp, Path(shard_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def stage_shard(
    shard_dir: Path, columns: dict[str, Column], dtypes: dict[str, str]
) -> tuple[Path, dict]:
    """Writes a shard into its temp folder, fsynced and ready to `publish`; returns (temp, meta)."""
    shard_dir = Path(shard_dir)
    counts = {key: len(col.offsets) - 1 for key, col in columns.items() if col.offsets is not None}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{shard_dir}: keys disagree on the number of records: {counts}")
    tmp = tmp_path(shard_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        meta = {}
        for key, col in columns.items():
            if not KEY_RE.match(key):
                raise ValueError(f"key {key!r} cannot name a file; use letters, digits, _ and -")
            values = cast(col.values, dtypes[key], f"key {key!r}")
            write_durable(tmp / f"{key}.bin", values)
            entry: dict[str, Any] = {
                "shape": [len(values)],
                "dtype": dtypes[key],
                "nbytes": values.nbytes,
                "xxh64": checksum(values),
            }
            for part, bounds in (("offsets", col.offsets), ("items", col.items)):
                if bounds is not None:
                    bounds = np.ascontiguousarray(bounds, OFFSET_DTYPE)
                    write_durable(tmp / f"{key}.{part}.bin", bounds)
                    entry[part] = {
                        "file": f"{key}.{part}.bin",
                        "count": len(bounds),
                        "xxh64": checksum(bounds),
                    }
            meta[key] = entry
        write_durable(tmp / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, meta


def stage_part(part: Path, lines: list[bytes]) -> tuple[Path, dict]:
    """Writes a JSONL part into its temp file, ready to `publish`; returns (temp, size and checksum)."""
    data = b"".join(lines)
    tmp = tmp_path(Path(part))
    try:
        write_durable(tmp, data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, {"nbytes": len(data), "xxh64": checksum(data)}


class ShardCutter:
    """Where shards end, from token counts alone: a shard closes before a record that would take it
    past `max_tokens` and as soon as it reaches `max_tokens`, so only a record that alone exceeds
    the limit gets a shard above it. ShardWriter follows it; the Ray engine plans with it."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens_per_shard must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.records = self.tokens = 0

    def close_before(self, tokens: int) -> bool:
        """Whether the open shard must close before a record of `tokens` tokens joins it."""
        return self.records > 0 and self.tokens + tokens > self.max_tokens

    def add(self, tokens: int) -> bool:
        """Counts a record in the open shard; True when the shard is now full and must close."""
        self.records += 1
        self.tokens += tokens
        return self.tokens >= self.max_tokens

    def reset(self) -> None:
        self.records = self.tokens = 0


class ShardWriter:
    """Writes the shards of one domain folder, rolling at max_tokens_per_shard tokens of primary_key
    (the ShardCutter rule)."""

    def __init__(
        self,
        domain_dir: Path,
        dtypes: dict[str, str],
        primary_key: str,
        max_tokens_per_shard: int,
        storage_format: str = "bin",
        first_index: int = 0,
    ):
        if storage_format not in STORAGE_FORMATS:
            raise ValueError(
                f"storage_format {storage_format!r} is not one of {list(STORAGE_FORMATS)}"
            )
        self.cutter = ShardCutter(max_tokens_per_shard)
        self.domain_dir, self.primary_key = Path(domain_dir), primary_key
        self.storage_format, self.index = storage_format, first_index
        self.buffer = ShardBuffer(dtypes)
        self.lines: list[bytes] = []  # storage_format "jsonl"
        self.published: list[dict] = []
        self.closed = False

    def add(self, row: dict[str, Any]) -> None:
        """Adds one row (a stored record); every row must have the first row's keys."""
        if self.closed:
            raise RuntimeError("ShardWriter is closed")
        if self.primary_key not in row:
            raise ValueError(
                f"primary key {self.primary_key!r} is not in the record keys {list(row)}"
            )
        tokens = row_tokens(row[self.primary_key])
        if self.cutter.close_before(tokens):
            self._flush()
        if self.storage_format == "jsonl":
            self.buffer.check(row)
            self.lines.append(
                jsonl_line({k: row[k] for k in self.buffer.keys or []}, self.buffer.dtypes)
            )
            self.buffer.records += 1
        else:
            self.buffer.add(row)
        if self.cutter.add(tokens):
            self._flush()

    def stage(self) -> tuple[Path, dict]:
        """Writes the open shard into its temp place beside its final one, not yet published;
        returns (temp, the shard's info). The Ray engine's write tasks stage, its driver publishes."""
        name = shard_name(self.index, self.storage_format)
        final = self.domain_dir / name
        self.domain_dir.mkdir(parents=True, exist_ok=True)
        if self.storage_format == "jsonl":
            tmp, extra = stage_part(final, self.lines)
        else:
            tmp, _ = stage_shard(final, self.buffer.build(), self.buffer.dtypes)
            # the manifest covers meta.json too: an edited dtype or shape is caught at load
            extra = {"meta_xxh64": checksum((tmp / "meta.json").read_bytes())}
        info = {
            "name": name,
            "records": self.buffer.records,
            "tokens": self.cutter.tokens,
            "keys": list(self.buffer.keys or []),
            **extra,
        }
        return tmp, info

    def _flush(self) -> None:
        if not self.buffer.records:
            return
        tmp, info = self.stage()
        try:
            publish(tmp, self.domain_dir / info["name"])
        except BaseException:
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            raise
        self.published.append(info)
        self.index += 1
        self.buffer.clear()
        self.lines = []
        self.cutter.reset()

    def close(self) -> list[dict]:
        """Publishes the last shard; returns one info per published shard."""
        if not self.closed:
            self._flush()
            self.closed = True
        return self.published

    def abort(self) -> None:
        """Drops buffered records and removes this process's temp files; publishes nothing more."""
        self.closed = True
        self.buffer.clear()
        self.lines = []
        if self.domain_dir.is_dir():
            for path in self.domain_dir.glob(f"*{TMP_MARK}{os.getpid()}"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort() if exc_type else self.close()
