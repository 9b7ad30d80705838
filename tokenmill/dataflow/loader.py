"""DataflowLoader: runs the roles' batch sequence (roles.py) in torch DataLoader workers, in
background threads or in this process, and keeps its place in it.

Worker w of N yields groups w, w + N, ... of the rank's sequence and torch's DataLoader
returns worker outputs round robin, so the sequence is the same for every num_workers (and
num_threads) and a resume continues it exactly. A group of windows crosses the worker pipe as
int32 (`WindowBatch`) and is collated here, on the training side."""

from __future__ import annotations

import copy
import itertools
import queue
import sys
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory

from tokenmill.dataflow.batchers import SampleBatcher, SimpleBatcher
from tokenmill.dataflow.collators import BatchCollator
from tokenmill.dataflow.distributors import DataDistributor
from tokenmill.dataflow.fitting import fitting_collator
from tokenmill.dataflow.processors import IdentityProcessor, RawItemProcessor
from tokenmill.dataflow.roles import check_roles, collate_windows, read_path, run_roles
from tokenmill.training.state import (
    STATE_VERSION,
    check_state,
    data_parallel_coordinates,
    state_count,
)
from tokenmill.training.windows import WindowBatch, piped

__all__ = ["DataflowLoader", "LoaderOptions"]


@dataclass(frozen=True)
class LoaderOptions:
    """How a DataflowLoader runs its roles, as one value: each field means what the loader's
    keyword of the same name means (see DataflowLoader), with the same default. Checked when
    made, so a wrong setting is refused where it is written."""

    batch_size: int | None = None
    num_workers: int = 0
    prefetch_factor: int = 2
    dp_rank: int | None = None
    dp_world_size: int | None = None
    timeout: float = 300.0
    pin_memory: bool = False
    multiprocessing_context: Any = None
    num_threads: int = 0
    lookahead: int = 0
    rank_keyed: bool = False

    def __post_init__(self) -> None:
        if self.num_workers < 0 or self.num_threads < 0:
            raise ValueError(
                "num_workers and num_threads must be >= 0, got "
                f"{self.num_workers}, {self.num_threads}"
            )
        if self.num_workers and self.num_threads:
            raise ValueError("give num_workers (processes) or num_threads (in process), not both")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")


def options_of(keywords: dict[str, Any], options: LoaderOptions | None) -> LoaderOptions:
    """The loader's options: `options`, or the keywords; a keyword set away from its default
    next to `options` is refused by name (the two would disagree on who decides)."""
    if options is None:
        return LoaderOptions(**keywords)
    if not isinstance(options, LoaderOptions):
        raise TypeError(f"DataflowLoader: options is a {type(options).__name__}, not LoaderOptions")
    both = [
        f.name
        for f in fields(LoaderOptions)
        if keywords[f.name] is not f.default and keywords[f.name] != f.default
    ]
    if both:
        raise ValueError(
            f"DataflowLoader: {', '.join(both)} given both as a keyword and in options; "
            "give each setting once"
        )
    return options


class _Roles(IterableDataset):
    """The DataLoader's dataset: runs the roles for the worker it finds itself in."""

    def __init__(self, loader: DataflowLoader) -> None:
        self.roles = (loader.distributor, loader.processor, loader.batcher, loader.collator)
        self.coordinates = (loader.dp_rank, loader.dp_world_size)

    def __iter__(self) -> Iterator[tuple[dict, dict, dict]]:
        info = get_worker_info()
        worker = (info.id, info.num_workers) if info is not None else (0, 1)
        outputs = run_roles(*self.roles, *self.coordinates, *worker)
        return piped(outputs) if info is not None else outputs


def threaded_roles(loader: DataflowLoader) -> Iterator[tuple[dict, dict, dict]]:
    """The roles run by `num_threads` background threads of this process, merged round robin as
    DataLoader merges workers: the same sequence, with no process to start and no pipe to cross.
    Thread t reads groups t, t + N, ... (its own copy of the roles when N > 1); reading ahead
    overlaps the training step, which releases the GIL, as do numpy's and torch's copies."""
    n = loader.num_threads
    roles = (loader.distributor, loader.processor, loader.batcher, loader.collator)
    copies: list[tuple[Any, Any, Any, Any]] = [roles]
    if n > 1:
        copies = [copy.deepcopy(roles) for _ in range(n)]  # stores copy paths, not maps
    queues: list[queue.Queue] = [queue.Queue(loader.prefetch_factor) for _ in range(n)]
    stop = threading.Event()

    def produce(t: int) -> None:
        outputs = run_roles(*copies[t], loader.dp_rank, loader.dp_world_size, t, n)
        try:
            for output in outputs:
                if not _put(queues[t], output, stop):
                    return
            _put(queues[t], _END, stop)
        except BaseException as err:  # handed to the training loop, which raises it
            _put(queues[t], _Failed(err), stop)

    threads = [threading.Thread(target=produce, args=(t,), daemon=True) for t in range(n)]
    for thread in threads:
        thread.start()
    try:
        for t in itertools.cycle(range(n)):
            output = queues[t].get()
            if output is _END:  # the thread due next has no group: the sequence has ended
                return
            if isinstance(output, _Failed):
                raise output.error
            yield output
    finally:
        stop.set()
        for thread in threads:
            thread.join()


