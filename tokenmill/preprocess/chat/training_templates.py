"""Chat templates under the user's control: the config's `chat_template` names a Jinja file or a
training template tokenmill ships, rendered in place of the tokenizer folder's own.

The shipped ones fix what a family's own template does to training data: it drops an earlier
turn's reasoning (Qwen3, DeepSeek-R1), or cannot render tool arguments given as objects
(DeepSeek-V3). Each renders exactly as the template it replaces wherever that one keeps
everything (tests hold them to it). The folder `chat_templates/` holds them, with their
sources and licences in its README.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from tokenmill.preprocess.chat.tokenizer import TokenizerBundle

FOLDER = Path(__file__).with_name("chat_templates")

# name -> (file in chat_templates/, what it changes)
TEMPLATES = {
    "qwen3-keep-reasoning": (
        "qwen3_keep_reasoning.jinja",
        "Qwen3's template with every assistant turn's reasoning kept (Qwen3 keeps only the"
        " turns after the last user query's)",
    ),
    "qwen3.5-keep-reasoning": (
        "qwen3_5_keep_reasoning.jinja",
        "Qwen3.5's template with every assistant turn's reasoning kept",
    ),
    "deepseek-r1-keep-reasoning": (
        "deepseek_r1_keep_reasoning.jinja",
        "DeepSeek-R1-Distill's template with the reasoning kept in every assistant turn (R1"
        " removes it) and tool calls rendered",
    ),
    "deepseek-v3-tools": (
        "deepseek_v3_tools.jinja",
        "DeepSeek-V3's template with tool-call arguments given as objects rendered as JSON"
        " (the original concatenates strings and fails on them)",
    ),
}


def resolve(value: str, base: Path | None = None) -> str:
    """A shipped name as it is, or the absolute path of a Jinja file (relative paths from
    `base`, the config file's folder, then the working directory); ValueError otherwise."""
    if value in TEMPLATES:
        return value
    path = Path(value).expanduser()
    for candidate in ([base / path] if base is not None and not path.is_absolute() else []) + [
        path
    ]:
        if candidate.is_file():
            return str(candidate.resolve())
    raise ValueError(
        f"{value!r} is neither a file nor a shipped template (one of {', '.join(TEMPLATES)})"
    )


def template_text(value: str) -> str:
    """The Jinja text `value` names (resolved: a shipped name or an absolute path)."""
    file = FOLDER / TEMPLATES[value][0] if value in TEMPLATES else Path(value)
    return file.read_text(encoding="utf-8")


def with_chat_template(bundle: TokenizerBundle, value: str | None) -> TokenizerBundle:
    """The bundle rendering with the template `value` names; the bundle itself for None."""
    if value is None:
        return bundle
    return dataclasses.replace(bundle, chat_template=template_text(value))


def template_name(bundle: TokenizerBundle, value: str | None) -> str:
    """How errors, `tokenmill show` and the manifest name the template that rendered."""
    if value is None:
        return f"the tokenizer's own, {Path(bundle.path).name}"
    return value if value in TEMPLATES else Path(value).name


def template_identity(bundle: TokenizerBundle, value: str | None) -> dict[str, str]:
    """Name and sha256 of the rendering template: part of a run's identity and its manifest."""
    text = (bundle.chat_template or "") if value is None else template_text(value)
    return {
        "name": template_name(bundle, value),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
