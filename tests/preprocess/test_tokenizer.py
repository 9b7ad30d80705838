"""The tokenizer folder's own rule for plain text: its post-processor, and a BOS only where
tokenizer_config.json sets add_bos_token; checked against transformers' own encode."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import unicodedata

import numpy as np
import orjson
import pytest
import tokenizers
from helpers import ROOT, TOKENIZERS
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.preprocess.chat import spans
from tokenmill.preprocess.chat.tokenizer import (
    encode_fast,
    encode_text,
    is_stable,
    load_tokenizer,
    unnormalized,
)
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.document.parts import Premade
from tokenmill.preprocess.engines import chunks
from tokenmill.preprocess.engines.chunks import preencode, prerender
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.presets import default_config

TEXTS = ["Hello world.", "  leading spaces and\nnew lines", "数据 and δέλτα", ""]


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory):
    """A folder that names a BOS token but does not add it (as GPT-2-style configs do)."""
    folder = tmp_path_factory.mktemp("gpt2_style")
    shutil.copy(TOKENIZERS / "qwen2.5" / "tokenizer.json", folder)
    config = json.loads((TOKENIZERS / "qwen2.5" / "tokenizer_config.json").read_text())
    config.pop("add_bos_token", None)
    config["bos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow  # a transformers tokenizer a family
@pytest.mark.parametrize("family", ["qwen2.5", "deepseek-v3", "gpt2-style"])
def test_plain_text_gets_the_special_tokens_its_tokenizer_would_add(family, gpt2_style):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    folder = gpt2_style if family == "gpt2-style" else TOKENIZERS / family
    oracle = transformers.AutoTokenizer.from_pretrained(str(folder))
    bundle = load_tokenizer(folder)
    for text in TEXTS:
        want = oracle(text, add_special_tokens=True)["input_ids"]
        if family == "deepseek-v3":
            # its config sets add_bos_token (a LlamaTokenizerFast in transformers 4, which adds
            # the BOS); transformers 5 loads this ByteLevel folder as a generic backend that
            # ignores the flag, so the config's rule is added here by hand
            assert bundle.add_bos_token and want[:1] != [bundle.bos_id]
            want = [bundle.bos_id, *want]
        assert encode_text(bundle, text, add_special_tokens=True).tolist() == want, (family, text)
        plain = oracle(text, add_special_tokens=False)["input_ids"]
        assert encode_text(bundle, text, add_special_tokens=False).tolist() == plain
    if family == "gpt2-style":
        assert bundle.bos_id is not None and not bundle.add_bos_token
        out = RecordMasker(default_config("seq"), bundle).process({"text": "A document." * 9})
        assert out["sequence"][0] != bundle.bos_id  # a document never starts with a stray BOS
        assert out["sequence"][-1] == bundle.eos_id  # the section asked for its EOS


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "deepseek-v3"])
@pytest.mark.parametrize("bos", [None, False])
def test_a_chunk_encoded_ahead_in_one_batch_gives_the_same_rows(family, bos):
    """Pretraining text is encoded a chunk at a time without offsets (encode_batch_fast);
    every array equals a record-by-record encode's, and a text past max_chars is not encoded."""
    data = default_config("seq").model_dump(mode="json")
    data["input"]["sections"][0]["add_special_tokens"] = bos
    data["preprocessing"].update(max_chars=20_000)
    config = PipelineConfig.from_dict(data)
    lines = (ROOT / "data" / "pretrain_c4_300.jsonl").read_text().splitlines()[:40]
    records = [Record("c4.jsonl", i, orjson.loads(line)) for i, line in enumerate(lines, 1)]
    records += [Record("c4.jsonl", 41, {"text": TEXTS[2] * 3}), Record("c4.jsonl", 42, {"x": 1})]
    records.append(Record("c4.jsonl", 43, {"text": "x" * 20_001}))
    bundle = load_tokenizer(TOKENIZERS / family)
    one, ahead = RecordMasker(config, bundle), RecordMasker(config, bundle)
    made = Premade(encoded=preencode(ahead, records))
    ahead.take_premade(made)
    assert len(made.encoded) == 41  # not the text past max_chars, nor the record without one
    for record in records:
        try:
            expected = one.process_counted(record)[0]
        except RecordError as err:
            with pytest.raises(RecordError, match=re.escape(err.message)):
                ahead.process_counted(record)
            continue
        got = ahead.process_counted(record)[0]
        assert got.keys() == expected.keys()
        assert all(np.array_equal(got[k], expected[k]) for k in got)
    assert not made.encoded  # every text encoded ahead was used


