"""PipelineConfig: the declarative description of one preprocessing job.

First stage of the flow: it says which record fields become which output keys
and which roles train. Validation is strict so that a typo fails before any
work, with the dotted path of the bad field and the valid choices.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tokenmill.preprocess.chat.training_templates import TEMPLATES, resolve
from tokenmill.preprocess.packing import PackingStrategy, PositionIdsMode
from tokenmill.shards.format import DtypeName, StorageFormat

Action = Literal["train", "mask", "$role", "value"]


RoleAction = Literal["train", "mask"]


TruncationMode = Literal["auto", "none", "latest_turns", "cut_prompt", "keep_start", "keep_end"]


DEFAULT_MASK: dict[str, RoleAction] = {"system": "mask", "user": "mask", "assistant": "train"}


KNOWN_ROLES = ("system", "user", "assistant", "tool")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the dotted path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Section(_Strict):
    """One record field turned into tokens (or copied, for `action: value`)."""

    field: str = Field(description="record key to read (dotted for nested keys)")
    action: Action = Field(
        "train",
        description="train, mask, $role (per chat message, from `mask`), or value (copy the raw number(s), no tokens)",
    )
    template: bool = Field(
        False, description="render chat messages through the tokenizer's chat template"
    )
    add_special_tokens: bool | None = Field(
        None,
        description="prepend BOS to a text section; default: true for the first section when it is text",
    )
    generation_prompt: bool = Field(
        False, description="append the template's generation prompt (masked): GRPO prompts"
    )
    eos: bool = Field(
        False, description="append the tokenizer's EOS token, with the section's action"
    )
    prefix: str = Field(
        "",
        description="text put before a text section's value (Alpaca's input after its instruction: a newline)",
    )
    optional: bool = Field(
        False, description="a record without this field (or with null) skips the section"
    )
    train_spans: Literal["turn", "roles", "generation"] = Field(
        "turn",
        description=(
            "what a trained message trains in a chat: turn (its content, tool calls and"
            " end-of-turn; the role header masked, as TRL's training templates mark it), roles"
            " (the whole span it adds to the rendering, header included: the older rule) or"
            " generation (exactly the template's {% generation %} blocks, as transformers'"
            " return_assistant_tokens_mask)"
        ),
    )
    train_turns: Literal["all", "last"] = Field(
        "all",
        description=(
            "which trained messages train: all, or only the last turn's (those after the last"
            " user message; earlier turns masked, as LLaMA-Factory's mask_history)"
        ),
    )
    message_train_field: str | None = Field(
        "train",
        description=(
            "message key whose true/false overrides its role's action (axolotl's"
            " message_field_training); null: roles alone decide"
        ),
    )
    tools_field: str | None = Field(
        "tools",
        description="record field with the tool schemas a chat template renders (absent: none)",
    )
    template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments for the chat template, e.g. {enable_thinking: false}",
    )

    @model_validator(mode="after")
    def _check(self) -> Section:
        if self.action == "$role" and not self.template:
            raise ValueError('action "$role" needs template: true (roles come from chat messages)')
        if self.action == "value" and (self.template or self.eos):
            raise ValueError('action "value" copies the raw value: template and eos must be false')
        if self.prefix and (self.template or self.action == "value"):
            raise ValueError("prefix is for text sections (template: false, not action: value)")
        if self.generation_prompt and not self.template:
            raise ValueError("generation_prompt needs template: true")
        if self.train_spans == "generation" and not self.template:
            raise ValueError("train_spans: generation needs template: true")
        if self.train_spans == "generation" and self.train_turns != "all":
            raise ValueError("train_turns: the template's generation blocks decide what trains")
        return self


class Source(_Strict):
    """One output key of multi-output data (DPO chosen/rejected, GRPO prompts/responses/rewards)."""

    sections: list[Section] = Field(
        min_length=1, description="sections concatenated into this output key"
    )
    list_field: bool = Field(
        False,
        description="the field is a list; each element becomes its own token array (GRPO responses)",
    )
    mask_key: str | None = Field(
        None,
        description="name of the stored mask; default `<output_key>_mask` when some tokens are masked",
    )

    @model_validator(mode="after")
    def _check(self) -> Source:
        values = [s.action == "value" for s in self.sections]
        if any(values) and len(self.sections) != 1:
            raise ValueError(
                'a source with an "action: value" section must have exactly that one section'
            )
        if self.list_field and len(self.sections) != 1:
            raise ValueError("list_field: true needs exactly one section (the list field)")
        return self


class InputConfig(_Strict):
    sections: list[Section] = Field(
        default_factory=list,
        description="single-output data: sections concatenated into `sequence`",
    )
    sources: dict[str, Source] | None = Field(
        None,
        description="multi-output data (DPO, GRPO): output key -> source; `sections` is then ignored",
    )
    columns: dict[str, list[str]] = Field(
        default_factory=dict,
        description=(
            "field -> the record keys that may hold it, the first a record has winning:"
            " {messages: [messages, conversations]} (LLaMA-Factory's columns, axolotl's"
            " field_messages); a key alone stands for a list of one"
        ),
    )
    message_fields: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "message property -> the message key holding it: {role: from, content: value}"
            " (axolotl's message_property_mappings, LLaMA-Factory's role_tag / content_tag)"
        ),
    )
    roles: dict[str, list[str]] = Field(
        default_factory=dict,
        description=(
            "role -> the names records give it: {assistant: [gpt, model], tool: [observation]}"
            " (LLaMA-Factory's user_tag, assistant_tag, ...; axolotl's roles)"
        ),
    )
    text_unit: Literal["file", "line"] = Field(
        "file",
        description="what one record of a .txt input is: the whole file, or each line (as {text})",
    )
    shared_prompt: str | None = Field(
        None,
        description=(
            "preference data: when a record has no field of this name, the longest prefix its"
            " sources share (messages, or text) becomes it, as TRL extracts an implicit prompt"
        ),
    )

    @field_validator("columns", "roles", mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: [v] if isinstance(v, str) else v for k, v in value.items()}
        return value

    def all_sections(self) -> list[Section]:
        """Every section: the single output's, then each source's."""
        sources = (self.sources or {}).values()
        return [*self.sections, *(s for source in sources for s in source.sections)]

    @model_validator(mode="after")
    def _check(self) -> InputConfig:
        if not self.sources and not self.sections:
            raise ValueError("give input.sections (single output) or input.sources (multi-output)")
        if any(s.action == "value" for s in self.sections):
            raise ValueError('"action: value" is only valid inside input.sources')
        return self


HOOK = re.compile(r"^([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_]\w*$")  # module, or a .py file


class Validation(_Strict):
    """The held-out split: a fixed rule of each record, so no worker count, engine or rerun
    moves a record from one split to the other (document/cleaning.py)."""

    fraction: float = Field(gt=0, lt=1, description="share of records held out, about")
    by: Literal["document", "record"] = Field(
        "document",
        description=(
            "document: a hash of the record's normalized text (copies of a text share a split);"
            " record: a hash of its input file (relative to `root`) and line"
        ),
    )
    seed: int = Field(0, ge=0, description="another seed, another split")
    root: str | None = Field(
        None,
        description=(
            "by record: the folder input files are named relative to; default: the folder"
            " holding every input file"
        ),
    )


class Preprocessing(_Strict):
    max_seq_len: int = Field(
        2048,
        gt=0,
        description=(
            "tokens a record may keep (per output for multi-output data), cut as"
            " truncation_mode says; plain text under auto is never cut"
        ),
    )
    min_chars: int = Field(
        50,
        ge=0,
        description="records with fewer text characters are skipped and counted (too_short)",
    )
    max_chars: int = Field(
        2_000_000,
        gt=0,
        description="records with more text characters are skipped and counted (too_long)",
    )
    max_items: int | None = Field(None, gt=0, description="stop after reading this many records")
    batch_size: int = Field(
        256, gt=0, description="records per chunk of work; packing pools never cross chunks"
    )
    task_bytes: int = Field(
        128 << 20,
        gt=0,
        description=(
            "input bytes per task: a task reads its files (a plain .jsonl file larger than this"
            " is split by byte ranges) and writes its own shards, so shards end at task ends"
        ),
    )
    packing_strategy: Literal["none", PackingStrategy] = Field(
        "simple",
        description=(
            "none (a record per row), simple (in order), bfd (best-fit decreasing), bfd_split"
            " (bfd, long records split), stream (in order, rows filled to max_packed_len, a"
            " record continues in the next row: nothing is dropped)"
        ),
    )
    max_packed_len: int = Field(8192, gt=0, description="token budget of one packed row")
    truncation_mode: TruncationMode = Field(
        "auto",
        description=(
            "what a record longer than max_seq_len keeps: latest_turns (system prompt and the"
            " latest complete turns that fit), cut_prompt (the prompt's end is cut for the"
            " response), keep_start, keep_end, or none (nothing is cut); auto: latest_turns for"
            " chats, cut_prompt for prompt + response, none for plain text. Cuts are counted"
        ),
    )
    map: str | None = Field(
        None,
        description=(
            "module:function or file.py:function, record dict -> record dict: what is"
            " tokenized (run in the workers, before the split and the filter)"
        ),
    )
    filter: str | None = Field(
        None,
        description=(
            "module:function or file.py:function, record dict -> bool (after `map`): False"
            " drops the record, counted as filtered"
        ),
    )
    validation: Validation | None = Field(
        None,
        description="hold out a validation split: OUT/train and OUT/validation (see below)",
    )
    dedup: Literal["none", "exact"] = Field(
        "none",
        description="exact: a record whose normalized text came before is dropped (duplicate)",
    )

    @field_validator("map", "filter")
    @classmethod
    def _hook(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A hook in a .py file is named relative to the config file, as chat_template is:
        made absolute here, so every worker imports the same file."""
        if value is None:
            return None
        if not HOOK.match(value):
            raise ValueError(
                "expected module:function (such as mypkg.clean:keep) or file.py:function "
                f"(such as hooks.py:keep, relative to the config file), got {value!r}"
            )
        where, _, function = value.rpartition(":")
        base = (info.context or {}).get("base")
        if where.endswith(".py") and base is not None and not Path(where).is_absolute():
            return f"{(Path(base) / where).resolve()}:{function}"
        return value


