"""What the model sees of every training type: the collator a loader picks when given none,
packed DPO, KTO and GRPO batches scored against padded ones, and packing that resumes with
each document once.

The data is the shipped data, preprocessed with each type's default config: DPO pairs, GRPO
groups, chats and web text as shipped; KTO items made of the DPO pairs (each chosen reply
desirable, each rejected one not), as no KTO data ships but examples/kto's three records.
The oracle of a packed batch is the padded batch of the same items: a tiny random Llama (sdpa
and eager) must give each sequence the same log-probability (the sum of log p of its masked
tokens, what DPO, KTO and GRPO losses take) from both.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import DATA, QWEN, ROOT
from resume import check_resume, same
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill.dataflow import (
    DataflowLoader,
    DefaultBatchCollator,
    DPOPaddingCollator,
    GRPOPaddingCollator,
    IterableDistributor,
    KTOPaddingCollator,
    MapDistributor,
    MixtureDistributor,
    PackedCollator,
    PackedDPOCollator,
    PackedGRPOCollator,
    PackedKTOCollator,
    PoolPackingBatcher,
    SequentialPackingBatcher,
    SFTPaddingCollator,
    SimpleBatcher,
)
from tokenmill.dataflow.packed_preferences import packed_tokens
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.training.dataset_factory import DatasetFactory

RECORDS = 24
SHIPPED = {
    "seq": "pretrain_c4_300.jsonl",
    "sft": "chat_sharegpt_1000.jsonl",
    "dpo": "dpo_en_300.jsonl",
    "grpo": "grpo_from_dpo_300.jsonl",
}


def records(train_type: str) -> list[dict]:
    """The first shipped records of a type; KTO's made of the DPO pairs; GRPO prompts alone
    (for online generation) from examples/grpo_prompts."""
    if train_type == "grpo_prompts":
        lines = (ROOT / "examples" / "grpo_prompts" / "records.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]
    name = SHIPPED["dpo" if train_type == "kto" else train_type]
    with open(DATA / name, encoding="utf-8") as f:
        found = [json.loads(next(f)) for _ in range(RECORDS)]
    if train_type != "kto":
        return found
    return [
        {
            "prompt": r["prompt"],
            "completion": r[side][len(r["prompt"]) :],
            "label": side == "chosen",
        }
        for r in found
        for side in ("chosen", "rejected")
    ]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each type's records preprocessed with its default config."""
    out = {}
    for name in ("seq", "sft", "dpo", "kto", "grpo", "grpo_prompts"):
        root = tmp_path_factory.mktemp(name)
        raw = root / "records.jsonl"
        raw.write_text("".join(json.dumps(r) + "\n" for r in records(name)))
        out[name] = root / "bin"
        Pipeline(
            default_config(name.removesuffix("_prompts")),
            [raw],
            output_dir=out[name],
            tokenizer_path=QWEN,
            workers=1,
            overwrite=True,
            progress=False,
        ).run()
    return out


def dataset(shards: dict[str, Path], name: str, sample: str | None = None) -> Any:
    window = 64 if name == "seq" or sample == "window" else 2048
    train_type = name.removesuffix("_prompts")
    return DatasetFactory.load(train_type, shards[name], window_size=window, sample=sample)


# --- the default loader call fits every type --------------------------------------------------

FITTING = [
    ("seq", None, DefaultBatchCollator),
    ("sft", "window", DefaultBatchCollator),
    ("sft", "row", SFTPaddingCollator),
    ("sft", "record", SFTPaddingCollator),
    ("dpo", None, DPOPaddingCollator),
    ("kto", None, KTOPaddingCollator),
    ("grpo", None, GRPOPaddingCollator),
    ("grpo_prompts", None, GRPOPaddingCollator),
]


