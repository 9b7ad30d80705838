"""The output layout of a config: which keys it writes, their dtypes, which hold tokens.

Depends on the config alone (no tokenizer): the pipeline, the writers, the ledger and the
stores all ask it what a record of this config becomes; `row_schema` gives its stored rows'
keys as the item schema (shards/schema.py) reads them, so a run counts the tokens and trained
tokens of its rows by the schema's rule.
"""

from __future__ import annotations

from tokenmill.preprocess.config import ConfigError, PipelineConfig, Section
from tokenmill.shards.schema import ItemSchema


def key_dtype(key: str, config: PipelineConfig, value_keys: set[str]) -> str:
    """Stored dtype of an output key: config override, else bool masks, float32 values, int32 ids."""
    if key in config.output.dtype:
        return config.output.dtype[key]
    if key in value_keys:
        return "float32"
    if key == "loss_mask" or key == "masks" or key.endswith("_mask"):
        return "bool"
    return "int32"


class OutputLayout:
    """What a config writes (a RecordMasker holds one, as `layout`)."""

    def __init__(self, config: PipelineConfig):
        self.config = config

    def output_keys(self) -> list[str]:
        if not self.config.multi_output:
            keys = ["sequence"]
            if self.single_needs_mask():
                keys.append("loss_mask")
            if self.config.output.position_ids_mode != "none":
                keys.append("position_ids")
            if self.config.preprocessing.packing_strategy != "none":
                keys.append("doc_lengths")  # each row's documents, so rows know their boundaries
            return keys
        keys = []
        for key in self.config.input.sources or {}:
            keys.append(key)
            mask_key = self.source_mask_key(key)
            if mask_key:
                keys.append(mask_key)
        return keys

    def value_keys(self) -> set[str]:
        sources = self.config.input.sources or {}
        return {k for k, s in sources.items() if s.sections[0].action == "value"}

    def dtypes(self) -> dict[str, str]:
        """Each output key's stored dtype; an override of a key the output does not have (a
        typo) is a ConfigError naming it, not ignored."""
        keys = self.output_keys()
        unknown = sorted(set(self.config.output.dtype) - set(keys))
        if unknown:
            raise ConfigError(
                f"output.dtype.{unknown[0]}: not a key this config writes (its keys: "
                f"{', '.join(keys)})"
            )
        values = self.value_keys()
        return {k: key_dtype(k, self.config, values) for k in keys}

    def primary_key(self) -> str:
        return self.output_keys()[0]

    def token_keys(self) -> list[str]:
        """The keys whose elements are tokens: what the ledger counts."""
        if not self.config.multi_output:
            return ["sequence"]
        return [k for k in self.config.input.sources or {} if k not in self.value_keys()]

    def row_schema(self) -> ItemSchema:
        """A stored row's keys as an ItemSchema: each token key with its mask. Rows are not
        items: their keys are the config's (`sequence` where a dataset item has `input_ids`,
        any source's name), so the schema is made here, not looked up in ITEMS. Once any key
        has a mask, a row trains its masks' True values only: a token key without a mask is
        then context (a GRPO prompt), as the run's trained tokens have always counted it;
        where no key has one, every token trains."""
        masks = {key: self.mask_key(key) for key in self.token_keys()}
        masked = any(masks.values())
        sources = self.config.input.sources or {}
        return ItemSchema(
            "row",
            {key: mask for key, mask in masks.items() if mask or not masked},
            context=tuple(key for key, mask in masks.items() if masked and not mask),
            values=tuple(key for key in sources if key in self.value_keys()),
            grouped=any(source.list_field for source in sources.values()),
        )

    def mask_key(self, key: str) -> str | None:
        """The key of the mask of token key `key`; None when every token of it trains."""
        if not self.config.multi_output:
            return "loss_mask" if self.single_needs_mask() else None
        return self.source_mask_key(key)

    def single_needs_mask(self) -> bool:
        return needs_mask(self.config.input.sections)

    def source_mask_key(self, key: str) -> str | None:
        source = (self.config.input.sources or {})[key]
        if source.sections[0].action == "value":
            return None
        if source.mask_key:
            return source.mask_key
        return f"{key}_mask" if needs_mask(source.sections) and can_train(source.sections) else None


def needs_mask(sections: list[Section]) -> bool:
    return any(s.template or s.action == "mask" for s in sections)


def can_train(sections: list[Section]) -> bool:
    return any(s.action in ("train", "$role") for s in sections)
