"""Where an encoding's tokens sit in its text: positions by binary search, and which ids are
added tokens (template control text). Read by the span finders (content_spans, probe_spans).

`encode_offsets` is how a rendering is encoded: for a byte-level BPE tokenizer that leaves
the text as it is, the positions follow from the ids alone (each id stands for a fixed run
of bytes), so the encode skips the tokenizer's own offsets, about a tenth of its time. Such
a tokenizer cuts the text at every added token before it splits words, so the tokens before
an added token do not depend on what follows it: a thread's next rendering that shares a
start with its last one (a DPO pair's prompt, a system prompt) encodes only the rest. And a
text its normalizer would leave as it is (NFC: nearly every rendering) is encoded without
the normalizer (`unnormalized`), which is about 7% of the tokenizer's time."""

from __future__ import annotations

import json
import threading
from bisect import bisect_left, bisect_right
from functools import cache, cached_property
from itertools import compress
from operator import itemgetter
from typing import Any, cast

import numpy as np
import tokenizers
from tokenizers import pre_tokenizers

from tokenmill.preprocess.chat.tokenizer import (
    Form,
    TokenizerBundle,
    is_stable,
    normal_form,
    tokenizer_threads_are_off,
    unnormalized,
)


class TokenOffsets:
    """Where the tokens of `ids` start and end in their text: from `starts` and `ends` where
    they are known, else from the encoding, one position at a time by binary search (token
    starts never decrease): reading `encoding.offsets` costs more than the masking. `text` is
    kept so that the thread's next rendering can find the start it shares with this one."""

    def __init__(
        self,
        ids: np.ndarray,
        table: np.ndarray,
        encoding: tokenizers.Encoding | None = None,
        starts: np.ndarray | None = None,
        ends: np.ndarray | None = None,
        text: str = "",
    ):
        self.encoding, self.ids, self.table, self.text = encoding, ids, table, text
        self._tokens = range(len(ids))
        if starts is not None and ends is not None:
            self.starts, self.ends = starts, ends

    def _start(self, token: int) -> int:
        assert self.encoding is not None
        chars = self.encoding.token_to_chars(token)
        assert chars is not None  # one sequence: every token has its characters
        return chars[0]

    def count_before(self, at: int) -> int:
        """How many tokens start before character `at`."""
        if self.encoding is None:  # the method: np.searchsorted's wrapper costs as much
            return int(self.starts.searchsorted(at, side="left"))
        return bisect_left(self._tokens, at, key=self._start)

    def counts_before(self, ats: list[int]) -> list[int]:
        """`count_before` of each position, in one search where positions are known."""
        if self.encoding is None:
            return cast(list[int], self.starts.searchsorted(ats, side="left").tolist())
        return [self.count_before(at) for at in ats]

    def start_at(self, at: int) -> int:
        """Where the last token that starts at or before `at` starts; -1 if none does."""
        if self.encoding is None:
            token = int(self.starts.searchsorted(at, side="right")) - 1
            return int(self.starts[token]) if token >= 0 else -1
        token = bisect_right(self._tokens, at, key=self._start) - 1
        return self._start(token) if token >= 0 else -1

    def starts_at(self, ats: list[int]) -> list[int]:
        """`start_at` of each position, in one search where positions are known."""
        if self.encoding is not None:
            return [self.start_at(at) for at in ats]
        if not len(self.starts):
            return [-1] * len(ats)
        tokens = self.starts.searchsorted(ats, side="right") - 1
        return cast(list[int], np.where(tokens >= 0, self.starts[tokens], -1).tolist())

    @cached_property
    def starts(self) -> np.ndarray:
        return self._column(0)

    @cached_property
    def ends(self) -> np.ndarray:
        return self._column(1)

    @cached_property
    def is_control(self) -> np.ndarray:
        """Which tokens are added tokens (template control text)."""
        return self.table[self.ids]

    @property
    def control(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) of the control tokens."""
        return self.starts[self.is_control], self.ends[self.is_control]

    def _column(self, k: int) -> np.ndarray:
        assert self.encoding is not None
        pairs = self.encoding.offsets
        return np.fromiter(map(itemgetter(k), pairs), dtype=np.int64, count=len(pairs))


def encode_offsets(bundle: TokenizerBundle, text: str) -> TokenOffsets:
    """`text` encoded without special tokens, with where each token sits in it. Positions come
    from the ids' byte lengths where the tokenizer is byte-level BPE, its normalizer leaves
    this text as it is in any Unicode version (`is_stable`), and the bytes add up to the text's
    (no prefix space was added); from the tokenizer's offsets otherwise. Both give the same
    ids and positions (tests hold them equal)."""
    tokenizer = bundle.tokenizer
    table = added_table(tokenizer)
    lengths, form = _byte_level(tokenizer)
    if lengths is not None and tokenizer_threads_are_off() and is_stable(form, text):
        derived = _derived(tokenizer, table, lengths, text)
        if derived is not None:
            _LAST.offsets = derived
            return derived
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return TokenOffsets(np.asarray(encoding.ids, dtype=np.int32), table, encoding, text=text)


def encode_offsets_batch(bundle: TokenizerBundle, texts: list[str]) -> list[TokenOffsets | None]:
    """`encode_offsets` of each text whose positions come from its ids' byte lengths, all in
    one batched encode (the tokenizer lets go of the GIL once, not once per text: a chunk's
    threads wait less for each other); None for the others, which `encode_offsets` encodes."""
    tokenizer = bundle.tokenizer
    table = added_table(tokenizer)
    lengths, form = _byte_level(tokenizer)
    out: list[TokenOffsets | None] = [None] * len(texts)
    if lengths is None or not tokenizer_threads_are_off():
        return out
    picked = [k for k, text in enumerate(texts) if is_stable(form, text)]
    group = [texts[k] for k in picked]
    encodings = unnormalized(tokenizer).encode_batch_fast(group, add_special_tokens=False)
    for k, text, encoding in zip(picked, group, encodings, strict=True):
        if (derived := _positions(lengths, encoding, text)) is not None:
            ids, starts, ends = derived
            out[k] = TokenOffsets(ids, table, starts=starts, ends=ends, text=text)
    return out


def _derived(
    tokenizer: tokenizers.Tokenizer, table: np.ndarray, lengths: np.ndarray, text: str
) -> TokenOffsets | None:
    """`text`'s ids, positions from their byte lengths; the tokens before the last added token
    it shares with the thread's last rendering are that one's. None where the bytes do not add
    up to the text's."""
    last: TokenOffsets | None = getattr(_LAST, "offsets", None)
    if last is None or last.table is not table or not _cuts_at_added(tokenizer):
        last = None
    kept = _kept(last, text) if last is not None else 0
    cut = int(last.starts[kept]) if last is not None and kept else 0
    rest = text[cut:]
    [encoding] = unnormalized(tokenizer).encode_batch_fast([rest], add_special_tokens=False)
    derived = _positions(lengths, encoding, rest)
    if derived is None:
        return None
    ids, starts, ends = derived
    if last is not None and kept:  # the kept tokens, then the rest's, which starts with
        if ids[0] != last.ids[kept]:  # the shared added token
            return None
        ids = np.concatenate([last.ids[:kept], ids])
        starts = np.concatenate([last.starts[:kept], starts + cut])
        ends = np.concatenate([last.ends[:kept], ends + cut])
    return TokenOffsets(ids, table, starts=starts, ends=ends, text=text)


