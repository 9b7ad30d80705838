"""Chat templates (preprocess/chat/tokenizer.py, chat/template.py, spans.py): real tokenizers, checked against transformers' apply_chat_template."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil

import jinja2
import numpy as np
import pytest
from helpers import ROOT

from tokenmill.preprocess.chat.mask_proof import ContentDropped
from tokenmill.preprocess.chat.spans import render_conversation
from tokenmill.preprocess.chat.template import Renderer, render_text
from tokenmill.preprocess.chat.tokenizer import encode_text, load_tokenizer

DATA = ROOT / "data"
FAMILIES = ["qwen2.5", "deepseek-v3", "qwen3"]
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _sharegpt(n: int) -> list[list[dict]]:
    with open(DATA / "chat_sharegpt_1000.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in itertools.islice(f, n)]


EXTRA = [
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Arr, hello!"},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nA simple sum.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAgain simple.\n</think>\n\n6"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "<think>Pick one.</think>Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Red."},
    ],
    [  # contents hidden in template words: <|im_end|>, user, assistant, <think>
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "user"},
        {"role": "assistant", "content": "hi"},
    ],
    [  # DeepSeek joins system prompts with "\n\n": only the second is followed by a
        # control token, so preferring that would leave the second unplaced
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ],
    [  # the same text in two turns: the search must move forward
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "ok"},
    ],
]
# The first 40 real chats, and chat 174 (a user writes "e", twice).
CONVERSATIONS = [*_sharegpt(40), _sharegpt(175)[174], *EXTRA]


@pytest.fixture(scope="module")
def bundles():
    return {family: load_tokenizer(DATA / "tokenizers" / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def oracles():
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    return {
        family: transformers.AutoTokenizer.from_pretrained(str(DATA / "tokenizers" / family))
        for family in FAMILIES
    }


def _oracle_ids(oracle, messages, add_generation_prompt=False) -> list[int]:
    out = oracle.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _trained_runs(bundle, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decoded text of each maximal run of trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [
        bundle.tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        for a, b in edges.reshape(-1, 2)
    ]


HEADER = {
    "qwen2.5": "<|im_start|>assistant\n",
    "qwen3": "<|im_start|>assistant\n",
    "deepseek-v3": "<｜Assistant｜>",
}


def _expected_turn(family: str, messages: list[dict], k: int, header: bool = False) -> str:
    """The text assistant message k must train on: its visible content and end-of-turn, after
    its role header where `header` (the older `roles` rule)."""
    head = HEADER[family] if header else ""
    content = messages[k]["content"]
    if family == "deepseek-v3":
        return f"{head}{content}{DS_EOS}"
    if family == "qwen2.5" or "</think>" not in content:
        if family == "qwen3" and k == len(messages) - 1:
            return f"{head}<think>\n\n</think>\n\n{content}<|im_end|>\n"
        return f"{head}{content}<|im_end|>\n"
    answer = content.split("</think>")[-1].lstrip("\n")
    reasoning = content.split("</think>")[0].split("<think>")[-1].strip("\n")
    return f"{head}<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>\n"


def _drops_reasoning(family: str, messages: list[dict]) -> bool:
    """Whether the family's own template leaves out an assistant turn's reasoning: Qwen3 does
    up to the last user turn."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return family == "qwen3" and any(
        "</think>" in m["content"] and k < last_user
        for k, m in enumerate(messages)
        if m["role"] == "assistant"
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("train_spans", ["turn", "roles"])
def test_ids_match_transformers_and_mask_trains_exactly_the_assistant_turns(
    family, train_spans, bundles, oracles
):
    """The turn past its header trains (`turn`), or the whole span (`roles`); a template that
    leaves out reasoning makes the record a ContentDropped, never a silently shorter row."""
    bundle = bundles[family]
    for n, messages in enumerate(CONVERSATIONS):
        actions = [m["role"] == "assistant" for m in messages]
        if _drops_reasoning(family, messages):
            with pytest.raises(ContentDropped, match=r"its reasoning does not appear"):
                render_conversation(bundle, messages, actions, train_spans=train_spans)
            continue
        ids, mask = render_conversation(bundle, messages, actions, train_spans=train_spans)
        assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
        assert ids.tolist() == _oracle_ids(oracles[family], messages), f"conversation {n}"

        header = train_spans == "roles"
        expected = [_expected_turn(family, messages, k, header) for k, a in enumerate(actions) if a]
        assert _trained_runs(bundle, ids, mask) == expected, f"conversation {n}"
        text = bundle.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        if family == "deepseek-v3":
            assert ids[0] == bundle.bos_id == 0 and not mask[0]
            assert int((ids == bundle.bos_id).sum()) == 1
        if family == "qwen2.5" and messages[0]["role"] != "system":
            assert text.count(QWEN_SYSTEM) == 1
            assert not any(QWEN_SYSTEM in run for run in expected)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_text_matches_transformers(family, add_generation_prompt, bundles, oracles):
    with_reasoning_field = [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because.", "reasoning_content": "Think first."},
        {"role": "user", "content": "Sure?"},
    ]
    for messages in [*CONVERSATIONS[:5], *EXTRA, with_reasoning_field]:
        for prompt in (messages, messages[:-1] if len(messages) > 1 else messages):
            expected = oracles[family].apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert render_text(bundles[family], prompt, add_generation_prompt) == expected


