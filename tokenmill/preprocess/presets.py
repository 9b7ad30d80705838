"""The built-in configs, one per training type: what `--type` and `default_config` give.

Each matches the shipped sample data of its type; `examples/<type>/config.yaml` writes it out
and a test keeps the two equal."""

from __future__ import annotations

from typing import Any

from tokenmill.preprocess.config import PipelineConfig


def default_config(train_type: str) -> PipelineConfig:
    """The built-in config for each training type, matching the shipped sample data."""
    if train_type not in DEFAULT_CONFIGS:
        raise ValueError(f"unknown train_type {train_type!r}; valid: {sorted(DEFAULT_CONFIGS)}")
    return PipelineConfig.from_dict(
        DEFAULT_CONFIGS[train_type], origin=f"default_config({train_type})"
    )


_CHAT = {"field": "messages", "template": True, "action": "$role"}


_PROMPT = {"field": "prompt", "template": True, "action": "mask", "optional": True}


DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    # pretraining keeps every token: no cut, documents continue across rows in order
    "seq": {
        "input": {"sections": [{"field": "text", "action": "train", "eos": True}]},
        "preprocessing": {"packing_strategy": "stream"},
    },
    # whole conversations: rows no longer than a 2048-token sample; OpenAI `messages` or
    # ShareGPT `conversations` (LLaMA-Factory's and axolotl's name for it)
    "sft": {
        "input": {"sections": [_CHAT], "columns": {"messages": ["messages", "conversations"]}},
        "preprocessing": {"max_packed_len": 2048},
    },
    # prompt + response, or Alpaca's instruction, optional input (after a newline) and output
    "instruction": {
        "input": {
            "sections": [
                {"field": "prompt", "action": "mask"},
                {"field": "input", "action": "mask", "optional": True, "prefix": "\n"},
                {"field": "response", "action": "train", "eos": True},
            ],
            "columns": {"prompt": ["prompt", "instruction"], "response": ["response", "output"]},
        },
        "preprocessing": {"min_chars": 1, "max_packed_len": 2048},
    },
    # TRL's conversational preference data, explicit prompt or not: the prompt (when given)
    # and each reply are one conversation; a reply that repeats the prompt is not doubled
    "dpo": {
        "input": {
            "sources": {
                side: {
                    "sections": [
                        dict(_PROMPT),
                        {"field": side, "template": True, "action": "$role"},
                    ]
                }
                for side in ("chosen", "rejected")
            },
            "shared_prompt": "prompt",
        },
        "preprocessing": {"min_chars": 1, "packing_strategy": "none"},
    },
    # TRL's unpaired preference data (KTO): a prompt and one completion, labelled good or bad;
    # or LLaMA-Factory's: a whole conversation (`messages`) whose last reply the label judges
    "kto": {
        "input": {
            "sources": {
                "completion": {
                    "sections": [
                        dict(_PROMPT),
                        {
                            "field": "completion",
                            "template": True,
                            "action": "$role",
                            "train_turns": "last",
                        },
                    ]
                },
                "label": {"sections": [{"field": "label", "action": "value"}]},
            },
            "columns": {
                "completion": ["completion", "messages", "conversations"],
                "label": ["label", "kto_tag"],
            },
        },
        "preprocessing": {"min_chars": 1, "packing_strategy": "none"},
    },
    "grpo": {
        "input": {
            "sources": {
                "prompts": {
                    "sections": [
                        {
                            "field": "prompt",
                            "template": True,
                            "action": "mask",
                            "generation_prompt": True,
                        }
                    ]
                },
                "responses": {
                    "sections": [
                        {
                            "field": "responses",
                            "optional": True,  # prompt-only data: prompts for online generation
                            "action": "train",
                            "eos": True,
                            "add_special_tokens": False,
                        }
                    ],
                    "list_field": True,
                    "mask_key": "masks",
                },
                "rewards": {
                    "sections": [{"field": "rewards", "action": "value", "optional": True}]
                },
            }
        },
        "preprocessing": {"min_chars": 1, "packing_strategy": "none"},
    },
}
