"""SampleBatcher: the third dataflow role (samples -> groups) and its built-ins.

DataDistributor -> RawItemProcessor -> SampleBatcher -> BatchCollator. `SimpleBatcher`
takes N samples per group; the packing batchers fill groups up to a token budget. A
batcher's state says how to continue after its last group: `pending` samples it already
pulled go back to the stream, and the first `skip` groups of the next pull are dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from itertools import islice
from types import MappingProxyType
from typing import Any

from tokenmill.dataflow.contracts import keeps
from tokenmill.preprocess.packing import best_fit
from tokenmill.shards.schema import token_count
from tokenmill.training.state import STATE_VERSION, check_state

__all__ = [
    "SampleBatcher",
    "SimpleBatcher",
    "PoolPackingBatcher",
    "SequentialPackingBatcher",
    "token_count",
]

# token_count (tokenmill.shards.schema's, the packing batchers' default size) is exported here
# too, for the callers of before


class SampleBatcher(ABC):
    """Consumes a stream of samples and yields groups (the selection strategy).

    Besides `batches` and its state, a batcher may declare the hooks below; each default
    means "not offered", and the loader then takes the general path (roles.py)."""

    group_size: int | None = None
    """Hook: samples per group when fixed (a positive int). The loader then gives each worker
    whole groups of consecutive samples and reads only those; None: every worker runs
    `batches` over the whole stream and collates only its own groups."""

    @property
    def consecutive_groups(self) -> bool:
        """Hook: True promises that each group is exactly the next `group_size` samples as they
        came: the loader then never calls `batches`, and reads a group of windows at once
        (WindowBatch) where the dataset's items are windows of one length. Default False."""
        return False

    @property
    def counts_tokens(self) -> bool:
        """Hook: True promises that `batches(samples)` is `plan` of each sample with its token
        count (`tokenmill.shards.schema.token_count`): the loader then plans groups from the
        dataset's stored lengths (`plan` of indices), and each worker reads only its own
        groups. Default False."""
        return False

    @property
    def restart_every(self) -> int:
        """Hook: a resume restarts only after a multiple of this many pulled samples (where
        `pending` in the state ends): the loader keeps the distributor's state at those
        points only, on the stored-lengths path. Default 1."""
        return 1

    counters: Mapping[str, int] = MappingProxyType({})
    """Hook: running totals (groups, tokens, ...) the loader hands to the training side with
    each batch (`DataflowLoader.counters`). Default: none."""

    @abstractmethod
    def batches(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
        """Pull from ``samples``; yield one ``list[dict]`` per batch."""

    def plan(self, sized: Iterator[tuple[Any, int]]) -> Iterator[list[Any]]:
        """Hook of `counts_tokens`: groups of what comes with each size, samples or indices
        (the loader, from stored lengths), so that groups are planned without reading a sample."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no plan(sized); a batcher that sets "
            "counts_tokens=True must define it"
        )

    def sample_size(self, sample: dict) -> int:
        """Per-sample token cost for packing batchers. Non-packing batchers never call this."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Position after the last yielded group: {} means nothing pending, nothing to skip.
        A batcher that holds pulled samples across groups must report them as `pending`."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state: the caller feeds the stream from before `pending` samples."""
        return None


class SimpleBatcher(SampleBatcher):
    """N samples per group, in stream order; a finite stream's last group may be shorter."""

    def __init__(self, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.group_size = batch_size

    @property
    def consecutive_groups(self) -> bool:
        """True while `batches` is this class's: a subclass that overrides it is called."""
        return keeps(self, SimpleBatcher, "batches")

    def batches(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
        samples = iter(samples)
        while group := list(islice(samples, self.group_size)):
            yield group

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "batcher": "SimpleBatcher", "batch_size": self.group_size}

    def load_state_dict(self, state: dict) -> None:
        check_state(
            "SimpleBatcher", state, {"batcher": "SimpleBatcher", "batch_size": self.group_size}
        )


class _PackingBatcher(SampleBatcher):
    """Shared by the packing batchers: the size function, the budget, the counters."""

    name = ""
    counters: dict[str, int]

    def __init__(self, budget: int, size_fn: Callable[[dict], int] | None = None) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.budget = budget
        self.size_fn = size_fn or token_count
        self.counters = {"groups": 0, "samples": 0, "tokens": 0, "dropped": 0}
        self.pending, self.skip = 0, 0

    def sample_size(self, sample: dict) -> int:
        return self.size_fn(sample)

    def batches(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
        return self.plan(self._sized(samples))

    def _sized(self, samples: Iterator[dict]) -> Iterator[tuple[dict, int]]:
        """Each sample with its size; an item of no training type is refused naming this
        batcher, where the default size_fn cannot count it."""
        for sample in samples:
            try:
                size = self.sample_size(sample)
            except KeyError as err:
                if self.size_fn is not token_count:
                    raise
                raise KeyError(
                    f"{self.name}: {err.args[0]}; pass size_fn to count its tokens"
                ) from err
            yield sample, size

    @abstractmethod
    def plan(self, sized: Iterator[tuple[Any, int]]) -> Iterator[list[Any]]:
        """Groups of what comes with each size: samples, or (the loader, where sizes are stored)
        indices, so that groups are planned without reading a sample."""

    @property
    def counts_tokens(self) -> bool:
        """Sizes are token counts (the default size_fn) and `batches` plans by them, as this
        class's `batches` and `sample_size` do: a dataset's stored lengths give the sizes."""
        return self.size_fn is token_count and keeps(
            self, _PackingBatcher, "batches", "_sized", "sample_size"
        )

    @property
    def efficiency(self) -> float:
        """Share of the groups' token budget filled with real tokens (1.0 = no padding)."""
        groups = self.counters["groups"]
        return self.counters["tokens"] / (groups * self.budget) if groups else 0.0

    def _count(self, group: list[Any], sizes: list[int]) -> list[Any]:
        self.counters["groups"] += 1
        self.counters["samples"] += len(group)
        self.counters["tokens"] += sum(sizes)
        return group

    def _setup(self) -> dict[str, Any]:
        return {"batcher": self.name, "budget": self.budget}

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            **self._setup(),
            "pending": self.pending,
            "skip": self.skip,
        }

    def load_state_dict(self, state: dict) -> None:
        check_state(self.name, state, self._setup())
        self.pending, self.skip = 0, int(state["skip"])


class SequentialPackingBatcher(_PackingBatcher):
    """Order-preserving: pulls samples into a group until the next one would pass the
    budget. A sample larger than the budget is dropped and counted (`counters['dropped']`)."""

    name = "SequentialPackingBatcher"

    def plan(self, sized: Iterator[tuple[Any, int]]) -> Iterator[list[Any]]:
        group: list[Any] = []
        sizes: list[int] = []
        used = 0
        for sample, size in sized:
            if size > self.budget:
                self.counters["dropped"] += 1
                continue
            if group and used + size > self.budget:
                self.pending = 1  # this sample opens the next group
                yield self._count(group, sizes)
                group, sizes, used = [], [], 0
            group.append(sample)
            sizes.append(size)
            used += size
        if group:
            self.pending = 0
            yield self._count(group, sizes)


class PoolPackingBatcher(_PackingBatcher):
    """Pulls `pool_size` samples, packs them by `best_fit` into groups of at most `budget`
    tokens and yields those groups before pulling the next pool. Pools never mix, so a
    resume re-reads at most one pool. Oversized samples are dropped and counted."""

    name = "PoolPackingBatcher"

    def __init__(
        self, budget: int, pool_size: int = 64, size_fn: Callable[[dict], int] | None = None
    ) -> None:
        super().__init__(budget, size_fn)
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        self.pool_size = pool_size

    @property
    def restart_every(self) -> int:
        return self.pool_size  # a resume restarts at a pool's start

    def _setup(self) -> dict[str, Any]:
        return {**super()._setup(), "pool_size": self.pool_size}

    def plan(self, sized: Iterator[tuple[Any, int]]) -> Iterator[list[Any]]:
        sized = iter(sized)
        skip, self.skip = self.skip, 0
        while pool := list(islice(sized, self.pool_size)):
            kept = [s for s, size in pool if size <= self.budget]
            sizes = [size for _, size in pool if size <= self.budget]
            self.counters["dropped"] += len(pool) - len(kept)
            groups = pool_groups(tuple(sizes), self.budget)
            for j, positions in enumerate(groups):
                last = j == len(groups) - 1
                self.pending, self.skip = (0, 0) if last else (len(pool), j + 1)
                if j >= skip:
                    yield self._count([kept[p] for p in positions], [sizes[p] for p in positions])
            skip = 0


@lru_cache(maxsize=64)
def pool_groups(sizes: tuple[int, ...], budget: int) -> tuple[tuple[int, ...], ...]:
    """`best_fit` of a pool, each group's positions in order. Remembered: pools of windows
    (every size the same) plan once, not once per pool in every worker."""
    return tuple(tuple(sorted(group)) for group in best_fit(sizes, budget))
