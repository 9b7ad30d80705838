"""Where shards and files live, asked of storage alone: a store reads every shard through its
source (a local folder, or a bucket through the machine's cache), which travels to a worker
as paths and metadata; files and folders at a path or a URL are listed, opened and named
alike; one file lock and one manifest parser serve every caller."""

from __future__ import annotations

import copy
from pathlib import Path

import fsspec
import pytest
import torch
from helpers import write_sft_rows

from tokenmill.shards.files import locked, relock
from tokenmill.shards.format import FORMAT_VERSION
from tokenmill.shards.manifest import parse_manifest
from tokenmill.storage.bucket_source import BucketSource
from tokenmill.storage.location import (
    Folder,
    dataset_folder,
    file_name,
    list_location,
    located,
    open_file,
    output_folder,
    output_location,
)
from tokenmill.storage.remote import Remote
from tokenmill.storage.source import (
    BucketOptions,
    FolderSource,
    holds_shards,
    open_source,
    through_cache,
)
from tokenmill.training.mmap_store import MmapStore


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    return write_sft_rows(tmp_path / "data", 0, rows=20, lengths=(2, 12), shard=30)


def travelled(obj):
    """`obj` as a DataLoader worker rebuilds it: its own reduction (`__reduce_ex__`, state and
    all), which `copy.deepcopy` follows as unpickling does, without bytes to trust."""
    return copy.deepcopy(obj)


# --- shard sources ------------------------------------------------------------------------------
def test_a_folder_source_reads_the_shards_where_they_lie_and_travels_as_paths(shards):
    source = open_source(shards)
    assert isinstance(source, FolderSource) and source.root == shards
    assert source.manifest is None and not source.prefetches and not source.opens_keys_alone
    assert [rel for rel, _ in source.shards][:2] == ["shard_00000", "shard_00001"]
    assert sorted(source.open(0)) == ["loss_mask", "position_ids", "sequence"]
    assert source.prefetch_items({0: 0}, (), 0.5) is None and source.stats() == {}
    assert source.fits_cache() and not source.all_cached() and source.verify() == []
    copy = travelled(source)
    assert copy.shards == source.shards and copy.root == shards
    store = MmapStore().load(shards)
    assert isinstance(store.source, FolderSource) and store.root == shards
    assert store.cache_stats() == {} and store.fits_cache() and not store.all_cached()


