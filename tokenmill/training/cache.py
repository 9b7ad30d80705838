"""The local shard cache: a remote dataset's shards, downloaded once per machine on first use.

One folder (`cache_dir`) is shared by every DataLoader worker and rank of a machine:

    cache_dir/<name>-<id>/manifest.json        the dataset's manifest (id: xxh64 of URL + manifest)
    cache_dir/<name>-<id>/meta/<shard>/meta.json   every shard's meta.json (small, kept)
    cache_dir/<name>-<id>/shards/<shard>/<files>   shard files, evicted least recently used
    cache_dir/<name>-<id>/locks/<shard>.lock       one lock file per shard (fcntl.flock)

A shard's files are downloaded under its lock held exclusively (so once per machine), each
checked against the size and xxh64 its meta.json gives (a mismatch is fetched once more, then
raises naming the shard), written aside and renamed into place: a file in the cache is
always complete. Readers map files under the shared lock; eviction takes the exclusive lock
without waiting (a shard being read or downloaded is skipped), renames the shard's folder
away and deletes it, so a process that has a file mapped keeps reading its pages. Every
file's (size, mtime, inode) when it was checked is kept beside it (`.checked`): a file
replaced or rewritten by another process is hashed again, and fetched again if it no longer
matches; a file or folder removed under a running job is fetched again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import xxhash

from tokenmill.shards.files import file_checksum
from tokenmill.shards.format import DTYPES, OFFSET_DTYPE, Column, checksum
from tokenmill.shards.reader import map_array, map_bounds, map_shard, read_meta
from tokenmill.shards.remote import STATS, Remote

log = logging.getLogger("tokenmill.cache")

CHECKED = ".checked"
ATTEMPTS = 3  # opens of one shard before giving up on a cache that keeps changing under us


def default_cache_dir() -> Path:
    """TOKENMILL_CACHE, else ~/.cache/tokenmill/shards."""
    return Path(
        os.environ.get("TOKENMILL_CACHE") or Path.home() / ".cache" / "tokenmill" / "shards"
    )


def shard_files(meta: dict, keys: list[str] | None = None, values: bool = True) -> list[tuple]:
    """(file name, bytes, xxh64 or None) of the files `keys` of a shard need: each key's
    `.bin` (unless `values` is False: offsets and items only) and its bounds files."""
    files = []
    for key in keys if keys is not None else list(meta):
        entry = meta[key]
        if values:
            size = entry["shape"][0] * DTYPES[entry["dtype"]].itemsize
            files.append((f"{key}.bin", size, entry.get("xxh64")))
        for part in ("offsets", "items"):
            bounds = entry.get(part)
            if isinstance(bounds, dict):
                size = bounds["count"] * OFFSET_DTYPE.itemsize
                files.append((bounds["file"], size, bounds.get("xxh64")))
    return files


class CacheStats:
    """This process's counts, also kept on disk (`stats/<host>-<pid>.json`) so that one
    process can read what all of the machine's did (`ShardCache.stats()`)."""

    NAMES = ("hits", "downloads", "download_bytes", "evictions", "refetched", "rechecked")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                self.counts[name] += n


