"""Where an encoding's tokens sit in its text: positions by binary search, and which ids are
added tokens (template control text). Read by the span finders (content_spans, probe_spans)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import cache, cached_property
from operator import itemgetter

import numpy as np
import tokenizers


class TokenOffsets:
    """Where an encoding's tokens start and end in its text. One position is found by binary
    search through the encoding (token starts never decrease); every token's, as arrays, only
    where a path needs them all: reading `encoding.offsets` costs more than the masking."""

    def __init__(self, encoding: tokenizers.Encoding, ids: np.ndarray, table: np.ndarray):
        self.encoding, self.ids, self.table = encoding, ids, table
        self._tokens = range(len(ids))

    def _start(self, token: int) -> int:
        chars = self.encoding.token_to_chars(token)
        assert chars is not None  # one sequence: every token has its characters
        return chars[0]

    def count_before(self, at: int) -> int:
        """How many tokens start before character `at`."""
        return bisect_left(self._tokens, at, key=self._start)

    def start_at(self, at: int) -> int:
        """Where the last token that starts at or before `at` starts; -1 if none does."""
        token = bisect_right(self._tokens, at, key=self._start) - 1
        return self._start(token) if token >= 0 else -1

    @cached_property
    def starts(self) -> np.ndarray:
        return self._column(0)

    @cached_property
    def ends(self) -> np.ndarray:
        return self._column(1)

    @cached_property
    def is_control(self) -> np.ndarray:
        """Which tokens are added tokens (template control text)."""
        ids, table = self.ids, self.table
        return table[np.minimum(ids, len(table) - 1)] & (ids < len(table))

    @property
    def control(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) of the control tokens."""
        return self.starts[self.is_control], self.ends[self.is_control]

    def _column(self, k: int) -> np.ndarray:
        pairs = self.encoding.offsets
        return np.fromiter(map(itemgetter(k), pairs), dtype=np.int64, count=len(pairs))


@cache
def added_table(tokenizer: tokenizers.Tokenizer) -> np.ndarray:
    """Lookup table id -> is an added token, for O(1) tests per token."""
    added = _added_ids(tokenizer)
    table = np.zeros(int(added.max()) + 2 if len(added) else 1, dtype=bool)
    table[added] = True
    return table


@cache
def _added_ids(tokenizer: tokenizers.Tokenizer) -> np.ndarray:
    """Ids of the added tokens (`<|im_end|>`, `<think>`, ...): template control text."""
    return np.asarray(sorted(tokenizer.get_added_tokens_decoder()), dtype=np.int32)
