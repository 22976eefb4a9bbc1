"""Structured outputs: a run's or a row's ``response_format``, checked once, mapped by each engine.

A ``response_format`` is an object with exactly one of four keys:

* ``{"json_schema": {...}}``: the response is JSON text valid under this JSON Schema;
* ``{"regex": "..."}``: the response fully matches this regular expression;
* ``{"choice": ["yes", "no"]}``: the response is one of these strings;
* ``{"grammar": "root ::= ..."}``: the response is a sentence of this EBNF grammar (the GBNF dialect that
  xgrammar, SGLang's ``ebnf`` and vLLM's ``grammar`` read; the start rule is ``root``).

The run's ``response_format`` setting applies to every row; a row's own ``response_format`` column replaces it.
Input scanning checks every row's value (:func:`row_errors`) and the setting (:func:`from_setting`) before any
engine starts: the schema must be a valid JSON Schema that the engines' constrained decoding enforces whole
(:mod:`daskgen.input.schema_support`), the regex must compile, the choices must be non-empty strings.  Each row's
format is stored per prompt as JSON text (:meth:`ResponseFormat.text`) and is part of the input fingerprint (a
row's) or of the store's identity (the run's), so a resume with another one is refused.
:meth:`ResponseFormat.violation` checks a finished response against its format.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from daskgen.errors import ConfigError
from daskgen.input.schema_support import compile_problem, unenforced

#: The row column (and run setting) this module reads.
ROW_KEY = "response_format"
#: The kinds of format, one of which a ``response_format`` object names.
KINDS = ("json_schema", "regex", "choice", "grammar")
EXAMPLE = (
    '{"json_schema": {"type": "object"}}, {"regex": "[0-9]+"}, {"choice": ["yes", "no"]} or {"grammar": "root ::= ..."}'
)


@dataclass(frozen=True)
class ResponseFormat:
    """One checked ``response_format``: its ``kind`` (one of :data:`KINDS`) and ``value``.

    ``value`` is the schema as canonical JSON text, the regex, the tuple of choices, or the grammar text
    (hashable, so the format can sit in the frozen :class:`~daskgen.engines.base.SamplingParams`).
    """

    kind: str
    value: str | tuple[str, ...]

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> ResponseFormat:
        """The format of a ``response_format`` object that :func:`problem` found valid."""
        ((kind, value),) = raw.items()
        if kind == "json_schema":
            return cls(kind, json.dumps(value, sort_keys=True, ensure_ascii=False))
        return cls(kind, tuple(value) if kind == "choice" else value)

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON Schema of a ``json_schema`` format."""
        return json.loads(str(self.value))

    @property
    def choices(self) -> tuple[str, ...]:
        """The strings of a ``choice`` format."""
        return tuple(self.value)

    def as_dict(self) -> dict[str, Any]:
        """The ``response_format`` object (the schema as an object, the choices as a list)."""
        if self.kind == "json_schema":
            return {self.kind: self.schema}
        return {self.kind: list(self.value) if self.kind == "choice" else self.value}

    def text(self) -> str:
        """Canonical JSON text of :meth:`as_dict` (what the store keeps per prompt)."""
        return json.dumps(self.as_dict(), sort_keys=True, ensure_ascii=False)

    def ebnf(self) -> str:
        """An EBNF grammar for a ``grammar`` or ``choice`` format (for engines without a native choice)."""
        if self.kind == "grammar":
            return str(self.value)
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)

    def violation(self, text: str) -> str | None:
        """Why the response ``text`` does not conform to this format, or ``None`` when it does."""
        if self.kind == "json_schema":
            return _schema_violation(text, self.schema)
        if self.kind == "regex":
            return None if re.fullmatch(str(self.value), text) else f"{text!r} does not fully match {self.value!r}"
        if self.kind == "choice":
            return None if text in self.choices else f"{text!r} is not one of {list(self.choices)}"
        return _grammar_violation(text, str(self.value))


def problem(raw: Any) -> str:
    """What is wrong with a ``response_format`` value ("" when it is valid)."""
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in KINDS:
        found = sorted(map(str, raw)) if isinstance(raw, dict) else type(raw).__name__
        return f"expected an object with exactly one of the keys {list(KINDS)}, found {found}; e.g. {EXAMPLE}"
    ((kind, value),) = raw.items()
    return {"json_schema": _schema_problem, "regex": _regex_problem, "choice": _choice_problem}.get(
        kind, _grammar_problem
    )(value)


