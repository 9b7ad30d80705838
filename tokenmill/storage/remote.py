"""Object storage: a dataset folder at a URL (s3://, gs://, az://, any fsspec filesystem).

Object stores have no rename, so a shard is published by the order of its uploads: its
arrays and offsets first, its `meta.json` last (a reader never takes a shard without it),
and the dataset's `manifest.json` last of all (the commit point). Every remote call goes
through `retrying`: a transient error (a dropped connection, a timeout, a 5xx or a throttle)
is retried with bounded exponential backoff, counted in `STATS` and logged; anything else
(no such object, no permission) raises at once.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("tokenmill.remote")

T = TypeVar("T")

RETRY_ATTEMPTS = 6  # tries of one call in all; the waits between them double from RETRY_BASE_S
RETRY_BASE_S = 0.2
RETRY_MAX_S = 10.0


def is_url(path: Any) -> bool:
    """A URL (`s3://bucket/prefix`, `gs://...`, `file:///...`), not a local path."""
    return isinstance(path, str) and "://" in path


@dataclass
class RemoteStats:
    """What this process's remote calls did: retries of transient errors, calls that failed
    after every retry, objects fetched again after a checksum mismatch, bytes moved, byte
    ranges read."""

    retries: int = 0
    failures: int = 0
    refetches: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    ranges: int = 0  # byte ranges read (`cat_ranges`)

    def add(self, **counts: int) -> None:
        with _STATS_LOCK:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def reset(self) -> None:
        for name in self.as_dict():
            setattr(self, name, 0)


_STATS_LOCK = threading.Lock()
STATS = RemoteStats()  # this process's counts; training caches also keep them per process on disk
os.register_at_fork(after_in_child=STATS.reset)  # a forked worker counts its own calls only


# --- transient or not -----------------------------------------------------------------------
_TRANSIENT_NAMES = set(
    # botocore / aiobotocore
    "EndpointConnectionError ConnectionClosedError ReadTimeoutError ConnectTimeoutError "
    "ResponseStreamingError IncompleteReadError HTTPClientError ProxyConnectionError "
    "ResponseParserError "
    # aiohttp, http.client, urllib3, fsspec
    "ServerDisconnectedError ClientPayloadError ClientOSError ClientConnectionError "
    "ServerTimeoutError IncompleteRead RemoteDisconnected ProtocolError FSTimeoutError".split()
)
_TRANSIENT_CODES = set(
    "SlowDown ServiceUnavailable InternalError RequestTimeout Throttling ThrottlingException "
    "RequestTimeTooSkewed 503 500 502 504".split()
)


def is_transient(err: BaseException) -> bool:
    """Whether an error may pass if the call is made again: a connection dropped, refused or
    timed out, a 5xx or a throttle, anywhere in the chain of causes. A missing object or a
    refused permission is not."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if type(e).__name__ in _TRANSIENT_NAMES:
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            meta = response.get("ResponseMetadata") or {}
            code = (response.get("Error") or {}).get("Code")
            if int(meta.get("HTTPStatusCode") or 0) >= 500 or code in _TRANSIENT_CODES:
                return True
        if any(
            code in str(e)
            for code in ("SlowDown", "ServiceUnavailable", "reduce your request rate")
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def retrying(what: str, call: Callable[[], T], attempts: int | None = None) -> T:
    """`call()`, made again after a transient error with exponential backoff (and jitter),
    at most `attempts` times in all; each retry counted in STATS.retries and logged."""
    attempts = attempts or RETRY_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as err:
            _back_off(what, err, attempt, attempts)
    raise AssertionError("unreachable")


def _back_off(what: str, err: Exception, attempt: int, attempts: int) -> None:
    """Raises `err` if it is not transient or this was the last attempt; else counts a
    retry, logs it and waits before it."""
    if not is_transient(err):
        raise err
    if attempt == attempts:
        STATS.add(failures=1)
        log.error("%s: failed after %d attempts: %r", what, attempts, err)
        raise OSError(f"{what}: failed after {attempts} attempts: {err}") from err
    delay = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1)
    STATS.add(retries=1)
    log.warning("%s: %r; retry %d of %d in %.2fs", what, err, attempt, attempts - 1, delay)
    time.sleep(delay)


