"""Output to object storage: a run staged here, its shards uploaded as they are published.

Object stores have no rename, so the local writers stage and publish each shard in a local
staging folder as always, and a background thread uploads it: first the journal lines that
account for its rows (one new segment, `.tokenmill-run/journal/NNNNNNNN.jsonl`), then its
arrays and offsets, then its `meta.json` (which publishes it); the local copy is then
removed, so staging holds a few shards at most. The Ray engine's write tasks upload their
shards themselves, after the driver has uploaded the journal. `commit` uploads
`rejects.jsonl`, then `manifest.json` last (the commit point), then removes the run folder.

A resumed run, on this machine or another, rebuilds its journal from the bucket's segments
(merged by chunk index: a chunk's line is the same whichever run wrote it) and takes as
published, in each domain, the shards with a `meta.json` from shard 0 up to the first one
missing; whatever follows (a shard without `meta.json`, one past a gap) is deleted.
"""

from __future__ import annotations

import contextlib
import queue
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import xxhash

from tokenmill.preprocess.run.runlog import Summary, part_info, shard_info
from tokenmill.shards.format import RUN_DIR
from tokenmill.shards.manifest import parse_manifest
from tokenmill.storage.bucket_lock import LOCK, BucketLock
from tokenmill.storage.remote import Remote

_SHARD_FILE = re.compile(r"^(?:(?P<domain>.+)/)?(?P<name>shard_(?P<index>\d+))/(?P<file>[^/]+)$")
_PART = re.compile(r"^(?:(?P<domain>.+)/)?(?P<name>part_(?P<index>\d+)\.jsonl)(?P<tmp>\.tmp-.*)?$")
JOURNAL = f"{RUN_DIR}/journal"
IN_FLIGHT = 2  # published shards waiting for upload before the writers wait (bounds staging)


def default_staging(url: str) -> Path:
    """Where a run to `url` is staged by default: the system temp folder (TMPDIR)."""
    return (
        Path(tempfile.gettempdir()) / "tokenmill-staging" / xxhash.xxh64(url.encode()).hexdigest()
    )


