"""DataDistributor: the first dataflow role (raw items for a rank) and its built-ins.

DataDistributor -> RawItemProcessor -> SampleBatcher -> BatchCollator. A distributor owns the raw
data and decides each data-parallel rank's stream; built-ins give it as cheap `indices` and read
an item only in `fetch`, so each loader worker reads only its own groups."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any

from tokenmill.dataflow.contracts import (
    dataset_tokenizer,
    has_fixed_windows,
    has_stored_lengths,
    keeps,
    stored_length,
)
from tokenmill.dataflow.provenance import check_one_tokenizer, first_tokenizer
from tokenmill.shards.schema import trained_tokens
from tokenmill.training.order_prefetch import order_prefetch
from tokenmill.training.state import (
    STATE_VERSION,
    ShardLayout,
    adopt_groups,
    check_shuffle,
    check_state,
    data_fingerprint,
    epoch_end,
    order_blocks,
    order_layout,
    order_setup,
    order_state,
    shard_bounds,
    state_count,
    worker_of,
)
from tokenmill.training.windows import WindowBatch

__all__ = [
    "DataDistributor",
    "IterableDistributor",
    "MapDistributor",
    "RankPartitionedDistributor",
    "MixtureDistributor",
    "MIXTURE_UNITS",
    "ON_EXHAUSTED",
    "worker_share",
    "rank_split",
    "pick_source",
    "check_sources",
    "trained_tokens",
]

# trained_tokens (tokenmill.shards.schema's, the mixture's default size by tokens) is exported
# here too, for the callers of before


class DataDistributor(ABC):
    """Owns the raw dataset, shards it across DP ranks x workers, shuffles, carries state.

    Besides `stream` (or `indices` and `fetch`) and its state, a distributor may declare the
    hooks below; each default means "not offered", and the loader then takes the general
    path (roles.py)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "keys" in cls.__dict__:  # the old name: silently unused now, so refused
            raise TypeError(f"{cls.__name__}.keys: the index stream is now named `indices`")

    @abstractmethod
    def stream(
        self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int
    ) -> Iterator[Any]:
        """Yield this (rank, worker)'s disjoint slice of raw items, from the saved position on."""

    def indices(self, dp_rank: int, dp_world_size: int) -> Iterator[Any]:
        """The rank's whole stream as indices for `fetch`, from the saved position on; once an index
        is yielded, `state_dict()` is the position after it. Default: the items themselves."""
        return self.stream(dp_rank, dp_world_size, 0, 1)

    def fetch(self, index: Any) -> Any:
        """The raw item of an index from `indices`."""
        return index

    def state_dict(self) -> dict:
        """Resume state. No-op default; resumable distributors override."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore resume state. No-op default; resumable distributors override."""
        return None

    def set_coordinates(self, dp_rank: int, dp_world_size: int) -> None:
        """Hook: the loader's data-parallel coordinates, given when it is made and after each
        `load_state_dict`: a distributor fixes here what the first run's world size decides,
        and refuses here, by name, a loaded state this rank cannot continue, not at the first
        batch inside a worker. Default: nothing."""
        return None

    def share_reads(self, worker_id: int, num_workers: int, block: int) -> None:
        """Hook: the loader tells each worker's distributor, before `indices`, which of them
        it will read: blocks worker_id, worker_id + num_workers, ... of `block` consecutive
        indices (`worker_share`); block 0: every worker walks every index and reads only its
        own groups'. A distributor may read ahead just those (MapDistributor has its dataset
        fetch them ahead). Default: nothing."""
        return None

    @property
    def windowed(self) -> bool:
        """Hook: True promises that `fetch_windows(group)` gives the WindowBatch of the items
        `fetch` gives of the group (windows of one length): the loader then reads a group at
        once and hands it over as stored, for the collator's `collate_windows`. Default False."""
        return False

    def fetch_windows(self, indices: list[Any]) -> WindowBatch:
        """Hook of `windowed`: items `indices` as one WindowBatch."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no fetch_windows(indices); a distributor that "
            "is windowed must define it"
        )

    @property
    def sized(self) -> bool:
        """Hook: True promises that `sample_length(index)` is the token count of `fetch(index)`
        (`tokenmill.shards.schema.token_count`), known without reading it: packing batchers
        that count tokens then plan from it, and each worker reads only its own groups.
        Default False."""
        return False

    def sample_length(self, index: Any) -> int:
        """Hook of `sized`: the tokens of item `index`, without reading it."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no sample_length(index); a distributor that is "
            "sized must define it"
        )

    @property
    def tokenizer_provenance(self) -> tuple[str, str] | None:
        """Hook: (fingerprint, path) of the tokenizer the data was made with, where it says,
        so that mixtures refuse sources of different tokenizers (provenance.py). Default
        None: it does not say."""
        return None

    def item_datasets(self) -> list[Any] | None:
        """Hook: the datasets whose items this distributor hands on as they are, so that a
        loader given no collator picks the one their items take (fitting.py). Default None:
        it cannot tell (the loader then stacks, and names the collator to pass if that
        fails)."""
        return None


