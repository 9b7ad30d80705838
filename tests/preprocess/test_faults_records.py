"""Silent acceptance (issue 39): bad labels, pairs, groups, domains and config keys are named
bad records or config errors, never stored as given; a plain-text config keeps every token."""

from __future__ import annotations

import json

import pytest
from helpers import QWEN

from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.config import ConfigError, PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.inputs.records import RecordError
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer(QWEN)


def _masker(train_type: str, bundle, **pre) -> RecordMasker:
    data = default_config(train_type).model_dump(mode="json")
    data["preprocessing"].update(min_chars=0, **pre)
    return RecordMasker(PipelineConfig.from_dict(data), bundle)


def _kto(label) -> dict:
    return {"prompt": "What is 2+2?", "completion": "4", "label": label}


@pytest.mark.parametrize("label", [2, 0.5, -1, [True], "true", 1.0])
def test_a_kto_label_that_is_not_a_boolean_is_a_named_bad_record(label, qwen):
    with pytest.raises(RecordError) as caught:
        _masker("kto", qwen).process(_kto(label), "kto.jsonl", 3)
    err = caught.value
    assert (err.source, err.line, err.field, err.reason) == ("kto.jsonl", 3, "label", "bad_value")
    assert f"a label must be true or false (or 1 or 0), got {label!r}" in str(err)


@pytest.mark.parametrize(("label", "stored"), [(True, 1.0), (False, 0.0), (1, 1.0), (0, 0.0)])
def test_a_kto_label_true_false_1_or_0_is_stored(label, stored, qwen):
    out = _masker("kto", qwen).process(_kto(label))
    assert out["label"].tolist() == [stored]


def _turns(prompt: str, reply: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]


def test_a_dpo_pair_whose_prompts_differ_is_a_named_bad_record(qwen):
    """Conversational chosen/rejected with an implicit prompt: they must share it."""
    record = {"chosen": _turns("Hi", "Hello!"), "rejected": _turns("Bye", "Go away.")}
    with pytest.raises(RecordError) as caught:
        _masker("dpo", qwen).process(record, "dpo.jsonl", 7)
    err = caught.value
    assert (err.line, err.field, err.reason) == (7, "rejected", "bad_value")
    assert "differ at message 0, before their replies: a pair must share its prompt" in str(err)
    same = {"chosen": _turns("Hi", "Hello!"), "rejected": _turns("Hi", "Go away.")}
    out = _masker("dpo", qwen).process(same)
    assert len(out["chosen"]) and len(out["rejected"])


def test_grpo_rewards_without_responses_are_a_named_bad_record(qwen):
    masker = _masker("grpo", qwen)
    with pytest.raises(RecordError) as caught:
        masker.process({"prompt": "Add 2 and 2.", "rewards": [1.0, 0.0]}, "g.jsonl", 2)
    err = caught.value
    assert (err.field, err.reason) == ("rewards", "bad_value")
    assert "2 value(s) but no 'responses' for them to score" in str(err)
    out = masker.process({"prompt": "Add 2 and 2."})  # prompt-only data is still fine
    assert "rewards" not in out and len(out["prompts"])


@pytest.mark.parametrize(
    "domain", ["meta.json", "manifest.json", "shards.index", "x.bin", "a.jsonl", ".hidden"]
)
def test_a_domain_named_like_a_dataset_file_is_a_named_bad_record(tmp_path, domain):
    """`domain: "meta.json"` exited 0 with an output verify rejected: now a counted bad
    record naming the field, and the output verifies."""
    from tokenmill.shards.verify import verify_dataset

    src = tmp_path / "in.jsonl"
    rows = [{"text": "a good document " * 8, "d": "en"}, {"text": "another one " * 8, "d": domain}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = default_config("seq").model_dump(mode="json")
    data["output"]["domain_key"] = "d"
    summary = Pipeline(
        PipelineConfig.from_dict(data), [src], tmp_path / "out", QWEN, workers=1, on_error="skip"
    ).run()
    assert summary.records_written == 1 and summary.skipped == {"bad_value": 1}
    reject = json.loads((tmp_path / "out" / "rejects.jsonl").read_text())
    assert (reject["line"], reject["field"], reject["reason"]) == (2, "d", "bad_value")
    assert f"got {domain!r}" in reject["message"]
    assert verify_dataset(tmp_path / "out") == []


def test_a_typo_key_under_output_dtype_is_a_config_error_naming_it(qwen):
    data = default_config("seq").model_dump(mode="json")
    data["output"]["dtype"] = {"sequnce": "int32"}
    with pytest.raises(ConfigError, match="output.dtype.sequnce: not a key this config writes"):
        RecordMasker(PipelineConfig.from_dict(data), qwen)
    data["output"]["dtype"] = {"sequence": "uint32"}
    assert RecordMasker(PipelineConfig.from_dict(data), qwen).layout.dtypes()["sequence"] == (
        "uint32"
    )


def test_unknown_config_keys_anywhere_are_errors_naming_them():
    data = default_config("seq").model_dump(mode="json")
    for where in ("preprocessing", "output", "input"):
        bad = json.loads(json.dumps(data))
        bad[where]["packing_stratgy"] = "none"
        with pytest.raises(ConfigError, match=f"{where}.packing_stratgy"):
            PipelineConfig.from_dict(bad)


def test_a_hand_written_plain_text_config_keeps_every_token(tmp_path):
    """No packing named, one text section: it streams as the seq preset does, so a document
    past max_packed_len is kept whole across rows, not cut and counted packing_overflow."""
    config = PipelineConfig.from_dict(
        {"input": {"sections": [{"field": "text"}]}, "preprocessing": {"max_packed_len": 16}}
    )
    assert config.preprocessing.packing_strategy == "stream"
    named = PipelineConfig.from_dict(
        {
            "input": {"sections": [{"field": "text"}]},
            "preprocessing": {"max_packed_len": 16, "packing_strategy": "simple"},
        }
    )
    assert named.preprocessing.packing_strategy == "simple"  # what a user names, stays
    chat = PipelineConfig.from_dict({"input": {"sections": [{"field": "m", "template": True}]}})
    assert chat.preprocessing.packing_strategy == "simple"
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "word " * 100}) + "\n")
    summary = Pipeline(config, [src], tmp_path / "out", QWEN, workers=1).run()
    assert summary.dropped == {} and summary.tokens == summary.tokens_read > 16


def test_a_dangling_link_in_an_input_folder_is_an_error_naming_it(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "word " * 20}) + "\n")
    (folder / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(FileNotFoundError, match=f"{folder / 'b.jsonl'}: a link to .*gone.jsonl"):
        Pipeline(default_config("seq"), [folder], tmp_path / "out", QWEN, workers=1).run()
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_an_output_whose_every_record_was_rejected_never_loads_its_rejects_as_data(tmp_path):
    from tokenmill.training.jsonl_store import JsonlStore

    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": 7}\n{"nope": "x"}\n')
    out = tmp_path / "out"
    data = default_config("seq").model_dump(mode="json")
    data["output"]["storage_format"] = "jsonl"
    summary = Pipeline(PipelineConfig.from_dict(data), [src], out, QWEN, on_error="skip").run()
    assert summary.records_written == 0 and (out / "rejects.jsonl").exists()
    for path in (out, tmp_path / "renamed"):  # as written, and with a manifest of "bin" format
        if path != out:
            out.rename(path)
            manifest = json.loads((path / "manifest.json").read_text())
            manifest["storage_format"] = "bin"
            (path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises((FileNotFoundError, ValueError)):
            JsonlStore().load(path)
