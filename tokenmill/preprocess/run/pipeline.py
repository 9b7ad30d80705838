"""Pipeline: input files -> masked, packed records -> shards + manifest, on an engine.

The orchestration stage. Records are cut into fixed chunks of `batch_size` in
input order (file, then line); workers process chunks, and the writer consumes
results strictly in chunk order, so the bytes written do not depend on the
number of workers. Under `on_error="raise"` a bad record stops the run and the
shards it published are removed: no manifest, nothing that looks complete. An output URL
(`s3://bucket/prefix`, any fsspec filesystem) is staged locally and uploaded shard by shard,
manifest last (upload.py).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import orjson

from tokenmill import __version__
from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.chat.training_templates import template_identity
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.filters import FILTER_REASONS
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.engines.chunks import ChunkResult
from tokenmill.preprocess.engines.engine import make_engine
from tokenmill.preprocess.inputs.files import (
    InputPath,
    input_identity,
    input_list,
    list_inputs,
)
from tokenmill.preprocess.inputs.hf import DatasetInput
from tokenmill.preprocess.inputs.records import ON_ERROR, RecordError
from tokenmill.preprocess.run.runlog import Journal, ResumeState, Summary, output_lock
from tokenmill.preprocess.run.upload import BucketOutput
from tokenmill.shards.files import write_atomic
from tokenmill.shards.format import RUN_DIR, natural_key
from tokenmill.shards.manifest import read_manifest, write_manifest
from tokenmill.shards.writer import ShardSpec, ShardWriter
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
    ):
        if not isinstance(config, PipelineConfig):
            config = PipelineConfig.from_file(config)
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
        self.tokenizer_path = str(Path(tokenizer_path).absolute())
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers  # None: every local core, or every cluster CPU but one (Ray)
        self.on_error = on_error
        self.engine = engine
        self._engine = make_engine(engine, workers, ray_address)  # fails now if Ray is missing
        self.overwrite = overwrite
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.ray_address = ray_address

    # --- the run ---------------------------------------------------------------------------
    def run(self) -> Summary:
        """The whole run, holding the output's lock: one run writes an output at a time."""
        bucket_lock = self.bucket.held() if self.bucket else contextlib.nullcontext()
        with output_lock(self._out), bucket_lock:  # a bucket output: its lock in the bucket too
            return self._run()

    def _run(self) -> Summary:
        start = time.perf_counter()
        files = list_inputs(self.inputs)
        self._input_rank = {str(f): i for i, f in enumerate(files)}  # rejects in input order
        if self.engine == "ray" and any(isinstance(f, DatasetInput) for f in files):
            raise ValueError(
                "the ray engine reads input files on its workers, not an in-memory dataset: "
                "save it (Dataset.save_to_disk(DIR) or to_parquet) and pass that"
            )
        for file in files:  # the output folder is removed on a bad record or --overwrite
            if (isinstance(file, Path) and self._out in (file, *file.parents)) or (
                isinstance(file, str) and f"{file}/".startswith(f"{self.output_dir}/")
            ):
                raise ValueError(
                    f"{self.output_dir} contains the input {file}; write the output elsewhere"
                )
        bundle = load_tokenizer(self.tokenizer_path)
        masker = RecordMasker(self.config, bundle)  # validates that the tokenizer suits the config
        inputs = [[str(f), *input_identity(f)] for f in files]  # read once: the run's own view
        run_id = self._run_id(bundle.fingerprint, inputs)
        done = self._prepare_output(run_id, inputs)
        if done is not None:
            return done
        journal = Journal(self._out, run_id, inputs)
        published = self.bucket.published if self.bucket is not None else None
        state = journal.resume(self._out, masker.layout.primary_key(), published)
        if self.bucket is not None:
            self.bucket.start()
        summary, rejects = state.summary, state.rejects
        with self._engine.session():
            domains = self._write(files, masker, journal, state)
        summary.shards = sum(len(infos) for infos in domains.values())
        unbalanced = summary.ledger().unbalanced()
        if unbalanced:  # a defect in tokenmill, never in the data: no manifest, nothing complete
            raise RuntimeError(f"{self.output_dir}: the ledger does not balance: {unbalanced}")
        summary.seconds = time.perf_counter() - start
        if rejects:
            write_atomic(self._out / "rejects.jsonl", b"".join(rejects))
        write_manifest(
            self._out, self._manifest(bundle.fingerprint, masker, domains, summary, files, run_id)
        )
        if self.bucket is not None:
            self.bucket.commit()  # manifest.json uploaded last: the commit point
        journal.remove()
        return summary

    def _write(
        self, files: list[InputPath], masker: RecordMasker, journal: Journal, state: ResumeState
    ) -> dict[str, list[dict]]:
        """Consumes every chunk's result in order; returns each domain's published shard infos."""
        writers = {d: self._writer(d, masker, len(infos)) for d, infos in state.published.items()}
        for d, infos in state.published.items():
            writers[d].published = list(infos)  # shards reused from the interrupted run
        bar = _progress_bar(self.progress)
        try:
            # closing: on an error the engine stops now (Ray: its tasks), not at garbage collection
            with contextlib.closing(self._results(files, state.chunks_done)) as results:
                for result in results:
                    self._consume(result, masker, writers, state, bar, journal)
            domains = {d: w.close() for d, w in writers.items()}
            if self.bucket is not None:
                for d, w in writers.items():
                    self.bucket.watch(d, w)
            return domains
        except BaseException as err:
            for w in writers.values():
                w.abort()
            if isinstance(err, RecordError):  # bad input: remove everything, nothing looks complete
                self._remove_published(writers)
                journal.remove()
            if self.bucket is not None:
                self.bucket.abort(remove=isinstance(err, RecordError))
            raise
        finally:
            if bar is not None:
                bar.close()

    def _results(
        self, files: list[InputPath], chunks_done: int
    ) -> Generator[ChunkResult, None, None]:
        collect = self.on_error == "skip"
        return self._engine.results(files, self.config, self.tokenizer_path, collect, chunks_done)

    def _consume(
        self,
        result: ChunkResult,
        masker: RecordMasker,
        writers: dict[str, Any],
        state: ResumeState,
        bar: Any,
        journal: Journal,
    ) -> None:
        """Counts a chunk, journals it, then hands its rows to the writers (minus rows already on disk)."""
        summary, skip_rows = state.summary, state.skip_rows
        errors: list[dict[str, Any]] = []
        for err in result.errors:
            if self.on_error == "raise" and err.reason not in FILTER_REASONS:
                raise err
            errors.append(
                {
                    "source": err.source,
                    "line": err.line,
                    "field": err.field,
                    "reason": err.reason,
                    "message": err.message,
                    "text": str(err),
                }
            )
        # a chunk's unreadable lines come before its records' errors: put them in input order
        unknown = len(self._input_rank)
        errors.sort(key=lambda e: (self._input_rank.get(e["source"], unknown), e["line"] or 0))
        counts = {
            "records_read": result.records_read,
            "records_written": result.records_written,
            "rows": len(result.rows),
            "tokens": result.tokens,
            "trained_tokens": result.trained_tokens,
            "ledgers": {domain: ledger.as_dict() for domain, ledger in result.ledgers.items()},
        }
        rows_per_domain: dict[str, int] = {}
        for domain, _ in result.rows:
            rows_per_domain[domain] = rows_per_domain.get(domain, 0) + 1
        journal.append(result.index, rows_per_domain, counts, errors)
        for err_line in errors:
            state.add_error(err_line)
        summary.add_counts(counts)
        for domain, row in result.rows:
            if skip_rows.get(domain, 0) > 0:
                skip_rows[domain] -= 1  # already in a published shard from the interrupted run
                continue
            if domain not in writers:
                writers[domain] = self._writer(domain, masker, 0)
            writers[domain].add(row)
            if self.bucket is not None:
                self.bucket.watch(domain, writers[domain])
        if bar is not None:
            bar.update(result.records_read)
            rate = summary.tokens / max(bar.format_dict["elapsed"], 1e-9)
            bar.set_postfix_str(f"{summary.tokens:,} tokens, {rate:,.0f} tok/s")

    def _writer(self, domain: str, masker: RecordMasker, first_index: int) -> Any:
        """The domain's shard writer, from the engine (same cut on every engine)."""
        domain_dir = self._out / domain if domain else self._out
        out = self.config.output
        spec = ShardSpec(
            domain_dir,
            masker.layout.dtypes(),
            masker.layout.primary_key(),
            out.max_tokens_per_shard,
            out.storage_format,
            first_index,
        )
        return self._engine.writer(spec, bucket=self.bucket)

    # --- output folder -----------------------------------------------------------------------
    def _run_id(self, tokenizer_fp: str, inputs: list[list]) -> str:
        identity: list[Any] = [self.config.canonical_json(), tokenizer_fp, self.on_error, inputs]
        if self.config.chat_template is not None:  # the file's text, not only its path
            bundle = load_tokenizer(self.tokenizer_path)
            identity.append(template_identity(bundle, self.config.chat_template))
        return _sha256(orjson.dumps(identity).decode())

    def _prepare_output(self, run_id: str, inputs: list[list]) -> Summary | None:
        """Creates OUT, or resumes an interrupted run of the same job; a finished one is left as is."""
        if self.bucket is not None:
            return self.bucket.prepare(run_id, inputs, self.overwrite)
        out = self._out
        if self.overwrite and out.exists() and any(out.iterdir()):
            if read_manifest(out) is None and not (out / RUN_DIR).is_dir():
                raise FileExistsError(
                    f"{out} is not a tokenmill output (no manifest.json, no {RUN_DIR}/): "
                    "--overwrite replaces only what tokenmill wrote; remove it yourself"
                )
            shutil.rmtree(out)
        if Journal.never_started(out):  # killed before it wrote anything: start afresh
            shutil.rmtree(out / RUN_DIR)
        if not out.exists() or not any(out.iterdir()):
            out.mkdir(parents=True, exist_ok=True)
            return None
        manifest = read_manifest(out)
        if manifest is not None and manifest.get("run_id") == run_id:
            shutil.rmtree(out / RUN_DIR, ignore_errors=True)  # a crash right after the manifest
            return Summary(**manifest["summary"])  # the same job already finished: nothing to do
        if manifest is None and Journal.run_id_of(out) == run_id:
            return None  # an interrupted run of this same job: resume it
        changed = Journal.changed_inputs(out, inputs) if manifest is None else []
        why = f" (an interrupted run of another job: {'; '.join(changed)})" if changed else ""
        raise FileExistsError(
            f"{out} holds other data{why}; pass overwrite=True (--overwrite) to replace it"
        )

    def _remove_published(self, writers: dict[str, ShardWriter]) -> None:
        for domain in writers:
            domain_dir = self._out / domain if domain else self._out
            for shard in domain_dir.glob("shard_*"):
                shutil.rmtree(shard, ignore_errors=True)
            for part in domain_dir.glob("part_*.jsonl"):
                part.unlink(missing_ok=True)

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
        return {
            "tool": f"tokenmill {__version__}",
            "fingerprint": _sha256(f"{tokenizer_fp}:{config_fp}"),
            "tokenizer_fingerprint": tokenizer_fp,
            "config_fingerprint": config_fp,
            "tokenizer_path": self.tokenizer_path,
            "chat_template": template_identity(masker.bundle, self.config.chat_template),
            "run_id": run_id,
            "config": self.config.model_dump(mode="json"),
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
