"""The Ray engine's scan and process steps (ray_engine.py has the whole flow): the actor that
masks and packs work units, the driver's head start while Ray Data starts the pool, and each
chunk's counts back on the driver in chunk order, its rows left in the object store."""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from tokenmill.preprocess.chunks import (
    THREADS,
    ChunkResult,
    process_here,
    process_stream,
    setup_worker,
)
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.inputs import InputPath
from tokenmill.preprocess.plans import (
    ChunkPlan,
    FileRangeReader,
    FileScan,
    plan_chunks,
    read_chunk,
    scan_file,
    work_units,
)
from tokenmill.preprocess.ray_writer import RowRef


class ChunkWorker:
    """One actor of the pool: loads the tokenizer once, then reads, masks and packs work units,
    THREADS chunks at once as the local engine's processes do (`process_stream`); Ray Data calls
    it for two units at once, whose chunks share those threads."""

    def __init__(self, config_data: dict, tokenizer_path: str):
        # the actor's threads encode on their own: a batched encode may not add threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        setup_worker(config_data, tokenizer_path)  # as a local engine's worker process

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """A unit's plans in; one output row per chunk: its index, its counts (`meta`: the
        ChunkResult with each row replaced by its domain) and its rows, yielded chunk by chunk
        (Ray Data may put several in one block). The columns hold Python objects that Ray Data
        serialises itself."""
        reader = FileRangeReader()
        try:
            for unit in batch["unit"]:
                chunks = (read_chunk(plan, reader) for plan in unit)
                for plan, result in zip(unit, process_stream(chunks), strict=True):
                    rows = ChunkRows([row for _, row in result.rows])
                    result.rows = [(domain, None) for domain, _ in result.rows]
                    yield {
                        "index": np.array([plan.index]),
                        "meta": _objects([result]),
                        "rows": _objects([rows]),
                    }
        finally:
            reader.close()


@dataclass
class ChunkRows:
    """A chunk's rows, boxed so that Ray Data keeps them as Python objects: converted to Arrow,
    a list of arrays (GRPO groups) would come back as an object array."""

    rows: list[dict]


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _block_metas(block: Any) -> list[tuple[int, int, ChunkResult]]:
    """(row in block, chunk index, meta) of each chunk in a block; runs where the block is."""
    from ray.data.block import BlockAccessor

    columns = BlockAccessor.for_block(block).to_numpy(["index", "meta"])
    return [(r, int(i), m) for r, (i, m) in enumerate(zip(columns["index"], columns["meta"]))]


def ray_results(
    ray: ModuleType,
    files: Sequence[InputPath],
    args: tuple[dict, str],
    workers: int | None,
    first_chunk: int = 0,
) -> Generator[ChunkResult, None, None]:
    """ChunkResults of `files` from chunk `first_chunk` on, in chunk order, computed on Ray;
    `args` = (config data, tokenizer path), as `setup_worker` takes them. Each result's rows are
    RowRefs: the rows stay in the object store until a RayShardWriter writes them."""
    config = PipelineConfig.from_dict(args[0])
    pre = config.preprocessing
    with _data_context(ray):
        plans = (
            p
            for p in plan_chunks(_scans(ray, files), pre.batch_size, pre.max_items)
            if p.index >= first_chunk
        )
        units = list(_joined(work_units(plans)))
        if not units:
            return
        head = units.pop(0) if len(units) > 1 and DRIVER_THREADS else []  # while the pool starts
        items = [{"first": unit[0].index, "unit": unit} for unit in units]
        size, cpus = pool_size(float(ray.cluster_resources().get("CPU", 1.0)), workers)
        results = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            ChunkWorker,  # Ray Data restarts a dead actor and retries its task (max_restarts=-1)
            fn_constructor_args=args,
            batch_size=1,
            batch_format="numpy",
            # two tasks at once on an actor, on its THREADS threads: the next task's chunks
            # start while the last chunk of the one before is still being worked
            compute=ray.data.ActorPoolStrategy(
                size=size, max_concurrent_calls_per_actor=2, enable_true_multi_threading=True
            ),
            num_cpus=cpus,
        )
        blocks, close = _pulled(lambda: _with_metas(ray, results.iter_internal_ref_bundles()))
        try:
            yield from _on_driver(ray, head, args, DRIVER_THREADS)
            first = first_chunk + len(head)
            yield from _in_order(ray, blocks, first, first + sum(len(unit) for unit in units))
        finally:  # a closed run: Ray Data stops its pool, before the session may end
            close()


# Threads on which the driver works the first unit while Ray Data starts the pool: one, so that
# the pool's start (the driver's Ray Data thread, the actor's process) keeps a core.
DRIVER_THREADS = 1
_END = object()