def worker_share(
    indices: Iterable[Any], worker_id: int, num_workers: int, block: int = 1
) -> Iterator[Any]:
    """Indices of blocks worker_id, worker_id + num_workers, ... of `block` consecutive indices
    (`worker_of`); pulls no index past the one it yields, so the source's position stays exact."""
    if not 0 <= worker_id < num_workers or block < 1:
        raise ValueError(
            f"need 0 <= worker_id < num_workers and block >= 1, got {worker_id}, {num_workers}, {block}"
        )
    for q, index in enumerate(indices):
        if worker_of(q, block, num_workers) == worker_id:
            yield index


def check_sources(owner: str, sources: Sequence[Any]) -> None:
    """Every source of a composite distributor is a DataDistributor: refused by name if not."""
    for i, source in enumerate(sources):
        if not isinstance(source, DataDistributor):
            raise TypeError(
                f"{owner}: source {i} is a {type(source).__name__}, not a DataDistributor; "
                "wrap a dataset in MapDistributor or an iterable in IterableDistributor"
            )


def sources_datasets(sources: Sequence[DataDistributor]) -> list[Any] | None:
    """The item datasets of every source of a mixture, or None where one cannot tell."""
    found = [source.item_datasets() for source in sources]
    if any(datasets is None for datasets in found):
        return None
    return [dataset for datasets in found if datasets for dataset in datasets]


def _check_coordinates(dp_rank: int, dp_world_size: int) -> None:
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"need 0 <= dp_rank < dp_world_size, got {dp_rank}, {dp_world_size}")


class _IndexedDistributor(DataDistributor):
    """A distributor defined by `indices` and `fetch`; `stream` deals indices round robin to workers."""

    @abstractmethod
    def indices(self, dp_rank: int, dp_world_size: int) -> Iterator[Any]: ...

    def stream(
        self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int
    ) -> Iterator[Any]:
        for index in worker_share(self.indices(dp_rank, dp_world_size), worker_id, num_workers):
            yield self.fetch(index)


