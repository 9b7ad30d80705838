"""BatchCollator built-ins: exact batches, and each one as collate_fn of a real DataLoader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from tokenmill.dataflow.collators import (
    BatchCollator,
    DefaultBatchCollator,
    DPOPaddingCollator,
    GRPOPaddingCollator,
    KTOPaddingCollator,
    PackedCollator,
    SFTPaddingCollator,
)
from tokenmill.dataflow.packed_preferences import (
    PackedDPOCollator,
    PackedGRPOCollator,
    PackedKTOCollator,
    packed_tokens,
)
from tokenmill.training.windows import WindowBatch


def L(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def B(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


def assert_batch(batch: dict, expected: dict) -> None:
    assert sorted(batch) == sorted(expected)
    for key, want in expected.items():
        got = batch[key]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype, key
            assert torch.equal(got, want), f"{key}: {got} != {want}"
        else:
            assert got == want, key


def sft_item(ids: list[int], mask: list[int], positions: list[int]) -> dict:
    return {
        "input_ids": L(*ids[:-1]),
        "target_ids": L(*ids[1:]),
        "loss_mask": B(*mask[1:]),
        "position_ids": L(*positions[:-1]),
    }


def kto_item(ids: list[int], mask: list[int], label: float) -> dict:
    return {"completion": L(*ids), "completion_mask": B(*mask), "label": torch.tensor(label)}


def grpo_item(
    prompt: list[int], responses: list[list[int]], masks: list[list[int]], rewards: list[float]
) -> dict:
    return {
        "prompts": L(*prompt),
        "responses": [L(*r) for r in responses],
        "masks": [B(*m) for m in masks],
        "rewards": torch.tensor(rewards),
    }


def test_batch_collator_is_an_abc_with_collate_and_call():
    with pytest.raises(TypeError):
        BatchCollator()  # type: ignore[abstract]

    class Count(BatchCollator):
        def collate(self, samples: list[dict]) -> dict:
            return {"n": len(samples)}

    assert Count()([{}, {}]) == {"n": 2}


def test_default_stacks_tensors_lists_and_numbers():
    samples = [
        {"input_ids": L(1, 2), "responses": [L(3), L(4)], "score": 0.5},
        {"input_ids": L(5, 6), "responses": [L(7), L(8)], "score": 1.5},
    ]
    assert_batch(
        DefaultBatchCollator().collate(samples),
        {
            "input_ids": torch.tensor([[1, 2], [5, 6]]),
            "responses": torch.tensor([[[3], [4]], [[7], [8]]]),
            "score": torch.tensor([0.5, 1.5]),
        },
    )


def test_default_refuses_unequal_lengths_and_missing_keys():
    with pytest.raises(ValueError, match=r"key 'input_ids' has shapes \[\(2,\), \(3,\)\]"):
        DefaultBatchCollator()([{"input_ids": L(1, 2)}, {"input_ids": L(1, 2, 3)}])
    with pytest.raises(KeyError, match=r"sample 1 lacks \['a'\]"):
        DefaultBatchCollator()([{"a": L(1)}, {"b": L(1)}])
    with pytest.raises(ValueError, match="empty group"):
        DefaultBatchCollator()([])


def test_default_names_the_collator_that_items_of_other_lengths_take():
    sft = [sft_item([1, 2, 3], [0, 1, 1], [0, 1, 2]), sft_item([4, 5], [0, 1], [0, 1])]
    with pytest.raises(ValueError, match=r"equal shapes: pass collator=SFTPaddingCollator\(\)"):
        DefaultBatchCollator()(sft)
    kto = [kto_item([1, 2, 3], [0, 1, 1], 1.0), kto_item([4, 5], [0, 1], 0.0)]
    with pytest.raises(ValueError, match=r"'completion' has shapes .*=KTOPaddingCollator\(\)"):
        DefaultBatchCollator()(kto)
    grpo = [grpo_item([1], [[2], [3, 4]], [[1], [1, 1]], [1.0, 0.0])]
    with pytest.raises(ValueError, match=r"'responses' holds shapes .*=GRPOPaddingCollator\(\)"):
        DefaultBatchCollator()(grpo)
    with pytest.raises(ValueError, match="give the loader a collator that pads or packs"):
        DefaultBatchCollator()([{"x": L(1)}, {"x": L(1, 2)}])


def test_sft_padding_exact():
    samples = [
        sft_item([10, 11, 12, 13], [0, 0, 1, 1], [0, 1, 2, 3]),
        sft_item([20, 21], [0, 1], [0, 1]),
    ]
    batch = SFTPaddingCollator(pad_id=7).collate(samples)
    assert_batch(
        batch,
        {
            "input_ids": L(10, 11, 12, 20, 7, 7).view(2, 3),
            "target_ids": L(11, 12, 13, 21, -100, -100).view(2, 3),
            "loss_mask": B(0, 1, 1, 1, 0, 0).view(2, 3),
            "position_ids": L(0, 1, 2, 0, 0, 0).view(2, 3),
            "attention_mask": B(1, 1, 1, 1, 0, 0).view(2, 3),
        },
    )
    masked = SFTPaddingCollator(pad_id=7, mask_targets=True)(samples)
    assert torch.equal(masked["target_ids"], L(-100, 12, 13, 21, -100, -100).view(2, 3))
    # seq items (no loss_mask, no position_ids) pad too
    seq = SFTPaddingCollator()(
        [{"input_ids": L(1), "target_ids": L(2)}, {"input_ids": L(3, 4), "target_ids": L(4, 5)}]
    )
    assert_batch(
        seq,
        {
            "input_ids": L(1, 0, 3, 4).view(2, 2),
            "target_ids": L(2, -100, 4, 5).view(2, 2),
            "attention_mask": B(1, 0, 1, 1).view(2, 2),
        },
    )


def test_dpo_padding_to_one_common_length():
    samples = [
        {
            "chosen": L(1, 2, 3),
            "rejected": L(1, 9),
            "chosen_mask": B(0, 1, 1),
            "rejected_mask": B(0, 1),
        },
        {
            "chosen": L(4, 5),
            "rejected": L(4, 6, 6, 6),
            "chosen_mask": B(0, 1),
            "rejected_mask": B(0, 1, 1, 1),
        },
    ]
    assert_batch(
        DPOPaddingCollator(pad_id=0).collate(samples),
        {
            "chosen": L(1, 2, 3, 0, 4, 5, 0, 0).view(2, 4),
            "rejected": L(1, 9, 0, 0, 4, 6, 6, 6).view(2, 4),
            "chosen_mask": B(0, 1, 1, 0, 0, 1, 0, 0).view(2, 4),
            "rejected_mask": B(0, 1, 0, 0, 0, 1, 1, 1).view(2, 4),
            "chosen_attention_mask": B(1, 1, 1, 0, 1, 1, 0, 0).view(2, 4),
            "rejected_attention_mask": B(1, 1, 0, 0, 1, 1, 1, 1).view(2, 4),
        },
    )


def test_kto_padding_with_the_names_trl_gives():
    samples = [kto_item([1, 2, 3], [0, 1, 1], 1.0), kto_item([4, 5], [0, 1], 0.0)]
    assert_batch(
        KTOPaddingCollator(pad_id=9).collate(samples),
        {
            "completion": L(1, 2, 3, 4, 5, 9).view(2, 3),
            "completion_mask": B(0, 1, 1, 0, 1, 0).view(2, 3),
            "attention_mask": B(1, 1, 1, 1, 1, 0).view(2, 3),
            "label": torch.tensor([1.0, 0.0]),
        },
    )
    with pytest.raises(KeyError, match=r"KTOPaddingCollator: sample 0 lacks \['label'\]"):
        KTOPaddingCollator()([{"completion": L(1), "completion_mask": B(1)}])


def test_grpo_padding_of_prompts_alone():
    """Prompt-only items (prompts for online generation): the prompts, left-padded."""
    batch = GRPOPaddingCollator(pad_id=0)([{"prompts": L(1, 2, 3)}, {"prompts": L(4)}])
    assert_batch(
        batch,
        {
            "prompts": L(1, 2, 3, 0, 0, 4).view(2, 3),
            "prompt_attention_mask": B(1, 1, 1, 0, 0, 1).view(2, 3),
        },
    )


def test_packed_dpo_keeps_each_pair_addressable():
    samples = [
        {
            "chosen": L(1, 2, 3),
            "rejected": L(1, 9),
            "chosen_mask": B(0, 0, 1),
            "rejected_mask": B(0, 1),
        },
        {
            "chosen": L(4, 5),
            "rejected": L(4, 6, 7, 8),
            "chosen_mask": B(0, 1),
            "rejected_mask": B(0, 1, 0, 1),
        },
    ]
    assert_batch(
        PackedDPOCollator().collate(samples),
        {
            # chosen_0, rejected_0, chosen_1, rejected_1, each shifted as seq/sft items are:
            # inputs without the last token, targets and mask without the first
            "input_ids": L(1, 2, 1, 4, 4, 6, 7).view(1, 7),
            "target_ids": L(2, 3, 9, 5, 6, 7, 8).view(1, 7),
            "loss_mask": B(0, 1, 1, 1, 1, 0, 1).view(1, 7),
            "position_ids": L(0, 1, 0, 0, 0, 1, 2).view(1, 7),
            "cu_seqlens": torch.tensor([0, 2, 3, 4, 7], dtype=torch.int32),
            "max_seqlen": 3,
            "num_tokens": 7,
            "chosen_index": L(0, 2),
            "rejected_index": L(1, 3),
        },
    )
    assert [packed_tokens(s) for s in samples] == [3, 4]


def test_packed_kto_pads_to_a_static_row_and_keeps_the_labels():
    samples = [kto_item([1, 2, 3], [0, 1, 1], 1.0), kto_item([4, 5], [0, 1], 0.0)]
    assert_batch(
        PackedKTOCollator(pad_id=0, pad_to=5).collate(samples),
        {
            "input_ids": L(1, 2, 4, 0, 0).view(1, 5),
            "target_ids": L(2, 3, 5, -100, -100).view(1, 5),
            "loss_mask": B(1, 1, 1, 0, 0).view(1, 5),
            "position_ids": L(0, 1, 0, 0, 1).view(1, 5),
            "cu_seqlens": torch.tensor([0, 2, 3, 5], dtype=torch.int32),
            "max_seqlen": 2,
            "num_tokens": 3,
            "label": torch.tensor([1.0, 0.0]),
        },
    )
    with pytest.raises(ValueError, match="PackedKTOCollator: group has 3 tokens, over pad_to=2"):
        PackedKTOCollator(pad_to=2)(samples)
    with pytest.raises(ValueError, match="sequence 0 has 3 tokens and a mask of 2"):
        PackedKTOCollator()([kto_item([1, 2, 3], [0, 1], 1.0)])


def test_packed_grpo_puts_each_response_after_its_prompt():
    samples = [
        grpo_item([1, 2], [[3], [4, 5]], [[1], [1, 0]], [1.0, 0.0]),
        grpo_item([6], [[7, 8]], [[1, 1]], [0.5]),
    ]
    assert_batch(
        PackedGRPOCollator().collate(samples),
        {
            # 1 2 3 | 1 2 4 5 | 6 7 8: the prompt never trains, the response as its mask says
            "input_ids": L(1, 2, 1, 2, 4, 6, 7).view(1, 7),
            "target_ids": L(2, 3, 2, 4, 5, 7, 8).view(1, 7),
            "loss_mask": B(0, 1, 0, 1, 0, 1, 1).view(1, 7),
            "position_ids": L(0, 1, 0, 1, 2, 0, 1).view(1, 7),
            "cu_seqlens": torch.tensor([0, 2, 5, 7], dtype=torch.int32),
            "max_seqlen": 3,
            "num_tokens": 7,
            "group_ids": L(0, 0, 1),
            "rewards": torch.tensor([1.0, 0.0, 0.5]),
        },
    )
    assert [packed_tokens(s) for s in samples] == [5, 2]
    with pytest.raises(
        KeyError, match=r"PackedGRPOCollator: sample 0 lacks \['responses', 'masks', 'rewards'\]"
    ):
        PackedGRPOCollator()([{"prompts": L(1, 2)}])


def test_grpo_padding_left_prompts_right_responses_and_group_mask():
    samples = [
        {
            "prompts": L(1, 2, 3),
            "responses": [L(4), L(5, 6)],
            "masks": [B(1), B(1, 1)],
            "rewards": torch.tensor([1.0, 0.0]),
        },
        {
            "prompts": L(7),
            "responses": [L(8, 9, 10)],
            "masks": [B(0, 1, 1)],
            "rewards": torch.tensor([0.5]),
        },
    ]
    assert_batch(
        GRPOPaddingCollator(pad_id=0).collate(samples),
        {
            "prompts": L(1, 2, 3, 0, 0, 7).view(2, 3),
            "prompt_attention_mask": B(1, 1, 1, 0, 0, 1).view(2, 3),
            "responses": L(4, 0, 0, 5, 6, 0, 8, 9, 10, 0, 0, 0).view(2, 2, 3),
            "masks": B(1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0).view(2, 2, 3),
            "response_attention_mask": B(1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0).view(2, 2, 3),
            "rewards": torch.tensor([[1.0, 0.0], [0.5, 0.0]]),
            "group_mask": B(1, 1, 1, 0).view(2, 2),
        },
    )


def test_packed_concatenates_with_cu_seqlens_and_reset_positions():
    samples = [
        sft_item([1, 2, 3, 4], [0, 1, 1, 1], [0, 1, 2, 3]),
        sft_item([5, 6, 7], [0, 0, 1], [0, 1, 2]),
    ]
    assert_batch(
        PackedCollator().collate(samples),
        {
            "input_ids": L(1, 2, 3, 5, 6).view(1, 5),
            "target_ids": L(2, 3, 4, 6, 7).view(1, 5),
            "loss_mask": B(1, 1, 1, 0, 1).view(1, 5),
            "position_ids": L(0, 1, 2, 0, 1).view(1, 5),
            "cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32),
            "max_seqlen": 3,
            "num_tokens": 5,
        },
    )


def test_packed_splits_windows_at_stored_position_restarts_and_pads():
    # one window holding the end of a document (positions 7, 8) and a new one (0, 1, 2)
    window = {
        "input_ids": L(1, 2, 3, 4, 5),
        "target_ids": L(2, 3, 4, 5, 6),
        "position_ids": L(7, 8, 0, 1, 2),
    }
    other = {"input_ids": L(9), "target_ids": L(10), "position_ids": L(0)}
    batch = PackedCollator(pad_id=0, pad_to=8)([window, other])
    assert_batch(
        batch,
        {
            "input_ids": L(1, 2, 3, 4, 5, 9, 0, 0).view(1, 8),
            "target_ids": L(2, 3, 4, 5, 6, 10, -100, -100).view(1, 8),
            "position_ids": L(0, 1, 0, 1, 2, 0, 0, 1).view(1, 8),
            "cu_seqlens": torch.tensor([0, 2, 5, 6, 8], dtype=torch.int32),
            "max_seqlen": 3,
            "num_tokens": 6,
        },
    )
    assert batch["num_tokens"] / batch["input_ids"].shape[1] == 0.75  # packing efficiency
    with pytest.raises(ValueError, match="group has 6 tokens, over pad_to=4"):
        PackedCollator(pad_to=4)([window, other])


def test_packed_splits_where_a_bfd_split_remainder_follows_another_document():
    # a window across two stored rows: the first ends with a document at positions 0..2, the
    # next starts with the remainder (positions 5, 6) of a document that bfd_split cut: three
    # documents, not two, although no position restarts at 0 between the first two
    window = {"input_ids": L(1, 2, 3, 4, 5, 6), "target_ids": L(2, 3, 4, 5, 6, 7),
              "position_ids": L(0, 1, 2, 5, 6, 0)}  # fmt: skip
    batch = PackedCollator()([window])
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 6]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch["max_seqlen"] == 3


class _Items(Dataset):
    """Variable-length sft-, dpo-, kto- and grpo-shaped items, deterministic in the index."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        n = i % 3 + 2
        ids = list(range(10 * i, 10 * i + n + 1))
        return {
            **sft_item(ids, [0] + [1] * n, list(range(n + 1))),
            "chosen": L(*ids),
            "rejected": L(*ids[:2]),
            "chosen_mask": B(*[1] * (n + 1)),
            "rejected_mask": B(1, 1),
            "prompts": L(*ids[:n]),
            "responses": [L(*ids[: g + 1]) for g in range(i % 2 + 1)],
            "masks": [B(*[1] * (g + 1)) for g in range(i % 2 + 1)],
            "rewards": torch.arange(i % 2 + 1, dtype=torch.float32),
            "completion": L(*ids),
            "completion_mask": B(*[0] + [1] * n),
            "label": torch.tensor(float(i % 2)),
        }


