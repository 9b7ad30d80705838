"""The shard-aware shuffle (`shuffle="shards"`): a permutation per epoch, pinned; each rank
reads its canonical streams' shards only; exactly once and resumable under 2 -> 3 -> 1 ranks,
with and without packing; refusals at load_state_dict that name the field. Real shards
written by the Pipeline; the torchrun run of the same is test_shard_shuffle_torchrun.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume import ToyDataset, check_resume

from tokenmill.dataflow import (
    BatchCollator,
    DataflowLoader,
    IterableDistributor,
    MapDistributor,
    MixtureDistributor,
    RankPartitionedDistributor,
    SequentialPackingBatcher,
    SimpleBatcher,
)
from tokenmill.shards.format import shard_records
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.order import ShardLayout, epoch_order, order_at, shard_bounds
from tokenmill.training.sampler import RDSampler

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "seq": "pretrain_c4_300.jsonl",
    "sft": "chat_sharegpt_1000.jsonl",
    "dpo": "dpo_en_300.jsonl",
}
WINDOWS = {"seq": 64, "sft": 256, "dpo": None}


def build(out: Path, kind: str) -> Path:
    """A small real dataset of many shards (rows of 256 tokens, shards of 1,500)."""
    from tokenmill.preprocess.config import PipelineConfig
    from tokenmill.preprocess.presets import DEFAULT_CONFIGS
    from tokenmill.preprocess.run.pipeline import Pipeline

    config = copy.deepcopy(DEFAULT_CONFIGS[kind])
    config.setdefault("preprocessing", {}).update(max_items=40, max_packed_len=256)
    config.setdefault("output", {})["max_tokens_per_shard"] = 1500
    tokenizer = ROOT / "data" / "tokenizers" / "qwen2.5"
    source = [ROOT / "data" / SOURCES[kind]]
    Pipeline(
        PipelineConfig.from_dict(config), source, out, tokenizer, workers=1, progress=False
    ).run()
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    return {kind: build(root / kind, kind) for kind in SOURCES}


def load(path: Path, kind: str):
    return DatasetFactory.load(kind, path, window_size=WINDOWS[kind])


class Indexed(torch.utils.data.Dataset):
    """A real dataset whose items are their index (so a batch says which samples it holds),
    with the real one's length, fingerprint, stored lengths and shards."""

    def __init__(self, dataset) -> None:
        self.dataset, self.fingerprint = dataset, dataset.fingerprint
        self.bounds = shard_bounds(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {"index": i}

    def sample_length(self, i: int) -> int:
        return self.dataset.sample_length(i)

    def shard_bounds(self) -> np.ndarray:
        return self.bounds


class Indices(BatchCollator):
    def collate(self, samples: list[dict]) -> dict:
        return {"index": torch.tensor([s["index"] for s in samples])}


class Bounded:
    """A dataset of `sum(sizes)` items that says its shards."""

    def __init__(self, sizes) -> None:
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def __getitem__(self, i: int) -> dict:
        return {"index": i}

    def shard_bounds(self) -> np.ndarray:
        return self.bounds


# --- the order ------------------------------------------------------------------------


def test_shard_order_is_pinned_and_keeps_each_canonical_stream_in_its_shards():
    layout = ShardLayout(np.arange(0, 25, 5), groups=2, window=1)  # 4 shards of 5 items
    assert epoch_order(20, 42, 0, "shards", layout).tolist() == [
        16, 9, 18, 8, 19, 7, 17, 6, 15, 5, 14, 2, 13, 1, 10, 3, 12, 4, 11, 0,
    ]  # fmt: skip
    assert (
        epoch_order(20, 42, 1, "shards", layout).tolist()
        != epoch_order(20, 42, 0, "shards", layout).tolist()
    )
    # stream 0 (even positions) reads shard 3 then 2; stream 1 shard 1 then 0
    order = epoch_order(20, 42, 0, "shards", layout) // 5
    assert order[0::2].tolist() == [3] * 5 + [2] * 5
    assert order[1::2].tolist() == [1] * 5 + [0] * 5


def test_the_layout_keeps_runs_of_window_consecutive_shards_together():
    """A seq window past its shard's end reads the next shard: laid out beside it, that
    shard is most often on the same machine already (bench_bucket_shuffle: 1.84x -> 1.27x)."""
    layout = ShardLayout(np.arange(0, 60, 5), groups=1, window=3)  # 11 shards of 5 items
    shards, _ = layout.slots(seed=42, epoch=0)
    assert sorted(shards.tolist()) == list(range(11))
    after = dict(zip(shards.tolist(), shards[1:].tolist(), strict=False))
    assert all(after[s] == s + 1 for s in range(10) if s % 3 != 2)  # runs 0-2, 3-5, 6-8, 9-10
    assert shards.tolist() != list(range(11))  # the runs themselves are shuffled
    assert layout.slots(seed=42, epoch=1)[0].tolist() != shards.tolist()
    runs = ShardLayout(np.arange(0, 35, 5), groups=2, window=3)  # 6 shards: runs 0-2, 3-5
    assert epoch_order(30, 42, 0, "shards", runs).tolist() == [
        10, 17, 9, 27, 12, 29, 2, 21, 8, 15, 4, 25, 6, 23, 13, 24, 7, 19, 11, 28,
        1, 22, 3, 18, 5, 16, 14, 26, 0, 20,
    ]  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=25),
    groups=st.integers(1, 12),
    window=st.integers(1, 4),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 1000),
)
def test_shard_order_is_a_permutation_for_any_shards_groups_and_window(
    sizes, groups, window, seed, epoch
):
    if sum(sizes) == 0:
        sizes = [*sizes, 1]
    layout = ShardLayout(np.concatenate([[0], np.cumsum(sizes)]), groups, window)
    n = sum(sizes)
    order = epoch_order(n, seed, epoch, "shards", layout)
    assert np.array_equal(np.sort(order), np.arange(n))
    picks = np.asarray([0, n - 1, n, 3 * n + 1])  # one at a time, and past the end (padding)
    assert order_at(picks, n, seed, epoch, "shards", layout).tolist() == order[picks % n].tolist()