def retrying_each(
    what: str, items: list, batch: Callable[[list], dict], attempts: int | None = None
) -> None:
    """`batch(items)` returns {item: error} for the items that failed; those alone are tried
    again (a batch of many requests is not lost to one dropped connection), as `retrying`."""
    attempts = attempts or RETRY_ATTEMPTS
    todo = list(items)
    for attempt in range(1, attempts + 1):
        try:
            failed = batch(todo)
        except Exception as err:  # the batch failed as a whole: all of it again
            failed = dict.fromkeys(todo, err)
        if not failed:
            return
        hard = [e for e in failed.values() if not is_transient(e)]
        _back_off(what, hard[0] if hard else next(iter(failed.values())), attempt, attempts)
        todo = [item for item in todo if item in failed]
    raise AssertionError("unreachable")


# --- missing objects ------------------------------------------------------------------------
class ObjectMissing(FileNotFoundError):
    """An object a dataset needs is not in the bucket, named by its URL (where the client
    says only "The specified key does not exist.")."""


class NoSuchBucket(ObjectMissing):
    """The bucket itself does not exist: `s3://nope: no such bucket`."""


def bucket_missing(err: BaseException) -> bool:
    """Whether an error (or one of its causes) says that the bucket does not exist."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NoSuchBucket) or "NoSuchBucket" in f"{type(e).__name__} {e}":
            return True
        if "specified bucket does not exist" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


# --- the filesystem -------------------------------------------------------------------------
def client_options(protocol: str, given: dict[str, Any] | None) -> dict[str, Any]:
    """Storage options for fsspec: the user's, plus (for s3, where not set) botocore's own
    silent retries turned off, so that `retrying` sees, backs off and counts every transient
    error. `endpoint_url` and credentials come from the options or the usual environment
    (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). The filesystem is this Remote's own (not
    fsspec's shared instance), as its retry settings are."""
    options = {"skip_instance_cache": True, **(given or {})}
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config
    return options


