"""Chat-template options: a template file overriding the model's, keyword arguments, a row's tools.

``messages`` rows are rendered by the tokenizer's chat template (Jinja).  A run may override the template
(``chat_template``: a file) and give it keyword arguments (``chat_template_kwargs``, e.g.
``{"enable_thinking": false}``); a row may add its own (a ``chat_template_kwargs`` column, merged over the
run's) and a ``tools`` column (a list of JSON-schema objects, the template's ``tools`` variable).
:class:`ChatTemplate` holds the run's part; the store's tokenizer identity records it (:meth:`ChatTemplate.identity`),
and a row's part is in the input fingerprint (it hashes every column), so a resume with other values is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daskgen.errors import ConfigError, InputError
from daskgen.input.image_refs import template_messages

#: Row columns this module reads.
ROW_KEYS = ("chat_template_kwargs", "tools")
#: Keyword arguments of ``apply_chat_template`` that are not template variables (they change what it returns).
NOT_TEMPLATE_VARIABLES = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"}
)  # fmt: skip


@dataclass(frozen=True)
class ChatTemplate:
    """The run's chat-template options.

    Attributes
    ----------
    text:
        Template text overriding the tokenizer's (read from the ``chat_template`` file), or ``None``.
    kwargs:
        Template variables of every row (``chat_template_kwargs``); a row's own override them key by key.
    """

    text: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, path: str | Path | None, kwargs: Any) -> ChatTemplate:
        """The options of a run's ``chat_template`` file and ``chat_template_kwargs``; :class:`ConfigError`
        naming the setting and the fix when the file is unreadable or not a template, or ``kwargs`` is not a mapping."""
        problem = kwargs_problem(kwargs or {})
        if problem:
            raise ConfigError(f"setting 'chat_template_kwargs': {problem}.")
        return cls(None if path is None else read_template(Path(path)), dict(kwargs or {}))

    @property
    def is_default(self) -> bool:
        """True when the run renders with the tokenizer's template and no variables."""
        return self.text is None and not self.kwargs

    def identity(self) -> dict[str, Any]:
        """What a resume must share, added to the tokenizer identity (nothing when :attr:`is_default`)."""
        out: dict[str, Any] = {}
        if self.text is not None:
            out["chat_template_override_sha256"] = hashlib.sha256(self.text.encode()).hexdigest()[:16]
        if self.kwargs:
            out["chat_template_kwargs"] = self.kwargs
        return out

    def ids(self, tokenizer: Any, row: dict[str, Any], number: int) -> list[int]:
        """Token ids of a ``messages`` row (``number``: its index in the input, for errors)."""
        if self.text is None and getattr(tokenizer, "chat_template", None) is None:
            raise InputError(
                f"row {number}: column 'messages' needs a chat template, but the model's tokenizer has none; "
                "use 'prompt' strings, a model with a chat template, or give one with the chat_template setting."
            )
        options = self._options(row)
        if options and not hasattr(tokenizer, "get_chat_template"):  # the simulated engine's byte tokenizer
            raise InputError(
                f"row {number}: chat-template options {sorted(options)} need the model's Hugging Face tokenizer, "
                "found the simulated engine's byte tokenizer (the model is no folder with tokenizer files), which "
                "has no template. Give a model folder with tokenizer files, or drop the chat_template and "
                "chat_template_kwargs settings and the row's chat_template_kwargs/tools."
            )
        import jinja2

        try:
            messages = template_messages(row["messages"])  # image parts as the template's {"type": "image"}
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **options)
        except jinja2.TemplateError as exc:
            raise InputError(
                f"row {number}: the chat template failed on this row ({type(exc).__name__}: {exc}); fix the row's "
                "messages/tools/chat_template_kwargs or the template."
            ) from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _options(self, row: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of ``apply_chat_template`` for ``row``: template, variables, tools."""
        options: dict[str, Any] = {**self.kwargs, **(row.get("chat_template_kwargs") or {})}
        if self.text is not None:
            options["chat_template"] = self.text
        if row.get("tools") is not None:
            options["tools"] = row["tools"]
        return options


def read_template(path: Path) -> str:
    """The template text of ``path``, checked to parse as Jinja; :class:`ConfigError` naming the file and the fix."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"setting 'chat_template': cannot read {str(path)!r} ({exc}); give the path of a UTF-8 text file "
            "holding a Jinja chat template."
        ) from exc
    import jinja2
    import jinja2.ext

    try:
        jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            f"setting 'chat_template': {str(path)!r} is not a valid Jinja template (line {exc.lineno}: {exc.message}); "
            "fix the template or point the setting at another file."
        ) from exc
    if not text.strip():
        raise ConfigError(
            f"setting 'chat_template': {str(path)!r} is empty; give a file holding a Jinja chat template."
        )
    return text


def kwargs_problem(kwargs: Any) -> str:
    """What is wrong with a ``chat_template_kwargs`` value ("" when it is a mapping of template variables)."""
    if not isinstance(kwargs, dict):
        example = '{"enable_thinking": false}'
        return f"expected an object of template variables such as {example}, found {type(kwargs).__name__}"
    reserved = sorted(str(k) for k in kwargs if k in NOT_TEMPLATE_VARIABLES or not isinstance(k, str))
    if reserved:
        return f"{reserved} are not template variables (use the tools column and the chat_template setting)"
    return ""


def row_errors(row: dict[str, Any]) -> list[str]:
    """Problems of a row's ``chat_template_kwargs`` and ``tools`` columns (each names the column and the fix)."""
    errors = []
    kwargs, tools = row.get("chat_template_kwargs"), row.get("tools")
    if kwargs is not None and kwargs_problem(kwargs):
        errors.append(f"column 'chat_template_kwargs': {kwargs_problem(kwargs)}")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        found = type(tools).__name__ if not isinstance(tools, list) else "a list holding non-objects"
        errors.append(f"column 'tools': expected a list of JSON-schema objects (one per tool), found {found}")
    if (kwargs is not None or tools is not None) and row.get("messages") is None:
        errors.append("columns 'chat_template_kwargs'/'tools' apply to 'messages' rows only; give the row 'messages'")
    return errors
