"""`tokenmill export` / `tokenmill import`, checked with the libraries that read and write
those formats: megatron-core's IndexedDataset and IndexedDatasetBuilder, and datasets'
load_from_disk."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DATA, QWEN

from tokenmill import DatasetFactory, Pipeline, PipelineConfig, StoreFactory, default_config
from tokenmill.tools.cli import main
from tokenmill.tools.convert import export_megatron, import_megatron
from tokenmill.tools.hf_export import export_hf
from tokenmill.tools.megatron import read_megatron

with warnings.catch_warnings():  # megatron-core warns that Apex and Transformer Engine are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def config(train_type: str, **sections) -> PipelineConfig:
    data = default_config(train_type).model_dump(mode="json")
    for name, values in sections.items():
        data[name].update(values)
    return PipelineConfig.from_dict(data)


def records(name: str, n: int) -> list[dict]:
    lines = [x for x in (DATA / name).read_text().split("\n") if x]
    return [json.loads(x) for x in lines[:n]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_of(out: Path, key: str = "sequence") -> list[np.ndarray]:
    store = StoreFactory.create("bin", window_size=8).load(out)
    return [np.asarray(store.fetch_row(i, key)) for i in range(store.num_rows)]


def stream_of(out: Path) -> np.ndarray:
    store = StoreFactory.create("bin", window_size=8).load(out)
    return np.asarray(store.fetch(0, store.token_count, "sequence"))


@pytest.fixture(scope="module")
def seq(tmp_path_factory):
    """The same 60 documents in two domains, packed as a stream into 300-token rows (documents
    cut across rows and shards), and unpacked (one document per row: the reference)."""
    root = tmp_path_factory.mktemp("seq")
    texts = [r["text"] for r in records("pretrain_c4_300.jsonl", 60)]
    src = write_jsonl(
        root / "in.jsonl",
        [{"text": t, "lang": "en" if i % 3 else "fr"} for i, t in enumerate(texts)],
    )
    out = {}
    for name, packing in (("streamed", "stream"), ("documents", "none")):
        cfg = config(
            "seq",
            preprocessing={"packing_strategy": packing, "max_packed_len": 300},
            output={"domain_key": "lang", "max_tokens_per_shard": 3_000},
        )
        out[name] = root / name
        Pipeline(cfg, [src], out[name], QWEN, workers=1).run()
    manifest = json.loads((out["streamed"] / "manifest.json").read_text())
    assert len(manifest["domains"]["en"]) > 2  # documents run across shards
    return out


def test_megatron_export_is_read_by_megatron_core_one_sequence_per_document(seq, tmp_path):
    prefix = tmp_path / "mg" / "corpus"
    result = export_megatron(seq["streamed"], prefix)
    documents = rows_of(seq["documents"])
    megatron = IndexedDataset(str(prefix))
    assert len(megatron) == len(documents) == result["documents"] == 60
    assert megatron.document_indices.tolist() == list(range(61))
    assert megatron.index.dtype == np.int32  # Qwen's ids pass uint16
    for i, document in enumerate(documents):
        assert np.array_equal(megatron[i], document), i
    assert np.array_equal(megatron.get(5, offset=3, length=7), documents[5][3:10])


def test_megatron_core_corpus_imports_token_for_token(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 65_000, size=n) for n in (5, 1, 300, 42, 7)]
    builder = IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for i, document in enumerate(documents):
        if i == 2:  # a document of several sequences (Megatron's --split-sentences)
            for part in np.split(document, [100, 250]):
                builder.add_item(torch.from_numpy(part))
            builder.end_document()
        else:
            builder.add_document(document, [len(document)])
    builder.end_document()  # an empty document: counted, not written
    builder.finalize(str(tmp_path / "mc.idx"))

    summary = import_megatron(tmp_path / "mc", tmp_path / "out", max_tokens_per_shard=100)
    assert summary.records_read == 6 and summary.records_written == 5
    assert summary.skipped == {"too_short": 1} and summary.tokens == 355
    assert main(["verify", str(tmp_path / "out")]) == 0
    assert [r.tolist() for r in rows_of(tmp_path / "out")] == [d.tolist() for d in documents]
    assert [r.tolist() for r in rows_of(tmp_path / "out", "doc_lengths")] == [
        [len(d)] for d in documents
    ]
    everything = np.concatenate(documents)
    ds = DatasetFactory.load("seq", str(tmp_path / "out"), window_size=16)
    assert len(ds) == (len(everything) - 1) // 16
    for i in range(len(ds)):
        item = ds[i]
        assert item["input_ids"].tolist() == everything[i * 16 : i * 16 + 16].tolist()
        assert item["target_ids"].tolist() == everything[i * 16 + 1 : i * 16 + 17].tolist()


def test_round_trip_through_megatron_keeps_every_token(seq, tmp_path):
    export_megatron(seq["streamed"], tmp_path / "a")
    import_megatron(tmp_path / "a", tmp_path / "back")
    assert np.array_equal(stream_of(tmp_path / "back"), stream_of(seq["streamed"]))
    assert [r.tolist() for r in rows_of(tmp_path / "back")] == [
        r.tolist() for r in rows_of(seq["documents"])
    ]
    export_megatron(tmp_path / "back", tmp_path / "b")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    src = write_jsonl(root / "chat.jsonl", records("chat_sharegpt_1000.jsonl", 30))
    out = root / "sft"
    Pipeline(default_config("sft"), [src], out, QWEN, workers=1).run()
    return out


def test_megatron_export_of_sft_refuses_to_drop_the_loss_mask_unasked(sft, tmp_path, capsys):
    with pytest.raises(ValueError, match="loss_mask.*--tokens-only"):
        export_megatron(sft, tmp_path / "x")
    assert not list(tmp_path.iterdir())
    code = main(["export", str(sft), "--to", "megatron", "-o", str(tmp_path / "x")])
    assert code == 2 and "--tokens-only" in capsys.readouterr().err

    code = main(
        ["export", str(sft), "--to", "megatron", "-o", str(tmp_path / "x"), "--tokens-only"]
    )
    assert code == 0 and "warning: exporting tokens only: loss_mask" in capsys.readouterr().err
    megatron = IndexedDataset(str(tmp_path / "x"))
    conversations = np.concatenate(rows_of(sft, "doc_lengths"))
    assert megatron.sequence_lengths.tolist() == conversations.tolist()  # one per conversation
    assert np.array_equal(
        np.concatenate([megatron[i] for i in range(len(megatron))]), stream_of(sft)
    )


def test_hf_export_is_read_by_load_from_disk_with_exact_values(sft, tmp_path):
    import datasets

    export_hf(sft, tmp_path / "hf")
    loaded = datasets.load_from_disk(str(tmp_path / "hf"))
    keys = ["sequence", "loss_mask", "position_ids", "doc_lengths"]
    assert loaded.column_names == keys
    assert loaded.features["loss_mask"].feature.dtype == "bool"
    assert loaded.features["sequence"].feature.dtype == "int32"
    stored = {k: rows_of(sft, k) for k in keys}
    assert len(loaded) == len(stored["sequence"])
    for i, row in enumerate(loaded):
        for key in keys:
            assert row[key] == stored[key][i].tolist(), (i, key)


def test_hf_export_of_groups_and_domains(seq, tmp_path):
    import datasets

    root = tmp_path / "grpo"
    src = write_jsonl(tmp_path / "g.jsonl", records("grpo_from_dpo_300.jsonl", 12))
    Pipeline(default_config("grpo"), [src], root, QWEN, workers=1).run()
    export_hf(root, tmp_path / "hf")
    loaded = datasets.load_from_disk(str(tmp_path / "hf"))
    store = StoreFactory.create("bin", window_size=8).load(root)
    assert len(loaded) == store.num_rows == 12
    for i, row in enumerate(loaded):
        stored = store.fetch_row(i, ["prompts", "responses", "masks", "rewards"])
        assert row["prompts"] == np.asarray(stored["prompts"]).tolist()
        assert row["responses"] == [np.asarray(r).tolist() for r in stored["responses"]]
        assert row["masks"] == [np.asarray(m).tolist() for m in stored["masks"]]
        assert row["rewards"] == pytest.approx(np.asarray(stored["rewards"]).tolist())

    export_hf(seq["streamed"], tmp_path / "domains")
    loaded = datasets.load_from_disk(str(tmp_path / "domains"))
    manifest = json.loads((seq["streamed"] / "manifest.json").read_text())
    rows = {d: sum(s["records"] for s in infos) for d, infos in manifest["domains"].items()}
    assert loaded["domain"] == ["en"] * rows["en"] + ["fr"] * rows["fr"]
    assert [r for r in loaded["sequence"]] == [r.tolist() for r in rows_of(seq["streamed"])]


def test_export_refusals_name_the_reason(seq, tmp_path, capsys):
    root = tmp_path / "dpo"
    src = write_jsonl(tmp_path / "d.jsonl", records("dpo_en_300.jsonl", 5))
    Pipeline(default_config("dpo"), [src], root, QWEN, workers=1).run()
    with pytest.raises(ValueError, match="no `sequence` key.*--to hf"):
        export_megatron(root, tmp_path / "x")
    export_megatron(seq["streamed"], tmp_path / "x")
    with pytest.raises(FileExistsError, match="x.bin exists; pass --overwrite"):
        export_megatron(seq["streamed"], tmp_path / "x")
    export_megatron(seq["streamed"], tmp_path / "x", overwrite=True)
    (tmp_path / "a_file").write_text("")
    for to in ("megatron", "hf"):
        argv = ["export", str(seq["streamed"]), "--to", to, "-o", str(tmp_path / "a_file" / "x")]
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith("tokenmill: error: ")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a saved dataset"):
        export_hf(seq["streamed"], tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_import_names_what_is_wrong_with_a_corpus(seq, tmp_path):
    export_megatron(seq["streamed"], tmp_path / "c")
    idx = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "short.idx").write_bytes(idx[:-8])
    (tmp_path / "short.bin").write_bytes((tmp_path / "c.bin").read_bytes())
    with pytest.raises(ValueError, match=r"short\.idx: \d+ bytes, expected \d+"):
        read_megatron(tmp_path / "short")
    (tmp_path / "cut.idx").write_bytes(idx)
    (tmp_path / "cut.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"cut\.bin: .*beyond it"):
        read_megatron(tmp_path / "cut")
    (tmp_path / "junk.idx").write_bytes(b"not an index at all, not at all")
    (tmp_path / "junk.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no MMIDIDX header"):
        read_megatron(tmp_path / "junk")
    import_megatron(tmp_path / "c.idx", tmp_path / "out")  # the prefix, given with a suffix
    with pytest.raises(FileExistsError, match="not empty; pass --overwrite"):
        import_megatron(tmp_path / "c", tmp_path / "out")
    import_megatron(tmp_path / "c", tmp_path / "out", overwrite=True)