def _pulled(start: Callable[[], Iterator[Any]]) -> tuple[Iterator[Any], Callable[[], None]]:
    """The items of `start()`, pulled on a thread of the driver from now on (Ray Data's iterator
    only returns once the pool has its first output, a second or two that the driver spends on
    its own unit, `_on_driver`), at most 2 ahead of the reader, so that Ray Data's backpressure
    still holds; and `close`, which stops the pull (and with it Ray Data's run) and waits for
    its thread, which may first wait for the pool's first output."""
    items: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()

    def put(entry: tuple[Any, BaseException | None]) -> bool:
        """Put unless the reader has stopped; False once it has."""
        while not stop.is_set():
            try:
                items.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pull() -> None:
        try:
            source = start()
            if stop.is_set():
                return
            for item in source:
                if not put((item, None)):
                    break
            getattr(source, "close", lambda: None)()
            put((_END, None))
        except BaseException as err:  # raised where the driver reads the results
            put((None, err))

    def read() -> Iterator[Any]:
        while True:
            item, err = items.get()
            if err is not None:
                raise err
            if item is _END:
                return
            yield item

    thread = threading.Thread(target=pull, daemon=True, name="tokenmill-ray-results")
    thread.start()

    def close() -> None:
        stop.set()
        thread.join(timeout=60)

    return read(), close


def _on_driver(
    ray: ModuleType, unit: list[ChunkPlan], args: tuple[dict, str], threads: int
) -> Iterator[ChunkResult]:
    """A unit processed on the driver's own threads while Ray Data starts the actor pool (about
    a second before an actor's first chunk): the same chunks and code; each chunk's rows are put
    in the object store, where a write task finds them as it finds an actor's."""
    if not unit:
        return
    reader = FileRangeReader()
    try:
        chunks = (read_chunk(plan, reader) for plan in unit)
        for result in process_here(chunks, threads, args):
            rows = ray.put([ChunkRows([row for _, row in result.rows])])
            yield _referred(result, rows, 0)
    finally:
        reader.close()


def _with_metas(ray: ModuleType, bundles: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
    """Each block of Ray Data's ref bundles (the pool starts with the first pull) and its counts:
    on this node the block itself (the object store maps it, and only the `meta` column is
    decoded); elsewhere, or if unknown, a task there, started as the block comes in, on the
    pull thread, so that it runs before the driver asks for it."""
    here = ray.get_runtime_context().get_node_id()
    remote_metas = ray.remote(num_cpus=0)(_block_metas)
    try:
        for bundle in bundles:
            for block in bundle.block_refs:
                try:
                    where = ray.experimental.get_object_locations([block])[block]["node_ids"]
                except (AttributeError, KeyError):  # Ray Client drivers have no object directory
                    where = []
                yield block, block if here in where else remote_metas.remote(block)
    finally:
        getattr(bundles, "close", lambda: None)()  # a closed run stops Ray Data's run too


def _in_order(
    ray: ModuleType, blocks: Iterator[tuple[Any, Any]], first: int, end: int
) -> Iterator[ChunkResult]:
    """The counts of chunks first..end-1 (each block with its counts, `_with_metas`), checked
    to come once each and in order, their rows as RowRefs. A block is handed on as soon as it
    comes: none waits for later ones."""
    expected = first
    for block, future in blocks:
        got = ray.get(future)
        for row, index, meta in got if isinstance(got, list) else _block_metas(got):
            if index < expected:  # a block that Ray Data handed over again, in slices
                continue
            if index != expected:
                raise RuntimeError(f"Ray returned chunk {index} where chunk {expected} was due")
            expected += 1
            yield _referred(meta, block, row)
    if expected != end:
        raise RuntimeError(f"Ray Data ended after chunk {expected - 1} of {first}..{end - 1}")


def _referred(result: ChunkResult, block: Any, row: int) -> ChunkResult:
    """`result` with each of its rows as a RowRef: item j of row `row` of `block`."""
    result.rows = [
        (domain, RowRef(block, row, j, tokens))
        for j, ((domain, _), tokens) in enumerate(zip(result.rows, result.sizes))
    ]
    return result


def _scan_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"index": row["index"], "scan": scan_file(row["path"])}


def _scans(ray: ModuleType, files: Sequence[InputPath]) -> Iterator[FileScan]:
    items = [{"index": i, "path": str(f)} for i, f in enumerate(files)]
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


TASK_CHUNKS = 4 * THREADS  # a task's chunks: few tasks to schedule, and the driver's first unit


def _joined(units: Iterator[list[ChunkPlan]]) -> Iterator[list[ChunkPlan]]:
    """Consecutive units joined until each has TASK_CHUNKS plans (a seekable file makes a unit
    per chunk), so that tasks are few (each is a Ray Data round trip); plans stay in order,
    read by one reader, as a unit's are."""
    joined: list[ChunkPlan] = []
    for unit in units:
        joined += unit
        if len(joined) >= TASK_CHUNKS:
            yield joined
            joined = []
    if joined:
        yield joined


def pool_size(cpus: float, workers: int | None) -> tuple[int, float]:
    """(actors, CPUs per actor): one CPU (half the cluster if it has less than two) stays free
    for the shard writes (0.25 each) and Ray Data's own tasks; `workers` (default: the CPUs
    left) are threads, THREADS to an actor as to a local engine's process. The actors share
    the rest, at most THREADS CPUs each (rounded down, so that reservation always holds: else
    a write could wait for a CPU forever while the pool waits for the driver)."""
    free = min(1.0, cpus / 2)
    threads = workers if workers is not None else max(1, int(cpus - free))
    size = -(-threads // THREADS)
    share = math.floor(100 * (cpus - free) / size) / 100
    if share < 0.01:
        raise ValueError(f"workers={threads} is more than a Ray cluster of {cpus:g} CPUs can run")
    return size, min(float(THREADS), share)
