"""Provenance: the tokenizer each source's data was made with, checked before sources mix.

Each source says it by its `tokenizer_provenance` hook (DataDistributor's; a dataset's is the
TokenizerProvenance of contracts.py)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.dataflow.contracts import TokenizerProvenance, checked_tokenizer


def first_tokenizer(sources: Sequence[TokenizerProvenance]) -> tuple[str, str] | None:
    """(fingerprint, path) of the first tokenizer a source says its data was made with."""
    for source in sources:
        found = checked_tokenizer(source, source.tokenizer_provenance)
        if found is not None:
            return found
    return None


def check_one_tokenizer(owner: str, sources: Sequence[TokenizerProvenance], allow: bool) -> None:
    """Sources tokenized by different tokenizers make a stream whose ids mean different
    things: refused, naming both, unless `allow` says it is on purpose."""
    seen: dict[str, tuple[int, str]] = {}
    for i, source in enumerate(sources):
        found = checked_tokenizer(source, source.tokenizer_provenance)
        if found is not None:
            seen.setdefault(found[0], (i, found[1]))
    if len(seen) > 1 and not allow:
        (fp_a, (a, path_a)), (fp_b, (b, path_b)) = list(seen.items())[:2]
        raise ValueError(
            f"{owner}: source {a} was tokenized with {path_a} (fingerprint {fp_a[:12]}) and "
            f"source {b} with {path_b} (fingerprint {fp_b[:12]}); their token ids do not mean "
            "the same; pass allow_mixed_tokenizers=True if that is on purpose"
        )
