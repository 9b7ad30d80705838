"""Loading a damaged dataset folder (issue 39): a preprocessing run's output without its
manifest.json is refused at load, naming the folder and what shows it; a shard its manifest
lists gone is named (at load without an index, at its first read with one); shards written
otherwise (the seed's style: shard folders alone) load."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import QWEN, ROOT, write_sft_rows

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.index import INDEX_NAME, ShardIndex, write_index
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.mmap_store import MmapStore

SHARDS = [f"shard_00000_{i:03d}" for i in range(6)]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seq dataset as the pipeline writes it: many shards, an index, a manifest."""
    tmp = tmp_path_factory.mktemp("written")
    src = tmp / "in.jsonl"
    with open(ROOT / "data" / "pretrain_c4_300.jsonl", encoding="utf-8") as f:
        src.write_text("".join(next(f) for _ in range(20)))
    cfg = default_config("seq").model_dump(mode="json")
    cfg["output"]["max_tokens_per_shard"] = 700
    cfg["preprocessing"]["max_packed_len"] = 256
    out = tmp / "out"
    Pipeline(PipelineConfig.from_dict(cfg), [src], out, QWEN, workers=1).run()
    found = sorted(p.name for p in out.iterdir())
    assert found[:7] == ["manifest.json", *SHARDS] and found[-1] == INDEX_NAME
    return out


@pytest.fixture
def copy(written: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(written, tmp_path / "data"))


def load(path: Path, **kw):
    return MmapStore(window_size=64).load(path, **kw)


def quiet_load(path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no shards.index" where it was removed
        return load(path)


def test_a_run_output_without_its_manifest_is_refused_naming_the_folder(copy):
    """The issue's probe: manifest.json deleted, then half the shards, then the index too;
    each state is refused (it loaded 364 of 708 items)."""
    whole = load(copy).num_rows
    (copy / "manifest.json").unlink()
    said = (
        rf"{copy}: manifest.json is missing, yet a preprocessing run wrote this folder "
        r"\(its shard shard_00000_000 is named as a preprocessing run's tasks name theirs\)"
    )
    with pytest.raises(ValueError, match=said):
        load(copy)
    for shard in sorted(copy.glob("shard_*"))[3:]:
        shutil.rmtree(shard)
    with pytest.raises(ValueError, match=said):
        load(copy)
    (copy / INDEX_NAME).unlink()
    with pytest.raises(ValueError, match=said):
        quiet_load(copy)
    with pytest.raises(ValueError, match=said), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DatasetFactory.load("seq", copy, window_size=64)
    with warnings.catch_warnings(record=True) as said_now:
        warnings.simplefilter("always")
        part = load(copy, allow_partial=True).num_rows  # asked for: what is there
    assert [str(w.message).split(": ")[1][:22] for w in said_now] == [
        "no shards.index (writt",
        "loading an unfinished ",
    ]
    assert 0 < part < whole


def test_a_rejects_file_marks_a_run_output_whatever_its_shards_are_named(copy):
    (copy / "manifest.json").unlink()
    (copy / INDEX_NAME).unlink()
    for s, shard in enumerate(sorted(copy.glob("shard_*"))):
        shard.rename(copy / f"shard_{s:05d}")  # named as before tasks named shards
    assert quiet_load(copy).num_rows > 0  # nothing marks it: loads as seed-style shards
    (copy / "rejects.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"rejects.jsonl a preprocessing run writes"):
        quiet_load(copy)


def test_shards_written_without_a_manifest_load_indexed_or_not(tmp_path):
    """The seed's style (the shard writer's folders, no manifest, no run folder) and the
    same folder indexed by `tokenmill index` load, every row."""
    root = write_sft_rows(tmp_path / "rows", 5, rows=30, lengths=(2, 12), shard=30)
    with pytest.warns(UserWarning, match="no shards.index"):
        assert MmapStore().load(root).num_rows == 30
    write_index(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MmapStore().load(root).num_rows == 30


def copy_of(folder: Path, to: Path) -> Path:
    return Path(shutil.copytree(folder, to))


def read_all(store) -> None:
    for row in range(store.num_rows):
        store.fetch_row(row, ["sequence"])


def test_a_shard_the_manifest_lists_gone_is_named(copy):
    """Without an index the load lists the folder and names every missing shard; with one,
    the load stays O(1) in shards and the first read of the missing shard names it (no row
    of another shard is served in its place)."""
    shutil.rmtree(copy / SHARDS[4])
    shutil.rmtree(copy / SHARDS[2])
    store = load(copy)
    with pytest.raises(ValueError, match=rf"{copy}/{SHARDS[2]}/meta.json: cannot read: .*"
                       rf"changed since it was indexed, run `tokenmill verify {copy}`"):  # fmt: skip
        read_all(store)
    (copy / INDEX_NAME).unlink()
    with pytest.raises(
        ValueError,
        match=rf"{copy}: shards listed in manifest.json are missing: \['{SHARDS[2]}', '{SHARDS[4]}'\]",
    ):
        quiet_load(copy)


def test_a_domain_dataset_names_the_missing_shard_with_its_domain(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = (ROOT / "data" / "pretrain_c4_300.jsonl").read_text().splitlines()[:16]
    src.write_text(
        "".join(json.dumps({**json.loads(t), "d": "ab"[i % 2]}) + "\n" for i, t in enumerate(lines))
    )
    cfg = default_config("seq").model_dump(mode="json")
    cfg["output"].update(max_tokens_per_shard=2000, domain_key="d")
    out = tmp_path / "out"
    Pipeline(PipelineConfig.from_dict(cfg), [src], out, QWEN, workers=1).run()
    index = ShardIndex(out / INDEX_NAME)
    names = [index.name(s) for s in range(index.count)]
    assert names[0].startswith("a/") and names[-1].startswith("b/")
    whole = load(out).num_rows
    # a domain folder of the finished dataset loads on its own (its manifest is OUT's)
    assert load(out / "a").num_rows + load(out / "b").num_rows == whole
    with pytest.raises(ValueError, match=r"manifest.json is missing"):
        load(copy_of(out / "a", tmp_path / "alone"))  # taken out of its dataset: a lost one
    shutil.rmtree(out / names[-1])
    with pytest.raises(ValueError, match=rf"{out}/{names[-1]}/meta.json: cannot read"):
        read_all(load(out))
