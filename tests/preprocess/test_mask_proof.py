"""Masks that cannot be silently wrong (preprocess/chat/mask_proof.py, spans.py, chat/training_templates.py):
every chat record's spans proven against its own rendering, the field's loss convention, and the
chat template under the config's control. Oracles: transformers' apply_chat_template and its
`{% generation %}` masks (TRL's training templates, read from the installed trl package)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import DATA, ROOT, TOKENIZERS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.preprocess.chat import spans
from tokenmill.preprocess.chat.mask_proof import MaskUnproven
from tokenmill.preprocess.chat.spans import render_conversation
from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.chat.training_templates import FOLDER, TEMPLATES, template_text
from tokenmill.preprocess.config import ConfigError, PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.inputs.fields import check_messages, get_tools
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline

QWEN35_STYLE = (ROOT / "tests" / "data" / "qwen35_style.jinja").read_text()
GLAIVE = json.loads((DATA / "toolcall_glaive_zh_300.json").read_text())


def _trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def oracles():
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    return {
        family: transformers.AutoTokenizer.from_pretrained(str(TOKENIZERS / family))
        for family in ("qwen2.5", "qwen3", "deepseek-v3")
    }


def _glaive(n: int) -> tuple[list[dict], list[dict] | None]:
    record = Record("toolcall_glaive_zh_300.json", n + 1, GLAIVE[n])
    messages = check_messages(record, "conversations", GLAIVE[n]["conversations"], None)
    return messages, get_tools(record, "tools")


def _oracle(oracle, messages, tools, template):
    """transformers' ids and `{% generation %}` mask of one conversation (a null content given
    as "", which TRL's DeepSeek-V3 template reads)."""
    messages = [{**m, "content": m["content"] or ""} for m in messages]
    out = oracle.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=bool)


def _assistant_mask(messages: list[dict]) -> list[bool]:
    return [m["role"] == "assistant" for m in messages]


@pytest.mark.slow  # all 300 glaive records against transformers
def test_a_template_that_renders_by_content_is_exact_on_every_glaive_record(oracles):
    """Qwen3.5's style (last query found by its text, reasoning blocks after it, tool results
    folded): ids and masks of all 300 tool chats equal transformers' rendering and the
    template's own generation blocks, which the span finder does not read."""
    bundle = dataclasses.replace(load_tokenizer(TOKENIZERS / "qwen3"), chat_template=QWEN35_STYLE)
    for n in range(len(GLAIVE)):
        messages, tools = _glaive(n)
        ids, mask = render_conversation(bundle, messages, _assistant_mask(messages), tools=tools)
        want_ids, want_mask = _oracle(oracles["qwen3"], messages, tools, QWEN35_STYLE)
        assert ids.tolist() == want_ids, n
        assert mask.tolist() == want_mask.tolist(), n


# What TRL's training templates train beyond the field's rule (role header masked; content,
# tool calls and end-of-turn trained): Qwen2.5's opens its generation block after
# `<|im_start|>assistant`, before the newline; DeepSeek-V3's trains its `<｜Assistant｜>`
# header and the `<｜tool▁outputs▁end｜>` that opens a turn after tool results.
TRL_EXTRA = {
    "qwen2.5": {"\n"},
    "qwen3": set(),
    "deepseek-v3": {"<｜Assistant｜>", "<｜tool▁outputs▁end｜>"},
}
TRL_TEMPLATE = {
    "qwen2.5": "qwen2_5_training",
    "qwen3": "qwen3_training",
    "deepseek-v3": "deepseekv3_training",
}