def test_a_rank_reads_its_share_of_the_shards_and_switches_rarely():
    """200 shards of 50 items, 8 canonical groups, 4 ranks: each rank reads a quarter of the
    shards (and at most the two a neighbour's stream shares at each of its streams' ends),
    any 100 reads in a row from at most 2 streams x 2 windows x 2 shards (here windows start
    where shards do); the global shuffle reads every shard, and most of 100 in 100 reads."""
    sizes = np.full(200, 50)
    sampler = {
        r: RDSampler(Bounded(sizes), shuffle="shards", rank=r, world_size=4, canonical_groups=8,
                     shard_window=2)
        for r in range(4)
    }  # fmt: skip
    shards = {r: np.asarray(list(sampler[r])) // 50 for r in range(4)}
    for r in range(4):
        touched = set(shards[r].tolist())
        assert 50 <= len(touched) <= 50 + 2 * 2, (r, len(touched))  # 2 streams, 2 ends each
        spans = np.lib.stride_tricks.sliding_window_view(shards[r], 100)
        assert max(len(set(span.tolist())) for span in spans) <= 8, r
    every = set().union(*(set(s.tolist()) for s in shards.values()))
    assert every == set(range(200))
    plain = np.asarray(list(RDSampler(Bounded(sizes), rank=0, world_size=4))) // 50
    assert len(set(plain.tolist())) > 190  # the global shuffle: (nearly) every shard
    assert len(set(plain[:100].tolist())) > 60


# --- real shards ---------------------------------------------------------------------


def test_shard_bounds_of_real_datasets_follow_their_shards(data):
    for kind, path in data.items():
        dataset = load(path, kind)
        metas = sorted(path.rglob("meta.json"), key=lambda p: p.parent.name)
        bounds = shard_bounds(dataset)
        assert len(bounds) == len(metas) + 1 > 8, kind
        assert bounds[0] == 0 and bounds[-1] == len(dataset)
        if kind == "dpo":  # a record per row: the shards' row counts
            rows = [shard_records(json.loads(m.read_text())) for m in metas]
            assert np.diff(bounds).tolist() == rows
            continue
        tokens = [json.loads(m.read_text())["sequence"]["shape"][0] for m in metas]
        starts = np.concatenate([[0], np.cumsum(tokens)])
        first = dataset.item_ranges(np.arange(len(dataset)))[0]  # each item's first token
        shard = np.searchsorted(starts, first, side="right") - 1
        assert np.array_equal(np.searchsorted(bounds, np.arange(len(dataset)), "right") - 1, shard)


def test_a_dataset_that_cannot_tell_its_shards_is_refused_by_name():
    with pytest.raises(ValueError, match='shuffle="shards" needs to know which shard.*ToyDataset'):
        RDSampler(ToyDataset("seq", 10), shuffle="shards")
    with pytest.raises(ValueError, match="ToyDataset"):
        MapDistributor(ToyDataset("seq", 10), shuffle="shards")
    with pytest.raises(ValueError, match="shuffle must be True, False or 'shards', got 'shard'"):
        RDSampler(Bounded([3]), shuffle="shard")
    with pytest.raises(ValueError, match="canonical_groups must be a positive int, got 0"):
        MapDistributor(Bounded([3]), shuffle="shards", canonical_groups=0)


# --- RDSampler: exactly once under 2 -> 3 -> 1 ranks ------------------------------------


def sampler_epoch(dataset, worlds=(2, 3, 1), steps=(7, 5), **kw) -> list[int]:
    """Read `steps[i]` samples per rank at world size `worlds[i]`, save, resume at the next;
    the last reads the rest of the epoch. Returns every index read."""
    seen: list[int] = []
    state = None
    for i, world in enumerate(worlds):
        samplers = [RDSampler(dataset, rank=r, world_size=world, **kw) for r in range(world)]
        for s in samplers:
            if state is not None:
                s.load_state_dict(json.loads(json.dumps(state)))
        iters = [iter(s) for s in samplers]
        count = steps[i] if i < len(steps) else len(samplers[0])
        for it in iters:
            seen += [next(it) for _ in range(count)] if i < len(steps) else list(it)
        for s in samplers:
            s.advance(count)
        states = [s.state_dict() for s in samplers]
        assert all(st == states[0] for st in states), "ranks saved different states"
        state = states[0]
    return seen


def test_rd_sampler_reads_every_sample_once_under_2_3_1_ranks(data):
    dataset = load(data["seq"], "seq")
    seen = sampler_epoch(dataset, shuffle="shards", seed=5)
    assert sorted(seen) == list(range(len(dataset)))
    # the saved group count wins over each world size's default, and is in the state
    sampler = RDSampler(dataset, shuffle="shards", world_size=3, rank=0)
    sampler.load_state_dict(RDSampler(dataset, shuffle="shards", world_size=2, rank=0).state_dict())
    assert sampler.canonical_groups == 2 and sampler.state_dict()["canonical_groups"] == 2


def test_rd_sampler_shards_state_resumes_exactly():
    dataset = Bounded([7, 0, 12, 5, 9])

    def make():
        return RDSampler(dataset, shuffle="shards", rank=1, world_size=2, canonical_groups=4)

    def iterate(sampler):  # epoch 0's rest (a state at its end is epoch 1's start)
        if sampler.epoch != 0:
            return
        for index in sampler:
            sampler.advance(1)
            yield index

    check_resume(make, iterate, points=(3, 9))


def test_shard_states_are_refused_under_another_setup_by_name():
    dataset = Bounded([10, 10, 10])
    shards = RDSampler(dataset, shuffle="shards", canonical_groups=4).state_dict()
    assert shards["shuffle"] == "shards" and shards["shard_window"] == 4
    with pytest.raises(ValueError, match="shuffle: saved 'shards', now True"):
        RDSampler(dataset).load_state_dict(shards)
    with pytest.raises(ValueError, match="shuffle: saved True, now 'shards'"):
        RDSampler(dataset, shuffle="shards").load_state_dict(RDSampler(dataset).state_dict())
    with pytest.raises(ValueError, match="canonical_groups: saved 4, now 6"):
        RDSampler(dataset, shuffle="shards", canonical_groups=6).load_state_dict(shards)
    with pytest.raises(ValueError, match="shard_window: saved 4, now 2"):
        RDSampler(dataset, shuffle="shards", shard_window=2).load_state_dict(shards)
    # the global shuffle's state keeps its fields, and no others
    assert set(RDSampler(dataset).state_dict()) == {
        "version", "seed", "shuffle", "drop_last", "fingerprint", "epoch", "consumed",
        "handed_out", "advanced",
    }  # fmt: skip


# --- DataflowLoader: exactly once under 2 -> 3 -> 1 ranks, with and without packing -------


def make_loader(dataset, packing: bool, rank, world, workers: int = 0, groups=None):
    """A shard-shuffled loader of indices; rank and world None: from torch.distributed."""
    distributor = MapDistributor(
        dataset, seed=3, shuffle="shards", num_epochs=1, canonical_groups=groups
    )
    batcher = SequentialPackingBatcher(600) if packing else SimpleBatcher(3)
    return DataflowLoader(
        distributor, batcher=batcher, collator=Indices(), dp_rank=rank, dp_world_size=world,
        num_workers=workers,
    )  # fmt: skip


def loader_epoch(dataset, packing: bool, worlds=(2, 3, 1), steps=(2, 1)) -> list[int]:
    """Ranks of each world size in turn (in this process): `steps[i]` batches each, then a
    state (every rank's the same) that the next world size loads; the last reads the rest."""
    seen: list[int] = []
    state = None
    for i, world in enumerate(worlds):
        loaders = [make_loader(dataset, packing, r, world, workers=i % 2) for r in range(world)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            batches = iter(loader)
            if i < len(steps):
                for _ in range(steps[i]):
                    seen += next(batches)["index"].tolist()
            else:
                seen += [j for batch in batches for j in batch["index"].tolist()]
        states = [loader.state_dict() for loader in loaders]
        if i < len(steps):
            assert all(s == states[0] for s in states), "ranks saved different states"
            assert states[0]["dp_rank"] is None and states[0]["dp_world_size"] == world
            assert states[0]["position"]["distributor"]["canonical_groups"] == 2
        state = states[0]
    return seen


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("kind", ["seq", "sft"])
def test_loader_reads_every_sample_once_under_2_3_1_ranks(data, kind, packing):
    dataset = Indexed(load(data[kind], kind))
    seen = loader_epoch(dataset, packing)
    assert sorted(seen) == list(range(len(dataset))), f"{kind} packing={packing}"


def test_a_packing_plan_is_the_same_under_any_world_size(data):
    """Packing planned from stored lengths plans the global order: the groups of 1 rank are
    those of 3 ranks, dealt round robin (of one canonical group count)."""
    dataset = Indexed(load(data["sft"], "sft"))
    alone = [b["index"].tolist() for b in make_loader(dataset, True, 0, 1, groups=2)]
    dealt = [
        [b["index"].tolist() for b in make_loader(dataset, True, r, 3, groups=2)] for r in range(3)
    ]
    for r in range(3):
        assert [alone[g] for g in range(len(alone)) if g % 3 == r] == dealt[r]
    assert sum(len(d) for d in dealt) == len(alone)


# --- what cannot resume under another world size is refused at load_state_dict ----------


def test_rank_partitioned_and_token_mixture_states_are_refused_at_load_by_name():
    items = [{"input_ids": torch.arange(n % 5 + 1, n % 5 + 4)} for n in range(40)]

    def partitioned():
        return RankPartitionedDistributor(
            [IterableDistributor(items), IterableDistributor(items[:20])], [1, 1]
        )

    saved = DataflowLoader(partitioned(), batch_size=2, dp_rank=0, dp_world_size=2)
    next(iter(saved))
    with pytest.raises(
        ValueError, match=r"\[dp_world_size, source\]: saved \[2, 0\], now \[3, 0\]"
    ):
        DataflowLoader(partitioned(), batch_size=2, dp_rank=0, dp_world_size=3).load_state_dict(
            saved.state_dict()
        )

    def mixture():
        return MixtureDistributor(
            [IterableDistributor(items), IterableDistributor(items[:20])], [1, 1], by="tokens"
        )

    saved = DataflowLoader(mixture(), batch_size=2, dp_rank=1, dp_world_size=2)
    next(iter(saved))
    with pytest.raises(
        ValueError, match=r"\[dp_rank, dp_world_size\]: saved \[1, 2\], now \[1, 3\]"
    ):
        DataflowLoader(mixture(), batch_size=2, dp_rank=1, dp_world_size=3).load_state_dict(
            saved.state_dict()
        )
