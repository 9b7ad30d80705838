"""The ledger: every token read is written or dropped by reason, whatever the data and config."""

from __future__ import annotations

import json

import pytest
from helpers import DATA, QWEN, TOKENIZERS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.layout import OutputLayout
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.engines.chunks import Chunk, process_chunk
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.ledger import DROP_REASONS, Ledger
from tokenmill.preprocess.packing import PACKING_STRATEGIES
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.format import row_tokens
from tokenmill.training.factory import StoreFactory

BUNDLES = {f: load_tokenizer(TOKENIZERS / f) for f in ("qwen2.5", "deepseek-v3")}
WORDS = ["alpha", "beta", "the", "quick", "fox", "δέλτα", "数据", "\n", "!", "1234"]
text = st.lists(st.sampled_from(WORDS), max_size=40).map(" ".join)


def chat(roles: list[str]) -> st.SearchStrategy[list[dict]]:
    return st.tuples(*[text for _ in roles]).map(
        lambda contents: [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
    )


conversation = st.sampled_from(
    [
        ["user", "assistant"],
        ["system", "user", "assistant"],
        ["user", "assistant"] * 3,
        ["system", "user", "assistant", "user", "assistant", "user"],
        ["user"],
    ]
).flatmap(chat)
malformed = st.sampled_from([{}, {"text": 5}, {"messages": "hi"}, {"prompt": None}])
RECORDS = {
    "seq": st.builds(lambda t: {"text": t}, text),
    "instruction": st.builds(lambda p, r: {"prompt": p, "response": r}, text, text),
    "sft": st.builds(lambda m: {"messages": m}, conversation),
    "dpo": st.builds(lambda a, b: {"chosen": a, "rejected": b}, conversation, conversation),
    "grpo": st.builds(
        lambda p, rs: {"prompt": p, "responses": rs, "rewards": [0.5] * len(rs)},
        chat(["user"]),
        st.lists(text, min_size=1, max_size=3),
    ),
}


@st.composite
def runs(draw):
    train_type = draw(st.sampled_from(sorted(RECORDS)))
    data = default_config(train_type).model_dump(mode="json")
    pre = data["preprocessing"]
    pre["truncation_mode"] = draw(
        st.sampled_from(["auto", "none", "latest_turns", "cut_prompt", "keep_start", "keep_end"])
    )
    pre["max_seq_len"] = draw(st.sampled_from([8, 24, 64, 512]))
    pre["min_chars"] = draw(st.sampled_from([0, 1, 30]))
    pre["max_chars"] = draw(st.sampled_from([60, 400, 100_000]))
    if train_type in ("seq", "instruction", "sft"):
        pre["packing_strategy"] = draw(st.sampled_from(["none", *PACKING_STRATEGIES]))
        pre["max_packed_len"] = draw(st.sampled_from([16, 48, 2048]))
    records = draw(st.lists(st.one_of(RECORDS[train_type], malformed), min_size=1, max_size=12))
    return PipelineConfig.from_dict(data), draw(st.sampled_from(sorted(BUNDLES))), records


def raw_chars(record: dict, fields: list[str]) -> int:
    """Characters of the named fields' text (strings, message contents), nothing rendered."""
    total = 0
    for field in fields:
        value = record.get(field)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                item = item.get("content")
            total += len(item) if isinstance(item, str) else 0
    return total


def tokens_rendered(config: PipelineConfig, family: str, records: list[dict]) -> int:
    """The oracle for tokens read: every record rendered whole (no cut, no filter, every role
    trained so nothing is dropped for training nothing), malformed ones counting 0."""
    data = config.model_dump(mode="json")
    data["preprocessing"].update(
        truncation_mode="none", min_chars=0, max_chars=10**9, packing_strategy="none"
    )
    data["mask"] = {"system": "train", "user": "train"}
    data["mask_default"] = "train"
    whole = RecordMasker(PipelineConfig.from_dict(data), BUNDLES[family])
    fields = [s.field for s in config.all_sections()]
    total = 0
    for record in records:
        if raw_chars(record, fields) > config.preprocessing.max_chars:
            continue  # dropped as too long before it is tokenized
        try:
            out = whole.process(record)
        except RecordError as err:  # identical pairs are read whole, then dropped
            total += err.tokens if err.reason == "identical_pair" else 0
            continue
        except ValueError:
            continue
        for key in whole.layout.token_keys():
            value = out[key]
            total += sum(len(v) for v in value) if isinstance(value, list) else len(value)
    return total


@pytest.mark.slow  # 150 generated runs; the per-reason ledger tests below stay fast
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_every_token_read_is_written_or_dropped_by_reason(run):
    config, family, records = run
    masker = RecordMasker(config, BUNDLES[family])
    chunk = Chunk(0, 0, [Record("in.jsonl", i + 1, r) for i, r in enumerate(records)])
    result = process_chunk(chunk, masker)
    total = Ledger()
    for ledger in result.ledgers.values():
        assert ledger.unbalanced() == []
        total.add(ledger)
    assert total.unbalanced() == []
    assert total.records_read == len(records) and total.records_written == result.records_written
    assert total.tokens_read == tokens_rendered(config, family, records)
    assert total.tokens_written == result.tokens
    keys = masker.layout.token_keys()  # the rows hold exactly the written tokens
    assert total.tokens_written == sum(
        row_tokens(row[k]) for _, row in result.rows for k in keys if k in row
    )
    assert set(total.dropped) <= set(DROP_REASONS)
    dropped_records = sum(
        e["records"] for r, e in total.dropped.items() if r not in ("truncated", "packing_overflow")
    )
    assert dropped_records == len(result.errors)
    if config.preprocessing.truncation_mode == "none" and "packing_overflow" not in total.dropped:
        assert "truncated" not in total.dropped


def test_pretraining_keeps_every_token_of_the_shipped_shakespeare(tmp_path):
    """The default seq config: nothing cut, documents in order with EOS between them, so the
    stored stream is the tokenizer's own encoding of each text, end to end."""
    summary = Pipeline(
        default_config("seq"), [DATA / "pretrain_shakespeare.jsonl"], tmp_path, QWEN, workers=1
    ).run()
    bundle = load_tokenizer(QWEN)
    expected: list[int] = []
    with open(DATA / "pretrain_shakespeare.jsonl", encoding="utf-8") as f:
        for line in f:
            expected += bundle.tokenizer.encode(json.loads(line)["text"]).ids + [bundle.eos_id]
    store = StoreFactory.create("bin").load(tmp_path)
    assert store.fetch(0, store.token_count, "sequence").tolist() == expected
    assert summary.tokens_read == summary.tokens == len(expected) > 50_000
    assert summary.dropped_tokens == 0 and summary.dropped == {}
    assert summary.ledger().unbalanced() == []
    rows = store.row_lengths("sequence")
    assert (rows[:-1] == default_config("seq").preprocessing.max_packed_len).all()


def test_a_record_too_long_is_dropped_before_it_is_tokenized():
    """Issue 16's 50 MB record: counted too_long with no token made (memory stays flat)."""
    data = default_config("seq").model_dump(mode="json")
    data["preprocessing"]["max_chars"] = 1_000_000
    masker = RecordMasker(PipelineConfig.from_dict(data), BUNDLES["qwen2.5"])
    chunk = Chunk(0, 0, [Record("big.jsonl", 1, {"text": "word " * 1_000_000})])
    result = process_chunk(chunk, masker)
    ledger = result.ledgers[""]
    assert ledger.dropped == {"too_long": {"records": 1, "tokens": 0}} and ledger.tokens_read == 0
    assert "5000000 characters, more than max_chars=1000000" in str(result.errors[0])


ROW_SCHEMAS = {  # train type -> (token keys with their masks, context, values)
    "seq": ({"sequence": None}, (), ()),
    "sft": ({"sequence": "loss_mask"}, (), ()),
    "instruction": ({"sequence": "loss_mask"}, (), ()),
    "dpo": ({"chosen": "chosen_mask", "rejected": "rejected_mask"}, (), ()),
    "kto": ({"completion": "completion_mask"}, (), ("label",)),
    "grpo": ({"responses": "masks"}, ("prompts",), ("rewards",)),
}


@pytest.mark.parametrize("train_type", sorted(ROW_SCHEMAS))
def test_a_runs_rows_are_counted_by_the_item_schemas_rule(train_type):
    """The rows a run writes are read by an ItemSchema made from the config's layout: the
    keys each type's item would name (but `sequence`), the ledger's tokens and the summary's
    trained tokens both counted by it."""
    tokens, context, values = ROW_SCHEMAS[train_type]
    schema = OutputLayout(default_config(train_type)).row_schema()
    assert (schema.tokens, schema.context, schema.values) == (tokens, context, values)
    assert schema.grouped == (train_type == "grpo")


def test_beside_a_masked_key_an_unmasked_one_trains_nothing_in_the_counts():
    """A row's trained tokens are its masks' True values once any key has a mask (what run
    summaries have always counted): a trained text source with no mask is then context."""
    chat = {"field": "chosen", "template": True, "action": "$role"}
    text = {"field": "rejected", "action": "train"}
    config = PipelineConfig.from_dict(
        {"input": {"sources": {"chosen": {"sections": [chat]}, "rejected": {"sections": [text]}}}}
    )
    schema = OutputLayout(config).row_schema()
    assert schema.tokens == {"chosen": "chosen_mask"} and schema.context == ("rejected",)
    row = {"chosen": [1, 2, 3], "chosen_mask": [False, True, True], "rejected": [4, 5]}
    assert (schema.token_count(row), schema.trained_tokens(row)) == (5, 2)
