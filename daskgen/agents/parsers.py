"""Tool-call parsers: model text -> tool calls.  Default: Hermes-style ``<tool_call>{json}</tool_call>``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from daskgen.errors import ConfigError


@dataclass
class ToolCall:
    """One parsed call; ``error`` is set (and ``name`` may be None) when the call was malformed."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class ToolCallParser(Protocol):
    """Anything with ``parse(text) -> list[ToolCall]``."""

    def parse(self, text: str) -> list[ToolCall]: ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes/Qwen style)."""

    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        """Every block in ``text``, malformed ones included (with ``error`` set)."""
        return [self._call(body.strip()) for body in self._block.findall(text)]

    @staticmethod
    def _call(body: str) -> ToolCall:
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCall(None, error=f"malformed tool call JSON ({exc.msg} at column {exc.colno}): {body[:200]!r}")
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            expected = '{"name": str, "arguments": object}'
            return ToolCall(None, error=f"a tool call must be {expected}, found {body[:200]!r}")
        args = data.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCall(data["name"], error=f"arguments of {data['name']!r} are not a JSON object: {args!r}")
        if not isinstance(args, dict):
            return ToolCall(data["name"], error=f"arguments of {data['name']!r} must be an object, found {args!r}")
        return ToolCall(data["name"], args)


PARSERS: dict[str, type] = {"hermes": HermesParser}


def resolve_parser(spec: str) -> ToolCallParser:
    """A parser by name (``hermes``) or ``package.module:Class``."""
    if spec in PARSERS:
        return PARSERS[spec]()
    if ":" in spec:
        from daskgen.importing import import_object

        return import_object(spec, "tool-call parser")()
    raise ConfigError(f"unknown tool-call parser {spec!r}; use one of {sorted(PARSERS)} or 'package.module:Class'.")
