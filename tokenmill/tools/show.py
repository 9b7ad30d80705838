"""One sample decoded back to text, trained and masked tokens told apart (`tokenmill show`).

Works on shards (via MmapStore: a folder, or a URL) and on raw records with a config and a
tokenizer, so a template can be checked before a whole corpus is preprocessed.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

import numpy as np

from tokenmill.preprocess.chat.tokenizer import TokenizerBundle, load_tokenizer
from tokenmill.preprocess.chat.training_templates import template_name
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.inputs.files import list_inputs
from tokenmill.preprocess.inputs.records import read_records
from tokenmill.storage.source import holds_shards

GREEN, DIM, BOLD, RESET = "\033[32m", "\033[2m", "\033[1m", "\033[0m"


PLAIN_MASKED = ("[masked]", "[/masked]")


def render(
    bundle: TokenizerBundle,
    ids: np.ndarray,
    mask: np.ndarray | None,
    color: bool,
    show_ids: bool = False,
) -> str:
    """Decoded text; masked runs dimmed (color) or wrapped in [masked]...[/masked] (plain)."""
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.ones(len(ids), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    out = []
    start = 0
    for end in [*np.flatnonzero(np.diff(mask.astype(np.int8))) + 1, len(ids)]:
        if end == start:
            continue
        text = bundle.tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=False)
        if show_ids:
            text += " " + str(ids[start:end].tolist())
        trained = bool(mask[start])
        if color:
            out.append((GREEN if trained else DIM) + text + RESET)
        else:
            out.append(text if trained else PLAIN_MASKED[0] + text + PLAIN_MASKED[1])
        start = end
    return "".join(out)


def format_sample(
    bundle: TokenizerBundle, sample: dict[str, Any], color: bool, show_ids: bool
) -> str:
    """Every token key of one sample, with its mask when it has one."""

    def mask_of(key: str) -> Any:
        for name in (
            "loss_mask" if key == "sequence" else f"{key}_mask",
            "masks" if key == "responses" else "",
        ):
            if name in sample:
                return sample[name]
        return None

    lines = []
    trained_total = tokens_total = 0
    for key, value in sample.items():
        if key in ("loss_mask", "masks", "position_ids") or key.endswith("_mask"):
            continue
        if key == "rewards":
            lines.append(
                f"{BOLD if color else ''}rewards{RESET if color else ''}: {np.asarray(value).tolist()}"
            )
            continue
        items = value if isinstance(value, list) else [value]
        masks = mask_of(key)
        masks = masks if isinstance(masks, list) else [masks] * len(items)
        for j, (ids, mask) in enumerate(zip(items, masks, strict=True)):
            title = f"{key}[{j}]" if isinstance(value, list) else key
            if (
                mask is None
            ):  # no mask key: prompts are context (never trained), anything else trains whole
                mask = np.full(len(ids), key != "prompts")
            m = np.asarray(mask, bool)
            trained_total += int(m.sum())
            tokens_total += len(ids)
            header = f"--- {title}: {len(ids)} tokens, {int(m.sum())} trained"
            lines += [
                f"{BOLD if color else ''}{header}{RESET if color else ''}",
                render(bundle, np.asarray(ids), mask, color, show_ids),
            ]
    legend = (
        "green = trained, dim = masked"
        if color
        else "plain = trained, [masked]...[/masked] = masked"
    )
    lines.append(f"--- {trained_total} of {tokens_total} tokens trained ({legend})")
    return "\n".join(lines)


def sample_from_records(
    paths: list[str], index: int, config: PipelineConfig, bundle: TokenizerBundle
) -> dict:
    """Record `index` (0-based, over the inputs in order) processed exactly as the pipeline would."""
    masker = RecordMasker(config, bundle)
    seen = 0
    unit = config.input.text_unit
    for path in list_inputs(paths):
        for record in islice(read_records(path, text_unit=unit), max(0, index - seen), None):
            return masker.process(record)
        seen += sum(1 for _ in read_records(path, text_unit=unit))
    raise IndexError(f"index {index} out of range: the inputs hold {seen} records")


def show(
    target: str,
    index: int,
    tokenizer: str | None,
    config: PipelineConfig | None,
    color: bool,
    show_ids: bool,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Sample `index` of a dataset folder, a dataset at a URL (s3://..., one shard downloaded)
    or raw records (with a config and a tokenizer), decoded."""
    if holds_shards(target):
        from tokenmill.tools.bucket import record_at

        sample, manifest = record_at(target, index, storage_options)
        tokenizer = tokenizer or manifest.get("tokenizer_path")
        if tokenizer is None:
            raise ValueError(f"{target}: the manifest names no tokenizer; pass --tokenizer")
        shown = format_sample(load_tokenizer(tokenizer), sample, color, show_ids)
        template = (manifest.get("chat_template") or {}).get("name")
        return shown + (f"\n--- rendered with the chat template: {template}" if template else "")
    if config is None or tokenizer is None:
        raise ValueError("raw records need a config (-c or --type) and --tokenizer")
    bundle = load_tokenizer(tokenizer)
    shown = format_sample(
        bundle, sample_from_records([target], index, config, bundle), color, show_ids
    )
    if not any(s.template for s in config.all_sections()):
        return shown
    template = template_name(bundle, config.chat_template)
    return f"{shown}\n--- rendered with the chat template: {template}"
