"""Eviction from the machine's shard cache: least recently used shards first, across every
dataset in the cache folder, never a shard being read or downloaded, nor one the caller
keeps (the shard it downloads, the shards its sample order reads next)."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Container
from pathlib import Path

from tokenmill.shards.files import locked
from tokenmill.storage.cache_files import CHECKED, lock_file


def usage(root: Path) -> list[tuple[float, Path, Path, int]]:
    """(last use, shard folder, its dataset folder, bytes) of every shard in the cache
    folder `root`, of every dataset in it."""
    found = []
    for dataset in root.iterdir() if root.is_dir() else []:
        base = dataset / "shards"
        for folder, _, names in os.walk(base):
            if CHECKED not in names:
                continue
            try:
                size = sum(os.path.getsize(os.path.join(folder, n)) for n in names if n[0] != ".")
                found.append((os.stat(folder).st_mtime, Path(folder), dataset, size))
            except FileNotFoundError:
                continue
    return found


def evict(
    root: Path, limit: int, need: int, keep: Container[Path], later: dict[Path, int] | None = None
) -> tuple[list[tuple[Path, str]], int]:
    """Evicts the least recently used shards until `need` more bytes fit under `limit`: each
    renamed away under its exclusive lock taken without waiting (a shard in use is skipped),
    then deleted; a folder in `keep` is skipped, and those in `later` (folder -> how soon it
    is read) go last, the one read last first. Returns ((dataset folder, shard) of each
    evicted, the bytes the folder then holds)."""
    entries = usage(root)
    total = sum(size for *_, size in entries)
    evicted: list[tuple[Path, str]] = []
    soon = later or {}

    def order(entry: tuple[float, Path, Path, int]) -> tuple[int, float]:
        rank = soon.get(entry[1])
        return (0, entry[0]) if rank is None else (1, -rank)

    for _, folder, dataset, size in sorted(entries, key=order):
        if total + need <= limit:
            break
        if folder in keep:
            continue
        rel = folder.relative_to(dataset / "shards").as_posix()
        trash = root / ".trash" / uuid.uuid4().hex
        try:
            with locked(lock_file(dataset, rel), wait=False, parents=False):
                trash.parent.mkdir(parents=True, exist_ok=True)
                os.rename(folder, trash)
        except OSError as err:  # in use (EWOULDBLOCK), already gone, or its lock folder
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.ENOENT):
                raise
            continue
        shutil.rmtree(trash, ignore_errors=True)
        total -= size
        evicted.append((dataset, rel))
    return evicted, total
