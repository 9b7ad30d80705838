"""Pipeline: input files -> tasks -> shards + manifest, on an engine.

The orchestration stage. The inputs are planned into tasks from their sizes
(engines/tasks.py); each task cuts its records into chunks of `batch_size`, masks and
packs them, and writes its own shards and its record (run/task_output.py), so the bytes
written do not depend on the engine or the number of workers. The pipeline orders the
tasks' records into the summary, `rejects.jsonl` and the manifest: O(tasks) work. Under
`on_error="raise"` a bad record stops the run and the shards it published are removed: no
manifest, nothing that looks complete. An output URL (`s3://bucket/prefix`, any fsspec
filesystem) gets each task's shards uploaded by the task, manifest last (upload.py).

With `preprocessing.validation`, rows go to OUT/train/... or OUT/validation/...
(document/cleaning.py); each split folder gets its own index and manifest (its ledger),
written before OUT's, so each loads as a dataset of its own. A dry run (`dry_run=True`)
does the same tasks on the same engine and writes nothing: its summary is the real run's,
less the shards, and `lengths` holds the written rows' and documents' length histograms.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import orjson

from tokenmill import __version__
from tokenmill.preprocess.chat.tokenizer import load_tokenizer, tokenizer_folder
from tokenmill.preprocess.chat.training_templates import template_identity
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.dedup import dedup_plan
from tokenmill.preprocess.document.cleaning import (
    SPLITS,
    check_hooks,
    hooks_identity,
    in_split,
    input_root,
)
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.engines.engine import make_engine
from tokenmill.preprocess.engines.tasks import TaskPlan, plan_tasks
from tokenmill.preprocess.inputs.files import (
    InputPath,
    input_identity,
    input_list,
    list_inputs,
)
from tokenmill.preprocess.inputs.hf import DatasetInput
from tokenmill.preprocess.inputs.records import ON_ERROR, RecordError
from tokenmill.preprocess.ledger import Ledger
from tokenmill.preprocess.run.runlog import (
    OutputNotWritable,
    RunFolder,
    Summary,
    output_lock,
    reject_line,
)
from tokenmill.preprocess.run.task_output import TASKS, OutputSpec, read_task_records
from tokenmill.preprocess.run.upload import BucketOutput
from tokenmill.shards.files import fsync_dir
from tokenmill.shards.format import RUN_DIR, TMP_MARK, is_shard_name, natural_key
from tokenmill.shards.index import write_indexes
from tokenmill.shards.manifest import local_not_ours, read_manifest, write_manifest
from tokenmill.storage.location import output_location
from tokenmill.storage.remote import Remote


class Pipeline:
    """Preprocess `inputs` into `output_dir` as `config` says.

    `output_dir` may be a URL (`s3://bucket/prefix`, `gs://...`, any fsspec filesystem): the
    run is staged in `staging_dir` (default: a folder in the system temp folder) and each
    shard uploaded as it is published, `manifest.json` last; `storage_options` go to fsspec
    (such as `{"endpoint_url": ...}` for an S3-compatible store)."""

    def __init__(
        self,
        config: PipelineConfig | str | Path,
        inputs: Sequence[str | Path | Any] | str | Path | Any,  # Any: a datasets.Dataset
        output_dir: str | Path,
        tokenizer_path: str | Path,
        workers: int | None = None,
        on_error: str = "raise",
        engine: str = "local",
        overwrite: bool = False,
        progress: bool | None = None,
        ray_address: str | None = None,
        storage_options: dict[str, Any] | None = None,
        staging_dir: str | Path | None = None,
        dry_run: bool = False,
    ):
        if not isinstance(config, PipelineConfig):
            config = PipelineConfig.from_file(config)
        check_hooks(config)  # a hook that does not import fails here, before any work
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
        self.config = config
        self.inputs = input_list(inputs)
        self.bucket: BucketOutput | None = None
        self.output_dir: Path | str
        location = output_location(output_dir, storage_options)
        if isinstance(location, Remote):
            self.bucket = BucketOutput(location, staging=staging_dir)
            self.output_dir = self.bucket.url
            self._out = self.bucket.local  # staging: shards are written here, then uploaded
        else:
            self.output_dir = self._out = location  # absolute: Ray workers run elsewhere
        folder = tokenizer_folder(tokenizer_path)  # a Hub name: its snapshot in the local cache
        self.tokenizer_path = str(folder)
        self.tokenizer_name = (
            None if folder == Path(tokenizer_path).absolute() else str(tokenizer_path)
        )
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers  # None: every local core, or every cluster CPU but one (Ray)
        self.on_error = on_error
        self.engine = engine
        self._engine = make_engine(engine, workers, ray_address)  # fails now if Ray is missing
        self.overwrite = overwrite
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.ray_address = ray_address
        self.dry_run = dry_run
        # a dry run's histograms: "rows" / "documents" -> {power of two: how many at or below it}
        self.lengths: dict[str, dict[int, int]] = {"rows": {}, "documents": {}}

    # --- the run ---------------------------------------------------------------------------
    def run(self) -> Summary:
        """The whole run, holding the output's lock: one run writes an output at a time. An
        output that cannot be written (a read-only filesystem) is still found finished, where
        it is: the same job run again there reports its summary and writes nothing. A dry run
        takes no lock: it writes nothing."""
        if self.dry_run:
            return self._run()
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(output_lock(self._out))
            except OutputNotWritable:
                if self.bucket is not None or self.overwrite or read_manifest(self._out) is None:
                    raise
                return self._run(finished_only=True)
            if self.bucket is not None:  # a bucket output: its lock in the bucket too
                held.enter_context(self.bucket.held())
            return self._run()

    def _run(self, finished_only: bool = False) -> Summary:
        start = time.perf_counter()
        self.lengths = {"rows": {}, "documents": {}}  # this run's, not an earlier run's too
        files = list_inputs(self.inputs)
        if self.engine == "ray" and any(isinstance(f, DatasetInput) for f in files):
            raise ValueError(
                "the ray engine reads input files on its workers, not an in-memory dataset: "
                "save it (Dataset.save_to_disk(DIR) or to_parquet) and pass that"
            )
        if self.engine == "ray" and self.config.preprocessing.max_items is not None:
            raise ValueError(
                "preprocessing.max_items needs the records counted in input order, which the "
                "ray engine's tasks do not do: use the local engine, or cut the input"
            )
        real_out = self._out.resolve()  # links resolved: an input linked into it is in it
        for file in files:  # the output folder is removed on a bad record or --overwrite
            if (isinstance(file, Path) and real_out in (real := file.resolve(), *real.parents)) or (
                isinstance(file, str) and f"{file}/".startswith(f"{self.output_dir}/")
            ):
                raise ValueError(
                    f"{self.output_dir} contains the input {file}; write the output elsewhere"
                )
        bundle = load_tokenizer(self.tokenizer_path)
        masker = RecordMasker(self.config, bundle)  # validates that the tokenizer suits the config
        identities = [input_identity(f) for f in files]  # read once: the run's own view
        sizes = [size for size, _ in identities]
        plans = plan_tasks(files, sizes, self.config.preprocessing.task_bytes)
        out = self.config.output
        layout = (masker.layout.dtypes(), masker.layout.primary_key(), out.max_tokens_per_shard)
        if self.dry_run:
            spec = OutputSpec(None, None, *layout, out.storage_format, self.on_error, True)
            with self._engine.session():
                summary, _, _ = self._merge(plans, spec, self._worker_config(files))
            self._check_ledger(summary)
            summary.seconds = time.perf_counter() - start
            return summary
        inputs = [[str(f), *identity] for f, identity in zip(files, identities, strict=True)]
        run_id = self._run_id(bundle.fingerprint, inputs)
        done = self._finished(run_id) if finished_only else self._prepare_output(run_id, inputs)
        if done is not None:
            return done
        if finished_only:
            raise OutputNotWritable(
                f"{self.output_dir}: cannot write there, and the job is not done"
            )
        # a kill between a temp file's write and its rename leaves it: a task redone rewrites
        # its own shards; the index, rejects, manifest and records are written again whole
        self._remove_where(lambda path: TMP_MARK in path.name)
        run_folder = RunFolder(self._out, run_id, inputs)
        remote = self.bucket.remote if self.bucket is not None else None
        if self.bucket is not None:
            self.bucket.start()
        spec = OutputSpec(
            None if remote is not None else self._out,
            remote,
            *layout,
            out.storage_format,
            self.on_error,
        )
        try:
            with self._engine.session():
                summary, domains, index = self._merge(plans, spec, self._worker_config(files))
        except BaseException as err:
            if isinstance(err, RecordError):  # bad input: remove everything, nothing looks complete
                self._remove_output()
                run_folder.remove()
            if self.bucket is not None:
                self.bucket.abort(remove=isinstance(err, RecordError))
            raise
        summary.shards = sum(len(infos) for infos in domains.values())
        self._check_ledger(summary)
        summary.seconds = time.perf_counter() - start
        if index:  # the dataset's index, before the manifest (a bucket's: uploaded before it)
            write_indexes(self._out, index)
        rejects = self._out / RUN_DIR / "rejects.jsonl"
        if rejects.exists():
            os.replace(rejects, self._out / "rejects.jsonl")
            fsync_dir(self._out)
        manifest = self._manifest(bundle.fingerprint, masker, domains, summary, files, run_id)
        if self.config.preprocessing.validation is not None:
            self._write_splits(manifest, index)
        write_manifest(self._out, manifest)
        if self.bucket is not None:
            self.bucket.commit()  # manifest.json uploaded last: the commit point
        run_folder.remove()
        return summary

    def _check_ledger(self, summary: Summary) -> None:
        unbalanced = summary.ledger().unbalanced()
        if unbalanced:  # a defect in tokenmill, never in the data: no manifest, nothing complete
            raise RuntimeError(f"{self.output_dir}: the ledger does not balance: {unbalanced}")

    def _worker_config(self, files: list[InputPath]) -> PipelineConfig:
        """The config the workers get: a by-record split's root filled in (the folder
        holding every input file), as a worker sees its own records' files only."""
        rule = self.config.preprocessing.validation
        if rule is None or rule.by != "record" or rule.root is not None:
            return self.config
        root = input_root([str(f) for f in files if not isinstance(f, DatasetInput)])
        pre = self.config.preprocessing.model_copy(
            update={"validation": rule.model_copy(update={"root": root})}
        )
        return self.config.model_copy(update={"preprocessing": pre})

    def _write_splits(self, manifest: dict, index: dict[str, list[dict]]) -> None:
        """OUT/train and OUT/validation each a dataset: its index and its manifest (the run's,
        with the split's shards and ledger), before OUT's manifest, the run's commit point."""
        for split in SPLITS:
            ledgers = in_split(manifest["summary"]["domains"], split)
            if not ledgers and not in_split(manifest["domains"], split):
                continue  # no record came to this split
            folder = self._out / split  # made here too: tasks may have written elsewhere
            folder.mkdir(parents=True, exist_ok=True)
            facts = in_split(index, split)
            if facts:
                write_indexes(folder, facts)
            total = Ledger()
            for data in ledgers.values():
                total.add(Ledger.from_dict(data))
            domains = in_split(manifest["domains"], split)
            rows = sum(info["records"] for infos in domains.values() for info in infos)
            summary = Summary(
                records_read=total.records_read,
                records_written=total.records_written,
                rows=rows,
                tokens=total.tokens_written,
                dropped_tokens=total.dropped_tokens,
                shards=sum(len(infos) for infos in domains.values()),
                tokens_read=total.tokens_read,
                dropped=total.as_dict()["dropped"],
                domains=ledgers,
            )
            write_manifest(
                folder,
                {**manifest, "split": split, "domains": domains, "summary": summary.as_dict()},
            )

    def _merge(
        self, plans: list[TaskPlan], spec: OutputSpec, config: PipelineConfig
    ) -> tuple[Summary, dict[str, list[dict]], dict[str, list[dict]]]:
        """The tasks' records in task order (those of an interrupted run's tasks read back,
        the others as the engine does them) into the summary, the rejects, each domain's
        shard entries and what the index needs of each shard; a dry run's lengths."""
        done = read_task_records(spec.out, spec.remote)
        todo = [plan for plan in plans if plan.index not in done]
        staging = self.bucket.local if self.bucket is not None else None
        summary, domains, index = Summary(), dict[str, list[dict]](), dict[str, list[dict]]()
        bar = _progress_bar(self.progress)
        rejects: IO[bytes] | None = None
        # every task's keys, done ones' too: a first copy may be in one (dedup.py)
        duplicates = dedup_plan(self._engine, plans, config) if todo else {}
        results = self._engine.run_tasks(
            todo, config, self.tokenizer_path, spec, staging, duplicates
        )
        try:
            for plan in plans:
                record = done.get(plan.index) or next(results)
                if record["task"] != plan.index:  # a defect in an engine, never in the data
                    raise RuntimeError(f"task {record['task']} came where {plan.index} was due")
                summary.add_counts(record["counts"])
                for kind, buckets in record.get("lengths", {}).items():
                    for bucket, count in buckets:
                        self.lengths[kind][bucket] = self.lengths[kind].get(bucket, 0) + count
                for err in record["errors"]:
                    summary.count_error(err["reason"], err["text"])
                    if spec.dry_run:
                        continue
                    if rejects is None:
                        rejects = open(self._out / RUN_DIR / "rejects.jsonl", "wb")  # noqa: SIM115
                    rejects.write(reject_line(err))
                for domain, infos in record["shards"].items():
                    domains.setdefault(domain, []).extend(infos)
                for domain, facts in record["index"].items():
                    index.setdefault(domain, []).extend(facts)
                if bar is not None:
                    bar.update(record["counts"]["records_read"])
                    rate = summary.tokens / max(bar.format_dict["elapsed"], 1e-9)
                    bar.set_postfix_str(f"{summary.tokens:,} tokens, {rate:,.0f} tok/s")
            if rejects is not None:
                rejects.flush()
                os.fsync(rejects.fileno())
        finally:
            results.close()  # the engine's tasks still running stop now
            if rejects is not None:
                rejects.close()
            if bar is not None:
                bar.close()
        index = {d: facts for d, facts in index.items() if facts}
        return summary, {d: infos for d, infos in domains.items() if infos}, index

    # --- output folder -----------------------------------------------------------------------
    def _run_id(self, tokenizer_fp: str, inputs: list[list]) -> str:
        identity: list[Any] = [self.config.canonical_json(), tokenizer_fp, self.on_error, inputs]
        if self.config.chat_template is not None:  # the file's text, not only its path
            bundle = load_tokenizer(self.tokenizer_path)
            identity.append(template_identity(bundle, self.config.chat_template))
        hooks = hooks_identity(self.config)  # the hooks' code too
        if hooks:
            identity.append(hooks)
        return _sha256(orjson.dumps(identity).decode())

    def _finished(self, run_id: str) -> Summary | None:
        """The summary of this same job, finished in the output; None otherwise."""
        manifest = read_manifest(self._out)
        if manifest is not None and manifest.get("run_id") == run_id:
            return Summary(**manifest["summary"])
        return None

    def _prepare_output(self, run_id: str, inputs: list[list]) -> Summary | None:
        """Creates OUT, or resumes an interrupted run of the same job; a finished one is left as is."""
        if self.bucket is not None:
            return self.bucket.prepare(run_id, inputs, self.overwrite)
        out = self._out
        if RunFolder.never_started(out):  # killed before it wrote anything: start afresh
            shutil.rmtree(out / RUN_DIR)
        if self.overwrite and out.exists() and any(out.iterdir()):
            why = local_not_ours(out)
            if why is not None:
                raise FileExistsError(
                    f"{out} is not a tokenmill output ({why}): --overwrite replaces only what "
                    "tokenmill wrote; remove it yourself"
                )
            shutil.rmtree(out)
        if not out.exists() or not any(out.iterdir()):
            out.mkdir(parents=True, exist_ok=True)
            return None
        manifest = read_manifest(out)
        if manifest is not None and manifest.get("run_id") == run_id:
            shutil.rmtree(out / RUN_DIR, ignore_errors=True)  # a crash right after the manifest
            return Summary(**manifest["summary"])  # the same job already finished: nothing to do
        if manifest is None and RunFolder.run_id_of(out) == run_id:
            return None  # an interrupted run of this same job: resume it
        changed = RunFolder.changed_inputs(out, inputs) if manifest is None else []
        why = f" (an interrupted run of another job: {'; '.join(changed)})" if changed else ""
        raise FileExistsError(
            f"{out} holds other data{why}; pass overwrite=True (--overwrite) to replace it"
        )

    def _remove_output(self) -> None:
        """Every shard, part and temp file in the output and its domain folders (a bucket's
        are the BucketOutput's to remove)."""
        self._remove_where(lambda path: is_shard_name(path.name.split(TMP_MARK)[0]))

    def _remove_where(self, picked: Callable[[Path], bool]) -> None:
        """What `picked` picks in the output folder, its domain folders and its task records'
        folder; domain folders left empty go too."""
        if self.bucket is not None:
            return
        ours = lambda path: is_shard_name(path.name.split(TMP_MARK)[0])  # noqa: E731
        domains = [p for p in self._out.iterdir() if p.is_dir() and p.name != RUN_DIR]
        tasks = self._out / TASKS
        for folder in (self._out, tasks, *(d for d in domains if not ours(d))):
            for path in [p for p in folder.iterdir() if picked(p)] if folder.is_dir() else []:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            if folder not in (self._out, tasks) and not any(folder.iterdir()):
                folder.rmdir()

    def _manifest(
        self,
        tokenizer_fp: str,
        masker: RecordMasker,
        domains: dict[str, list[dict]],
        summary: Summary,
        files: list[InputPath],
        run_id: str,
    ) -> dict:
        config_fp = self.config.fingerprint()
        hooks = hooks_identity(self.config)
        data_fp = f"{tokenizer_fp}:{config_fp}" + (
            f":{orjson.dumps(hooks).decode()}" if hooks else ""
        )
        return {
            "tool": f"tokenmill {__version__}",
            "fingerprint": _sha256(data_fp),
            "tokenizer_fingerprint": tokenizer_fp,
            "config_fingerprint": config_fp,
            "tokenizer_path": self.tokenizer_path,
            **({"tokenizer_name": self.tokenizer_name} if self.tokenizer_name else {}),
            "chat_template": template_identity(masker.bundle, self.config.chat_template),
            **({"hooks": hooks} if hooks else {}),
            "run_id": run_id,
            "config": self.config.dump(),
            "keys": masker.layout.dtypes(),
            "primary_key": masker.layout.primary_key(),
            "storage_format": self.config.output.storage_format,
            "inputs": [str(f) for f in files],
            "domains": {d: domains[d] for d in sorted(domains, key=lambda d: natural_key(Path(d)))},
            "summary": summary.as_dict(),
        }


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit="rec", unit_scale=True, desc="preprocess", file=sys.stderr)
