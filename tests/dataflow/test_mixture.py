"""MixtureDistributor's repeats and on_exhausted: pinned streams, every sample once per pass,
exact resume, states saved before them still loading, refusals that name the source."""

from __future__ import annotations

import json
from itertools import islice

import pytest
import torch
from resume import check_resume

from tokenmill.dataflow.distributors import (
    IterableDistributor,
    MapDistributor,
    MixtureDistributor,
)


def three(on_exhausted: str, c_repeats: int | None = 2, shuffle: bool = False):
    a = MapDistributor([100, 101, 102], shuffle=shuffle, seed=1)
    b = MapDistributor([200, 201], shuffle=shuffle, seed=1)
    c = MapDistributor([300, 301, 302, 303], shuffle=shuffle, seed=1)
    return MixtureDistributor(
        [a, b, c], [2, 1, 1], repeats=[2, 1, c_repeats], on_exhausted=on_exhausted,
        names=["a", "b", "c"],
    )  # fmt: skip


def stream(mixture: MixtureDistributor, rank: int = 0, world: int = 1) -> list:
    return list(mixture.stream(rank, world, 0, 1))


def test_stop_ends_the_mix_when_a_source_has_used_its_passes():
    # shares 2:1:1 hold within one sample; b (one pass of 2) is picked a third time: the end
    assert stream(three("stop")) == [100, 200, 101, 300, 102, 201, 100, 301, 101]
    check_resume(lambda: three("stop"), lambda d: d.stream(0, 1, 0, 1))


def test_reweight_lets_a_spent_source_leave_and_the_rest_keep_their_weights():
    got = stream(three("reweight"))
    assert got[:9] == stream(three("stop"))  # as stop, until b is out
    # then a:c = 2:1 until a's two passes are spent, then c alone to its second pass's end
    assert got[9:] == [302, 102, 303, 300, 301, 302, 303]
    full = got
    for base, size, passes in ((100, 3, 2), (200, 2, 1), (300, 4, 2)):
        mine = [x for x in full if base <= x < base + 100]
        assert sorted(mine) == sorted(list(range(base, base + size)) * passes)
    check_resume(lambda: three("reweight"), lambda d: d.stream(0, 1, 0, 1), points=[9, 10, 12])


def test_each_pass_is_a_fresh_order_with_every_sample_once():
    full = stream(three("reweight", shuffle=True))
    c = [x for x in full if x >= 300]
    assert sorted(c[:4]) == sorted(c[4:]) == [300, 301, 302, 303]
    assert c[:4] != c[4:]  # epoch 1's order is not epoch 0's (pinned: seed 1)
    check_resume(lambda: three("reweight", shuffle=True), lambda d: d.stream(0, 1, 0, 1))


def test_unlimited_repeats_stream_on():
    endless = islice(three("reweight", c_repeats=None).stream(0, 1, 0, 1), 40)
    tail = list(endless)[16:]
    assert tail == [300, 301, 302, 303] * 6  # a and b spent: c alone, pass after pass


def test_reweight_by_tokens_and_two_ranks_resume_exactly():
    def item(source: int, index: int, trained: int) -> dict:
        return {
            "input_ids": torch.tensor([source, index, 0, 0]),
            "loss_mask": torch.arange(4) < trained,
        }

    def make() -> MixtureDistributor:
        a = MapDistributor([item(0, i, 4) for i in range(6)], shuffle=False)
        b = MapDistributor([item(1, i, 1) for i in range(10)], shuffle=False)
        return MixtureDistributor(
            [a, b], [1, 1], by="tokens", repeats=[2, 1], on_exhausted="reweight"
        )

    picks = [(int(x["input_ids"][0]), int(x["input_ids"][1])) for x in stream(make())]
    assert sorted(picks) == sorted([(0, i) for i in range(6)] * 2 + [(1, i) for i in range(10)])
    assert [s for s, _ in picks[:10]] == [0, 1, 1, 1, 1, 0, 1, 1, 1, 1]  # 4 tokens vs 1
    check_resume(make, lambda d: d.stream(0, 1, 0, 1), points=[11, 12, 13])
    for rank in (0, 1):
        check_resume(make, lambda d, r=rank: d.stream(r, 2, 0, 1), points=[3])