@pytest.mark.slow  # 300 glaive records x 3 families against TRL
@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "deepseek-v3"])
def test_glaive_masks_follow_trls_training_templates_on_every_family(family, oracles):
    """The default rule against TRL's own `{% generation %}` masks, record by record: equal
    but for the tokens TRL_EXTRA names. DeepSeek-V3's own template cannot render the file's
    tool arguments (objects), so it renders with the shipped deepseek-v3-tools."""
    data = default_config("sft").model_dump(mode="json")
    data["input"]["sections"][0]["field"] = "conversations"
    data["preprocessing"].update(max_seq_len=100_000, min_chars=0)
    data["chat_template"] = "deepseek-v3-tools" if family == "deepseek-v3" else None
    bundle = load_tokenizer(TOKENIZERS / family)
    masker = RecordMasker(PipelineConfig.from_dict(data), bundle)
    trl_template = _trl_template(TRL_TEMPLATE[family])
    compared = 0
    for n in range(len(GLAIVE)):
        messages, tools = _glaive(n)
        out = masker.process(Record("glaive.json", n + 1, GLAIVE[n]))
        want_ids, want_mask = _oracle(oracles[family], messages, tools, trl_template)
        ids, mask = out["sequence"], out["loss_mask"]
        if ids.tolist() != want_ids:  # TRL's template renders this record otherwise
            continue
        compared += 1
        assert not (mask & ~want_mask).any(), n  # nothing trains that TRL masks
        extra = {bundle.tokenizer.id_to_token(int(t)) for t in ids[want_mask & ~mask]}
        decoded = {bundle.tokenizer.decode([bundle.tokenizer.token_to_id(t)]) for t in extra}
        assert decoded <= TRL_EXTRA[family], (n, decoded)
    # TRL's Qwen3 template adds an empty reasoning block to every assistant turn, where Qwen3's
    # adds it only to the last; TRL's DeepSeek-V3 ignores the tool schemas deepseek-v3-tools
    # renders: most tool chats render otherwise there
    assert compared >= {"qwen2.5": 250, "qwen3": 40, "deepseek-v3": 90}[family]


def _conversations():
    """Chats with tool calls, tool results, reasoning, empty and null contents; each role's
    words come from its own pool, so a trained token's owner can be read off its text."""
    words = {
        role: st.sampled_from([f"{role[:2]}{i}" for i in range(5)])
        for role in ("system", "user", "assistant", "tool", "think")
    }

    def text(role, empty=True):
        return st.lists(words[role], min_size=0 if empty else 1, max_size=4).map(" ".join)

    call = st.builds(
        lambda name, value: {
            "type": "function",
            "function": {"name": f"f{name}", "arguments": {"x": value}},
        },
        st.integers(0, 3),
        text("assistant", empty=False),
    )
    assistant = st.one_of(
        st.builds(lambda c: {"role": "assistant", "content": c}, text("assistant")),
        st.builds(
            lambda c, r: {"role": "assistant", "content": c, "reasoning_content": r},
            text("assistant", empty=False),
            text("think", empty=False),
        ),
        st.builds(
            lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
            st.one_of(st.none(), text("assistant")),
            st.lists(call, min_size=1, max_size=2),
        ),
    )

    @st.composite
    def chat(draw):
        messages = []
        if draw(st.booleans()):
            messages.append({"role": "system", "content": draw(text("system", empty=False))})
        for _ in range(draw(st.integers(1, 3))):
            messages.append({"role": "user", "content": draw(text("user", empty=False))})
            reply = draw(assistant)
            messages.append(reply)
            if reply.get("tool_calls"):
                for _ in reply["tool_calls"]:
                    messages.append({"role": "tool", "content": draw(text("tool", empty=False))})
                if draw(st.booleans()):
                    messages.append(
                        {"role": "assistant", "content": draw(text("assistant", empty=False))}
                    )
        return messages

    return chat()


PROPERTY_TEMPLATES = {
    "qwen2.5": ("qwen2.5", None),
    "qwen3": ("qwen3", None),
    "deepseek-v3": ("deepseek-v3", None),
    "qwen3-keep-reasoning": ("qwen3", "qwen3-keep-reasoning"),
    "deepseek-v3-tools": ("deepseek-v3", "deepseek-v3-tools"),
    "deepseek-r1-keep-reasoning": ("deepseek-v3", "deepseek-r1-keep-reasoning"),
    "qwen3.5-keep-reasoning": ("qwen3", "qwen3.5-keep-reasoning"),
    "qwen3.5-style": ("qwen3", str(ROOT / "tests" / "data" / "qwen35_style.jinja")),
}
REFUSALS = {"mask_unproven", "content_dropped", "template_error"}


