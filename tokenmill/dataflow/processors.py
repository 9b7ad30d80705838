"""RawItemProcessor: the second dataflow role (one raw item -> one sample) and its built-ins.

DataDistributor -> RawItemProcessor -> SampleBatcher -> BatchCollator. Dataset items are
already dicts of tensors, so `IdentityProcessor` is the default; `TruncateProcessor` cuts
token arrays to a length. A processor maps items one to one and keeps no state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.dataflow.contracts import keeps

__all__ = ["RawItemProcessor", "IdentityProcessor", "TruncateProcessor"]


class RawItemProcessor(ABC):
    """Transforms one raw dataset item into one training-ready sample dict."""

    @abstractmethod
    def process(self, item: Any) -> dict: ...

    @property
    def changes_items(self) -> bool:
        """Hook: False promises that `process` returns every item as it is, so the loader may
        skip it: read a group of windows at once and hand it over as stored (WindowBatch), and
        plan packing from the dataset's stored lengths (roles.py). Default True: every item
        goes through `process`."""
        return True


class IdentityProcessor(RawItemProcessor):
    """Passes dataset items (already dicts of tensors) through unchanged."""

    @property
    def changes_items(self) -> bool:
        """False while `process` is this class's: a subclass that overrides it is called."""
        return not keeps(self, IdentityProcessor, "process")

    def process(self, item: Any) -> dict:
        if not isinstance(item, dict):
            raise TypeError(
                f"IdentityProcessor expects dict items, got {type(item).__name__}; "
                "give the loader a processor that turns these items into dicts"
            )
        return item


def _is_tokens(value: Any) -> bool:
    """A 1-D integer or bool tensor: ids, masks and positions; float values such as rewards are not."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point()


class TruncateProcessor(RawItemProcessor):
    """Cuts token arrays to `max_len`, keeping the start (or the end with `keep_end`).

    `keys=None` cuts every 1-D integer or bool tensor and every list of them (GRPO
    `responses` and `masks`); float tensors (`rewards`) stay whole."""

    def __init__(
        self, max_len: int, keys: Sequence[str] | None = None, keep_end: bool = False
    ) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len, self.keys, self.keep_end = max_len, keys, keep_end

    def _cut(self, value: torch.Tensor) -> torch.Tensor:
        return value[-self.max_len :] if self.keep_end else value[: self.max_len]

    def process(self, item: Any) -> dict:
        sample = dict(IdentityProcessor().process(item))
        lengths = sample.pop("doc_lengths", None)  # boundaries, not tokens: cut to match below
        for key in sample if self.keys is None else self.keys:
            value = sample[key]
            if _is_tokens(value):
                sample[key] = self._cut(value)
            elif isinstance(value, list) and all(_is_tokens(v) for v in value):
                sample[key] = [self._cut(v) for v in value]
            elif self.keys is not None:
                raise TypeError(
                    f"TruncateProcessor: key {key!r} is not a 1-D token tensor or a list of them"
                )
        if lengths is not None and "input_ids" in sample:
            sample["doc_lengths"] = _cut_lengths(lengths, len(sample["input_ids"]), self.keep_end)
        return sample


def _cut_lengths(lengths: torch.Tensor, kept: int, keep_end: bool) -> torch.Tensor:
    """Document lengths of the `kept` tokens left at the start (or the end) of a sample."""
    lengths = lengths.flip(0) if keep_end else lengths
    ends = torch.cumsum(lengths, 0)
    cut = torch.minimum(ends, torch.tensor(kept)) - torch.minimum(
        ends - lengths, torch.tensor(kept)
    )
    cut = cut[cut > 0]
    return cut.flip(0) if keep_end else cut