GOLDEN_MESSAGES = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
GOLDEN = {
    # system prompt (20 tokens) + "\n" | user "Hi!" | assistant "Hello." | user "2+2?" | assistant "4"
    "qwen2.5": (
        [
            151644,
            8948,
            198,
            2610,
            525,
            1207,
            16948,
            11,
            3465,
            553,
            54364,
            14817,
            13,
            1446,
            525,
            264,
            10950,
            17847,
            13,
            151645,
            198,
            151644,
            872,
            198,
            13048,
            0,
            151645,
            198,
            151644,
            77091,
            198,
            9707,
            13,
            151645,
            198,
            151644,
            872,
            198,
            17,
            10,
            17,
            30,
            151645,
            198,
            151644,
            77091,
            198,
            19,
            151645,
            198,
        ],
        "00000000000000000000000000001111111000000000111111",
    ),
    # BOS <User> "Hi!" | <Assistant> "Hello." <eos> | <User> "2+2?" | <Assistant> "4" <eos>
    "deepseek-v3": (
        [0, 128803, 23166, 3, 128804, 19923, 16, 1, 128803, 20, 13, 20, 33, 128804, 22, 1],
        "0000111100000111",
    ),
    # no system prompt; the last assistant turn gets an empty <think> block
    "qwen3": (
        [
            151644,
            872,
            198,
            13048,
            0,
            151645,
            198,
            151644,
            77091,
            198,
            9707,
            13,
            151645,
            198,
            151644,
            872,
            198,
            17,
            10,
            17,
            30,
            151645,
            198,
            151644,
            77091,
            198,
            151667,
            271,
            151668,
            271,
            19,
            151645,
            198,
        ],
        "000000011111110000000001111111111",
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_ids_and_mask(family, bundles):
    """The older rule, pinned: the whole span of a trained message trains, header included."""
    actions = [False, True, False, True]
    ids, mask = render_conversation(bundles[family], GOLDEN_MESSAGES, actions, train_spans="roles")
    expected_ids, expected_mask = GOLDEN[family]
    assert ids.tolist() == expected_ids
    assert "".join("1" if m else "0" for m in mask) == expected_mask


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_prompt_is_never_trained(family, bundles, oracles):
    messages = GOLDEN_MESSAGES[:3]
    ids, mask = render_conversation(bundles[family], messages, [True] * 3, True)
    assert ids.tolist() == _oracle_ids(oracles[family], messages, add_generation_prompt=True)
    # the prompt is <｜Assistant｜> (DeepSeek) or <|im_start|> assistant \n (Qwen)
    prompt = {"deepseek-v3": 1, "qwen2.5": 3, "qwen3": 3}[family]
    assert not mask[-prompt:].any()
    assert mask[-prompt - 1]  # the user turn before it trains, as asked
    # neither DeepSeek's BOS nor Qwen2.5's injected default system prompt trains; Qwen3 has no preamble
    assert mask[0] == (family == "qwen3")


def test_empty_content_gets_its_own_header_and_end_of_turn(bundles, oracles):
    messages = [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Now say hi."},
        {"role": "assistant", "content": "hi"},
    ]
    for family, turn in [("qwen2.5", "{}<|im_end|>\n"), ("deepseek-v3", "{}" + DS_EOS)]:
        ids, mask = render_conversation(bundles[family], messages, [False, True, False, True])
        assert ids.tolist() == _oracle_ids(oracles[family], messages)
        assert _trained_runs(bundles[family], ids, mask) == [turn.format(""), turn.format("hi")]


def test_encode_text_adds_exactly_one_bos(bundles):
    deepseek, qwen = bundles["deepseek-v3"], bundles["qwen2.5"]
    plain = encode_text(deepseek, "Hello world", add_special_tokens=False)
    assert plain.dtype == np.int32 and plain[0] != 0
    assert encode_text(deepseek, "Hello world", True).tolist() == [0, *plain.tolist()]
    assert encode_text(deepseek, DS_BOS + "Hello world", True).tolist() == [0, *plain.tolist()]
    assert encode_text(deepseek, "", True).tolist() == [0]
    assert encode_text(qwen, "Hello world", True).tolist() == [9707, 1879]
    assert encode_text(qwen, "Hello world", False).tolist() == [9707, 1879]


def test_bundle_reads_added_token_dicts_and_null_bos(bundles):
    deepseek, qwen = bundles["deepseek-v3"], bundles["qwen2.5"]
    assert (deepseek.bos_token, deepseek.bos_id, deepseek.eos_id, deepseek.pad_id) == (
        DS_BOS,
        0,
        1,
        1,
    )
    assert (qwen.bos_token, qwen.bos_id, qwen.eos_token, qwen.eos_id, qwen.pad_id) == (
        None,
        None,
        "<|im_end|>",
        151645,
        151643,
    )
    assert len(qwen.fingerprint) == 64 and qwen.fingerprint != bundles["qwen3"].fingerprint
    assert load_tokenizer(str(DATA / "tokenizers" / "qwen2.5")) is qwen  # cached


def test_template_sources_in_a_folder(tmp_path, bundles):
    shutil.copy(DATA / "tokenizers" / "qwen2.5" / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    listed = load_tokenizer(tmp_path)
    assert render_text(listed, [{"role": "user", "content": "a"}]) == "[a]"
    assert listed.fingerprint != bundles["qwen2.5"].fingerprint

    (tmp_path / "chat_template.jinja").write_text("<{{ messages[0].content }}>")
    jinja_dir = tmp_path / "copy"
    shutil.copytree(tmp_path, jinja_dir)
    assert render_text(load_tokenizer(jinja_dir), [{"role": "user", "content": "a"}]) == "<a>"


def test_errors_name_the_file_or_the_message(tmp_path, bundles):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    shutil.copy(DATA / "tokenizers" / "qwen2.5" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<\|nope\|>'"):
        load_tokenizer(tmp_path)

    shouting = dataclasses.replace(
        bundles["qwen2.5"],
        chat_template="{% for m in messages %}{{ m.content | upper }}{% endfor %}",
    )
    messages = [{"role": "user", "content": "HI"}, {"role": "assistant", "content": "yes"}]
    with pytest.raises(
        ContentDropped, match=r"messages\[1\] \(role 'assistant'\): its content does"
    ):
        render_conversation(shouting, messages, [False, True])
    with pytest.raises(ValueError, match="2 values for 1 messages"):
        render_conversation(bundles["qwen2.5"], messages[:1], [False, True])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__name__ }}",
        "{% set x = messages.append(1) %}",
        "{% set ns = namespace(__init__=1) %}",
        "{{ messages[0].__class__.__mro__ }}",
        "{% set x = messages[0].update({'role': 1}) %}",
    ],
)
def test_sandbox_refuses_unsafe_templates(template, bundles):
    hostile = dataclasses.replace(bundles["qwen2.5"], chat_template=template)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_text(hostile, [{"role": "user", "content": "hi"}])


