"""MmapStore: every shard below a folder, memory-mapped read-only.

Opening costs O(shards), not O(records); pickling carries paths, never data, so DataLoader
workers map the files themselves and share the page cache.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections import OrderedDict
from functools import partial
from pathlib import Path

from tokenmill.shards.format import DTYPES, RUN_DIR, checksum, shard_records
from tokenmill.shards.manifest import listed, read_manifest
from tokenmill.shards.reader import check_sizes, find_shards, map_shard, read_meta
from tokenmill.shards.verify import verify_dataset
from tokenmill.training.store import ShardView, Store, Transform


# --- shards on disk ---------------------------------------------------------------------------
class MmapStore(Store):
    """Every shard below a folder, memory-mapped read-only; opening costs O(shards), not O(records)."""

    def load(
        self,
        path: str | Path,
        transform: Transform | None = None,
        processor: Transform | None = None,
        tokenizer_path: str | Path | None = None,
        allow_partial: bool = False,
    ) -> MmapStore:
        """Maps the shards below `path`; checks every file's size against meta.json.

        A tokenmill output whose run has not finished (its run folder, no manifest) is refused
        unless `allow_partial`; shard folders the manifest does not list are ignored, with a
        warning naming them. Shards written by other tools in the seed's format (no manifest,
        no run folder) load as they are. `tokenizer_path` is accepted and unused.
        """
        if transform is not None or processor is not None:
            raise ValueError(
                "MmapStore reads tokenized shards; transform= and processor= are for JsonlStore"
            )
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a folder of shards")
        self.manifest = read_manifest(root)
        if self.manifest is None and (root / RUN_DIR).is_dir():
            if not allow_partial:
                raise ValueError(
                    f"{root}: the tokenmill run writing this dataset has not finished (no "
                    f"manifest.json, {RUN_DIR}/ present): re-run the same preprocess command "
                    "to finish it, or load(..., allow_partial=True) to read what is there"
                )
            warnings.warn(f"{root}: loading an unfinished run's shards", stacklevel=2)
        shards = find_shards(root)
        if not shards:
            raise FileNotFoundError(f"{root}: no shard (a folder with meta.json) below it")
        shards = self._check_manifest(root, shards)
        self.root = root
        self._metas = [
            (str(d.relative_to(root)) if d != root else ".", read_meta(d)) for d in shards
        ]
        self._map()
        return self

    def _check_manifest(self, root: Path, shards: list[Path]) -> list[Path]:
        """The shards to read: the manifest's, all present; others ignored with a warning."""
        if not self.manifest:
            return shards
        names = {rel for rel, _ in listed(self.manifest)}
        found = {d.relative_to(root).as_posix() for d in shards}
        missing = sorted(n for n in names - found if not n.endswith(".jsonl"))
        if missing:
            raise ValueError(
                f"{root}: shards listed in manifest.json are missing: {missing[:5]}; run `tokenmill verify {root}`"
            )
        edited = [
            rel
            for rel, info in listed(self.manifest)
            if "meta_xxh64" in info
            and checksum((root / rel / "meta.json").read_bytes()) != info["meta_xxh64"]
        ]
        if edited:
            raise ValueError(
                f"{root}: meta.json of {edited[:5]} edited since written (its xxh64 differs from "
                f"manifest.json's); run `tokenmill verify {root}`"
            )
        unlisted = sorted(found - names)
        if unlisted:
            warnings.warn(
                f"{root}: ignoring shard folders manifest.json does not list: {unlisted[:5]}",
                stacklevel=3,
            )
        return [d for d in shards if d.relative_to(root).as_posix() in names]

    def _map(self) -> None:
        """A view per shard, its files' sizes checked now and mapped on first use."""
        views = []
        for rel, meta in self._metas:
            check_sizes(self.root / rel, meta)
            sizes = {k: int(e["shape"][0]) for k, e in meta.items()}
            dtypes = {k: DTYPES[e["dtype"]] for k, e in meta.items()}
            opener = partial(map_shard, self.root / rel, meta)
            views.append(ShardView(rel, shard_records(meta), sizes, dtypes, open=opener))
        self._set_views(views)

    @property
    def fingerprint(self) -> str:
        """Identity of the data: a hash over every shard's name and meta.json (sizes, checksums)."""
        self._loaded()
        digest = hashlib.sha256()
        for rel, meta in self._metas:
            digest.update(f"{rel}\n{json.dumps(meta, sort_keys=True)}\n".encode())
        return digest.hexdigest()[:16]

    def verify(self) -> list[str]:
        """Every size, checksum and offsets problem of the dataset; [] when sound."""
        self._loaded()
        return verify_dataset(self.root, require_manifest=self.manifest is not None)

    def __getstate__(self) -> dict:
        """Pickles paths and metadata, never the mapped data: workers map the files themselves."""
        state = dict(self.__dict__)
        if state.get("_views") is not None:
            state.update(_views=None, _starts=None, _record_starts=[], _values={})
            state["_opened"] = OrderedDict()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if getattr(self, "_metas", None) is not None:
            self._map()
