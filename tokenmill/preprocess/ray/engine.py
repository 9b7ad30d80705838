"""Ray engine: each of the run's tasks done by a Ray task, which writes its own shards.

Used by `Pipeline(engine="ray")` in place of the local engine's threads. The driver does
bookkeeping only, O(tasks): it submits the tasks (planned from file sizes, engines/tasks.py)
a few at a time, and takes back each one's record (counts, bad records, shard entries: a
few hundred bytes) in task order. A task reads its own records (a byte range of a JSONL
file, or whole files), masks and packs them on THREADS threads with the local engine's own
code, and writes its shards into the output (a shared folder, or a bucket: staged on its
node, then uploaded), then its record (run/task_output.py). No row passes through the driver
or another task. Same tasks, same code, same cut: the bytes are the local engine's.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.engines.tasks import TaskPlan
from tokenmill.preprocess.inputs.records import RecordError
from tokenmill.preprocess.run.task_output import OutputSpec

INSTALL_HINT = "pip install 'tokenmill[ray]'"
AHEAD = 2  # tasks submitted per task slot: the next one is queued when one ends
MAX_RETRIES = 8  # a task whose process or node died is run again, from its start


def require_ray() -> ModuleType:
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(
            f"engine='ray' needs Ray, which is not installed: {INSTALL_HINT}"
        ) from err
    return ray


@contextlib.contextmanager
def connect(address: str | None) -> Iterator[ModuleType]:
    """Ray for one run: the connection this process already has, else one to `address`, else a
    local Ray (Ray's own rule: RAY_ADDRESS if set); one this opened is shut down at the end."""
    ray = require_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False if address is None else None)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


_RUN: str | None = None  # the run this worker process is set up for (`setup_worker`)


def run_task(
    plan: TaskPlan,
    run: str,
    config_data: dict,
    tokenizer_path: str,
    spec: OutputSpec,
    duplicates: np.ndarray | None = None,
) -> dict[str, Any]:
    """A Ray task: one task's chunks worked on THREADS threads, as a local engine's process
    works them, its shards written and its record returned. Ray keeps its worker processes,
    so a process loads the tokenizer and starts its threads at its first task of a run only.
    A bad record under on_error="raise" comes back as {"error": ...}, its task's shards
    removed, so that the driver raises the first one in input order. `duplicates`: the
    positions of the records the dedup pre-pass sets aside (`task_chunks`)."""
    global _RUN
    from tokenmill.preprocess.chat.tokenizer import tokenizer_threads_off
    from tokenmill.preprocess.engines.chunks import process_stream, setup_worker
    from tokenmill.preprocess.engines.tasks import task_chunks
    from tokenmill.preprocess.run.task_output import TaskWriter

    if _RUN != run:
        setup_worker(config_data, tokenizer_path)
        _RUN = run
    pre, unit = config_data["preprocessing"], config_data["input"].get("text_unit", "file")
    writer = TaskWriter(spec, plan)
    try:
        with tokenizer_threads_off():  # the threads encode on their own, on the task's CPUs
            for result in process_stream(
                task_chunks(plan, pre["batch_size"], unit, None, duplicates)
            ):
                writer.add(result)
        return writer.finish()
    except RecordError as err:
        writer.abort()
        return {"task": plan.index, "error": err}
    except BaseException:
        writer.abort()
        raise


class RayEngine:
    """The pipeline's engine on Ray (see the module's docstring)."""

    def __init__(self, workers: int | None, address: str | None):
        require_ray()  # fail before touching the output folder
        self.workers = workers
        self.address = address
        self.ray: Any = None  # the ray module while a session is open

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        with connect(self.address) as self.ray:
            try:
                yield
            finally:
                self.ray = None

    def run_tasks(
        self,
        plans: Sequence[TaskPlan],
        config: PipelineConfig,
        tokenizer_path: str,
        spec: OutputSpec,
        staging: Path | None,
        duplicates: Mapping[int, np.ndarray] | None = None,
    ) -> Generator[dict[str, Any], None, None]:
        """Records in task order; at most AHEAD tasks per slot are submitted at once, so the
        driver holds a few records, whatever the run's size."""
        ray = self.ray
        slots, cpus = self._slots()
        remote = ray.remote(run_task).options(num_cpus=cpus, max_retries=MAX_RETRIES)
        args = (uuid.uuid4().hex, config.model_dump(mode="json"), tokenizer_path, spec)
        shared = [ray.put(arg) for arg in args]  # sent once, not with every task
        dups = duplicates or {}
        calls = ((plan, *shared, dups.get(plan.index)) for plan in plans)
        # closed here, not when collected: the tasks still running stop before an error leaves
        with contextlib.closing(self._in_order(remote, calls, AHEAD * slots)) as records:
            for record in records:
                if "error" in record:
                    raise record["error"]
                yield record

    def hash_tasks(self, plans: Sequence[TaskPlan], config: PipelineConfig) -> list[np.ndarray]:
        """Each plan's records' dedup keys, hashed by Ray tasks on a thread's share of a slot
        (hashing holds the GIL), as many at once as the run has threads."""
        from tokenmill.preprocess.dedup import task_hashes
        from tokenmill.preprocess.engines.chunks import THREADS

        slots, cpus = self._slots()
        remote = self.ray.remote(task_hashes).options(
            num_cpus=cpus / THREADS, max_retries=MAX_RETRIES
        )
        data = self.ray.put(config.model_dump(mode="json"))
        calls = ((plan, data) for plan in plans)
        return list(self._in_order(remote, calls, AHEAD * slots * THREADS))

    def _slots(self) -> tuple[int, float]:
        """`pool_size` for the cluster connected to."""
        ray = self.ray
        nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]]
        node = min((cpus for cpus in nodes if cpus > 0), default=1.0)
        total = float(ray.cluster_resources().get("CPU", 1.0))
        return pool_size(total, self.workers, node)

    def _in_order(
        self, remote: Any, calls: Iterator[tuple], ahead: int
    ) -> Generator[Any, None, None]:
        """`remote` called with each of `calls`, at most `ahead` at once, results in order."""
        ray = self.ray
        pending: deque[Any] = deque()
        try:
            while True:
                while len(pending) < ahead and (args := next(calls, None)) is not None:
                    pending.append(remote.remote(*args))
                if not pending:
                    return
                yield ray.get(pending.popleft())
        finally:  # an error or a closed run: the tasks still running are stopped, and waited for
            for ref in pending:
                ray.cancel(ref, force=True)
            for ref in pending:
                with contextlib.suppress(Exception):
                    ray.get(ref)


def pool_size(cpus: float, workers: int | None, node: float | None = None) -> tuple[int, float]:
    """(tasks at once, CPUs per task): `workers` (default: one per cluster CPU) are threads,
    THREADS to a task as to a local engine's process; the tasks share the cluster's `cpus`,
    at most THREADS each and no more than the smallest node has (`node`: else a task that
    fits no node would wait forever), rounded down, so that they all fit."""
    from tokenmill.preprocess.engines.chunks import THREADS

    threads = workers if workers is not None else max(1, int(cpus))
    size = -(-threads // THREADS)
    share = math.floor(100 * cpus / size) / 100
    if share < 0.01:
        raise ValueError(f"workers={threads} is more than a Ray cluster of {cpus:g} CPUs can run")
    return size, min(float(THREADS), share, node if node is not None else float(THREADS))
