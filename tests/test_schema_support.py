"""A ``json_schema`` format is refused at the input scan when the engines' constrained decoding would not enforce it.

Each refused case is proven necessary here: xgrammar (what every engine compiles schemas with) accepts a document
that breaks it, and jsonschema says the document breaks it.  Each accepted case is proven enforced: xgrammar rejects
the breaking document.  When an xgrammar release starts enforcing a refused keyword, its case fails here and the
rule in ``daskgen/input/schema_support.py`` is to be relaxed.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from daskgen.errors import InputError
from daskgen.input.response_format import problem
from daskgen.input.rows import scan_prompts
from daskgen.input.schema_support import UNENFORCED_KEYWORDS, unenforced
from daskgen.input.tokenizer import ByteTokenizer
from daskgen.testing.structured import PERSON

xgrammar = pytest.importorskip("xgrammar")

INT = {"type": "integer"}
DRAFT7 = "http://json-schema.org/draft-07/schema#"
#: ``(what the error names, schema, a document that breaks the schema)``: constraints xgrammar does not enforce.
REFUSED = [
    ("'not' at #", {"type": "integer", "not": {"const": 3}}, "3"),
    ("'if' at #", {"type": "integer", "if": {"minimum": 0}, "then": {"minimum": 5}}, "3"),
    ("'uniqueItems' at #", {"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]"),
    (
        "'contains' at #",
        {"type": "array", "items": {"type": ["integer", "string"]}, "contains": {"type": "string"}},
        "[1]",
    ),
    ("'maxContains' at #", {"type": "array", "items": INT, "contains": {"minimum": 5}, "maxContains": 1}, "[5, 6]"),
    (
        "'dependentRequired' at #",
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
    ),
    (
        "'dependentSchemas' at #",
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependentSchemas": {"a": {"required": ["b"]}}},
        '{"a": 1}',
    ),
    (
        "'dependencies' at #",
        {"$schema": DRAFT7, "type": "object", "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}},
        '{"a": 1}',
    ),
    ("'multipleOf' on a non-integer at #", {"type": "number", "multipleOf": 0.5}, "0.3"),
    ("'allOf' of 2 schemas at #", {"allOf": [INT, {"minimum": 5}]}, "3"),
    ("format with pattern on one string at #", {"type": "string", "format": "email", "pattern": "^a"}, '"b@x.com"'),
    (
        "format with minLength/maxLength on one string at #",
        {"type": "string", "format": "email", "maxLength": 3},
        '"bb@x.com"',
    ),
    (
        "pattern with minLength/maxLength on one string at #",
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2},
        '"abcd"',
    ),
    (
        "'uniqueItems' at #/properties/tags",
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
        '{"tags": ["a", "a"]}',
    ),
    ("'not' at #/$defs/odd", {"$defs": {"odd": {"type": "integer", "not": {"const": 2}}}, "$ref": "#/$defs/odd"}, "2"),
]
#: ``(schema, a document that breaks it)``: constraints xgrammar enforces, which the scan accepts.
ENFORCED = [
    (PERSON, '{"name": "Ann", "age": "x"}'),
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"allOf": [{"type": "integer", "minimum": 5}]}, "3"),
    ({"$defs": {"p": {"type": "integer", "minimum": 5}}, "$ref": "#/$defs/p"}, "3"),
    ({"type": "string", "pattern": "^[0-9]+$"}, '"a"'),
    ({"type": "string", "maxLength": 2}, '"abc"'),
    ({"type": "object", "additionalProperties": INT, "propertyNames": {"pattern": "^x"}}, '{"a": 1}'),
    ({"type": "object", "additionalProperties": INT, "minProperties": 1}, "{}"),
    ({"anyOf": [INT, {"type": "boolean"}]}, '"a"'),
]


def accepted_by_xgrammar(schema: dict, document: str) -> bool:
    """Whether the grammar xgrammar compiles from ``schema`` (as the engines compile it) accepts ``document``."""
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_json_schema(json.dumps(schema))
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(document) and matcher.is_completed()


def breaks(schema: dict, document: str) -> bool:
    return not jsonschema.validators.validator_for(schema)(schema).is_valid(json.loads(document))


@pytest.mark.parametrize(("named", "schema", "document"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_constraint_xgrammar_ignores_is_refused_at_the_scan_naming_where(named, schema, document):
    assert breaks(schema, document), "the document must break the schema"
    assert accepted_by_xgrammar(schema, document), "xgrammar enforces it now: relax the rule in schema_support.py"
    reason = problem({"json_schema": schema})
    assert named in reason and "would not enforce" in reason and "remove or rewrite" in reason


@pytest.mark.parametrize(("schema", "document"), ENFORCED)
def test_a_constraint_xgrammar_enforces_passes_the_scan(schema, document):
    assert breaks(schema, document)
    assert not accepted_by_xgrammar(schema, document)
    assert problem({"json_schema": schema}) == ""


def test_every_unenforced_keyword_has_a_refused_case():
    named = " ".join(r[0] for r in REFUSED)
    assert [k for k in sorted(UNENFORCED_KEYWORDS) if f"'{k}'" not in named] == ["else", "minContains", "then"]
    assert unenforced({"if": {}, "then": {}, "else": {}, "minContains": 1}) == [
        "'else' at #",
        "'if' at #",
        "'minContains' at #",
        "'then' at #",
    ]


def test_a_schema_xgrammar_cannot_compile_is_refused_with_its_reason():
    reason = problem({"json_schema": {"type": "array", "minItems": 2}})  # no items: xgrammar allows none
    assert reason.startswith("'json_schema' cannot be compiled into a grammar (minItems") and "fix the schema" in reason
    assert problem({"json_schema": {"type": "array", "items": INT, "minItems": 2}}) == ""


def test_the_scan_names_the_row_and_the_keyword_and_keeps_the_other_rows_checked():
    rows = [
        {"prompt": "a", "response_format": {"json_schema": PERSON}},
        {"prompt": "b", "response_format": {"json_schema": {"type": "array", "items": INT, "uniqueItems": True}}},
        {"prompt": "c", "response_format": {"json_schema": {"$ref": "https://example.com/s.json"}}},
    ]
    with pytest.raises(InputError) as info:
        scan_prompts(rows, ByteTokenizer(), max_prompt_tokens=64)
    message = str(info.value)
    assert "2 problem(s)" in message and "row 0" not in message
    assert "row 1: column 'response_format': 'json_schema' uses what" in message and "'uniqueItems' at #" in message
    assert "row 2:" in message and "'$ref' 'https://example.com/s.json' outside the schema at #" in message
