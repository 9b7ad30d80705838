"""SampleBatcher built-ins: pinned groups, packing invariants, counters, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume import check_resume

from tokenmill.dataflow.batchers import (
    PoolPackingBatcher,
    SampleBatcher,
    SequentialPackingBatcher,
    SimpleBatcher,
    pool_groups,
    token_count,
)
from tokenmill.preprocess.packing import best_fit


def sample(index: int, size: int) -> dict:
    """A sample of `size` tokens whose first token is its index."""
    ids = torch.full((size,), 7)
    if size:
        ids[0] = index
    return {"input_ids": ids, "index": index}


def indices(groups: list[list[dict]]) -> list[list[int]]:
    return [[s["index"] for s in group] for group in groups]


class Fed:
    """A batcher fed from a list, resumed as the loader resumes it: from before its pending samples."""

    def __init__(self, batcher: SampleBatcher, samples: list[dict]) -> None:
        self.batcher, self.samples = batcher, samples
        self.start = self.pulled = 0

    def groups(self):
        def feed():
            for s in self.samples[self.start :]:
                self.pulled += 1
                yield s

        self.pulled = self.start
        return self.batcher.batches(feed())

    def state_dict(self) -> dict:
        state = self.batcher.state_dict()
        return {"batcher": state, "restart": self.pulled - state.get("pending", 0)}

    def load_state_dict(self, state: dict) -> None:
        self.batcher.load_state_dict(state["batcher"])
        self.start = state["restart"]


SIZES = [5, 3, 8, 2, 7, 9, 1, 4, 6, 12, 2, 2]


def test_simple_batcher_groups_in_order_and_refuses_another_size():
    groups = list(SimpleBatcher(3).batches(iter([sample(i, 1) for i in range(7)])))
    assert indices(groups) == [[0, 1, 2], [3, 4, 5], [6]]
    state = SimpleBatcher(8).state_dict()
    assert state == {"version": 2, "batcher": "SimpleBatcher", "batch_size": 8}
    with pytest.raises(ValueError, match="batch_size: saved 8, now 16"):
        SimpleBatcher(16).load_state_dict(state)
    with pytest.raises(TypeError):
        SampleBatcher()  # type: ignore[abstract]


def test_best_fit_is_pinned():
    """The one best-fit packer: groups in opening order, positions in placement order."""
    assert best_fit([5, 3, 8, 2, 7], 10) == [[2, 3], [4, 1], [0]]
    assert best_fit([], 10) == []
    assert best_fit([4, 0, 6, 0], 10) == [[2, 0, 1, 3]]  # an empty item joins the fullest group
    with pytest.raises(ValueError, match="exceeds the capacity of 10"):
        best_fit([11], 10)


def test_pool_packing_is_pinned_and_counts_efficiency():
    batcher = PoolPackingBatcher(10, pool_size=6)
    groups = list(batcher.batches(iter([sample(i, s) for i, s in enumerate(SIZES)])))
    # pool [5 3 8 2 7 9]: largest first into the fullest group it fits; pool [1 4 6 12 2 2]
    assert indices(groups) == [[5], [2, 3], [1, 4], [0], [7, 8], [6, 10, 11]]
    assert batcher.counters == {"groups": 6, "samples": 11, "tokens": 49, "dropped": 1}  # 12 > 10
    assert batcher.efficiency == pytest.approx(49 / 60)


def test_sequential_packing_keeps_order_and_drops_oversized():
    batcher = SequentialPackingBatcher(10)
    groups = list(batcher.batches(iter([sample(i, s) for i, s in enumerate(SIZES)])))
    assert indices(groups) == [[0, 1], [2, 3], [4], [5, 6], [7, 8], [10, 11]]
    assert batcher.counters["dropped"] == 1


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), max_size=60),
    budget=st.integers(1, 40),
    pool=st.integers(1, 10),
)
def test_packing_places_every_sample_once_and_no_group_over_budget(sizes, budget, pool):
    kept = [i for i, s in enumerate(sizes) if s <= budget]
    for batcher in (PoolPackingBatcher(budget, pool_size=pool), SequentialPackingBatcher(budget)):
        groups = indices(list(batcher.batches(iter([sample(i, s) for i, s in enumerate(sizes)]))))
        assert sorted(i for g in groups for i in g) == kept
        assert all(g and sum(sizes[i] for i in g) <= budget for g in groups)
        assert batcher.counters["dropped"] == len(sizes) - len(kept)
        assert batcher.counters["tokens"] == sum(sizes[i] for i in kept)
        if isinstance(batcher, SequentialPackingBatcher):
            assert [i for g in groups for i in g] == kept  # order preserved


@pytest.mark.parametrize(
    "make",
    [
        lambda: SimpleBatcher(5),
        lambda: PoolPackingBatcher(10, pool_size=4),
        lambda: SequentialPackingBatcher(10),
    ],
    ids=["simple", "pool", "sequential"],
)
def test_batchers_resume_exactly(make):
    samples = [sample(i, s) for i, s in enumerate(SIZES * 3)]
    full = check_resume(lambda: Fed(make(), samples), lambda fed: fed.groups(), points=range(20))
    assert len(full) > 5


def test_packing_state_names_pending_and_skip_and_refuses_another_budget():
    fed = Fed(PoolPackingBatcher(10, pool_size=6), [sample(i, s) for i, s in enumerate(SIZES)])
    groups = fed.groups()
    next(groups), next(groups)
    assert fed.state_dict() == {
        "batcher": {
            "version": 2,
            "batcher": "PoolPackingBatcher",
            "budget": 10,
            "pool_size": 6,
            "pending": 6,
            "skip": 2,
        },
        "restart": 0,
    }
    with pytest.raises(ValueError, match="budget: saved 10, now 16"):
        PoolPackingBatcher(16, pool_size=6).load_state_dict(fed.batcher.state_dict())
    with pytest.raises(
        ValueError, match="batcher: saved 'PoolPackingBatcher', now 'SequentialPackingBatcher'"
    ):
        SequentialPackingBatcher(10).load_state_dict(fed.batcher.state_dict())


def test_token_count_covers_each_train_type():
    assert token_count({"input_ids": torch.arange(4)}) == 4
    assert token_count({"chosen": torch.arange(3), "rejected": torch.arange(2)}) == 5
    assert (
        token_count({"prompts": torch.arange(2), "responses": [torch.arange(3), torch.arange(1)]})
        == 6
    )
    assert token_count({"completion": torch.arange(4), "label": torch.tensor(True)}) == 4  # KTO
    with pytest.raises(KeyError, match="matches no training type"):
        token_count({"pixels": torch.arange(3)})
    with pytest.raises(KeyError, match="SequentialPackingBatcher: .* pass size_fn"):
        list(SequentialPackingBatcher(8).batches(iter([{"pixels": torch.arange(3)}])))


def test_a_remembered_pool_plan_is_best_fit_of_the_pool():
    """Pools of one size pattern plan once; each plan is best_fit's, positions in order."""
    rng = np.random.default_rng(0)
    for sizes in [[5] * 12, rng.integers(1, 11, 40).tolist(), [3, 7, 7, 3], []]:
        for _ in range(2):  # planned, then remembered
            got = pool_groups(tuple(sizes), 10)
            assert [list(g) for g in got] == [sorted(g) for g in best_fit(sizes, 10)]