@pytest.mark.parametrize("train_type, sample, fits", FITTING, ids=lambda v: str(v))
def test_the_default_loader_call_picks_the_collator_that_fits(shards, train_type, sample, fits):
    data = dataset(shards, train_type, sample)
    default = DataflowLoader(MapDistributor(data, seed=1, num_epochs=1), batch_size=5)
    assert type(default.collator) is fits
    explicit = DataflowLoader(
        MapDistributor(data, seed=1, num_epochs=1), batcher=SimpleBatcher(5), collator=fits()
    )
    batches = list(default)
    assert len(batches) == -(-len(data) // 5)  # every item, in groups of five
    assert same(batches, list(explicit))


def test_prompts_alone_are_left_padded(shards):
    data = dataset(shards, "grpo_prompts")
    distributor = MapDistributor(data, shuffle=False, num_epochs=1)
    (batch,) = list(DataflowLoader(distributor, batch_size=len(data)))
    assert sorted(batch) == ["prompt_attention_mask", "prompts"]
    lengths = [len(data[i]["prompts"]) for i in range(len(data))]
    assert batch["prompt_attention_mask"].sum(1).tolist() == lengths
    for i in range(len(data)):
        assert torch.equal(batch["prompts"][i, -lengths[i] :], data[i]["prompts"])


def test_a_distributor_that_changes_its_items_or_a_stray_type_gets_no_guess(shards):
    class Doubled(MapDistributor):
        def fetch(self, index: int) -> Any:
            item = super().fetch(index)
            return {**item, "input_ids": item["input_ids"].repeat(2)}

    data = dataset(shards, "sft", "record")
    assert type(DataflowLoader(Doubled(data), batch_size=2).collator) is DefaultBatchCollator

    class Stray(list):
        train_type = "pretrain"

    with pytest.raises(TypeError, match=r"Stray.train_type is 'pretrain'; it must be one of"):
        DataflowLoader(MapDistributor(Stray([{"input_ids": torch.ones(2)}])), batch_size=2)


@pytest.mark.parametrize("collator", [SFTPaddingCollator, PackedCollator])
def test_batch_size_with_a_collator_is_simple_batches_of_that_collator(shards, collator):
    data = dataset(shards, "sft", "record")
    given = DataflowLoader(
        MapDistributor(data, seed=1, num_epochs=1), batch_size=4, collator=collator()
    )
    assert isinstance(given.batcher, SimpleBatcher) and given.batcher.group_size == 4
    assert type(given.collator) is collator
    explicit = DataflowLoader(
        MapDistributor(data, seed=1, num_epochs=1), batcher=SimpleBatcher(4), collator=collator()
    )
    assert same(list(given), list(explicit))
    with pytest.raises(ValueError, match="batch_size=N stands for SimpleBatcher"):
        DataflowLoader(MapDistributor(data), batch_size=4, batcher=SimpleBatcher(4))


@pytest.mark.parametrize(
    "train_type, argument",
    [("sft", "SFTPaddingCollator"), ("kto", "KTOPaddingCollator"), ("grpo", "GRPOPaddingCollator")],
)
def test_items_that_say_nothing_are_stacked_or_refused_naming_the_argument(
    shards, train_type, argument
):
    """A plain list of items declares no type: the loader stacks them, and items of other
    lengths are refused naming the one argument to add."""
    data = dataset(shards, train_type, "record" if train_type == "sft" else None)
    items = [data[i] for i in range(len(data))]
    loader = DataflowLoader(IterableDistributor(items), batch_size=4)
    assert type(loader.collator) is DefaultBatchCollator
    with pytest.raises(
        ValueError, match=rf"stacking needs equal shapes: pass collator={argument}\(\)"
    ):
        list(loader)


def test_sources_of_different_types_are_refused_by_name(shards):
    mixed = MixtureDistributor(
        [MapDistributor(dataset(shards, "dpo")), MapDistributor(dataset(shards, "kto"))], [1, 1]
    )
    with pytest.raises(ValueError, match=r"items of types \['dpo', 'kto'\].*give collator="):
        DataflowLoader(mixed, batch_size=4)
    same_type = MixtureDistributor(
        [
            MapDistributor(dataset(shards, "sft", "row")),
            MapDistributor(dataset(shards, "sft", "record")),
        ],
        [1, 1],
    )
    assert type(DataflowLoader(same_type, batch_size=4).collator) is SFTPaddingCollator


# --- packed preference batches score as padded ones -------------------------------------------


def smallest(data: Any, count: int) -> list[dict]:
    """The `count` shortest items: a batch small enough for the eager attention of a test."""
    return [data[i] for i in sorted(range(len(data)), key=data.sample_length)[:count]]


def tiny_llama(vocab: int, implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        attn_implementation=implementation,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def vocabulary(*tensors: torch.Tensor) -> torch.Tensor:
    """The ids of the batches (with the pad id 0): the model's vocabulary is theirs, each id
    renamed to its rank (one to one), so that logits stay small."""
    return torch.unique(torch.cat([t.reshape(-1) for t in tensors] + [torch.zeros(1).long()]))


def padded_logps(model: Any, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor):
    """Per row, the sum of log p(token | the tokens before it) over `mask`, from a padded batch
    run as TRL runs it (attention mask, no position ids)."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention.long(), use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (logp * mask[:, 1:]).sum(-1)


def flush_left(*rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row's real tokens moved to its start (TRL's `flush_left`): left padding leaves a
    padding token nothing to attend to, which eager attention turns into NaN in float64."""
    order = torch.sort((~rows[1].bool()).int(), dim=1, stable=True).indices
    return tuple(row.gather(1, order) for row in rows)


def packed_logps(model: Any, batch: dict, vocab: torch.Tensor, positions: bool = True):
    """Per sequence of a packed row, the sum of log p(target) over its loss mask; without
    `positions`, as one sequence (the mistake packing must not make)."""
    inputs, targets = (torch.searchsorted(vocab, batch[k]) for k in ("input_ids", "target_ids"))
    given = {"position_ids": batch["position_ids"]} if positions else {}
    with torch.no_grad():
        logits = model(input_ids=inputs, use_cache=False, **given).logits
    logp = torch.log_softmax(logits[0], -1).gather(-1, targets[0, :, None])[:, 0]
    logp = logp * batch["loss_mask"][0]
    bounds = batch["cu_seqlens"].tolist()
    return torch.stack([logp[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


IMPLEMENTATIONS = ["sdpa", "eager"]


@pytest.mark.slow  # a tiny Llama per pair; KTO keeps the packed-vs-padded oracle fast
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_dpo_pairs_score_as_padded(shards, implementation):
    items = smallest(dataset(shards, "dpo"), 4)
    padded, packed = DPOPaddingCollator()(items), PackedDPOCollator()(items)
    vocab = vocabulary(padded["chosen"], padded["rejected"])
    model = tiny_llama(len(vocab), implementation)
    sides = ("chosen", "rejected")
    ids = torch.searchsorted(vocab, torch.cat([padded[side] for side in sides]))
    attention = torch.cat([padded[f"{side}_attention_mask"] for side in sides])
    want = padded_logps(
        model, ids, attention, torch.cat([padded[f"{side}_mask"] for side in sides])
    )
    got = packed_logps(model, packed, vocab)
    assert packed["chosen_index"].tolist() == [0, 2, 4, 6]
    pairs = torch.cat([got[packed["chosen_index"]], got[packed["rejected_index"]]])
    assert (pairs - want).abs().max() < 1e-5
    assert want.abs().min() > 1  # sums of many tokens' log p: an error would show
    before = packed_logps(model, packed, vocab, positions=False)  # sequences seeing each other
    assert (before - got)[0].abs() < 1e-5 and (before - got)[1:].abs().min() > 1e-4


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_kto_completions_score_as_padded(shards, implementation):
    items = smallest(dataset(shards, "kto"), 6)
    padded, packed = KTOPaddingCollator()(items), PackedKTOCollator()(items)
    vocab = vocabulary(padded["completion"])
    model = tiny_llama(len(vocab), implementation)
    ids = torch.searchsorted(vocab, padded["completion"])
    want = padded_logps(model, ids, padded["attention_mask"], padded["completion_mask"])
    got = packed_logps(model, packed, vocab)
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(packed["label"], padded["label"])
    assert set(packed["label"].tolist()) == {0.0, 1.0}


@pytest.mark.slow  # a tiny Llama per group; KTO keeps the packed-vs-padded oracle fast
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_grpo_groups_score_as_padded(shards, implementation):
    items = smallest(dataset(shards, "grpo"), 3)
    padded, packed = GRPOPaddingCollator()(items), PackedGRPOCollator()(items)
    vocab = vocabulary(padded["prompts"], padded["responses"])
    model = tiny_llama(len(vocab), implementation)
    real = padded["group_mask"]  # [B, G]
    groups = real.shape[1]
    prompts = padded["prompts"].repeat_interleave(groups, 0)[real.flatten()]
    prompt_attention = padded["prompt_attention_mask"].repeat_interleave(groups, 0)
    prompt_attention = prompt_attention[real.flatten()]
    ids = torch.cat([prompts, padded["responses"][real]], 1)
    attention = torch.cat([prompt_attention, padded["response_attention_mask"][real]], 1)
    mask = torch.cat([torch.zeros_like(prompt_attention), padded["masks"][real]], 1)
    ids, attention, mask = flush_left(ids, attention, mask)
    want = padded_logps(model, torch.searchsorted(vocab, ids), attention, mask)
    got = packed_logps(model, packed, vocab)
    assert (got - want).abs().max() < 1e-5
    assert packed["group_ids"].tolist() == [b for b, g in real.nonzero().tolist()]
    assert torch.equal(packed["rewards"], padded["rewards"][real])


# --- packing fills the slots that padding leaves empty ----------------------------------------

PACKED = {"dpo": PackedDPOCollator, "kto": PackedKTOCollator, "grpo": PackedGRPOCollator}


def padded_fill(train_type: str, batch: dict) -> tuple[int, int]:
    """(real tokens, slots) of a padded batch as a model runs it."""
    if train_type == "dpo":
        masks = [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
        return sum(int(m.sum()) for m in masks), sum(m.numel() for m in masks)
    if train_type == "kto":
        return int(batch["attention_mask"].sum()), batch["attention_mask"].numel()
    rows = batch["group_mask"].numel()  # each response after its prompt, one row each
    prompt = batch["prompt_attention_mask"].sum(1, keepdim=True) * batch["group_mask"]
    real = int(prompt.sum() + batch["response_attention_mask"].sum())
    return real, rows * (batch["prompts"].shape[1] + batch["responses"].shape[2])


@pytest.mark.parametrize("train_type", list(PACKED))
def test_packed_rows_fill_more_of_their_slots_than_padded_batches(shards, train_type):
    data = dataset(shards, train_type)
    budget = max(packed_tokens(data[i]) for i in range(len(data)))
    padded = DataflowLoader(MapDistributor(data, seed=1, num_epochs=1), batch_size=4)
    real, slots = map(sum, zip(*(padded_fill(train_type, b) for b in padded)))
    packer = PoolPackingBatcher(budget, pool_size=16, size_fn=packed_tokens)
    packed = DataflowLoader(
        MapDistributor(data, seed=1, num_epochs=1),
        batcher=packer,
        collator=PACKED[train_type](pad_to=budget),
    )
    rows = list(packed)
    assert all(b["input_ids"].shape == (1, budget) for b in rows)
    assert packer.counters["dropped"] == 0
    assert sum(b["num_tokens"] for b in rows) / (budget * len(rows)) > real / slots


# --- packing resumes with each document once ---------------------------------------------------


def sequences(batch: dict) -> list[tuple[int, ...]]:
    """The sequences of a packed row (no pad_to), whole again: each segment's inputs and its
    last target."""
    assert batch["num_tokens"] == batch["input_ids"].shape[1]
    bounds = batch["cu_seqlens"].tolist()
    ids, targets = batch["input_ids"][0].tolist(), batch["target_ids"][0].tolist()
    return [tuple(ids[a:b] + targets[b - 1 : b]) for a, b in zip(bounds[:-1], bounds[1:])]


def documents(train_type: str, batch: dict) -> list[Any]:
    """What each item of a packed batch was: its sequences (and label or rewards)."""
    found = sequences(batch)
    if train_type == "sft":
        return found
    if train_type == "dpo":
        return [
            (found[c], found[r]) for c, r in zip(batch["chosen_index"], batch["rejected_index"])
        ]
    if train_type == "kto":
        return list(zip(found, batch["label"].tolist()))
    groups: dict[int, list] = {}
    for group, sequence, reward in zip(
        batch["group_ids"].tolist(), found, batch["rewards"].tolist()
    ):
        groups.setdefault(group, []).append((sequence, reward))
    return [tuple(groups[g]) for g in sorted(groups)]


def item_document(train_type: str, item: dict) -> Any:
    """What `documents` finds of an item: the same, from the item itself."""
    if train_type == "sft":
        return tuple(item["input_ids"].tolist() + item["target_ids"][-1:].tolist())
    if train_type == "dpo":
        return (tuple(item["chosen"].tolist()), tuple(item["rejected"].tolist()))
    if train_type == "kto":
        return (tuple(item["completion"].tolist()), float(item["label"]))
    return tuple(
        (tuple(item["prompts"].tolist() + r.tolist()), float(w))
        for r, w in zip(item["responses"], item["rewards"])
    )


RESUMED = [
    ("sft", lambda: SequentialPackingBatcher(4096), PackedCollator),
    ("dpo", lambda: PoolPackingBatcher(6000, pool_size=6), PackedDPOCollator),
    ("kto", lambda: SequentialPackingBatcher(3000), PackedKTOCollator),
    ("grpo", lambda: PoolPackingBatcher(4096, pool_size=5), PackedGRPOCollator),
]


@pytest.mark.parametrize("train_type, batcher, collator", RESUMED, ids=[r[0] for r in RESUMED])
def test_packing_resumes_with_every_document_once(shards, train_type, batcher, collator):
    """Stopped anywhere (state_dict through JSON), a new loader given the state goes on with
    exactly the batches the first would have given; and the epoch's batches hold each item
    once, so stopped and resumed hold the epoch, each document once."""
    data = dataset(shards, train_type, "record" if train_type == "sft" else None)

    def make() -> DataflowLoader:
        distributor = MapDistributor(data, seed=7, num_epochs=1)
        return DataflowLoader(distributor, batcher=batcher(), collator=collator())

    full = check_resume(make, iter, points=[2, 3])
    assert len(full) >= 4
    seen = Counter(d for batch in full for d in documents(train_type, batch))
    epoch = Counter(item_document(train_type, data[i]) for i in range(len(data)))
    assert seen == epoch and sum(epoch.values()) == len(data)
