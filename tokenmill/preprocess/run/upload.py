"""Output to object storage: the bucket's side of a run.

Object stores have no rename, so each task stages its shards in a local folder and uploads
them, arrays and offsets first, `meta.json` last, then its record
(`.tokenmill-run/tasks/TTTTT.json`, run/task_output.py); the driver stages only the run's
identity, `rejects.jsonl` and the manifest. `commit` uploads `rejects.jsonl`, then
`manifest.json` last (the commit point), then removes the run folder.

A resumed run, on this machine or another, reads the records of the tasks done from the
bucket and does the others again; a task done again overwrites whatever an earlier try of
it uploaded (the same names, the same bytes).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from tokenmill.preprocess.run.runlog import RunFolder, Summary
from tokenmill.shards.format import RUN_DIR
from tokenmill.shards.index import INDEX_NAME
from tokenmill.shards.manifest import not_ours, parse_manifest
from tokenmill.storage.bucket_lock import LOCK, BucketLock
from tokenmill.storage.remote import Remote


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
        if overwrite and listing:
            found = self.remote.cat("manifest.json") if "manifest.json" in listing else None
            has_id = f"{RUN_DIR}/run_id" in listing
            why = not_ours(found, self.remote.cat(f"{RUN_DIR}/run_id") if has_id else None)
            if why is not None:
                raise FileExistsError(
                    f"{self.url} is not a tokenmill output ({why}): --overwrite replaces only "
                    "what tokenmill wrote; remove it yourself"
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
            return None  # an interrupted run of this same job: its tasks' records say what is done
        why = ""
        if manifest is None and f"{RUN_DIR}/inputs.json" in listing:
            (self.local / RUN_DIR / "inputs.json").write_bytes(
                self.remote.cat(f"{RUN_DIR}/inputs.json")
            )
            changed = RunFolder.changed_inputs(self.local, inputs)
            why = f" (an interrupted run of another job: {'; '.join(changed)})"
        raise FileExistsError(
            f"{self.url} holds other data{why}; pass overwrite=True (--overwrite) to replace it"
        )

    def _manifest(self) -> dict:
        return parse_manifest(self.remote.cat("manifest.json"), f"{self.url}/manifest.json")

    def start(self) -> None:
        """The run's identity in the bucket, before any task's output: run_id, then
        inputs.json, as the local run folder writes them."""
        run = self.local / RUN_DIR
        if not self.remote.exists(f"{RUN_DIR}/run_id"):
            self.remote.pipe(f"{RUN_DIR}/run_id", (run / "run_id").read_bytes())
            self.remote.pipe(f"{RUN_DIR}/inputs.json", (run / "inputs.json").read_bytes())

    # --- after the run -------------------------------------------------------------------
    def commit(self) -> None:
        """Once the manifest is written in staging: the dataset's index files, rejects.jsonl,
        the splits' manifests, then manifest.json (the commit point), then the run folder
        removed, here and there."""
        self.lock.check(server=True)  # a run whose lock another took over never commits
        indexes = sorted(self.local.glob(f"**/{INDEX_NAME}"))
        self.remote.put([(p, p.relative_to(self.local).as_posix()) for p in indexes])
        if (self.local / "rejects.jsonl").exists():
            self.remote.put([(self.local / "rejects.jsonl", "rejects.jsonl")])
        splits = sorted(self.local.glob("*/manifest.json"))  # train/, validation/: datasets
        self.remote.put([(p, p.relative_to(self.local).as_posix()) for p in splits])
        self.remote.put([(self.local / "manifest.json", "manifest.json")])
        self.remote.remove_all(RUN_DIR)
        shutil.rmtree(self.local, ignore_errors=True)

    def abort(self, remove: bool) -> None:
        """The run failed; with `remove` (bad input) everything it wrote in the bucket is
        deleted, as the local output's shards are."""
        if remove and not self.lock.lost:  # never delete what a run that took over wrote
            self.remote.remove([k for k in self.remote.listing() if k != LOCK])
            shutil.rmtree(self.local, ignore_errors=True)
