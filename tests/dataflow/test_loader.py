"""DataflowLoader: one batch sequence for every num_workers, exact resume, refusals by
name, and real worker failures surfacing in the main process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import ROOT
from resume import ToyDataset, check_resume, roles, same, sample_ids
from torch.utils.data import get_worker_info

from tokenmill.dataflow import (
    DataflowLoader,
    DefaultBatchCollator,
    IdentityProcessor,
    IterableDistributor,
    MapDistributor,
    MixtureDistributor,
    PoolPackingBatcher,
    RawItemProcessor,
    SimpleBatcher,
    TruncateProcessor,
)
from tokenmill.dataflow.batchers import token_count
from tokenmill.dataflow.distributors import DataDistributor
from tokenmill.dataflow.roles import plans_from_lengths
from tokenmill.training.state import epoch_order

ROOT = ROOT


def loader(
    kind: str = "seq",
    packing: bool = False,
    workers: int = 0,
    size: int = 20,
    epochs: int = 2,
    **kw,
) -> DataflowLoader:
    batcher, collator = roles(kind, packing)
    distributor = MapDistributor(ToyDataset(kind, size), seed=9, num_epochs=epochs)
    return DataflowLoader(
        distributor, batcher=batcher, collator=collator, num_workers=workers, **kw
    )


def test_batch_size_is_shorthand_for_simple_batcher_and_default_collator():
    ds = ToyDataset("seq", 10)
    short = list(DataflowLoader(MapDistributor(ds, num_epochs=1), batch_size=4))
    long = list(
        DataflowLoader(
            MapDistributor(ds, num_epochs=1),
            batcher=SimpleBatcher(4),
            collator=DefaultBatchCollator(),
        )
    )
    assert same(short, long)
    order = epoch_order(10, 42, 0).tolist()
    assert [sample_ids(b) for b in short] == [order[0:4], order[4:8], order[8:10]]
    with pytest.raises(ValueError, match="not both"):
        DataflowLoader(MapDistributor(ds), batch_size=4, batcher=SimpleBatcher(4))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("kind, packing", [("seq", False), ("sft", True), ("grpo", True)])
def test_the_batch_sequence_is_the_same_for_every_num_workers(kind, packing):
    reference = list(loader(kind, packing))
    for workers in (1, 2, 3):
        assert same(list(loader(kind, packing, workers)), reference), f"num_workers={workers}"
    for threads in (1, 2, 3):
        got = list(loader(kind, packing, num_threads=threads))
        assert same(got, reference), f"num_threads={threads}"
    ids = sorted(i for b in reference for i in sample_ids(b))
    assert ids == sorted(list(range(20)) * 2)  # two epochs, every sample once per epoch


def test_any_distributor_gives_one_sequence_for_every_num_workers():
    def make(workers: int) -> DataflowLoader:
        items = [{"input_ids": torch.tensor([i, i])} for i in range(13)]
        mixture = MixtureDistributor(
            [IterableDistributor(items), MapDistributor(items[:5], seed=1, num_epochs=3)], [3, 1]
        )
        return DataflowLoader(
            mixture, batch_size=3, num_workers=workers, processor=TruncateProcessor(1)
        )

    reference = [b["input_ids"].flatten().tolist() for b in make(0)]
    # three from the list per one from the shuffled map (epoch_order(5, 1, 0) = 0 4 3 2 1)
    assert reference == [[0, 0, 1], [2, 3, 4], [4, 5, 6], [3, 7, 8], [9, 2, 10], [11, 12, 1]]
    assert [b["input_ids"].flatten().tolist() for b in make(2)] == reference


@pytest.mark.parametrize(
    "packing, workers, threads",
    [
        (False, 0, 0),
        pytest.param(False, 2, 0, marks=pytest.mark.slow),  # worker processes: seconds
        (True, 0, 0),
        pytest.param(True, 2, 0, marks=pytest.mark.slow),
        (False, 0, 2),
        (True, 0, 2),
    ],
)
def test_loader_resumes_exactly_across_an_epoch_boundary(packing, workers, threads):
    per_epoch = len(list(loader("sft", packing, epochs=1)))
    check_resume(
        lambda: loader("sft", packing, workers, num_threads=threads),
        iter,
        points=[per_epoch - 1, per_epoch, per_epoch + 1],
    )


def test_state_counts_consumed_batches_not_prefetched_ones():
    first = loader(workers=2, prefetch_factor=4)
    batches = iter(first)
    for _ in range(3):
        next(batches)
    time.sleep(0.5)  # workers prefetch further meanwhile
    state = first.state_dict()
    assert state["consumed_batches"] == 3
    assert state["position"]["distributor"]["consumed"] == 12  # 3 batches of 4
    assert state["position"]["batcher"] == {
        "version": 2,
        "batcher": "SimpleBatcher",
        "batch_size": 4,
    }


def test_a_state_from_another_setup_is_refused_by_name():
    used = loader()
    next(iter(used))
    state = used.state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 4, now 8"):
        DataflowLoader(MapDistributor(ToyDataset("seq", 20), seed=9), batch_size=8).load_state_dict(
            state
        )
    with pytest.raises(ValueError, match="fingerprint: saved 'toy-seq-20-0', now 'toy-seq-21-0'"):
        DataflowLoader(MapDistributor(ToyDataset("seq", 21), seed=9), batch_size=4).load_state_dict(
            state
        )
    # packing that reads every item to size it (a processor that changes items) plans the
    # rank's own stream: its state is that rank's of that world size
    truncate = TruncateProcessor(10**6)
    packed = loader("sft", True, dp_rank=1, dp_world_size=2, processor=truncate)
    next(iter(packed))
    with pytest.raises(ValueError, match="dp_world_size: saved 2, now 1"):
        loader("sft", True, processor=truncate).load_state_dict(packed.state_dict())
    with pytest.raises(ValueError, match="dp_rank: saved 1, now 0"):
        loader("sft", True, dp_rank=0, dp_world_size=2, processor=truncate).load_state_dict(
            packed.state_dict()
        )
    # such a state does not load where packing plans on the global order (stored lengths)
    with pytest.raises(ValueError, match="dp_rank: saved 1 of 2 ranks, each packing its own"):
        loader("sft", True, dp_rank=0, dp_world_size=3).load_state_dict(packed.state_dict())


def test_a_distributor_without_state_cannot_resume_midway():
    class Plain(DataDistributor):
        def stream(self, dp_rank, dp_world_size, worker_id, num_workers):
            return iter([{"x": torch.tensor(1)}] * 4)

    used = DataflowLoader(Plain(), batch_size=2)
    next(iter(used))
    with pytest.raises(ValueError, match="cannot resume at batch 1: Plain keeps no position"):
        DataflowLoader(Plain(), batch_size=2).load_state_dict(used.state_dict())


def test_packing_counters_reach_the_main_process():
    packed = DataflowLoader(
        MapDistributor(ToyDataset("sft", 30), num_epochs=1),
        batcher=PoolPackingBatcher(24, pool_size=8),
        collator=roles("sft", True)[1],
        num_workers=2,
    )
    batches = list(packed)
    assert packed.counters["groups"] == len(batches)
    tokens = sum(b["num_tokens"] for b in batches)
    assert (
        packed.counters["tokens"]
        == tokens
        == sum(len(ToyDataset("sft", 30)[i]["input_ids"]) for i in range(30))
    )


class DieInWorker(RawItemProcessor):
    """Kills its DataLoader worker process on the item whose first token is `index`."""

    def __init__(self, index: int, sleep: bool = False) -> None:
        self.index, self.sleep = index, sleep

    def process(self, item: dict) -> dict:
        if get_worker_info() is not None and int(item["input_ids"][0]) == self.index:
            if self.sleep:
                time.sleep(60)
            os._exit(3)
        return item


class Unreadable(RawItemProcessor):
    """Raises on the item whose first token is `index`."""

    def __init__(self, index: int) -> None:
        self.index = index

    def process(self, item: dict) -> dict:
        if int(item["input_ids"][0]) == self.index:
            raise ValueError(f"sample {self.index} is unreadable")
        return item


@pytest.mark.parametrize("threads", [1, 3])
def test_an_error_in_a_reading_thread_raises_in_the_training_loop_and_stops_the_threads(threads):
    before = set(threading.enumerate())  # daemons of earlier tests (watchdogs, prefetchers)
    victim = int(epoch_order(20, 9, 0)[10])
    broken = DataflowLoader(
        MapDistributor(ToyDataset("seq", 20), seed=9),
        batch_size=2,
        processor=Unreadable(victim),
        num_threads=threads,
    )
    with pytest.raises(ValueError, match=f"sample {victim} is unreadable"):
        list(broken)
    stopped = time.monotonic() + 120  # a bound for a loaded machine; the loop ends early
    while time.monotonic() < stopped and set(threading.enumerate()) - before:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - before


def test_leaving_a_threaded_loader_early_stops_its_threads():
    before = set(threading.enumerate())
    batches = iter(loader(num_threads=2, prefetch_factor=1))
    next(batches)
    assert len(set(threading.enumerate()) - before) >= 2  # the loader's (and any late daemon)
    batches.close()  # what a `break` out of the training loop does
    assert not set(threading.enumerate()) - before


@pytest.mark.slow
@pytest.mark.parametrize("sleep", [False, True], ids=["worker-dies", "worker-hangs"])
def test_a_dead_or_stuck_worker_raises_in_the_main_process_within_seconds(sleep):
    victim = epoch_order(20, 9, 0)[10]
    broken = DataflowLoader(
        MapDistributor(ToyDataset("seq", 20), seed=9),
        batch_size=2,
        processor=DieInWorker(int(victim), sleep),
        num_workers=2,
        timeout=1,
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited unexpectedly|timed out"):
        for _ in broken:
            pass
    assert time.monotonic() - start < 300  # raises, not hangs: the bound is for a loaded machine


@pytest.mark.slow
def test_taking_one_batch_and_exiting_is_clean():
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, "tests")
        from resume import ToyDataset
        from tokenmill.dataflow import DataflowLoader, MapDistributor
        loader = DataflowLoader(MapDistributor(ToyDataset("seq", 100)), batch_size=4, num_workers=2)
        batch = next(iter(loader))
        print("took", batch["input_ids"].shape[0])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "took 4"


def test_processors_pass_items_through_or_cut_token_arrays():
    item = ToyDataset("grpo", 3)[2]
    assert IdentityProcessor().process(item) is item
    with pytest.raises(TypeError, match="expects dict items, got int"):
        IdentityProcessor().process(5)
    cut = TruncateProcessor(2).process(item)
    assert cut["prompts"].tolist() == item["prompts"][:2].tolist()
    assert [r.tolist() for r in cut["responses"]] == [r[:2].tolist() for r in item["responses"]]
    assert cut["rewards"] is item["rewards"]  # float values are not tokens
    ends = TruncateProcessor(1, keys=["prompts"], keep_end=True).process(item)
    assert ends["prompts"].tolist() == item["prompts"][-1:].tolist()
    assert ends["responses"] is item["responses"]
    with pytest.raises(TypeError, match="key 'rewards' is not a 1-D token tensor"):
        TruncateProcessor(1, keys=["rewards"]).process(item)


class Counted(ToyDataset):
    """A ToyDataset that counts the items read in this process."""

    reads = 0

    def __getitem__(self, index: int) -> dict:
        Counted.reads += 1
        return super().__getitem__(index)

    def sample_length(self, index: int) -> int:
        return ToyDataset(self.kind, self.size, self.seed).sample_length(index)


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_packing_plans_from_stored_lengths_as_it_would_by_reading(kind):
    """Packing batchers plan their groups from the dataset's `sample_length` (no read) and give
    the same batches and states as when they measure each item read; a worker then reads only
    the items of its own groups."""

    def make(measure: bool, threads: int = 0) -> DataflowLoader:
        batcher, collator = roles(kind, True)
        if measure:  # a size_fn of its own: the batcher must read every item to measure it
            batcher.size_fn = lambda item: token_count(item)
        distributor = MapDistributor(Counted(kind, 30), seed=9, num_epochs=1)
        return DataflowLoader(distributor, batcher=batcher, collator=collator, num_threads=threads)

    planned, measured = make(False), make(True)
    assert plans_from_lengths(planned.distributor, planned.processor, planned.batcher)
    assert not plans_from_lengths(measured.distributor, measured.processor, measured.batcher)
    Counted.reads = 0
    reference = list(measured)
    assert Counted.reads == 30
    assert same(check_resume(lambda: make(False), iter, points=[2, 3]), reference)
    Counted.reads = 0
    assert same(list(make(False, threads=3)), reference)
    assert Counted.reads == 30  # three threads, each reading only its groups' items
