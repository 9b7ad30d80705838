"""A local Hugging Face tokenizer folder: the tokenizer, its chat template, its special tokens.

Loaded once per process; `TokenizerBundle.fingerprint` enters the run's identity, and
`encode_text` is how plain text becomes ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import groupby
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import tokenizers

Form = Literal["", "NFC", "NFD", "NFKC", "NFKD"]  # "": no normalizer

# The named special tokens a template can read, as transformers passes them.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class TokenizerBundle:
    """A loaded tokenizer folder: the tokenizer, its chat template and special tokens."""

    tokenizer: tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str | None
    bos_id: int | None
    eos_token: str | None
    eos_id: int | None
    pad_id: int | None
    fingerprint: str
    path: str
    # (name, text) of every named special token the config sets; the template sees these.
    special_tokens: tuple[tuple[str, str], ...] = ()
    # tokenizer_config.json's add_bos_token: plain text gets a BOS only when this is set
    add_bos_token: bool = False


# Words a BPE model keeps merged: `tokenizers` keeps 10,000 and caches no new word once it is
# full, so a corpus with more distinct words merges the rest again at every occurrence. This
# many costs about 19 MiB per process and about 5% of a run's time on the shipped samples.
BPE_CACHE_WORDS = 100_000


def empty_word_cache(tokenizer: tokenizers.Tokenizer) -> None:
    """A run starts with no merged words cached, as in a fresh process: the cache takes no new
    word once full, so the words of a run before (same process, same tokenizer, loaded once)
    would crowd out this run's."""
    clear = getattr(tokenizer.model, "_clear_cache", None)  # BPE models: private, pinned version
    if clear is not None:
        clear()


def load_tokenizer(path: str | Path) -> TokenizerBundle:
    """Load `tokenizer.json` + `tokenizer_config.json` from a folder, or from the local
    Hugging Face cache's copy of a Hub name (`tokenizer_folder`), once per process."""
    return _load_folder(str(tokenizer_folder(path).resolve()))


# A Hub name, ORG/NAME, then @REVISION (a branch, tag or commit hash) if any
_HUB_NAME = re.compile(r"(?P<repo>\w[\w.-]*/\w[\w.-]*)(?:@(?P<revision>[^@]+))?")
_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def tokenizer_folder(path: str | Path) -> Path:
    """The folder a tokenizer loads from: `path` itself where it exists or is no Hub name, else
    the snapshot of ORG/NAME[@REVISION] in the local Hugging Face cache, found the way
    huggingface_hub finds it offline (never a network call: tokenmill downloads nothing)."""
    folder = Path(path)
    match = _HUB_NAME.fullmatch(str(path))
    if match is None or folder.exists():
        return folder.absolute()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    repo, revision = match["repo"], match["revision"] or "main"
    cache, chosen_by = hub_cache()
    try:
        found = snapshot_download(
            repo,
            revision=revision,
            cache_dir=cache,
            local_files_only=True,
            allow_patterns=_TOKENIZER_FILES,  # a tokenizer-only download is complete
        )
    except IncompleteSnapshotError:
        raise
    except LocalEntryNotFoundError:
        stored = cache / f"models--{repo.replace('/', '--')}"
        where = [stored / "snapshots" / revision]
        if not re.fullmatch(r"[0-9a-f]{40}", revision):  # a ref names its commit in refs/
            where = [stored / "refs" / revision, stored / "snapshots"]
        raise FileNotFoundError(
            f"tokenizer {str(path)!r}: no such folder ({folder.absolute()}), and no copy in the "
            f"Hugging Face cache {cache} ({chosen_by}): searched "
            + ", ".join(str(p) for p in where)
            + f". tokenmill never downloads: fetch it first (`hf download {repo}`), or set "
            "HF_HUB_CACHE to the cache that holds it"
        ) from None
    return Path(found)


