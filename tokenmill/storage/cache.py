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

import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import AbstractContextManager
from pathlib import Path

import xxhash

from tokenmill.shards.files import file_checksum, locked, relock
from tokenmill.shards.format import Column
from tokenmill.shards.reader import map_shard, read_meta
from tokenmill.storage.cache_files import (
    CacheStats,
    lock_file,
    map_keys,
    matches,
    meta_ok,
    read_checked,
    shard_files,
    write_checked,
)
from tokenmill.storage.eviction import evict, usage
from tokenmill.storage.remote import STATS, Remote

log = logging.getLogger("tokenmill.cache")

ATTEMPTS = 3  # opens of one shard before giving up on a cache that keeps changing under us
SEEN_S = 1.0  # a shard known present is looked at (and marked used) again after this long


def default_cache_dir() -> Path:
    """TOKENMILL_CACHE, else ~/.cache/tokenmill/shards."""
    return Path(
        os.environ.get("TOKENMILL_CACHE") or Path.home() / ".cache" / "tokenmill" / "shards"
    )


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
        # this process's record of the shards it knows whole in the cache (rel -> when last
        # seen there, monotonic); of those its sample order reads next (never evicted); and
        # of those it reads after them (rel -> how soon: evicted last, the latest first)
        self.present: dict[str, float] = {}
        self.keep: set[str] = set()
        self.later: dict[str, int] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_stats"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._stats, self._pid = CacheStats(), os.getpid()
        self.present, self.keep, self.later = {}, set(), {}

    @property
    def counts(self) -> CacheStats:
        self.claim()
        return self._stats

    def claim(self) -> None:
        """A forked worker counts its own, and keeps none of its parent's look-ahead."""
        if self._pid != os.getpid():
            self._stats, self._pid = CacheStats(), os.getpid()
            self.keep, self.later = set(), {}

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
            if data is not None and meta_ok(data, info):
                out[rel] = data
            else:
                missing.append(rel)
        fetched = self.remote.cat_many([f"{rel}/meta.json" for rel in missing])
        wanted = dict(listed)
        for rel in missing:
            data = fetched[f"{rel}/meta.json"]
            if not meta_ok(data, wanted[rel]):
                data = self.remote.cat(f"{rel}/meta.json")  # once more, then refuse
                STATS.add(refetches=1)
                if not meta_ok(data, wanted[rel]):
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
                        self.present[rel] = time.monotonic()
                        return map_shard(shard, meta)
                    return map_keys(shard, meta, keys or list(meta), values)
            except FileNotFoundError:  # the cache changed under us (evicted, removed): again
                self.present.pop(rel, None)
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
            self.present[rel] = time.monotonic()
            return True
        except BlockingIOError:
            return False
        except FileNotFoundError:
            self.present.pop(rel, None)
            return False

    def known(self, rel: str) -> bool:
        """Whether this process knows a shard whole in the cache: a dict lookup. Where the
        cache has a limit (shards may be evicted, by any process), a shard not seen for
        `SEEN_S` is looked at again and marked as just used (one utime), so that the least
        recently used go first and the shards about to be read last."""
        seen = self.present.get(rel)
        if seen is None:
            return False
        if self.limit is None:
            return True
        now = time.monotonic()
        if now - seen < SEEN_S:
            return True
        try:
            os.utime(self.dir / "shards" / rel)
        except FileNotFoundError:  # evicted (by another process) or removed
            self.present.pop(rel, None)
            return False
        self.present[rel] = now
        return True

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
            relock(lock)  # exclusive: one download per machine
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
        checked = read_checked(shard)
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
            write_checked(shard, checked)
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
                wrong = [f for f in todo if not matches(temps[f[0]], f[1], f[2])]
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
            checked = read_checked(shard)
            for name, _, _ in files:
                os.replace(temps[name], shard / name)
                st = os.stat(shard / name)
                checked[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
            write_checked(shard, checked)
        finally:
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)
        self.counts.add(downloads=1, download_bytes=sum(size for _, size, _ in files))
        self._save_stats()

    # --- locks ---------------------------------------------------------------------------
    def _locked(self, rel: str, exclusive: bool, wait: bool = True) -> AbstractContextManager[int]:
        """Shard `rel`'s lock (made again where the cache folder was removed)."""
        return locked(lock_file(self.dir, rel), exclusive, wait)

    # --- eviction ------------------------------------------------------------------------
    def _make_room(self, need: int, keep: Path) -> None:
        """Evicts the least recently used shards (of any dataset in the folder) until `need`
        more bytes fit under the limit; shards being read or downloaded are skipped, and so
        are this process's `keep` (the shards its sample order reads next)."""
        if self.limit is None:
            return
        shards = self.dir / "shards"
        self.claim()
        kept = {keep, *(shards / rel for rel in self.keep)}
        later = {shards / rel: rank for rel, rank in self.later.items()}
        evicted, total = evict(self.root, self.limit, need, kept, later)
        for dataset, rel in evicted:
            if dataset == self.dir:
                self.present.pop(rel, None)
        if evicted:
            self.counts.add(evictions=len(evicted))
        if total + need > self.limit and not self._warned:
            self._warned = True
            log.warning(
                "%s: the cache holds %d bytes in shards being read; the limit of %d is passed "
                "until they are released",
                self.root,
                total + need,
                self.limit,
            )

    def usage(self) -> list[tuple[float, Path, Path, int]]:
        """(last use, shard folder, its dataset folder, bytes) of every shard in the folder."""
        return usage(self.root)

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
