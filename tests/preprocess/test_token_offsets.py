"""Token positions derived from the ids (byte-level BPE) are the tokenizer's own offsets: on
every shipped conversation rendered by each shipped template, on arbitrary text, and through
the fallback where the text or the tokenizer rules the derivation out."""

from __future__ import annotations

import json
import os
import unicodedata

import numpy as np
import orjson
import pytest
import tokenizers
from helpers import DATA, TOKENIZERS
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.preprocess.chat.template import render_text
from tokenmill.preprocess.chat.token_offsets import (
    _byte_level,
    _cuts_at_added,
    _kept,
    encode_offsets,
)
from tokenmill.preprocess.chat.tokenizer import (
    TokenizerBundle,
    load_tokenizer,
    tokenizer_threads_are_off,
    tokenizer_threads_off,
)

FAMILIES = ["qwen2.5", "qwen3", "deepseek-v3"]


@pytest.fixture(autouse=True, scope="module")
def threads_off():
    """As in a run's workers: positions are derived only where the tokenizer's threads are off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENIZERS_PARALLELISM", "false")
        yield


def conversations() -> list[list[dict]]:
    """Chat (English), DPO replies and tool calls (Chinese) of the shipped samples."""
    chats = [orjson.loads(x)["messages"] for x in (DATA / "chat_sharegpt_1000.jsonl").open("rb")]
    pairs = [orjson.loads(x) for x in (DATA / "dpo_en_300.jsonl").open("rb")]
    roles = {"human": "user", "gpt": "assistant", "function_call": "assistant"}
    roles |= {"observation": "user"}
    tools = [
        [{"role": roles[m["from"]], "content": m["value"]} for m in r["conversations"]]
        for r in json.loads((DATA / "toolcall_glaive_zh_300.json").read_text())
    ]
    return chats[:300] + [p[k] for p in pairs[:100] for k in ("chosen", "rejected")] + tools[:100]


def assert_same_as_encode(bundle: TokenizerBundle, text: str) -> bool:
    """encode_offsets agrees with `encode` on ids and offsets; True where it derived them."""
    offsets = encode_offsets(bundle, text)
    encoding = bundle.tokenizer.encode(text, add_special_tokens=False)
    assert offsets.ids.tolist() == encoding.ids
    expected = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    assert offsets.starts.tolist() == expected[:, 0].tolist()
    assert offsets.ends.tolist() == expected[:, 1].tolist()
    for at in {0, len(text) // 3, len(text) // 2, len(text)}:
        assert offsets.count_before(at) == int((expected[:, 0] < at).sum())
    return offsets.encoding is None


@pytest.mark.slow  # 600 shipped renderings a family
@pytest.mark.parametrize("family", FAMILIES)
def test_derived_positions_are_the_tokenizers_offsets_on_shipped_conversations(family):
    bundle = load_tokenizer(TOKENIZERS / family)
    texts = [render_text(bundle, messages) for messages in conversations()]
    derived = [assert_same_as_encode(bundle, text) for text in texts]
    assert all(derived)  # every shipped rendering takes the fast way


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.text(st.characters(exclude_categories=["Cs"]), max_size=40),
            st.sampled_from(["<|im_start|>", "<|im_end|>", "<think>", "<｜User｜>", " ", "\n"]),
        ),
        max_size=8,
    ),
    family=st.sampled_from(FAMILIES),
)
def test_derived_positions_hold_on_any_text(pieces, family):
    """Combining marks, emoji split across tokens, non-NFC text (the fallback), control text."""
    text = "".join(pieces)
    derived = assert_same_as_encode(load_tokenizer(TOKENIZERS / family), text)
    if derived and family.startswith("qwen"):  # an NFC normalizer: only NFC text is derived
        assert unicodedata.is_normalized("NFC", text)


PIECES = st.lists(
    st.one_of(
        st.text(st.characters(exclude_categories=["Cs"]), max_size=20),
        st.sampled_from(["<|im_start|>", "<|im_end|>", "<think>", "<｜User｜>", "\n"]),
    ),
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(start=PIECES, first=PIECES, second=PIECES, family=st.sampled_from(FAMILIES))
def test_a_rendering_that_shares_a_start_with_the_last_encodes_only_the_rest(
    start, first, second, family
):
    """The tokens before the last added token two texts share are kept from the last encoding;
    ids and positions are still exactly `encode`'s, whatever follows."""
    bundle = load_tokenizer(TOKENIZERS / family)
    a, b = "".join(start + first), "".join(start + second)
    assert_same_as_encode(bundle, a)
    assert_same_as_encode(bundle, b)
    assert_same_as_encode(bundle, a)  # and back


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dpo_pair_encodes_its_prompt_once(family):
    bundle = load_tokenizer(TOKENIZERS / family)
    pair = orjson.loads((DATA / "dpo_en_300.jsonl").open("rb").readline())
    chosen, rejected = (render_text(bundle, pair[k]) for k in ("chosen", "rejected"))
    last = encode_offsets(bundle, chosen)
    kept = _kept(last, rejected)
    assert kept > 0 and last.ids[kept] in bundle.tokenizer.get_added_tokens_decoder()
    assert chosen[: last.starts[kept]] == rejected[: last.starts[kept]]
    assert assert_same_as_encode(bundle, rejected)