@pytest.mark.slow  # shipped chats rendered both ways, 3 families
@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "deepseek-v3"])
def test_a_chat_chunk_rendered_ahead_in_one_batch_gives_the_same_rows(family, monkeypatch):
    """Chat SFT is rendered and encoded a chunk at a time (one batched encode): every array
    and every error equals a record-by-record run's, through ShareGPT and tool-call records,
    a text the normalizer changes (encoded alone), bad records and truncation's re-render."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # as in a run's workers
    data = default_config("sft").model_dump(mode="json")
    data["preprocessing"].update(max_seq_len=512, min_chars=50)
    config = PipelineConfig.from_dict(data)
    lines = (ROOT / "data" / "chat_sharegpt_1000.jsonl").read_bytes().splitlines()[:30]
    values = [orjson.loads(line) for line in lines]
    raw = (ROOT / "data" / "chat_sharegpt_raw_200.jsonl").read_bytes().splitlines()[:3]
    values += [{"messages": orjson.loads(line)["conversations"]} for line in raw]
    calls = json.loads((ROOT / "data" / "toolcall_glaive_zh_300.json").read_text())[:3]
    values += [{"messages": r["conversations"], "tools": r["tools"]} for r in calls]
    decomposed = "Cafe\u0301 au lait, " * 5  # not NFC: the normalizer changes it
    values += [
        {
            "messages": [
                {"role": "user", "content": decomposed},
                {"role": "assistant", "content": "Oui."},
            ]
        },
        {"messages": []},
        {"messages": [{"role": "user", "content": 3}]},
        {
            "messages": [
                {"role": "user", "content": "short"},
                {"role": "assistant", "content": "ok"},
            ]
        },
        {"text": "no messages"},
    ]
    records = [Record("chat.jsonl", i, value) for i, value in enumerate(values, 1)]
    bundle = load_tokenizer(TOKENIZERS / family)
    one, ahead = RecordMasker(config, bundle), RecordMasker(config, bundle)
    made = Premade(rendered=prerender(ahead, records))
    ahead.take_premade(made)
    derived = [made[4] is not None for entries in made.rendered.values() for made in entries]
    assert sum(derived) >= 30
    if family != "deepseek-v3":  # no normalizer there: nothing for it to change
        [(*_, offsets)] = made.rendered[("chat.jsonl", records[-5].line)]
        assert not offsets  # encoded alone, with its normalizer
    encodes = {one: 0, ahead: 0}  # texts each masker encodes on its own
    alone = spans.encode_offsets

    def counted(bundle, text):
        encodes[masker] += 1
        return alone(bundle, text)

    monkeypatch.setattr(spans, "encode_offsets", counted)
    for record in records:
        try:
            masker = one
            expected = one.process_counted(record)[0]
        except RecordError as err:
            masker = ahead
            with pytest.raises(RecordError, match=re.escape(err.message)):
                ahead.process_counted(record)
            continue
        masker = ahead
        assert (record.source, record.line) in made.rendered  # only a failing one renders none
        got = ahead.process_counted(record)[0]
        assert got.keys() == expected.keys()
        assert all(np.array_equal(got[k], expected[k]) for k in got)
    assert not made.rendered  # every rendering made ahead was used
    assert encodes[ahead] <= encodes[one] - 30  # and its encoding, where it was derived
    monkeypatch.setattr(chunks, "PRERENDER_CHARS", 20_000)  # past it, records go one at a time
    assert 1 < len(prerender(ahead, records)) < 30
    dated = f"{{{{ strftime_now('%d %b %Y') }}}}{bundle.chat_template}"  # Llama 3's system date
    clock = RecordMasker(config, dataclasses.replace(bundle, chat_template=dated))
    assert prerender(clock, records) == {}  # rendered with its record, on the same date


def _preference_records(preset: str) -> list[Record]:
    """Preference pairs as TRL writes them: explicit and implicit prompts, a multi-turn prompt
    long enough to be cut, the standard (text) format, bad pairs, and two records made by hand
    under one name; as KTO completions, or as GRPO groups (their prompts are the chats)."""
    lines = (ROOT / "data" / "dpo_en_300.jsonl").read_bytes().splitlines()[:24]
    values = [orjson.loads(line) for line in lines]
    implicit = {k: v for k, v in values[0].items() if k != "prompt"}  # the replies repeat it
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "word " * 90}
        for i in range(9)
    ]
    reply = [{"role": "assistant", "content": "A short reply."}]
    other = [{"role": "assistant", "content": "Another reply."}]
    bad = [{"role": "assistant", "content": 3}]
    values += [
        implicit,  # line 25
        {"prompt": turns, "chosen": reply, "rejected": other},  # cut: the latest turns that fit
        {"prompt": "Say hi.", "chosen": " Hi!", "rejected": " No."},  # the standard format
        {"prompt": turns[:1], "chosen": reply, "rejected": reply},  # the same tokens
        {"prompt": turns[:1], "chosen": bad, "rejected": other},
        {"prompt": turns[:1], "chosen": reply, "rejected": bad},
        {"chosen": reply},
    ]
    if preset == "kto":  # a prompt and one completion, labelled
        values = [
            {"prompt": v.get("prompt"), "completion": v.get("chosen"), "label": i % 2 == 0}
            for i, v in enumerate(values)
        ]
    if preset == "grpo":  # a prompt and a group of text responses, with their rewards
        values = [
            {"prompt": v.get("prompt"), "responses": ["One.", "Two."], "rewards": [1.0, 0.0]}
            for v in values
        ]
    records = [Record("pairs.jsonl", i, value) for i, value in enumerate(values, 1)]
    return records + [Record("<record>", 0, values[k]) for k in (1, 2)]  # one name, two records


@pytest.mark.parametrize(
    ("family", "preset"),
    [
        ("qwen2.5", "dpo"),
        ("qwen3", "dpo"),
        ("deepseek-v3", "dpo"),
        ("qwen2.5", "kto"),
        ("qwen3", "grpo"),
    ],
)
def test_preference_records_rendered_ahead_in_one_batch_give_the_same_rows(
    family, preset, monkeypatch
):
    """Every conversation of a preference record (each reply with its prompt, explicit or
    implicit; a GRPO prompt with its generation prompt) is rendered and encoded with its chunk,
    in one batch: every array, count and error equals a record-by-record run's, through
    truncation's re-render, the text format and bad replies."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # as in a run's workers
    data = default_config(preset).model_dump(mode="json")
    data["preprocessing"].update(max_seq_len=512)
    config = PipelineConfig.from_dict(data)
    records = _preference_records(preset)
    bundle = load_tokenizer(TOKENIZERS / family)
    one, ahead = RecordMasker(config, bundle), RecordMasker(config, bundle)
    made = Premade(rendered=prerender(ahead, records))
    ahead.take_premade(made)
    conversations = 2 if preset == "dpo" else 1
    for line in (1, 25, 26) if preset != "grpo" else (1, 26):  # explicit, implicit, to be cut
        assert len(made.rendered[("pairs.jsonl", line)]) == conversations
    assert ("pairs.jsonl", 27) not in made.rendered  # text: rendered by the record's own pass
    assert ("<record>", 0) not in made.rendered  # a name two records share
    if preset == "dpo":  # a bad reply: the record renders on its own, and says why
        assert not {("pairs.jsonl", 29), ("pairs.jsonl", 30)} & made.rendered.keys()
    alone = spans.encode_offsets
    encodes = {one: 0, ahead: 0}

    def counted(bundle, text):
        encodes[masker] += 1
        return alone(bundle, text)

    monkeypatch.setattr(spans, "encode_offsets", counted)
    for record in records:
        masker = one
        try:
            expected, counts = one.process_counted(record)
        except RecordError as err:
            masker = ahead
            with pytest.raises(RecordError, match=re.escape(err.message)) as raised:
                ahead.process_counted(record)
            assert raised.value.tokens == err.tokens
            continue
        masker = ahead
        got, got_counts = ahead.process_counted(record)
        assert got.keys() == expected.keys() and got_counts == counts
        assert all(_same(got[k], expected[k]) for k in got)
    assert encodes[ahead] <= encodes[one] - 24 * conversations
    assert not made.rendered  # every rendering made ahead was used