def test_a_reweighted_state_resumes_on_its_own_rank_only():
    used = three("reweight")
    next(used.stream(1, 2, 0, 1))
    fresh = three("reweight")
    fresh.load_state_dict(json.loads(json.dumps(used.state_dict())))
    with pytest.raises(
        ValueError, match=r"\[dp_rank, dp_world_size\]: saved \[1, 2\], now \[0, 2\]"
    ):
        stream(fresh, 0, 2)


def test_a_state_saved_before_repeats_still_loads():
    # tests/golden/states.json's MixtureDistributor state as it was before repeats existed
    old = {
        "by": "samples",
        "coordinates": None,
        "counts": [1, 0],
        "largest": 1,
        "sources": [
            {"consumed": 1, "fingerprint": "len=5", "version": 2},
            {"consumed": 0, "fingerprint": "len=3", "version": 2},
        ],
        "version": 2,
        "weights": [0.7, 0.3],
    }

    def make() -> MixtureDistributor:
        return MixtureDistributor(
            [IterableDistributor(list("abcde")), IterableDistributor(list("xyz"))], [0.7, 0.3]
        )

    whole = stream(make())
    assert whole == list("axbcydez")
    resumed = make()
    resumed.load_state_dict(old)
    assert stream(resumed) == whole[1:]
    assert make().state_dict()["repeats"] is None  # the keys old states lack, at their values
    assert make().state_dict()["on_exhausted"] == "stop" and make().state_dict()["left"] == []


def test_an_edited_mix_is_refused_by_name():
    used = three("stop")
    list(islice(used.stream(0, 1, 0, 1), 4))
    state = json.loads(json.dumps(used.state_dict()))

    def refused(mixture: MixtureDistributor, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            mixture.load_state_dict(state)

    refused(three("reweight"), r"on_exhausted: saved 'stop', now 'reweight'")
    refused(three("stop", c_repeats=3), r"repeats of c: saved 2, now 3")
    refused(three("stop", c_repeats=None), r"repeats of c: saved 2, now None")
    edited = three("stop")
    edited.weights[1] = 5.0
    refused(edited, r"weights of b: saved 1.0, now 5.0")
    a = MapDistributor([100, 101, 102], shuffle=False, seed=1)
    b = MapDistributor([7, 8, 9], shuffle=False, seed=1)  # other data: another fingerprint
    c = MapDistributor([300, 301, 302, 303], shuffle=False, seed=1)
    other_b = MixtureDistributor([a, b, c], [2, 1, 1], repeats=[2, 1, 2], names=["a", "B", "c"])
    refused(other_b, r"B: MapDistributor cannot resume: fingerprint: saved 'len=2', now 'len=3'")
    two = MixtureDistributor([MapDistributor([1]), MapDistributor([2])], [2, 1], repeats=[2, 1])
    refused(two, r"sources: saved 3, now 2")
    for left in ([True], [3], ["0"]):  # a bool is not a source's number
        state["left"] = left
        refused(three("stop"), rf"left {left!r} names no sources of these".replace("[", r"\["))


def test_repeats_are_checked_when_the_mix_is_made():
    with pytest.raises(TypeError, match="source 0 is a IterableDistributor; repeats need"):
        MixtureDistributor([IterableDistributor([1])], [1], repeats=[2])
    with pytest.raises(ValueError, match="source 0 has num_epochs=3 but repeats 2"):
        MixtureDistributor([MapDistributor([1], num_epochs=3)], [1], repeats=[2])
    with pytest.raises(ValueError, match=r"repeats\[0\] must be a positive int or None, got 0"):
        MixtureDistributor([MapDistributor([1])], [1], repeats=[0])
    with pytest.raises(ValueError, match="1 sources but 2 repeats"):
        MixtureDistributor([MapDistributor([1])], [1], repeats=[1, 1])
    with pytest.raises(
        ValueError, match=r"unknown on_exhausted='skip'; valid: \['stop', 'reweight'\]"
    ):
        MixtureDistributor([MapDistributor([1])], [1], on_exhausted="skip")
