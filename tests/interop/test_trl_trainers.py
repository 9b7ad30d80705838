"""TRL's DPO, KTO and GRPO trainers train on tokenmill's stored data, tokenizing nothing.

TRL 1.16's DPOTrainer and KTOTrainer tokenize text in `_prepare_dataset` whatever columns they
get: the subclasses below (docs/training.md's) return tokenmill's columns as they are, and the
batches the trainers' own collators make hold tokenmill's sequences and train exactly the tokens
its masks train. GRPOTrainer takes stored groups with no subclass: `StoredRollouts` stands in
for generation, and the reward function sees each stored response with its stored reward.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
from helpers import QWEN, ROOT
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import DEFAULT_CONFIGS
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.trl_columns import StoredRollouts, stored_rewards, trl_dataset

pytestmark = [
    pytest.mark.slow,  # real trainers, two steps each over a 151k-token vocabulary
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

SOURCES = {
    "dpo": ROOT / "data" / "dpo_en_300.jsonl",
    "kto": ROOT / "examples" / "kto" / "records.jsonl",
    "grpo": ROOT / "data" / "grpo_from_dpo_300.jsonl",
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(QWEN)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The first 8 shipped records of each type under its built-in config."""
    out = {}
    for kind, source in SOURCES.items():
        folder = tmp_path_factory.mktemp(kind)
        config = copy.deepcopy(DEFAULT_CONFIGS[kind])
        config["preprocessing"]["max_items"] = 8
        Pipeline(PipelineConfig.from_dict(config), [source], folder, QWEN, progress=False).run()
        out[kind] = DatasetFactory.load(kind, folder, window_size=4096, max_len=4096)
    return out


def tiny_model(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def arguments(config_class, tmp_path, **options):
    return config_class(
        str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        **options,
    )


def trains(trainer) -> None:
    """Two steps, a finite loss, and weights that moved."""
    before = trainer.model.get_input_embeddings().weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    assert not torch.equal(before, trainer.model.get_input_embeddings().weight.detach())


def test_dpo_trainer_trains_tokenmills_pairs(stored, tokenizer, tmp_path):
    from trl import DPOConfig, DPOTrainer

    class PretokenizedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # prompt_ids, chosen_ids, rejected_ids: nothing to tokenize

    pairs = stored["dpo"]
    model = tiny_model(tokenizer)
    trainer = PretokenizedDPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=arguments(
            DPOConfig, tmp_path, max_length=256
        ),  # TRL's collator cuts, keeping the start
        train_dataset=trl_dataset(pairs, cache_dir=str(tmp_path / "cache")),
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    sequences = [
        (pairs[i][side], pairs[i][f"{side}_mask"])
        for i in range(len(pairs))
        for side in ("chosen", "rejected")
    ]
    for row in range(len(batch["input_ids"])):  # chosen rows, then rejected: stored sequences
        length = int(batch["attention_mask"][row].sum())
        tokens = batch["input_ids"][row, :length]
        masks = {
            tuple(m[:length].tolist()) for s, m in sequences if torch.equal(s[:length], tokens)
        }
        assert masks == {tuple(batch["completion_mask"][row, :length].bool().tolist())}
    trains(trainer)


def test_kto_trainer_trains_tokenmills_completions(stored, tokenizer, tmp_path):
    from trl import KTOConfig, KTOTrainer

    class PretokenizedKTOTrainer(KTOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if not self.calculate_KL:
                return dataset  # prompt_ids, completion_ids, label: nothing to tokenize

            # TRL's mismatched pairs for the KL term: completions rotated by one in each batch
            def rotate(batch):
                completions = batch["completion_ids"]
                return {"KL_completion_ids": completions[-1:] + completions[:-1]}

            return dataset.map(rotate, batched=True, batch_size=args.per_device_train_batch_size)

    completions = stored["kto"]
    model = tiny_model(tokenizer)
    trainer = PretokenizedKTOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=arguments(KTOConfig, tmp_path),
        train_dataset=trl_dataset(completions, cache_dir=str(tmp_path / "cache")),
        processing_class=tokenizer,
    )
    assert trainer.calculate_KL
    batch = next(iter(trainer.get_train_dataloader()))
    items = {
        tuple(completions[i]["completion"].tolist()): completions[i]
        for i in range(len(completions))
    }
    for row in range(len(batch["input_ids"])):
        length = int(batch["attention_mask"][row].sum())
        item = items[tuple(batch["input_ids"][row, :length].tolist())]
        assert torch.equal(batch["completion_mask"][row, :length].bool(), item["completion_mask"])
        assert bool(batch["label"][row]) == bool(item["label"])
    trains(trainer)


def test_grpo_trainer_trains_stored_groups_without_generating(stored, tokenizer, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    groups = stored["grpo"]
    seen = []

    def recorded_rewards(prompts, completion_ids, reward, **kwargs):
        seen.extend(zip(prompts, completion_ids, reward, strict=True))
        return stored_rewards(completion_ids, reward)

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's experiment
    trainer = GRPOTrainer(
        model=tiny_model(tokenizer),
        reward_funcs=recorded_rewards,
        args=arguments(GRPOConfig, tmp_path, num_generations=2),
        train_dataset=trl_dataset(groups, cache_dir=str(tmp_path / "cache")),
        processing_class=tokenizer,
        rollout_func=StoredRollouts(groups),
    )
    trains(trainer)
    assert len(seen) == 4  # two steps of 2 completions: one group each
    for at in range(0, len(seen), 2):
        (index, first, r0), (again, second, r1) = seen[at], seen[at + 1]
        group = groups[index]
        assert again == index  # a group's copies side by side, as TRL normalizes them
        assert [first, second] == [r.tolist() for r in group["responses"]]
        assert [r0, r1] == group["rewards"].tolist()
