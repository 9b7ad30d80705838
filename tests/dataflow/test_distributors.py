"""DataDistributor built-ins: pinned streams, disjoint and complete slices, exact resume,
mixture shares, refusals that name the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume import check_resume

from tokenmill.dataflow.distributors import (
    DataDistributor,
    IterableDistributor,
    MapDistributor,
    MixtureDistributor,
    RankPartitionedDistributor,
    pick_source,
    rank_split,
    trained_tokens,
    worker_share,
)
from tokenmill.training.order_prefetch import own_positions


def stream(
    distributor: DataDistributor, rank: int = 0, world: int = 1, worker: int = 0, workers: int = 1
) -> list:
    return list(distributor.stream(rank, world, worker, workers))


def test_the_seed_contract_stream_is_the_one_abstract_method():
    with pytest.raises(TypeError):
        DataDistributor()  # type: ignore[abstract]

    class Letters(DataDistributor):
        def stream(self, dp_rank, dp_world_size, worker_id, num_workers):
            return iter("abc")

    letters = Letters()
    assert letters.state_dict() == {} and letters.load_state_dict({}) is None
    assert list(letters.indices(0, 1)) == ["a", "b", "c"] and letters.fetch("b") == "b"


def test_worker_share_deals_blocks_round_robin():
    assert list(worker_share(range(10), 1, 3, block=2)) == [2, 3, 8, 9]
    assert list(worker_share(range(7), 0, 2)) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="worker_id < num_workers"):
        list(worker_share(range(3), 2, 2))


def test_map_distributor_streams_are_pinned():
    def make() -> MapDistributor:
        return MapDistributor(list(range(10)), seed=42, num_epochs=1)

    assert stream(make()) == [7, 9, 1, 4, 3, 0, 2, 6, 8, 5]  # epoch_order(10, 42, 0)
    assert [stream(make(), r, 2) for r in range(2)] == [[7, 1, 3, 2, 8], [9, 4, 0, 6, 5]]
    assert [stream(make(), 0, 1, w, 3) for w in range(3)] == [[7, 4, 2, 5], [9, 3, 6], [1, 0, 8]]
    assert stream(MapDistributor(list("abc"), shuffle=False, num_epochs=2)) == list("abcabc")


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 30),
    world=st.integers(1, 4),
    workers=st.integers(1, 3),
    epochs=st.integers(1, 2),
)
def test_map_slices_are_disjoint_and_complete(n, world, workers, epochs):
    slices = [
        stream(MapDistributor(list(range(n)), seed=7, num_epochs=epochs), r, world, w, workers)
        for r in range(world)
        for w in range(workers)
    ]
    per_rank_epoch = -(-n // world)
    assert sum(len(s) for s in slices) == per_rank_epoch * world * epochs
    seen = sorted(i for s in slices for i in s)
    assert set(seen) == set(range(n))
    assert (
        len(seen) - n * epochs == (per_rank_epoch * world - n) * epochs
    )  # only the padding repeats


@pytest.mark.parametrize("rank, world", [(0, 1), (1, 3)])
def test_map_distributor_resumes_exactly_across_epochs(rank, world):
    def make() -> MapDistributor:
        return MapDistributor(list(range(9)), seed=1, num_epochs=3)

    per_epoch = -(-9 // world)
    full = check_resume(
        make,
        lambda d: d.stream(rank, world, 0, 1),
        points=[per_epoch - 1, per_epoch, per_epoch + 1],
    )
    assert len(full) == 3 * per_epoch


def test_map_state_is_global_so_another_world_size_reads_exactly_the_rest():
    ranks = [MapDistributor(list(range(25)), seed=3, num_epochs=1) for _ in range(2)]
    streams = [r.stream(i, 2, 0, 1) for i, r in enumerate(ranks)]
    seen = [next(s) for s in streams for _ in range(5)]
    assert ranks[0].state_dict() == ranks[1].state_dict()
    assert ranks[0].state_dict()["consumed"] == 10
    rest = []
    for r in range(3):
        d = MapDistributor(list(range(25)), seed=3, num_epochs=1)
        d.load_state_dict(ranks[0].state_dict())
        rest += stream(d, r, 3)
    assert sorted(seen + rest) == list(range(25))  # 15 left: 5 for each of 3 ranks


def test_map_refuses_other_data_or_seed():
    state = MapDistributor(list(range(5))).state_dict()
    with pytest.raises(ValueError, match="fingerprint: saved 'len=5', now 'len=6'"):
        MapDistributor(list(range(6))).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: saved 42, now 1"):
        MapDistributor(list(range(5)), seed=1).load_state_dict(state)


def test_iterable_distributor_round_robin_and_resume():
    assert [stream(IterableDistributor(list("abcdefg")), r, 3) for r in range(3)] == [
        ["a", "d", "g"],
        ["b", "e"],
        ["c", "f"],
    ]
    check_resume(lambda: IterableDistributor(list(range(11))), lambda d: d.stream(1, 2, 0, 1))
    with pytest.raises(TypeError, match="re-iterable"):
        IterableDistributor(iter([1, 2]))


def test_rank_partitioned_gives_whole_ranks_by_ratio():
    assert rank_split(8, [3, 1]) == [6, 2]
    assert rank_split(5, [1, 1, 1]) == [2, 2, 1]
    with pytest.raises(ValueError, match="source 1 gets no rank: ratio 0.1 of 4 ranks"):
        rank_split(4, [1, 0.1])

    def make() -> RankPartitionedDistributor:
        return RankPartitionedDistributor(
            [IterableDistributor(list("abcdef")), IterableDistributor(list("XYZ"))], [3, 1]
        )

    assert [stream(make(), r, 4) for r in range(4)] == [
        ["a", "d"],
        ["b", "e"],
        ["c", "f"],
        ["X", "Y", "Z"],
    ]
    check_resume(make, lambda d: d.stream(3, 4, 0, 1))
    used = make()
    next(used.stream(3, 4, 0, 1))
    state = used.state_dict()
    with pytest.raises(
        ValueError, match=r"\[dp_world_size, source\]: saved \[4, 1\], now \[8, 1\]"
    ):
        fresh = make()
        fresh.load_state_dict(state)
        stream(fresh, 7, 8)
    with pytest.raises(
        ValueError, match=r"\[dp_world_size, source\]: saved \[4, 1\], now \[4, 0\]"
    ):
        fresh = make()
        fresh.load_state_dict(state)
        stream(fresh, 0, 4)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.floats(0.01, 20), min_size=1, max_size=7),
    sizes=st.lists(st.integers(0, 50), min_size=1, max_size=300),
)
def test_mixture_shares_stay_within_one_sample_over_every_prefix(weights, sizes):
    shares = [w / sum(weights) for w in weights]
    for unit in ("samples", "tokens"):
        counts, largest = [0] * len(shares), 1
        for size in sizes:
            size = 1 if unit == "samples" else size
            i = pick_source(counts, shares, largest)
            counts[i] += size
            largest = max(largest, size)
            total = sum(counts)
            for share, count in zip(shares, counts):
                assert abs(count - share * total) <= largest * (1 + 1e-9)


def item(source: int, index: int, trained: int) -> dict:
    return {
        "input_ids": torch.tensor([source, index, 0, 0]),
        "loss_mask": torch.arange(4) < trained,
    }


def test_mixture_by_samples_is_pinned_and_resumes():
    def make() -> MixtureDistributor:
        a = MapDistributor(list(range(100, 106)), shuffle=False, num_epochs=1)
        b = MapDistributor(list(range(200, 203)), shuffle=False, num_epochs=1)
        return MixtureDistributor([a, b], [2, 1])

    assert stream(make()) == [100, 200, 101, 102, 201, 103, 104, 202, 105]
    check_resume(make, lambda d: d.stream(0, 1, 0, 1))
    with pytest.raises(ValueError, match=r"weights of source 0: saved 2.0, now 1.0"):
        MixtureDistributor([MapDistributor([1]), MapDistributor([2])], [1, 1]).load_state_dict(
            make().state_dict()
        )


def test_mixture_by_tokens_balances_trained_tokens_and_resumes():
    def make() -> MixtureDistributor:
        a = MapDistributor([item(0, i, 4) for i in range(40)], shuffle=False, num_epochs=1)
        b = MapDistributor([item(1, i, 1) for i in range(40)], shuffle=False, num_epochs=1)
        return MixtureDistributor([a, b], [1, 1], by="tokens")

    picks = [int(x["input_ids"][0]) for x in stream(make())]
    assert picks[:10] == [0, 1, 1, 1, 1, 0, 1, 1, 1, 1]  # 4 trained tokens vs 1: four b per a
    assert picks.count(1) == 40 and picks.count(0) == 11  # ends when b runs out
    check_resume(make, lambda d: d.stream(0, 1, 0, 1), points=[5, 6])
    used = make()
    next(used.stream(0, 2, 0, 1))
    fresh = make()
    fresh.load_state_dict(used.state_dict())
    with pytest.raises(
        ValueError, match=r"\[dp_rank, dp_world_size\]: saved \[0, 2\], now \[1, 2\]"
    ):
        stream(fresh, 1, 2)


def test_trained_tokens_counts_masks_or_all_tokens():
    assert trained_tokens(item(0, 0, 3)) == 3
    assert (
        trained_tokens(
            {
                "chosen": torch.ones(3),
                "rejected": torch.ones(2),
                "chosen_mask": torch.tensor([0, 1, 1]).bool(),
                "rejected_mask": torch.tensor([1, 1]).bool(),
            }
        )
        == 4
    )
    assert trained_tokens({"input_ids": torch.arange(5)}) == 5


def test_a_distributor_with_the_old_index_method_name_is_refused():
    with pytest.raises(TypeError, match="Old.keys: the index stream is now named `indices`"):

        class Old(IterableDistributor):
            def keys(self, dp_rank, dp_world_size):  # type: ignore[override]
                return iter([])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    workers=st.integers(1, 4),
    block=st.integers(1, 9),
    given_before=st.integers(0, 50),
)
def test_each_worker_fetches_ahead_the_positions_worker_share_deals_it(
    n, workers, block, given_before
):
    """The read-ahead of a bucket dataset looks at the positions its own worker will read:
    `own_positions` agrees with `worker_share` over the same stream of indices."""
    positions = np.arange(given_before, given_before + n)
    for worker in range(workers):
        dealt = list(worker_share(range(given_before + n), worker, workers, block))
        expected = [p for p in dealt if p >= given_before]
        got = own_positions(positions, given_before, (worker, workers, block))
        assert got.tolist() == expected