class ShardCache:
    """One remote dataset's shards in a machine-wide cache folder (see the module docstring).
    `limit` is the bytes of shard files the whole folder may hold (None: no limit)."""

    def __init__(
        self, remote: Remote, manifest_bytes: bytes, cache_dir: str | Path | None, limit: int | None
    ):
        self.remote, self.limit = remote, limit
        self.root = Path(cache_dir or default_cache_dir()).absolute()
        ident = xxhash.xxh64(remote.url.encode() + b"\n" + manifest_bytes).hexdigest()
        name = "".join(
            c if c.isalnum() or c in "-_." else "_" for c in remote.url.rsplit("/", 1)[-1]
        )
        self.dir = self.root / f"{name or 'dataset'}-{ident}"
        self.manifest_bytes = manifest_bytes
        self._stats = CacheStats()
        self._pid = os.getpid()
        self._warned = False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_stats"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._stats, self._pid = CacheStats(), os.getpid()

    @property
    def counts(self) -> CacheStats:
        if self._pid != os.getpid():  # a forked worker counts its own
            self._stats, self._pid = CacheStats(), os.getpid()
        return self._stats

    # --- metadata ------------------------------------------------------------------------
    def metas(self, listed: list[tuple[str, dict]]) -> list[tuple[str, bytes]]:
        """(shard, meta.json bytes) of every listed shard: from the cache, else fetched at
        once (concurrently); each checked against the manifest's meta_xxh64."""
        self._write_once(self.dir / "manifest.json", self.manifest_bytes)
        out: dict[str, bytes] = {}
        missing = []
        for rel, info in listed:
            path = self.dir / "meta" / rel / "meta.json"
            data = path.read_bytes() if path.is_file() else None
            if data is not None and _meta_ok(data, info):
                out[rel] = data
            else:
                missing.append(rel)
        fetched = self.remote.cat_many([f"{rel}/meta.json" for rel in missing])
        wanted = dict(listed)
        for rel in missing:
            data = fetched[f"{rel}/meta.json"]
            if not _meta_ok(data, wanted[rel]):
                data = self.remote.cat(f"{rel}/meta.json")  # once more, then refuse
                STATS.add(refetches=1)
                if not _meta_ok(data, wanted[rel]):
                    raise ValueError(
                        f"{self.remote.where(rel)}/meta.json: xxh64 differs from manifest.json's "
                        "after two downloads; the dataset in the bucket is corrupted"
                    )
            self._write_once(self.dir / "meta" / rel / "meta.json", data)
            out[rel] = data
        return [(rel, out[rel]) for rel, _ in listed]

    def read_meta(self, rel: str, data: bytes) -> dict:
        """A shard's meta.json (these bytes), checked as the shard reader checks a local one."""
        folder = self.dir / "meta" / rel
        try:
            return read_meta(folder)
        except ValueError:  # removed under us: written again from the bytes in hand
            self._write_once(folder / "meta.json", data)
            return read_meta(folder)

    def _write_once(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    # --- shards --------------------------------------------------------------------------
    def open(
        self, rel: str, meta: dict, keys: list[str] | None = None, values: bool = True
    ) -> dict[str, Column]:
        """A shard's columns (`keys`, default all; without `values`: offsets and items only),
        downloaded first if need be, mapped from the cache."""
        files = shard_files(meta, keys, values)
        for attempt in range(ATTEMPTS):
            try:
                with self._locked(rel, exclusive=False) as lock:
                    shard = self.ensure_locked(rel, meta, files, lock)
                    if keys is None and values:
                        return map_shard(shard, meta)
                    return _map_keys(shard, meta, keys or list(meta), values)
            except FileNotFoundError:  # the cache changed under us (evicted, removed): again
                if attempt == ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def ensure(self, rel: str, meta: dict, wait: bool = True) -> bool:
        """Every file of a shard in the cache (prefetch); without `wait`, a shard that another
        process or thread holds is skipped (False)."""
        files = shard_files(meta)
        try:
            with self._locked(rel, exclusive=False, wait=wait) as lock:
                self.ensure_locked(rel, meta, files, lock)
            return True
        except BlockingIOError:
            return False
        except FileNotFoundError:
            return False

    def cached(self, rel: str, meta: dict) -> bool:
        """Whether every file of a shard is in the cache (a stat per file; not checked)."""
        shard = self.dir / "shards" / rel
        return all(
            (shard / name).is_file() and (shard / name).stat().st_size == size
            for name, size, _ in shard_files(meta)
        )

    def ensure_locked(self, rel: str, meta: dict, files: list[tuple], lock: int) -> Path:
        """Under the shard's shared lock: missing or changed files fetched (under the exclusive
        lock, checked again first); the shard marked as just used. Returns its folder."""
        shard = self.dir / "shards" / rel
        if self._check(shard, files):
            fcntl.flock(lock, fcntl.LOCK_EX)  # one download per machine
            bad = self._check(shard, files)
            if bad:
                self._download(rel, shard, bad)
        else:
            self.counts.add(hits=1)
        if files:
            os.utime(shard)  # least recently used goes first
        return shard

    def _check(self, shard: Path, files: list[tuple]) -> list[tuple]:
        """The files that are missing, or not as they were when checked (hashed again then)."""
        checked = _read_checked(shard)
        bad, changed = [], False
        for name, size, digest in files:
            try:
                st = os.stat(shard / name)
            except FileNotFoundError:
                bad.append((name, size, digest))
                continue
            stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
            if checked.get(name) == stamp and st.st_size == size:
                continue
            self.counts.add(rechecked=1)
            if st.st_size == size and (digest is None or file_checksum(shard / name) == digest):
                checked[name], changed = stamp, True
            else:
                log.warning(
                    "%s/%s: not as downloaded (size or xxh64); fetching it again", shard, name
                )
                bad.append((name, size, digest))
        if changed:
            _write_checked(shard, checked)
        return bad

    def _download(self, rel: str, shard: Path, files: list[tuple]) -> None:
        """Fetches files (concurrently), checks each, fetches a mismatch once more, then
        renames them into place; raises naming the shard if a file still does not match."""
        shard.mkdir(parents=True, exist_ok=True)
        for stale in shard.glob(".*.tmp-*"):  # a killed download's (we hold the lock)
            stale.unlink(missing_ok=True)
        self._make_room(sum(size for _, size, _ in files), keep=shard)
        tag = f"{os.getpid()}-{threading.get_ident()}"
        temps = {name: shard / f".{name}.tmp-{tag}" for name, _, _ in files}
        todo = list(files)
        try:
            for attempt in (1, 2):
                self.remote.get(
                    [(f"{rel}/{name}", temps[name]) for name, _, _ in todo],
                    [size for _, size, _ in todo],
                )
                wrong = [f for f in todo if not _matches(temps[f[0]], f[1], f[2])]
                if not wrong:
                    break
                if attempt == 2:
                    names = ", ".join(name for name, _, _ in wrong)
                    raise ValueError(
                        f"{self.remote.where(rel)}: {names}: size or xxh64 differs from its "
                        "meta.json after two downloads; the shard in the bucket is corrupted "
                        "(run `tokenmill verify` on a copy)"
                    )
                STATS.add(refetches=len(wrong))
                self.counts.add(refetched=len(wrong))
                log.warning(
                    "%s: %d file(s) did not match meta.json; fetching again", rel, len(wrong)
                )
                todo = wrong
            checked = _read_checked(shard)
            for name, _, _ in files:
                os.replace(temps[name], shard / name)
                st = os.stat(shard / name)
                checked[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
            _write_checked(shard, checked)
        finally:
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)
        self.counts.add(downloads=1, download_bytes=sum(size for _, size, _ in files))
        self._save_stats()

    # --- locks ---------------------------------------------------------------------------
    @contextmanager
    def _locked(self, rel: str, exclusive: bool, wait: bool = True) -> Iterator[int]:
        path = self.dir / "locks" / (rel.replace("/", "__") + ".lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:  # the cache folder was removed: make it again
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            fcntl.flock(fd, mode if wait else mode | fcntl.LOCK_NB)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    # --- eviction ------------------------------------------------------------------------
    def usage(self) -> list[tuple[float, Path, Path, int]]:
        """(last use, shard folder, its dataset folder, bytes) of every shard in the cache
        folder, of every dataset in it."""
        found = []
        for dataset in self.root.iterdir() if self.root.is_dir() else []:
            base = dataset / "shards"
            for folder, _, names in os.walk(base):
                if CHECKED not in names:
                    continue
                try:
                    size = sum(
                        os.path.getsize(os.path.join(folder, n)) for n in names if n[0] != "."
                    )
                    found.append((os.stat(folder).st_mtime, Path(folder), dataset, size))
                except FileNotFoundError:
                    continue
        return found

    def _make_room(self, need: int, keep: Path) -> None:
        """Evicts the least recently used shards (of any dataset in the folder) until `need`
        more bytes fit under the limit; shards being read or downloaded are skipped."""
        if self.limit is None:
            return
        entries = self.usage()
        total = sum(size for *_, size in entries)
        for _, folder, dataset, size in sorted(entries, key=lambda e: e[0]):
            if total + need <= self.limit:
                return
            if folder == keep:
                continue
            rel = folder.relative_to(dataset / "shards").as_posix()
            lock = dataset / "locks" / (rel.replace("/", "__") + ".lock")
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                trash = self.root / ".trash" / uuid.uuid4().hex
                trash.parent.mkdir(parents=True, exist_ok=True)
                os.rename(folder, trash)
            except OSError as err:  # in use (EWOULDBLOCK) or already gone
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.ENOENT):
                    raise
                continue
            finally:
                os.close(fd)
            shutil.rmtree(trash, ignore_errors=True)
            total -= size
            self.counts.add(evictions=1)
        if total + need > self.limit and not self._warned:
            self._warned = True
            log.warning(
                "%s: the cache holds %d bytes in shards being read; the limit of %d is passed "
                "until they are released", self.root, total + need, self.limit,
            )  # fmt: skip

    # --- counters ------------------------------------------------------------------------
    def _save_stats(self) -> None:
        """This process's counts (and its remote STATS) on disk, for `stats()`."""
        path = self.dir / "stats" / f"{socket.gethostname()}-{os.getpid()}.json"
        counts = self.counts
        with counts.lock:  # the counts as they are now, never overtaken by an older copy
            data = {**counts.counts, **{f"remote_{k}": v for k, v in STATS.as_dict().items()}}
            try:
                self._write_once(path, json.dumps(data).encode())
            except OSError:
                pass

    def stats(self) -> dict[str, int]:
        """Counts summed over every process that used this dataset's cache (DataLoader
        workers and ranks of the machine, since the cache folder was made): downloads,
        bytes, evictions, refetched files, retries of transient errors (remote_retries), ..."""
        self._save_stats()
        total: dict[str, int] = {}
        for path in (self.dir / "stats").glob("*.json"):
            try:
                for k, v in json.loads(path.read_text()).items():
                    total[k] = total.get(k, 0) + v
            except (OSError, ValueError):
                continue
        return total


def _meta_ok(data: bytes, info: dict) -> bool:
    return "meta_xxh64" not in info or checksum(data) == info["meta_xxh64"]


def _matches(path: Path, size: int, digest: str | None) -> bool:
    try:
        if path.stat().st_size != size:
            return False
    except FileNotFoundError:
        return False
    return digest is None or file_checksum(path) == digest


def _read_checked(shard: Path) -> dict[str, list[int]]:
    try:
        return json.loads((shard / CHECKED).read_text())
    except (OSError, ValueError):
        return {}


def _write_checked(shard: Path, checked: dict) -> None:
    tmp = shard / f"{CHECKED}.{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    tmp.write_text(json.dumps(checked))
    os.replace(tmp, shard / CHECKED)


def _map_keys(shard: Path, meta: dict, keys: list[str], values: bool) -> dict[str, Column]:
    """Some keys of a shard mapped; without values, a key's values are an empty array and
    only its offsets and items are read (a dataset's lengths at load)."""
    columns = {}
    for key in keys:
        entry = meta[key]
        count = entry["shape"][0]
        vals = (
            map_array(shard / f"{key}.bin", entry["dtype"], count, key)
            if values
            else np.empty(0, DTYPES[entry["dtype"]])
        )
        items = map_bounds(shard, key, entry.get("items"), count)
        below = count if items is None else len(items) - 1
        columns[key] = Column(vals, map_bounds(shard, key, entry.get("offsets"), below), items)
    return columns
