"""Cleaning hooks for examples/cleaning/config.yaml: each runs in the preprocessing workers,
on one raw record (a dict) before it is tokenized."""

REFUSALS = ("i'm sorry", "i am sorry", "i apologize", "as an ai")  # how a refusal starts


def turns(record: dict) -> list[dict]:
    """The record's messages, in either shape the config reads (OpenAI or ShareGPT)."""
    return record.get("messages") or record.get("conversations") or []


def tidy(record: dict) -> dict:
    """map: every message's text without the white space around it."""
    for turn in turns(record):
        for key in ("content", "value"):
            if isinstance(turn.get(key), str):
                turn[key] = turn[key].strip()
    return record


def keep(record: dict) -> bool:
    """filter: drop conversations where the model answers with a canned refusal."""
    for turn in turns(record):
        if turn.get("role", turn.get("from")) in ("assistant", "gpt"):
            text = str(turn.get("content") or turn.get("value") or "").lower()
            if text.startswith(REFUSALS):
                return False
    return True