def from_setting(raw: Any) -> ResponseFormat | None:
    """The run's ``response_format`` setting checked (``None`` when unset); :class:`ConfigError` naming the fix.

    A string (the command line's ``--response-format``) is read as JSON.
    """
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"setting 'response_format': not valid JSON ({exc.msg}); give e.g. {EXAMPLE}.") from None
    reason = problem(raw)
    if reason:
        raise ConfigError(f"setting 'response_format': {reason}.")
    return ResponseFormat.parse(raw)


def row_errors(row: dict[str, Any]) -> list[str]:
    """Problems of a row's ``response_format`` column (each names the column and the fix)."""
    raw = row.get(ROW_KEY)
    reason = problem(raw) if raw is not None else ""
    return [f"column {ROW_KEY!r}: {reason}"] if reason else []


class FormatCheck:
    """Checks each row's ``response_format`` during the input scan; :attr:`used` tells whether any row has one."""

    def __init__(self) -> None:
        self.used = False

    def row_errors(self, row: dict[str, Any]) -> list[str]:
        """:func:`row_errors` of ``row``, noting whether it has a ``response_format``."""
        self.used = self.used or row.get(ROW_KEY) is not None
        return row_errors(row)


def for_row(row: dict[str, Any], run: ResponseFormat | None) -> ResponseFormat | None:
    """The format of a (valid) row: its own ``response_format`` column, else the run's."""
    raw = row.get(ROW_KEY)
    return ResponseFormat.parse(raw) if raw is not None else run


def _schema_problem(schema: Any) -> str:
    if not isinstance(schema, dict):
        return f"'json_schema' must be a JSON Schema object, found {type(schema).__name__}"
    return _schema_text_problem(json.dumps(schema, sort_keys=True, ensure_ascii=False))


@functools.lru_cache(maxsize=1024)
def _schema_text_problem(text: str) -> str:
    """:func:`_schema_problem` of the schema whose canonical JSON is ``text`` (rows mostly share a few schemas:
    each is checked, and compiled, once)."""
    import jsonschema

    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "(top level)"
        return f"'json_schema' is not a valid JSON Schema at {where}: {exc.message}; fix the schema"
    if found := unenforced(schema):
        return (
            f"'json_schema' uses what the engines' constrained decoding (xgrammar) would not enforce, so responses "
            f"could break it: {'; '.join(found)}; remove or rewrite these constraints (enum, anyOf, pattern and "
            "bounds are enforced) and check the rest on the stored responses"
        )
    if reason := compile_problem(schema):
        return f"'json_schema' cannot be compiled into a grammar ({reason}); fix the schema"
    return ""


def _regex_problem(pattern: Any) -> str:
    if not isinstance(pattern, str) or not pattern:
        return f"'regex' must be a non-empty string, found {pattern!r}"
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"'regex' {pattern!r} does not compile ({exc}); fix the expression"
    return ""


def _choice_problem(choices: Any) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        return f"'choice' must be a non-empty list of non-empty strings, found {choices!r}"
    return ""


def _grammar_problem(grammar: Any) -> str:
    if not isinstance(grammar, str) or not grammar.strip():
        return f"'grammar' must be EBNF text with a 'root' rule, found {grammar!r}"
    try:
        import xgrammar
    except ImportError:  # the grammar is checked by the engine when xgrammar is not installed here
        return ""
    try:
        xgrammar.Grammar.from_ebnf(grammar)
    except Exception as exc:  # xgrammar raises RuntimeError (older) or its own errors for a bad grammar
        reason = re.sub(r"^\[[^]]*\] \S+: ", "", str(exc).strip().splitlines()[-1])  # drop xgrammar's log prefix
        return f"'grammar' is not valid EBNF ({reason}); fix the grammar"
    return ""


def _schema_violation(text: str, schema: dict[str, Any]) -> str | None:
    import jsonschema

    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at character {exc.pos})"
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError as exc:
        return f"JSON not valid under the schema: {exc.message}"
    return None


def _grammar_violation(text: str, grammar: str) -> str | None:
    """Checked with xgrammar's matcher over the text's bytes (xgrammar must be installed)."""
    import xgrammar

    info = xgrammar.TokenizerInfo([])  # no vocabulary: the matcher reads the text itself
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_grammar(grammar))
    if not matcher.accept_string(text) or not matcher.is_completed():
        return f"{text!r} is not a sentence of the grammar"
    return None
