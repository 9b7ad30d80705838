"""The machine's cache index and ledger: one SQLite file in the cache folder (`.index.sqlite`)
that every process using the folder reads and writes under one file lock (`.index.lock`).

It holds every cached shard (dataset folder, shard, bytes, last use; a running total kept by
triggers), the downloads under way (`reserved`: their bytes count against the limit before
they land), and each live process's claims on shards: kept (the shards its sample order
reads next: evicted only when nothing else can go) or read later (evicted after the unclaimed
ones, the one read last first). So the limit holds for the whole machine, and choosing the
victims of one download costs O(log n) in the shards cached plus the victims and claims
passed over: the folder is never walked (but once, to index a cache made before the index).

A process is alive while it holds the flock on its own file `.owners/<owner>.lock`: the lock
dies with the process (no timeout, no heartbeat), and a process that finds it free removes
that owner's claims and downloads. Eviction takes a shard's own lock (cache_files.lock_file)
without waiting, so a shard being read or downloaded is passed over, renames its folder away
and deletes it (a process that has its files mapped keeps reading its pages).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from tokenmill.shards.files import locked
from tokenmill.storage.cache_files import CHECKED, lock_file

INDEX = ".index.sqlite"
KEEP = -1  # a claim's rank for a shard kept (read next); later shards rank 0, 1, ... in order
BATCH = 64  # victims looked at per query

SCHEMA = """
CREATE TABLE IF NOT EXISTS shards(
    dataset TEXT NOT NULL, rel TEXT NOT NULL, bytes INTEGER NOT NULL, used REAL NOT NULL,
    PRIMARY KEY(dataset, rel));
CREATE INDEX IF NOT EXISTS shards_used ON shards(used);
CREATE TABLE IF NOT EXISTS claims(
    owner TEXT NOT NULL, dataset TEXT NOT NULL, rel TEXT NOT NULL, rank INTEGER NOT NULL,
    PRIMARY KEY(owner, dataset, rel));
CREATE INDEX IF NOT EXISTS claims_shard ON claims(dataset, rel);
CREATE TABLE IF NOT EXISTS reserved(
    owner TEXT NOT NULL, dataset TEXT NOT NULL, rel TEXT NOT NULL, bytes INTEGER NOT NULL,
    PRIMARY KEY(dataset, rel));