@pytest.mark.parametrize(
    "collator",
    [
        SFTPaddingCollator(),
        DPOPaddingCollator(),
        KTOPaddingCollator(),
        GRPOPaddingCollator(),
        PackedCollator(),
        PackedDPOCollator(),
        PackedKTOCollator(),
        PackedGRPOCollator(),
    ],
    ids=lambda c: type(c).__name__,
)
def test_collators_as_collate_fn_with_two_workers(collator: BatchCollator):
    dataset = _Items()
    in_process = [collator([dataset[j] for j in range(i, i + 4)]) for i in (0, 4)]
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collator)
    batches = list(loader)
    assert len(batches) == 2
    for got, want in zip(batches, in_process, strict=True):
        assert sorted(got) == sorted(want)
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert torch.equal(got[key], want[key]), key
            else:
                assert got[key] == want[key]


def test_default_collator_with_two_workers():
    class Fixed(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": torch.full((3,), i), "target_ids": torch.full((3,), i + 1)}

    batches = list(
        DataLoader(Fixed(), batch_size=3, num_workers=2, collate_fn=DefaultBatchCollator())
    )
    assert torch.equal(batches[1]["input_ids"], torch.tensor([[3, 3, 3], [4, 4, 4], [5, 5, 5]]))
    assert torch.equal(batches[0]["target_ids"][:, 0], torch.tensor([1, 2, 3]))


def test_packed_collator_takes_document_starts_from_stored_boundaries():
    """Row samples carry `doc_lengths`: cu_seqlens comes from them, not from positions (which
    here go on by one across a boundary, as a stream row's continuing document does)."""
    samples = [
        {"input_ids": torch.arange(5), "target_ids": torch.arange(1, 6),
         "position_ids": torch.arange(5), "doc_lengths": torch.tensor([2, 3])},
        {"input_ids": torch.arange(3), "target_ids": torch.arange(1, 4),
         "position_ids": torch.tensor([7, 8, 9]), "doc_lengths": torch.tensor([3])},
    ]  # fmt: skip
    batch = PackedCollator().collate(samples)
    assert batch["cu_seqlens"].tolist() == [0, 2, 5, 8]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    assert batch["max_seqlen"] == 3 and batch["num_tokens"] == 8


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(1, 9),
    seed=st.integers(0, 10**6),
    pad=st.sampled_from([None, 0, 5]),
    positions=st.booleans(),
)
def test_packing_stacked_windows_equals_packing_the_items(rows, width, seed, pad, positions):
    """collate_stacked (samples of one length, stacked as default_collate stacks them) gives
    what collate gives the items."""
    rng = np.random.default_rng(seed)
    stacked = {
        "input_ids": torch.from_numpy(rng.integers(0, 50, (rows, width))),
        "target_ids": torch.from_numpy(rng.integers(0, 50, (rows, width))),
        "loss_mask": torch.from_numpy(rng.random((rows, width)) < 0.5),
    }
    if positions:  # documents restart inside windows
        restarts = rng.random((rows, width)) < 0.3
        stacked["position_ids"] = torch.from_numpy(
            np.asarray([[0 if r else 1 for r in row] for row in restarts]).cumsum(1) * ~restarts
        )
    collator = PackedCollator(pad_to=None if pad is None else rows * width + pad)
    items = [{k: v[j] for k, v in stacked.items()} for j in range(rows)]
    expected, got = collator.collate(items), collator.collate_stacked(stacked)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), key


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(1, 9),
    seed=st.integers(0, 10**6),
    pad=st.sampled_from([None, 0, 5]),
    mask=st.booleans(),
    restarts=st.booleans(),
)
def test_packing_stored_windows_equals_packing_the_items(rows, width, seed, pad, mask, restarts):
    """collate_windows (the loader's path: [B, W + 1] int32 windows as stored) gives what
    collate gives the items, tensor for tensor, each the batch's own."""
    rng = np.random.default_rng(seed)
    arrays = {"sequence": torch.from_numpy(rng.integers(0, 50, (rows, width + 1), dtype=np.int32))}
    if mask:
        arrays["loss_mask"] = torch.from_numpy(rng.random((rows, width + 1)) < 0.5)
    if restarts:  # documents restarting inside windows
        start = rng.random((rows, width + 1)) < 0.3
        positions = np.where(start, 0, 1).cumsum(1) * ~start
        arrays["position_ids"] = torch.from_numpy(positions.astype(np.int32))
    collator = PackedCollator(pad_to=None if pad is None else rows * width + pad)
    windows = WindowBatch(arrays)
    expected, got = collator.collate(windows.items()), collator.collate_windows(arrays)
    assert list(got) == list(expected)
    for key, value in expected.items():
        want, have = torch.as_tensor(value), torch.as_tensor(got[key])
        assert have.dtype == want.dtype and torch.equal(have, want), key
    again = collator.collate_windows(arrays)
    for key in ("input_ids", "target_ids", "loss_mask", "position_ids"):  # the batch's own
        for stored in [*arrays.values(), again.get(key, torch.zeros(1))]:
            assert key not in got or not np.shares_memory(got[key].numpy(), stored.numpy())
