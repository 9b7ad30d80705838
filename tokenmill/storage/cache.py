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
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import xxhash

from tokenmill.shards.files import file_checksum, locked, relock
from tokenmill.shards.format import DTYPES, OFFSET_DTYPE, Column
from tokenmill.shards.reader import map_shard, read_meta
from tokenmill.storage.cache_files import (
    CacheStats,
    lock_file,
    map_keys,
    matches,
    meta_ok,
    read_checked,
    shard_files,
    shard_rows,
    write_checked,
)
from tokenmill.storage.eviction import CacheIndex
from tokenmill.storage.remote import STATS, ObjectMissing, Remote

log = logging.getLogger("tokenmill.cache")

ATTEMPTS = 3  # opens of one shard before giving up on a cache that keeps changing under us
SEEN_S = 1.0  # a shard known present is looked at (and marked used) again after this long
LOOKAHEAD_SHARE = 0.5  # of the limit, for the shards every process of the machine reads next
WAIT_S = 0.05  # between two tries for room while other downloads are under way
FULL = (errno.ENOSPC, errno.EDQUOT)  # a disk (or a quota) with no room left
RANGE_RATIO = 64  # rows read by byte ranges, not a download, when under 1/64 of a shard's


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
        self.index = CacheIndex(self.root)  # the machine's: shards, downloads, claims
        # this process's record of the shards it knows whole in the cache (rel -> when last
        # seen there, monotonic); of those its sample order reads next (evicted only when
        # nothing else can go); and of those it reads after them (rel -> how soon: evicted
        # after the unclaimed ones, the latest first); both published to the index
        self.present: dict[str, float] = {}
        self._keep: set[str] = set()
        self._later: dict[str, int] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_stats"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._stats, self._pid = CacheStats(), os.getpid()
        self.present, self._keep, self._later = {}, set(), {}

    @property
    def counts(self) -> CacheStats:
        self.claim()
        return self._stats

    def claim(self) -> None:
        """A forked worker counts its own, and keeps none of its parent's look-ahead."""
        if self._pid != os.getpid():
            self._stats, self._pid = CacheStats(), os.getpid()
            self._keep, self._later = set(), {}

    # --- the look-ahead, machine-wide -------------------------------------------------------
    @property
    def keep(self) -> set[str]:
        return self._keep

    @keep.setter
    def keep(self, rels: set[str]) -> None:
        """The shards this process reads next: claimed in the machine's index, so that no
        process evicts them while anything else can go."""
        self.claim()
        if rels != self._keep:
            self._keep = set(rels)
            self._publish()

    @property
    def later(self) -> dict[str, int]:
        return self._later

    @later.setter
    def later(self, ranks: dict[str, int]) -> None:
        """The shards this process reads after `keep` (shard -> how soon): claimed in the
        index, evicted after the unclaimed ones, the one read last first."""
        self.claim()
        if ranks != self._later:
            self._later = dict(ranks)
            self._publish()

    def _publish(self) -> None:
        if self.limit is not None:
            self.index.claim(self.dir, self._keep, self._later)

    def lookahead_budget(self, share: float) -> float | None:
        """The bytes this process may fetch ahead of its reads: `share` of the limit, and
        at most its part of the machine's LOOKAHEAD_SHARE, split between every live process
        that fetches ahead into this cache folder (8 ranks claim half the limit in all, not
        4 times it); None without a limit."""
        if self.limit is None:
            return None
        return min(self.limit * share, self.limit * LOOKAHEAD_SHARE / self.index.lookers())

    # --- metadata ------------------------------------------------------------------------
    def metas(self, listed: list[tuple[str, dict]]) -> list[tuple[str, bytes]]:
        """(shard, meta.json bytes) of every listed shard: from the cache, else fetched at
        once (concurrently); each checked against the manifest's meta_xxh64."""
        self._write_once(self.dir / "manifest.json", self.manifest_bytes)
        missing = self._cached_metas(listed, {})
        if not missing:
            return self._metas_in_cache(listed)
        with locked(self.dir / "locks" / "metas.lock"):  # one process of the machine fetches
            return self._fetch_metas(listed)

    def _metas_in_cache(self, listed: list[tuple[str, dict]]) -> list[tuple[str, bytes]]:
        out: dict[str, bytes] = {}
        self._cached_metas(listed, out)
        return [(rel, out[rel]) for rel, _ in listed]

    def _cached_metas(self, listed: list[tuple[str, dict]], out: dict[str, bytes]) -> list[str]:
        """The shards whose meta.json the cache lacks (or holds not as listed); `out` gets
        the others'."""
        missing = []
        for rel, info in listed:
            path = self.dir / "meta" / rel / "meta.json"
            data = path.read_bytes() if path.is_file() else None
            if data is not None and meta_ok(data, info):
                out[rel] = data
            else:
                missing.append(rel)
        return missing

    def _fetch_metas(self, listed: list[tuple[str, dict]]) -> list[tuple[str, bytes]]:
        out: dict[str, bytes] = {}
        missing = self._cached_metas(listed, out)  # again: another process may have fetched
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

    def meta_bytes(self, rel: str, ok: Callable[[bytes], bool]) -> bytes | None:
        """A shard's meta.json from the cache; where the cache lacks it (or `ok` refuses
        it), fetched into it once per machine: under the shard's meta lock, looked for again
        first. None if what is fetched is still refused (the caller fetches once more and
        says why)."""
        path = self.dir / "meta" / rel / "meta.json"
        data = path.read_bytes() if path.is_file() else None
        if data is not None and ok(data):
            return data
        with locked(lock_file(self.dir, f"{rel}/meta.json")):
            data = path.read_bytes() if path.is_file() else None
            if data is not None and ok(data):
                return data
            data = self.remote.cat(f"{rel}/meta.json")
            if not ok(data):
                return None
            self._write_once(path, data)
            return data

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
        try:
            tmp.write_bytes(data)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            if err.errno in FULL:
                raise self.full(str(path.relative_to(self.dir)), len(data), err) from None
            raise
        os.replace(tmp, path)

    def full(self, what: str, need: int, err: OSError) -> OSError:
        """The error of a full disk under the cache: which cache, what was being written,
        the bytes it needed and the room left there, not a bare "No space left on device"."""
        try:
            free = f"{shutil.disk_usage(self.root).free:,} bytes are free there"
        except OSError:
            free = "the room left there is unknown"
        limit = f"{self.limit:,} bytes" if self.limit is not None else "none"
        return OSError(
            err.errno,
            f"{self.root}: the shard cache's disk is full ({err.strerror}): {what} of "
            f"{self.remote.url} needs {need:,} bytes and {free}; free room on that disk, set "
            f"cache_limit below the room the cache may take (now: {limit}), or choose "
            "another cache_dir",
        )

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
            except ObjectMissing:  # gone from the bucket: fetching again cannot help
                raise
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
        recently used go first and the shards about to be read last (in the machine's index)."""
        seen = self.present.get(rel)
        if seen is None:
            return False
        if self.limit is None:
            return True
        now = time.monotonic()
        if now - seen < SEEN_S:
            return True
        if not (self.dir / "shards" / rel).is_dir():  # evicted (by another process) or removed
            self.present.pop(rel, None)
            return False
        self.index.touch(self.dir, rel, time.time())
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
            self.index.touch(self.dir, rel, time.time())  # least recently used goes first
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
        need = sum(size for _, size, _ in files)
        self._make_room(rel, need)
        tag = f"{os.getpid()}-{threading.get_ident()}"
        temps = {name: shard / f".{name}.tmp-{tag}" for name, _, _ in files}
        todo = list(files)
        try:
            for attempt in (1, 2):
                self._get(rel, [(name, temps[name], size) for name, size, _ in todo], need)
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
            self.index.landed(self.dir, rel, time.time())  # the reservation, now the shard
        self.counts.add(downloads=1, download_bytes=sum(size for _, size, _ in files))
        self._save_stats()

    def _get(self, rel: str, files: list[tuple[str, Path, int]], need: int) -> None:
        """Shard `rel`'s files (name, temp path, bytes) downloaded; an object gone from the
        bucket, or a full disk, raises naming the shard."""
        try:
            self.remote.get(
                [(f"{rel}/{name}", tmp) for name, tmp, _ in files], [n for _, _, n in files]
            )
        except ObjectMissing as err:
            raise ObjectMissing(
                f"{self.remote.where(rel)}: shard {rel}, listed in the dataset's manifest, "
                f"cannot be read from the bucket ({err}): the dataset changed since it was "
                f"written; run `tokenmill verify {self.remote.url}`"
            ) from None
        except OSError as err:
            if err.errno in FULL:
                for _, tmp, _ in files:  # the room left is what the disk has without them
                    tmp.unlink(missing_ok=True)
                raise self.full(f"shard {rel}", need, err) from None
            raise

    # --- ranged reads --------------------------------------------------------------------
    def ranged_pays(self, rel: str, meta: dict, rows: int) -> bool:
        """Whether reading `rows` rows of a shard by byte ranges pays better than downloading
        it whole: it is not in the cache, the cache is full (a download would evict), no
        process of the machine reads it soon (none claims it), and the rows are under
        1/RANGE_RATIO of its rows (a few KB of a 225 MB shard)."""
        if self.limit is None or rows * RANGE_RATIO > shard_rows(meta):
            return False
        if rel in self.present or (self.dir / "shards" / rel).is_dir():
            return False
        size = sum(n for _, n, _ in shard_files(meta))
        return self.index.unwanted(self.dir, rel, size, self.limit)

    def read_rows(self, rel: str, meta: dict, keys: list[str], begin: int, end: int) -> dict:
        """Rows [begin, end) of some keys of a shard, read from the bucket by byte ranges
        (a round trip per level of bounds: offsets, items, values), not cached: Columns with
        the rows' values and their bounds from 0, as a slice of the mapped shard gives them.
        A range is checked by its size only (a file's xxh64 covers the whole file)."""
        for key in keys:
            rows = shard_rows({key: meta[key]})
            if not 0 <= begin <= end <= rows:
                raise ValueError(
                    f"{self.remote.where(rel)}: rows {begin}..{end} of key {key!r}: it has {rows}"
                )
        spans = {key: (begin, end) for key in keys}
        bounds: dict[str, dict[str, np.ndarray]] = {key: {} for key in keys}
        for part in ("offsets", "items"):
            ranges, wanted = [], []
            for key in keys:
                entry, (lo, hi) = meta[key].get(part), spans[key]
                if isinstance(entry, list):  # inline (seed-style): in meta.json
                    bounds[key][part] = np.asarray(entry[lo : hi + 1], OFFSET_DTYPE)
                elif isinstance(entry, dict):
                    size = OFFSET_DTYPE.itemsize
                    ranges.append((f"{rel}/{entry['file']}", lo * size, (hi + 1) * size))
                    wanted.append(key)
            for key, data in zip(wanted, self.remote.cat_ranges(ranges)):
                bounds[key][part] = np.frombuffer(data, OFFSET_DTYPE)
            for key in keys:
                got = bounds[key].get(part)
                if got is not None:
                    spans[key] = (int(got[0]), int(got[-1]))
        ranges = []
        for key in keys:
            size, (lo, hi) = DTYPES[meta[key]["dtype"]].itemsize, spans[key]
            ranges.append((f"{rel}/{key}.bin", lo * size, hi * size))
        columns = {}
        for key, data in zip(keys, self.remote.cat_ranges(ranges)):
            rebased = {part: b - b[0] for part, b in bounds[key].items()}
            values = np.frombuffer(data, DTYPES[meta[key]["dtype"]])
            columns[key] = Column(values, rebased.get("offsets"), rebased.get("items"))
        return columns

    def _locked(self, rel: str, exclusive: bool, wait: bool = True) -> AbstractContextManager[int]:
        """Shard `rel`'s lock (made again where the cache folder was removed)."""
        return locked(lock_file(self.dir, rel), exclusive, wait)

    # --- eviction ------------------------------------------------------------------------
    def _make_room(self, rel: str, need: int) -> None:
        """Room for `need` more bytes of shard `rel` under the limit, machine-wide (the
        index's `reserve`): evicts the least recently used unclaimed shards (of any dataset
        in the folder) first; waits while other downloads are under way and nothing else can
        go; passes the limit (and says so, once) only when every shard left is being read."""
        if self.limit is None:
            return
        self.claim()
        while True:
            evicted, state = self.index.reserve(self.dir, rel, need, self.limit)
            for dataset, gone in evicted:
                if dataset == self.dir.name:
                    self.present.pop(gone, None)
            if evicted:
                self.counts.add(evictions=len(evicted))
            if state != "wait":
                break
            time.sleep(WAIT_S)
        if state == "over" and not self._warned:
            self._warned = True
            log.warning(
                "%s: every shard left in the cache is being read; its limit of %d bytes is "
                "passed until they are released",
                self.root,
                self.limit,
            )

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
        bytes, evictions, refetched files, retries of transient errors (remote_retries), ...;
        and the whole folder's bytes from its index: cached (cache_bytes), downloads under
        way (cache_reserved), the most the two ever held together (cache_peak)."""
        self._save_stats()
        index = self.index.totals()
        total: dict[str, int] = {
            "cache_bytes": index["bytes"],
            "cache_reserved": index["reserved"],
            "cache_peak": index["peak"],
        }
        for path in (self.dir / "stats").glob("*.json"):
            try:
                for k, v in json.loads(path.read_text()).items():
                    total[k] = total.get(k, 0) + v
            except (OSError, ValueError):
                continue
        return total
