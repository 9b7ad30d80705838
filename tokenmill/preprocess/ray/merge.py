"""The Ray engine's chunks back on the driver (ray/results.py has the process step): the
tasks' blocks and the driver's own chunks, each pulled on a thread of the driver, checked to
come once each and handed on in chunk order, as soon as the chunks before them are."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tokenmill.preprocess.engines.chunks import ChunkResult
from tokenmill.preprocess.ray.head_start import Frontier
from tokenmill.preprocess.ray.writer import RowRef, block_rows


@dataclass
class ChunkRows:
    """A chunk's rows, boxed so that Ray Data keeps them as Python objects: converted to Arrow,
    a list of arrays (GRPO groups) would come back as an object array."""

    rows: list[dict]

    @classmethod
    def of(cls, result: ChunkResult) -> ChunkRows:
        return cls([row for _, row in result.rows])


def _block_metas(block: Any) -> list[tuple[int, int, ChunkResult]]:
    """(row in block, chunk index, meta) of each chunk in a block; runs where the block is. A
    task whose chunks the driver took all yields an empty block, without columns."""
    from ray.data.block import BlockAccessor

    accessor = BlockAccessor.for_block(block)
    if accessor.num_rows() == 0:
        return []
    columns = accessor.to_numpy(["index", "meta"])
    return [(r, int(i), m) for r, (i, m) in enumerate(zip(columns["index"], columns["meta"]))]


_END = object()


def pulled(
    *starts: Callable[[], Iterator[Any]],
) -> tuple[Iterator[tuple[int, Any]], Callable[[], None]]:
    """The items of each `starts[i]()` as (i, item), in the order they come, each source pulled
    on a thread of the driver from now on (Ray Data's iterator only returns once the first
    task has output), all at most 2 ahead of the reader, so that Ray Data's backpressure still
    holds; and `close`, which stops the pulls (and with them Ray Data's run) and waits for
    their threads, which may first wait for the first task's output. An error of any source
    is raised where the reader reads."""
    items: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()

    def put(entry: tuple[int, Any, BaseException | None]) -> bool:
        """Put unless the reader has stopped; False once it has."""
        while not stop.is_set():
            try:
                items.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pull(i: int, start: Callable[[], Iterator[Any]]) -> None:
        try:
            source = start()
            if stop.is_set():
                return
            for item in source:
                if not put((i, item, None)):
                    break
            getattr(source, "close", lambda: None)()
            put((i, _END, None))
        except BaseException as err:  # raised where the driver reads the results
            put((i, None, err))

    def read() -> Iterator[tuple[int, Any]]:
        ended = 0
        while ended < len(starts):
            i, item, err = items.get()
            if err is not None:
                raise err
            if item is _END:
                ended += 1
                continue
            yield i, item

    threads = [
        threading.Thread(target=pull, args=(i, start), daemon=True, name="tokenmill-ray-results")
        for i, start in enumerate(starts)
    ]
    for thread in threads:
        thread.start()

    def close() -> None:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)

    return read(), close


def with_metas(
    ray: ModuleType, bundles: Iterator[Any], rows_here: bool
) -> Iterator[tuple[Any, Any]]:
    """Each block of Ray Data's ref bundles (the tasks start with the first pull) and its counts:
    on this node (always, with `rows_here`) the block itself (the object store maps it, and only
    the columns used are decoded); elsewhere, or if unknown, a task there, started as the block
    comes in, on the pull thread, so that it runs before the driver asks for it."""
    blocks = (block for bundle in bundles for block in bundle.block_refs)
    try:
        if rows_here:
            yield from ((block, block) for block in blocks)
            return
        here = ray.get_runtime_context().get_node_id()
        remote_metas = ray.remote(num_cpus=0)(_block_metas)
        for block in blocks:
            try:
                where = ray.experimental.get_object_locations([block])[block]["node_ids"]
            except (AttributeError, KeyError):  # Ray Client drivers have no object directory
                where = []
            yield block, block if here in where else remote_metas.remote(block)
    finally:
        getattr(bundles, "close", lambda: None)()  # a closed run stops Ray Data's run too


def in_order(
    ray: ModuleType,
    items: Iterator[tuple[int, Any]],
    frontier: Frontier,
    end: int,
    rows_here: bool,
) -> Iterator[ChunkResult]:
    """The counts of chunks frontier.index..end-1, from the tasks' blocks (source 0: each block
    with its counts, `with_metas`) and the driver's head start (source 1: ChunkResults), in
    any order; checked to come once each and yielded in chunk order, moving `frontier` on,
    their rows as RowRefs (with `rows_here`: the rows, read from the block in place, or the
    driver's own). A chunk is handed on as soon as the chunks before it are: none waits for
    later ones."""
    first = frontier.index
    held: dict[int, ChunkResult] = {}  # done, waiting for an earlier chunk
    sides: dict[int, int] = {}  # the source each chunk came from
    for source, item in items:
        for result in _block_results(ray, item, rows_here) if source == 0 else [item]:
            index = result.index
            if sides.get(index) == source:  # a block that Ray Data handed over again, in slices
                continue
            if index in sides or not first <= index < end:
                raise RuntimeError(f"Ray returned chunk {index} twice or out of {first}..{end - 1}")
            sides[index] = source
            if source == 1 and not rows_here:  # the rows go where a write task finds them
                result = _referred(result, ray.put([ChunkRows.of(result)]), 0)
            held[index] = result
        while frontier.index in held:
            result = held.pop(frontier.index)
            frontier.advance()
            yield result
    if frontier.index != end:
        raise RuntimeError(f"Ray Data ended after chunk {frontier.index - 1} of {first}..{end - 1}")


def _block_results(ray: ModuleType, item: tuple[Any, Any], rows_here: bool) -> list[ChunkResult]:
    """The chunks of one of the tasks' blocks, given with its counts (`with_metas`)."""
    block, future = item
    got = ray.get(future)
    metas = got if isinstance(got, list) else _block_metas(got)
    chunk_rows = block_rows(got) if rows_here and metas else None
    results = []
    for row, _, meta in metas:
        if chunk_rows is None:
            results.append(_referred(meta, block, row))
            continue
        rows = chunk_rows[row].rows
        meta.rows = [(domain, r) for (domain, _), r in zip(meta.rows, rows, strict=True)]
        results.append(meta)
    return results


def _referred(result: ChunkResult, block: Any, row: int) -> ChunkResult:
    """`result` with each of its rows as a RowRef: item j of row `row` of `block`."""
    result.rows = [
        (domain, RowRef(block, row, j, tokens))
        for j, ((domain, _), tokens) in enumerate(zip(result.rows, result.sizes))
    ]
    return result
