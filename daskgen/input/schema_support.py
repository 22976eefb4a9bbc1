"""What of a JSON Schema the engines' constrained decoding enforces: the rule a ``json_schema`` format must meet.

Every engine that constrains JSON to a schema (``transformers`` through its sampler, ``sglang``, ``vllm``, and the
``openai`` engine against their servers) compiles it with xgrammar.  xgrammar accepts some JSON Schema keywords
without enforcing them, so a response could break a schema whose constraints all looked accepted; and the engines
differ on such a schema (sglang refuses the request, vLLM may switch to another backend with other rules,
``transformers`` would generate under the weaker grammar).  A run never reaches that difference: the input scan
refuses a schema that uses what is not enforced (:func:`unenforced`) or that xgrammar cannot compile
(:func:`compile_problem`), naming where in the schema and what to change.

Not enforced, measured with xgrammar 0.2.7-0.2.9 (a document that breaks the keyword is accepted; each listed case
is a test in ``tests/test_schema_support.py``):

* the keywords in :data:`UNENFORCED_KEYWORDS`;
* ``multipleOf`` on anything but ``{"type": "integer"}``;
* ``allOf`` with more than one schema;
* a ``$ref`` that does not point into the schema itself (``#...``);
* more than one of ``format``, ``pattern`` and ``minLength``/``maxLength`` on one string.

Stricter than JSON Schema, and so still valid under it: an object with ``properties`` gets no other property unless
``additionalProperties`` allows them, and an array without ``items`` gets no items beyond its ``prefixItems``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

#: Keywords xgrammar accepts and ignores: a response may break them.
UNENFORCED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
    }
)
#: Constraints on a string of which xgrammar enforces one only.
_STRING_GROUPS = {"format": ("format",), "pattern": ("pattern",), "minLength/maxLength": ("minLength", "maxLength")}
#: Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE = (
    *("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else"),
    *("propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema"),
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def subschemas(schema: Any, pointer: str = "#") -> Iterator[tuple[dict[str, Any], str]]:
    """Every object schema inside ``schema`` (itself first) with its JSON pointer."""
    if not isinstance(schema, dict):
        return
    yield schema, pointer
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield from subschemas(schema[key], f"{pointer}/{key}")
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, child in enumerate(schema[key]):
                yield from subschemas(child, f"{pointer}/{key}/{i}")
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, child in schema[key].items():
                yield from subschemas(child, f"{pointer}/{key}/{_escaped(name)}")


def unenforced(schema: Any) -> list[str]:
    """What ``schema`` uses that the constrained decoding would not enforce, each as ``"<what> at <pointer>"``."""
    found = []
    for sub, pointer in subschemas(schema):
        found += [f"{key!r} at {pointer}" for key in sorted(UNENFORCED_KEYWORDS.intersection(sub))]
        if "multipleOf" in sub and sub.get("type") != "integer":
            found.append(f'\'multipleOf\' on a non-integer at {pointer} (only on {{"type": "integer"}})')
        if isinstance(sub.get("allOf"), list) and len(sub["allOf"]) > 1:
            found.append(f"'allOf' of {len(sub['allOf'])} schemas at {pointer} (merge them into one)")
        ref = sub.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            found.append(f"'$ref' {ref!r} outside the schema at {pointer} (put it under '$defs')")
        groups = [name for name, keys in _STRING_GROUPS.items() if any(k in sub for k in keys)]
        if len(groups) > 1:
            found.append(f"{' with '.join(groups)} on one string at {pointer} (only one of them is enforced)")
    return found


def compile_problem(schema: dict[str, Any]) -> str:
    """Why xgrammar cannot compile ``schema`` ("" when it can, or when xgrammar is not installed here: the engine
    then compiles it and a failure fails its rows)."""
    try:
        import xgrammar
    except ImportError:
        return ""
    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except Exception as exc:  # xgrammar raises RuntimeError (older) or its own errors
        return re.sub(r"^\[[^]]*\] \S+: ", "", str(exc).strip().splitlines()[-1])  # without xgrammar's log prefix
    return ""


def _escaped(name: str) -> str:
    """``name`` as one JSON pointer token (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")