@pytest.mark.slow  # 60 generated chats x 7 templates
@pytest.mark.parametrize("name", list(PROPERTY_TEMPLATES))
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(messages=_conversations())
def test_no_trained_token_lies_outside_an_assistant_message(name, messages):
    """Every generated chat is either refused by name (mask_unproven, content_dropped, or the
    template's own error) or trains only assistant text: no word of a system, user or tool
    message trains, and every assistant word the rendering shows trains."""
    family, template = PROPERTY_TEMPLATES[name]
    bundle = load_tokenizer(TOKENIZERS / family)
    masker = RecordMasker(_chat_config(chat_template=template), bundle)
    try:
        out = masker.process({"messages": messages})
    except RecordError as err:
        assert err.reason in REFUSALS, err
        return
    ids, mask = out["sequence"], out["loss_mask"]
    trained = bundle.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False)
    masked = bundle.tokenizer.decode(ids[~mask].tolist(), skip_special_tokens=False)
    for prefix in ("sy", "us", "to"):
        assert not any(f"{prefix}{i}" in trained for i in range(5)), (prefix, trained)
    for message in messages:
        if message["role"] == "assistant":
            for word in (message.get("content") or "").split():
                assert word in trained and word not in masked.replace("<tool_call>", ""), word


@pytest.mark.parametrize("delta", [-6, -1, 1, 6])
def test_a_broken_span_finder_is_caught_by_the_proof(monkeypatch, delta):
    """Mutation check: with every span start moved by `delta` characters (and no second
    reading), each glaive record is refused as mask_unproven or keeps its exact mask: never a
    silently different one."""
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    truth = []
    for n in range(60):
        messages, tools = _glaive(n)
        truth.append(render_conversation(bundle, messages, _assistant_mask(messages), tools=tools))
    found = spans._probed_starts
    monkeypatch.setattr(
        spans, "_probed_starts", lambda *a: [s + delta if s else s for s in found(*a)]
    )
    monkeypatch.setattr(spans, "anchored_starts", lambda *a: None)
    refused = 0
    for n in range(60):
        messages, tools = _glaive(n)
        try:
            _, mask = render_conversation(bundle, messages, _assistant_mask(messages), tools=tools)
        except MaskUnproven:
            refused += 1
            continue
        assert mask.tolist() == truth[n][1].tolist(), n
    assert refused >= 30


def _chat_config(tmp_path: Path | None = None, **changes) -> PipelineConfig:
    data = default_config("sft").model_dump(mode="json")
    data["preprocessing"].update(max_seq_len=100_000, min_chars=0)
    section = {
        k: changes.pop(k)
        for k in list(changes)
        if k in data["input"]["sections"][0] or k in ("train_turns", "message_train_field")
    }
    data["input"]["sections"][0].update(section)
    data.update(changes)
    return PipelineConfig.from_dict(data, base=tmp_path)


REASONING_CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nA sum.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
]


