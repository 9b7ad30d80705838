"""TRL columns: DPO, KTO and GRPO items in the columns TRL's preference and GRPO trainers take.

TRL (1.16) holds a DPO or KTO sequence as `prompt_ids` then a reply (`chosen_ids` and
`rejected_ids`, or `completion_ids`) that trains whole. A tokenmill item whose mask is False on a
prefix and True on the rest is exactly that, split where the mask turns; one that is not (a
reply with an untrained turn inside) is refused by name, as TRL's columns cannot say it.
DPOTrainer and KTOTrainer tokenize text in `_prepare_dataset` whatever columns they get, so they
take these through a subclass that skips it (docs/training.md). GRPOTrainer generates and scores
its own completions; `StoredRollouts`, a `rollout_func`, hands it a GRPO group's stored
responses, masks and rewards instead, so it trains on tokenmill's groups offline.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

TRL_LAYOUT = "trl-columns"
"""Part of the Arrow cache's name, beside the dataset's fingerprint."""


def split_reply(tokens: Any, mask: Any, where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids): the untrained prefix of `tokens` and the trained rest (empty
    where `max_len` cut the reply away: it trains nothing, as in TRL)."""
    trained = torch.as_tensor(mask).bool()
    prompt = int((~trained).long().cumprod(0).sum())
    if not bool(trained[prompt:].all()):
        inside = int((~trained[prompt:]).sum())
        raise ValueError(
            f"{where}: {inside} untrained tokens inside the reply, which starts at token {prompt}; "
            "TRL's columns train the whole reply after the prompt"
        )
    ids = torch.as_tensor(tokens).tolist()
    return ids[:prompt], ids[prompt:]


def dpo_columns(item: Mapping[str, Any], where: str = "item") -> dict[str, list[int]]:
    """A DPO item (chosen, rejected and their masks) as `prompt_ids`, `chosen_ids` and
    `rejected_ids`: DPOTrainer's collator puts `prompt_ids + chosen_ids` back together and
    trains `chosen_ids`, the tokens tokenmill's mask trains."""
    prompt, chosen = split_reply(item["chosen"], item["chosen_mask"], f"{where}: chosen")
    other, rejected = split_reply(item["rejected"], item["rejected_mask"], f"{where}: rejected")
    if prompt != other:
        raise ValueError(
            f"{where}: chosen and rejected start with different prompts ({len(prompt)} and "
            f"{len(other)} untrained tokens); TRL's DPO columns hold one prompt per pair"
        )
    return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}


def kto_columns(item: Mapping[str, Any], where: str = "item") -> dict[str, Any]:
    """A KTO item (completion, completion_mask, label) as `prompt_ids`, `completion_ids` and
    `label` (True: desirable), KTOTrainer's names."""
    prompt, reply = split_reply(item["completion"], item["completion_mask"], f"{where}: completion")
    label = float(torch.as_tensor(item["label"]).reshape(()))
    return {"prompt_ids": prompt, "completion_ids": reply, "label": label >= 0.5}


def trl_dataset(dataset: Any, cache_dir: str | None = None) -> Any:
    """A tokenmill dpo, kto or grpo dataset as a `datasets.Dataset` in TRL's columns, written
    once to Arrow files a row at a time: `dpo_columns`, `kto_columns`, or for grpo a `prompt`
    column of group indices, which `StoredRollouts` reads the groups by."""
    import datasets  # an optional dependency: only this path needs it

    train_type = getattr(dataset, "train_type", "")
    ids = datasets.Sequence(datasets.Value("int64"))
    if train_type == "dpo":
        names = {"prompt_ids": ids, "chosen_ids": ids, "rejected_ids": ids}
    elif train_type == "kto":
        names = {"prompt_ids": ids, "completion_ids": ids, "label": datasets.Value("bool")}
    elif train_type == "grpo":
        names = {"prompt": datasets.Value("int64")}
    else:
        raise ValueError(
            f"trl_dataset takes dpo, kto or grpo datasets, got {type(dataset).__name__} of type "
            f"{train_type!r}; seq and sft data go through hf_names.hf_dataset"
        )

    def rows() -> Iterator[dict[str, Any]]:
        for index in range(len(dataset)):
            if train_type == "grpo":  # the group itself is read at training time
                yield {"prompt": index}
            else:
                columns = dpo_columns if train_type == "dpo" else kto_columns
                yield columns(dataset[index], f"item {index}")

    fingerprint = getattr(dataset, "fingerprint", None)
    return datasets.Dataset.from_generator(
        rows,
        features=datasets.Features(names),
        cache_dir=cache_dir,
        fingerprint=f"{fingerprint}-{TRL_LAYOUT}" if fingerprint else None,
    )


class StoredRollouts:
    """GRPOTrainer's `rollout_func` for stored GRPO groups: it generates nothing. For each
    prompt of the batch (a group index, `trl_dataset`'s `prompt`) it returns the group's
    prompt ids, one of its responses, that response's mask as `env_mask` (TRL trains only
    where it is 1) and its reward as `reward`, which `stored_rewards` hands back.

    TRL lays out each prompt's `num_generations` copies one after another, across the
    processes' slices of the batch, and normalizes rewards over each run of copies; copy g of a
    run (the global position modulo `num_generations`) takes response g, so each group is scored
    against itself. A group of another size is refused by name."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        training = trainer.model.training
        size = trainer.num_generations if training else trainer.num_generations_eval
        first = trainer.accelerator.process_index * len(prompts)
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        out.update(env_mask=[], reward=[])
        for i, index in enumerate(prompts):
            group = self.dataset[int(index)]
            if "responses" not in group:
                raise ValueError(
                    f"GRPO group {index} holds a prompt alone: StoredRollouts trains stored "
                    "responses; prompt-only data needs generation"
                )
            if len(group["responses"]) != size:
                raise ValueError(
                    f"GRPO group {index} holds {len(group['responses'])} responses; the trainer "
                    f"makes groups of num_generations={size}"
                )
            g = (first + i) % size
            out["prompt_ids"].append(group["prompts"].tolist())
            out["completion_ids"].append(group["responses"][g].tolist())
            out["env_mask"].append(group["masks"][g].int().tolist())
            out["reward"].append(float(group["rewards"][g]))
        return out


def stored_rewards(completions: list[Any], reward: list[float], **kwargs: Any) -> list[float]:
    """GRPOTrainer's reward function beside StoredRollouts: each completion's stored reward."""
    return [float(value) for value in reward]