def test_a_truncated_file_is_found_again_wherever_a_source_is_sent(shards):
    source = open_source(shards)
    (shards / "shard_00001" / "sequence.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"shard_00001/sequence\.bin: key 'sequence': 1 bytes"):
        travelled(source)  # rebuilt where it is sent, as a worker rebuilds it


def test_which_source_a_path_takes(shards, tmp_path):
    assert through_cache("s3://bucket/data") and through_cache("memory://x")
    assert not through_cache(shards) and not through_cache(str(shards))
    assert holds_shards(shards) and holds_shards("s3://bucket/data")
    assert not holds_shards(tmp_path / "missing") and not holds_shards(
        shards / "shard_00000" / "meta.json"
    )
    assert BucketOptions(cache_limit="2GB").limit == 2 * 10**9
    with pytest.raises(ValueError, match="cannot read the size"):
        MmapStore(cache_limit="lots")


# --- locations ----------------------------------------------------------------------------------
def test_paths_and_urls_are_named_and_checked_alike(tmp_path):
    assert located("s3://b/x//y") == "s3://b/x//y" and located("a/b") == Path("a/b")
    assert file_name("https://host/data/x.jsonl?sig=a/b") == "x.jsonl"
    assert file_name(tmp_path / "y.parquet") == "y.parquet"
    remote = output_location("s3://b/out/", {"endpoint_url": "http://127.0.0.1:1"})
    assert isinstance(remote, Remote) and remote.url == "s3://b/out"
    assert output_location(Path("rel") / "out") == (Path("rel") / "out").absolute()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        output_location(tmp_path / "a_file" / "out")
    with pytest.raises(ValueError, match="lost a slash"):
        output_location(Path("s3://bucket/x"))
    with pytest.raises(ValueError, match="writes a local folder, not a URL"):
        output_folder("s3://bucket/x")
    with dataset_folder(tmp_path) as (root, named):
        assert root == tmp_path and named("as it is") == "as it is"


def test_a_folder_lists_the_same_at_a_path_and_at_a_url(tmp_path):
    fs = fsspec.filesystem("memory")
    for name in ("b.jsonl", "sub/a.jsonl", "_SUCCESS", ".hidden/c.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
        fs.pipe(f"/sources-test/{name}", name.encode())
    local = list_location(tmp_path)
    remote = list_location("memory://sources-test")
    assert isinstance(local, Folder) and isinstance(remote, Folder)
    assert sorted(local.files) == sorted(remote.files) == [("b.jsonl",), ("sub", "a.jsonl")]
    assert local.read(("sub", "a.jsonl")) == remote.read(("sub", "a.jsonl")) == b"sub/a.jsonl"
    assert local.join(("b.jsonl",)) == tmp_path / "b.jsonl"
    assert remote.join(("b.jsonl",)) == "memory://sources-test/b.jsonl"
    assert list_location("memory://sources-test/b.jsonl") == "memory://sources-test/b.jsonl"
    with (
        open_file("memory://sources-test/b.jsonl") as there,
        open_file(tmp_path / "b.jsonl") as here,
    ):
        assert there.read() == here.read() == b"b.jsonl"
    with pytest.raises(FileNotFoundError, match="input not found: memory://sources-test/nope"):
        list_location("memory://sources-test/nope")
    with pytest.raises(FileNotFoundError, match="input not found"):
        list_location(tmp_path / "nope")


# --- one lock, one manifest parser --------------------------------------------------------------
def test_a_locked_file_is_held_by_one_writer_or_many_readers(tmp_path):
    path = tmp_path / "locks" / "x.lock"  # its folder made on the way
    with locked(path):
        with pytest.raises(BlockingIOError), locked(path, wait=False):
            pass
        with pytest.raises(BlockingIOError), locked(path, exclusive=False, wait=False):
            pass
    with locked(path, exclusive=False), locked(path, exclusive=False, wait=False) as fd:
        with pytest.raises(BlockingIOError):
            relock(fd, wait=False)  # the other reader holds it shared
    with locked(path, exclusive=False) as fd:
        relock(fd)  # alone: made exclusive
        with pytest.raises(BlockingIOError), locked(path, exclusive=False, wait=False):
            pass
    with pytest.raises(FileNotFoundError):
        with locked(tmp_path / "gone" / "x.lock", parents=False):
            pass


def test_one_manifest_parser_checks_every_manifest_read(tmp_path):
    assert parse_manifest(b'{"domains": {}}', "x") == {"domains": {}}
    with pytest.raises(ValueError, match="where/manifest.json: not valid JSON"):
        parse_manifest(b"{", "where/manifest.json")
    with pytest.raises(ValueError, match="where: expected a JSON object, got list"):
        parse_manifest(b"[]", "where")
    newer = f'{{"format_version": {FORMAT_VERSION + 1}}}'.encode()
    with pytest.raises(ValueError, match=r"s3://b/x/manifest.json: format_version .* upgrade"):
        parse_manifest(newer, "s3://b/x/manifest.json")
    (tmp_path / "manifest.json").write_bytes(newer)
    with pytest.raises(ValueError, match=f"{tmp_path}/manifest.json: format_version"):
        open_source(tmp_path)


# --- a bucket ------------------------------------------------------------------------------------
@pytest.mark.slow  # an S3 server
def test_a_bucket_source_travels_without_its_threads_and_reads_the_same(
    datasets, options, tmp_path
):
    local, url = datasets["seq"]
    store = MmapStore(window_size=256, cache_dir=tmp_path / "c", storage_options=options)
    store.load(url)
    assert isinstance(store.source, BucketSource) and store.root == url.rstrip("/")
    assert store.source.prefetches and store.source.opens_keys_alone
    first = store.fetch(*store.window_at(3), "sequence")  # starts the prefetch threads
    assert "_prefetch_threads" in store.source.__dict__
    copy = travelled(store)
    assert "_prefetch_threads" not in copy.source.__dict__ and not copy._opened
    assert torch.equal(copy.fetch(*copy.window_at(3), "sequence"), first)
    assert (
        copy.manifest == store.manifest and copy.fingerprint == MmapStore().load(local).fingerprint
    )
    assert store.verify() == []
