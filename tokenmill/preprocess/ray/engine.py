"""Ray engine: the pipeline's chunks read, masked, packed and written on a Ray cluster.

Used by `Pipeline(engine="ray")` in place of the local engine's threads:
1. scan (Ray Data, a task per file, `plans.scan_file`): record counts, positions and read
   errors, so that the driver cuts the same chunks as `iter_chunks` (`plans.plan_chunks`);
2. process (Ray Data `map_batches` tasks, in Ray's worker processes, each of which loads the
   tokenizer once): `process_chunk`, the local engine's own function, on THREADS threads; the
   driver shares the first task's chunks from the run's start, while the scan runs and that
   task starts, to the end (`ray_head_start.head_start`); the rows stay in the object store
   and only each chunk's counts reach the driver, in chunk order;
3. write: on a cluster of one node the driver writes each chunk's rows as it comes, read in
   place from its object store, with the local ShardWriter (`one_node`); else (Ray tasks) the
   driver cuts shards with the local writer's rule and a task per shard gathers its rows and
   writes it; the driver renames finished shards into place in order (output to a bucket:
   the task uploads its shard, meta.json last, after the driver has uploaded the journal
   lines that account for its rows).
Same chunks, same code, same cut: the output equals the local engine's byte for byte.
Steps 1 and 2 are in ray/results.py (the head start in ray/head_start.py, the chunks' way back
to the driver in ray/merge.py), step 3 in ray/writer.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Sequence
from types import ModuleType
from typing import Any

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.engines.chunks import ChunkResult
from tokenmill.preprocess.inputs.files import InputPath
from tokenmill.preprocess.ray.results import ray_results
from tokenmill.preprocess.ray.writer import RayShardWriter, Upload
from tokenmill.shards.writer import ShardSpec, ShardWriter

INSTALL_HINT = "pip install 'tokenmill[ray]'"


def require_ray() -> ModuleType:
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"engine='ray' needs Ray Data, which is not installed: {INSTALL_HINT}"
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


def one_node(ray: ModuleType) -> bool:
    """Whether the cluster is the driver's node alone (reached without Ray Client): then every
    chunk's block is in the driver's object store, and the driver writes the shards as the
    chunks come, as the local engine does, where write tasks would each write a whole shard
    once it is cut: the last one only after the last chunk (at 3,000 chat records, 0.15 s
    more at the end of a 3 s run). A node added later only makes its blocks travel."""
    from ray.util.client import ray as client

    if client.is_connected():
        return False
    alive = [node for node in ray.nodes() if node["Alive"]]
    return len(alive) == 1 and alive[0]["NodeID"] == ray.get_runtime_context().get_node_id()


class RayEngine:
    """The pipeline's engine on Ray: `ray_results` for chunks, `RayShardWriter` for shards (on
    a cluster of one node, the local ShardWriter, on the driver: `one_node`)."""

    def __init__(self, workers: int | None, address: str | None):
        require_ray()  # fail before touching the output folder
        self.workers = workers
        self.address = address
        self.ray: Any = None  # the ray module while a session is open
        self.rows_here = False  # the driver writes the rows (`one_node`)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        with connect(self.address) as self.ray:
            try:
                self.rows_here = one_node(self.ray)
                yield
            finally:
                self.ray = None

    def results(
        self,
        files: Sequence[InputPath],
        config: PipelineConfig,
        tokenizer_path: str,
        collect_errors: bool,
        first_chunk: int,
    ) -> Generator[ChunkResult, None, None]:
        args = (config.model_dump(mode="json"), tokenizer_path)
        return ray_results(
            self.ray, files, args, self.workers, first_chunk=first_chunk, rows_here=self.rows_here
        )

    def writer(self, shards: ShardSpec, bucket: Any = None) -> RayShardWriter | ShardWriter:
        """The shard writer of one domain's shards."""
        if self.rows_here:  # a bucket's uploads are then the local engine's (BucketOutput)
            return ShardWriter(shards)
        upload = None
        if bucket is not None:  # the write tasks upload; the driver first uploads the journal
            domain = shards.domain_dir.relative_to(bucket.local).as_posix()
            upload = Upload(bucket.remote, bucket.rel("" if domain == "." else domain))
        return RayShardWriter(
            self.ray,
            shards,
            upload=upload,
            before_upload=bucket.sync_journal if bucket is not None else None,
        )