def hub_cache() -> tuple[Path, str]:
    """The Hugging Face hub cache folder and what chose it, as huggingface_hub chooses, read
    now (huggingface_hub reads the environment once, on import): $HF_HUB_CACHE, else
    $HUGGINGFACE_HUB_CACHE (its older name), else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    for variable, tail in (
        ("HF_HUB_CACHE", ""),
        ("HUGGINGFACE_HUB_CACHE", ""),
        ("HF_HOME", "hub"),
        ("XDG_CACHE_HOME", "huggingface/hub"),
    ):
        value = os.environ.get(variable)
        if value:
            return Path(os.path.expandvars(value)).expanduser() / tail, f"${variable}"
    return Path.home() / ".cache" / "huggingface" / "hub", "the default"


@cache
def _load_folder(folder: str) -> TokenizerBundle:
    tokenizer_file = Path(folder) / "tokenizer.json"
    config_file = Path(folder) / "tokenizer_config.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file}: not found (expected a Hugging Face tokenizer)")
    raw = tokenizer_file.read_bytes()
    try:
        tokenizer = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"{tokenizer_file}: cannot load tokenizer: {exc}") from exc
    resize = getattr(tokenizer.model, "_resize_cache", None)  # BPE models: private, pinned version
    if resize is not None:
        resize(BPE_CACHE_WORDS)
    config: dict[str, Any] = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_file}: invalid JSON: {exc}") from exc
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name), config_file, name)
        if text is not None:
            special[name] = text
    template = _chat_template(config, config_file)
    ids = {
        name: _token_id(tokenizer, special[name], config_file, name)
        for name in ("bos_token", "eos_token", "pad_token")
        if name in special
    }
    add_bos = config.get("add_bos_token") is True
    digest = hashlib.sha256(raw)
    digest.update((template or "").encode("utf-8"))
    if add_bos:
        digest.update(b"\0add_bos_token")
    return TokenizerBundle(
        tokenizer=tokenizer,
        chat_template=template,
        bos_token=special.get("bos_token"),
        bos_id=ids.get("bos_token"),
        eos_token=special.get("eos_token"),
        eos_id=ids.get("eos_token"),
        pad_id=ids.get("pad_token"),
        fingerprint=digest.hexdigest(),
        path=folder,
        special_tokens=tuple(special.items()),
        add_bos_token=add_bos,
    )


def _token_text(value: Any, config_file: Path, name: str) -> str | None:
    """A special token is null, a string, or an AddedToken dict with its text in `content`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{config_file}: {name}: expected a string or AddedToken dict, got {value!r}")


def _token_id(tokenizer: tokenizers.Tokenizer, text: str, config_file: Path, name: str) -> int:
    token_id = tokenizer.token_to_id(text)
    if token_id is None:
        raise ValueError(f"{config_file}: {name} {text!r} is not in the tokenizer's vocabulary")
    return token_id


def _chat_template(config: dict[str, Any], config_file: Path) -> str | None:
    """chat_template.jinja wins over the config entry, as in transformers."""
    jinja_file = config_file.with_name("chat_template.jinja")
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{config_file}: chat_template: expected a string or a list with a 'default'")


def encode_text(
    bundle: TokenizerBundle, text: str, add_special_tokens: bool, ids: list[int] | None = None
) -> np.ndarray:
    """Token ids of plain text, with special tokens as the tokenizer's own `encode` puts them:
    its tokenizer.json post-processor, and one leading BOS only where tokenizer_config.json
    sets `add_bos_token` (as transformers does). A GPT-2-style folder that names a BOS token
    but does not add it gets none. `ids`: the same text's encoding, preencoded in a batch (chunks.py)."""
    if ids is None and tokenizer_threads_are_off():  # the same ids, without offsets
        [encoding] = encode_fast(bundle.tokenizer, [text], add_special_tokens)
        ids = encoding.ids
    elif ids is None:
        ids = bundle.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    if add_special_tokens and bundle.add_bos_token and bundle.bos_id is not None:
        if ids[:1] != [bundle.bos_id]:
            ids = [bundle.bos_id, *ids]
    return np.asarray(ids, dtype=np.int32)


@cache
def normal_form(tokenizer: tokenizers.Tokenizer) -> Form | None:
    """The Unicode form the normalizer puts text in ("" for none); None for one that does more."""
    normalizer = tokenizer.normalizer
    if normalizer is None:
        return ""
    state = json.loads(normalizer.__getstate__())
    steps = state.get("normalizers", []) if state.get("type") == "Sequence" else [state]
    forms = {step.get("type") for step in steps}
    if not forms:
        return ""
    form = forms.pop() if len(forms) == 1 else None
    return cast(Form, form) if form in ("NFC", "NFD", "NFKC", "NFKD") else None


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def is_stable(form: Form, text: str) -> bool:
    """Whether a normalizer to `form` leaves `text` as it is, whatever Unicode version the
    tokenizer's tables are: normalized by Python's, and every character assigned in them
    (Unicode's stability policy: a normalized string of assigned characters stays normalized
    in every later version; a character Python does not know could be a newer mark)."""
    if not form or text.isascii():
        return True
    return unicodedata.is_normalized(form, text) and all(
        unicodedata.category(c) != "Cn" for c in set(_NON_ASCII.findall(text))
    )


