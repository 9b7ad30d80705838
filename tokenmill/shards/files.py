"""Durable writes: the one way tokenmill puts bytes on disk.

Every file is written whole and fsynced before it becomes visible: shards and JSONL parts are
written aside and published by rename (`publish`), single files are replaced at once
(`write_atomic`), so a reader never sees half of anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xxhash

from tokenmill.shards.format import TMP_MARK


def write_durable(path: Path, data: np.ndarray | bytes) -> None:
    """One write of the whole array (or bytes), flushed to disk before anything is published."""
    with open(path, "wb") as f:
        data.tofile(f) if isinstance(data, np.ndarray) else f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Renames a finished temp file/folder into place; never over a published one."""
    if final.exists():
        raise FileExistsError(f"{final} already exists; refusing to overwrite a published shard")
    os.rename(tmp, final)
    fsync_dir(final.parent)


def tmp_path(final: Path) -> Path:
    return final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}")


def write_atomic(path: Path, data: bytes) -> None:
    """Replaces `path` with `data` at once: a reader sees the old file or the new one, never part."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def file_checksum(path: Path) -> str:
    digest = xxhash.xxh64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