class Remote:
    """A dataset folder at a URL: paths relative to it, every call retried (`retrying`).

    `storage_options` go to fsspec as they are; `{"filesystem": fs}` passes a filesystem
    object instead (an fsspec one, or a `pyarrow.fs.FileSystem`, wrapped for fsspec), and the
    URL's path is then its path on that filesystem.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._fs, root = _filesystem(self.url, self.storage_options)
        self._pid = os.getpid()
        self.root = root.rstrip("/")

    def __reduce__(self) -> Any:  # DataLoader workers and Ray tasks open their own client
        return (Remote, (self.url, self.storage_options))

    @property
    def fs(self) -> Any:
        """This process's filesystem client: a forked DataLoader worker makes its own (an
        async client's event loop does not survive a fork)."""
        if self._pid != os.getpid():
            self._fs, _ = _filesystem(self.url, self.storage_options)
            self._pid = os.getpid()
        return self._fs

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def where(self, rel: str) -> str:
        """The URL of `rel`, for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    def missing(self, rel: str, err: BaseException) -> ObjectMissing:
        """The error for object `rel` not found (`err`, the client's), naming it by its URL,
        or naming the bucket where the bucket is what does not exist."""
        if bucket_missing(err):
            scheme, _, path = self.url.partition("://")
            return NoSuchBucket(f"{scheme}://{path.split('/')[0]}: no such bucket")
        return ObjectMissing(f"{self.where(rel)}: no such object")

    # --- reads --------------------------------------------------------------------------
    def cat(self, rel: str) -> bytes:
        try:
            data = retrying(f"get {self.where(rel)}", lambda: self.fs.cat_file(self.path(rel)))
        except FileNotFoundError as err:
            raise self.missing(rel, err) from None
        STATS.add(bytes_down=len(data))
        return bytes(data)

    def cat_many(self, rels: list[str]) -> dict[str, bytes]:
        """Small objects read concurrently (where the filesystem can): rel -> bytes."""
        out: dict[str, bytes] = {}

        def batch(todo: list[str]) -> dict[str, Exception]:
            paths = [self.path(r) for r in todo]
            got = self.fs.cat(paths, on_error="return")
            if not isinstance(got, dict):
                got = {paths[0]: got}
            failed = {}
            for rel, path in zip(todo, paths):
                data = got.get(path, got.get(self.fs._strip_protocol(path)))
                if data is None:
                    data = FileNotFoundError(self.where(rel))
                if isinstance(data, Exception):
                    failed[rel] = data
                else:
                    out[rel] = bytes(data)
            return failed

        retrying_each(f"get {len(rels)} objects of {self.url}", list(rels), batch)
        STATS.add(bytes_down=sum(len(d) for d in out.values()))
        return {rel: out[rel] for rel in rels}

    def cat_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Byte ranges [start, end) of objects (HTTP range GETs, concurrent where the
        filesystem can): a few rows of a large shard without downloading it. Each range
        must come back whole (a short one raises naming the object)."""
        if not ranges:
            return []
        paths = [self.path(rel) for rel, _, _ in ranges]
        starts = [start for _, start, _ in ranges]
        ends = [end for _, _, end in ranges]
        what = f"get {len(ranges)} byte ranges of {self.url}"
        got = retrying(what, lambda: self.fs.cat_ranges(paths, starts, ends))
        out = []
        for (rel, start, end), data in zip(ranges, got):
            if isinstance(data, FileNotFoundError):
                raise self.missing(rel, data) from None
            if isinstance(data, Exception):
                raise data
            if len(data) != end - start:
                raise ValueError(
                    f"{self.where(rel)}: bytes {start}..{end} came back as {len(data)} bytes; "
                    "the object is shorter than its meta.json says"
                )
            out.append(bytes(data))
        STATS.add(bytes_down=sum(len(d) for d in out), ranges=len(out))
        return out

    def exists(self, rel: str) -> bool:
        return bool(retrying(f"stat {self.where(rel)}", lambda: self.fs.exists(self.path(rel))))

    def listing(self, rel: str = "") -> dict[str, int]:
        """Every object below `rel`, by its path relative to the dataset folder (not to
        `rel`) -> its size; {} if none."""
        base = self.path(rel)

        def find() -> dict:
            self.fs.invalidate_cache()
            try:
                return self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}

        found = retrying(f"list {self.where(rel)}", find)
        out = {}
        for path, info in found.items():
            path = self.fs._strip_protocol(path).rstrip("/")
            if info.get("type") == "directory" or not path.startswith(self.root + "/"):
                continue
            out[path[len(self.root) + 1 :]] = int(info.get("size") or 0)
        return out

    def get(self, pairs: list[tuple[str, Path]], sizes: list[int] | None = None) -> None:
        """Downloads objects to local files, concurrently where the filesystem can; after a
        transient error, only the files not yet whole (`sizes`, when given) again."""
        if not pairs:
            return
        expected = dict(zip(pairs, sizes)) if sizes is not None else {}

        def batch(todo: list[tuple[str, Path]]) -> dict:
            try:
                self.fs.get([self.path(r) for r, _ in todo], [str(p) for _, p in todo])
                return {}
            except Exception as err:
                if not is_transient(err):
                    raise
                return {pair: err for pair in todo if not _whole(pair[1], expected.get(pair))}

        what = f"get {pairs[0][0]}" + (f" and {len(pairs) - 1} more" if len(pairs) > 1 else "")
        try:
            retrying_each(f"{what} of {self.url}", list(pairs), batch)
        except FileNotFoundError as err:  # an object gone (which: the client may not say),
            gone = next((r for r, _ in pairs if not self.exists(r)), None)
            if gone is None:  # or a local folder removed under the download
                raise
            raise self.missing(gone, err) from None
        STATS.add(bytes_down=sum(os.path.getsize(p) for _, p in pairs))

    # --- writes -------------------------------------------------------------------------
    def pipe(self, rel: str, data: bytes) -> None:
        retrying(f"put {self.where(rel)}", lambda: self.fs.pipe_file(self.path(rel), data))
        STATS.add(bytes_up=len(data))

    def put(self, pairs: list[tuple[Path, str]]) -> None:
        """Uploads local files, concurrently where the filesystem can; each object whole."""
        if not pairs:
            return
        lpaths = [str(p) for p, _ in pairs]
        rpaths = [self.path(r) for _, r in pairs]
        what = f"put {pairs[0][1]}" + (f" and {len(pairs) - 1} more" if len(pairs) > 1 else "")
        retrying(f"{what} to {self.url}", lambda: self.fs.put(lpaths, rpaths))
        STATS.add(bytes_up=sum(os.path.getsize(p) for p in lpaths))

    def remove(self, rels: list[str]) -> None:
        """Deletes these objects (those already gone are fine)."""
        if not rels:
            return
        paths = [self.path(r) for r in rels]

        def rm() -> None:
            try:
                self.fs.rm(paths)
            except FileNotFoundError:  # some were gone: the others one by one
                for path in paths:
                    try:
                        self.fs.rm_file(path)
                    except FileNotFoundError:
                        pass

        retrying(f"delete {len(rels)} objects of {self.url}", rm)

    def remove_all(self, rel: str = "") -> None:
        """Deletes every object below `rel`."""
        self.remove(sorted(self.listing(rel)))

    def upload_shard(self, local: Path, rel: str) -> None:
        """A staged shard folder (or JSONL part) uploaded: for a folder, every file but
        meta.json first, then meta.json, which publishes it."""
        local = Path(local)
        if local.is_file():
            self.put([(local, rel)])
            return
        files = sorted(p for p in local.iterdir() if p.is_file() and p.name != "meta.json")
        self.put([(p, f"{rel}/{p.name}") for p in files])
        self.put([(local / "meta.json", f"{rel}/meta.json")])