def test_message_attributes_read_as_in_jinjas_own_sandbox(bundles):
    """`m.role` is the item, `m.items()` the dict's method, a missing key undefined: as in the
    stock sandbox, which the faster lookup for plain dicts must not change."""
    template = (
        "{% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %}"
        "{{ messages[0].role }}|{{ messages[0].missing }}|{{ messages[0].missing is defined }}|"
        "{{ messages[0].get('content') }}|{{ messages[0]['role'] }}|{{ messages[0].keys() | list }}"
    )
    messages = [{"role": "user", "content": "hi", "items": "shadowed"}]
    stock = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(template)
    ours = dataclasses.replace(bundles["qwen2.5"], chat_template=template)
    assert render_text(ours, messages) == stock.render(messages=messages)


def test_template_helpers(bundles):
    template = (
        "{{ messages[0].content | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}{% endfor %}"
        "{% if messages | length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
    )
    helpers = dataclasses.replace(bundles["qwen2.5"], chat_template=template)
    assert render_text(helpers, [{"role": "user", "content": {"é": [1]}}]) == (
        '{\n  "é": [\n    1\n  ]\n}|4|user'
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="only one message"):
        render_text(helpers, [{"role": "user", "content": "a"}] * 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_preamble_before_the_first_header_never_trains(family, bundles, oracles):
    """A chat opening with a trained role keeps the template's preamble (default system prompt) masked."""
    messages = [
        {"role": "assistant", "content": "Hello there, how can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "No."},
    ]
    ids, mask = render_conversation(bundles[family], messages, [True, False, True])
    assert ids.tolist() == _oracle_ids(oracles[family], messages)
    runs = _trained_runs(bundles[family], ids, mask)
    assert len(runs) == 2 and "You are Qwen" not in "".join(runs)
    assert runs[0].endswith(
        "Hello there, how can I help?" + ("<|im_end|>\n" if "qwen" in family else DS_EOS)
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "content", ["assistant.", "You are a helpful assistant.", "user", "<think>"]
)
def test_content_that_looks_like_template_text_is_placed_exactly(family, content, bundles, oracles):
    """A user turn whose text also occurs in the default system prompt or a header stays masked."""
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "Sure"}]
    ids, mask = render_conversation(bundles[family], messages, [False, True])
    assert ids.tolist() == _oracle_ids(oracles[family], messages)
    end = "<|im_end|>\n" if "qwen" in family else DS_EOS
    head = "<think>\n\n</think>\n\n" if family == "qwen3" else ""
    assert _trained_runs(bundles[family], ids, mask) == [head + "Sure" + end]


