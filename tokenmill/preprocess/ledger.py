"""The ledger: every input token accounted for, written or dropped by reason, per domain.

For each domain (and in total): records read and written, tokens read (every token a record
was rendered to, before any cut) and written, and what was dropped, by reason, in records and
tokens. tokens_read = tokens_written + dropped tokens, always; a run's summary, its manifest
and `tokenmill inspect` show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Why tokens leave the flow. truncated and packing_overflow cut tokens from records that are
# still written (their `records` count the records cut); the others drop whole records.
# filtered (the config's filter hook said no) and duplicate (a text met before, dedup) drop
# records before they are tokenized: records counted, 0 tokens.
DROP_REASONS = (
    "truncated",
    "too_short",
    "too_long",
    "no_trained_tokens",
    "identical_pair",
    "packing_overflow",
    "bad_record",
    "filtered",
    "duplicate",
)
CUTS = ("truncated", "packing_overflow")


@dataclass
class Ledger:
    records_read: int = 0
    records_written: int = 0
    tokens_read: int = 0
    tokens_written: int = 0
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)

    def drop(self, reason: str, records: int, tokens: int) -> None:
        if reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {reason!r}; expected one of {DROP_REASONS}")
        entry = self.dropped.setdefault(reason, {"records": 0, "tokens": 0})
        entry["records"] += records
        entry["tokens"] += tokens

    def add(self, other: Ledger) -> None:
        self.records_read += other.records_read
        self.records_written += other.records_written
        self.tokens_read += other.tokens_read
        self.tokens_written += other.tokens_written
        for reason, entry in other.dropped.items():
            self.drop(reason, entry["records"], entry["tokens"])

    @property
    def dropped_tokens(self) -> int:
        return sum(entry["tokens"] for entry in self.dropped.values())

    def unbalanced(self) -> list[str]:
        """What does not add up, in words; [] when every record and token is accounted for."""
        problems = []
        if self.tokens_read != self.tokens_written + self.dropped_tokens:
            problems.append(
                f"tokens read {self.tokens_read:,} != written {self.tokens_written:,} + "
                f"dropped {self.dropped_tokens:,}"
            )
        dropped_records = sum(e["records"] for r, e in self.dropped.items() if r not in CUTS)
        if self.records_read != self.records_written + dropped_records:
            problems.append(
                f"records read {self.records_read:,} != written {self.records_written:,} + "
                f"dropped {dropped_records:,}"
            )
        return problems

    def as_dict(self) -> dict[str, Any]:
        dropped = {r: dict(self.dropped[r]) for r in DROP_REASONS if r in self.dropped}
        return {
            "records_read": self.records_read,
            "records_written": self.records_written,
            "tokens_read": self.tokens_read,
            "tokens_written": self.tokens_written,
            "dropped_tokens": self.dropped_tokens,
            "dropped": dropped,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        ledger = cls(
            data["records_read"],
            data["records_written"],
            data["tokens_read"],
            data["tokens_written"],
        )
        for reason, entry in data.get("dropped", {}).items():
            ledger.drop(reason, entry["records"], entry["tokens"])
        return ledger

    def format(self, indent: str = "") -> list[str]:
        """The ledger as the summary prints it: read = written + dropped, then each reason."""
        share = (
            f"  ({self.dropped_tokens / self.tokens_read:.2%} of read)" if self.tokens_read else ""
        )
        lines = [
            f"{indent}tokens read      {self.tokens_read:>12,}",
            f"{indent}tokens written   {self.tokens_written:>12,}",
            f"{indent}tokens dropped   {self.dropped_tokens:>12,}{share}",
        ]
        for reason in DROP_REASONS:
            if reason in self.dropped:
                entry = self.dropped[reason]
                what = "records cut" if reason in CUTS else "records"
                lines.append(
                    f"{indent}  {reason:<18}{entry['tokens']:>10,} tokens  "
                    f"({entry['records']:,} {what})"
                )
        return lines


@dataclass
class Tally:
    """What one record cost and lost: text characters read, tokens rendered (before any cut),
    and tokens cut by truncation. The ledger adds these up; a dropped record's RecordError
    carries its `tokens` too, so every rendered token is accounted for."""

    chars: int = 0
    tokens: int = 0
    truncated: int = 0
