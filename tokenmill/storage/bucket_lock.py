"""A run's lock in the bucket (`PREFIX/.tokenmill-lock`): two runs writing the same prefix
from different machines do not both proceed (the local output lock covers one machine).

Taken with a conditional put (S3 `If-None-Match: "*"`: the put fails if the object exists),
the object naming the holder (pid, host, start, run id); a heartbeat thread rewrites it
every `HEARTBEAT_S` with `If-Match` on its own ETag, so a run that lost its lock learns it
and stops before its commit. A lock not rewritten for `STALE_S` (by the server's clock,
LastModified), or one whose holder ran on this machine and is gone, belongs to a dead
run: it is taken over by a put conditional on the stale lock's ETag (`If-Match`), so of
two runs taking it over one wins. Removed at the end.
Stores without conditional writes (not S3) get a lock checked then written: advisory."""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from tokenmill.storage.remote import Remote, bucket_missing, retrying

log = logging.getLogger("tokenmill.remote")

LOCK = ".tokenmill-lock"
HEARTBEAT_S = 30.0
STALE_S = 180.0


class BucketLock:
    """The lock of the run writing `remote`'s prefix (see the module docstring)."""

    def __init__(
        self, remote: Remote, stale_s: float | None = None, heartbeat_s: float | None = None
    ):
        self.remote = remote
        self.etag: str | None = None
        self.run_id: str | None = None
        self.stale_s = STALE_S if stale_s is None else stale_s
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "boot": _boot_id(),
            "started": started,
        }
        self.lost = False
        self.refreshed = time.monotonic()  # when the server last took our write
        self._writing = threading.Lock()  # one write of the lock at a time (run and heartbeat)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._s3 = hasattr(remote.fs, "call_s3")

    def _key(self) -> tuple[str, str]:
        bucket, key, _ = self.remote.fs.split_path(self.remote.path(LOCK))
        return bucket, key

    def _body(self) -> bytes:
        return json.dumps({**self.holder, "run_id": self.run_id, "at": time.time()}).encode()

    def _put(self, **condition: str) -> str | None:
        """The lock written under `condition`; its ETag, or None when the condition failed."""
        if not self._s3:
            if condition.get("IfNoneMatch") and self.remote.exists(LOCK):
                return None
            self.remote.pipe(LOCK, self._body())
            return "advisory"
        bucket, key = self._key()
        try:
            out = retrying(
                f"put {self.remote.where(LOCK)}",
                lambda: self.remote.fs.call_s3(
                    "put_object", Bucket=bucket, Key=key, Body=self._body(), **condition
                ),
            )
        except FileNotFoundError as err:  # If-Match on a lock that is gone (404)
            if bucket_missing(err):
                raise self.remote.missing(LOCK, err) from None
            return None
        except OSError as err:  # 412 Precondition Failed (s3fs: FileExistsError or EINVAL)
            if "pre-condition" in str(err) or "Precondition" in str(err):
                return None
            raise
        return str(out["ETag"])

    def _read(self) -> tuple[dict[str, Any], str | None, float] | None:
        """(the lock's holder, its ETag, seconds since it was written) or None: no lock."""
        try:
            if not self._s3:
                return holder_of(self.remote.cat(LOCK)), None, 0.0
            bucket, key = self._key()
            head = retrying(
                f"stat {self.remote.where(LOCK)}",
                lambda: self.remote.fs.call_s3("head_object", Bucket=bucket, Key=key),
            )
            body = holder_of(self.remote.cat(LOCK))
        except FileNotFoundError as err:
            if bucket_missing(err):
                raise
            return None
        headers = head.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        now = parsedate_to_datetime(headers["date"]).timestamp() if "date" in headers else None
        age = (now or time.time()) - head["LastModified"].timestamp()  # by the server's clock
        return body, str(head["ETag"]), age

    def acquire(self) -> None:
        """Takes the lock, or raises FileExistsError naming the live run holding it."""
        for _ in range(5):
            self.etag = self._put(IfNoneMatch="*")
            if self.etag is not None:
                break
            found = self._read()
            if found is None:
                continue  # released meanwhile: again
            holder, etag, age = found
            if etag is not None and all(holder.get(k) == v for k, v in self.holder.items()):
                self.etag, self.refreshed = etag, time.monotonic()  # ours: a retried put
                break
            if etag is not None and (age > self.stale_s or self._dead_here(holder)):
                log.warning(
                    "%s: taking over a stale lock (%s, last written %.0f s ago)",
                    self.remote.where(LOCK),
                    describe(holder),
                    age,
                )
                self.etag = self._put(IfMatch=etag)
                if self.etag is not None:
                    self.refreshed = time.monotonic()
                    break
                continue  # another run took it over first
            stale = (
                f"a lock not refreshed for {self.stale_s:.0f} s is taken over"
                if etag is not None
                else f"this store has no conditional writes: remove {self.remote.where(LOCK)} "
                "once that run is dead"
            )
            if UNKNOWN in holder:
                stale += f"; if no run writes there, remove {self.remote.where(LOCK)} yourself"
            raise FileExistsError(
                f"{self.remote.url}: another run is writing this prefix ({describe(holder)}, "
                f"lock last written {age:.0f} s ago); wait for it to finish or stop it, then "
                f"run again ({stale})"
            )
        if self.etag is None:
            raise FileExistsError(f"{self.remote.where(LOCK)}: could not take the lock")
        self._thread = threading.Thread(target=self._beat, name="tokenmill-lock", daemon=True)
        self._thread.start()

    def _dead_here(self, holder: dict[str, Any]) -> bool:
        """The holder ran on this machine and its process is gone (a killed run: its lock
        is taken over at once, not after STALE_S)."""
        same = all(holder.get(k) == self.holder[k] for k in ("host", "boot"))
        if not same or not self.holder["boot"] or not isinstance(holder.get("pid"), int):
            return False  # another machine (or one we cannot tell apart): wait for STALE_S
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def set_run_id(self, run_id: str) -> None:
        self.run_id = run_id
        self.refresh()

    def refresh(self) -> None:
        """The lock written again (If-Match its ETag); a lock another run took is `lost`. A
        failed condition on a lock that still names this run (a retried put whose first try
        went through) keeps the lock."""
        with self._writing:
            if self.etag is None or self.lost:
                return
            etag = self._put(IfMatch=self.etag) if self._s3 else self._put()
            if etag is None:
                found = self._read()
                if found is not None and found[1] is not None and self._ours(found[0]):
                    etag = found[1]
            if etag is None:
                self.lost = True
                log.error("%s: the lock was taken over by another run", self.remote.where(LOCK))
            else:
                self.etag, self.refreshed = etag, time.monotonic()

    def _ours(self, holder: dict[str, Any]) -> bool:
        return holder.get("run_id") == self.run_id and all(
            holder.get(k) == v for k, v in self.holder.items()
        )

    def check(self, server: bool = False) -> None:
        """Raises if this run may no longer hold the lock. `server` (before the commit): the
        lock rewritten on condition that it is still this run's write (If-Match its ETag),
        however late the heartbeats were (a loaded machine): held, and fresh for `stale_s`
        while the commit uploads, or lost. Otherwise judged by age: not refreshed for
        `stale_s`, another run may have taken it meanwhile."""
        if not self.lost and server:
            if not self._s3:  # no conditional write: the content read back, then rewritten
                with self._writing:
                    found = self._read()
                    self.lost = found is None or not self._ours(found[0])
            self.refresh()
        elif not self.lost and time.monotonic() - self.refreshed > self.stale_s:
            self.lost = True  # heartbeats kept failing: another run may hold it now
        if self.lost:
            raise RuntimeError(
                f"{self.remote.where(LOCK)}: this run no longer holds the prefix's lock (taken "
                f"over, or not refreshed for {self.stale_s:.0f} s); stopping before writing more"
            )

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.refresh()
            except Exception as err:  # a failed heartbeat: the next one tries again
                log.warning("%s: heartbeat failed: %r", self.remote.where(LOCK), err)

    def release(self) -> None:
        """The heartbeat stopped and the lock removed, if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.etag is None or self.lost:
            return
        found = self._read()
        if found is not None and (found[1] is None or found[1] == self.etag):
            self.remote.remove([LOCK])
        self.etag = None


def _boot_id() -> str:
    """This boot of this machine: hosts can share a name (containers), never a boot id."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


UNKNOWN = "unknown"  # a holder's key where the lock's body names no tokenmill run


def holder_of(body: bytes) -> dict[str, Any]:
    """The holder a lock's body names: its JSON object; anything else (not JSON, not an
    object: not written by tokenmill) a holder of `UNKNOWN` kind, not a traceback."""
    try:
        holder = json.loads(body)
    except ValueError:
        holder = None
    if isinstance(holder, dict):
        return holder
    shown = body[:40].decode(errors="replace")
    return {UNKNOWN: f"{len(body)} bytes that are not a tokenmill lock: {shown!r}"}


def describe(holder: dict[str, Any]) -> str:
    if UNKNOWN in holder:
        return f"an unknown run: the lock holds {holder[UNKNOWN]}"
    run = f", run {str(holder['run_id'])[:12]}" if holder.get("run_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}{run}"
