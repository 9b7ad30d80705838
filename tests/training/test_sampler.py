"""RDSampler and the order functions: pinned orders, ranks disjoint and complete, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume import ToyDataset, check_resume
from torch.utils.data import DataLoader

from tokenmill.training.sampler import RDSampler
from tokenmill.training.state import (
    advance_position,
    data_parallel_coordinates,
    epoch_end,
    epoch_order,
    order_at,
)

ORDER_42_0 = [7, 9, 1, 4, 3, 0, 2, 6, 8, 5]
ORDER_42_1 = [6, 9, 0, 1, 2, 4, 5, 3, 7, 8]


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_epoch_order_is_pinned_and_depends_on_seed_and_epoch():
    assert epoch_order(10, 42, 0).tolist() == ORDER_42_0
    assert epoch_order(10, 42, 1).tolist() == ORDER_42_1
    assert epoch_order(10, 41, 1).tolist() != ORDER_42_0  # (seed, epoch), not seed + epoch
    assert order_at(np.asarray([12, 3]), 10, 42, 0).tolist() == [ORDER_42_0[2], ORDER_42_0[3]]
    assert epoch_order(4, 42, 0, shuffle=False).tolist() == [0, 1, 2, 3]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**40), epoch=st.integers(0, 10**6))
def test_order_at_is_a_permutation_for_any_size_seed_and_epoch(n, seed, epoch):
    order = epoch_order(n, seed, epoch)
    assert np.array_equal(np.sort(order), np.arange(n))
    # positions read one at a time, or past the end (padding), agree with the whole epoch
    picks = np.asarray([0, n - 1, n, 2 * n + 1])
    assert order_at(picks, n, seed, epoch).tolist() == order[picks % n].tolist()


def test_order_at_spreads_every_index_over_every_position():
    """Over 4,000 epochs, each of 8 indices lands at position 0 about 500 times (a biased
    permutation, such as a near-identity or a fixed cycle, would not)."""
    first = [int(order_at(np.asarray([0]), 8, 7, epoch)[0]) for epoch in range(4000)]
    counts = np.bincount(first, minlength=8)
    assert counts.min() > 400 and counts.max() < 600, counts


def test_ranks_read_round_robin_positions_and_pad_with_the_first_indices():
    ranks = [list(RDSampler(Sized(10), rank=r, world_size=4)) for r in range(4)]
    assert ranks == [[7, 3, 8], [9, 0, 5], [1, 2, 7], [4, 6, 9]]  # 7 and 9 repeat as padding
    cut = [list(RDSampler(Sized(10), rank=r, world_size=4, drop_last=True)) for r in range(4)]
    assert cut == [[7, 3], [9, 0], [1, 2], [4, 6]]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    world=st.integers(1, 6),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
    consumed=st.integers(0, 40),
)
def test_ranks_are_disjoint_and_complete(n, world, epoch, drop_last, consumed):
    consumed = min(consumed, n)
    if drop_last and n < world:
        return
    order = epoch_order(n, 42, epoch).tolist()
    ranks = []
    for r in range(world):
        sampler = RDSampler(
            Sized(n), start_epoch=epoch, rank=r, world_size=world, drop_last=drop_last
        )
        sampler.consumed = consumed
        ranks.append(list(sampler))
    assert len({len(r) for r in ranks}) == 1  # every rank steps alike
    merged = [ranks[p % world][p // world] for p in range(world * len(ranks[0]))]
    left = order[consumed:]
    if drop_last:
        assert merged == left[: len(left) // world * world]
    else:
        assert merged[: len(left)] == left  # complete, in global order
        assert merged[len(left) :] == [order[i % n] for i in range(len(merged) - len(left))]


def test_order_does_not_depend_on_world_size():
    one = list(RDSampler(Sized(12), world_size=1, rank=0))
    three = [list(RDSampler(Sized(12), world_size=3, rank=r)) for r in range(3)]
    assert [three[p % 3][p // 3] for p in range(12)] == one


def steps(sampler: RDSampler, epochs: int):
    """A training loop that consumes one sample per step until `epochs` is reached."""
    while sampler.epoch < epochs:
        for index in sampler:
            sampler.advance(1)
            yield index


@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2)])
def test_resume_is_exact_across_an_epoch_boundary(rank, world):
    def make():
        return RDSampler(Sized(10), seed=3, rank=rank, world_size=world)

    per_epoch = 10 // world
    full = check_resume(
        make, lambda s: steps(s, 2), points=[per_epoch - 1, per_epoch, per_epoch + 1]
    )
    assert len(full) == 2 * per_epoch


def test_state_is_plain_data_and_start_iter_counts_all_ranks():
    sampler = RDSampler(Sized(10), rank=1, world_size=2)
    sampler.advance(3)
    state = sampler.state_dict()
    assert state == {
        "version": 2,
        "seed": 42,
        "shuffle": True,
        "drop_last": False,
        "fingerprint": "len=10",
        "epoch": 0,
        "consumed": 6,
        "handed_out": 0,  # the position the last iterator reached: none has run
        "advanced": True,
    }
    started = RDSampler(Sized(10), start_epoch=1, start_iter=4, rank=0, world_size=2)
    assert list(started) == [ORDER_42_1[4], ORDER_42_1[6], ORDER_42_1[8]]
    assert len(started) == 3
    assert advance_position(0, 6, 2, 10, 2, False) == (1, 0)
    assert advance_position(0, 0, 12, 10, 2, False) == (2, 4)
    assert epoch_end(10, 6, 3, drop_last=False) == 12  # 4 left, padded to 6 for 3 ranks
    assert epoch_end(10, 6, 3, drop_last=True) == 9


def test_resume_under_another_world_size_reads_exactly_the_rest():
    before = [RDSampler(Sized(20), rank=r, world_size=2) for r in range(2)]
    seen = [i for s in before for i in list(s)[:3]]
    for s in before:
        s.advance(3)
    state = before[0].state_dict()
    assert state == before[1].state_dict()
    after = []
    for r in range(3):
        s = RDSampler(Sized(20), rank=r, world_size=3)
        s.load_state_dict(state)
        after += list(s)
    padding = epoch_order(20, 42, 0)[0]  # 14 left over 3 ranks: one repeat of the first index
    assert sorted(seen + after) == sorted([*range(20), padding])


def test_a_state_from_another_setup_is_refused_by_name():
    state = RDSampler(Sized(10), seed=42).state_dict()
    with pytest.raises(ValueError, match="seed: saved 42, now 7"):
        RDSampler(Sized(10), seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint: saved 'len=10', now 'len=11'"):
        RDSampler(Sized(11)).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint: saved 'len=10', now 'toy-seq-10-0'"):
        RDSampler(ToyDataset("seq", 10)).load_state_dict(state)


def test_coordinates_are_explicit_or_default_and_checked():
    assert data_parallel_coordinates() == (0, 1)
    assert data_parallel_coordinates(2, 4) == (2, 4)
    with pytest.raises(ValueError, match="rank=4, world_size=4"):
        data_parallel_coordinates(4, 4)
    with pytest.raises(ValueError, match="not initialised"):
        data_parallel_coordinates(process_group=object())


def test_plain_dataloader_with_workers_resumes_from_consumed_not_prefetched():
    ds = ToyDataset("seq", 24)

    def batches(sampler: RDSampler, count: int):
        loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
        out = []
        for batch in loader:
            sampler.advance(len(batch["input_ids"]))
            out.append(batch["input_ids"][:, 0].tolist())
            if len(out) == count:
                break  # workers have prefetched further than this
        return out

    full = batches(RDSampler(ds, seed=5), 6)
    sampler = RDSampler(ds, seed=5)
    head = batches(sampler, 2)
    resumed = RDSampler(ds, seed=5)
    resumed.load_state_dict(sampler.state_dict())
    assert head + batches(resumed, 4) == full
    assert sorted(i for b in full for i in b) == list(range(24))
    assert torch.equal(torch.tensor(full[0]), torch.tensor(epoch_order(24, 5, 0)[:4]))