class OutputConfig(_Strict):
    domain_key: str | None = Field(
        None, description="record field whose value names the domain subfolder"
    )
    storage_format: StorageFormat = Field(
        "bin", description="bin (memory-mapped shards) or jsonl (one output record per line)"
    )
    max_tokens_per_shard: int = Field(
        100_000_000,
        gt=0,
        description="a shard rolls before it would exceed this many tokens of the primary key",
    )
    dtype: dict[str, DtypeName] = Field(
        default_factory=dict, description="per-key dtype override, e.g. {sequence: uint32}"
    )
    position_ids_mode: PositionIdsMode = Field(
        "doc_reset",
        description="none, doc_reset (restart at each document), continuous (count through a row)",
    )


class PipelineConfig(_Strict):
    version: Literal[1] = Field(1, description="config format version")
    input: InputConfig = Field(description="which record fields become which output keys")
    mask: dict[str, RoleAction] = Field(
        default_factory=lambda: dict(DEFAULT_MASK),
        description="role -> train or mask, for `$role` sections",
    )
    mask_default: RoleAction = Field(
        "mask", description="action of a known role not listed in `mask`"
    )
    chat_template: str | None = Field(
        None,
        description=(
            "the chat template to render with, in place of the tokenizer folder's own: a Jinja"
            " file (relative to the config file) or a shipped training template"
            f" ({', '.join(TEMPLATES)})"
        ),
    )
    preprocessing: Preprocessing = Field(
        default_factory=Preprocessing, description="lengths, filters, packing"
    )
    output: OutputConfig = Field(
        default_factory=lambda: OutputConfig(), description="where and how shards are written"
    )

    @field_validator("mask")
    @classmethod
    def _roles(cls, mask: dict[str, str]) -> dict[str, str]:
        for role in mask:
            if not role or not isinstance(role, str):
                raise ValueError("role names must be non-empty strings")
        return mask

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None, info: ValidationInfo) -> str | None:
        base = (info.context or {}).get("base")
        return None if value is None else resolve(value, base)

    @model_validator(mode="before")
    @classmethod
    def _plain_text_streams(cls, data: Any) -> Any:
        """A plain-text config (one text section: no chat template, no sources) that names no
        packing strategy streams, as the seq preset does: pretraining keeps every token
        (simple packing would cut each document past max_packed_len)."""
        if not isinstance(data, dict):
            return data
        given, pre = data.get("input"), data.get("preprocessing", {})
        if not isinstance(given, dict) or not isinstance(pre, dict) or given.get("sources"):
            return data
        sections = given.get("sections")
        plain = (
            isinstance(sections, list)
            and len(sections) == 1
            and isinstance(sections[0], dict)
            and not sections[0].get("template")
        )
        if plain and "packing_strategy" not in pre:
            return {**data, "preprocessing": {**pre, "packing_strategy": "stream"}}
        return data

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if self.preprocessing.min_chars > self.preprocessing.max_chars:
            raise ValueError("preprocessing.min_chars is larger than preprocessing.max_chars")
        return self

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls, data: Any, origin: str = "config", base: Path | None = None
    ) -> PipelineConfig:
        try:
            return cls.model_validate(data, context={"base": base})
        except ValidationError as err:
            raise ConfigError(format_errors(err, origin)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> PipelineConfig:
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise ConfigError(
                f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {err}"
            ) from None
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k != "tokenizer_path"}
        return cls.from_dict(data, origin=str(path), base=path.parent)

    # --- derived facts ----------------------------------------------------------------
    @property
    def multi_output(self) -> bool:
        return bool(self.input.sources)

    def all_sections(self) -> list[Section]:
        """Every section of the input (InputConfig.all_sections)."""
        return self.input.all_sections()

    def role_trains(self, role: str) -> bool:
        return self.mask.get(role, self.mask_default) == "train"

    def known_roles(self) -> set[str]:
        return set(KNOWN_ROLES) | set(self.mask)

    def dump(self) -> dict[str, Any]:
        """The config as JSON data, less the keys added since v1 that hold their defaults: a
        config that uses none of them keeps its fingerprint and its manifest's bytes."""
        data = self.model_dump(mode="json")
        for key, default in LATER_DEFAULTS.items():
            if data["preprocessing"].get(key) == default:
                del data["preprocessing"][key]
        return data

    def canonical_json(self) -> str:
        return json.dumps(self.dump(), sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


LATER_DEFAULTS: dict[str, Any] = {"map": None, "filter": None, "validation": None, "dedup": "none"}


def format_errors(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        path = ""
        for part in e["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif str(part).startswith(("literal[", "function-")) or part in {"str", "int"}:
                continue
            else:
                path += ("." if path else "") + str(part)
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        lines.append(f"{origin}: {path or '<root>'}: {msg}")
    return "\n".join(lines)


def config_reference() -> str:
    """The config reference (docs/config.md), generated from the model so it cannot go stale."""
    parts = [
        (PipelineConfig, ""),
        (InputConfig, "input."),
        (Section, "input.sections[]."),
        (Source, "input.sources.<output_key>."),
        (Preprocessing, "preprocessing."),
        (Validation, "preprocessing.validation."),
        (OutputConfig, "output."),
    ]
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for model, prefix in parts:
        for name, info in model.model_fields.items():  # type: ignore[attr-defined]
            kind = str(info.annotation).replace("typing.", "").replace(f"{__name__}.", "")
            kind = re.sub(r"<class '(\w+)'>", r"\1", kind).replace("|", "\\|")
            if info.is_required():
                default = "required"
            elif info.default_factory is not None:
                value = info.default_factory()  # type: ignore[call-arg]
                default = "see below" if isinstance(value, BaseModel) else repr(value)
            else:
                default = repr(info.default)
            rows.append(f"| `{prefix}{name}` | `{kind}` | `{default}` | {info.description or ''} |")
    return "\n".join(rows) + "\n"