_END = object()


@dataclass
class _Failed:
    error: BaseException


def _put(into: queue.Queue, output: Any, stop: threading.Event) -> bool:
    """Put unless the consumer has stopped; False once it has."""
    while not stop.is_set():
        try:
            into.put(output, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _called_by_lightning() -> bool:
    """state_dict() was called by Lightning's loops (they checkpoint stateful loaders)."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller.startswith(("lightning.", "pytorch_lightning."))


def _as_is(batch: Any) -> Any:
    return batch


class DataflowLoader:
    """Iterable of batches from the four roles, resumable at any consumed batch.

    `batch_size=N` is shorthand for `SimpleBatcher(N)`. With no collator the loader takes the
    one that fits its dataset's items (fitting.py): windows of one length stack
    (DefaultBatchCollator), other items of a training type take its padding collator. DP
    coordinates come from `dp_rank`/`dp_world_size`, else torch.distributed. `state_dict()`
    counts batches the training loop received, not what workers prefetched; a state saved
    under a setup that cannot continue exactly is refused with the field and both values.
    Fixed-size groups resume under another world size, and so does packing planned from the
    dataset's stored lengths (on the global order, groups dealt to ranks round robin); packing
    that reads every item to size it resumes on the same rank of the same world size, and
    another is refused at `load_state_dict`. `timeout` (seconds, num_workers > 0) bounds a stuck worker.
    `num_threads=N` (instead of workers) reads ahead in N threads of this process: for
    memory-mapped data, where a read costs less than handing a batch across processes.
    `lookahead=N`: the consumer takes N batches ahead of the one it trains (Lightning's
    fetcher takes 1), so `state_dict()` leaves the last N handed out for the resume.
    `rank_keyed=True`: torchtitan's per-rank state layout (see `state_dict`).
    `options=LoaderOptions(...)` gives these settings (every keyword but the roles) as one
    value instead; a keyword set next to it is refused by name. Each role must be an
    instance of its base class, whose hooks choose the fast paths (roles.py)."""

    def __init__(
        self,
        distributor: DataDistributor,
        processor: RawItemProcessor | None = None,
        batcher: SampleBatcher | None = None,
        collator: BatchCollator | None = None,
        batch_size: int | None = None,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
        timeout: float = 300.0,
        pin_memory: bool = False,
        multiprocessing_context: Any = None,
        num_threads: int = 0,
        lookahead: int = 0,
        rank_keyed: bool = False,
        options: LoaderOptions | None = None,
    ) -> None:
        keywords = {
            "batch_size": batch_size,
            "num_workers": num_workers,
            "prefetch_factor": prefetch_factor,
            "dp_rank": dp_rank,
            "dp_world_size": dp_world_size,
            "timeout": timeout,
            "pin_memory": pin_memory,
            "multiprocessing_context": multiprocessing_context,
            "num_threads": num_threads,
            "lookahead": lookahead,
            "rank_keyed": rank_keyed,
        }
        self.options = options_of(keywords, options)
        if self.options.batch_size is not None:
            if batcher is not None:
                raise ValueError(
                    "batch_size=N stands for SimpleBatcher(N); give it or a batcher, not both"
                )
            batcher = SimpleBatcher(self.options.batch_size)
        if batcher is None:
            raise ValueError("DataflowLoader needs batch_size=N or a batcher")
        self.distributor, self.batcher = distributor, batcher
        self.processor = IdentityProcessor() if processor is None else processor
        self.collator = fitting_collator(distributor) if collator is None else collator
        check_roles(self.distributor, self.processor, self.batcher, self.collator)
        self.dp_rank, self.dp_world_size = data_parallel_coordinates(
            self.options.dp_rank, self.options.dp_world_size
        )
        self.distributor.set_coordinates(self.dp_rank, self.dp_world_size)
        # packing planned from stored lengths: on the global order, the same under any world size
        self.global_plan = read_path(distributor, self.processor, batcher).startswith("planned")
        self.num_workers = self.options.num_workers
        self.prefetch_factor = self.options.prefetch_factor
        self.timeout = self.options.timeout
        self.pin_memory = self.options.pin_memory
        self.multiprocessing_context = self.options.multiprocessing_context
        self.num_threads = self.options.num_threads
        self.lookahead = self.options.lookahead
        self.rank_keyed = self.options.rank_keyed
        self.consumed_batches = 0
        self.counters: dict[str, int] = {}
        self._position: dict[str, Any] | None = None  # None: wherever the roles stand now
        # (position, consumed_batches) before the last `lookahead` batches handed out
        self._trail: deque[tuple[dict[str, Any], int]] = deque(maxlen=self.lookahead + 1)

    def __iter__(self) -> Iterator[dict]:
        position = self._current_position()
        self.distributor.load_state_dict(position["distributor"])
        self.batcher.load_state_dict(position["batcher"])
        self._trail.clear()
        self._trail.append((position, self.consumed_batches))
        if self.num_threads:
            outputs: Any = threaded_roles(self)
        elif self.num_workers == 0:
            outputs = iter(_Roles(self))
        else:
            outputs = iter(
                DataLoader(
                    _Roles(self),
                    batch_size=None,
                    collate_fn=_as_is,
                    num_workers=self.num_workers,
                    prefetch_factor=self.prefetch_factor,
                    timeout=self.timeout,
                    pin_memory=self.pin_memory,
                    multiprocessing_context=self.multiprocessing_context,
                )
            )
        pin = self.pin_memory and torch.cuda.is_available()  # tensors only: ints pass as they are
        try:
            while True:
                try:
                    batch, position, counters = next(outputs)
                except StopIteration:  # nothing handed out is left untrained
                    self._trail.clear()
                    return
                except (EOFError, ConnectionError) as err:
                    # a worker that dies while the parent collects its batch's shared memory
                    raise RuntimeError(
                        "DataLoader worker exited unexpectedly while handing over a batch"
                    ) from err
                if isinstance(batch, WindowBatch):
                    batch = collate_windows(batch, self.collator)
                    batch = pin_memory(batch) if pin else batch
                elif pin and not self.num_workers:  # a worker's own batch: the DataLoader pinned it
                    batch = pin_memory(batch)
                self._position, self.counters = position, counters
                self.consumed_batches += 1
                self._trail.append((position, self.consumed_batches))
                yield batch
        finally:
            # Stop workers now: a traceback holding the iterator would keep a dead worker
            # registered, and torch would raise again on the next child exit.
            shutdown = getattr(outputs, "_shutdown_workers", None) or getattr(
                outputs, "close", None
            )
            if shutdown is not None:
                shutdown()

    def _current_position(self) -> dict[str, Any]:
        if self._position is None:
            self._position = {
                "distributor": self.distributor.state_dict(),
                "batcher": self.batcher.state_dict(),
            }
        return self._position

    def _setup(self) -> dict[str, Any]:
        """Fields a state of a per-rank packing plan must match: its positions belong to one
        rank of one world size (fixed groups and the global plan belong to none)."""
        if self.batcher.group_size or self.global_plan:
            return {}
        return {"dp_world_size": self.dp_world_size, "dp_rank": self.dp_rank}

    def _any_rank(self) -> bool:
        """A state of this loader is any rank's: fixed groups, or the global plan of several
        ranks (of one rank, the global plan is the rank's own: its states say dp_rank 0)."""
        return bool(self.batcher.group_size) or (self.global_plan and self.dp_world_size > 1)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch trained: the last handed out, or with `lookahead`
        the one `lookahead` batches before it, until the sequence ends. `rank_keyed`: as
        {"dp_rank_R": state, "world_size": W}, torchtitan's layout, so that a checkpointer that
        merges equal keys across ranks (torch.distributed.checkpoint) keeps every rank's own."""
        if not self.lookahead and _called_by_lightning():
            raise RuntimeError(
                "DataflowLoader under Lightning: its fetcher takes one batch ahead of the one "
                "it trains, so this state would skip a batch on resume; create the loader "
                "with lookahead=1"
            )
        state = self._state()
        if self.rank_keyed:
            return {f"dp_rank_{self.dp_rank}": state, "world_size": self.dp_world_size}
        return state

    def _state(self) -> dict[str, Any]:
        if self.lookahead and self._trail:
            position, consumed = self._trail[0]
        else:
            position, consumed = self._current_position(), self.consumed_batches
        return {
            "version": STATE_VERSION,
            "dp_world_size": self.dp_world_size,
            "dp_rank": None if self._any_rank() else self.dp_rank,  # None: any rank's state
            "consumed_batches": consumed,
            "position": position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "world_size" in state and "version" not in state:  # rank-keyed (torchtitan's layout)
            key = f"dp_rank_{self.dp_rank}"
            if key not in state:
                raise ValueError(
                    f"DataflowLoader: the state holds {sorted(k for k in state if k != 'world_size')}"
                    f", not {key!r}: it was saved by other data-parallel ranks"
                )
            state = state[key]
        check_state("DataflowLoader", state, self._setup())
        saved_rank, saved_world = state.get("dp_rank"), state.get("dp_world_size")
        if self.global_plan and saved_rank is not None and saved_world != 1:
            raise ValueError(
                f"DataflowLoader cannot resume: dp_rank: saved {saved_rank} of {saved_world} "
                "ranks, each packing its own stream; this loader packs on the global order "
                "(stored lengths), whose states are any rank's (dp_rank None)"
            )
        if not state["position"]["distributor"] and state["consumed_batches"]:
            raise ValueError(
                f"DataflowLoader cannot resume at batch {state['consumed_batches']}: "
                f"{type(self.distributor).__name__} keeps no position (its state_dict() is empty)"
            )
        self.distributor.load_state_dict(state["position"]["distributor"])
        self.distributor.set_coordinates(self.dp_rank, self.dp_world_size)  # may refuse it
        self.batcher.load_state_dict(state["position"]["batcher"])
        self._position = state["position"]
        self.consumed_batches = state_count("DataflowLoader", state, "consumed_batches")
        self._trail.clear()
