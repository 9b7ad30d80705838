"""Prefetch: shards downloaded before the reads that need them, in background threads.

A remote MmapStore asks for three kinds of work: every shard a batch of windows touches,
fetched at once and in parallel before the batch is read (`wait`); the shards after the one
just opened, when reads go through the shards in order (`ahead`); and, when the whole
dataset fits the cache's limit, every shard in turn (`fill`: one process per machine fills,
the others skip a shard another holds). A read never waits for more than its own shards. A
distributor with a shuffled order fetches ahead of it (`OrderReadAhead`).
The threads are daemons of this process (a forked DataLoader worker makes its own), and
end when the store that started them is collected (`close`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.training.state import order_at, worker_of

log = logging.getLogger("tokenmill.cache")


class Prefetcher:
    """Runs `fetch(view)` (download one shard's files, or skip it) on `threads` daemon threads."""

    def __init__(self, fetch: Callable[[int, bool], Any], threads: int):
        self.fetch = fetch
        self.pid = os.getpid()
        self.tasks: queue.Queue = queue.Queue()
        self.inflight: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.filling = self.closed = False
        self.threads = max(1, threads)
        for i in range(self.threads):
            threading.Thread(target=self._work, name=f"tokenmill-prefetch-{i}", daemon=True).start()

    def close(self) -> None:
        """Stops the threads after their current download (the store is gone)."""
        self.closed = True
        for _ in range(self.threads):
            self.tasks.put(None)

    def _work(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                return
            future, view, wait = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.fetch(view, wait))
            except BaseException as err:  # the read that needs the shard raises it
                future.set_exception(err)

    def submit(self, views: Iterable[int]) -> list[Future]:
        """Starts the download of each view not already under way; its future."""
        futures = []
        with self.lock:
            for view in views:
                future = self.inflight.get(view)
                if future is None:
                    future = self.inflight[view] = Future()
                    future.add_done_callback(partial(self._done, view))
                    self.tasks.put((future, view, True))
                futures.append(future)
        return futures

    def _done(self, view: int, future: Future) -> None:
        with self.lock:
            self.inflight.pop(view, None)
        if not future.cancelled() and future.exception() is not None:  # said even if no read
            log.warning("download of shard %d failed: %r", view, future.exception())

    def wait(self, views: Iterable[int]) -> None:
        """Downloads these views in parallel and waits for them all (a batch's shards)."""
        for future in self.submit(views):
            future.result()

    def busy(self) -> int:
        """Downloads queued or running."""
        return len(self.inflight)

    def pending(self, view: int) -> Future | None:
        with self.lock:
            return self.inflight.get(view)

    def ahead(self, views: Iterable[int]) -> None:
        """Starts downloads that a later read will want; their errors surface at that read."""
        self.submit(views)

    def fill(self, views: list[int], lock: Path) -> None:
        """Every view in turn, `threads` at a time, by one process of the machine (the one
        holding `lock`); a view another process holds is skipped."""
        if self.filling:
            return
        self.filling = True
        threading.Thread(
            target=self._fill, args=(views, lock), name="tokenmill-fill", daemon=True
        ).start()

    def _fill(self, views: list[int], lock: Path) -> None:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return  # another process of the machine fills
        slots = threading.Semaphore(self.threads)
        running: list[Future] = []
        try:
            for view in views:
                slots.acquire()
                if self.closed:
                    return
                future: Future = Future()
                future.add_done_callback(lambda _: slots.release())
                self.tasks.put((future, view, False))
                running.append(future)
            for future in running:
                future.result()
        except Exception as err:  # a read that needs the shard will fetch it and raise
            log.warning("background fill stopped: %r", err)
        finally:
            os.close(fd)


# --- ahead of the sample order ------------------------------------------------------------
ORDER_LOOKAHEAD = 128  # positions of the sample order whose shards are fetched ahead (0: off)
LOOK_EVERY = 32  # positions read between two looks ahead
AHEAD_SHARE = 0.5  # of the cache limit, for the shards looked ahead at (all workers together)


def order_read_ahead(
    dataset: Any, seed: int, shuffle: bool, share: tuple[int, int, int] | None = None
) -> OrderReadAhead | None:
    """What fetches a dataset's shards ahead of its sample order (`training.state.order_at`),
    or None where there is nothing to fetch (shards on local disk, prefetch=0). `share`:
    (worker, workers, block) when a loader worker reads blocks worker, worker + workers, ...
    of the indices (`dataflow.distributors.worker_share`): each fetches ahead what it reads;
    block 0 (packing: every worker walks every index), worker 0 fetches ahead for all."""
    store = getattr(dataset, "store", None)
    if ORDER_LOOKAHEAD <= 0 or getattr(store, "cache", None) is None:
        return None
    if not getattr(store, "prefetch", 0) or not hasattr(store, "fetch_ahead"):
        return None
    if share is not None and share[2] == 0:
        if share[0] != 0:
            return None
        share = None
    return OrderReadAhead(dataset, seed, shuffle, share or (0, 1, 1))


def own_positions(positions: np.ndarray, given: int, share: tuple[int, int, int]) -> np.ndarray:
    """Those of the next `positions` (the order's, from the `given`-th index on) that fall to
    this worker under `share` (worker, workers, block), as `worker_share` deals them."""
    worker, workers, block = share
    return positions[worker_of(given + np.arange(len(positions)), block, workers) == worker]


class OrderReadAhead:
    """Called with each position a distributor reads; every `LOOK_EVERY` positions, looks at
    the next `ORDER_LOOKAHEAD` positions that this worker reads and has the store fetch their
    items' shards ahead (`MmapStore.fetch_ahead`), within `AHEAD_SHARE` of the cache's limit;
    once every shard is known cached and none can be evicted, a call costs nothing."""

    def __init__(self, dataset: Any, seed: int, shuffle: bool, share: tuple[int, int, int]) -> None:
        self.dataset, self.store, self.seed, self.shuffle = dataset, dataset.store, seed, shuffle
        self.share, self.calls = share, 0  # calls: the indices the distributor gave so far
        self.n = len(dataset)
        self.next, self.epoch = 0, -1
        self.done = False

    def __call__(self, position: int, end: int, step: int, epoch: int) -> None:
        given, self.calls = self.calls, self.calls + 1
        if self.done or (epoch == self.epoch and position < self.next):
            return
        self.epoch, self.next = epoch, position + LOOK_EVERY * step
        if self.store.all_cached():
            self.done = True
            return
        positions = np.arange(position, min(end, position + ORDER_LOOKAHEAD * step), step)
        positions = own_positions(positions, given, self.share)
        indices = order_at(positions, self.n, self.seed, epoch, self.shuffle)
        ranges = self.dataset.item_ranges(indices)
        first, last = ranges if ranges is not None else (indices, None)
        stop = self.store.fetch_ahead(first, last, AHEAD_SHARE / self.share[1])  # per worker
        if stop is not None:  # the budget stopped it: look again halfway to that item
            self.next = position + max(1, stop * self.share[1] // 2) * step
