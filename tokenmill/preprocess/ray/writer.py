"""Writing shards on a Ray cluster: rows stay in the object store until a task writes them.

The driver cuts shards with the local writer's rule (`ShardCutter`); a Ray task per shard
gathers its rows from the blocks and stages the shard with the local `ShardWriter`; the
driver renames finished shards into place in index order. For output to a bucket (`Upload`),
the task uploads its shard itself (arrays first, meta.json last) and the data never passes
through the driver, which needs no filesystem shared with the workers."""

from __future__ import annotations

import collections
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from tokenmill.shards.files import publish
from tokenmill.shards.format import TMP_MARK, shard_name
from tokenmill.shards.writer import ShardCutter, ShardSpec, ShardWriter
from tokenmill.storage.remote import Remote


@dataclass
class Upload:
    """Where a domain's shards go in a bucket: the dataset's Remote and the domain's folder."""

    remote: Remote
    domain: str  # "" for the dataset's root


@dataclass
class RowRef:
    """One output row that stays on the cluster: row `item` of the chunk in row `row` of `block`."""

    block: Any  # ray.ObjectRef of a Ray Data block
    row: int
    item: int
    tokens: int  # primary-key tokens, for the shard cut


def write_rows(
    spec: ShardSpec,
    where: list[tuple[int, int, int]],
    upload: Upload | None,
    *blocks: Any,
) -> tuple[str | None, dict]:
    """A Ray task: gathers shard `spec.first_index`'s rows from the blocks that hold them and
    stages it with the local ShardWriter (temp place, fsynced, checksummed); the driver
    publishes it. With `upload`, the task uploads the staged shard (meta.json last) and
    removes it."""
    # a Ray Data block's `rows` column, or the list the driver put for the chunks it processed
    chunks = [b if isinstance(b, list) else block_rows(b) for b in blocks]
    writer = ShardWriter(spec)
    for b, row, item in where:
        writer.add(chunks[b][row].rows[item])
    tmp, info = writer.stage()
    if upload is None:
        return str(tmp), info
    try:
        rel = f"{upload.domain}/{info['name']}" if upload.domain else info["name"]
        upload.remote.upload_shard(tmp, rel)
    finally:
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    return None, info


def block_rows(block: Any) -> Any:
    """The `rows` column of a Ray Data block: a ChunkRows per chunk, in an object array."""
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(block).to_numpy("rows")


_NO_CUT = 1 << 62  # a write task stages exactly the rows it is given: the driver made the cut


class RayShardWriter:
    """ShardWriter for rows that stay on the cluster. The driver cuts shards with the same
    ShardCutter; a Ray task writes each shard's temp copy; the driver renames them into place in
    index order, so the published shards of a domain are always a prefix (what resume relies on)."""

    def __init__(
        self,
        ray: ModuleType,
        spec: ShardSpec,
        in_flight: int = 4,
        upload: Upload | None = None,
        before_upload: Callable[[], None] | None = None,
    ):
        self.ray = ray
        self.spec = spec
        self.domain_dir = spec.domain_dir
        self.index = spec.first_index
        self.in_flight = in_flight
        self.cutter = ShardCutter(spec.max_tokens_per_shard)
        self.rows: list[RowRef] = []
        self.pending: collections.deque = collections.deque()  # (name, future of write_rows)
        self.written: list[str] = []  # names this writer wrote, whose stray temps it removes
        self.published: list[dict] = []
        self.upload, self.before_upload = upload, before_upload
        self.uploads = upload is not None  # BucketOutput leaves this writer's shards alone
        self.task = ray.remote(num_cpus=0.25, max_retries=3)(write_rows)

    def add(self, row: RowRef) -> None:
        if self.cutter.close_before(row.tokens):
            self._submit()
        self.rows.append(row)
        if self.cutter.add(row.tokens):
            self._submit()

    def _submit(self) -> None:
        """Starts the write of the open shard, once the done ones are published and fewer than
        `in_flight` writes are running."""
        if not self.rows:
            return
        while self.pending and (len(self.pending) >= self.in_flight or self._done(self.pending[0])):
            self._publish_next()
        name = shard_name(self.index, self.spec.storage_format)
        blocks: dict[Any, int] = {}
        where = [(blocks.setdefault(r.block, len(blocks)), r.row, r.item) for r in self.rows]
        if self.before_upload is not None:
            self.before_upload()  # the journal lines of these rows reach the bucket first
        # the task stages exactly the rows it is given: the driver made the cut
        spec = replace(self.spec, first_index=self.index, max_tokens_per_shard=_NO_CUT)
        future = self.task.remote(spec, where, self.upload, *blocks)
        self.pending.append((name, future))
        self.written.append(name)
        self.index += 1
        self.rows = []
        self.cutter.reset()

    def _done(self, entry: tuple) -> bool:
        ready, _ = self.ray.wait([entry[1]], timeout=0)
        return bool(ready)

    def _publish_next(self) -> None:
        name, future = self.pending.popleft()
        try:
            tmp, info = self.ray.get(future)
        except self.ray.exceptions.RayTaskError as err:
            raise err.as_instanceof_cause() from None
        if tmp is not None:  # None: uploaded to the bucket by the task
            publish(Path(tmp), self.domain_dir / name)
        self.published.append(info)

    def close(self) -> list[dict]:
        """Writes and publishes the last shards; removes temps left by killed task attempts."""
        self._submit()
        while self.pending:
            self._publish_next()
        self._remove_temps()
        return self.published

    def abort(self) -> None:
        """Cancels the writes in flight; publishes nothing more and removes their temps."""
        self.rows = []
        for _, future in self.pending:
            self.ray.cancel(future, force=True)
        if self.pending:
            self.ray.wait([f for _, f in self.pending], num_returns=len(self.pending), timeout=30)
        self.pending.clear()
        self._remove_temps()

    def _remove_temps(self) -> None:
        """Temps of this writer's shards (one listing of the folder, whatever the shard count)."""
        names = set(self.written)
        if not self.domain_dir.is_dir():
            return
        for path in self.domain_dir.glob(f"*{TMP_MARK}*"):
            if path.name.split(TMP_MARK)[0] in names:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
