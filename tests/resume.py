"""The shared resume check that every stateful piece passes, and small datasets for it.

`check_resume(make, iterate, points)`: run a fresh component to a point, save its state
(through JSON), finish; load the state into another fresh component, finish; the two
remainders must be bitwise identical. Callers add the points that cross an epoch boundary;
step 0 and the last step are always checked.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from tokenmill.dataflow import (
    DefaultBatchCollator,
    DPOPaddingCollator,
    GRPOPaddingCollator,
    PackedCollator,
    PoolPackingBatcher,
    SequentialPackingBatcher,
    SFTPaddingCollator,
    SimpleBatcher,
)

KINDS = ("seq", "sft", "dpo", "grpo")


def same(a: Any, b: Any) -> bool:
    """Bitwise equality through dicts, lists and tensors (dtype included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if not same(x, y):
            return f"output {i} differs: {x!r} != {y!r}"
    return f"lengths differ: {len(a)} != {len(b)}"


def check_resume(
    make: Callable[[], Any],
    iterate: Callable[[Any], Iterator[Any]],
    points: Iterable[int] = (),
) -> list[Any]:
    """`make()` gives a fresh component, `iterate(c)` its outputs from its position on (a
    finite stream). Checks resuming after 0, 1, half, all-but-one and all outputs plus
    `points`; returns the uninterrupted outputs."""
    full = list(iterate(make()))
    n = len(full)
    for k in sorted({0, 1, n // 2, n - 1, n, *points} & set(range(n + 1))):
        first = make()
        outputs = iterate(first)
        head = [next(outputs) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        tail = list(outputs)
        assert same(head + tail, full), (
            f"saving changed the stream at {k}: {first_difference(head + tail, full)}"
        )
        second = make()
        second.load_state_dict(state)
        resumed = list(iterate(second))
        assert same(resumed, full[k:]), (
            f"resume at {k} of {n}: {first_difference(resumed, full[k:])}"
        )
    return full


class ToyDataset(torch.utils.data.Dataset):
    """Map-style items shaped like the real `seq`/`sft`/`dpo`/`grpo` items, of random
    lengths, whose first token is the item's index so a batch says which samples it holds."""

    def __init__(self, kind: str, size: int, seed: int = 0) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; valid: {list(KINDS)}")
        self.kind, self.size, self.seed = kind, size, seed
        self.fingerprint = f"toy-{kind}-{size}-{seed}"

    def __len__(self) -> int:
        return self.size

    def _tokens(self, rng: np.random.Generator, index: int, low: int, high: int) -> torch.Tensor:
        ids = rng.integers(1000, 2000, size=int(rng.integers(low, high + 1)))
        ids[0] = index
        return torch.from_numpy(ids).long()

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        rng = np.random.default_rng([self.seed, index])
        if self.kind in ("seq", "sft"):
            ids = (
                self._tokens(rng, index, 9, 9)
                if self.kind == "seq"
                else self._tokens(rng, index, 3, 12)
            )
            item = {"input_ids": ids[:-1], "target_ids": ids[1:]}
            if self.kind == "sft":
                item["loss_mask"] = torch.from_numpy(rng.random(len(ids) - 1) < 0.7)
                item["position_ids"] = torch.arange(len(ids) - 1)
            return item
        if self.kind == "dpo":
            chosen, rejected = self._tokens(rng, index, 2, 8), self._tokens(rng, index, 2, 8)
            return {
                "chosen": chosen,
                "rejected": rejected,
                "chosen_mask": torch.arange(len(chosen)) > 0,
                "rejected_mask": torch.arange(len(rejected)) > 0,
            }
        responses = [self._tokens(rng, index, 1, 5) for _ in range(2)]
        return {
            "prompts": self._tokens(rng, index, 2, 6),
            "responses": responses,
            "masks": [torch.ones(len(r), dtype=torch.bool) for r in responses],
            "rewards": torch.from_numpy(rng.random(2).astype(np.float32)),
        }

    def sample_length(self, index: int) -> int:
        from tokenmill.dataflow.batchers import token_count

        return token_count(self[index])


def roles(kind: str, packing: bool, batch_size: int = 4, budget: int = 24) -> tuple[Any, Any]:
    """(batcher, collator) for a train type: fixed groups, or packing to a token budget."""
    collators = {
        "seq": DefaultBatchCollator,
        "sft": SFTPaddingCollator,
        "dpo": DPOPaddingCollator,
        "grpo": GRPOPaddingCollator,
    }
    if not packing:
        return SimpleBatcher(batch_size), collators[kind]()
    if kind in ("seq", "sft"):
        return PoolPackingBatcher(budget, pool_size=6), PackedCollator()
    if kind == "dpo":
        return SequentialPackingBatcher(budget), DPOPaddingCollator()
    return PoolPackingBatcher(budget, pool_size=5), GRPOPaddingCollator()


def sample_ids(batch: dict) -> list[int]:
    """Indices of the toy samples in a collated batch (their first token)."""
    if "cu_seqlens" in batch:
        return batch["input_ids"][0][batch["cu_seqlens"][:-1].long()].tolist()
    if "input_ids" in batch:
        return batch["input_ids"][:, 0].tolist()
    if "chosen" in batch:
        return batch["chosen"][:, 0].tolist()
    return [row[0] for row in batch["responses"][:, 0, :].tolist()]