def _whole(path: Path, size: int | None) -> bool:
    """A downloaded file is there with its size (unknown size: never taken as whole)."""
    try:
        return size is not None and os.path.getsize(path) == size
    except OSError:
        return False


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    given = options.get("filesystem")
    if given is not None:
        fs = given
        if not isinstance(fs, fsspec.AbstractFileSystem):  # a pyarrow.fs.FileSystem
            from fsspec.implementations.arrow import ArrowFSWrapper

            fs = ArrowFSWrapper(fs)
        return fs, fs._strip_protocol(url)
    protocol = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url, **client_options(protocol, options))
    except ImportError as err:
        raise ImportError(
            f"{url}: the {protocol}:// filesystem is not installed ({err}); for S3 "
            "pip install 'tokenmill[s3]', for others the fsspec package of that store "
            "(gcsfs, adlfs, ...)"
        ) from None
    if hasattr(fs, "retries") and "retries" not in options:
        fs.retries = 1  # s3fs: its own silent retries off, as botocore's
    return fs, path


def parse_size(size: int | str | None) -> int | None:
    """Bytes from 20GB, 500MiB, 1.5TB or an int; None stays None (no limit)."""
    if size is None or isinstance(size, int):
        return size
    text = str(size).strip().upper().replace(" ", "")
    units = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    for power, prefix in enumerate("KMGT", start=1):
        units[prefix] = units[prefix + "B"] = 1000**power
    number = text.rstrip("KMGTIB")
    try:
        return int(float(number) * units[text[len(number) :]])
    except (ValueError, KeyError):
        raise ValueError(
            f"cannot read the size {size!r}; write it as 20GB, 500MiB or bytes"
        ) from None