class MapDistributor(_IndexedDistributor):
    """A map-style dataset shuffled per epoch by (seed, epoch) (`training.state.order_at`).

    Global position p of an epoch goes to rank p % dp_world_size, so the state is one global
    count of consumed positions: O(1) to resume, under any world size. Streams `num_epochs`
    epochs, or indefinitely; `drop_last` as in `RDSampler`. The dataset may fetch items
    ahead of the order (`training.order_prefetch.OrderPrefetch`, for the indices this worker
    reads: `share_reads`). Windowed and sized as its dataset is (contracts.py), while `fetch`
    is this class's. `shuffle="shards"`, `canonical_groups` and `shard_window`: the
    shard-aware order, as in `RDSampler` (the group count defaults to the world size of the
    first run: the loader's, else the first `indices` call's)."""

    def __init__(
        self,
        dataset: Any,
        seed: int = 42,
        shuffle: bool | str = True,
        drop_last: bool = False,
        num_epochs: int | None = None,
        *,
        canonical_groups: int | None = None,
        shard_window: int = 4,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("MapDistributor needs a non-empty dataset")
        check_shuffle("MapDistributor", shuffle, canonical_groups, shard_window)
        self.dataset = dataset
        self.seed, self.shuffle = seed, shuffle
        self.drop_last, self.num_epochs = drop_last, num_epochs
        self.fingerprint = data_fingerprint(dataset)
        self.epoch, self.consumed = 0, 0
        self.reads: tuple[int, int, int] | None = None  # a loader worker's: see share_reads
        self.groups_given = canonical_groups is not None
        self.canonical_groups, self.shard_window = canonical_groups, shard_window
        self.bounds = shard_bounds(dataset) if shuffle == "shards" else None  # refused here
        self._layout: ShardLayout | None = None

    def indices(self, dp_rank: int, dp_world_size: int) -> Iterator[int]:
        _check_coordinates(dp_rank, dp_world_size)
        n = len(self.dataset)
        if self.drop_last and n < dp_world_size:
            raise ValueError(f"drop_last with {n} items and {dp_world_size} ranks leaves no items")
        self.set_coordinates(dp_rank, dp_world_size)
        layout = order_layout(self)
        prefetch = order_prefetch(self.dataset, self.seed, self.shuffle, self.reads, layout)
        while self.num_epochs is None or self.epoch < self.num_epochs:
            epoch, start = self.epoch, self.consumed
            end = epoch_end(n, start, dp_world_size, self.drop_last)
            order = order_blocks(
                start + dp_rank, end, dp_world_size, n, self.seed, epoch, self.shuffle,
                layout=layout,
            )  # fmt: skip
            for position, index in zip(range(start + dp_rank, end, dp_world_size), order):
                if prefetch is not None:  # the dataset fetches what the order reads next
                    prefetch(position, end, dp_world_size, epoch)
                done = position - dp_rank + dp_world_size  # every rank is past this round
                self.epoch, self.consumed = (epoch + 1, 0) if done >= end else (epoch, done)
                yield index
            self.epoch, self.consumed = epoch + 1, 0

    def fetch(self, index: int) -> Any:
        return self.dataset[index]

    def set_coordinates(self, dp_rank: int, dp_world_size: int) -> None:
        """The shard-aware order's canonical group count, when not given nor loaded, is the
        world size of the run that starts it."""
        if self.shuffle == "shards" and self.canonical_groups is None:
            self.canonical_groups = dp_world_size

    def share_reads(self, worker_id: int, num_workers: int, block: int) -> None:
        """The dataset fetches ahead only what this worker reads (`order_prefetch`)."""
        self.reads = (worker_id, num_workers, block)

    @property
    def windowed(self) -> bool:
        """The dataset's items are windows of one length (WindowReads) and `fetch` is this
        class's: `fetch_windows` reads a group at once."""
        return keeps(self, MapDistributor, "fetch") and has_fixed_windows(self.dataset)

    @property
    def sized(self) -> bool:
        """The dataset tells an item's tokens without reading it (StoredLengths) and `fetch`
        is this class's: packing plans from that."""
        return keeps(self, MapDistributor, "fetch") and has_stored_lengths(self.dataset)

    def sample_length(self, index: int) -> int:
        return stored_length(self.dataset, index)

    def fetch_windows(self, indices: list[int]) -> Any:
        """Items `indices` as one WindowBatch (see training.datasets)."""
        return self.dataset.read_windows(indices)

    @property
    def tokenizer_provenance(self) -> tuple[str, str] | None:
        return dataset_tokenizer(self.dataset)

    def item_datasets(self) -> list[Any] | None:
        return [self.dataset] if keeps(self, MapDistributor, "fetch") else None

    def _setup(self) -> dict[str, Any]:
        return order_setup(self)

    def state_dict(self) -> dict[str, Any]:
        return order_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        adopt_groups(self, state)
        check_state("MapDistributor", state, self._setup())
        self.epoch = state_count("MapDistributor", state, "epoch")
        self.consumed = state_count("MapDistributor", state, "consumed", len(self.dataset))


class IterableDistributor(_IndexedDistributor):
    """Any re-iterable (a list, an IterableDataset): item k goes to rank k % dp_world_size.
    Resuming reads the consumed items again and drops them; the stream ends with the iterable."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        if iter(iterable) is iterable:
            raise TypeError(
                "IterableDistributor needs a re-iterable (a list, a dataset), not a one-shot "
                "iterator: every worker and every resume reads it from the start"
            )
        self.iterable = iterable
        self.fingerprint = f"len={len(iterable)}" if isinstance(iterable, Sized) else "unsized"
        self.consumed = 0

    @property
    def tokenizer_provenance(self) -> tuple[str, str] | None:
        return dataset_tokenizer(self.iterable)

    def item_datasets(self) -> list[Any] | None:
        own = keeps(self, IterableDistributor, "fetch", "indices")
        return [self.iterable] if own else None

    def indices(self, dp_rank: int, dp_world_size: int) -> Iterator[Any]:
        _check_coordinates(dp_rank, dp_world_size)
        start = self.consumed
        for k, item in enumerate(self.iterable):
            q = k - start
            if q >= 0 and q % dp_world_size == dp_rank:
                self.consumed = start + q - dp_rank + dp_world_size
                yield item

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state("IterableDistributor", state, {"fingerprint": self.fingerprint})
        self.consumed = state_count("IterableDistributor", state, "consumed")


def rank_split(dp_world_size: int, ratios: Sequence[float]) -> list[int]:
    """Ranks per source, proportional to `ratios` (largest remainder, lowest index on ties)."""
    if any(r <= 0 for r in ratios) or not ratios:
        raise ValueError(f"ratios must be positive, got {list(ratios)}")
    quotas = [dp_world_size * r / sum(ratios) for r in ratios]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: dp_world_size - sum(counts)]:
        counts[i] += 1
    for i, count in enumerate(counts):
        if count == 0:
            raise ValueError(
                f"source {i} gets no rank: ratio {ratios[i]} of {dp_world_size} ranks; "
                "raise its ratio or the world size"
            )
    return counts


class RankPartitionedDistributor(_IndexedDistributor):
    """Whole ranks to sources by ratio: with ratios [3, 1] and 8 ranks, ranks 0-5 read source
    0 (as its ranks 0-5 of 6) and ranks 6-7 read source 1 (as its ranks 0-1 of 2). A rank's
    state is its source's position: it resumes under the same world size, on the same source."""

    def __init__(
        self,
        sources: Sequence[DataDistributor],
        ratios: Sequence[float],
        allow_mixed_tokenizers: bool = False,
    ) -> None:
        if len(sources) != len(ratios):
            raise ValueError(f"{len(sources)} sources but {len(ratios)} ratios")
        check_sources("RankPartitionedDistributor", sources)
        check_one_tokenizer("RankPartitionedDistributor", sources, allow_mixed_tokenizers)
        if not ratios or any(r <= 0 for r in ratios):
            raise ValueError(f"ratios must be positive, got {list(ratios)}")
        self.sources, self.ratios = list(sources), [float(r) for r in ratios]
        self.dp_world_size: int | None = None
        self.source: int | None = None

    def assignment(self, dp_rank: int, dp_world_size: int) -> tuple[int, int, int]:
        """(source, rank within the source, ranks of the source) for one rank."""
        _check_coordinates(dp_rank, dp_world_size)
        first = 0
        for source, count in enumerate(rank_split(dp_world_size, self.ratios)):
            if dp_rank < first + count:
                return source, dp_rank - first, count
            first += count
        raise AssertionError("unreachable: rank_split covers every rank")

    def set_coordinates(self, dp_rank: int, dp_world_size: int) -> None:
        """A loaded state resumes on the same source under the same world size only: refused
        here otherwise, naming both."""
        source, sub_rank, sub_world = self.assignment(dp_rank, dp_world_size)
        saved, now = [self.dp_world_size, self.source], [dp_world_size, source]
        if saved != [None, None] and saved != now:
            raise ValueError(
                f"RankPartitionedDistributor cannot resume on rank {dp_rank}: "
                f"[dp_world_size, source]: saved {saved}, now {now}"
            )
        self.sources[source].set_coordinates(sub_rank, sub_world)

    def indices(self, dp_rank: int, dp_world_size: int) -> Iterator[tuple[int, Any]]:
        self.set_coordinates(dp_rank, dp_world_size)
        source, sub_rank, sub_world = self.assignment(dp_rank, dp_world_size)
        self.dp_world_size, self.source = dp_world_size, source
        for index in self.sources[source].indices(sub_rank, sub_world):
            yield source, index

    def fetch(self, index: tuple[int, Any]) -> Any:
        return self.sources[index[0]].fetch(index[1])

    @property
    def tokenizer_provenance(self) -> tuple[str, str] | None:
        return first_tokenizer(self.sources)

    def item_datasets(self) -> list[Any] | None:
        if not keeps(self, RankPartitionedDistributor, "fetch", "indices"):
            return None
        return sources_datasets(self.sources)

    def state_dict(self) -> dict[str, Any]:
        position = None if self.source is None else self.sources[self.source].state_dict()
        return {
            "version": STATE_VERSION,
            "ratios": self.ratios,
            "dp_world_size": self.dp_world_size,
            "source": self.source,
            "position": position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state("RankPartitionedDistributor", state, {"ratios": self.ratios})
        self.dp_world_size, self.source = state["dp_world_size"], state["source"]
        if self.source is not None:
            self.sources[self.source].load_state_dict(state["position"])


MIXTURE_UNITS = ("samples", "tokens")
ON_EXHAUSTED = ("stop", "reweight")


def pick_source(counts: Sequence[float], shares: Sequence[float], largest: float = 1) -> int:
    """The next source of a mixture: among the sources not ahead of their share, the one
    whose lag would first reach `largest` (one sample). Keeps every prefix within one
    sample of the shares: |counts_i - share_i * sum(counts)| <= largest."""
    total = sum(counts)
    lag = [share * total - count for share, count in zip(shares, counts)]
    ready = [i for i in range(len(shares)) if lag[i] >= -1e-9 * max(total, 1)]
    return min(ready, key=lambda i: ((largest - lag[i]) / shares[i], i))


def _check_repeats(sources: Sequence[DataDistributor], repeats: Sequence[int | None]) -> None:
    """Each repeat is a pass count (None: unlimited) of a MapDistributor whose epochs are the
    passes: its num_epochs, unset or the same, becomes that count."""
    if len(repeats) != len(sources):
        raise ValueError(f"{len(sources)} sources but {len(repeats)} repeats")
    for i, (source, count) in enumerate(zip(sources, repeats)):
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            raise ValueError(f"repeats[{i}] must be a positive int or None, got {count!r}")
        if count is not None and count < 1:
            raise ValueError(f"repeats[{i}] must be a positive int or None, got {count!r}")
        if not isinstance(source, MapDistributor):
            raise TypeError(
                f"MixtureDistributor: source {i} is a {type(source).__name__}; repeats need "
                "MapDistributor sources, whose epochs are the passes"
            )
        if source.num_epochs is not None and source.num_epochs != count:
            raise ValueError(
                f"MixtureDistributor: source {i} has num_epochs={source.num_epochs} but "
                f"repeats {count}; give one of them"
            )


class MixtureDistributor(_IndexedDistributor):
    """A deterministic ratio-weighted merge of sources, each read as the same rank.

    Every prefix holds each source's share within one sample (`pick_source`): of samples
    (`by="samples"`: ranks pick alike, so with map-style sources the state is global), or
    of trained tokens (`by="tokens"`, counted by `size_fn`, default `trained_tokens`: this
    reads each item to count it, and the counts are the rank's own).

    `repeats` (one per source, MapDistributor sources): how many passes over each source the
    mixture may take, each a fresh epoch of its order, every sample once per pass; None in
    it: unlimited. Not given: each source streams as it was built (its own num_epochs).
    When a source has no more to give, `on_exhausted="stop"` ends the mixture, and
    `"reweight"` lets that source leave while the others keep their relative weights, until
    all are spent (the picks then depend on where each rank's stream ends: the state is the
    rank's own, as by tokens). `names` name the sources in refusals (default "source i").
    The state keeps weights, repeats and on_exhausted, and each source's state its data's
    fingerprint: a state saved under others is refused, naming the field and the source."""

    def __init__(
        self,
        sources: Sequence[DataDistributor],
        weights: Sequence[float],
        by: str = "samples",
        size_fn: Callable[[Any], int] | None = None,
        allow_mixed_tokenizers: bool = False,
        *,
        repeats: Sequence[int | None] | None = None,
        on_exhausted: str = "stop",
        names: Sequence[str] | None = None,
    ) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        check_sources("MixtureDistributor", sources)
        check_one_tokenizer("MixtureDistributor", sources, allow_mixed_tokenizers)
        if any(w <= 0 for w in weights):
            raise ValueError(f"weights must be positive, got {list(weights)}")
        if by not in MIXTURE_UNITS:
            raise ValueError(f"unknown by={by!r}; valid: {list(MIXTURE_UNITS)}")
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"unknown on_exhausted={on_exhausted!r}; valid: {list(ON_EXHAUSTED)}")
        if names is not None and len(names) != len(sources):
            raise ValueError(f"{len(sources)} sources but {len(names)} names")
        if repeats is not None:
            _check_repeats(sources, repeats)
            for source, count in zip(sources, repeats):
                source.num_epochs = count  # type: ignore[attr-defined]  # MapDistributor
        self.sources, self.weights, self.by = list(sources), [float(w) for w in weights], by
        self.repeats = None if repeats is None else list(repeats)
        self.on_exhausted = on_exhausted
        self.names = (
            list(names) if names is not None else [f"source {i}" for i in range(len(sources))]
        )
        self.size_fn = size_fn or trained_tokens
        self.counts = [0] * len(sources)  # samples or tokens taken from each source
        self.largest = 1  # the largest sample so far, in the unit of `counts`
        self.left: list[int] = []  # sources spent under on_exhausted="reweight", in order
        self.coordinates: list[int] | None = None  # the rank a rank-own state belongs to

    @property
    def rank_own(self) -> bool:
        """Whether the state is one rank's own: by tokens, or reweighted at each rank's ends."""
        return self.by == "tokens" or self.on_exhausted == "reweight"

    def set_coordinates(self, dp_rank: int, dp_world_size: int) -> None:
        """A rank's own state (`rank_own`) resumes on that rank of that world size only,
        refused here otherwise, naming both. The sources are told too."""
        _check_coordinates(dp_rank, dp_world_size)
        now = [dp_rank, dp_world_size]
        if self.rank_own and self.coordinates is not None and self.coordinates != now:
            raise ValueError(
                f"MixtureDistributor(by={self.by!r}, on_exhausted={self.on_exhausted!r}) "
                f"cannot resume: [dp_rank, dp_world_size]: saved {self.coordinates}, now {now}"
            )
        for source in self.sources:
            source.set_coordinates(dp_rank, dp_world_size)

    def indices(self, dp_rank: int, dp_world_size: int) -> Iterator[tuple]:
        self.set_coordinates(dp_rank, dp_world_size)
        if self.rank_own:
            self.coordinates = [dp_rank, dp_world_size]
        streams = [source.indices(dp_rank, dp_world_size) for source in self.sources]
        end = object()
        while True:
            active = [i for i in range(len(self.sources)) if i not in self.left]
            if not active:
                return
            weight = sum(self.weights[i] for i in active)
            shares = [self.weights[i] / weight for i in active]
            i = active[pick_source([self.counts[i] for i in active], shares, self.largest)]
            index = next(streams[i], end)
            if index is end:
                if self.on_exhausted == "stop":
                    return
                self.left.append(i)
                continue
            if self.by == "samples":
                self.counts[i] += 1
                yield (i, index)
            else:  # the item is read here to count it; the index carries it to fetch
                item = self.sources[i].fetch(index)
                size = self.size_fn(item)
                self.counts[i] += size
                self.largest = max(self.largest, size)
                yield (i, index, item)

    def fetch(self, index: tuple) -> Any:
        return index[2] if len(index) == 3 else self.sources[index[0]].fetch(index[1])

    @property
    def tokenizer_provenance(self) -> tuple[str, str] | None:
        return first_tokenizer(self.sources)

    def item_datasets(self) -> list[Any] | None:
        if not keeps(self, MixtureDistributor, "fetch", "indices"):
            return None
        return sources_datasets(self.sources)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "by": self.by,
            "weights": self.weights,
            "repeats": self.repeats,
            "on_exhausted": self.on_exhausted,
            "counts": list(self.counts),
            "largest": self.largest,
            "left": list(self.left),
            "coordinates": self.coordinates,
            "sources": [source.state_dict() for source in self.sources],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        owner = "MixtureDistributor"
        if isinstance(state, dict):  # a state saved before repeats and on_exhausted
            state = {"repeats": None, "on_exhausted": "stop", "left": [], **state}
        check_state(owner, state, {"by": self.by, "on_exhausted": self.on_exhausted})
        saved_sources = state.get("sources")
        if not isinstance(saved_sources, list) or len(saved_sources) != len(self.sources):
            count = len(saved_sources) if isinstance(saved_sources, list) else saved_sources
            raise ValueError(
                f"{owner} cannot resume: sources: saved {count}, now {len(self.sources)}"
            )
        for key in ("weights", "repeats"):
            saved, now = state.get(key), getattr(self, key)
            if not (isinstance(saved, list) and isinstance(now, list)) or len(saved) != len(now):
                continue  # check_state below names the whole field
            for i, (was, is_now) in enumerate(zip(saved, now)):
                if was != is_now:
                    raise ValueError(
                        f"{owner} cannot resume: {key} of {self.names[i]}: "
                        f"saved {was!r}, now {is_now!r}"
                    )
        check_state(owner, state, {"weights": self.weights, "repeats": self.repeats})
        left = state["left"]
        if not isinstance(left, list) or any(
            type(i) is not int or i not in range(len(self.sources)) for i in left
        ):
            raise ValueError(f"{owner} cannot resume: left {left!r} names no sources of these")
        for i, (source, saved) in enumerate(zip(self.sources, saved_sources)):
            try:
                source.load_state_dict(saved)
            except (ValueError, TypeError) as error:
                raise ValueError(f"{owner} cannot resume: {self.names[i]}: {error}") from error
        self.counts, self.largest = list(state["counts"]), state["largest"]
        self.coordinates, self.left = state["coordinates"], list(left)