def test_dropped_reasoning_is_counted_by_name_or_stops_the_run(tmp_path):
    """Qwen3's own template drops an earlier turn's reasoning: the run stops naming file, line
    and template; under skip it is counted (content_dropped) and listed; the shipped
    qwen3-keep-reasoning keeps it, trained."""
    src = tmp_path / "chats.jsonl"
    lines = [{"messages": REASONING_CHAT[:2]}, {"messages": REASONING_CHAT}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    qwen3 = TOKENIZERS / "qwen3"
    with pytest.raises(
        RecordError,
        match=r"chats\.jsonl:2: messages: messages\[1\].*its reasoning does not appear.*chat template: the tokenizer's own, qwen3",
    ):
        Pipeline(_chat_config(), [src], tmp_path / "a", qwen3, workers=1, progress=False).run()
    summary = Pipeline(
        _chat_config(), [src], tmp_path / "b", qwen3, workers=1, on_error="skip", progress=False
    ).run()
    assert summary.records_written == 1 and "content_dropped: 1" in summary.format()
    rejects = [json.loads(x) for x in (tmp_path / "b" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(2, "content_dropped")]
    kept = Pipeline(
        _chat_config(chat_template="qwen3-keep-reasoning"),
        [src],
        tmp_path / "c",
        qwen3,
        workers=1,
        progress=False,
    ).run()
    assert kept.records_written == 2
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["chat_template"]["name"] == "qwen3-keep-reasoning"
    masker = RecordMasker(_chat_config(chat_template="qwen3-keep-reasoning"), load_tokenizer(qwen3))
    out = masker.process({"messages": REASONING_CHAT})
    trained = load_tokenizer(qwen3).tokenizer.decode(out["sequence"][out["loss_mask"]].tolist())
    assert "A sum." in trained


def test_a_chat_template_is_a_shipped_name_or_a_file_beside_the_config(tmp_path):
    (tmp_path / "mine.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    )
    config = tmp_path / "config.yaml"
    data = _chat_config().model_dump(mode="json") | {"chat_template": "mine.jinja"}
    config.write_text(json.dumps(data))
    loaded = PipelineConfig.from_file(config)
    assert loaded.chat_template == str((tmp_path / "mine.jinja").resolve())
    masker = RecordMasker(loaded, load_tokenizer(TOKENIZERS / "qwen2.5"))
    out = masker.process({"messages": REASONING_CHAT[2:]})
    decoded = masker.bundle.tokenizer.decode(out["sequence"].tolist())
    assert decoded == "<user>And 3+3?\n<assistant>6\n"
    with pytest.raises(
        ConfigError,
        match=r"chat_template: 'nope' is neither a file nor a shipped template \(one of qwen3-keep-reasoning",
    ):
        _chat_config(chat_template="nope")


def test_last_turn_only_and_per_message_train_flags(oracles):
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "train": False},
        {"role": "user", "content": "Name a colour", "train": True},
        {"role": "assistant", "content": "Blue"},
    ]

    def runs(config):
        out = RecordMasker(config, bundle).process({"messages": chat})
        mask = out["loss_mask"]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
        return [
            bundle.tokenizer.decode(out["sequence"][a:b].tolist(), skip_special_tokens=False)
            for a, b in edges.reshape(-1, 2)
        ]

    assert runs(_chat_config()) == [
        "<|im_start|>user\nName a colour<|im_end|>\n",
        "Blue<|im_end|>\n",
    ]
    assert runs(_chat_config(train_turns="last")) == ["Blue<|im_end|>\n"]
    plain = [{k: v for k, v in m.items() if k != "train"} for m in chat]
    chat[:] = plain
    assert runs(_chat_config(message_train_field=None)) == ["Hello<|im_end|>\n", "Blue<|im_end|>\n"]
    assert runs(_chat_config(train_spans="roles", train_turns="last")) == [
        "<|im_start|>assistant\nBlue<|im_end|>\n"
    ]
    chat[1] = {**chat[1], "train": "yes"}
    with pytest.raises(RecordError, match=r"messages\[1\]\.train: expected true or false"):
        RecordMasker(_chat_config(), bundle).process({"messages": chat})


# conversations each shipped template and the template it replaces render alike: no reasoning
# before the last query, tool arguments as strings where the original needs them
SHARED_CHATS = [
    json.loads(line)["messages"]
    for line in (DATA / "chat_sharegpt_1000.jsonl").read_text().splitlines()[:30]
] + [REASONING_CHAT[2:], [{"role": "system", "content": "Be brief."}, *REASONING_CHAT[:2]]]
REPLACED = {
    "qwen3-keep-reasoning": ("qwen3", None),
    "qwen3.5-keep-reasoning": ("qwen3", "qwen3_5_think"),
    "deepseek-r1-keep-reasoning": ("deepseek-v3", "deepseek_r1_distill"),
    "deepseek-v3-tools": ("deepseek-v3", None),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_shipped_template_renders_as_the_one_it_replaces(name, oracles):
    family, original = REPLACED[name]
    original_text = _trl_template(original) if original else None
    ours = template_text(name)
    chats = [c for c in SHARED_CHATS if "deepseek-r1" not in name or "</think>" not in str(c)]
    if name.startswith("qwen"):  # tool chats too: Qwen's tool formats take argument objects
        chats += [_glaive(n)[0] for n in range(20)]
    for chat in chats:
        for prompt in (False, True):
            kwargs = {"tokenize": False, "add_generation_prompt": prompt}
            want = oracles[family].apply_chat_template(chat, chat_template=original_text, **kwargs)
            assert oracles[family].apply_chat_template(chat, chat_template=ours, **kwargs) == want
    assert (FOLDER / "README.md").read_text().count(f"`{name}`") == 1


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "w",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _call(city, as_text=False):
    arguments = json.dumps({"city": city}) if as_text else {"city": city}
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def _runs(bundle, ids, mask) -> list[str]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [
        bundle.tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        for a, b in edges.reshape(-1, 2)
    ]


def test_tool_rounds_close_their_turns_on_deepseek():
    """Each tool-calling turn trains its `<｜end▁of▁sentence｜>`, the second round too."""
    bundle = load_tokenizer(TOKENIZERS / "deepseek-v3")
    chat = []
    for city, answer in (("Paris", "Sunny."), ("Rome", "Rainy.")):
        chat += [
            {"role": "user", "content": f"{city}?"},
            {"role": "assistant", "content": None, "tool_calls": [_call(city)]},
            {"role": "tool", "content": f"{answer} there"},
            {"role": "assistant", "content": answer},
        ]
    masker = RecordMasker(_chat_config(chat_template="deepseek-v3-tools"), bundle)
    out = masker.process({"messages": chat, "tools": WEATHER})
    runs = _runs(bundle, out["sequence"], out["loss_mask"])
    assert len(runs) == 4 and all(r.endswith("<｜end▁of▁sentence｜>") for r in runs), runs


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_parallel_calls_with_text_arguments_and_words_of_the_tools_block(family):
    """Two calls (JSON text with \\u escapes, as json.dumps writes it; the same arguments
    twice), two results, and a user who writes a word of the tools block ("hi" is in
    "within"): proven, calls trained, results masked."""
    bundle = load_tokenizer(TOKENIZERS / family)
    chat = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("北京", as_text=True), _call("北京", as_text=True)],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "sunny too"},
        {"role": "assistant", "content": "Both sunny."},
    ]
    out = RecordMasker(_chat_config(), bundle).process({"messages": chat, "tools": WEATHER})
    trained = "".join(_runs(bundle, out["sequence"], out["loss_mask"]))
    assert trained.count("get_weather") == 2 and "Both sunny." in trained
    assert "sunny\n" not in trained and "<tool_response>" not in trained and "user" not in trained


