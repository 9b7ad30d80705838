"""Files that other processes read at the same time: written durably, locked one at a time.

Every file is written whole and fsynced before it becomes visible: shards and JSONL parts are
written aside and published by rename (`publish`), single files are replaced at once
(`write_atomic`), so a reader never sees half of anything. Where processes must take turns
(a run's output folder, a shard in the machine's cache), they hold the file lock of
`locked`, which the kernel drops when its holder dies, however it dies.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tokenmill.shards.format import TMP_MARK


def write_durable(path: Path, data: np.ndarray | bytes) -> None:
    """One write of the whole array (or bytes), flushed to disk before anything is published."""
    with open(path, "wb") as f:
        write_to(f, data, path)
        try:
            f.flush()
            os.fsync(f.fileno())
        except OSError as err:
            raise write_error(
                path, len(data) if isinstance(data, bytes) else data.nbytes, err
            ) from err


def write_to(file: Any, data: np.ndarray | bytes, path: Path) -> None:
    """`data` written to the open `file` of `path`; a failed write (a full disk) names the
    file, the bytes asked and the room left, where numpy would say "59115 requested and
    17408 written"."""
    try:
        data.tofile(file) if isinstance(data, np.ndarray) else file.write(data)
    except OSError as err:
        raise write_error(path, len(data) if isinstance(data, bytes) else data.nbytes, err) from err


def write_error(path: Path, nbytes: int, err: OSError) -> OSError:
    try:
        free = f"{shutil.disk_usage(Path(path).parent).free:,} bytes free there"
    except OSError:
        free = "free space unknown"
    why = err.strerror or str(err)
    return OSError(
        err.errno or errno.ENOSPC, f"{path}: writing {nbytes:,} bytes failed: {why} ({free})"
    )


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


@contextmanager
def locked(
    path: Path,
    exclusive: bool = True,
    wait: bool = True,
    parents: bool = True,
    mode: int = 0o666,
) -> Iterator[int]:
    """`path`'s lock (flock), exclusive or shared, held until the block ends. Without `wait`,
    a lock another process holds raises BlockingIOError at once. The file is made where
    missing (its folder too, with `parents`; without, FileNotFoundError) and never removed,
    so that every process locks the same file. Yields its descriptor (`relock` changes the
    lock it holds)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    except FileNotFoundError:
        if not parents:
            raise
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        relock(fd, exclusive, wait)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def relock(fd: int, exclusive: bool = True, wait: bool = True) -> None:
    """The lock held on a `locked` file made exclusive (or shared), as `locked` takes it."""
    kind = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    fcntl.flock(fd, kind if wait else kind | fcntl.LOCK_NB)