_LAST = threading.local()  # each thread's last derived encoding: `offsets`


def _positions(
    lengths: np.ndarray, encoding: tokenizers.Encoding, text: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(ids, starts, ends) of `encoding` of `text`, positions in characters from the bytes each
    id stands for; None where they do not add up to the text's."""
    ids = np.fromiter(encoding.ids, dtype=np.int32)
    sizes = lengths[ids]
    ends = np.cumsum(sizes)
    data = None if text.isascii() else text.encode("utf-8")
    if not len(ids) or ends[-1] != len(text if data is None else data):
        return None
    starts = ends - sizes
    if data is not None:  # byte positions -> character positions
        char_of = np.cumsum((np.frombuffer(data, np.uint8) & 0xC0) != 0x80) - 1
        starts, ends = char_of[starts], char_of[ends - 1] + 1
    return ids, starts, ends


def _kept(last: TokenOffsets, text: str) -> int:
    """How many of `last`'s tokens `text` has too: those before the last added token that
    both texts have whole at the same place (0 if none but the first)."""
    tokens = np.flatnonzero(last.is_control)
    start = last.text
    ends = last.ends[tokens].tolist()
    low, high = 0, len(tokens)  # how many added tokens the texts share, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(start[: ends[mid - 1]]):
            low = mid
        else:
            high = mid - 1
    return int(tokens[low - 1]) if low else 0


@cache
def _byte_level(tokenizer: tokenizers.Tokenizer) -> tuple[np.ndarray | None, Form]:
    """(bytes each id stands for, the Unicode form the normalizer puts text in, "" for none)
    of a byte-level BPE tokenizer, where every vocabulary token is written in the byte-level
    alphabet (a character per byte) but the added tokens; (None, "") for any other tokenizer."""
    form = normal_form(tokenizer)
    decoder = tokenizer.decoder
    added = tokenizer.get_added_tokens_decoder()
    if (
        form is None
        or not isinstance(tokenizer.model, tokenizers.models.BPE)
        or decoder is None
        or json.loads(decoder.__getstate__()).get("type") != "ByteLevel"
        # offsets that skip characters a token stands for: trimmed spaces, a space added in
        # front or an added token's stripped neighbours (which could even out the bytes)
        or _sets(tokenizer.post_processor, "trim_offsets")
        or _sets(tokenizer.pre_tokenizer, "add_prefix_space")
        or any(token.lstrip or token.rstrip for token in added.values())
    ):
        return None, ""
    vocab = tokenizer.get_vocab(with_added_tokens=False)  # some added tokens are in it (DeepSeek)
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
    sizes = np.fromiter(map(len, vocab), dtype=np.int32, count=len(vocab))
    plain = ~np.isin(ids, list(added))
    tokens = "".join(compress(vocab, plain.tolist()))
    if not set(tokens) <= set(pre_tokenizers.ByteLevel.alphabet()):
        return None, ""
    lengths = np.zeros(max([int(ids.max(initial=0)), *added]) + 1, dtype=np.int32)
    lengths[ids[plain]] = sizes[plain]
    for i, added_token in added.items():
        lengths[i] = len(added_token.content.encode("utf-8"))
    return lengths, form


@cache
def _cuts_at_added(tokenizer: tokenizers.Tokenizer) -> bool:
    """Whether the tokenizer cuts a text at every place an added token's text is, whatever is
    around it: no added token matches only as a whole word, and no two (or two copies of one)
    can overlap or hold one another, so no match depends on the text beyond the token."""
    added = tokenizer.get_added_tokens_decoder().values()
    contents = [token.content for token in added]
    if any(token.single_word or not token.content for token in added):
        return False
    prefixes = {c[:k] for c in contents for k in range(1, len(c))}
    for c in contents:
        if any(c[k:] in prefixes for k in range(1, len(c))):
            return False
        if any(c in other and c != other for other in contents):
            return False
    return True


def _sets(component: Any, option: str) -> bool:
    """Whether a tokenizer component, or any step of it, sets `option` true."""
    if component is None:
        return False

    def found(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get(option) is True or any(map(found, node.values()))
        return isinstance(node, list) and any(map(found, node))

    return found(json.loads(component.__getstate__()))


@cache
def added_table(tokenizer: tokenizers.Tokenizer) -> np.ndarray:
    """Lookup table id -> is an added token, for every id the tokenizer gives."""
    added = _added_ids(tokenizer)
    lengths = _byte_level(tokenizer)[0]
    if lengths is not None:  # it has every id already
        size = len(lengths)
    else:
        size = max([*tokenizer.get_vocab(with_added_tokens=True).values(), *added.tolist(), 0]) + 1
    table = np.zeros(size, dtype=bool)
    table[added] = True
    return table


@cache
def _added_ids(tokenizer: tokenizers.Tokenizer) -> np.ndarray:
    """Ids of the added tokens (`<|im_end|>`, `<think>`, ...): template control text."""
    return np.asarray(sorted(tokenizer.get_added_tokens_decoder()), dtype=np.int32)
