"""Other tools' record shapes with a built-in type and no hand-written config (columns.py,
presets.py, records.py's .txt): ShareGPT under sft, Alpaca, LLaMA-Factory's KTO, plain text
files, and column / message / role mappings."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DATA, TOKENIZERS

from tokenmill.preprocess.chat.tokenizer import encode_text, load_tokenizer
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline

QWEN = TOKENIZERS / "qwen2.5"
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def bundle():
    return load_tokenizer(QWEN)


def test_sharegpt_conversations_load_under_the_sft_type(tmp_path):
    """LLaMA-Factory's tool chats (`conversations`, `from`/`value`) with --type sft as it is."""
    summary = Pipeline(
        default_config("sft"),
        [DATA / "toolcall_glaive_zh_300.json"],
        tmp_path / "out",
        QWEN,
        workers=1,
        progress=False,
    ).run()
    assert (summary.records_read, summary.records_written) == (300, 300)
    masker = RecordMasker(default_config("sft"), load_tokenizer(QWEN))
    record = json.loads((DATA / "toolcall_glaive_zh_300.json").read_text())[0]
    as_messages = {"messages": record["conversations"], "tools": record["tools"]}
    a, b = masker.process(record), masker.process(as_messages)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_alpaca_with_and_without_its_input(bundle):
    masker = RecordMasker(default_config("instruction"), bundle)
    eos = bundle.eos_id
    for record, prompt in [
        (
            {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            "Add the numbers.\n2 and 3",
        ),
        ({"instruction": "Say hi.", "input": "", "output": "hi"}, "Say hi."),  # no newline
        ({"instruction": "Say hi.", "output": "hi"}, "Say hi."),
    ]:
        out = masker.process(record)
        head = encode_text(bundle, record["instruction"], True).tolist()
        if record.get("input"):
            head += encode_text(bundle, "\n" + record["input"], False).tolist()
        reply = [*encode_text(bundle, record["output"], False).tolist(), eos]
        assert out["sequence"].tolist() == head + reply
        assert out["loss_mask"].tolist() == [False] * len(head) + [True] * len(reply)
        assert bundle.tokenizer.decode(head) == prompt


def test_llama_factory_kto_trains_the_last_reply_under_its_label(bundle):
    """`messages` + a boolean `label` (LLaMA-Factory's kto_tag): the whole chat is the
    completion's conversation, its last reply trains; TRL's shape is unchanged."""
    masker = RecordMasker(default_config("kto"), bundle)
    for label, tag in [(True, "label"), (False, "kto_tag")]:
        out = masker.process({"messages": CHAT, tag: label})
        trained = out["completion"][out["completion_mask"]].tolist()
        assert bundle.tokenizer.decode(trained, skip_special_tokens=False) == "4<|im_end|>\n"
        assert out["label"].tolist() == [float(label)]
    trl = masker.process({"prompt": CHAT[:3], "completion": CHAT[3:], "label": True})
    assert (
        trl["completion"].tolist()
        == masker.process({"messages": CHAT, "label": 1})["completion"].tolist()
    )


def test_messages_in_another_shape_map_by_config(bundle):
    """axolotl's field_messages / message_property_mappings / roles, as input.columns,
    input.message_fields and input.roles: the same ids and mask as OpenAI messages."""
    data = default_config("sft").model_dump(mode="json")
    data["preprocessing"]["min_chars"] = 0
    data["input"].update(
        columns={"messages": "dialog"},
        message_fields={"role": "speaker", "content": "text"},
        roles={"user": ["human", "customer"], "assistant": "bot"},
    )
    mapped = RecordMasker(PipelineConfig.from_dict(data), bundle)
    names = {"user": "customer", "assistant": "bot"}
    dialog = [{"speaker": names[m["role"]], "text": m["content"]} for m in CHAT]
    a = mapped.process({"dialog": dialog})
    data["input"].update(columns={}, message_fields={}, roles={})
    b = RecordMasker(PipelineConfig.from_dict(data), bundle).process({"messages": CHAT})
    assert all(np.array_equal(a[k], b[k]) for k in b)


def test_an_unknown_shape_names_the_field_that_maps_it(bundle):
    masker = RecordMasker(default_config("sft"), bundle)
    with pytest.raises(
        RecordError,
        match=r"x\.jsonl:4: messages: missing field \(record has: dialog\); map one with input\.columns: \{messages: <its key>\}",
    ):
        masker.process(Record("x.jsonl", 4, {"dialog": CHAT}))


def test_text_files_are_one_record_each_or_one_per_line(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text(
        "A first document, long enough to pass the min_chars filter.\n" * 2
    )
    (folder / "b.txt").write_text(
        "line one of b, with enough characters to pass min_chars\n\nshort\r\nline four of b, also long enough to pass the min_chars filter\n"
    )
    seq = default_config("seq")
    whole = Pipeline(seq, [folder], tmp_path / "whole", QWEN, workers=1, progress=False).run()
    assert (whole.records_read, whole.records_written) == (2, 2)
    data = seq.model_dump(mode="json")
    data["input"]["text_unit"] = "line"
    lines = Pipeline(
        PipelineConfig.from_dict(data),
        [folder],
        tmp_path / "lines",
        QWEN,
        workers=1,
        on_error="skip",
        progress=False,
    ).run()
    assert (lines.records_read, lines.records_written) == (6, 4)
    rejects = [
        json.loads(x) for x in (tmp_path / "lines" / "rejects.jsonl").read_text().splitlines()
    ]
    assert [(r["source"][-5:], r["line"], r["reason"]) for r in rejects] == [
        ("b.txt", 2, "too_short"),
        ("b.txt", 3, "too_short"),
    ]
    (folder / "c.txt").write_bytes(b"fine\nbroken \xff here\n")
    with pytest.raises(RecordError, match=r"c\.txt:2: not valid UTF-8"):
        Pipeline(seq, [folder], tmp_path / "bad", QWEN, workers=1, progress=False).run()