class BucketOutput:
    """A run's output at a URL, staged in `staging` (see the module's docstring)."""

    def __init__(
        self,
        url: str | Remote,
        storage_options: dict[str, Any] | None = None,
        staging: str | Path | None = None,
    ):
        """`url`: the output's URL (`storage_options` go to fsspec), or its client."""
        self.remote = url if isinstance(url, Remote) else Remote(url, storage_options)
        self.url = self.remote.url
        self.local = Path(staging or default_staging(self.url)).absolute()
        self._published: dict[str, list[str]] = {}  # domain -> shard names in the bucket
        self._seen: dict[int, int] = {}  # id(writer) -> published shards handed to the uploader
        self._journal_lock = threading.Lock()
        self._uploaded = 0  # bytes of the local journal already in the bucket
        self._segment = 0  # number of the next journal segment
        self._queue: queue.Queue = queue.Queue(IN_FLIGHT)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.lock = BucketLock(self.remote)  # held by the run, inside the staging folder's lock

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The prefix's lock in the bucket (`storage/bucket_lock.py`), for the whole run."""
        self.lock.acquire()
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the run's own error is the one to see
                self.lock.release()
            raise
        self.lock.release()

    def __str__(self) -> str:
        return self.url

    def rel(self, domain: str, name: str = "") -> str:
        return "/".join(p for p in (domain, name) if p)

    # --- before the run ------------------------------------------------------------------
    def prepare(self, run_id: str, inputs: list[list], overwrite: bool) -> Summary | None:
        """The bucket side of Pipeline._prepare_output: a fresh staging folder, and the
        bucket emptied (overwrite), left as it is (the same job finished: its summary), or
        reconciled for a resume. Another job's data is refused."""
        try:
            done = self._prepare(run_id, inputs, overwrite)
        except BaseException:
            shutil.rmtree(self.local, ignore_errors=True)
            raise
        if done is not None:
            shutil.rmtree(self.local, ignore_errors=True)
        return done

    def _prepare(self, run_id: str, inputs: list[list], overwrite: bool) -> Summary | None:
        shutil.rmtree(self.local, ignore_errors=True)
        (self.local / RUN_DIR).mkdir(parents=True)
        self.lock.set_run_id(run_id)
        listing = {k: v for k, v in self.remote.listing().items() if k != LOCK}
        ours = "manifest.json" in listing or any(k.startswith(RUN_DIR + "/") for k in listing)
        if overwrite and listing:
            if not ours:
                raise FileExistsError(
                    f"{self.url} is not a tokenmill output (no manifest.json, no {RUN_DIR}/): "
                    "--overwrite replaces only what tokenmill wrote; remove it yourself"
                )
            self.remote.remove(sorted(listing))
            listing = {}
        run_keys = [k for k in listing if k.startswith(RUN_DIR + "/")]
        if run_keys and f"{RUN_DIR}/run_id" not in listing and len(run_keys) == len(listing):
            self.remote.remove(run_keys)  # killed before it wrote anything: start afresh
            listing = {}
        if not listing:
            return None
        manifest = self._manifest() if "manifest.json" in listing else None
        if manifest is not None and manifest.get("run_id") == run_id:
            self.remote.remove(run_keys)  # a crash right after the manifest
            return Summary(**manifest["summary"])
        has_id = f"{RUN_DIR}/run_id" in listing
        before = self.remote.cat(f"{RUN_DIR}/run_id").decode() if has_id else None
        if manifest is None and before == run_id:
            self._resume_from(listing)
            return None
        why = ""
        if manifest is None and f"{RUN_DIR}/inputs.json" in listing:
            from tokenmill.preprocess.run.runlog import Journal

            (self.local / RUN_DIR / "inputs.json").write_bytes(
                self.remote.cat(f"{RUN_DIR}/inputs.json")
            )
            changed = Journal.changed_inputs(self.local, inputs)
            why = f" (an interrupted run of another job: {'; '.join(changed)})"
        raise FileExistsError(
            f"{self.url} holds other data{why}; pass overwrite=True (--overwrite) to replace it"
        )

    def _manifest(self) -> dict:
        return parse_manifest(self.remote.cat("manifest.json"), f"{self.url}/manifest.json")

    def _resume_from(self, listing: dict[str, int]) -> None:
        """Staging rebuilt from the bucket: run id, inputs, the merged journal; the bucket's
        published shards noted, whatever is not one of them deleted."""
        run = self.local / RUN_DIR
        fetched = self.remote.cat_many(
            [f"{RUN_DIR}/run_id", f"{RUN_DIR}/inputs.json"]
            if f"{RUN_DIR}/inputs.json" in listing
            else [f"{RUN_DIR}/run_id"]
        )
        for rel, data in fetched.items():
            (self.local / rel).write_bytes(data)
        segments = sorted(k for k in listing if k.startswith(JOURNAL + "/"))
        lines: dict[int, bytes] = {}
        for _, data in sorted(self.remote.cat_many(segments).items()):
            for raw in data.splitlines():
                try:
                    lines.setdefault(orjson.loads(raw)["chunk"], raw)
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    continue
        kept: list[bytes] = []
        while len(kept) in lines:
            kept.append(lines[len(kept)])
        (run / "journal.jsonl").write_bytes(b"".join(line + b"\n" for line in kept))
        self._segment = 1 + max((int(Path(s).stem) for s in segments), default=-1)
        self._published, stale = _published_in(listing)
        self.remote.remove(stale)

    def published(self, domain: str, primary: str) -> list[dict]:
        """A domain's shards already in the bucket, as manifest infos (Journal.resume)."""
        names = self._published.get(domain, [])
        if not names:
            return []
        if names[0].endswith(".jsonl"):
            data = self.remote.cat_many([self.rel(domain, n) for n in names])
            return [part_info(n, data[self.rel(domain, n)], primary) for n in names]
        metas = self.remote.cat_many([self.rel(domain, f"{n}/meta.json") for n in names])
        return [shard_info(n, metas[self.rel(domain, f"{n}/meta.json")], primary) for n in names]

    def start(self) -> None:
        """After the journal is set up (and trimmed by a resume): the run's identity in the
        bucket first (run_id, then inputs.json, as the local journal writes them), then the
        uploader."""
        run = self.local / RUN_DIR
        if not self.remote.exists(f"{RUN_DIR}/run_id"):
            self.remote.pipe(f"{RUN_DIR}/run_id", (run / "run_id").read_bytes())
            self.remote.pipe(f"{RUN_DIR}/inputs.json", (run / "inputs.json").read_bytes())
        self._uploaded = (run / "journal.jsonl").stat().st_size
        self._thread = threading.Thread(
            target=self._upload_loop, name="tokenmill-upload", daemon=True
        )
        self._thread.start()

    # --- during the run ------------------------------------------------------------------
    def watch(self, domain: str, writer: Any) -> None:
        """Hands the shards `writer` published since the last call to the uploader (waits
        while IN_FLIGHT are queued); a writer that uploads itself (Ray) is left alone."""
        self._raise_failed()
        if getattr(writer, "uploads", False):
            return
        done = self._seen.get(id(writer))
        if done is None:  # a writer resumed with the bucket's shards starts past them
            done = len(self._published.get(domain, [])) if writer.published else 0
        for info in writer.published[done:]:
            while True:
                try:
                    self._queue.put((domain, info["name"]), timeout=1)
                    break
                except queue.Full:
                    self._raise_failed()
        self._seen[id(writer)] = len(writer.published)

    def sync_journal(self) -> None:
        """Uploads the journal lines written since the last segment, as a new segment: called
        before any shard whose rows they account for can be published in the bucket."""
        with self._journal_lock:
            path = self.local / RUN_DIR / "journal.jsonl"
            with open(path, "rb") as f:
                f.seek(self._uploaded)
                data = f.read()
            data = data[: data.rfind(b"\n") + 1]  # whole lines only
            if not data:
                return
            self.remote.pipe(f"{JOURNAL}/{self._segment:08d}.jsonl", data)
            self._segment += 1
            self._uploaded += len(data)

    def _upload_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # drain: the run is failing
            domain, name = item
            try:
                self.lock.check()  # never write into a prefix another run now holds
                self.sync_journal()
                local = self.local / domain / name if domain else self.local / name
                self.remote.upload_shard(local, self.rel(domain, name))
                shutil.rmtree(local) if local.is_dir() else local.unlink()
            except BaseException as err:
                self._error = err

    def _raise_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # --- after the run -------------------------------------------------------------------
    def commit(self) -> None:
        """Once the manifest is written in staging: the last uploads, rejects.jsonl, then
        manifest.json (the commit point), then the run folder removed, here and there."""
        self._stop()
        self._raise_failed()
        self.lock.check(server=True)  # a run whose lock another took over never commits
        if (self.local / "rejects.jsonl").exists():
            self.remote.put([(self.local / "rejects.jsonl", "rejects.jsonl")])
        self.remote.put([(self.local / "manifest.json", "manifest.json")])
        self.remote.remove_all(RUN_DIR)
        shutil.rmtree(self.local, ignore_errors=True)

    def abort(self, remove: bool) -> None:
        """The run failed: uploads stop; with `remove` (bad input) everything it wrote in the
        bucket is deleted, as the local output's shards are."""
        self._error = self._error or RuntimeError("the run stopped")
        self._stop()
        if remove and not self.lock.lost:  # never delete what a run that took over wrote
            self.remote.remove([k for k in self.remote.listing() if k != LOCK])
            shutil.rmtree(self.local, ignore_errors=True)


def _published_in(listing: dict[str, int]) -> tuple[dict[str, list[str]], list[str]]:
    """(domain -> names of its published shards or parts, in order, from 0 up to the first
    one missing; the objects to delete: every other shard's or part's)."""
    complete: dict[str, set[int]] = {}
    objects: dict[tuple[str, int], list[str]] = {}
    names: dict[tuple[str, int], str] = {}
    for key in listing:
        if key.startswith(RUN_DIR + "/") or key in ("manifest.json", "rejects.jsonl"):
            continue
        shard, part = _SHARD_FILE.match(key), _PART.match(key)
        match = shard or part
        if match is None:
            continue
        domain, index = match["domain"] or "", int(match["index"])
        names[domain, index] = match["name"]
        objects.setdefault((domain, index), []).append(key)
        if (shard and match["file"] == "meta.json") or (part and not match["tmp"]):
            complete.setdefault(domain, set()).add(index)
    published: dict[str, list[str]] = {}
    stale: list[str] = []
    for (domain, index), keys in sorted(objects.items()):
        run = complete.get(domain, set())
        prefix = next(i for i in range(len(run) + 1) if i not in run)
        if index < prefix:
            published.setdefault(domain, []).append(names[domain, index])
        else:
            stale += keys
    return published, stale
