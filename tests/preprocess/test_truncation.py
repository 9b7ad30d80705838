"""Truncation: what a record longer than max_seq_len keeps, by policy, checked against
transformers' own rendering of the kept turns; every token cut is tallied."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import DATA, TOKENIZERS

from tokenmill.preprocess.chat.spans import render_conversation
from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.presets import default_config

FAMILIES = ["qwen2.5", "qwen3", "deepseek-v3"]


def config(train_type: str, **preprocessing) -> PipelineConfig:
    data = default_config(train_type).model_dump(mode="json")
    data["preprocessing"].update(preprocessing)
    return PipelineConfig.from_dict(data)


@pytest.fixture(scope="module")
def oracles():
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    return {f: transformers.AutoTokenizer.from_pretrained(str(TOKENIZERS / f)) for f in FAMILIES}


def oracle_ids(oracle, messages: list[dict]) -> list[int]:
    out = oracle.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def shipped_chats(count: int) -> list[list[dict]]:
    with open(DATA / "chat_sharegpt_1000.jsonl", encoding="utf-8") as f:
        return [json.loads(next(f))["messages"] for _ in range(count)]


def turns(messages: list[dict]) -> tuple[list[dict], list[int]]:
    """The leading system messages, and where each turn (a user message onwards) starts."""
    head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    starts = [head] + [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    return messages[:head], starts


@pytest.mark.slow  # transformers renders every turn suffix of 150 chats, 3 families
@pytest.mark.parametrize("family", FAMILIES)
def test_latest_turns_keep_the_system_prompt_and_the_latest_turns_that_fit(family, oracles):
    """The kept conversation is transformers' rendering of the system prompt plus the longest
    suffix of complete turns that fits; one more turn would not fit; the kept assistant turns
    train exactly as they would in that conversation alone."""
    bundle, oracle, limit = load_tokenizer(TOKENIZERS / family), oracles[family], 512
    masker = RecordMasker(config("sft", max_seq_len=limit), bundle)
    checked = 0
    for n, messages in enumerate(shipped_chats(150)):
        system, starts = turns(messages)
        full = oracle_ids(oracle, messages)
        if len(full) <= limit or len(starts) < 2:
            continue
        fitting = [
            k
            for k in range(1, len(starts))
            if len(oracle_ids(oracle, system + messages[starts[k] :])) <= limit
        ]
        if not fitting:
            continue  # no suffix of turns fits: the fallback, tested below
        k = fitting[0]
        kept = system + messages[starts[k] :]
        try:
            out, tally = masker.process_counted(
                Record("chats.jsonl", n + 1, {"messages": messages})
            )
        except RecordError as err:  # the suffix that fits trains nothing: dropped, counted
            assert err.reason == "no_trained_tokens" and err.tokens > limit
            assert not any(m["role"] == "assistant" for m in kept)
            continue
        assert out["sequence"].tolist() == oracle_ids(oracle, kept), n
        assert len(oracle_ids(oracle, system + messages[starts[k - 1] :])) > limit
        _, mask = render_conversation(bundle, kept, [m["role"] == "assistant" for m in kept])
        assert out["loss_mask"].tolist() == mask.tolist() and mask.any()
        assert tally.tokens == len(full) and tally.truncated == len(full) - len(out["sequence"])
        checked += 1
    assert checked >= 5


def test_a_first_turn_too_long_to_train_gives_way_to_the_later_turns():
    """The shipped data's record 18 shape: the first question alone is over the limit; the
    later turns fit and train instead of the record being dropped."""
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    masker = RecordMasker(config("sft", max_seq_len=64), bundle)
    messages = [
        {"role": "user", "content": "word " * 400},
        {"role": "assistant", "content": "A long question."},
        {"role": "user", "content": "And a short one?"},
        {"role": "assistant", "content": "A short answer."},
    ]
    out, tally = masker.process_counted(Record("a.jsonl", 1, {"messages": messages}))
    kept = messages[2:]
    ids, mask = render_conversation(bundle, kept, [False, True])
    assert out["sequence"].tolist() == ids.tolist() and out["loss_mask"].tolist() == mask.tolist()
    assert tally.truncated == tally.tokens - len(ids) > 400


def test_when_no_turn_fits_the_latest_trained_turn_is_cut_at_its_prompt():
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    masker = RecordMasker(config("sft", max_seq_len=80), bundle)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one " * 300},
        {"role": "assistant", "content": "Done."},
    ]
    out, tally = masker.process_counted(Record("a.jsonl", 1, {"messages": messages}))
    assert len(out["sequence"]) == 80 and tally.truncated == tally.tokens - 80
    text = bundle.tokenizer.decode(out["sequence"].tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.") and text.endswith("Done.<|im_end|>\n")
    trained = out["sequence"][out["loss_mask"]].tolist()
    assert bundle.tokenizer.decode(trained, skip_special_tokens=False) == ("Done.<|im_end|>\n")


def test_cut_prompt_keeps_the_response_and_the_start_of_the_prompt():
    bundle = load_tokenizer(TOKENIZERS / "deepseek-v3")  # a BOS, kept
    masker = RecordMasker(config("instruction", max_seq_len=40), bundle)
    record = {"prompt": "Count: " + "one two three " * 30, "response": "Three hundred."}
    whole = RecordMasker(config("instruction", max_seq_len=10_000), bundle).process(record)
    out, tally = masker.process_counted(Record("a.jsonl", 1, record))
    first = int(np.flatnonzero(whole["loss_mask"])[0])
    response = whole["sequence"][first:].tolist()
    assert len(out["sequence"]) == 40 and out["sequence"][-len(response) :].tolist() == response
    assert (
        out["sequence"][: 40 - len(response)].tolist()
        == whole["sequence"][: 40 - len(response)].tolist()
    )
    assert out["sequence"][0] == bundle.bos_id and not out["loss_mask"][0]
    assert int(out["loss_mask"].sum()) == int(whole["loss_mask"].sum())
    assert tally.truncated == len(whole["sequence"]) - 40


@pytest.mark.parametrize(
    "mode, keeps", [("keep_start", "start"), ("keep_end", "end"), ("none", "all"), ("auto", "all")]
)
def test_plain_text_is_cut_only_when_the_config_asks(mode, keeps):
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    text = "The quick brown fox jumps over the lazy dog. " * 40
    whole = bundle.tokenizer.encode(text).ids + [bundle.eos_id]
    masker = RecordMasker(config("seq", max_seq_len=50, truncation_mode=mode), bundle)
    out, tally = masker.process_counted(Record("a.jsonl", 1, {"text": text}))
    want = {"start": whole[:50], "end": whole[-50:], "all": whole}[keeps]
    assert out["sequence"].tolist() == want
    assert tally.tokens == len(whole) and tally.truncated == len(whole) - len(want)
