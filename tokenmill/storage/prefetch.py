"""Prefetch: shards downloaded before the reads that need them, in background threads.

A remote MmapStore asks for three kinds of work: every shard a batch of windows touches,
fetched at once and in parallel before the batch is read (`wait`); the shards after the one
just opened, when reads go through the shards in order (`ahead`); and, when the whole
dataset fits the cache's limit, every shard in turn (`fill`: one process per machine fills,
the others skip a shard another holds). A read never waits for more than its own shards. A
distributor with a shuffled order fetches ahead of it (training/order_prefetch.py).
The threads are daemons of this process (a forked DataLoader worker makes its own), and
end when the store that started them is collected (`close`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

from tokenmill.shards.files import locked

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
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(locked(lock, wait=False))
            except BlockingIOError:
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