@pytest.mark.slow  # two tokenizers built from Qwen's tokenizer.json
def test_tokenizers_whose_added_tokens_can_overlap_encode_all_of_each_text():
    """`q<a>z` holds `<a>`: where one added token can hold or overlap another, a match depends
    on what follows it (`q<a>y` has `<a>` at 1, `q<a>z` does not), so nothing is kept."""
    qwen = load_tokenizer(TOKENIZERS / "qwen2.5").tokenizer
    assert _cuts_at_added(qwen)
    for extra in (["<a>", "q<a>z"], ["q<a", "<a>z"]):
        tokenizer = tokenizers.Tokenizer.from_str(qwen.to_str())
        tokenizer.add_special_tokens(extra)
        assert not _cuts_at_added(tokenizer)
        bundle = TokenizerBundle(tokenizer, None, None, None, None, None, None, "", "")
        for text in ("x<|im_end|>q<a>y", "x<|im_end|>q<a>z", "x<|im_end|>q<a>y"):
            assert_same_as_encode(bundle, text)


def test_text_the_normalizer_changes_falls_back_to_the_tokenizers_offsets():
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    text = unicodedata.normalize("NFD", "café and naïve résumé")  # NFC joins the accents
    assert not assert_same_as_encode(bundle, text)


@pytest.mark.slow  # five tokenizers built from Qwen's tokenizer.json
def test_tokenizers_it_cannot_derive_for_use_their_offsets():
    """Not byte-level (a word-level model); a normalizer that rewrites text (lower case);
    offsets that leave out characters a token stands for: trimmed (GPT-2-style
    post-processors), a prefix space, added tokens that strip their neighbours (whose bytes
    could make up for a prefix space)."""
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hi": 0, "[UNK]": 1}, "[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    qwen = load_tokenizer(TOKENIZERS / "qwen2.5").tokenizer
    variants = [tokenizers.Tokenizer.from_str(qwen.to_str()) for _ in range(4)]
    lower, trimmed, prefixed, stripping = variants
    lower.normalizer = tokenizers.normalizers.Lowercase()
    trimmed.post_processor = tokenizers.processors.ByteLevel(trim_offsets=True)
    prefixed.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    stripping.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    stripping.add_special_tokens([tokenizers.AddedToken("<|x|>", lstrip=True, special=True)])
    for tokenizer in (words, *variants):
        assert _byte_level(tokenizer) == (None, "")
        bundle = TokenizerBundle(tokenizer, None, None, None, None, None, None, "", "")
        for text in ("hi there HI", "hi <|x|> and  more <|im_end|>"):
            assert not assert_same_as_encode(bundle, text)


def test_with_the_tokenizers_threads_on_its_own_encode_is_used(monkeypatch):
    """A one-text batched encode would start the tokenizer's thread pool, and a DataLoader
    worker forked after that warns: outside a run's workers, `encode` as before."""
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    assert not assert_same_as_encode(bundle, "hi there")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert not assert_same_as_encode(bundle, "hi there")


@pytest.mark.parametrize("before", [None, "true"])
def test_runs_turn_the_tokenizers_threads_off_and_the_last_one_back(monkeypatch, before):
    """Two runs in one process, overlapping: the value before the first comes back only after
    the last (not the first's "false" restored by the second)."""
    if before is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", before)
    first, second = tokenizer_threads_off(), tokenizer_threads_off()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert tokenizer_threads_are_off()
    second.__exit__(None, None, None)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before
