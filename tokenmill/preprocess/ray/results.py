"""The Ray engine's scan and process steps (ray/engine.py has the whole flow): the scan and the
Ray Data tasks that mask and pack work units, on a thread of the driver, while another works
the driver's share of the first task's chunks (ray/head_start.py); each chunk's counts come
back on the driver in chunk order (ray/merge.py), its rows left in the object store (or, on a
cluster of one node, the driver's, read in place: `rows_here`)."""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future
from types import ModuleType
from typing import Any

import numpy as np

from tokenmill.preprocess.chat.tokenizer import tokenizer_threads_off
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.engines.chunks import (
    THREADS,
    ChunkResult,
    process_stream,
    setup_worker,
)
from tokenmill.preprocess.engines.plans import (
    ChunkPlan,
    FileRangeReader,
    FileScan,
    joined,
    plan_chunks,
    read_chunk,
    scan_file,
    task_chunks,
    work_units,
)
from tokenmill.preprocess.inputs.files import InputPath
from tokenmill.preprocess.ray.head_start import (
    CLAIMS,
    DRIVER_THREADS,
    Frontier,
    claim,
    claims_kv,
    head_start,
)
from tokenmill.preprocess.ray.merge import ChunkRows, in_order, pulled, with_metas

_RUN: str | None = None  # the run this worker process is set up for (`setup_worker`)


def process_units(
    batch: dict[str, np.ndarray], run: str, config_data: dict, tokenizer_path: str
) -> Iterator[dict[str, np.ndarray]]:
    """A Ray Data task: a unit's plans in, THREADS chunks at once as a local engine's process
    works them (`process_stream`); one output row per chunk: its index, its counts (`meta`: the
    ChunkResult with each row replaced by its domain) and its rows, yielded chunk by chunk (Ray
    Data may put several in one block). The columns hold Python objects that Ray Data
    serialises itself. Ray keeps its worker processes, so a process is set up (the tokenizer
    loaded once, the threads started once) at its first task of a run, and not again: there is
    no actor to start, which costs a second or two before a run's first chunk."""
    global _RUN
    if _RUN != run:
        setup_worker(config_data, tokenizer_path)
        _RUN = run
    reader = FileRangeReader(config_data["input"].get("text_unit", "file"))
    try:
        with tokenizer_threads_off():  # the threads encode on their own, on the task's CPUs
            for unit, claims in zip(batch["unit"], batch["claims"], strict=True):
                plans = iter(unit)
                in_flight = THREADS + 1
                if claims:  # the first task, shared with the driver's thread(s): as many
                    # threads as the driver leaves, each chunk claimed as a thread comes free
                    plans = (plan for plan in unit if claim(claims, plan.index, "pool"))
                    in_flight = max(1, THREADS - DRIVER_THREADS)
                chunks = (read_chunk(plan, reader) for plan in plans)
                for result in process_stream(chunks, in_flight=in_flight):
                    rows = ChunkRows.of(result)
                    result.rows = [(domain, None) for domain, _ in result.rows]
                    yield {
                        "index": np.array([result.index]),
                        "meta": _objects([result]),
                        "rows": _objects([rows]),
                    }
    finally:
        reader.close()


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def ray_results(
    ray: ModuleType,
    files: Sequence[InputPath],
    args: tuple[dict, str],
    workers: int | None,
    first_chunk: int = 0,
    rows_here: bool = False,
) -> Generator[ChunkResult, None, None]:
    """ChunkResults of `files` from chunk `first_chunk` on, in chunk order, computed on Ray;
    `args` = (config data, tokenizer path), as `setup_worker` takes them. Each result's rows are
    RowRefs: the rows stay in the object store until a RayShardWriter writes them; with
    `rows_here` (every block is on the driver's node) the rows themselves, read in place, for
    the local ShardWriter to write as they come."""
    config = PipelineConfig.from_dict(args[0])
    run = uuid.uuid4().hex
    claims = f"tokenmill-{run}-chunk-" if DRIVER_THREADS else ""
    with _data_context(ray):
        units: Future[list[list[ChunkPlan]]] = Future()  # the tasks' units, once scanned
        frontier = Frontier(first_chunk)
        head = (files, config) if first_chunk == 0 else None
        # a thread scans, then starts the tasks and pulls their blocks (source 0); another runs
        # the driver's share of the first task from the run's start (source 1)
        tasks = _tasks(ray, files, config, args, workers, first_chunk, run, claims, units)

        def blocks() -> Iterator[tuple[Any, Any]]:
            """Source 0; an error before the scan's end is also the units' (waited on here)."""
            try:
                yield from with_metas(ray, tasks, rows_here)
            except BaseException as err:
                if not units.done():
                    units.set_exception(err)
                raise

        items, close = pulled(
            blocks, lambda: head_start(head, units.result, args, claims, frontier)
        )
        try:
            end = first_chunk + sum(map(len, units.result()))
            yield from in_order(ray, items, frontier, end, rows_here)
        finally:  # a closed run: Ray Data stops its tasks, before the session may end
            frontier.close()
            units.cancel()  # if the scan has not begun, the head start stops waiting for it
            close()
            if claims and ray.is_initialized():  # a lost connection keeps the run's own error
                claims_kv()._internal_kv_del(claims, del_by_prefix=True, namespace=CLAIMS)


