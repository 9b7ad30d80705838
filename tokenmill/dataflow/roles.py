"""The batch sequence itself: the four roles run in fixed order, for worker w of N.

DataDistributor -> RawItemProcessor -> SampleBatcher -> BatchCollator, as if one process ran
them; worker w yields groups w, w + N, ... (DataflowLoader, loader.py, runs the workers). With
a fixed group size a worker reads only its own groups' items, and a group of windows of one
length is read at once (`WindowBatch`). A packing group depends on the sizes of every sample
before it, so each worker plans every group: from the dataset's stored lengths where it has
them (reading only its own groups' items), else by reading the whole stream and collating only
its own groups (see benchmarks/bench_loader.py)."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

from tokenmill.dataflow.batchers import SampleBatcher, SimpleBatcher
from tokenmill.dataflow.collators import BatchCollator, DefaultBatchCollator, PackedCollator
from tokenmill.dataflow.distributors import DataDistributor, worker_share
from tokenmill.dataflow.processors import IdentityProcessor, RawItemProcessor
from tokenmill.training.windows import WindowBatch


def run_roles(
    distributor: DataDistributor,
    processor: RawItemProcessor,
    batcher: SampleBatcher,
    collator: BatchCollator,
    dp_rank: int,
    dp_world_size: int,
    worker_id: int = 0,
    num_workers: int = 1,
) -> Iterator[tuple[dict, dict, dict]]:
    """Yield (batch, position, counters) for this worker's groups of the rank's sequence.

    With a fixed group size the worker reads only its own groups' indices; otherwise (packing)
    every worker plans the rank's whole sequence (from stored lengths, or by reading it) and
    reads and collates only its own groups. Groups of windows are yielded as read (WindowBatch),
    for the training side to collate. `position` is the distributor state before the batcher's
    pending samples plus the batcher state: loading both continues right after this batch."""
    block = batcher.group_size
    if hasattr(distributor, "read_share"):  # a worker fetches ahead what it reads (prefetch.py)
        distributor.read_share = (worker_id, num_workers, block or 0)
    indices = distributor.indices(dp_rank, dp_world_size)
    if block:
        indices = worker_share(indices, worker_id, num_workers, block)
    windows = reads_windows(distributor, processor)
    if block and windows and type(batcher) is SimpleBatcher:
        # groups of windows: one read per group, handed over as int32 (WindowBatch)
        while group := list(islice(indices, block)):
            position = {"distributor": distributor.state_dict(), "batcher": batcher.state_dict()}
            yield distributor.fetch_windows(group), position, {}  # type: ignore[attr-defined]
        return
    positions = {0: distributor.state_dict()}  # packing: distributor state after each sample
    pulled = 0

    def samples() -> Iterator[dict]:
        nonlocal pulled
        for index in indices:
            sample = processor.process(distributor.fetch(index))
            pulled += 1
            if not block:
                positions[pulled] = distributor.state_dict()
            yield sample

    def sized() -> Iterator[tuple[Any, int]]:
        nonlocal pulled
        every = getattr(batcher, "restart_every", 1)  # states kept where a resume can restart
        for index in indices:
            size = distributor.sample_length(index)  # type: ignore[attr-defined]
            pulled += 1
            if pulled % every == 0:
                positions[pulled] = distributor.state_dict()
            yield index, size

    # packing on stored lengths: every worker plans every group, and reads only its own
    planned = not block and plans_from_lengths(distributor, processor, batcher)
    groups = batcher.plan(sized()) if planned else batcher.batches(samples())  # type: ignore[attr-defined]
    for index, group in enumerate(groups):
        batcher_state = batcher.state_dict()
        restart = pulled - batcher_state.get("pending", 0)
        if restart == pulled:
            positions = {pulled: distributor.state_dict()}
        else:
            positions = {k: v for k, v in positions.items() if k >= restart}
        position = {"distributor": positions[restart], "batcher": batcher_state}
        if block or index % num_workers == worker_id:
            counters = dict(getattr(batcher, "counters", {}))
            if planned and windows:
                yield distributor.fetch_windows(group), position, counters  # type: ignore[attr-defined]
                continue
            if planned:
                group = [distributor.fetch(i) for i in group]
            yield collator.collate(group), position, counters


def plans_from_lengths(
    distributor: DataDistributor, processor: RawItemProcessor, batcher: SampleBatcher
) -> bool:
    """A packing batcher can plan its groups from the dataset's stored lengths: they are the
    sizes it would measure (token counts of unprocessed items)."""
    return (
        getattr(distributor, "sized", False)
        and type(processor) is IdentityProcessor
        and getattr(batcher, "counts_tokens", False)
    )


def reads_windows(distributor: DataDistributor, processor: RawItemProcessor) -> bool:
    """A group can be read at once and crosses as stored (WindowBatch), to be collated on the
    training side: the items are windows of one length and nothing processes them."""
    return getattr(distributor, "windowed", False) and type(processor) is IdentityProcessor


def collate_windows(batch: WindowBatch, collator: BatchCollator) -> dict:
    """The batch `collator` makes of a WindowBatch's items; the default and packed ones without items."""
    if type(collator) is DefaultBatchCollator:
        return batch.tensors()
    if type(collator) is PackedCollator:
        return collator.collate_windows(batch.arrays)
    return collator.collate(batch.items())
