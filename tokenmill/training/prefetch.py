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

from tokenmill.training.cache_files import shard_files
from tokenmill.training.state import order_at

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

    def _done(self, view: int, _: Future) -> None:
        with self.lock:
            self.inflight.pop(view, None)

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
AHEAD_SHARE = 0.5  # the most of the cache's limit the shards looked ahead at may hold


def order_read_ahead(dataset: Any, seed: int, shuffle: bool) -> OrderReadAhead | None:
    """What fetches a dataset's shards ahead of its sample order (`training.state.order_at`),
    or None where there is nothing to fetch (shards on local disk, prefetch=0)."""
    store = getattr(dataset, "store", None)
    if ORDER_LOOKAHEAD <= 0 or getattr(store, "cache", None) is None:
        return None
    if not getattr(store, "prefetch", 0) or not hasattr(store, "_prefetcher"):
        return None
    return OrderReadAhead(dataset, seed, shuffle)


class OrderReadAhead:
    """Called with each position a distributor reads; every `LOOK_EVERY` positions, looks at
    the next `ORDER_LOOKAHEAD` positions' items, finds their shards in order of need and
    starts the download of those the cache does not hold. A shard this process knows is in
    the cache costs a dict lookup (`ShardCache.known`); once every shard is known and none
    can be evicted, a look costs nothing. Bounded: at most `AHEAD_SHARE` of the cache's
    limit in shards, `2 x prefetch` downloads at once; until the next look, the shards
    looked at are kept from eviction (`ShardCache.keep`), and those the order reads after
    them are evicted last (`ShardCache.later`)."""

    def __init__(self, dataset: Any, seed: int, shuffle: bool) -> None:
        self.dataset, self.store, self.seed, self.shuffle = dataset, dataset.store, seed, shuffle
        self.n = len(dataset)
        self.next, self.epoch = 0, -1
        store = self.store
        self.windows = bool(getattr(dataset, "fixed_windows", False))
        self.spans = None if self.windows else getattr(dataset, "_starts", None)
        if self.windows or self.spans is not None:  # items are spans of the token stream
            starts = store._shared_starts
        else:  # items are records (DPO, KTO, GRPO)
            starts = store._record_starts
        self.starts = np.asarray(starts, dtype=np.int64)
        self.sizes = [sum(size for _, size, _ in shard_files(meta)) for _, meta in store._metas]
        cache = store.cache
        self.evicts = cache.limit is not None and sum(self.sizes) > cache.limit * 0.9
        self.budget = cache.limit * AHEAD_SHARE if cache.limit is not None else None
        self.done = False  # every shard known in the cache, none to be evicted: nothing to do

    def __call__(self, position: int, end: int, step: int, epoch: int) -> None:
        if self.done or (epoch == self.epoch and position < self.next):
            return
        self.epoch, self.next = epoch, position + LOOK_EVERY * step
        cache = self.store.cache
        if not self.evicts and len(cache.present) == len(self.sizes):
            self.done = True
            return
        positions = np.arange(position, min(end, position + ORDER_LOOKAHEAD * step), step)
        indices = order_at(positions, self.n, self.seed, epoch, self.shuffle)
        views, need = self.views(indices)
        covered = self.look(views)
        if covered < len(views):  # the budget stopped it: look again halfway to that shard
            self.next = position + max(1, need[covered] // 2) * step

    def views(self, indices: np.ndarray) -> tuple[list[int], list[int]]:
        """The shards holding these items, each once, in order of first need; and the item
        (its place in `indices`) that first needs each."""
        if self.windows:
            first = (indices % self.n) * int(self.store.stride)
            last = first + int(self.store.window_size)  # the window and its one more token
        elif self.spans is not None:
            first = self.spans[indices]
            last = first + np.maximum(self.dataset._lengths[indices] - 1, 0)
        else:
            first = last = indices
        top = len(self.starts) - 2
        a = np.clip(np.searchsorted(self.starts, first, side="right") - 1, 0, top)
        b = np.clip(np.searchsorted(self.starts, last, side="right") - 1, 0, top)
        first_need: dict[int, int] = {}
        for k, view in enumerate(np.stack([a, b], axis=1).reshape(-1).tolist()):
            first_need.setdefault(view, k // 2)
        return list(first_need), list(first_need.values())

    def look(self, views: list[int]) -> int:
        """Starts the downloads of these shards (in order of need) that the cache lacks, as
        far as the budget goes; keeps them from eviction. Returns how many it covered."""
        store, cache = self.store, self.store.cache
        prefetcher, mapped = store._prefetcher(), store._opened  # mapped: read from its pages
        keep: set[str] = set()
        held = started = covered = 0
        for s in views:
            if s in mapped:
                covered += 1
                continue
            if self.budget is not None:
                if keep and held + self.sizes[s] > self.budget:
                    break
                held += self.sizes[s]
            covered += 1
            rel = store._metas[s][0]
            keep.add(rel)
            if cache.known(rel) or prefetcher.pending(s) is not None:
                continue
            if prefetcher.busy() < 2 * prefetcher.threads:
                prefetcher.ahead([s])
                started += 1
        if self.evicts:  # past the budget: evicted last, the one read last first
            cache.keep = keep
            cache.later = {store._metas[s][0]: k for k, s in enumerate(views[covered:])}
        if started:
            cache.counts.add(ahead=started)
        return covered