def _tasks(
    ray: ModuleType,
    files: Sequence[InputPath],
    config: PipelineConfig,
    args: tuple[dict, str],
    workers: int | None,
    first_chunk: int,
    run: str,
    claims: str,
    units_out: Future[list[list[ChunkPlan]]],
) -> Iterator[Any]:
    """Run on a pull thread: the scan (`_scans`), whose units of the tasks go to `units_out`,
    then Ray Data's ref bundles of the tasks' output."""
    pre = config.preprocessing
    plans = (
        p
        for p in plan_chunks(
            _scans(ray, files, config.input.text_unit), pre.batch_size, pre.max_items
        )
        if p.index >= first_chunk
    )
    units = list(work_units(plans))
    size, cpus = pool_size(float(ray.cluster_resources().get("CPU", 1.0)), workers)
    if units:
        units = list(joined(units, task_chunks(sum(map(len, units)), size)))
    units_out.set_result(units)
    if not units:
        return
    items = [
        {"first": unit[0].index, "unit": unit, "claims": claims if i == 0 else ""}
        for i, unit in enumerate(units)
    ]
    results = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        process_units,  # Ray Data runs a task again if its worker dies (max_retries=-1)
        fn_args=(run, *args),
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=size),
        num_cpus=cpus,
    )
    yield from results.iter_internal_ref_bundles()


def _scan_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"index": row["index"], "scan": scan_file(row["path"], row["text_unit"])}


def _scans(ray: ModuleType, files: Sequence[InputPath], text_unit: str) -> Iterator[FileScan]:
    items = [{"index": i, "path": str(f), "text_unit": text_unit} for i, f in enumerate(files)]
    scanned = ray.data.from_items(items, override_num_blocks=len(items)).map(_scan_row)
    for expected, row in enumerate(scanned.iter_rows()):
        if row["index"] != expected:
            raise RuntimeError(
                f"Ray returned the scan of file {row['index']} where {expected} was due"
            )
        yield row["scan"]


@contextlib.contextmanager
def _data_context(ray: ModuleType) -> Iterator[None]:
    """Ray Data set up for this run, then restored: results in input order, no progress output
    of its own, Python-object columns without a warning (ours are objects on purpose)."""
    context = ray.data.DataContext.get_current()
    options = context.execution_options
    wanted = {
        "enable_progress_bars": False,
        "print_on_execution_start": False,
        "enable_fallback_to_arrow_object_ext_type": True,
        "target_max_block_size": 1,  # a block per chunk, handed on as soon as it is done
    }
    saved = {name: getattr(context, name) for name in wanted}, options.preserve_order
    for name, value in wanted.items():
        setattr(context, name, value)
    options.preserve_order = True
    try:
        yield
    finally:
        for name, value in saved[0].items():
            setattr(context, name, value)
        options.preserve_order = saved[1]


def pool_size(cpus: float, workers: int | None) -> tuple[int, float]:
    """(tasks at once, CPUs per task): one CPU (half the cluster if it has less than two) stays
    free for the shard writes (0.25 each) and Ray Data's own tasks; `workers` (default: the
    CPUs left) are threads, THREADS to a task as to a local engine's process. The tasks share
    the rest, at most THREADS CPUs each (rounded down, so that reservation always holds: else
    a write could wait for a CPU forever while the tasks wait for the driver)."""
    free = min(1.0, cpus / 2)
    threads = workers if workers is not None else max(1, int(cpus - free))
    size = -(-threads // THREADS)
    share = math.floor(100 * (cpus - free) / size) / 100
    if share < 0.01:
        raise ValueError(f"workers={threads} is more than a Ray cluster of {cpus:g} CPUs can run")
    return size, min(float(THREADS), share)