def test_a_user_turn_that_reads_like_the_tools_block_never_trains():
    """Words of the tools block and of role headers as contents (found by fuzzing): the
    record is refused by name or no user or tool text trains."""
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    chat = [
        {"role": "user", "content": "get_weather"},
        {"role": "assistant", "content": "user", "tool_calls": [_call("", True), _call("", True)]},
        {"role": "tool", "content": "hihello world"},
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "ex"},
        {"role": "assistant", "content": None, "tool_calls": [_call("")]},
        {"role": "tool", "content": "tassistant"},
        {"role": "tool", "content": "<tool_call>"},
        {"role": "assistant", "content": ""},
    ]
    try:
        out = RecordMasker(_chat_config(), bundle).process({"messages": chat, "tools": WEATHER})
    except RecordError as err:
        assert err.reason == "mask_unproven"
        return
    trained = "".join(_runs(bundle, out["sequence"], out["loss_mask"]))
    assert (
        "<|im_start|>" not in trained and "hihello" not in trained and "tassistant" not in trained
    )


def test_last_turn_only_survives_truncation_and_keeps_its_tool_calls():
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    chat = [
        {"role": "user", "content": "long " * 40},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "second answer"},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "third answer"},
    ]
    data = _chat_config(train_turns="last").model_dump(mode="json")
    data["preprocessing"]["max_seq_len"] = 60
    out = RecordMasker(PipelineConfig.from_dict(data), bundle).process({"messages": chat})
    assert _runs(bundle, out["sequence"], out["loss_mask"]) == ["third answer<|im_end|>\n"]
    # a KTO completion in TRL's shape: a call, its result and the answer are the last turn
    kto = RecordMasker(default_config("kto"), bundle)
    completion = [
        {"role": "assistant", "content": None, "tool_calls": [_call("Rome")]},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Rain."},
    ]
    out = kto.process(
        {"prompt": chat[4:5], "completion": completion, "label": True, "tools": WEATHER}
    )
    trained = "".join(_runs(bundle, out["completion"], out["completion_mask"]))
    assert "get_weather" in trained and "Rain." in trained and "rain\n" not in trained


def test_a_cut_prompt_keeps_the_reply_header_when_the_reply_opens_with_line_breaks():
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    chat = [
        {"role": "user", "content": "word " * 30},
        {"role": "assistant", "content": "\n\nAnswer here."},
    ]
    data = _chat_config().model_dump(mode="json")
    data["preprocessing"].update(max_seq_len=40, truncation_mode="cut_prompt")
    out = RecordMasker(PipelineConfig.from_dict(data), bundle).process({"messages": chat})
    text = bundle.tokenizer.decode(out["sequence"].tolist(), skip_special_tokens=False)
    assert len(out["sequence"]) == 40 and text.endswith(
        "<|im_start|>assistant\n\n\nAnswer here.<|im_end|>\n"
    )
