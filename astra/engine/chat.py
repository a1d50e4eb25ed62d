"""A model's chat template, read from its directory and rendered as transformers renders it.

A Hugging Face directory carries its template in `chat_template.jinja` (newer
transformers) or in tokenizer_config.json's `chat_template` (a string, or a
list of named templates of which "default" is used). `ChatTemplate.render`
turns a list of messages (`{"role": ..., "content": ...}`) into the prompt
text, with `add_generation_prompt` (the assistant's turn opened, as
`apply_chat_template(..., add_generation_prompt=True)` does), in a sandboxed
Jinja environment with the same helpers (`raise_exception`, `tojson`,
`strftime_now`, loop controls) and the tokenizer's special tokens as variables
(`bos_token`, `eos_token`...). Encoding the text with `HFTokenizer.encode` (no
special tokens added) gives the ids `apply_chat_template(tokenize=True)` gives.

Who applies it: only chat-shaped workflows (the built-in `chat`, or any that
calls `WorkflowContext.chat_prompt_ids`); `single_turn` and the others feed
the prompt text as it is. The built-in char tokenizer has no template.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from astra.errors import FailedPrecondition

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _fail(path: Path, what: str, reason: str) -> FailedPrecondition:
    return FailedPrecondition(f"{path}: {what}", reason=reason, metadata={"path": str(path)})


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str = "") -> None:
        import jinja2
        import jinja2.ext
        import jinja2.meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens)
        self._template = env.from_string(source)
        # the variables the template reads (`tools` among them when it supports tool calls)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))

    def render(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        """The prompt text of `messages`, the assistant's turn opened; `variables` reach the
        template too (say, `enable_thinking=False` for Qwen3)."""
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                **self.special_tokens,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template {self.origin}: {exc}") from exc


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(directory: str | os.PathLike[str]) -> ChatTemplate | None:
    """The directory's chat template, None when it has none; a damaged one raises
    FailedPrecondition naming the file."""
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _fail(config_path, f"not valid JSON: {exc}", "BAD_TOKENIZER_CONFIG") from None
    source, origin = None, config_path
    if (directory / TEMPLATE_FILE).is_file():
        source, origin = (directory / TEMPLATE_FILE).read_text(), directory / TEMPLATE_FILE
    else:
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str) or not source.strip():
        raise _fail(origin, "chat_template is not a template string", "BAD_CHAT_TEMPLATE")
    tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    try:
        return ChatTemplate(source, tokens, str(origin))
    except Exception as exc:  # jinja2.TemplateSyntaxError and kin
        raise _fail(
            origin,
            f"chat template does not compile: {type(exc).__name__}: {exc}",
            "BAD_CHAT_TEMPLATE",
        ) from None


def has_chat_template(model: str) -> bool:
    """Whether `model` (`tiny` or a directory) carries a chat template; reads files only."""
    if model == "tiny":
        return False
    directory = Path(model)
    if (directory / TEMPLATE_FILE).is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))


def user_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """The conversation of a one-turn prompt: an optional system message, then the user's."""
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt}]


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], **variables: Any) -> str:
    """`messages` through the tokenizer's chat template; a tokenizer without one raises
    ValueError saying what to do."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError(
            "this model's tokenizer has no chat template (chat_template.jinja or "
            "tokenizer_config.json `chat_template`); use a completion-style workflow "
            "such as single_turn, or add a template to the model directory"
        )
    return template.render(messages, **variables)