@cache
def unnormalized(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """The tokenizer without its normalizer, on the same model (vocabulary, merges, cache: no
    second copy in memory): for a text the normalizer leaves as it is (`is_stable`) the same
    ids, without the normalizer's pass over every character. The tokenizer itself where it
    has no normalizer, or cuts or pads, or where the copy's added tokens would differ or match
    differently (one matched on normalized text whose own text is not in the normal form)."""
    form = normal_form(tokenizer)
    added = tokenizer.get_added_tokens_decoder()
    if (
        not form
        or tokenizer.truncation is not None
        or tokenizer.padding is not None
        # an added token matched on normalized text whose own text the normalizer changes
        or any(t.normalized and not is_stable(form, t.content) for t in added.values())
    ):
        return tokenizer
    plain = tokenizers.Tokenizer(tokenizer.model)
    plain.pre_tokenizer, plain.decoder = tokenizer.pre_tokenizer, tokenizer.decoder
    plain.post_processor = tokenizer.post_processor
    plain.encode_special_tokens = tokenizer.encode_special_tokens
    for special, group in groupby(sorted(added.items()), key=lambda item: item[1].special):
        tokens = [token for _, token in group]  # in id order: they take the same ids
        if special:
            plain.add_special_tokens(tokens)
        else:
            plain.add_tokens(tokens)
    same = plain.get_added_tokens_decoder() == added
    if not same or plain.get_vocab_size() != tokenizer.get_vocab_size():
        return tokenizer
    return plain


def encode_fast(
    tokenizer: tokenizers.Tokenizer, texts: list[str], add_special_tokens: bool
) -> list[tokenizers.Encoding]:
    """`encode_batch_fast` (no offsets), with each text its normalizer leaves as it is encoded
    without it (`unnormalized`): the same ids, in the same order."""
    plain = unnormalized(tokenizer)
    form = normal_form(tokenizer)
    if plain is tokenizer or not form:
        return tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    stable = [is_stable(form, text) for text in texts]
    encodings: dict[int, tokenizers.Encoding] = {}
    for encoder, flag in ((plain, True), (tokenizer, False)):
        picked = [k for k, s in enumerate(stable) if s is flag]
        if picked:
            group = [texts[k] for k in picked]
            encodings.update(
                zip(picked, encoder.encode_batch_fast(group, add_special_tokens=add_special_tokens))
            )
    return [encodings[k] for k in range(len(texts))]


_PARALLELISM = "TOKENIZERS_PARALLELISM"


def tokenizer_threads_are_off() -> bool:
    """Whether TOKENIZERS_PARALLELISM turns the tokenizer's own threads off here, as in a run's
    workers. Only then does a one-text `encode_batch_fast` replace `encode` (without offsets
    it costs a tenth less): with them on it would start their pool, and a process forked
    after that (a DataLoader worker) would warn and lose it."""
    value = os.environ.get(_PARALLELISM)
    return value is not None and value.lower() in ("", "off", "false", "f", "no", "n", "0")


_OFF_LOCK = threading.Lock()
_off_runs = 0  # runs in this process that turned the tokenizer's threads off
_off_saved: str | None = None  # the value before the first of them


@contextlib.contextmanager
def tokenizer_threads_off() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM false in this process while any run's threads encode (a batched
    encode would hand each text to the tokenizer's own threads), its value back after the last."""
    global _off_runs, _off_saved
    with _OFF_LOCK:
        if _off_runs == 0:
            _off_saved = os.environ.get(_PARALLELISM)
        _off_runs += 1
        os.environ[_PARALLELISM] = "false"
    try:
        yield
    finally:
        with _OFF_LOCK:
            _off_runs -= 1
            if _off_runs == 0:
                if _off_saved is None:
                    os.environ.pop(_PARALLELISM, None)
                else:
                    os.environ[_PARALLELISM] = _off_saved