def _same(a, b) -> bool:
    if isinstance(a, list):  # a group: one array per item
        return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    return np.array_equal(a, b)


def test_the_unnormalized_tokenizer_shares_the_model_and_its_added_tokens():
    """Qwen's NFC normalizer is left out on a tokenizer over the same model (its added tokens
    at the same ids); DeepSeek has no normalizer to leave out, and a tokenizer that cuts or
    pads keeps its own."""
    qwen = load_tokenizer(TOKENIZERS / "qwen2.5").tokenizer
    plain = unnormalized(qwen)
    assert plain is not qwen and plain.normalizer is None and qwen.normalizer is not None
    assert plain.get_added_tokens_decoder() == qwen.get_added_tokens_decoder()
    assert plain.get_vocab_size() == qwen.get_vocab_size()
    deepseek = load_tokenizer(TOKENIZERS / "deepseek-v3").tokenizer
    assert unnormalized(deepseek) is deepseek
    cutting = tokenizers.Tokenizer.from_str(qwen.to_str())
    cutting.enable_truncation(8)
    assert unnormalized(cutting) is cutting


@pytest.mark.slow  # 12,000 words encoded 4 times
@pytest.mark.parametrize("family", ["qwen2.5", "deepseek-v3"])
def test_the_larger_word_cache_gives_the_ids_of_a_plain_tokenizer(family):
    """Loaded, a BPE model keeps more merged words than `tokenizers` does by default: a text of
    more distinct words than that default, encoded twice (the second time from the cache),
    gives a plain tokenizer's ids both times."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyzäöüß"))
    words = ["".join(rng.choice(letters, 8)) for _ in range(12_000)]
    texts = [" ".join(words[i : i + 200]) for i in range(0, len(words), 200)]
    loaded = load_tokenizer(TOKENIZERS / family).tokenizer
    plain = tokenizers.Tokenizer.from_file(str(TOKENIZERS / family / "tokenizer.json"))
    expected = [e.ids for e in plain.encode_batch(texts, add_special_tokens=False)]
    for _ in range(2):
        assert [loaded.encode(t, add_special_tokens=False).ids for t in texts] == expected


def test_text_with_a_character_python_does_not_know_is_not_stable():
    """A code point unassigned in Python's Unicode tables could be a combining mark of a newer
    version, which the tokenizer's NFC would move: such text keeps the normalizer."""
    assert is_stable("NFC", "plain ascii") and is_stable("NFC", "café 数据 🙂")
    assert not is_stable("NFC", unicodedata.normalize("NFD", "café"))
    assert unicodedata.is_normalized("NFC", "caf\u0378") and not is_stable("NFC", "caf\u0378")
    assert is_stable("", unicodedata.normalize("NFD", "café"))  # no normalizer: nothing moves