CREATE TABLE IF NOT EXISTS totals(name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES ('bytes', 0), ('peak', 0);
CREATE TRIGGER IF NOT EXISTS shards_in AFTER INSERT ON shards BEGIN
    UPDATE totals SET value = value + new.bytes WHERE name = 'bytes'; END;
CREATE TRIGGER IF NOT EXISTS shards_out AFTER DELETE ON shards BEGIN
    UPDATE totals SET value = value - old.bytes WHERE name = 'bytes'; END;
CREATE TRIGGER IF NOT EXISTS shards_size AFTER UPDATE OF bytes ON shards BEGIN
    UPDATE totals SET value = value - old.bytes + new.bytes WHERE name = 'bytes'; END;
"""

# this process's owner name and the descriptor holding its lock, per cache folder
_OWNERS: dict[Path, tuple[str, int]] = {}
_OWNERS_LOCK = threading.Lock()


def _forget_owners() -> None:
    """A forked child is not its parent: it closes its copies of the parent's owner locks
    (the parent keeps holding them) and registers as an owner of its own."""
    for _, fd in _OWNERS.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _OWNERS.clear()


os.register_at_fork(after_in_child=_forget_owners)


def owner_of(root: Path) -> str:
    """This process's owner name in the cache folder `root`, its lock taken on first use."""
    with _OWNERS_LOCK:
        known = _OWNERS.get(root)
        if known is not None:
            return known[0]
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        folder = root / ".owners"
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours for as long as this process lives
        _OWNERS[root] = (name, fd)
        return name


def alive(root: Path, owner: str) -> bool:
    """Whether `owner` (of the cache folder `root`) still holds its lock; a dead one's lock
    file is removed."""
    path = root / ".owners" / f"{owner}.lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)
    return False


def usage(root: Path) -> list[tuple[float, Path, Path, int]]:
    """(last use, shard folder, its dataset folder, bytes) of every shard in the cache
    folder `root`, found by walking it: only to index a cache made before the index."""
    found = []
    for dataset in root.iterdir() if root.is_dir() else []:
        for folder, _, names in os.walk(dataset / "shards"):
            if CHECKED not in names:
                continue
            try:
                size = sum(os.path.getsize(os.path.join(folder, n)) for n in names if n[0] != ".")
                found.append((os.stat(folder).st_mtime, Path(folder), dataset, size))
            except FileNotFoundError:
                continue
    return found


def shard_bytes(folder: Path) -> int:
    """The bytes of a shard folder's files (a few files: not a walk of the cache)."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            if entry.name[0] != "." and entry.is_file():
                total += entry.stat().st_size
    return total


class CacheIndex:
    """The index and ledger of the cache folder `root` (see the module docstring). One
    connection per process, used by its threads one at a time."""

    def __init__(self, root: Path):
        self.root = root
        self._db: sqlite3.Connection | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"root": self.root}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"])  # type: ignore[misc]

    @property
    def owner(self) -> str:
        return owner_of(self.root)

    @contextlib.contextmanager
    def txn(self) -> Iterator[sqlite3.Connection]:
        """A transaction under the folder's index lock, which every process waits for (a
        flock: it dies with its holder, never taken away from a slow one)."""
        with self._lock, locked(self.root / ".index.lock"):
            db = self._connect()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _connect(self) -> sqlite3.Connection:
        """This process's connection (a forked child opens its own); a folder without an
        index (made before it) is indexed from one walk. Called under the index lock."""
        if self._db is not None and self._pid == os.getpid():
            return self._db
        path = self.root / INDEX
        fresh = not path.exists()
        # the index lock is what serialises: SQLite's own lock then never waits
        db = sqlite3.connect(path, timeout=600, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        if fresh:
            shutil.rmtree(self.root / ".trash", ignore_errors=True)
            db.executemany(
                "INSERT OR REPLACE INTO shards VALUES (?, ?, ?, ?)",
                [
                    (dataset.name, folder.relative_to(dataset / "shards").as_posix(), size, used)
                    for used, folder, dataset, size in usage(self.root)
                ],
            )
        self._db, self._pid = db, os.getpid()
        return db

    # --- shards ---------------------------------------------------------------------------
    def touch(self, dataset: Path, rel: str, now: float) -> None:
        """A shard marked as just used; one in the folder but not in the index (a download
        killed between its rename and its entry) is entered with its size."""
        with self.txn() as db:
            cur = db.execute(
                "UPDATE shards SET used = ? WHERE dataset = ? AND rel = ?",
                (now, dataset.name, rel),
            )
            if cur.rowcount == 0:
                size = shard_bytes(dataset / "shards" / rel)
                if size:
                    db.execute(
                        "INSERT INTO shards VALUES (?, ?, ?, ?)", (dataset.name, rel, size, now)
                    )

    def landed(self, dataset: Path, rel: str, now: float) -> None:
        """A download done (or failed): its reservation released, the shard's bytes entered
        as its folder now holds them."""
        size = shard_bytes(dataset / "shards" / rel)
        with self.txn() as db:
            db.execute("DELETE FROM reserved WHERE dataset = ? AND rel = ?", (dataset.name, rel))
            if size:
                db.execute(
                    "INSERT INTO shards VALUES (?, ?, ?, ?) ON CONFLICT DO UPDATE "
                    "SET bytes = excluded.bytes, used = excluded.used",
                    (dataset.name, rel, size, now),
                )
            else:
                db.execute("DELETE FROM shards WHERE dataset = ? AND rel = ?", (dataset.name, rel))

    def totals(self) -> dict[str, int]:
        """Bytes of the shards cached, of the downloads under way, and the most the two
        together ever were (`peak`), machine-wide."""
        with self.txn() as db:
            out = dict(db.execute("SELECT name, value FROM totals").fetchall())
            out["reserved"] = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM reserved").fetchone()[
                0
            ]
        return out

    def unwanted(self, dataset: Path, rel: str, size: int, limit: int) -> bool:
        """Whether a shard of `size` bytes would only push others out: no process keeps it or
        reads it later, and the cache has no room for it without evicting."""
        with self.txn() as db:
            claimed = db.execute(
                "SELECT 1 FROM claims WHERE dataset = ? AND rel = ? LIMIT 1", (dataset.name, rel)
            ).fetchone()
            return claimed is None and self._used(db) + size > limit

    # --- claims ---------------------------------------------------------------------------
    def claim(self, dataset: Path, keep: set[str], later: dict[str, int]) -> None:
        """This process's claims on a dataset's shards replaced by these."""
        owner = self.owner
        rows = [(owner, dataset.name, rel, KEEP) for rel in keep]
        rows += [(owner, dataset.name, rel, rank) for rel, rank in later.items() if rel not in keep]
        with self.txn() as db:
            db.execute("DELETE FROM claims WHERE owner = ? AND dataset = ?", (owner, dataset.name))
            db.executemany("INSERT INTO claims VALUES (?, ?, ?, ?)", rows)

    def lookers(self) -> int:
        """The live processes with claims (this one counted): they share the look-ahead."""
        owner = self.owner
        with self.txn() as db:
            owners = [r[0] for r in db.execute("SELECT DISTINCT owner FROM claims")]
            dead = [o for o in owners if o != owner and not alive(self.root, o)]
            self._drop(db, dead)
        return len(set(owners) - set(dead) | {owner})

    def _drop(self, db: sqlite3.Connection, owners: list[str]) -> None:
        for o in owners:
            db.execute("DELETE FROM claims WHERE owner = ?", (o,))
            db.execute("DELETE FROM reserved WHERE owner = ?", (o,))

    def _sweep(self, db: sqlite3.Connection) -> bool:
        """Claims and downloads of processes that died removed; whether there were any."""
        owners = {
            r[0] for r in db.execute("SELECT owner FROM claims UNION SELECT owner FROM reserved")
        }
        dead = [o for o in owners if o != self.owner and not alive(self.root, o)]
        self._drop(db, dead)
        return bool(dead)

    # --- eviction -------------------------------------------------------------------------
    def reserve(self, dataset: Path, rel: str, need: int, limit: int) -> tuple[list, str]:
        """Room for a download of `need` bytes of a shard under `limit`, machine-wide:
        evicts (in the order of `_candidates`) until the shards cached and the downloads
        under way fit, and reserves the bytes. Returns ((dataset folder name, shard) of each
        evicted, "fits" | "wait" | "over"): "wait" reserves nothing, as another download is
        under way (it lands as a shard that can go) or a shard is being mapped (it is soon
        released): the caller tries again; "over" reserves past the limit, as nothing left
        can go (the caller warns)."""
        evicted: list[tuple[str, str]] = []
        reading = False  # a shard passed over is being read: it is released soon
        with self.txn() as db:
            db.execute("DELETE FROM reserved WHERE dataset = ? AND rel = ?", (dataset.name, rel))
            over = self._used(db) + need - limit
            for attempt in (1, 2):
                for victim, size in self._candidates(db, (dataset.name, rel), over):
                    moved = self._move_away(*victim)
                    if moved in ("read", "busy"):
                        reading = reading or moved == "read"
                        continue  # being read or downloaded: passed over
                    db.execute("DELETE FROM shards WHERE dataset = ? AND rel = ?", victim)
                    if isinstance(moved, Path):  # deleted now: the disk holds the limit
                        shutil.rmtree(moved, ignore_errors=True)
                        evicted.append(victim)
                    over -= size  # (an entry whose folder was gone held no room either)
                    if over <= 0:
                        break
                if over <= 0 or attempt == 2 or not self._sweep(db):
                    break
                over = self._used(db) + need - limit  # the dead's downloads are gone
            state = "fits" if over <= 0 else "over"
            if state == "over" and (
                reading or db.execute("SELECT 1 FROM reserved LIMIT 1").fetchone()
            ):
                state = "wait"
            else:
                db.execute(
                    "INSERT INTO reserved VALUES (?, ?, ?, ?)",
                    (self.owner, dataset.name, rel, need),
                )
                db.execute(
                    "UPDATE totals SET value = MAX(value, ?) WHERE name = 'peak'",
                    (self._used(db),),
                )
        return evicted, state

    def _used(self, db: sqlite3.Connection) -> int:
        cached = db.execute("SELECT value FROM totals WHERE name = 'bytes'").fetchone()[0]
        return cached + db.execute("SELECT COALESCE(SUM(bytes), 0) FROM reserved").fetchone()[0]

    def _candidates(
        self, db: sqlite3.Connection, spare: tuple[str, str], over: int
    ) -> Iterator[tuple[tuple[str, str], int]]:
        """The shards to evict, in order, while room is wanted (`over` > 0): the unclaimed
        ones least recently used first; then those some process reads later, the one read
        last first (a shard's soonest read counts); then the kept ones, least recently used
        first. Fetched BATCH at a time from the index: O(log n) a batch. `spare` (the shard
        downloaded) is never one."""
        if over <= 0:
            return
        for query in QUERIES:
            after: tuple[float, int] = (float("-inf"), -1)
            while True:
                rows = db.execute(query, (after[0], after[0], after[1], BATCH)).fetchall()
                for dataset, rel, size, key, rowid in rows:
                    after = (key, rowid)
                    if (dataset, rel) != spare:
                        yield (dataset, rel), size
                if len(rows) < BATCH:
                    break

    def _move_away(self, dataset: str, rel: str) -> Path | str:
        """The shard's folder renamed into `.trash` (returned) under its lock taken without
        waiting; else "read" (held shared: being mapped or checked, soon released), "busy"
        (held exclusive: being downloaded), or "gone" (no such folder)."""
        trash = self.root / ".trash" / uuid.uuid4().hex
        try:
            fd = os.open(lock_file(self.root / dataset, rel), os.O_RDWR)
        except FileNotFoundError:
            fd = -1  # never locked here: nobody holds it
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        return "busy"
                    return "read"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.root / dataset / "shards" / rel, trash)
        except FileNotFoundError:
            return "gone"
        finally:
            if fd >= 0:
                os.close(fd)
        return trash


# the eviction order's three passes (see `_candidates`), each paged by (key, rowid): the
# first walks the index of last use, the others the claims (a look-ahead's worth of rows)
_AFTER = "%s >= ? AND (%s > ? OR s.rowid > ?)"
_CLAIMS = (
    "(SELECT dataset, rel, MIN(rank) AS r FROM claims GROUP BY dataset, rel) m "
    "JOIN shards s ON s.dataset = m.dataset AND s.rel = m.rel"
)
QUERIES = (
    "SELECT s.dataset, s.rel, s.bytes, s.used, s.rowid FROM shards s "
    f"WHERE {_AFTER % ('s.used', 's.used')} AND NOT EXISTS (SELECT 1 FROM claims c "
    "WHERE c.dataset = s.dataset AND c.rel = s.rel) ORDER BY s.used, s.rowid LIMIT ?",
    f"SELECT s.dataset, s.rel, s.bytes, -m.r, s.rowid FROM {_CLAIMS} "
    f"WHERE m.r >= 0 AND {_AFTER % ('-m.r', '-m.r')} ORDER BY -m.r, s.rowid LIMIT ?",
    f"SELECT s.dataset, s.rel, s.bytes, s.used, s.rowid FROM {_CLAIMS} "
    f"WHERE m.r < 0 AND {_AFTER % ('s.used', 's.used')} ORDER BY s.used, s.rowid LIMIT ?",
)
