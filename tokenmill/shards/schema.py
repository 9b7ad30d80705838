"""Item schema: which keys of a training type's item hold tokens, which masks say which of
them train, which hold values, and whether an item is a group.

One table for every reader of items: the batchers count tokens by it, the mixture counts
trained tokens by it, the collators and the tools find tokens and masks by it. Numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.shards.format import row_tokens, trained_count


@dataclass(frozen=True)
class ItemSchema:
    """The keys of one training type's item.

    `tokens` maps each trainable token key to the key of its mask (None: every token
    trains); `context` keys hold tokens that never train (a GRPO prompt); `values` are
    per-item numbers (a KTO label, GRPO rewards); `grouped`: the token keys hold a list of
    sequences per item (a GRPO group) rather than one."""

    train_type: str
    tokens: dict[str, str | None]
    context: tuple[str, ...] = ()
    values: tuple[str, ...] = ()
    grouped: bool = False

    @property
    def token_keys(self) -> list[str]:
        """Every key holding tokens, context first (the order a packed row puts them in)."""
        return [*self.context, *self.tokens]

    @property
    def mask_keys(self) -> list[str]:
        return [m for m in self.tokens.values() if m is not None]

    def token_count(self, item: dict[str, Any]) -> int:
        """Tokens the item puts in a batch: every token key it holds."""
        return sum(row_tokens(item[k]) for k in self.token_keys if k in item)

    def trained_tokens(self, item: dict[str, Any]) -> int:
        """Tokens the item trains: each mask's True count, or every token of an unmasked key."""
        total = 0
        for key, mask in self.tokens.items():
            if key not in item:
                continue
            if mask is not None and mask in item:
                total += trained_count(item[mask])
            else:
                total += row_tokens(item[key])
        return total


# the items the training datasets hand out (training/datasets.py, training/record_datasets.py)
ITEMS: dict[str, ItemSchema] = {
    "seq": ItemSchema("seq", {"input_ids": None}),
    "sft": ItemSchema("sft", {"input_ids": "loss_mask"}),
    "dpo": ItemSchema("dpo", {"chosen": "chosen_mask", "rejected": "rejected_mask"}),
    "kto": ItemSchema("kto", {"completion": "completion_mask"}, values=("label",)),
    "grpo": ItemSchema(
        "grpo", {"responses": "masks"}, context=("prompts",), values=("rewards",), grouped=True
    ),
}


def schema_of(item: dict[str, Any]) -> ItemSchema:
    """The schema an item's keys match (an item does not carry its type): its first token key
    tells; an `input_ids` item with a `loss_mask` is SFT's."""
    if "input_ids" in item:
        return ITEMS["sft"] if "loss_mask" in item else ITEMS["seq"]
    for schema in (ITEMS["dpo"], ITEMS["kto"], ITEMS["grpo"]):
        if schema.token_keys[0] in item:
            return schema
    known = "; ".join(f"{t}: {s.token_keys}" for t, s in ITEMS.items())
    raise KeyError(f"an item with keys {sorted(item)} matches no training type ({known})")


def token_count(item: dict[str, Any]) -> int:
    """Tokens an item of any training type puts in a batch."""
    return schema_of(item).token_count(item)


def trained_tokens(item: dict[str, Any]) -> int:
    """Tokens an item of any training type trains."""
    return schema_of(item).trained_tokens(item)


def stored_schema(keys: Iterable[str]) -> ItemSchema | None:
    """The schema of a dataset's stored rows, told by their keys: a row's keys are its items'
    but for `sequence`, which seq and sft items hand out as `input_ids` (shifted, as targets);
    None for keys of no training type (a config's own names)."""
    names = ["input_ids" if key == "sequence" else key for key in keys]
    try:
        schema = schema_of(dict.fromkeys(names))
    except KeyError:
        return None
    if "input_ids" not in schema.tokens:
        return schema
    return replace(schema, tokens={"sequence": schema.tokens["input_ids"]})