@settings(max_examples=150, deadline=None)
@given(
    texts=st.lists(
        st.one_of(
            st.text(st.characters(exclude_categories=["Cs"]), max_size=30),
            st.sampled_from(["café", unicodedata.normalize("NFD", "naïve"), "<|im_end|>x"]),
        ),
        max_size=6,
    ),
    add_special=st.booleans(),
    family=st.sampled_from(["qwen2.5", "qwen3", "deepseek-v3"]),
)
def test_encode_fast_gives_the_tokenizers_ids_in_order(texts, add_special, family):
    """Stable texts without the normalizer, the others with it: the same ids as `encode`."""
    tokenizer = load_tokenizer(TOKENIZERS / family).tokenizer
    got = [e.ids for e in encode_fast(tokenizer, texts, add_special)]
    assert got == [tokenizer.encode(t, add_special_tokens=add_special).ids for t in texts]


def test_an_added_token_matched_on_normalized_text_keeps_the_normalizer():
    """`e\u0301x` (normalized=True) is matched on NFC text as `éx`: without the normalizer
    it would not be, so such a tokenizer is used as it is, and the ids stay `encode`'s."""
    words = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"[UNK]": 0, "x": 7, "é": 4}, unk_token="[UNK]")
    )
    words.normalizer = tokenizers.normalizers.NFC()
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.add_tokens([tokenizers.AddedToken("e\u0301x", normalized=True)])
    assert unnormalized(words) is words
    assert [e.ids for e in encode_fast(words, ["éx"], False)] == [words.encode("éx").ids]
