"""Provenance: the tokenizer each source's data was made with, checked before sources mix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def source_tokenizer(source: Any) -> tuple[str, str] | None:
    """(fingerprint, path) of the tokenizer a source's data was made with, where it says."""
    data = getattr(source, "dataset", None) or getattr(source, "iterable", None)
    found = getattr(data, "tokenizer_provenance", None)
    for inner in getattr(source, "sources", ()) if found is None else ():
        found = found or source_tokenizer(inner)
    return found


def check_one_tokenizer(owner: str, sources: Sequence[Any], allow: bool) -> None:
    """Sources tokenized by different tokenizers make a stream whose ids mean different
    things: refused, naming both, unless `allow` says it is on purpose."""
    seen: dict[str, tuple[int, str]] = {}
    for i, source in enumerate(sources):
        found = source_tokenizer(source)
        if found is not None:
            seen.setdefault(found[0], (i, found[1]))
    if len(seen) > 1 and not allow:
        (fp_a, (a, path_a)), (fp_b, (b, path_b)) = list(seen.items())[:2]
        raise ValueError(
            f"{owner}: source {a} was tokenized with {path_a} (fingerprint {fp_a[:12]}) and "
            f"source {b} with {path_b} (fingerprint {fp_b[:12]}); their token ids do not mean "
            "the same; pass allow_mixed_tokenizers=True if that is on purpose"
        )