@pytest.mark.parametrize("family", ["qwen2.5", "deepseek-v3"])
def test_default_preamble_stays_masked_when_the_first_role_trains_once(family, bundles, oracles):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = render_conversation(bundles[family], messages, [True, True])
    runs = _trained_runs(bundles[family], ids, mask)
    assert "You are Qwen" not in "".join(runs) and not mask[0]
    assert "".join(runs).startswith(
        "<|im_start|>user\nHi" if family == "qwen2.5" else "<｜User｜>Hi"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_assistant_end_of_turn_trains_when_the_chat_ends_with_a_user_turn(family, bundles, oracles):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    ids, mask = render_conversation(bundles[family], messages, [False, True, False])
    assert ids.tolist() == _oracle_ids(oracles[family], messages)
    expected = "Hello" + DS_EOS if family == "deepseek-v3" else "Hello<|im_end|>\n"
    assert _trained_runs(bundles[family], ids, mask) == [expected]


def test_kept_probe_renderings_follow_their_context(bundles):
    """Renderer.probe keeps marker renderings per process: one per message shape, tool schemas
    and keyword arguments, never shared by values a template renders differently (0 is not
    False to Qwen3's `enable_thinking is false`)."""
    bundle = bundles["qwen3"]
    marks = [{"role": "user", "content": "\ue0000\ue001"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kwargs in [{}, {"enable_thinking": False}, {"enable_thinking": 0}]:
        for schemas in [None, tools]:
            for _ in range(2):  # rendered, then kept
                probe = Renderer(bundle, schemas, kwargs).probe(marks, True)
                assert probe == render_text(bundle, marks, True, schemas, **kwargs)


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "deepseek-v3"])
def test_what_is_kept_per_message_shape_follows_the_generation_prompt_and_the_actions(
    family, bundles
):
    """The glue, role tails and first header read from marker renderings are kept per message
    shape: one conversation with and without a generation prompt, and with other roles
    trained, in any order, gets the ids and mask it gets from nothing kept."""
    from tokenmill.preprocess.chat import template as chat_template

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    settings = [
        (prompt, actions)
        for prompt in (False, True)
        for actions in ((False, False, True, False), (False, True, True, True))
    ]
    fresh = {}
    for setting in settings:
        chat_template._PROBES.clear()
        fresh[setting] = render_conversation(bundles[family], messages, [*setting[1]], setting[0])
    chat_template._PROBES.clear()
    for setting in settings + settings[::-1]:
        ids, mask = render_conversation(bundles[family], messages, [*setting[1]], setting[0])
        assert ids.tolist() == fresh[setting][0].tolist()
        assert mask.tolist() == fresh[setting][1].tolist(), setting


HOSTILE = (
    "{% if messages[0].content == 'spin' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[0].content == 'huge' %}{{ 'a' * 10**10 }}"
    "{% elif messages[0].content == 'power' %}{{ 7 ** 1000000000000 }}"
    "{% elif messages[0].content == 'wide' %}{% for i in range(10**9) %}{% endfor %}"
    "{% elif messages[0].content == 'deep' %}"
    "{% macro down(n) %}{{ down(n + 1) }}{% endmacro %}{{ down(0) }}"
    "{% else %}"
)


@pytest.mark.slow  # waits out render time limits
@pytest.mark.parametrize("workers", [1, 2])
def test_templates_that_loop_or_allocate_without_bound_are_counted_bad_records(
    tmp_path, monkeypatch, workers
):
    """Each hostile record is a named template_error the run skips and counts; the good
    records around them are written as usual. On two threads, a record a chunk (batch_size
    1), two renderings are watched at once: each is stopped, in its own thread."""
    from tokenmill.preprocess.chat import template as chat_template
    from tokenmill.preprocess.config import PipelineConfig
    from tokenmill.preprocess.presets import default_config
    from tokenmill.preprocess.run.pipeline import Pipeline

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    folder = tmp_path / "hostile"
    shutil.copytree(ROOT / "data" / "tokenizers" / "qwen2.5", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = HOSTILE + config["chat_template"] + "{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    kinds = ["spin", "huge", "power", "wide", "deep"]
    records = [
        {"messages": [{"role": "user", "content": c}, {"role": "assistant", "content": "ok"}]}
        for c in ["hello there", *kinds, "goodbye now"]
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = default_config("sft").model_dump(mode="json")
    data["preprocessing"].update(min_chars=0, batch_size=1)
    summary = Pipeline(
        PipelineConfig.from_dict(data),
        [src],
        tmp_path / "out",
        folder,
        workers=workers,
        on_error="skip",
        progress=False,
    ).run()
    assert summary.records_written == 2
    assert summary.skipped == {"template_error": len(kinds)}
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").open()]
    assert [r["line"] for r in rejects] == [2, 3, 4, 5, 6]
    said = " ".join(r["message"] for r in rejects)
    for reason in ("longer than 0.5 s", "over the budget", "Range too big", "recursion"):
        assert reason in said, (reason, said)
